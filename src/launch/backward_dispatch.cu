// Backward dispatch: what this build can run, the workspace it needs, and the switch to the
// compiled instantiation.
#include <string>

#include "launch/backward_launch.hpp"
#include "launch/backward_workspace.hpp"
#include "launch/device_info.hpp"
#include "launch/dispatch.hpp"
#include "launch/launch.hpp"

namespace flashhopper::launch {

namespace {
const KernelFamily* backward_family(const BackwardParams& p, const detail::ProblemShape& s) {
  return family_for(Pass::kBackward, static_cast<fh_dtype>(p.q.dtype), s.head_dim, s.head_dim_v);
}
}  // namespace

std::string backward_unsupported_reason(const BackwardParams& p, const detail::ProblemShape& s) {
  const detail::MaskSpec mask = detail::mask_spec(p);
  if (const char* reason = varlen_batch_reason(s)) return reason;
  if (std::string reason = sm_margin_reason(p.sm_margin); !reason.empty()) return reason;
  if (mask.num_sink_tokens > 0 && mask.attention_chunk > 0)
    return "num_sink_tokens together with attention_chunk is not supported by the kernels";
  return family_unsupported_reason(Pass::kBackward, static_cast<fh_dtype>(p.q.dtype), s.head_dim, s.head_dim_v);
}

size_t backward_workspace_size(const BackwardParams& p, const detail::ProblemShape& s) {
  const bool dsink = detail::present(p.learnable_sink) && detail::present(p.dsink);
  return visit_built_family<Pass::kBackward>(backward_family(p, s), size_t(0), [&](auto, auto head_dim, auto) {
    return backward_workspace_layout<decltype(head_dim)::value>(s, dsink).bytes;
  });
}

int run_backward(const BackwardParams& params, const detail::ProblemShape& shape, void* workspace, fh_stream_t stream) {
  return visit_instantiation<Pass::kBackward>(
      backward_family(params, shape), mask_kind(params), params.softcap > 0.f,
      [&](auto dtype, auto head_dim, auto head_dim_v, auto mask, auto softcap) {
        // Every backward variant is compiled with and without packed batches (the manifest's
        // BACKWARD_FEATURE_SETS): a dense call takes the kernels without their code.
        if (detail::uses_packed_batches(params, shape))
          return run_backward_hdim<dtype.value, head_dim.value, head_dim_v.value, mask.value, softcap.value, true>(
              params, shape, workspace, stream);
        return run_backward_hdim<dtype.value, head_dim.value, head_dim_v.value, mask.value, softcap.value, false>(
            params, shape, workspace, stream);
      });
}

}  // namespace flashhopper::launch
