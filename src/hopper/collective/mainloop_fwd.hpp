// Forward mainloop: the producer's TMA loads (Q once per tile, K and V through a ring of
// kStages buffers) and the consumers' loop S = Q K^T -> online softmax -> O += P V.
//
// Consumer warpgroups each own 64 rows of the tile. Two overlaps keep the tensor cores busy:
// - intra-warpgroup: the next block's Q K^T and the current block's P V are issued together,
//   and the softmax of the new S runs while P V is still in flight;
// - ping-pong: a ring of named barriers lets one warpgroup issue its GEMMs while the other does
//   its softmax.
// With qv (absorbed MLA, ForwardFeatures::kQv) S = Q K^T + Qv V^T: Qv loads with Q, and the same
// shared V block is the B operand of Qv V^T (read K-major) before it is P V's (read MN-major), so
// V of a block loads with its K and stays one block longer.
// Value head dims past 256 (qv against absorbed MLA's 512-wide latent; head dim 512): one
// warpgroup's registers cannot hold 64 rows of O, so two warpgroups share the 64 rows and split O's
// columns. Each computes half of S's contraction (half of d in Q K^T, its half of dv in Qv V^T);
// they add the halves through shared memory, after which both hold the same S, run the same softmax
// and keep P in registers for their own half of P V.
// fp8 (e4m3): WGMMA reads 8-bit operands K-major only, so P V's B operand must hold V with the keys
// contiguous, not as stored. The TMA loads V as stored (a key a row) into staging buffers, and the
// producer warpgroup's other three warps transpose each into the buffers P V reads (transpose_v),
// in the key order in which P's registers hold the keys (key_of_fp8_slot). P is 2^8 times the
// probability there (OnlineSoftmax's kProbabilityLog2), and q/k/v_descale scale S and O per tile.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/cutlass.h>
#include <cutlass/fast_math.h>
#include <cutlass/gemm/collective/builders/sm90_common.inl>
#include <cutlass/pipeline/pipeline.hpp>

#include "hopper/collective/paged_kv_loads.hpp"
#include "hopper/common/descale.hpp"
#include "hopper/common/forward_features.hpp"
#include "hopper/common/fp8_v_transpose.hpp"
#include "hopper/common/gmma_shapes.hpp"
#include "hopper/common/mask.hpp"
#include "hopper/common/named_barrier.hpp"
#include "hopper/common/score_transform.hpp"
#include "hopper/common/softmax.hpp"
#include "hopper/common/tile_scheduler.hpp"
#include "hopper/common/tile_size.hpp"
#include "hopper/common/tma_pipeline.hpp"
#include "hopper/common/utils.hpp"

namespace flashhopper::hopper {

using namespace cute;

template <class Element_, int kBlockM_, int kBlockN_, int kHeadDim_, int kHeadDimV_, int kStages_, MaskKind kMask_,
          bool kSoftcap_, ForwardFeatures kFeatures_, int kClusterM_ = 1>
struct ForwardMainloop {
  using Element = Element_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kHeadDim = kHeadDim_;    // Q and K
  static constexpr int kHeadDimV = kHeadDimV_;  // V and O
  static constexpr int kStages = kStages_;
  static constexpr MaskKind kMask = kMask_;
  static constexpr ForwardFeatures kFeatures = kFeatures_;
  using Mask = AttentionMask<kBlockM_, kBlockN_, kMask_, query_row_grouping(kFeatures_)>;
  using Transform = ScoreTransform<kSoftcap_>;
  static constexpr bool kPacked = holds(kFeatures, ForwardFeatures::kPacked);
  static constexpr bool kSplitKv = holds(kFeatures, ForwardFeatures::kSplitKv);
  static constexpr bool kKvCache = holds(kFeatures, ForwardFeatures::kKvCache);
  static constexpr bool kPagedKv = holds(kFeatures, ForwardFeatures::kPagedKv);
  static constexpr bool kQv = holds(kFeatures, ForwardFeatures::kQv);
  // Q's WGMMA descriptors (one per 16 columns of d) built per use rather than held across the key
  // loop, where holding them spills: the general kernels of head dims 192 and 256 (hdim 256 causal:
  // 42 local loads/stores in the loop, none per use; bench/RESULTS.md), and every kernel of head
  // dim 512 (dense: 1-22 -> 0 in the loop, as built here), and fp8 at head dim 256 with key blocks
  // of 128 (4 -> 0 at 240 registers; not today's tile). Elsewhere the code stays as measured.
  static constexpr bool kQDescriptorsPerUse =
      kHeadDim >= 192 && !kQv &&
      (kFeatures != ForwardFeatures::kNone || kHeadDim > 256 || (sizeof(Element_) == 1 && kBlockN_ >= 128));
  static constexpr bool kSplitsO = kHeadDimV > 256;  // O's columns over two warpgroups (above)
  static constexpr int kRowWarpGroups = kBlockM / 64;
  static constexpr int kColumnWarpGroups = kSplitsO ? 2 : 1;
  static_assert(!kSplitsO || (kRowWarpGroups == 1 && kHeadDim % (16 * kColumnWarpGroups) == 0),
                "O split over warpgroups: 64-row tiles, d in 16-column slices for each");
  static constexpr int kNumMmaWarpGroups = kRowWarpGroups * kColumnWarpGroups;
  static constexpr int kNumMmaThreads = kNumMmaWarpGroups * cutlass::NumThreadsPerWarpGroup;
  // Ping-pong between warpgroups of different rows; those that split O work in step.
  static constexpr bool kPingPong = kNumMmaWarpGroups > 1 && !kSplitsO;
  static constexpr bool kTransposesV = sizeof(Element) == 1;  // fp8 (above)
  static_assert(!kTransposesV || (!kQv && !kSplitsO && kBlockN % 32 == 0),
                "fp8: no qv, 64 rows of O a warpgroup, key blocks of whole 32-key MMA slices");
  static constexpr int kTransposeThreads = 3 * cutlass::NumThreadsPerWarp;  // the producer's warps 1-3
  static constexpr int kProbabilityLog2 = kTransposesV ? 8 : 0;
  // kClusterM CTAs of a cluster take adjacent query blocks of one head and share each K and V
  // block: each loads 1 / kClusterM of it by TMA multicast into all of them, so the L2 serves a
  // block once per cluster (ForwardTileSize's kClusterM). Their walks must be the same blocks in
  // the same order (ForwardKernel::key_blocks): dense kernels, unmasked or causal, one TMA thread.
  static constexpr int kClusterM = kClusterM_;
  static_assert(kClusterM == 1 || (kClusterM == 2 && kFeatures == ForwardFeatures::kNone &&
                                   (kMask == MaskKind::kNone || kMask == MaskKind::kCausal) && !kTransposesV),
                "K/V multicast: pairs of CTAs of dense 16-bit kernels, unmasked or causal");
  using KvTmaOp = cute::conditional_t<kClusterM == 1, SM90_TMA_LOAD, SM90_TMA_LOAD_MULTICAST>;

  using TileShapeQK = Shape<Int<kBlockM>, Int<kBlockN>, Int<kHeadDim>>;  // (M, N, d)
  using TileShapePV = Shape<Int<kBlockM>, Int<kHeadDimV>, Int<kBlockN>>;  // (M, dv, N)

