#!/usr/bin/env bash
# One call on the GPU machine: GPU tests, compute-sanitizer on small cases, the demo, and the
# side-by-side benchmarks; prints a short summary last. Build here first (cmake --build build)
# and carry the build folder, or build there (step `build`: the full kernel set, or KERNELS=dev or bench, with the
# GoogleTest headers and archives carried in .gtest/); scripts/device_job.sh runs a build and
# several steps as one background job, for builds longer than a call. Usage:
#   scripts/device_check.sh [build|tests|features|varlen|sanitize|demo|gate|bench|features_bench|varlen_bench|
#                            kernel_times|head_dims_bench|decode_bench|kv_cache|python|
#                            host_overhead|hostile|sweep|readme|resources]...
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build="${BUILD:-$root/build}"
out="${OUT:-/tmp/flashhopper_out}"
mkdir -p "$out"
export LD_LIBRARY_PATH="$build:${LD_LIBRARY_PATH:-}"  # the build's rpath names this machine's paths
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(resources tests sanitize demo gate bench)
summary=()
nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.used --format=csv,noheader || true

# compute-sanitizer memcheck and racecheck over one test binary's filtered cases.
# SANITIZE_SETS (default all) picks sets by name: forward, backward, forward_features, ..., kv_cache.
sanitize() {
  local pass_=$1 binary=$2 filter=$3 tool rc
  [[ " ${SANITIZE_SETS:-$pass_} " == *" $pass_ "* ]] || return 0
  for tool in memcheck racecheck; do
    timeout 300 compute-sanitizer --tool "$tool" --error-exitcode 9 "$build/tests/cpp/$binary" \
      --gtest_brief=1 --gtest_filter="$filter" >"$out/sanitizer_${pass_}_$tool.log" 2>&1
    rc=$?
    tail -3 "$out/sanitizer_${pass_}_$tool.log"
    summary+=("compute-sanitizer $pass_ $tool: rc=$rc, $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' \
      "$out/sanitizer_${pass_}_$tool.log" | tail -1)")
  done
}

# One GPU test binary over a gtest filter: its log, the failures and totals, a summary line.
run_gtests() {
  local label=$1 binary=$2 filter=$3 seconds=$4 log=$5 rc
  timeout "$seconds" "$build/tests/cpp/$binary" --gtest_brief=1 --gtest_filter="$filter" >"$out/$log" 2>&1
  rc=$?
  grep -E "FAILED|Failure|error|PASSED|SKIPPED|spread" "$out/$log" | head -40
  summary+=("$label: rc=$rc, $(grep -E '^\[  PASSED  \]|^\[  FAILED  \]' "$out/$log" | tr '\n' ' ')")
}

