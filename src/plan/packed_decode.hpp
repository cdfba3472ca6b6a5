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
//   positions divided by rows_per_token = Hq (the qv kernels with a KV cache's code,
//   RowGrouping::kDivide). Where q,
//   out and qv have heads adjacent to tokens (strides Hq * d and d, as contiguous tensors). The lse
//   [B, Hq, sq] stays as given: its rows take two strides, which those kernels' epilogue and the
//   split-KV combine apply (row r: head r % Hq, token r / Hq).
//   Up to kMostTokensPacked tokens: where a query tile (64 to 192 rows) would be mostly empty
//   unpacked; past that the dense kernels, which those calls would leave, do more good.
// - Several query tokens without qv (speculative decoding with GQA or MQA): KV head g's rows are
//   r = t * G + j, token t's query head g * ratio + j for j < ratio, G the ratio rounded up to a
//   power of two (rows_per_token), the mask's positions shifted by log2(G) (the general kernels'
//   RowGrouping::kShift). q's rows of a KV head take two strides (token Hq * d, head d) where there
//   are several KV heads, so the call gathers q first into the workspace as [B, Hkv, sq, G, d],
//   rows j >= ratio zero (gather_source: q as given; params.q then views that copy as
//   [B, sq * G, Hkv, d], its data bound at run time). These kernels' epilogue writes rows, not
//   (token, head) pairs, so the call always writes float32 partials and the combine writes out and
//   lse as given (combine_always, grouped_partials below), skipping the padding rows.
// Neither with a learnable sink (one logit per query head) nor with seqused_q over dense queries (a
// count of tokens, not rows); packed queries only without qv; one token not with an lse whose heads
// are not adjacent.
struct KernelCall {
  ForwardParams params;
  ProblemShape shape;
  bool combine_always = false;  // partials at any split count, then the combine into out and lse
  Tensor gather_source{};       // present: q to gather into params.q's rows before the attention
};

inline constexpr int64_t kMostTokensPacked = 64;
// Several tokens without qv pack from this many keys (seqlen_k, the cache's capacity): below it the
// two small launches around the attention (the gather, the combine; a few us) may cost more than
// the key reads they save. A guess: measured from 4k keys only.
inline constexpr int64_t kFewestKeysGathered = 512;

// Whether q-like t [B, sq, Hq, d]'s rows (token, head) form one stride, head fastest.
inline bool tokens_and_heads_are_one_stride(const Tensor& t, int64_t heads_q) {
  return !present(t) || t.stride[1] == heads_q * t.stride[2];
}

// The rows of a packed call's float32 partials as the combine reads them: element strides of
// (split, batch, KV head, query head within it, token, column) over the contiguous
// [splits, B, Hkv, sq * g, dv] (row t * g + j; g = rows_per_token, at least the ratio Hq / Hkv;
// packed queries: one batch of total_q tokens), for out [B, sq, Hq, dv] and lse [B, Hq, sq] as
// given (packed: [total_q, Hq, dv] and [Hq, total_q]; query head h = KV head h / ratio, within it
// h % ratio).
struct GroupedPartials {
  int64_t out[6];
  int64_t lse[5];
};
inline GroupedPartials grouped_partials(const ProblemShape& given, int64_t rows_per_token) {
  const int64_t g = rows_per_token, dv = given.head_dim_v;
  const int64_t tokens = given.varlen_q ? given.total_q : given.seqlen_q, batches = given.varlen_q ? 1 : given.batch;
  const int64_t group = tokens * g, batch = given.heads_kv * group, split = batches * batch;
  return {{split * dv, batch * dv, group * dv, dv, g * dv, 1}, {split, batch, group, 1, g}};
}

// The several-token rewrite without qv (above), dense queries [B, sq, Hq, d] or packed ones
// [total_q, Hq, d] (cu_seqlens_q: sequences of up to max_seqlen_q tokens, which the kernels count
// in rows, SeqlenParams::q_rows_log2); the call as it is where it does not apply.
inline KernelCall tokens_by_kv_head(const ForwardParams& p, const ProblemShape& s) {
  const int64_t ratio = s.heads_q / s.heads_kv, group = int64_t(1) << ceil_log2(ratio);
  if (s.seqlen_q > kMostTokensPacked || s.seqlen_k < kFewestKeysGathered) return {p, s};
  KernelCall call{p, s, /*combine_always=*/true, {}};
  const int r = s.varlen_q ? 0 : 1;  // the row axis: [total_q, H, d] or [B, sq, H, d]
  const int64_t tokens = s.varlen_q ? s.total_q : s.seqlen_q, rows = tokens * group, d = s.head_dim;
  Tensor& q = call.params.q;
  if (s.heads_kv > 1 || group != ratio || p.q.stride[r] != s.heads_q * p.q.stride[r + 1]) {
    call.gather_source = p.q;  // as [B, sq, Hq, d] (packed: one batch), gathered contiguous, padded
    if (s.varlen_q) {
      call.gather_source.ndim = 4;
      for (int i = 3; i > 0; --i) {
        call.gather_source.shape[i] = p.q.shape[i - 1];
        call.gather_source.stride[i] = p.q.stride[i - 1];
      }
      call.gather_source.shape[0] = 1;
      call.gather_source.stride[0] = 0;
    }
    q.data = nullptr;
    q.stride[r] = d;
    q.stride[r + 1] = rows * d;
    if (!s.varlen_q) q.stride[0] = s.heads_kv * rows * d;
  } else {  // one KV head, a power-of-two ratio, whose rows (t, j) are one stride already
    q.stride[r + 1] = rows * p.q.stride[r + 1];
    q.stride[r] = p.q.stride[r + 1];
  }
  q.shape[r] = rows;
  q.shape[r + 1] = s.heads_kv;
  // out and lse as given: the combine writes them. The kernels' epilogue still describes an out of
  // the call's rows (never written: partials), here out's own memory seen so.
  call.params.out.shape[r] = rows;
  call.params.out.shape[r + 1] = s.heads_kv;
  call.params.out.stride[r] = p.out.stride[r + 1];
  call.params.out.stride[r + 1] = ratio * p.out.stride[r + 1];
  call.params.lse = {};
  call.shape.seqlen_q = s.seqlen_q * group;
  call.shape.total_q = s.varlen_q ? rows : s.batch * rows;
  call.shape.heads_q = s.heads_kv;
  call.shape.rows_per_token = group;
  return call;
}

inline KernelCall kernel_call(const ForwardParams& p, const ProblemShape& s) {
  const MaskSpec mask = mask_spec(p);
  // seqused_q counts tokens; the kernels scale it to rows for packed queries only (q_rows_log2).
  const bool tokens_used = present(p.seqused_q) && !s.varlen_q;
  if (s.heads_q <= s.heads_kv || present(p.learnable_sink) || tokens_used) return {p, s};
  if (!present(p.qv) && (s.varlen_q || s.seqlen_q > 1)) return tokens_by_kv_head(p, s);
  if (s.varlen_q) return {p, s};
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
  // The kernels such a call runs on (the KV cache's code and qv) must group rows.
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
