// Helpers shared by the GPU tests (test_forward_gpu, test_backward_gpu): CUDA return-code checks,
// the sm_90 probe and the main() that exits 77 without one (device memory: device_memory.hpp), and
// inputs stored [B, S, H, D] or [B, H, S, D], and the grid case both tests parameterize over.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <sstream>
#include <string>
#include <utility>
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

// The masks and score transforms beyond causal: a window, sink tokens, chunks, softcap and a
// learnable sink (random logits, one a query head).
struct Features {
  int window_left = -1, window_right = -1;
  int num_sink_tokens = 0;
  int chunk = 0;
  float softcap = 0.f;
  bool learnable_sink = false;

  std::string tag() const {
    std::ostringstream s;
    if (window_left != -1 || window_right != -1)
      s << "_w" << (window_left < 0 ? "inf" : std::to_string(window_left)) << "x"
        << (window_right < 0 ? "inf" : std::to_string(window_right));
    if (num_sink_tokens > 0) s << "_sinks" << num_sink_tokens;
    if (chunk > 0) s << "_chunk" << chunk;
    if (softcap > 0) s << "_cap" << int(softcap);
    if (learnable_sink) s << "_lsink";
    return s.str();
  }
  template <class Params>
  void apply(Params& p) const {
    p.window_left = window_left;
    p.window_right = window_right;
    p.num_sink_tokens = num_sink_tokens;
    p.attention_chunk = chunk;
    p.softcap = softcap;
  }
};

// One problem of the GPU tests' grids; name() is the test's name.
struct GridCase {
  fh_dtype dtype;
  int head_dim;
  bool causal;
  int batch, seqlen_q, seqlen_k, heads_q, heads_kv;
  bool heads_major_layout;  // inputs stored as [B, H, S, D] and passed as a strided [B, S, H, D] view
  Features features{};
  // Outputs are views of tensors kGuardColumns wider, whose extra columns must stay poisoned
  // (the padded head dims: the kernels compute kHeadDim columns and must write only d).
  bool guard_columns = false;
  int head_dim_v = 0;  // v's, out's and dout's head dim; 0: head_dim
  int num_splits = 1;  // the forward's split-KV count (0: the library's choice)
  bool v_column_major = false;  // fp8: v stored [B, Hkv, dv, S], passed as a [B, S, Hkv, dv] view
  int value_dim() const { return head_dim_v > 0 ? head_dim_v : head_dim; }
  // A tensor of `dim` columns as the kernel writes it: with the guard columns.
  int output_columns(int dim) const;

  std::string name() const {
    std::ostringstream s;
    s << (dtype == FH_DTYPE_BF16 ? "bf16" : dtype == FH_DTYPE_FP16 ? "fp16" : "fp8") << "_d" << head_dim
      << (causal ? "_causal" : "_full") << "_b" << batch << "_sq" << seqlen_q << "_sk" << seqlen_k << "_h" << heads_q << "_hkv" << heads_kv
      << (heads_major_layout ? "_bhsd" : "") << (head_dim_v > 0 ? "_dv" + std::to_string(head_dim_v) : "")
      << features.tag() << (num_splits != 1 ? "_splits" + std::to_string(num_splits) : "")
      << (v_column_major ? "_vcolumns" : "");
    return s.str();
  }
};

inline constexpr int kGuardColumns = 8;
inline int GridCase::output_columns(int dim) const { return dim + (guard_columns ? kGuardColumns : 0); }

// Each family this build compiled for a pass (fh_compiled_families, from the kernel manifest):
// the grids run on these. head_dim_v is 0 where it equals head_dim (GridCase's convention).
struct FamilyDims {
  fh_dtype dtype;
  int head_dim, head_dim_v;
};
inline std::vector<FamilyDims> compiled_family_dims(bool backward) {
  std::vector<fh_kernel_family> families(size_t(fh_compiled_families(nullptr, 0)));
  fh_compiled_families(families.data(), int32_t(families.size()));
  std::vector<FamilyDims> out;
  for (const fh_kernel_family& f : families)
    if ((f.backward != 0) == backward)
      out.push_back({fh_dtype(f.dtype), f.head_dim, f.head_dim_v == f.head_dim ? 0 : f.head_dim_v});
  return out;
}
// The (dtype, head dim) of each compiled family whose value head dim is its head dim; the fp8 ones
// (forward only; no paged cache) where asked for.
inline std::vector<std::pair<fh_dtype, int>> compiled_families(bool backward, bool with_fp8 = false) {
  std::vector<std::pair<fh_dtype, int>> out;
  for (const FamilyDims& f : compiled_family_dims(backward))
    if (f.head_dim_v == 0 && (with_fp8 || f.dtype != FH_DTYPE_FP8_E4M3)) out.emplace_back(f.dtype, f.head_dim);
  return out;
}

