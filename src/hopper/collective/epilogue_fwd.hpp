// Forward epilogue: O (float32 registers) -> output dtype -> shared memory (stmatrix) -> global
// memory by one TMA store; LSE straight from the threads holding column 0 of each row. Tiles
// that see no key write O = 0 and LSE = -inf with predicated 16-byte stores instead.
#pragma once

#include <cmath>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/cutlass.h>
#include <cutlass/gemm/collective/builders/sm90_common.inl>

#include "hopper/common/named_barrier.hpp"
#include "hopper/common/tile_scheduler.hpp"
#include "hopper/common/utils.hpp"

namespace flashhopper::hopper {

using namespace cute;

template <class Element_, int kBlockM_, int kHeadDimV_, class TiledMmaPV_>
struct ForwardEpilogue {
  using Element = Element_;
  using TiledMmaPV = TiledMmaPV_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kHeadDimV = kHeadDimV_;
  static constexpr int kNumMmaThreads = size(TiledMmaPV{});

  using TileShapeO = Shape<Int<kBlockM>, Int<kHeadDimV>>;
  using SmemLayoutO = decltype(tile_to_shape(
      cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::K, Element, Int<kBlockM>, Int<kHeadDimV>>(),
      TileShapeO{}));
  using SmemCopyAtomO = Copy_Atom<SM90_U32x4_STSM_N, Element>;

  using ShapeO = Shape<int32_t, int32_t, int32_t, int32_t>;  // (seqlen_q, dv, heads, batch)
  using StrideO = Stride<int64_t, _1, int64_t, int64_t>;
  using StrideLse = Stride<_1, int64_t, int64_t>;            // lse (seqlen_q, heads, batch)
  using TmaO = decltype(make_tma_copy(
      SM90_TMA_STORE{}, make_tensor(make_gmem_ptr(static_cast<Element*>(nullptr)), ShapeO{}, StrideO{}),
      SmemLayoutO{}, TileShapeO{}, _1{}));

  struct Arguments {
    Element* ptr_o;
    ShapeO shape_o;
    StrideO stride_o;
    float* ptr_lse;  // may be null
    StrideLse stride_lse;
  };

  struct Params {
    Element* ptr_o;
    ShapeO shape_o;
    StrideO stride_o;
    float* ptr_lse;
    StrideLse stride_lse;
    TmaO tma_o;
  };

  static Params to_underlying_arguments(Arguments const& args) {
    Tensor mO = make_tensor(make_gmem_ptr(args.ptr_o), args.shape_o, args.stride_o);
    TmaO tma_o = make_tma_copy(SM90_TMA_STORE{}, mO, SmemLayoutO{}, TileShapeO{}, _1{});
    return {args.ptr_o, args.shape_o, args.stride_o, args.ptr_lse, args.stride_lse, tma_o};
  }

  CUTLASS_DEVICE static void prefetch_tma_descriptors(Params const& params) {
    cute::prefetch_tma_descriptor(params.tma_o.get_tma_descriptor());
  }

  template <int kRows, class TensorO>
  CUTLASS_DEVICE static void write_lse(Params const& params, TensorO const& tOrO, float const (&lse)[kRows],
                                       int thread_idx, WorkTile const& work) {
    if (params.ptr_lse == nullptr) return;
    auto thr_mma = TiledMmaPV{}.get_thread_slice(thread_idx);
    Tensor tOcO = thr_mma.partition_C(make_identity_tensor(TileShapeO{}));
    Tensor coords = make_tensor(tOcO.data(), accumulator_rowcol(tOcO.layout()));
    static_assert(decltype(size<0>(coords))::value == kRows);
    const int seqlen_q = get<0>(params.shape_o);
    if (get<1>(coords(0, 0)) != 0) return;  // only the threads holding column 0
    Tensor mLse = make_tensor(make_gmem_ptr(params.ptr_lse),
                              make_shape(seqlen_q, get<2>(params.shape_o), get<3>(params.shape_o)),
                              params.stride_lse)(_, work.head, work.batch);
    CUTLASS_PRAGMA_UNROLL
    for (int m = 0; m < kRows; ++m) {
      const int row = work.block * kBlockM + get<0>(coords(m, 0));
      if (row < seqlen_q) mLse(row) = lse[m];
    }
  }

  // O already normalised, in float32 registers. The store is left in flight: the next store
  // waits for it before overwriting sO, and so must anyone who reuses sO (wait_for_store).
  template <int kRows, class TensorO>
  CUTLASS_DEVICE static void store(Params const& params, TensorO const& tOrO, float const (&lse)[kRows],
                                   Element* smem_o, int thread_idx, WorkTile const& work) {
    write_lse(params, tOrO, lse, thread_idx, work);

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
      Tensor mO = params.tma_o.get_tma_tensor(params.shape_o)(_, _, work.head, work.batch);  // (sq, dv)
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
                                          int thread_idx, WorkTile const& work) {
    write_lse(params, tOrO, lse, thread_idx, work);
    Tensor tOcO = TiledMmaPV{}.get_thread_slice(thread_idx).partition_C(make_identity_tensor(TileShapeO{}));
    Tensor mO = make_tensor(make_gmem_ptr(params.ptr_o), params.shape_o, params.stride_o)(_, _, work.head, work.batch);
    Tensor gO = local_tile(mO, TileShapeO{}, make_coord(work.block, _0{}));  // (M, dv)
    store_accumulator_rows(tOrO, tOcO, gO, get<0>(params.shape_o) - work.block * kBlockM);
  }

  // Called by the thread that issued the stores: returns once they have read shared memory.
  CUTLASS_DEVICE static void wait_for_store() { tma_store_wait<0>(); }

  // A tile whose rows see no key: O = 0 and LSE = -inf, by predicated 16-byte stores.
  // lse_value: -inf, or the learnable sink's logit (the only term of an empty row's sum).
  CUTLASS_DEVICE static void store_empty(Params const& params, int thread_idx, WorkTile const& work,
                                         float lse_value) {
    constexpr int kElemsPerStore = 16 / sizeof(Element);
    constexpr int kStoresPerRow = kHeadDimV / kElemsPerStore;
    const int seqlen_q = get<0>(params.shape_o);
    Tensor mO = make_tensor(make_gmem_ptr(params.ptr_o), params.shape_o, params.stride_o)(_, _, work.head, work.batch);
    const int row0 = work.block * kBlockM;
    for (int i = thread_idx; i < kBlockM * kStoresPerRow; i += kNumMmaThreads) {
      const int row = row0 + i / kStoresPerRow;
      const int col = (i % kStoresPerRow) * kElemsPerStore;
      if (row < seqlen_q) *reinterpret_cast<uint4*>(&mO(row, col)) = make_uint4(0, 0, 0, 0);
    }
    if (params.ptr_lse != nullptr) {
      Tensor mLse = make_tensor(make_gmem_ptr(params.ptr_lse),
                                make_shape(seqlen_q, get<2>(params.shape_o), get<3>(params.shape_o)),
                                params.stride_lse)(_, work.head, work.batch);
      for (int i = thread_idx; i < kBlockM; i += kNumMmaThreads) {
        if (row0 + i < seqlen_q) mLse(row0 + i) = lse_value;
      }
    }
  }
};

}  // namespace flashhopper::hopper
