#!/usr/bin/env bash
# The fp8 forward's key-block A/B on a warm GPU machine (issue 19), after scripts/device_job.sh has
# built the bench set into $JOB_DIR (default /tmp/fhjob): each variant rewrites, in the job's copy
# of the source, the fp8 tile line of src/hopper/common/tile_size.hpp (unmasked key blocks at head
# dims 128 and 256), optionally the producer/consumer register split and the share of exponents
# on the FMA pipe (ForwardTileSizeFp8::kConsumerRegisters in tile_size.hpp, kFmaExpEvery in
# src/hopper/kernel/forward_kernel.hpp), rebuilds only the fp8 hdim-64, 128 and 256 objects and
# forward_dispatch (ninja -t commands: no header-driven rebuild of the rest),
# relinks libflashhopper.so and runs python -m flashhopper.bench --fp8 (unmasked, 4k and 16k) after
# a run of the unchanged build. The job's source is restored at the end. Usage:
#   bench/ab_fp8_tiles.sh VARIANT...     VARIANT = B128:B256:EXT128:EXT256:PRODUCER_REGS:FMA_EVERY[:M64]
# B128/B256: the unmasked key block at head dim 128/256 (masked ones keep 128/64); EXT128/EXT256: 1
# where that N is one of CuTe's extended WGMMA shapes (160, 224), which the instantiation file
# must then include; PRODUCER_REGS: 56 as built, or less (the consumers get the rest of the
# 504-register split); FMA_EVERY: 0 as built, or n (every n-th exponent on the FMA pipe,
# exp2_fma); M64: the query rows of head dim 64's tile, 128 as built or 192 (three consumer
# warpgroups at 160 registers, as bf16's). E.g. 192:96:0:0:56:0 192:96:0:0:56:4 128:64:0:0:56:4
# 128:64:0:0:56:0:192 (bench/RESULTS.md, "fp8's key blocks and exponents", "fp8's V transpose by
# ldmatrix"). Each variant's table: $JOB_DIR/out/ab/bench_n<variant>.txt; progress in
# $JOB_DIR/out/ab/progress.log ("AB DONE" last). A rewrite that does not match its line is logged
# and the variant skipped, never run half-applied.
set -u
job="${JOB_DIR:-/tmp/fhjob}"
src="$job/src" build="$job/build" out="$job/out/ab"
mkdir -p "$out"
log() { echo "$(date +%T) $*" >> "$out/progress.log"; }
tile="$src/src/hopper/common/tile_size.hpp"
kernel="$src/src/hopper/kernel/forward_kernel.hpp"
inst128="$src/src/hopper/instantiations/fwd_fp8_hdim128.cu"
inst256="$src/src/hopper/instantiations/fwd_fp8_hdim256.cu"
edited=("$tile" "$kernel" "$inst128" "$inst256")
for f in "${edited[@]}"; do cp "$f" "$out/$(basename "$f").orig" || exit 1; done
restore() { for f in "${edited[@]}"; do cp "$out/$(basename "$f").orig" "$f"; done; }
objects=(CMakeFiles/flashhopper_kernels.dir/src/hopper/instantiations/fwd_fp8_hdim64.cu.o
         CMakeFiles/flashhopper_kernels.dir/src/hopper/instantiations/fwd_fp8_hdim128.cu.o
         CMakeFiles/flashhopper_kernels.dir/src/hopper/instantiations/fwd_fp8_hdim256.cu.o
         CMakeFiles/flashhopper_kernels.dir/src/launch/forward_dispatch.cu.o)
extended='s|^#include "launch/forward_launch.cuh"|#include "hopper/common/gmma_extended_shapes.hpp"\n&|'

bench() {
  (cd "$src" && PYTHONUNBUFFERED=1 FLASHHOPPER_LIBRARY="$build/libflashhopper.so" PYTHONPATH="$src/python" \
    timeout 300 python3 -m flashhopper.bench --fp8 --hdims 64 128 256 --seqlens 4096 16384 --causal 0 \
    --out "$out/$1" > "$out/bench_$1.txt" 2>&1)
  log "bench $1 rc=$?: $(tail -1 "$out/bench_$1.txt")"
}

# shellcheck source=bench/ab_common.sh
source "$(dirname "$0")/ab_common.sh"  # rewrite, rebuild_library

bench base
for variant in "$@"; do
  IFS=: read -r block128 block256 ext128 ext256 producer fma rows64 <<< "$variant"
  rows64=${rows64:-128}
  restore
  blocks="kHeadDim == 256 ? (kMasked ? 64 : $block256) : kHeadDim == 128 && !kMasked ? $block128 : 128"
  rewrite "$tile" "static constexpr int kBlockN = kHeadDim == 256 ? 64 : 128;" \
    "static constexpr int kBlockN = $blocks;" || continue
  consumer=$(( (504 - producer) / 2 / 8 * 8 ))  # the tile's consumers take the rest of 3 x 168
  if [ "$rows64" = 192 ]; then  # three consumer warpgroups: 160 registers each, the producer 32
    rewrite "$tile" "static constexpr int kBlockM = 128;  // fp8: two consumer warpgroups" \
      "static constexpr int kBlockM = kHeadDim == 64 ? 192 : 128;" &&
      rewrite "$tile" "static constexpr int kConsumerRegisters = 224;" \
        "static constexpr int kConsumerRegisters = kBlockM == 192 ? 160 : $consumer;" || continue
  elif [ "$producer" != 56 ]; then
    rewrite "$tile" "static constexpr int kConsumerRegisters = 224;" \
      "static constexpr int kConsumerRegisters = $consumer;" || continue
  fi
  if [ "$fma" != 0 ]; then
    every="Mainloop::Transform::kFmaExpEvery"
    rewrite "$kernel" "OnlineSoftmax<kRows, $every," \
      "OnlineSoftmax<kRows, (Mainloop::kTransposesV && $every == 0 ? $fma : $every)," || continue
  fi
  [ "$ext128" = 1 ] && sed -i "$extended" "$inst128"
  [ "$ext256" = 1 ] && sed -i "$extended" "$inst256"
  name="${block128}_${block256}_r${producer}_f${fma}_m${rows64}"
  rebuild_library "$name" "${objects[@]}" || continue
  log "built $name"
  bench "n$name"
done
restore
log "AB DONE"
