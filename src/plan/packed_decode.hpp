// Decoding with GQA as the kernels run it: a host-side rewrite of a call's tensors (no CUDA), so
// that the CPU tests can check that it computes the same attention.
#pragma once

#include "plan/problem_shape.hpp"

namespace flashhopper::detail {

// The attention the kernels run for a call. Decoding (one query token per sequence, GQA): the
// ratio query heads of a KV head become the rows of one tile, q [B, 1, Hq, d] read as the strided
// view [B, ratio, Hkv, d] (row j of KV head g is query head g * ratio + j), out and lse likewise,
// so that each K/V block is loaded and multiplied once per KV head instead of once per query
// head. Exact where the one row sees every key of its sequence, as every packed row then does: no
// mask, causal or a right bound only (the row is the last position). Not with a learnable sink
// (one logit per query head) or an lse whose heads are not adjacent.
struct KernelCall {
  ForwardParams params;
  ProblemShape shape;
};
inline KernelCall kernel_call(const ForwardParams& p, const ProblemShape& s) {
  const MaskSpec mask = mask_spec(p);
  const bool packable = !s.varlen_q && s.seqlen_q == 1 && s.heads_q > s.heads_kv && !present(p.learnable_sink) &&
                        mask.window_left < 0 && mask.attention_chunk == 0 &&
                        (!present(p.lse) || p.lse.stride[1] == 1);
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

}  // namespace flashhopper::detail
