// The C++ entry points: check the arguments, ask whether this build can run them, check the
// device and workspace, then launch. Every refusal happens here, before anything is enqueued.
#include <string>

#include "plan/problem_shape.hpp"
#include "api/validate.hpp"
#include "flashhopper/flashhopper.hpp"

#ifdef FLASHHOPPER_WITH_CUDA
#include <cuda.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <mutex>

#include "launch/device_info.hpp"
#include "launch/launch.hpp"
#endif

namespace flashhopper {
namespace {

Status error(fh_status code, std::string message) { return Status{code, std::move(message)}; }

#ifdef FLASHHOPPER_WITH_CUDA
Status cuda_error(const char* what, cudaError_t err) {
  return error(FH_ERROR_CUDA, std::string(what) + ": " + cudaGetErrorName(err) + " (" +
                                  cudaGetErrorString(err) + ")");
}

// The current device must be an sm_90 GPU (the kernels are built for sm_90a only).
Status check_device() {
  launch::DeviceInfo device;
  const cudaError_t err = launch::current_device_info(&device);
  if (err != cudaSuccess) {
    cudaGetLastError();  // clear, so the caller's next CUDA call does not see our failure
    // Without an NVIDIA driver the runtime answers "driver version is insufficient": say what that
    // usually means rather than only its words.
    const char* meaning = err == cudaErrorInsufficientDriver
                              ? "no NVIDIA driver is loaded (no GPU here), or it is older than the CUDA runtime "
                                "this library was built with needs"
                          : err == cudaErrorNoDevice ? "no CUDA GPU is visible"
                                                     : "the CUDA runtime could not reach a device";
    return error(FH_ERROR_NO_DEVICE, std::string("no CUDA device available: ") + meaning + " (" +
                                         cudaGetErrorName(err) + ": " + cudaGetErrorString(err) + ")");
  }
  if (device.cc_major != 9 || device.cc_minor != 0) {
    return error(FH_ERROR_NO_DEVICE, "device " + std::to_string(device.device) + " has compute capability " +
                                         std::to_string(device.cc_major) + "." + std::to_string(device.cc_minor) +
                                         "; FlashHopper's kernels need sm_90 (H100/H200)");
  }
  return {};
}

// The device allocations a call's pointers were found in, so that later calls check a pointer by a
// lookup instead of a pointer-attribute query each (host time on every call). An allocation stays
// trusted for the process's life: memory freed while a call uses it is the caller's error, as with
// any CUDA call. Fixed size; when full, the oldest entry goes.
class DeviceAllocations {
 public:
  bool contains(const void* p) {
    const auto address = reinterpret_cast<uintptr_t>(p);
    std::lock_guard<std::mutex> lock(mutex_);
    for (int i = 0; i < count_; ++i)
      if (address >= ranges_[i].begin && address < ranges_[i].end) return true;
    return false;
  }
  // Remembers the allocation that holds p, when the driver can say which.
  void add(const void* p) {
    using AddressRange = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);
    static const AddressRange address_range = [] {
      void* fn = nullptr;
      cudaDriverEntryPointQueryResult found{};
      if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &fn, 12000, cudaEnableDefault, &found) !=
              cudaSuccess ||
          found != cudaDriverEntryPointSuccess)
        fn = nullptr;
      return reinterpret_cast<AddressRange>(fn);
    }();
    CUdeviceptr base = 0;
    size_t bytes = 0;
    if (address_range == nullptr || address_range(&base, &bytes, reinterpret_cast<CUdeviceptr>(p)) != CUDA_SUCCESS)
      return;
    std::lock_guard<std::mutex> lock(mutex_);
    ranges_[next_] = {uintptr_t(base), uintptr_t(base) + bytes};
    next_ = (next_ + 1) % kSize;
    if (count_ < kSize) ++count_;
  }

 private:
  static constexpr int kSize = 64;
  struct Range {
    uintptr_t begin = 0, end = 0;
  };
  std::mutex mutex_;
  Range ranges_[kSize];
  int count_ = 0, next_ = 0;
};

DeviceAllocations& device_allocations() {
  static DeviceAllocations allocations;
  return allocations;
}

// The pointer must be device (or managed) memory.
Status check_device_pointer(const Tensor& t, const char* name) {
  if (t.data == nullptr || device_allocations().contains(t.data)) return {};
  cudaPointerAttributes attributes{};
  cudaError_t err = cudaPointerGetAttributes(&attributes, t.data);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return error(FH_ERROR_INVALID_ARGUMENT, std::string(name) + ": pointer is not known to CUDA (" +
                                                cudaGetErrorString(err) + ")");
  }
  if (attributes.type != cudaMemoryTypeDevice && attributes.type != cudaMemoryTypeManaged) {
    return error(FH_ERROR_INVALID_ARGUMENT, std::string(name) + ": must point to device memory");
  }
  device_allocations().add(t.data);
  return {};
}
#endif

