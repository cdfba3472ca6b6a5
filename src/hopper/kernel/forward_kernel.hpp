// The forward kernel: warp roles, register split, shared storage and the persistent tile loop.
// Warpgroup 0 is the producer (one thread issues every TMA load; a warp or all four gather a paged cache;
// with fp8 warps 1-3 transpose V); warpgroups 1.. are consumers that run the mainloop and the
// epilogue on the same tile, 64 rows each.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/cutlass.h>
#include <cutlass/pipeline/pipeline.hpp>

#include "hopper/common/mask.hpp"
#include "hopper/common/named_barrier.hpp"
#include "hopper/common/softmax.hpp"
#include "hopper/common/tile_scheduler.hpp"
#include "hopper/common/tma_pipeline.hpp"

namespace flashhopper::hopper {

using namespace cute;

// kTileConsumerRegisters: the consumer warpgroups' registers a thread where the tile table says
// (ForwardTileSizeFp8::kConsumerRegisters), else 0 for the rule below.
template <class Mainloop_, class Epilogue_, class Scheduler_, int kTileConsumerRegisters = 0>
struct ForwardKernel {
  using Mainloop = Mainloop_;
  using Epilogue = Epilogue_;
  using Scheduler = Scheduler_;
  using Element = typename Mainloop::Element;
  using ElementOut = typename Epilogue::Element;  // O's: Element's, bf16 for fp8
  static constexpr bool kTransposesV = Mainloop::kTransposesV;
  static constexpr int kClusterM = Mainloop::kClusterM;  // CTAs sharing each K/V block (multicast)

  static constexpr int kNumMmaWarpGroups = Mainloop::kNumMmaWarpGroups;
  static constexpr int kNumMmaThreads = Mainloop::kNumMmaThreads;
  static constexpr int kNumThreads = kNumMmaThreads + cutlass::NumThreadsPerWarpGroup;
  static_assert(kNumMmaWarpGroups == 2 || kNumMmaWarpGroups == 3);
  // 64K registers a CTA. These kernels launch with the most a thread can have, 65536 / kNumThreads
  // rounded down to a multiple of 8 (ptxas -v: 168 and 128), and setmaxnreg moves registers within
  // that allocation: the consumers take 240 (two warpgroups) or 160 (three), or the tile's number,
  // and the producer keeps the rest (24, 32; 56 beside two of 224). A split past the allocation
  // would hang the consumers' increase (a 32-register producer beside two 240-register consumers).
  static constexpr int kLaunchRegisters = 65536 / kNumThreads / 8 * 8;
  static constexpr int kConsumerRegisters =
      kTileConsumerRegisters != 0 ? kTileConsumerRegisters : kNumMmaWarpGroups == 2 ? 240 : 160;
  static constexpr int kProducerRegisters = kLaunchRegisters * (kNumMmaWarpGroups + 1) -
                                            kNumMmaWarpGroups * kConsumerRegisters;
  static_assert(kConsumerRegisters % 8 == 0 && kProducerRegisters % 8 == 0 && kConsumerRegisters <= 256 &&
                    kProducerRegisters >= 24 && kProducerRegisters <= kLaunchRegisters,
                "setmaxnreg: multiples of 8 from 24 to 256, within the launch allocation");

  static constexpr int kSmemLimit = kSmemLimitBytes;
  static constexpr int kOBytes = cosize_v<typename Epilogue::SmemLayoutO> * sizeof(ElementOut);
  static constexpr int kQKVBytes = cosize_v<typename Mainloop::SmemLayoutQ> * sizeof(Element) +
                                   int(sizeof(typename Mainloop::SharedStorageKV));
  // O goes registers -> shared memory -> TMA store when its buffer fits beside Q, K and V;
  // otherwise (hdim 256, hdim 128 with 176 key columns) straight from registers to global memory.
  // Either way Q's buffer is free once the tile's last Q K^T is done, so the next tile's Q loads
  // during the last P V and the epilogue. (Reusing Q's buffer for O instead made every tile wait
  // for its store before the next Q could load.)
  static constexpr bool kOStagedInSmem = kQKVBytes + kOBytes + 1024 <= kSmemLimit;

