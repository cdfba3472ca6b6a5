#!/usr/bin/env bash
# On the GPU machine: which unit bounds a pass's main kernel. ncu's speed-of-light, memory and
# compute workload sections (the details page: L2, L1/shared, DRAM and SM throughput as % of peak,
# L2 bytes a second) for the third launch of each named call, one CSV each under $OUT, then one
# table of them (throughput_report.py). Usage: profile_throughput.sh "fwd 8192 512 0" "bwd 8192 256 1" ...
# (pass, seqlen, head dim, causal: one_call.py's arguments, 16k tokens and model dim 2048).
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
out="${OUT:-/tmp/flashhopper_out}"
mkdir -p "$out"
export PYTHONPATH="$root/python${PYTHONPATH:+:$PYTHONPATH}"
export FLASHHOPPER_LIBRARY="${FLASHHOPPER_LIBRARY:-$root/build/libflashhopper.so}"
csvs=()
for spec in "$@"; do
  read -r pass_ seqlen hdim causal <<< "$spec"
  kernel=regex:forward_kernel
  [ "$pass_" = bwd ] && kernel=regex:backward_kernel_entry
  name="throughput_${pass_}_${seqlen}_d${hdim}_c${causal}"
  # shellcheck disable=SC2086
  if timeout 300 ncu --clock-control none -k "$kernel" --launch-skip 2 --launch-count 1 \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
      --metrics lts__t_bytes.sum.per_second --page details --csv \
      python3 "$root/bench/profile/one_call.py" $pass_ "$seqlen" "$hdim" "$causal" \
      > "$out/$name.csv" 2> "$out/$name.log"; then
    csvs+=("$out/$name.csv")
  else
    echo "ncu failed for '$spec': see $out/$name.log"
  fi
done
[ ${#csvs[@]} -gt 0 ] && python3 "$root/bench/profile/throughput_report.py" "${csvs[@]}"
