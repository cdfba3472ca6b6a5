// fp8's descale factors (FA3's q/k/v_descale): the true value of an fp8 input is the stored one
// times its factor, one a (batch, KV head), float32.
#pragma once

#include <cstdint>

#include <cutlass/cutlass.h>

namespace flashhopper::hopper {

struct Descale {
  float const* factors = nullptr;  // [B, Hkv] at these strides; null: every factor is 1
  int64_t batch_stride = 0, head_stride = 0;

  CUTLASS_DEVICE float at(int batch, int head_kv) const {
    return factors == nullptr ? 1.f : __ldg(factors + batch * batch_stride + head_kv * head_stride);
  }
};

}  // namespace flashhopper::hopper
