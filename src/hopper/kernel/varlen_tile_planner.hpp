// The tile list of a packed (varlen) batch, planned on the device before the attention kernel
// (no host synchronisation, no host copy of cu_seqlens, so calls can be captured in CUDA graphs;
// every CTA sorts the sequences, then each thread places tiles, so planning takes microseconds).
// It reproduces the dense scheduler's order (tile_scheduler.hpp) over sequences of different
// lengths:
// - the (sequence, head) pairs in sequence order, sequences with the most blocks first, cut into
//   sections of at least section_tiles tiles (four waves, or what fits half the L2) at pair
//   boundaries;
// - within a section block rank by block rank, every pair that has the rank at each one, so that
//   the CTAs of a wave get tiles of the same length (causal: the longest first), the short ones
//   fill the last wave, and a section's pairs share their K/V (or Q/dO) in L2;
// - block rank r is block r, or the highest block minus r where the dense scheduler gives the
//   highest first (causal), so that the kernels see the same order either way. In the dK/dV
//   kernel a head's lower key blocks thus always come no later, which its deterministic dQ
//   turns rely on.
// PersistentTileScheduler's CTAs take the entries in order as they become free (a counter),
// so the list needs no snake. A split-KV forward plans num_splits tiles a block, one a split: the
// order above over (block, split) pairs, a block's splits at consecutive ranks.
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
  static constexpr int kMaxCtas = 128;

  struct Params {
    SeqlenParams seqlen;
    int batch;
    int heads;          // tile heads: query heads, or key heads for the dK/dV kernel
    int block_rows;     // rows of a tile's block (kBlockM, or kBlockN over keys)
    bool key_blocks;    // blocks run over the keys (dK/dV kernel), else over the queries
    bool highest_first; // blocks from the highest down
    int section_tiles;  // the fewest tiles a section spans
    int max_tiles;
    PlannedTile* tiles;
    int* counters;      // [2]: the list's length, and the kernel's next entry (zeroed here)
    int num_splits = 1; // split-KV forward: tiles a block (max_tiles counts them)
  };

  static constexpr int batch_capacity(int batch) {
    int p = 1;
    while (p < batch) p *= 2;
    return p;
  }
  // Dynamic shared memory: the sort keys (a power of two of them) and the first tile of each
  // sorted sequence.
  static size_t shared_bytes(int batch) {
    return size_t(batch_capacity(batch)) * sizeof(uint64_t) + size_t(batch + 1) * sizeof(long long);
  }
  // About one tile a thread.
  static int grid_size(int max_tiles) {
    const int ctas = (max_tiles + kThreads - 1) / kThreads;
    return ctas < 1 ? 1 : ctas > kMaxCtas ? kMaxCtas : ctas;
  }

  // The plan, by grid_size() CTAs of kThreads threads (defined in src/launch/varlen_plan.cu, its
  // one user).
  CUTLASS_DEVICE void operator()(Params const& p, char* smem) const;
};

}  // namespace flashhopper::hopper
