// The masks' block logic on the host. The backward's masking of transposed score tiles: the query
// rows each key sees (hopper::AttentionMask::rows_seeing, which Mask::apply_by_key bounds rows by)
// against the same mask's row-by-row bounds as Mask::apply takes them, and against the CPU
// reference's RowMask, over random lengths, windows, sink tokens and chunks, padded rows and keys
// included. The forward's walk: the steps it runs without masking code (unmasked_steps) against
// crosses_boundary block by block.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <vector>

#include "hopper/common/mask.hpp"
#include "reference/row_mask.hpp"

namespace {

using flashhopper::detail::MaskSpec;
using flashhopper::hopper::AttentionMask;
using flashhopper::hopper::LocalMaskParams;
using flashhopper::hopper::MaskKind;
using flashhopper::hopper::SeqlenInfo;
using flashhopper::reference::detail::RowMask;

constexpr int kBlockM = 64, kBlockN = 128;

// Whether row sees col by apply's bounds (mask.hpp, AttentionMask::apply), spelled out row by row.
template <class Mask>
bool row_sees(const Mask& mask, int row, int col) {
  int col_end = mask.seqlen_k, col_begin = 0, sink_end = 0;
  if constexpr (Mask::kCausal) col_end = std::min(col_end, mask.position(row) + 1);
  if constexpr (Mask::kLocal) {
    col_end = std::min(col_end, mask.cols_hi(row));
    col_begin = mask.cols_lo(row);
    if (mask.local.num_sink_tokens > 0) sink_end = std::min(mask.local.num_sink_tokens, col_end);
  }
  return col < col_end && !(col < col_begin && col >= sink_end);
}

// Every (row, col) of the padded blocks: rows_seeing's interval against row_sees, and, inside the
// sequence, against the reference. Returns the number of (row, col) pairs that disagree.
template <MaskKind kKind>
int count_mismatches(int seqlen_q, int seqlen_k, const LocalMaskParams& local, const MaskSpec& spec) {
  const SeqlenInfo seq{seqlen_q, seqlen_k, seqlen_q, seqlen_k};
  const AttentionMask<kBlockM, kBlockN, kKind> mask(seq, local);
  const RowMask reference(spec, seqlen_q, seqlen_k, 0, seqlen_k);
  const int rows = (seqlen_q + kBlockM - 1) / kBlockM * kBlockM;
  const int cols = (seqlen_k + kBlockN - 1) / kBlockN * kBlockN;
  int mismatches = 0;
  for (int col = 0; col < cols; ++col) {
    int lo = 0, hi = 0;
    mask.rows_seeing(col, lo, hi);
    for (int row = 0; row < rows; ++row) {
      const bool by_key = lo <= row && row <= hi;
      bool expected = row_sees(mask, row, col);
      if (row < seqlen_q && col < seqlen_k) {
        bool in_reference = false;
        for (const auto& range : reference.visible(row)) in_reference |= range.begin <= col && col < range.end;
        // Sink tokens with chunks: the kernels refuse them (docs/masks.md) and do not bound sinks
        // by the chunk's start, the reference does; there only rows_seeing and apply's bounds agree.
        if (!(local.chunk > 0 && local.num_sink_tokens > 0)) EXPECT_EQ(expected, in_reference) << row << " " << col;
      }
      if (by_key != expected) {
        if (++mismatches <= 5) {
          ADD_FAILURE() << "seqlen_q " << seqlen_q << " seqlen_k " << seqlen_k << " window " << local.window_left
                        << "/" << local.window_right << " sinks " << local.num_sink_tokens << " chunk " << local.chunk
                        << ": row " << row << " col " << col << " by key " << by_key << ", by row " << expected;
        }
      }
    }
  }
  return mismatches;
}

TEST(TransposedMask, CausalRowsMatchRowBounds) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 300; ++trial) {
    const int seqlen_q = 1 + int(rng() % 300), seqlen_k = 1 + int(rng() % 300);
    MaskSpec spec;
    spec.window_left = -1;
    spec.window_right = 0;
    EXPECT_EQ(count_mismatches<MaskKind::kCausal>(seqlen_q, seqlen_k, LocalMaskParams{}, spec), 0);
  }
}

TEST(TransposedMask, LocalRowsMatchRowBounds) {
  std::mt19937 rng(11);
  for (int trial = 0; trial < 600; ++trial) {
    const int seqlen_q = 1 + int(rng() % 300), seqlen_k = 1 + int(rng() % 300);
    LocalMaskParams local;
    local.window_left = rng() % 4 == 0 ? -1 : int(rng() % 200);
    local.window_right = rng() % 4 == 0 ? -1 : int(rng() % 200);
    local.num_sink_tokens = local.window_left >= 0 && rng() % 2 ? int(rng() % 9) : 0;
    local.chunk = rng() % 3 == 0 ? 1 + int(rng() % 100) : 0;
    MaskSpec spec;
    spec.window_left = local.window_left;
    spec.window_right = local.window_right;
    spec.num_sink_tokens = local.num_sink_tokens;
    spec.attention_chunk = local.chunk;
    EXPECT_EQ(count_mismatches<MaskKind::kLocal>(seqlen_q, seqlen_k, local, spec), 0);
  }
}

