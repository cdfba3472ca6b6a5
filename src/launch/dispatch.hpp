// The switch from run-time values to a compiled instantiation, shared by both passes: dtype, head
// dim, mask kind and softcap (the axes of scripts/generate_kernels.py). `run` is a generic
// callable taking the four as integral_constant tags; a family this build left out
// (FLASHHOPPER_BUILT_*) returns cudaErrorInvalidValue, which compiled_family_reason refuses first.
#pragma once

#include <type_traits>

#include <cuda_runtime_api.h>

#include "api/problem_shape.hpp"
#include "hopper/common/mask_kind.hpp"

namespace flashhopper::launch {

template <class Params>
hopper::MaskKind mask_kind(const Params& p) {
  const detail::MaskSpec m = detail::mask_spec(p);
  if (m.is_causal()) return hopper::MaskKind::kCausal;
  return m.is_local() ? hopper::MaskKind::kLocal : hopper::MaskKind::kNone;
}

namespace dispatch_detail {

template <fh_dtype kDType, int kHeadDim, hopper::MaskKind kMask, class Run>
cudaError_t with_softcap(bool softcap, Run&& run) {
  using D = std::integral_constant<fh_dtype, kDType>;
  using H = std::integral_constant<int, kHeadDim>;
  using M = std::integral_constant<hopper::MaskKind, kMask>;
  return softcap ? run(D{}, H{}, M{}, std::true_type{}) : run(D{}, H{}, M{}, std::false_type{});
}

template <fh_dtype kDType, int kHeadDim, class Run>
cudaError_t with_mask(hopper::MaskKind mask, bool softcap, Run&& run) {
  switch (mask) {
    case hopper::MaskKind::kCausal: return with_softcap<kDType, kHeadDim, hopper::MaskKind::kCausal>(softcap, run);
    case hopper::MaskKind::kLocal: return with_softcap<kDType, kHeadDim, hopper::MaskKind::kLocal>(softcap, run);
    default: return with_softcap<kDType, kHeadDim, hopper::MaskKind::kNone>(softcap, run);
  }
}

template <fh_dtype kDType, class Run>
cudaError_t with_head_dim(int64_t head_dim, hopper::MaskKind mask, bool softcap, Run&& run) {
  switch (head_dim) {
#ifdef FLASHHOPPER_BUILT_HDIM64
    case 64: return with_mask<kDType, 64>(mask, softcap, run);
#endif
#ifdef FLASHHOPPER_BUILT_HDIM128
    case 128: return with_mask<kDType, 128>(mask, softcap, run);
#endif
#ifdef FLASHHOPPER_BUILT_HDIM256
    case 256: return with_mask<kDType, 256>(mask, softcap, run);
#endif
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace dispatch_detail

template <class Run>
cudaError_t dispatch_family(int32_t dtype, int64_t head_dim, hopper::MaskKind mask, bool softcap, Run&& run) {
  switch (dtype) {
#ifdef FLASHHOPPER_BUILT_BF16
    case FH_DTYPE_BF16: return dispatch_detail::with_head_dim<FH_DTYPE_BF16>(head_dim, mask, softcap, run);
#endif
#ifdef FLASHHOPPER_BUILT_FP16
    case FH_DTYPE_FP16: return dispatch_detail::with_head_dim<FH_DTYPE_FP16>(head_dim, mask, softcap, run);
#endif
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace flashhopper::launch
