#!/usr/bin/env bash
# On the GPU machine: build the library of several source trees (commits) side by side, each with
# only the instantiations a bisect times compiled for real; every other instantiation becomes a
# stub that returns cudaErrorNotSupported, so a tree builds in a fraction of the full set's time
# and the dispatch still links. Then time them with bench/ab_compare.sh LIB@PYTHONPATH ...
#
# Usage: bench/bisect_build.sh SRC_DIR LABEL... (KEEP="fwd_bf16_hdim128_full ..." picks the real
#        instantiations by variant name; default: the bf16 forward's full and causal at hdim 128 and 256; TARGETS:
#        what to build, default the library; test binaries, e.g. test_forward_gpu, need GTEST_ROOT)
# SRC_DIR holds LABEL.tar.xz for each label: `git archive COMMIT | xz > SRC_DIR/LABEL.tar.xz`,
# made where the history is; and cutlass.tar.xz (third_party/cutlass) when the headers are not
# installed there. Each tree lands in /tmp/bisect/LABEL, its library in /tmp/bisect/LABEL/build.
set -uo pipefail
src_dir=$1
shift
keep="${KEEP:-fwd_bf16_hdim128_full fwd_bf16_hdim128_causal fwd_bf16_hdim256_full fwd_bf16_hdim256_causal}"
targets="${TARGETS:-flashhopper}"
tests=OFF
[[ " $targets" == *" test_"* ]] && tests=ON
work=/tmp/bisect
mkdir -p "$work"
if [ ! -f "$work/cutlass/include/cute/tensor.hpp" ]; then
  mkdir -p "$work/cutlass" && tar xJf "$src_dir/cutlass.tar.xz" -C "$work/cutlass" --strip-components=1 ||
    { echo "bisect_build: no CUTLASS headers ($src_dir/cutlass.tar.xz)" >&2; exit 2; }
fi

# The instantiations of a file that KEEP does not name made stubs: the same function, explicitly
# specialised with a body that refuses. A file holds several (a "// <variant>" line before each;
# before 2026-12-06 one, named by the file); where none is kept, the declaration comes from the
# launch header and the kernel headers are never compiled.
stub() {
  python3 - "$1" "$keep" <<'PY' || { echo "bisect_build: could not stub $1" >&2; return 1; }
import pathlib, re, sys
path, keep = pathlib.Path(sys.argv[1]), set(sys.argv[2].split())
text = path.read_text()
instantiation = re.compile(r"(?:// (\w+)\n)?template (cudaError_t \w+<[^>]*>\(\s*[^;]*cudaStream_t\));")
kept = []

def refuse(m):
    variant = m.group(1) or path.stem
    if variant in keep:
        kept.append(variant)
        return m.group(0)
    return (f"// {variant}\n" if m.group(1) else "") + f"template <> {m.group(2)} {{ return cudaErrorNotSupported; }}"

text, count = instantiation.subn(refuse, text)
if count == 0:
    sys.exit(1)
if len(kept) < count:
    text = re.sub(r"\n// The file reads CuTe's extended shapes.*?;\n", "\n", text, flags=re.S)
if not kept:
    text = re.sub(r"launch/(forward|backward)_launch\.cuh", r"launch/\1_launch.hpp", text)
path.write_text(text)
PY
}

for label in "$@"; do
  tree="$work/$label"
  rm -rf "$tree" && mkdir -p "$tree" && tar xJf "$src_dir/$label.tar.xz" -C "$tree" --strip-components=1 || exit 2
  for f in "$tree"/src/hopper/instantiations/*.cu; do stub "$f" || exit 2; done
  cmake -S "$tree" -B "$tree/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHHOPPER_KERNELS=full \
    -DFLASHHOPPER_TESTS=$tests ${GTEST_ROOT:+-DGTEST_ROOT=$GTEST_ROOT} -DFLASHHOPPER_EXAMPLES=OFF \
    -DFLASHHOPPER_TORCH_OPS=OFF -DCUTLASS_DIR="$work/cutlass" >"$work/$label.configure.log" 2>&1 ||
    { echo "bisect_build: $label: configure failed ($work/$label.configure.log)"; continue; }
done
# One ninja per tree, all at once, the cores shared among them (JOBS: each tree's, default an
# equal share): the real instantiations dominate.
start=$(date +%s)
jobs=${JOBS:-$(( $(nproc) / $# > 2 ? $(nproc) / $# : 2 ))}
for label in "$@"; do
  [ -f "$work/$label/build/build.ninja" ] &&
    (cmake --build "$work/$label/build" --target $targets -j "$jobs" >"$work/$label.build.log" 2>&1;
     echo "$label: build rc=$? after $(( $(date +%s) - start )) s") &
done
wait
