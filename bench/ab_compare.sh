#!/usr/bin/env bash
# On the GPU machine: the benchmark run twice in one call, once per library, so that two builds
# compare under the same conditions. Prints each run's table; the CSVs land in $OUT/a and $OUT/b.
# Usage: bench/ab_compare.sh LIB_A LIB_B [benchmark arguments, e.g. --passes bwd --seqlens 2048]
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
lib_a=$1 lib_b=$2
shift 2
out="${OUT:-/tmp/flashhopper_out}"
for side in a b; do
  lib=$lib_a
  [ "$side" = b ] && lib=$lib_b
  mkdir -p "$out/$side"
  echo "==== $side: $lib"
  PYTHONUNBUFFERED=1 FLASHHOPPER_LIBRARY="$lib" PYTHONPATH="$root/python" \
    timeout 280 python3 "$root/bench/benchmark_attention.py" --out "$out/$side" "$@" 2>&1 | tail -32
done
