// What every kernel launch shares: the device's SM count and L2 size (device_info.hpp), the
// shared-memory opt-in and the launch itself, and the mask's run-time parameters from a parameter
// struct.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <type_traits>

#include "plan/problem_shape.hpp"
#include "hopper/common/mask.hpp"
#include "launch/device_info.hpp"

namespace flashhopper::launch {

// CTAs a kernel's clusters hold (Kernel::kClusterM where it has one, else 1).
template <class Kernel, class = void>
inline constexpr int kClusterSizeOf = 1;
template <class Kernel>
inline constexpr int kClusterSizeOf<Kernel, std::void_t<decltype(Kernel::kClusterM)>> = Kernel::kClusterM;

// Opts the kernel into its shared memory (once per device: the attribute stays set, and setting
// it costs host time on every call) and launches it on `grid` CTAs. A kernel of clusters gets at
// most as many as can run at once (a persistent grid whose last clusters waited for the first
// would run twice as long), a whole number of clusters.
template <class Kernel, class Entry>
cudaError_t launch_kernel(Entry entry, int grid, typename Kernel::Params const& params, cudaStream_t stream) {
  constexpr int kSmemBytes = Kernel::kSharedStorageSize;
  constexpr int kCluster = kClusterSizeOf<Kernel>;
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
  if constexpr (kCluster == 1) {
    entry<<<grid, Kernel::kNumThreads, kSmemBytes, stream>>>(params);
    return cudaGetLastError();
  } else {
    static std::atomic<int> resident_clusters[64] = {};  // per device, 0 until asked
    cudaLaunchAttribute cluster;
    cluster.id = cudaLaunchAttributeClusterDimension;
    cluster.val.clusterDim.x = kCluster;
    cluster.val.clusterDim.y = 1;
    cluster.val.clusterDim.z = 1;
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(kCluster, 1, 1);
    config.blockDim = dim3(Kernel::kNumThreads, 1, 1);
    config.dynamicSmemBytes = kSmemBytes;
    config.stream = stream;
    config.attrs = &cluster;
    config.numAttrs = 1;
    int clusters = device < 64 ? resident_clusters[device].load(std::memory_order_relaxed) : 0;
    if (clusters == 0) {
      if ((err = cudaOccupancyMaxActiveClusters(&clusters, entry, &config)) != cudaSuccess) return err;
      if (clusters == 0) return cudaErrorInvalidConfiguration;  // no cluster of this kernel fits the device
      if (device < 64) resident_clusters[device].store(clusters, std::memory_order_relaxed);
    }
    config.gridDim.x = std::max(1, std::min(grid / kCluster, clusters)) * kCluster;
    return cudaLaunchKernelEx(&config, entry, params);
  }
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
