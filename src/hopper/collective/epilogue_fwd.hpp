// Forward epilogue: O (float32 registers) -> output dtype -> shared memory (stmatrix) -> global
// memory by one TMA store; LSE straight from the threads holding column 0 of each row. Tiles
// that see no key write O = 0 and LSE = -inf with predicated 16-byte stores instead. In a packed
// (varlen) batch a tile that ends past its sequence stores from registers, predicated by row, as
// when O does not fit in shared memory: a TMA store would write into the next sequence. Rows
// are written up to the sequence's capacity (SeqlenInfo), those past seqused_q as O = 0, LSE = -inf.
// Columns: the tensor's dv, which may be below kHeadDimV (the TMA store clips the rest, the
// register stores are predicated). A split-KV tile writes its split's float32 partials instead
// (O normalised over the split's keys, and its LSE), from registers, for the combine kernel.
// Packed GQA over several query tokens (kGroupedRows: the qv kernels with a KV cache's code) keeps
// the lse [B, Hq, sq] as the caller gave it: row r of the tile is token r / g's query head r % g.
#pragma once

#include <cmath>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/cutlass.h>
#include <cutlass/gemm/collective/builders/sm90_common.inl>

#include "hopper/common/forward_features.hpp"
#include "hopper/common/named_barrier.hpp"
#include "hopper/common/seqlen.hpp"
#include "hopper/common/tile_scheduler.hpp"
#include "hopper/common/utils.hpp"

namespace flashhopper::hopper {

using namespace cute;

template <class Element_, int kBlockM_, int kHeadDimV_, class TiledMmaPV_, ForwardFeatures kFeatures>
struct ForwardEpilogue {
  using Element = Element_;
  using TiledMmaPV = TiledMmaPV_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kHeadDimV = kHeadDimV_;
  static constexpr int kNumMmaThreads = size(TiledMmaPV{});
  static constexpr bool kPacked = holds(kFeatures, ForwardFeatures::kPacked);
  static constexpr bool kSplitKv = holds(kFeatures, ForwardFeatures::kSplitKv);
  static constexpr bool kGroupedRows = groups_query_rows(kFeatures);

  using TileShapeO = Shape<Int<kBlockM>, Int<kHeadDimV>>;
  using SmemLayoutO = decltype(tile_to_shape(
      cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::K, Element, Int<kBlockM>, Int<kHeadDimV>>(),
      TileShapeO{}));
  using SmemCopyAtomO = Copy_Atom<SM90_U32x4_STSM_N, Element>;

  using ShapeO = Shape<int32_t, int32_t, int32_t, int32_t>;  // (seqlen_q, dv, heads, batch); packed (total_q, dv, heads, 1)
  using StrideO = Stride<int64_t, _1, int64_t, int64_t>;
  using StrideLse = Stride<_1, int64_t, int64_t>;            // lse (seqlen_q, heads, batch), likewise
  // The lse's rows with several query tokens packed (kGroupedRows): row r is query head r % g of
  // token r / g. rows_per_token 1 otherwise.
  struct GroupedLse {
    int rows_per_token = 1;
    int64_t head_stride = 0;
    int64_t token_stride = 1;
  };
  // One sequence's lse rows of a grouped tile, addressed as write_lse_rows asks (lse(row)).
  struct GroupedLseRows {
    float* ptr;  // the sequence's row 0
    GroupedLse grouped;
    CUTLASS_DEVICE float& operator()(int row) const {
      const int token = row / grouped.rows_per_token, head = row - token * grouped.rows_per_token;
      return ptr[head * grouped.head_stride + token * grouped.token_stride];
    }
  };
  using TmaO = decltype(make_tma_copy(
      SM90_TMA_STORE{}, make_tensor(make_gmem_ptr(static_cast<Element*>(nullptr)), ShapeO{}, StrideO{}),
      SmemLayoutO{}, TileShapeO{}, _1{}));

  struct Arguments {
    Element* ptr_o;
    ShapeO shape_o;
    StrideO stride_o;
    float* ptr_lse;  // may be null
    StrideLse stride_lse;
    bool packed;     // varlen queries
    // Split-KV (else null): o_partial [splits, batch, heads, rows, dv] and lse_partial
    // [splits, batch, heads, rows], contiguous, with o's (rows, dv, heads, batch) extents.
    float* ptr_o_partial = nullptr;
    float* ptr_lse_partial = nullptr;
    GroupedLse grouped_lse = {};
  };

