#!/usr/bin/env bash
# On the GPU machine: the benchmark run once per library, one after the other in one call, so
# that builds compare under the same conditions. Prints each run's table; the CSVs land in
# $OUT/a, $OUT/b, ... in the order the libraries are given.
# Usage: bench/ab_compare.sh LIB_A LIB_B [LIB_C ...] [benchmark arguments, e.g. --passes bwd --seqlens 2048]
# A library may be given as LIB@PYTHONPATH: the Python package it runs under (an older library
# needs its own checkout's python/; default: this checkout's).
# AB_SCRIPT: the benchmark (default bench/benchmark_attention.py; word-split, so '-m flashhopper.bench'
# runs the package's, e.g. with --fp8).
# AB_PASSES=N takes the libraries in turn N times (a b a b: a host's slow spell shows as a spread
# within a side, not as a difference between sides); pass 2's output goes to $OUT/a.2, ...
# AB_GATE=1 times the speed gate's rows instead (`python -m flashhopper.bench --gate`, the
# arguments its own, e.g. --rows "dense hdim 64" window softcap): each run's figures go to
# $OUT/gate_<side>.<pass>.csv, and a table of every row's figure per side and pass, with each
# side's median over a's, is printed last (bench/ab_gate_table.py).
set -uo pipefail
set -f  # AB_SCRIPT is split on spaces, never expanded as file names
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
passes=${AB_PASSES:-1}
mkdir -p "$out"
for pass in $(seq "$passes"); do
  for i in "${!libs[@]}"; do
    side=${sides[$i]}
    lib="${libs[$i]%%@*}"
    package="$root/python"
    [ "$lib" != "${libs[$i]}" ] && package="${libs[$i]#*@}"
    echo "==== $side (pass $pass): $lib (package $package)"
    if [ "${AB_GATE:-0}" = 1 ]; then
      PYTHONUNBUFFERED=1 FLASHHOPPER_LIBRARY="$lib" PYTHONPATH="$package" \
        timeout 280 python3 -m flashhopper.bench --gate --out "$out/gate_$side.$pass.csv" "$@" 2>&1 | tail -4
    else
      folder="$out/$side" && [ "$pass" -gt 1 ] && folder="$out/$side.$pass"
      mkdir -p "$folder"
      PYTHONUNBUFFERED=1 FLASHHOPPER_LIBRARY="$lib" PYTHONPATH="$package" \
        timeout 280 python3 ${AB_SCRIPT:-"$root/bench/benchmark_attention.py"} --out "$folder" "$@" 2>&1 | tail -32
    fi
  done
done
if [ "${AB_GATE:-0}" = 1 ]; then
  python3 "$root/bench/ab_gate_table.py" "$out" | tee "$out/ab_gate_table.md"
fi
