// Composes the backward for one (dtype, head dim, value head dim, mask kind, softcap) and
// enqueues its kernels:
// preprocess (D, LSE2), the main kernel (dK, dV and dQaccum), postprocess (dQ); or, where the
// tile table gives dQ a kernel of its own (kDqKernel): preprocess, the main kernel (dK, dV) and
// the dQ kernel. With a learnable sink's gradient asked for, a last small kernel sums it. A call
// whose head dim is below the compiled one passes its own in the tensor shapes, as the forward.
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
#include "launch/varlen_plan.hpp"

namespace flashhopper::launch {

template <class Element, int kHeadDim, int kHeadDimV, hopper::MaskKind kMask, bool kSoftcap, bool kPacked,
          class Tile = hopper::BackwardDqTileSize<kHeadDim>>
using BackwardDqMainloopOf =
    hopper::BackwardDqMainloop<Element, Tile::kBlockM, Tile::kBlockN, kHeadDim, kHeadDimV, Tile::kStagesK,
                               Tile::kStagesV, kMask, kSoftcap, kPacked, hopper::kSdPByOperand<Tile>>;

// The dQ kernel, with the main kernel's arguments (Q, K, V, dO and the preprocess's buffers).
template <class Element, int kHeadDim, int kHeadDimV, hopper::MaskKind kMask, bool kSoftcap, bool kPacked,
          class MainArguments>
cudaError_t run_backward_dq_kernel(const BackwardParams& p, const detail::ProblemShape& s, MainArguments const& args,
                                   const TensorRows& dq_rows, char* ws, const BackwardWorkspaceLayout& layout,
                                   float scale, int num_sms, int l2_bytes, cudaStream_t stream) {
  using namespace cute;
  using namespace flashhopper::hopper;
  using Tile = BackwardDqTileSize<kHeadDim>;
  using Mainloop = BackwardDqMainloopOf<Element, kHeadDim, kHeadDimV, kMask, kSoftcap, kPacked>;
  using Scheduler = PersistentTileScheduler</*kLongestFirst=*/kMask == MaskKind::kCausal, kPacked, /*kSplit=*/false>;
  using Kernel = BackwardDqKernel<Mainloop, Scheduler>;
  static_assert(BackwardWorkspaceLayout::kRowAlign % Tile::kBlockM == 0);

  const int heads_q = int(s.heads_q), heads_kv = int(s.heads_kv), batch = int(s.batch);
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
                                       args.head_dim_v,
                                       static_cast<Element*>(p.dq.data),
                                       make_stride(dq_rows.row_stride, _1{}, dq_rows.head_stride, dq_rows.batch_stride),
                                       scale,
                                       args.softcap,
                                       args.local,
                                       args.workspace,
                                       args.seqlen};
  // As the forward: a head's query blocks share its K and V in L2.
  const int64_t kv_bytes_per_row = (s.head_dim + s.head_dim_v) * int64_t(sizeof(Element)) * heads_kv / heads_q;
  typename Scheduler::Params scheduler;
  if (s.varlen_q) {
    auto* tiles = reinterpret_cast<hopper::PlannedTile*>(ws + layout.dq_tiles);
    auto* counters = reinterpret_cast<int*>(tiles + layout.max_dq_tiles);
    hopper::VarlenTilePlanner::Params plan{args.seqlen, batch, heads_q, Tile::kBlockM, /*key_blocks=*/false,
                                           /*highest_first=*/kMask == MaskKind::kCausal,
                                           planner_section_tiles(num_sms, l2_bytes, Tile::kBlockM, kv_bytes_per_row),
                                           int(layout.max_dq_tiles), tiles, counters};
    cudaError_t err = plan_varlen_tiles(plan, stream);
    if (err != cudaSuccess) return err;
    scheduler = Scheduler::planned_params(tiles, counters, int(layout.max_dq_tiles));
  } else {
    const int num_m_blocks = (args.seqlen.seqlen_q + Tile::kBlockM - 1) / Tile::kBlockM;
    scheduler = Scheduler::make_params(num_m_blocks, heads_q, batch, args.seqlen.seqlen_k * kv_bytes_per_row, l2_bytes,
                                       num_sms);
  }
  typename Kernel::Params params{Mainloop::to_underlying_arguments(dq_args), scheduler};
  return launch_kernel<Kernel>(backward_dq_kernel_entry<Kernel>, Scheduler::grid_size(params.scheduler, num_sms),
                               params, stream);
}

