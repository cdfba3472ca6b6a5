// Which scores a query row may see, as one policy type that every mainloop takes: the key blocks
// a query block visits (forward, dQ kernel), the query blocks a key block visits (dK/dV kernel),
// which of those blocks hold an invisible score, masking a score tile, and what the deterministic
// backward counts. Rows and columns are aligned at the bottom-right: with off = seqlen_k - seqlen_q
// and p = row + off, row `row` sees key j iff j < seqlen_k and
//   kCausal: j <= p;
//   kLocal:  (wl < 0 or j >= p - wl or j < num_sink_tokens) and (wr < 0 or j <= p + wr) and, with
//            chunk c > 0, floor(p / c) * c <= j < floor(p / c) * c + c.
// Masks are applied only to the blocks that cross a boundary; blocks wholly outside are skipped.
// With grouped rows (kGrouping, the forward kernels with a KV cache's code: packed GQA over several
// query tokens, plan/packed_decode.hpp), rows r * g .. r * g + g - 1 are query position r, g =
// rows_per_token, and seqlen_q counts rows: p = row / g + seqlen_k - seqlen_q / g.
#pragma once

#include <cmath>

#include <cute/tensor.hpp>

#include "hopper/common/forward_features.hpp"
#include "hopper/common/mask_kind.hpp"
#include "hopper/common/seqlen.hpp"
#include "hopper/common/utils.hpp"

namespace flashhopper::hopper {

using namespace cute;

// A mask's run-time parameters: a kLocal mask's bounds (the other kinds ignore them), and the rows
// of a query position (read by the kernels that group rows only).
struct LocalMaskParams {
  int window_left = -1;  // -1: unbounded
  int window_right = -1;
  int num_sink_tokens = 0;
  int chunk = 0;  // 0: none
  // Read by RowGrouping::kDivide's kernels (the qv ones with the KV cache's code), whose mask
  // divides by it row by row. A plain division: cutlass::FastDivmod's multiplier and shift cost
  // those kernels registers (qv causal general: 112/5 -> 176/30 stack / local ops in the loop).
  int rows_per_token = 1;
  int rows_per_token_log2 = 0;  // RowGrouping::kShift's: rows_per_token is 1 << this
};

CUTLASS_HOST_DEVICE int floor_div(int a, int b) { return a >= 0 ? a / b : -((-a + b - 1) / b); }
CUTLASS_HOST_DEVICE int ceil_div_pos(int a, int b) { return a <= 0 ? 0 : (a + b - 1) / b; }

template <int kBlockM, int kBlockN, MaskKind kKind, RowGrouping kGrouping = RowGrouping::kNone>
struct AttentionMask {
  static constexpr bool kGroupedRows = kGrouping != RowGrouping::kNone;
  static constexpr bool kCausal = kKind == MaskKind::kCausal;
  static constexpr bool kLocal = kKind == MaskKind::kLocal;
  int seqlen_q;
  int seqlen_k;
  LocalMaskParams local;

  CUTLASS_HOST_DEVICE AttentionMask(SeqlenInfo const& seq, LocalMaskParams const& local_ = {})
      : seqlen_q(seq.seqlen_q), seqlen_k(seq.seqlen_k), local(local_) {}

  CUTLASS_HOST_DEVICE int offset() const { return seqlen_k - query_token(seqlen_q); }
  // The query position of a row, aligned with the keys (p above).
  CUTLASS_HOST_DEVICE int position(int row) const { return query_token(row) + offset(); }
  // The query token of a row (rows are never negative).
  CUTLASS_HOST_DEVICE int query_token(int row) const {
    if constexpr (kGrouping == RowGrouping::kDivide) return row / local.rows_per_token;
    if constexpr (kGrouping == RowGrouping::kShift) return row >> local.rows_per_token_log2;
    return row;
  }
  CUTLASS_HOST_DEVICE bool has_sinks() const { return kLocal && local.num_sink_tokens > 0; }

