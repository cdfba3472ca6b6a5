// bf16, fp16 and fp8 e4m3 on the host: rounding to their value sets and conversion to and from
// their bit patterns, round-to-nearest-even (ties to even), overflow to inf (e4m3, which has no
// inf: to NaN, as PyTorch's float8_e4m3fn does), NaN kept. Header-only so the
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

// fp8 e4m3 ("fn": no inf): 1 sign, 4 exponent (bias 7), 3 mantissa bits; largest 448, smallest
// normal 2^-6, subnormals down to 2^-9; S.1111.111 is NaN.
constexpr float kE4m3MaxFinite = 448.f;

template <class T>
T round_to_e4m3(T x) {
  const T rounded = round_to_format<T>(x, 4, -6, T(kE4m3MaxFinite));
  return std::isinf(rounded) ? std::numeric_limits<T>::quiet_NaN() : rounded;
}

inline float e4m3_bits_to_float(uint8_t bits) {
  const float sign = (bits & 0x80) ? -1.f : 1.f;
  const int exponent_field = (bits >> 3) & 0xF;
  const int mantissa = bits & 0x7;
  if (exponent_field == 15 && mantissa == 7) return std::numeric_limits<float>::quiet_NaN();
  if (exponent_field == 0) return sign * std::ldexp(float(mantissa), -9);  // zero, subnormal
  return sign * std::ldexp(float(8 + mantissa), exponent_field - 10);
}

inline uint8_t double_to_e4m3_bits(double x) {
  const double rounded = round_to_e4m3(x);
  if (std::isnan(rounded)) return 0x7F;
  const uint8_t sign = std::signbit(rounded) ? 0x80 : 0;
  const double magnitude = std::fabs(rounded);
  if (magnitude < std::ldexp(1.0, -6)) return sign | uint8_t(std::ldexp(magnitude, 9));  // 2^-9 steps
  int e = 0;
  std::frexp(magnitude, &e);
  const int exponent = e - 1;  // in [-6, 8]
  const int mantissa = int(std::ldexp(magnitude, 3 - exponent)) - 8;
  return sign | uint8_t((exponent + 7) << 3) | uint8_t(mantissa);
}

}  // namespace flashhopper::reference
