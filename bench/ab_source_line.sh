#!/usr/bin/env bash
# One-line A/Bs on a warm GPU machine, after scripts/device_job.sh has built into $JOB_DIR
# (default /tmp/fhjob): runs the tests and the benchmark on the job's build as it is (side a);
# then, for each variant, rewrites one line of a source file in the job's copy, rebuilds only the
# named instantiation files (ninja -t commands: no header-driven rebuild of the rest), relinks
# libflashhopper.so, runs the same tests and benchmark (sides b, c, ...) and restores the line, so
# that each variant stands alone against side a. The GPU test binaries load the relinked library,
# which stays the last variant's. Usage:
#   AB_FILE=src/hopper/common/tile_size.hpp AB_UNITS='bwd_bf16_hdim512' \
#   AB_FROM='...' AB_TO='...' [AB_FROM_2='...' AB_TO_2='...' ...] \
#   AB_TESTS='test_backward_gpu:Grid/*bf16_d512*' AB_BENCH='--hdims 512 --seqlens 8192 16384' bench/ab_source_line.sh
# AB_UNITS: instantiation file stems (src/hopper/instantiations/<stem>.cu), AB_UNITS_2, ... a side's
# own where only some of them read its line (AB_UNITS_1 for side b); AB_TESTS: binary:gtest
# filter pairs, space-separated (optional); AB_BENCH: the benchmark's arguments (AB_BENCH_SCRIPT,
# default bench/bench_head_dims.py; bench/bench_features.py for masks and softcap; '-m
# flashhopper.bench' for the deterministic backward's column);
# AB_TESTS_1, AB_BENCH_1, ...: a side's own instead; AB_ALSO_FROM_n / AB_ALSO_TO_n: a second line
# side n rewrites with its first (n = 1: side b). Output
# in $JOB_DIR/out/ab_line/ (ab_line_$AB_NAME/ where AB_NAME is set; a/, b/, ..., tests_<side>.log,
# progress.log with "AB DONE" last). A FROM that is not in the file, a failed compile or link:
# logged, and that side is not run. AB_RESTORE=1: at the end, the units rebuilt from the restored
# source and the library relinked, so that another A/B can follow on the same build (a queue:
# scripts/device_job.sh's AB_QUEUE).
set -u
set -f  # AB_TESTS' gtest filters are split on spaces, never expanded as file names
job="${JOB_DIR:-/tmp/fhjob}"
src="$job/src" build="$job/build" out="$job/out/ab_line${AB_NAME:+_$AB_NAME}"
mkdir -p "$out"
log() { echo "$(date +%T) $*" >> "$out/progress.log"; }
file="$src/${AB_FILE:?AB_FILE: the file to rewrite, relative to the repository root}"
: "${AB_FROM:?AB_FROM: the line to replace}" "${AB_TO:?AB_TO: its replacement}" "${AB_UNITS:?AB_UNITS: stems}"

side() {  # the tests, then the benchmark, of the library as it is now
  local name=$1 tests=$2 bench=$3 spec
  for spec in $tests; do
    timeout 300 "$build/tests/cpp/${spec%%:*}" --gtest_brief=1 --gtest_filter="${spec#*:}" \
      >> "$out/tests_$name.log" 2>&1
    log "side $name tests ${spec%%:*} rc=$?: $(grep -E '^\[  (PASSED|FAILED)  \]' "$out/tests_$name.log" |
      tail -2 | tr '\n' ' ')"
  done
  # shellcheck disable=SC2086
  (cd "$src" && PYTHONUNBUFFERED=1 FLASHHOPPER_LIBRARY="$build/libflashhopper.so" PYTHONPATH="$src/python" \
    timeout 300 python3 ${AB_BENCH_SCRIPT:-bench/bench_head_dims.py} $bench --out "$out/$name" \
    > "$out/bench_$name.txt" 2>&1)
  log "side $name bench rc=$?"
}

# shellcheck source=bench/ab_common.sh
source "$(dirname "$0")/ab_common.sh"  # rewrite, rebuild_library

# One variant: FROM -> TO in the file (and ALSO_FROM -> ALSO_TO where given), the units rebuilt and
# the library relinked, the file restored.
build_variant() {
  local name=$1 from=$2 to=$3 units=$4 also_from=$5 also_to=$6 stem ok=0 objects=()
  cp "$file" "$out/source.orig"
  rewrite "$file" "$from" "$to" || { log "side $name not run"; cp "$out/source.orig" "$file"; return 1; }
  if [ -n "$also_from" ]; then
    rewrite "$file" "$also_from" "$also_to" || { log "side $name not run"; cp "$out/source.orig" "$file"; return 1; }
  fi
  for stem in $units; do objects+=("CMakeFiles/flashhopper_kernels.dir/src/hopper/instantiations/$stem.cu.o"); done
  rebuild_library "$name" "${objects[@]}" && ok=1
  cp "$out/source.orig" "$file"
  [ $ok = 1 ] && log "built side $name: $to"
}

side a "${AB_TESTS:-}" "${AB_BENCH:-}"
sides=(b c d e f g h)
for i in "${!sides[@]}"; do
  n=$((i + 1))
  units_var="AB_UNITS_$n" tests_var="AB_TESTS_$n" bench_var="AB_BENCH_$n"
  also_from_var="AB_ALSO_FROM_$n" also_to_var="AB_ALSO_TO_$n"
  if [ "$n" = 1 ]; then from=$AB_FROM to=$AB_TO; else
    from_var="AB_FROM_$n" to_var="AB_TO_$n"
    [ -n "${!from_var:-}" ] || break
    from=${!from_var} to=${!to_var:?$to_var: the replacement of $from_var}
  fi
  units=${!units_var:-$AB_UNITS} tests=${!tests_var:-${AB_TESTS:-}} bench=${!bench_var:-${AB_BENCH:-}}
  build_variant "${sides[$i]}" "$from" "$to" "$units" "${!also_from_var:-}" "${!also_to_var:-}" &&
    side "${sides[$i]}" "$tests" "$bench"
  all_units="${all_units:-} $units"
done
if [ "${AB_RESTORE:-0}" = 1 ]; then
  objects=()
  for stem in $(echo "${all_units:-}" | tr ' ' '\n' | sort -u); do
    objects+=("CMakeFiles/flashhopper_kernels.dir/src/hopper/instantiations/$stem.cu.o")
  done
  if [ ${#objects[@]} -gt 0 ] && rebuild_library base "${objects[@]}"; then
    log "restored: the base library relinked"
  else
    log "restore failed: the library may still be a variant's"
  fi
fi
log "AB DONE"
