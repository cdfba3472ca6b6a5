// What every kernel launch shares: the device's SM count and L2 size, the shared-memory opt-in
// and the launch itself, and the mask's run-time parameters from a parameter struct.
#pragma once

#include <cuda_runtime_api.h>

#include "api/problem_shape.hpp"
#include "hopper/common/mask.hpp"

namespace flashhopper::launch {

inline cudaError_t device_sms_and_l2(int* num_sms, int* l2_bytes) {
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(num_sms, cudaDevAttrMultiProcessorCount, device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(l2_bytes, cudaDevAttrL2CacheSize, device);
  return err;
}

// Opts the kernel into its shared memory and launches it on `grid` CTAs.
template <class Kernel, class Entry>
cudaError_t launch_kernel(Entry entry, int grid, typename Kernel::Params const& params, cudaStream_t stream) {
  constexpr int kSmemBytes = Kernel::kSharedStorageSize;
  cudaError_t err = cudaFuncSetAttribute(entry, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  if (err != cudaSuccess) return err;
  entry<<<grid, Kernel::kNumThreads, kSmemBytes, stream>>>(params);
  return cudaGetLastError();
}

// The window, sink tokens and chunk of a forward or backward call (used by kLocal kernels).
template <class Params>
hopper::LocalMaskParams local_mask_params(const Params& p) {
  const detail::MaskSpec m = detail::mask_spec(p);
  return {m.window_left, m.window_right, m.num_sink_tokens, m.attention_chunk};
}

}  // namespace flashhopper::launch
