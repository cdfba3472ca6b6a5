// Host-side helpers shared by the C++ tests: host tensors of any dtype with random contents,
// views over them (padded, permuted, narrowed, one sequence of a packed batch), bf16/fp16
// conversions, and the largest difference of two tensors read through their strides.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "flashhopper/flashhopper.hpp"
#include "reference/host_dtype.hpp"
#include "reference/tensor_access.hpp"

namespace flashhopper::test {

// bf16/fp16 <-> float, round-to-nearest-even: the same functions as the CPU reference.
using reference::bf16_bits_to_float;
using reference::float_to_bf16_bits;
using reference::float_to_fp16_bits;
using reference::fp16_bits_to_float;
using reference::round_to_bf16;
using reference::round_to_fp16;

inline size_t element_bytes(int32_t dtype) {
  const size_t bytes = dtype_size(static_cast<DType>(dtype));
  if (bytes == 0) throw std::invalid_argument("unknown dtype");
  return bytes;
}

inline int64_t element_offset(const Tensor& t, const std::vector<int64_t>& index) {
  int64_t offset = 0;
  for (int i = 0; i < t.ndim; ++i) offset += index[i] * t.stride[i];
  return offset;
}

// Calls fn(index) for every index of `shape`, last dim fastest.
inline void for_each_index(const std::vector<int64_t>& shape,
                           const std::function<void(const std::vector<int64_t>&)>& fn) {
  for (int64_t extent : shape)
    if (extent == 0) return;
  std::vector<int64_t> index(shape.size(), 0);
  while (true) {
    fn(index);
    int dim = int(shape.size()) - 1;
    while (dim >= 0 && ++index[dim] == shape[dim]) index[dim--] = 0;
    if (dim < 0) return;
  }
}

inline std::vector<int64_t> shape_of(const Tensor& t) {
  return std::vector<int64_t>(t.shape, t.shape + t.ndim);
}

// Reads any float dtype (and int32) as a double.
inline double read(const Tensor& t, const std::vector<int64_t>& index) {
  const int64_t offset = element_offset(t, index);
  if (t.dtype == FH_DTYPE_INT32) return double(static_cast<const int32_t*>(t.data)[offset]);
  return reference::load_element(t, offset);
}

inline void write(const Tensor& t, const std::vector<int64_t>& index, double value) {
  const int64_t offset = element_offset(t, index);
  if (t.dtype == FH_DTYPE_INT32) {
    static_cast<int32_t*>(t.data)[offset] = int32_t(value);
  } else {
    reference::store_element(t, offset, value);
  }
}

// A host buffer, row-major over its storage shape. view() shows `shape` (each extent at most the
// storage's), so a padded storage gives a view with strides larger than its shape.
class HostTensor {
 public:
  HostTensor() = default;
  HostTensor(int32_t dtype, std::vector<int64_t> shape, std::vector<int64_t> storage_shape = {})
      : dtype_(dtype), shape_(std::move(shape)), storage_shape_(std::move(storage_shape)) {
    if (storage_shape_.empty()) storage_shape_ = shape_;
    if (storage_shape_.size() != shape_.size() || shape_.size() > FH_MAX_DIMS) {
      throw std::invalid_argument("HostTensor: bad storage shape");
    }
    int64_t count = 1;
    for (size_t i = 0; i < shape_.size(); ++i) {
      if (shape_[i] > storage_shape_[i]) throw std::invalid_argument("HostTensor: shape > storage");
      count *= storage_shape_[i];
    }
    // At least one element, so that even an empty tensor has a non-null data pointer (null
    // means "absent" in the parameter structs).
    bytes_.assign(size_t(std::max<int64_t>(count, 1)) * element_bytes(dtype_), 0);
  }

  Tensor view() const {
    Tensor t{};
    t.data = const_cast<unsigned char*>(bytes_.data());
    t.dtype = dtype_;
    t.ndim = int32_t(shape_.size());
    int64_t stride = 1;
    for (int i = t.ndim - 1; i >= 0; --i) {
      t.shape[i] = shape_[i];
      t.stride[i] = stride;
      stride *= storage_shape_[i];
    }
    return t;
  }

  int32_t dtype() const { return dtype_; }
  const std::vector<int64_t>& shape() const { return shape_; }
  void* data() { return bytes_.data(); }
  size_t bytes() const { return bytes_.size(); }  // of the whole storage

  double get(const std::vector<int64_t>& index) const { return read(view(), index); }
  void set(const std::vector<int64_t>& index, double value) { write(view(), index, value); }

  void fill(double value) {
    const Tensor t = view();
    for_each_index(shape_, [&](const std::vector<int64_t>& i) { write(t, i, value); });
  }

