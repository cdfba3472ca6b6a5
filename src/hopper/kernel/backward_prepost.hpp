// The backward's two small kernels around the main one.
// Preprocess: per query row, D = rowsum(dO * O) and LSE * log2 e into the padded float32
// workspace buffers (rows past the used ones, up to the sequence's padded end: D = 0,
// LSE2 = +inf, so their P and dS are 0); with a
// learnable sink also each CTA's share of its gradient, -sum_rows exp(sink - LSE) * D, which
// SinkGradientReduce sums per head in a fixed order (so deterministic whatever the mode).
// Postprocess: dQ = scale * dQaccum, converted to the input dtype and layout.
#pragma once

#include <cmath>

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/numeric_types.h>

#include "hopper/common/seqlen.hpp"
#include "hopper/common/utils.hpp"
#include "hopper/common/workspace_rows.hpp"

namespace flashhopper::hopper {

using namespace cute;

template <class Element, int kHeadDim>
struct BackwardPreprocess {
  // A row is read by kLanesPerRow lanes in 16-byte chunks, kChunksPerLane each; every thread has
  // all its rows' loads in flight at once (one row a warp and 8-byte loads ran at 1.8 TB/s).
  static constexpr int kChunk = 16 / sizeof(Element);
  static_assert(kHeadDim % kChunk == 0);
  static constexpr int kChunksPerRow = kHeadDim / kChunk;
  static constexpr int kLanesPerRow = kChunksPerRow % 32 == 0 ? 32
                                      : kChunksPerRow % 16 == 0 ? 16
                                      : kChunksPerRow % 8 == 0  ? 8
                                      : kChunksPerRow % 4 == 0  ? 4
                                      : kChunksPerRow % 2 == 0  ? 2
                                                                : 1;
  static constexpr int kChunksPerLane = kChunksPerRow / kLanesPerRow;
  static constexpr int kRowsPerCta = 64;
  static constexpr int kThreads = kLanesPerRow >= 4 ? 256 : 64 * kLanesPerRow;
  static constexpr int kRowGroups = kThreads / kLanesPerRow;  // rows read at once
  static constexpr int kRowIters = kRowsPerCta / kRowGroups;
  static_assert(kRowIters >= 1 && kRowsPerCta % kRowGroups == 0);

  struct Params {
    Element const* ptr_o;   // [batch, seqlen_q, heads_q, d] or packed [total_q, heads_q, d]
    int64_t stride_o[3];    // batch (0 when packed), row, head
    Element const* ptr_do;
    int64_t stride_do[3];
    float const* ptr_lse;   // [batch, heads_q, seqlen_q] or packed [heads_q, total_q]
    int64_t stride_lse[3];  // batch (0 when packed), head, row
    int rows_per_sequence;  // the grid's rows per (sequence, head): max_seqlen_q rounded up to kRowAlign
    int heads_q;
    int head_dim_v;         // O's and dO's columns: the call's dv, at most kHeadDim (a multiple of kChunk)
    BackwardWorkspacePointers workspace;
    SeqlenParams seqlen;
    float const* learnable_sink;  // [heads_q] or null
    float* dsink_partial;         // [heads_q, batch * rows_per_sequence / kRowsPerCta], with the sink
  };

