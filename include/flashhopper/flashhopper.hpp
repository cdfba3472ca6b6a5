// FlashHopper C++ API: the C ABI's structs with C++ conveniences (a Status that carries its
// message, tensor builders). No CUDA or CuTe include, so any host code can use it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "flashhopper/flashhopper.h"

namespace flashhopper {

using DType = fh_dtype;
using Tensor = fh_tensor;
using ForwardParams = fh_forward_params;
using BackwardParams = fh_backward_params;
using CombineParams = fh_combine_params;

struct Status {
  fh_status code = FH_SUCCESS;
  std::string message;
  bool ok() const { return code == FH_SUCCESS; }
};

// A view with the given shape and strides (elements). Strides default to row-major contiguous.
Tensor make_tensor(void* data, DType dtype, std::initializer_list<int64_t> shape,
                   std::initializer_list<int64_t> stride = {});

// The library's version, "MAJOR.MINOR.PATCH" (as fh_version).
const char* version();

// Bytes of one element of `dtype`.
size_t dtype_size(DType dtype);

ForwardParams default_forward_params();
BackwardParams default_backward_params();

Status check(const ForwardParams& params);
Status check(const BackwardParams& params);
Status check(const CombineParams& params);

Status workspace_size(const ForwardParams& params, size_t* bytes);
Status workspace_size(const BackwardParams& params, size_t* bytes);

Status forward(const ForwardParams& params, void* workspace, size_t workspace_bytes,
               fh_stream_t stream);
Status backward(const BackwardParams& params, void* workspace, size_t workspace_bytes,
                fh_stream_t stream);
Status combine(const CombineParams& params, fh_stream_t stream);

}  // namespace flashhopper
