// Packed (varlen) batches: the tile list's place in the workspace and the planner's launch.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include <cuda_runtime_api.h>

#include "plan/problem_shape.hpp"
#include "hopper/kernel/varlen_tile_planner.hpp"

namespace flashhopper::launch {

// The most tiles a packed batch can have: every sequence (clamped to max_rows) adds at most one
// partial block to total_rows / block_rows.
inline int64_t max_planned_tiles(int64_t total_rows, int64_t max_rows, int64_t batch, int64_t heads, int block_rows) {
  const int64_t by_total = total_rows / block_rows + batch;
  const int64_t by_max = batch * ((max_rows + block_rows - 1) / block_rows);
  return (by_total < by_max ? by_total : by_max) * heads;
}

// Bytes of a tile list of max_tiles entries and its two counters (length, next entry), 256-aligned.
inline size_t planned_tiles_bytes(int64_t max_tiles) {
  return (size_t(max_tiles) * sizeof(hopper::PlannedTile) + 2 * sizeof(int) + 255) / 256 * 256;
}

// The kernels' view of a call's sequence lengths.
template <class Params>
hopper::SeqlenParams seqlen_params(const Params& p, const detail::ProblemShape& s) {
  hopper::SeqlenParams q;
  q.seqlen_q = int(s.seqlen_q);
  q.seqlen_k = int(s.seqlen_k);
  q.total_q = int(s.varlen_q ? s.total_q : s.seqlen_q);
  // Paged keys have no row axis for cu_seqlens_k to point into: only its differences count.
  q.total_k = s.paged && s.varlen_k ? INT32_MAX : int(s.varlen_k ? s.total_k : s.seqlen_k);
  q.keys_paged = s.paged;
  q.cu_seqlens_q = static_cast<int const*>(p.cu_seqlens_q.data);
  q.cu_seqlens_k = static_cast<int const*>(p.cu_seqlens_k.data);
  q.seqused_q = static_cast<int const*>(p.seqused_q.data);
  q.seqused_k = static_cast<int const*>(p.seqused_k.data);
  if constexpr (std::is_same_v<Params, ForwardParams>) {  // a dense KV cache
    q.cache_seqlens = static_cast<int const*>(p.cache_seqlens.data);
    q.cache_leftpad = static_cast<int const*>(p.cache_leftpad.data);
    q.cache_batch_idx = static_cast<int const*>(p.cache_batch_idx.data);
    q.seqlen_new = int(s.seqlen_new);
    q.cu_seqlens_new = static_cast<int const*>(p.cu_seqlens_k_new.data);
    if (s.varlen_q) q.q_rows_log2 = detail::rows_per_token_log2(s);  // packed GQA's rows a token
  }
  return q;
}

// The planner's section size (VarlenTilePlanner): four waves of tiles, or more where half the L2
// holds more blocks' streamed rows (bytes_per_row: what one row of the other axis streams a pair).
inline int planner_section_tiles(int num_sms, int l2_bytes, int block_rows, int64_t bytes_per_row) {
  const int64_t fitting = int64_t(l2_bytes) / 2 / (int64_t(block_rows) * bytes_per_row);
  return int(fitting > 4 * num_sms ? fitting : 4 * num_sms);
}

// Null when the planner can order this batch, else why not.
inline const char* varlen_batch_reason(const detail::ProblemShape& s) {
  if ((s.varlen_q || s.varlen_k) && s.batch > hopper::VarlenTilePlanner::kMaxBatch)
    return "varlen batches of more than 8192 sequences are not supported yet";
  return nullptr;
}

cudaError_t plan_varlen_tiles(const hopper::VarlenTilePlanner::Params& params, cudaStream_t stream);

}  // namespace flashhopper::launch
