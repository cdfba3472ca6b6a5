// CPU reference attention: the meaning of every parameter, in plain loops with double
// accumulation. It takes the public parameter structs with HOST pointers; inputs may be bf16,
// fp16, fp32 or fp64 and outputs fp32 or fp64 (or bf16/fp16 in low-precision emulation).
//
// Conventions beyond docs/conventions.md:
// - Lengths. A sequence's query rows: its cu_seqlens_q length (dense: sq), or seqused_q[b].
//   Its keys: its cu_seqlens_k length (dense: sk; paged: max_pages * page_size), replaced by
//   seqused_k[b] when given, and by cache_seqlens[b] + s_new when cache_seqlens is given
//   (cache_seqlens wins over seqused_k).
// - Only what takes part is written: out/lse rows past seqused_q are left untouched (as
//   FlashAttention-3 does), and so are dq rows past seqused_q and dk/dv rows past a sequence's
//   keys. A row that takes part but sees no key gets O = 0, LSE = -inf (sigma_h with a learnable
//   sink), dQ = 0; a key that takes part but that no row sees gets dK = dV = 0.
// - Masks: problem_shape.hpp's MaskSpec rule, attention_chunk included (a chunk cuts the sink
//   tokens too).
// - Learnable sink sigma_h (learnable_sink, fp32 or fp64 [Hq] in host memory; -inf: none for
//   that head, NaN/+inf refused): e^sigma_h joins every row's softmax denominator with no value,
//   so LSE_i = log(sum_j e^S_ij + e^sigma_h) and O_i = sum_j e^(S_ij - LSE_i) V_j; with
//   num_splits > 1 it joins split 0 only, so that combine() counts it once. The backward's
//   dS/dQ/dK/dV formulas are unchanged given that LSE, and dsink (fp32 or fp64 [Hq], optional,
//   with learnable_sink only) is -sum over sequences and rows of exp(sigma_h - LSE_i) D_i,
//   D_i = rowsum(dO_i * O_i), summed over each sequence's rows in order, then over sequences in
//   order (float32 accumulation in low-precision emulation, like the softmax).
// - Outputs are written in their tensor's dtype (fp64, fp32, bf16, fp16; rounded to nearest
//   even); lse may be fp32 or fp64.
// - qv (forward): the scores are S = Q K^T + Qv V^T, summed over d + dv columns as one dot
//   product (in low-precision emulation one float32 sum, rounded once); default scale
//   1/sqrt(d + dv).
// - Results do not depend on the thread count: every sum runs in a fixed order (the GQA sums
//   of dK/dV add the group's query heads in head order).
// - fp8 (e4m3) inputs, forward only: read exactly, times their descale factors q/k/v_descale
//   [B, Hkv] (fp32 or fp64) when given; low-precision emulation is Fp8Math (P rounded to e4m3, O
//   to bf16).
// - Refusals come back as a Status, nothing is written then: an fp8 backward (FH_ERROR_NOT_SUPPORTED),
//   metadata that points outside the tensors, shapes that disagree (FH_ERROR_INVALID_ARGUMENT).
#pragma once

#include "flashhopper/flashhopper.hpp"

namespace flashhopper::reference {

struct Options {
  // false: exact, double accumulation, no rounding of intermediates.
  // true: a plain low-precision implementation as PyTorch computes attention in the input
  //       dtype: S = round(scale * Q K^T), P = round(softmax(S)), O = round(P V), each product
  //       accumulated in float32 and rounded to the dtype of q (bf16/fp16). Its error versus
  //       the exact result is the yardstick of the pass rule.
  //       Softcap and mask act in float32 on the rounded S; softmax (with the learnable sink)
  //       and LSE are float32.
  //       Backward: D = rowsum(dO * O) from the rounded O; dP = round(dO V^T),
  //       dS = round(P * (dP - D) [* (1 - tanh^2)]), dQ = round(scale * dS K),
  //       dK = round(scale * dS^T Q), dV = round(P^T dO) per query head; for GQA the group's
  //       rounded per-head dK/dV are summed in float32 and rounded once more.
  //       q in fp32 emulates float32 attention (no rounding); fp64 q is refused.
  //       combine() ignores this flag (it is always exact).
  bool emulate_low_precision = false;
  int num_threads = 0;  // 0: all hardware threads
};

// O and LSE (LSE optional). With num_splits > 1, writes the float32 partials instead:
// out_partial [num_splits, B, Hq, sq, dv], lse_partial [num_splits, B, Hq, sq], where split s
// attends to keys [s*c, (s+1)*c) with c = ceil(seqlen_k_of_the_sequence / num_splits); out/lse
// are then left untouched. A split that sees no key of a row gives it O_s = 0, LSE_s = -inf.
// With varlen q the partials are out_partial [num_splits, Hq, total_q, dv] and lse_partial
// [num_splits, Hq, total_q] (the dense layout with B = 1 and sq = total_q), which combine()
// takes as they are. Paged KV with k_new/v_new appends into the (host) cache first: k_new[b, t]
// becomes key cache_seqlens[b] + t of sequence b, through the page table when paged or in
// dense k [B, sk_max, Hkv, d] otherwise; the call writes into params.k and params.v.
Status forward(const ForwardParams& params, const Options& options = {},
               const Tensor* out_partial = nullptr, const Tensor* lse_partial = nullptr);

// dQ, dK, dV. Recomputes the forward itself in double: params.out and params.lse are not read.
Status backward(const BackwardParams& params, const Options& options = {});

// LSE = log sum exp(LSE_s), O = sum exp(LSE_s - LSE) O_s; all splits -inf: O = 0, LSE = -inf.
// Dense: out_partial [S, B, H, sq, dv], lse_partial [S, B, H, sq] into out [B, sq, H, dv],
// lse [B, H, sq]. Varlen: out_partial [S, H, total_q, dv], lse_partial [S, H, total_q] into
// out [total_q, H, dv], lse [H, total_q]. lse is optional. Every row is combined.
Status combine(const CombineParams& params, const Options& options = {});

}  // namespace flashhopper::reference