// The backward's main kernel of one (dtype, head dim, value head dim, mask kind, softcap, packed or
// not): its tile, collectives and scheduler, and whether it or its dQ kernel reads CuTe's extended
// shapes.
template <fh_dtype kDType, int kHeadDim, int kHeadDimV, hopper::MaskKind kMask, bool kSoftcap, bool kPacked>
struct BackwardKernelOf {
  using Element = typename ElementOf<kDType>::type;
  using Tile = hopper::BackwardTileSize<kHeadDim>;
  using Mainloop =
      hopper::BackwardMainloop<Element, Tile::kBlockM, Tile::kBlockN, kHeadDim, kHeadDimV, Tile::kStages,
                               Tile::kStagesDo, kMask, kSoftcap, /*kComputeDq=*/!Tile::kDqKernel, kPacked,
                               hopper::kSdPByOperand<Tile>, hopper::kSdPTransposed<Tile>>;
  using Epilogue = hopper::BackwardEpilogue<Element, Mainloop>;
  // Causal: longest first (the backward reverses its key blocks). Otherwise key blocks in
  // order, which the deterministic dQ order relies on.
  using Scheduler =
      hopper::PersistentTileScheduler</*kLongestFirst=*/kMask == hopper::MaskKind::kCausal, kPacked, /*kSplit=*/false>;
  using Kernel = hopper::BackwardKernel<Mainloop, Epilogue, Scheduler>;
  static constexpr bool kUsesExtendedGmma = [] {
    if constexpr (Tile::kDqKernel)
      return Mainloop::kUsesExtendedGmma ||
             BackwardDqMainloopOf<Element, kHeadDim, kHeadDimV, kMask, kSoftcap, kPacked>::kUsesExtendedGmma;
    else
      return Mainloop::kUsesExtendedGmma;
  }();
};

