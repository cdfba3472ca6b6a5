// Forward dispatch: what this build can run, and the switch to the compiled instantiation.
#include "launch/compiled_families.hpp"
#include "launch/forward_launch.hpp"
#include "launch/launch.hpp"

namespace flashhopper::launch {
namespace {

template <fh_dtype kDType, bool kCausal>
cudaError_t run_head_dim(const ForwardParams& p, const detail::ProblemShape& s, cudaStream_t stream) {
  switch (s.head_dim) {
#ifdef FLASHHOPPER_BUILT_HDIM64
    case 64: return run_forward_hdim<kDType, 64, kCausal>(p, s, stream);
#endif
#ifdef FLASHHOPPER_BUILT_HDIM128
    case 128: return run_forward_hdim<kDType, 128, kCausal>(p, s, stream);
#endif
#ifdef FLASHHOPPER_BUILT_HDIM256
    case 256: return run_forward_hdim<kDType, 256, kCausal>(p, s, stream);
#endif
    default: return cudaErrorInvalidValue;  // refused earlier by forward_unsupported_reason
  }
}

template <fh_dtype kDType>
cudaError_t run_dtype(const ForwardParams& p, const detail::ProblemShape& s, bool causal, cudaStream_t stream) {
  return causal ? run_head_dim<kDType, true>(p, s, stream) : run_head_dim<kDType, false>(p, s, stream);
}

}  // namespace

const char* forward_unsupported_reason(const ForwardParams& p, const detail::ProblemShape& s) {
  const detail::MaskSpec mask = detail::mask_spec(p.causal, p.window_left, p.window_right, p.num_sink_tokens);
  if (s.varlen_q || s.varlen_k) return "varlen (cu_seqlens_q/cu_seqlens_k) is not supported yet";
  if (detail::present(p.seqused_q) || detail::present(p.seqused_k)) return "seqused_q/seqused_k are not supported yet";
  if (s.paged || s.append_kv) return "the paged KV cache and k_new/v_new are not supported yet";
  if (p.q.dtype == FH_DTYPE_FP8_E4M3) return "fp8 e4m3 inputs are not supported yet";
  if (p.softcap != 0.f) return "softcap is not supported yet";
  if (mask.is_masked() && !mask.is_causal()) return "local (sliding window) attention is not supported yet";
  if (p.num_splits > 1) return "split-KV (num_splits > 1) is not supported yet";
  if (s.head_dim != s.head_dim_v) return "head_dim_v different from head_dim is not supported yet";
  return compiled_family_reason(static_cast<fh_dtype>(p.q.dtype), s.head_dim);
}

size_t forward_workspace_size(const ForwardParams&, const detail::ProblemShape&) { return 0; }

int run_forward(const ForwardParams& params, const detail::ProblemShape& shape, void*, fh_stream_t stream) {
  const bool causal = detail::mask_spec(params.causal, params.window_left, params.window_right,
                                        params.num_sink_tokens).is_causal();
  switch (params.q.dtype) {
#ifdef FLASHHOPPER_BUILT_BF16
    case FH_DTYPE_BF16: return run_dtype<FH_DTYPE_BF16>(params, shape, causal, stream);
#endif
#ifdef FLASHHOPPER_BUILT_FP16
    case FH_DTYPE_FP16: return run_dtype<FH_DTYPE_FP16>(params, shape, causal, stream);
#endif
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace flashhopper::launch
