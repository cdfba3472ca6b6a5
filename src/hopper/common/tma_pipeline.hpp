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
template <class Pipeline>
CUTLASS_DEVICE Pipeline make_tma_pipeline(typename Pipeline::SharedStorage& shared, int warp_group, int num_consumers,
                                          uint32_t transaction_bytes, uint32_t num_producers = 1) {
  typename Pipeline::Params params;
  params.role = warp_group == 0 ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer;
  params.is_leader = threadIdx.x == 0;
  params.num_consumers = num_consumers;
  params.num_producers = num_producers;
  params.transaction_bytes = transaction_bytes;
  return Pipeline(shared, params, cute::Shape<cute::_1, cute::_1, cute::_1>{});
}

// Producer: waits for the next stage to be free, loads src into it (dst_stages(_, stage)) on the
// stage's barrier, and moves on.
template <class Pipeline, class State, class Tma, class TensorSrc, class TensorDst>
CUTLASS_DEVICE void tma_load_stage(Pipeline& pipeline, State& state, Tma const& tma, TensorSrc const& src,
                                   TensorDst const& dst_stages) {
  pipeline.producer_acquire(state);
  cute::copy(tma.with(*pipeline.producer_get_barrier(state)), src, dst_stages(cute::_, state.index()));
  ++state;
}

}  // namespace flashhopper::hopper
