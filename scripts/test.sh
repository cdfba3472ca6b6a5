#!/usr/bin/env bash
# Builds FlashHopper and runs its tests (CTest). On a machine without an sm_90 GPU the GPU tests
# skip and say so; everything else runs. Usage: scripts/test.sh [extra cmake -D options]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
./scripts/setup_deps.sh
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
build="${BUILD_DIR:-build}"
cmake -S . -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release "$@"
cmake --build "$build" -j "$(nproc)"
ctest --test-dir "$build" --output-on-failure