  struct Params {
    Element* ptr_o;
    ShapeO shape_o;
    StrideO stride_o;
    float* ptr_lse;
    StrideLse stride_lse;
    bool packed;
    TmaO tma_o;
    float* ptr_o_partial;
    float* ptr_lse_partial;
    GroupedLse grouped_lse;
  };

  static Params to_underlying_arguments(Arguments const& args) {
    Tensor mO = make_tensor(make_gmem_ptr(args.ptr_o), args.shape_o, args.stride_o);
    TmaO tma_o = make_tma_copy(SM90_TMA_STORE{}, mO, SmemLayoutO{}, TileShapeO{}, _1{});
    return {args.ptr_o,         args.shape_o, args.stride_o,      args.ptr_lse,         args.stride_lse,
            args.packed,        tma_o,        args.ptr_o_partial, args.ptr_lse_partial, args.grouped_lse};
  }

  CUTLASS_DEVICE static bool split_kv(Params const& params) { return kSplitKv && params.ptr_o_partial != nullptr; }

  CUTLASS_DEVICE static void prefetch_tma_descriptors(Params const& params) {
    cute::prefetch_tma_descriptor(params.tma_o.get_tma_descriptor());
  }

  // The tile's sequence rows of O (seqlen, dv) and of the LSE (seqlen).
  CUTLASS_DEVICE static auto sequence_o(Params const& params, WorkTile const& work, SeqlenInfo const& seq) {
    Tensor mO = make_tensor(make_gmem_ptr(params.ptr_o), params.shape_o, params.stride_o)(_, _, work.head, seq.batch_q);
    return domain_offset(make_coord(seq.offset_q, _0{}), mO);
  }
  CUTLASS_DEVICE static auto sequence_lse(Params const& params, WorkTile const& work, SeqlenInfo const& seq) {
    if constexpr (kGroupedRows) {
      // Rows as (query head, token): r -> (r % g, r / g), so each row finds its own head's lse.
      // These kernels also run ungrouped calls (g = 1, the identity: token_stride 1, as lse's rows),
      // packed ones included; grouped calls are never packed (offset_q 0).
      return GroupedLseRows{params.ptr_lse + seq.offset_q + work.head * get<1>(params.stride_lse) +
                                int64_t(seq.batch_q) * get<2>(params.stride_lse),
                            params.grouped_lse};
    } else {
      Tensor mLse = make_tensor(make_gmem_ptr(params.ptr_lse),
                                make_shape(get<0>(params.shape_o), get<2>(params.shape_o), get<3>(params.shape_o)),
                                params.stride_lse)(_, work.head, seq.batch_q);
      return domain_offset(make_coord(seq.offset_q), mLse);
    }
  }
  // The tile's split's rows of the partials: (seqlen, dv) and (seqlen), float32.
  CUTLASS_DEVICE static int64_t partial_row0(Params const& params, WorkTile const& work, SeqlenInfo const& seq) {
    const int64_t rows = get<0>(params.shape_o);
    return ((int64_t(work.split) * get<3>(params.shape_o) + seq.batch_q) * get<2>(params.shape_o) + work.head) * rows +
           seq.offset_q;
  }
  CUTLASS_DEVICE static auto partial_o(Params const& params, WorkTile const& work, SeqlenInfo const& seq) {
    const int dv = get<1>(params.shape_o);
    return make_tensor(make_gmem_ptr(params.ptr_o_partial + partial_row0(params, work, seq) * dv),
                       make_shape(get<0>(params.shape_o), dv), make_stride(int64_t(dv), _1{}));
  }
  CUTLASS_DEVICE static auto partial_lse(Params const& params, WorkTile const& work, SeqlenInfo const& seq) {
    return make_tensor(make_gmem_ptr(params.ptr_lse_partial + partial_row0(params, work, seq)),
                       make_shape(get<0>(params.shape_o)));
  }

  CUTLASS_DEVICE static bool tma_store_fits(Params const& params, WorkTile const& work, SeqlenInfo const& seq) {
    return !kPacked || !params.packed || (work.block + 1) * kBlockM <= seq.capacity_q;
  }

