// Backward dQ mainloop, for the head dims whose dQ is computed by a kernel of its own: a CTA owns
// one query block (Q, dO and its rows' LSE2 and D stay put) and walks the key blocks it sees, as
// the forward does, so dQ sums in registers and goes to global memory once, with no float32
// dQaccum, no reduce-adds and nothing to order in deterministic mode. It recomputes S and dP,
// which the dK/dV kernel computes too (7 GEMMs a block pair instead of 5); at hdim 256 the dK/dV
// kernel's dQ adds to L2 cost more than that.
//
// Per key block n (each MMA warpgroup owns 64 of the block's rows, or both share 64: kSharesRows):
//   S = Q K^T, dP = dO V^T               SS GEMMs, issued together
//   P = exp2(S * scale * log2 e - LSE2)  while dP runs
//   dS = P * (dP - D)                    converted in registers into the A operand of
//   dQ += dS K                           an RS GEMM, left in flight under the next block's S and dP
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/cutlass.h>
#include <cutlass/gemm/collective/builders/sm90_common.inl>
#include <cutlass/pipeline/pipeline.hpp>

#include "hopper/common/gmma_shapes.hpp"
#include "hopper/common/mask.hpp"
#include "hopper/common/named_barrier.hpp"
#include "hopper/common/score_transform.hpp"
#include "hopper/common/softmax.hpp"
#include "hopper/common/tile_scheduler.hpp"
#include "hopper/common/tma_pipeline.hpp"
#include "hopper/common/utils.hpp"
#include "hopper/common/workspace_rows.hpp"

namespace flashhopper::hopper {

using namespace cute;

template <class Element_, int kBlockM_, int kBlockN_, int kHeadDim_, int kHeadDimV_, int kStagesK_, int kStagesV_,
          MaskKind kMask_, bool kSoftcap_, bool kPacked_, bool kSdPByOperand_ = false>
struct BackwardDqMainloop {
  using Element = Element_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kHeadDim = kHeadDim_;    // Q, K, dQ
  static constexpr int kHeadDimV = kHeadDimV_;  // V and dO (dP = dO V^T)
  static constexpr int kStagesK = kStagesK_;
  static constexpr int kStagesV = kStagesV_;
  static constexpr MaskKind kMask = kMask_;
  static constexpr bool kPacked = kPacked_;  // as BackwardMainloop's
  using Mask = AttentionMask<kBlockM_, kBlockN_, kMask_>;
  using Transform = ScoreTransform<kSoftcap_>;
  // Two MMA warpgroups. kBlockM = 128: each owns 64 rows. kBlockM = 64 (head dims whose 64 rows
  // of dQ, kHeadDim / 2 floats a thread, fill a warpgroup's registers: 512): both take the same
  // rows, each computes all of S and dP (the same bits) and dQ for its half of the head dim, so
  // nothing crosses between them; the price is S and dP twice (5 GEMM units of 64 x kBlockN x
  // d/2 a warpgroup and block, not 3).
  static constexpr bool kSharesRows = kBlockM == 64;
  static constexpr int kNumMmaWarpGroups = 2;
  static constexpr int kNumMmaThreads = kNumMmaWarpGroups * cutlass::NumThreadsPerWarpGroup;
  static_assert((kBlockM == 128 || kSharesRows) && kBlockN % 16 == 0);
  static constexpr int kDqColumnsPerWarpGroup = kSharesRows ? kHeadDim / 2 : kHeadDim;
  // The tile's choice where the warpgroups share rows (BackwardDqTileSize::kSdPByOperand):
  // warpgroup 0 computes S and P, warpgroup 1 dP and dS, each whole, and they trade through one
  // float32 exchange buffer, P one way and dS back over it (each thread its own slots), instead of
  // each computing both.
  static constexpr bool kSdPByOperand = kSdPByOperand_;
  static_assert(kSharesRows || !kSdPByOperand);

  using TileShapeSdP = Shape<Int<kBlockM>, Int<kBlockN>, Int<kHeadDim>>;  // (M, N, d)
  using TileShapedQ = Shape<Int<kBlockM>, Int<kHeadDim>, Int<kBlockN>>;   // (M, d, N)

