// Which scores a query row may see: keys past the sequence end never, and with causal masking
// only keys j <= i + (seqlen_k - seqlen_q) (bottom-right aligned). Applied only to the key blocks
// that cross a boundary; the block range skips blocks wholly outside.
#pragma once

#include <cmath>

#include <cute/tensor.hpp>

#include "hopper/common/utils.hpp"

namespace flashhopper::hopper {

using namespace cute;

template <int kBlockM, int kBlockN, bool kCausal>
struct AttentionMask {
  int seqlen_q;
  int seqlen_k;

  // True when block (m_block, n_block) holds a score that some row of the tile may not see.
  CUTLASS_DEVICE bool crosses_boundary(int m_block, int n_block) const {
    const int last_col = (n_block + 1) * kBlockN - 1;
    if (last_col >= seqlen_k) return true;
    if constexpr (kCausal) return last_col > m_block * kBlockM + seqlen_k - seqlen_q;
    return false;
  }

  // The backward visits key block n_block's query blocks [m_block_min, m_block_max) and masks
  // only those that cross a boundary. They form the start of the range; this returns where that
  // run ends: m_block_max when the key block holds padding, else (causal) the first m for which
  // crosses_boundary(m, n_block) is false.
  CUTLASS_DEVICE int masked_query_blocks_end(int n_block, int m_block_min, int m_block_max) const {
    const int last_col = (n_block + 1) * kBlockN - 1;
    if (last_col >= seqlen_k) return m_block_max;
    int end = m_block_min;
    if constexpr (kCausal) {
      const int diagonal = last_col - (seqlen_k - seqlen_q);  // crossed while m * kBlockM < diagonal
      if (diagonal > 0) end = (diagonal + kBlockM - 1) / kBlockM;
    }
    return max(m_block_min, min(end, m_block_max));
  }

  // s: scores (rows, cols) in registers; coords: the matching (row, col) tile coordinates.
  template <class TensorS, class TensorCoord>
  CUTLASS_DEVICE void apply(TensorS& s, TensorCoord const& coords, int m_block, int n_block) const {
    const int row0 = m_block * kBlockM;
    const int col0 = n_block * kBlockN;
    CUTLASS_PRAGMA_UNROLL
    for (int m = 0; m < size<0>(s); ++m) {
      int col_end = seqlen_k - col0;  // first invisible column, relative to the block
      if constexpr (kCausal) {
        const int row = row0 + get<0>(coords(m, 0));
        col_end = min(col_end, row + seqlen_k - seqlen_q + 1 - col0);
      }
      CUTLASS_PRAGMA_UNROLL
      for (int n = 0; n < size<1>(s); ++n) {
        if (get<1>(coords(m, n)) >= col_end) s(m, n) = -INFINITY;
      }
    }
  }
};

// Key blocks [n_block_min, n_block_max) that query block m_block must visit.
template <int kBlockM, int kBlockN, bool kCausal>
CUTLASS_DEVICE void key_block_range(int seqlen_q, int seqlen_k, int m_block, int& n_block_min,
                                    int& n_block_max) {
  n_block_min = 0;
  int visible_cols = seqlen_k;
  if constexpr (kCausal) {
    const int rows_end = min((m_block + 1) * kBlockM, seqlen_q);
    visible_cols = max(0, min(seqlen_k, rows_end + seqlen_k - seqlen_q));
  }
  n_block_max = (visible_cols + kBlockN - 1) / kBlockN;
}

// Query blocks [m_block_min, m_block_max) that key block n_block must visit (the backward).
// With causal masking row i sees key j iff j <= i + seqlen_k - seqlen_q, so the first row that
// sees the block's first key is n_block * kBlockN - (seqlen_k - seqlen_q).
template <int kBlockM, int kBlockN, bool kCausal>
CUTLASS_DEVICE void query_block_range(int seqlen_q, int seqlen_k, int n_block, int& m_block_min,
                                      int& m_block_max) {
  m_block_min = 0;
  if constexpr (kCausal) m_block_min = max(0, n_block * kBlockN - (seqlen_k - seqlen_q)) / kBlockM;
  m_block_max = (seqlen_q + kBlockM - 1) / kBlockM;
}

}  // namespace flashhopper::hopper
