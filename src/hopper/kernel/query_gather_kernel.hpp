// Packed GQA over several query tokens (plan/packed_decode.hpp): q [B, sq, Hq, d] (any strides,
// its rows 16-byte aligned) copied into [B, Hkv, sq, group, d], contiguous, so that the forward
// reads KV head g's rows t * group + j (token t's query head g * ratio + j) as one stride; rows
// j >= ratio (group: the ratio rounded up to a power of two) are zeros. A few MB against the
// cache's GB; plain CUDA, 16-byte copies, the destination written in order.
#pragma once

#include <cstdint>

#include <cutlass/cutlass.h>

namespace flashhopper::hopper {

struct QueryGatherKernel {
  static constexpr int kThreads = 256;
  static constexpr int kChunkBytes = 16;

  struct Params {
    char const* src;
    int64_t src_stride[3];  // bytes: batch, token, query head
    char* dst;
    int64_t batch;
    int tokens, heads_kv, ratio;
    int group;       // rows a token: ratio, or the power of two above it
    int row_chunks;  // a row's bytes / kChunkBytes
  };

  CUTLASS_DEVICE void operator()(Params const& p) const {
    const int64_t total = p.batch * p.heads_kv * p.tokens * p.group * p.row_chunks;
    for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < total; i += int64_t(gridDim.x) * kThreads) {
      int64_t rest = i;  // (batch, KV head, token, row of the group, chunk), chunk fastest
      const int chunk = int(rest % p.row_chunks);
      rest /= p.row_chunks;
      const int head_in_group = int(rest % p.group);
      rest /= p.group;
      if (head_in_group >= p.ratio) {  // padding: a row of zeros
        reinterpret_cast<uint4*>(p.dst)[i] = make_uint4(0, 0, 0, 0);
        continue;
      }
      const int token = int(rest % p.tokens);
      rest /= p.tokens;
      const int kv_head = int(rest % p.heads_kv);
      const int64_t batch = rest / p.heads_kv;
      const int head = kv_head * p.ratio + head_in_group;
      char const* from = p.src + batch * p.src_stride[0] + token * p.src_stride[1] + head * p.src_stride[2];
      reinterpret_cast<uint4*>(p.dst)[i] = reinterpret_cast<uint4 const*>(from)[chunk];
    }
  }
};

}  // namespace flashhopper::hopper
