// The kernels' TMA pipelines: one producer thread fills the stages by TMA, the MMA warpgroups
// consume them.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/pipeline/pipeline.hpp>

namespace flashhopper::hopper {

// A pipeline whose stages each expect transaction_bytes; warpgroup 0 produces, and its thread 0
// is the one that arms the barriers. A stage's phase completes after num_producers arrivals (thread
// 0's in producer_acquire and, where threads copy without TMA, theirs) and the bytes.
// kClusterM > 1: the stages are multicast to that many CTAs, so a stage is free again once the
// consumers of all of them released it (each consumer warpgroup signals every CTA's barrier).
template <class Pipeline, int kClusterM = 1>
CUTLASS_DEVICE Pipeline make_tma_pipeline(typename Pipeline::SharedStorage& shared, int warp_group, int num_consumers,
                                          uint32_t transaction_bytes, uint32_t num_producers = 1) {
  typename Pipeline::Params params;
  params.role = warp_group == 0 ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer;
  params.is_leader = threadIdx.x == 0;
  params.num_consumers = num_consumers;
  params.num_producers = num_producers;
  params.transaction_bytes = transaction_bytes;
  return Pipeline(shared, params, cute::Shape<cute::Int<kClusterM>, cute::_1, cute::_1>{});
}

// The stages of K or V multicast to kClusterM CTAs: each consumer warpgroup's thread c releases
// the stage in CTA c (CUTLASS's own spread keeps two more values in registers across the loop,
// which spilled the hdim-512 kernel's). Without a cluster, CUTLASS's pipeline as it is.
template <int kStages, int kClusterM>
class MulticastTmaPipeline : public cutlass::PipelineTmaAsync<kStages> {
  using Base = cutlass::PipelineTmaAsync<kStages>;

 public:
  CUTLASS_DEVICE MulticastTmaPipeline(typename Base::SharedStorage& storage, typename Base::Params params,
                                      cute::Shape<cute::Int<kClusterM>, cute::_1, cute::_1> cluster_shape)
      : Base(storage, params, cluster_shape), empty_(&storage.empty_barrier_[0]) {}

  CUTLASS_DEVICE void consumer_release(typename Base::PipelineState state) {
    const uint32_t thread = threadIdx.x % cutlass::NumThreadsPerWarpGroup;
    empty_[state.index()].arrive(thread, thread < kClusterM);
  }

 private:
  typename Base::EmptyBarrier* empty_;
};
template <int kStages, int kClusterM>
using KvTmaPipeline =
    cute::conditional_t<kClusterM == 1, cutlass::PipelineTmaAsync<kStages>, MulticastTmaPipeline<kStages, kClusterM>>;

// Producer: waits for the next stage to be free, loads src into it (dst_stages(_, stage)) on the
// stage's barrier, and moves on. A multicast TMA writes the same stage, and signals the same
// barrier, in each CTA of multicast_mask.
template <class Pipeline, class State, class Tma, class TensorSrc, class TensorDst>
CUTLASS_DEVICE void tma_load_stage(Pipeline& pipeline, State& state, Tma const& tma, TensorSrc const& src,
                                   TensorDst const& dst_stages, uint16_t multicast_mask = 1) {
  pipeline.producer_acquire(state);
  // (SM90_TMA_LOAD takes the mask too, and ignores it.)
  cute::copy(tma.with(*pipeline.producer_get_barrier(state), multicast_mask), src, dst_stages(cute::_, state.index()));
  ++state;
}

}  // namespace flashhopper::hopper
