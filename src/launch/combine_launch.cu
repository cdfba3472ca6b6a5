// The split-KV combine's launch (SplitCombineKernel), for fh_combine and after a split-KV forward.
#include <cuda_runtime_api.h>

#include <algorithm>

#include <cutlass/numeric_types.h>

#include "hopper/kernel/split_combine_kernel.hpp"
#include "hopper/kernel/plain_kernel_entry.hpp"
#include "launch/launch.hpp"

namespace flashhopper::launch {
namespace {

template <class Kernel>
int launch_combine(typename Kernel::Params const& k, cudaStream_t stream) {
  const int64_t items = int64_t(k.batch) * k.heads * k.rows;
  const int64_t blocks = (items + Kernel::kWarps - 1) / Kernel::kWarps;
  hopper::plain_kernel_entry<Kernel><<<unsigned(blocks), Kernel::kThreads, 0, stream>>>(k);
  return int(cudaGetLastError());
}

// out/lse as fh_combine takes them, the partials as given.
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
  return launch_combine<Kernel>(k, stream);
}

// A dense split-KV forward's partials (contiguous, ForwardWorkspace's layout) into its out
// [B, sq, Hq, dv] and lse [B, Hq, sq].
template <class OutElement>
int run_split_kv_combine_as(const ForwardParams& p, const detail::ProblemShape& s, const float* out_partial,
                            const float* lse_partial, int splits, cudaStream_t stream) {
  using Kernel = hopper::SplitCombineKernel<OutElement>;
  typename Kernel::Params k{};
  k.splits = splits;
  k.batch = int(s.batch);
  k.heads = int(s.heads_q);
  k.rows = int(s.seqlen_q);
  k.columns = int(s.head_dim_v);
  const int64_t row = k.columns, head = row * k.rows, batch = head * k.heads;
  const int64_t out_partial_stride[5] = {batch * k.batch, batch, head, row, 1};
  const int64_t lse_partial_stride[4] = {int64_t(k.batch) * k.heads * k.rows, int64_t(k.heads) * k.rows, k.rows, 1};
  const int64_t out_stride[4] = {p.out.stride[0], p.out.stride[2], p.out.stride[1], p.out.stride[3]};
  std::copy(out_partial_stride, out_partial_stride + 5, k.out_partial_stride);
  std::copy(lse_partial_stride, lse_partial_stride + 4, k.lse_partial_stride);
  std::copy(out_stride, out_stride + 4, k.out_stride);
  k.out_partial = out_partial;
  k.lse_partial = lse_partial;
  k.out = static_cast<OutElement*>(p.out.data);
  k.lse = static_cast<float*>(p.lse.data);
  if (k.lse != nullptr) std::copy(p.lse.stride, p.lse.stride + 3, k.lse_stride);
  return launch_combine<Kernel>(k, stream);
}

}  // namespace

int run_split_kv_combine(const ForwardParams& params, const detail::ProblemShape& shape, const float* out_partial,
                         const float* lse_partial, int num_splits, fh_stream_t stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  switch (params.out.dtype) {
    case FH_DTYPE_BF16: return run_split_kv_combine_as<cutlass::bfloat16_t>(params, shape, out_partial, lse_partial,
                                                                           num_splits, s);
    case FH_DTYPE_FP16:
      return run_split_kv_combine_as<cutlass::half_t>(params, shape, out_partial, lse_partial, num_splits, s);
    default: return int(cudaErrorInvalidValue);  // refused by the checks before
  }
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
