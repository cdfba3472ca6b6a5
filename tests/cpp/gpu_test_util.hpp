// Helpers shared by the GPU tests (test_forward_gpu, test_backward_gpu): CUDA return-code checks,
// the sm_90 probe and the main() that exits 77 without one (device memory: device_memory.hpp), and
// inputs stored [B, S, H, D] or [B, H, S, D], and the grid case both tests parameterize over.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <sstream>
#include <string>
#include <vector>

#include "device_memory.hpp"
#include "flashhopper/flashhopper.hpp"
#include "test_util.hpp"

#define CUDA_CHECK(expr)                                                       \
  do {                                                                         \
    cudaError_t err_ = (expr);                                                 \
    ASSERT_EQ(err_, cudaSuccess) << #expr << ": " << cudaGetErrorString(err_); \
  } while (0)

namespace flashhopper::test {

// One problem of the GPU tests' grids; name() is the test's name.
struct GridCase {
  fh_dtype dtype;
  int head_dim;
  bool causal;
  int batch, seqlen_q, seqlen_k, heads_q, heads_kv;
  bool heads_major_layout;  // inputs stored as [B, H, S, D] and passed as a strided [B, S, H, D] view

  std::string name() const {
    std::ostringstream s;
    s << (dtype == FH_DTYPE_BF16 ? "bf16" : "fp16") << "_d" << head_dim << (causal ? "_causal" : "_full") << "_b"
      << batch << "_sq" << seqlen_q << "_sk" << seqlen_k << "_h" << heads_q << "_hkv" << heads_kv
      << (heads_major_layout ? "_bhsd" : "");
    return s.str();
  }
};

inline bool sm90_available(std::string* why) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    cudaGetLastError();
    *why = "no CUDA device";
    return false;
  }
  int major = 0, minor = 0;
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0);
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, 0);
  if (major != 9 || minor != 0) {
    *why = "device 0 is sm_" + std::to_string(major * 10 + minor) + ", not sm_90";
    return false;
  }
  return true;
}

// Without an sm_90 GPU nothing in a GPU test can run: say so and exit with CTest's skip code (77).
inline int gpu_test_main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  std::string why;
  if (!sm90_available(&why)) {
    std::printf("GPU tests skipped: %s\n", why.c_str());
    return 77;
  }
  return RUN_ALL_TESTS();
}

// [B, S, H, D] tensor; with heads_major the storage is [B, H, S, D] and the view is permuted.
inline HostTensor make_input(fh_dtype dtype, int b, int s, int h, int d, bool heads_major, uint32_t seed) {
  if (!heads_major) return random_tensor(dtype, {b, s, h, d}, seed);
  return random_tensor(dtype, {b, h, s, d}, seed);
}
inline Tensor bshd_view(const HostTensor& t, bool heads_major) {
  return heads_major ? permute(t.view(), {0, 2, 1, 3}) : t.view();
}

}  // namespace flashhopper::test
