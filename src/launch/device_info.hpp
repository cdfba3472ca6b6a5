// The current device's SM count and L2 size, as the launches and the dispatch's plans use them.
#pragma once

#include <cuda_runtime_api.h>

namespace flashhopper::launch {

inline cudaError_t device_sms_and_l2(int* num_sms, int* l2_bytes) {
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(num_sms, cudaDevAttrMultiProcessorCount, device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(l2_bytes, cudaDevAttrL2CacheSize, device);
  return err;
}

}  // namespace flashhopper::launch
