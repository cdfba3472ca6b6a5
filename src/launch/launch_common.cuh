// What every kernel launch shares: the device's SM count and L2 size (device_info.hpp), the
// shared-memory opt-in and the launch itself, and the mask's run-time parameters from a parameter
// struct.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>

#include "plan/problem_shape.hpp"
#include "hopper/common/mask.hpp"
#include "launch/device_info.hpp"

namespace flashhopper::launch {

// Opts the kernel into its shared memory (once per device: the attribute stays set, and setting
// it costs host time on every call) and launches it on `grid` CTAs.
template <class Kernel, class Entry>
cudaError_t launch_kernel(Entry entry, int grid, typename Kernel::Params const& params, cudaStream_t stream) {
  constexpr int kSmemBytes = Kernel::kSharedStorageSize;
  static std::atomic<uint64_t> opted_in{0};  // bit i: done on device i (this instantiation's own)
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  const uint64_t bit = device < 64 ? uint64_t(1) << device : 0;
  if (bit == 0 || (opted_in.load(std::memory_order_acquire) & bit) == 0) {
    err = cudaFuncSetAttribute(entry, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
    if (err != cudaSuccess) return err;
    opted_in.fetch_or(bit, std::memory_order_release);
  }
  entry<<<grid, Kernel::kNumThreads, kSmemBytes, stream>>>(params);
  return cudaGetLastError();
}

// A tensor of per-token rows as the kernels' (rows, d, heads, batch) view: dense [B, S, H, d] as
// it is; packed [total, H, d] as one batch of `total` rows.
struct TensorRows {
  int rows;
  int batch;
  int64_t row_stride, head_stride, batch_stride;
};
inline TensorRows tensor_rows(const Tensor& t, bool packed, int rows, int batch) {
  if (packed) return {rows, 1, t.stride[0], t.stride[1], 0};
  return {rows, batch, t.stride[1], t.stride[2], t.stride[0]};
}

// The window, sink tokens and chunk of a forward or backward call (used by kLocal kernels).
template <class Params>
hopper::LocalMaskParams local_mask_params(const Params& p) {
  const detail::MaskSpec m = detail::mask_spec(p);
  return {m.window_left, m.window_right, m.num_sink_tokens, m.attention_chunk};
}

}  // namespace flashhopper::launch
