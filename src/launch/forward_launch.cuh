// Composes the forward kernel for one (dtype, head dim, mask kind, softcap) and launches it.
#pragma once

#include <cuda_runtime_api.h>

#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include "hopper/collective/epilogue_fwd.hpp"
#include "hopper/collective/mainloop_fwd.hpp"
#include "hopper/common/tile_scheduler.hpp"
#include "hopper/common/tile_size.hpp"
#include "hopper/kernel/forward_kernel.hpp"
#include "launch/element_of.cuh"
#include "launch/forward_launch.hpp"
#include "launch/launch_common.cuh"

namespace flashhopper::launch {

template <fh_dtype kDType, int kHeadDim, hopper::MaskKind kMask, bool kSoftcap>
cudaError_t run_forward_hdim(const ForwardParams& p, const detail::ProblemShape& s, cudaStream_t stream) {
  using namespace cute;
  using namespace flashhopper::hopper;
  using Element = typename ElementOf<kDType>::type;
  using Tile = ForwardTileSize<kHeadDim, /*kMasked=*/kMask != MaskKind::kNone>;
  using Mainloop = ForwardMainloop<Element, Tile::kBlockM, Tile::kBlockN, kHeadDim, Tile::kStages, kMask, kSoftcap>;
  using Epilogue = ForwardEpilogue<Element, Tile::kBlockM, kHeadDim, typename Mainloop::TiledMmaPV>;
  // Causal tiles differ in length (longest first); a window's are alike, and those run together
  // share their K/V in L2 when the blocks of a head go together.
  using Scheduler = StaticPersistentScheduler</*kLongestFirst=*/kMask == MaskKind::kCausal>;
  using Kernel = ForwardKernel<Mainloop, Epilogue, Scheduler>;

  const int batch = int(s.batch), seqlen_q = int(s.seqlen_q), seqlen_k = int(s.seqlen_k);
  const int heads_q = int(s.heads_q), heads_kv = int(s.heads_kv);
  typename Mainloop::Arguments mainloop_args{
      static_cast<Element const*>(p.q.data),
      make_shape(seqlen_q, kHeadDim, heads_q, batch),
      make_stride(p.q.stride[1], _1{}, p.q.stride[2], p.q.stride[0]),
      static_cast<Element const*>(p.k.data),
      make_shape(seqlen_k, kHeadDim, heads_kv, batch),
      make_stride(p.k.stride[1], _1{}, p.k.stride[2], p.k.stride[0]),
      static_cast<Element const*>(p.v.data),
      make_shape(kHeadDim, seqlen_k, heads_kv, batch),
      make_stride(_1{}, p.v.stride[1], p.v.stride[2], p.v.stride[0]),
      float(detail::default_scale(p.softmax_scale, kHeadDim)),
      p.softcap,
      local_mask_params(p),
      static_cast<float const*>(p.learnable_sink.data)};
  typename Epilogue::Arguments epilogue_args{
      static_cast<Element*>(p.out.data),
      make_shape(seqlen_q, kHeadDim, heads_q, batch),
      make_stride(p.out.stride[1], _1{}, p.out.stride[2], p.out.stride[0]),
      static_cast<float*>(p.lse.data),
      make_stride(_1{}, p.lse.data ? p.lse.stride[1] : 0, p.lse.data ? p.lse.stride[0] : 0)};

  int num_sms = 0, l2_bytes = 0;
  cudaError_t err = device_sms_and_l2(&num_sms, &l2_bytes);
  if (err != cudaSuccess) return err;

  const int num_m_blocks = (seqlen_q + Tile::kBlockM - 1) / Tile::kBlockM;
  typename Kernel::Params params{Mainloop::to_underlying_arguments(mainloop_args),
                                 Epilogue::to_underlying_arguments(epilogue_args),
                                 Scheduler::make_params(num_m_blocks, heads_q, batch,
                                                        int64_t(seqlen_k) * 2 * kHeadDim * sizeof(Element), l2_bytes,
                                                        num_sms)};

  return launch_kernel<Kernel>(forward_kernel_entry<Kernel>, Scheduler::grid_size(params.scheduler, num_sms),
                               params, stream);
}

}  // namespace flashhopper::launch
