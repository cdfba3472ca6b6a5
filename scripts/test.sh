#!/usr/bin/env bash
# Builds FlashHopper and runs its tests (CTest). On a machine without an sm_90 GPU the GPU tests
# skip and say so; everything else runs. Usage: scripts/test.sh [extra cmake -D options]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
"$root/scripts/build.sh" "$@"
ctest --test-dir "$root/${BUILD_DIR:-build}" --output-on-failure