  // Normal(0, stddev) values, rounded into the dtype, from a std::mt19937 seeded with `seed`.
  void fill_random(uint32_t seed, double stddev = 1.0) {
    std::mt19937 generator(seed);
    std::normal_distribution<double> normal(0.0, stddev);
    const Tensor t = view();
    for_each_index(shape_, [&](const std::vector<int64_t>& i) { write(t, i, normal(generator)); });
  }

 private:
  int32_t dtype_ = FH_DTYPE_FP64;
  std::vector<int64_t> shape_, storage_shape_;
  std::vector<unsigned char> bytes_;
};

inline HostTensor random_tensor(int32_t dtype, std::vector<int64_t> shape, uint32_t seed,
                                std::vector<int64_t> storage_shape = {}) {
  HostTensor t(dtype, std::move(shape), std::move(storage_shape));
  t.fill_random(seed);
  return t;
}

inline HostTensor int32_tensor(const std::vector<int32_t>& values,
                               std::vector<int64_t> shape = {}) {
  if (shape.empty()) shape = {int64_t(values.size())};
  HostTensor t(FH_DTYPE_INT32, shape);
  std::copy(values.begin(), values.end(), static_cast<int32_t*>(t.data()));
  return t;
}

// ---- views ---------------------------------------------------------------------------------

// The view with dims reordered: result dim i is t's dim order[i].
inline Tensor permute(const Tensor& t, const std::vector<int>& order) {
  Tensor r = t;
  for (int i = 0; i < t.ndim; ++i) {
    r.shape[i] = t.shape[order[i]];
    r.stride[i] = t.stride[order[i]];
  }
  return r;
}

// Elements [start, start + length) of dim `dim`.
inline Tensor narrow(const Tensor& t, int dim, int64_t start, int64_t length) {
  Tensor r = t;
  r.data = static_cast<unsigned char*>(t.data) + start * t.stride[dim] * element_bytes(t.dtype);
  r.shape[dim] = length;
  return r;
}

// A new dim of extent 1 at `dim`.
inline Tensor unsqueeze(const Tensor& t, int dim) {
  Tensor r = t;
  for (int i = t.ndim; i > dim; --i) {
    r.shape[i] = t.shape[i - 1];
    r.stride[i] = t.stride[i - 1];
  }
  r.shape[dim] = 1;
  r.stride[dim] = 0;
  r.ndim = t.ndim + 1;
  return r;
}

// Sequence [start, start + length) of a packed varlen [total, H, x] tensor, as a dense
// [1, length, H, x] view of the same memory.
inline Tensor sequence_view(const Tensor& packed, int64_t start, int64_t length) {
  return unsqueeze(narrow(packed, 0, start, length), 0);
}

// ---- comparisons ---------------------------------------------------------------------------

// max |a - b| over all elements (same shapes), read through both tensors' strides. Equal
// infinities count as 0; a NaN on either side gives NaN, so `EXPECT_LE(diff, tol)` fails.
inline double max_abs_diff(const Tensor& a, const Tensor& b) {
  if (shape_of(a) != shape_of(b)) throw std::invalid_argument("max_abs_diff: shapes differ");
  double worst = 0;
  bool saw_nan = false;
  for_each_index(shape_of(a), [&](const std::vector<int64_t>& i) {
    const double x = read(a, i), y = read(b, i);
    if (std::isnan(x) || std::isnan(y)) {
      saw_nan = true;
    } else if (x != y) {
      worst = std::max(worst, std::fabs(x - y));
    }
  });
  return saw_nan ? std::numeric_limits<double>::quiet_NaN() : worst;
}

// max |a| over its finite elements (an lse's -inf rows left out).
inline double max_abs_finite(const Tensor& a) {
  double worst = 0;
  for_each_index(shape_of(a), [&](const std::vector<int64_t>& i) {
    const double x = read(a, i);
    if (std::isfinite(x)) worst = std::max(worst, std::fabs(x));
  });
  return worst;
}

inline double max_abs(const Tensor& a) {
  double worst = 0;
  for_each_index(shape_of(a), [&](const std::vector<int64_t>& i) {
    worst = std::max(worst, std::fabs(read(a, i)));
  });
  return worst;
}

inline bool has_nan(const Tensor& a) {
  bool found = false;
  for_each_index(shape_of(a),
                 [&](const std::vector<int64_t>& i) { found |= std::isnan(read(a, i)); });
  return found;
}

// Elements that are not NaN (a poisoned region that nothing may write keeps 0 of them).
inline int64_t count_not_nan(const Tensor& a) {
  int64_t count = 0;
  for_each_index(shape_of(a), [&](const std::vector<int64_t>& i) { count += !std::isnan(read(a, i)); });
  return count;
}

}  // namespace flashhopper::test
