#!/usr/bin/env bash
# Builds a kernel set here (no GPU needed: nvcc compiles for sm_90a) into a folder laid out as a
# build folder, small enough to carry to the GPU machine (the device tool's 64 MiB): the library,
# the GPU test binaries, test_validation and host_overhead_cpp, and the commit they were built
# from. There, PREBUILT=<folder> scripts/device_job.sh runs its steps on it with no build, which
# saves the device's build minutes (the bench set: 11 minutes on this machine's 2 cores, 52 MB).
#   scripts/prebuild.sh [KERNELS (default bench)] [FOLDER (default build-prebuilt)]
# PROMOTE="512:512 ..." adds those head-dim rows of the manifest (d:dv) to the set, built from a
# copy of HEAD's tree with the manifest so edited and regenerated (the repository's stays as it
# is), e.g. PROMOTE=512:512 scripts/prebuild.sh dev build-512 for head dim 512 beside the dev set.
# (PREBUILD=1 scripts/device_kit.sh runs it with the rest of what a device session carries.)
# Carry the folder only while `git diff $(cat FOLDER/COMMIT) -- src include cmake CMakeLists.txt
# tests/cpp bench/profile scripts/kernel_manifest.py` is empty (else they are not the tree's).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
kernels=${1:-bench} dest=${2:-build-prebuilt}
promoted=${PROMOTE:+-$(echo "$PROMOTE" | tr ' :' '_x')}
build=${PREBUILD_DIR:-/tmp/flashhopper-prebuild-$kernels$promoted}
command -v nvcc >/dev/null || export PATH="/usr/local/cuda/bin:$PATH"
src="$root"
if [ -n "${PROMOTE:-}" ]; then
  src="$build-src"
  rm -rf "$src" && mkdir -p "$src" && git -C "$root" archive HEAD | tar x -C "$src"
  ln -s "$root/third_party" "$src/third_party"
  for row in $PROMOTE; do
    pattern="HeadDims(${row/:/, }"  # the row's other arguments, if any, stay
    grep -qE "HeadDims\(${row/:/, }[,)]" "$src/scripts/kernel_manifest.py" ||
      { echo "prebuild: no manifest row $pattern)" >&2; exit 2; }
    sed -i -E "s/HeadDims\(${row/:/, }([,)])/HeadDims(${row/:/, }, bf16_set=\"$kernels\"\1/" "$src/scripts/kernel_manifest.py"
  done
  (cd "$src" && python3 scripts/generate_kernels.py >/dev/null)
fi
cmake -S "$src" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHHOPPER_KERNELS="$kernels" \
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
echo "$kernels${PROMOTE:+ + $PROMOTE}" > "$dest/KERNELS"
size=$(du -sm "$dest" | cut -f1)
echo "prebuilt: $dest ($kernels set, $(cat "$dest/COMMIT"), ${size} MB)"
[ "$size" -le 64 ] || echo "prebuilt: over the device tool's 64 MiB carry; use a smaller kernel set" >&2
