// The problem's static geometry, read off a parameter struct once so that the checks, the
// dispatch and the CPU reference agree on what the tensors mean. Host code only.
#pragma once

#include <cmath>
#include <cstdint>

#include "flashhopper/flashhopper.hpp"

namespace flashhopper::detail {

struct ProblemShape {
  int64_t batch = 0;
  int64_t seqlen_q = 0;       // dense: q.shape[1]; varlen: max_seqlen_q
  int64_t seqlen_k = 0;       // dense: k.shape[1]; varlen: max_seqlen_k; paged: max_pages * page_size
  int64_t total_q = 0;        // varlen: q.shape[0]
  int64_t total_k = 0;        // varlen: k.shape[0]
  int64_t heads_q = 0;
  int64_t heads_kv = 0;
  int64_t head_dim = 0;       // d
  int64_t head_dim_v = 0;     // dv
  int64_t page_size = 0;      // paged only
  int64_t num_pages = 0;      // paged only
  int64_t max_pages = 0;      // paged only: page_table.shape[1]
  int64_t seqlen_new = 0;     // appending: k_new.shape[1]; packed (cu_seqlens_k_new): total_new,
                              // a bound of every sequence's new keys
  bool varlen_q = false;
  bool varlen_k = false;
  bool varlen_k_new = false;  // k_new/v_new packed [total_new, Hkv, d] (cu_seqlens_k_new)
  bool paged = false;
  bool append_kv = false;
  // Packed GQA over several query tokens (plan/packed_decode.hpp): the query rows of one token, a
  // KV head's query heads; rows t * rows_per_token .. + rows_per_token - 1 are token t. 1 otherwise.
  int64_t rows_per_token = 1;
};

// The least k with 2^k >= x (x >= 1).
inline int ceil_log2(int64_t x) {
  int k = 0;
  while ((int64_t(1) << k) < x) ++k;
  return k;
}

// log2 of rows_per_token rounded up (exact where the kernels shift: a power of two there).
inline int rows_per_token_log2(const ProblemShape& s) { return ceil_log2(s.rows_per_token); }

// Window bounds after folding `causal` in: causal is (-1, 0). -1 means unbounded.
// Query row i sees key j (off = sk - sq, p = i + off) iff
//   (p - wl <= j or wl < 0 or j < num_sink_tokens) and (j <= p + wr or wr < 0), and, with
//   attention_chunk = c > 0, floor(p / c) * c <= j < floor(p / c) * c + c (floor division, so a
//   row with p < 0 sees no key of a chunk).
struct MaskSpec {
  int32_t window_left = -1;
  int32_t window_right = -1;
  int32_t num_sink_tokens = 0;
  int32_t attention_chunk = 0;
  bool is_causal() const { return window_left < 0 && window_right == 0 && attention_chunk == 0; }
  // Anything beyond no mask and causal: a window bound, or chunks.
  bool is_local() const { return is_masked() && !is_causal(); }
  bool is_masked() const { return window_left >= 0 || window_right >= 0 || attention_chunk > 0; }
};

inline bool present(const Tensor& t) { return t.data != nullptr; }

// fp8's v may come column-major: [B, S, Hkv, dv] with the keys contiguous (FA3's V_colmajor),
// which the kernels load as P V's operand, with no transpose. Any other v has its last dim
// contiguous (the validation's rule).
inline bool v_column_major(const ForwardParams& p) {
  return p.q.dtype == FH_DTYPE_FP8_E4M3 && p.v.ndim == 4 && p.v.shape[3] > 1 && p.v.stride[3] != 1 &&
         p.v.stride[1] == 1;
}

// Whether a call (either pass) needs the kernels for packed batches: cu_seqlens, or seqused,
// which a dense layout may carry too (rows past it take no part).
template <class Params>
bool uses_packed_batches(const Params& p, const ProblemShape& s) {
  return s.varlen_q || s.varlen_k || present(p.seqused_q) || present(p.seqused_k);
}

// a * b for extents read before they are checked: saturates at INT64_MAX (a huge product is then
// refused by the shape checks) instead of overflowing.
inline int64_t saturating_product(int64_t a, int64_t b) {
  int64_t product = 0;
  return __builtin_mul_overflow(a, b, &product) ? INT64_MAX : product;
}

// Assumes the rank checks passed (the validator calls it only then).
inline ProblemShape forward_shape(const ForwardParams& p) {
  ProblemShape s;
  s.varlen_q = present(p.cu_seqlens_q);
  s.varlen_k = present(p.cu_seqlens_k);
  s.paged = present(p.page_table);
  s.append_kv = present(p.k_new);
  const int qo = s.varlen_q ? 0 : 1;  // offset of the head dim in q's shape
  s.batch = s.varlen_q ? p.cu_seqlens_q.shape[0] - 1 : p.q.shape[0];
  s.seqlen_q = s.varlen_q ? p.max_seqlen_q : p.q.shape[1];
  s.total_q = s.varlen_q ? p.q.shape[0] : saturating_product(s.batch, s.seqlen_q);
  s.heads_q = p.q.shape[qo + 1];
  s.head_dim = p.q.shape[qo + 2];
  const int ko = (s.varlen_k && !s.paged) ? 0 : 1;
  s.heads_kv = p.k.shape[ko + 1];
  s.head_dim_v = p.v.shape[ko + 2];
  if (s.paged) {
    s.num_pages = p.k.shape[0];
    s.page_size = p.k.shape[1];
    s.max_pages = p.page_table.shape[1];
    s.seqlen_k = saturating_product(s.max_pages, s.page_size);
  } else if (s.varlen_k) {
    s.total_k = p.k.shape[0];
    s.seqlen_k = p.max_seqlen_k;
  } else {
    s.seqlen_k = p.k.shape[1];
    s.total_k = saturating_product(s.batch, s.seqlen_k);
  }
  s.varlen_k_new = s.append_kv && present(p.cu_seqlens_k_new);
  if (s.append_kv) s.seqlen_new = p.k_new.shape[s.varlen_k_new ? 0 : 1];
  return s;
}

inline ProblemShape backward_shape(const BackwardParams& p) {
  ForwardParams f = default_forward_params();
  f.q = p.q;
  f.k = p.k;
  f.v = p.v;
  f.cu_seqlens_q = p.cu_seqlens_q;
  f.cu_seqlens_k = p.cu_seqlens_k;
  f.max_seqlen_q = p.max_seqlen_q;
  f.max_seqlen_k = p.max_seqlen_k;
  return forward_shape(f);
}

inline MaskSpec mask_spec(int32_t causal, int32_t window_left, int32_t window_right,
                          int32_t num_sink_tokens, int32_t attention_chunk = 0) {
  MaskSpec m;
  m.attention_chunk = attention_chunk;
  if (causal) {
    m.window_left = -1;
    m.window_right = 0;
  } else {
    m.window_left = window_left;
    m.window_right = window_right;
  }
  m.num_sink_tokens = num_sink_tokens;
  return m;
}

// FlashAttention's window arguments in the parameter structs' terms (fh_window_from_fa3).
struct Fa3Window {
  int32_t causal;
  int64_t window_left, window_right;
};
inline Fa3Window window_from_fa3(bool causal, int64_t left, int64_t right, int64_t seqlen_q, int64_t seqlen_k) {
  if (left >= seqlen_k - 1) left = -1;
  if (right >= seqlen_q - 1) right = -1;
  if (causal) right = 0;
  if (left == -1 && right == 0) return {1, -1, -1};
  return {0, left, right};
}

template <class Params>
inline MaskSpec mask_spec(const Params& p) {
  return mask_spec(p.causal, p.window_left, p.window_right, p.num_sink_tokens, p.attention_chunk);
}

inline double default_scale(float scale, int64_t head_dim) {
  return scale != 0.f ? double(scale) : 1.0 / std::sqrt(double(head_dim));
}

// The forward's scores sum over d columns, and over dv more with qv (S = Q K^T + Qv V^T): the
// default scale is 1/sqrt of that, as FlashAttention-3's.
inline double forward_scale(const ForwardParams& p, const ProblemShape& s) {
  return default_scale(p.softmax_scale, s.head_dim + (present(p.qv) ? s.head_dim_v : 0));
}

}  // namespace flashhopper::detail
