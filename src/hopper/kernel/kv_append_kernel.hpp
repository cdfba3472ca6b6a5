// The KV cache's append, before the attention reads the cache: k_new/v_new [B, s_new, Hkv, d|dv]
// (or packed [total_new, Hkv, d|dv], sequence b's rows [cu_seqlens_new[b], cu_seqlens_new[b + 1]))
// into a dense cache at positions cache_seqlens[b] + t of row cache_batch_idx[b] (b without it),
// or into a paged one at those positions through that row of the page table,
// with the rotary embedding on the new keys' first rotary_dim dims; and, with rotary, q rotated
// into a copy the attention then reads (q itself is not written). Positions and rows outside the
// cache or the rotary tables are the caller's contract: such a row is not written (cache) or not
// rotated (tables), so nothing is read or written outside the tensors. One warp a row; plain CUDA.
#pragma once

#include <cstdint>

#include <cutlass/cutlass.h>
#include <cutlass/numeric_conversion.h>

namespace flashhopper::hopper {

template <class Element>
struct KvAppendKernel {
  static constexpr int kWarps = 8;
  static constexpr int kThreads = kWarps * 32;

  // A [.., token, head, column] tensor as element strides (batch, token, head); the column is
  // contiguous.
  struct Rows {
    Element* data;
    int64_t batch_stride, token_stride, head_stride;
    CUTLASS_DEVICE Element* row(int64_t b, int64_t token, int head) const {
      return data + b * batch_stride + token * token_stride + head * head_stride;
    }
  };

  struct Params {
    Rows k_new, v_new, k_cache, v_cache;  // k_new/v_new read only
    Rows q, q_rotated;                    // with rotary only; q read only. q_rotated dense [B, sq, Hq, d]
    int const* cache_seqlens;
    int const* cache_batch_idx;  // or null
    Element const* rotary_cos;   // [positions, rotary_dim / 2], or null: no rotary
    Element const* rotary_sin;
    int64_t cos_stride[2], sin_stride[2];
    int rotary_positions, rotary_half;
    int const* rotary_seqlens;  // or null: cache_seqlens
    bool interleaved, query_rows_advance;
    int const* cu_seqlens_q;    // packed q, or null
    int const* cu_seqlens_new;  // packed k_new/v_new [total_new, ..] (seqlen_new = total_new), or null
    int batch, seqlen_new, heads_kv, heads_q, seqlen_q, head_dim, head_dim_v, cache_rows, cache_len;
    // Paged: the cache is [pages = cache_rows, page_size = cache_len, Hkv, d] and position i of
    // sequence b is in page page_table[r * page_table_stride + i / cache_len], r = cache_batch_idx[b]
    // (b without it), one of page_table_rows. Null: dense.
    int const* page_table;
    int64_t page_table_stride;
    int page_table_rows, max_pages;
  };

  // Rows: the keys (k and v) of every (b, t, hk), or of every packed (token, hk), then with rotary
  // q's (b, i, h). (The launch sizes its grid with them, on the host.)
  CUTLASS_HOST_DEVICE static int64_t key_rows(Params const& p) {
    return (p.cu_seqlens_new != nullptr ? 1 : int64_t(p.batch)) * p.seqlen_new * p.heads_kv;
  }

  // The sequence that holds packed row `token`: the last b with cu_seqlens_new[b] <= token (a
  // binary search over the batch + 1 prefix sums), or -1 where none does or token lies past
  // cu_seqlens_new[batch].
  CUTLASS_DEVICE static int packed_sequence(Params const& p, int token) {
    if (token < __ldg(p.cu_seqlens_new) || token >= __ldg(p.cu_seqlens_new + p.batch)) return -1;
    int lo = 0, hi = p.batch - 1;  // cu_seqlens_new[lo] <= token < cu_seqlens_new[hi + 1]
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (__ldg(p.cu_seqlens_new + mid) <= token) lo = mid; else hi = mid - 1;
    }
    return lo;
  }
  CUTLASS_HOST_DEVICE static int64_t query_rows(Params const& p) {
    return p.rotary_cos == nullptr ? 0 : int64_t(p.batch) * p.seqlen_q * p.heads_q;
  }

