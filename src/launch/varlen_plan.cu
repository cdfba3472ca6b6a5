// The varlen tile planner's one launch (VarlenTilePlanner), shared by every kernel family.
#include <cub/block/block_scan.cuh>

#include "hopper/kernel/varlen_tile_planner.hpp"
#include "launch/varlen_plan.hpp"

namespace flashhopper::hopper {

CUTLASS_DEVICE void VarlenTilePlanner::operator()(Params const& p, char* smem) const {
  const int capacity = batch_capacity(p.batch);
  uint64_t* keys = reinterpret_cast<uint64_t*>(smem);
  long long* start = reinterpret_cast<long long*>(keys + capacity);
  int* tiles_of = reinterpret_cast<int*>(start + p.batch + 1);
  const int tid = threadIdx.x;

  // Per sequence: its tile count and a key that sorts the most blocks first, then by index.
  for (int b = tid; b < capacity; b += kThreads) {
    if (b >= p.batch) {
      keys[b] = ~uint64_t(0);
      continue;
    }
    const SeqlenInfo seq = SeqlenInfo::make(p.seqlen, b);
    const int rows = p.key_blocks ? seq.capacity_k : seq.capacity_q;  // unused rows get zeros
    const int blocks = (rows + p.block_rows - 1) / p.block_rows;
    tiles_of[b] = blocks * p.heads;
    keys[b] = (uint64_t(0x7fffffff - blocks) << 32) | uint32_t(b);
  }
  __syncthreads();
  // Bitonic sort, ascending.
  for (int size = 2; size <= capacity; size *= 2) {
    for (int stride = size / 2; stride > 0; stride /= 2) {
      for (int i = tid; i < capacity / 2; i += kThreads) {
        const int lo = 2 * i - (i & (stride - 1));
        const int hi = lo + stride;
        const bool ascending = (lo & size) == 0;
        const uint64_t a = keys[lo], c = keys[hi];
        if ((a > c) == ascending) {
          keys[lo] = c;
          keys[hi] = a;
        }
      }
      __syncthreads();
    }
  }
  // start[s]: the first tile of the s-th sequence of the order (exclusive scan, in chunks of
  // one item a thread).
  using Scan = cub::BlockScan<long long, kThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  long long carry = 0;
  for (int base = 0; base < p.batch; base += kThreads) {
    const int s = base + tid;
    const long long count = s < p.batch ? tiles_of[uint32_t(keys[s])] : 0;
    long long offset, chunk_total;
    Scan(scan_storage).ExclusiveSum(count, offset, chunk_total);
    if (s < p.batch) start[s] = carry + offset;
    carry += chunk_total;
    __syncthreads();
  }
  const int total = int(carry < p.max_tiles ? carry : p.max_tiles);
  if (tid == 0) {
    start[p.batch] = carry;
    *p.num_tiles = total;
  }
  __syncthreads();

  // Pairs (sequence, head) in sequence-major order, P = s * heads + h; pair P's first tile in
  // that order, and the number of pairs from `first` on whose blocks exceed r (blocks do not grow
  // along the order, so they are a prefix).
  const int num_pairs = p.batch * p.heads;
  auto pair_blocks = [&](int pair) { return tiles_of[uint32_t(keys[pair / p.heads])] / p.heads; };
  auto pair_start = [&](int pair) {
    if (pair >= num_pairs) return start[p.batch];
    return start[pair / p.heads] + (long long)(pair % p.heads) * pair_blocks(pair);
  };
  auto first_pair_at = [&](long long tile) {  // the first pair whose first tile is >= tile
    int lo = 0, hi = num_pairs;
    while (lo < hi) {
      const int mid = (lo + hi) / 2;
      if (pair_start(mid) < tile) lo = mid + 1;
      else hi = mid;
    }
    return lo;
  };
  for (int entry = tid; entry < total; entry += kThreads) {
    // Odd waves backwards over the CTAs, as the dense scheduler's snake (here, so that a CTA's
    // decode is one load: entry i is the i-th tile CTA i % grid takes).
    const int wave_start = entry / p.grid * p.grid;
    const int wave_size = min(p.grid, total - wave_start);
    const int t = (entry / p.grid) % 2 ? wave_start + wave_size - 1 - (entry - wave_start) : entry;
    // The section: the pairs whose first tile lies in [k * S, (k + 1) * S).
    const int pair_of_t = first_pair_at(t + 1) - 1;  // the last pair starting at or before t
    const long long section = pair_start(pair_of_t) / p.section_tiles;
    const int first = first_pair_at(section * p.section_tiles);
    const int end = first_pair_at((section + 1) * p.section_tiles);
    const long long u = t - pair_start(first);
    auto longer_than = [&](int r) {  // pairs of the section with more than r blocks
      int lo = first, hi = end;
      while (lo < hi) {
        const int mid = (lo + hi) / 2;
        if (pair_blocks(mid) > r) lo = mid + 1;
        else hi = mid;
      }
      return lo - first;
    };
    // Tiles of the section before rank r: every pair's first min(blocks, r).
    auto rank_start = [&](int r) {
      const int longer = longer_than(r);
      return (long long)r * longer + (pair_start(end) - pair_start(first + longer));
    };
    int lo = 0, hi = pair_blocks(first);  // the last rank r with rank_start(r) <= u
    while (hi - lo > 1) {
      const int mid = (lo + hi) / 2;
      if (rank_start(mid) <= u) lo = mid;
      else hi = mid;
    }
    const int pair = first + int(u - rank_start(lo));
    const int s = pair / p.heads;
    const int blocks = pair_blocks(pair);
    const int block = p.highest_first ? blocks - 1 - lo : lo;
    p.tiles[entry] = PlannedTile{block, pair % p.heads, int(uint32_t(keys[s])), 0};
  }
}

}  // namespace flashhopper::hopper

namespace flashhopper::launch {

namespace {
__global__ void __launch_bounds__(hopper::VarlenTilePlanner::kThreads)
    varlen_tile_planner_entry(hopper::VarlenTilePlanner::Params const params) {
  extern __shared__ __align__(16) char smem_buf[];
  hopper::VarlenTilePlanner{}(params, smem_buf);
}
}  // namespace

cudaError_t plan_varlen_tiles(const hopper::VarlenTilePlanner::Params& params, cudaStream_t stream) {
  const size_t smem = hopper::VarlenTilePlanner::shared_bytes(params.batch);
  cudaError_t err = cudaFuncSetAttribute(varlen_tile_planner_entry, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         int(smem));
  if (err != cudaSuccess) return err;
  varlen_tile_planner_entry<<<1, hopper::VarlenTilePlanner::kThreads, smem, stream>>>(params);
  return cudaGetLastError();
}

}  // namespace flashhopper::launch
