// Persistent tile scheduler: CTAs stride over the tiles (block, head, batch), where block is the
// query block of a forward tile and the key block of a backward one. Packed (varlen) batches
// come as a list of tiles that VarlenTilePlanner writes on the device before the kernel (tile i
// is list entry i); dense ones are decoded from the tile index as follows. With causal masking the
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

#include <cutlass/cutlass.h>
#include <cutlass/fast_math.h>

namespace flashhopper::hopper {

struct WorkTile {
  int block;  // the tile's row block: a query block in the forward, a key block in the backward
  int head;
  int batch;
  bool valid;
};

// A planned tile: block, head, batch (w unused; 16 bytes, one load).
using PlannedTile = int4;

template <bool kLongestFirst>
struct PersistentTileScheduler {
  struct Params {
    int num_blocks;
    int num_tiles;
    int num_head_batch;     // heads * batch
    int heads_per_section;  // (batch, head) pairs whose K/V share the L2 (longest-first only)
    cutlass::FastDivmod block_divmod;  // over num_blocks
    cutlass::FastDivmod head_divmod;   // over num_heads
    PlannedTile const* planned = nullptr;  // packed batches: the planner's tile list, else null
    int const* num_planned = nullptr;      // its length, written by the planner
  };

  // streamed_bytes_per_head: what the tiles of one (batch, head) stream and share: K and V in
  // the forward, the group's Q and dO in the backward (0: no sections, one order over all heads).
  // l2_bytes: the device's L2 size.
  static Params make_params(int num_blocks, int num_heads, int num_batch, int64_t streamed_bytes_per_head,
                            int64_t l2_bytes, int num_sms) {
    const int num_tiles = num_blocks * num_heads * num_batch;
    const int64_t fitting_l2 = (l2_bytes / 2) / (streamed_bytes_per_head > 0 ? streamed_bytes_per_head : 1);
    const int64_t four_waves = (4 * int64_t(num_sms) + num_blocks - 1) / num_blocks;
    const int64_t pairs = std::min<int64_t>(std::max<int64_t>({fitting_l2, four_waves, 1}), num_heads * num_batch);
    const int heads_per_section = int(pairs);
    return {num_blocks, num_tiles, num_heads * num_batch, heads_per_section,
            cutlass::FastDivmod(num_blocks), cutlass::FastDivmod(num_heads)};
  }

  // Packed batches: the planner's list of at most max_tiles tiles.
  static Params planned_params(PlannedTile const* planned, int const* num_planned, int max_tiles) {
    Params params{};
    params.num_tiles = max_tiles;
    params.planned = planned;
    params.num_planned = num_planned;
    return params;
  }

  static int grid_size(Params const& params, int num_sms) {
    return params.num_tiles < num_sms ? params.num_tiles : num_sms;
  }

  CUTLASS_DEVICE static WorkTile decode(Params const& params, int tile) {
    WorkTile work;
    if (params.planned != nullptr) {
      // Both loads at once (the planner wrote the snake order into the list).
      const PlannedTile t = tile < params.num_tiles ? __ldg(params.planned + tile) : PlannedTile{0, 0, 0, 0};
      work.valid = tile < __ldg(params.num_planned);
      work.block = t.x;
      work.head = t.y;
      work.batch = t.z;
      return work;
    }
    work.valid = tile < params.num_tiles;
    int block, rest;
    if constexpr (kLongestFirst) {
      if (work.valid) tile = snake(tile, params.num_tiles);
      // rank = section * (heads_per_section * num_blocks) + (block from the last) * heads_here + pair
      const int section_tiles = params.heads_per_section * params.num_blocks;
      const int section = tile / section_tiles;
      const int within = tile - section * section_tiles;
      const int heads_here = min(params.heads_per_section, params.num_head_batch - section * params.heads_per_section);
      const int block_rank = within / heads_here;
      rest = section * params.heads_per_section + (within - block_rank * heads_here);
      block = params.num_blocks - 1 - block_rank;
    } else {
      // block fastest, so the CTAs running together share a head's K and V in L2.
      params.block_divmod(rest, block, tile);
    }
    params.head_divmod(work.batch, work.head, rest);
    work.block = block;
    return work;
  }

  // Odd waves run backwards over the CTAs (the last wave may be partial).
  CUTLASS_DEVICE static int snake(int tile, int num_tiles) {
    const int wave = tile / int(gridDim.x);
    const int wave_start = wave * int(gridDim.x);
    const int wave_size = min(int(gridDim.x), num_tiles - wave_start);
    return (wave & 1) ? wave_start + wave_size - 1 - (tile - wave_start) : tile;
  }

  CUTLASS_DEVICE static int first_tile() { return blockIdx.x; }
  CUTLASS_DEVICE static int next_tile(int tile) { return tile + gridDim.x; }
};

}  // namespace flashhopper::hopper
