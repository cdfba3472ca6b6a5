#!/usr/bin/env bash
# A one-line variant of the prebuilt kernel set, built here for an A/B on the GPU machine that
# compiles nothing there (its device minutes go to the runs): the tree of the prebuilt folder's
# commit with FROM -> TO in FILE, the named instantiation files recompiled by the prebuild's own
# compile commands pointed at that tree, the library relinked with them, packed as
# build-kit/variant_NAME.tar.xz (the folder build-variant-NAME with libflashhopper.so.0, a few MB).
#   scripts/prebuild_variant.sh NAME FILE 'FROM' 'TO' STEM...
#   scripts/prebuild_variant.sh NAME CHANGE.diff - - STEM...   (a change of several lines or files: git diff's output)
#     STEM: src/hopper/instantiations/<STEM>.cu, the files that read the line (e.g. bwd_bf16_hdim128
#     bwd_bf16_hdim128_packed for the hdim-128 backward), or src/<STEM>.cu where it holds a '/' (e.g.
#     launch/forward_dispatch, which reads the forward's tile extents); PREBUILT (default build-prebuilt) the
#     folder scripts/prebuild.sh made, PREBUILD_DIR its build folder (default that of its KERNELS).
# On the device, after unpacking it and the prebuilt folder: bench/ab_compare.sh
# build-prebuilt/libflashhopper.so build-variant-NAME/libflashhopper.so.0 [benchmark arguments];
# the prebuilt test binaries run the variant with LD_LIBRARY_PATH=build-variant-NAME.
#   scripts/prebuild_variant.sh --queue QUEUE [NAME...]
#     builds the variants a queue file lists (all, or those named), one after another: a bash file of
#     `variant NAME FILE 'FROM' 'TO' 'STEM...' 'BINARY:FILTER ...' GATE_ARGUMENTS...` lines, which
#     scripts/device_job.sh's AB_VARIANTS runs on the GPU machine (the tests, then the gate's rows).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
if [ "${1:-}" = --queue ]; then
  queue=${2:?--queue QUEUE}
  shift 2
  wanted=" $* "
  variant() {
    local name=$1 file=$2 from=$3 to=$4 stems=$5
    [ "$wanted" = "  " ] || [[ "$wanted" == *" $name "* ]] || return 0
    # shellcheck disable=SC2086
    "$root/scripts/prebuild_variant.sh" "$name" "$file" "$from" "$to" $stems || echo "variant $name: FAILED" >&2
  }
  # shellcheck disable=SC1090
  source "$queue"
  exit 0
fi
[ $# -ge 5 ] || { sed -n '2,19p' "$0" >&2; exit 2; }
name=$1 file=$2 from=$3 to=$4
shift 4
prebuilt=${PREBUILT:-build-prebuilt}
[ -f "$prebuilt/COMMIT" ] || { echo "prebuild_variant: no $prebuilt/COMMIT (scripts/prebuild.sh first)" >&2; exit 1; }
commit=$(cat "$prebuilt/COMMIT") kernels=$(cut -d' ' -f1 "$prebuilt/KERNELS")
build=${PREBUILD_DIR:-/tmp/flashhopper-prebuild-$kernels}
[ -f "$build/build.ninja" ] || { echo "prebuild_variant: no build folder $build" >&2; exit 1; }
source_root=$(sed -n 's/^CMAKE_HOME_DIRECTORY:INTERNAL=//p' "$build/CMakeCache.txt")
# The build folder must hold the prebuilt commit's objects: its sources as they were then. A
# PROMOTE build's tree is its own copy (prebuild.sh: the commit's files, the manifest regenerated).
if [ "$source_root" = "$root" ] && ! git -C "$root" diff --quiet "$commit" -- src include; then
  echo "prebuild_variant: $source_root/src or include differ from $commit, which $build was built from" >&2
  exit 1
fi
work=/tmp/flashhopper-variant-$name
rm -rf "$work" && mkdir -p "$work/tree" "$work/objects" "$work/build-variant-$name"
cp -a "$source_root/src" "$source_root/include" "$work/tree/"
ln -s "$source_root/third_party" "$work/tree/third_party"
if [ "$from" = - ] && [ "$to" = - ]; then  # FILE: a patch of src/ and include/ (git diff's form)
  patch -s -p1 -d "$work/tree" < "$file" || { echo "prebuild_variant: $file does not apply" >&2; exit 1; }
else
  python3 - "$work/tree/$file" "$from" "$to" <<'PY'
import sys
path, old, new = sys.argv[1:]
text = open(path).read()
if text.count(old) != 1:
    sys.exit(f"prebuild_variant: '{old}' is in {path} {text.count(old)} times (must be once)")
open(path, "w").write(text.replace(old, new))
PY
fi
cd "$build"
link=$(ninja -t commands libflashhopper.so.0.1.0 | tail -1)
pids=()
for stem in "$@"; do
  object=CMakeFiles/flashhopper_kernels.dir/src/hopper/instantiations/$stem.cu.o
  [[ "$stem" == */* ]] && object=CMakeFiles/flashhopper_kernels.dir/src/$stem.cu.o  # e.g. launch/forward_dispatch
  command=$(ninja -t commands "$object" | tail -1)
  [[ "$command" == *nvcc* ]] || { echo "prebuild_variant: no compile command for $object" >&2; exit 1; }
  command=${command//$source_root\//$work\/tree\/}
  flat=${stem//\//_}
  command=${command//$object/$work\/objects\/$flat.cu.o}
  link=${link//$object/$work\/objects\/$flat.cu.o}
  (eval "$command") > "$work/compile_$flat.log" 2>&1 &
  pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid" || { echo "prebuild_variant: a compile failed ($work/compile_*.log)" >&2; exit 1; }; done
link=${link//-o libflashhopper.so.0.1.0/-o $work\/build-variant-$name\/libflashhopper.so.0}
eval "$link"
ln -sf libflashhopper.so.0 "$work/build-variant-$name/libflashhopper.so"
printf '%s\n%s: %s -> %s\n' "$commit" "$file" "$from" "$to" > "$work/build-variant-$name/VARIANT"
mkdir -p "$root/build-kit"
tar cJf "$root/build-kit/variant_$name.tar.xz" -C "$work" "build-variant-$name"
echo "variant $name: build-kit/variant_$name.tar.xz ($(du -k "$root/build-kit/variant_$name.tar.xz" | cut -f1) KiB)"