  // Rows past seqused_q get O = 0 and LSE = -inf (set, not scaled: their Q may be garbage).
  template <int kRows, class TensorORowCol>
  CUTLASS_DEVICE static void clear_unused_rows(TensorORowCol& o_rowcol, float (&lse)[kRows], int thread_idx,
                                               WorkTile const& work, SeqlenInfo const& seq) {
    Tensor tOcO = TiledMmaPV{}.get_thread_slice(thread_idx).partition_C(make_identity_tensor(TileShapeO{}));
    Tensor coords = make_tensor(tOcO.data(), accumulator_rowcol(tOcO.layout()));
    CUTLASS_PRAGMA_UNROLL
    for (int m = 0; m < kRows; ++m) {
      if (work.block * kBlockM + get<0>(coords(m, 0)) >= seq.seqlen_q) {
        lse[m] = -INFINITY;
        CUTLASS_PRAGMA_UNROLL
        for (int n = 0; n < size<1>(o_rowcol); ++n) o_rowcol(m, n) = 0.f;
      }
    }
  }

  template <int kRows, class TensorO>
  CUTLASS_DEVICE static void write_lse(Params const& params, TensorO const& tOrO, float const (&lse)[kRows],
                                       int thread_idx, WorkTile const& work, SeqlenInfo const& seq) {
    if (params.ptr_lse == nullptr) return;
    write_lse_rows(sequence_lse(params, work, seq), lse, thread_idx, work, seq);
  }
  template <int kRows, class TensorLse>
  CUTLASS_DEVICE static void write_lse_rows(TensorLse mLse, float const (&lse)[kRows], int thread_idx,
                                            WorkTile const& work, SeqlenInfo const& seq) {
    auto thr_mma = TiledMmaPV{}.get_thread_slice(thread_idx);
    Tensor tOcO = thr_mma.partition_C(make_identity_tensor(TileShapeO{}));
    Tensor coords = make_tensor(tOcO.data(), accumulator_rowcol(tOcO.layout()));
    static_assert(decltype(size<0>(coords))::value == kRows);
    if (get<1>(coords(0, 0)) != 0) return;  // only the threads holding column 0
    CUTLASS_PRAGMA_UNROLL
    for (int m = 0; m < kRows; ++m) {
      const int row = work.block * kBlockM + get<0>(coords(m, 0));
      if (row < seq.capacity_q) mLse(row) = lse[m];
    }
  }

  // O already normalised, in float32 registers. The store is left in flight: the next store
  // waits for it before overwriting sO, and so must anyone who reuses sO (wait_for_store).
  template <int kRows, class TensorO>
  CUTLASS_DEVICE static void store(Params const& params, TensorO const& tOrO, float const (&lse)[kRows],
                                   Element* smem_o, int thread_idx, WorkTile const& work, SeqlenInfo const& seq) {
    write_lse(params, tOrO, lse, thread_idx, work, seq);

    Tensor sO = make_tensor(make_smem_ptr(smem_o), SmemLayoutO{});
    auto smem_tiled_copy_o = make_tiled_copy_C(SmemCopyAtomO{}, TiledMmaPV{});
    auto smem_thr_copy_o = smem_tiled_copy_o.get_thread_slice(thread_idx);
    Tensor tOrO_out = make_tensor_like<Element>(tOrO);
    convert_into(tOrO, tOrO_out);
    Tensor taccOrO = smem_thr_copy_o.retile_S(tOrO_out);
    Tensor taccOsO = smem_thr_copy_o.partition_D(sO);

    // The previous tile's store has read sO.
    if (thread_idx == 0) wait_for_store();
    named_barrier_sync(kNumMmaThreads, FwdBarrier::kEpilogue);
    copy(smem_tiled_copy_o, taccOrO, taccOsO);
    cutlass::arch::fence_view_async_shared();  // make the stmatrix writes visible to the TMA unit
    named_barrier_sync(kNumMmaThreads, FwdBarrier::kEpilogue);

    if (thread_idx == 0) {
      Tensor mO = domain_offset(make_coord(seq.offset_q, _0{}),
                                params.tma_o.get_tma_tensor(params.shape_o)(_, _, work.head, seq.batch_q));  // (sq, dv)
      Tensor gO = local_tile(mO, TileShapeO{}, make_coord(work.block, _0{}));             // (M, dv)
      auto [tOgO, tOsO] =
          tma_partition(params.tma_o, _0{}, Layout<_1>{}, group_modes<0, 2>(sO), group_modes<0, 2>(gO));
      copy(params.tma_o, tOsO, tOgO);
      tma_store_arrive();
    }
  }

