# shellcheck shell=bash
# One-line variants of the bench set that wait for a GPU, built here on the CPU machine against the
# prebuilt set (scripts/prebuild_variant.sh --queue bench/ab_variants_pending.sh [NAME...]: each a
# build-kit/variant_NAME.tar.xz) and run on the GPU machine without compiling there
# (scripts/device_job.sh AB_VARIANTS=bench/ab_variants_pending.sh: the tests named, then the gate's
# rows named, base and variant in turn twice). In the order to run them, the forward's first (issue
# 52). bench/RESULTS.md says why each (the section named beside it); remove an entry once it has
# run, and its diff from bench/variants/ where it has one.
#   variant NAME FILE 'FROM' 'TO' 'STEM...' 'BINARY:FILTER ...' GATE_ARGUMENTS...

# FlashAttention-4's forward schedule choices: a CTA a tile instead of a persistent grid (dense
# kernels), K/V multicast to CTA pairs at head dims 128 and 256, no ping-pong at 256.
variant grid src/launch/forward_launch.cuh \
  'forward_kernel_entry<Kernel>, Scheduler::grid_size(params.scheduler, num_sms),' \
  'forward_kernel_entry<Kernel>, params.scheduler.num_tiles,' \
  'fwd_bf16_hdim64 fwd_bf16_hdim128 fwd_bf16_hdim256' 'test_forward_gpu:Grid/*bf16_d128_*' \
  --passes fwd --rows 'dense hdim'
variant cluster128 src/hopper/common/tile_size.hpp \
  'kClusterM = 1;  // 128 forward' 'kClusterM = 2;  // 128 forward' \
  fwd_bf16_hdim128 'test_forward_gpu:Grid/*bf16_d128_*' --passes fwd --rows 'dense hdim 128'
variant pingpong256 src/hopper/collective/mainloop_fwd.hpp \
  'kPingPong = kNumMmaWarpGroups > 1 && !kSplitsO;' \
  'kPingPong = kNumMmaWarpGroups > 1 && !kSplitsO && kHeadDim <= 128;' \
  fwd_bf16_hdim256 'test_forward_gpu:*bf16_d256*' --passes fwd --rows 'hdim 256'
variant cluster256 src/hopper/common/tile_size.hpp \
  'kClusterM = 1;  // 256 forward' 'kClusterM = 2;  // 256 forward' \
  fwd_bf16_hdim256 'test_forward_gpu:Grid/*bf16_d256_*' --passes fwd --rows 'dense hdim 256'

# "The causal walk in two loops": head dim 64's causal in two loops (b) and windows in three (c);
# head dim 256's windows and softcap with Q's descriptors built per use (e).
variant loops64_causal src/hopper/collective/mainloop_fwd.hpp \
  'kFeatures != ForwardFeatures::kNone || kRowWarpGroups > 2) {' \
  'kFeatures != ForwardFeatures::kNone || (kRowWarpGroups > 2 && kMask != MaskKind::kCausal)) {' \
  fwd_bf16_hdim64 'test_forward_gpu:*bf16_d64*' --passes fwd --rows 'hdim 64'
variant loops64_local src/hopper/collective/mainloop_fwd.hpp \
  'kFeatures != ForwardFeatures::kNone || kRowWarpGroups > 2) {' \
  'kFeatures != ForwardFeatures::kNone || (kRowWarpGroups > 2 && kMask != MaskKind::kLocal)) {' \
  fwd_bf16_hdim64 'test_forward_gpu:*bf16_d64*' --passes fwd --rows 'hdim 64'
variant qdesc256 src/hopper/collective/mainloop_fwd.hpp \
  '(kFeatures != ForwardFeatures::kNone || kHeadDim > 256 ||' \
  '(kFeatures != ForwardFeatures::kNone || kHeadDim > 256 || kMask_ == MaskKind::kLocal || kSoftcap_ ||' \
  fwd_bf16_hdim256 'test_forward_gpu:*bf16_d256*' --passes fwd --rows 'hdim 256'

# fp8's tiles (issue 19; bench/RESULTS.md, "fp8's key blocks and exponents" and "fp8's V transpose
# by ldmatrix"): unmasked key blocks of 192/224 at head dim 128 and 96/128 at 256 with 240
# consumer registers (first 192/96 at 232: with the 240 split the producer's 24 registers spill,
# 48-72 local operations, read off the build), the 240-register split alone, every fourth
# exponent on the FMA pipe (on the 192/96 tile at 232), and head dim 64 in three warpgroups of 64
# rows. Diffs in bench/variants/ (the rewrites bench/ab_fp8_tiles.sh made on a device build before
# this queue took them over), built against the dense and general fp8 files and forward_dispatch,
# which reads the tile's extents.
fp8_stems='fwd_fp8_hdim64 fwd_fp8_hdim128 fwd_fp8_hdim256 fwd_fp8_hdim64_general fwd_fp8_hdim128_general
  fwd_fp8_hdim256_general launch/forward_dispatch'
fp8_tests='test_forward_gpu:*fp8*'
fp8_bench=(--bench --fp8 --hdims 64 128 256 --seqlens 4096 16384 --causal 0)
for fp8_variant in fp8_192_96_r232 fp8_192_96 fp8_224_96 fp8_192_128 fp8_r240 fp8_192_96_fma4 fp8_m192; do
  variant "$fp8_variant" "bench/variants/$fp8_variant.diff" - - "$fp8_stems" "$fp8_tests" "${fp8_bench[@]}"
done

# "The hdim-128 backward's windows without loop spills": the row values back in registers (windows
# still transposed), and windows untransposed altogether (softcap windows as before).
variant bwd_windows_registers src/hopper/collective/mainloop_bwd.hpp \
  'kRowValuesInSmem = kSdPTransposed && (kBlockM >= 128 || kMask_ == MaskKind::kLocal);' \
  'kRowValuesInSmem = kSdPTransposed && kBlockM >= 128;' \
  'bwd_bf16_hdim128 bwd_bf16_hdim128_packed' 'test_backward_gpu:*d128*' \
  --passes bwd --rows window softcap 'dense hdim 128 causal 16384'
variant bwd_windows_untransposed src/hopper/collective/mainloop_bwd.hpp \
  'kSdPTransposed = kSdPTransposed_;' 'kSdPTransposed = kSdPTransposed_ && kMask_ != MaskKind::kLocal;' \
  'bwd_bf16_hdim128 bwd_bf16_hdim128_packed' 'test_backward_gpu:*d128*' \
  --passes bwd --rows window softcap 'dense hdim 128 causal 16384'

# Head dim 64's backward transposed with its 128-row blocks: the package's benchmark, whose
# backward rows carry the deterministic column (64-row transposed blocks had lost 11-20% there),
# which the gate has no row for.
variant bwd64_transposed src/hopper/common/tile_size.hpp \
  'struct BackwardTileSize<64> {' 'struct BackwardTileSize<64> { static constexpr bool kSdPTransposed = true;' \
  bwd_bf16_hdim64 'test_backward_gpu:*d64*' --bench --passes bwd --hdims 64 --seqlens 4096 8192 16384
