// The backward's main kernel: warp roles, register split and the persistent loop over key blocks.
// Warpgroup 0 is the producer: its warp 0 issues the TMA loads, its warp 1 adds dQ tiles to
// dQaccum (where the mainloop computes dQ: kComputeDq). Warpgroups 1 and 2 run the GEMMs and the
// epilogue of each key block.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/cutlass.h>
#include <cutlass/pipeline/pipeline.hpp>

#include "hopper/collective/mainloop_bwd.hpp"
#include "hopper/common/mask.hpp"
#include "hopper/common/tile_scheduler.hpp"
#include "hopper/common/tma_pipeline.hpp"

namespace flashhopper::hopper {

using namespace cute;

template <class Mainloop_, class Epilogue_, class Scheduler_>
struct BackwardKernel {
  using Mainloop = Mainloop_;
  using Epilogue = Epilogue_;
  using Scheduler = Scheduler_;
  static constexpr int kNumMmaThreads = Mainloop::kNumMmaThreads;
  static constexpr int kNumThreads = kNumMmaThreads + cutlass::NumThreadsPerWarpGroup;
  static constexpr int kProducerRegisters = 24;
  static constexpr int kConsumerRegisters = 240;

  using SharedStorage = typename Mainloop::SharedStorage;
  static constexpr int kSharedStorageSize = sizeof(SharedStorage);
  static_assert(kSharedStorageSize <= kSmemLimitBytes, "shared memory over the sm_90 limit: shrink the tile");

  struct Params {
    typename Mainloop::Params mainloop;
    typename Epilogue::Params epilogue;
    typename Scheduler::Params scheduler;
  };

  // The scheduler hands out the longest tiles first by giving the highest block first; in the
  // causal backward the longest key block is the lowest, so the order is reversed here. Either
  // way a lower key block of a head comes no later, which the deterministic dQ order relies on.
  // (VarlenTilePlanner gives packed batches the same order.)
  CUTLASS_DEVICE static BackwardBlock block_of(Params const& params, WorkTile const& work) {
    const SeqlenInfo seq = Mainloop::seqlen_info(params.mainloop, work.batch);
    const auto mask = Mainloop::make_mask(params.mainloop, seq);
    const int num_n_blocks = (seq.capacity_k + Mainloop::kBlockN - 1) / Mainloop::kBlockN;
    BackwardBlock blk{0, work.head, seq, 0, 0};
    blk.n_block = Mainloop::kCausal ? num_n_blocks - 1 - work.block : work.block;
    mask.query_blocks(blk.n_block, blk.m_block_min, blk.m_block_max);
    return blk;
  }

  CUTLASS_DEVICE void operator()(Params const& params, char* smem_buf) {
    SharedStorage& storage = *reinterpret_cast<SharedStorage*>(smem_buf);
    const int warp_group = cutlass::canonical_warp_group_idx();
    const int warp_in_group = cutlass::canonical_warp_idx_sync() % cutlass::NumWarpsPerWarpGroup;

    if (threadIdx.x == 0) {
      // The producer, the dQ writer and the MMA threads but the taker.
      storage.tiles.init(kNumMmaThreads + cutlass::NumThreadsPerWarp);
      Mainloop::prefetch_tma_descriptors(params.mainloop);
      storage.kv_full.init(/*arrive_count=*/1);
      storage.kv_empty.init(kNumMmaThreads);  // every MMA thread, after its key block's last GEMM
    }
    using Pipeline = typename Mainloop::Pipeline;
    // A stage: a Q (dO) tile and its LSE (D) rows.
    Pipeline pipeline_q =
        make_tma_pipeline<Pipeline>(storage.pipeline_q, warp_group, kNumMmaThreads, Mainloop::kTmaBytesQStage);
    auto pipeline_do = make_tma_pipeline<typename Mainloop::PipelineDo>(storage.pipeline_do, warp_group,
                                                                      kNumMmaThreads, Mainloop::kTmaBytesDoStage);
    cutlass::arch::fence_barrier_init();
    __syncthreads();

    if (warp_group == 0) {
      cutlass::arch::warpgroup_reg_dealloc<kProducerRegisters>();
      if (warp_in_group == 0) {  // TMA loads, one thread
        if (threadIdx.x != 0) return;
        auto pipe_q_write = cutlass::make_producer_start_state<Pipeline>();
        auto pipe_do_write = cutlass::make_producer_start_state<typename Mainloop::PipelineDo>();
        int kv_empty_phase = 1;  // K and V start free: the first wait passes
        const typename Mainloop::SharedState shared{pipeline_q, pipeline_do, pipe_q_write, pipe_do_write, storage,
                                                    kv_empty_phase};
        for (int k = 0;; ++k) {
          const int tile = Scheduler::tile_at(params.scheduler, storage.tiles, k, false);
          const WorkTile work = Scheduler::decode(params.scheduler, tile);
          if (!work.valid) break;
          const BackwardBlock blk = block_of(params, work);
          if (blk.m_block_min >= blk.m_block_max) continue;  // the MMA warpgroups write zeros
          Mainloop::load(params.mainloop, shared, blk);
        }
      } else if (warp_in_group == 1) {  // dQ writer
        Mainloop::store_dq_start();
        for (int k = 0;; ++k) {
          const int tile = Scheduler::tile_at(params.scheduler, storage.tiles, k, false);
          const WorkTile work = Scheduler::decode(params.scheduler, tile);
          if (!work.valid) break;
          Mainloop::store_dq(params.mainloop, storage, block_of(params, work));
        }
        Mainloop::store_dq_done();
      }
    } else {
      cutlass::arch::warpgroup_reg_alloc<kConsumerRegisters>();
      const int thread_idx = threadIdx.x - cutlass::NumThreadsPerWarpGroup;
      typename Mainloop::PipelineState pipe_q_read;
      typename Mainloop::PipelineStateDo pipe_do_read;
      int kv_full_phase = 0;
      const typename Mainloop::SharedState shared{pipeline_q, pipeline_do, pipe_q_read, pipe_do_read, storage,
                                                  kv_full_phase};
      int pds_buffer = 0;
      for (int k = 0;; ++k) {
        const int tile = Scheduler::tile_at(params.scheduler, storage.tiles, k, thread_idx == 0);
        const WorkTile work = Scheduler::decode(params.scheduler, tile);
        if (!work.valid) break;
        const BackwardBlock blk = block_of(params, work);
        Tensor tdKrdK = partition_fragment_C(typename Mainloop::TiledMmadK{}, select<0, 1>(typename Mainloop::TileShapedK{}));
        Tensor tdVrdV = partition_fragment_C(typename Mainloop::TiledMmadV{}, select<0, 1>(typename Mainloop::TileShapedV{}));
        if (blk.m_block_min < blk.m_block_max) {
          Mainloop::mma(params.mainloop, shared, pds_buffer, tdKrdK, tdVrdV, thread_idx, blk);
        } else {
          clear(tdKrdK);
          clear(tdVrdV);
        }
        Epilogue::store(params.epilogue, tdKrdK, tdVrdV, thread_idx, blk);
      }
      Mainloop::mma_done();
    }
  }
};

template <class Kernel>
__global__ void __launch_bounds__(Kernel::kNumThreads, 1)
    backward_kernel_entry(CUTE_GRID_CONSTANT typename Kernel::Params const params) {
#if defined(__CUDA_ARCH__)  // the body in the device pass only (docs/kernel_families.md, "Build time")
  extern __shared__ char smem_buf[];
  Kernel{}(params, smem_buf);
#endif
}

}  // namespace flashhopper::hopper
