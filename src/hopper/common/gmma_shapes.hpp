// WGMMA's N and CuTe's two sets of instruction shapes. For 16-bit inputs the instruction takes any
// N that is a multiple of 8 up to 256; CuTe declares N = 8, 16, 32, 64, 96, 128, 192 and 256 by
// default and the others only under CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED, whose instruction
// types take about half of an instantiation's compile time (docs/kernel_families.md, "Build
// time"). So only the instantiation files with a kernel whose tiles use such an N read them (the
// generated file includes gmma_extended_shapes.hpp first; scripts/kernel_manifest.py:
// HeadDims.extended_gmma). Without them CuTe's selectors would quietly build that N from several
// narrower instructions: each collective asserts that its MMAs span the N they ask for (gmma_n),
// each launch that its kernel reads the extended shapes if it uses them, and each generated file
// that it reads them only when one of its kernels does (kUsesExtendedGmma).
#pragma once

#include <cute/arch/mma_sm90.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#ifndef FLASHHOPPER_EXTENDED_GMMA_SHAPES
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

// Whether one of these tiled MMAs' instructions has an N of CuTe's extended set (each collective
// first asserts that its instructions span the N it asked for).
template <class... TiledMmas>
inline constexpr bool uses_extended_gmma = (is_extended_gmma_n(gmma_n<TiledMmas>) || ...);

// The SS WGMMA atom (bf16, fp16 or e4m3 in, float out) for a (64, N, K) tile: CuTe's selector, and the
// extended N the tiles use named directly (see above; another one fails ss_gmma's static_assert).
template <class Element, class TileShape, cute::GMMA::Major kMajorA = cute::GMMA::Major::K,
          cute::GMMA::Major kMajorB = cute::GMMA::Major::K>
constexpr auto ss_gmma() {
#if FLASHHOPPER_EXTENDED_GMMA_SHAPES
  constexpr int n = decltype(cute::size<1>(TileShape{}))::value;
  if constexpr (is_extended_gmma_n(n)) {
    if constexpr (cute::is_same_v<Element, cutlass::float_e4m3_t>) {  // fp8: K-major operands only
      static_assert(n == 160 || n == 224, "ss_gmma: name this extended N's instructions");
      if constexpr (n == 160) return cute::SM90::GMMA::MMA_64x160x32_F32E4M3E4M3_SS_TN<>{};
      else return cute::SM90::GMMA::MMA_64x224x32_F32E4M3E4M3_SS_TN<>{};
    } else {
      constexpr bool kBf16 = cute::is_same_v<Element, cutlass::bfloat16_t>;
      static_assert(kBf16 || cute::is_same_v<Element, cutlass::half_t>);
      static_assert(n == 48 || n == 80 || n == 112 || n == 160, "ss_gmma: name this extended N's instructions");
      if constexpr (n == 48) {
        if constexpr (kBf16) return cute::SM90::GMMA::MMA_64x48x16_F32BF16BF16_SS<kMajorA, kMajorB>{};
        else return cute::SM90::GMMA::MMA_64x48x16_F32F16F16_SS<kMajorA, kMajorB>{};
      } else if constexpr (n == 80) {
        if constexpr (kBf16) return cute::SM90::GMMA::MMA_64x80x16_F32BF16BF16_SS<kMajorA, kMajorB>{};
        else return cute::SM90::GMMA::MMA_64x80x16_F32F16F16_SS<kMajorA, kMajorB>{};
      } else if constexpr (n == 112) {
        if constexpr (kBf16) return cute::SM90::GMMA::MMA_64x112x16_F32BF16BF16_SS<kMajorA, kMajorB>{};
        else return cute::SM90::GMMA::MMA_64x112x16_F32F16F16_SS<kMajorA, kMajorB>{};
      } else {
        if constexpr (kBf16) return cute::SM90::GMMA::MMA_64x160x16_F32BF16BF16_SS<kMajorA, kMajorB>{};
        else return cute::SM90::GMMA::MMA_64x160x16_F32F16F16_SS<kMajorA, kMajorB>{};
      }
    }
  } else
#endif
    return cute::GMMA::ss_op_selector<Element, Element, float, TileShape, kMajorA, kMajorB>();
}

}  // namespace flashhopper::hopper

#define FLASHHOPPER_GMMA_SPAN_MESSAGE                                                                   \
  "a WGMMA narrower than the N it was asked for: that N needs CuTe's extended shapes, which the "       \
  "family's HeadDims.extended_gmma in scripts/kernel_manifest.py turns on (src/hopper/common/gmma_shapes.hpp)"
#define FLASHHOPPER_GMMA_SET_MESSAGE                                                                    \
  "this instantiation's reading of the extended shapes disagrees with its tiles: set the family's "     \
  "HeadDims.extended_gmma in scripts/kernel_manifest.py to the passes whose tiles use an extended N "     \
  "(src/hopper/common/gmma_shapes.hpp), then run scripts/generate_kernels.py"
