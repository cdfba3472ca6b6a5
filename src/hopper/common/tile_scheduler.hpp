// Persistent tile scheduler: CTAs stride over the tiles (block, head, batch), where block is the
// query block of a forward tile and the key block of a backward one; a split-KV forward has
// num_splits tiles per query block, one per part of its keys (adjacent in the order). Packed (varlen) batches
// come as a list of tiles, longest first, that VarlenTilePlanner writes on the device before the
// kernel; a CTA takes its next entry from a counter when it is free (one of its threads takes it
// and hands it to the CTA's other roles through a TileRing), as tiles of several lengths do not
// balance statically (mixed lengths: the busiest CTA 8% above the mean with a snake).
// Dense ones are decoded from the tile index as follows. With causal masking the
// tiles are handed out longest first (highest block first; the backward reverses its key
// blocks so that this holds for it too), so that the short diagonal tiles fill the last wave
// instead of one long tile trailing alone, and in a
// snake order (odd waves run backwards over the CTAs), so that the CTA that got the longest tile
// of one wave gets the shortest of the next: a plain stride would give CTA 0 the longest tile of
// every wave, about 12% more work than the last CTA at 8k tokens. Longest-first alone would run
// 132 different heads at once and their K/V would not fit L2 (ncu: DRAM 78% busy at hdim 128,
// 2k, causal), so the (batch, head) pairs go in sections whose K/V fit half the L2, and the
// longest-first order holds within a section. A section also spans at least 4 waves of tiles:
// with fewer, one wave mixes the longest and shortest tiles of a head and the balance is lost
// (hdim 256, 16k, causal: 0.78 of cuDNN with one-head sections, 1.10 with one global order).
#pragma once

#include <algorithm>

#include <cutlass/arch/barrier.h>
#include <cutlass/cutlass.h>
#include <cutlass/fast_math.h>

namespace flashhopper::hopper {

struct WorkTile {
  int block;  // the tile's row block: a query block in the forward, a key block in the backward
  int head;
  int batch;
  bool valid;
  int split = 0;  // split-KV: which part of the block's keys
};

// A planned tile: block, head, batch (w unused; 16 bytes, one load). With split-KV the block is
// block * num_splits + split, as in a dense tile's index (a split in w cost the general kernels'
// key-block loop spills: scripts/kernel_resources.py).
using PlannedTile = int4;

// The tiles a CTA's taker thread takes, handed to every other thread of the CTA's roles (each
// receives each tile, then frees its slot). In shared memory, set up by one thread; receivers:
// all the roles' threads but the taker.
struct TileRing {
  static constexpr int kSlots = 4;
  using Barrier = cutlass::arch::ClusterBarrier;
  Barrier::ValueType full[kSlots];
  Barrier::ValueType empty[kSlots];
  int tile[kSlots];

  CUTLASS_DEVICE void init(int receivers) {
    for (int i = 0; i < kSlots; ++i) {
      Barrier::init(&full[i], 1);
      Barrier::init(&empty[i], receivers);
    }
  }
};

// kPlanned: packed batches may come (the planner's tile list, taken from a counter); kSplit:
// split-KV may come. Without them (a dense forward) a tile is only ever decoded from its index, so
// every thread of a warp provably holds the same one, and it stays in uniform registers.
// kClusterM > 1 (dense only): the CTAs of a cluster, adjacent in the grid, take adjacent blocks of
// one head: the order above runs over pairs of blocks and pairs of CTAs.
template <bool kLongestFirst, bool kPlanned = true, bool kSplit = true, int kClusterM = 1>
struct PersistentTileScheduler {
  static_assert(kClusterM == 1 || (!kPlanned && !kSplit), "clusters: dense tiles");
  struct Params {
    int num_blocks;  // row blocks times splits
    int num_tiles;
    int num_head_batch;     // heads * batch
    int heads_per_section;  // (batch, head) pairs whose K/V share the L2 (longest-first only)
    cutlass::FastDivmod block_divmod;  // over num_blocks
    cutlass::FastDivmod head_divmod;   // over num_heads
    PlannedTile const* planned = nullptr;  // packed batches: the planner's tile list, else null
    int const* num_planned = nullptr;      // its length, written by the planner
    int* next_planned = nullptr;           // the counter CTAs take entries from (the planner zeroes it)
    int num_splits = 1;
    cutlass::FastDivmod split_divmod{1};
  };

  // streamed_bytes_per_head: what the tiles of one (batch, head) stream and share: K and V in
  // the forward, the group's Q and dO in the backward (0: no sections, one order over all heads).
  // l2_bytes: the device's L2 size. cluster_size: CTAs of a cluster take adjacent blocks of one
  // head (blocks fastest, no longest-first order): the row blocks are rounded up to whole
  // clusters, the extra block's rows all past the sequence.
  static Params make_params(int num_row_blocks, int num_heads, int num_batch, int64_t streamed_bytes_per_head,
                            int64_t l2_bytes, int num_sms, int num_splits = 1, int cluster_size = 1) {
    num_row_blocks = (num_row_blocks + cluster_size - 1) / cluster_size * cluster_size;
    const int num_blocks = num_row_blocks * num_splits;
    const int num_tiles = num_blocks * num_heads * num_batch;
    const int64_t fitting_l2 = (l2_bytes / 2) / (streamed_bytes_per_head > 0 ? streamed_bytes_per_head : 1);
    const int64_t four_waves = (4 * int64_t(num_sms) + num_blocks - 1) / num_blocks;
    const int64_t pairs = std::min<int64_t>(std::max<int64_t>({fitting_l2, four_waves, 1}), num_heads * num_batch);
    const int heads_per_section = int(pairs);
    Params params{num_blocks, num_tiles, num_heads * num_batch, heads_per_section,
                  cutlass::FastDivmod(num_blocks), cutlass::FastDivmod(num_heads)};
    params.num_splits = num_splits;
    params.split_divmod = cutlass::FastDivmod(num_splits);
    return params;
  }

