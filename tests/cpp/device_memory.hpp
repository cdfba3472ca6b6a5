// Device memory for the GPU tests and the demo (no GoogleTest here): a device copy of a host
// tensor, and a raw buffer for workspaces. Errors come back as cudaError_t / ok().
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "flashhopper/flashhopper.hpp"
#include "test_util.hpp"

namespace flashhopper::test {

// A device copy of a host tensor with the same (possibly padded) storage and strides.
class DeviceTensor {
 public:
  explicit DeviceTensor(const HostTensor& host) : host_view_(host.view()), bytes_(host.bytes()) {
    if (cudaMalloc(&data_, bytes_) != cudaSuccess) data_ = nullptr;
  }
  ~DeviceTensor() { cudaFree(data_); }
  DeviceTensor(const DeviceTensor&) = delete;
  DeviceTensor& operator=(const DeviceTensor&) = delete;

  bool ok() const { return data_ != nullptr; }
  cudaError_t upload(const HostTensor& host) {
    return cudaMemcpy(data_, const_cast<HostTensor&>(host).data(), bytes_, cudaMemcpyHostToDevice);
  }
  cudaError_t download(HostTensor& host) const {
    return cudaMemcpy(host.data(), data_, bytes_, cudaMemcpyDeviceToHost);
  }
  cudaError_t poison() { return cudaMemset(data_, 0xff, bytes_); }  // NaN in bf16/fp16/fp32
  Tensor view() const {
    Tensor t = host_view_;
    t.data = data_;
    return t;
  }

 private:
  Tensor host_view_;
  size_t bytes_;
  void* data_ = nullptr;
};

// A cudaMalloc'ed workspace (cudaMalloc aligns to 256 bytes, as the API requires).
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  ~DeviceBuffer() { cudaFree(data_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  cudaError_t allocate(size_t bytes) {
    cudaFree(data_);
    data_ = nullptr;
    bytes_ = 0;
    if (bytes == 0) return cudaSuccess;
    const cudaError_t err = cudaMalloc(&data_, bytes);
    if (err == cudaSuccess) bytes_ = bytes;
    return err;
  }
  cudaError_t poison() { return bytes_ > 0 ? cudaMemset(data_, 0xff, bytes_) : cudaSuccess; }
  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

}  // namespace flashhopper::test
