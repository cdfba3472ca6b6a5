// The CUTLASS element type of a public dtype, and the type a forward writes O in.
#pragma once

#include <type_traits>

#include <cutlass/numeric_types.h>

#include "flashhopper/flashhopper.h"

namespace flashhopper::launch {

template <fh_dtype kDType>
struct ElementOf;
template <>
struct ElementOf<FH_DTYPE_BF16> {
  using type = cutlass::bfloat16_t;
};
template <>
struct ElementOf<FH_DTYPE_FP16> {
  using type = cutlass::half_t;
};
template <>
struct ElementOf<FH_DTYPE_FP8_E4M3> {
  using type = cutlass::float_e4m3_t;
};

// O is written in the inputs' dtype, but bf16 for fp8 inputs (the C library's rule).
template <class Element>
using OutputElementOf = std::conditional_t<sizeof(Element) == 1, cutlass::bfloat16_t, Element>;

}  // namespace flashhopper::launch
