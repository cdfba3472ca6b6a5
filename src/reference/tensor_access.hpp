// Reading and writing host tensors through their strides, whatever their floating-point dtype.
// The dtype is looked at once per call, outside the loop over elements, so a caller that copies
// a whole row pays for one switch, not one per element. Header-only; the tests use it too.
#pragma once

#include <cstddef>
#include <cstdint>

#include "flashhopper/flashhopper.hpp"
#include "reference/host_dtype.hpp"

namespace flashhopper::reference {

inline bool is_readable_float(int32_t dtype) {
  return dtype == FH_DTYPE_BF16 || dtype == FH_DTYPE_FP16 || dtype == FH_DTYPE_FP32 ||
         dtype == FH_DTYPE_FP64 || dtype == FH_DTYPE_FP8_E4M3;
}

inline const char* dtype_name(int32_t dtype) {
  switch (dtype) {
    case FH_DTYPE_BF16: return "bf16";
    case FH_DTYPE_FP16: return "fp16";
    case FH_DTYPE_FP8_E4M3: return "fp8_e4m3";
    case FH_DTYPE_FP32: return "fp32";
    case FH_DTYPE_INT32: return "int32";
    case FH_DTYPE_FP64: return "fp64";
    default: return "unknown dtype";
  }
}

// dst[i] = t.data[offset + i * stride] for i < n, converted to T. t has a readable float dtype.
template <class T>
void load_strided(const Tensor& t, int64_t offset, int64_t stride, int64_t n, T* dst) {
  switch (t.dtype) {
    case FH_DTYPE_BF16: {
      const uint16_t* p = static_cast<const uint16_t*>(t.data) + offset;
      for (int64_t i = 0; i < n; ++i) dst[i] = T(bf16_bits_to_float(p[i * stride]));
      break;
    }
    case FH_DTYPE_FP16: {
      const uint16_t* p = static_cast<const uint16_t*>(t.data) + offset;
      for (int64_t i = 0; i < n; ++i) dst[i] = T(fp16_bits_to_float(p[i * stride]));
      break;
    }
    case FH_DTYPE_FP8_E4M3: {
      const uint8_t* p = static_cast<const uint8_t*>(t.data) + offset;
      for (int64_t i = 0; i < n; ++i) dst[i] = T(e4m3_bits_to_float(p[i * stride]));
      break;
    }
    case FH_DTYPE_FP32: {
      const float* p = static_cast<const float*>(t.data) + offset;
      for (int64_t i = 0; i < n; ++i) dst[i] = T(p[i * stride]);
      break;
    }
    case FH_DTYPE_FP64: {
      const double* p = static_cast<const double*>(t.data) + offset;
      for (int64_t i = 0; i < n; ++i) dst[i] = T(p[i * stride]);
      break;
    }
    default: break;  // callers check the dtype first
  }
}

// t.data[offset + i * stride] = src[i] for i < n, rounded to nearest-even into t's dtype.
template <class T>
void store_strided(const Tensor& t, int64_t offset, int64_t stride, int64_t n, const T* src) {
  switch (t.dtype) {
    case FH_DTYPE_BF16: {
      uint16_t* p = static_cast<uint16_t*>(t.data) + offset;
      for (int64_t i = 0; i < n; ++i) p[i * stride] = double_to_bf16_bits(double(src[i]));
      break;
    }
    case FH_DTYPE_FP16: {
      uint16_t* p = static_cast<uint16_t*>(t.data) + offset;
      for (int64_t i = 0; i < n; ++i) p[i * stride] = double_to_fp16_bits(double(src[i]));
      break;
    }
    case FH_DTYPE_FP8_E4M3: {
      uint8_t* p = static_cast<uint8_t*>(t.data) + offset;
      for (int64_t i = 0; i < n; ++i) p[i * stride] = double_to_e4m3_bits(double(src[i]));
      break;
    }
    case FH_DTYPE_FP32: {
      float* p = static_cast<float*>(t.data) + offset;
      for (int64_t i = 0; i < n; ++i) p[i * stride] = float(src[i]);
      break;
    }
    case FH_DTYPE_FP64: {
      double* p = static_cast<double*>(t.data) + offset;
      for (int64_t i = 0; i < n; ++i) p[i * stride] = double(src[i]);
      break;
    }
    default: break;
  }
}

inline double load_element(const Tensor& t, int64_t offset) {
  double x = 0;
  load_strided(t, offset, 1, 1, &x);
  return x;
}

inline void store_element(const Tensor& t, int64_t offset, double x) {
  store_strided(t, offset, 1, 1, &x);
}

// An int32 metadata tensor (cu_seqlens, seqused, page table), read on the host.
inline int64_t load_int(const Tensor& t, int64_t offset) {
  return static_cast<const int32_t*>(t.data)[offset];
}

}  // namespace flashhopper::reference
