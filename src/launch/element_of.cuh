// The CUTLASS element type of a public dtype.
#pragma once

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

}  // namespace flashhopper::launch
