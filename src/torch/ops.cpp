// The PyTorch ops flashhopper::fwd and flashhopper::bwd in C++, over the library's C ABI, through
// PyTorch's stable ABI (torch/csrc/stable). C++ registration is what lets AOTInductor's runtime
// call them (it cannot call an op implemented in Python), and the stable ABI is what lets one build
// of this file load into every PyTorch from 2.9 on (TORCH_TARGET_VERSION, set by CMake).
//
// Only the CUDA kernels live here. python/flashhopper/ops.py adds what the C++ side cannot: the
// fake (meta) functions, autograd, and the CPU kernels that refuse host tensors with the Python
// layer's messages. Semantics are those of the Python implementation in ops.py (its docstring):
// the same mask rules, output layouts and dout handling, so that both give bit-identical results.
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "flashhopper/flashhopper.h"
#include "op_schemas.inc"

namespace {

using torch::headeronly::ScalarType;
using torch::stable::Tensor;

// Messages start as the Python layer's do ("flashhopper (<status>): ..."), so that it can raise
// its own exception classes from them (ops.py: _raised_as).
[[noreturn]] void refuse(fh_status status, const std::string& message) {
  throw std::runtime_error(std::string("flashhopper (") + fh_status_name(status) + "): " + message);
}

void check(fh_status status) {
  if (status != FH_SUCCESS) refuse(status, fh_last_error());
}

void check_aoti(AOTITorchError error, const char* what) {
  if (error != AOTI_TORCH_SUCCESS) refuse(FH_ERROR_CUDA, std::string("PyTorch could not ") + what);
}

int32_t as_int32(const char* name, int64_t value) {
  if (value < std::numeric_limits<int32_t>::min() || value > std::numeric_limits<int32_t>::max()) {
    refuse(FH_ERROR_INVALID_ARGUMENT, std::string(name) + ": " + std::to_string(value) + " does not fit in int32");
  }
  return static_cast<int32_t>(value);
}

fh_tensor view(const char* name, const Tensor& t) {
  fh_tensor v{};
  switch (t.scalar_type()) {
    case ScalarType::BFloat16: v.dtype = FH_DTYPE_BF16; break;
    case ScalarType::Half: v.dtype = FH_DTYPE_FP16; break;
    case ScalarType::Float8_e4m3fn: v.dtype = FH_DTYPE_FP8_E4M3; break;
    case ScalarType::Float: v.dtype = FH_DTYPE_FP32; break;
    case ScalarType::Int: v.dtype = FH_DTYPE_INT32; break;
    default:
      refuse(FH_ERROR_INVALID_ARGUMENT,
             std::string(name) + ": dtype is not supported (bf16, fp16, float8_e4m3fn, float32, int32)");
  }
  const int64_t ndim = t.dim();
  if (ndim > FH_MAX_DIMS) {
    refuse(FH_ERROR_INVALID_ARGUMENT, std::string(name) + ": " + std::to_string(ndim) + " dims, at most 5");
  }
  v.data = t.data_ptr();
  v.ndim = static_cast<int32_t>(ndim);
  for (int64_t d = 0; d < ndim; ++d) {
    v.shape[d] = t.size(d);
    v.stride[d] = t.stride(d);
  }
  return v;
}

void set(fh_tensor& field, const char* name, const std::optional<Tensor>& t) {
  if (t.has_value()) field = view(name, *t);
}

std::vector<int64_t> shape_of(const Tensor& t) {
  std::vector<int64_t> shape;
  for (int64_t d = 0; d < t.dim(); ++d) shape.push_back(t.size(d));
  return shape;
}

// The input tensor fields both parameter structs share.
template <typename Params>
void set_inputs(Params& p, const Tensor& q, const Tensor& k, const Tensor& v,
                const std::optional<Tensor>& learnable_sink, const std::optional<Tensor>& cu_seqlens_q,
                const std::optional<Tensor>& cu_seqlens_k, const std::optional<Tensor>& seqused_q,
                const std::optional<Tensor>& seqused_k) {
  p.q = view("q", q);
  p.k = view("k", k);
  p.v = view("v", v);
  set(p.learnable_sink, "learnable_sink", learnable_sink);
  set(p.cu_seqlens_q, "cu_seqlens_q", cu_seqlens_q);
  set(p.cu_seqlens_k, "cu_seqlens_k", cu_seqlens_k);
  set(p.seqused_q, "seqused_q", seqused_q);
  set(p.seqused_k, "seqused_k", seqused_k);
}

// The launch: on the tensors' device, on PyTorch's current stream of it, with the workspace from
// PyTorch's caching allocator.
class OnDevice {
 public:
  explicit OnDevice(const Tensor& t) : index_(t.get_device_index()) {
    check_aoti(aoti_torch_create_cuda_guard(index_, &guard_), "set the CUDA device");
  }
  ~OnDevice() { aoti_torch_delete_cuda_guard(guard_); }
  OnDevice(const OnDevice&) = delete;
  OnDevice& operator=(const OnDevice&) = delete;

