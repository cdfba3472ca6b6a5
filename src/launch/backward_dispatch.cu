// Backward dispatch: what this build can run, the workspace it needs, and the switch to the
// compiled instantiation. Both passes are compiled for the same families (compiled_families.hpp).
#include "launch/backward_launch.hpp"
#include "launch/backward_workspace.hpp"
#include "launch/compiled_families.hpp"
#include "launch/dispatch.hpp"
#include "launch/launch.hpp"

namespace flashhopper::launch {

const char* backward_unsupported_reason(const BackwardParams& p, const detail::ProblemShape& s) {
  const detail::MaskSpec mask = detail::mask_spec(p);
  if (const char* reason = varlen_batch_reason(s)) return reason;
  if (mask.num_sink_tokens > 0 && mask.attention_chunk > 0)
    return "num_sink_tokens together with attention_chunk is not supported by the kernels";
  if (s.head_dim != s.head_dim_v) return "head_dim_v different from head_dim is not supported yet";
  return compiled_family_reason(static_cast<fh_dtype>(p.q.dtype), s.head_dim);
}

size_t backward_workspace_size(const BackwardParams& p, const detail::ProblemShape& shape) {
  return backward_workspace_layout(shape, detail::present(p.learnable_sink) && detail::present(p.dsink)).bytes;
}

int run_backward(const BackwardParams& params, const detail::ProblemShape& shape, void* workspace,
                 fh_stream_t stream) {
  return dispatch_family(params.q.dtype, shape.head_dim, mask_kind(params), params.softcap > 0.f,
                         [&](auto dtype, auto head_dim, auto mask, auto softcap) {
                           return run_backward_hdim<decltype(dtype)::value, decltype(head_dim)::value,
                                                    decltype(mask)::value, decltype(softcap)::value>(
                               params, shape, workspace, stream);
                         });
}

}  // namespace flashhopper::launch
