// The entry of a plain-CUDA kernel object: static shared memory only, no warp specialization (the
// split-KV combine, the KV cache append).
#pragma once

#include <cutlass/cutlass.h>

namespace flashhopper::hopper {

template <class Kernel>
__global__ void __launch_bounds__(Kernel::kThreads) plain_kernel_entry(typename Kernel::Params const params) {
#if defined(__CUDA_ARCH__)  // the body in the device pass only (docs/kernel_families.md, "Build time")
  Kernel{}(params);
#endif
}

}  // namespace flashhopper::hopper