  // One 64-row WGMMA atom per consumer warpgroup, stacked along M; P V's also side by side along
  // dv where O is split. S's is one warpgroup's wide: those that split O each compute all of S's
  // rows and columns, over their half of the contraction.
  static constexpr int kHeadDimVPerWarpGroup = kHeadDimV / kColumnWarpGroups;
  using TiledMmaQK = decltype(make_tiled_mma(ss_gmma<Element, Shape<_64, Int<kBlockN>, Int<kHeadDim>>>(),
                                             Layout<Shape<Int<kRowWarpGroups>, _1, _1>>{}));
  using TiledMmaPV = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, float, Shape<_64, Int<kHeadDimVPerWarpGroup>, Int<kBlockN>>,
                           GMMA::Major::K, kTransposesV ? GMMA::Major::K : GMMA::Major::MN>(),
      Layout<Shape<Int<kRowWarpGroups>, Int<kColumnWarpGroups>, _1>>{}));
  static_assert(gmma_n<TiledMmaQK> == kBlockN && gmma_n<TiledMmaPV> == kHeadDimVPerWarpGroup,
                FLASHHOPPER_GMMA_SPAN_MESSAGE);
  static constexpr bool kUsesExtendedGmma = uses_extended_gmma<TiledMmaQK, TiledMmaPV>;

  // Q and K are K-major (d contiguous). V is stored as Vt (dv, N): dv contiguous, which is the
  // MN-major B operand of P V, so the TMA writes it straight into the layout the MMA reads; with
  // fp8, N contiguous (K-major), written by transpose_v.
  using SmemLayoutQ = decltype(tile_to_shape(
      cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::K, Element, Int<kBlockM>, Int<kHeadDim>>(),
      Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  using SmemLayoutK = decltype(tile_to_shape(
      cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::K, Element, Int<kBlockN>, Int<kHeadDim>>(),
      Shape<Int<kBlockN>, Int<kHeadDim>, Int<kStages>>{}));
  using SmemLayoutVtMN = decltype(tile_to_shape(
      cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::MN, Element, Int<kHeadDimV>, Int<kBlockN>>(),
      Shape<Int<kHeadDimV>, Int<kBlockN>, Int<kStages>>{}, Step<_2, _1, _3>{}));
  using SmemLayoutVtK = decltype(tile_to_shape(
      cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::K, Element, Int<kHeadDimV>, Int<kBlockN>>(),
      Shape<Int<kHeadDimV>, Int<kBlockN>, Int<kStages>>{}));
  using SmemLayoutVt = cute::conditional_t<kTransposesV, SmemLayoutVtK, SmemLayoutVtMN>;
  // qv: Qv (M, dv) K-major as Q; V's stages read as the K-major B operand (N, dv) of Qv V^T. Both
  // tile the same 128-byte swizzle atom (dv contiguous, 8 keys), N first: (n, c, s) of the one
  // is (c, n, s) of the other (checked below). fp8: SmemLayoutVAsB is V's staging buffers.
  using SmemLayoutQv = decltype(tile_to_shape(
      cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::K, Element, Int<kBlockM>, Int<kHeadDimV>>(),
      Shape<Int<kBlockM>, Int<kHeadDimV>>{}));
  using SmemLayoutVAsB = decltype(tile_to_shape(
      cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::K, Element, Int<kBlockN>, Int<kHeadDimV>>(),
      Shape<Int<kBlockN>, Int<kHeadDimV>, Int<kStages>>{}));
  // Both as each warpgroup's columns of Qv V^T (the whole of them unless O is split): (M, dv / c, c)
  // and (N, dv / c, c, stages), the same bytes (checked by qv_halves_agree).
  using SmemLayoutQvHalves = decltype(tile_to_shape(
      cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::K, Element, Int<kBlockM>,
                                                          Int<kHeadDimVPerWarpGroup>>(),
      Shape<Int<kBlockM>, Int<kHeadDimVPerWarpGroup>, Int<kColumnWarpGroups>>{}));
  using SmemLayoutVAsBHalves = decltype(tile_to_shape(
      cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::K, Element, Int<kBlockN>,
                                                          Int<kHeadDimVPerWarpGroup>>(),
      Shape<Int<kBlockN>, Int<kHeadDimVPerWarpGroup>, Int<kColumnWarpGroups>, Int<kStages>>{}));

  // Global tensors as (seqlen, d, head, batch); Vt as (dv, seqlen, head, batch). Packed batches:
  // (total, d, head, 1), a tile's sequence at its SeqlenInfo's row offset.
  using ShapeQKV = Shape<int32_t, int32_t, int32_t, int32_t>;
  using StrideQK = Stride<int64_t, _1, int64_t, int64_t>;
  using StrideVt = Stride<_1, int64_t, int64_t, int64_t>;

  using TmaQ = decltype(make_tma_copy(
      SM90_TMA_LOAD{}, make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), ShapeQKV{}, StrideQK{}),
      SmemLayoutQ{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}, _1{}));
  using TmaK = decltype(make_tma_copy(
      KvTmaOp{}, make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), ShapeQKV{}, StrideQK{}),
      take<0, 2>(SmemLayoutK{}), Shape<Int<kBlockN>, Int<kHeadDim>>{}, Int<kClusterM>{}));
  using TmaVtMN = decltype(make_tma_copy(
      KvTmaOp{}, make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), ShapeQKV{}, StrideVt{}),
      take<0, 2>(SmemLayoutVt{}), Shape<Int<kHeadDimV>, Int<kBlockN>>{}, Int<kClusterM>{}));
  // fp8: V as stored, (seqlen, dv, head, batch), into a staging buffer (N, dv).
  using TmaVStaged = decltype(make_tma_copy(
      SM90_TMA_LOAD{}, make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), ShapeQKV{}, StrideQK{}),
      take<0, 2>(SmemLayoutVAsB{}), Shape<Int<kBlockN>, Int<kHeadDimV>>{}, _1{}));
  using TmaVt = cute::conditional_t<kTransposesV, TmaVStaged, TmaVtMN>;

  using Pipeline = KvTmaPipeline<kStages, kClusterM>;
  using PipelineState = cutlass::PipelineState<kStages>;
  // fp8: transposed V stages, from transpose_v's threads to the MMA warpgroups.
  using PipelineVt = cutlass::PipelineAsync<kStages>;
  // A paged KV cache's loads (kPagedKv only); with fp8, of V as stored into the staging buffers.
  using Paged = PagedKvLoads<Element, kBlockN, kHeadDim, kHeadDimV, SmemLayoutK,
                             cute::conditional_t<kTransposesV, SmemLayoutVAsB, SmemLayoutVt>, ShapeQKV, StrideQK,
                             cute::conditional_t<kTransposesV, StrideQK, StrideVt>, Pipeline, PipelineState,
                             kTransposesV>;
  using PagedMode = typename Paged::PagedMode;
  // Without kPagedKv the kernel's parameters hold none of Paged's (its TMA descriptors and gather
  // sources: 1152 of a dense launch's 3072 bytes, copied by every launch).
  struct NoPagedParams {
    static constexpr PagedMode mode = PagedMode::kNone;
  };
  using PagedParams = cute::conditional_t<kPagedKv, typename Paged::Params, NoPagedParams>;

  static constexpr uint32_t kTmaBytesQ = cosize_v<SmemLayoutQ> * sizeof(Element);
  static constexpr uint32_t kTmaBytesK = size(take<0, 2>(SmemLayoutK{})) * sizeof(Element);
  static constexpr uint32_t kTmaBytesV = size(take<0, 2>(SmemLayoutVt{})) * sizeof(Element);
  // What completes Q's barrier: Q, and Qv with it.
  static constexpr uint32_t kTmaBytesQAndQv = kTmaBytesQ + (kQv ? cosize_v<SmemLayoutQv> * sizeof(Element) : 0);

  // qv only: empty bases elsewhere, so that the other kernels' layouts do not change, and the
  // TMA type is computed only for the kernels that have one.
  template <bool kOn, class = void>
  struct QvStorage {};
  template <class Unused>
  struct QvStorage<true, Unused> {
    cute::array_aligned<Element, cosize_v<SmemLayoutQv>, 1024> smem_qv;
  };
  // kSplitsO: each warpgroup's half of S, float, as [buffer][warpgroup][register / 4][thread][4]
  // (16-byte accesses, a quarter warp's 128 contiguous bytes: no bank conflicts); two buffers used
  // by turns where they fit beside Q, Qv, K and V, else one.
  static constexpr int kScoreRegisters = kBlockN / 2;  // S's floats a thread holds: 64 x N / 128
  static constexpr int kExchangeBufferBytes =
      kColumnWarpGroups * kScoreRegisters * cutlass::NumThreadsPerWarpGroup * int(sizeof(float));
  static constexpr int kBytesBesideExchange =
      int((cosize_v<SmemLayoutQ> + cosize_v<SmemLayoutK> + cosize_v<SmemLayoutVt> +
           (kQv ? cosize_v<SmemLayoutQv> : 0)) * sizeof(Element)) +
      1024;  // the barriers and alignment
  static constexpr int kExchangeBuffers = kBytesBesideExchange + 2 * kExchangeBufferBytes <= kSmemLimitBytes ? 2 : 1;
  template <bool kOn, class = void>
  struct ScoreExchangeStorage {};
  template <class Unused>
  struct ScoreExchangeStorage<true, Unused> {
    cute::array_aligned<float, kExchangeBuffers * kExchangeBufferBytes / sizeof(float), 128> smem_s;
  };
  template <bool kOn, class = void>
  struct QvParams {};
  template <class Unused>
  struct QvParams<true, Unused> {
    using TmaQv = decltype(make_tma_copy(
        SM90_TMA_LOAD{}, make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), ShapeQKV{}, StrideQK{}),
        SmemLayoutQv{}, Shape<Int<kBlockM>, Int<kHeadDimV>>{}, _1{}));
    TmaQv tma_qv;
    ShapeQKV shape_qv;
  };

  // fp8, V stored column-major (keys contiguous: FA3's V_colmajor): Vt (dv, seqlen, head, batch) by
  // the TMA straight into a staging buffer laid out as P V's stage (SmemLayoutVtK), whose keys
  // transpose_v then only reorders (key_of_fp8_slot) instead of transposing them.
  template <bool kOn, class = void>
  struct VColumnMajorParams {
    bool enabled = false;
  };
  template <class Unused>
  struct VColumnMajorParams<true, Unused> {
    using Tma = decltype(make_tma_copy(
        SM90_TMA_LOAD{}, make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), ShapeQKV{}, StrideQK{}),
        take<0, 2>(SmemLayoutVtK{}), Shape<Int<kHeadDimV>, Int<kBlockN>>{}, _1{}));
    Tma tma;
    bool enabled = false;
  };

  // fp8: V's staging buffers, as the TMA writes them (SmemLayoutVAsB; SmemLayoutVtK column-major).
  template <bool kOn, class = void>
  struct VStagingStorage {};
  template <class Unused>
  struct VStagingStorage<true, Unused> {
    cute::array_aligned<Element, cosize_v<SmemLayoutVAsB>, 1024> smem_v_staged;
  };

  // K and V stages (and Qv's buffer with qv, V's staging buffers with fp8).
  struct SharedStorageKV : QvStorage<kQv>, ScoreExchangeStorage<kSplitsO>, VStagingStorage<kTransposesV> {
    cute::array_aligned<Element, cosize_v<SmemLayoutK>, 1024> smem_k;
    cute::array_aligned<Element, cosize_v<SmemLayoutVt>, 1024> smem_v;
  };

  struct Arguments {
    Element const* ptr_q;
    ShapeQKV shape_q;  // (seqlen_q, d, heads_q, batch)
    StrideQK stride_q;
    Element const* ptr_k;
    ShapeQKV shape_k;  // (seqlen_k, d, heads_kv, batch)
    StrideQK stride_k;
    Element const* ptr_v;
    ShapeQKV shape_vt;  // (dv, seqlen_k, heads_kv, batch)
    StrideVt stride_vt;
    float softmax_scale;
    float softcap;                 // > 0 only with kSoftcap
    LocalMaskParams local;         // kLocal only
    float const* learnable_sink;   // [heads_q] or null
    SeqlenParams seqlen;
    // Paged: shape_k/shape_vt are the per-page views above, and sequence b's key i lies in page
    // page_table[r * page_table_stride + (leftpad + i) / page_size] with r = cache_batch_idx[b] (b
    // without it; r < page_table_rows) and leftpad = cache_leftpad[b] (0 without it). Null: K and
    // V as shape_k/shape_vt say.
    int const* page_table = nullptr;
    int64_t page_table_stride = 0;
    int page_table_rows = 0;
    int page_size = 0;
    // qv [rows, dv, heads_q, batch] as Q (kQv only, which every call with qv runs on).
    Element const* ptr_qv = nullptr;
    ShapeQKV shape_qv{};
    StrideQK stride_qv{};
    // fp8: the true q, k and v are the stored ones times these [B, Hkv] factors (null: 1).
    Descale q_descale{}, k_descale{}, v_descale{};
    // fp8: V stored column-major (keys contiguous; shape_vt's strides then unused): its dv stride.
    // 0: V as stride_vt says (dv contiguous).
    int64_t v_column_stride = 0;
  };

  struct Params : QvParams<kQv> {
    ShapeQKV shape_q;
    ShapeQKV shape_k;
    ShapeQKV shape_vt;
    TmaQ tma_q;
    TmaK tma_k;
    TmaVt tma_vt;
    float softmax_scale;       // after the score transform (ScoreTransform::softmax_scale)
    float softmax_scale_log2;
    Transform transform;
    LocalMaskParams local;
    float const* learnable_sink;
    cutlass::FastDivmod heads_per_kv_head;
    SeqlenParams seqlen;
    PagedParams paged;
    Descale q_descale, k_descale, v_descale;  // fp8 only
    VColumnMajorParams<kTransposesV> v_column_major;  // fp8 only
  };

  // The producer's threads: one, or a warp or the warpgroup for a paged cache.
  CUTLASS_HOST_DEVICE static int producer_threads(Params const& params) {
    if constexpr (!kPagedKv) return 1;
    else return Paged::producer_threads(params.paged);
  }

  // What completes a K or V stage: TMA bytes and thread 0's arrival; when the warpgroup gathers,
  // its threads' arrivals once their copies land (cp.async.mbarrier.arrive.noinc) and no bytes.
  struct KvStageCompletion {
    uint32_t bytes_k, bytes_v, arrivals;
  };
  CUTLASS_HOST_DEVICE static KvStageCompletion kv_stage_completion(Params const& params) {
    if (kPagedKv && params.paged.mode == PagedMode::kGather) return {0, 0, 1 + Paged::kGatherThreads};
    return {kTmaBytesK, kTmaBytesV, 1};
  }

  static Params to_underlying_arguments(Arguments const& args) {
    Tensor mQ = make_tensor(make_gmem_ptr(args.ptr_q), args.shape_q, args.stride_q);
    Tensor mK = make_tensor(make_gmem_ptr(args.ptr_k), args.shape_k, args.stride_k);
    Tensor mVt = make_tensor(make_gmem_ptr(args.ptr_v), args.shape_vt, args.stride_vt);
    // fp8: V as stored, (seqlen, dv, head, batch), for the staging loads.
    Tensor mV = make_tensor(make_gmem_ptr(args.ptr_v), select<1, 0, 2, 3>(args.shape_vt),
                            make_stride(get<1>(args.stride_vt), _1{}, get<2>(args.stride_vt), get<3>(args.stride_vt)));
    TmaQ tma_q = make_tma_copy(SM90_TMA_LOAD{}, mQ, SmemLayoutQ{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}, _1{});
    TmaK tma_k = make_tma_copy(KvTmaOp{}, mK, take<0, 2>(SmemLayoutK{}), Shape<Int<kBlockN>, Int<kHeadDim>>{},
                               Int<kClusterM>{});
    VColumnMajorParams<kTransposesV> v_column_major{};
    if constexpr (kTransposesV) {
      if (args.v_column_stride != 0) {
        Tensor mVtColumns = make_tensor(make_gmem_ptr(args.ptr_v), args.shape_vt,
                                        make_stride(args.v_column_stride, _1{}, get<2>(args.stride_vt),
                                                    get<3>(args.stride_vt)));
        v_column_major.tma = make_tma_copy(SM90_TMA_LOAD{}, mVtColumns, take<0, 2>(SmemLayoutVtK{}),
                                           Shape<Int<kHeadDimV>, Int<kBlockN>>{}, _1{});
        v_column_major.enabled = true;
      }
    }
    TmaVt tma_vt = [&] {
      if constexpr (kTransposesV) {
        if (v_column_major.enabled) return TmaVt{};  // V's rows are not contiguous: never used
        return make_tma_copy(SM90_TMA_LOAD{}, mV, take<0, 2>(SmemLayoutVAsB{}), Shape<Int<kBlockN>, Int<kHeadDimV>>{},
                             _1{});
      } else {
        return make_tma_copy(KvTmaOp{}, mVt, take<0, 2>(SmemLayoutVt{}), Shape<Int<kHeadDimV>, Int<kBlockN>>{},
                             Int<kClusterM>{});
      }
    }();
    const int heads_per_kv_head = get<2>(args.shape_q) / get<2>(args.shape_k);
    const float scale = Transform::softmax_scale(args.softmax_scale, args.softcap);
    PagedParams paged{};
    if constexpr (kPagedKv) {
      if (args.page_table != nullptr) {
        auto const& v_pages = [&]() -> auto const& {  // V as Paged loads it: as stored with fp8
          if constexpr (kTransposesV) return mV; else return mVt;
        }();
        paged = Paged::make(mK, v_pages, args.page_table, args.page_table_stride, args.page_table_rows,
                            args.page_size, /*keys_start_mid_page=*/args.seqlen.cache_leftpad != nullptr);
      }
    }
    QvParams<kQv> qv{};
    if constexpr (kQv) {
      Tensor mQv = make_tensor(make_gmem_ptr(args.ptr_qv), args.shape_qv, args.stride_qv);
      qv = {make_tma_copy(SM90_TMA_LOAD{}, mQv, SmemLayoutQv{}, Shape<Int<kBlockM>, Int<kHeadDimV>>{}, _1{}),
            args.shape_qv};
    }
    return {qv,
            args.shape_q,
            args.shape_k,
            args.shape_vt,
            tma_q,
            tma_k,
            tma_vt,
            scale,
            float(scale * M_LOG2E),
            Transform::make(args.softmax_scale, args.softcap),
            args.local,
            args.learnable_sink,
            cutlass::FastDivmod(heads_per_kv_head),
            args.seqlen,
            paged,
            args.q_descale,
            args.k_descale,
            args.v_descale,
            v_column_major};
  }

  CUTLASS_DEVICE static void prefetch_tma_descriptors(Params const& params) {
    cute::prefetch_tma_descriptor(params.tma_q.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_k.get_tma_descriptor());
    if constexpr (kTransposesV) {
      if (params.v_column_major.enabled) cute::prefetch_tma_descriptor(params.v_column_major.tma.get_tma_descriptor());
      else cute::prefetch_tma_descriptor(params.tma_vt.get_tma_descriptor());
    } else {
      cute::prefetch_tma_descriptor(params.tma_vt.get_tma_descriptor());
    }
    if constexpr (kQv) cute::prefetch_tma_descriptor(params.tma_qv.get_tma_descriptor());
    if constexpr (kPagedKv) Paged::prefetch(params.paged);
  }

  CUTLASS_DEVICE static SeqlenInfo seqlen_info(Params const& params, WorkTile const& work) {
    return SeqlenInfo::make<kKvCache, kPacked>(params.seqlen, work.batch);
  }
  CUTLASS_DEVICE static Mask make_mask(Params const& params, SeqlenInfo const& seq) {
    return Mask(seq, params.local);
  }
  // The learnable sink's logit * log2 e for the tile's head; -inf without one.
  CUTLASS_DEVICE static float sink_log2(Params const& params, WorkTile const& work) {
    return params.learnable_sink ? params.learnable_sink[work.head] * float(M_LOG2E) : -INFINITY;
  }

  // What the producer and the consumers share besides the parameters, as one role sees it: the K
  // and V pipelines with its place in each (write states for the producer, read states for the
  // consumers), Q's buffer with its barriers and the phase of the one it waits on (q_empty for
  // the producer, q_full for the consumers), and the K/V stages. The kernel binds one per role.
  struct SharedState {
    Pipeline& pipeline_k;
    Pipeline& pipeline_v;
    PipelineState& k_state;
    PipelineState& v_state;
    cutlass::arch::ClusterTransactionBarrier& q_full;
    cutlass::arch::ClusterBarrier& q_empty;
    int& q_phase;
    Element* smem_q;
    SharedStorageKV& kv;
    // fp8: the transposed V stages' pipeline (P V waits on it instead of pipeline_v) and, for
    // transpose_v's threads, their write state in it.
    PipelineVt* pipeline_vt = nullptr;
    PipelineState* vt_state = nullptr;
  };

  // Producer: called by producer_threads threads. Loads K/V
  // blocks in the walk's order (the last block, which may need masking, first), interleaved as K
  // of one block and V of the one before, as the consumers use them, and Q once its buffer is free
  // (every consumer is done with the previous tile's Q K^T).
  CUTLASS_DEVICE static void load(Params const& params, SharedState const& shared, WorkTile const& work,
                                  SeqlenInfo const& seq, typename Mask::KeyBlocks const& blocks) {
    Tensor sQ = make_tensor(make_smem_ptr(shared.smem_q), SmemLayoutQ{});
    Tensor sK = make_tensor(make_smem_ptr(shared.kv.smem_k.data()), SmemLayoutK{});
    Tensor sVt = make_tensor(make_smem_ptr(shared.kv.smem_v.data()), SmemLayoutVt{});
    const int head_kv = params.heads_per_kv_head.divide(work.head);

    Tensor mQ = domain_offset(make_coord(seq.offset_q, _0{}),
                              params.tma_q.get_tma_tensor(params.shape_q)(_, _, work.head, seq.batch_q));  // (sq, d)
    Tensor mK = domain_offset(make_coord(seq.offset_k, _0{}),
                              params.tma_k.get_tma_tensor(params.shape_k)(_, _, head_kv, seq.batch_k));  // (sk, d)
    Tensor gQ = local_tile(mQ, Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(work.block, _0{}));  // (M, d)
    Tensor gK = local_tile(mK, Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(_, _0{}));  // (N, d, n)

    auto [tQgQ, tQsQ] = tma_partition(params.tma_q, _0{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
    // This CTA's slice of each K/V block (all of it without a cluster), multicast to the cluster.
    const int cluster_rank = kClusterM == 1 ? 0 : int(cute::block_rank_in_cluster());
    const Layout<Int<kClusterM>> cluster_layout{};
    constexpr uint16_t kMulticastMask = (1u << kClusterM) - 1;
    auto tma_k_parts =
        tma_partition(params.tma_k, cluster_rank, cluster_layout, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
    // V's blocks (dv, N, n) into its stages, or with fp8 as stored, (N, dv, n), into the staging buffers.
    auto tma_v_parts = [&] {
      if constexpr (kTransposesV) {
        cute::Tensor sV = make_tensor(make_smem_ptr(shared.kv.smem_v_staged.data()), SmemLayoutVAsB{});
        cute::Tensor mV = domain_offset(
            make_coord(seq.offset_k, _0{}),
            params.tma_vt.get_tma_tensor(select<1, 0, 2, 3>(params.shape_vt))(_, _, head_kv, seq.batch_k));  // (sk, dv)
        cute::Tensor gV = local_tile(mV, Shape<Int<kBlockN>, Int<kHeadDimV>>{}, make_coord(_, _0{}));
        return tma_partition(params.tma_vt, _0{}, Layout<_1>{}, group_modes<0, 2>(sV), group_modes<0, 2>(gV));
      } else {
        cute::Tensor mVt = domain_offset(
            make_coord(_0{}, seq.offset_k),
            params.tma_vt.get_tma_tensor(params.shape_vt)(_, _, head_kv, seq.batch_k));  // (dv, sk)
        cute::Tensor gVt = local_tile(mVt, Shape<Int<kHeadDimV>, Int<kBlockN>>{}, make_coord(_0{}, _));
        return tma_partition(params.tma_vt, cluster_rank, cluster_layout, group_modes<0, 2>(sVt),
                             group_modes<0, 2>(gVt));
      }
    }();

    // fp8, V column-major: Vt's blocks (dv, N, n) into the staging buffers laid out as P V's stages.
    auto tma_v_column_parts = [&] {
      if constexpr (kTransposesV) {
        cute::Tensor sV = make_tensor(make_smem_ptr(shared.kv.smem_v_staged.data()), SmemLayoutVtK{});
        cute::Tensor mVt = domain_offset(
            make_coord(_0{}, seq.offset_k),
            params.v_column_major.tma.get_tma_tensor(params.shape_vt)(_, _, head_kv, seq.batch_k));  // (dv, sk)
        cute::Tensor gVt = local_tile(mVt, Shape<Int<kHeadDimV>, Int<kBlockN>>{}, make_coord(_0{}, _));
        return tma_partition(params.v_column_major.tma, _0{}, Layout<_1>{}, group_modes<0, 2>(sV),
                             group_modes<0, 2>(gVt));
      } else {
        return cute::tuple<>{};
      }
    }();

    // Plain tensors rather than structured bindings: lambdas capture them (C++17).
    Tensor tKgK = get<0>(tma_k_parts);  // (TMA, n)
    Tensor tKsK = get<1>(tma_k_parts);  // (TMA, PIPE)
    Tensor tVgVt = get<0>(tma_v_parts);
    Tensor tVsVt = get<1>(tma_v_parts);

    // V's stages as the producer writes them, and their per-page view: with fp8 the staging
    // buffers (N, dv) and V as stored, else P V's stages (dv, N) and Vt.
    auto v_stages = [&] {  // not const: with const, nvcc warned that the stage lambda returns a dangling reference
      if constexpr (kTransposesV) {
        return make_tensor(make_smem_ptr(shared.kv.smem_v_staged.data()), SmemLayoutVAsB{});
      } else {
        return sVt;
      }
    }();
    const ShapeQKV v_pages = kTransposesV ? ShapeQKV(select<1, 0, 2, 3>(params.shape_vt)) : params.shape_vt;

    // Every producer thread runs this (producer_threads); thread 0 alone arms the barriers and
    // issues the other loads.
    const bool leader = threadIdx.x == 0;
    auto load_stage = [&](auto is_v, int n_block) {
      constexpr bool kIsV = decltype(is_v)::value;
      Pipeline& pipeline = kIsV ? shared.pipeline_v : shared.pipeline_k;
      PipelineState& state = kIsV ? shared.v_state : shared.k_state;
      auto const& stages = [&]() -> auto const& {
        if constexpr (kIsV) return v_stages; else return sK;
      }();
      if constexpr (kPagedKv) {
        if (params.paged.mode == PagedMode::kGather) {
          Paged::template gather_stage<kIsV>(params.paged, pipeline, state, stages, seq, head_kv, n_block);
          return;
        }
        if (params.paged.mode != PagedMode::kNone) {
          Paged::template load_chunks_stage<kIsV>(params.paged, kIsV ? v_pages : params.shape_k, pipeline, state,
                                                  stages, seq, head_kv, n_block);
          return;
        }
      }
      if constexpr (kIsV) {
        if constexpr (kTransposesV) {
          if (params.v_column_major.enabled) {
            tma_load_stage(pipeline, state, params.v_column_major.tma, get<0>(tma_v_column_parts)(_, n_block),
                           get<1>(tma_v_column_parts));
            return;
          }
        }
        tma_load_stage(pipeline, state, params.tma_vt, tVgVt(_, n_block), tVsVt, kMulticastMask);
      } else {
        tma_load_stage(pipeline, state, params.tma_k, tKgK(_, n_block), tKsK, kMulticastMask);
      }
    };
    auto load_k = [&](int n_block) { load_stage(cute::false_type{}, n_block); };
    auto load_v = [&](int n_block) { load_stage(cute::true_type{}, n_block); };
    // The first K block goes out while the previous tile's last GEMMs may still read Q. With qv
    // each V block goes with its K: Qv V^T needs it as Q K^T needs K.
    const int num_blocks = blocks.count();
    load_k(blocks.at(0));
    if constexpr (kQv) load_v(blocks.at(0));
    shared.q_empty.wait(shared.q_phase);
    shared.q_phase ^= 1;
    if (leader) {
      shared.q_full.arrive_and_expect_tx(kTmaBytesQAndQv);
      copy(params.tma_q.with(reinterpret_cast<uint64_t&>(shared.q_full)), tQgQ, tQsQ);
      if constexpr (kQv) load_qv(params, shared, work, seq);
    }
    for (int i = 1; i < num_blocks; ++i) {
      load_k(blocks.at(i));
      load_v(blocks.at(kQv ? i : i - 1));
    }
    if constexpr (!kQv) load_v(blocks.at(num_blocks - 1));
  }

  // SmemLayoutVAsB is SmemLayoutVt with its first two modes swapped: the same swizzle, and the
  // same offsets at the corners of an atom, across atoms in both modes and in the last stage.
  static constexpr bool v_views_agree() {
    auto vt = get_nonswizzle_portion(SmemLayoutVt{});
    auto vb = get_nonswizzle_portion(SmemLayoutVAsB{});
    for (int n : {0, 1, 7, 8, kBlockN - 1})
      for (int c : {0, 1, 63, 64, kHeadDimV - 1})
        for (int s : {0, kStages - 1})
          if (vt(c, n, s) != vb(n, c, s)) return false;
    return cute::is_same_v<decltype(get_swizzle_portion(SmemLayoutVt{})),
                           decltype(get_swizzle_portion(SmemLayoutVAsB{}))>;
  }

  // SmemLayoutQvHalves and SmemLayoutVAsBHalves: the same offsets as SmemLayoutQv and SmemLayoutVAsB
  // at the corners of atoms and of halves, and the same swizzle.
  static constexpr bool qv_halves_agree() {
    constexpr int h = kHeadDimVPerWarpGroup;
    auto qv = get_nonswizzle_portion(SmemLayoutQv{});
    auto qv_halves = get_nonswizzle_portion(SmemLayoutQvHalves{});
    auto v = get_nonswizzle_portion(SmemLayoutVAsB{});
    auto v_halves = get_nonswizzle_portion(SmemLayoutVAsBHalves{});
    for (int c : {0, 1, 63, 64, h - 1, h, h + 64, kHeadDimV - 1}) {
      if (c >= kHeadDimV) continue;
      for (int m : {0, 1, 7, 8, kBlockM - 1})
        if (qv(m, c) != qv_halves(m, c % h, c / h)) return false;
      for (int n : {0, 1, 7, 8, kBlockN - 1})
        for (int stage : {0, kStages - 1})
          if (v(n, c, stage) != v_halves(n, c % h, c / h, stage)) return false;
    }
    return cute::is_same_v<decltype(get_swizzle_portion(SmemLayoutQv{})),
                           decltype(get_swizzle_portion(SmemLayoutQvHalves{}))> &&
           cute::is_same_v<decltype(get_swizzle_portion(SmemLayoutVAsB{})),
                           decltype(get_swizzle_portion(SmemLayoutVAsBHalves{}))>;
  }

  // qv: the tile's Qv rows, on Q's barrier (its bytes counted in kTmaBytesQAndQv).
  CUTLASS_DEVICE static void load_qv(Params const& params, SharedState const& shared, WorkTile const& work,
                                     SeqlenInfo const& seq) {
    static_assert(v_views_agree(), "Qv V^T must read V's stages where the TMA wrote them");
    static_assert(qv_halves_agree(), "each warpgroup's Qv V^T must read its columns where the TMA wrote them");
    Tensor sQv = make_tensor(make_smem_ptr(shared.kv.smem_qv.data()), SmemLayoutQv{});
    Tensor mQv = domain_offset(make_coord(seq.offset_q, _0{}),
                               params.tma_qv.get_tma_tensor(params.shape_qv)(_, _, work.head, seq.batch_q));
    Tensor gQv = local_tile(mQv, Shape<Int<kBlockM>, Int<kHeadDimV>>{}, make_coord(work.block, _0{}));  // (M, dv)
    auto [tQvgQv, tQvsQv] =
        tma_partition(params.tma_qv, _0{}, Layout<_1>{}, group_modes<0, 2>(sQv), group_modes<0, 2>(gQv));
    copy(params.tma_qv.with(reinterpret_cast<uint64_t&>(shared.q_full)), tQvgQv, tQvsQv);
  }

  // Consumer: one 64-row slice per warpgroup. On return tOrO holds the unnormalised O and
  // `softmax` the row statistics.
  template <class TensorO, class Softmax>
  CUTLASS_DEVICE static void mma(Params const& params, SharedState const& shared, TensorO& tOrO, Softmax& softmax,
                                 int thread_idx, WorkTile const& work, SeqlenInfo const& seq,
                                 typename Mask::KeyBlocks const& blocks) {
    Tensor sQ = make_tensor(make_smem_ptr(shared.smem_q), SmemLayoutQ{});
    Tensor sK = make_tensor(make_smem_ptr(shared.kv.smem_k.data()), SmemLayoutK{});
    Tensor sVt = make_tensor(make_smem_ptr(shared.kv.smem_v.data()), SmemLayoutVt{});

    TiledMmaQK tiled_mma_qk;
    TiledMmaPV tiled_mma_pv;
    // Warpgroups that split O's columns each hold all of S: the same S thread, column_wg apart.
    const int column_wg = kSplitsO ? thread_idx / cutlass::NumThreadsPerWarpGroup : 0;
    auto thr_mma_qk =
        tiled_mma_qk.get_thread_slice(kSplitsO ? thread_idx % cutlass::NumThreadsPerWarpGroup : thread_idx);
    auto thr_mma_pv = tiled_mma_pv.get_thread_slice(thread_idx);
    Tensor tSrQ = thr_mma_qk.partition_fragment_A(sQ);    // (MMA, MMA_M, MMA_K)
    Tensor tSrK = thr_mma_qk.partition_fragment_B(sK);    // (MMA, MMA_N, MMA_K, PIPE)
    Tensor tOrVt = thr_mma_pv.partition_fragment_B(sVt);  // (MMA, MMA_N, MMA_K, PIPE)

    Tensor tSrS = partition_fragment_C(tiled_mma_qk, select<0, 1>(TileShapeQK{}));  // (MMA, MMA_M, MMA_N)
    Tensor tOrP = make_tensor<Element>([&] {
      if constexpr (kTransposesV) return fp8_operand_layout(tSrS.layout());
      else return accumulator_as_a_operand(tSrS.layout());
    }());
    Tensor scores = make_tensor(tSrS.data(), accumulator_rowcol(tSrS.layout()));     // (rows, cols)
    Tensor tScS = thr_mma_qk.partition_C(make_identity_tensor(select<0, 1>(TileShapeQK{})));
    Tensor coords = make_tensor(tScS.data(), accumulator_rowcol(tScS.layout()));
    Tensor o_rowcol = make_tensor(tOrO.data(), accumulator_rowcol(tOrO.layout()));
    constexpr int kRows = decltype(size<0>(scores))::value;
    float o_scale[kRows];

    const Mask mask = make_mask(params, seq);
    // fp8: the tile's own (descaled) transform; elsewhere the parameters' (read where used).
    const Transform tile_transform = kTransposesV ? tile_scale(params, work, seq).transform : Transform{};
    const int num_blocks = blocks.count();
    // The score transform, then, in a step that may cross a mask boundary, the mask where it does.
    auto mask_scores = [&](int n_block, auto may_cross) {
      if constexpr (kTransposesV) tile_transform.apply(scores);
      else params.transform.apply(scores);
      if constexpr (decltype(may_cross)::value) {
        if (mask.crosses_boundary(work.block, n_block)) mask.apply(scores, coords, work.block, n_block);
      }
    };
    const int warp_group = thread_idx / cutlass::NumThreadsPerWarpGroup;
    // Ping-pong: wait for this warpgroup's turn at the tensor cores, then pass it on.
    auto take_turn = [&] {
      if constexpr (kPingPong)
        named_barrier_sync(2 * cutlass::NumThreadsPerWarpGroup, FwdBarrier::kWarpScheduler0, warp_group);
    };
    auto pass_turn = [&] {
      if constexpr (kPingPong)
        named_barrier_arrive(2 * cutlass::NumThreadsPerWarpGroup, FwdBarrier::kWarpScheduler0,
                             (warp_group + 1) % kNumMmaWarpGroups);
    };

    // A gathered stage was written by cp.async, through the generic proxy; the WGMMAs read it
    // through the async proxy.
    const bool gathered = kPagedKv && params.paged.mode == PagedMode::kGather;
    auto wait_stage = [&](auto& pipeline, PipelineState& state) {
      pipeline.consumer_wait(state);
      if (gathered) cutlass::arch::fence_view_async_shared();
    };

    // S = Q K^T (+ Qv V^T with qv, V of the same block: the V stage `v_ahead`, one block ahead of
    // the one P V reads; the second wait on a stage returns at once).
    // P V's V stages: pipeline_v's, or with fp8 the transposed ones.
    auto& pipeline_pv = [&]() -> auto& {
      if constexpr (kTransposesV) return *shared.pipeline_vt;
      else return shared.pipeline_v;
    }();
    PipelineState v_ahead = shared.v_state;
    auto wait_v_ahead = [&] {
      if constexpr (kQv) wait_stage(shared.pipeline_v, v_ahead);
    };
    // Qv's and V's operands of Qv V^T, (MMA, MMA_M, MMA_K) and (MMA, MMA_N, MMA_K, PIPE), made once
    // as Q's and K's are (none without qv); where O is split, this warpgroup's half of their
    // columns. (cute::Tensor named: in a lambda of this template the unqualified name finds
    // flashhopper's.)
    auto qv_operands = [&] {
      if constexpr (kQv) {
        cute::Tensor sQv = make_tensor(make_smem_ptr(shared.kv.smem_qv.data()), SmemLayoutQvHalves{});
        cute::Tensor sV = make_tensor(make_smem_ptr(shared.kv.smem_v.data()), SmemLayoutVAsBHalves{});
        return cute::make_tuple(thr_mma_qk.partition_fragment_A(sQv)(_, _, _, column_wg),
                                thr_mma_qk.partition_fragment_B(sV)(_, _, _, column_wg, _));
      } else {
        return cute::tuple<>{};
      }
    }();
    // This warpgroup's share of Q K^T's MMA slices of d (16 columns, 32 with fp8): all of them unless O is split.
    constexpr int kSlicesQK = decltype(size<2>(tSrQ))::value / kColumnWarpGroups;
    const int first_slice_qk = column_wg * kSlicesQK;
    auto gemm_s = [&](auto zero_init) {
      constexpr bool kZeroInit = decltype(zero_init)::value;
      if constexpr (kQDescriptorsPerUse) {
        warpgroup_gemm<kZeroInit, -1, kSlicesQK>(tiled_mma_qk, descriptors_per_use(tSrQ),
                                                 tSrK(_, _, _, shared.k_state.index()), tSrS, first_slice_qk);
      } else {
        warpgroup_gemm<kZeroInit, -1, kSlicesQK>(tiled_mma_qk, tSrQ, tSrK(_, _, _, shared.k_state.index()), tSrS,
                                                 first_slice_qk);
      }
      if constexpr (kQv) {
        // Qv's 16 k-slices stay put across the loop: recomputed per use rather than held (utils.hpp).
        warpgroup_gemm<false, -1>(tiled_mma_qk, descriptors_per_use(get<0>(qv_operands)),
                                  get<1>(qv_operands)(_, _, _, v_ahead.index()), tSrS);
        ++v_ahead;
      }
    };

    // Where O is split: S is this warpgroup's half of the contraction until the other's is added.
    // Block k's halves go through buffer k % 2 (the K stages' count, which runs on across tiles),
    // so one barrier a block suffices: a buffer is written again only after the next block's
    // barrier, which the other warpgroup reaches after reading it. With one buffer a second barrier
    // before the writes waits until both have read the previous block's halves. s0 + s1 and s1 + s0
    // are the same float, so both warpgroups hold the same S.
    auto add_other_half = [&] {
      if constexpr (kSplitsO) {
        static_assert(decltype(size(tSrS))::value == kScoreRegisters && kScoreRegisters % 4 == 0);
        constexpr int kThreads = cutlass::NumThreadsPerWarpGroup;
        constexpr int kQuads = kScoreRegisters / 4;  // 16-byte accesses, conflict-free a quarter warp each
        constexpr uint32_t kStride = kThreads * 16;  // bytes from one register quad to the next
        const uint32_t turn = kExchangeBuffers == 2 ? shared.k_state.count() & 1 : 0;
        const uint32_t buffer = cute::cast_smem_ptr_to_uint(shared.kv.smem_s.data()) +
                                turn * kColumnWarpGroups * kQuads * kStride + (thread_idx % kThreads) * 16;
        const uint32_t mine = buffer + column_wg * kQuads * kStride;
        const uint32_t theirs = buffer + (1 - column_wg) * kQuads * kStride;
        if constexpr (kExchangeBuffers == 1) named_barrier_sync(kNumMmaThreads, FwdBarrier::kScoreExchange);
        CUTLASS_PRAGMA_UNROLL
        for (int r = 0; r < kQuads; ++r)
          store_shared_16(mine + r * kStride, tSrS(4 * r), tSrS(4 * r + 1), tSrS(4 * r + 2), tSrS(4 * r + 3));
        named_barrier_sync(kNumMmaThreads, FwdBarrier::kScoreExchange);
        CUTLASS_PRAGMA_UNROLL
        for (int r = 0; r < kQuads; ++r) {
          const float4 other = load_shared_16(theirs + r * kStride);
          tSrS(4 * r) += other.x;
          tSrS(4 * r + 1) += other.y;
          tSrS(4 * r + 2) += other.z;
          tSrS(4 * r + 3) += other.w;
        }
      }
    };

    shared.q_full.wait(shared.q_phase);
    shared.q_phase ^= 1;

    // First block: S only.
    int n_block = blocks.at(0);
    wait_stage(shared.pipeline_k, shared.k_state);
    wait_v_ahead();
    take_turn();
    gemm_s(/*kZeroInit=*/cute::true_type{});
    pass_turn();
    warpgroup_wait<0>();
    add_other_half();
    shared.pipeline_k.consumer_release(shared.k_state);
    ++shared.k_state;
    // Q is free once the tile's last Q K^T is done: the next tile's Q loads during the rest.
    if (num_blocks == 1) shared.q_empty.arrive();
    mask_scores(n_block, cute::true_type{});
    softmax.template update</*kFirst=*/true>(scores, o_scale);
    clear(tOrO);

    // P (the previous block's probabilities, as the A operand of P V) is written only at the top
    // of the next iteration, after the K pipeline's wait: its registers are read by the P V still
    // in flight, so a wait for that P V must come first, and with the conversion at the end of
    // the softmax ptxas hoisted that wait above the whole softmax, which then no longer overlapped
    // P V (ncu, hdim 128: 15% of all stall samples on that wait). The pipeline wait's branch keeps
    // the softmax and the wait apart.
    // (The wait is unconditional: behind a branch, ptxas serialised every WGMMA of the kernel.)
    auto write_p = [&](bool pv_in_flight) {
      warpgroup_wait<0>();
      if (pv_in_flight) {
        pipeline_pv.consumer_release(shared.v_state);
        ++shared.v_state;
      }
      if constexpr (kTransposesV) fp8_operand_from_scores(tSrS, tOrP);
      else convert_into(tSrS, tOrP);
    };
    // Step i >= 1 of the walk: S of block i, P V of block i - 1. Inlined at its three calls: as a
    // function of its own, ptxas serialised its WGMMAs.
    auto step = [&](int i, auto may_cross) CUTLASS_LAMBDA_FUNC_INLINE {
      n_block = blocks.at(i);
      wait_stage(shared.pipeline_k, shared.k_state);
      write_p(i > 1);
      wait_v_ahead();
      take_turn();
      gemm_s(cute::true_type{});
      // O shrinks for the previous block's maximum while Q K^T runs, before P V adds to it.
      scale_rows(o_rowcol, o_scale);
      wait_stage(pipeline_pv, shared.v_state);
      warpgroup_gemm<false, -1>(tiled_mma_pv, tOrP, tOrVt(_, _, _, shared.v_state.index()), tOrO);
      pass_turn();
      warpgroup_wait<1>();  // S is ready; P V may still run
      add_other_half();
      shared.pipeline_k.consumer_release(shared.k_state);
      ++shared.k_state;
      if (i == num_blocks - 1) shared.q_empty.arrive();
      mask_scores(n_block, may_cross);
      softmax.template update</*kFirst=*/false>(scores, o_scale);
    };
    // The steps whose blocks cross no boundary run without the masking code (unmasked: every step
    // after the first, which holds the key padding); the others, at the ends of a window or at the
    // diagonal, and the sink blocks, with it.
    if constexpr (kMask == MaskKind::kNone) {
      CUTLASS_PRAGMA_NO_UNROLL
      for (int i = 1; i < num_blocks; ++i) step(i, cute::false_type{});
    } else if constexpr (kFeatures != ForwardFeatures::kNone || kRowWarpGroups > 2) {
      // One loop that tests each block in the general kernels, where three spilled (hdim 128 causal:
      // 0 -> 13 local operations in the loops, window 17 -> 70), and in three-warpgroup tiles (hdim
      // 64), where three ran 3-4% slower causal (bench/RESULTS.md, 2026-12-07 night; the causal
      // branch's two loops there wait for their A/B: "the causal walk in two loops").
      CUTLASS_PRAGMA_NO_UNROLL
      for (int i = 1; i < num_blocks; ++i) step(i, cute::true_type{});
    } else if constexpr (kMask == MaskKind::kCausal) {
      // The diagonal's steps, then those that cross nothing (first_unmasked_step): two loops.
      const int first_unmasked = mask.first_unmasked_step(blocks, work.block);
      int i = 1;
      CUTLASS_PRAGMA_NO_UNROLL
      for (; i < min(first_unmasked, num_blocks); ++i) step(i, cute::true_type{});
      CUTLASS_PRAGMA_NO_UNROLL
      for (; i < num_blocks; ++i) step(i, cute::false_type{});
    } else {  // windows: unmasked steps between the ends' masked ones
      int unmasked_begin, unmasked_end;
      mask.unmasked_steps(blocks, work.block, unmasked_begin, unmasked_end);
      int i = 1;
      CUTLASS_PRAGMA_NO_UNROLL
      for (; i < min(unmasked_begin, num_blocks); ++i) step(i, cute::true_type{});
      CUTLASS_PRAGMA_NO_UNROLL
      for (; i < min(unmasked_end, num_blocks); ++i) step(i, cute::false_type{});
      CUTLASS_PRAGMA_NO_UNROLL
      for (; i < num_blocks; ++i) step(i, cute::true_type{});
    }

    // Last block: P V only.
    write_p(num_blocks > 1);
    scale_rows(o_rowcol, o_scale);
    wait_stage(pipeline_pv, shared.v_state);
    take_turn();
    warpgroup_gemm<false, -1>(tiled_mma_pv, tOrP, tOrVt(_, _, _, shared.v_state.index()), tOrO);
    pass_turn();
    warpgroup_wait<0>();
    pipeline_pv.consumer_release(shared.v_state);
    ++shared.v_state;
  }

  // fp8: V's bytes in the staging buffers and in P V's stages, and the transpose's moves
  // (fp8_v_transpose.hpp). Slot s of a 32-key slice of P V's operands holds key key_of_fp8_slot(s).
  using VTranspose = Fp8VTranspose<kBlockN, kHeadDimV>;

  // fp8: byte v of slice k of a thread's P (fp8_operand_from_scores) is, by CuTe's layouts of the
  // two MMAs, the accumulator value of the same row and of the key that P V's stage holds at that
  // byte's k (key_of_fp8_slot): every byte, at the threads of each lane bit and warp and at the first
  // and last slice (the layouts are linear in those; all 128 threads exceed nvcc's constexpr budget).
  static constexpr bool fp8_keys_agree() {
    using ALayout = typename TiledMmaPV::Atom::Traits::ALayout;  // (thread, byte) -> m + 64 k of a 64 x 32 slice
    using CLayout = typename TiledMmaQK::Atom::Traits::CLayout;  // (thread, value) -> m + 64 n of 64 x kBlockN
    for (int thread : {0, 1, 2, 3, 4, 8, 16, 31, 32, 64, 96, 127})
      for (int slice : {0, kBlockN / 32 - 1})
        for (int byte = 0; byte < 16; ++byte) {
          const int i = byte % 4, r = byte / 4 % 2, h = byte / 8;
          const int a = ALayout{}(thread, byte), c = CLayout{}(thread, i % 2 + 2 * r + 4 * (4 * slice + 2 * h + i / 2));
          if (a % 64 != c % 64 || c / 64 != 32 * slice + VTranspose::key_of_fp8_slot(a / 64)) return false;
        }
    return true;
  }
  // The transpose's byte offsets are CuTe's layouts' of the staging buffers and P V's stages.
  static constexpr bool transpose_offsets_agree() {
    for (int n : {0, 1, 4, 7, 8, 13, 31, 32, kBlockN - 1})
      for (int c : {0, 1, 8, 15, 16, 63, kHeadDimV / 2, kHeadDimV - 1})
        for (int stage : {0, kStages - 1})
          if (int(SmemLayoutVAsB{}(n, c, stage)) != VTranspose::staged_v_offset(n, c, stage) ||
              int(SmemLayoutVtK{}(c, n, stage)) != VTranspose::vt_offset(c, n, stage))
            return false;
    return true;
  }

  // fp8: warp kWarp's units of a block (kWarp, kWarp + kWarps, ...): unrolled, so that each unit's two
  // addresses are the lane's bases with a constant XOR and add (a unit index known only at run
  // time cost about 20 instructions of address arithmetic a unit), and each unit's load issued
  // before the previous unit's store (the asm statements keep their order), two in flight.
  template <int kWarp, int kWarps>
  CUTLASS_DEVICE static void transpose_units(uint32_t load_base, uint32_t store_base) {
    static_assert(kWarp < VTranspose::kUnits);
    uint32_t loaded[2][4];
    load_matrices_x4_transposed(VTranspose::load_address(load_base, kWarp), loaded[0]);
    CUTLASS_PRAGMA_UNROLL
    for (int unit = kWarp, i = 0; unit < VTranspose::kUnits; unit += kWarps, ++i) {
      if (unit + kWarps < VTranspose::kUnits)
        load_matrices_x4_transposed(VTranspose::load_address(load_base, unit + kWarps), loaded[(i + 1) % 2]);
      uint32_t stored[4];
      VTranspose::reorder(loaded[i % 2], stored);
      store_matrices_x4(VTranspose::store_address(store_base, unit), stored);
    }
  }

  // fp8, the producer's warps 1-3 (kTransposeThreads, `thread` their index): each of the tile's
  // num_blocks V blocks from its staging buffer (N, dv) into P V's stage (dv, N) in key_of_fp8_slot's
  // order, a warp a unit of 16 slots by 32 columns at a time: one ldmatrix.x4.trans, four PRMT, one
  // stmatrix.x4 (Fp8VTranspose). Its loads read 8 keys' 16-byte chunks at a column, which the
  // staging buffer's swizzle puts on different banks; its stores write 8 columns' chunks at a slot,
  // columns c and c + 8 of which share banks (two ways).
  //
  // V column-major (v_column_major): the staging buffer already has P V's layout, keys in their
  // order; each 16-byte chunk (16 keys, a half of a 32-key slice) only reorders its bytes into
  // key_of_fp8_slot's order, which stays within the half: a 16-byte load, 4 PRMT, a 16-byte store
  // at the same offset (both buffers share the layout, so the swizzle never matters).
  CUTLASS_DEVICE static void transpose_v(SharedState const& shared, int num_blocks, int thread, bool v_column_major) {
    static_assert(kTransposesV);
    static_assert(fp8_keys_agree(), "P's bytes and V's transposed keys must pair the same key");
    static_assert(transpose_offsets_agree(), "the transpose's offsets must be CuTe's layouts'");
    static_assert(VTranspose::column_major_order_agrees(), "the chunk's byte order must be key_of_fp8_slot's");
    constexpr int kTransposeWarps = kTransposeThreads / cutlass::NumThreadsPerWarp;
    const int warp = thread / cutlass::NumThreadsPerWarp, lane = thread % cutlass::NumThreadsPerWarp;
    const uint32_t staged = cast_smem_ptr_to_uint(shared.kv.smem_v_staged.data());
    const uint32_t transposed = cast_smem_ptr_to_uint(shared.kv.smem_v.data());
    // The XORs act on whole addresses: both buffers start on a swizzle atom's repeat (as the TMA's
    // 128-byte swizzle and the WGMMA descriptors already require).
    if ((staged | transposed) % 1024 != 0) __trap();
    PipelineVt& pipeline_vt = *shared.pipeline_vt;
    PipelineState& vt_state = *shared.vt_state;
    for (int block = 0; block < num_blocks; ++block) {
      shared.pipeline_v.consumer_wait(shared.v_state);
      pipeline_vt.producer_acquire(vt_state);
      const int from = shared.v_state.index(), to = vt_state.index();
      if (v_column_major) {
        constexpr int kStageBytes = kBlockN * kHeadDimV, kChunks = kStageBytes / 16;
        const uint32_t from_stage = staged + uint32_t(from * kStageBytes);
        const uint32_t to_stage = transposed + uint32_t(to * kStageBytes);
#pragma unroll 1
        for (int chunk = thread; chunk < kChunks; chunk += kTransposeThreads) {
          uint32_t keys[4], slots[4];
          load_shared_u32x4(from_stage + 16 * chunk, keys);
          VTranspose::reorder_column_major(keys, slots);
          store_shared_u32x4(to_stage + 16 * chunk, slots);
        }
      } else {
        const uint32_t load_base = staged + uint32_t(VTranspose::load_lane_offset(lane, from));
        const uint32_t store_base = transposed + uint32_t(VTranspose::store_lane_offset(lane, to));
        static_assert(kTransposeWarps == 3);
        switch (warp) {
          case 0: transpose_units<0, kTransposeWarps>(load_base, store_base); break;
          case 1: transpose_units<1, kTransposeWarps>(load_base, store_base); break;
          default: transpose_units<2, kTransposeWarps>(load_base, store_base); break;
        }
      }
      shared.pipeline_v.consumer_release(shared.v_state);
      ++shared.v_state;
      // The stores went through the generic proxy; the WGMMAs read through the async proxy.
      cutlass::arch::fence_view_async_shared();
      pipeline_vt.producer_commit(vt_state);
      ++vt_state;
    }
  }

  // The tile's softmax scale, its transform (softcap's pre-tanh scale) and O's factor: with fp8,
  // q_descale * k_descale scales S (the transform's scale with softcap, else the softmax's) and
  // v_descale O, for the tile's batch and KV head; elsewhere the parameters' own.
  struct TileScale {
    float softmax_scale, softmax_scale_log2;
    Transform transform;
    float o_factor;
  };
  CUTLASS_DEVICE static TileScale tile_scale(Params const& params, WorkTile const& work, SeqlenInfo const& seq) {
    TileScale t{params.softmax_scale, params.softmax_scale_log2, params.transform, 1.f};
    if constexpr (kTransposesV) {
      const int head_kv = params.heads_per_kv_head.divide(work.head);
      // A factor a sequence: its index in the batch (batch_q is 0 for packed rows).
      const float qk = params.q_descale.at(seq.batch, head_kv) * params.k_descale.at(seq.batch, head_kv);
      if constexpr (Transform::kSoftcap) {
        t.transform.pre_tanh_scale *= qk;
      } else {
        t.softmax_scale *= qk;
        t.softmax_scale_log2 *= qk;
      }
      t.o_factor = params.v_descale.at(seq.batch, head_kv);
    }
    return t;
  }
};

}  // namespace flashhopper::hopper
