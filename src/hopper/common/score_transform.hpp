// What happens to a raw score s = q.k before the softmax, as a policy the mainloops call at one
// place each: nothing, or softcapping, S = cap * tanh(scale * s / cap).
// Softcap folds the scales so that the softmax still takes one FFMA per exponent: the transform
// leaves t = tanh(s * scale / cap) in place of s, and the mainloop's softmax scale becomes cap
// (exponent: t * cap * log2 e). The backward's dS takes the chain rule's factor 1 - t^2, with t
// recovered from P (dp_to_ds_softcap), which costs no registers to keep t.
#pragma once

#include <cmath>

#include <cute/tensor.hpp>

namespace flashhopper::hopper {

using namespace cute;

// tanh by the SFU's tanh.approx.f32 (one MUFU op, as exp2 is): a more accurate tanh from exp2
// and a reciprocal takes two, and the softmax is already bound by the SFU.
CUTLASS_DEVICE float tanh_fast(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

template <bool kSoftcap_>
struct ScoreTransform {
  static constexpr bool kSoftcap = kSoftcap_;
  float pre_tanh_scale = 0.f;  // scale / cap (softcap only)

  // The softmax scale applied after the transform: cap with softcap, else the softmax scale.
  static CUTLASS_HOST_DEVICE float softmax_scale(float scale, float softcap) { return kSoftcap ? softcap : scale; }
  static CUTLASS_HOST_DEVICE ScoreTransform make(float scale, float softcap) {
    ScoreTransform t;
    if (kSoftcap) t.pre_tanh_scale = scale / softcap;
    return t;
  }

  // s (any register tensor of raw scores) -> the transformed scores, in place.
  template <class TensorS>
  CUTLASS_DEVICE void apply(TensorS& s) const {
    if constexpr (kSoftcap) {
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(s); ++i) s(i) = tanh_fast(s(i) * pre_tanh_scale);
    }
  }

};

}  // namespace flashhopper::hopper
