// The current device's SM count, L2 size and compute capability, as the launches, the dispatch's
// plans and the API's device check use them: queried once per device (they do not change while
// the process runs), as an attribute query on every call costs host time.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <mutex>
#include <string>

namespace flashhopper::launch {

struct DeviceInfo {
  int device = 0, num_sms = 0, l2_bytes = 0, cc_major = 0, cc_minor = 0;
};

inline cudaError_t current_device_info(DeviceInfo* info) {
  constexpr int kMaxDevices = 64;  // past it, every call queries
  static std::atomic<bool> known[kMaxDevices];
  static DeviceInfo cache[kMaxDevices];
  static std::mutex filling;
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  const bool cached = device >= 0 && device < kMaxDevices;
  if (cached && known[device].load(std::memory_order_acquire)) {
    *info = cache[device];
    return cudaSuccess;
  }
  DeviceInfo d;
  d.device = device;
  if ((err = cudaDeviceGetAttribute(&d.num_sms, cudaDevAttrMultiProcessorCount, device)) != cudaSuccess ||
      (err = cudaDeviceGetAttribute(&d.l2_bytes, cudaDevAttrL2CacheSize, device)) != cudaSuccess ||
      (err = cudaDeviceGetAttribute(&d.cc_major, cudaDevAttrComputeCapabilityMajor, device)) != cudaSuccess ||
      (err = cudaDeviceGetAttribute(&d.cc_minor, cudaDevAttrComputeCapabilityMinor, device)) != cudaSuccess)
    return err;
  if (cached) {
    std::lock_guard<std::mutex> lock(filling);
    if (!known[device].load(std::memory_order_relaxed)) {
      cache[device] = d;
      known[device].store(true, std::memory_order_release);
    }
  }
  *info = d;
  return cudaSuccess;
}

inline cudaError_t device_sms_and_l2(int* num_sms, int* l2_bytes) {
  DeviceInfo d;
  const cudaError_t err = current_device_info(&d);
  *num_sms = d.num_sms;
  *l2_bytes = d.l2_bytes;
  return err;
}

// The SMs a call's persistent kernels spread over: the device's less the caller's sm_margin (the
// dispatch refused a margin that leaves none: sm_margin_reason).
inline cudaError_t usable_sms_and_l2(int sm_margin, int* num_sms, int* l2_bytes) {
  const cudaError_t err = device_sms_and_l2(num_sms, l2_bytes);
  *num_sms = *num_sms > sm_margin ? *num_sms - sm_margin : 1;
  return err;
}

// Empty when sm_margin leaves the current device an SM (or the device cannot be asked: the launch
// reports that), else why not.
inline std::string sm_margin_reason(int sm_margin) {
  int num_sms = 0, l2_bytes = 0;
  if (sm_margin == 0 || device_sms_and_l2(&num_sms, &l2_bytes) != cudaSuccess || sm_margin < num_sms) return {};
  return "sm_margin " + std::to_string(sm_margin) + " leaves no SM of the device's " + std::to_string(num_sms) +
         " to the kernels";
}

}  // namespace flashhopper::launch
