// Which kernel families this build compiled (cmake/kernels.cmake sets FLASHHOPPER_BUILT_*; the
// forward and the backward are compiled for the same dtypes and head dims).
#pragma once

#include <cstdint>

#include "flashhopper/flashhopper.h"

namespace flashhopper::launch {

inline constexpr bool compiled_dtype(fh_dtype dtype) {
  switch (dtype) {
#ifdef FLASHHOPPER_BUILT_BF16
    case FH_DTYPE_BF16: return true;
#endif
#ifdef FLASHHOPPER_BUILT_FP16
    case FH_DTYPE_FP16: return true;
#endif
    default: return false;
  }
}

inline constexpr bool compiled_head_dim(int64_t head_dim) {
  switch (head_dim) {
#ifdef FLASHHOPPER_BUILT_HDIM64
    case 64: return true;
#endif
#ifdef FLASHHOPPER_BUILT_HDIM128
    case 128: return true;
#endif
#ifdef FLASHHOPPER_BUILT_HDIM256
    case 256: return true;
#endif
    default: return false;
  }
}

// Null when kernels for (dtype, head_dim) exist in this build, else a sentence saying why not.
inline const char* compiled_family_reason(fh_dtype dtype, int64_t head_dim) {
  if (head_dim != 64 && head_dim != 128 && head_dim != 256) {
    return "head dims other than 64, 128 and 256 are not supported yet";
  }
  if (!compiled_dtype(dtype))
    return "this dtype's kernels are not in this build (configure with -DFLASHHOPPER_KERNELS=full)";
  if (!compiled_head_dim(head_dim))
    return "this head dim's kernels are not in this build (configure with -DFLASHHOPPER_KERNELS=full)";
  return nullptr;
}

}  // namespace flashhopper::launch