  fh_stream_t stream() const {
    void* stream = nullptr;
    check_aoti(aoti_torch_get_current_cuda_stream(index_, &stream), "get the current CUDA stream");
    return static_cast<fh_stream_t>(stream);
  }

 private:
  int32_t index_;
  CUDAGuardHandle guard_ = nullptr;
};

// The call with its workspace of `bytes` (the library's workspace query, which checks every
// argument, ran on the call before its outputs were allocated: under `on`, since the size depends
// on the device, not on the outputs' addresses).
template <typename Params, typename RunFn>
void launch(const Params& params, const Tensor& like, const OnDevice& on, size_t bytes, RunFn run) {
  std::optional<Tensor> workspace;
  if (bytes > 0) workspace = torch::stable::new_empty(like, {static_cast<int64_t>(bytes)}, ScalarType::Byte);
  check(run(&params, workspace ? workspace->data_ptr() : nullptr, bytes, on.stream()));
}

// softmax_scale as the C ABI's float; its range is the library's rule. 0 is refused here: the C
// ABI reads it as 1/sqrt(head_dim), the ops' callers mean None by that.
float library_scale(const std::optional<double>& softmax_scale) {
  if (!softmax_scale.has_value()) return 0.0f;  // the C ABI's 0: 1/sqrt(head_dim)
  const double s = *softmax_scale;
  if (s == 0) refuse(FH_ERROR_NOT_SUPPORTED, "softmax_scale: 0.0 is not supported; pass None for the default");
  return static_cast<float>(s);
}

// The ops' packed layout packs q and k alike (the C ABI also takes one side packed alone; the
// ops' callers do not), as the Python package's Varlen.
void check_packed_pair(const std::optional<Tensor>& cu_seqlens_q, const std::optional<Tensor>& cu_seqlens_k) {
  if (cu_seqlens_q.has_value() == cu_seqlens_k.has_value()) return;
  refuse(FH_ERROR_INVALID_ARGUMENT, std::string(cu_seqlens_q ? "cu_seqlens_k" : "cu_seqlens_q") +
                                        ": is required in the packed layout (with cu_seqlens_q, cu_seqlens_k, "
                                        "max_seqlen_q or max_seqlen_k given), which packs q and k alike");
}

// A view for an output the op has not allocated yet, contiguous, at a stand-in address (aligned,
// never dereferenced): the library's check reads no data, so the arguments are checked before
// anything is allocated.
fh_tensor stand_in(int32_t index, int32_t dtype, const std::vector<int64_t>& shape) {
  fh_tensor v{};
  v.data = reinterpret_cast<void*>(static_cast<uintptr_t>(index + 1) << 40);
  v.dtype = dtype;
  v.ndim = static_cast<int32_t>(shape.size());
  int64_t step = 1;
  for (int32_t d = v.ndim - 1; d >= 0; --d) {
    v.shape[d] = shape[d];
    v.stride[d] = step;
    step *= std::max<int64_t>(shape[d], 1);
  }
  return v;
}

// The mask fields both parameter structs share, by FlashAttention-3's rules (fh_window_from_fa3,
// which the Python package calls too), judged against the call's lengths (max_seqlen in the
// packed layout).
template <typename Params>
void set_mask(Params& p, bool causal, int64_t left, int64_t right, double softcap, int64_t chunk,
              const Tensor& q, const Tensor& k, bool varlen, const std::optional<int64_t>& max_seqlen_q,
              const std::optional<int64_t>& max_seqlen_k) {
  int64_t seqlen_q = 0, seqlen_k = 0;
  if (varlen) {  // an absent max_seqlen is the C ABI's 0, which the library refuses by name
    seqlen_q = max_seqlen_q.value_or(0);
    seqlen_k = max_seqlen_k.value_or(0);
    p.max_seqlen_q = as_int32("max_seqlen_q", seqlen_q);
    p.max_seqlen_k = as_int32("max_seqlen_k", seqlen_k);
  } else if (q.dim() == 4 && k.dim() == 4) {
    seqlen_q = q.size(1);
    seqlen_k = k.size(1);
  }
  int32_t resolved_causal = 0;
  fh_window_from_fa3(causal ? 1 : 0, left, right, seqlen_q, seqlen_k, &resolved_causal, &left, &right);
  p.causal = resolved_causal;
  p.window_left = as_int32("window_left", left);
  p.window_right = as_int32("window_right", right);
  // The C ABI takes a float32 and refuses what is not finite; a positive softcap that rounds to 0
  // there would turn the cap off (as interface.check_softcap refuses it).
  p.softcap = static_cast<float>(softcap);
  if (softcap > 0 && p.softcap == 0.f) {
    refuse(FH_ERROR_INVALID_ARGUMENT, "softcap: " + std::to_string(softcap) +
                                          " rounds to 0 in float32 (the C ABI's type), which would turn the cap "
                                          "off; pass 0.0 for no cap");
  }
  p.attention_chunk = as_int32("attention_chunk", chunk);
}

// The output shapes the fake functions in ops.py give: out like q with v's head dim, lse [B, Hq, sq]
// (dense) or [Hq, total_q] (packed). Where q's or v's rank allows neither, a placeholder of one
// element: the library's check refuses q or v first.
std::vector<int64_t> out_shape(const Tensor& q, const Tensor& v) {
  if (q.dim() < 1 || v.dim() < 1) return {1};
  std::vector<int64_t> shape;
  for (int64_t d = 0; d + 1 < q.dim(); ++d) shape.push_back(q.size(d));
  shape.push_back(v.size(v.dim() - 1));
  return shape;
}

std::vector<int64_t> lse_shape(const Tensor& q) {
  if (q.dim() == 4) return {q.size(0), q.size(2), q.size(1)};
  if (q.dim() == 3) return {q.size(1), q.size(0)};
  return {1};
}

// dout as the kernels take it (ops.py's _normalize_dout): last dim contiguous, other strides
// multiples of 16 bytes and none 0 on a dim of more than one element, data 16-byte aligned;
// otherwise a contiguous copy (autograd may hand over an expanded or unaligned one).
Tensor kernel_ready(const Tensor& dout) {
  if (dout.dim() < 1) return dout;  // the library's check refuses its rank
  const int64_t granule = 16 / static_cast<int64_t>(dout.element_size());
  bool ok = dout.stride(dout.dim() - 1) == 1 && reinterpret_cast<uintptr_t>(dout.data_ptr()) % 16 == 0;
  for (int64_t d = 0; ok && d + 1 < dout.dim(); ++d) {
    ok = dout.stride(d) % granule == 0 && (dout.stride(d) != 0 || dout.size(d) <= 1);
  }
  if (ok) return dout;
  std::vector<int64_t> sizes;
  for (int64_t d = 0; d < dout.dim(); ++d) sizes.push_back(dout.size(d));
  Tensor copy = torch::stable::new_empty(dout, sizes);
  torch::stable::copy_(copy, dout);
  return copy;
}

std::tuple<Tensor, Tensor> forward(Tensor q, Tensor k, Tensor v, std::optional<double> softmax_scale, bool causal,
                                   bool /*deterministic: autograd's, for bwd*/, int64_t window_left,
                                   int64_t window_right, double softcap, int64_t attention_chunk,
                                   std::optional<Tensor> learnable_sink, std::optional<Tensor> cu_seqlens_q,
                                   std::optional<Tensor> cu_seqlens_k, std::optional<int64_t> max_seqlen_q,
                                   std::optional<int64_t> max_seqlen_k, std::optional<Tensor> seqused_q,
                                   std::optional<Tensor> seqused_k, int64_t num_splits, int64_t sm_margin,
                                   std::optional<Tensor> q_descale, std::optional<Tensor> k_descale,
                                   std::optional<Tensor> v_descale) {
  check_packed_pair(cu_seqlens_q, cu_seqlens_k);
  const bool varlen = cu_seqlens_q.has_value();
  fh_forward_params p;
  fh_forward_params_init(&p);
  set_inputs(p, q, k, v, learnable_sink, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k);
  set(p.q_descale, "q_descale", q_descale);
  set(p.k_descale, "k_descale", k_descale);
  set(p.v_descale, "v_descale", v_descale);
  // fp8 inputs give a bf16 out (the library's rule; interface.output_dtype in Python).
  const bool fp8 = p.q.dtype == FH_DTYPE_FP8_E4M3;
  p.out = stand_in(0, fp8 ? FH_DTYPE_BF16 : p.q.dtype, out_shape(q, v));
  p.lse = stand_in(1, FH_DTYPE_FP32, lse_shape(q));
  p.softmax_scale = library_scale(softmax_scale);
  set_mask(p, causal, window_left, window_right, softcap, attention_chunk, q, k, varlen, max_seqlen_q,
           max_seqlen_k);
  p.num_splits = as_int32("num_splits", num_splits);
  p.sm_margin = as_int32("sm_margin", sm_margin);
  OnDevice on(q);
  size_t bytes = 0;
  check(fh_forward_workspace_size(&p, &bytes));  // the library's check, before anything is allocated
  Tensor out = fp8 ? torch::stable::new_empty(q, out_shape(q, v), ScalarType::BFloat16)
                   : torch::stable::new_empty(q, out_shape(q, v));
  Tensor lse = torch::stable::new_empty(q, lse_shape(q), ScalarType::Float);
  p.out = view("out", out);
  p.lse = view("lse", lse);
  launch(p, q, on, bytes, fh_forward);
  return {out, lse};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> backward(
    Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, std::optional<double> softmax_scale,
    bool causal, bool deterministic, int64_t window_left, int64_t window_right, double softcap,
    int64_t attention_chunk, std::optional<Tensor> learnable_sink, std::optional<Tensor> cu_seqlens_q,
    std::optional<Tensor> cu_seqlens_k, std::optional<int64_t> max_seqlen_q, std::optional<int64_t> max_seqlen_k,
    std::optional<Tensor> seqused_q, std::optional<Tensor> seqused_k, int64_t sm_margin) {
  check_packed_pair(cu_seqlens_q, cu_seqlens_k);
  const bool varlen = cu_seqlens_q.has_value();
  dout = kernel_ready(dout);
  fh_backward_params p;
  fh_backward_params_init(&p);
  set_inputs(p, q, k, v, learnable_sink, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k);
  p.out = view("out", out);
  p.lse = view("lse", lse);
  p.dout = view("dout", dout);
  // the gradients as empty_like would give them, at stand-in addresses until the check passes
  p.dq = stand_in(0, p.q.dtype, shape_of(q));
  p.dk = stand_in(1, p.k.dtype, shape_of(k));
  p.dv = stand_in(2, p.v.dtype, shape_of(v));
  const int64_t sink_size = learnable_sink.has_value() && q.dim() >= 2 ? q.size(q.dim() - 2) : 0;
  if (learnable_sink.has_value()) p.dsink = stand_in(3, FH_DTYPE_FP32, {std::max<int64_t>(sink_size, 1)});
  p.softmax_scale = library_scale(softmax_scale);
  p.deterministic = deterministic ? 1 : 0;
  p.sm_margin = as_int32("sm_margin", sm_margin);
  set_mask(p, causal, window_left, window_right, softcap, attention_chunk, q, k, varlen, max_seqlen_q,
           max_seqlen_k);
  OnDevice on(q);
  size_t bytes = 0;
  check(fh_backward_workspace_size(&p, &bytes));  // the library's check, before anything is allocated
  Tensor dq = torch::stable::empty_like(q);
  Tensor dk = torch::stable::empty_like(k);
  Tensor dv = torch::stable::empty_like(v);
  // the library writes every element of dsink (a fixed-order sum of per-CTA shares): no zero fill
  Tensor dsink = torch::stable::new_empty(q, {sink_size}, ScalarType::Float);
  p.dq = view("dq", dq);
  p.dk = view("dk", dk);
  p.dv = view("dv", dv);
  if (learnable_sink.has_value()) p.dsink = view("dsink", dsink);
  launch(p, q, on, bytes, fh_backward);
  return {dq, dk, dv, dsink};
}

}  // namespace

// The schemas' one home is python/flashhopper/op_schemas.py (ops.py defines the Python ops from it
// where these are not loaded); op_schemas.inc is generated from it.
STABLE_TORCH_LIBRARY(flashhopper, m) {
  m.def(kFwdSchema);
  m.def(kBwdSchema);
}

STABLE_TORCH_LIBRARY_IMPL(flashhopper, CUDA, m) {
  m.impl("fwd", TORCH_BOX(&forward));
  m.impl("bwd", TORCH_BOX(&backward));
}
