// bf16 and fp16 on the host: rounding to their value sets and conversion to and from their bit
// patterns, round-to-nearest-even (ties to even), overflow to inf, NaN kept. Header-only so the
// tests can use the very same conversions as the CPU reference.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace flashhopper::reference {

// The nearest value (ties to even) of a binary format with `significand_bits` bits of
// significand (the implicit bit included) whose normal exponents go down to `min_exponent`
// (below that the spacing stays 2^(min_exponent - significand_bits + 1): subnormals). Values
// beyond `max_finite` after rounding become inf. Exact for every float or double input because
// scaling by a power of two is exact and nearbyint rounds ties to even in the default mode.
template <class T>
T round_to_format(T x, int significand_bits, int min_exponent, T max_finite) {
  if (!std::isfinite(x) || x == T(0)) return x;
  int e = 0;
  std::frexp(x, &e);  // |x| = f * 2^e with f in [0.5, 1), so the exponent of x is e - 1
  const int exponent = std::max(e - 1, min_exponent);
  const T quantum = std::ldexp(T(1), exponent - (significand_bits - 1));
  const T rounded = std::nearbyint(x / quantum) * quantum;
  if (std::fabs(rounded) > max_finite) return std::copysign(std::numeric_limits<T>::infinity(), x);
  return rounded;
}

constexpr float kBf16MaxFinite = 3.38953139e38f;  // (2 - 2^-7) * 2^127
constexpr float kFp16MaxFinite = 65504.f;         // (2 - 2^-10) * 2^15

template <class T>
T round_to_bf16(T x) {
  return round_to_format<T>(x, 8, -126, T(kBf16MaxFinite));
}

template <class T>
T round_to_fp16(T x) {
  return round_to_format<T>(x, 11, -14, T(kFp16MaxFinite));
}

inline float bf16_bits_to_float(uint16_t bits) {
  const uint32_t word = uint32_t(bits) << 16;
  float x;
  std::memcpy(&x, &word, sizeof(x));
  return x;
}

// bf16 is the upper half of a float, so a float already rounded to bf16 is truncated exactly.
inline uint16_t double_to_bf16_bits(double x) {
  if (std::isnan(x)) return std::signbit(x) ? 0xFFC0 : 0x7FC0;
  const float rounded = float(round_to_bf16(x));
  uint32_t word;
  std::memcpy(&word, &rounded, sizeof(word));
  return uint16_t(word >> 16);
}

inline uint16_t float_to_bf16_bits(float x) { return double_to_bf16_bits(double(x)); }

inline float fp16_bits_to_float(uint16_t bits) {
  const float sign = (bits & 0x8000) ? -1.f : 1.f;
  const int exponent_field = (bits >> 10) & 0x1F;
  const int mantissa = bits & 0x3FF;
  if (exponent_field == 0) return sign * std::ldexp(float(mantissa), -24);  // zero, subnormal
  if (exponent_field == 31) {
    return mantissa == 0 ? sign * std::numeric_limits<float>::infinity()
                         : std::numeric_limits<float>::quiet_NaN();
  }
  return sign * std::ldexp(float(1024 + mantissa), exponent_field - 25);
}

inline uint16_t double_to_fp16_bits(double x) {
  if (std::isnan(x)) return 0x7E00;
  const double rounded = round_to_fp16(x);
  const uint16_t sign = std::signbit(rounded) ? 0x8000 : 0;
  const double magnitude = std::fabs(rounded);
  if (std::isinf(magnitude)) return sign | 0x7C00;
  if (magnitude < std::ldexp(1.0, -14)) {  // zero or subnormal: mantissa counts 2^-24 steps
    return sign | uint16_t(std::ldexp(magnitude, 24));
  }
  int e = 0;
  std::frexp(magnitude, &e);
  const int exponent = e - 1;  // in [-14, 15]
  const int mantissa = int(std::ldexp(magnitude, 10 - exponent)) - 1024;
  return sign | uint16_t((exponent + 15) << 10) | uint16_t(mantissa);
}

inline uint16_t float_to_fp16_bits(float x) { return double_to_fp16_bits(double(x)); }

}  // namespace flashhopper::reference
