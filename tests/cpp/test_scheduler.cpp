// The persistent tile scheduler's order, run on the host: every dense tile handed out exactly once,
// and with clusters (K/V multicast, kClusterM = 2) the two CTAs of each cluster given adjacent query
// blocks of one head at every step, the lower block to the first CTA, the same number of steps
// each (each loads half of every K/V block the other consumes: a CTA that stopped early, or worked
// on another head, would leave its partner waiting). Unmasked order (blocks fastest) and causal
// (longest first, in sections, snaking), over query-block counts that need a block past the
// sequence to make whole pairs, and grids from one cluster to a full H100.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <tuple>
#include <vector>

// Host stand-ins for the CUDA built-ins that the scheduler's tile decode reads (the kernels run the
// same code on the device).
namespace {
struct HostDim3 {
  unsigned x = 1, y = 1, z = 1;
};
}  // namespace
static HostDim3 gridDim, blockIdx;
using std::max;
using std::min;
template <class T>
T __ldg(const T* p) {
  return *p;
}

#include "hopper/common/tile_scheduler.hpp"

namespace {

using flashhopper::hopper::PersistentTileScheduler;
using flashhopper::hopper::WorkTile;

struct Shape {
  int query_blocks, heads, batch;
};

// Each CTA's tiles in its order, as the kernel's loop takes them (blockIdx.x + k * gridDim.x until
// past the last tile).
template <class Scheduler>
std::vector<std::vector<WorkTile>> walk(typename Scheduler::Params const& params, int grid) {
  gridDim.x = unsigned(grid);
  std::vector<std::vector<WorkTile>> tiles(grid);
  for (int cta = 0; cta < grid; ++cta) {
    blockIdx.x = unsigned(cta);
    for (int tile = cta; tile < params.num_tiles; tile += grid) {
      const WorkTile work = Scheduler::decode(params, tile);
      EXPECT_TRUE(work.valid) << "tile " << tile << " of " << params.num_tiles;
      tiles[cta].push_back(work);
    }
  }
  return tiles;
}

// Every (block, head, batch) of the padded grid exactly once.
void expect_each_tile_once(const std::vector<std::vector<WorkTile>>& tiles, int blocks, const Shape& s) {
  std::map<std::tuple<int, int, int>, int> seen;
  for (const auto& cta : tiles)
    for (const WorkTile& w : cta) {
      ASSERT_GE(w.block, 0);
      ASSERT_LT(w.block, blocks);
      ASSERT_LT(w.head, s.heads);
      ASSERT_LT(w.batch, s.batch);
      ++seen[{w.block, w.head, w.batch}];
    }
  EXPECT_EQ(int(seen.size()), blocks * s.heads * s.batch);
  for (const auto& [tile, count] : seen) EXPECT_EQ(count, 1) << "block " << std::get<0>(tile);
}

template <bool kLongestFirst>
void check_pairs(const Shape& s, int sms) {
  using Paired = PersistentTileScheduler<kLongestFirst, /*kPlanned=*/false, /*kSplit=*/false, /*kClusterM=*/2>;
  const auto params = Paired::make_params(s.query_blocks, s.heads, s.batch, /*streamed_bytes_per_head=*/1 << 22,
                                          /*l2_bytes=*/50 << 20, sms, /*num_splits=*/1, /*cluster_size=*/2);
  const int blocks = (s.query_blocks + 1) / 2 * 2;
  ASSERT_EQ(params.num_tiles, blocks * s.heads * s.batch);
  // As launch_kernel sizes it: at most the tiles and the SMs, whole clusters.
  const int grid = std::max(2, std::min(params.num_tiles, sms) / 2 * 2);
  const auto tiles = walk<Paired>(params, grid);
  expect_each_tile_once(tiles, blocks, s);
  for (int cta = 0; cta < grid; cta += 2) {
    ASSERT_EQ(tiles[cta].size(), tiles[cta + 1].size()) << "CTAs " << cta << " and " << cta + 1;
    for (size_t k = 0; k < tiles[cta].size(); ++k) {
      const WorkTile &lower = tiles[cta][k], &upper = tiles[cta + 1][k];
      EXPECT_EQ(lower.head, upper.head) << "CTA " << cta << ", step " << k;
      EXPECT_EQ(lower.batch, upper.batch) << "CTA " << cta << ", step " << k;
      EXPECT_EQ(lower.block % 2, 0) << "CTA " << cta << ", step " << k;
      EXPECT_EQ(upper.block, lower.block + 1) << "CTA " << cta << ", step " << k;
    }
  }
}

// check(shape, sms) over every shape and SM count, each named in the failures.
template <class Check>
void for_each_case(Check check) {
  const Shape shapes[] = {{1, 1, 1}, {5, 3, 2}, {6, 4, 1}, {65, 1, 1}, {17, 8, 3}, {256, 16, 2}};
  for (const Shape& s : shapes)
    for (int sms : {2, 8, 66, 132}) {
      SCOPED_TRACE(testing::Message() << s.query_blocks << " blocks, " << s.heads << " heads, batch " << s.batch
                                      << ", " << sms << " SMs");
      check(s, sms);
    }
}

TEST(TileScheduler, UnmaskedPairsShareHeadAndStep) {
  for_each_case([](const Shape& s, int sms) { check_pairs</*kLongestFirst=*/false>(s, sms); });
}

TEST(TileScheduler, CausalPairsShareHeadAndStep) {
  for_each_case([](const Shape& s, int sms) { check_pairs</*kLongestFirst=*/true>(s, sms); });
}

// Without clusters the order is a permutation of the tiles too (the control for the above).
template <bool kLongestFirst>
void check_single_ctas(const Shape& s, int sms) {
  using Scheduler = PersistentTileScheduler<kLongestFirst, /*kPlanned=*/false, /*kSplit=*/false>;
  const auto params = Scheduler::make_params(s.query_blocks, s.heads, s.batch, 1 << 22, 50 << 20, sms);
  expect_each_tile_once(walk<Scheduler>(params, std::min(params.num_tiles, sms)), s.query_blocks, s);
}

TEST(TileScheduler, SingleCtaOrderCoversEveryTile) {
  for_each_case([](const Shape& s, int sms) {
    check_single_ctas</*kLongestFirst=*/false>(s, sms);
    check_single_ctas</*kLongestFirst=*/true>(s, sms);
  });
}

}  // namespace
