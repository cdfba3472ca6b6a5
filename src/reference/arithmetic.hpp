// The number formats of the computation: exact (double), or a plain low-precision
// implementation (Options::emulate_low_precision), and the dispatch on q's dtype between them.
#pragma once

#include <cstdint>
#include <string>

#include "flashhopper/flashhopper.hpp"
#include "reference/checks.hpp"
#include "reference/host_dtype.hpp"
#include "reference/reference.hpp"
#include "reference/tensor_access.hpp"

namespace flashhopper::reference::detail {

// round: O and every other rounded intermediate; round_score: S; round_prob: P.
struct ExactMath {
  using Acc = double;
  static double round(double x) { return x; }
  static double round_score(double x) { return x; }
  static double round_prob(double x) { return x; }
};

// Products accumulate in float32; S, P, O (and dP, dS, the gradients) are rounded to `Dtype`.
template <int Dtype>
struct LowPrecisionMath {
  using Acc = float;
  static float round(float x) {
    if constexpr (Dtype == FH_DTYPE_BF16) return round_to_bf16(x);
    if constexpr (Dtype == FH_DTYPE_FP16) return round_to_fp16(x);
    return x;  // fp32
  }
  static float round_score(float x) { return round(x); }
  static float round_prob(float x) { return round(x); }
};

// A plain fp8 (e4m3) forward: products of the (descaled) inputs accumulate in float32, S stays
// float32, P is rounded to e4m3 as it is (values in [0, 1]; no per-row scaling), O to bf16, the
// output dtype of fp8 attention.
struct Fp8Math {
  using Acc = float;
  static float round(float x) { return round_to_bf16(x); }
  static float round_score(float x) { return x; }
  static float round_prob(float x) { return round_to_e4m3(x); }
};

// ---- dispatch on the arithmetic --------------------------------------------------------------

template <class Run>
Status dispatch_math(const Options& options, int32_t q_dtype, const Run& run) {
  if (!options.emulate_low_precision) {
    run(ExactMath{});
    return {};
  }
  switch (q_dtype) {
    case FH_DTYPE_BF16: run(LowPrecisionMath<FH_DTYPE_BF16>{}); return {};
    case FH_DTYPE_FP16: run(LowPrecisionMath<FH_DTYPE_FP16>{}); return {};
    case FH_DTYPE_FP32: run(LowPrecisionMath<FH_DTYPE_FP32>{}); return {};
    case FH_DTYPE_FP8_E4M3: run(Fp8Math{}); return {};
    default:
      return failure(FH_ERROR_NOT_SUPPORTED,
                     std::string("emulate_low_precision needs q in bf16, fp16, fp8_e4m3 or fp32, not ") +
                         dtype_name(q_dtype));
  }
}

}  // namespace flashhopper::reference::detail
