// fp8's V transpose (ForwardMainloop::transpose_v), its addresses and byte moves apart from the
// kernel so that the host can run them: tests/cpp/test_fp8_transpose.cu plays a warp's moves on
// the host, with CuTe's models of the two matrix instructions, and checks every byte lands.
//
// WGMMA reads 8-bit operands K-major only, so P V's B operand must hold V with the keys contiguous.
// The TMA loads each V block as stored, a key a row, into a staging buffer (N, dv); the producer's
// transposing warps write it into P V's stage (dv, N), each column's keys in the order in which P's
// registers hold them (key_of_fp8_slot). A warp moves a unit of 16 slots (a half of a 32-key slice)
// by 32 columns with one ldmatrix.x4.trans, four PRMT and one stmatrix.x4:
// - ldmatrix.trans reads 16-bit elements, here byte pairs (columns 2p, 2p + 1) of a key. Its four
//   8 x 8 matrices are the half's keys 0-7 and 8-15 at columns 0-15, then at 16-31 (a lane's row
//   address: matrix lane / 8, its key lane % 8). Thread t gets, of each, the pair p = t / 4 of
//   keys 2q and 2q + 1 (q = t % 4): bytes (2q, 2p), (2q, 2p + 1), (2q + 1, 2p), (2q + 1, 2p + 1).
// - Slots 4q .. 4q + 3 of a column hold the half's keys 2q, 2q + 1, 8 + 2q, 9 + 2q
//   (key_of_fp8_slot), so the even bytes of the keys-0-7 and keys-8-15 words are column 2p's four
//   slots and the odd bytes column 2p + 1's: two PRMT per 16 columns. The permutation that P's
//   register order asks for is the one ldmatrix.trans's fragment already has.
// - stmatrix (not transposed) stores 8 rows of 16 bytes a matrix, thread t's word as bytes
//   4 (t % 4) .. + 3 of row t / 4: rows are columns (2p + parity of 16 columns), 16 slots each.
// Both buffers are swizzled layouts whose byte offsets are XOR-linear in the row, so a lane
// computes its two addresses once a stage and each unit's from them with one XOR and one add.
// 16 bytes a lane an instruction, where 8-byte loads and stores with a byte transpose in registers
// took 126 instructions a 64 bytes and 56 registers a producer thread.
#pragma once

#include <cstdint>

#include <cutlass/cutlass.h>

namespace flashhopper::hopper {

// PRMT (__byte_perm): byte i of the result is byte (selector's nibble i) of {x, y} (x bytes 0-3).
CUTLASS_HOST_DEVICE uint32_t byte_perm(uint32_t x, uint32_t y, uint32_t selector) {
#if defined(__CUDA_ARCH__)
  return __byte_perm(x, y, selector);
#else
  const uint64_t both = uint64_t(y) << 32 | x;
  uint32_t out = 0;
  for (int i = 0; i < 4; ++i) out |= uint32_t(both >> (8 * (selector >> (4 * i) & 7)) & 0xff) << (8 * i);
  return out;
#endif
}

template <int kBlockN, int kHeadDimV>
struct Fp8VTranspose {
  static_assert(kBlockN % 32 == 0 && kHeadDimV % 64 == 0, "key blocks of 32-key slices, dv of 64-byte rows");

  // The key that slot `slot` (< 32) of a 32-key slice holds: P's byte 16 h + 4 t + i in
  // fp8_operand_from_scores (utils.hpp) is the accumulator's key column 8 (2 h + i / 2) + 2 t + i % 2.
  static constexpr CUTLASS_HOST_DEVICE int key_of_fp8_slot(int slot) {
    const int h = slot / 16, t = slot % 16 / 4, i = slot % 4;
    return 16 * h + 8 * (i / 2) + 2 * t + i % 2;
  }
  // Of any slot of the block.
  static constexpr CUTLASS_HOST_DEVICE int key_of_slot(int slot) { return slot / 32 * 32 + key_of_fp8_slot(slot % 32); }

  // Byte offsets in the staging buffers (N, dv, stages) and in P V's stages (dv, N, stages), as
  // CuTe's swizzled layouts place them (ForwardMainloop::transpose_offsets_agree): both tile 8-row
  // swizzle atoms of `w`-byte rows (128, 64 or 32: the widest that divides the row), rows first; a
  // row's offset in its atom is row * w with its 16-byte chunk index XORed by the row (w = 128),
  // row / 2 (w = 64) or row / 4 (w = 32).
  static constexpr int kStagedRowBytes = kHeadDimV % 128 == 0 ? 128 : 64;
  static constexpr int kVtRowBytes = kBlockN % 128 == 0 ? 128 : kBlockN % 64 == 0 ? 64 : 32;
  static constexpr CUTLASS_HOST_DEVICE int atom_row_offset(int row, int w) {
    return row * w ^ ((w == 128 ? row : w == 64 ? row >> 1 & 3 : row >> 2 & 1) << 4);
  }
  static constexpr CUTLASS_HOST_DEVICE int staged_v_offset(int key, int column, int stage) {
    constexpr int w = kStagedRowBytes;
    return stage * kBlockN * kHeadDimV + column / w * (kBlockN * w) + key / 8 * (8 * w) +
           (atom_row_offset(key % 8, w) ^ column % w);
  }
  static constexpr CUTLASS_HOST_DEVICE int vt_offset(int column, int slot, int stage) {
    constexpr int w = kVtRowBytes;
    return stage * kHeadDimV * kBlockN + slot / w * (kHeadDimV * w) + column / 8 * (8 * w) +
           (atom_row_offset(column % 8, w) ^ slot % w);
  }

