// FlashHopper demo: runs the forward on an sm_90 GPU, checks it against the CPU reference and
// times it; without such a GPU it runs the CPU reference alone and says so.
//   flashhopper_demo [seqlen] [head_dim]
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "flashhopper/flashhopper.hpp"
#include "reference/reference.hpp"
#include "test_util.hpp"

#ifdef FLASHHOPPER_DEMO_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

using namespace flashhopper;

namespace {

struct Problem {
  int batch = 2, seqlen = 1024, heads = 8, head_dim = 128;
  double flops(bool causal) const {
    return 4.0 * batch * heads * double(seqlen) * seqlen * head_dim * (causal ? 0.5 : 1.0);
  }
};

int run_cpu_only(const Problem& pb, const std::string& why) {
  std::printf("No sm_90 GPU (%s): running the CPU reference only.\n", why.c_str());
  test::HostTensor q = test::random_tensor(FH_DTYPE_BF16, {pb.batch, pb.seqlen, pb.heads, pb.head_dim}, 1);
  test::HostTensor k = test::random_tensor(FH_DTYPE_BF16, {pb.batch, pb.seqlen, pb.heads, pb.head_dim}, 2);
  test::HostTensor v = test::random_tensor(FH_DTYPE_BF16, {pb.batch, pb.seqlen, pb.heads, pb.head_dim}, 3);
  test::HostTensor out(FH_DTYPE_FP32, {pb.batch, pb.seqlen, pb.heads, pb.head_dim});
  test::HostTensor lse(FH_DTYPE_FP32, {pb.batch, pb.heads, pb.seqlen});
  ForwardParams p = default_forward_params();
  p.q = q.view();
  p.k = k.view();
  p.v = v.view();
  p.out = out.view();
  p.lse = lse.view();
  for (int causal = 0; causal <= 1; ++causal) {
    p.causal = causal;
    const auto start = std::chrono::steady_clock::now();
    const Status status = reference::forward(p);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (!status.ok()) {
      std::printf("reference failed: %s\n", status.message.c_str());
      return 1;
    }
    std::printf("CPU reference  B=%d S=%d H=%d d=%d causal=%d: %.2f s (%.2f GFLOP/s), lse[0]=%.4f\n", pb.batch,
                pb.seqlen, pb.heads, pb.head_dim, causal, seconds, pb.flops(causal) / seconds * 1e-9,
                lse.get({0, 0, 0}));
  }
  test::HostTensor out_bf16(FH_DTYPE_BF16, {pb.batch, pb.seqlen, pb.heads, pb.head_dim});
  p.out = out_bf16.view();  // the kernels write the input dtype
  p.lse = Tensor{};
  const Status status = forward(p, nullptr, 0, nullptr);
  std::printf("GPU forward on this machine: refused as expected (%s)\n", status.message.c_str());
  return status.ok() ? 1 : 0;
}

#ifdef FLASHHOPPER_DEMO_WITH_CUDA
bool sm90_present(std::string* why) {
  int count = 0, major = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    *why = "no CUDA device";
    return false;
  }
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0);
  if (major != 9) {
    *why = "device 0 is not sm_90";
    return false;
  }
  return true;
}

