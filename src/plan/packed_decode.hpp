// Decoding with GQA as the kernels run it: a host-side rewrite of a call's tensors (no CUDA), so
// that the CPU tests can check that it computes the same attention.
#pragma once

#include "hopper/common/forward_features.hpp"
#include "plan/problem_shape.hpp"

namespace flashhopper::detail {

// The attention the kernels run for a call. Decoding with GQA: the ratio query heads of a KV head
// become rows of one tile, so that each K/V block is loaded and multiplied once per KV head
// instead of once per query head.
// - One query token per sequence: q [B, 1, Hq, d] read as the strided view [B, ratio, Hkv, d] (row
//   j of KV head g is query head g * ratio + j), out and lse likewise. Exact where the one row sees
//   every key of its sequence, as every packed row then does: no mask, causal or a right bound only
//   (the row is the last position); the kernels then run without a mask.
// - Several query tokens and one KV head with qv (absorbed MLA, speculative decoding too): q [B, sq, Hq, d]
//   read as [B, sq * Hq, 1, d], row t * Hq + j being token t's head j, the mask kept, its row
//   positions divided by rows_per_token = Hq (the qv kernels with a KV cache's code do that; the
//   others, which packed prefill shares, stay without the division, so MQA leaves such calls as
//   they are). Where q,
//   out and qv have heads adjacent to tokens (strides Hq * d and d, as contiguous tensors). The lse
//   [B, Hq, sq] stays as given: its rows take two strides, which those kernels' epilogue and the
//   split-KV combine apply (row r: head r % Hq, token r / Hq).
//   Up to kMostTokensPacked tokens: where a query tile (64 to 192 rows) would be mostly empty
//   unpacked; past that the dense kernels, which those calls would leave, do more good.
// Neither with a learnable sink (one logit per query head) nor packed batches; one token not with an
// lse whose heads are not adjacent.
struct KernelCall {
  ForwardParams params;
  ProblemShape shape;
};

inline constexpr int64_t kMostTokensPacked = 64;

// Whether q-like t [B, sq, Hq, d]'s rows (token, head) form one stride, head fastest.
inline bool tokens_and_heads_are_one_stride(const Tensor& t, int64_t heads_q) {
  return !present(t) || t.stride[1] == heads_q * t.stride[2];
}

inline KernelCall kernel_call(const ForwardParams& p, const ProblemShape& s) {
  const MaskSpec mask = mask_spec(p);
  if (s.varlen_q || s.heads_q <= s.heads_kv || present(p.learnable_sink)) return {p, s};
  if (s.seqlen_q == 1) {
    const bool packable = mask.window_left < 0 && mask.attention_chunk == 0 && (!present(p.lse) || p.lse.stride[1] == 1);
    if (!packable) return {p, s};
    const int64_t ratio = s.heads_q / s.heads_kv;
    ForwardParams packed = p;
    for (Tensor* t : {&packed.q, &packed.out, &packed.qv}) {  // [B, 1, Hq, d] -> [B, ratio, Hkv, d]
      if (!present(*t)) continue;  // qv
      const int64_t head_stride = t->stride[2];
      t->shape[1] = ratio;
      t->shape[2] = s.heads_kv;
      t->stride[1] = head_stride;
      t->stride[2] = ratio * head_stride;
    }
    if (present(packed.lse)) {  // [B, Hq, 1] -> [B, Hkv, ratio]
      packed.lse.shape[1] = s.heads_kv;
      packed.lse.shape[2] = ratio;
      packed.lse.stride[1] = ratio;
      packed.lse.stride[2] = 1;
    }
    packed.causal = 0;
    packed.window_left = packed.window_right = -1;
    packed.num_sink_tokens = 0;
    ProblemShape shape = s;  // what the KV cache and the append made of the call stays as it was
    shape.seqlen_q = ratio;
    shape.heads_q = s.heads_kv;
    shape.total_q = s.batch * ratio;
    return {packed, shape};
  }
  // The kernels such a call runs on (the KV cache's code, qv where given) must group rows.
  using hopper::ForwardFeatures;
  const bool grouped_kernels = hopper::groups_query_rows(
      ForwardFeatures::kKvCache | (present(p.qv) ? ForwardFeatures::kQv : ForwardFeatures::kNone));
  const bool several_tokens = grouped_kernels && s.heads_kv == 1 && s.seqlen_q <= kMostTokensPacked &&
                              tokens_and_heads_are_one_stride(p.q, s.heads_q) &&
                              tokens_and_heads_are_one_stride(p.out, s.heads_q) &&
                              tokens_and_heads_are_one_stride(p.qv, s.heads_q);
  if (!several_tokens) return {p, s};
  ForwardParams packed = p;
  for (Tensor* t : {&packed.q, &packed.out, &packed.qv}) {  // [B, sq, Hq, d] -> [B, sq * Hq, 1, d]; lse as given
    if (!present(*t)) continue;  // qv
    t->shape[1] = s.seqlen_q * s.heads_q;
    t->shape[2] = 1;
    t->stride[1] = t->stride[2];
    t->stride[2] = t->shape[1] * t->stride[1];
  }
  ProblemShape shape = s;
  shape.seqlen_q = s.seqlen_q * s.heads_q;
  shape.heads_q = 1;
  shape.total_q = s.batch * shape.seqlen_q;
  shape.rows_per_token = s.heads_q;
  return {packed, shape};
}

}  // namespace flashhopper::detail
