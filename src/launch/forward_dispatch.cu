// Forward dispatch: what this build can run, and the switch to the compiled instantiation.
#include "launch/compiled_families.hpp"
#include "launch/dispatch.hpp"
#include "launch/forward_launch.hpp"
#include "launch/launch.hpp"

namespace flashhopper::launch {

const char* forward_unsupported_reason(const ForwardParams& p, const detail::ProblemShape& s) {
  const detail::MaskSpec mask = detail::mask_spec(p);
  if (s.varlen_q || s.varlen_k) return "varlen (cu_seqlens_q/cu_seqlens_k) is not supported yet";
  if (detail::present(p.seqused_q) || detail::present(p.seqused_k)) return "seqused_q/seqused_k are not supported yet";
  if (s.paged || s.append_kv) return "the paged KV cache and k_new/v_new are not supported yet";
  if (p.q.dtype == FH_DTYPE_FP8_E4M3) return "fp8 e4m3 inputs are not supported yet";
  if (mask.num_sink_tokens > 0 && mask.attention_chunk > 0)
    return "num_sink_tokens together with attention_chunk is not supported by the kernels";
  if (p.num_splits > 1) return "split-KV (num_splits > 1) is not supported yet";
  if (s.head_dim != s.head_dim_v) return "head_dim_v different from head_dim is not supported yet";
  return compiled_family_reason(static_cast<fh_dtype>(p.q.dtype), s.head_dim);
}

size_t forward_workspace_size(const ForwardParams&, const detail::ProblemShape&) { return 0; }

int run_forward(const ForwardParams& params, const detail::ProblemShape& shape, void*, fh_stream_t stream) {
  return dispatch_family(params.q.dtype, shape.head_dim, mask_kind(params), params.softcap > 0.f,
                         [&](auto dtype, auto head_dim, auto mask, auto softcap) {
                           return run_forward_hdim<decltype(dtype)::value, decltype(head_dim)::value,
                                                   decltype(mask)::value, decltype(softcap)::value>(params, shape,
                                                                                                    stream);
                         });
}

}  // namespace flashhopper::launch
