# shellcheck shell=bash
# The one-line A/Bs built and resource-checked on the CPU that wait for a GPU, in the order to run
# them (the forward's first: issue 52), as scripts/device_job.sh's AB_QUEUE (sourced there:
# `ab_run NAME VAR=VALUE ...` runs bench/ab_source_line.sh on the job's bench-set build and
# relinks the base library after it):
#   KERNELS=bench STEPS="..." AB_QUEUE=bench/ab_queue_pending.sh scripts/device_job.sh
# Each entry's reasoning and its build-time figures are in bench/RESULTS.md (the section named
# beside it). Remove an entry once its A/B has run (its result goes to RESULTS).

# "The causal walk in two loops" (forward): head dim 64's loop form (b: causal in two loops,
# c: windows in three, d: both) and head dim 256's windows and softcap with Q's descriptors built
# per use (e); windows, chunks, softcap and sinks beside the causal or full call.
ab_run fwd_loops AB_FILE=src/hopper/collective/mainloop_fwd.hpp AB_UNITS=fwd_bf16_hdim64 \
  AB_FROM='kFeatures != ForwardFeatures::kNone || kRowWarpGroups > 2) {' \
  AB_TO='kFeatures != ForwardFeatures::kNone || (kRowWarpGroups > 2 && kMask != MaskKind::kCausal)) {' \
  AB_FROM_2='kFeatures != ForwardFeatures::kNone || kRowWarpGroups > 2) {' \
  AB_TO_2='kFeatures != ForwardFeatures::kNone || (kRowWarpGroups > 2 && kMask != MaskKind::kLocal)) {' \
  AB_FROM_3='kFeatures != ForwardFeatures::kNone || kRowWarpGroups > 2) {' \
  AB_TO_3='kFeatures != ForwardFeatures::kNone) {' \
  AB_FROM_4='(kFeatures != ForwardFeatures::kNone || kHeadDim > 256 ||' \
  AB_TO_4='(kFeatures != ForwardFeatures::kNone || kHeadDim > 256 || kMask_ == MaskKind::kLocal || kSoftcap_ ||' \
  AB_UNITS_4=fwd_bf16_hdim256 AB_TESTS='test_forward_gpu:*bf16_d64*:*bf16_d256*' \
  AB_BENCH_SCRIPT=bench/bench_features.py AB_BENCH='--rows grid --hdims 64 256 --tokens 16384 --passes fwd'

# FlashAttention-4's forward schedule choices on ours (bench/RESULTS.md, "What FlashAttention-4's
# Hopper path chooses"): K/V multicast to CTA pairs at head dims 128 (b) and 256 (c); no ping-pong
# at head dim 256; a CTA a tile instead of a persistent grid (the dense kernels only: the general
# ones are other instantiations, not rebuilt).
ab_run fwd_clusters AB_FILE=src/hopper/common/tile_size.hpp AB_UNITS=fwd_bf16_hdim128 \
  AB_FROM='kClusterM = 1;  // 128 forward' AB_TO='kClusterM = 2;  // 128 forward' \
  AB_FROM_2='kClusterM = 1;  // 256 forward' AB_TO_2='kClusterM = 2;  // 256 forward' AB_UNITS_2=fwd_bf16_hdim256 \
  AB_TESTS='test_forward_gpu:*bf16_d128*:*bf16_d256*' AB_BENCH='--hdims 128 256 --seqlens 4096 16384'
ab_run fwd_pingpong256 AB_FILE=src/hopper/collective/mainloop_fwd.hpp AB_UNITS=fwd_bf16_hdim256 \
  AB_FROM='kPingPong = kNumMmaWarpGroups > 1 && !kSplitsO;' \
  AB_TO='kPingPong = kNumMmaWarpGroups > 1 && !kSplitsO && kHeadDim <= 128;' \
  AB_TESTS='test_forward_gpu:*bf16_d256*' AB_BENCH='--hdims 256 --seqlens 4096 16384'
ab_run fwd_grid AB_FILE=src/launch/forward_launch.cuh AB_UNITS='fwd_bf16_hdim64 fwd_bf16_hdim128 fwd_bf16_hdim256' \
  AB_FROM='forward_kernel_entry<Kernel>, Scheduler::grid_size(params.scheduler, num_sms),' \
  AB_TO='forward_kernel_entry<Kernel>, params.scheduler.num_tiles,' \
  AB_TESTS='test_forward_gpu:*bf16_d128*' AB_BENCH='--hdims 64 128 256 --seqlens 4096 16384'

# "The hdim-128 backward's windows without loop spills": today's form (a) against the row values
# in registers with softcap windows untransposed (b) and windows untransposed altogether (c).
ab_run bwd_windows AB_FILE=src/hopper/collective/mainloop_bwd.hpp \
  AB_UNITS='bwd_bf16_hdim128 bwd_bf16_hdim128_packed' \
  AB_FROM='kRowValuesInSmem = kSdPTransposed && (kBlockM >= 128 || kMask_ == MaskKind::kLocal);' \
  AB_TO='kRowValuesInSmem = kSdPTransposed && kBlockM >= 128;' \
  AB_ALSO_FROM_1='kSdPTransposed = kSdPTransposed_;' \
  AB_ALSO_TO_1='kSdPTransposed = kSdPTransposed_ && !(kMask_ == MaskKind::kLocal && kSoftcap_);' \
  AB_FROM_2='kSdPTransposed = kSdPTransposed_;' \
  AB_TO_2='kSdPTransposed = kSdPTransposed_ && kMask_ != MaskKind::kLocal;' \
  AB_TESTS='test_backward_gpu:*d128*' AB_BENCH_SCRIPT=bench/bench_features.py \
  AB_BENCH='--rows grid --hdims 128 --tokens 16384 --passes bwd'

# Same section, after it: head dim 64's backward transposed with its 128-row blocks (v64t), with the
# deterministic column.
ab_run bwd_hdim64_transposed AB_FILE=src/hopper/common/tile_size.hpp AB_UNITS=bwd_bf16_hdim64 \
  AB_FROM='struct BackwardTileSize<64> {' \
  AB_TO='struct BackwardTileSize<64> { static constexpr bool kSdPTransposed = true;' \
  AB_TESTS='test_backward_gpu:*d64*' AB_BENCH_SCRIPT='-m flashhopper.bench' \
  AB_BENCH='--passes bwd --hdims 64 --seqlens 4096 8192 16384'
