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

// Device copies of host tensors and output buffers, freed together.
struct DeviceBuffers {
  std::vector<void*> owned;
  ~DeviceBuffers() {
    for (void* p : owned) cudaFree(p);
  }
  void* alloc(size_t bytes) {
    void* p = nullptr;
    if (cudaMalloc(&p, bytes) != cudaSuccess) return nullptr;
    owned.push_back(p);
    return p;
  }
  void* upload(test::HostTensor& t) {
    void* p = alloc(t.bytes());
    if (p && cudaMemcpy(p, t.data(), t.bytes(), cudaMemcpyHostToDevice) != cudaSuccess) return nullptr;
    return p;
  }
};

int run_gpu(const Problem& pb) {
  const std::vector<int64_t> shape = {pb.batch, pb.seqlen, pb.heads, pb.head_dim};
  const std::vector<int64_t> lse_shape = {pb.batch, pb.heads, pb.seqlen};
  test::HostTensor q = test::random_tensor(FH_DTYPE_BF16, shape, 1);
  test::HostTensor k = test::random_tensor(FH_DTYPE_BF16, shape, 2);
  test::HostTensor v = test::random_tensor(FH_DTYPE_BF16, shape, 3);
  test::HostTensor dout = test::random_tensor(FH_DTYPE_BF16, shape, 4);
  test::HostTensor out(FH_DTYPE_BF16, shape), lse(FH_DTYPE_FP32, lse_shape);
  test::HostTensor dq(FH_DTYPE_BF16, shape), dk(FH_DTYPE_BF16, shape), dv(FH_DTYPE_BF16, shape);
  const size_t bytes = q.bytes();
  DeviceBuffers device;
  void* d_q = device.upload(q);
  void* d_k = device.upload(k);
  void* d_v = device.upload(v);
  void* d_dout = device.upload(dout);
  void* d_out = device.alloc(bytes);
  void* d_lse = device.alloc(lse.bytes());
  void* d_dq = device.alloc(bytes);
  void* d_dk = device.alloc(bytes);
  void* d_dv = device.alloc(bytes);
  if (!d_q || !d_k || !d_v || !d_dout || !d_out || !d_lse || !d_dq || !d_dk || !d_dv) {
    std::printf("device allocation or copy failed: %s\n", cudaGetErrorString(cudaGetLastError()));
    return 1;
  }
  auto on_device = [](void* data, DType dtype, const std::vector<int64_t>& s) {
    return s.size() == 3 ? make_tensor(data, dtype, {s[0], s[1], s[2]})
                         : make_tensor(data, dtype, {s[0], s[1], s[2], s[3]});
  };
  void* workspace = nullptr;
  size_t workspace_bytes = 0;

  int failures = 0;
  for (int causal = 0; causal <= 1; ++causal) {
    // Forward: O and LSE, checked against the CPU reference, then timed.
    ForwardParams fwd = default_forward_params();
    fwd.q = on_device(d_q, FH_DTYPE_BF16, shape);
    fwd.k = on_device(d_k, FH_DTYPE_BF16, shape);
    fwd.v = on_device(d_v, FH_DTYPE_BF16, shape);
    fwd.out = on_device(d_out, FH_DTYPE_BF16, shape);
    fwd.lse = on_device(d_lse, FH_DTYPE_FP32, lse_shape);
    fwd.causal = causal;
    DEMO_CUDA(cudaMemset(d_out, 0xff, bytes));  // poison: unwritten elements read as NaN
    Status status = forward(fwd, nullptr, 0, nullptr);
    if (!status.ok()) {
      std::printf("forward failed: %s\n", status.message.c_str());
      return 1;
    }
    DEMO_CUDA(cudaDeviceSynchronize());
    DEMO_CUDA(cudaMemcpy(out.data(), d_out, bytes, cudaMemcpyDeviceToHost));
    DEMO_CUDA(cudaMemcpy(lse.data(), d_lse, lse.bytes(), cudaMemcpyDeviceToHost));

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
    bwd.dout = on_device(d_dout, FH_DTYPE_BF16, shape);
    bwd.dq = on_device(d_dq, FH_DTYPE_BF16, shape);
    bwd.dk = on_device(d_dk, FH_DTYPE_BF16, shape);
    bwd.dv = on_device(d_dv, FH_DTYPE_BF16, shape);
    bwd.causal = causal;
    size_t needed = 0;
    status = workspace_size(bwd, &needed);
    if (!status.ok()) {
      std::printf("workspace_size failed: %s\n", status.message.c_str());
      return 1;
    }
    if (needed > workspace_bytes) {
      workspace = device.alloc(needed);
      workspace_bytes = needed;
      if (!workspace) {
        std::printf("workspace allocation (%zu bytes) failed\n", needed);
        return 1;
      }
    }
    for (void* grad : {d_dq, d_dk, d_dv}) DEMO_CUDA(cudaMemset(grad, 0xff, bytes));
    status = backward(bwd, workspace, workspace_bytes, nullptr);
    if (!status.ok()) {
      std::printf("backward failed: %s\n", status.message.c_str());
      return 1;
    }
    DEMO_CUDA(cudaDeviceSynchronize());
    DEMO_CUDA(cudaMemcpy(dq.data(), d_dq, bytes, cudaMemcpyDeviceToHost));
    DEMO_CUDA(cudaMemcpy(dk.data(), d_dk, bytes, cudaMemcpyDeviceToHost));
    DEMO_CUDA(cudaMemcpy(dv.data(), d_dv, bytes, cudaMemcpyDeviceToHost));

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
    if (!time_calls([&] { return backward(bwd, workspace, workspace_bytes, nullptr); }, &ms)) {
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
