// Backward mainloop for one key block: the producer's TMA loads (K and V once, Q and dO per
// query block through rings of kStages and kStagesDo stages, each stage with its rows' LSE or D),
// the MMA warpgroups' five GEMMs per query block, and the dQ writer warp that adds each block's
// partial dQ to the float32 dQaccum.
//
// Per query block m (rows of Q, dO; the CTA's kBlockN keys are the columns):
//   S = Q K^T, dP = dO V^T               split by key columns between the warpgroups;
//                                        kSdPByOperand: S in warpgroup 0, dP in warpgroup 1
//   P = exp2(S * scale * log2 e - LSE2)  LSE2 = LSE * log2 e, +inf for rows that see no key
//   dS = P * (dP - D)                    D = rowsum(dO * O), from the preprocess kernel
//   dV += P^T dO, dK += dS^T Q           P and dS go through shared memory (transposed reads);
//                                        kDkvTransposed: dV^T += dO^T P, dK^T += Q^T dS;
//                                        kSdPTransposed: S^T and dP^T computed, keys as rows, so
//                                        P^T and dS^T are dV's and dK's operands in registers
//   dQ_m = dS K                          split by head dim; added to dQaccum (scale applied later).
//                                        kComputeDq = false: not computed (the dQ kernel does it)
#pragma once

#include <cmath>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/cutlass.h>
#include <cutlass/fast_math.h>
#include <cutlass/gemm/collective/builders/sm90_common.inl>
#include <cutlass/pipeline/pipeline.hpp>

#include "hopper/common/backward_block.hpp"
#include "hopper/common/gmma_shapes.hpp"
#include "hopper/common/mask.hpp"
#include "hopper/common/named_barrier.hpp"
#include "hopper/common/score_transform.hpp"
#include "hopper/common/softmax.hpp"
#include "hopper/common/tile_scheduler.hpp"
#include "hopper/common/utils.hpp"
#include "hopper/common/workspace_rows.hpp"

namespace flashhopper::hopper {

using namespace cute;

CUTLASS_DEVICE void bulk_reduce_add_f32(float* gmem, float const* smem, int bytes) {
  const uint32_t smem_addr = cute::cast_smem_ptr_to_uint(smem);
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(gmem),
               "r"(smem_addr), "r"(bytes)
               : "memory");
}

// The dK and dV GEMMs' atom: P^T or dS^T (A) from registers, or both operands read transposed
// (MN-major) from shared memory.
template <class Element, class TileShape, bool kAInRegisters>
constexpr auto key_grad_gmma() {
  if constexpr (kAInRegisters) {
    return GMMA::rs_op_selector<Element, Element, float, TileShape, GMMA::Major::K, GMMA::Major::MN>();
  } else {
    return ss_gmma<Element, TileShape, GMMA::Major::MN, GMMA::Major::MN>();
  }
}

template <class Element_, int kBlockM_, int kBlockN_, int kHeadDim_, int kHeadDimV_, int kStages_, int kStagesDo_,
          MaskKind kMask_, bool kSoftcap_, bool kComputeDq_, bool kPacked_, bool kSdPByOperand_ = false,
          bool kSdPTransposed_ = false>
struct BackwardMainloop {
  using Element = Element_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kHeadDim = kHeadDim_;    // Q, K, dQ, dK
  static constexpr int kHeadDimV = kHeadDimV_;  // V, dO, dV (MLA prefill: 128 under a head dim of 192)
  static constexpr int kStages = kStages_;      // Q
  static constexpr int kStagesDo = kStagesDo_;  // dO
  static constexpr MaskKind kMask = kMask_;
  static constexpr bool kCausal = kMask == MaskKind::kCausal;
  using Mask = AttentionMask<kBlockM_, kBlockN_, kMask_>;
  using Transform = ScoreTransform<kSoftcap_>;
  // true: each query block's partial dQ goes to dQaccum through one shared float32 buffer and the
  // dQ writer warp's TMA bulk reduce-add. false: dK and dV only; dQ comes from the dQ kernel
  // (BackwardDqMainloop).
  static constexpr bool kComputeDq = kComputeDq_;
  // Packed batches (cu_seqlens, seqused) and their planned tiles; compiled out of the dense
  // kernels, to which they cost spills (bench/RESULTS.md, "The backward against 11-30").
  static constexpr bool kPacked = kPacked_;
  static constexpr int kNumMmaWarpGroups = 2;
  static constexpr int kNumMmaThreads = kNumMmaWarpGroups * cutlass::NumThreadsPerWarpGroup;
  // dK/dV split by key rows while each warpgroup still gets a 64-row WGMMA; else the
  // warpgroups compute dK^T and dV^T (rows: head dim), which takes any kBlockN as the WGMMA's N,
  // and split those by head dim in 64-row atoms where d has an even count of them, else by key
  // columns (hdim 192: each warpgroup then takes every head-dim row of the keys it scored).
  static constexpr bool kDkvTransposed = kBlockN / kNumMmaWarpGroups < 64;
  // dV splits as dK does (dK's head dim decides), so P and dS share their layout and buffers.
  static constexpr bool kDkvSplitByKeys = kDkvTransposed && kHeadDim % (64 * kNumMmaWarpGroups) != 0;
  // The tile's choice (BackwardTileSize::kSdPByOperand): S and dP split by key columns leave each
  // warpgroup kBlockN / 2 (16 at head dim 512's 32-key blocks: a WGMMA that narrow reads 2.5 KiB of
  // shared memory a 64 x 16 x 16 step, more per FLOP than the tensor cores can use); by operand,
  // warpgroup 0 computes S and warpgroup 1 dP, each whole, and P crosses to warpgroup 1 in float32
  // through shared memory (p_exchange) for dS.
  static constexpr bool kSdPByOperand = kSdPByOperand_;
  // The tile's choice (BackwardTileSize::kSdPTransposed): S^T = K Q^T and dP^T = V dO^T, the keys
  // as the WGMMA's M, split between the warpgroups as dK's and dV's rows are. P^T and dS^T are then
  // each warpgroup's register A operands of dV += P^T dO and dK += dS^T Q: P never goes to shared
  // memory and dS only once, stored transposed (so as dS) for dQ = dS K. The price: a thread holds
  // kBlockM / 4 query columns, so as many LSE2 and D values (2 rows otherwise); masks bound its
  // few keys' rows (Mask::apply_by_key), not each row's keys. Windows too (3-5% faster than
  // untransposed, bench/RESULTS.md, 2026-12-07 evening), with softcap as well since their row
  // values stay in shared memory (below; in registers its loop's local traffic doubled, 29 -> 70).
  static constexpr bool kSdPTransposed = kSdPTransposed_;
  // Transposed, a thread's S^T and dP^T hold kBlockM / 4 query columns, each with its LSE2 and D.
  // With 128-row blocks those would be 64 registers beside S^T and dP^T's 128 (they spilled), so
  // they stay in their shared stages and are read where used; so too under a window, whose mask
  // bounds take registers (hdim 128's 64-row blocks: window 26 -> 0 local operations in the loop,
  // packed 68 -> 4, with softcap 29 -> 0 and 56 -> 0); elsewhere with 64-row blocks, in registers.
  static constexpr bool kRowValuesInSmem = kSdPTransposed && (kBlockM >= 128 || kMask_ == MaskKind::kLocal);
  static_assert(!kSdPTransposed || (!kSdPByOperand && !kDkvTransposed && kHeadDimV == kHeadDim));
  // The WGMMA's N of S and dP, a warpgroup's: query rows when transposed, else key columns.
  static constexpr int kSdPColumns =
      kSdPTransposed ? kBlockM : (kSdPByOperand ? kBlockN : kBlockN / kNumMmaWarpGroups);
  static_assert(!(kSdPByOperand && kDkvSplitByKeys), "split by keys reads only the P and dS columns a warpgroup wrote");
  static constexpr int kDqTileFloats = kBlockM * kHeadDim;
  static_assert(kBlockM % 64 == 0 && kBlockN % 16 == 0 && kHeadDim % 32 == 0);  // d: whole 32-column atoms
  static_assert(kHeadDimV <= kHeadDim && kHeadDimV % 32 == 0 &&
                (kHeadDimV == kHeadDim || kDkvSplitByKeys || kHeadDimV % (64 * kNumMmaWarpGroups) == 0));
  static_assert((kDqTileFloats / kNumMmaThreads) % 4 == 0);

