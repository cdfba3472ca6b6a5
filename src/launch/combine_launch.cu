// The split-KV combine's launch (SplitCombineKernel), for fh_combine and after a split-KV forward.
#include <cuda_runtime_api.h>

#include <algorithm>

#include <cutlass/numeric_types.h>

#include "hopper/kernel/split_combine_kernel.hpp"
#include "hopper/kernel/plain_kernel_entry.hpp"
#include "launch/launch.hpp"

namespace flashhopper::launch {
namespace {

// grouped: the partials of a call with several query tokens packed (their strides, heads_per_group
// query heads a KV head: the ratio), p.out_partial and p.lse_partial then giving the extents only.
template <class OutElement>
int run_combine_as(const CombineParams& p, cudaStream_t stream, const detail::GroupedPartials* grouped = nullptr,
                   int heads_per_group = 0) {
  using Kernel = hopper::SplitCombineKernel<OutElement>;
  typename Kernel::Params k{};
  const bool packed = p.out.ndim == 3;  // out [total_q, H, dv], out_partial [S, H, total_q, dv]
  const int64_t* op = p.out_partial.stride;
  const int64_t* lp = p.lse_partial.stride;
  const int64_t* o = p.out.stride;
  k.out_partial = static_cast<float const*>(p.out_partial.data);
  k.lse_partial = static_cast<float const*>(p.lse_partial.data);
  k.out = static_cast<OutElement*>(p.out.data);
  k.lse = static_cast<float*>(p.lse.data);
  k.splits = int(p.out_partial.shape[0]);
  if (packed) {
    k.batch = 1;
    k.heads = int(p.out_partial.shape[1]);
    k.rows = int(p.out_partial.shape[2]);
    k.columns = int(p.out_partial.shape[3]);
    const int64_t out_partial_stride[5] = {op[0], 0, op[1], op[2], op[3]};
    const int64_t lse_partial_stride[4] = {lp[0], 0, lp[1], lp[2]};
    const int64_t out_stride[4] = {0, o[1], o[0], o[2]};
    std::copy(out_partial_stride, out_partial_stride + 5, k.out_partial_stride);
    std::copy(lse_partial_stride, lse_partial_stride + 4, k.lse_partial_stride);
    std::copy(out_stride, out_stride + 4, k.out_stride);
    if (k.lse != nullptr) {
      k.lse_stride[0] = 0;
      k.lse_stride[1] = p.lse.stride[0];
      k.lse_stride[2] = p.lse.stride[1];
    }
  } else {
    k.batch = int(p.out_partial.shape[1]);
    k.heads = int(p.out_partial.shape[2]);
    k.rows = int(p.out_partial.shape[3]);
    k.columns = int(p.out_partial.shape[4]);
    std::copy(op, op + 5, k.out_partial_stride);
    std::copy(lp, lp + 4, k.lse_partial_stride);
    const int64_t out_stride[4] = {o[0], o[2], o[1], o[3]};  // out is [B, sq, H, dv]
    std::copy(out_stride, out_stride + 4, k.out_stride);
    if (k.lse != nullptr) std::copy(p.lse.stride, p.lse.stride + 3, k.lse_stride);
  }
  k.heads_per_group = k.heads;  // one group: the strides above
  if (grouped != nullptr) {
    const int64_t* go = grouped->out;
    const int64_t* gl = grouped->lse;
    const int64_t out_partial_stride[5] = {go[0], go[1], go[3], go[4], go[5]};
    const int64_t lse_partial_stride[4] = {gl[0], gl[1], gl[3], gl[4]};
    std::copy(out_partial_stride, out_partial_stride + 5, k.out_partial_stride);
    std::copy(lse_partial_stride, lse_partial_stride + 4, k.lse_partial_stride);
    k.heads_per_group = heads_per_group;
    k.out_partial_group_stride = go[2];
    k.lse_partial_group_stride = gl[2];
  }
  const int64_t items = int64_t(k.batch) * k.heads * k.rows;
  const int64_t blocks = (items + Kernel::kWarps - 1) / Kernel::kWarps;
  hopper::plain_kernel_entry<Kernel><<<unsigned(blocks), Kernel::kThreads, 0, stream>>>(k);
  return int(cudaGetLastError());
}

}  // namespace

// The partials are contiguous (ForwardWorkspace's layout): fh_combine's dense case.
int run_split_kv_combine(const ForwardParams& params, const detail::ProblemShape& shape, float* out_partial,
                         float* lse_partial, int num_splits, fh_stream_t stream, int64_t rows_per_token) {
  CombineParams combine{};
  if (rows_per_token > 1) {
    // Several query tokens packed (plan/packed_decode.hpp): KV head g's partial rows are token t's
    // query heads g * ratio + j at t * g' + j (g' = rows_per_token, at least the ratio), read into
    // the call's own out and lse (params and shape: the call as given) through
    // detail::grouped_partials' strides.
    const int64_t b = shape.batch, h = shape.heads_q, sq = shape.seqlen_q, dv = shape.head_dim_v;
    if (shape.varlen_q) {  // extents only, as fh_combine takes packed partials
      combine.out_partial = make_tensor(out_partial, FH_DTYPE_FP32, {num_splits, h, shape.total_q, dv});
      combine.lse_partial = make_tensor(lse_partial, FH_DTYPE_FP32, {num_splits, h, shape.total_q});
    } else {
      combine.out_partial = make_tensor(out_partial, FH_DTYPE_FP32, {num_splits, b, h, sq, dv});
      combine.lse_partial = make_tensor(lse_partial, FH_DTYPE_FP32, {num_splits, b, h, sq});
    }
    combine.out = params.out;
    combine.lse = params.lse;
    const detail::GroupedPartials grouped = detail::grouped_partials(shape, rows_per_token);
    const int ratio = int(h / shape.heads_kv);
    const auto s = static_cast<cudaStream_t>(stream);
    switch (params.out.dtype) {
      case FH_DTYPE_BF16: return run_combine_as<cutlass::bfloat16_t>(combine, s, &grouped, ratio);
      case FH_DTYPE_FP16: return run_combine_as<cutlass::half_t>(combine, s, &grouped, ratio);
      case FH_DTYPE_FP32: return run_combine_as<float>(combine, s, &grouped, ratio);
      default: return int(cudaErrorInvalidValue);  // refused by the checks before
    }
  }
  if (shape.varlen_q) {  // [S, Hq, total_q, (dv)], as fh_combine takes packed partials
    combine.out_partial =
        make_tensor(out_partial, FH_DTYPE_FP32, {num_splits, shape.heads_q, shape.total_q, shape.head_dim_v});
    combine.lse_partial = make_tensor(lse_partial, FH_DTYPE_FP32, {num_splits, shape.heads_q, shape.total_q});
  } else {
    combine.out_partial = make_tensor(out_partial, FH_DTYPE_FP32,
                                      {num_splits, shape.batch, shape.heads_q, shape.seqlen_q, shape.head_dim_v});
    combine.lse_partial =
        make_tensor(lse_partial, FH_DTYPE_FP32, {num_splits, shape.batch, shape.heads_q, shape.seqlen_q});
  }
  combine.out = params.out;
  combine.lse = params.lse;
  return run_combine(combine, stream);
}

int run_combine(const CombineParams& params, fh_stream_t stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  switch (params.out.dtype) {
    case FH_DTYPE_BF16: return run_combine_as<cutlass::bfloat16_t>(params, s);
    case FH_DTYPE_FP16: return run_combine_as<cutlass::half_t>(params, s);
    case FH_DTYPE_FP32: return run_combine_as<float>(params, s);
    default: return int(cudaErrorInvalidValue);  // refused by the checks before
  }
}

}  // namespace flashhopper::launch
