// Composes the backward for one (dtype, head dim, mask kind, softcap) and enqueues its kernels:
// preprocess (D, LSE2), the main kernel (dK, dV and dQaccum), postprocess (dQ); or, where the
// tile table gives dQ a kernel of its own (kDqKernel): preprocess, the main kernel (dK, dV) and
// the dQ kernel. With a learnable sink's gradient asked for, a last small kernel sums it.
#pragma once

#include <cuda_runtime_api.h>

#include <cute/tensor.hpp>

#include "hopper/collective/epilogue_bwd.hpp"
#include "hopper/collective/mainloop_bwd.hpp"
#include "hopper/collective/mainloop_bwd_dq.hpp"
#include "hopper/common/tile_scheduler.hpp"
#include "hopper/common/tile_size.hpp"
#include "hopper/kernel/backward_dq_kernel.hpp"
#include "hopper/kernel/backward_kernel.hpp"
#include "hopper/kernel/backward_prepost.hpp"
#include "launch/backward_launch.hpp"
#include "launch/backward_workspace.hpp"
#include "launch/element_of.cuh"
#include "launch/launch_common.cuh"

namespace flashhopper::launch {

// The dQ kernel, with the main kernel's arguments (Q, K, V, dO and the preprocess's buffers).
template <class Element, int kHeadDim, hopper::MaskKind kMask, bool kSoftcap, class MainArguments>
cudaError_t run_backward_dq_kernel(const BackwardParams& p, MainArguments const& args, float scale, int num_sms,
                                   int l2_bytes, cudaStream_t stream) {
  using namespace cute;
  using namespace flashhopper::hopper;
  using Tile = BackwardDqTileSize<kHeadDim>;
  using Mainloop = BackwardDqMainloop<Element, Tile::kBlockM, Tile::kBlockN, kHeadDim, Tile::kStagesK, Tile::kStagesV,
                                      kMask, kSoftcap>;
  using Scheduler = StaticPersistentScheduler</*kLongestFirst=*/kMask == MaskKind::kCausal>;
  using Kernel = BackwardDqKernel<Mainloop, Scheduler>;
  static_assert(BackwardWorkspaceLayout::kRowAlign % Tile::kBlockM == 0);

  const int seqlen_q = get<0>(args.shape_q), seqlen_k = get<0>(args.shape_k);
  const int heads_q = get<2>(args.shape_q), heads_kv = get<2>(args.shape_k), batch = get<3>(args.shape_q);
  typename Mainloop::Arguments dq_args{args.ptr_q,
                                       args.shape_q,
                                       args.stride_q,
                                       args.ptr_k,
                                       args.shape_k,
                                       args.stride_k,
                                       args.ptr_v,
                                       args.stride_v,
                                       args.ptr_do,
                                       args.stride_do,
                                       static_cast<Element*>(p.dq.data),
                                       make_stride(p.dq.stride[1], _1{}, p.dq.stride[2], p.dq.stride[0]),
                                       scale,
                                       args.softcap,
                                       args.local,
                                       args.workspace.lse_log2,
                                       args.workspace.dpsum,
                                       args.workspace.rows_padded};
  const int num_m_blocks = (seqlen_q + Tile::kBlockM - 1) / Tile::kBlockM;
  // As the forward: a head's query blocks share its K and V in L2.
  const int64_t streamed_bytes_per_head = int64_t(seqlen_k) * 2 * kHeadDim * sizeof(Element) * heads_kv / heads_q;
  typename Kernel::Params params{
      Mainloop::to_underlying_arguments(dq_args),
      Scheduler::make_params(num_m_blocks, heads_q, batch, streamed_bytes_per_head, l2_bytes, num_sms)};
  return launch_kernel<Kernel>(backward_dq_kernel_entry<Kernel>, Scheduler::grid_size(params.scheduler, num_sms),
                               params, stream);
}

template <fh_dtype kDType, int kHeadDim, hopper::MaskKind kMask, bool kSoftcap>
cudaError_t run_backward_hdim(const BackwardParams& p, const detail::ProblemShape& s, void* workspace,
                              cudaStream_t stream) {
  using namespace cute;
  using namespace flashhopper::hopper;
  using Element = typename ElementOf<kDType>::type;
  using Tile = BackwardTileSize<kHeadDim>;
  constexpr bool kCausal = kMask == MaskKind::kCausal;
  using Mainloop = BackwardMainloop<Element, Tile::kBlockM, Tile::kBlockN, kHeadDim, Tile::kStages, Tile::kStagesDo,
                                    kMask, kSoftcap, /*kComputeDq=*/!Tile::kDqKernel>;
  using Epilogue = BackwardEpilogue<Element, Mainloop>;
  // Causal: longest first (the backward reverses its key blocks). Otherwise key blocks in
  // order, which the deterministic dQ order relies on.
  using Scheduler = StaticPersistentScheduler</*kLongestFirst=*/kCausal>;
  using Kernel = BackwardKernel<Mainloop, Epilogue, Scheduler>;
  using Preprocess = BackwardPreprocess<Element, kHeadDim>;
  using Postprocess = BackwardPostprocess<Mainloop>;
  static_assert(BackwardWorkspaceLayout::kRowAlign % Tile::kBlockM == 0);
  static_assert(Tile::kBlockM % BackwardWorkspaceLayout::kSemaphoreRows == 0);

  const int batch = int(s.batch), seqlen_q = int(s.seqlen_q), seqlen_k = int(s.seqlen_k);
  const int heads_q = int(s.heads_q), heads_kv = int(s.heads_kv);
  const float scale = float(detail::default_scale(p.softmax_scale, kHeadDim));
  const bool dsink = detail::present(p.learnable_sink) && detail::present(p.dsink);
  const BackwardWorkspaceLayout layout = backward_workspace_layout(s, dsink);
  char* ws = static_cast<char*>(workspace);
  const BackwardWorkspacePointers pointers{reinterpret_cast<float*>(ws + layout.lse_log2),
                                           reinterpret_cast<float*>(ws + layout.dpsum),
                                           reinterpret_cast<float*>(ws + layout.dq_accum),
                                           reinterpret_cast<int*>(ws + layout.dq_semaphore), int(layout.rows_padded)};
  // Tensors are [batch, seqlen, heads, d]; CuTe sees (seqlen, d, heads, batch).
  auto stride_of = [](const Tensor& t) { return make_stride(t.stride[1], _1{}, t.stride[2], t.stride[0]); };

  int num_sms = 0, l2_bytes = 0;
  cudaError_t err = device_sms_and_l2(&num_sms, &l2_bytes);
  if (err != cudaSuccess) return err;

  // dQaccum and the semaphores start at zero; the preprocess fills the rest.
  if constexpr (!Tile::kDqKernel) {
    err = cudaMemsetAsync(ws + layout.dq_accum, 0, layout.dsink_partial - layout.dq_accum, stream);
    if (err != cudaSuccess) return err;
  }

  typename Preprocess::Params pre{static_cast<Element const*>(p.out.data),
                                  {p.out.stride[0], p.out.stride[1], p.out.stride[2]},
                                  static_cast<Element const*>(p.dout.data),
                                  {p.dout.stride[0], p.dout.stride[1], p.dout.stride[2]},
                                  static_cast<float const*>(p.lse.data),
                                  {p.lse.stride[0], p.lse.stride[1], p.lse.stride[2]},
                                  seqlen_q,
                                  heads_q,
                                  pointers,
                                  dsink ? static_cast<float const*>(p.learnable_sink.data) : nullptr,
                                  reinterpret_cast<float*>(ws + layout.dsink_partial)};
  static_assert(Preprocess::kRowsPerCta == kSinkRowsPerShare);
  const int64_t pre_ctas = layout.rows_padded / Preprocess::kRowsPerCta * heads_q * batch;
  backward_prepost_entry<Preprocess><<<unsigned(pre_ctas), Preprocess::kThreads, 0, stream>>>(pre);
  if ((err = cudaGetLastError()) != cudaSuccess) return err;

  typename Mainloop::Arguments mainloop_args{static_cast<Element const*>(p.q.data),
                                             make_shape(seqlen_q, kHeadDim, heads_q, batch),
                                             stride_of(p.q),
                                             static_cast<Element const*>(p.k.data),
                                             make_shape(seqlen_k, kHeadDim, heads_kv, batch),
                                             stride_of(p.k),
                                             static_cast<Element const*>(p.v.data),
                                             stride_of(p.v),
                                             static_cast<Element const*>(p.dout.data),
                                             stride_of(p.dout),
                                             scale,
                                             p.softcap,
                                             local_mask_params(p),
                                             pointers,
                                             p.deterministic != 0};
  typename Epilogue::Arguments epilogue_args{static_cast<Element*>(p.dk.data), stride_of(p.dk),
                                             static_cast<Element*>(p.dv.data), stride_of(p.dv),
                                             make_shape(seqlen_k, kHeadDim, heads_kv, batch), scale};
  const int num_n_blocks = (seqlen_k + Tile::kBlockN - 1) / Tile::kBlockN;
  // One longest-first order over all heads balances best: the scheduler's L2 sections end
  // unevenly (hdim 128, causal, 16k: 0.68 of cuDNN with 5-head sections, 0.75 with one order).
  // It also keeps L2 use small while every head gets four or more CTAs of a wave, since the CTAs
  // of a head walk its Q and dO in step. With more heads than that, the CTAs stream too many
  // heads from DRAM (hdim 128, 2k: 305 -> 258 TFLOP/s with one CTA a head; hdim 256, 2k: 211 ->
  // 275 with two), so L2-sized sections keep a head's CTAs together.
  const bool one_order = int64_t(heads_kv) * batch * 4 <= num_sms;
  const int64_t streamed_bytes_per_head = int64_t(seqlen_q) * (heads_q / heads_kv) * 2 * kHeadDim * sizeof(Element);
  typename Kernel::Params params{Mainloop::to_underlying_arguments(mainloop_args),
                                 Epilogue::to_underlying_arguments(epilogue_args),
                                 Scheduler::make_params(num_n_blocks, heads_kv, batch,
                                                        one_order ? 0 : streamed_bytes_per_head, l2_bytes, num_sms)};
  // Deterministic, non-causal: a head's key blocks are consecutive tiles that start together and
  // add to each dQ tile in key-block order, so key block n runs n hand-offs behind key block 0.
  // When the grid is a multiple of the key blocks, each CTA keeps its key block index from wave
  // to wave and that lag is paid once; otherwise the wave boundary moves through the heads and
  // every wave pays it again (2k-4k: 0.80 of the default mode). Worth at most 10% of the SMs.
  int grid = Scheduler::grid_size(params.scheduler, num_sms);
  if (!Tile::kDqKernel && p.deterministic != 0 && !kCausal && num_n_blocks < grid) {
    const int whole_heads = grid / num_n_blocks * num_n_blocks;
    if (whole_heads * 10 >= grid * 9) grid = whole_heads;
  }
  if ((err = launch_kernel<Kernel>(backward_kernel_entry<Kernel>, grid, params, stream)) != cudaSuccess) return err;

  if constexpr (Tile::kDqKernel) {
    err = run_backward_dq_kernel<Element, kHeadDim, kMask, kSoftcap>(p, mainloop_args, scale, num_sms, l2_bytes,
                                                                     stream);
  } else {
    typename Postprocess::Params post{static_cast<Element*>(p.dq.data), make_shape(seqlen_q, kHeadDim, heads_q, batch),
                                      stride_of(p.dq), scale, pointers};
    const int64_t post_ctas = int64_t((seqlen_q + Tile::kBlockM - 1) / Tile::kBlockM) * heads_q * batch;
    backward_prepost_entry<Postprocess><<<unsigned(post_ctas), Postprocess::kThreads, 0, stream>>>(post);
    err = cudaGetLastError();
  }
  if (err != cudaSuccess || !dsink) return err;
  typename SinkGradientReduce::Params reduce{reinterpret_cast<float const*>(ws + layout.dsink_partial),
                                             layout.dsink_partials_per_head, static_cast<float*>(p.dsink.data),
                                             p.dsink.stride[0]};
  backward_prepost_entry<SinkGradientReduce><<<heads_q, SinkGradientReduce::kThreads, 0, stream>>>(reduce);
  return cudaGetLastError();
}

}  // namespace flashhopper::launch