  // fp8: the transposed V stages' barriers (none elsewhere, so the other kernels' layout stays).
  template <bool kOn, class = void>
  struct TransposedVBarriers {};
  template <class Unused>
  struct TransposedVBarriers<true, Unused> {
    typename Mainloop::PipelineVt::SharedStorage pipeline_vt;
  };
  struct Barriers : TransposedVBarriers<kTransposesV> {
    cutlass::arch::ClusterTransactionBarrier q_full;
    cutlass::arch::ClusterBarrier q_empty;
    typename Mainloop::Pipeline::SharedStorage pipeline_k;
    typename Mainloop::Pipeline::SharedStorage pipeline_v;
    TileRing tiles;  // packed batches: the hand-off of the tiles a CTA takes
  };
  struct SharedStorageWithO {
    cute::array_aligned<Element, cosize_v<typename Mainloop::SmemLayoutQ>, 1024> smem_q;
    cute::array_aligned<ElementOut, cosize_v<typename Epilogue::SmemLayoutO>, 1024> smem_o;
    typename Mainloop::SharedStorageKV kv;
    Barriers barriers;
  };
  struct SharedStorageWithoutO {
    cute::array_aligned<Element, cosize_v<typename Mainloop::SmemLayoutQ>, 1024> smem_q;
    typename Mainloop::SharedStorageKV kv;
    Barriers barriers;
  };
  using SharedStorage = cute::conditional_t<kOStagedInSmem, SharedStorageWithO, SharedStorageWithoutO>;
  static_assert(sizeof(SharedStorage) <= kSmemLimit, "shared memory over the sm_90 limit: shrink the tile");
  static constexpr int kSharedStorageSize = sizeof(SharedStorage);

  struct Params {
    typename Mainloop::Params mainloop;
    typename Epilogue::Params epilogue;
    typename Scheduler::Params scheduler;
  };

  // O's shared-memory buffer, where the kernel has one (kOStagedInSmem), else null.
  CUTLASS_DEVICE static ElementOut* o_buffer(SharedStorage& storage) {
    if constexpr (kOStagedInSmem) {
      return storage.smem_o.data();
    } else {
      return nullptr;
    }
  }

  // The key blocks a tile walks: its query block's, or its split's part of them. The CTAs of a
  // cluster load each block together, so they walk the same ones: those of the cluster's last
  // query block that has rows, which include the others' (unmasked: the same; causal: more, the
  // extra ones wholly masked for the lower blocks' rows).
  CUTLASS_DEVICE static auto key_blocks(Params const& params, SeqlenInfo const& seq, WorkTile const& work) {
    int walk_block = work.block;
    if constexpr (kClusterM > 1) {
      walk_block = min(walk_block | (kClusterM - 1), max(seq.seqlen_q - 1, 0) / Mainloop::kBlockM);
    }
    const auto blocks = Mainloop::make_mask(params.mainloop, seq).key_blocks(walk_block);
    if constexpr (Mainloop::kSplitKv) {
      if (params.scheduler.num_splits > 1) return blocks.split(work.split, params.scheduler.num_splits);
    }
    return blocks;
  }