  // ---- Visible key columns [lo, hi) of the rows [row_first, row_last] (their union) --------------
  // (Exact: each row's visible columns are an interval whose ends grow with the row, so the union
  // is [lo(first), hi(last)). The sink tokens come on top of it, below lo.)
  CUTLASS_HOST_DEVICE int cols_lo(int row_first) const {
    if constexpr (!kLocal) {
      return 0;
    } else {
      const int p = position(row_first);
      int lo = local.window_left < 0 ? 0 : p - local.window_left;
      if (local.chunk > 0) lo = max(lo, floor_div(p, local.chunk) * local.chunk);
      return max(lo, 0);
    }
  }
  CUTLASS_HOST_DEVICE int cols_hi(int row_last) const {
    const int p = position(row_last);
    int hi = seqlen_k;
    if constexpr (kCausal) hi = min(hi, p + 1);
    if constexpr (kLocal) {
      if (local.window_right >= 0) hi = min(hi, p + local.window_right + 1);
      if (local.chunk > 0) hi = min(hi, floor_div(p, local.chunk) * local.chunk + local.chunk);
    }
    return max(hi, 0);
  }

  // ---- Forward and dQ kernel: the key blocks query block m_block visits ------------------------
  // The window's blocks [n_min, n_max), visited from the last down, then the sink tokens' blocks
  // below n_min (kLocal with sinks), from the last down.
  struct KeyBlocks {
    int n_min;
    int n_max;
    int num_sink_blocks;  // blocks [0, num_sink_blocks), all below n_min
    CUTLASS_HOST_DEVICE int count() const { return max(n_max - n_min, 0) + num_sink_blocks; }
    // The i-th block of the walk, i in [0, count()).
    CUTLASS_HOST_DEVICE int at(int i) const {
      const int window = max(n_max - n_min, 0);
      return i < window ? n_max - 1 - i : num_sink_blocks - 1 - (i - window);
    }
    // Split-KV: split `split` of `num_splits` walks consecutive parts of ceil(count / num_splits)
    // blocks (the last ones may be short or empty), as a walk of the same form, so that the
    // mainloops keep three registers for it: a part that would end among the sink blocks takes
    // them all (a block or two: sink tokens are few).
    CUTLASS_HOST_DEVICE KeyBlocks split(int split, int num_splits) const {
      const int window = max(n_max - n_min, 0), total = count();
      const int per_split = (total + num_splits - 1) / num_splits;
      auto snap = [&](int i) { return i <= window ? i : total; };
      const int begin = snap(min(split * per_split, total)), end = snap(min((split + 1) * per_split, total));
      KeyBlocks part;
      part.n_max = n_max - begin;
      if (begin >= end) {  // empty
        part.n_min = part.n_max;
        part.num_sink_blocks = 0;
      } else if (end <= window) {  // within the window
        part.n_min = n_max - end;
        part.num_sink_blocks = 0;
      } else {  // the window's rest and every sink block
        part.n_min = n_min;
        part.num_sink_blocks = num_sink_blocks;
      }
      return part;
    }
  };
  CUTLASS_HOST_DEVICE KeyBlocks key_blocks(int m_block) const {
    const int row_first = m_block * kBlockM;
    const int row_last = min(row_first + kBlockM, seqlen_q) - 1;
    KeyBlocks b;
    if (row_first >= seqlen_q) {  // rows past the used ones (seqused_q): they see nothing
      b.n_min = b.n_max = b.num_sink_blocks = 0;
      return b;
    }
    const int lo = cols_lo(row_first), hi = cols_hi(row_last);
    b.n_min = lo / kBlockN;
    b.n_max = lo < hi ? ceil_div_pos(hi, kBlockN) : b.n_min;
    b.num_sink_blocks = 0;
    if (has_sinks()) {
      // Sink keys are visible within the right bound, to rows whose window starts past them.
      const int sink_hi = min(local.num_sink_tokens, cols_hi(row_last));
      b.num_sink_blocks = min(ceil_div_pos(sink_hi, kBlockN), b.n_min);
    }
    return b;
  }

  // ---- dK/dV kernel: the query blocks key block n_block visits, [m_min, m_max) ------------------
  CUTLASS_DEVICE void query_blocks(int n_block, int& m_min, int& m_max) const {
    static_assert(!kGroupedRows, "the backward does not group rows");
    const int col_first = n_block * kBlockN;
    const int col_last = min(col_first + kBlockN, seqlen_k) - 1;
    if (col_first >= seqlen_k) {  // keys past the used ones (seqused_k): no row sees them
      m_min = m_max = 0;
      return;
    }
    int p_min = -(1 << 30), p_max = 1 << 30;  // rows p (= row + offset) that see a column of the block
    if constexpr (kCausal) p_min = col_first;
    if constexpr (kLocal) {
      if (local.window_right >= 0) p_min = col_first - local.window_right;
      const bool sinks_here = col_first < local.num_sink_tokens;
      if (local.window_left >= 0 && !sinks_here) p_max = col_last + local.window_left;
      if (local.chunk > 0) {
        p_min = max(p_min, floor_div(col_first, local.chunk) * local.chunk);
        p_max = min(p_max, floor_div(col_last, local.chunk) * local.chunk + local.chunk - 1);
      }
    }
    const int row_min = max(p_min - offset(), 0);
    const int row_end = int(min<int64_t>(int64_t(p_max) - offset() + 1, seqlen_q));  // exclusive
    m_min = row_min / kBlockM;
    m_max = row_min < row_end ? ceil_div_pos(row_end, kBlockM) : m_min;
  }

