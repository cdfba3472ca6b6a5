#!/usr/bin/env bash
# compute-sanitizer over whole GPU test binaries (every case of their grids, not a filtered few),
# split into GoogleTest shards so that a sweep can spread over several device calls. Usage:
#   scripts/sanitizer_sweep.sh [TOOL...]          (default: memcheck racecheck initcheck synccheck)
# Environment:
#   BUILD          build folder (default build/)
#   OUT            where logs and the summary go (default /tmp/flashhopper_sweep)
#   SWEEP_BINARIES test binaries (default: every GPU test binary of tests/cpp)
#   SWEEP_SHARDS   N: each binary's cases split into N shards (GTEST_TOTAL_SHARDS; default 1)
#   SWEEP_RUN      which shards to run, e.g. "0 1" (default all N)
#   SWEEP_TIMEOUT  seconds per (tool, binary, shard) run (default 300)
#   SWEEP_FILTER   a gtest filter applied before sharding (default *)
#   SWEEP_JOBS     how many runs go at once (default 1); the GPU is shared, the CPU reference and
#                  the sanitizer's own host work are what parallel runs spread over the cores
# Each run writes OUT/sweep_<tool>_<binary>_<shard>of<N>.log and appends one line to
# OUT/sweep_summary.tsv: tool, binary, shard, exit code, seconds, tests run, failed tests, the
# sanitizer's summary. Exit code 0 only when every run passed its tests with a clean summary.
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build="${BUILD:-$root/build}"
out="${OUT:-/tmp/flashhopper_sweep}"
mkdir -p "$out"
export LD_LIBRARY_PATH="$build:${LD_LIBRARY_PATH:-}"
tools=("$@")
[ ${#tools[@]} -eq 0 ] && tools=(memcheck racecheck initcheck synccheck)
binaries=(${SWEEP_BINARIES:-test_forward_gpu test_backward_gpu test_varlen_gpu test_hostile_values_gpu test_concurrency_gpu})
shards="${SWEEP_SHARDS:-1}"
run_shards=(${SWEEP_RUN:-$(seq 0 $((shards - 1)))})
summary="$out/sweep_summary.tsv"
[ -f "$summary" ] || printf 'tool\tbinary\tshard\trc\tseconds\ttests\tfailed\tsanitizer\n' >"$summary"
status=0

# One (tool, binary, shard) run: its log, and one line of the summary.
run_one() {
  local tool=$1 binary=$2 shard=$3 log rc start seconds tests failed verdict clean=1
  log="$out/sweep_${tool}_${binary}_${shard}of${shards}.log"
  start=$(date +%s)
  GTEST_TOTAL_SHARDS="$shards" GTEST_SHARD_INDEX="$shard" timeout "${SWEEP_TIMEOUT:-300}" \
    compute-sanitizer --tool "$tool" --error-exitcode 9 "$build/tests/cpp/$binary" --gtest_brief=1 \
    --gtest_filter="${SWEEP_FILTER:-*}" >"$log" 2>&1
  rc=$?
  seconds=$(($(date +%s) - start))
  tests=$(grep -oE '^\[==========\] [0-9]+ tests? from' "$log" | tail -1 | grep -oE '[0-9]+' | head -1)
  failed=$(grep -cE '^\[  FAILED  \] .*\.' "$log")
  verdict=$(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$log" | tail -1 | sed 's/^========= //')
  # A clean run: exit 0 (77: no GPU), no failed test, a summary of 0 errors.
  [[ $rc -eq 0 && $failed -eq 0 && "$verdict" =~ (^|[^0-9])0\ (errors|hazards) ]] || clean=0
  printf '%s\t%s\t%s/%s\t%s\t%s\t%s\t%s\t%s\n' "$tool" "$binary" "$shard" "$shards" "$rc" "$seconds" \
    "${tests:-?}" "$failed" "${verdict:-no summary (timed out?)}" | tee -a "$summary"
  return $((1 - clean))
}

jobs_max="${SWEEP_JOBS:-1}"
running=0
for tool in "${tools[@]}"; do
  for binary in "${binaries[@]}"; do
    for shard in "${run_shards[@]}"; do
      if [ "$running" -ge "$jobs_max" ]; then
        wait -n || status=1
        running=$((running - 1))
      fi
      run_one "$tool" "$binary" "$shard" &
      running=$((running + 1))
    done
  done
done
while [ "$running" -gt 0 ]; do
  wait -n || status=1
  running=$((running - 1))
done
echo "==== sanitizer sweep ($summary) ===="
(column -t -s $'\t' "$summary" 2>/dev/null || cat "$summary")
exit $status
