// Composes the forward kernel for one (dtype, head dim, value head dim, mask kind, softcap) and
// launches it. A call whose head dim is below the compiled one passes its own in the tensor shapes:
// the TMA loads zero-fill the columns past it and the stores leave them unwritten.
#pragma once

#include <cuda_runtime_api.h>

#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include "hopper/collective/epilogue_fwd.hpp"
#include "hopper/collective/mainloop_fwd.hpp"
#include "hopper/common/tile_scheduler.hpp"
#include "hopper/common/tile_size.hpp"
#include "hopper/kernel/forward_kernel.hpp"
#include "launch/element_of.cuh"
#include "launch/forward_launch.hpp"
#include "launch/launch_common.cuh"
#include "launch/varlen_plan.hpp"

namespace flashhopper::launch {

// The forward kernel of one (dtype, head dim, value head dim, mask kind, softcap, feature set): its
// tile, collectives and scheduler.
template <fh_dtype kDType, int kHeadDim, int kHeadDimV, hopper::MaskKind kMask, bool kSoftcap,
          hopper::ForwardFeatures kFeatures>
struct ForwardKernelOf {
  using Element = typename ElementOf<kDType>::type;
  static constexpr bool kMasked = kMask != hopper::MaskKind::kNone;
  using Tile = hopper::ForwardTile<kDType == FH_DTYPE_FP8_E4M3, kHeadDim, kHeadDimV, kMasked>;
  // K/V multicast over a cluster where the tile asks for it: dense 16-bit kernels, unmasked or
  // causal (whose pairs walk the union of their blocks: ForwardKernel::key_blocks).
  static constexpr int kClusterM =
      (kMask == hopper::MaskKind::kNone || kMask == hopper::MaskKind::kCausal) &&
              kFeatures == hopper::ForwardFeatures::kNone && kDType != FH_DTYPE_FP8_E4M3
          ? hopper::kForwardClusterM<Tile>
          : 1;
  using Mainloop = hopper::ForwardMainloop<Element, Tile::kBlockM, Tile::kBlockN, kHeadDim, kHeadDimV, Tile::kStages,
                                           kMask, kSoftcap, kFeatures, kClusterM>;
  using Epilogue =
      hopper::ForwardEpilogue<OutputElementOf<Element>, Tile::kBlockM, kHeadDimV, typename Mainloop::TiledMmaPV,
                              kFeatures>;
  // Causal tiles differ in length (longest first); a window's are alike, and those run together
  // share their K/V in L2 when the blocks of a head go together.
  using Scheduler = hopper::PersistentTileScheduler</*kLongestFirst=*/kMask == hopper::MaskKind::kCausal,
                                                    Mainloop::kPacked, Mainloop::kSplitKv, kClusterM>;
  using Kernel = hopper::ForwardKernel<Mainloop, Epilogue, Scheduler, hopper::kForwardConsumerRegisters<Tile>>;
  static constexpr bool kUsesExtendedGmma = Mainloop::kUsesExtendedGmma;
};

template <fh_dtype kDType, int kHeadDim, int kHeadDimV, hopper::MaskKind kMask, bool kSoftcap,
          hopper::ForwardFeatures kFeatures>
cudaError_t run_forward_hdim(const ForwardParams& p, const detail::ProblemShape& s, const ForwardWorkspace& workspace,
                             cudaStream_t stream) {
  using namespace cute;
  using namespace flashhopper::hopper;
  using Of = ForwardKernelOf<kDType, kHeadDim, kHeadDimV, kMask, kSoftcap, kFeatures>;
  using Element = typename Of::Element;
  using Tile = typename Of::Tile;
  using Mainloop = typename Of::Mainloop;
  using Epilogue = typename Of::Epilogue;
  using Scheduler = typename Of::Scheduler;
  using Kernel = typename Of::Kernel;
  static_assert(!Of::kUsesExtendedGmma || FLASHHOPPER_EXTENDED_GMMA_SHAPES, FLASHHOPPER_GMMA_SET_MESSAGE);
  // The dispatch picks a kernel that holds the call's features; one without would ignore them.
  if (!holds(kFeatures, forward_features(p, s, workspace.out_partial != nullptr))) return cudaErrorInvalidValue;
  // A kernel that shifts for grouped rows takes a power of two (plan/packed_decode.hpp packs no other).
  if (query_row_grouping(kFeatures) == RowGrouping::kShift && (s.rows_per_token & (s.rows_per_token - 1)) != 0)
    return cudaErrorInvalidValue;

  const int batch = int(s.batch), heads_q = int(s.heads_q), heads_kv = int(s.heads_kv);
  const int d = int(s.head_dim), dv = int(s.head_dim_v);
  const hopper::SeqlenParams seqlen = seqlen_params(p, s);
  hopper::LocalMaskParams mask_params = local_mask_params(p);
  // Packed GQA over several tokens (the kernels with the KV cache's code: query_row_grouping).
  mask_params.rows_per_token = int(s.rows_per_token);
  mask_params.rows_per_token_log2 = detail::rows_per_token_log2(s);
  // (rows, d, heads, batch) views: dense [B, S, H, d]; packed [total, H, d] as one batch.
  const TensorRows q_rows = tensor_rows(p.q, s.varlen_q, seqlen.total_q, batch);
  // A dense K/V's own batch extent: a KV cache indexed by cache_batch_idx has any number of rows;
  // a paged one is (page_size, d, heads, pages), a page per batch index.
  const bool packed_kv = s.varlen_k && !s.paged;
  const int kv_batch = packed_kv ? 1 : int(p.k.shape[0]);
  const int kv_rows = s.paged ? int(s.page_size) : seqlen.total_k;
  const TensorRows k_rows = tensor_rows(p.k, packed_kv, kv_rows, kv_batch);
  const TensorRows v_rows = tensor_rows(p.v, packed_kv, kv_rows, kv_batch);
  const TensorRows o_rows = tensor_rows(p.out, s.varlen_q, seqlen.total_q, batch);
  typename Mainloop::Arguments mainloop_args{
      static_cast<Element const*>(p.q.data),
      make_shape(q_rows.rows, d, heads_q, q_rows.batch),
      make_stride(q_rows.row_stride, _1{}, q_rows.head_stride, q_rows.batch_stride),
      static_cast<Element const*>(p.k.data),
      make_shape(k_rows.rows, d, heads_kv, k_rows.batch),
      make_stride(k_rows.row_stride, _1{}, k_rows.head_stride, k_rows.batch_stride),
      static_cast<Element const*>(p.v.data),
      make_shape(dv, v_rows.rows, heads_kv, v_rows.batch),
      make_stride(_1{}, v_rows.row_stride, v_rows.head_stride, v_rows.batch_stride),
      float(detail::forward_scale(p, s)),
      p.softcap,
      mask_params,
      static_cast<float const*>(p.learnable_sink.data),
      seqlen,
      static_cast<int const*>(p.page_table.data),
      s.paged ? p.page_table.stride[0] : 0,
      s.paged ? int(p.page_table.shape[0]) : 0,
      int(s.page_size)};
  if constexpr (Mainloop::kQv) {  // [B, sq, Hq, dv] as q (packed: [total_q, Hq, dv])
    const TensorRows qv_rows = tensor_rows(p.qv, s.varlen_q, seqlen.total_q, batch);
    mainloop_args.ptr_qv = static_cast<Element const*>(p.qv.data);
    mainloop_args.shape_qv = make_shape(qv_rows.rows, dv, heads_q, qv_rows.batch);
    mainloop_args.stride_qv = make_stride(qv_rows.row_stride, _1{}, qv_rows.head_stride, qv_rows.batch_stride);
  }
  // lse: dense [B, Hq, sq], packed [Hq, total_q].
  const bool has_lse = p.lse.data != nullptr;
  const int64_t lse_head_stride = !has_lse ? 0 : (s.varlen_q ? p.lse.stride[0] : p.lse.stride[1]);
  const int64_t lse_batch_stride = !has_lse || s.varlen_q ? 0 : p.lse.stride[0];
  if constexpr (kDType == FH_DTYPE_FP8_E4M3) {  // [B, Hkv] each, or absent
    auto descale = [](const fh_tensor& t) {
      return hopper::Descale{static_cast<float const*>(t.data), t.data ? t.stride[0] : 0, t.data ? t.stride[1] : 0};
    };
    mainloop_args.q_descale = descale(p.q_descale);
    mainloop_args.k_descale = descale(p.k_descale);
    mainloop_args.v_descale = descale(p.v_descale);
    // [B, S, Hkv, dv] with the keys contiguous: loaded as P V's operand (the shape above holds).
    if (detail::v_column_major(p)) mainloop_args.v_column_stride = p.v.stride[3];
  }
  typename Epilogue::Arguments epilogue_args{
      static_cast<typename Epilogue::Element*>(p.out.data),
      make_shape(o_rows.rows, dv, heads_q, o_rows.batch),
      make_stride(o_rows.row_stride, _1{}, o_rows.head_stride, o_rows.batch_stride),
      static_cast<float*>(p.lse.data),
      make_stride(_1{}, lse_head_stride, lse_batch_stride),
      s.varlen_q,
      workspace.out_partial,
      workspace.lse_partial};
  // lse [B, Hq, sq] as given: row r is head r % g of token r / g (grouped rows run on such kernels
  // alone: forward_features above).
  if constexpr (Epilogue::kGroupedRows) {
    if (s.rows_per_token > 1 && has_lse)
      epilogue_args.grouped_lse = {int(s.rows_per_token), p.lse.stride[1], p.lse.stride[2]};
  }

  int num_sms = 0, l2_bytes = 0;
  cudaError_t err = usable_sms_and_l2(p.sm_margin, &num_sms, &l2_bytes);
  if (err != cudaSuccess) return err;

  const int64_t kv_bytes_per_row = int64_t(d + dv) * sizeof(Element);  // a key's K and V, one head
  typename Scheduler::Params scheduler;
  if (s.varlen_q) {
    // The sequences' tiles, planned on the device (the workspace holds the list), a tile a split.
    const int64_t max_tiles =
        max_planned_tiles(s.total_q, s.seqlen_q, batch, heads_q, Tile::kBlockM) * workspace.num_splits;
    auto* tiles = static_cast<hopper::PlannedTile*>(workspace.planned_tiles);
    auto* counters = reinterpret_cast<int*>(tiles + max_tiles);
    hopper::VarlenTilePlanner::Params plan{seqlen, batch, heads_q, Tile::kBlockM, /*key_blocks=*/false,
                                           /*highest_first=*/kMask == MaskKind::kCausal,
                                           planner_section_tiles(num_sms, l2_bytes, Tile::kBlockM, kv_bytes_per_row),
                                           int(max_tiles), tiles, counters, workspace.num_splits};
    if ((err = plan_varlen_tiles(plan, stream)) != cudaSuccess) return err;
    scheduler = Scheduler::planned_params(tiles, counters, int(max_tiles), workspace.num_splits);
  } else {
    const int num_m_blocks = (seqlen.seqlen_q + Tile::kBlockM - 1) / Tile::kBlockM;
    scheduler = Scheduler::make_params(num_m_blocks, heads_q, batch, int64_t(seqlen.seqlen_k) * kv_bytes_per_row,
                                       l2_bytes, num_sms, workspace.num_splits, Of::kClusterM);
  }
  typename Kernel::Params params{Mainloop::to_underlying_arguments(mainloop_args),
                                 Epilogue::to_underlying_arguments(epilogue_args), scheduler};

  return launch_kernel<Kernel>(forward_kernel_entry<Kernel>, Scheduler::grid_size(params.scheduler, num_sms),
                               params, stream);
}

}  // namespace flashhopper::launch
