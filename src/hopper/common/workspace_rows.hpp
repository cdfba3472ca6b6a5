// The backward's per-row float32 buffers (LSE * log2 e, D, dQaccum, the dQ semaphores): where a
// (sequence, query head)'s rows start. Dense: [batch, heads_q, rows_padded]. Packed (varlen):
// [heads_q, rows_padded], sequence b at padded_offset(cu_seqlens_q[b], b), which rounds its start
// down to a multiple of kRowAlign after shifting it by b * kRowAlign; so every sequence owns
// round_up(capacity, kRowAlign) rows that no other sequence touches, and the main kernel's
// loads and dQ tiles need no bounds checks.
#pragma once

#include <cstdint>

#include <cutlass/cutlass.h>

#include "hopper/common/seqlen.hpp"

namespace flashhopper::hopper {

// dQaccum tiles are stored in the order the MMA warpgroups hold them, so registers -> shared or
// global memory is one conflict-free float4 per thread per step: warpgroup w owns the tile's
// half w; in it, the thread's values v = 4r .. 4r + 3 sit at r * 512 + thread * 4.
template <int kTileFloats>
CUTLASS_HOST_DEVICE constexpr int dq_accum_offset(int warp_group, int thread_in_group, int r) {
  return warp_group * (kTileFloats / 2) + r * 512 + thread_in_group * 4;
}

struct BackwardWorkspacePointers {
  // A multiple of every backward kBlockM.
  static constexpr int kRowAlign = 128;

  float* lse_log2;    // LSE * log2 e; +inf where a row sees no key (so P = 0 there)
  float* dpsum;       // D = rowsum(dO * O)
  float* dq_accum;    // partial dQ sums, each kBlockM x d tile in the order dq_accum_offset gives
  int* dq_semaphore;  // deterministic mode: key blocks added so far, per kBlockM rows
  int rows_padded;    // rows of a (batch, head), or of a head when packed
  bool packed;
  int heads_q;

  CUTLASS_HOST_DEVICE static int64_t padded_offset(int offset, int batch) {
    return (int64_t(offset) + int64_t(batch) * kRowAlign) / kRowAlign * kRowAlign;
  }
  // The first row of (seq, head).
  CUTLASS_HOST_DEVICE int64_t row0(SeqlenInfo const& seq, int head) const {
    if (packed) return int64_t(head) * rows_padded + padded_offset(seq.offset_q, seq.batch);
    return (int64_t(seq.batch) * heads_q + head) * rows_padded;
  }
  // Rows a packed head needs for `batch` sequences of total_q tokens in all.
  static int64_t packed_rows(int64_t total_q, int64_t batch) {
    return (total_q + (batch + 1) * kRowAlign + kRowAlign - 1) / kRowAlign * kRowAlign;
  }
};

}  // namespace flashhopper::hopper