  // S = Q K^T is (M, N) over d, dP = dO V^T (M, N) over dv: one tiled MMA (its atom is 16 deep).
  using TileShapeSdP = Shape<Int<kBlockM>, Int<kBlockN>, Int<kHeadDim>>;  // (M, N, d)
  // The S and dP accumulators' tile: (M, N), or (N, M) when transposed.
  using ScoreTileShape =
      cute::conditional_t<kSdPTransposed, Shape<Int<kBlockN>, Int<kBlockM>>, Shape<Int<kBlockM>, Int<kBlockN>>>;
  // dK (N, d, M) or dK^T (d, N, M); dV likewise with dv columns.
  template <int kCols>
  using TileShapeKeyGrad = cute::conditional_t<kDkvTransposed, Shape<Int<kCols>, Int<kBlockN>, Int<kBlockM>>,
                                               Shape<Int<kBlockN>, Int<kCols>, Int<kBlockM>>>;
  using TileShapedK = TileShapeKeyGrad<kHeadDim>;
  using TileShapedV = TileShapeKeyGrad<kHeadDimV>;
  using TileShapedQ = Shape<Int<kBlockM>, Int<kHeadDim>, Int<kBlockN>>;  // (M, d, N)

  using TiledMmaSdP = decltype(make_tiled_mma(
      ss_gmma<Element, Shape<_64, Int<kSdPColumns>, Int<kHeadDim>>>(),
      Layout<Shape<Int<kSdPTransposed ? 2 : 1>, Int<kSdPByOperand || kSdPTransposed ? 1 : 2>, _1>>{}));
  // dV = P^T dO and dK = dS^T Q (or dV^T = dO^T P and dK^T = Q^T dS) read both operands
  // transposed (MN-major) from shared memory, or P^T and dS^T from registers (kSdPTransposed); the
  // warpgroups split the result's rows.
  template <class TileShape>
  static constexpr int kKeyGradMmaN =
      kDkvSplitByKeys ? kBlockN / kNumMmaWarpGroups : int(cute::tuple_element_t<1, TileShape>::value);
  template <class TileShape>
  using TiledMmaKeyGrad = decltype(make_tiled_mma(
      key_grad_gmma<Element, Shape<_64, Int<kKeyGradMmaN<TileShape>>, Int<kBlockM>>, kSdPTransposed>(),
      cute::conditional_t<kDkvSplitByKeys, Layout<Shape<_1, _2, _1>>, Layout<Shape<_2, _1, _1>>>{}));
  using TiledMmadK = TiledMmaKeyGrad<TileShapedK>;
  using TiledMmadV = TiledMmaKeyGrad<TileShapedV>;
  using TiledMmadQ = decltype(make_tiled_mma(
      ss_gmma<Element, Shape<_64, Int<kHeadDim / 2>, Int<kBlockN>>, GMMA::Major::K, GMMA::Major::MN>(),
      Layout<Shape<_1, _2, _1>>{}));
  static_assert(gmma_n<TiledMmaSdP> == kSdPColumns && gmma_n<TiledMmadK> == kKeyGradMmaN<TileShapedK> &&
                    gmma_n<TiledMmadV> == kKeyGradMmaN<TileShapedV> && gmma_n<TiledMmadQ> == kHeadDim / 2,
                FLASHHOPPER_GMMA_SPAN_MESSAGE);
  static constexpr bool kUsesExtendedGmma = uses_extended_gmma<TiledMmaSdP, TiledMmadK, TiledMmadV, TiledMmadQ>;

