// Split-KV combine: for every (batch, head, row), LSE = log sum_s exp(LSE_s) and
// O = sum_s exp(LSE_s - LSE) O_s over the splits' float32 partials. A split that saw no key of the
// row (LSE_s = -inf) weighs 0; a row no split saw gets O = 0 and LSE = -inf, never NaN.
// One warp a row: its lanes reduce the splits' LSE, keep the weights in shared memory, then read
// the rows O_s column by column (consecutive lanes, consecutive columns). Memory-bound; plain
// CUDA, no tensor cores.
#pragma once

#include <cmath>
#include <cstdint>

#include <cutlass/cutlass.h>
#include <cutlass/numeric_conversion.h>

#include "flashhopper/flashhopper.h"
#include "hopper/common/nan_max.hpp"

namespace flashhopper::hopper {

template <class OutElement>
struct SplitCombineKernel {
  static constexpr int kWarps = 8;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kMaxSplits = FH_MAX_SPLITS;  // the C ABI's bound on num_splits

  // Every tensor as (split, batch, head, row, column) element strides; a packed (varlen) call
  // is one batch of total_q rows. lse may be null. The partials' heads may come in groups
  // (several query tokens packed, plan/packed_decode.hpp: a KV head's query heads): head h at
  // (h / heads_per_group) * group stride + (h % heads_per_group) * head stride.
  struct Params {
    float const* out_partial;
    int64_t out_partial_stride[5];
    float const* lse_partial;
    int64_t lse_partial_stride[4];  // (split, batch, head, row)
    OutElement* out;
    int64_t out_stride[4];  // (batch, head, row, column)
    float* lse;
    int64_t lse_stride[3];  // (batch, head, row)
    int splits, batch, heads, rows, columns;
    int heads_per_group;  // heads for one group
    int64_t out_partial_group_stride, lse_partial_group_stride;
  };

  CUTLASS_DEVICE void operator()(Params const& p) const {
    __shared__ float weights[kWarps][kMaxSplits];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int64_t item = int64_t(blockIdx.x) * kWarps + warp;  // (batch, head, row), row fastest
    if (item >= int64_t(p.batch) * p.heads * p.rows) return;
    const int row = int(item % p.rows);
    const int head = int(item / p.rows % p.heads);
    const int batch = int(item / p.rows / p.heads);
    const int group = head / p.heads_per_group, head_in_group = head - group * p.heads_per_group;
    auto lse_of = [&](int s) {
      return p.lse_partial[s * p.lse_partial_stride[0] + batch * p.lse_partial_stride[1] +
                           group * p.lse_partial_group_stride + head_in_group * p.lse_partial_stride[2] +
                           row * p.lse_partial_stride[3]];
    };
    // A split's NaN (from a NaN input) must reach the row, not read as "no key": max.NaN.
    float max_lse = -INFINITY;
    for (int s = lane; s < p.splits; s += 32) max_lse = max_keep_nan(max_lse, lse_of(s));
    for (int offset = 16; offset > 0; offset /= 2)
      max_lse = max_keep_nan(max_lse, __shfl_xor_sync(0xffffffff, max_lse, offset));
    OutElement* out_row = p.out + batch * p.out_stride[0] + head * p.out_stride[1] + row * p.out_stride[2];
    if (max_lse == -INFINITY) {  // no split saw a key of this row
      for (int c = lane; c < p.columns; c += 32) out_row[c * p.out_stride[3]] = OutElement(0.f);
      if (p.lse != nullptr && lane == 0)
        p.lse[batch * p.lse_stride[0] + head * p.lse_stride[1] + row * p.lse_stride[2]] = -INFINITY;
      return;
    }
    float sum = 0.f;
    for (int s = lane; s < p.splits; s += 32) sum += expf(lse_of(s) - max_lse);
    for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffff, sum, offset);
    const float lse = max_lse + logf(sum);
    for (int s = lane; s < p.splits; s += 32) weights[warp][s] = expf(lse_of(s) - lse);
    __syncwarp();
    float const* partial = p.out_partial + batch * p.out_partial_stride[1] + group * p.out_partial_group_stride +
                           head_in_group * p.out_partial_stride[2] + row * p.out_partial_stride[3];
    for (int c = lane; c < p.columns; c += 32) {
      float acc = 0.f;
      for (int s = 0; s < p.splits; ++s) {
        const float w = weights[warp][s];
        if (w != 0.f) acc += w * partial[s * p.out_partial_stride[0] + c * p.out_partial_stride[4]];
      }
      out_row[c * p.out_stride[3]] = cutlass::NumericConverter<OutElement, float>{}(acc);
    }
    if (p.lse != nullptr && lane == 0)
      p.lse[batch * p.lse_stride[0] + head * p.lse_stride[1] + row * p.lse_stride[2]] = lse;
  }
};

}  // namespace flashhopper::hopper
