// Where the backward's float32 buffers sit in the caller's workspace. Host code, shared by the
// workspace query and the launch.
#pragma once

#include <cstddef>
#include <cstdint>

#include "api/problem_shape.hpp"
#include "hopper/common/tile_size.hpp"

namespace flashhopper::launch {

struct BackwardWorkspaceLayout {
  // Rows per (batch, head) rounded up to a multiple of every backward kBlockM, so that the main
  // kernel's per-row loads and dQ tiles need no bounds checks.
  static constexpr int64_t kRowAlign = 128;
  static constexpr int64_t kSemaphoreRows = 64;  // the smallest kBlockM: one counter per query block

  int64_t rows_padded = 0;
  size_t lse_log2 = 0;  // byte offsets
  size_t dpsum = 0;
  size_t dq_accum = 0;  // dq_accum and the semaphores are contiguous: one memset zeroes both
  size_t dq_semaphore = 0;  // both empty where dQ has a kernel of its own (BackwardTileSize::kDqKernel)
  size_t dsink_partial = 0;  // the learnable sink's per-CTA gradient shares (empty without dsink)
  int64_t dsink_partials_per_head = 0;
  size_t bytes = 0;
};

// Whether the backward at this head dim computes dQ by the dQ kernel, which needs no dQaccum.
inline bool backward_dq_kernel(int64_t head_dim) {
  switch (head_dim) {
    case 64: return hopper::BackwardTileSize<64>::kDqKernel;
    case 128: return hopper::BackwardTileSize<128>::kDqKernel;
    case 256: return hopper::BackwardTileSize<256>::kDqKernel;
    default: return false;
  }
}

// The preprocess kernel's rows per CTA, each CTA writing one share of the sink's gradient.
inline constexpr int64_t kSinkRowsPerShare = 8;

inline BackwardWorkspaceLayout backward_workspace_layout(const detail::ProblemShape& s, bool dsink) {
  auto align = [](size_t bytes) { return (bytes + 255) / 256 * 256; };
  const bool dq_accum_used = !backward_dq_kernel(s.head_dim);
  BackwardWorkspaceLayout w;
  w.rows_padded = (s.seqlen_q + w.kRowAlign - 1) / w.kRowAlign * w.kRowAlign;
  const size_t rows = size_t(s.batch) * s.heads_q * w.rows_padded;
  w.lse_log2 = 0;
  w.dpsum = align(rows * sizeof(float));
  w.dq_accum = w.dpsum + align(rows * sizeof(float));
  w.dq_semaphore = w.dq_accum + (dq_accum_used ? align(rows * s.head_dim * sizeof(float)) : 0);
  w.dsink_partial = w.dq_semaphore + (dq_accum_used ? align(rows / w.kSemaphoreRows * sizeof(int32_t)) : 0);
  w.dsink_partials_per_head = dsink ? int64_t(s.batch) * w.rows_padded / kSinkRowsPerShare : 0;
  w.bytes = w.dsink_partial + align(size_t(s.heads_q * w.dsink_partials_per_head) * sizeof(float));
  return w;
}

}  // namespace flashhopper::launch
