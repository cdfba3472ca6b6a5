// The boundary between the host API (g++) and the kernels (nvcc): what the dispatch may ask of
// the compiled instantiations. Plain types only; no CuTe.
#pragma once

#include <cstddef>
#include <string>

#include "plan/packed_decode.hpp"
#include "plan/problem_shape.hpp"

namespace flashhopper::launch {

// Empty when this build can run the forward on `params`, else a sentence saying why not.
// Argument validity is checked before this is asked.
std::string forward_unsupported_reason(const ForwardParams& params, const detail::ProblemShape& shape);

// A forward as the kernels run it, computed once per call: the call after the decode rewrite
// (detail::kernel_call), the split count and the workspace's parts, in order: the planned tiles
// (packed queries), the rotated copy of q (an append with rotary), the split partials (split-KV,
// or the call's combine_always), q's gathered rows (its gather_source).
// It refers to the params and shape it was made from, which must outlive it.
struct ForwardPlan {
  const ForwardParams* params = nullptr;
  const detail::ProblemShape* shape = nullptr;
  detail::KernelCall call;
  size_t planned_tiles = 0, rotated_q = 0, out_partial = 0, lse_partial = 0, gathered_q = 0;
  int num_splits = 1;
  size_t workspace_bytes() const { return planned_tiles + rotated_q + out_partial + lse_partial + gathered_q; }
};
ForwardPlan plan_forward(const ForwardParams& params, const detail::ProblemShape& shape);

inline size_t forward_workspace_size(const ForwardParams& params, const detail::ProblemShape& shape) {
  return plan_forward(params, shape).workspace_bytes();
}

// Enqueues the forward. Returns the CUDA error of the launch (0 on success).
int run_forward(const ForwardPlan& plan, void* workspace, fh_stream_t stream);

std::string backward_unsupported_reason(const BackwardParams& params, const detail::ProblemShape& shape);

size_t backward_workspace_size(const BackwardParams& params, const detail::ProblemShape& shape);

// Enqueues the backward's kernels. Returns the CUDA error of the first failed launch (0 on success).
int run_backward(const BackwardParams& params, const detail::ProblemShape& shape, void* workspace,
                 fh_stream_t stream);

// The KV cache's append: k_new/v_new into the dense cache at cache_seqlens, rotary on them and, into
// a copy at q_rotated (rotated_q_bytes of the workspace, laid out as rotated_q_view), on q.
// Enqueued before the attention, which then reads the copy. Returns the CUDA error of the launch.
int run_kv_append(const ForwardParams& params, const detail::ProblemShape& shape, void* q_rotated,
                  fh_stream_t stream);
size_t rotated_q_bytes(const ForwardParams& params, const detail::ProblemShape& shape);
Tensor rotated_q_view(const ForwardParams& params, void* data);  // q's shape, contiguous

// Packed GQA over several query tokens: call.gather_source's rows into `gathered` (gathered_q_bytes
// of the workspace), as call.params.q views them. Returns the CUDA error of the launch.
int run_query_gather(const detail::KernelCall& call, void* gathered, fh_stream_t stream);
size_t gathered_q_bytes(const detail::KernelCall& call);

// Enqueues the split-KV combine (checked params). Returns the CUDA error of the launch.
int run_combine(const CombineParams& params, fh_stream_t stream);
// The combine after a split-KV forward: its num_splits partials (ForwardWorkspace's layout, dense
// or packed as the queries are) into params.out and params.lse. rows_per_token > 1: the partials of
// a call with several query tokens packed (its kernel call's shape), params and shape the call's own.
int run_split_kv_combine(const ForwardParams& params, const detail::ProblemShape& shape, float* out_partial,
                         float* lse_partial, int num_splits, fh_stream_t stream, int64_t rows_per_token = 1);

}  // namespace flashhopper::launch
