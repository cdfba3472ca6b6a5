// The varlen tile planner's one launch (VarlenTilePlanner), shared by every kernel family.
#include <cub/block/block_scan.cuh>

#include "hopper/kernel/varlen_tile_planner.hpp"
#include "launch/varlen_plan.hpp"

namespace flashhopper::hopper {

CUTLASS_DEVICE void VarlenTilePlanner::operator()(Params const& p, char* smem) const {
  const int capacity = batch_capacity(p.batch);
  uint64_t* keys = reinterpret_cast<uint64_t*>(smem);
  long long* start = reinterpret_cast<long long*>(keys + capacity);
  const int tid = threadIdx.x;

  // Every CTA sorts the sequences (cheap next to the tiles it places). The key sorts the most
  // blocks first, then by index, and holds both. With split-KV a "block" here is a (block,
  // split) pair, a block's splits at consecutive ranks.
  for (int b = tid; b < capacity; b += kThreads) {
    if (b >= p.batch) {
      keys[b] = ~uint64_t(0);
      continue;
    }
    const SeqlenInfo seq = SeqlenInfo::make(p.seqlen, b);
    const int rows = p.key_blocks ? seq.capacity_k : seq.capacity_q;  // unused rows get zeros
    const int blocks = (rows + p.block_rows - 1) / p.block_rows * p.num_splits;
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
  auto blocks_of = [&](int s) { return 0x7fffffff - int(keys[s] >> 32); };  // s-th sequence of the order
  // start[s]: the first tile of the s-th sequence of the order, sequence-major (exclusive scan, in
  // chunks of one item a thread).
  using Scan = cub::BlockScan<long long, kThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  long long carry = 0;
  for (int base = 0; base < p.batch; base += kThreads) {
    const int s = base + tid;
    const long long count = s < p.batch ? (long long)blocks_of(s) * p.heads : 0;
    long long offset, chunk_total;
    Scan(scan_storage).ExclusiveSum(count, offset, chunk_total);
    if (s < p.batch) start[s] = carry + offset;
    carry += chunk_total;
    __syncthreads();
  }
  const long long total = carry < p.max_tiles ? carry : p.max_tiles;
  if (tid == 0) start[p.batch] = carry;
  if (tid == 0 && blockIdx.x == 0) {
    p.counters[0] = int(total);
    p.counters[1] = 0;  // the attention kernel's CTAs take entries from grid on
  }
  __syncthreads();

  // Pairs (sequence, head) in sequence-major order, P = s * heads + h; pair P's first tile in
  // that order, and the first pair whose first tile is at or after a tile.
  const int num_pairs = p.batch * p.heads;
  auto pair_blocks = [&](int pair) { return blocks_of(pair / p.heads); };
  auto pair_start = [&](int pair) {
    if (pair >= num_pairs) return start[p.batch];
    return start[pair / p.heads] + (long long)(pair % p.heads) * pair_blocks(pair);
  };
  auto first_pair_at = [&](long long tile) {
    int lo = 0, hi = num_pairs;
    while (lo < hi) {
      const int mid = (lo + hi) / 2;
      if (pair_start(mid) < tile) lo = mid + 1;
      else hi = mid;
    }
    return lo;
  };
  // Each thread of the grid takes tiles in sequence-major order (pair, rank r) and puts each at
  // its place in the planned order: within its section, after every pair's first min(blocks, r)
  // tiles, then after the section's pairs before it that have more than r blocks (a prefix, as
  // blocks do not grow along the order).
  for (long long i = blockIdx.x * kThreads + tid; i < carry; i += (long long)gridDim.x * kThreads) {
    const int pair = first_pair_at(i + 1) - 1;  // the last pair starting at or before tile i
    const long long first_tile = pair_start(pair);
    const int rank = int(i - first_tile);
    const long long section = first_tile / p.section_tiles;
    const int first = first_pair_at(section * p.section_tiles);
    const int end = first_pair_at((section + 1) * p.section_tiles);
    int longer = first, hi = end;  // the end of the section's pairs with more than `rank` blocks
    while (longer < hi) {
      const int mid = (longer + hi) / 2;
      if (pair_blocks(mid) > rank) longer = mid + 1;
      else hi = mid;
    }
    const long long t = pair_start(first) + (long long)rank * (longer - first) +
                        (pair_start(end) - pair_start(longer)) + (pair - first);
    if (t >= total) continue;  // past the workspace's capacity (cu_seqlens beyond the contract)
    // Block and split as block * num_splits + split (the scheduler decodes it as a dense index).
    const int blocks = pair_blocks(pair) / p.num_splits, block_rank = rank / p.num_splits;
    const int block = p.highest_first ? blocks - 1 - block_rank : block_rank;
    p.tiles[t] = PlannedTile{block * p.num_splits + rank % p.num_splits, pair % p.heads,
                             int(uint32_t(keys[pair / p.heads])), 0};
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
  if (smem > 48 * 1024) {  // beyond the default only (big batches): the call costs host time
    const cudaError_t err =
        cudaFuncSetAttribute(varlen_tile_planner_entry, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
    if (err != cudaSuccess) return err;
  }
  using Planner = hopper::VarlenTilePlanner;
  varlen_tile_planner_entry<<<Planner::grid_size(params.max_tiles), Planner::kThreads, smem, stream>>>(params);
  return cudaGetLastError();
}

}  // namespace flashhopper::launch
