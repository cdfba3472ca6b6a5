// One dense attention problem run on the GPU as training runs it: the forward (out, lse), then
// the deterministic backward from those outputs, results copied back to the host. For the tests
// that compare runs with each other (hostile values, concurrency) rather than with the reference.
// Errors come back as strings ("" on success) instead of test assertions, so the helper can run
// on any host thread.
#pragma once

#include <cuda_runtime_api.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "device_memory.hpp"
#include "flashhopper/flashhopper.hpp"
#include "gpu_test_util.hpp"
#include "test_util.hpp"

namespace flashhopper::test {

// The inputs: q, k, v, dout [B, S, H, d] (random normal unless a test sets them), the learnable
// sink when the case has one, and the scale (0: the default).
struct Problem {
  GridCase c;
  float softmax_scale = 0.f;
  HostTensor q, k, v, dout, sink;

  static Problem random(const GridCase& c, uint32_t seed) {
    Problem p;
    p.c = c;
    p.q = random_tensor(c.dtype, {c.batch, c.seqlen_q, c.heads_q, c.head_dim}, seed);
    p.k = random_tensor(c.dtype, {c.batch, c.seqlen_k, c.heads_kv, c.head_dim}, seed + 1);
    p.v = random_tensor(c.dtype, {c.batch, c.seqlen_k, c.heads_kv, c.value_dim()}, seed + 2);
    p.dout = random_tensor(c.dtype, {c.batch, c.seqlen_q, c.heads_q, c.value_dim()}, seed + 3);
    p.sink = make_sink_logits(c.heads_q, seed + 4);
    return p;
  }
};

// What a run produces, on the host (dq, dk, dv only when the backward ran).
struct Results {
  HostTensor out, lse, dq, dk, dv, dsink;
};

inline std::string cuda_failure(const char* what, cudaError_t err) {
  return err == cudaSuccess ? "" : std::string(what) + ": " + cudaGetErrorString(err);
}

// Device copies of a problem, its outputs and workspaces. prepare() allocates (and may
// synchronise the device); enqueue() then only enqueues work on its stream, so several runs can
// be in flight on several streams at once.
class AttentionRun {
 public:
  std::string prepare(const Problem& problem, bool with_backward) {
    with_backward_ = with_backward;
    const GridCase& c = problem.c;
    inputs_.clear();
    outputs_.clear();
    for (const HostTensor* t : {&problem.q, &problem.k, &problem.v, &problem.dout, &problem.sink})
      inputs_.push_back({t, nullptr});
    r_.out = HostTensor(c.dtype, {c.batch, c.seqlen_q, c.heads_q, c.value_dim()});
    r_.lse = HostTensor(FH_DTYPE_FP32, {c.batch, c.heads_q, c.seqlen_q});
    r_.dq = HostTensor(c.dtype, {c.batch, c.seqlen_q, c.heads_q, c.head_dim});
    r_.dk = HostTensor(c.dtype, {c.batch, c.seqlen_k, c.heads_kv, c.head_dim});
    r_.dv = HostTensor(c.dtype, {c.batch, c.seqlen_k, c.heads_kv, c.value_dim()});
    r_.dsink = HostTensor(FH_DTYPE_FP32, {c.heads_q});
    for (const HostTensor* t : {&r_.out, &r_.lse, &r_.dq, &r_.dk, &r_.dv, &r_.dsink}) outputs_.push_back({t, nullptr});
    for (auto* mirrors : {&inputs_, &outputs_})
      for (Mirror& m : *mirrors) {
        m.device = std::make_unique<DeviceTensor>(*m.host);
        if (!m.device->ok()) return "cudaMalloc failed";
      }
    auto input = [&](int i) { return inputs_[i].device->view(); };
    auto output = [&](int i) { return outputs_[i].device->view(); };

    fwd_ = default_forward_params();
    fwd_.q = input(0);
    fwd_.k = input(1);
    fwd_.v = input(2);
    fwd_.out = output(0);
    fwd_.lse = output(1);
    fwd_.causal = c.causal;
    fwd_.num_splits = c.num_splits;
    fwd_.softmax_scale = problem.softmax_scale;
    c.features.apply(fwd_);
    if (c.features.learnable_sink) fwd_.learnable_sink = input(4);

    bwd_ = default_backward_params();
    bwd_.q = fwd_.q;
    bwd_.k = fwd_.k;
    bwd_.v = fwd_.v;
    bwd_.out = fwd_.out;
    bwd_.lse = fwd_.lse;
    bwd_.dout = input(3);
    bwd_.dq = output(2);
    bwd_.dk = output(3);
    bwd_.dv = output(4);
    bwd_.causal = c.causal;
    bwd_.softmax_scale = problem.softmax_scale;
    bwd_.deterministic = 1;
    c.features.apply(bwd_);
    if (c.features.learnable_sink) {
      bwd_.learnable_sink = fwd_.learnable_sink;
      bwd_.dsink = output(5);
    }

    size_t bytes = 0;
    Status status = workspace_size(fwd_, &bytes);
    if (!status.ok()) return status.message;
    std::string err = cuda_failure("workspace", forward_workspace_.allocate(bytes));
    if (!err.empty() || !with_backward) return err;
    status = workspace_size(bwd_, &bytes);
    if (!status.ok()) return status.message;
    return cuda_failure("workspace", backward_workspace_.allocate(bytes));
  }