Status check_workspace(void* workspace, size_t workspace_bytes, size_t needed) {
  if (workspace_bytes < needed) {
    return error(FH_ERROR_WORKSPACE, "workspace_bytes: " + std::to_string(workspace_bytes) +
                                         " given, the call needs " + std::to_string(needed) +
                                         " (ask workspace_size)");
  }
  if (needed > 0 && workspace == nullptr) {
    return error(FH_ERROR_WORKSPACE, "workspace: null, the call needs " + std::to_string(needed) + " bytes");
  }
  if (reinterpret_cast<uintptr_t>(workspace) % 256 != 0) {
    return error(FH_ERROR_WORKSPACE, "workspace: must be 256-byte aligned");
  }
  return {};
}

const char* kNoCuda = "this FlashHopper build has no CUDA kernels (configured with FLASHHOPPER_CUDA=OFF)";

}  // namespace

const char* version() { return FLASHHOPPER_VERSION; }

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case FH_DTYPE_BF16:
    case FH_DTYPE_FP16: return 2;
    case FH_DTYPE_FP8_E4M3: return 1;
    case FH_DTYPE_FP32:
    case FH_DTYPE_INT32: return 4;
    case FH_DTYPE_FP64: return 8;
  }
  return 0;
}

Tensor make_tensor(void* data, DType dtype, std::initializer_list<int64_t> shape,
                   std::initializer_list<int64_t> stride) {
  Tensor t{};
  t.data = data;
  t.dtype = dtype;
  // More dims than a tensor holds: ndim 0, which every check refuses ("expected N dims"), rather
  // than a silently shortened view.
  if (shape.size() > FH_MAX_DIMS) return t;
  t.ndim = static_cast<int32_t>(shape.size());
  int i = 0;
  for (int64_t extent : shape) {
    if (i < FH_MAX_DIMS) t.shape[i++] = extent;
  }
  if (stride.size() == shape.size()) {
    i = 0;
    for (int64_t s : stride) {
      if (i < FH_MAX_DIMS) t.stride[i++] = s;
    }
  } else {
    int64_t running = 1;  // saturates: a shape past int64 gets strides the range check refuses
    for (i = t.ndim - 1; i >= 0; --i) {
      t.stride[i] = running;
      running = detail::saturating_product(running, t.shape[i]);
    }
  }
  return t;
}

ForwardParams default_forward_params() {
  ForwardParams p{};
  p.window_left = -1;
  p.window_right = -1;
  p.num_splits = 1;
  return p;
}

BackwardParams default_backward_params() {
  BackwardParams p{};
  p.window_left = -1;
  p.window_right = -1;
  return p;
}

Status check(const ForwardParams& params) { return detail::validate(params, detail::Target::kKernel); }
Status check(const BackwardParams& params) { return detail::validate(params, detail::Target::kKernel); }
Status check(const CombineParams& params) { return detail::validate(params, detail::Target::kKernel); }

Status workspace_size(const ForwardParams& params, size_t* bytes) {
  if (bytes == nullptr) return error(FH_ERROR_INVALID_ARGUMENT, "bytes: must not be null");
  *bytes = 0;
  Status status = check(params);
  if (!status.ok()) return status;
#ifdef FLASHHOPPER_WITH_CUDA
  *bytes = launch::forward_workspace_size(params, detail::forward_shape(params));
#endif
  return {};
}

Status workspace_size(const BackwardParams& params, size_t* bytes) {
  if (bytes == nullptr) return error(FH_ERROR_INVALID_ARGUMENT, "bytes: must not be null");
  *bytes = 0;
  Status status = check(params);
  if (!status.ok()) return status;
#ifdef FLASHHOPPER_WITH_CUDA
  *bytes = launch::backward_workspace_size(params, detail::backward_shape(params));
#endif
  return {};
}

