#!/usr/bin/env bash
# A whole device session's checks as one background job on the GPU machine, so that no single
# call has to outlive the build: it copies this tree to $JOB_DIR/src (each call replaces the
# repository root), unpacks CUTLASS there from a carried tarball (the machine has no network),
# builds KERNELS (default bench) with the torch ops, runs the device_check.sh STEPS (default
# "resources gate tests varlen sanitize python") and, with BENCH_HDIMS set, bench_head_dims.py
# beside FlashAttention-4 (the peers' env.sh, when $PEERS_ENV exists); with BENCH_SM_MARGIN=N,
# python -m flashhopper.bench without and with N SMs left free; with BENCH_DENSE, python -m
# flashhopper.bench beside the peers for each ';'-separated argument list; with BENCH_MLA=1 (full set), the
# absorbed-MLA decode rows and split_sweep.py (MLA and GQA); with BENCH_FP8=1 (bench set up), python -m
# flashhopper.bench --fp8; with PROFILE_THROUGHPUT, bench/profile/profile_throughput.sh; with
# AB_FILE (and the other AB_* variables),
# bench/ab_source_line.sh (it leaves its variant linked); with AB_QUEUE=FILE, the one-line A/Bs
# FILE lists (`ab_run NAME VAR=VALUE ...`), each on the base library; with AB_VARIANTS=FILE, the A/Bs
# of prebuilt variants it lists (prebuild_variant.sh --queue's, no compile here), last.
# With PREBUILT=<folder> (scripts/prebuild.sh's, carried), or that folder as a .tar.xz (device_kit.sh's
# build-kit/prebuilt.tar.xz: a tenth of the carry), it builds nothing and runs on that folder (not
# the A/B steps, which recompile objects of a build).
# One line a step goes to $JOB_DIR/out/progress.log; each step's output to $JOB_DIR/out/step_<step>.txt. Usage, from the
# repository root on the GPU machine (carry the tarball and .gtest/, which scripts/device_kit.sh
# makes here, with PREBUILD=1 the prebuilt folder too; it prints the carry list and this command):
#   CUTLASS_TARBALL=build-kit/cutlass.tar.xz setsid nohup scripts/device_job.sh > /tmp/job.log 2>&1 < /dev/null &
# then, within 30 s of each call's end (the machine's idle release), poll progress.log until it
# says "ALL DONE", and copy $JOB_DIR/out into $OUT.
set -u
root="$(cd "$(dirname "$0")/.." && pwd)"
job="${JOB_DIR:-/tmp/fhjob}"
src="$job/src" out="$job/out"
mkdir -p "$out"
log() { echo "$(date +%T) $*" >> "$out/progress.log"; }
summary() { grep -A30 '==== summary' "$1" | tail -n +2 | tr '\n' ' '; }

rm -rf "$src" && mkdir -p "$src" && cp -a "$root"/. "$src"/ && cd "$src" || exit 1
if [ -n "${CUTLASS_TARBALL:-}" ]; then
  mkdir -p third_party && tar xJf "$CUTLASS_TARBALL" -C third_party || { log "cannot unpack $CUTLASS_TARBALL"; exit 1; }
fi
export BUILD="$job/build" OUT="$out"
if [[ "${PREBUILT:-}" == *.tar.xz ]]; then  # the folder packed (scripts/device_kit.sh): unpacked here
  folder=$(tar tJf "$src/$PREBUILT" | head -1 | cut -d/ -f1)
  tar xJf "$src/$PREBUILT" -C "$src" || { log "cannot unpack $PREBUILT"; exit 1; }
  PREBUILT=$folder
fi
if [ -n "${PREBUILT:-}" ]; then  # scripts/prebuild.sh's folder, carried: no build here
  export BUILD="$src/$PREBUILT"
  [ -f "$BUILD/libflashhopper.so.0" ] || { log "PREBUILT: no $PREBUILT/libflashhopper.so.0"; exit 1; }
  ln -sf libflashhopper.so.0 "$BUILD/libflashhopper.so"
  log "prebuilt $PREBUILT: $(cat "$BUILD/KERNELS" "$BUILD/COMMIT" 2>/dev/null | tr '\n' ' ')"
