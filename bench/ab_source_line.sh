#!/usr/bin/env bash
# A one-line A/B on a warm GPU machine, after scripts/device_job.sh has built into $JOB_DIR
# (default /tmp/fhjob): runs the tests and the benchmark on the job's build as it is (side a),
# rewrites one line of a source file in the job's copy, rebuilds only the named instantiation
# files (ninja -t commands: no header-driven rebuild of the rest) and relinks libflashhopper.so,
# then runs the same tests and benchmark again (side b). The GPU test binaries load the relinked
# library. The source is restored at the end; the library stays side b's. Usage:
#   AB_FILE=src/hopper/common/tile_size.hpp AB_FROM='...' AB_TO='...' AB_UNITS='bwd_bf16_hdim512' \
#   AB_TESTS='test_backward_gpu:Grid/*bf16_d512*' AB_BENCH='--hdims 512 --seqlens 8192 16384' bench/ab_source_line.sh
# AB_UNITS: instantiation file stems (src/hopper/instantiations/<stem>.cu); AB_TESTS: binary:gtest
# filter pairs, space-separated (optional); AB_BENCH: bench/bench_head_dims.py's arguments. Output
# in $JOB_DIR/out/ab_line/ (a/, b/, tests_<side>.log, progress.log with "AB DONE" last). A FROM that
# is not in the file, a failed compile or link: logged, and side b is not run.
set -u
job="${JOB_DIR:-/tmp/fhjob}"
src="$job/src" build="$job/build" out="$job/out/ab_line"
mkdir -p "$out"
log() { echo "$(date +%T) $*" >> "$out/progress.log"; }
file="$src/${AB_FILE:?AB_FILE: the file to rewrite, relative to the repository root}"
: "${AB_FROM:?AB_FROM: the line to replace}" "${AB_TO:?AB_TO: its replacement}" "${AB_UNITS:?AB_UNITS: stems}"

side() {  # the tests, then the benchmark, of the library as it is now
  local name=$1 spec
  for spec in ${AB_TESTS:-}; do
    timeout 300 "$build/tests/cpp/${spec%%:*}" --gtest_brief=1 --gtest_filter="${spec#*:}" \
      >> "$out/tests_$name.log" 2>&1
    log "side $name tests ${spec%%:*} rc=$?: $(grep -E '^\[  (PASSED|FAILED)  \]' "$out/tests_$name.log" |
      tail -2 | tr '\n' ' ')"
  done
  # shellcheck disable=SC2086
  (cd "$src" && PYTHONUNBUFFERED=1 FLASHHOPPER_LIBRARY="$build/libflashhopper.so" PYTHONPATH="$src/python" \
    timeout 300 python3 bench/bench_head_dims.py ${AB_BENCH:-} --out "$out/$name" > "$out/bench_$name.txt" 2>&1)
  log "side $name bench rc=$?"
}

side a
grep -qF -- "$AB_FROM" "$file" || { log "no line '$AB_FROM' in $file: side b not run"; log "AB DONE"; exit 1; }
cp "$file" "$out/source.orig"
python3 - "$file" "$AB_FROM" "$AB_TO" <<'PY'
import sys
path, old, new = sys.argv[1:]
text = open(path).read()
open(path, "w").write(text.replace(old, new, 1))
PY
pids=()
for stem in $AB_UNITS; do
  o="CMakeFiles/flashhopper_kernels.dir/src/hopper/instantiations/$stem.cu.o"
  (cd "$build" && eval "$(ninja -t commands "$o" | tail -1)") > "$out/compile_$stem.log" 2>&1 &
  pids+=($!)
done
ok=1
for p in "${pids[@]}"; do wait "$p" || ok=0; done
cp "$out/source.orig" "$file"
relink() { (cd "$build" && eval "$(ninja -t commands libflashhopper.so.0.1.0 | tail -1)") > "$out/link.log" 2>&1; }
if [ $ok = 1 ] && relink; then
  log "built side b"
  side b
else
  log "side b: a compile or the link failed (compile_*.log, link.log)"
fi
log "AB DONE"
