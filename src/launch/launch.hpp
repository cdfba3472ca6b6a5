// The boundary between the host API (g++) and the kernels (nvcc): what the dispatch may ask of
// the compiled instantiations. Plain types only; no CuTe.
#pragma once

#include <cstddef>
#include <string>

#include "api/problem_shape.hpp"

namespace flashhopper::launch {

// Empty when this build can run the forward on `params`, else a sentence saying why not.
// Argument validity is checked before this is asked.
std::string forward_unsupported_reason(const ForwardParams& params, const detail::ProblemShape& shape);

size_t forward_workspace_size(const ForwardParams& params, const detail::ProblemShape& shape);

// Enqueues the forward. Returns the CUDA error of the launch (0 on success).
int run_forward(const ForwardParams& params, const detail::ProblemShape& shape, void* workspace,
                fh_stream_t stream);

std::string backward_unsupported_reason(const BackwardParams& params, const detail::ProblemShape& shape);

size_t backward_workspace_size(const BackwardParams& params, const detail::ProblemShape& shape);

// Enqueues the backward's kernels. Returns the CUDA error of the first failed launch (0 on success).
int run_backward(const BackwardParams& params, const detail::ProblemShape& shape, void* workspace,
                 fh_stream_t stream);

// Enqueues the split-KV combine (checked params). Returns the CUDA error of the launch.
int run_combine(const CombineParams& params, fh_stream_t stream);

}  // namespace flashhopper::launch
