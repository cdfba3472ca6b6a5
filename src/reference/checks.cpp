// The reference's refusals: Status helpers and checks of the arguments it reads.
#include "reference/checks.hpp"

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "reference/tensor_access.hpp"

namespace flashhopper::reference::detail {

using flashhopper::detail::present;

namespace {

std::string shape_string(const Tensor& t) {
  std::string s = "[";
  for (int i = 0; i < t.ndim; ++i) s += (i ? ", " : "") + std::to_string(t.shape[i]);
  return s + "]";
}

std::string shape_string(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

bool is_writable_float(int32_t dtype) { return is_readable_float(dtype); }

// A float tensor the reference reads: present, bf16/fp16/fp32/fp64, of rank `ndim`.
// No negative extent or stride: the loops below size buffers and index with them (extents of 0
// are allowed here, e.g. an empty sequence's view; check_heads refuses a head dim of 0); and a data
// pointer aligned to the element, which the loads and stores below dereference.
Status check_extents(const Tensor& t, const char* name) {
  const size_t element = dtype_size(static_cast<DType>(t.dtype));
  if (element > 0 && reinterpret_cast<uintptr_t>(t.data) % element != 0) {
    return invalid(std::string(name) + "'s data pointer is not aligned to its " + std::to_string(element) +
                   "-byte elements");
  }
  for (int dim = 0; dim < t.ndim; ++dim) {
    if (t.shape[dim] < 0) {
      return invalid(std::string(name) + " has shape[" + std::to_string(dim) + "] = " + std::to_string(t.shape[dim]) +
                     "; extents must not be negative");
    }
  }
  for (int dim = 0; dim < t.ndim; ++dim) {
    if (t.stride[dim] < 0) {
      return invalid(std::string(name) + " has stride[" + std::to_string(dim) + "] = " +
                     std::to_string(t.stride[dim]) + "; negative strides are not supported");
    }
  }
  return {};
}

}  // namespace

Status failure(fh_status code, const std::string& message) {
  return Status{code, "reference: " + message};
}

Status invalid(const std::string& message) { return failure(FH_ERROR_INVALID_ARGUMENT, message); }

Status check_input(const Tensor& t, const char* name, int ndim) {
  if (!present(t)) return invalid(std::string(name) + " is required");
  if (!is_readable_float(t.dtype)) {
    return invalid(std::string(name) + " has dtype " + dtype_name(t.dtype) +
                   "; expected bf16, fp16, fp8_e4m3, fp32 or fp64");
  }
  if (t.ndim != ndim) {
    return invalid(std::string(name) + " has rank " + std::to_string(t.ndim) + ", expected " +
                   std::to_string(ndim));
  }
  return check_extents(t, name);
}

Status check_output(const Tensor& t, const char* name, int ndim) {
  if (!present(t)) return invalid(std::string(name) + " is required");
  if (!is_writable_float(t.dtype)) {
    return invalid(std::string(name) + " has dtype " + dtype_name(t.dtype) +
                   "; the CPU reference writes bf16, fp16, fp32 or fp64");
  }
  if (t.ndim != ndim) {
    return invalid(std::string(name) + " has rank " + std::to_string(t.ndim) + ", expected " +
                   std::to_string(ndim));
  }
  return check_extents(t, name);
}

Status check_dereferenceable(const Tensor& t, const char* name) {
  return present(t) ? check_extents(t, name) : Status{};
}

Status check_int32(const Tensor& t, const char* name, int ndim) {
  if (t.dtype != FH_DTYPE_INT32) return invalid(std::string(name) + " must be int32");
  if (t.ndim != ndim) {
    return invalid(std::string(name) + " has rank " + std::to_string(t.ndim) + ", expected " +
                   std::to_string(ndim));
  }
  return check_extents(t, name);
}

Status check_shape(const Tensor& t, const char* name, const std::vector<int64_t>& expected) {
  bool same = int(expected.size()) == t.ndim;
  for (int i = 0; same && i < t.ndim; ++i) same = t.shape[i] == expected[i];
  if (!same) {
    return invalid(std::string(name) + " has shape " + shape_string(t) + ", expected " +
                   shape_string(expected));
  }
  return {};
}

Status read_sinks(const Tensor& t, int64_t heads, std::vector<double>* sinks) {
  sinks->clear();
  if (!present(t)) return {};
  if (t.dtype != FH_DTYPE_FP32 && t.dtype != FH_DTYPE_FP64) {
    return invalid(std::string("learnable_sink has dtype ") + dtype_name(t.dtype) +
                   "; expected fp32 or fp64");
  }
  FLASHHOPPER_REFERENCE_CHECK(check_shape(t, "learnable_sink", {heads}));
  sinks->resize(heads);
  for (int64_t h = 0; h < heads; ++h) {
    const double x = load_element(t, h * t.stride[0]);
    if (std::isnan(x) || x == std::numeric_limits<double>::infinity()) {
      return invalid("learnable_sink[" + std::to_string(h) + "] is " + std::to_string(x) +
                     "; a sink logit must be finite or -inf (no sink)");
    }
    (*sinks)[h] = x;
  }
  return {};
}

}  // namespace flashhopper::reference::detail