  // Uploads the inputs, poisons outputs and workspaces, runs the passes and downloads the
  // results, all on `stream`; the caller synchronises before reading results(). A refusal
  // (FH_ERROR_NOT_SUPPORTED: not in this build) comes back in *status with the message.
  std::string enqueue(cudaStream_t stream, Status* status) {
    *status = {};
    std::string err;
    for (const Mirror& m : inputs_)
      if (!(err = cuda_failure("upload", cudaMemcpyAsync(m.device->view().data, const_cast<HostTensor*>(m.host)->data(),
                                                         m.host->bytes(), cudaMemcpyHostToDevice, stream)))
               .empty())
        return err;
    for (const Mirror& m : outputs_)
      if (!(err = cuda_failure("poison", cudaMemsetAsync(m.device->view().data, 0xff, m.host->bytes(), stream))).empty())
        return err;
    for (DeviceBuffer* w : {&forward_workspace_, &backward_workspace_})
      if (w->bytes() > 0 && !(err = cuda_failure("poison", cudaMemsetAsync(w->data(), 0xff, w->bytes(), stream))).empty())
        return err;
    *status = forward(fwd_, forward_workspace_.data(), forward_workspace_.bytes(), stream);
    if (status->ok() && with_backward_)
      *status = backward(bwd_, backward_workspace_.data(), backward_workspace_.bytes(), stream);
    if (!status->ok()) return "";
    for (const Mirror& m : outputs_) {
      HostTensor* host = const_cast<HostTensor*>(m.host);  // outputs_ holds r_'s own tensors
      if (!(err = cuda_failure("download", cudaMemcpyAsync(host->data(), m.device->view().data, host->bytes(),
                                                           cudaMemcpyDeviceToHost, stream)))
               .empty())
        return err;
    }
    return cuda_failure("launch", cudaGetLastError());
  }

  const Results& results() const { return r_; }
  const ForwardParams& forward_params() const { return fwd_; }

 private:
  struct Mirror {
    const HostTensor* host;
    std::unique_ptr<DeviceTensor> device;
  };
  bool with_backward_ = true;
  Results r_;
  std::vector<Mirror> inputs_, outputs_;  // q, k, v, dout, sink; out, lse, dq, dk, dv, dsink
  ForwardParams fwd_{};
  BackwardParams bwd_{};
  DeviceBuffer forward_workspace_, backward_workspace_;
};

// Runs a problem on the default stream and waits: "" or what failed. *status carries a refusal.
inline std::string run_and_wait(const Problem& problem, bool with_backward, Results* results, Status* status) {
  AttentionRun run;
  std::string err = run.prepare(problem, with_backward);
  if (err.empty()) err = run.enqueue(nullptr, status);
  if (err.empty()) err = cuda_failure("synchronize", cudaDeviceSynchronize());
  if (err.empty()) *results = run.results();
  return err;
}

// Bit-for-bit equality of two host tensors' views (NaN payloads included).
inline bool bit_identical(const Tensor& a, const Tensor& b) {
  if (a.ndim != b.ndim || a.dtype != b.dtype) return false;
  for (int i = 0; i < a.ndim; ++i)
    if (a.shape[i] != b.shape[i]) return false;
  const size_t bytes = element_bytes(a.dtype);
  bool same = true;
  for_each_index(shape_of(a), [&](const std::vector<int64_t>& i) {
    same = same && std::memcmp(static_cast<const unsigned char*>(a.data) + element_offset(a, i) * bytes,
                               static_cast<const unsigned char*>(b.data) + element_offset(b, i) * bytes, bytes) == 0;
  });
  return same;
}

}  // namespace flashhopper::test
