// Where the backward's float32 buffers sit in the caller's workspace. Host code, shared by the
// workspace query and the launch.
#pragma once

#include <cstddef>
#include <cstdint>

#include "api/problem_shape.hpp"

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
  size_t dq_semaphore = 0;
  size_t bytes = 0;
};

inline BackwardWorkspaceLayout backward_workspace_layout(const detail::ProblemShape& s) {
  auto align = [](size_t bytes) { return (bytes + 255) / 256 * 256; };
  BackwardWorkspaceLayout w;
  w.rows_padded = (s.seqlen_q + w.kRowAlign - 1) / w.kRowAlign * w.kRowAlign;
  const size_t rows = size_t(s.batch) * s.heads_q * w.rows_padded;
  w.lse_log2 = 0;
  w.dpsum = align(rows * sizeof(float));
  w.dq_accum = w.dpsum + align(rows * sizeof(float));
  w.dq_semaphore = w.dq_accum + align(rows * s.head_dim * sizeof(float));
  w.bytes = w.dq_semaphore + align(rows / w.kSemaphoreRows * sizeof(int32_t));
  return w;
}

}  // namespace flashhopper::launch
