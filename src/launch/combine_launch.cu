// The split-KV combine's launch (SplitCombineKernel), for fh_combine and after a split-KV forward.
#include <cuda_runtime_api.h>

#include <algorithm>

#include <cutlass/numeric_types.h>

#include "hopper/kernel/split_combine_kernel.hpp"
#include "hopper/kernel/plain_kernel_entry.hpp"
#include "launch/launch.hpp"

namespace flashhopper::launch {
namespace {

template <class OutElement>
int run_combine_as(const CombineParams& p, cudaStream_t stream) {
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
    // Several query tokens of one KV head packed (plan/packed_decode.hpp): the partials' rows are
    // token t's heads j at t * Hq + j, read here as [S, B, Hq, sq, (dv)] into the call's own out
    // and lse (params and shape: the call as given).
    const int64_t b = shape.batch, h = shape.heads_q, sq = shape.seqlen_q, dv = shape.head_dim_v;
    combine.out_partial = make_tensor(out_partial, FH_DTYPE_FP32, {num_splits, b, h, sq, dv},
                                      {b * sq * h * dv, sq * h * dv, dv, h * dv, 1});
    combine.lse_partial = make_tensor(lse_partial, FH_DTYPE_FP32, {num_splits, b, h, sq}, {b * sq * h, sq * h, 1, h});
  } else if (shape.varlen_q) {  // [S, Hq, total_q, (dv)], as fh_combine takes packed partials
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