# One side-by-side benchmark script of bench/ (its own peers), the table it prints last; extra
# arguments go to the script, whose files then go into $out/$name<arguments>.
run_bench() {
  local name=$1 dir=$out
  shift
  [ $# -gt 0 ] && dir="$out/$name$(printf '%s' "$@" | tr -c 'a-zA-Z0-9' '_')"
  PYTHONUNBUFFERED=1 FLASHHOPPER_LIBRARY="$build/libflashhopper.so" PYTHONPATH="$root/python${PYTHONPATH:+:$PYTHONPATH}" \
    timeout 400 python3 "$root/bench/bench_$name.py" --out "$dir" "$@" 2>&1 | tail -30
  summary+=("$name bench $*: see $dir/bench_${name}_*.csv")
}

for step in "${steps[@]}"; do
  case "$step" in
    build)
      # nvcc and ninja are there; GoogleTest is not (.gtest/ holds this machine's copy).
      # BUILD_TARGETS (default all) builds only some targets, e.g. the GPU test binaries for a sweep.
      cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHHOPPER_KERNELS="${KERNELS:-full}" \
        -DGTEST_ROOT="$root/.gtest" -DFLASHHOPPER_TORCH_OPS="${TORCH_OPS:-ON}" >"$out/build.log" 2>&1 &&
        timeout "${BUILD_TIMEOUT:-560}" cmake --build "$build" -j "$(nproc)" \
          ${BUILD_TARGETS:+--target $BUILD_TARGETS} >>"$out/build.log" 2>&1
      rc=$?
      tail -3 "$out/build.log"
      summary+=("build: rc=$rc")
      ;;
    features)
      # The masks and score transforms alone, both passes (a subset of `tests`).
      run_gtests "forward features" test_forward_gpu 'Features/*' 420 gpu_tests_features_fwd.log
      run_gtests "backward features" test_backward_gpu 'Features/*:Repeat/*:Waves/*' 420 gpu_tests_features_bwd.log
      ;;
    varlen)
      # Packed batches, both passes (VARLEN_FILTER, default all).
      run_gtests "varlen tests" test_varlen_gpu "${VARLEN_FILTER:-*}" "${VARLEN_TIMEOUT:-420}" gpu_tests_varlen.log
      ;;
    varlen_bench) run_bench varlen ;;
    kernel_times)
      # Each kernel's device time in one call, varlen against dense (equal lengths) and the issue's
      # packed batch and a mix of three lengths (bench/profile/kernel_times.py).
      for lengths in 2048,2048,2048,2048,2048,2048,2048,2048 2048,2048,128,1000,3000,2048,2048,1000,2048,1000,16 \
          3072,3072,3072,1024,1024,1024,2048,2048; do
        PYTHONUNBUFFERED=1 FLASHHOPPER_LIBRARY="$build/libflashhopper.so" PYTHONPATH="$root/python" \
          timeout 120 python3 "$root/bench/profile/kernel_times.py" --lengths "$lengths" 2>&1 | grep -v Warn
      done
      summary+=("kernel_times: printed above")
      ;;
    kv_cache)
      # The KV cache (append, rotary, leftpad, cache rows) and the split-KV combine, forward only.
      run_gtests "kv cache tests" test_forward_gpu 'KvCache/*:Combine/*:ForwardGpuErrors.*' 300 gpu_tests_kv_cache.log
      ;;
    python)
      # The PyTorch package on the GPU (PYTEST_FILTER: a pytest -k expression, default all). No -x:
      # one failure must not hide the tests after it; -rA lists every test's outcome (and a skip's reason)
      # in pytest_gpu.log, so a note can say which ran.
      FLASHHOPPER_LIBRARY="$build/libflashhopper.so" PYTHONPATH="$root/python" timeout "${PYTEST_TIMEOUT:-400}" \
        python3 -m pytest -q -rA "$root/tests/python/test_gpu.py" "$root/tests/python/test_library.py" \
        "$root/tests/python/test_distributed.py" \
        ${PYTEST_FILTER:+-k "$PYTEST_FILTER"} >"$out/pytest_gpu.log" 2>&1
      rc=$?
      grep -E "^FAILED|passed|failed|error" "$out/pytest_gpu.log" | tail -15
      summary+=("python gpu tests: rc=$rc, $(tail -1 "$out/pytest_gpu.log")")
      ;;
    host_overhead)
      FLASHHOPPER_LIBRARY="$build/libflashhopper.so" PYTHONPATH="$root/python" \
        timeout 120 python3 "$root/bench/profile/host_overhead.py" 2>&1 | tee "$out/host_overhead.txt" | tail -14
      timeout 60 "$build/bench/profile/host_overhead_cpp" 2>&1 | tee "$out/host_overhead_cpp.txt" | tail -14
      summary+=("host_overhead: see $out/host_overhead.txt, $out/host_overhead_cpp.txt")
      ;;
    features_bench) run_bench features ;;
    head_dims_bench) run_bench head_dims ;;
    decode_bench)
      # The paged column at each of DECODE_PAGE_SIZES (default the issue's 16 and 256).
      for page_size in ${DECODE_PAGE_SIZES:-16 256}; do run_bench decode --page-size "$page_size"; done
      ;;
    tests)
      # FWD_FILTER / BWD_FILTER (gtest filters, default all) split the grid over several calls.
      run_gtests "gpu tests" test_forward_gpu "${FWD_FILTER:-*}" "${FWD_TIMEOUT:-420}" gpu_tests.log
      run_gtests "gpu backward tests" test_backward_gpu "${BWD_FILTER:-*}" "${BWD_TIMEOUT:-420}" gpu_tests_backward.log
      # The host-side checks on this build's kernel set (which families it refuses, and how): CI's
      # build has no kernels, so only here do they run against compiled families.
      run_gtests "validation tests" test_validation '*' 120 gpu_tests_validation.log
      ;;
    sanitize)
      # One small case per head dim and pass (several key and query blocks, GQA, causal); fp8's
      # column-major V (its own loads and reorder) once a head dim.
      sanitize forward test_forward_gpu \
        'Grid/ForwardGpuTest.MatchesReference/*_b1_sq113_sk200_h4_hkv2:Grid/ForwardGpuTest.MatchesReference/*_b3_sq128_sk128_h2_hkv2:VColumnMajor/ForwardGpuTest.MatchesReference/*_causal_b3_sq128_sk128_h2_hkv2_vcolumns'
      # Backward: also the families with a value head dim of their own, head dim 256 non-causal,
      # and causal with query blocks that see no key (its dQ kernel writes them zeros).
      sanitize backward test_backward_gpu "$(printf 'Grid/BackwardGpuTest.MatchesReference/%s:' \
        'bf16_d*_causal_b1_sq113_sk200_h4_hkv2' 'bf16_d*_causal_b1_sq113_sk200_h4_hkv2_dv*' \
        bf16_d256_full_b1_sq113_sk200_h4_hkv2 bf16_d256_causal_b2_sq1000_sk513_h4_hkv1)"
      # Head dim 512's backward (the full kernel set): 32-key blocks with one Q and one dO stage, the
      # dQ kernel's two warpgroups on the same rows; causal with rows that see no key, and a window.
      sanitize hdim512 test_backward_gpu "$(printf 'Grid/BackwardGpuTest.MatchesReference/bf16_d512_%s:' \
        causal_b2_sq1000_sk513_h4_hkv1 full_b1_sq113_sk200_h4_hkv2)Features/*.MatchesReference/bf16_d512_full_b1_sq600_sk500_h4_hkv2_w100x0_sinks2_cap20_lsink"
      # Its forward's CTA pairs (K/V multicast), unmasked and causal, odd counts of query blocks
      # (a pair's block past the sequence) and causal rows that see no key among them.
      sanitize hdim512_forward test_forward_gpu "$(printf 'Grid/ForwardGpuTest.MatchesReference/bf16_d512_%s:' \
        full_b1_sq113_sk200_h4_hkv2 full_b1_sq257_sk1000_h2_hkv2 full_b2_sq7_sk7_h3_hkv3 \
        causal_b1_sq257_sk1000_h2_hkv2 causal_b2_sq1000_sk513_h4_hkv1)"
      # One small case of each mask and transform, both passes (windows, sinks, chunks, softcap,
      # learnable sink), at head dims 128 and 256 (the dQ kernel).
      features_filter="$(printf 'Features/*.MatchesReference/bf16_d%s_%s:' \
        128 'full_b2_sq300_sk300_h4_hkv2_w5x3' 128 'full_b2_sq1000_sk513_h4_hkv1_w70x0_sinks4' \
        128 'causal_b1_sq257_sk1000_h2_hkv2_chunk100' 128 'full_b1_sq113_sk200_h4_hkv2_cap30' \
        128 'full_b1_sq600_sk500_h4_hkv2_w100x0_sinks2_cap20_lsink' 256 'full_b1_sq400_sk700_h4_hkv2_w64x0_cap5' \
        256 'causal_b1_sq500_sk300_h2_hkv1_lsink')"
      sanitize forward_features test_forward_gpu "$features_filter"
      sanitize backward_features test_backward_gpu "$features_filter"
      # Packed batches with zero-length sequences, seqused, both passes, head dims 128 and 256; and
      # split-KV over packed queries (empty splits among them; decode rows of 1-3 tokens packed by KV
      # head, plan/packed_decode.hpp); paged keys with cu_seqlens_k.
      varlen_filter="$(printf 'Varlen/VarlenForwardGpuTest.*/bf16_d%s_%s:Varlen/VarlenBackwardGpuTest.*/bf16_d%s_%s:' \
        128 'causal_q1_7_113_0_1000_300_0_*' 128 'causal_q1_7_113_0_1000_300_0_*' \
        256 'causal_q200_513_64_0_*' 256 'causal_q200_513_64_0_*')"
      split_filter="$(printf 'VarlenSplitKv/VarlenForwardGpuTest.*/bf16_d128_%s:' 'causal_q1_7_113_*_splits7' \
        'full_q1_1_0_3_1_*_splits3')"
      sanitize varlen test_varlen_gpu "${varlen_filter}${split_filter}$(printf \
        'VarlenPaged/VarlenForwardGpuTest.*/bf16_d128_%s:' '*_page24' '*_splits5_page16')"
      # The KV cache (append with rotary, leftpad, cache rows; new keys packed into pages, split)
      # and the split-KV combine.
      sanitize kv_cache test_forward_gpu \
        'KvCache/KvCacheGpuTest.*/b4_sq3_h8_hkv2_rows6_S1000_causal_leftpad_batchidx_new3_rotary64i:KvCache/KvCacheGpuTest.*/b6_sq3_h8_hkv2_rows6_S1024_causal_leftpad_batchidx_new3_rotary64i_splits3_page16_packednew:Combine/*/packed_bf16_splits7:Combine/*/dense_fp32_splits256'
      # A paged cache: pages loaded key by key (1, 24 keys, an append with rotary into pages of 4)
      # and in chunks of 16 and 32 keys; rows of the page table picked by cache_batch_idx, keys
      # from mid-page (cache_leftpad); fp8 gathered by one warp (pages of 24; leftpad, an append).
      sanitize paged test_forward_gpu "$(printf 'KvCache/*/%s:' b6_sq1_h32_hkv8_rows0_S2048_splits0_page1 \
        b6_sq1_h32_hkv8_rows0_S2040_splits0_page24 b4_sq3_h8_hkv2_rows0_S1024_causal_new3_rotary64i_page4 \
        b6_sq1_h32_hkv8_rows0_S2048_causal_splits0_page16 b6_sq1_h32_hkv8_rows9_S2048_batchidx_splits0_page128 \
        b4_sq3_h8_hkv2_rows6_S1024_causal_leftpad_batchidx_new3_rotary64i_page16 \
        fp8_b6_sq1_h32_hkv8_rows0_S2040_splits0_page24 fp8_b4_sq3_h8_hkv2_rows6_S1024_causal_leftpad_batchidx_new3_page16)"
      # Split-KV: the partials and the combine after the attention (sinks, empty splits, an append,
      # packed GQA at ratio 32 over pages).
      sanitize split_kv test_forward_gpu "$(printf 'SplitKv/*/bf16_d128_%s:' full_b1_sq200_sk300_h2_hkv2_lsink_splits256 \
        causal_b1_sq300_sk2000_h4_hkv1_splits3 full_b2_sq130_sk1500_h4_hkv2_w128x0_sinks4_splits5)$(printf \
        'KvCache/*/%s:' b6_sq1_h32_hkv8_rows7_S4096_causal_leftpad_batchidx_new3_rotary64i_splits3 \
        b4_sq1_h32_hkv1_rows4_S4096_causal_splits3_page16)"
      # qv (absorbed MLA; the full kernel set): dense causal, and decoding 128 query heads of one KV
      # head, split, one query token and four (their query heads packed into one tile's rows); the
      # same at dv 512 (O split over two warpgroups, S's halves exchanged).
      sanitize qv test_forward_gpu "$(printf 'Qv/QvGpuTest.*/%s:' b2_sq300_sk300_h16_causal b3_sq1_sk3000_h128_cache_splits5 \
        b3_sq4_sk3000_h128_causal_cache_splits5_nolse b2_sq300_sk300_h16_causal_dv512 \
        b3_sq1_sk3000_h128_cache_splits5_dv512 b3_sq4_sk3000_h128_causal_cache_splits5_nolse_dv512)"
      # Several query tokens of one KV head packed into one tile's rows, the mask by token, the lse
      # by head and token (qv only: the kernels that group rows; the full kernel set).
      sanitize grouped_rows test_forward_gpu 'Qv/QvGpuTest.*/b3_sq4_sk1000_h128_causal_cache:Qv/QvGpuTest.*/b3_sq4_sk1000_h128_causal_cache_dv512'
      # Several query tokens with GQA: q gathered by KV head, the rows' positions shifted, the
      # combine writing out and lse through the grouped strides (one split and three over pages;
      # a ratio of 7, its rows padded to 8).
      sanitize grouped_gqa test_forward_gpu "$(printf 'KvCache/*/%s:' \
        b4_sq4_h32_hkv8_rows4_S4096_causal_splits3_page16 b4_sq4_h64_hkv8_rows4_S4096 \
        b4_sq5_h28_hkv4_rows6_S2048_leftpad_batchidx_splits3_page16)"
      ;;
    hostile)
      # Extreme and non-finite input values; concurrent calls from threads and streams.
      run_gtests "hostile value tests" test_hostile_values_gpu '*' 300 gpu_tests_hostile.log
      run_gtests "concurrency tests" test_concurrency_gpu '*' 300 gpu_tests_concurrency.log
      ;;
    sweep)
      # compute-sanitizer over whole test binaries (scripts/sanitizer_sweep.sh; SWEEP_TOOLS, and
      # its SWEEP_* variables pick the tools, binaries and shards of this call).
      # The logs travel as one archive (a device call returns a bounded number of files).
      BUILD="$build" OUT="$out/sweep" "$root/scripts/sanitizer_sweep.sh" ${SWEEP_TOOLS:-} | tail -40
      rc=${PIPESTATUS[0]}
      tar czf "$out/sweep_logs.tgz" -C "$out/sweep" . && find "$out/sweep" -name '*.log' -delete
      summary+=("sanitizer sweep: rc=$rc, see $out/sweep/sweep_summary.tsv and sweep_logs.tgz")
      ;;
    readme)
      # The README's GPU-side commands as written, on the build step's folder (README_STEPS picks
      # some of: test demo bench decode): scripts/test.sh (CTest, then every Python test),
      # scripts/demo.sh, python -m flashhopper.bench and its --decode (small grids, to see they run).
      for part in ${README_STEPS:-test demo bench decode}; do
        case "$part" in
          test) (cd "$root" && BUILD_DIR="$(realpath --relative-to="$root" "$build")" FLASHHOPPER_PYTHON=python3 \
                 FLASHHOPPER_CMAKE_ARGS="-DGTEST_ROOT=$root/.gtest" timeout "${README_TEST_TIMEOUT:-540}" \
                 ./scripts/test.sh) >"$out/readme_test.log" 2>&1 ;;
          demo) (cd "$root" && BUILD_DIR="$(realpath --relative-to="$root" "$build")" timeout 300 ./scripts/demo.sh) \
                  >"$out/readme_demo.log" 2>&1 ;;
          bench) (cd "$out" && FLASHHOPPER_LIBRARY="$build/libflashhopper.so" PYTHONPATH="$root/python" timeout 300 \
                  python3 -m flashhopper.bench --hdims 128 --seqlens 2048 --rounds 3 --calls 5 --bwd-rounds 3 --bwd-calls 3) >"$out/readme_bench.log" 2>&1 ;;
          decode) (cd "$out" && FLASHHOPPER_LIBRARY="$build/libflashhopper.so" PYTHONPATH="$root/python" timeout 300 \
                   python3 -m flashhopper.bench --decode --batches 8 --cache-lens 4096 --rounds 3 --calls 5 --prefill-lens 1024) >"$out/readme_decode.log" 2>&1 ;;
        esac
        rc=$?
        tail -4 "$out/readme_$part.log"
        summary+=("README $part: rc=$rc, $(grep -E 'passed|tests passed|PASS|TFLOP|TB/s' "$out/readme_$part.log" | tail -1)")
      done
      ;;
    demo)
      timeout 300 "$build/examples/flashhopper_demo" 2048 128 2>&1 | tee "$out/demo.log"
      summary+=("demo: $(grep -c PASS "$out/demo.log") pass, $(grep -c FAIL "$out/demo.log") fail")
      ;;
    gate)
      # The speed gate (python -m flashhopper.bench --gate): each row against bench/baseline_<gpu>.csv;
      # GATE_ARGS adds options (--update writes the better figures back).
      PYTHONUNBUFFERED=1 FLASHHOPPER_LIBRARY="$build/libflashhopper.so" PYTHONPATH="$root/python" \
        timeout 400 python3 -m flashhopper.bench --gate --out "$out/gate.csv" ${GATE_ARGS:-} 2>&1 | tee "$out/gate.log" | tail -60
      summary+=("gate: $(tail -1 "$out/gate.log")")
      ;;
    resources)
      # Registers, stack and local loads/stores of each forward instantiation against the recorded
      # ones (scripts/kernel_resources.py, bench/kernel_resources.txt).
      python3 "$root/scripts/kernel_resources.py" "$build" --check "$root/bench/kernel_resources.txt" \
        2>&1 | tee "$out/kernel_resources.txt" | tail -30
      summary+=("kernel resources: $(tail -1 "$out/kernel_resources.txt")")
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