  // Q (M, d, stage) and dO (M, dv, stage), columns contiguous; their transposes view the same
  // bytes as (d, M, stage).
  template <int kCols, int kNumStages>
  using SmemLayoutRowStages = decltype(tile_to_shape(
      cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::K, Element, Int<kBlockM>, Int<kCols>>(),
      Shape<Int<kBlockM>, Int<kCols>, Int<kNumStages>>{}));
  template <int kCols, int kNumStages>
  using SmemLayoutRowStagesT = decltype(composition(
      SmemLayoutRowStages<kCols, kNumStages>{}, make_layout(Shape<Int<kCols>, Int<kBlockM>, Int<kNumStages>>{},
                                                            Stride<Int<kBlockM>, _1, Int<kBlockM * kCols>>{})));
  using SmemLayoutQ = SmemLayoutRowStages<kHeadDim, kStages>;
  using SmemLayoutQt = SmemLayoutRowStagesT<kHeadDim, kStages>;
  using SmemLayoutdO = SmemLayoutRowStages<kHeadDimV, kStagesDo>;
  using SmemLayoutdOt = SmemLayoutRowStagesT<kHeadDimV, kStagesDo>;
  // K and V: (N, d), d contiguous; K^T (d, N) for dQ = dS K, whose warpgroups read d/2 columns
  // each: the swizzle atom must tile that half too. Where d is a multiple of 64 the 64-column
  // (128-byte) atom does (a half fills or halves it); at d = 96 a half is 48 columns, which takes
  // 16-column (32-byte) atoms.
  static constexpr int kKAtomCols = kHeadDim % 64 == 0 ? kHeadDim : kHeadDim / kNumMmaWarpGroups;
  using SmemLayoutK = decltype(tile_to_shape(
      cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::K, Element, Int<kBlockN>, Int<kKAtomCols>>(),
      Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  using SmemLayoutKt = decltype(composition(
      SmemLayoutK{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockN>>{}, Stride<Int<kBlockN>, _1>{})));
  // V: (N, dv), only ever read as dP's K-major B operand.
  using SmemLayoutV = cute::conditional_t<
      kHeadDimV == kHeadDim, SmemLayoutK,
      decltype(tile_to_shape(
          cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::K, Element, Int<kBlockN>, Int<kHeadDimV>>(),
          Shape<Int<kBlockN>, Int<kHeadDimV>>{}))>;
  // P and dS: (M, N, buffer), N contiguous; transposed (N, M, buffer) for dV and dK. When a
  // warpgroup's kSdPColumns do not fill whole 16-column swizzle atoms (kBlockN = 80), the
  // unswizzled 8x8 atom; split by key columns, atoms no wider than a warpgroup's columns (its
  // dK/dV GEMM's B operand starts there). dS has two buffers, so that one warpgroup may write block
  // m + 1's while the other still reads block m's for dQ. P needs only one when dV is split by key
  // rows or key columns: each warpgroup then reads just the P columns it wrote itself, and its dV
  // GEMM is done before it writes the next block's.
  static constexpr int kPBuffers = kDkvTransposed && !kDkvSplitByKeys ? 2 : 1;
  static constexpr bool kPdSSwizzled = kSdPColumns % 16 == 0;
  static constexpr int kPdSAtomColumns = kDkvSplitByKeys ? kBlockN / kNumMmaWarpGroups : kBlockN;
  using SmemLayoutAtomPdS =
      cute::conditional_t<kPdSSwizzled,
                          decltype(cutlass::gemm::collective::detail::ss_smem_selector<
                                   GMMA::Major::K, Element, Int<kBlockM>, Int<kPdSAtomColumns>>()),
                          GMMA::Layout_K_INTER_Atom<Element>>;
  template <int kBuffers>
  using SmemLayoutPdSBuffers =
      decltype(tile_to_shape(SmemLayoutAtomPdS{}, Shape<Int<kBlockM>, Int<kBlockN>, Int<kBuffers>>{}));
  template <int kBuffers>
  using SmemLayoutPdStBuffers = decltype(composition(
      SmemLayoutPdSBuffers<kBuffers>{},
      make_layout(Shape<Int<kBlockN>, Int<kBlockM>, Int<kBuffers>>{}, Stride<Int<kBlockM>, _1, Int<kBlockM * kBlockN>>{})));
  using SmemLayoutP = SmemLayoutPdSBuffers<kPBuffers>;
  using SmemLayoutPt = SmemLayoutPdStBuffers<kPBuffers>;
  using SmemLayoutdS = SmemLayoutPdSBuffers<2>;
  using SmemLayoutdSt = SmemLayoutPdStBuffers<2>;
  // stmatrix: four 8x8 matrices a warp where the columns allow, else two; transposed (dS^T's
  // accumulator into dS's buffer) with kSdPTransposed.
  using SmemCopyAtomPdS = Copy_Atom<
      cute::conditional_t<kSdPTransposed, SM90_U16x8_STSM_T,
                          cute::conditional_t<kPdSSwizzled, SM90_U32x4_STSM_N, SM90_U32x2_STSM_N>>,
      Element>;

  // Global tensors as (seqlen, d, head, batch).
  using ShapeQKV = Shape<int32_t, int32_t, int32_t, int32_t>;
  using StrideQKV = Stride<int64_t, _1, int64_t, int64_t>;
  template <int kRows, int kCols, class SmemLayout>
  using TileTma = decltype(make_tile_tma<kRows, kCols>(static_cast<Element const*>(nullptr), ShapeQKV{}, StrideQKV{},
                                                       SmemLayout{}));
  using TmaQ = TileTma<kBlockM, kHeadDim, decltype(take<0, 2>(SmemLayoutQ{}))>;
  using TmaDo = TileTma<kBlockM, kHeadDimV, decltype(take<0, 2>(SmemLayoutdO{}))>;
  using TmaK = TileTma<kBlockN, kHeadDim, SmemLayoutK>;
  using TmaV = TileTma<kBlockN, kHeadDimV, SmemLayoutV>;

  using Pipeline = cutlass::PipelineTmaAsync<kStages>;
  using PipelineState = cutlass::PipelineState<kStages>;
  using PipelineDo = cutlass::PipelineTmaAsync<kStagesDo>;
  using PipelineStateDo = cutlass::PipelineState<kStagesDo>;
  // Each Q stage also brings its rows' LSE * log2 e, each dO stage their D, by a bulk copy on the
  // same barrier: the MMA warpgroups then read them from shared memory. (Loaded from global
  // memory by the warpgroups themselves, they were the largest stall at hdim 64 and 256.)
  static constexpr uint32_t kRowStatBytes = kBlockM * sizeof(float);
  static constexpr uint32_t kTmaBytesQStage = kBlockM * kHeadDim * sizeof(Element) + kRowStatBytes;
  static constexpr uint32_t kTmaBytesDoStage = kBlockM * kHeadDimV * sizeof(Element) + kRowStatBytes;
  static constexpr uint32_t kTmaBytesKV = (cosize_v<SmemLayoutK> + cosize_v<SmemLayoutV>) * sizeof(Element);

  struct SharedStorageDq {
    cute::array_aligned<float, kDqTileFloats, 128> smem_dq;
  };
  struct SharedStorage {
    cute::array_aligned<Element, cosize_v<SmemLayoutK>, 1024> smem_k;
    cute::array_aligned<Element, cosize_v<SmemLayoutV>, 1024> smem_v;
    cute::array_aligned<Element, cosize_v<SmemLayoutQ>, 1024> smem_q;
    cute::array_aligned<Element, cosize_v<SmemLayoutdO>, 1024> smem_do;
    cute::array_aligned<float, kBlockM * kStages, 128> smem_lse_log2;  // per Q stage
    cute::array_aligned<float, kBlockM * kStagesDo, 128> smem_dpsum;   // per dO stage
    cute::conditional_t<kSdPTransposed, cute::array<Element, 0>,
                        cute::array_aligned<Element, cosize_v<SmemLayoutP>, 1024>>
        smem_p;  // none with kSdPTransposed
    cute::array_aligned<Element, cosize_v<SmemLayoutdS>, 1024> smem_ds;
    cute::conditional_t<kComputeDq, SharedStorageDq, cute::array<float, 0>> dq;
    cutlass::arch::ClusterTransactionBarrier kv_full;
    cutlass::arch::ClusterBarrier kv_empty;
    typename Pipeline::SharedStorage pipeline_q;
    typename PipelineDo::SharedStorage pipeline_do;
    TileRing tiles;  // packed batches: the hand-off of the tiles a CTA takes (tile_scheduler.hpp)
    // kSdPByOperand: warpgroup 0's P, a thread's kBlockM * kBlockN / 128 floats strided by 128.
    // Last, so that the other kernels' layout is the same with or without it.
    cute::conditional_t<kSdPByOperand, cute::array_aligned<float, kBlockM * kBlockN, 128>, cute::array<float, 0>>
        p_exchange;
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
    float softmax_scale;
    float softcap;          // > 0 only with kSoftcap
    LocalMaskParams local;  // kLocal only
    BackwardWorkspacePointers workspace;
    bool deterministic;
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
    float softmax_scale_log2;  // after the score transform
    Transform transform;
    LocalMaskParams local;
    BackwardWorkspacePointers workspace;
    int heads_per_kv_head;
    bool deterministic;
    SeqlenParams seqlen;
  };

  static Params to_underlying_arguments(Arguments const& args) {
    const ShapeQKV shape_v = with_columns(args.shape_k, args.head_dim_v);
    const ShapeQKV shape_do = with_columns(args.shape_q, args.head_dim_v);
    return {args.shape_q,
            args.shape_k,
            shape_v,
            shape_do,
            make_tile_tma<kBlockM, kHeadDim>(args.ptr_q, args.shape_q, args.stride_q, take<0, 2>(SmemLayoutQ{})),
            make_tile_tma<kBlockM, kHeadDimV>(args.ptr_do, shape_do, args.stride_do, take<0, 2>(SmemLayoutdO{})),
            make_tile_tma<kBlockN, kHeadDim>(args.ptr_k, args.shape_k, args.stride_k, SmemLayoutK{}),
            make_tile_tma<kBlockN, kHeadDimV>(args.ptr_v, shape_v, args.stride_v, SmemLayoutV{}),
            float(Transform::softmax_scale(args.softmax_scale, args.softcap) * M_LOG2E),
            Transform::make(args.softmax_scale, args.softcap),
            args.local,
            args.workspace,
            get<2>(args.shape_q) / get<2>(args.shape_k),
            args.deterministic,
            args.seqlen};
  }

  CUTLASS_DEVICE static void prefetch_tma_descriptors(Params const& params) {
    cute::prefetch_tma_descriptor(params.tma_q.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_do.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_k.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_v.get_tma_descriptor());
  }

  CUTLASS_DEVICE static SeqlenInfo seqlen_info(Params const& params, int batch) {
    return SeqlenInfo::make</*kKvCache=*/false, kPacked>(params.seqlen, batch);
  }
  CUTLASS_DEVICE static Mask make_mask(Params const& params, SeqlenInfo const& seq) {
    return Mask(seq, params.local);
  }

  // An S or dP accumulator (or its coordinates) as (query rows, key columns), whichever way round
  // the WGMMA computed it.
  template <class Layout>
  CUTLASS_DEVICE static auto scores_rowcol(Layout acc) {
    auto rowcol = accumulator_rowcol(acc);
    if constexpr (kSdPTransposed) return make_layout(get<1>(rowcol), get<0>(rowcol));
    else return rowcol;
  }

  // A thread's LSE2 or D values, read from their shared stage where used (kRowValuesInSmem):
  // index m is the thread's m-th row of the scores' (rows, cols) view, as a register array's.
  template <class Coords>
  struct RowValuesInSmem {
    float const* stage;
    Coords const& coords;
    CUTLASS_DEVICE float operator[](int m) const { return stage[get<0>(coords(m, 0))]; }
  };
  template <class Coords>
  CUTLASS_DEVICE static RowValuesInSmem<Coords> row_values_in_smem(float const* stage, Coords const& coords) {
    return {stage, coords};
  }

  // The i-th query block of key block blk's walk (the mask's order, Mask::for_each_query_block's).
  CUTLASS_DEVICE static int query_block_at(BackwardBlock const& blk, int i) {
    return Mask::query_block_at(blk.m_block_min, blk.m_block_max, i);
  }


  // What the producer and the MMA warpgroups share besides the parameters, as one role sees it:
  // the Q and dO pipelines with its place in each (write states for the producer, read states
  // for the MMA warpgroups), the shared storage, and the phase of the K/V barrier it waits on
  // (kv_empty for the producer, kv_full for the MMA warpgroups). The kernel binds one per role.
  struct SharedState {
    Pipeline& pipeline_q;
    PipelineDo& pipeline_do;
    PipelineState& q_state;
    PipelineStateDo& do_state;
    SharedStorage& storage;
    int& kv_phase;
  };

  // Producer (one thread): K and V once, after the previous block's consumers let go of them;
  // then Q and dO of each query block of each query head of the group, in the consumers' order,
  // with the block's LSE and D rows.
  CUTLASS_DEVICE static void load(Params const& params, SharedState const& shared, BackwardBlock const& blk) {
    SharedStorage& storage = shared.storage;
    Tensor sQ = make_tensor(make_smem_ptr(storage.smem_q.data()), SmemLayoutQ{});
    Tensor sdO = make_tensor(make_smem_ptr(storage.smem_do.data()), SmemLayoutdO{});
    Tensor sK = make_tensor(make_smem_ptr(storage.smem_k.data()), SmemLayoutK{});
    Tensor sV = make_tensor(make_smem_ptr(storage.smem_v.data()), SmemLayoutV{});

    auto key_tile = [&](auto const& tma, ShapeQKV const& shape, auto cols) {
      auto m = domain_offset(make_coord(blk.seq.offset_k, _0{}),
                             tma.get_tma_tensor(shape)(_, _, blk.head_kv, blk.seq.batch_k));
      return local_tile(m, Shape<Int<kBlockN>, decltype(cols)>{}, make_coord(blk.n_block, _0{}));  // (N, cols)
    };
    auto [tKgK, tKsK] = tma_partition(params.tma_k, _0{}, Layout<_1>{}, group_modes<0, 2>(sK),
                                      group_modes<0, 2>(key_tile(params.tma_k, params.shape_k, Int<kHeadDim>{})));
    auto [tVgV, tVsV] = tma_partition(params.tma_v, _0{}, Layout<_1>{}, group_modes<0, 2>(sV),
                                      group_modes<0, 2>(key_tile(params.tma_v, params.shape_v, Int<kHeadDimV>{})));
    storage.kv_empty.wait(shared.kv_phase);
    shared.kv_phase ^= 1;
    storage.kv_full.arrive_and_expect_tx(kTmaBytesKV);
    copy(params.tma_k.with(reinterpret_cast<uint64_t&>(storage.kv_full)), tKgK, tKsK);
    copy(params.tma_v.with(reinterpret_cast<uint64_t&>(storage.kv_full)), tVgV, tVsV);

    for (int g = 0; g < params.heads_per_kv_head; ++g) {
      const int head = blk.head_kv * params.heads_per_kv_head + g;
      auto query_tiles = [&](auto const& tma, ShapeQKV const& shape, auto cols) {
        auto m = domain_offset(make_coord(blk.seq.offset_q, _0{}),
                               tma.get_tma_tensor(shape)(_, _, head, blk.seq.batch_q));
        return local_tile(m, Shape<Int<kBlockM>, decltype(cols)>{}, make_coord(_, _0{}));  // (M, cols, m)
      };
      auto [tQgQ, tQsQ] = tma_partition(params.tma_q, _0{}, Layout<_1>{}, group_modes<0, 2>(sQ),
                                        group_modes<0, 2>(query_tiles(params.tma_q, params.shape_q, Int<kHeadDim>{})));
      auto [tdOgdO, tdOsdO] =
          tma_partition(params.tma_do, _0{}, Layout<_1>{}, group_modes<0, 2>(sdO),
                        group_modes<0, 2>(query_tiles(params.tma_do, params.shape_do, Int<kHeadDimV>{})));
      const int64_t row0_head = params.workspace.row0(blk.seq, head);
      // One stage: a query block's tile (Q or dO) by TMA and its rows' statistic (LSE2 or D) by a
      // bulk copy, on the stage's barrier.
      auto load_stage = [&](auto& pipeline, auto& state, auto const& tma, auto const& gmem_tiles,
                            auto const& smem_stages, float const* row_stat, float* smem_row_stat, int m_block) {
        pipeline.producer_acquire(state);
        uint64_t* barrier = pipeline.producer_get_barrier(state);
        copy(tma.with(*barrier), gmem_tiles(_, m_block), smem_stages(_, state.index()));
        SM90_BULK_COPY_G2S::copy(row_stat, barrier, smem_row_stat + state.index() * kBlockM, kRowStatBytes);
        ++state;
      };
      for (int i = 0; i < blk.m_block_max - blk.m_block_min; ++i) {
        const int m_block = query_block_at(blk, i);
        const int64_t row0 = row0_head + int64_t(m_block) * kBlockM;  // padded rows: always in bounds
        load_stage(shared.pipeline_q, shared.q_state, params.tma_q, tQgQ, tQsQ, params.workspace.lse_log2 + row0,
                   storage.smem_lse_log2.data(), m_block);
        load_stage(shared.pipeline_do, shared.do_state, params.tma_do, tdOgdO, tdOsdO, params.workspace.dpsum + row0,
                   storage.smem_dpsum.data(), m_block);
      }
    }
  }

  // Deterministic mode: dQaccum of (batch, head, m_block) takes the partials of the key blocks
  // that visit it in key-block order; Mask::key_blocks_before says how many come before n_block
  // (all lower ones, but for a window's left bound). The scheduler hands lower key blocks of a
  // head out first, and every key block walks its query blocks in the same order, so the wait
  // always ends.
  CUTLASS_DEVICE static int* dq_semaphore(Params const& params, SeqlenInfo const& seq, int head, int m_block) {
    static_assert(BackwardWorkspacePointers::kRowAlign % kBlockM == 0);
    return params.workspace.dq_semaphore + params.workspace.row0(seq, head) / kBlockM + m_block;
  }
  CUTLASS_DEVICE static void wait_for_turn(int const* semaphore, int expected) {
    int seen;
    do {
      asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(seen) : "l"(semaphore) : "memory");
    } while (seen < expected);
  }

  // dQ writer warp and MMA warpgroups hand the shared dQ buffer back and forth through named
  // barriers of all of them: kDqFull (written) and kDqEmpty (read by the bulk reduce-add, may be
  // written again). The writer frees it once at the start and once after each add; the
  // warpgroups wait for it once more at the end.
  static constexpr int kDqBarrierThreads = kNumMmaThreads + cutlass::NumThreadsPerWarp;
  CUTLASS_DEVICE static void store_dq_start() {
    if constexpr (kComputeDq) named_barrier_arrive(kDqBarrierThreads, BwdBarrier::kDqEmpty0, 0);
  }
  CUTLASS_DEVICE static void mma_done() {
    if constexpr (kComputeDq) named_barrier_sync(kDqBarrierThreads, BwdBarrier::kDqEmpty0, 0);
  }

  // dQ writer warp: adds each query block's dQ tile, as the warpgroups finish it, to dQaccum
  // with one bulk reduce-add, then frees the buffer.
  CUTLASS_DEVICE static void store_dq(Params const& params, SharedStorage& storage, BackwardBlock const& blk) {
    if constexpr (kComputeDq) {
      const int lane = threadIdx.x % cutlass::NumThreadsPerWarp;
      const Mask mask = make_mask(params, blk.seq);
      for (int g = 0; g < params.heads_per_kv_head; ++g) {
        const int head = blk.head_kv * params.heads_per_kv_head + g;
        float* dq_head = params.workspace.dq_accum + params.workspace.row0(blk.seq, head) * kHeadDim;
        for (int i = 0; i < blk.m_block_max - blk.m_block_min; ++i) {
          const int m_block = query_block_at(blk, i);
          float* dq_tile = dq_head + int64_t(m_block) * kDqTileFloats;
          int* semaphore = dq_semaphore(params, blk.seq, head, m_block);
          // Deterministic: the turn is awaited while the warpgroups still compute the tile, so
          // that a turn already passed costs no round trip to L2 once the tile is ready.
          if (params.deterministic && lane == 0)
            wait_for_turn(semaphore, mask.key_blocks_before(m_block, blk.n_block));
          __syncwarp();  // the barrier below is warp-aligned
          named_barrier_sync(kDqBarrierThreads, BwdBarrier::kDqFull0, 0);
          if (lane == 0) {
            bulk_reduce_add_f32(dq_tile, storage.dq.smem_dq.data(), kDqTileFloats * sizeof(float));
            tma_store_arrive();
            tma_store_wait<0>();  // the add has read the buffer: it may be written again
          }
          __syncwarp();
          named_barrier_arrive(kDqBarrierThreads, BwdBarrier::kDqEmpty0, 0);
          if (params.deterministic && lane == 0) {
            // The add must have landed, not just been read, before the next key block's turn; the
            // warpgroups meanwhile write the next dQ tile into the freed buffer.
            asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
            asm volatile("fence.proxy.async.global;\n" ::: "memory");
            // Release: the add (made visible to the generic proxy above) comes before the count.
            // Lighter than __threadfence() and atomicAdd.
            asm volatile("red.release.gpu.global.add.s32 [%0], 1;\n" ::"l"(semaphore) : "memory");
          }
        }
      }
    }
  }

  CUTLASS_DEVICE static void store_dq_done() {
    if constexpr (kComputeDq) {
      if (threadIdx.x % cutlass::NumThreadsPerWarp == 0) asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
    }
  }

  // MMA warpgroups: the whole key block. On return tdKrdK (unscaled) and tdVrdV hold the sums.
  // dS (and P where kPBuffers = 2) alternates between two shared buffers (`buffer`, kept across
  // key blocks), so one warpgroup may write block m + 1's while the other still reads block m's.
  template <class TensordK, class TensordV>
  CUTLASS_DEVICE static void mma(Params const& params, SharedState const& shared, int& buffer, TensordK& tdKrdK,
                                 TensordV& tdVrdV, int thread_idx, BackwardBlock const& blk) {
    SharedStorage& storage = shared.storage;
    Tensor sQ = make_tensor(make_smem_ptr(storage.smem_q.data()), SmemLayoutQ{});
    Tensor sQt = make_tensor(make_smem_ptr(storage.smem_q.data()), SmemLayoutQt{});
    Tensor sdO = make_tensor(make_smem_ptr(storage.smem_do.data()), SmemLayoutdO{});
    Tensor sdOt = make_tensor(make_smem_ptr(storage.smem_do.data()), SmemLayoutdOt{});
    Tensor sK = make_tensor(make_smem_ptr(storage.smem_k.data()), SmemLayoutK{});
    Tensor sKt = make_tensor(make_smem_ptr(storage.smem_k.data()), SmemLayoutKt{});
    Tensor sV = make_tensor(make_smem_ptr(storage.smem_v.data()), SmemLayoutV{});
    Tensor sP = make_tensor(make_smem_ptr(storage.smem_p.data()), SmemLayoutP{});
    Tensor sPt = make_tensor(make_smem_ptr(storage.smem_p.data()), SmemLayoutPt{});
    Tensor sdS = make_tensor(make_smem_ptr(storage.smem_ds.data()), SmemLayoutdS{});
    Tensor sdSt = make_tensor(make_smem_ptr(storage.smem_ds.data()), SmemLayoutdSt{});

    TiledMmaSdP tiled_mma_sdp;
    TiledMmadK tiled_mma_dk;
    TiledMmadV tiled_mma_dv;
    TiledMmadQ tiled_mma_dq;
    const int warp_group = thread_idx / cutlass::NumThreadsPerWarpGroup;
    const int thread_in_group = thread_idx % cutlass::NumThreadsPerWarpGroup;
    // kSdPByOperand: each warpgroup runs TiledMmaSdP (one warpgroup's) whole, on its own operands.
    const int sdp_thread = kSdPByOperand ? thread_in_group : thread_idx;
    auto thr_mma_sdp = tiled_mma_sdp.get_thread_slice(sdp_thread);
    auto thr_mma_dk = tiled_mma_dk.get_thread_slice(thread_idx);
    auto thr_mma_dv = tiled_mma_dv.get_thread_slice(thread_idx);
    auto thr_mma_dq = tiled_mma_dq.get_thread_slice(thread_idx);

    // S's and dP's operands: the query rows' (Q, dO: x, x, MMA_K, PIPE) and the keys' (K, V) as A
    // and B, or as B and A when transposed; sdp_gemm puts them in order.
    auto sdp_operand = [&](auto const& s, auto is_keys) {
      if constexpr (decltype(is_keys)::value == kSdPTransposed) return thr_mma_sdp.partition_fragment_A(s);
      else return thr_mma_sdp.partition_fragment_B(s);
    };
    Tensor tSrQ = sdp_operand(sQ, cute::false_type{});
    Tensor tSrK = sdp_operand(sK, cute::true_type{});
    Tensor tdPrdO = sdp_operand(sdO, cute::false_type{});
    Tensor tdPrV = sdp_operand(sV, cute::true_type{});
    auto sdp_gemm = [&](auto const& rows, auto const& keys, auto& acc) {
      if constexpr (kSdPTransposed) warpgroup_gemm</*kZeroInit=*/true, /*kWait=*/-1>(tiled_mma_sdp, keys, rows, acc);
      else warpgroup_gemm</*kZeroInit=*/true, /*kWait=*/-1>(tiled_mma_sdp, rows, keys, acc);
    };
    // dV's and dK's operands: P^T, dS^T (x, M, BUF) and dO^T, Q^T (x, M, PIPE), each as the A or
    // the B of TiledMmadV / TiledMmadK; gemm_key_grad puts them in order.
    auto key_grad_operand = [&](auto const& thr_mma, auto const& s, auto is_a) {
      if constexpr (decltype(is_a)::value) return thr_mma.partition_fragment_A(s);
      else return thr_mma.partition_fragment_B(s);
    };
    // (P^T and dS^T from shared memory only where not transposed: in registers otherwise.)
    auto pds_operand = [&](auto const& thr_mma, auto const& s) {
      if constexpr (kSdPTransposed) return 0;
      else return key_grad_operand(thr_mma, s, cute::bool_constant<!kDkvTransposed>{});
    };
    auto tdVrPt = pds_operand(thr_mma_dv, sPt);
    Tensor tdVrdOt = key_grad_operand(thr_mma_dv, sdOt, cute::bool_constant<kDkvTransposed>{});
    auto tdKrdSt = pds_operand(thr_mma_dk, sdSt);
    Tensor tdKrQt = key_grad_operand(thr_mma_dk, sQt, cute::bool_constant<kDkvTransposed>{});
    auto gemm_key_grad = [&](auto& tiled_mma, auto const& pds, auto const& qdo, auto& acc) {
      if constexpr (kDkvTransposed) warpgroup_gemm<false, -1>(tiled_mma, qdo, pds, acc);
      else warpgroup_gemm<false, -1>(tiled_mma, pds, qdo, acc);
    };
    // dQ's operands, only where this kernel computes dQ (TiledMmadQ's split of d needs it).
    auto dq_operands = [&] {
      if constexpr (kComputeDq) {
        return cute::make_tuple(thr_mma_dq.partition_fragment_A(sdS),   // (MMA, MMA_M, MMA_N, BUF)
                                thr_mma_dq.partition_fragment_B(sKt));  // (MMA, MMA_d, MMA_N)
      } else {
        return cute::make_tuple(0, 0);
      }
    }();

    auto smem_tiled_copy_pds = make_tiled_copy_C(SmemCopyAtomPdS{}, tiled_mma_sdp);
    auto smem_copy_pds = smem_tiled_copy_pds.get_thread_slice(sdp_thread);
    auto tPsP = [&] {  // (CPY, CPY_M, CPY_N, BUF); no P buffer when transposed
      if constexpr (kSdPTransposed) return 0;
      else return smem_copy_pds.partition_D(sP);
    }();
    // dS^T's accumulator goes into dS's buffer through its transposed view.
    Tensor tdSsdS = smem_copy_pds.partition_D([&] {
      if constexpr (kSdPTransposed) return sdSt;
      else return sdS;
    }());

    // Each accumulator value's (query row, key column) in the tile, viewed as the scores are.
    Tensor tScS = thr_mma_sdp.partition_C([] {
      if constexpr (kSdPTransposed) {  // a (key, query) tile whose values read (query, key)
        return make_coord_tensor(make_layout(Shape<Int<kBlockN>, Int<kBlockM>>{}, Stride<E<1>, E<0>>{}));
      } else {
        return make_identity_tensor(ScoreTileShape{});
      }
    }());
    Tensor coords = make_tensor(tScS.data(), scores_rowcol(tScS.layout()));  // (rows, cols)
    constexpr int kRows = decltype(size<0>(coords))::value;
    const Mask mask = make_mask(params, blk.seq);

    clear(tdKrdK);
    clear(tdVrdV);
    storage.kv_full.wait(shared.kv_phase);
    shared.kv_phase ^= 1;

    for (int g = 0; g < params.heads_per_kv_head; ++g) {
      const int head = blk.head_kv * params.heads_per_kv_head + g;
      // Hands query block m_block's dQ to the dQ writer warp through the shared buffer (its
      // bulk reduce-add, in deterministic mode after this key block's turn).
      auto add_dq = [&](auto const& tdQrdQ) {
        if constexpr (kComputeDq) {
          static_assert(decltype(size(tdQrdQ))::value % 4 == 0);
          constexpr int kSteps = decltype(size(tdQrdQ))::value / 4;
          named_barrier_sync(kDqBarrierThreads, BwdBarrier::kDqEmpty0, 0);
          float* smem_dq = storage.dq.smem_dq.data();
          CUTLASS_PRAGMA_UNROLL
          for (int r = 0; r < kSteps; ++r) {
            *reinterpret_cast<float4*>(smem_dq + dq_accum_offset<kDqTileFloats>(warp_group, thread_in_group, r)) =
                make_float4(tdQrdQ(4 * r), tdQrdQ(4 * r + 1), tdQrdQ(4 * r + 2), tdQrdQ(4 * r + 3));
          }
          cutlass::arch::fence_view_async_shared();  // the bulk copy reads through the async proxy
          named_barrier_arrive(kDqBarrierThreads, BwdBarrier::kDqFull0, 0);
        }
      };
      // One query block. masked: whether it crosses a mask boundary or the key padding, as a
      // compile-time constant (causal) or a run-time bool (the others).
      // (cute::Tensor spelled out: in a generic lambda, flashhopper::Tensor would be found.)
      auto step = [&](int m_block, auto masked) {
        cute::Tensor tSrS = partition_fragment_C(tiled_mma_sdp, ScoreTileShape{});
        cute::Tensor tdPrdP = partition_fragment_C(tiled_mma_sdp, ScoreTileShape{});
        // S -> P in place: the transform, the mask where this block needs it, the softmax.
        auto to_probabilities = [&](auto& scores, auto const& lse_log2) {
          params.transform.apply(scores);
          auto apply_mask = [&] {
            if constexpr (kSdPTransposed) mask.apply_by_key(scores, coords, m_block, blk.n_block);
            else mask.apply(scores, coords, m_block, blk.n_block);
          };
          if constexpr (cute::is_same_v<decltype(masked), bool>) {
            if (masked) apply_mask();
          } else if constexpr (decltype(masked)::value) {
            apply_mask();
          }
          scores_to_probabilities(scores, lse_log2, params.softmax_scale_log2);
        };
        // P or dS, float32 accumulator -> Element -> its shared buffer (the dK/dV GEMMs' operand).
        auto store_operand = [&](auto const& acc, auto&& smem) {
          cute::Tensor converted = make_tensor_like<Element>(acc);
          convert_into(acc, converted);
          copy(smem_tiled_copy_pds, smem_copy_pds.retile_S(converted), smem);
        };
        auto load_rows = [&](auto& rows, float const* smem_rows) {
          CUTLASS_PRAGMA_UNROLL
          for (int i = 0; i < kRows; ++i) rows[i] = smem_rows[get<0>(coords(i, 0))];
        };
        float lse_log2[kRows], dpsum[kRows];
        auto smem_lse_log2 = [&] { return storage.smem_lse_log2.data() + shared.q_state.index() * kBlockM; };
        shared.pipeline_q.consumer_wait(shared.q_state);
        if constexpr (kSdPTransposed) {
          // S^T and dP^T, then P^T and dS^T as dV's and dK's register A operands; dS^T also into
          // dS's buffer (transposed) for dQ, which alone needs both warpgroups' keys (the barrier).
          // P^T and dS^T are converted once both are done, so that no bf16 copy is live beside
          // the float32 ones (spills).
          const int q_stage = shared.q_state.index();
          sdp_gemm(tSrQ(_, _, _, q_stage), descriptors_per_use(tSrK), tSrS);
          if constexpr (!kRowValuesInSmem) load_rows(lse_log2, smem_lse_log2());
          shared.pipeline_do.consumer_wait(shared.do_state);
          const int do_stage = shared.do_state.index();
          sdp_gemm(tdPrdO(_, _, _, do_stage), descriptors_per_use(tdPrV), tdPrdP);
          warpgroup_wait<1>();  // S^T is ready
          cute::Tensor scores = make_tensor(tSrS.data(), scores_rowcol(tSrS.layout()));
          cute::Tensor dS = make_tensor(tdPrdP.data(), scores.layout());
          if constexpr (kRowValuesInSmem) {
            const auto smem_lse = row_values_in_smem(smem_lse_log2(), coords);
            to_probabilities(scores, smem_lse);
            warpgroup_wait<0>();  // dP^T is ready
            Transform::dp_to_ds(dS, scores, row_values_in_smem(storage.smem_dpsum.data() + do_stage * kBlockM, coords),
                                smem_lse, params.softmax_scale_log2);
          } else {
            to_probabilities(scores, lse_log2);
            load_rows(dpsum, storage.smem_dpsum.data() + do_stage * kBlockM);  // after: kRows registers
            warpgroup_wait<0>();  // dP^T is ready
            // Softcap's dS reads LSE2 again: loaded anew rather than kept across dP's wait.
            if constexpr (Transform::kSoftcap) load_rows(lse_log2, smem_lse_log2());
            Transform::dp_to_ds(dS, scores, dpsum, lse_log2, params.softmax_scale_log2);
          }
          cute::Tensor rPt = make_tensor_like<Element>(tSrS);
          cute::Tensor rdSt = make_tensor_like<Element>(tdPrdP);
          convert_into(tSrS, rPt);
          convert_into(tdPrdP, rdSt);
          copy(smem_tiled_copy_pds, smem_copy_pds.retile_S(rdSt), tdSsdS(_, _, _, buffer));
          auto tdVrP = make_tensor(rPt.data(), accumulator_as_a_operand(rPt.layout()));
          auto tdKrdS = make_tensor(rdSt.data(), accumulator_as_a_operand(rdSt.layout()));
          // dV first (frees dO soonest), then dQ, whose hand-off to the dQ writer overlaps dK.
          warpgroup_gemm<false, -1>(tiled_mma_dv, tdVrP, tdVrdOt(_, _, _, do_stage), tdVrdV);
          if constexpr (kComputeDq) {
            cutlass::arch::fence_view_async_shared();  // the tensor cores read dS through the async proxy
            named_barrier_sync(kNumMmaThreads, BwdBarrier::kPdS);
            cute::Tensor tdQrdQ = partition_fragment_C(tiled_mma_dq, select<0, 1>(TileShapedQ{}));
            warpgroup_gemm<true, -1>(tiled_mma_dq, get<0>(dq_operands)(_, _, _, buffer),
                                     descriptors_per_use(get<1>(dq_operands)), tdQrdQ);
            warpgroup_gemm<false, -1>(tiled_mma_dk, tdKrdS, tdKrQt(_, _, _, q_stage), tdKrdK);
            warpgroup_wait<2>();  // dV is done with dO and P^T
            warpgroup_fence_operand(rPt);
            shared.pipeline_do.consumer_release(shared.do_state);
            warpgroup_wait<1>();  // dQ
            add_dq(tdQrdQ);
          } else {
            warpgroup_gemm<false, -1>(tiled_mma_dk, tdKrdS, tdKrQt(_, _, _, q_stage), tdKrdK);
            warpgroup_wait<1>();  // dV is done with dO and P^T
            warpgroup_fence_operand(rPt);
            shared.pipeline_do.consumer_release(shared.do_state);
          }
          warpgroup_wait<0>();  // dK is done with Q and dS^T
          warpgroup_fence_operand(rdSt);
          shared.pipeline_q.consumer_release(shared.q_state);
          ++shared.do_state;
        } else {
          if constexpr (kSdPByOperand) {
            // P crosses from warpgroup 0 to 1 through p_exchange, which warpgroup 0 writes again only
            // after the kPdS barrier below, so after warpgroup 1 has read it.
            float* p_exchange = storage.p_exchange.data() + thread_in_group;
            constexpr int kStride = cutlass::NumThreadsPerWarpGroup;
            if (warp_group == 0) {
              warpgroup_gemm</*kZeroInit=*/true, /*kWait=*/-1>(tiled_mma_sdp, tSrQ(_, _, _, shared.q_state.index()),
                                                               descriptors_per_use(tSrK), tSrS);
              load_rows(lse_log2, smem_lse_log2());
              shared.pipeline_do.consumer_wait(shared.do_state);  // dO: dV's operand, below
              warpgroup_wait<0>();
              cute::Tensor scores = make_tensor(tSrS.data(), scores_rowcol(tSrS.layout()));
              to_probabilities(scores, lse_log2);
              CUTLASS_PRAGMA_UNROLL
              for (int i = 0; i < size(tSrS); ++i) p_exchange[i * kStride] = tSrS(i);
              named_barrier_arrive(kNumMmaThreads, BwdBarrier::kPExchange);
              store_operand(tSrS, tPsP(_, _, _, buffer % kPBuffers));
            } else {
              shared.pipeline_do.consumer_wait(shared.do_state);
              warpgroup_gemm<true, -1>(tiled_mma_sdp, tdPrdO(_, _, _, shared.do_state.index()),
                                       descriptors_per_use(tdPrV), tdPrdP);
              load_rows(lse_log2, smem_lse_log2());
              load_rows(dpsum, storage.smem_dpsum.data() + shared.do_state.index() * kBlockM);
              warpgroup_wait<0>();
              named_barrier_sync(kNumMmaThreads, BwdBarrier::kPExchange);
              cute::Tensor tSrP = make_tensor_like(tSrS);
              CUTLASS_PRAGMA_UNROLL
              for (int i = 0; i < size(tSrP); ++i) tSrP(i) = p_exchange[i * kStride];
              cute::Tensor probabilities = make_tensor(tSrP.data(), scores_rowcol(tSrP.layout()));
              cute::Tensor dS = make_tensor(tdPrdP.data(), probabilities.layout());
              Transform::dp_to_ds(dS, probabilities, dpsum, lse_log2, params.softmax_scale_log2);
              store_operand(tdPrdP, tdSsdS(_, _, _, buffer));
            }
          } else {
            sdp_gemm(tSrQ(_, _, _, shared.q_state.index()), descriptors_per_use(tSrK), tSrS);
            load_rows(lse_log2, smem_lse_log2());
            shared.pipeline_do.consumer_wait(shared.do_state);
            sdp_gemm(tdPrdO(_, _, _, shared.do_state.index()), descriptors_per_use(tdPrV), tdPrdP);
            load_rows(dpsum, storage.smem_dpsum.data() + shared.do_state.index() * kBlockM);
            warpgroup_wait<1>();  // S is ready
            cute::Tensor scores = make_tensor(tSrS.data(), accumulator_rowcol(tSrS.layout()));
            to_probabilities(scores, lse_log2);
            warpgroup_wait<0>();  // dP is ready
            cute::Tensor dS = make_tensor(tdPrdP.data(), scores.layout());
            Transform::dp_to_ds(dS, scores, dpsum, lse_log2, params.softmax_scale_log2);
            // Both converted, then both stored (not store_operand twice, which moves ptxas's schedule of
            // the hdim-128 kernels).
            cute::Tensor rP = make_tensor_like<Element>(tSrS);
            cute::Tensor rdS = make_tensor_like<Element>(tdPrdP);
            convert_into(tSrS, rP);
            convert_into(tdPrdP, rdS);
            const int p_buffer = buffer % kPBuffers;
            copy(smem_tiled_copy_pds, smem_copy_pds.retile_S(rP), tPsP(_, _, _, p_buffer));
            copy(smem_tiled_copy_pds, smem_copy_pds.retile_S(rdS), tdSsdS(_, _, _, buffer));
          }
          // The tensor cores read P and dS through the async proxy; dQ needs both halves of dS.
          cutlass::arch::fence_view_async_shared();
          named_barrier_sync(kNumMmaThreads, BwdBarrier::kPdS);

          // dV first, so that the dO stage is freed as early as possible; then dQ and dK.
          // warpgroup_wait<n> waits for all but the last n.
          gemm_key_grad(tiled_mma_dv, tdVrPt(_, _, _, buffer % kPBuffers), tdVrdOt(_, _, _, shared.do_state.index()),
                        tdVrdV);
          if constexpr (!kComputeDq) {
            gemm_key_grad(tiled_mma_dk, tdKrdSt(_, _, _, buffer), tdKrQt(_, _, _, shared.q_state.index()), tdKrdK);
            warpgroup_wait<1>();  // dV is done with dO
            shared.pipeline_do.consumer_release(shared.do_state);
            ++shared.do_state;
            warpgroup_wait<0>();  // dK is done with Q
            shared.pipeline_q.consumer_release(shared.q_state);
          } else {
            cute::Tensor tdQrdQ = partition_fragment_C(tiled_mma_dq, select<0, 1>(TileShapedQ{}));
            warpgroup_gemm<true, -1>(tiled_mma_dq, get<0>(dq_operands)(_, _, _, buffer),
                                     descriptors_per_use(get<1>(dq_operands)), tdQrdQ);
            gemm_key_grad(tiled_mma_dk, tdKrdSt(_, _, _, buffer), tdKrQt(_, _, _, shared.q_state.index()), tdKrdK);
            warpgroup_wait<2>();  // dV is done with dO
            shared.pipeline_do.consumer_release(shared.do_state);
            ++shared.do_state;
            warpgroup_wait<1>();  // dQ
            add_dq(tdQrdQ);
            warpgroup_wait<0>();  // dK is done with Q
            shared.pipeline_q.consumer_release(shared.q_state);
          }
        }
        ++shared.q_state;
        buffer ^= 1;
      };
      mask.for_each_query_block(blk.n_block, blk.m_block_min, blk.m_block_max, step);
    }
    // K and V may be replaced by the next key block's.
    storage.kv_empty.arrive();
  }
};

}  // namespace flashhopper::hopper