else
  log "build start (KERNELS=${KERNELS:-bench})"
  KERNELS="${KERNELS:-bench}" TORCH_OPS="${TORCH_OPS:-ON}" BUILD_TIMEOUT="${BUILD_TIMEOUT:-1500}" \
    scripts/device_check.sh build > "$out/step_build.txt" 2>&1
  log "build done: $(summary "$out/step_build.txt")"
fi
for step in ${STEPS:-resources gate tests varlen sanitize python}; do
  log "$step start"
  scripts/device_check.sh "$step" > "$out/step_$step.txt" 2>&1
  log "$step done: $(summary "$out/step_$step.txt")"
done
cp bench/baseline_*.csv "$out/" 2>/dev/null  # with GATE_ARGS=--update: the new baselines
if [ -n "${BENCH_HDIMS:-}" ]; then
  peers="${PEERS_ENV:-/tmp/peers/env.sh}"
  # shellcheck disable=SC1090
  [ -f "$peers" ] && source "$peers"
  log "head_dims ${BENCH_HDIMS} at ${BENCH_SEQLENS:-1024 4096 16384}"
  # shellcheck disable=SC2086
  PYTHONUNBUFFERED=1 FLASHHOPPER_LIBRARY="$BUILD/libflashhopper.so" PYTHONPATH="$src/python:${PYTHONPATH:-}" \
    timeout 500 python3 bench/bench_head_dims.py --hdims $BENCH_HDIMS --seqlens ${BENCH_SEQLENS:-1024 4096 16384} \
    --out "$out/head_dims" > "$out/head_dims.txt" 2>&1
  log "head_dims rc=$?: $(tail -1 "$out/head_dims.txt")"
fi
if [ -n "${BENCH_FP8:-}" ]; then
  # The fp8 forward beside our bf16 and cuDNN (the bench set up: the fp8 families), 16k tokens a run.
  log "bench fp8"
  PYTHONUNBUFFERED=1 FLASHHOPPER_LIBRARY="$BUILD/libflashhopper.so" PYTHONPATH="$src/python:${PYTHONPATH:-}" \
    timeout 400 python3 -m flashhopper.bench --fp8 --out "$out/fp8" > "$out/bench_fp8.txt" 2>&1
  log "bench fp8 rc=$?: $(tail -1 "$out/bench_fp8.txt")"
fi
if [ -n "${BENCH_DENSE:-}" ]; then
  # python -m flashhopper.bench beside the peers (FA4's column where they import), one run a
  # ';'-separated argument list, e.g. BENCH_DENSE="--hdims 128 --seqlens 1024 4096 16384;--hdims 64 256 --seqlens 8192".
  peers="${PEERS_ENV:-/tmp/peers/env.sh}"
  # shellcheck disable=SC1090
  [ -f "$peers" ] && source "$peers"
  n=0
  IFS=';' read -ra dense_runs <<< "$BENCH_DENSE"
  for args in "${dense_runs[@]}"; do
    n=$((n + 1))
    log "bench dense $n: $args"
    # shellcheck disable=SC2086
    PYTHONUNBUFFERED=1 FLASHHOPPER_LIBRARY="$BUILD/libflashhopper.so" PYTHONPATH="$src/python:${PYTHONPATH:-}" \
      timeout 400 python3 -m flashhopper.bench $args --out "$out/dense$n" > "$out/bench_dense$n.txt" 2>&1
    log "bench dense $n rc=$?: $(tail -1 "$out/bench_dense$n.txt")"
  done
fi
if [ -n "${BENCH_SM_MARGIN:-}" ]; then
  # python -m flashhopper.bench (FA4's column where the peers import, peak memory) without and with
  # BENCH_SM_MARGIN SMs left free, hdim 128 at 4k and 16k tokens a sequence.
  peers="${PEERS_ENV:-/tmp/peers/env.sh}"
  # shellcheck disable=SC1090
  [ -f "$peers" ] && source "$peers"
  for margin in 0 "$BENCH_SM_MARGIN"; do
    log "bench sm_margin $margin"
    PYTHONUNBUFFERED=1 FLASHHOPPER_LIBRARY="$BUILD/libflashhopper.so" PYTHONPATH="$src/python:${PYTHONPATH:-}" \
      timeout 400 python3 -m flashhopper.bench --hdims 128 --seqlens 4096 16384 --sm-margin "$margin" \
      --out "$out/bench_margin$margin" > "$out/bench_margin$margin.txt" 2>&1
    log "bench sm_margin $margin rc=$?: $(tail -1 "$out/bench_margin$margin.txt")"
  done