#define DEMO_CUDA(expr)                                                              \
  do {                                                                               \
    cudaError_t err_ = (expr);                                                       \
    if (err_ != cudaSuccess) {                                                       \
      std::printf("%s failed: %s\n", #expr, cudaGetErrorString(err_));               \
      return 1;                                                                      \
    }                                                                                \
  } while (0)

int run_gpu(const Problem& pb) {
  const std::vector<int64_t> shape = {pb.batch, pb.seqlen, pb.heads, pb.head_dim};
  test::HostTensor q = test::random_tensor(FH_DTYPE_BF16, shape, 1);
  test::HostTensor k = test::random_tensor(FH_DTYPE_BF16, shape, 2);
  test::HostTensor v = test::random_tensor(FH_DTYPE_BF16, shape, 3);
  test::HostTensor out(FH_DTYPE_BF16, shape);
  const size_t bytes = q.bytes();
  void *d_q, *d_k, *d_v, *d_out;
  DEMO_CUDA(cudaMalloc(&d_q, bytes));
  DEMO_CUDA(cudaMalloc(&d_k, bytes));
  DEMO_CUDA(cudaMalloc(&d_v, bytes));
  DEMO_CUDA(cudaMalloc(&d_out, bytes));
  DEMO_CUDA(cudaMemcpy(d_q, q.data(), bytes, cudaMemcpyHostToDevice));
  DEMO_CUDA(cudaMemcpy(d_k, k.data(), bytes, cudaMemcpyHostToDevice));
  DEMO_CUDA(cudaMemcpy(d_v, v.data(), bytes, cudaMemcpyHostToDevice));
  cudaEvent_t start, stop;
  DEMO_CUDA(cudaEventCreate(&start));
  DEMO_CUDA(cudaEventCreate(&stop));
  int failures = 0;
  for (int causal = 0; causal <= 1; ++causal) {
    ForwardParams p = default_forward_params();
    p.q = make_tensor(d_q, FH_DTYPE_BF16, {pb.batch, pb.seqlen, pb.heads, pb.head_dim});
    p.k = make_tensor(d_k, FH_DTYPE_BF16, {pb.batch, pb.seqlen, pb.heads, pb.head_dim});
    p.v = make_tensor(d_v, FH_DTYPE_BF16, {pb.batch, pb.seqlen, pb.heads, pb.head_dim});
    p.out = make_tensor(d_out, FH_DTYPE_BF16, {pb.batch, pb.seqlen, pb.heads, pb.head_dim});
    p.causal = causal;
    DEMO_CUDA(cudaMemset(d_out, 0xff, bytes));
    Status status = forward(p, nullptr, 0, nullptr);
    if (!status.ok()) {
      std::printf("forward failed: %s\n", status.message.c_str());
      return 1;
    }
    DEMO_CUDA(cudaDeviceSynchronize());
    DEMO_CUDA(cudaMemcpy(out.data(), d_out, bytes, cudaMemcpyDeviceToHost));

    ForwardParams host = p;
    host.q = q.view();
    host.k = k.view();
    host.v = v.view();
    test::HostTensor exact(FH_DTYPE_FP64, shape), plain(FH_DTYPE_BF16, shape);
    host.out = exact.view();
    reference::forward(host);
    host.out = plain.view();
    reference::Options lowp;
    lowp.emulate_low_precision = true;
    reference::forward(host, lowp);
    const double err = test::max_abs_diff(out.view(), exact.view());
    const double plain_err = test::max_abs_diff(plain.view(), exact.view());
    const bool pass = err <= 2 * plain_err + 1e-5;
    failures += !pass;

    const int iterations = 20;
    for (int i = 0; i < 3; ++i) forward(p, nullptr, 0, nullptr);
    DEMO_CUDA(cudaEventRecord(start));
    for (int i = 0; i < iterations; ++i) forward(p, nullptr, 0, nullptr);
    DEMO_CUDA(cudaEventRecord(stop));
    DEMO_CUDA(cudaEventSynchronize(stop));
    float ms = 0;
    DEMO_CUDA(cudaEventElapsedTime(&ms, start, stop));
    ms /= iterations;
    std::printf("GPU forward  B=%d S=%d H=%d d=%d causal=%d: %.3f ms, %.0f TFLOP/s; max error %.2e "
                "(plain bf16 %.2e) %s\n",
                pb.batch, pb.seqlen, pb.heads, pb.head_dim, causal, ms, pb.flops(causal) / ms * 1e-9, err,
                plain_err, pass ? "PASS" : "FAIL");
  }
  cudaFree(d_q);
  cudaFree(d_k);
  cudaFree(d_v);
  cudaFree(d_out);
  return failures == 0 ? 0 : 1;
}
#endif

}  // namespace

int main(int argc, char** argv) {
  Problem pb;
  if (argc > 1) pb.seqlen = std::atoi(argv[1]);
  if (argc > 2) pb.head_dim = std::atoi(argv[2]);
  std::string why = "this build has no CUDA kernels";
#ifdef FLASHHOPPER_DEMO_WITH_CUDA
  if (sm90_present(&why)) return run_gpu(pb);
#endif
  return run_cpu_only(pb, why);
}