  CUTLASS_DEVICE void operator()(Params const& params, char* smem_buf) {
    SharedStorage& storage = *reinterpret_cast<SharedStorage*>(smem_buf);
    const int warp_group = cutlass::canonical_warp_group_idx();

    const int producer_threads =
        kTransposesV ? cutlass::NumThreadsPerWarpGroup : Mainloop::producer_threads(params.mainloop);
    const int producer_warps = (producer_threads + cutlass::NumThreadsPerWarp - 1) / cutlass::NumThreadsPerWarp;
    if (threadIdx.x == 0) {
      // Receivers of the tiles: a thread of each producer warp and the MMA threads but the taker.
      storage.barriers.tiles.init(producer_warps + kNumMmaThreads - 1);
      Mainloop::prefetch_tma_descriptors(params.mainloop);
      Epilogue::prefetch_tma_descriptors(params.epilogue);
      storage.barriers.q_full.init(/*arrive_count=*/1);
      storage.barriers.q_empty.init(kNumMmaThreads);  // every consumer thread, after its last Q K^T
    }

    using Pipeline = typename Mainloop::Pipeline;
    const auto kv_stage = Mainloop::kv_stage_completion(params.mainloop);
    Pipeline pipeline_k = make_tma_pipeline<Pipeline, kClusterM>(storage.barriers.pipeline_k, warp_group,
                                                                 kNumMmaThreads, kv_stage.bytes_k, kv_stage.arrivals);
    // With fp8 V's TMA stages are consumed by the transposing warps, whose output the MMAs consume.
    Pipeline pipeline_v = make_tma_pipeline<Pipeline, kClusterM>(
        storage.barriers.pipeline_v, warp_group, kTransposesV ? Mainloop::kTransposeThreads : kNumMmaThreads,
        kv_stage.bytes_v, kv_stage.arrivals);
    using PipelineVt = typename Mainloop::PipelineVt;
    auto pipeline_vt_if_fp8 = [&] {
      if constexpr (kTransposesV) {
        typename PipelineVt::Params vt;
        vt.role = warp_group == 0 ? PipelineVt::ThreadCategory::Producer : PipelineVt::ThreadCategory::Consumer;
        vt.producer_arv_count = Mainloop::kTransposeThreads;
        vt.consumer_arv_count = kNumMmaThreads;
        return PipelineVt(storage.barriers.pipeline_vt, vt);
      } else {
        return cute::tuple<>{};
      }
    }();
    PipelineVt* const pipeline_vt = [&]() -> PipelineVt* {
      if constexpr (kTransposesV) return &pipeline_vt_if_fp8;
      else return nullptr;
    }();

    cutlass::arch::fence_barrier_init();
    if constexpr (kClusterM > 1) {
      // The other CTAs' loads and releases reach this one's barriers only once they are set up.
      cute::cluster_arrive_relaxed();
      cute::cluster_wait();
    } else {
      __syncthreads();
    }

    if (warp_group == 0) {  // producer
      cutlass::arch::warpgroup_reg_dealloc<kProducerRegisters>();
      // One thread issues the loads, or a warp or the warpgroup for a paged cache
      // (Mainloop::producer_threads); lane 0 of each warp takes the tiles and hands them on.
      if (int(threadIdx.x) >= producer_threads) return;
      auto pipe_k_write = cutlass::make_producer_start_state<Pipeline>();
      auto pipe_v_write = cutlass::make_producer_start_state<Pipeline>();
      int q_empty_phase = 1;  // the buffer starts empty: the first wait passes
      // fp8's transposing warps read V's TMA stages and write the transposed ones.
      typename Mainloop::PipelineState pipe_v_staged_read;
      auto pipe_vt_write = cutlass::make_producer_start_state<PipelineVt>();
      const bool lane0 = cutlass::canonical_lane_idx() == 0;
      // A warp's tiles, with the V state it advances: the loading warp's write state or, with
      // fp8, the transposing warps' read state. Each role is its own copy of the loop, so that
      // its states stay in registers (a state picked at run time had to live on the stack, each
      // advance a local store: 85 local operations in every dense fp8 kernel, bench/RESULTS.md
      // 2026-12-08).
      auto produce = [&](typename Mainloop::PipelineState& v_state, auto transposes) CUTLASS_LAMBDA_FUNC_INLINE {
        const typename Mainloop::SharedState shared{pipeline_k,
                                                    pipeline_v,
                                                    pipe_k_write,
                                                    v_state,
                                                    storage.barriers.q_full,
                                                    storage.barriers.q_empty,
                                                    q_empty_phase,
                                                    storage.smem_q.data(),
                                                    storage.kv,
                                                    pipeline_vt,
                                                    &pipe_vt_write};
        for (int k = 0;; ++k) {
          int tile = lane0 ? Scheduler::tile_at(params.scheduler, storage.barriers.tiles, k, false) : 0;
          if (producer_threads > 1) tile = __shfl_sync(0xffffffff, tile, 0);
          const WorkTile work = Scheduler::decode(params.scheduler, tile);
          if (!work.valid) break;
          const SeqlenInfo seq = Mainloop::seqlen_info(params.mainloop, work);
          const auto blocks = key_blocks(params, seq, work);
          if (blocks.count() == 0) continue;  // consumers write zeros; nothing to load
          if constexpr (decltype(transposes)::value) {
            Mainloop::transpose_v(shared, blocks.count(), int(threadIdx.x) - cutlass::NumThreadsPerWarp,
                                  params.mainloop.v_column_major.enabled);
          } else if (!kTransposesV || int(threadIdx.x) < Mainloop::producer_threads(params.mainloop)) {
            Mainloop::load(params.mainloop, shared, work, seq, blocks);  // fp8: a lane, or warp 0 paged
          }
        }
      };
      if (kTransposesV && cutlass::canonical_warp_idx_sync() % 4 != 0) {
        if constexpr (kTransposesV) produce(pipe_v_staged_read, cute::true_type{});
      } else {
        produce(pipe_v_write, cute::false_type{});
      }
      if constexpr (kClusterM > 1) {
        // The other CTAs' consumers release this one's stages remotely: stay until they all have.
        pipeline_k.producer_tail(pipe_k_write);
        pipeline_v.producer_tail(pipe_v_write);
      }
    } else {  // consumers
      cutlass::arch::warpgroup_reg_alloc<kConsumerRegisters>();
      const int thread_idx = threadIdx.x - cutlass::NumThreadsPerWarpGroup;
      const int mma_warp_group = warp_group - 1;
      // Hand the first ping-pong turn to warpgroup 0.
      if (Mainloop::kPingPong && mma_warp_group == kNumMmaWarpGroups - 1)
        named_barrier_arrive(2 * cutlass::NumThreadsPerWarpGroup, FwdBarrier::kWarpScheduler0, 0);

      typename Mainloop::PipelineState pipe_k_read, pipe_v_read;
      int q_full_phase = 0;
      const typename Mainloop::SharedState shared{pipeline_k,
                                                  pipeline_v,
                                                  pipe_k_read,
                                                  pipe_v_read,
                                                  storage.barriers.q_full,
                                                  storage.barriers.q_empty,
                                                  q_full_phase,
                                                  storage.smem_q.data(),
                                                  storage.kv,
                                                  pipeline_vt};
      typename Mainloop::TiledMmaPV tiled_mma_pv;
      for (int k = 0;; ++k) {
        const int tile = Scheduler::tile_at(params.scheduler, storage.barriers.tiles, k, thread_idx == 0);
        const WorkTile work = Scheduler::decode(params.scheduler, tile);
        if (!work.valid) break;
        const SeqlenInfo seq = Mainloop::seqlen_info(params.mainloop, work);
        const auto blocks = key_blocks(params, seq, work);
        // The learnable sink joins split 0's sum only, so that the combine counts it once.
        const float sink_log2 = work.split == 0 ? Mainloop::sink_log2(params.mainloop, work) : -INFINITY;
        if (blocks.count() == 0) {
          // O = 0; the LSE is -inf, or the sink's logit when there is one.
          Epilogue::store_empty(params.epilogue, thread_idx, work, seq, sink_log2 * float(M_LN2));
          continue;
        }
        Tensor tOrO = partition_fragment_C(tiled_mma_pv, select<0, 1>(typename Mainloop::TileShapePV{}));
        constexpr int kRows = 2;  // rows of the accumulator a thread holds
        const auto scale = Mainloop::tile_scale(params.mainloop, work, seq);
        OnlineSoftmax<kRows, Mainloop::Transform::kFmaExpEvery, Mainloop::kProbabilityLog2> softmax(
            scale.softmax_scale_log2);
        Mainloop::mma(params.mainloop, shared, tOrO, softmax, thread_idx, work, seq, blocks);
        float o_scale[kRows], lse[kRows];
        softmax.finalize(scale.softmax_scale, o_scale, lse, sink_log2);
        if constexpr (kTransposesV) {
          CUTLASS_PRAGMA_UNROLL
          for (int m = 0; m < kRows; ++m) o_scale[m] *= scale.o_factor;
        }
        Tensor o_rowcol = make_tensor(tOrO.data(), accumulator_rowcol(tOrO.layout()));
        scale_rows(o_rowcol, o_scale);
        // Rows past seqused_q: O = 0, LSE = -inf.
        if (Mainloop::kPacked && seq.seqlen_q < seq.capacity_q) {
          Epilogue::clear_unused_rows(o_rowcol, lse, thread_idx, work, seq);
        }
        Epilogue::template store_tile<kOStagedInSmem>(params.epilogue, tOrO, lse, o_buffer(storage), thread_idx,
                                                      work, seq);
      }
      // Shared memory must outlive the last TMA store.
      if constexpr (kOStagedInSmem) {
        if (thread_idx == 0) Epilogue::wait_for_store();
      }
    }
  }
};

template <class Kernel>
__global__ void __launch_bounds__(Kernel::kNumThreads, 1)
    forward_kernel_entry(CUTE_GRID_CONSTANT typename Kernel::Params const params) {
#if defined(__CUDA_ARCH__)  // the body in the device pass only (docs/kernel_families.md, "Build time")
  extern __shared__ char smem_buf[];
  Kernel{}(params, smem_buf);
#endif
}

}  // namespace flashhopper::hopper
