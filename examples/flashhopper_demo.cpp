// FlashHopper demo: runs the forward and the backward on an sm_90 GPU, checks them against the
// CPU reference and times them; without such a GPU it runs the CPU reference alone and says so.
//   flashhopper_demo [seqlen] [head_dim]
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "flashhopper/flashhopper.hpp"
#include "reference/reference.hpp"
#include "test_util.hpp"

#ifdef FLASHHOPPER_DEMO_WITH_CUDA
#include <cuda_runtime_api.h>

#include "device_memory.hpp"
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

// The tests' pass rule: the error against the exact (double) result must be at most twice that
// of a plain bf16 implementation, plus a tiny slack, and nothing may be NaN (or left poisoned).
struct Check {
  double err, plain_err;
  bool pass;
};
Check check_against(const Tensor& ours, const Tensor& exact, const Tensor& plain) {
  const double err = test::max_abs_diff(ours, exact);
  const double plain_err = test::max_abs_diff(plain, exact);
  return {err, plain_err, !test::has_nan(ours) && err <= 2 * plain_err + 1e-5};
}

// Milliseconds per call of `launch` (which returns a Status), over 20 calls after 3 warm-up calls.
template <class Launch>
bool time_calls(Launch launch, float* ms) {
  cudaEvent_t start, stop;
  if (cudaEventCreate(&start) != cudaSuccess || cudaEventCreate(&stop) != cudaSuccess) return false;
  constexpr int kIterations = 20;
  bool ok = true;
  for (int i = 0; i < 3 && ok; ++i) ok = launch().ok();
  ok = ok && cudaEventRecord(start) == cudaSuccess;
  for (int i = 0; i < kIterations && ok; ++i) ok = launch().ok();
  ok = ok && cudaEventRecord(stop) == cudaSuccess && cudaEventSynchronize(stop) == cudaSuccess &&
       cudaEventElapsedTime(ms, start, stop) == cudaSuccess;
  *ms /= kIterations;
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return ok;
}