  // Deterministic backward: how many key blocks below n_block add to query block m_block's dQ
  // before it does (the key blocks visiting a query block are the ones key_blocks() gives it).
  CUTLASS_DEVICE int key_blocks_before(int m_block, int n_block) const {
    if constexpr (!kLocal) {
      return n_block;
    } else {
      // The visitors: the sink tokens' blocks [0, num_sink_blocks), then the window's [n_min, n_max).
      const KeyBlocks b = key_blocks(m_block);
      return n_block < b.n_min ? n_block : n_block - b.n_min + b.num_sink_blocks;
    }
  }

  // ---- Which blocks need masking --------------------------------------------------------------
  // True when block (m_block, n_block) holds a score that some row of the tile may not see.
  CUTLASS_HOST_DEVICE bool crosses_boundary(int m_block, int n_block) const {
    const int col_first = n_block * kBlockN, col_last = col_first + kBlockN - 1;
    if (col_last >= seqlen_k) return true;
    const int row_first = m_block * kBlockM, row_last = row_first + kBlockM - 1;
    if constexpr (kCausal) return col_last > position(row_first);
    if constexpr (kLocal) {
      // Wholly visible iff every row's interval covers the block: the first row's right end and
      // the last row's left end bound it (a chunk boundary inside the rows always masks).
      if (col_last >= cols_hi(row_first)) return true;
      if (col_first < cols_lo(row_last)) return true;
      if (local.chunk > 0 &&
          floor_div(position(row_first), local.chunk) != floor_div(position(row_last), local.chunk))
        return true;
    }
    return false;
  }

  // The forward's walk b of query block m_block: its steps [*i_begin, *i_end), window blocks that
  // cross no boundary (crosses_boundary false for each), so that the loop there carries no masking
  // code. crosses_boundary's bounds as ranges of blocks; the sink blocks after the window count as
  // crossing, as does every block of a tile whose rows straddle a chunk boundary.
  CUTLASS_HOST_DEVICE void unmasked_steps(KeyBlocks const& b, int m_block, int& i_begin, int& i_end) const {
    const int row_first = m_block * kBlockM, row_last = row_first + kBlockM - 1;
    const int n_end = min(cols_hi(row_first) / kBlockN, b.n_max);  // blocks below: every column <= the right end
    int n_begin = b.n_min;
    bool none = false;
    if constexpr (kLocal) {
      n_begin = max(n_begin, ceil_div_pos(cols_lo(row_last), kBlockN));  // at or past the left end
      none = local.chunk > 0 &&
             floor_div(position(row_first), local.chunk) != floor_div(position(row_last), local.chunk);
    }
    if (none || n_end <= n_begin) {
      i_begin = i_end = 0;
    } else {  // step i visits block b.n_max - 1 - i
      i_begin = b.n_max - n_end;
      i_end = b.n_max - n_begin;
    }
  }

  // Causal: a walk's steps that cross a boundary all come first (the diagonal's blocks, and those a
  // CTA pair's shared walk takes past this tile's diagonal), so the walk is two runs: the first step
  // of the unmasked run (b.count() where every step crosses), from which none does.
  CUTLASS_HOST_DEVICE int first_unmasked_step(KeyBlocks const& b, int m_block) const {
    static_assert(kCausal, "a causal walk's unmasked steps run to its end; a window's may not");
    int i_begin, i_end;
    unmasked_steps(b, m_block, i_begin, i_end);
    return i_begin < i_end ? i_begin : b.count();
  }

