// Softmax over the rows of a WGMMA accumulator held in registers: the forward's online softmax, and
// the backward's P and dS from the saved LSE.
// Forward: scores stay raw (unscaled) until the exponent: p = exp2(s * scale_log2 - max * scale_log2), one
// FFMA per element. The running sum is kept per thread and reduced over the quad only at the end.
#pragma once

#include <cmath>

#include <cute/tensor.hpp>

#include "hopper/common/nan_max.hpp"
#include "hopper/common/utils.hpp"

namespace flashhopper::hopper {

using namespace cute;

// 2^x for x <= 0 on the FMA and integer pipes instead of the SFU: x = r + f with r = round(x) (by
// the 1.5 * 2^23 trick) and f in [-0.5, 0.5], 2^f by its degree-4 Taylor polynomial (relative
// error under 5e-5, a tenth of fp16's rounding of P), then r added to the exponent bits.
CUTLASS_DEVICE float exp2_fma(float x) {
  const float clamped = fmaxf(x, -125.f);  // keeps the exponent arithmetic in range
  const float shifted = __fadd_rn(clamped, 12582912.f);  // low mantissa bits: 2^22 + round(x)
  const float r = __fadd_rn(shifted, -12582912.f);
  const float f = __fadd_rn(clamped, -r);
  float p = fmaf(0.0096181291f, f, 0.0555041087f);
  p = fmaf(p, f, 0.2402265070f);
  p = fmaf(p, f, 0.6931471806f);
  p = fmaf(p, f, 1.f);
  const float y = __int_as_float(__float_as_int(p) + (__float_as_int(shifted) << 23));
  return x < -125.f ? 0.f : y;  // exactly 0 for masked scores (-inf), as exp2f gives
}

// kFmaExpEvery > 0: every kFmaExpEvery-th exponent of a row goes through exp2_fma, which relieves
// the SFU where it is the bottleneck (softcap's tanh takes a second SFU op per score).
// kProbabilityLog2 > 0: P is 2^kProbabilityLog2 times the probability (up to 256 for 8, below
// e4m3's 448), so that P rounded to fp8 keeps its small values normal; the sum carries the same
// factor, so O's normalisation cancels it, and the LSE takes it out.
template <int kRows, int kFmaExpEvery = 0, int kProbabilityLog2 = 0>
struct OnlineSoftmax {
  float row_max[kRows];
  float row_sum[kRows];
  float scale_log2;  // softmax_scale * log2(e)
  // An LSE from sums that carry P's factor, without it.
  static CUTLASS_DEVICE float without_probability_factor(float lse) {
    if constexpr (kProbabilityLog2 == 0) return lse;
    return lse - float(kProbabilityLog2) * float(M_LN2);
  }

  CUTLASS_DEVICE explicit OnlineSoftmax(float scale_log2_) : scale_log2(scale_log2_) {
    CUTLASS_PRAGMA_UNROLL
    for (int m = 0; m < kRows; ++m) {
      row_max[m] = -INFINITY;
      row_sum[m] = 0.f;
    }
  }