// Head dims between the compiled ones, each run on the next compiled family of its dtype (so
// with the columns past d zero-filled on load and never stored): outputs carry guard columns.
// Cases: not causal and causal with sq > sk (rows that see no key), GQA and MQA, the [B, H, S, D]
// layout, a window with sink tokens, softcap and a learnable sink.
inline std::vector<GridCase> padded_head_dim_cases(bool backward) {
  const std::vector<std::pair<fh_dtype, int>> compiled = compiled_families(backward);
  std::vector<GridCase> cases;
  for (fh_dtype dtype : {FH_DTYPE_BF16, FH_DTYPE_FP16})
    for (int head_dim : {32, 40, 72, 80, 96, 112, 160, 192, 200, 224, 320, 392}) {
      bool exact = false, runs = false;
      for (const auto& [d_type, d] : compiled) {
        exact |= d_type == dtype && d == head_dim;
        runs |= d_type == dtype && d > head_dim;
      }
      if (exact || !runs) continue;  // the grids test it, or nothing in this build runs it
      cases.push_back({dtype, head_dim, false, 1, 113, 200, 4, 2, false, {}, true});
      cases.push_back({dtype, head_dim, true, 2, 1000, 513, 4, 1, false, {}, true});
      cases.push_back({dtype, head_dim, false, 1, 257, 1000, 2, 2, true, {}, true});
      cases.push_back({dtype, head_dim, false, 1, 600, 500, 4, 2, false, {100, 0, 2, 0, 20.f, true}, true});
    }
  // A value head dim other than the head dim (MLA's 192/128, and both ways; 64/256 and less as MLA's
  // latent values without qv, on 192/192 or 256/256; 64/512 and 320/128 on 512/512, the forward's),
  // run on a family that holds both.
  for (const auto& [d, dv] : std::vector<std::pair<int, int>>{
           {192, 128}, {128, 64}, {64, 128}, {96, 40}, {64, 256}, {64, 192}, {32, 160}, {64, 512}, {320, 128}})
    for (bool causal : {false, true}) {
      bool runs = false;
      for (const auto& [d_type, compiled_d] : compiled) runs |= d_type == FH_DTYPE_BF16 && compiled_d >= std::max(d, dv);
      if (runs) cases.push_back({FH_DTYPE_BF16, d, causal, 2, 300, 257, 4, 2, false, {}, true, dv});
    }
  return cases;
}

// fp8 descale factors [B, Hkv] in [0, 2), float32.
inline HostTensor make_descale_factors(int batch, int heads_kv, uint32_t seed) {
  HostTensor t = random_tensor(FH_DTYPE_FP32, {batch, heads_kv}, seed);
  float* x = static_cast<float*>(t.data());
  for (int i = 0; i < batch * heads_kv; ++i) x[i] = std::fmod(std::fabs(x[i]) * 1.7f, 2.f);
  return t;
}

// fp8's q/k/v_descale, each [B, Hkv] from make_descale_factors (seeds seed .. seed + 2), on the
// host and uploaded (make_descales, under ASSERT_NO_FATAL_FAILURE); set_descales points a call's
// three fields at one copy or the other.
struct Descales {
  std::vector<HostTensor> host;
  std::deque<DeviceTensor> device;  // not movable: a deque keeps them in place
};

inline void make_descales(int batch, int heads_kv, uint32_t seed, Descales* d) {
  for (uint32_t i = 0; i < 3; ++i) {
    d->host.push_back(make_descale_factors(batch, heads_kv, seed + i));
    d->device.emplace_back(d->host.back());
    ASSERT_TRUE(d->device.back().ok()) << "cudaMalloc failed";
    CUDA_CHECK(d->device.back().upload(d->host.back()));
  }
}

