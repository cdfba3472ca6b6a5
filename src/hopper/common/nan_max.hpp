// max that returns NaN when either input is NaN (fmaxf drops it), for reductions where a NaN
// input must reach the result rather than read as "smaller than everything".
#pragma once

#include <cutlass/cutlass.h>

namespace flashhopper::hopper {

CUTLASS_DEVICE float max_keep_nan(float a, float b) {
  float m;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(m) : "f"(a), "f"(b));
  return m;
}

}  // namespace flashhopper::hopper
