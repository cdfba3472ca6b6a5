// Backward epilogue: a key block's dK (times the softmax scale) and dV, float32 registers ->
// input dtype -> global memory. Rows past the key sequence's end are not written.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>

#include "hopper/collective/mainloop_bwd.hpp"
#include "hopper/common/utils.hpp"

namespace flashhopper::hopper {

using namespace cute;

template <class Element_, int kBlockN_, int kHeadDim_, class TiledMmadKV_>
struct BackwardEpilogue {
  using Element = Element_;
  using TiledMmadKV = TiledMmadKV_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kHeadDim = kHeadDim_;
  using TileShapedKV = Shape<Int<kBlockN>, Int<kHeadDim>>;

  using ShapedKV = Shape<int32_t, int32_t, int32_t, int32_t>;  // (seqlen_k, d, heads_kv, batch)
  using StridedKV = Stride<int64_t, _1, int64_t, int64_t>;

  struct Arguments {
    Element* ptr_dk;
    StridedKV stride_dk;
    Element* ptr_dv;
    StridedKV stride_dv;
    ShapedKV shape_dkv;
    float softmax_scale;
  };
  using Params = Arguments;
  static Params to_underlying_arguments(Arguments const& args) { return args; }

  template <class TensordKV>
  CUTLASS_DEVICE static void store(Params const& params, TensordKV& tdKrdK, TensordKV const& tdVrdV,
                                   int thread_idx, BackwardBlock const& blk) {
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(tdKrdK); ++i) tdKrdK(i) *= params.softmax_scale;
    Tensor coords = TiledMmadKV{}.get_thread_slice(thread_idx).partition_C(make_identity_tensor(TileShapedKV{}));
    const int rows = get<0>(params.shape_dkv) - blk.n_block * kBlockN;
    auto tile = [&](Element* ptr, StridedKV stride) {
      Tensor m = make_tensor(make_gmem_ptr(ptr), params.shape_dkv, stride)(_, _, blk.head_kv, blk.batch);
      return local_tile(m, TileShapedKV{}, make_coord(blk.n_block, _0{}));  // (N, d)
    };
    store_accumulator_rows(tdKrdK, coords, tile(params.ptr_dk, params.stride_dk), rows);
    store_accumulator_rows(tdVrdV, coords, tile(params.ptr_dv, params.stride_dv), rows);
  }
};

}  // namespace flashhopper::hopper