  // ---- The backward's walk over a key block's query blocks ------------------------------------
  // The i-th query block of key block n_block's walk over [m_block_min, m_block_max), the same in
  // the producer, the MMA warpgroups and the dQ writer. Causal walks down from the last block to
  // the diagonal, so that all key blocks of a head, which all reach the last block, visit the same
  // block at the same step, as in non-causal: they share its Q and dO in L2, and in deterministic
  // mode key block n adds to dQ one hand-off after key block n - 1 instead of waiting for its
  // whole walk down to the diagonal (walking up, key block n started at block n, which key block
  // 0 reaches at step n).
  CUTLASS_HOST_DEVICE static int query_block_at(int m_block_min, int m_block_max, int i) {
    return kCausal ? m_block_max - 1 - i : m_block_min + i;
  }

  // The walk itself, in query_block_at's order: step(m_block, masked) for each query block, where
  // `masked` says whether the block crosses a mask boundary or the key padding. Causal and local
  // split the walk into runs of a compile-time masked (true_type) or unmasked (false_type) kind,
  // so that the unmasked runs, the hot ones, carry no masking code; the other kinds mask only for
  // padding, which is the same for every block of the walk, and pass a run-time bool (a split
  // made them slower).
  template <class Step>
  CUTLASS_DEVICE void for_each_query_block(int n_block, int m_block_min, int m_block_max, Step&& step) const {
    if constexpr (kCausal) {
      // Down: the unmasked blocks, then the masked ones at the diagonal.
      const int m_masked_end = masked_query_blocks_end(n_block, m_block_min, m_block_max);
      CUTLASS_PRAGMA_NO_UNROLL
      for (int m_block = m_block_max - 1; m_block >= m_masked_end; --m_block) step(m_block, cute::false_type{});
      CUTLASS_PRAGMA_NO_UNROLL
      for (int m_block = m_masked_end - 1; m_block >= m_block_min; --m_block) step(m_block, cute::true_type{});
    } else if constexpr (kLocal) {
      // A window masks the query blocks at both ends of the range: three runs.
      int full_begin, full_end;
      unmasked_query_blocks(n_block, m_block_min, m_block_max, full_begin, full_end);
      CUTLASS_PRAGMA_NO_UNROLL
      for (int m_block = m_block_min; m_block < full_begin; ++m_block) step(m_block, cute::true_type{});
      CUTLASS_PRAGMA_NO_UNROLL
      for (int m_block = full_begin; m_block < full_end; ++m_block) step(m_block, cute::false_type{});
      CUTLASS_PRAGMA_NO_UNROLL
      for (int m_block = full_end; m_block < m_block_max; ++m_block) step(m_block, cute::true_type{});
    } else {
      const bool padded = crosses_boundary(m_block_min, n_block);  // the same for every m_block
      CUTLASS_PRAGMA_NO_UNROLL
      for (int m_block = m_block_min; m_block < m_block_max; ++m_block) step(m_block, padded);
    }
  }

  // Causal: the walk's masked query blocks form the start of [m_block_min, m_block_max); where
  // that run ends (m_block_max when the key block holds padding).
  CUTLASS_DEVICE int masked_query_blocks_end(int n_block, int m_block_min, int m_block_max) const {
    static_assert(kCausal && !kGroupedRows);
    const int last_col = (n_block + 1) * kBlockN - 1;
    if (last_col >= seqlen_k) return m_block_max;
    const int diagonal = last_col - offset();  // crossed while m * kBlockM < diagonal
    const int end = diagonal > 0 ? (diagonal + kBlockM - 1) / kBlockM : m_block_min;
    return max(m_block_min, min(end, m_block_max));
  }

  // kLocal: the query blocks [*full_begin, *full_end) within [m_block_min, m_block_max)
  // that see the whole key block (the window's both bounds clear of it, no padding), so that the
  // walk can skip the mask there; the masked ones lie before and after. Conservative: a chunk or
  // sink tokens in the block mask the whole walk.
  CUTLASS_DEVICE void unmasked_query_blocks(int n_block, int m_block_min, int m_block_max, int& full_begin,
                                            int& full_end) const {
    static_assert(kLocal && !kGroupedRows);
    const int col_first = n_block * kBlockN, col_last = col_first + kBlockN - 1;
    full_begin = full_end = m_block_max;
    if (col_last >= seqlen_k || local.chunk > 0 || col_first < local.num_sink_tokens) return;
    // Right bound: every row's p + wr reaches col_last, i.e. m * kBlockM >= col_last - off - wr.
    int begin = m_block_min;
    if (local.window_right >= 0) begin = max(begin, ceil_div_pos(col_last - offset() - local.window_right, kBlockM));
    // Left bound: every row's p - wl stays at or below col_first, i.e. (m + 1) * kBlockM - 1 + off - wl <= col_first.
    int end = m_block_max;
    if (local.window_left >= 0) end = min(end, floor_div(col_first - offset() + local.window_left + 1, kBlockM));
    full_begin = min(begin, m_block_max);
    full_end = max(full_begin, min(end, m_block_max));
  }

