// The backward's dQ kernel (BackwardDqMainloop): warp roles, register split and the persistent
// loop over (query block, head, batch) tiles. Warpgroup 0 is the producer (one thread issues the
// TMA loads); the MMA warpgroups run the mainloop, then write dQ = scale * (dS K) from registers.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/cutlass.h>
#include <cutlass/pipeline/pipeline.hpp>

#include "hopper/collective/mainloop_bwd_dq.hpp"
#include "hopper/common/mask.hpp"
#include "hopper/common/tile_scheduler.hpp"
#include "hopper/common/tma_pipeline.hpp"
#include "hopper/common/utils.hpp"

namespace flashhopper::hopper {

using namespace cute;

template <class Mainloop_, class Scheduler_>
struct BackwardDqKernel {
  using Mainloop = Mainloop_;
  using Scheduler = Scheduler_;
  static constexpr int kNumMmaThreads = Mainloop::kNumMmaThreads;
  static constexpr int kNumThreads = kNumMmaThreads + cutlass::NumThreadsPerWarpGroup;
  static constexpr int kProducerRegisters = 24;
  static constexpr int kConsumerRegisters = 240;
  static_assert(Mainloop::kNumMmaWarpGroups == 2);

  using SharedStorage = typename Mainloop::SharedStorage;
  static constexpr int kSharedStorageSize = sizeof(SharedStorage);
  static_assert(kSharedStorageSize <= kSmemLimitBytes, "shared memory over the sm_90 limit: shrink the tile");

  struct Params {
    typename Mainloop::Params mainloop;
    typename Scheduler::Params scheduler;
  };

  CUTLASS_DEVICE void operator()(Params const& params, char* smem_buf) {
    SharedStorage& storage = *reinterpret_cast<SharedStorage*>(smem_buf);
    const int warp_group = cutlass::canonical_warp_group_idx();

    if (threadIdx.x == 0) {
      storage.tiles.init(kNumMmaThreads);  // the producer and the MMA threads but the taker
      Mainloop::prefetch_tma_descriptors(params.mainloop);
      storage.qdo_full.init(/*arrive_count=*/1);
      storage.qdo_empty.init(kNumMmaThreads);  // every MMA thread, after its tile's last S and dP
    }
    auto pipeline_k = make_tma_pipeline<typename Mainloop::PipelineK>(storage.pipeline_k, warp_group, kNumMmaThreads,
                                                                      Mainloop::kTmaBytesK);
    auto pipeline_v = make_tma_pipeline<typename Mainloop::PipelineV>(storage.pipeline_v, warp_group, kNumMmaThreads,
                                                                      Mainloop::kTmaBytesV);
    cutlass::arch::fence_barrier_init();
    __syncthreads();


    if (warp_group == 0) {
      cutlass::arch::warpgroup_reg_dealloc<kProducerRegisters>();
      if (threadIdx.x != 0) return;
      auto pipe_k_write = cutlass::make_producer_start_state<typename Mainloop::PipelineK>();
      auto pipe_v_write = cutlass::make_producer_start_state<typename Mainloop::PipelineV>();
      int qdo_empty_phase = 1;  // the buffers start empty: the first wait passes
      const typename Mainloop::SharedState shared{pipeline_k, pipeline_v, pipe_k_write, pipe_v_write, storage,
                                                  qdo_empty_phase};
      for (int k = 0;; ++k) {
        const int tile = Scheduler::tile_at(params.scheduler, storage.tiles, k, false);
        const WorkTile work = Scheduler::decode(params.scheduler, tile);
        if (!work.valid) break;
        const SeqlenInfo seq = Mainloop::seqlen_info(params.mainloop, work);
        const auto blocks = Mainloop::make_mask(params.mainloop, seq).key_blocks(work.block);
        if (blocks.count() == 0) continue;  // the MMA warpgroups write zeros
        Mainloop::load(params.mainloop, shared, work, seq, blocks);
      }
    } else {
      cutlass::arch::warpgroup_reg_alloc<kConsumerRegisters>();
      const int thread_idx = threadIdx.x - cutlass::NumThreadsPerWarpGroup;
      typename Mainloop::PipelineStateK pipe_k_read;
      typename Mainloop::PipelineStateV pipe_v_read;
      int qdo_full_phase = 0;
      const typename Mainloop::SharedState shared{pipeline_k, pipeline_v, pipe_k_read, pipe_v_read, storage,
                                                  qdo_full_phase};
      typename Mainloop::TiledMmadQ tiled_mma_dq;
      using TileShape = decltype(select<0, 1>(typename Mainloop::TileShapedQ{}));  // (M, d)
      Tensor tdQcdQ = tiled_mma_dq.get_thread_slice(thread_idx).partition_C(make_identity_tensor(TileShape{}));
      for (int k = 0;; ++k) {
        const int tile = Scheduler::tile_at(params.scheduler, storage.tiles, k, thread_idx == 0);
        const WorkTile work = Scheduler::decode(params.scheduler, tile);
        if (!work.valid) break;
        const SeqlenInfo seq = Mainloop::seqlen_info(params.mainloop, work);
        const auto blocks = Mainloop::make_mask(params.mainloop, seq).key_blocks(work.block);
        Tensor tdQrdQ = partition_fragment_C(tiled_mma_dq, TileShape{});
        if (blocks.count() > 0) {
          Mainloop::mma(params.mainloop, shared, tdQrdQ, thread_idx, work, seq, blocks);
          CUTLASS_PRAGMA_UNROLL
          for (int i = 0; i < size(tdQrdQ); ++i) tdQrdQ(i) *= params.mainloop.softmax_scale;
        } else {
          clear(tdQrdQ);  // rows that see no key
        }
        Tensor mdQ = domain_offset(make_coord(seq.offset_q, _0{}),
                                   make_tensor(make_gmem_ptr(params.mainloop.ptr_dq), params.mainloop.shape_q,
                                               params.mainloop.stride_dq)(_, _, work.head, seq.batch_q));
        Tensor gdQ = local_tile(mdQ, TileShape{}, make_coord(work.block, _0{}));  // (M, d)
        store_accumulator_rows(tdQrdQ, tdQcdQ, gdQ, seq.capacity_q - work.block * Mainloop::kBlockM,
                               get<1>(params.mainloop.shape_q));
      }
    }
  }
};

template <class Kernel>
__global__ void __launch_bounds__(Kernel::kNumThreads, 1)
    backward_dq_kernel_entry(CUTE_GRID_CONSTANT typename Kernel::Params const params) {
#if defined(__CUDA_ARCH__)  // the body in the device pass only (docs/kernel_families.md, "Build time")
  extern __shared__ char smem_buf[];
  Kernel{}(params, smem_buf);
#endif
}

}  // namespace flashhopper::hopper
