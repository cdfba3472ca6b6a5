// Where the backward's float32 buffers sit in the caller's workspace. Host code, shared by the
// workspace query and the launch.
#pragma once

#include <cstddef>
#include <cstdint>

#include "plan/problem_shape.hpp"
#include "hopper/common/tile_size.hpp"
#include "hopper/common/workspace_rows.hpp"
#include "launch/varlen_plan.hpp"

namespace flashhopper::launch {

struct BackwardWorkspaceLayout {
  // Rows per sequence rounded up to a multiple of every backward kBlockM, so that the main
  // kernel's per-row loads and dQ tiles need no bounds checks (hopper/common/workspace_rows.hpp).
  static constexpr int64_t kRowAlign = hopper::BackwardWorkspacePointers::kRowAlign;
  static constexpr int64_t kSemaphoreRows = 64;  // the smallest kBlockM: one counter per query block

  int64_t rows_per_sequence = 0;  // max seqlen_q rounded up: the preprocess grid's rows a (sequence, head)
  int64_t rows_padded = 0;        // rows of a (batch, head); packed: of a head
  size_t main_tiles = 0;          // packed keys: the dK/dV kernel's planned tiles (else empty)
  int64_t max_main_tiles = 0;
  size_t dq_tiles = 0;            // packed queries with the dQ kernel: its planned tiles
  int64_t max_dq_tiles = 0;
  size_t lse_log2 = 0;  // byte offsets
  size_t dpsum = 0;
  size_t dq_accum = 0;  // dq_accum and the semaphores are contiguous: one memset zeroes both
  size_t dq_semaphore = 0;  // both empty where dQ has a kernel of its own (BackwardTileSize::kDqKernel)
  size_t dsink_partial = 0;  // the learnable sink's per-CTA gradient shares (empty without dsink)
  int64_t dsink_partials_per_head = 0;
  size_t bytes = 0;
};

// The preprocess kernel's rows per CTA, each CTA writing one share of the sink's gradient.
inline constexpr int64_t kSinkRowsPerShare = 64;

// kHeadDim: the compiled head dim the call runs on (dQaccum rows are that wide).
template <int kHeadDim>
BackwardWorkspaceLayout backward_workspace_layout(const detail::ProblemShape& s, bool dsink) {
  using Tile = hopper::BackwardTileSize<kHeadDim>;
  auto align = [](size_t bytes) { return (bytes + 255) / 256 * 256; };
  const bool dq_kernel = Tile::kDqKernel;
  const bool dq_accum_used = !dq_kernel;
  BackwardWorkspaceLayout w;
  w.rows_per_sequence = (s.seqlen_q + w.kRowAlign - 1) / w.kRowAlign * w.kRowAlign;
  w.rows_padded = s.varlen_q ? hopper::BackwardWorkspacePointers::packed_rows(s.total_q, s.batch) : w.rows_per_sequence;
  const size_t rows = size_t(s.varlen_q ? 1 : s.batch) * s.heads_q * w.rows_padded;
  if (s.varlen_k)
    w.max_main_tiles = max_planned_tiles(s.total_k, s.seqlen_k, s.batch, s.heads_kv, Tile::kBlockN);
  if constexpr (Tile::kDqKernel) {
    if (s.varlen_q)
      w.max_dq_tiles =
          max_planned_tiles(s.total_q, s.seqlen_q, s.batch, s.heads_q, hopper::BackwardDqTileSize<kHeadDim>::kBlockM);
  }
  w.main_tiles = 0;
  w.dq_tiles = w.main_tiles + (w.max_main_tiles > 0 ? planned_tiles_bytes(w.max_main_tiles) : 0);
  w.lse_log2 = w.dq_tiles + (w.max_dq_tiles > 0 ? planned_tiles_bytes(w.max_dq_tiles) : 0);
  w.dpsum = w.lse_log2 + align(rows * sizeof(float));
  w.dq_accum = w.dpsum + align(rows * sizeof(float));
  w.dq_semaphore = w.dq_accum + (dq_accum_used ? align(rows * kHeadDim * sizeof(float)) : 0);
  w.dsink_partial = w.dq_semaphore + (dq_accum_used ? align(rows / w.kSemaphoreRows * sizeof(int32_t)) : 0);
  w.dsink_partials_per_head = dsink ? int64_t(s.batch) * w.rows_per_sequence / kSinkRowsPerShare : 0;
  w.bytes = w.dsink_partial + align(size_t(s.heads_q * w.dsink_partials_per_head) * sizeof(float));
  return w;
}

}  // namespace flashhopper::launch