  // Packed batches: the planner's list of at most max_tiles tiles; counters[0] its length,
  // counters[1] the next entry to take.
  static Params planned_params(PlannedTile const* planned, int* counters, int max_tiles, int num_splits = 1) {
    Params params{};
    params.num_tiles = max_tiles;
    params.planned = planned;
    params.num_planned = counters;
    params.next_planned = counters + 1;
    params.num_splits = num_splits;
    params.split_divmod = cutlass::FastDivmod(num_splits);
    return params;
  }

  static int grid_size(Params const& params, int num_sms) {
    return params.num_tiles < num_sms ? params.num_tiles : num_sms;
  }

  CUTLASS_DEVICE static WorkTile decode(Params const& params, int tile) {
    WorkTile work;
    if (kPlanned && params.planned != nullptr) {
      // Both loads at once.
      const PlannedTile t = tile < params.num_tiles ? __ldg(params.planned + tile) : PlannedTile{0, 0, 0, 0};
      work.valid = tile < __ldg(params.num_planned);
      work.block = t.x;
      work.head = t.y;
      work.batch = t.z;
      if (kSplit && params.num_splits > 1) params.split_divmod(work.block, work.split, t.x);
      return work;
    }
    work.valid = tile < params.num_tiles;
    int block, rest;
    if constexpr (kLongestFirst) {
      // With clusters: the order of pairs of blocks, each CTA of a pair taking its own block of it.
      int rank_in_cluster = 0, num_blocks = params.num_blocks;
      if constexpr (kClusterM > 1) {
        rank_in_cluster = tile % kClusterM;
        tile /= kClusterM;
        num_blocks /= kClusterM;
      }
      if (work.valid) tile = snake(tile, params.num_tiles / kClusterM);
      // rank = section * (heads_per_section * num_blocks) + (block from the last) * heads_here + pair
      const int section_tiles = params.heads_per_section * num_blocks;
      const int section = tile / section_tiles;
      const int within = tile - section * section_tiles;
      const int heads_here = min(params.heads_per_section, params.num_head_batch - section * params.heads_per_section);
      const int block_rank = within / heads_here;
      rest = section * params.heads_per_section + (within - block_rank * heads_here);
      block = num_blocks - 1 - block_rank;
      if constexpr (kClusterM > 1) block = block * kClusterM + rank_in_cluster;
    } else {
      // block fastest, so the CTAs running together share a head's K and V in L2.
      params.block_divmod(rest, block, tile);
    }
    params.head_divmod(work.batch, work.head, rest);
    work.block = block;
    if (kSplit && params.num_splits > 1) params.split_divmod(work.block, work.split, block);
    return work;
  }

  // Odd waves run backwards over the CTAs (the last wave may be partial); with clusters over the
  // clusters, a wave a tile each.
  CUTLASS_DEVICE static int snake(int tile, int num_tiles) {
    const int width = int(gridDim.x) / kClusterM;
    const int wave = tile / width;
    const int wave_start = wave * width;
    const int wave_size = min(width, num_tiles - wave_start);
    return (wave & 1) ? wave_start + wave_size - 1 - (tile - wave_start) : tile;
  }

  // The k-th tile of this CTA, for every thread of every role. Dense batches: tiles blockIdx.x,
  // + gridDim.x, ..., which each thread computes alone. Packed ones: the first is blockIdx.x;
  // the taker (one MMA thread) takes tile k + 1 from the counter as the MMA warpgroups start
  // tile k, so the producer has it before it is needed, and hands it to the others through the
  // ring. (Not the producer: its warpgroup runs on 24 registers.)
  CUTLASS_DEVICE static int tile_at(Params const& params, TileRing& ring, int k, bool taker) {
    if (!kPlanned || params.planned == nullptr) return int(blockIdx.x) + k * int(gridDim.x);
    int tile = int(blockIdx.x);
    if (k > 0) {  // tile k sits in slot (k - 1) % kSlots
      const int slot = (k - 1) % TileRing::kSlots;
      if (!taker) TileRing::Barrier::wait(&ring.full[slot], ((k - 1) / TileRing::kSlots) & 1);
      // The barriers' asm orders no plain C++ access: the slot is read and written by asm too,
      // which keeps its place between them.
      asm volatile("ld.shared.u32 %0, [%1];" : "=r"(tile) : "r"(cute::cast_smem_ptr_to_uint(&ring.tile[slot])));
      if (!taker) TileRing::Barrier::arrive(&ring.empty[slot]);
    }
    if (taker) {
      const int slot = k % TileRing::kSlots;
      TileRing::Barrier::wait(&ring.empty[slot], ((k / TileRing::kSlots) & 1) ^ 1);
      const int next = int(gridDim.x) + atomicAdd(params.next_planned, 1);
      asm volatile("st.shared.u32 [%0], %1;" ::"r"(cute::cast_smem_ptr_to_uint(&ring.tile[slot])), "r"(next));
      TileRing::Barrier::arrive(&ring.full[slot]);
    }
    return tile;
  }
};

}  // namespace flashhopper::hopper
