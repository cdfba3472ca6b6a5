// The reference's refusals: Status helpers and checks of the arguments it reads.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "flashhopper/flashhopper.hpp"
#include "plan/problem_shape.hpp"

namespace flashhopper::reference::detail {

using flashhopper::detail::ProblemShape;

Status failure(fh_status code, const std::string& message);
Status invalid(const std::string& message);

// A tensor of rank `ndim` with no negative extent or stride and its data aligned to its elements:
// one the reference reads (check_input: present, a float dtype it reads), writes (check_output:
// present, a float dtype it writes) or int32 metadata (check_int32). check_shape: its extents
// are `expected`.
Status check_input(const Tensor& t, const char* name, int ndim);
Status check_output(const Tensor& t, const char* name, int ndim);
Status check_int32(const Tensor& t, const char* name, int ndim);
Status check_shape(const Tensor& t, const char* name, const std::vector<int64_t>& expected);

// What the library's check (validate, kHostReference) leaves to the reference: that a tensor it
// reads or writes, when present, has no negative extent or stride and its data aligned to its
// elements (the loads and stores dereference them). The library checks everything else.
Status check_dereferenceable(const Tensor& t, const char* name);

// learnable_sink [Hq] (fp32 or fp64, host memory), read into `sinks`. A logit may be -inf (that
// head has no sink) but neither NaN nor +inf, which would leave no defined softmax.
Status read_sinks(const Tensor& t, int64_t heads, std::vector<double>* sinks);

}  // namespace flashhopper::reference::detail

// Returns the first refusal from the calling function.
#define FLASHHOPPER_REFERENCE_CHECK(expr) \
  do {                                    \
    Status status_ = (expr);              \
    if (!status_.ok()) return status_;    \
  } while (0)