Status forward(const ForwardParams& call, void* workspace, size_t workspace_bytes, fh_stream_t stream) {
  const ForwardParams params = detail::without_ignored_arguments(call);
  Status status = check(params);
  if (!status.ok()) return status;
#ifdef FLASHHOPPER_WITH_CUDA
  const detail::ProblemShape shape = detail::forward_shape(params);
  if (const std::string reason = launch::forward_unsupported_reason(params, shape); !reason.empty()) {
    return error(FH_ERROR_NOT_SUPPORTED, "forward: " + reason);
  }
  if (!(status = check_device()).ok()) return status;
  const std::pair<const Tensor*, const char*> pointers[] = {
      {&params.q, "q"},     {&params.k, "k"},     {&params.v, "v"},
      {&params.out, "out"}, {&params.lse, "lse"}, {&params.learnable_sink, "learnable_sink"},
      {&params.cu_seqlens_q, "cu_seqlens_q"}, {&params.cu_seqlens_k, "cu_seqlens_k"},
      {&params.seqused_q, "seqused_q"}, {&params.seqused_k, "seqused_k"},
      {&params.cache_seqlens, "cache_seqlens"}, {&params.cache_batch_idx, "cache_batch_idx"},
      {&params.cache_leftpad, "cache_leftpad"}, {&params.k_new, "k_new"}, {&params.v_new, "v_new"},
      {&params.rotary_cos, "rotary_cos"}, {&params.rotary_sin, "rotary_sin"},
      {&params.rotary_seqlens, "rotary_seqlens"}, {&params.page_table, "page_table"},
      {&params.cu_seqlens_k_new, "cu_seqlens_k_new"}};
  for (const auto& [tensor, name] : pointers) {
    if (!(status = check_device_pointer(*tensor, name)).ok()) return status;
  }
  const launch::ForwardPlan plan = launch::plan_forward(params, shape);
  status = check_workspace(workspace, workspace_bytes, plan.workspace_bytes());
  if (!status.ok()) return status;
  const int err = launch::run_forward(plan, workspace, stream);
  if (err != 0) return cuda_error("forward kernel launch", static_cast<cudaError_t>(err));
  return {};
#else
  (void)workspace;
  (void)workspace_bytes;
  (void)stream;
  return error(FH_ERROR_NO_DEVICE, kNoCuda);
#endif
}

Status backward(const BackwardParams& params, void* workspace, size_t workspace_bytes,
                fh_stream_t stream) {
  Status status = check(params);
  if (!status.ok()) return status;
#ifdef FLASHHOPPER_WITH_CUDA
  const detail::ProblemShape shape = detail::backward_shape(params);
  if (const std::string reason = launch::backward_unsupported_reason(params, shape); !reason.empty()) {
    return error(FH_ERROR_NOT_SUPPORTED, "backward: " + reason);
  }
  if (!(status = check_device()).ok()) return status;
  const std::pair<const Tensor*, const char*> pointers[] = {
      {&params.q, "q"},       {&params.k, "k"},     {&params.v, "v"},   {&params.out, "out"}, {&params.dout, "dout"},
      {&params.lse, "lse"},   {&params.dq, "dq"},   {&params.dk, "dk"}, {&params.dv, "dv"},
      {&params.learnable_sink, "learnable_sink"},   {&params.dsink, "dsink"},
      {&params.cu_seqlens_q, "cu_seqlens_q"},       {&params.cu_seqlens_k, "cu_seqlens_k"},
      {&params.seqused_q, "seqused_q"},             {&params.seqused_k, "seqused_k"}};
  for (const auto& [tensor, name] : pointers) {
    if (!(status = check_device_pointer(*tensor, name)).ok()) return status;
  }
  status = check_workspace(workspace, workspace_bytes, launch::backward_workspace_size(params, shape));
  if (!status.ok()) return status;
  const int err = launch::run_backward(params, shape, workspace, stream);
  if (err != 0) return cuda_error("backward kernel launch", static_cast<cudaError_t>(err));
  return {};
#else
  (void)workspace;
  (void)workspace_bytes;
  (void)stream;
  return error(FH_ERROR_NO_DEVICE, kNoCuda);
#endif
}

Status combine(const CombineParams& params, fh_stream_t stream) {
  Status status = check(params);
  if (!status.ok()) return status;
#ifdef FLASHHOPPER_WITH_CUDA
  if (!(status = check_device()).ok()) return status;
  const std::pair<const Tensor*, const char*> pointers[] = {{&params.out_partial, "out_partial"},
                                                            {&params.lse_partial, "lse_partial"},
                                                            {&params.out, "out"},
                                                            {&params.lse, "lse"}};
  for (const auto& [tensor, name] : pointers) {
    if (!(status = check_device_pointer(*tensor, name)).ok()) return status;
  }
  const int err = launch::run_combine(params, stream);
  if (err != 0) return cuda_error("combine kernel launch", static_cast<cudaError_t>(err));
  return {};
#else
  (void)stream;
  return error(FH_ERROR_NO_DEVICE, kNoCuda);
#endif
}

}  // namespace flashhopper
