#!/usr/bin/env bash
# Builds FlashHopper and runs its demo: on an sm_90 GPU it runs the forward and backward kernels,
# checks them against the CPU reference and times them; elsewhere it runs the CPU reference and
# says so.
# Usage: scripts/demo.sh [seqlen] [head_dim]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
BUILD_TARGET=flashhopper_demo "$root/scripts/build.sh"
"$root/${BUILD_DIR:-build}/examples/flashhopper_demo" "$@"