  // ---- Masking a score tile -------------------------------------------------------------------
  // s: scores (rows, cols) in registers; coords: the matching (row, col) tile coordinates.
  template <class TensorS, class TensorCoord>
  CUTLASS_DEVICE void apply(TensorS& s, TensorCoord const& coords, int m_block, int n_block) const {
    const int row0 = m_block * kBlockM;
    const int col0 = n_block * kBlockN;
    CUTLASS_PRAGMA_UNROLL
    for (int m = 0; m < size<0>(s); ++m) {
      const int row = row0 + get<0>(coords(m, 0));
      // Visible columns of the row, relative to the block: [col_begin, col_end), plus the sinks.
      int col_end = seqlen_k - col0;
      int col_begin = 0;
      int sink_end = 0;
      if constexpr (kCausal) col_end = min(col_end, position(row) + 1 - col0);
      if constexpr (kLocal) {
        col_end = min(col_end, cols_hi(row) - col0);
        col_begin = cols_lo(row) - col0;
        if (local.num_sink_tokens > 0) sink_end = min(local.num_sink_tokens - col0, col_end);
      }
      CUTLASS_PRAGMA_UNROLL
      for (int n = 0; n < size<1>(s); ++n) {
        const int col = get<1>(coords(m, n));
        bool invisible = col >= col_end;
        if constexpr (kLocal) invisible = invisible || (col < col_begin && col >= sink_end);
        if (invisible) s(m, n) = -INFINITY;
      }
    }
  }

  // ---- Transposed score tiles (the backward's kSdPTransposed): the query rows a key sees --------
  // Rows [lo, hi] see key col (lo > hi: none): apply's bounds inverted, for rows without grouping.
  // Position p sees col iff col < seqlen_k, col < col_end(p) and (col >= col_begin(p) or col is a
  // sink token); both ends grow with p, so the rows form one interval. Rows are at least 0 and at
  // most seqlen_q + kBlockM (padding), so the bounds start at those rows' positions.
  CUTLASS_HOST_DEVICE void rows_seeing(int col, int& lo, int& hi) const {
    static_assert(!kGroupedRows, "rows_seeing: rows without grouping only");
    int p_lo = offset(), p_hi = seqlen_k + kBlockM;
    if (col >= seqlen_k) p_lo = p_hi + 1;
    if constexpr (kCausal) p_lo = max(p_lo, col);  // col < p + 1
    if constexpr (kLocal) {
      const bool sink = col < local.num_sink_tokens;
      if (local.window_right >= 0) p_lo = max(p_lo, col - local.window_right);   // col <= p + wr
      if (local.window_left >= 0 && !sink) p_hi = min(p_hi, col + local.window_left);  // col >= p - wl
      if (local.chunk > 0) {  // chunk(p) = chunk(col), the lower end waived for sinks
        const int first = floor_div(col, local.chunk) * local.chunk;
        p_lo = max(p_lo, first);
        if (!sink) p_hi = min(p_hi, first + local.chunk - 1);
      }
    }
    lo = p_lo - offset();
    hi = p_hi - offset();
  }

  // Masking a score tile by its keys: s and coords as apply's, for tiles whose threads hold many
  // rows and few keys (two bounds a key instead of a row's bounds each).
  template <class TensorS, class TensorCoord>
  CUTLASS_DEVICE void apply_by_key(TensorS& s, TensorCoord const& coords, int m_block, int n_block) const {
    const int row0 = m_block * kBlockM;
    const int col0 = n_block * kBlockN;
    CUTLASS_PRAGMA_UNROLL
    for (int n = 0; n < size<1>(s); ++n) {
      int lo, hi;
      rows_seeing(col0 + get<1>(coords(0, n)), lo, hi);
      CUTLASS_PRAGMA_UNROLL
      for (int m = 0; m < size<0>(s); ++m) {
        const int row = row0 + get<0>(coords(m, n));
        if (row < lo || row > hi) s(m, n) = -INFINITY;
      }
    }
  }
};

}  // namespace flashhopper::hopper