// The forward's walks of every query block (whole, each split's part, a CTA pair's shared walk):
// the steps unmasked_steps gives (and, causal, those from first_unmasked_step on) must cross no
// boundary (the kernel skips the mask there); the count of such steps it leaves masked is returned
// (the window's crossing-free steps lie in one run, so with no sink blocks and no chunk none should
// be).
template <int kM, MaskKind kKind>
int check_unmasked_steps(int seqlen_q, int seqlen_k, const LocalMaskParams& local, int* checked) {
  using Mask = AttentionMask<kM, kBlockN, kKind>;
  const SeqlenInfo seq{seqlen_q, seqlen_k, seqlen_q, seqlen_k};
  const Mask mask(seq, local);
  int left_masked = 0;
  const int num_m_blocks = (seqlen_q + kM - 1) / kM;
  for (int m_block = 0; m_block < num_m_blocks; ++m_block) {
    const typename Mask::KeyBlocks whole = mask.key_blocks(m_block);
    std::vector<typename Mask::KeyBlocks> walks{whole, mask.key_blocks(std::min(m_block | 1, num_m_blocks - 1))};
    for (int num_splits : {2, 3, 7})
      for (int split = 0; split < num_splits; ++split) walks.push_back(whole.split(split, num_splits));
    for (const auto& walk : walks) {
      int begin = 0, end = 0;
      mask.unmasked_steps(walk, m_block, begin, end);
      EXPECT_LE(0, begin);
      EXPECT_LE(begin, end);
      EXPECT_LE(end, walk.count() > 0 ? walk.n_max - walk.n_min : 0);
      int first_unmasked = walk.count();  // causal: the two-run walk's second run (every step after)
      if constexpr (kKind == MaskKind::kCausal) {
        first_unmasked = mask.first_unmasked_step(walk, m_block);
        if (begin < end) EXPECT_EQ(end, walk.count()) << "a causal walk's unmasked run must reach its end";
      }
      for (int i = 0; i < walk.count(); ++i) {
        const bool crosses = mask.crosses_boundary(m_block, walk.at(i));
        const bool unmasked = begin <= i && i < end;
        if (i >= first_unmasked && crosses) {
          ADD_FAILURE() << "causal seqlen_q " << seqlen_q << " seqlen_k " << seqlen_k << ": m_block " << m_block
                        << " step " << i << " crosses the diagonal after first_unmasked_step " << first_unmasked;
          return left_masked;
        }
        ++*checked;
        if (unmasked && crosses) {
          ADD_FAILURE() << "seqlen_q " << seqlen_q << " seqlen_k " << seqlen_k << " window " << local.window_left
                        << "/" << local.window_right << " sinks " << local.num_sink_tokens << " chunk "
                        << local.chunk << ": m_block " << m_block << " step " << i << " (key block " << walk.at(i)
                        << ") crosses a boundary but runs unmasked";
          return left_masked;
        }
        if (!unmasked && !crosses && i > 0 && i < walk.n_max - walk.n_min) ++left_masked;
      }
    }
  }
  return left_masked;
}

TEST(ForwardWalk, UnmaskedStepsCrossNoBoundary) {
  std::mt19937 rng(13);
  int checked = 0;
  for (int trial = 0; trial < 400; ++trial) {
    const int seqlen_q = 1 + int(rng() % 1200), seqlen_k = 1 + int(rng() % 1200);
    EXPECT_EQ((check_unmasked_steps<128, MaskKind::kCausal>(seqlen_q, seqlen_k, LocalMaskParams{}, &checked)), 0);
    EXPECT_EQ((check_unmasked_steps<192, MaskKind::kCausal>(seqlen_q, seqlen_k, LocalMaskParams{}, &checked)), 0);
    LocalMaskParams local;
    local.window_left = rng() % 4 == 0 ? -1 : int(rng() % 700);
    local.window_right = rng() % 4 == 0 ? -1 : int(rng() % 700);
    local.num_sink_tokens = local.window_left >= 0 && rng() % 2 ? int(rng() % 300) : 0;
    local.chunk = local.num_sink_tokens == 0 && rng() % 4 == 0 ? 1 + int(rng() % 600) : 0;
    // Sink blocks and chunks are masked whole walks or blocks at a time: no count to expect there.
    const bool exact = local.chunk == 0 && local.num_sink_tokens == 0;
    const int left_128 = check_unmasked_steps<128, MaskKind::kLocal>(seqlen_q, seqlen_k, local, &checked);
    const int left_192 = check_unmasked_steps<192, MaskKind::kLocal>(seqlen_q, seqlen_k, local, &checked);
    if (exact) {
      EXPECT_EQ(left_128, 0);
      EXPECT_EQ(left_192, 0);
    }
  }
  EXPECT_GT(checked, 100000);  // the trials walked many blocks
}

TEST(TransposedMask, KeysPastTheSequenceSeeNoRow) {
  const SeqlenInfo seq{100, 130, 100, 130};
  const AttentionMask<kBlockM, kBlockN, MaskKind::kNone> mask(seq);
  for (int col = 130; col < 256; ++col) {
    int lo = 0, hi = 0;
    mask.rows_seeing(col, lo, hi);
    EXPECT_GT(lo, hi) << col;
  }
  int lo = 0, hi = 0;
  mask.rows_seeing(129, lo, hi);
  EXPECT_LE(lo, 0);
  EXPECT_GE(hi, 127);
}

}  // namespace
