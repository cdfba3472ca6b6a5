// The C ABI: the C++ API with its status turned into a code plus a thread-local message.
#include <string>

#include "flashhopper/flashhopper.h"
#include "flashhopper/flashhopper.hpp"
#include "launch/compiled_families.hpp"
#include "plan/problem_shape.hpp"

#define FLASHHOPPER_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

thread_local std::string last_error;

fh_status record(const flashhopper::Status& status) {
  last_error = status.message;
  return status.code;
}

fh_status null_argument(const char* name) {
  last_error = std::string(name) + ": must not be null";
  return FH_ERROR_INVALID_ARGUMENT;
}

}  // namespace

FLASHHOPPER_EXPORT void fh_forward_params_init(fh_forward_params* params) {
  if (params) *params = flashhopper::default_forward_params();
}
FLASHHOPPER_EXPORT void fh_backward_params_init(fh_backward_params* params) {
  if (params) *params = flashhopper::default_backward_params();
}
FLASHHOPPER_EXPORT void fh_combine_params_init(fh_combine_params* params) {
  if (params) *params = fh_combine_params{};
}

FLASHHOPPER_EXPORT fh_status fh_forward_check(const fh_forward_params* params) {
  if (!params) return null_argument("params");
  return record(flashhopper::check(*params));
}
FLASHHOPPER_EXPORT fh_status fh_backward_check(const fh_backward_params* params) {
  if (!params) return null_argument("params");
  return record(flashhopper::check(*params));
}
FLASHHOPPER_EXPORT fh_status fh_combine_check(const fh_combine_params* params) {
  if (!params) return null_argument("params");
  return record(flashhopper::check(*params));
}

FLASHHOPPER_EXPORT fh_status fh_forward_workspace_size(const fh_forward_params* params, size_t* bytes) {
  if (!params) return null_argument("params");
  return record(flashhopper::workspace_size(*params, bytes));
}
FLASHHOPPER_EXPORT fh_status fh_backward_workspace_size(const fh_backward_params* params, size_t* bytes) {
  if (!params) return null_argument("params");
  return record(flashhopper::workspace_size(*params, bytes));
}

FLASHHOPPER_EXPORT fh_status fh_forward(const fh_forward_params* params, void* workspace,
                                        size_t workspace_bytes, fh_stream_t stream) {
  if (!params) return null_argument("params");
  return record(flashhopper::forward(*params, workspace, workspace_bytes, stream));
}
FLASHHOPPER_EXPORT fh_status fh_backward(const fh_backward_params* params, void* workspace,
                                         size_t workspace_bytes, fh_stream_t stream) {
  if (!params) return null_argument("params");
  return record(flashhopper::backward(*params, workspace, workspace_bytes, stream));
}
FLASHHOPPER_EXPORT fh_status fh_combine(const fh_combine_params* params, fh_stream_t stream) {
  if (!params) return null_argument("params");
  return record(flashhopper::combine(*params, stream));
}

FLASHHOPPER_EXPORT const char* fh_last_error(void) { return last_error.c_str(); }

FLASHHOPPER_EXPORT const char* fh_status_name(fh_status status) {
  switch (status) {
    case FH_SUCCESS: return "success";
    case FH_ERROR_INVALID_ARGUMENT: return "invalid argument";
    case FH_ERROR_NOT_SUPPORTED: return "not supported";
    case FH_ERROR_NO_DEVICE: return "no device";
    case FH_ERROR_CUDA: return "CUDA error";
    case FH_ERROR_WORKSPACE: return "workspace";
  }
  return "unknown status";
}

FLASHHOPPER_EXPORT void fh_window_from_fa3(int32_t causal, int64_t window_left, int64_t window_right,
                                           int64_t seqlen_q, int64_t seqlen_k, int32_t* out_causal,
                                           int64_t* out_window_left, int64_t* out_window_right) {
  const flashhopper::detail::Fa3Window w =
      flashhopper::detail::window_from_fa3(causal != 0, window_left, window_right, seqlen_q, seqlen_k);
  if (out_causal) *out_causal = w.causal;
  if (out_window_left) *out_window_left = w.window_left;
  if (out_window_right) *out_window_right = w.window_right;
}

FLASHHOPPER_EXPORT int32_t fh_built_with_cuda(void) {
#ifdef FLASHHOPPER_WITH_CUDA
  return 1;
#else
  return 0;
#endif
}

FLASHHOPPER_EXPORT const char* fh_version(void) { return flashhopper::version(); }

FLASHHOPPER_EXPORT int32_t fh_compiled_families(fh_kernel_family* families, int32_t capacity) {
  using flashhopper::launch::KernelFamily;
  int32_t count = 0;
  for (const KernelFamily& f : flashhopper::launch::kKernelFamilies) {
    if (!flashhopper::launch::built(f) || f.qv) continue;  // qv families: see flashhopper.h
    if (families != nullptr && count < capacity)
      families[count] = {f.pass == flashhopper::launch::Pass::kBackward ? 1 : 0, f.dtype, f.head_dim, f.head_dim_v};
    ++count;
  }
  return count;
}
