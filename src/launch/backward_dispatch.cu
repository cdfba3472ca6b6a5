// Backward dispatch: what this build can run, the workspace it needs, and the switch to the
// compiled instantiation. Both passes are compiled for the same families (compiled_families.hpp).
#include "launch/backward_launch.hpp"
#include "launch/backward_workspace.hpp"
#include "launch/compiled_families.hpp"
#include "launch/launch.hpp"

namespace flashhopper::launch {
namespace {

template <fh_dtype kDType, bool kCausal>
cudaError_t run_head_dim(const BackwardParams& p, const detail::ProblemShape& s, void* ws, cudaStream_t stream) {
  switch (s.head_dim) {
#ifdef FLASHHOPPER_BUILT_HDIM64
    case 64: return run_backward_hdim<kDType, 64, kCausal>(p, s, ws, stream);
#endif
#ifdef FLASHHOPPER_BUILT_HDIM128
    case 128: return run_backward_hdim<kDType, 128, kCausal>(p, s, ws, stream);
#endif
#ifdef FLASHHOPPER_BUILT_HDIM256
    case 256: return run_backward_hdim<kDType, 256, kCausal>(p, s, ws, stream);
#endif
    default: return cudaErrorInvalidValue;  // refused earlier by backward_unsupported_reason
  }
}

template <fh_dtype kDType>
cudaError_t run_dtype(const BackwardParams& p, const detail::ProblemShape& s, bool causal, void* ws,
                      cudaStream_t stream) {
  return causal ? run_head_dim<kDType, true>(p, s, ws, stream) : run_head_dim<kDType, false>(p, s, ws, stream);
}

}  // namespace

const char* backward_unsupported_reason(const BackwardParams& p, const detail::ProblemShape& s) {
  const detail::MaskSpec mask = detail::mask_spec(p.causal, p.window_left, p.window_right, p.num_sink_tokens);
  if (s.varlen_q || s.varlen_k) return "varlen (cu_seqlens_q/cu_seqlens_k) is not supported yet";
  if (detail::present(p.seqused_q) || detail::present(p.seqused_k)) return "seqused_q/seqused_k are not supported yet";
  if (p.softcap != 0.f) return "softcap is not supported yet";
  if (mask.is_masked() && !mask.is_causal()) return "local (sliding window) attention is not supported yet";
  if (s.head_dim != s.head_dim_v) return "head_dim_v different from head_dim is not supported yet";
  return compiled_family_reason(static_cast<fh_dtype>(p.q.dtype), s.head_dim);
}

size_t backward_workspace_size(const BackwardParams&, const detail::ProblemShape& shape) {
  return backward_workspace_layout(shape).bytes;
}

int run_backward(const BackwardParams& params, const detail::ProblemShape& shape, void* workspace,
                 fh_stream_t stream) {
  const bool causal = detail::mask_spec(params.causal, params.window_left, params.window_right,
                                        params.num_sink_tokens).is_causal();
  switch (params.q.dtype) {
#ifdef FLASHHOPPER_BUILT_BF16
    case FH_DTYPE_BF16: return run_dtype<FH_DTYPE_BF16>(params, shape, causal, workspace, stream);
#endif
#ifdef FLASHHOPPER_BUILT_FP16
    case FH_DTYPE_FP16: return run_dtype<FH_DTYPE_FP16>(params, shape, causal, workspace, stream);
#endif
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace flashhopper::launch