template <fh_dtype kDType, int kHeadDim, int kHeadDimV, hopper::MaskKind kMask, bool kSoftcap, bool kPacked>
cudaError_t run_backward_hdim(const BackwardParams& p, const detail::ProblemShape& s, void* workspace,
                              cudaStream_t stream) {
  using namespace cute;
  using namespace flashhopper::hopper;
  using Of = BackwardKernelOf<kDType, kHeadDim, kHeadDimV, kMask, kSoftcap, kPacked>;
  using Element = typename Of::Element;
  using Tile = typename Of::Tile;
  constexpr bool kCausal = kMask == MaskKind::kCausal;
  using Mainloop = typename Of::Mainloop;
  using Epilogue = typename Of::Epilogue;
  using Scheduler = typename Of::Scheduler;
  using Kernel = typename Of::Kernel;
  static_assert(!Of::kUsesExtendedGmma || FLASHHOPPER_EXTENDED_GMMA_SHAPES, FLASHHOPPER_GMMA_SET_MESSAGE);
  // A kernel without packed batches would read a packed one as dense; the dispatch never asks.
  if (!kPacked && detail::uses_packed_batches(p, s)) return cudaErrorInvalidValue;
  using Preprocess = BackwardPreprocess<Element, kHeadDimV>;
  using Postprocess = BackwardPostprocess<Mainloop>;
  static_assert(BackwardWorkspaceLayout::kRowAlign % Tile::kBlockM == 0);
  static_assert(Tile::kBlockM % BackwardWorkspaceLayout::kSemaphoreRows == 0);

  const int batch = int(s.batch), heads_q = int(s.heads_q), heads_kv = int(s.heads_kv);
  const int d = int(s.head_dim), dv = int(s.head_dim_v);
  const hopper::SeqlenParams seqlen = seqlen_params(p, s);
  const float scale = float(detail::default_scale(p.softmax_scale, s.head_dim));
  const bool dsink = detail::present(p.learnable_sink) && detail::present(p.dsink);
  const BackwardWorkspaceLayout layout = backward_workspace_layout<kHeadDim>(s, dsink);
  char* ws = static_cast<char*>(workspace);
  const BackwardWorkspacePointers pointers{reinterpret_cast<float*>(ws + layout.lse_log2),
                                           reinterpret_cast<float*>(ws + layout.dpsum),
                                           reinterpret_cast<float*>(ws + layout.dq_accum),
                                           reinterpret_cast<int*>(ws + layout.dq_semaphore),
                                           int(layout.rows_padded),
                                           s.varlen_q,
                                           heads_q};
  // Tensors are [batch, seqlen, heads, d] or packed [total, heads, d]; CuTe sees (rows, d, heads, batch).
  auto q_rows = [&](const Tensor& t) { return tensor_rows(t, s.varlen_q, seqlen.total_q, batch); };
  auto k_rows = [&](const Tensor& t) { return tensor_rows(t, s.varlen_k, seqlen.total_k, batch); };
  auto stride_of = [](const TensorRows& r) { return make_stride(r.row_stride, _1{}, r.head_stride, r.batch_stride); };
  const TensorRows qr = q_rows(p.q), kr = k_rows(p.k);

  int num_sms = 0, l2_bytes = 0;
  cudaError_t err = usable_sms_and_l2(p.sm_margin, &num_sms, &l2_bytes);
  if (err != cudaSuccess) return err;

  // dQaccum and the semaphores start at zero; the preprocess fills the rest.
  if constexpr (!Tile::kDqKernel) {
    err = cudaMemsetAsync(ws + layout.dq_accum, 0, layout.dsink_partial - layout.dq_accum, stream);
    if (err != cudaSuccess) return err;
  }

  const TensorRows out_r = q_rows(p.out), dout_r = q_rows(p.dout);
  // lse: [batch, heads, seqlen], or packed [heads, total]
  const int64_t lse_strides[3] = {s.varlen_q ? 0 : p.lse.stride[0], p.lse.stride[s.varlen_q ? 0 : 1],
                                  p.lse.stride[s.varlen_q ? 1 : 2]};
  typename Preprocess::Params pre{static_cast<Element const*>(p.out.data),
                                  {out_r.batch_stride, out_r.row_stride, out_r.head_stride},
                                  static_cast<Element const*>(p.dout.data),
                                  {dout_r.batch_stride, dout_r.row_stride, dout_r.head_stride},
                                  static_cast<float const*>(p.lse.data),
                                  {lse_strides[0], lse_strides[1], lse_strides[2]},
                                  int(layout.rows_per_sequence),
                                  heads_q,
                                  dv,
                                  pointers,
                                  seqlen,
                                  dsink ? static_cast<float const*>(p.learnable_sink.data) : nullptr,
                                  reinterpret_cast<float*>(ws + layout.dsink_partial)};
  static_assert(Preprocess::kRowsPerCta == kSinkRowsPerShare);
  const int64_t pre_ctas = layout.rows_per_sequence / Preprocess::kRowsPerCta * heads_q * batch;
  backward_prepost_entry<Preprocess><<<unsigned(pre_ctas), Preprocess::kThreads, 0, stream>>>(pre);
  if ((err = cudaGetLastError()) != cudaSuccess) return err;

  typename Mainloop::Arguments mainloop_args{static_cast<Element const*>(p.q.data),
                                             make_shape(qr.rows, d, heads_q, qr.batch),
                                             stride_of(qr),
                                             static_cast<Element const*>(p.k.data),
                                             make_shape(kr.rows, d, heads_kv, kr.batch),
                                             stride_of(kr),
                                             static_cast<Element const*>(p.v.data),
                                             stride_of(k_rows(p.v)),
                                             static_cast<Element const*>(p.dout.data),
                                             stride_of(dout_r),
                                             dv,
                                             scale,
                                             p.softcap,
                                             local_mask_params(p),
                                             pointers,
                                             p.deterministic != 0,
                                             seqlen};
  typename Epilogue::Arguments epilogue_args{static_cast<Element*>(p.dk.data), stride_of(k_rows(p.dk)),
                                             static_cast<Element*>(p.dv.data), stride_of(k_rows(p.dv)),
                                             make_shape(kr.rows, d, heads_kv, kr.batch), dv, scale};
  const int num_n_blocks = (seqlen.seqlen_k + Tile::kBlockN - 1) / Tile::kBlockN;
  // One longest-first order over all heads balances best: the scheduler's L2 sections end
  // unevenly (hdim 128, causal, 16k: 0.68 of cuDNN with 5-head sections, 0.75 with one order).
  // It also keeps L2 use small while every head gets four or more CTAs of a wave, since the CTAs
  // of a head walk its Q and dO in step. With more heads than that, the CTAs stream too many
  // heads from DRAM (hdim 128, 2k: 305 -> 258 TFLOP/s with one CTA a head; hdim 256, 2k: 211 ->
  // 275 with two), so L2-sized sections keep a head's CTAs together.
  const bool one_order = int64_t(heads_kv) * batch * 4 <= num_sms;
  const int64_t qdo_bytes_per_row = int64_t(heads_q / heads_kv) * (d + dv) * sizeof(Element);
  typename Scheduler::Params scheduler;
  if (s.varlen_k) {
    auto* tiles = reinterpret_cast<hopper::PlannedTile*>(ws + layout.main_tiles);
    auto* counters = reinterpret_cast<int*>(tiles + layout.max_main_tiles);
    hopper::VarlenTilePlanner::Params plan{seqlen, batch, heads_kv, Tile::kBlockN, /*key_blocks=*/true,
                                           /*highest_first=*/kCausal,
                                           planner_section_tiles(num_sms, l2_bytes, Tile::kBlockN, qdo_bytes_per_row),
                                           int(layout.max_main_tiles), tiles, counters};
    if ((err = plan_varlen_tiles(plan, stream)) != cudaSuccess) return err;
    scheduler = Scheduler::planned_params(tiles, counters, int(layout.max_main_tiles));
  } else {
    scheduler = Scheduler::make_params(num_n_blocks, heads_kv, batch,
                                       one_order ? 0 : int64_t(seqlen.seqlen_q) * qdo_bytes_per_row, l2_bytes, num_sms);
  }
  typename Kernel::Params params{Mainloop::to_underlying_arguments(mainloop_args),
                                 Epilogue::to_underlying_arguments(epilogue_args), scheduler};
  // Deterministic, non-causal: a head's key blocks are consecutive tiles that start together and
  // add to each dQ tile in key-block order, so key block n runs n hand-offs behind key block 0.
  // When the grid is a multiple of the key blocks, each CTA keeps its key block index from wave
  // to wave and that lag is paid once; otherwise the wave boundary moves through the heads and
  // every wave pays it again (2k-4k: 0.80 of the default mode). Worth at most 10% of the SMs.
  int grid = Scheduler::grid_size(params.scheduler, num_sms);
  if (!Tile::kDqKernel && p.deterministic != 0 && !kCausal && !s.varlen_k && num_n_blocks < grid) {
    const int whole_heads = grid / num_n_blocks * num_n_blocks;
    if (whole_heads * 10 >= grid * 9) grid = whole_heads;
  }
  if ((err = launch_kernel<Kernel>(backward_kernel_entry<Kernel>, grid, params, stream)) != cudaSuccess) return err;

  if constexpr (Tile::kDqKernel) {
    err = run_backward_dq_kernel<Element, kHeadDim, kHeadDimV, kMask, kSoftcap, kPacked>(
        p, s, mainloop_args, q_rows(p.dq), ws, layout, scale, num_sms, l2_bytes, stream);
  } else {
    const TensorRows dqr = q_rows(p.dq);
    typename Postprocess::Params post{static_cast<Element*>(p.dq.data),
                                      make_shape(dqr.rows, d, heads_q, dqr.batch),
                                      stride_of(dqr),
                                      scale,
                                      pointers,
                                      seqlen};
    const int64_t post_ctas = int64_t((seqlen.seqlen_q + Tile::kBlockM - 1) / Tile::kBlockM) * heads_q * batch;
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
