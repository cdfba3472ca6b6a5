// Persistent tile scheduler: CTAs stride over the tiles (block, head, batch), where block is the
// query block of a forward tile and the key block of a backward one. With causal masking the
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

template <bool kLongestFirst>
struct StaticPersistentScheduler {
  struct Params {
    int num_blocks;
    int num_tiles;
    int num_head_batch;     // heads * batch
    int heads_per_section;  // (batch, head) pairs whose K/V share the L2 (longest-first only)
    cutlass::FastDivmod block_divmod;  // over num_blocks
    cutlass::FastDivmod head_divmod;   // over num_heads
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

  static int grid_size(Params const& params, int num_sms) {
    return params.num_tiles < num_sms ? params.num_tiles : num_sms;
  }

  // Longest-first: a tile's place in the longest-first order, undoing the snake (odd waves run
  // backwards over the CTAs). tile < num_tiles.
  CUTLASS_DEVICE static int unsnaked(Params const& params, int tile) {
    const int wave = tile / int(gridDim.x);
    const int wave_start = wave * int(gridDim.x);
    const int wave_size = min(int(gridDim.x), params.num_tiles - wave_start);  // the last is partial
    return (wave & 1) ? wave_start + wave_size - 1 - (tile - wave_start) : tile;
  }

  // Longest-first: a place in that order is section_start + block_rank * heads_here + pair; the
  // section's heads_here (batch, head) pairs, from first_pair on, take turns block by block
  // (block_rank counts from the last block).
  struct RankedTile {
    int section_start;
    int first_pair;
    int heads_here;
    int block_rank;
    int pair;  // within the section
  };
  CUTLASS_DEVICE static RankedTile ranked_tile(Params const& params, int rank) {
    const int section_tiles = params.heads_per_section * params.num_blocks;
    const int section = rank / section_tiles;
    RankedTile r;
    r.section_start = section * section_tiles;
    r.first_pair = section * params.heads_per_section;
    r.heads_here = min(params.heads_per_section, params.num_head_batch - r.first_pair);
    const int within = rank - r.section_start;
    r.block_rank = within / r.heads_here;
    r.pair = within - r.block_rank * r.heads_here;
    return r;
  }

  CUTLASS_DEVICE static WorkTile decode(Params const& params, int tile) {
    WorkTile work;
    work.valid = tile < params.num_tiles;
    int block, rest;
    if constexpr (kLongestFirst) {
      const RankedTile ranked = ranked_tile(params, work.valid ? unsnaked(params, tile) : tile);
      rest = ranked.first_pair + ranked.pair;
      block = params.num_blocks - 1 - ranked.block_rank;
    } else {
      // block fastest, so the CTAs running together share a head's K and V in L2.
      params.block_divmod(rest, block, tile);
    }
    params.head_divmod(work.batch, work.head, rest);
    work.block = block;
    return work;
  }

  // The blocks [block_begin, block_end) of tile's (batch, head) that tile's wave hands out, tile's
  // own among them. The backward's deterministic mode orders its dQ adds by these.
  CUTLASS_DEVICE static void wave_peers(Params const& params, int tile, int& block_begin, int& block_end) {
    const int wave_start = tile / int(gridDim.x) * int(gridDim.x);
    const int wave_end = min(wave_start + int(gridDim.x), params.num_tiles);
    if constexpr (kLongestFirst) {
      // The pair's tiles are section_start + r * heads_here + pair for block ranks r (the snake
      // only permutes a wave); count those before the wave's start and end.
      const RankedTile ranked = ranked_tile(params, unsnaked(params, tile));
      auto ranks_before = [&](int t) {
        const int x = t - ranked.section_start - ranked.pair;
        return x <= 0 ? 0 : min(params.num_blocks, (x + ranked.heads_here - 1) / ranked.heads_here);
      };
      block_begin = params.num_blocks - ranks_before(wave_end);
      block_end = params.num_blocks - ranks_before(wave_start);
    } else {
      int pair, block;
      params.block_divmod(pair, block, tile);
      const int head_start = tile - block;
      block_begin = max(wave_start - head_start, 0);
      block_end = min(wave_end - head_start, params.num_blocks);
    }
  }

  CUTLASS_DEVICE static int first_tile() { return blockIdx.x; }
  CUTLASS_DEVICE static int next_tile(int tile) { return tile + gridDim.x; }
};

}  // namespace flashhopper::hopper
