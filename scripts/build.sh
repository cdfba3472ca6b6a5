#!/usr/bin/env bash
# Fetches the pinned CUTLASS headers (not for a CPU-only build, -DFLASHHOPPER_CUDA=OFF), configures
# and builds. Arguments go to the CMake configure step (e.g. -DFLASHHOPPER_KERNELS=full), after
# those in FLASHHOPPER_CMAKE_ARGS; BUILD_DIR picks the build folder (default build), BUILD_TARGET
# one target. An existing build folder keeps the generator it was configured with.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
read -r -a extra <<<"${FLASHHOPPER_CMAKE_ARGS:-}"
args=("${extra[@]}" "$@")
cpu_only=0
for a in "${args[@]}"; do
  case "$a" in -DFLASHHOPPER_CUDA=OFF|-DFLASHHOPPER_CUDA:BOOL=OFF) cpu_only=1 ;; esac
done
[ "$cpu_only" -eq 1 ] || ./scripts/setup_deps.sh
build="${BUILD_DIR:-build}"
generator=()
if [ -f "$build/CMakeCache.txt" ]; then
  :  # configured before: CMake keeps its generator (passing another one would fail)
elif command -v ninja >/dev/null; then
  generator=(-G Ninja)
fi
cmake -S . -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release "${args[@]}"
cmake --build "$build" -j "$(nproc)" ${BUILD_TARGET:+--target "$BUILD_TARGET"}