template <class Params>
void set_descales(Params& p, const Descales& d, bool on_device) {
  p.q_descale = on_device ? d.device[0].view() : d.host[0].view();
  p.k_descale = on_device ? d.device[1].view() : d.host[1].view();
  p.v_descale = on_device ? d.device[2].view() : d.host[2].view();
}

// Learnable-sink logits, one a query head, around the scores' own scale (so the sink matters).
inline HostTensor make_sink_logits(int heads_q, uint32_t seed) {
  HostTensor sink = random_tensor(FH_DTYPE_FP32, {heads_q}, seed);
  float* x = static_cast<float*>(sink.data());
  for (int h = 0; h < heads_q; ++h) x[h] = 2.f * x[h] + 1.f;
  return sink;
}

// The feature cases both GPU tests run, at every compiled family: each feature alone and
// combined, windows of 0, 1, wider than the sequence and asymmetric, sq != sk both ways, GQA,
// rows that see no key.
inline std::vector<GridCase> feature_cases(bool backward) {
  struct Row {
    bool causal;
    int batch, seqlen_q, seqlen_k, heads_q, heads_kv;
    Features f;
  };
  const std::vector<Row> rows = {
      {false, 2, 300, 300, 4, 2, {5, 3}},
      {false, 1, 113, 200, 2, 1, {0, 0}},
      {false, 1, 257, 1000, 2, 2, {1, 1}},
      {false, 1, 300, 200, 2, 2, {-1, 7}},
      {false, 2, 1000, 513, 4, 1, {70, 0, 4}},
      {false, 1, 200, 300, 2, 1, {1000, 2000}},
      {false, 1, 600, 600, 2, 2, {150, 40, 3}},
      {true, 1, 257, 1000, 2, 2, {-1, -1, 0, 100}},
      {false, 1, 333, 333, 3, 3, {-1, -1, 0, 128}},
      {false, 1, 500, 400, 2, 1, {90, 20, 0, 64}},
      {false, 1, 113, 200, 4, 2, {-1, -1, 0, 0, 30.f}},
      {true, 2, 1000, 513, 4, 1, {-1, -1, 0, 0, 30.f}},
      {false, 1, 400, 700, 4, 2, {64, 0, 0, 0, 5.f}},
      {false, 2, 300, 300, 4, 2, {-1, -1, 0, 0, 0.f, true}},
      {true, 1, 500, 300, 2, 1, {-1, -1, 0, 0, 0.f, true}},
      {false, 1, 600, 500, 4, 2, {100, 0, 2, 0, 20.f, true}},
  };
  std::vector<GridCase> cases;
  for (const FamilyDims& f : compiled_family_dims(backward))
    for (const Row& r : rows)
      cases.push_back({f.dtype, f.head_dim, r.causal, r.batch, r.seqlen_q, r.seqlen_k, r.heads_q, r.heads_kv, false, r.f,
                       false, f.head_dim_v});
  return cases;
}

// The pass rule for dsink (the backward tests): the plain implementation's error plus the error
// that the rounded out and float32 lse handed to the kernel carry by themselves (`given`: dsink
// from those inputs, in double), and the kernel's fixed-order float32 sum of those inputs within
// 1e-5 (relative) of `given`.
inline void expect_dsink_matches(const Tensor& ours, const Tensor& exact, const Tensor& plain,
                                 const std::vector<double>& given, double slack) {
  double input_err = 0, sum_err = 0, scale = 1;
  for (size_t h = 0; h < given.size(); ++h) {
    const std::vector<int64_t> at = {int64_t(h)};
    input_err = std::max(input_err, std::abs(given[h] - read(exact, at)));
    sum_err = std::max(sum_err, std::abs(read(ours, at) - given[h]));
    scale = std::max(scale, std::abs(given[h]));
  }
  const double err = max_abs_diff(ours, exact), plain_err = max_abs_diff(plain, exact);
  EXPECT_FALSE(has_nan(ours)) << "unwritten (poisoned) or NaN elements in dsink";
  EXPECT_LE(err, 2 * plain_err + input_err + slack)
      << "dsink: ours " << err << ", plain " << plain_err << ", from the rounded inputs " << input_err;
  EXPECT_LE(sum_err, 1e-5 * scale) << "dsink: the kernel's sum of its inputs is off by " << sum_err;
}

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
