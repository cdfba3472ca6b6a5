// The launch of packed GQA's query gather (QueryGatherKernel), before the forward of a call whose
// kernel call carries a gather_source (plan/packed_decode.hpp).
#include <cuda_runtime_api.h>

#include <algorithm>

#include "hopper/kernel/plain_kernel_entry.hpp"
#include "hopper/kernel/query_gather_kernel.hpp"
#include "launch/launch.hpp"

namespace flashhopper::launch {

int run_query_gather(const detail::KernelCall& call, void* gathered, fh_stream_t stream) {
  using Kernel = hopper::QueryGatherKernel;
  const Tensor& q = call.gather_source;
  const int64_t element = dtype_size(static_cast<fh_dtype>(q.dtype));
  const int64_t row_bytes = q.shape[3] * element;
  // The checks before keep rows 16-byte aligned (the kernels' TMA asks the same of q).
  if (row_bytes % Kernel::kChunkBytes != 0 || q.stride[3] != 1) return int(cudaErrorInvalidValue);
  Kernel::Params k{};
  k.src = static_cast<char const*>(q.data);
  for (int i = 0; i < 3; ++i) k.src_stride[i] = q.stride[i] * element;
  k.dst = static_cast<char*>(gathered);
  k.batch = q.shape[0];
  k.tokens = int(q.shape[1]);
  k.heads_kv = int(call.shape.heads_kv);
  k.ratio = int(q.shape[2] / call.shape.heads_kv);
  k.group = int(call.shape.rows_per_token);
  k.row_chunks = int(row_bytes / Kernel::kChunkBytes);
  const int64_t chunks = k.batch * k.heads_kv * k.tokens * k.group * k.row_chunks;
  const int64_t blocks = std::min<int64_t>((chunks + Kernel::kThreads - 1) / Kernel::kThreads, 4096);
  hopper::plain_kernel_entry<Kernel>
      <<<unsigned(blocks), Kernel::kThreads, 0, static_cast<cudaStream_t>(stream)>>>(k);
  return int(cudaGetLastError());
}

size_t gathered_q_bytes(const detail::KernelCall& call) {
  const Tensor& q = call.gather_source;
  if (!detail::present(q)) return 0;
  const int64_t rows = q.shape[0] * q.shape[1] * call.shape.heads_kv * call.shape.rows_per_token;  // padded
  return size_t(rows * q.shape[3]) * dtype_size(static_cast<fh_dtype>(q.dtype));
}

}  // namespace flashhopper::launch