  CUTLASS_DEVICE void operator()(Params const& params) const {
    __shared__ float sink_terms[kRowsPerCta];
    using Vector = cutlass::Array<Element, kChunk>;
    const int group = threadIdx.x / kLanesPerRow;
    const int lane = threadIdx.x % kLanesPerRow;
    // A flat grid over (row block, head, batch): no 65535 limit on heads or batch.
    const int num_row_blocks = params.rows_per_sequence / kRowsPerCta;
    const int row_block = blockIdx.x % num_row_blocks;
    const int head = (blockIdx.x / num_row_blocks) % params.heads_q;
    const int batch = blockIdx.x / num_row_blocks / params.heads_q;
    const SeqlenInfo seq = SeqlenInfo::make(params.seqlen, batch);
    // The sequence's own padded rows only: past them (packed) lies the next sequence's.
    const int padded_rows = (seq.capacity_q + BackwardWorkspacePointers::kRowAlign - 1) /
                            BackwardWorkspacePointers::kRowAlign * BackwardWorkspacePointers::kRowAlign;
    const int64_t row0 = params.workspace.row0(seq, head);
    Element const* o_head = params.ptr_o + seq.batch_q * params.stride_o[0] + head * params.stride_o[2];
    Element const* do_head = params.ptr_do + seq.batch_q * params.stride_do[0] + head * params.stride_do[2];

    Vector o[kRowIters][kChunksPerLane], d_o[kRowIters][kChunksPerLane];
    float lse[kRowIters];
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kRowIters; ++i) {
      const int row = row_block * kRowsPerCta + i * kRowGroups + group;
      if (row < seq.seqlen_q) {
        const int64_t token = int64_t(seq.offset_q) + row;
        if (lane == 0)
          lse[i] = params.ptr_lse[seq.batch_q * params.stride_lse[0] + head * params.stride_lse[1] +
                                  token * params.stride_lse[2]];
        CUTLASS_PRAGMA_UNROLL
        for (int c = 0; c < kChunksPerLane; ++c) {
          const int col = (c * kLanesPerRow + lane) * kChunk;
          if (col < params.head_dim_v) {
            o[i][c] = *reinterpret_cast<Vector const*>(o_head + token * params.stride_o[1] + col);
            d_o[i][c] = *reinterpret_cast<Vector const*>(do_head + token * params.stride_do[1] + col);
          } else {
            o[i][c].clear();
            d_o[i][c].clear();
          }
        }
      }
    }
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kRowIters; ++i) {
      const int row_in_cta = i * kRowGroups + group;
      const int row = row_block * kRowsPerCta + row_in_cta;
      float sum = 0.f;
      if (row < seq.seqlen_q) {
        CUTLASS_PRAGMA_UNROLL
        for (int c = 0; c < kChunksPerLane; ++c) {
          CUTLASS_PRAGMA_UNROLL
          for (int e = 0; e < kChunk; ++e) sum += float(o[i][c][e]) * float(d_o[i][c][e]);
        }
      }
      // The row's lanes are kLanesPerRow consecutive lanes of one warp.
      CUTLASS_PRAGMA_UNROLL
      for (int offset = kLanesPerRow / 2; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffff, sum, offset);
      if (lane != 0) continue;
      float sink_term = 0.f;
      if (row < seq.seqlen_q) {
        params.workspace.dpsum[row0 + row] = sum;
        // A row that sees no key has LSE = -inf and must get P = 0, not exp2(-inf + inf).
        params.workspace.lse_log2[row0 + row] = lse[i] == -INFINITY ? INFINITY : lse[i] * float(M_LOG2E);
        // P_sink = exp(sink - LSE): the sink's share of the row, whose gradient is -P_sink * D.
        if (params.learnable_sink != nullptr) sink_term = -expf(params.learnable_sink[head] - lse[i]) * sum;
      } else if (row < padded_rows) {  // D = 0 and LSE2 = +inf give P = dS = 0
        params.workspace.dpsum[row0 + row] = 0.f;
        params.workspace.lse_log2[row0 + row] = INFINITY;
      }
      sink_terms[row_in_cta] = sink_term;
    }
    if (params.learnable_sink != nullptr) {
      __syncthreads();
      if (threadIdx.x == 0) {
        float sum = 0.f;
        for (int r = 0; r < kRowsPerCta; ++r) sum += sink_terms[r];
        const int64_t partials_per_head = int64_t(gridDim.x) / params.heads_q;
        params.dsink_partial[head * partials_per_head + batch * num_row_blocks + row_block] = sum;
      }
    }
  }
};

// dsink[h] = the sum of the preprocess's per-CTA shares of head h, in a fixed order.
struct SinkGradientReduce {
  static constexpr int kThreads = 256;
  struct Params {
    float const* dsink_partial;  // [heads, partials_per_head]
    int64_t partials_per_head;
    float* dsink;                // [heads]
    int64_t dsink_stride;
  };
  CUTLASS_DEVICE void operator()(Params const& params) const {
    __shared__ float sums[kThreads];
    const int head = blockIdx.x;
    float sum = 0.f;
    for (int64_t i = threadIdx.x; i < params.partials_per_head; i += kThreads)
      sum += params.dsink_partial[head * params.partials_per_head + i];
    sums[threadIdx.x] = sum;
    __syncthreads();
    for (int width = kThreads / 2; width > 0; width /= 2) {
      if (threadIdx.x < width) sums[threadIdx.x] += sums[threadIdx.x + width];
      __syncthreads();
    }
    if (threadIdx.x == 0) params.dsink[head * params.dsink_stride] = sums[0];
  }
};

