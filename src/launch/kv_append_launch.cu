// The KV cache's append (KvAppendKernel), enqueued before the attention on the same stream.
#include <cuda_runtime_api.h>

#include <cutlass/numeric_types.h>

#include "hopper/kernel/kv_append_kernel.hpp"
#include "hopper/kernel/plain_kernel_entry.hpp"
#include "launch/launch.hpp"

namespace flashhopper::launch {
namespace {

template <class Element>
typename hopper::KvAppendKernel<Element>::Rows rows_of(const Tensor& t, bool packed) {
  Element* data = static_cast<Element*>(t.data);
  if (packed) return {data, 0, t.stride[0], t.stride[1]};  // [total, H, d]
  return {data, t.stride[0], t.stride[1], t.stride[2]};     // [B, S, H, d]
}

template <class Element>
int run_as(const ForwardParams& p, const detail::ProblemShape& s, void* q_rotated, cudaStream_t stream) {
  using Kernel = hopper::KvAppendKernel<Element>;
  typename Kernel::Params k{};
  k.k_new = rows_of<Element>(p.k_new, s.varlen_k_new);
  k.v_new = rows_of<Element>(p.v_new, s.varlen_k_new);
  k.cu_seqlens_new = static_cast<int const*>(p.cu_seqlens_k_new.data);
  k.k_cache = rows_of<Element>(p.k, false);
  k.v_cache = rows_of<Element>(p.v, false);
  k.cache_seqlens = static_cast<int const*>(p.cache_seqlens.data);
  k.cache_batch_idx = static_cast<int const*>(p.cache_batch_idx.data);
  k.batch = int(s.batch);
  k.seqlen_new = int(s.seqlen_new);
  k.heads_kv = int(s.heads_kv);
  k.heads_q = int(s.heads_q);
  k.seqlen_q = int(s.seqlen_q);
  k.head_dim = int(s.head_dim);
  k.head_dim_v = int(s.head_dim_v);
  k.cache_rows = int(p.k.shape[0]);  // paged: pages and page size
  k.cache_len = int(p.k.shape[1]);
  if (s.paged) {
    k.page_table = static_cast<int const*>(p.page_table.data);
    k.page_table_stride = p.page_table.stride[0];
    k.page_table_rows = int(p.page_table.shape[0]);
    k.max_pages = int(s.max_pages);
  }
  if (detail::present(p.rotary_cos)) {
    k.rotary_cos = static_cast<Element const*>(p.rotary_cos.data);
    k.rotary_sin = static_cast<Element const*>(p.rotary_sin.data);
    k.cos_stride[0] = p.rotary_cos.stride[0];
    k.cos_stride[1] = p.rotary_cos.stride[1];
    k.sin_stride[0] = p.rotary_sin.stride[0];
    k.sin_stride[1] = p.rotary_sin.stride[1];
    k.rotary_positions = int(p.rotary_cos.shape[0]);
    k.rotary_half = int(p.rotary_cos.shape[1]);
    k.rotary_seqlens = static_cast<int const*>(p.rotary_seqlens.data);
    k.interleaved = p.rotary_interleaved != 0;
    k.query_rows_advance = detail::mask_spec(p).is_masked();
    k.cu_seqlens_q = static_cast<int const*>(p.cu_seqlens_q.data);
    k.q = rows_of<Element>(p.q, s.varlen_q);
    k.q_rotated = rows_of<Element>(rotated_q_view(p, q_rotated), s.varlen_q);
  }
  const int64_t rows = Kernel::key_rows(k) + Kernel::query_rows(k);
  if (rows == 0) return 0;
  const int64_t blocks = (rows + Kernel::kWarps - 1) / Kernel::kWarps;
  hopper::plain_kernel_entry<Kernel><<<unsigned(blocks), Kernel::kThreads, 0, stream>>>(k);
  return int(cudaGetLastError());
}

}  // namespace

Tensor rotated_q_view(const ForwardParams& p, void* data) {
  Tensor t = p.q;  // q's shape, contiguous
  t.data = data;
  int64_t stride = 1;
  for (int dim = t.ndim - 1; dim >= 0; --dim) {
    t.stride[dim] = stride;
    stride *= t.shape[dim];
  }
  return t;
}

size_t rotated_q_bytes(const ForwardParams& p, const detail::ProblemShape& s) {
  if (!s.append_kv || !detail::present(p.rotary_cos)) return 0;
  size_t elements = 1;
  for (int dim = 0; dim < p.q.ndim; ++dim) elements *= size_t(p.q.shape[dim]);
  return (elements * dtype_size(static_cast<DType>(p.q.dtype)) + 255) / 256 * 256;
}

int run_kv_append(const ForwardParams& p, const detail::ProblemShape& s, void* q_rotated, fh_stream_t stream) {
  const auto st = static_cast<cudaStream_t>(stream);
  switch (p.q.dtype) {
    case FH_DTYPE_BF16: return run_as<cutlass::bfloat16_t>(p, s, q_rotated, st);
    case FH_DTYPE_FP16: return run_as<cutlass::half_t>(p, s, q_rotated, st);
    case FH_DTYPE_FP8_E4M3: return run_as<cutlass::float_e4m3_t>(p, s, q_rotated, st);  // no rotary (refused)
    default: return int(cudaErrorInvalidValue);  // refused before
  }
}

}  // namespace flashhopper::launch
