#!/usr/bin/env bash
# Builds FlashHopper and runs its demo: on an sm_90 GPU it runs the forward kernel, checks it
# against the CPU reference and times it; elsewhere it runs the CPU reference and says so.
# Usage: scripts/demo.sh [seqlen] [head_dim]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
./scripts/setup_deps.sh
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
build="${BUILD_DIR:-build}"
cmake -S . -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release
cmake --build "$build" -j "$(nproc)" --target flashhopper_demo
"$build/examples/flashhopper_demo" "$@"
