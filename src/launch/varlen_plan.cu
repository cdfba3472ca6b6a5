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

  // Per sequence: its tile count and a key that sorts longest other axis first, then by index.
  for (int b = tid; b < capacity; b += kThreads) {
    if (b >= p.batch) {
      keys[b] = ~uint64_t(0);
      continue;
    }
    const SeqlenInfo seq = SeqlenInfo::make(p.seqlen, b);
    const int rows = p.key_blocks ? seq.capacity_k : seq.capacity_q;  // unused rows get zeros
    const int other = p.key_blocks ? seq.seqlen_q : seq.seqlen_k;
    tiles_of[b] = (rows + p.block_rows - 1) / p.block_rows * p.heads;
    keys[b] = (uint64_t(0x7fffffff - other) << 32) | uint32_t(b);
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

  for (int t = tid; t < total; t += kThreads) {
    int lo = 0, hi = p.batch;  // the last s with start[s] <= t
    while (hi - lo > 1) {
      const int mid = (lo + hi) / 2;
      if (start[mid] <= t) lo = mid;
      else hi = mid;
    }
    const uint64_t key = keys[lo];
    const int b = int(uint32_t(key));
    const int other = 0x7fffffff - int(key >> 32);
    const int blocks = tiles_of[b] / p.heads;
    const int u = int(t - start[lo]);
    const int64_t streamed = int64_t(other) * p.streamed_bytes_per_row;
    const int64_t fitting = p.l2_budget_bytes / (streamed > 0 ? streamed : 1);
    const int per_section = int(fitting < 1 ? 1 : (fitting > p.heads ? p.heads : fitting));
    const int section = u / (per_section * blocks);
    const int within = u - section * per_section * blocks;
    const int heads_here = min(per_section, p.heads - section * per_section);
    const int block_rank = within / heads_here;
    const int head = section * per_section + (within - block_rank * heads_here);
    const int block = p.highest_first ? blocks - 1 - block_rank : block_rank;
    p.tiles[t] = PlannedTile{block, head, b, 0};
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
