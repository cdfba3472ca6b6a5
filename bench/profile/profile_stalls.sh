#!/usr/bin/env bash
# On the GPU machine: ncu's warp-stall sampling per SASS instruction for the third launch of one
# pass's main kernel, written as CSV to $OUT/stalls_<pass>_<seqlen>_d<hdim>_c<causal>.csv.
# Read it here with bench/profile/stall_report.py.
# Usage: profile_stalls.sh fwd|bwd SEQLEN HEAD_DIM CAUSAL [DETERMINISTIC (bwd: 0 or 1)]
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
pass_=$1 seqlen=$2 hdim=$3 causal=$4 deterministic=${5:-0}
out="${OUT:-/tmp/flashhopper_out}"
mkdir -p "$out"
export PYTHONPATH="$root/python" FLASHHOPPER_LIBRARY="${FLASHHOPPER_LIBRARY:-$root/build/libflashhopper.so}"
kernel=regex:forward_kernel
[ "$pass_" = bwd ] && kernel=regex:backward_kernel_entry
name="stalls_${pass_}_${seqlen}_d${hdim}_c${causal}"
[ "$deterministic" = 1 ] && name="${name}_det"
timeout 300 ncu --clock-control none -k "$kernel" --launch-skip 2 --launch-count 1 --section SourceCounters \
  --section WarpStateStats --import-source yes -o "$out/$name" \
  python3 "$root/bench/profile/one_call.py" "$pass_" "$seqlen" "$hdim" "$causal" "$deterministic" \
  >"$out/$name.log" 2>&1 ||
  { echo "ncu failed: see $out/$name.log"; exit 1; }
ncu --import "$out/$name.ncu-rep" --page source --csv --print-source sass >"$out/$name.csv" 2>>"$out/$name.log" ||
  { echo "ncu --import failed: see $out/$name.log"; exit 1; }
rm -f "$out/$name.ncu-rep"  # large; the CSV holds what stall_report.py reads
echo "wrote $out/$name.csv"