  // Folds the block of scores `s` (rows, cols) in: s becomes P (unnormalised), and `o_scale`
  // receives the factor by which the rows of O must shrink because the maximum moved.
  template <bool kFirst, class TensorS>
  CUTLASS_DEVICE void update(TensorS& s, float (&o_scale)[kRows]) {
    static_assert(decltype(size<0>(s))::value == kRows);
    CUTLASS_PRAGMA_UNROLL
    for (int m = 0; m < kRows; ++m) {
      // max.NaN: a NaN score makes the row's maximum NaN, and so every exponent of the row
      // (exp2_fma's clamp would otherwise turn a NaN exponent into a finite value).
      float block_max = row_max[m];
      CUTLASS_PRAGMA_UNROLL
      for (int n = 0; n < size<1>(s); ++n) block_max = max_keep_nan(block_max, s(m, n));
      block_max = quad_allreduce(block_max, [](float a, float b) { return max_keep_nan(a, b); });
      // A row that has seen only masked keys keeps max -inf; use 0 so no (-inf) - (-inf) arises.
      const float max_scaled = block_max == -INFINITY ? 0.f : block_max * scale_log2;
      if constexpr (kFirst) {
        o_scale[m] = 1.f;
      } else {
        o_scale[m] = row_max[m] == -INFINITY ? 0.f : exp2f(row_max[m] * scale_log2 - max_scaled);
      }
      row_max[m] = block_max;
      const float exponent_shift = kProbabilityLog2 == 0 ? max_scaled : max_scaled - float(kProbabilityLog2);
      float sum = 0.f;
      CUTLASS_PRAGMA_UNROLL
      for (int n = 0; n < size<1>(s); ++n) {
        const float x = s(m, n) * scale_log2 - exponent_shift;
        if constexpr (kFmaExpEvery > 0) {
          s(m, n) = n % kFmaExpEvery == kFmaExpEvery - 1 ? exp2_fma(x) : exp2f(x);
        } else {
          s(m, n) = exp2f(x);
        }
        sum += s(m, n);
      }
      row_sum[m] = row_sum[m] * o_scale[m] + sum;
    }
  }

  // Normalisation factor 1/sum per row (0 for rows that saw no key) and the natural-log LSE
  // (-inf for those rows). `softmax_scale` is the unscaled-to-logit factor. A learnable sink
  // (sink_log2 = its logit * log2 e; -inf: none) joins each row's sum with no value, so it shrinks
  // O and raises the LSE; a row that saw no key then has LSE = the sink's logit.
  CUTLASS_DEVICE void finalize(float softmax_scale, float (&o_scale)[kRows], float (&lse)[kRows],
                               float sink_log2 = -INFINITY) {
    CUTLASS_PRAGMA_UNROLL
    for (int m = 0; m < kRows; ++m) {
      float sum = quad_allreduce(row_sum[m], [](float a, float b) { return a + b; });
      if (sink_log2 != -INFINITY) {
        const float max_log2 = row_max[m] == -INFINITY ? -INFINITY : row_max[m] * scale_log2;
        const float new_max = fmaxf(max_log2, sink_log2);
        const float shrink = max_log2 == -INFINITY ? 0.f : exp2f(max_log2 - new_max);
        const float sink_exponent = sink_log2 - new_max;
        sum = sum * shrink + exp2f(kProbabilityLog2 == 0 ? sink_exponent : sink_exponent + float(kProbabilityLog2));
        o_scale[m] = shrink / sum;
        lse[m] = without_probability_factor(new_max * float(M_LN2) + logf(sum));
      } else {
        const bool empty = sum == 0.f;  // a NaN sum (a NaN input) stays NaN in O and LSE
        o_scale[m] = empty ? 0.f : 1.f / sum;
        lse[m] = empty ? -INFINITY : without_probability_factor(row_max[m] * softmax_scale + logf(sum));
      }
    }
  }
};

// O's rows scaled in place: o (rows, cols) *= o_scale[row].
template <int kRows, class TensorO>
CUTLASS_DEVICE void scale_rows(TensorO& o, float const (&o_scale)[kRows]) {
  CUTLASS_PRAGMA_UNROLL
  for (int m = 0; m < kRows; ++m) {
    CUTLASS_PRAGMA_UNROLL
    for (int n = 0; n < size<1>(o); ++n) o(m, n) *= o_scale[m];
  }
}

// Backward: the scores s (rows, cols) become the probabilities in place, from the forward's
// row LSE: p = exp2(s * scale_log2 - lse_log2[row]). lse_log2: the rows' values by index (an array,
// or a reader of them in shared memory).
template <class TensorS, class RowValues>
CUTLASS_DEVICE void scores_to_probabilities(TensorS& s, RowValues const& lse_log2, float scale_log2) {
  CUTLASS_PRAGMA_UNROLL
  for (int m = 0; m < size<0>(s); ++m) {
    CUTLASS_PRAGMA_UNROLL
    for (int n = 0; n < size<1>(s); ++n) s(m, n) = exp2f(s(m, n) * scale_log2 - lse_log2[m]);
  }
}

}  // namespace flashhopper::hopper
