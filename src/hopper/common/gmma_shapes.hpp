// WGMMA's N and CuTe's two sets of instruction shapes. For 16-bit inputs the instruction takes any
// N that is a multiple of 8 up to 256; CuTe declares N = 8, 16, 32, 64, 96, 128, 192 and 256 by
// default and the others only under CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED, whose thousands of
// instruction types take about half of an instantiation's compile time (docs/kernel_families.md,
// "Build time"). So only the generated instantiation files whose tiles use such an N define it
// (scripts/kernel_manifest.py: HeadDims.extended_gmma). Without it GMMA::ss_op_selector would
// quietly build that N from several narrower instructions: each collective asserts that its MMAs
// span the N they ask for (gmma_n), and the launches assert that an instantiation defines the set
// only when its collectives use it (kUsesExtendedGmma).
#pragma once

#include <cute/tensor.hpp>

#if defined(CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED)
#define FLASHHOPPER_EXTENDED_GMMA_SHAPES 1
#else
#define FLASHHOPPER_EXTENDED_GMMA_SHAPES 0
#endif

namespace flashhopper::hopper {

// An N that CuTe declares only in its extended set.
constexpr bool is_extended_gmma_n(int n) {
  return !(n == 8 || n == 16 || n == 32 || n == 64 || n == 96 || n == 128 || n == 192 || n == 256);
}

// The N of one instruction of a tiled MMA.
template <class TiledMma>
inline constexpr int gmma_n = decltype(cute::size<1>(typename TiledMma::AtomShape_MNK{}))::value;

}  // namespace flashhopper::hopper

#define FLASHHOPPER_GMMA_SPAN_MESSAGE                                                                   \
  "a WGMMA narrower than the N it was asked for: that N needs CuTe's extended shapes, which the "       \
  "family's HeadDims.extended_gmma in scripts/kernel_manifest.py turns on (src/hopper/common/gmma_shapes.hpp)"
#define FLASHHOPPER_GMMA_SET_MESSAGE                                                                    \
  "this instantiation's CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED disagrees with its tiles: set the family's "   \
  "HeadDims.extended_gmma in scripts/kernel_manifest.py to the passes whose tiles use an extended N "     \
  "(src/hopper/common/gmma_shapes.hpp), then run scripts/generate_kernels.py"