fi
if [ -n "${BENCH_MLA:-}" ]; then
  # Absorbed MLA decode (the full set's qv family): the bench's MLA rows alone, then every split
  # count beside the chosen one (bench/profile/split_sweep.py), one and four query tokens.
  log "bench MLA decode"
  (cd "$out" && PYTHONUNBUFFERED=1 FLASHHOPPER_LIBRARY="$BUILD/libflashhopper.so" PYTHONPATH="$src/python:${PYTHONPATH:-}" \
    timeout 300 python3 -m flashhopper.bench --decode --batches 32 --cache-lens 16384 --prefill-lens --packed-cache-lens \
    --mla-cache-lens 4096 16384 65536 --mla-batches 32 128 --mla-dvs 256 512 --out "$out/mla" > "$out/bench_mla.txt" 2>&1)
  log "bench MLA decode rc=$?"
  PYTHONUNBUFFERED=1 FLASHHOPPER_LIBRARY="$BUILD/libflashhopper.so" PYTHONPATH="$src/python:${PYTHONPATH:-}" \
    timeout 300 python3 "$src/bench/profile/split_sweep.py" --mla --batches 32 128 --cache-lens 4096 16384 \
    --seqlens-q 1 4 > "$out/split_sweep_mla.txt" 2>&1
  PYTHONUNBUFFERED=1 FLASHHOPPER_LIBRARY="$BUILD/libflashhopper.so" PYTHONPATH="$src/python:${PYTHONPATH:-}" \
    timeout 300 python3 "$src/bench/profile/split_sweep.py" --mla --mla-dv 512 --batches 32 128 \
    --cache-lens 4096 16384 --seqlens-q 1 4 > "$out/split_sweep_mla512.txt" 2>&1
  log "split sweep rc=$?: $(tail -1 "$out/split_sweep_mla.txt")"
  # GQA 32/8 hdim 128 decode at small batches, where the split count matters most.
  PYTHONUNBUFFERED=1 FLASHHOPPER_LIBRARY="$BUILD/libflashhopper.so" PYTHONPATH="$src/python:${PYTHONPATH:-}" \
    timeout 200 python3 "$src/bench/profile/split_sweep.py" --batches 1 2 4 --cache-lens 1024 4096 16384 \
    > "$out/split_sweep_gqa.txt" 2>&1
  log "split sweep gqa rc=$?: $(tail -1 "$out/split_sweep_gqa.txt")"
fi
if [ -n "${PROFILE_THROUGHPUT:-}" ]; then
  # Which unit bounds each named call's kernel (ncu; ';'-separated "pass seqlen hdim causal"), on
  # this build before any A/B relinks it.
  log "profile throughput: $PROFILE_THROUGHPUT"
  IFS=';' read -ra profile_calls <<< "$PROFILE_THROUGHPUT"
  FLASHHOPPER_LIBRARY="$BUILD/libflashhopper.so" OUT="$out/throughput" \
    bash "$src/bench/profile/profile_throughput.sh" "${profile_calls[@]}" > "$out/throughput.txt" 2>&1
  log "profile throughput rc=$?"
fi
if [ -n "${AB_FILE:-}" ]; then
  # A one-line A/B on this build (bench/ab_source_line.sh with the AB_* variables), last: it
  # relinks the library with side b.
  log "ab line: $AB_FILE: $AB_TO"
  JOB_DIR="$job" bash "$src/bench/ab_source_line.sh" > "$out/ab_line.txt" 2>&1
  log "ab line rc=$?: $(grep -c . "$out/ab_line/progress.log" 2>/dev/null) progress lines"
