// Small CuTe helpers shared by the Hopper kernels: WGMMA issue, accumulator views, conversion.
#pragma once

#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cute/tensor.hpp>
#include <cutlass/numeric_conversion.h>

namespace flashhopper::hopper {

using namespace cute;

// 16 bytes global -> shared with cp.async (L2 only, 128-byte L2 prefetch), zeros where !valid.
// It takes the 32-bit shared address, so a copy loop skips the generic pointer and its conversion
// that cutlass::arch::cp_async_zfill makes on every call.
CUTLASS_DEVICE void cp_async_16_zfill(uint32_t smem_addr, void const* gmem, bool valid) {
  asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(smem_addr), "l"(gmem),
               "r"(valid ? 16 : 0));
}

// 16 bytes to and from shared memory by its 32-bit address: st/ld.shared rather than the generic
// accesses a pointer into the kernel's dynamic shared memory otherwise compiles to. Volatile, so
// that they keep their order against named barriers.
CUTLASS_DEVICE void store_shared_16(uint32_t smem_addr, float a, float b, float c, float d) {
  asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"r"(smem_addr), "f"(a), "f"(b), "f"(c), "f"(d));
}
CUTLASS_DEVICE float4 load_shared_16(uint32_t smem_addr) {
  float4 v;
  asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];\n"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(smem_addr));
  return v;
}

CUTLASS_DEVICE uint32_t load_shared_u32(uint32_t smem_addr) {
  uint32_t v;
  asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(v) : "r"(smem_addr));
  return v;
}
CUTLASS_DEVICE void store_shared_u32(uint32_t smem_addr, uint32_t v) {
  asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(smem_addr), "r"(v));
}
// 16 bytes at a 16-byte aligned shared address.
CUTLASS_DEVICE void load_shared_u32x4(uint32_t smem_addr, uint32_t (&v)[4]) {
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v[0]), "=r"(v[1]), "=r"(v[2]), "=r"(v[3])
               : "r"(smem_addr));
}
CUTLASS_DEVICE void store_shared_u32x4(uint32_t smem_addr, uint32_t const (&v)[4]) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(smem_addr), "r"(v[0]), "r"(v[1]), "r"(v[2]),
               "r"(v[3]));
}

// A warp's four 8 x 8 matrices of 16-bit elements: lanes 8m .. 8m + 7 give the addresses of matrix
// m's rows (16 bytes each). ldmatrix .trans hands thread t, of matrix m, elements (2 (t % 4), t / 4)
// and (2 (t % 4) + 1, t / 4) in words[m]; stmatrix stores words[m] as elements (t / 4, 2 (t % 4))
// and (t / 4, 2 (t % 4) + 1). The first element in the low half.
CUTLASS_DEVICE void load_matrices_x4_transposed(uint32_t smem_addr, uint32_t (&words)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(words[0]), "=r"(words[1]), "=r"(words[2]), "=r"(words[3])
               : "r"(smem_addr));
}
CUTLASS_DEVICE void store_matrices_x4(uint32_t smem_addr, uint32_t const (&words)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(smem_addr), "r"(words[0]),
               "r"(words[1]), "r"(words[2]), "r"(words[3]));
}

// Issue one warpgroup GEMM C (+)= A B over the K mode. kWait >= 0 waits until at most kWait
// batches are in flight; -1 returns at once so the caller can overlap other work. kSlicesK > 0:
// over the K slices [first_slice, first_slice + kSlicesK) alone.
template <bool kZeroInit, int kWait = 0, int kSlicesK = 0, class TiledMma, class TensorA, class TensorB,
          class TensorC>