  // S and dP: one 64-row WGMMA atom per warpgroup, stacked along M; or one warpgroup's, which
  // each of the two runs for itself (kSharesRows). dQ: stacked along M, or side by side along d.
  using TiledMmaSdP = decltype(make_tiled_mma(ss_gmma<Element, Shape<_64, Int<kBlockN>, Int<kHeadDim>>>(),
                                              Layout<Shape<Int<kSharesRows ? 1 : kNumMmaWarpGroups>, _1, _1>>{}));
  using TiledMmadQ = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, float, Shape<_64, Int<kDqColumnsPerWarpGroup>, Int<kBlockN>>,
                           GMMA::Major::K, GMMA::Major::MN>(),
      cute::conditional_t<kSharesRows, Layout<Shape<_1, _2, _1>>, Layout<Shape<_2, _1, _1>>>{}));
  // The thread's index in TiledMmaSdP: each warpgroup runs it whole when they share rows.
  CUTLASS_DEVICE static int sdp_thread(int thread_idx) {
    return kSharesRows ? thread_idx % cutlass::NumThreadsPerWarpGroup : thread_idx;
  }
  static_assert(gmma_n<TiledMmaSdP> == kBlockN && gmma_n<TiledMmadQ> == kDqColumnsPerWarpGroup,
                FLASHHOPPER_GMMA_SPAN_MESSAGE);
  static constexpr bool kUsesExtendedGmma = uses_extended_gmma<TiledMmaSdP, TiledMmadQ>;

  // Q (M, d) and dO (M, dv), K (N, d, stage) and V (N, dv, stage): columns contiguous. dQ = dS K
  // reads K as K^T (d, N, stage), the same bytes: d contiguous is the MN-major B operand.
  template <int kCols>
  using SmemLayoutRows = decltype(tile_to_shape(
      cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::K, Element, Int<kBlockM>, Int<kCols>>(),
      Shape<Int<kBlockM>, Int<kCols>>{}));
  using SmemLayoutQ = SmemLayoutRows<kHeadDim>;
  using SmemLayoutdO = SmemLayoutRows<kHeadDimV>;
  template <int kCols, int kStages>
  using SmemLayoutKeys = decltype(tile_to_shape(
      cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::K, Element, Int<kBlockN>, Int<kCols>>(),
      Shape<Int<kBlockN>, Int<kCols>, Int<kStages>>{}));
  using SmemLayoutK = SmemLayoutKeys<kHeadDim, kStagesK>;
  using SmemLayoutV = SmemLayoutKeys<kHeadDimV, kStagesV>;
  using SmemLayoutKt = decltype(composition(
      SmemLayoutK{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockN>, Int<kStagesK>>{},
                                 Stride<Int<kBlockN>, _1, Int<kBlockN * kHeadDim>>{})));

  // Global tensors as (seqlen, d, head, batch).
  using ShapeQKV = Shape<int32_t, int32_t, int32_t, int32_t>;
  using StrideQKV = Stride<int64_t, _1, int64_t, int64_t>;
  template <int kRows, int kCols, class SmemLayout>
  using TileTma = decltype(make_tile_tma<kRows, kCols>(static_cast<Element const*>(nullptr), ShapeQKV{}, StrideQKV{},
                                                       SmemLayout{}));
  using TmaQ = TileTma<kBlockM, kHeadDim, SmemLayoutQ>;
  using TmaDo = TileTma<kBlockM, kHeadDimV, SmemLayoutdO>;
  using TmaK = TileTma<kBlockN, kHeadDim, decltype(take<0, 2>(SmemLayoutK{}))>;
  using TmaV = TileTma<kBlockN, kHeadDimV, decltype(take<0, 2>(SmemLayoutV{}))>;

  using PipelineK = cutlass::PipelineTmaAsync<kStagesK>;
  using PipelineStateK = cutlass::PipelineState<kStagesK>;
  using PipelineV = cutlass::PipelineTmaAsync<kStagesV>;
  using PipelineStateV = cutlass::PipelineState<kStagesV>;
  static constexpr uint32_t kTmaBytesQdO = (cosize_v<SmemLayoutQ> + cosize_v<SmemLayoutdO>) * sizeof(Element);
  static constexpr uint32_t kTmaBytesK = size(take<0, 2>(SmemLayoutK{})) * sizeof(Element);  // a K block
  static constexpr uint32_t kTmaBytesV = size(take<0, 2>(SmemLayoutV{})) * sizeof(Element);  // a V block

  struct SharedStorage {
    cute::array_aligned<Element, cosize_v<SmemLayoutQ>, 1024> smem_q;
    cute::array_aligned<Element, cosize_v<SmemLayoutdO>, 1024> smem_do;
    cute::array_aligned<Element, cosize_v<SmemLayoutK>, 1024> smem_k;
    cute::array_aligned<Element, cosize_v<SmemLayoutV>, 1024> smem_v;
    cutlass::arch::ClusterTransactionBarrier qdo_full;
    cutlass::arch::ClusterBarrier qdo_empty;
    typename PipelineK::SharedStorage pipeline_k;
    typename PipelineV::SharedStorage pipeline_v;
    TileRing tiles;  // packed batches: the hand-off of the tiles a CTA takes (tile_scheduler.hpp)
    // kSdPByOperand: a thread's kBlockM * kBlockN / 128 floats strided by 128. Last, so that the
    // other kernels' layout is the same with or without it.
    cute::conditional_t<kSdPByOperand, cute::array_aligned<float, kBlockM * kBlockN, 128>, cute::array<float, 0>>
        exchange;
  };

  struct Arguments {
    Element const* ptr_q;
    ShapeQKV shape_q;  // (seqlen_q, d, heads_q, batch)
    StrideQKV stride_q;
    Element const* ptr_k;
    ShapeQKV shape_k;  // (seqlen_k, d, heads_kv, batch)
    StrideQKV stride_k;
    Element const* ptr_v;
    StrideQKV stride_v;
    Element const* ptr_do;
    StrideQKV stride_do;
    int head_dim_v;  // the columns of V and dO (the call's dv); Q and K have shape_q's and shape_k's
    Element* ptr_dq;
    StrideQKV stride_dq;
    float softmax_scale;
    float softcap;          // > 0 only with kSoftcap
    LocalMaskParams local;  // kLocal only
    BackwardWorkspacePointers workspace;  // the preprocess kernel's LSE2 and D
    SeqlenParams seqlen;
  };

  struct Params {
    ShapeQKV shape_q;
    ShapeQKV shape_k;
    ShapeQKV shape_v;   // shape_k with dv columns
    ShapeQKV shape_do;  // shape_q with dv columns
    TmaQ tma_q;
    TmaDo tma_do;
    TmaK tma_k;
    TmaV tma_v;
    Element* ptr_dq;
    StrideQKV stride_dq;
    float softmax_scale;       // dQ's factor
    float softmax_scale_log2;  // after the score transform
    Transform transform;
    LocalMaskParams local;
    BackwardWorkspacePointers workspace;
    cutlass::FastDivmod heads_per_kv_head;
    SeqlenParams seqlen;
  };

  static Params to_underlying_arguments(Arguments const& args) {
    const ShapeQKV shape_v = with_columns(args.shape_k, args.head_dim_v);
    const ShapeQKV shape_do = with_columns(args.shape_q, args.head_dim_v);
    return {args.shape_q,
            args.shape_k,
            shape_v,
            shape_do,
            make_tile_tma<kBlockM, kHeadDim>(args.ptr_q, args.shape_q, args.stride_q, SmemLayoutQ{}),
            make_tile_tma<kBlockM, kHeadDimV>(args.ptr_do, shape_do, args.stride_do, SmemLayoutdO{}),
            make_tile_tma<kBlockN, kHeadDim>(args.ptr_k, args.shape_k, args.stride_k, take<0, 2>(SmemLayoutK{})),
            make_tile_tma<kBlockN, kHeadDimV>(args.ptr_v, shape_v, args.stride_v, take<0, 2>(SmemLayoutV{})),
            args.ptr_dq,
            args.stride_dq,
            args.softmax_scale,
            float(Transform::softmax_scale(args.softmax_scale, args.softcap) * M_LOG2E),
            Transform::make(args.softmax_scale, args.softcap),
            args.local,
            args.workspace,
            cutlass::FastDivmod(get<2>(args.shape_q) / get<2>(args.shape_k)),
            args.seqlen};
  }

  CUTLASS_DEVICE static void prefetch_tma_descriptors(Params const& params) {
    cute::prefetch_tma_descriptor(params.tma_q.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_do.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_k.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_v.get_tma_descriptor());
  }

  CUTLASS_DEVICE static SeqlenInfo seqlen_info(Params const& params, WorkTile const& work) {
    return SeqlenInfo::make</*kKvCache=*/false, kPacked>(params.seqlen, work.batch);
  }
  CUTLASS_DEVICE static Mask make_mask(Params const& params, SeqlenInfo const& seq) { return Mask(seq, params.local); }

  // What the producer and the MMA warpgroups share besides the parameters, as one role sees it
  // (BackwardMainloop's, with the roles of K/V and Q/dO swapped): the K and V pipelines with its
  // place in each, the shared storage, and the phase of the Q/dO barrier it waits on.
  struct SharedState {
    PipelineK& pipeline_k;
    PipelineV& pipeline_v;
    PipelineStateK& k_state;
    PipelineStateV& v_state;
    SharedStorage& storage;
    int& qdo_phase;
  };

  // Producer (one thread): the first K block, then Q and dO once the previous tile is done with
  // theirs, then K and V in the walk's order (the last key block, which may need masking,
  // first), K one block ahead of V in the order the warpgroups use them.
  CUTLASS_DEVICE static void load(Params const& params, SharedState const& shared, WorkTile const& work,
                                  SeqlenInfo const& seq, typename Mask::KeyBlocks const& blocks) {
    SharedStorage& storage = shared.storage;
    Tensor sQ = make_tensor(make_smem_ptr(storage.smem_q.data()), SmemLayoutQ{});
    Tensor sdO = make_tensor(make_smem_ptr(storage.smem_do.data()), SmemLayoutdO{});
    Tensor sK = make_tensor(make_smem_ptr(storage.smem_k.data()), SmemLayoutK{});
    Tensor sV = make_tensor(make_smem_ptr(storage.smem_v.data()), SmemLayoutV{});
    const int head_kv = params.heads_per_kv_head.divide(work.head);

    auto query_tile = [&](auto const& tma, ShapeQKV const& shape, auto cols) {
      auto m = domain_offset(make_coord(seq.offset_q, _0{}),
                             tma.get_tma_tensor(shape)(_, _, work.head, seq.batch_q));
      return local_tile(m, Shape<Int<kBlockM>, decltype(cols)>{}, make_coord(work.block, _0{}));  // (M, cols)
    };
    auto key_tiles = [&](auto const& tma, ShapeQKV const& shape, auto cols) {
      auto m = domain_offset(make_coord(seq.offset_k, _0{}),
                             tma.get_tma_tensor(shape)(_, _, head_kv, seq.batch_k));
      return local_tile(m, Shape<Int<kBlockN>, decltype(cols)>{}, make_coord(_, _0{}));  // (N, cols, n)
    };
    auto [tQgQ, tQsQ] = tma_partition(params.tma_q, _0{}, Layout<_1>{}, group_modes<0, 2>(sQ),
                                      group_modes<0, 2>(query_tile(params.tma_q, params.shape_q, Int<kHeadDim>{})));
    auto [tdOgdO, tdOsdO] =
        tma_partition(params.tma_do, _0{}, Layout<_1>{}, group_modes<0, 2>(sdO),
                      group_modes<0, 2>(query_tile(params.tma_do, params.shape_do, Int<kHeadDimV>{})));
    // Plain tensors rather than structured bindings: lambdas capture them (C++17).
    auto k_parts = tma_partition(params.tma_k, _0{}, Layout<_1>{}, group_modes<0, 2>(sK),
                                 group_modes<0, 2>(key_tiles(params.tma_k, params.shape_k, Int<kHeadDim>{})));
    auto v_parts = tma_partition(params.tma_v, _0{}, Layout<_1>{}, group_modes<0, 2>(sV),
                                 group_modes<0, 2>(key_tiles(params.tma_v, params.shape_v, Int<kHeadDimV>{})));
    Tensor tKgK = get<0>(k_parts);  // (TMA, n)
    Tensor tKsK = get<1>(k_parts);  // (TMA, PIPE)
    Tensor tVgV = get<0>(v_parts);
    Tensor tVsV = get<1>(v_parts);

    auto load_k = [&](int n_block) {
      tma_load_stage(shared.pipeline_k, shared.k_state, params.tma_k, tKgK(_, n_block), tKsK);
    };
    auto load_v = [&](int n_block) {
      tma_load_stage(shared.pipeline_v, shared.v_state, params.tma_v, tVgV(_, n_block), tVsV);
    };
    const int num_blocks = blocks.count();
    load_k(blocks.at(0));
    storage.qdo_empty.wait(shared.qdo_phase);
    shared.qdo_phase ^= 1;
    storage.qdo_full.arrive_and_expect_tx(kTmaBytesQdO);
    copy(params.tma_q.with(reinterpret_cast<uint64_t&>(storage.qdo_full)), tQgQ, tQsQ);
    copy(params.tma_do.with(reinterpret_cast<uint64_t&>(storage.qdo_full)), tdOgdO, tdOsdO);
    for (int i = 0; i < num_blocks; ++i) {
      load_v(blocks.at(i));
      if (i + 1 < num_blocks) load_k(blocks.at(i + 1));
    }
  }

  // MMA warpgroups: the whole query block. On return tdQrdQ holds dQ / scale, every GEMM done.
  template <class TensordQ>
  CUTLASS_DEVICE static void mma(Params const& params, SharedState const& shared, TensordQ& tdQrdQ, int thread_idx,
                                 WorkTile const& work, SeqlenInfo const& seq, typename Mask::KeyBlocks const& blocks) {
    SharedStorage& storage = shared.storage;
    Tensor sQ = make_tensor(make_smem_ptr(storage.smem_q.data()), SmemLayoutQ{});
    Tensor sdO = make_tensor(make_smem_ptr(storage.smem_do.data()), SmemLayoutdO{});
    Tensor sK = make_tensor(make_smem_ptr(storage.smem_k.data()), SmemLayoutK{});
    Tensor sKt = make_tensor(make_smem_ptr(storage.smem_k.data()), SmemLayoutKt{});
    Tensor sV = make_tensor(make_smem_ptr(storage.smem_v.data()), SmemLayoutV{});

    TiledMmaSdP tiled_mma_sdp;
    TiledMmadQ tiled_mma_dq;
    auto thr_mma_sdp = tiled_mma_sdp.get_thread_slice(sdp_thread(thread_idx));
    auto thr_mma_dq = tiled_mma_dq.get_thread_slice(thread_idx);
    Tensor tSrQ = thr_mma_sdp.partition_fragment_A(sQ);  // (MMA, MMA_M, MMA_K)
    Tensor tSrK = thr_mma_sdp.partition_fragment_B(sK);  // (MMA, MMA_N, MMA_K, PIPE)
    Tensor tdPrdO = thr_mma_sdp.partition_fragment_A(sdO);
    Tensor tdPrV = thr_mma_sdp.partition_fragment_B(sV);
    Tensor tdQrKt = thr_mma_dq.partition_fragment_B(sKt);  // (MMA, MMA_d, MMA_N, PIPE)

    Tensor tSrS = partition_fragment_C(tiled_mma_sdp, select<0, 1>(TileShapeSdP{}));  // (MMA, MMA_M, MMA_N)
    Tensor tdPrdP = partition_fragment_C(tiled_mma_sdp, select<0, 1>(TileShapeSdP{}));
    Tensor tdQrdS = make_tensor<Element>(accumulator_as_a_operand(tdPrdP.layout()));
    Tensor scores = make_tensor(tSrS.data(), accumulator_rowcol(tSrS.layout()));  // (rows, cols)
    Tensor dS = make_tensor(tdPrdP.data(), scores.layout());
    Tensor tScS = thr_mma_sdp.partition_C(make_identity_tensor(select<0, 1>(TileShapeSdP{})));
    Tensor coords = make_tensor(tScS.data(), accumulator_rowcol(tScS.layout()));
    constexpr int kRows = decltype(size<0>(scores))::value;

    // The rows' LSE2 and D: padded buffers, so every row of the tile is in bounds.
    const int64_t row0 = params.workspace.row0(seq, work.head) + int64_t(work.block) * kBlockM;
    float lse_log2[kRows], dpsum[kRows];
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kRows; ++i) {
      lse_log2[i] = params.workspace.lse_log2[row0 + get<0>(coords(i, 0))];
      dpsum[i] = params.workspace.dpsum[row0 + get<0>(coords(i, 0))];
    }
    const Mask mask = make_mask(params, seq);
    const int num_blocks = blocks.count();

    storage.qdo_full.wait(shared.qdo_phase);
    shared.qdo_phase ^= 1;
    clear(tdQrdQ);

    PipelineStateK pipe_k_previous;  // the previous block's K stage, read by its dQ GEMM
    CUTLASS_PRAGMA_NO_UNROLL
    for (int i = 0; i < num_blocks; ++i) {
      const int n_block = blocks.at(i);
      shared.pipeline_k.consumer_wait(shared.k_state);
      if constexpr (kSdPByOperand) {
        // The exchange is written again only after the other warpgroup has read it: P(n + 1) after
        // warpgroup 0 has read dS(n), dS(n + 1) after the barrier that P(n + 1) is there.
        float* exchange = storage.exchange.data() + thread_idx % cutlass::NumThreadsPerWarpGroup;
        constexpr int kStride = cutlass::NumThreadsPerWarpGroup;
        if (thread_idx < cutlass::NumThreadsPerWarpGroup) {
          warpgroup_gemm</*kZeroInit=*/true, /*kWait=*/-1>(tiled_mma_sdp, tSrQ,
                                                           tSrK(_, _, _, shared.k_state.index()), tSrS);
          shared.pipeline_v.consumer_wait(shared.v_state);  // V is warpgroup 1's: released unread
          shared.pipeline_v.consumer_release(shared.v_state);
          warpgroup_wait<0>();  // S is ready, and the previous block's dQ GEMM is done with its K
          params.transform.apply(scores);
          if (mask.crosses_boundary(work.block, n_block)) mask.apply(scores, coords, work.block, n_block);
          scores_to_probabilities(scores, lse_log2, params.softmax_scale_log2);
          CUTLASS_PRAGMA_UNROLL
          for (int j = 0; j < size(tSrS); ++j) exchange[j * kStride] = tSrS(j);
          named_barrier_arrive(kNumMmaThreads, BwdDqBarrier::kPExchange);
          named_barrier_sync(kNumMmaThreads, BwdDqBarrier::kDsExchange);
          CUTLASS_PRAGMA_UNROLL
          for (int j = 0; j < size(tdPrdP); ++j) tdPrdP(j) = exchange[j * kStride];  // dS
        } else {
          shared.pipeline_v.consumer_wait(shared.v_state);
          warpgroup_gemm<true, -1>(tiled_mma_sdp, tdPrdO, tdPrV(_, _, _, shared.v_state.index()), tdPrdP);
          warpgroup_wait<0>();  // dP is ready, and the previous block's dQ GEMM is done with its K
          shared.pipeline_v.consumer_release(shared.v_state);
          named_barrier_sync(kNumMmaThreads, BwdDqBarrier::kPExchange);
          CUTLASS_PRAGMA_UNROLL
          for (int j = 0; j < size(tSrS); ++j) tSrS(j) = exchange[j * kStride];  // P
          Transform::dp_to_ds(dS, scores, dpsum, lse_log2, params.softmax_scale_log2);
          CUTLASS_PRAGMA_UNROLL
          for (int j = 0; j < size(tdPrdP); ++j) exchange[j * kStride] = tdPrdP(j);
          named_barrier_arrive(kNumMmaThreads, BwdDqBarrier::kDsExchange);
        }
        ++shared.v_state;
        if constexpr (kStagesK > 1) {
          if (i > 0) shared.pipeline_k.consumer_release(pipe_k_previous);
        }
        if (i == num_blocks - 1) storage.qdo_empty.arrive();
      } else {
        warpgroup_gemm</*kZeroInit=*/true, /*kWait=*/-1>(tiled_mma_sdp, tSrQ, tSrK(_, _, _, shared.k_state.index()),
                                                         tSrS);
        shared.pipeline_v.consumer_wait(shared.v_state);
        warpgroup_gemm<true, -1>(tiled_mma_sdp, tdPrdO, tdPrV(_, _, _, shared.v_state.index()), tdPrdP);
        warpgroup_wait<1>();  // S is ready, and the previous block's dQ GEMM is done with its K
        if constexpr (kStagesK > 1) {
          if (i > 0) shared.pipeline_k.consumer_release(pipe_k_previous);
        }
        params.transform.apply(scores);
        if (mask.crosses_boundary(work.block, n_block)) mask.apply(scores, coords, work.block, n_block);
        scores_to_probabilities(scores, lse_log2, params.softmax_scale_log2);
        warpgroup_wait<0>();  // dP is ready
        shared.pipeline_v.consumer_release(shared.v_state);
        ++shared.v_state;
        // Q and dO are free once the tile's last S and dP are done: the next tile's load overlaps
        // the last dQ GEMM and the epilogue.
        if (i == num_blocks - 1) storage.qdo_empty.arrive();
        Transform::dp_to_ds(dS, scores, dpsum, lse_log2, params.softmax_scale_log2);
      }
      convert_into(tdPrdP, tdQrdS);
      warpgroup_gemm<false, -1>(tiled_mma_dq, tdQrdS, tdQrKt(_, _, _, shared.k_state.index()), tdQrdQ);
      if constexpr (kStagesK == 1) {  // the only K stage: the next block's K loads once it is free
        warpgroup_wait<0>();
        shared.pipeline_k.consumer_release(shared.k_state);
      }
      pipe_k_previous = shared.k_state;
      ++shared.k_state;
    }
    warpgroup_wait<0>();
    if constexpr (kStagesK > 1) shared.pipeline_k.consumer_release(pipe_k_previous);
  }
};

}  // namespace flashhopper::hopper
