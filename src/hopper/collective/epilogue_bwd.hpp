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
  using TiledMmadKV = typename Mainloop::TiledMmadKV;
  static constexpr int kBlockN = Mainloop::kBlockN;
  static constexpr int kHeadDim = Mainloop::kHeadDim;
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

  template <class TensordKV>
  CUTLASS_DEVICE static void store(Params const& params, TensordKV& tdKrdK, TensordKV const& tdVrdV,
                                   int thread_idx, BackwardBlock const& blk) {
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(tdKrdK); ++i) tdKrdK(i) *= params.softmax_scale;
    const int rows = blk.seq.capacity_k - blk.n_block * kBlockN;
    const int cols_k = get<1>(params.shape_dkv), cols_v = params.head_dim_v;  // at most kHeadDim
    auto tile = [&](Element* ptr, StridedKV stride) {
      Tensor m = domain_offset(make_coord(blk.seq.offset_k, _0{}), make_tensor(make_gmem_ptr(ptr), params.shape_dkv,
                                                                                 stride)(_, _, blk.head_kv, blk.seq.batch_k));
      return local_tile(m, Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(blk.n_block, _0{}));  // (N, d)
    };
    auto thr_mma = TiledMmadKV{}.get_thread_slice(thread_idx);
    if constexpr (kTransposed) {
      // Neighbouring registers are neighbouring keys, a row apart in memory: 2-byte stores, once
      // per key block.
      Tensor coords = thr_mma.partition_C(make_identity_tensor(Shape<Int<kHeadDim>, Int<kBlockN>>{}));  // (d, N)
      Tensor gdK = tile(params.ptr_dk, params.stride_dk);
      Tensor gdV = tile(params.ptr_dv, params.stride_dv);
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(tdKrdK); ++i) {
        const auto [d, n] = coords(i);
        if (n < rows) {
          if (d < cols_k) gdK(n, d) = Element(tdKrdK(i));
          if (d < cols_v) gdV(n, d) = Element(tdVrdV(i));
        }
      }
    } else {
      Tensor coords = thr_mma.partition_C(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{}));  // (N, d)
      store_accumulator_rows(tdKrdK, coords, tile(params.ptr_dk, params.stride_dk), rows, cols_k);
      store_accumulator_rows(tdVrdV, coords, tile(params.ptr_dv, params.stride_dv), rows, cols_v);
    }
  }
};

}  // namespace flashhopper::hopper
