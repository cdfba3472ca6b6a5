// Where things live: the token and row layouts of the tensors, and each sequence's lengths.
#pragma once

#include <cstdint>
#include <vector>

#include "flashhopper/flashhopper.hpp"
#include "plan/problem_shape.hpp"
#include "reference/tensor_access.hpp"

namespace flashhopper::reference::detail {

using flashhopper::detail::present;
using flashhopper::detail::ProblemShape;

// Element i (or [i, j]) of an int32 metadata tensor, through its strides.
inline int64_t int_at(const Tensor& t, int64_t i) { return load_int(t, i * t.stride[0]); }
inline int64_t int_at(const Tensor& t, int64_t i, int64_t j) {
  return load_int(t, i * t.stride[0] + j * t.stride[1]);
}

// Where token i of sequence b lives in a tensor of per-token rows [.., heads, x]: dense
// [B, s, H, x], packed varlen [total, H, x] (sequence b starts at cu_seqlens[b]), or paged
// [num_pages, page_size, H, x] (token i is in page page_table[b, i / page_size]).
struct TokenLayout {
  enum class Kind { dense, packed, paged };
  Kind kind = Kind::dense;
  Tensor tensor{};
  Tensor cu_seqlens{};
  Tensor page_table{};
  Tensor cache_row{};      // dense or paged: sequence b lives in row cache_row[b] of the cache or
                           // the page table (cache_batch_idx)
  Tensor first_token{};    // dense or paged: token i of sequence b is at position first_token[b] + i
                           // of that row (cache_leftpad)

  static TokenLayout dense(const Tensor& t) { return {Kind::dense, t, {}, {}}; }
  static TokenLayout packed(const Tensor& t, const Tensor& cu) { return {Kind::packed, t, cu, {}}; }
  static TokenLayout paged(const Tensor& t, const Tensor& table) {
    return {Kind::paged, t, {}, table};
  }

  // Element offset of tensor[.., token, head, 0].
  int64_t offset(int64_t b, int64_t i, int64_t head) const {
    const int64_t* st = tensor.stride;
    const int64_t row = present(cache_row) ? int_at(cache_row, b) : b;
    const int64_t token = i + (present(first_token) ? int_at(first_token, b) : 0);
    switch (kind) {
      case Kind::dense: return row * st[0] + token * st[1] + head * st[2];
      case Kind::packed: return (int_at(cu_seqlens, b) + i) * st[0] + head * st[1];
      case Kind::paged: {
        const int64_t page_size = tensor.shape[1];
        const int64_t page = int_at(page_table, row, token / page_size);
        return page * st[0] + (token % page_size) * st[1] + head * st[2];
      }
    }
    return 0;
  }
  int64_t dim_stride() const { return tensor.stride[tensor.ndim - 1]; }

  template <class T>
  void load_row(int64_t b, int64_t i, int64_t head, int64_t n, T* dst) const {
    load_strided(tensor, offset(b, i, head), dim_stride(), n, dst);
  }
  template <class T>
  void store_row(int64_t b, int64_t i, int64_t head, int64_t n, const T* src) const {
    store_strided(tensor, offset(b, i, head), dim_stride(), n, src);
  }
};

// Where row i of sequence b and head h lives in an LSE-like tensor: dense [B, H, s] or packed
// [H, total]; with `has_split`, a leading split dim. For out_partial the last dim is dv and the
// offset is that of element 0.
struct RowLayout {
  Tensor tensor{};
  Tensor cu_seqlens{};  // present: packed
  bool has_split = false;

  int64_t offset(int64_t split, int64_t b, int64_t h, int64_t i) const {
    const int64_t* st = tensor.stride + (has_split ? 1 : 0);
    const int64_t base = has_split ? split * tensor.stride[0] : 0;
    if (present(cu_seqlens)) return base + h * st[0] + (int_at(cu_seqlens, b) + i) * st[1];
    return base + b * st[0] + h * st[1] + i * st[2];
  }
  int64_t dim_stride() const { return tensor.stride[tensor.ndim - 1]; }
};

// The rows and keys of one sequence that take part, and the rows and keys the tensors hold for
// it (dense or packed): rows in [rows, row_capacity) get O = 0, LSE = -inf and dQ = 0, keys in
// [keys, key_capacity) dK = dV = 0 (seqused_q/seqused_k shorter than the sequence).
struct Sequence {
  int64_t rows = 0;
  int64_t keys = 0;
  int64_t row_capacity = 0;
  int64_t key_capacity = 0;  // 0 for a paged or appended cache: its unused keys are not written
  int64_t new_keys = 0;      // keys it appends to the cache (k_new): s_new, or its packed rows
};

// Metadata that sets each sequence's length (absent tensors are ignored).
struct LengthSources {
  Tensor cu_seqlens_q{}, cu_seqlens_k{}, seqused_q{}, seqused_k{};
  Tensor cache_seqlens{}, page_table{};
  int64_t seqlen_new = 0;
  Tensor cache_batch_idx{}, cache_leftpad{};
  int64_t cache_rows = 0;  // with cache_batch_idx: k.shape[0] of a dense cache, page_table.shape[0] of a paged one
  Tensor cu_seqlens_k_new{};  // with an append: k_new packed [total_new = seqlen_new, Hkv, d]
};

// Each sequence's rows and keys, checked against what the tensors hold. Keys: the packed
// length (cu_seqlens_k) or the dense/paged capacity, replaced by seqused_k when given, and by
// cache_seqlens + s_new when a KV cache length is given (cache_seqlens wins over seqused_k), s_new
// the append's length or the sequence's packed new rows (cu_seqlens_k_new).
Status sequence_lengths(const ProblemShape& shape, const LengthSources& src,
                        std::vector<Sequence>* sequences);

}  // namespace flashhopper::reference::detail
