#!/usr/bin/env bash
# Builds a kernel set here (no GPU needed: nvcc compiles for sm_90a) into a folder laid out as a
# build folder, small enough to carry to the GPU machine (the device tool's 64 MiB): the library,
# the GPU test binaries, test_validation and host_overhead_cpp, and the commit they were built
# from. There, PREBUILT=<folder> scripts/device_job.sh runs its steps on it with no build, which
# saves the device's build minutes (the bench set: 11 minutes on this machine's 2 cores, 52 MB).
#   scripts/prebuild.sh [KERNELS (default bench)] [FOLDER (default build-prebuilt)]
# (PREBUILD=1 scripts/device_kit.sh runs it with the rest of what a device session carries.)
# Carry the folder only while `git diff $(cat FOLDER/COMMIT) -- src include cmake CMakeLists.txt
# tests/cpp bench/profile scripts/kernel_manifest.py` is empty (else they are not the tree's).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
kernels=${1:-bench} dest=${2:-build-prebuilt}
build=${PREBUILD_DIR:-/tmp/flashhopper-prebuild-$kernels}
command -v nvcc >/dev/null || export PATH="/usr/local/cuda/bin:$PATH"
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHHOPPER_KERNELS="$kernels" \
  -DFLASHHOPPER_TORCH_OPS=OFF >/dev/null
tests=(test_forward_gpu test_backward_gpu test_varlen_gpu test_validation)  # device_check.sh's tests and varlen
targets=(flashhopper "${tests[@]}" host_overhead_cpp)
cmake --build "$build" -j "$(nproc)" --target "${targets[@]}"
cd "$root"
rm -rf "$dest" && mkdir -p "$dest/tests/cpp" "$dest/bench/profile"
# One copy of the library, under the name the binaries load (device_job.sh links the other).
cp -L "$build/libflashhopper.so.0" "$dest/libflashhopper.so.0"
for binary in "${tests[@]}"; do
  cp "$build/tests/cpp/$binary" "$dest/tests/cpp/"
done
cp "$build/bench/profile/host_overhead_cpp" "$dest/bench/profile/"
git rev-parse HEAD > "$dest/COMMIT"
echo "$kernels" > "$dest/KERNELS"
size=$(du -sm "$dest" | cut -f1)
echo "prebuilt: $dest ($kernels set, $(cat "$dest/COMMIT"), ${size} MB)"
[ "$size" -le 64 ] || echo "prebuilt: over the device tool's 64 MiB carry; use a smaller kernel set" >&2
