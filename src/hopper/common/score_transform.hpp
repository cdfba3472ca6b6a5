// What happens to a raw score s = q.k before the softmax, as a policy the mainloops call at one
// place each: nothing, or softcapping, S = cap * tanh(scale * s / cap). Both halves live here:
// the forward value (apply, and what it costs the softmax: kFmaExpEvery) and the backward's
// factor in dS (dp_to_ds). A new transform is a new specialisation and a manifest axis.
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

  // Softcap's tanh doubles the forward's SFU work: every second exponent of a row goes to the FMA
  // pipe instead (OnlineSoftmax's kFmaExpEvery).
  static constexpr int kFmaExpEvery = kSoftcap ? 2 : 0;

  // s (any register tensor of raw scores) -> the transformed scores, in place.
  template <class TensorS>
  CUTLASS_DEVICE void apply(TensorS& s) const {
    if constexpr (kSoftcap) {
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(s); ++i) s(i) = tanh_fast(s(i) * pre_tanh_scale);
    }
  }

  // Backward: dP (rows, cols) becomes dS in place: P * (dP - D[row]) times the transform's
  // derivative. With softcap that is 1 - t^2, t = tanh(scale * s / cap) recovered from
  // P = exp2(t * scale_log2 - LSE2) as t = (log2 P + LSE2) / scale_log2 (scale_log2 = cap * log2 e),
  // which keeps no t in registers. Clamping t to [-1, 1] also maps P = 0 (t = -inf, or NaN for a
  // row with LSE2 = +inf) to a factor 0. dpsum and lse_log2: the rows' values by index.
  template <class TensordP, class TensorP, class RowValuesD, class RowValuesLse>
  static CUTLASS_DEVICE void dp_to_ds(TensordP& dp, TensorP const& p, RowValuesD const& dpsum,
                                      RowValuesLse const& lse_log2, float scale_log2) {
    if constexpr (kSoftcap) {
      const float inv_scale_log2 = 1.f / scale_log2;
      CUTLASS_PRAGMA_UNROLL
      for (int m = 0; m < size<0>(dp); ++m) {
        CUTLASS_PRAGMA_UNROLL
        for (int n = 0; n < size<1>(dp); ++n) {
          const float t = fmaxf(fminf((__log2f(p(m, n)) + lse_log2[m]) * inv_scale_log2, 1.f), -1.f);
          dp(m, n) = p(m, n) * (dp(m, n) - dpsum[m]) * (1.f - t * t);
        }
      }
    } else {
      CUTLASS_PRAGMA_UNROLL
      for (int m = 0; m < size<0>(dp); ++m) {
        CUTLASS_PRAGMA_UNROLL
        for (int n = 0; n < size<1>(dp); ++n) dp(m, n) = p(m, n) * (dp(m, n) - dpsum[m]);
      }
    }
  }
};

}  // namespace flashhopper::hopper