  // A block's units, 16 slots by 32 columns: unit u + kSlotHalves v is slots 16 u .. 16 u + 15 (the
  // keys of that half) by columns 32 v .. 32 v + 31.
  static constexpr int kSlotHalves = kBlockN / 16;
  static constexpr int kUnits = kSlotHalves * (kHeadDimV / 32);

  // A lane's row addresses in unit 0 of a stage: ldmatrix's (matrix lane / 8: keys 8 (m % 2) + lane
  // % 8 at columns 16 (m / 2) ..) and stmatrix's (column 16 (m / 2) + 2 (lane % 8) + m % 2, slot 0).
  static constexpr CUTLASS_HOST_DEVICE int load_lane_offset(int lane, int stage) {
    const int m = lane / 8;
    return staged_v_offset(8 * (m % 2) + lane % 8, 16 * (m / 2), stage);
  }
  static constexpr CUTLASS_HOST_DEVICE int store_lane_offset(int lane, int stage) {
    const int m = lane / 8;
    return vt_offset(16 * (m / 2) + 2 * (lane % 8) + m % 2, 0, stage);
  }
  // The lane's addresses in unit `unit` from its unit-0 ones (`base`: a buffer's address, aligned
  // to a swizzle atom's repeat, plus the offset above). Columns + 32 v: the chunk bits XOR (the
  // lane's column is below 32), whole rows add; keys + 16 u add two 8-row atoms a half; slots
  // + 16 u: XOR within a row, whole rows add; columns + 32 v add four 8-row atoms.
  static constexpr CUTLASS_HOST_DEVICE uint32_t load_address(uint32_t base, int unit) {
    constexpr int w = kStagedRowBytes;
    const int u = unit % kSlotHalves, v = unit / kSlotHalves;
    return (base ^ uint32_t(32 * v % w)) + uint32_t(32 * v / w * (kBlockN * w) + u * (16 * w));
  }
  static constexpr CUTLASS_HOST_DEVICE uint32_t store_address(uint32_t base, int unit) {
    constexpr int w = kVtRowBytes;
    const int u = unit % kSlotHalves, v = unit / kSlotHalves;
    return (base ^ uint32_t(16 * u % w)) + uint32_t(16 * u / w * (kHeadDimV * w) + v * (32 * w));
  }

  // ldmatrix.trans's words (keys 0-7 then 8-15 at columns 0-15, then at 16-31) to stmatrix's
  // (columns 2p, 2p + 1, 16 + 2p, 17 + 2p): the even bytes of a pair of words, then the odd.
  static CUTLASS_HOST_DEVICE void reorder(uint32_t const (&loaded)[4], uint32_t (&stored)[4]) {
    stored[0] = byte_perm(loaded[0], loaded[1], 0x6420);
    stored[1] = byte_perm(loaded[0], loaded[1], 0x7531);
    stored[2] = byte_perm(loaded[2], loaded[3], 0x6420);
    stored[3] = byte_perm(loaded[2], loaded[3], 0x7531);
  }

  // Column-major V: the staging buffer already has P V's layout, keys in order; each 16-byte chunk
  // (16 keys, a half of a slice) only reorders its bytes into key_of_fp8_slot's order, which stays
  // within the half: slots 4t .. 4t + 3 take keys 2t, 2t + 1, 8 + 2t, 9 + 2t of the half, byte
  // 2 (t % 2) + i % 2 of word t / 2 (i < 2) or of word 2 + t / 2 (i >= 2).
  static CUTLASS_HOST_DEVICE void reorder_column_major(uint32_t const (&keys)[4], uint32_t (&slots)[4]) {
    slots[0] = byte_perm(keys[0], keys[2], 0x5410);
    slots[1] = byte_perm(keys[0], keys[2], 0x7632);
    slots[2] = byte_perm(keys[1], keys[3], 0x5410);
    slots[3] = byte_perm(keys[1], keys[3], 0x7632);
  }
  static constexpr bool column_major_order_agrees() {
    for (int s = 0; s < 16; ++s) {
      const int t = s / 4, i = s % 4;
      const int word = i < 2 ? t / 2 : 2 + t / 2, byte = 2 * (t % 2) + i % 2;
      if (4 * word + byte != key_of_fp8_slot(s) || key_of_fp8_slot(16 + s) != 16 + key_of_fp8_slot(s)) return false;
    }
    return true;
  }
};

}  // namespace flashhopper::hopper