fi
if [ -n "${AB_QUEUE:-}" ]; then
  # Several one-line A/Bs on this build, one after another: AB_QUEUE is a bash file (relative to
  # the repository root, or absolute) of `ab_run NAME VAR=VALUE ...` lines (the AB_* variables of
  # bench/ab_source_line.sh; backslashes continue a line). Each writes $out/ab_line_NAME/ and
  # relinks the base library when done (AB_RESTORE=1), so the next starts from it.
  ab_run() {
    local name=$1
    shift
    log "ab queue: $name"
    (export AB_NAME="$name" AB_RESTORE=1 JOB_DIR="$job" "$@"; bash "$src/bench/ab_source_line.sh") \
      > "$out/ab_line_$name.txt" 2>&1
    log "ab queue $name rc=$?: $(tail -1 "$out/ab_line_$name/progress.log" 2>/dev/null)"
  }
  queue="$AB_QUEUE"
  [ "${queue#/}" = "$queue" ] && queue="$src/$queue"
  # shellcheck disable=SC1090
  source "$queue" || log "ab queue: cannot read $AB_QUEUE"
fi
if [ -n "${AB_VARIANTS:-}" ]; then
  # A/Bs of variants prebuilt on the CPU machine (scripts/prebuild_variant.sh: the carried
  # build-kit/variant_NAME.tar.xz), which compile nothing here: AB_VARIANTS is the queue file they
  # were built from (`variant NAME FILE 'FROM' 'TO' 'STEM...' 'BINARY:FILTER ...' GATE_ARGUMENTS...`
  # lines; prebuild_variant.sh --queue; `--bench ARGUMENTS...` for python -m flashhopper.bench's
  # instead of the gate's rows, e.g. --bench --fp8 ...). Each carried one runs its tests on the
  # variant (the test binaries load the library from LD_LIBRARY_PATH), then the gate's rows it
  # names on the base and the variant in turn, twice (bench/ab_compare.sh AB_GATE=1 AB_PASSES=2),
  # into $out/ab_NAME/. A variant of another commit than the base's is refused.
  variant() {
    local name=$1 tests=$6 spec folder="$job/build-variant-$1" packed
    shift 6
    # The repository root's copy first: a later call may have carried it while the job ran.
    packed="$root/build-kit/variant_$name.tar.xz"
    [ -f "$packed" ] || packed="$src/build-kit/variant_$name.tar.xz"
    [ -f "$packed" ] || { log "ab variant $name: not carried"; return; }
    log "ab variant: $name"
    mkdir -p "$out/ab_$name"
    tar xJf "$packed" -C "$job" || { log "ab variant $name: cannot unpack"; return; }
    if [ "$(head -1 "$folder/VARIANT")" != "$(cat "$BUILD/COMMIT" 2>/dev/null)" ]; then
      log "ab variant $name: built from $(head -1 "$folder/VARIANT"), the base from $(cat "$BUILD/COMMIT" 2>/dev/null)"
      return
    fi
    set -f
    for spec in $tests; do
      LD_LIBRARY_PATH="$folder:$BUILD" timeout 300 "$BUILD/tests/cpp/${spec%%:*}" --gtest_brief=1 \
        --gtest_filter="${spec#*:}" >> "$out/ab_$name/tests.log" 2>&1
      log "ab variant $name tests ${spec%%:*} rc=$?: $(grep -E '^\[  (PASSED|FAILED)  \]' "$out/ab_$name/tests.log" |
        tail -2 | tr '\n' ' ')"
    done
    set +f
    local gate=1
    [ "${1:-}" = --bench ] && { gate=0; shift; }  # the package's benchmark instead of the gate's rows
    (cd "$src" && OUT="$out/ab_$name" AB_GATE=$gate AB_SCRIPT='-m flashhopper.bench' \
      AB_PASSES="${AB_VARIANT_PASSES:-2}" bash bench/ab_compare.sh \
      "$BUILD/libflashhopper.so" "$folder/libflashhopper.so.0" "$@") > "$out/ab_$name.txt" 2>&1
    log "ab variant $name rc=$?: $(tail -1 "$out/ab_$name.txt")"
  }
  variants="$AB_VARIANTS"
  [ "${variants#/}" = "$variants" ] && variants="$src/$variants"
  # shellcheck disable=SC1090
  source "$variants" || log "ab variants: cannot read $AB_VARIANTS"
fi
log "ALL DONE"
