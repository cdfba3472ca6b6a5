// fp8's V transpose on the host (label "cpu"): the transposing warps' units as
// ForwardMainloop::transpose_v runs them (Fp8VTranspose's addresses and byte moves), with
// ldmatrix.x4.trans and stmatrix.x4 played by CuTe's models of the two instructions (their copy
// traits' maps from a thread's register bits to the lanes' row addresses), not by this project's
// reading of them. Over the tiles fp8 uses and those its tile table may take: every byte of P V's
// stages must be written once, with the key key_of_slot(slot) of its column and stage.
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include <cute/atom/copy_traits_sm75.hpp>
#include <cute/atom/copy_traits_sm90.hpp>

#include "hopper/common/fp8_v_transpose.hpp"

namespace {

using flashhopper::hopper::Fp8VTranspose;

// Shared memory as two buffers at addresses a swizzle repeat apart from 0, as the kernel's are.
constexpr uint32_t kStagedBase = 3 * 1024, kTransposedBase = 7 * 1024;
constexpr int kStages = 2, kTransposeWarps = 3;

struct Buffers {
  std::vector<uint8_t> staged, transposed;
  std::vector<int> writes;  // per byte of the transposed stages
};

// ldmatrix.sync.aligned.m8n8.x4.trans.b16: row r of the warp's 32 rows (matrix r / 8) is 16 bytes at
// lane r's address; thread t's register i takes the bytes CuTe's DstLayout maps (t, bit 32 i + 8 j) to.
void ldmatrix_x4_trans(const Buffers& b, const uint32_t (&address)[32], uint32_t (&words)[32][4]) {
  using Map = cute::Copy_Traits<cute::SM75_U16x8_LDSM_T>::DstLayout;
  for (int t = 0; t < 32; ++t)
    for (int i = 0; i < 4; ++i) {
      words[t][i] = 0;
      for (int j = 0; j < 4; ++j) {
        const int bit = Map{}(t, 32 * i + 8 * j);
        ASSERT_EQ(bit % 8, 0);
        const uint32_t at = address[bit / 128] + bit % 128 / 8 - kStagedBase;
        ASSERT_LT(at, b.staged.size());
        words[t][i] |= uint32_t(b.staged[at]) << (8 * j);
      }
    }
}

// stmatrix.sync.aligned.m8n8.x4.b16: thread t's register i goes where CuTe's SrcLayout maps
// (t, bit 32 i + 8 j): row bit / 128, at that lane's address.
void stmatrix_x4(Buffers& b, const uint32_t (&address)[32], const uint32_t (&words)[32][4]) {
  using Map = cute::Copy_Traits<cute::SM90_U32x4_STSM_N>::SrcLayout;
  for (int t = 0; t < 32; ++t)
    for (int i = 0; i < 4; ++i)
      for (int j = 0; j < 4; ++j) {
        const int bit = Map{}(t, 32 * i + 8 * j);
        ASSERT_EQ(bit % 8, 0);
        const uint32_t at = address[bit / 128] + bit % 128 / 8 - kTransposedBase;
        ASSERT_LT(at, b.transposed.size());
        b.transposed[at] = uint8_t(words[t][i] >> (8 * j));
        ++b.writes[at];
      }
}

// The value of V's byte (key, column) at a stage, by what a pass identifies: the key, the column or
// the stage (each below 256, so a byte holds it whole).
enum class Tag { kKey, kColumn, kStage };
uint8_t tag_of(Tag tag, int key, int column, int stage) {
  return uint8_t(tag == Tag::kKey ? key : tag == Tag::kColumn ? column : 17 + stage);
}

// One pass: fill the staging buffers (key rows, or column-major V in P V's layout), run the warps'
// units over every stage, and check each transposed byte.
template <int kBlockN, int kHeadDimV>
void check_pass(Tag tag, bool column_major) {
  using T = Fp8VTranspose<kBlockN, kHeadDimV>;
  constexpr int kStageBytes = kBlockN * kHeadDimV;
  Buffers b{std::vector<uint8_t>(kStages * kStageBytes), std::vector<uint8_t>(kStages * kStageBytes, 0xee),
            std::vector<int>(kStages * kStageBytes, 0)};
  for (int stage = 0; stage < kStages; ++stage)
    for (int key = 0; key < kBlockN; ++key)
      for (int column = 0; column < kHeadDimV; ++column)
        b.staged[column_major ? T::vt_offset(column, key, stage) : T::staged_v_offset(key, column, stage)] =
            tag_of(tag, key, column, stage);

  for (int stage = 0; stage < kStages; ++stage) {
    if (column_major) {  // a thread a 16-byte chunk, reordered in place of itself
      for (int chunk = 0; chunk < kStageBytes / 16; ++chunk) {
        const int at = stage * kStageBytes + 16 * chunk;
        uint32_t keys[4], slots[4];
        for (int w = 0; w < 4; ++w)
          keys[w] = uint32_t(b.staged[at + 4 * w]) | uint32_t(b.staged[at + 4 * w + 1]) << 8 |
                    uint32_t(b.staged[at + 4 * w + 2]) << 16 | uint32_t(b.staged[at + 4 * w + 3]) << 24;
        T::reorder_column_major(keys, slots);
        for (int byte = 0; byte < 16; ++byte) {
          b.transposed[at + byte] = uint8_t(slots[byte / 4] >> (8 * (byte % 4)));
          ++b.writes[at + byte];
        }
      }
      continue;
    }
    for (int warp = 0; warp < kTransposeWarps; ++warp) {
      uint32_t load_base[32], store_base[32];
      for (int lane = 0; lane < 32; ++lane) {
        load_base[lane] = kStagedBase + uint32_t(T::load_lane_offset(lane, stage));
        store_base[lane] = kTransposedBase + uint32_t(T::store_lane_offset(lane, stage));
      }
      for (int unit = warp; unit < T::kUnits; unit += kTransposeWarps) {
        uint32_t load_address[32], store_address[32], loaded[32][4], stored[32][4];
        for (int lane = 0; lane < 32; ++lane) {
          load_address[lane] = T::load_address(load_base[lane], unit);
          store_address[lane] = T::store_address(store_base[lane], unit);
          // ldmatrix and stmatrix read 16 bytes a row: a row's address must be 16-byte aligned.
          ASSERT_EQ(load_address[lane] % 16, 0u);
          ASSERT_EQ(store_address[lane] % 16, 0u);
        }
        ldmatrix_x4_trans(b, load_address, loaded);
        for (int t = 0; t < 32; ++t) T::reorder(loaded[t], stored[t]);
        stmatrix_x4(b, store_address, stored);
      }
    }
  }

  for (int stage = 0; stage < kStages; ++stage)
    for (int column = 0; column < kHeadDimV; ++column)
      for (int slot = 0; slot < kBlockN; ++slot) {
        const int at = T::vt_offset(column, slot, stage);
        ASSERT_EQ(b.writes[at], 1) << "column " << column << " slot " << slot << " stage " << stage;
        ASSERT_EQ(b.transposed[at], tag_of(tag, T::key_of_slot(slot), column, stage))
            << "column " << column << " slot " << slot << " stage " << stage << " tag " << int(tag)
            << (column_major ? " (column-major V)" : "");
      }
}

template <int kBlockN, int kHeadDimV>
void check_tile() {
  for (bool column_major : {false, true})
    for (Tag tag : {Tag::kKey, Tag::kColumn, Tag::kStage}) {
      check_pass<kBlockN, kHeadDimV>(tag, column_major);
      if (::testing::Test::HasFatalFailure()) return;
    }
}

// The slots of a 32-key slice take each of its keys once, each half its own.
TEST(Fp8Transpose, SlotsArePermutationsOfEachHalf) {
  using T = Fp8VTranspose<128, 128>;
  for (int half = 0; half < 2; ++half) {
    std::vector<int> seen(16, 0);
    for (int slot = 16 * half; slot < 16 * half + 16; ++slot) {
      const int key = T::key_of_fp8_slot(slot);
      ASSERT_GE(key, 16 * half);
      ASSERT_LT(key, 16 * half + 16);
      ++seen[key - 16 * half];
    }
    for (int n : seen) EXPECT_EQ(n, 1);
  }
  EXPECT_TRUE(T::column_major_order_agrees());
}

// The tiles of ForwardTileSizeFp8 (hdim 64 and 128: 128 keys; 256: 64) and the key blocks its A/B
// may take (96, 160, 192 and 224 keys: 32- and 64-byte rows of P V's stage).
TEST(Fp8Transpose, Hdim64Keys128) { check_tile<128, 64>(); }
TEST(Fp8Transpose, Hdim128Keys128) { check_tile<128, 128>(); }
TEST(Fp8Transpose, Hdim256Keys64) { check_tile<64, 256>(); }
TEST(Fp8Transpose, Hdim256Keys128) { check_tile<128, 256>(); }
TEST(Fp8Transpose, Hdim256Keys96) { check_tile<96, 256>(); }
TEST(Fp8Transpose, Hdim128Keys192) { check_tile<192, 128>(); }
TEST(Fp8Transpose, Hdim128Keys160) { check_tile<160, 128>(); }
TEST(Fp8Transpose, Hdim128Keys224) { check_tile<224, 128>(); }
TEST(Fp8Transpose, Hdim64Keys32) { check_tile<32, 64>(); }

}  // namespace
