// What a forward kernel is compiled to handle beyond a dense batch. Each feature is a compile-time
// switch of the kernel, its collectives and its scheduler, so that a dense call runs a kernel that
// carries none of their code: as run-time branches they cost the dense forward 6-21% (more
// registers, spills in the key-block loop, the tile and the WGMMA descriptors out of uniform
// registers; bench/RESULTS.md, "the dense forward's lost speed"). The manifest
// (scripts/kernel_manifest.py, FORWARD_FEATURE_SETS) says which sets are compiled; the dispatch
// runs a call on the first compiled set that holds every feature it uses.
#pragma once

#include <cstdint>

namespace flashhopper::hopper {

enum class ForwardFeatures : uint32_t {
  kNone = 0,
  kPacked = 1u << 0,   // cu_seqlens or seqused: packed rows, used lengths, the planned tile list
  kSplitKv = 1u << 1,  // num_splits > 1: float32 partials of each split of the keys
  kKvCache = 1u << 2,  // cache_seqlens, cache_leftpad, cache_batch_idx (and the append before);
                       // query rows grouped by token (packed GQA over several tokens)
  kPagedKv = 1u << 3,  // page_table: K and V by page, in TMA chunks or gathered
  kAll = (1u << 4) - 1,
  // qv (absorbed MLA): S = Q K^T + Qv V^T. Not in kAll: only the families the manifest marks qv
  // compile it (both their sets carry it), and they run calls with qv only.
  kQv = 1u << 4,
};

constexpr ForwardFeatures operator|(ForwardFeatures a, ForwardFeatures b) {
  return ForwardFeatures(uint32_t(a) | uint32_t(b));
}
// Whether `set` holds every feature of `features`.
constexpr bool holds(ForwardFeatures set, ForwardFeatures features) {
  return (uint32_t(set) & uint32_t(features)) == uint32_t(features);
}
// Whether a kernel of this set writes the lse of query rows grouped by token (packed GQA over
// several query tokens, plan/packed_decode.hpp): the qv families' with the KV cache's code. The
// other kernels with that code run such calls through float32 partials and the combine.
constexpr bool groups_query_rows(ForwardFeatures set) {
  return holds(set, ForwardFeatures::kKvCache) && holds(set, ForwardFeatures::kQv);
}

// How a kernel's mask finds the query token of a row when rows are grouped by token
// (rows_per_token g: rows t * g .. t * g + g - 1 are token t).
enum class RowGrouping {
  kNone,    // a row is a token: the dense kernels, the backward
  kDivide,  // row / g, any g: the qv kernels with the KV cache's code (absorbed MLA: g = query heads)
  kShift,   // row >> log2(g), g a power of two: the other kernels with the KV cache's code. These
            // also run packed prefill, which an integer division (or FastDivmod's registers) cost
            // 5-8% (bench/RESULTS.md, 2026-12-06 evening); a shift by a parameter is one instruction.
};
constexpr RowGrouping query_row_grouping(ForwardFeatures set) {
  if (!holds(set, ForwardFeatures::kKvCache)) return RowGrouping::kNone;
  return holds(set, ForwardFeatures::kQv) ? RowGrouping::kDivide : RowGrouping::kShift;
}

}  // namespace flashhopper::hopper