// One CTA of the main kernel's MMA threads per (query block, head, batch) tile of dQaccum; each
// thread reads back the values it would hold in the main kernel and writes them as dQ.
template <class Mainloop>
struct BackwardPostprocess {
  using Element = typename Mainloop::Element;
  static constexpr int kBlockM = Mainloop::kBlockM;
  static constexpr int kHeadDim = Mainloop::kHeadDim;
  static constexpr int kThreads = Mainloop::kNumMmaThreads;
  using TileShape = Shape<Int<kBlockM>, Int<kHeadDim>>;  // the main kernel's dQ tile
  using ShapedQ = Shape<int32_t, int32_t, int32_t, int32_t>;  // (seqlen_q, d, heads_q, batch)
  using StridedQ = Stride<int64_t, _1, int64_t, int64_t>;

  struct Params {
    Element* ptr_dq;
    ShapedQ shape_dq;  // packed: (total_q, d, heads_q, 1)
    StridedQ stride_dq;
    float softmax_scale;
    BackwardWorkspacePointers workspace;
    SeqlenParams seqlen;
  };

  CUTLASS_DEVICE void operator()(Params const& params) const {
    // A flat grid over (m_block, head, batch), as the preprocess; blocks past a sequence's end
    // (packed: max_seqlen_q bounds the grid) return.
    const int num_m_blocks = (params.seqlen.seqlen_q + kBlockM - 1) / kBlockM;
    const int m_block = blockIdx.x % num_m_blocks;
    const int head = (blockIdx.x / num_m_blocks) % get<2>(params.shape_dq);
    const int batch = blockIdx.x / num_m_blocks / get<2>(params.shape_dq);
    const SeqlenInfo seq = SeqlenInfo::make(params.seqlen, batch);
    if (m_block * kBlockM >= seq.capacity_q) return;
    const int thread_idx = threadIdx.x;
    const int warp_group = thread_idx / cutlass::NumThreadsPerWarpGroup;
    const int thread_in_group = thread_idx % cutlass::NumThreadsPerWarpGroup;
    typename Mainloop::TiledMmadQ tiled_mma_dq;
    float const* dq_tile =
        params.workspace.dq_accum + (params.workspace.row0(seq, head) + int64_t(m_block) * kBlockM) * kHeadDim;
    Tensor mdQ = domain_offset(make_coord(seq.offset_q, _0{}),
                               make_tensor(make_gmem_ptr(params.ptr_dq), params.shape_dq, params.stride_dq)(_, _, head,
                                                                                                           seq.batch_q));
    Tensor coords = tiled_mma_dq.get_thread_slice(thread_idx).partition_C(make_identity_tensor(TileShape{}));
    Tensor tdQrdQ = partition_fragment_C(tiled_mma_dq, TileShape{});
    constexpr int kSteps = decltype(size(tdQrdQ))::value / 4;
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < kSteps; ++r) {
      const float4 v = *reinterpret_cast<float4 const*>(
          dq_tile + dq_accum_offset<kBlockM * kHeadDim>(warp_group, thread_in_group, r));
      tdQrdQ(4 * r) = v.x * params.softmax_scale;
      tdQrdQ(4 * r + 1) = v.y * params.softmax_scale;
      tdQrdQ(4 * r + 2) = v.z * params.softmax_scale;
      tdQrdQ(4 * r + 3) = v.w * params.softmax_scale;
    }
    Tensor gdQ = local_tile(mdQ, TileShape{}, make_coord(m_block, _0{}));
    store_accumulator_rows(tdQrdQ, coords, gdQ, seq.capacity_q - m_block * kBlockM, get<1>(params.shape_dq));
  }
};

template <class Kernel>
__global__ void __launch_bounds__(Kernel::kThreads) backward_prepost_entry(typename Kernel::Params const params) {
#if defined(__CUDA_ARCH__)  // the body in the device pass only (docs/kernel_families.md, "Build time")
  Kernel{}(params);
#endif
}

}  // namespace flashhopper::hopper
