// Each sequence's rows and keys (sequences.hpp), checked against what the tensors hold.
#include "reference/sequences.hpp"

#include <cstdint>
#include <string>
#include <vector>

#include "reference/checks.hpp"

namespace flashhopper::reference::detail {

Status sequence_lengths(const ProblemShape& shape, const LengthSources& src,
                        std::vector<Sequence>* sequences) {
  sequences->assign(shape.batch, {});
  auto check_prefix_sums = [&](const Tensor& cu, const char* name, int64_t total) -> Status {
    for (int64_t b = 0; b <= shape.batch; ++b) {
      const int64_t at = int_at(cu, b);
      const int64_t before = b > 0 ? int_at(cu, b - 1) : 0;
      if (at < before || at > total) {
        return invalid(std::string(name) + "[" + std::to_string(b) + "] = " + std::to_string(at) +
                       " is not a non-decreasing prefix sum within [0, " + std::to_string(total) +
                       "]");
      }
    }
    return {};
  };
  if (shape.varlen_q) {
    FLASHHOPPER_REFERENCE_CHECK(check_prefix_sums(src.cu_seqlens_q, "cu_seqlens_q", shape.total_q));
  }
  if (shape.varlen_k) {  // paged: only its differences count (each sequence's keys in its table row)
    FLASHHOPPER_REFERENCE_CHECK(
        check_prefix_sums(src.cu_seqlens_k, "cu_seqlens_k", shape.paged ? INT64_MAX : shape.total_k));
  }
  const bool packed_new = present(src.cu_seqlens_k_new);
  if (packed_new) {
    FLASHHOPPER_REFERENCE_CHECK(check_prefix_sums(src.cu_seqlens_k_new, "cu_seqlens_k_new", src.seqlen_new));
  }
  for (int64_t b = 0; b < shape.batch; ++b) {
    const std::string seq = "sequence " + std::to_string(b) + ": ";
    Sequence& s = (*sequences)[b];
    const int64_t q_capacity = shape.varlen_q
                                   ? int_at(src.cu_seqlens_q, b + 1) - int_at(src.cu_seqlens_q, b)
                                   : shape.seqlen_q;
    s.rows = present(src.seqused_q) ? int_at(src.seqused_q, b) : q_capacity;
    s.row_capacity = q_capacity;
    if (s.rows < 0 || s.rows > q_capacity) {
      return invalid(seq + std::to_string(s.rows) + " query rows used, but it holds " +
                     std::to_string(q_capacity));
    }
    const int64_t k_packed = shape.varlen_k
                                 ? int_at(src.cu_seqlens_k, b + 1) - int_at(src.cu_seqlens_k, b)
                                 : shape.seqlen_k;
    const int64_t k_capacity = shape.paged ? shape.max_pages * shape.page_size : k_packed;
    s.keys = k_packed;
    s.key_capacity = shape.paged || present(src.cache_seqlens) ? 0 : k_packed;
    if (present(src.seqused_k)) s.keys = int_at(src.seqused_k, b);
    const int64_t row = present(src.cache_batch_idx) ? int_at(src.cache_batch_idx, b) : b;
    if (present(src.cache_batch_idx) && (row < 0 || row >= src.cache_rows)) {
      return invalid(seq + "cache_batch_idx[" + std::to_string(b) + "] = " + std::to_string(row) + " is not a row of " +
                     (shape.paged ? "page_table" : "k") + " (" + std::to_string(src.cache_rows) + " rows)");
    }
    int64_t first = 0;  // the cache position of the sequence's first key (cache_leftpad)
    if (present(src.cache_seqlens)) {
      const int64_t cached = int_at(src.cache_seqlens, b);
      if (cached < 0) {  // the append would write before the sequence's first key
        return invalid(seq + "cache_seqlens[" + std::to_string(b) + "] = " + std::to_string(cached) +
                       " is negative; cached lengths are >= 0");
      }
      if (present(src.cache_leftpad)) {
        first = int_at(src.cache_leftpad, b);
        if (first < 0 || first > cached) {
          return invalid(seq + "cache_leftpad[" + std::to_string(b) + "] = " + std::to_string(first) +
                         " is not within [0, cache_seqlens[" + std::to_string(b) + "] = " + std::to_string(cached) +
                         "]");
        }
      }
      s.new_keys = packed_new ? int_at(src.cu_seqlens_k_new, b + 1) - int_at(src.cu_seqlens_k_new, b)
                              : src.seqlen_new;
      s.keys = cached + s.new_keys - first;
    }
    if (s.keys < 0 || first + s.keys > k_capacity) {
      return invalid(seq + std::to_string(first + s.keys) + " cache positions used (after any append), but the " +
                     "key tensor holds " + std::to_string(k_capacity) + " for it");
    }
    if (shape.paged && s.keys > 0) {  // the pages that hold positions [first, first + keys) of its row
      for (int64_t p = first / shape.page_size; p <= (first + s.keys - 1) / shape.page_size; ++p) {
        const int64_t page = int_at(src.page_table, row, p);
        if (page < 0 || page >= shape.num_pages) {
          return invalid(seq + "page_table[" + std::to_string(row) + ", " + std::to_string(p) +
                         "] = " + std::to_string(page) + " is not a page of k (" +
                         std::to_string(shape.num_pages) + " pages)");
        }
      }
    }
  }
  return {};
}

}  // namespace flashhopper::reference::detail
