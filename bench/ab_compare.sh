#!/usr/bin/env bash
# On the GPU machine: the benchmark run once per library, one after the other in one call, so
# that builds compare under the same conditions. Prints each run's table; the CSVs land in
# $OUT/a, $OUT/b, ... in the order the libraries are given.
# Usage: bench/ab_compare.sh LIB_A LIB_B [LIB_C ...] [benchmark arguments, e.g. --passes bwd --seqlens 2048]
# A library may be given as LIB@PYTHONPATH: the Python package it runs under (an older library
# needs its own checkout's python/; default: this checkout's).
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
libs=()
while [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; do
  libs+=("$1")
  shift
done
out="${OUT:-/tmp/flashhopper_out}"
sides=(a b c d e f g h)
if [ ${#libs[@]} -lt 1 ] || [ ${#libs[@]} -gt ${#sides[@]} ]; then
  echo "ab_compare.sh: give 1 to ${#sides[@]} libraries before the benchmark arguments (got ${#libs[@]})" >&2
  exit 2
fi
for i in "${!libs[@]}"; do
  side=${sides[$i]}
  mkdir -p "$out/$side"
  lib="${libs[$i]%%@*}"
  package="$root/python"
  [ "$lib" != "${libs[$i]}" ] && package="${libs[$i]#*@}"
  echo "==== $side: $lib (package $package)"
  PYTHONUNBUFFERED=1 FLASHHOPPER_LIBRARY="$lib" PYTHONPATH="$package" \
    timeout 280 python3 "$root/bench/benchmark_attention.py" --out "$out/$side" "$@" 2>&1 | tail -32
done