  // dst[c] = src[c] for c < columns, the first 2 * rotary_half of them rotated at `position`
  // (position < 0: not rotated).
  CUTLASS_DEVICE static void copy_row(Params const& p, Element const* src, Element* dst, int columns, int position,
                                      int lane) {
    cutlass::NumericConverter<Element, float> to_element;
    const bool rotate = p.rotary_cos != nullptr && position >= 0 && position < p.rotary_positions;
    const int rotated = rotate ? 2 * p.rotary_half : 0;
    for (int c = rotated + lane; c < columns; c += 32) dst[c] = src[c];
    for (int i = lane; i < rotated / 2; i += 32) {
      const int ix = p.interleaved ? 2 * i : i, iy = p.interleaved ? 2 * i + 1 : i + p.rotary_half;
      const float x = float(src[ix]), y = float(src[iy]);
      const float cos = float(p.rotary_cos[position * p.cos_stride[0] + i * p.cos_stride[1]]);
      const float sin = float(p.rotary_sin[position * p.sin_stride[0] + i * p.sin_stride[1]]);
      dst[ix] = to_element(x * cos - y * sin);
      dst[iy] = to_element(x * sin + y * cos);
    }
  }

  CUTLASS_DEVICE void operator()(Params const& p) const {
    const int lane = threadIdx.x % 32;
    const int64_t item = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32;
    const int64_t keys = key_rows(p);
    if (item < keys) {  // (b, t, hk) or packed (token, hk), hk fastest
      const int hk = int(item % p.heads_kv);
      int b, t, token;  // sequence b's new key t is row (b, t) of k_new, or packed row token
      if (p.cu_seqlens_new != nullptr) {
        token = int(item / p.heads_kv);
        if ((b = packed_sequence(p, token)) < 0) return;
        t = token - __ldg(p.cu_seqlens_new + b);
      } else {
        t = int(item / p.heads_kv % p.seqlen_new);
        b = int(item / p.heads_kv / p.seqlen_new);
        token = t;
      }
      const int new_row_batch = p.cu_seqlens_new != nullptr ? 0 : b;
      int row = p.cache_batch_idx != nullptr ? __ldg(p.cache_batch_idx + b) : b;
      int at = __ldg(p.cache_seqlens + b) + t;
      if (p.page_table != nullptr) {  // the page that holds position `at`, and the row in it
        if (row < 0 || row >= p.page_table_rows || at < 0 || at >= p.max_pages * p.cache_len) return;
        row = __ldg(p.page_table + row * p.page_table_stride + at / p.cache_len);
        at %= p.cache_len;
      }
      if (row < 0 || row >= p.cache_rows || at < 0 || at >= p.cache_len) return;  // outside the cache
      const int offset = p.rotary_seqlens != nullptr ? __ldg(p.rotary_seqlens + b) : __ldg(p.cache_seqlens + b);
      copy_row(p, p.k_new.row(new_row_batch, token, hk), p.k_cache.row(row, at, hk), p.head_dim, offset + t, lane);
      copy_row(p, p.v_new.row(new_row_batch, token, hk), p.v_cache.row(row, at, hk), p.head_dim_v, -1, lane);
      return;
    }
    const int64_t query = item - keys;
    if (query >= query_rows(p)) return;  // (b, i, h), h fastest
    const int h = int(query % p.heads_q), i = int(query / p.heads_q % p.seqlen_q);
    const int b = int(query / p.heads_q / p.seqlen_q);
    int64_t token = i;  // q's row: dense (b, i); packed cu_seqlens_q[b] + i, within the sequence
    if (p.cu_seqlens_q != nullptr) {
      const int start = __ldg(p.cu_seqlens_q + b), end = __ldg(p.cu_seqlens_q + b + 1);
      if (i >= end - start) return;
      token = int64_t(start) + i;
    }
    const int offset = p.rotary_seqlens != nullptr ? __ldg(p.rotary_seqlens + b) : __ldg(p.cache_seqlens + b);
    const int64_t b_row = p.cu_seqlens_q != nullptr ? 0 : b;
    copy_row(p, p.q.row(b_row, token, h), p.q_rotated.row(b_row, token, h), p.head_dim,
             offset + (p.query_rows_advance ? i : 0), lane);
  }
};

}  // namespace flashhopper::hopper
