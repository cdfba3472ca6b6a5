// The tile list of a packed (varlen) batch, planned on the device before the attention kernel
// (one CTA; no host synchronisation, no host copy of cu_seqlens, so calls can be captured in CUDA
// graphs). Order, for PersistentTileScheduler's CTAs that take tiles i, i + grid, ...:
// - sequences by the length of their tiles' other axis, longest first (a tile's work grows with
//   it), so that a long sequence never trails alone in the last wave;
// - within a sequence, its heads in sections whose streamed bytes (K and V in the forward, a key
//   head's Q and dO in the backward) fit the L2 budget, a section's tiles together; within a
//   section block by block, every head of the section at each block (the CTAs running together
//   share the section's data in L2);
// - blocks lowest first, or highest first where the dense scheduler gives the highest first
//   (causal), so that the kernels' causal walks see the same order either way. In the dK/dV
//   kernel a head's lower key blocks thus always come no later, which its deterministic dQ turns
//   rely on.
// At most max_tiles tiles (the workspace's capacity, from the tensors' sizes) are written; the
// clamped SeqlenInfo keeps that bound whatever cu_seqlens hold.
#pragma once

#include <cstdint>

#include <cutlass/cutlass.h>

#include "hopper/common/seqlen.hpp"
#include "hopper/common/tile_scheduler.hpp"

namespace flashhopper::hopper {

struct VarlenTilePlanner {
  static constexpr int kThreads = 512;
  static constexpr int kMaxBatch = 8192;  // sequences sorted in shared memory

  struct Params {
    SeqlenParams seqlen;
    int batch;
    int heads;          // tile heads: query heads, or key heads for the dK/dV kernel
    int block_rows;     // rows of a tile's block (kBlockM, or kBlockN over keys)
    bool key_blocks;    // blocks run over the keys (dK/dV kernel), else over the queries
    bool highest_first; // blocks from the highest down
    int64_t l2_budget_bytes;          // what a section's heads may stream together
    int64_t streamed_bytes_per_row;   // per head and row of the other axis
    int max_tiles;
    PlannedTile* tiles;
    int* num_tiles;
  };

  static constexpr int batch_capacity(int batch) {
    int p = 1;
    while (p < batch) p *= 2;
    return p;
  }
  // Dynamic shared memory: the sort keys (a power of two of them), each sequence's tile count and
  // the tile offsets of the sorted sequences.
  static size_t shared_bytes(int batch) {
    return size_t(batch_capacity(batch)) * sizeof(uint64_t) + size_t(batch) * sizeof(int) +
           size_t(batch + 1) * sizeof(long long);
  }

  // The plan, by the CTA's kThreads threads (defined in src/launch/varlen_plan.cu, its one user).
  CUTLASS_DEVICE void operator()(Params const& p, char* smem) const;
};

}  // namespace flashhopper::hopper
