// Backward epilogue: a key block's dK (times the softmax scale) and dV, float32 registers ->
// input dtype -> global memory. Rows past the sequence's capacity are not written (keys past
// seqused_k, which no row sees, get zeros).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>

#include "hopper/common/backward_block.hpp"
#include "hopper/common/utils.hpp"

namespace flashhopper::hopper {

using namespace cute;

template <class Element_, class Mainloop>
struct BackwardEpilogue {
  using Element = Element_;
  static constexpr int kBlockN = Mainloop::kBlockN;
  static constexpr bool kTransposed = Mainloop::kDkvTransposed;  // registers hold dK^T, dV^T

  using ShapedKV = Shape<int32_t, int32_t, int32_t, int32_t>;  // (seqlen_k, d, heads_kv, batch); packed (total_k, d, heads_kv, 1)
  using StridedKV = Stride<int64_t, _1, int64_t, int64_t>;

  struct Arguments {
    Element* ptr_dk;
    StridedKV stride_dk;
    Element* ptr_dv;
    StridedKV stride_dv;
    ShapedKV shape_dkv;  // dK's columns: the call's d; dV has head_dim_v
    int head_dim_v;
    float softmax_scale;
  };
  using Params = Arguments;
  static Params to_underlying_arguments(Arguments const& args) { return args; }

  template <class TensordK, class TensordV>
  CUTLASS_DEVICE static void store(Params const& params, TensordK& tdKrdK, TensordV const& tdVrdV, int thread_idx,
                                   BackwardBlock const& blk) {
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(tdKrdK); ++i) tdKrdK(i) *= params.softmax_scale;
    const int rows = blk.seq.capacity_k - blk.n_block * kBlockN;
    // The call's d and dv: at most the family's (Mainloop::kHeadDim, kHeadDimV).
    store_key_grad<Mainloop::kHeadDim>(typename Mainloop::TiledMmadK{}, tdKrdK, params.ptr_dk, params.stride_dk,
                                       get<1>(params.shape_dkv), rows, thread_idx, blk, params);
    store_key_grad<Mainloop::kHeadDimV>(typename Mainloop::TiledMmadV{}, tdVrdV, params.ptr_dv, params.stride_dv,
                                        params.head_dim_v, rows, thread_idx, blk, params);
  }

 private:
  // One of dK, dV: its (kBlockN, kCols) tile of the key block, rows below `rows` and columns below
  // `cols`.
  template <int kCols, class TiledMma, class TensorAcc>
  CUTLASS_DEVICE static void store_key_grad(TiledMma const& tiled_mma, TensorAcc const& acc, Element* ptr,
                                            StridedKV stride, int cols, int rows, int thread_idx,
                                            BackwardBlock const& blk, Params const& params) {
    Tensor m = domain_offset(make_coord(blk.seq.offset_k, _0{}),
                             make_tensor(make_gmem_ptr(ptr), with_columns(params.shape_dkv, cols),
                                         stride)(_, _, blk.head_kv, blk.seq.batch_k));
    Tensor gdst = local_tile(m, Shape<Int<kBlockN>, Int<kCols>>{}, make_coord(blk.n_block, _0{}));  // (N, cols)
    auto thr_mma = tiled_mma.get_thread_slice(thread_idx);
    if constexpr (kTransposed) {
      // Neighbouring registers are neighbouring keys, a row apart in memory: 2-byte stores, once
      // per key block.
      Tensor coords = thr_mma.partition_C(make_identity_tensor(Shape<Int<kCols>, Int<kBlockN>>{}));  // (d, N)
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(acc); ++i) {
        const auto [d, n] = coords(i);
        if (n < rows && d < cols) gdst(n, d) = Element(acc(i));
      }
    } else {
      Tensor coords = thr_mma.partition_C(make_identity_tensor(Shape<Int<kBlockN>, Int<kCols>>{}));  // (N, d)
      store_accumulator_rows(acc, coords, gdst, rows, cols);
    }
  }
};

}  // namespace flashhopper::hopper
