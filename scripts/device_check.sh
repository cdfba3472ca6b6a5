#!/usr/bin/env bash
# One call on the GPU machine: GPU tests, compute-sanitizer on small cases, the demo, and the
# side-by-side benchmark; prints a short summary last. Build here first (cmake --build build)
# and carry the build folder. Usage: scripts/device_check.sh [tests|sanitize|demo|bench]...
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build="${BUILD:-$root/build}"
out="${OUT:-/tmp/flashhopper_out}"
mkdir -p "$out"
export LD_LIBRARY_PATH="$build:${LD_LIBRARY_PATH:-}"  # the build's rpath names this machine's paths
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(tests sanitize demo bench)
summary=()
nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.used --format=csv,noheader || true

# compute-sanitizer memcheck and racecheck over one test binary's filtered cases.
sanitize() {
  local pass_=$1 binary=$2 filter=$3 tool rc
  for tool in memcheck racecheck; do
    timeout 300 compute-sanitizer --tool "$tool" --error-exitcode 9 "$build/tests/cpp/$binary" \
      --gtest_brief=1 --gtest_filter="$filter" >"$out/sanitizer_${pass_}_$tool.log" 2>&1
    rc=$?
    tail -3 "$out/sanitizer_${pass_}_$tool.log"
    summary+=("compute-sanitizer $pass_ $tool: rc=$rc, $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' \
      "$out/sanitizer_${pass_}_$tool.log" | tail -1)")
  done
}

for step in "${steps[@]}"; do
  case "$step" in
    tests)
      timeout 420 "$build/tests/cpp/test_forward_gpu" --gtest_brief=1 >"$out/gpu_tests.log" 2>&1
      rc=$?
      grep -E "FAILED|Failure|error|PASSED|SKIPPED" "$out/gpu_tests.log" | head -40
      summary+=("gpu tests: rc=$rc, $(grep -E '^\[  PASSED  \]|^\[  FAILED  \]' "$out/gpu_tests.log" | tr '\n' ' ')")
      timeout 420 "$build/tests/cpp/test_backward_gpu" --gtest_brief=1 >"$out/gpu_tests_backward.log" 2>&1
      rc=$?
      grep -E "FAILED|Failure|error|PASSED|SKIPPED|spread" "$out/gpu_tests_backward.log" | head -40
      summary+=("gpu backward tests: rc=$rc, $(grep -E '^\[  PASSED  \]|^\[  FAILED  \]' "$out/gpu_tests_backward.log" | tr '\n' ' ')")
      ;;
    sanitize)
      # One small case per head dim and pass (several key and query blocks, GQA, causal).
      sanitize forward test_forward_gpu \
        'Grid/ForwardGpuTest.MatchesReference/*_b1_sq113_sk200_h4_hkv2:Grid/ForwardGpuTest.MatchesReference/*_b3_sq128_sk128_h2_hkv2'
      # Backward: also head dim 256 non-causal, and causal with query blocks that see no key (its
      # dQ kernel writes them zeros).
      sanitize backward test_backward_gpu "$(printf 'Grid/BackwardGpuTest.MatchesReference/%s:' \
        'bf16_d*_causal_b1_sq113_sk200_h4_hkv2' bf16_d256_full_b1_sq113_sk200_h4_hkv2 \
        bf16_d256_causal_b2_sq1000_sk513_h4_hkv1)"
      ;;
    demo)
      timeout 300 "$build/examples/flashhopper_demo" 2048 128 2>&1 | tee "$out/demo.log"
      summary+=("demo: $(grep -c PASS "$out/demo.log") pass, $(grep -c FAIL "$out/demo.log") fail")
      ;;
    bench)
      PYTHONUNBUFFERED=1 FLASHHOPPER_LIBRARY="$build/libflashhopper.so" PYTHONPATH="$root/python" \
        timeout 560 python3 "$root/bench/benchmark_attention.py" --out "$out" 2>&1 | tail -100
      summary+=("bench: see $out/bench_*.csv")
      ;;
  esac
done
echo "==== summary ===="
printf '%s\n' "${summary[@]}"