CUTLASS_DEVICE void warpgroup_gemm(TiledMma& tiled_mma, TensorA const& tCrA, TensorB const& tCrB, TensorC& tCrC,
                                   int first_slice = 0) {
  constexpr bool kAInRegisters =
      !cute::is_same_v<typename TensorA::engine_type::iterator, GMMA::DescriptorIterator>;
  if constexpr (kAInRegisters) warpgroup_fence_operand(const_cast<TensorA&>(tCrA));
  warpgroup_fence_operand(tCrC);
  warpgroup_arrive();
  if constexpr (kZeroInit) tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
  constexpr int kSlices = kSlicesK > 0 ? kSlicesK : decltype(size<2>(tCrA))::value;
  CUTLASS_PRAGMA_UNROLL
  for (int k = 0; k < kSlices; ++k) {
    cute::gemm(tiled_mma, tCrA(_, _, first_slice + k), tCrB(_, _, first_slice + k), tCrC);
    tiled_mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
  if constexpr (kWait >= 0) warpgroup_wait<kWait>();
  warpgroup_fence_operand(tCrC);
  if constexpr (kAInRegisters) warpgroup_fence_operand(const_cast<TensorA&>(tCrA));
}

// The same shared-memory operand (a tensor of WGMMA descriptors), with its base descriptor
// passed through an empty asm so that the compiler cannot hoist the per-k-slice descriptors out
// of a loop. For an operand that stays put across the loop (the backward's K and V), it did:
// 24 64-bit descriptors live across the loop, spilled and reloaded before every WGMMA (ncu,
// hdim 128: the largest stall in the backward). Recomputing them is a few uniform adds.
template <class TensorDesc>
CUTLASS_DEVICE auto descriptors_per_use(TensorDesc const& t) {
  GMMA::DescriptorIterator base = t.data();
  asm volatile("" : "+r"(base.desc_.reg32_[0]), "+r"(base.desc_.reg32_[1]));
  return make_tensor(base, t.layout());
}

// A WGMMA accumulator ((2, 2, N/8), MMA_M, MMA_N) viewed as (rows, cols):
// ((2, MMA_M), (2, N/8, MMA_N)). Mode 0,1 is the row +8 half, mode 0,0 the column pair.
template <class Layout>
CUTLASS_DEVICE auto accumulator_rowcol(Layout acc) {
  static_assert(decltype(rank<0>(acc))::value == 3);
  return make_layout(make_layout(get<0, 1>(acc), get<1>(acc)),
                     make_layout(get<0, 0>(acc), get<0, 2>(acc), get<2>(acc)));
}

// The accumulator of S = Q K^T reused as the register A operand of O += P V:
// ((2, 2, N/8), MMA_M, 1) -> ((2, 2, 2), MMA_M, N/16). Two n8 column chunks make one k16 slice.
template <class Layout>
CUTLASS_DEVICE auto accumulator_as_a_operand(Layout acc) {
  auto chunks = logical_divide(get<0>(acc), Shape<Underscore, Underscore, _2>{});  // (2, 2, (2, N/16))
  return make_layout(make_layout(get<0>(chunks), get<1>(chunks), get<2, 0>(chunks)), get<1>(acc),
                     coalesce(make_layout(get<2, 1>(chunks), get<2>(acc))));
}

// fp8: S's accumulator ((2, 2, N/8), MMA_M, 1) as the 8-bit register A operand of O += P V,
// ((4, 2, 2), MMA_M, N/32): 16 bytes a 32-key slice. WGMMA wants a thread's bytes to be keys
// 4t .. 4t + 3 and 16 + 4t .. 16 + 4t + 3 of a slice (t = lane % 4, rows r and r + 8), where the
// accumulator holds keys 2t, 2t + 1 of every 8. fp8_operand_from_scores keeps each value in its
// thread and takes them in register order; the B operand's rows take the keys in the same order
// (Fp8VTranspose::key_of_fp8_slot), so that each product pairs the same key.
template <class Layout>
CUTLASS_DEVICE auto fp8_operand_layout(Layout acc) {
  static_assert(decltype(size<0>(acc))::value % 16 == 0 && decltype(size<2>(acc))::value == 1);
  constexpr int kSlices = decltype(size<0>(acc))::value / 16;
  return make_layout(make_shape(Shape<_4, _2, _2>{}, get<1>(acc).shape(), Int<kSlices>{}));
}

// Byte (i, r, h) of slice k (fp8_operand_layout) = accumulator value (i % 2, r, 4k + 2h + i / 2),
// rounded to e4m3 (saturating: P is at most 2^8 here).
template <class TensorS, class TensorP>
CUTLASS_DEVICE void fp8_operand_from_scores(TensorS const& s, TensorP& p) {
  using Fp8 = typename TensorP::value_type;
  static_assert(sizeof(Fp8) == 1 && decltype(size(s))::value == decltype(size(p))::value);
  constexpr int kQuads = decltype(size(s))::value / 4;  // 4 bytes a (r, h, k)
  cutlass::NumericArrayConverter<Fp8, float, 4, cutlass::FloatRoundStyle::round_to_nearest> convert;
  auto* out = reinterpret_cast<cutlass::Array<Fp8, 4>*>(p.data());
  CUTLASS_PRAGMA_UNROLL
  for (int q = 0; q < kQuads; ++q) {
    const int r = q % 2, hk = q / 2;  // hk = h + 2k: accumulator chunks 2 hk and 2 hk + 1
    const int first = 2 * r + 8 * hk;  // value (0, r, 2 hk): e + 2 r + 4 j
    cutlass::Array<float, 4> x;
    x[0] = s(first);
    x[1] = s(first + 1);
    x[2] = s(first + 4);
    x[3] = s(first + 5);
    out[q] = convert(x);
  }
}

// Elementwise conversion between register tensors of the same size, packed (cvt.rn.bf16x2.f32).
template <class TensorSrc, class TensorDst>
CUTLASS_DEVICE void convert_into(TensorSrc const& src, TensorDst& dst) {
  using From = typename TensorSrc::value_type;
  using To = typename TensorDst::value_type;
  constexpr int kNumel = decltype(size(src))::value;
  static_assert(kNumel == decltype(size(dst))::value);
  cutlass::NumericArrayConverter<To, From, kNumel> convert;
  *reinterpret_cast<cutlass::Array<To, kNumel>*>(dst.data()) =
      convert(*reinterpret_cast<cutlass::Array<From, kNumel> const*>(src.data()));
}

// Reduction over the 4 threads of a quad, which share the rows of a WGMMA accumulator.
template <class Op>
CUTLASS_DEVICE float quad_allreduce(float x, Op op) {
  x = op(x, __shfl_xor_sync(0xffffffff, x, 2));
  return op(x, __shfl_xor_sync(0xffffffff, x, 1));
}

// A (rows, columns, heads, batch) shape with another column count: V and dO take dv where Q and K
// take d.
template <class Shape4>
CUTLASS_HOST_DEVICE Shape4 with_columns(Shape4 const& shape, int columns) {
  return Shape4(get<0>(shape), columns, get<2>(shape), get<3>(shape));
}

// A float32 accumulator tile straight to global memory in dst's element type: each thread writes
// its column pairs as one store (4 bytes, 8 for float32); rows at or past `rows` and columns at or past `cols` (even:
// head dims are multiples of 8) are skipped. gdst is the tile's (rows, cols) window, coords the
// accumulator's identity partition (tile coordinates).
// A TMA load of (kRows, kCols) boxes of a (seqlen, cols, head, batch) tensor into smem_layout.
// (A free function: a class's type aliases cannot call its own deduced-return members.)
template <int kRows, int kCols, class Element, class Shape4, class Stride4, class SmemLayout>
auto make_tile_tma(Element const* ptr, Shape4 const& shape, Stride4 const& stride, SmemLayout const& smem_layout) {
  return cute::make_tma_copy(cute::SM90_TMA_LOAD{}, cute::make_tensor(cute::make_gmem_ptr(ptr), shape, stride),
                             smem_layout, cute::Shape<cute::Int<kRows>, cute::Int<kCols>>{}, cute::_1{});
}

template <class TensorAcc, class TensorCoord, class TensorDst>
CUTLASS_DEVICE void store_accumulator_rows(TensorAcc const& acc, TensorCoord const& coords, TensorDst gdst,
                                           int rows, int cols) {
  using Element = typename TensorDst::value_type;
  Tensor converted = make_tensor_like<Element>(acc);
  convert_into(acc, converted);
  Tensor out = make_tensor(converted.data(), accumulator_rowcol(converted.layout()));  // (rows, cols)
  Tensor coord_rc = make_tensor(coords.data(), accumulator_rowcol(coords.layout()));
  CUTLASS_PRAGMA_UNROLL
  for (int m = 0; m < size<0>(out); ++m) {
    const int row = get<0>(coord_rc(m, 0));
    if (row >= rows) continue;
    CUTLASS_PRAGMA_UNROLL
    for (int n = 0; n < size<1>(out); n += 2) {  // columns n, n + 1 are adjacent
      const int col = get<1>(coord_rc(m, n));
      if (col >= cols) continue;
      using Pair = cute::conditional_t<sizeof(Element) == 4, uint2, uint32_t>;
      alignas(Pair) Element pair[2] = {out(m, n), out(m, n + 1)};
      *reinterpret_cast<Pair*>(&gdst(row, col)) = *reinterpret_cast<Pair*>(pair);
    }
  }
}

}  // namespace flashhopper::hopper