  // O straight from registers, for when sO does not fit in shared memory.
  template <int kRows, class TensorO>
  CUTLASS_DEVICE static void store_direct(Params const& params, TensorO const& tOrO, float const (&lse)[kRows],
                                          int thread_idx, WorkTile const& work, SeqlenInfo const& seq) {
    write_lse(params, tOrO, lse, thread_idx, work, seq);
    Tensor tOcO = TiledMmaPV{}.get_thread_slice(thread_idx).partition_C(make_identity_tensor(TileShapeO{}));
    Tensor gO = local_tile(sequence_o(params, work, seq), TileShapeO{}, make_coord(work.block, _0{}));  // (M, dv)
    store_accumulator_rows(tOrO, tOcO, gO, seq.capacity_q - work.block * kBlockM, get<1>(params.shape_o));
  }

  // A finished tile's O and LSE, by the path its call takes: a split's float32 partials; else one
  // TMA store through shared memory (kOStaged: the kernel has O's buffer, smem_o) where the tile
  // ends within its sequence (in a packed batch a whole-tile store could spill into the next
  // sequence); else straight from registers.
  template <bool kOStaged, int kRows, class TensorO>
  CUTLASS_DEVICE static void store_tile(Params const& params, TensorO const& tOrO, float const (&lse)[kRows],
                                        Element* smem_o, int thread_idx, WorkTile const& work,
                                        SeqlenInfo const& seq) {
    if (split_kv(params)) {
      store_partial(params, tOrO, lse, thread_idx, work, seq);
    } else if constexpr (kOStaged) {
      if (tma_store_fits(params, work, seq)) {
        store(params, tOrO, lse, smem_o, thread_idx, work, seq);
      } else {
        store_direct(params, tOrO, lse, thread_idx, work, seq);
      }
    } else {
      store_direct(params, tOrO, lse, thread_idx, work, seq);
    }
  }

  // Split-KV: the split's normalised O and its LSE as float32 partials, from registers.
  template <int kRows, class TensorO>
  CUTLASS_DEVICE static void store_partial(Params const& params, TensorO const& tOrO, float const (&lse)[kRows],
                                           int thread_idx, WorkTile const& work, SeqlenInfo const& seq) {
    write_lse_rows(partial_lse(params, work, seq), lse, thread_idx, work, seq);
    Tensor tOcO = TiledMmaPV{}.get_thread_slice(thread_idx).partition_C(make_identity_tensor(TileShapeO{}));
    Tensor gO = local_tile(partial_o(params, work, seq), TileShapeO{}, make_coord(work.block, _0{}));  // (M, dv)
    store_accumulator_rows(tOrO, tOcO, gO, seq.capacity_q - work.block * kBlockM, get<1>(params.shape_o));
  }

  // Called by the thread that issued the stores: returns once they have read shared memory.
  CUTLASS_DEVICE static void wait_for_store() { tma_store_wait<0>(); }

  // A tile whose rows see no key: O = 0 and LSE = -inf, by predicated 16-byte stores.
  // lse_value: -inf, or the learnable sink's logit (the only term of an empty row's sum).
  // (Rows past seqused_q get -inf whatever lse_value is.)
  CUTLASS_DEVICE static void store_empty(Params const& params, int thread_idx, WorkTile const& work,
                                         SeqlenInfo const& seq, float lse_value) {
    const int row0 = work.block * kBlockM;
    auto clear_o = [&](auto mO) {
      constexpr int kElemsPerStore = 16 / sizeof(typename decltype(mO)::value_type);
      constexpr int kStoresPerRow = kHeadDimV / kElemsPerStore;
      for (int i = thread_idx; i < kBlockM * kStoresPerRow; i += kNumMmaThreads) {
        const int row = row0 + i / kStoresPerRow;
        const int col = (i % kStoresPerRow) * kElemsPerStore;
        if (row < seq.capacity_q && col < get<1>(params.shape_o))
          *reinterpret_cast<uint4*>(&mO(row, col)) = make_uint4(0, 0, 0, 0);
      }
    };
    auto set_lse = [&](auto mLse) {
      for (int i = thread_idx; i < kBlockM; i += kNumMmaThreads) {
        const int row = row0 + i;
        if (row < seq.capacity_q) mLse(row) = row < seq.seqlen_q ? lse_value : -INFINITY;
      }
    };
    if (split_kv(params)) {
      clear_o(partial_o(params, work, seq));
      set_lse(partial_lse(params, work, seq));
      return;
    }
    clear_o(sequence_o(params, work, seq));
    if (params.ptr_lse != nullptr) set_lse(sequence_lse(params, work, seq));
  }
};

}  // namespace flashhopper::hopper
