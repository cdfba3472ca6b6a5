// Where a tile's sequence lies: its used lengths and its first row along the tensors' row axis,
// built once per tile from the batch index and the varlen arguments (cu_seqlens, seqused) or the
// dense shapes. Every collective of a tile takes the same SeqlenInfo.
//
// Dense tensors are (seqlen, d, heads, batch) and a sequence is one batch index. Packed (varlen)
// tensors are (total, d, heads, 1) and sequence b is the rows [cu_seqlens[b], cu_seqlens[b + 1]).
// Monotone cu_seqlens are the caller's contract; whatever they hold, a sequence is clamped into
// the tensor (0 <= start <= end <= total) and its length to max_seqlen, so that no kernel reads
// or writes outside the tensors or the workspace. seqused (dense or packed) shortens a sequence:
// only its first seqused[b] tokens take part (clamped likewise). A dense KV cache (cache_seqlens)
// sets a sequence's keys instead: the cache positions [cache_leftpad[b], cache_seqlens[b] + s_new)
// of cache row cache_batch_idx[b] (b without it), clamped to the cache; s_new is the append's
// length, or sequence b's with the new keys packed (cu_seqlens_k_new). A paged K/V with
// cu_seqlens_k (keys_paged) takes only the lengths from it: sequence b's keys are the positions
// [0, cu_seqlens_k[b + 1] - cu_seqlens_k[b]) of row b of the page table.
#pragma once

#include <cutlass/cutlass.h>

namespace flashhopper::hopper {

struct SeqlenParams {
  int seqlen_q;  // dense: the tensors' sequence length; packed: max_seqlen_q, a bound of every length
  int seqlen_k;
  int total_q;   // rows along the row axis: packed: total tokens; dense: seqlen_q
  int total_k;
  int const* cu_seqlens_q = nullptr;  // [batch + 1], or null: dense
  int const* cu_seqlens_k = nullptr;
  int const* seqused_q = nullptr;     // [batch], or null
  int const* seqused_k = nullptr;
  int const* cache_seqlens = nullptr;    // [batch], or null: a dense KV cache (forward)
  int const* cache_leftpad = nullptr;    // [batch], or null
  int const* cache_batch_idx = nullptr;  // [batch], or null
  int seqlen_new = 0;                    // keys appended after the cached ones
  int const* cu_seqlens_new = nullptr;   // [batch + 1], or null: seqlen_new for every sequence
  bool keys_paged = false;               // K/V are paged (the forward): cu_seqlens_k sets lengths only
  // Packed GQA over several query tokens with packed queries (plan/packed_decode.hpp): a token is
  // 1 << this rows; cu_seqlens_q and seqused_q count tokens, seqlen_q and total_q rows.
  int q_rows_log2 = 0;

  CUTLASS_HOST_DEVICE bool packed_q() const { return cu_seqlens_q != nullptr; }
  CUTLASS_HOST_DEVICE bool packed_k() const { return cu_seqlens_k != nullptr; }
};

struct SeqlenInfo {
  int seqlen_q;      // the rows that take part (seqused_q, when given)
  int seqlen_k;      // the keys that take part
  int capacity_q;    // the sequence's rows in the tensor: rows in [seqlen_q, capacity_q) get O = 0,
  int capacity_k;    // LSE = -inf and zero gradients, keys in [seqlen_k, capacity_k) zero dK, dV
  int offset_q = 0;  // the sequence's first row along the row axis (0 when dense)
  int offset_k = 0;
  int batch_q = 0;   // its index along the batch axis (0 when packed)
  int batch_k = 0;
  int batch = 0;     // the sequence's index in the batch

  // kKvCache: read the KV cache's fields (the forward only; the other kernels never get them, so
  // they do not compile the code). kPacked: read cu_seqlens and seqused; without it (a dense
  // forward's kernel) every sequence has the tensors' lengths.
  template <bool kKvCache = false, bool kPacked = true>
  CUTLASS_DEVICE static SeqlenInfo make(SeqlenParams const& p, int batch) {
    SeqlenInfo s{p.seqlen_q, p.seqlen_k, p.seqlen_q, p.seqlen_k};
    s.batch = batch;
    if constexpr (kPacked) {
      if (p.packed_q()) {
        span(p.cu_seqlens_q, batch, p.total_q >> p.q_rows_log2, p.seqlen_q >> p.q_rows_log2, s.offset_q, s.capacity_q);
        s.offset_q <<= p.q_rows_log2;
        s.capacity_q <<= p.q_rows_log2;
      } else {
        s.batch_q = batch;
      }
      if (p.packed_k()) {
        span(p.cu_seqlens_k, batch, p.total_k, p.seqlen_k, s.offset_k, s.capacity_k);
        if (p.keys_paged) {
          s.offset_k = 0;
          s.batch_k = batch;
        }
      } else {
        s.batch_k = batch;
      }
      s.seqlen_q = p.seqused_q != nullptr ? min(s.capacity_q, max(__ldg(p.seqused_q + batch), 0) << p.q_rows_log2)
                                          : s.capacity_q;
      s.seqlen_k = p.seqused_k != nullptr ? min(s.capacity_k, max(__ldg(p.seqused_k + batch), 0)) : s.capacity_k;
    } else {
      s.batch_q = s.batch_k = batch;
    }
    if constexpr (kKvCache) {
      if (p.cache_seqlens != nullptr) {
        const int first = p.cache_leftpad != nullptr ? min(max(__ldg(p.cache_leftpad + batch), 0), p.seqlen_k) : 0;
        const int appended =
            p.cu_seqlens_new != nullptr ? __ldg(p.cu_seqlens_new + batch + 1) - __ldg(p.cu_seqlens_new + batch)
                                        : p.seqlen_new;
        const int used = __ldg(p.cache_seqlens + batch) + appended - first;
        s.offset_k = first;
        s.capacity_k = s.seqlen_k = min(max(used, 0), p.seqlen_k - first);
      }
      // A row past the cache's is the caller's contract; the loads zero-fill outside the tensor.
      if (p.cache_batch_idx != nullptr) s.batch_k = __ldg(p.cache_batch_idx + batch);
    }
    return s;
  }

 private:
  CUTLASS_DEVICE static void span(int const* cu_seqlens, int batch, int total, int max_len, int& offset, int& len) {
    const int start = min(max(__ldg(cu_seqlens + batch), 0), total);
    const int end = min(max(__ldg(cu_seqlens + batch + 1), start), total);
    offset = start;
    len = min(end - start, max_len);
  }
};

}  // namespace flashhopper::hopper