int run_gpu(const Problem& pb) {
  const std::vector<int64_t> shape = {pb.batch, pb.seqlen, pb.heads, pb.head_dim};
  const std::vector<int64_t> lse_shape = {pb.batch, pb.heads, pb.seqlen};
  test::HostTensor q = test::random_tensor(FH_DTYPE_BF16, shape, 1);
  test::HostTensor k = test::random_tensor(FH_DTYPE_BF16, shape, 2);
  test::HostTensor v = test::random_tensor(FH_DTYPE_BF16, shape, 3);
  test::HostTensor dout = test::random_tensor(FH_DTYPE_BF16, shape, 4);
  test::HostTensor out(FH_DTYPE_BF16, shape), lse(FH_DTYPE_FP32, lse_shape);
  test::HostTensor dq(FH_DTYPE_BF16, shape), dk(FH_DTYPE_BF16, shape), dv(FH_DTYPE_BF16, shape);
  test::DeviceTensor d_q(q), d_k(k), d_v(v), d_dout(dout), d_out(out), d_lse(lse);
  test::DeviceTensor d_dq(dq), d_dk(dk), d_dv(dv);
  test::DeviceBuffer workspace;
  for (const test::DeviceTensor* t : {&d_q, &d_k, &d_v, &d_dout, &d_out, &d_lse, &d_dq, &d_dk, &d_dv}) {
    if (!t->ok()) {
      std::printf("device allocation failed: %s\n", cudaGetErrorString(cudaGetLastError()));
      return 1;
    }
  }
  DEMO_CUDA(d_q.upload(q));
  DEMO_CUDA(d_k.upload(k));
  DEMO_CUDA(d_v.upload(v));
  DEMO_CUDA(d_dout.upload(dout));

  int failures = 0;
  for (int causal = 0; causal <= 1; ++causal) {
    // Forward: O and LSE, checked against the CPU reference, then timed.
    ForwardParams fwd = default_forward_params();
    fwd.q = d_q.view();
    fwd.k = d_k.view();
    fwd.v = d_v.view();
    fwd.out = d_out.view();
    fwd.lse = d_lse.view();
    fwd.causal = causal;
    DEMO_CUDA(d_out.poison());  // unwritten elements read as NaN
    Status status = forward(fwd, nullptr, 0, nullptr);
    if (!status.ok()) {
      std::printf("forward failed: %s\n", status.message.c_str());
      return 1;
    }
    DEMO_CUDA(cudaDeviceSynchronize());
    DEMO_CUDA(d_out.download(out));
    DEMO_CUDA(d_lse.download(lse));

    ForwardParams host = fwd;
    host.q = q.view();
    host.k = k.view();
    host.v = v.view();
    host.lse = Tensor{};
    test::HostTensor exact(FH_DTYPE_FP64, shape), plain(FH_DTYPE_BF16, shape);
    host.out = exact.view();
    reference::Options lowp;
    lowp.emulate_low_precision = true;
    Status ref = reference::forward(host);
    host.out = plain.view();
    if (ref.ok()) ref = reference::forward(host, lowp);
    if (!ref.ok()) {
      std::printf("CPU reference failed: %s\n", ref.message.c_str());
      return 1;
    }
    const Check fwd_check = check_against(out.view(), exact.view(), plain.view());
    float ms = 0;
    if (!time_calls([&] { return forward(fwd, nullptr, 0, nullptr); }, &ms)) {
      std::printf("timing the forward failed\n");
      return 1;
    }
    std::printf("GPU forward  B=%d S=%d H=%d d=%d causal=%d: %.3f ms, %.0f TFLOP/s; max error %.2e "
                "(plain bf16 %.2e) %s\n",
                pb.batch, pb.seqlen, pb.heads, pb.head_dim, causal, ms, pb.flops(causal) / ms * 1e-9,
                fwd_check.err, fwd_check.plain_err, fwd_check.pass ? "PASS" : "FAIL");
    failures += !fwd_check.pass;

    // Backward from that O and LSE: dQ, dK, dV against the CPU reference's gradients, then timed
    // (2.5 times the forward's FLOPs, as FlashAttention counts them).
    BackwardParams bwd = default_backward_params();
    bwd.q = fwd.q;
    bwd.k = fwd.k;
    bwd.v = fwd.v;
    bwd.out = fwd.out;
    bwd.lse = fwd.lse;
    bwd.dout = d_dout.view();
    bwd.dq = d_dq.view();
    bwd.dk = d_dk.view();
    bwd.dv = d_dv.view();
    bwd.causal = causal;
    size_t needed = 0;
    status = workspace_size(bwd, &needed);
    if (!status.ok()) {
      std::printf("workspace_size failed: %s\n", status.message.c_str());
      return 1;
    }
    if (needed > workspace.bytes()) DEMO_CUDA(workspace.allocate(needed));
    for (test::DeviceTensor* grad : {&d_dq, &d_dk, &d_dv}) DEMO_CUDA(grad->poison());
    status = backward(bwd, workspace.data(), needed, nullptr);
    if (!status.ok()) {
      std::printf("backward failed: %s\n", status.message.c_str());
      return 1;
    }
    DEMO_CUDA(cudaDeviceSynchronize());
    DEMO_CUDA(d_dq.download(dq));
    DEMO_CUDA(d_dk.download(dk));
    DEMO_CUDA(d_dv.download(dv));

    BackwardParams host_bwd = bwd;
    host_bwd.q = q.view();
    host_bwd.k = k.view();
    host_bwd.v = v.view();
    host_bwd.dout = dout.view();
    host_bwd.out = out.view();  // not read: the reference recomputes the forward
    host_bwd.lse = lse.view();
    test::HostTensor exact_dq(FH_DTYPE_FP64, shape), exact_dk(FH_DTYPE_FP64, shape);
    test::HostTensor exact_dv(FH_DTYPE_FP64, shape), plain_dq(FH_DTYPE_BF16, shape);
    test::HostTensor plain_dk(FH_DTYPE_BF16, shape), plain_dv(FH_DTYPE_BF16, shape);
    host_bwd.dq = exact_dq.view();
    host_bwd.dk = exact_dk.view();
    host_bwd.dv = exact_dv.view();
    ref = reference::backward(host_bwd);
    host_bwd.dq = plain_dq.view();
    host_bwd.dk = plain_dk.view();
    host_bwd.dv = plain_dv.view();
    if (ref.ok()) ref = reference::backward(host_bwd, lowp);
    if (!ref.ok()) {
      std::printf("CPU reference backward failed: %s\n", ref.message.c_str());
      return 1;
    }
    const Check grads[3] = {check_against(dq.view(), exact_dq.view(), plain_dq.view()),
                            check_against(dk.view(), exact_dk.view(), plain_dk.view()),
                            check_against(dv.view(), exact_dv.view(), plain_dv.view())};
    const bool bwd_pass = grads[0].pass && grads[1].pass && grads[2].pass;
    if (!time_calls([&] { return backward(bwd, workspace.data(), needed, nullptr); }, &ms)) {
      std::printf("timing the backward failed\n");
      return 1;
    }
    std::printf("GPU backward B=%d S=%d H=%d d=%d causal=%d: %.3f ms, %.0f TFLOP/s; max error dq %.2e dk %.2e "
                "dv %.2e (plain bf16 %.2e %.2e %.2e) %s\n",
                pb.batch, pb.seqlen, pb.heads, pb.head_dim, causal, ms, 2.5 * pb.flops(causal) / ms * 1e-9,
                grads[0].err, grads[1].err, grads[2].err, grads[0].plain_err, grads[1].plain_err, grads[2].plain_err,
                bwd_pass ? "PASS" : "FAIL");
    failures += !bwd_pass;
  }
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
