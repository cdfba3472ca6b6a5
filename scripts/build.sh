#!/usr/bin/env bash
# Fetches the pinned CUTLASS headers, configures and builds. Extra arguments go to the CMake
# configure step (e.g. -DFLASHHOPPER_KERNELS=full); BUILD_TARGET picks one target.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
./scripts/setup_deps.sh
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
build="${BUILD_DIR:-build}"
cmake -S . -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release "$@"
cmake --build "$build" -j "$(nproc)" ${BUILD_TARGET:+--target "$BUILD_TARGET"}
