// CPU reference attention (see reference.hpp and docs/conventions.md).
//
// Shape of the computation: one work item per (batch, query head). An item copies its
// sequence's Q, K, V (and dO) into contiguous arrays of the accumulation type, then walks the
// query rows a block at a time: scores of the block, softmax, output (and for the backward the
// gradients). Every row sees all of its keys at once, so there is no online softmax here: the
// maths reads as in the design page. Loops put contiguous keys (or head-dim elements)
// innermost so the compiler can vectorise them; summation order is fixed, so a result does not
// depend on the thread count.
#include "reference/reference.hpp"

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <limits>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "plan/problem_shape.hpp"
#include "reference/host_dtype.hpp"
#include "reference/tensor_access.hpp"

namespace flashhopper::reference {
namespace {

using detail::MaskSpec;
using detail::present;
using detail::ProblemShape;

constexpr int64_t kBlockRows = 16;  // query rows whose scores are held at once

Status failure(fh_status code, const std::string& message) {
  return Status{code, "reference: " + message};
}

Status invalid(const std::string& message) { return failure(FH_ERROR_INVALID_ARGUMENT, message); }

// ---- threads -------------------------------------------------------------------------------

int thread_count(const Options& options) {
  if (options.num_threads > 0) return options.num_threads;
  return std::max(1u, std::thread::hardware_concurrency());
}

// Calls work(i) for every i in [0, count) on up to `num_threads` threads. Items are handed out
// in increasing order, which the backward's ordered dK/dV sums rely on.
template <class Work>
void parallel_for(int64_t count, int num_threads, const Work& work) {
  const int64_t threads = std::min<int64_t>(num_threads, count);
  if (threads <= 1) {
    for (int64_t i = 0; i < count; ++i) work(i);
    return;
  }
  std::atomic<int64_t> next{0};
  auto worker = [&] {
    for (int64_t i = next.fetch_add(1); i < count; i = next.fetch_add(1)) work(i);
  };
  std::vector<std::thread> pool;
  for (int64_t t = 1; t < threads; ++t) pool.emplace_back(worker);
  worker();
  for (std::thread& thread : pool) thread.join();
}

// ---- argument checks -----------------------------------------------------------------------

std::string shape_string(const Tensor& t) {
  std::string s = "[";
  for (int i = 0; i < t.ndim; ++i) s += (i ? ", " : "") + std::to_string(t.shape[i]);
  return s + "]";
}

std::string shape_string(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

bool is_writable_float(int32_t dtype) { return is_readable_float(dtype); }

// A float tensor the reference reads: present, bf16/fp16/fp32/fp64, of rank `ndim`.
// No negative extent or stride: the loops below size buffers and index with them (extents of 0
// are allowed here, e.g. an empty sequence's view; check_heads refuses a head dim of 0); and a data
// pointer aligned to the element, which the loads and stores below dereference.
Status check_extents(const Tensor& t, const char* name) {
  const size_t element = dtype_size(static_cast<DType>(t.dtype));
  if (element > 0 && reinterpret_cast<uintptr_t>(t.data) % element != 0) {
    return invalid(std::string(name) + "'s data pointer is not aligned to its " + std::to_string(element) +
                   "-byte elements");
  }
  for (int dim = 0; dim < t.ndim; ++dim) {
    if (t.shape[dim] < 0) {
      return invalid(std::string(name) + " has shape[" + std::to_string(dim) + "] = " + std::to_string(t.shape[dim]) +
                     "; extents must not be negative");
    }
  }
  for (int dim = 0; dim < t.ndim; ++dim) {
    if (t.stride[dim] < 0) {
      return invalid(std::string(name) + " has stride[" + std::to_string(dim) + "] = " +
                     std::to_string(t.stride[dim]) + "; negative strides are not supported");
    }
  }
  return {};
}

Status check_input(const Tensor& t, const char* name, int ndim) {
  if (!present(t)) return invalid(std::string(name) + " is required");
  if (!is_readable_float(t.dtype)) {
    return invalid(std::string(name) + " has dtype " + dtype_name(t.dtype) +
                   "; expected bf16, fp16, fp8_e4m3, fp32 or fp64");
  }
  if (t.ndim != ndim) {
    return invalid(std::string(name) + " has rank " + std::to_string(t.ndim) + ", expected " +
                   std::to_string(ndim));
  }
  return check_extents(t, name);
}

Status check_output(const Tensor& t, const char* name, int ndim) {
  if (!present(t)) return invalid(std::string(name) + " is required");
  if (!is_writable_float(t.dtype)) {
    return invalid(std::string(name) + " has dtype " + dtype_name(t.dtype) +
                   "; the CPU reference writes bf16, fp16, fp32 or fp64");
  }
  if (t.ndim != ndim) {
    return invalid(std::string(name) + " has rank " + std::to_string(t.ndim) + ", expected " +
                   std::to_string(ndim));
  }
  return check_extents(t, name);
}

Status check_int32(const Tensor& t, const char* name, int ndim) {
  if (t.dtype != FH_DTYPE_INT32) return invalid(std::string(name) + " must be int32");
  if (t.ndim != ndim) {
    return invalid(std::string(name) + " has rank " + std::to_string(t.ndim) + ", expected " +
                   std::to_string(ndim));
  }
  return check_extents(t, name);
}

Status check_shape(const Tensor& t, const char* name, const std::vector<int64_t>& expected) {
  bool same = int(expected.size()) == t.ndim;
  for (int i = 0; same && i < t.ndim; ++i) same = t.shape[i] == expected[i];
  if (!same) {
    return invalid(std::string(name) + " has shape " + shape_string(t) + ", expected " +
                   shape_string(expected));
  }
  return {};
}

#define FLASHHOPPER_REFERENCE_CHECK(expr) \
  do {                                    \
    Status status_ = (expr);              \
    if (!status_.ok()) return status_;    \
  } while (0)

// ---- where things live ---------------------------------------------------------------------

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
  Tensor cache_row{};      // dense: sequence b lives in row cache_row[b] (cache_batch_idx)
  Tensor first_token{};    // dense: token i of sequence b is stored at first_token[b] + i (cache_leftpad)

  static TokenLayout dense(const Tensor& t) { return {Kind::dense, t, {}, {}}; }
  static TokenLayout packed(const Tensor& t, const Tensor& cu) { return {Kind::packed, t, cu, {}}; }
  static TokenLayout paged(const Tensor& t, const Tensor& table) {
    return {Kind::paged, t, {}, table};
  }

  // Element offset of tensor[.., token, head, 0].
  int64_t offset(int64_t b, int64_t i, int64_t head) const {
    const int64_t* st = tensor.stride;
    switch (kind) {
      case Kind::dense: {
        const int64_t row = present(cache_row) ? int_at(cache_row, b) : b;
        const int64_t token = i + (present(first_token) ? int_at(first_token, b) : 0);
        return row * st[0] + token * st[1] + head * st[2];
      }
      case Kind::packed: return (int_at(cu_seqlens, b) + i) * st[0] + head * st[1];
      case Kind::paged: {
        const int64_t page_size = tensor.shape[1];
        const int64_t page = int_at(page_table, b, i / page_size);
        return page * st[0] + (i % page_size) * st[1] + head * st[2];
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
};

// Metadata that sets each sequence's length (absent tensors are ignored).
struct LengthSources {
  Tensor cu_seqlens_q{}, cu_seqlens_k{}, seqused_q{}, seqused_k{};
  Tensor cache_seqlens{}, page_table{};
  int64_t seqlen_new = 0;
  Tensor cache_batch_idx{}, cache_leftpad{};
  int64_t cache_rows = 0;  // k.shape[0] of a dense cache with cache_batch_idx
};

// Each sequence's rows and keys, checked against what the tensors hold. Keys: the packed
// length (cu_seqlens_k) or the dense/paged capacity, replaced by seqused_k when given, and by
// cache_seqlens + s_new when a KV cache length is given (cache_seqlens wins over seqused_k).
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
  if (shape.varlen_k && !shape.paged) {
    FLASHHOPPER_REFERENCE_CHECK(check_prefix_sums(src.cu_seqlens_k, "cu_seqlens_k", shape.total_k));
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
    if (present(src.cache_batch_idx)) {
      const int64_t row = int_at(src.cache_batch_idx, b);
      if (row < 0 || row >= src.cache_rows) {
        return invalid(seq + "cache_batch_idx[" + std::to_string(b) + "] = " + std::to_string(row) +
                       " is not a row of k (" + std::to_string(src.cache_rows) + " rows)");
      }
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
      s.keys = cached + src.seqlen_new - first;
    }
    if (s.keys < 0 || first + s.keys > k_capacity) {
      return invalid(seq + std::to_string(first + s.keys) + " cache positions used (after any append), but the " +
                     "key tensor holds " + std::to_string(k_capacity) + " for it");
    }
    if (shape.paged) {
      const int64_t pages = (s.keys + shape.page_size - 1) / shape.page_size;
      for (int64_t p = 0; p < pages; ++p) {
        const int64_t page = int_at(src.page_table, b, p);
        if (page < 0 || page >= shape.num_pages) {
          return invalid(seq + "page_table[" + std::to_string(b) + ", " + std::to_string(p) +
                         "] = " + std::to_string(page) + " is not a page of k (" +
                         std::to_string(shape.num_pages) + " pages)");
        }
      }
    }
  }
  return {};
}

// ---- masks ---------------------------------------------------------------------------------

struct KeyRange {
  int64_t begin = 0;
  int64_t end = 0;  // exclusive; begin == end: empty
};

// The keys a query row sees, as two disjoint ascending ranges: the sink tokens not already in
// the window, then the window (each cut to the row's chunk with attention_chunk).
using VisibleKeys = std::array<KeyRange, 2>;

// The mask of docs/masks.md for one sequence, aligned at the bottom-right, restricted to the keys
// [key_begin, key_end) (a split's share; all keys otherwise).
class RowMask {
 public:
  RowMask(const MaskSpec& spec, int64_t rows, int64_t keys, int64_t key_begin, int64_t key_end)
      : spec_(spec), rows_(rows), keys_(keys), key_begin_(key_begin), key_end_(key_end) {}

  VisibleKeys visible(int64_t i) const {
    const int64_t diagonal = i + keys_ - rows_;  // the key row i is aligned with
    const int64_t last =
        spec_.window_right < 0 ? keys_ - 1 : std::min(keys_ - 1, diagonal + spec_.window_right);
    const int64_t first =
        spec_.window_left < 0 ? 0 : std::max<int64_t>(0, diagonal - spec_.window_left);
    const int64_t sink_end = std::min({int64_t(spec_.num_sink_tokens), last + 1, first});
    KeyRange sinks{0, sink_end}, window{first, last + 1};
    if (spec_.attention_chunk > 0) {
      // The chunk [floor(p / c) * c, + c) holds the diagonal; floor division, so that a row with
      // p < 0 gets a chunk of keys before the first one and sees nothing. Sinks are cut too.
      const int64_t c = spec_.attention_chunk;
      const int64_t chunk = diagonal >= 0 ? diagonal / c : -((-diagonal + c - 1) / c);
      sinks = intersect(sinks, chunk * c, chunk * c + c);
      window = intersect(window, chunk * c, chunk * c + c);
    }
    return {intersect(sinks, key_begin_, key_end_), intersect(window, key_begin_, key_end_)};
  }

 private:
  // r cut to [lo, hi); an empty result has begin == end.
  static KeyRange intersect(KeyRange r, int64_t lo, int64_t hi) {
    r.begin = std::max(r.begin, lo);
    r.end = std::max(r.begin, std::min(r.end, hi));
    return r;
  }

  MaskSpec spec_;
  int64_t rows_, keys_, key_begin_, key_end_;
};

// ---- arithmetic: exact, or a plain low-precision implementation ------------------------------

// round: O and every other rounded intermediate; round_score: S; round_prob: P.
struct ExactMath {
  using Acc = double;
  static double round(double x) { return x; }
  static double round_score(double x) { return x; }
  static double round_prob(double x) { return x; }
};

// Products accumulate in float32; S, P, O (and dP, dS, the gradients) are rounded to `Dtype`.
template <int Dtype>
struct LowPrecisionMath {
  using Acc = float;
  static float round(float x) {
    if constexpr (Dtype == FH_DTYPE_BF16) return round_to_bf16(x);
    if constexpr (Dtype == FH_DTYPE_FP16) return round_to_fp16(x);
    return x;  // fp32
  }
  static float round_score(float x) { return round(x); }
  static float round_prob(float x) { return round(x); }
};

// A plain fp8 (e4m3) forward: products of the (descaled) inputs accumulate in float32, S stays
// float32, P is rounded to e4m3 as it is (values in [0, 1]; no per-row scaling), O to bf16, the
// output dtype of fp8 attention.
struct Fp8Math {
  using Acc = float;
  static float round(float x) { return round_to_bf16(x); }
  static float round_score(float x) { return x; }
  static float round_prob(float x) { return round_to_e4m3(x); }
};

// ---- one (batch, query head) -----------------------------------------------------------------

template <class Acc>
struct HeadData {
  int64_t rows = 0, keys = 0, d = 0, dv = 0;
  Acc sink = -std::numeric_limits<Acc>::infinity();  // learnable sink logit; -inf: none
  std::vector<Acc> q;     // [rows, d]
  std::vector<Acc> k;     // [keys, d]
  std::vector<Acc> k_t;   // [d, keys]: a row of scores is a sum of scaled rows of k_t
  std::vector<Acc> v;     // [keys, dv]
  std::vector<Acc> v_t;   // [dv, keys]  (backward)
  std::vector<Acc> dout;  // [rows, dv]  (backward)
};

template <class Acc>
std::vector<Acc> transpose(const std::vector<Acc>& a, int64_t rows, int64_t cols) {
  std::vector<Acc> t(a.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) t[c * rows + r] = a[r * cols + c];
  return t;
}

// [rows, a_cols] next to [rows, b_cols]: [rows, a_cols + b_cols].
template <class Acc>
std::vector<Acc> concat_columns(const std::vector<Acc>& a, int64_t a_cols, const std::vector<Acc>& b, int64_t b_cols,
                                int64_t rows) {
  std::vector<Acc> out(rows * (a_cols + b_cols));
  for (int64_t r = 0; r < rows; ++r) {
    std::copy_n(a.data() + r * a_cols, a_cols, out.data() + r * (a_cols + b_cols));
    std::copy_n(b.data() + r * b_cols, b_cols, out.data() + r * (a_cols + b_cols) + a_cols);
  }
  return out;
}

template <class Acc>
void gather_rows(const TokenLayout& layout, int64_t b, int64_t head, int64_t count, int64_t dim,
                 std::vector<Acc>* dst) {
  dst->resize(count * dim);
  for (int64_t i = 0; i < count; ++i) layout.load_row(b, i, head, dim, dst->data() + i * dim);
}

// Scores and probabilities of a block of query rows; entries outside a row's visible keys are
// 0 in `probs` (and meaningless in `scores`).
template <class Acc>
struct RowBlock {
  int64_t row_begin = 0, rows = 0;
  int64_t span_begin = 0, span = 0;  // the keys any row of the block sees: [span_begin, +span)
  std::vector<VisibleKeys> visible;  // [rows]
  std::vector<Acc> scores;           // [rows, span], after scale, rounding and softcap
  std::vector<Acc> probs;            // [rows, span]
  std::vector<Acc> lse;              // [rows]; where a row sees no key: the sink (-inf without)
};

template <class Math>
struct Scaling {
  typename Math::Acc scale;
  typename Math::Acc softcap;  // 0: none
};

// S = round(scale * Q K^T), softcapped; P = round(softmax(S)) over each row's visible keys, with
// the head's learnable sink in the denominator (it has no value, so it gets no entry in P).
template <class Math>
void compute_probabilities(const HeadData<typename Math::Acc>& head, const RowMask& mask,
                           const Scaling<Math>& scaling, int64_t row_begin, int64_t row_end,
                           RowBlock<typename Math::Acc>* block) {
  using Acc = typename Math::Acc;
  RowBlock<Acc>& blk = *block;
  blk.row_begin = row_begin;
  blk.rows = row_end - row_begin;
  blk.visible.resize(blk.rows);
  int64_t span_begin = head.keys, span_end = 0;
  for (int64_t r = 0; r < blk.rows; ++r) {
    blk.visible[r] = mask.visible(row_begin + r);
    for (const KeyRange& range : blk.visible[r]) {
      if (range.begin == range.end) continue;
      span_begin = std::min(span_begin, range.begin);
      span_end = std::max(span_end, range.end);
    }
  }
  if (span_end <= span_begin) span_begin = span_end = 0;
  blk.span_begin = span_begin;
  blk.span = span_end - span_begin;
  const int64_t span = blk.span;
  blk.scores.assign(blk.rows * span, Acc(0));
  blk.probs.assign(blk.rows * span, Acc(0));
  blk.lse.assign(blk.rows, -std::numeric_limits<Acc>::infinity());

  // Q K^T as d rank-1 updates, so the innermost loop runs over contiguous keys.
  for (int64_t c = 0; c < head.d; ++c) {
    const Acc* k_col = head.k_t.data() + c * head.keys;
    for (int64_t r = 0; r < blk.rows; ++r) {
      const Acc q_rc = head.q[(row_begin + r) * head.d + c];
      Acc* s = blk.scores.data() + r * span;
      for (const KeyRange& range : blk.visible[r])
        for (int64_t j = range.begin; j < range.end; ++j) s[j - span_begin] += q_rc * k_col[j];
    }
  }

  for (int64_t r = 0; r < blk.rows; ++r) {
    Acc* s = blk.scores.data() + r * span;
    Acc* p = blk.probs.data() + r * span;
    bool sees_a_key = false;
    Acc row_max = -std::numeric_limits<Acc>::infinity();
    for (const KeyRange& range : blk.visible[r]) {
      for (int64_t j = range.begin - span_begin; j < range.end - span_begin; ++j) {
        s[j] = Math::round_score(scaling.scale * s[j]);
        if (scaling.softcap > 0) s[j] = scaling.softcap * std::tanh(s[j] / scaling.softcap);
        row_max = std::max(row_max, s[j]);
        sees_a_key = true;
      }
    }
    const bool has_sink = head.sink > -std::numeric_limits<Acc>::infinity();
    if (!sees_a_key) {  // P = 0: O = 0, and the sink alone makes up the denominator
      blk.lse[r] = head.sink;
      continue;
    }
    const Acc m = has_sink ? std::max(row_max, head.sink) : row_max;
    Acc sum = 0;
    for (const KeyRange& range : blk.visible[r]) {
      for (int64_t j = range.begin - span_begin; j < range.end - span_begin; ++j) {
        p[j] = std::exp(s[j] - m);
        sum += p[j];
      }
    }
    if (has_sink) sum += std::exp(head.sink - m);
    for (const KeyRange& range : blk.visible[r])
      for (int64_t j = range.begin - span_begin; j < range.end - span_begin; ++j)
        p[j] = Math::round_prob(p[j] / sum);
    blk.lse[r] = m + std::log(sum);
  }
}

// out [rows, dv] = round(P V).
template <class Math>
void compute_output(const HeadData<typename Math::Acc>& head,
                    const RowBlock<typename Math::Acc>& blk, std::vector<typename Math::Acc>* out) {
  using Acc = typename Math::Acc;
  const int64_t dv = head.dv;
  out->assign(blk.rows * dv, Acc(0));
  for (int64_t j = 0; j < blk.span; ++j) {
    const Acc* v_row = head.v.data() + (blk.span_begin + j) * dv;
    for (int64_t r = 0; r < blk.rows; ++r) {
      const Acc p = blk.probs[r * blk.span + j];
      if (p == 0) continue;
      Acc* o = out->data() + r * dv;
      for (int64_t c = 0; c < dv; ++c) o[c] += p * v_row[c];
    }
  }
  for (Acc& o : *out) o = Math::round(o);
}

// dK, dV of one query head, not yet scaled or rounded: sum over rows of dS^T Q and P^T dO.
template <class Acc>
struct KeyGradients {
  std::vector<Acc> dk;  // [keys, d]
  std::vector<Acc> dv;  // [keys, dv]
};

// The backward of one block of rows: writes the block's dQ into `dq` ([rows, d], final), adds
// its share of dK and dV into `grads` and, with a sink, its rows' terms into `dsink` in row order.
template <class Math>
void backward_block(const HeadData<typename Math::Acc>& head, const Scaling<Math>& scaling,
                    RowBlock<typename Math::Acc>* block, KeyGradients<typename Math::Acc>* grads,
                    std::vector<typename Math::Acc>* dq, typename Math::Acc* dsink) {
  using Acc = typename Math::Acc;
  RowBlock<Acc>& blk = *block;
  const int64_t d = head.d, dv = head.dv, span = blk.span, span_begin = blk.span_begin;

  std::vector<Acc> out;
  compute_output<Math>(head, blk, &out);
  // D = rowsum(dO * O), from the (rounded) output.
  std::vector<Acc> delta(blk.rows, Acc(0));
  for (int64_t r = 0; r < blk.rows; ++r)
    for (int64_t c = 0; c < dv; ++c)
      delta[r] += head.dout[(blk.row_begin + r) * dv + c] * out[r * dv + c];
  // The sink acts as a key whose value is 0: its dP is 0, so its dS is exp(sink - LSE_i) (0 - D_i),
  // and d loss / d sink sums that over the rows.
  if (head.sink > -std::numeric_limits<Acc>::infinity())
    for (int64_t r = 0; r < blk.rows; ++r) *dsink -= std::exp(head.sink - blk.lse[r]) * delta[r];

  // dP = dO V^T over the visible entries, as dv rank-1 updates (contiguous keys innermost).
  std::vector<Acc> ds(blk.rows * span, Acc(0));
  for (int64_t c = 0; c < dv; ++c) {
    const Acc* v_col = head.v_t.data() + c * head.keys;
    for (int64_t r = 0; r < blk.rows; ++r) {
      const Acc g = head.dout[(blk.row_begin + r) * dv + c];
      Acc* row = ds.data() + r * span;
      for (const KeyRange& range : blk.visible[r])
        for (int64_t j = range.begin; j < range.end; ++j) row[j - span_begin] += g * v_col[j];
    }
  }
  // dS = P * (dP - D), times the softcap's derivative 1 - tanh^2 (tanh = capped S / softcap).
  for (int64_t r = 0; r < blk.rows; ++r) {
    for (const KeyRange& range : blk.visible[r]) {
      for (int64_t j = range.begin - span_begin; j < range.end - span_begin; ++j) {
        const int64_t at = r * span + j;
        Acc x = blk.probs[at] * (Math::round(ds[at]) - delta[r]);
        if (scaling.softcap > 0) {
          const Acc t = blk.scores[at] / scaling.softcap;
          x *= Acc(1) - t * t;
        }
        ds[at] = Math::round(x);
      }
    }
  }

  // dQ = scale * dS K for the block's rows.
  dq->assign(blk.rows * d, Acc(0));
  for (int64_t j = 0; j < span; ++j) {
    const Acc* k_row = head.k.data() + (span_begin + j) * d;
    for (int64_t r = 0; r < blk.rows; ++r) {
      const Acc g = ds[r * span + j];
      if (g == 0) continue;
      Acc* row = dq->data() + r * d;
      for (int64_t c = 0; c < d; ++c) row[c] += g * k_row[c];
    }
  }
  for (Acc& x : *dq) x = Math::round(scaling.scale * x);

  // dK += dS^T Q, dV += P^T dO, key by key so each key's row stays in cache.
  for (int64_t j = 0; j < span; ++j) {
    Acc* dk_row = grads->dk.data() + (span_begin + j) * d;
    Acc* dv_row = grads->dv.data() + (span_begin + j) * dv;
    for (int64_t r = 0; r < blk.rows; ++r) {
      const int64_t row = blk.row_begin + r;
      const Acc g = ds[r * span + j];
      if (g != 0) {
        const Acc* q_row = head.q.data() + row * d;
        for (int64_t c = 0; c < d; ++c) dk_row[c] += g * q_row[c];
      }
      const Acc p = blk.probs[r * span + j];
      if (p != 0) {
        const Acc* do_row = head.dout.data() + row * dv;
        for (int64_t c = 0; c < dv; ++c) dv_row[c] += p * do_row[c];
      }
    }
  }
}

// ---- forward -------------------------------------------------------------------------------

// Rotary embedding of the appended keys and of q (flashhopper.h, "KV cache extras").
struct Rotary {
  Tensor cos{}, sin{};                // [seqlen_ro, rotary_dim / 2]; absent: no rotary
  std::vector<int64_t> offsets;       // [B]: rotary_seqlens, else cache_seqlens
  bool interleaved = false;
  bool rows_advance = false;          // q's rows at consecutive positions (a mask), else all at the offset

  int64_t key_position(int64_t b, int64_t t) const { return present(cos) ? offsets[b] + t : 0; }
  int64_t query_position(int64_t b, int64_t i) const {
    return present(cos) ? offsets[b] + (rows_advance ? i : 0) : 0;
  }
  // Rotates the first rotary_dim values of x at `position`; `round` as the stored result is.
  template <class T, class Round>
  void apply(T* x, int64_t position, Round round) const {
    if (!present(cos)) return;
    const int64_t half = cos.shape[1];
    for (int64_t i = 0; i < half; ++i) {
      double c = 0, s = 0;
      load_strided(cos, position * cos.stride[0] + i * cos.stride[1], 1, 1, &c);
      load_strided(sin, position * sin.stride[0] + i * sin.stride[1], 1, 1, &s);
      T& a = interleaved ? x[2 * i] : x[i];
      T& b = interleaved ? x[2 * i + 1] : x[i + half];
      const double x0 = double(a), x1 = double(b);
      a = round(T(x0 * c - x1 * s));
      b = round(T(x0 * s + x1 * c));
    }
  }
};

// fp8 descale factors [B, Hkv] (fp32 or fp64, host), read into `factors`; only with fp8 q.
Status read_descale(const ForwardParams& p, const Tensor& t, const char* name, const ProblemShape& shape,
                    std::vector<double>* factors) {
  factors->clear();
  if (!present(t)) return {};
  if (p.q.dtype != FH_DTYPE_FP8_E4M3) return invalid(std::string(name) + " is given but q is not fp8_e4m3");
  if (t.dtype != FH_DTYPE_FP32 && t.dtype != FH_DTYPE_FP64) {
    return invalid(std::string(name) + " has dtype " + dtype_name(t.dtype) + "; expected fp32 or fp64");
  }
  FLASHHOPPER_REFERENCE_CHECK(check_shape(t, name, {shape.batch, shape.heads_kv}));
  factors->resize(shape.batch * shape.heads_kv);
  for (int64_t b = 0; b < shape.batch; ++b)
    for (int64_t h = 0; h < shape.heads_kv; ++h)
      (*factors)[b * shape.heads_kv + h] = load_element(t, b * t.stride[0] + h * t.stride[1]);
  return {};
}

template <class Acc>
void descale_rows(const std::vector<double>& factors, int64_t at, std::vector<Acc>* rows) {
  if (factors.empty()) return;
  const Acc factor = Acc(factors[at]);
  for (Acc& x : *rows) x *= factor;
}

// Checks the rotary tables and that every position the call rotates is a row of them.
Status rotary_plan(const ForwardParams& p, const ProblemShape& shape, const std::vector<Sequence>& sequences,
                   Rotary* rotary) {
  if (!present(p.rotary_cos) && !present(p.rotary_sin)) return {};
  if (!present(p.rotary_cos) || !present(p.rotary_sin)) return invalid("rotary_cos and rotary_sin go together");
  if (!present(p.k_new)) return invalid("rotary_cos needs k_new/v_new (it rotates the appended keys and q)");
  FLASHHOPPER_REFERENCE_CHECK(check_input(p.rotary_cos, "rotary_cos", 2));
  FLASHHOPPER_REFERENCE_CHECK(check_input(p.rotary_sin, "rotary_sin", 2));
  const int64_t positions = p.rotary_cos.shape[0], half = p.rotary_cos.shape[1];
  if (2 * half > shape.head_dim) return invalid("rotary_cos: rotary_dim = 2 * shape[1] exceeds the head dim");
  FLASHHOPPER_REFERENCE_CHECK(check_shape(p.rotary_sin, "rotary_sin", {positions, half}));
  const Tensor& offsets = present(p.rotary_seqlens) ? p.rotary_seqlens : p.cache_seqlens;
  const char* offsets_name = present(p.rotary_seqlens) ? "rotary_seqlens" : "cache_seqlens";
  if (present(p.rotary_seqlens)) {
    FLASHHOPPER_REFERENCE_CHECK(check_int32(p.rotary_seqlens, "rotary_seqlens", 1));
    FLASHHOPPER_REFERENCE_CHECK(check_shape(p.rotary_seqlens, "rotary_seqlens", {shape.batch}));
  }
  rotary->cos = p.rotary_cos;
  rotary->sin = p.rotary_sin;
  rotary->interleaved = p.rotary_interleaved != 0;
  rotary->rows_advance = detail::mask_spec(p).is_masked();
  rotary->offsets.resize(shape.batch);
  for (int64_t b = 0; b < shape.batch; ++b) {
    const int64_t offset = int_at(offsets, b);
    const int64_t capacity = sequences[b].row_capacity;  // q's rows (all are rotated)
    const int64_t rows = rotary->rows_advance ? capacity : std::min<int64_t>(1, capacity);
    const int64_t last = offset + std::max(shape.seqlen_new, rows) - 1;
    if (offset < 0 || last >= positions) {
      return invalid("sequence " + std::to_string(b) + ": rotary positions " + std::to_string(offset) + ".." +
                     std::to_string(last) + " (from " + offsets_name + ") are not rows of rotary_cos (" +
                     std::to_string(positions) + ")");
    }
    rotary->offsets[b] = offset;
  }
  return {};
}

struct ForwardPlan {
  ProblemShape shape;
  MaskSpec mask;
  double scale = 0, softcap = 0;
  TokenLayout q, k, v, out;
  TokenLayout qv;                      // with has_qv only
  bool has_qv = false;
  Rotary rotary;                       // rotary_cos absent: none
  std::array<std::vector<double>, 3> descale;  // q, k, v [B * Hkv] (fp8): true value = stored * factor
  RowLayout lse;                       // tensor absent: not written
  RowLayout out_partial, lse_partial;  // split-KV only
  int64_t num_splits = 1;
  std::vector<double> sinks;           // [Hq] learnable sink logits; empty: none
  std::vector<Sequence> sequences;
};

template <class Acc>
Acc sink_of(const std::vector<double>& sinks, int64_t h) {
  return sinks.empty() ? -std::numeric_limits<Acc>::infinity() : Acc(sinks[h]);
}

template <class Math>
void run_forward(const ForwardPlan& plan, int num_threads) {
  using Acc = typename Math::Acc;
  const ProblemShape& shape = plan.shape;
  const int64_t group = shape.heads_q / shape.heads_kv;
  const Scaling<Math> scaling{Acc(plan.scale), Acc(plan.softcap)};
  const bool split = plan.num_splits > 1;

  parallel_for(shape.batch * shape.heads_q, num_threads, [&](int64_t item) {
    const int64_t b = item / shape.heads_q, h = item % shape.heads_q, hk = h / group;
    const Sequence& seq = plan.sequences[b];
    HeadData<Acc> head;
    head.rows = seq.rows;
    head.keys = seq.keys;
    head.d = shape.head_dim;
    head.dv = shape.head_dim_v;
    gather_rows(plan.q, b, h, head.rows, head.d, &head.q);
    descale_rows(plan.descale[0], b * shape.heads_kv + hk, &head.q);
    for (int64_t i = 0; i < head.rows; ++i)  // rounded as a plain implementation stores rotated q
      plan.rotary.apply(head.q.data() + i * head.d, plan.rotary.query_position(b, i), Math::round);
    gather_rows(plan.k, b, hk, head.keys, head.d, &head.k);
    gather_rows(plan.v, b, hk, head.keys, head.dv, &head.v);
    descale_rows(plan.descale[1], b * shape.heads_kv + hk, &head.k);
    descale_rows(plan.descale[2], b * shape.heads_kv + hk, &head.v);
    if (plan.has_qv) {  // S = Q K^T + Qv V^T = [Q | Qv] [K | V]^T: scores over d + dv columns
      std::vector<Acc> qv;
      gather_rows(plan.qv, b, h, head.rows, head.dv, &qv);
      head.q = concat_columns(head.q, head.d, qv, head.dv, head.rows);
      head.k = concat_columns(head.k, head.d, head.v, head.dv, head.keys);
      head.d += head.dv;
    }
    head.k_t = transpose(head.k, head.keys, head.d);

    // Split s attends to keys [s*c, (s+1)*c), c = ceil(keys / num_splits).
    const int64_t chunk = (head.keys + plan.num_splits - 1) / plan.num_splits;
    RowBlock<Acc> blk;
    std::vector<Acc> out;
    for (int64_t s = 0; s < plan.num_splits; ++s) {
      // The sink joins split 0 only, so that combining the splits counts it once.
      head.sink = s == 0 ? sink_of<Acc>(plan.sinks, h) : -std::numeric_limits<Acc>::infinity();
      const int64_t key_begin = split ? std::min(s * chunk, head.keys) : 0;
      const int64_t key_end = split ? std::min((s + 1) * chunk, head.keys) : head.keys;
      const RowMask mask(plan.mask, head.rows, head.keys, key_begin, key_end);
      for (int64_t r0 = 0; r0 < head.rows; r0 += kBlockRows) {
        compute_probabilities<Math>(head, mask, scaling, r0, std::min(r0 + kBlockRows, head.rows),
                                    &blk);
        compute_output<Math>(head, blk, &out);
        for (int64_t r = 0; r < blk.rows; ++r) {
          const int64_t i = r0 + r;
          if (split) {
            const RowLayout& op = plan.out_partial;
            store_strided(op.tensor, op.offset(s, b, h, i), op.dim_stride(), head.dv,
                          &out[r * head.dv]);
            store_element(plan.lse_partial.tensor, plan.lse_partial.offset(s, b, h, i),
                          double(blk.lse[r]));
          } else {
            plan.out.store_row(b, i, h, head.dv, &out[r * head.dv]);
            if (present(plan.lse.tensor)) {
              store_element(plan.lse.tensor, plan.lse.offset(0, b, h, i), double(blk.lse[r]));
            }
          }
        }
      }
    }
    if (!split) {  // rows past seqused_q
      const std::vector<Acc> zeros(head.dv, Acc(0));
      for (int64_t i = seq.rows; i < seq.row_capacity; ++i) {
        plan.out.store_row(b, i, h, head.dv, zeros.data());
        if (present(plan.lse.tensor))
          store_element(plan.lse.tensor, plan.lse.offset(0, b, h, i), -std::numeric_limits<double>::infinity());
      }
    }
  });
}

// Writes k_new/v_new into the cache at positions cache_seqlens[b].. of each sequence.
void append_new_keys(const ForwardPlan& plan, const ForwardParams& p) {
  const ProblemShape& shape = plan.shape;
  const TokenLayout k_new = TokenLayout::dense(p.k_new);
  const TokenLayout v_new = TokenLayout::dense(p.v_new);
  std::vector<double> row(std::max(shape.head_dim, shape.head_dim_v));
  for (int64_t b = 0; b < shape.batch; ++b) {
    // The layout counts tokens from the sequence's first key, cache_leftpad[b].
    const int64_t start = int_at(p.cache_seqlens, b) - (present(p.cache_leftpad) ? int_at(p.cache_leftpad, b) : 0);
    for (int64_t t = 0; t < shape.seqlen_new; ++t) {
      for (int64_t hk = 0; hk < shape.heads_kv; ++hk) {
        k_new.load_row(b, t, hk, shape.head_dim, row.data());
        plan.rotary.apply(row.data(), plan.rotary.key_position(b, t), [](double x) { return x; });
        plan.k.store_row(b, start + t, hk, shape.head_dim, row.data());
        v_new.load_row(b, t, hk, shape.head_dim_v, row.data());
        plan.v.store_row(b, start + t, hk, shape.head_dim_v, row.data());
      }
    }
  }
}

// ---- backward ------------------------------------------------------------------------------

struct BackwardPlan {
  ProblemShape shape;
  MaskSpec mask;
  double scale = 0, softcap = 0;
  TokenLayout q, k, v, dout, dq, dk, dv;
  std::vector<double> sinks;  // [Hq] learnable sink logits; empty: none
  Tensor dsink{};             // absent: not written
  std::vector<Sequence> sequences;
};

// dK and dV of one (batch, key head): the group's query heads add their share in head order,
// so the sum has the same bits whatever the thread count; the last one writes the result.
template <class Acc>
struct GroupGradients {
  std::mutex mutex;
  std::condition_variable turn;
  int64_t heads_added = 0;
  KeyGradients<Acc> sum;
};

template <class Math>
void run_backward(const BackwardPlan& plan, int num_threads) {
  using Acc = typename Math::Acc;
  const ProblemShape& shape = plan.shape;
  const int64_t group = shape.heads_q / shape.heads_kv;
  const Scaling<Math> scaling{Acc(plan.scale), Acc(plan.softcap)};
  std::vector<GroupGradients<Acc>> groups(shape.batch * shape.heads_kv);
  // Each (b, h)'s dsink term, summed over its rows in order; added over b in order at the end.
  std::vector<Acc> dsink_terms(shape.batch * shape.heads_q, Acc(0));

  // Items are (b, h) in increasing order, so a group's heads are handed out in head order: the
  // head a thread waits for has been taken already and never waits for a later one.
  parallel_for(shape.batch * shape.heads_q, num_threads, [&](int64_t item) {
    const int64_t b = item / shape.heads_q, h = item % shape.heads_q, hk = h / group;
    const Sequence& seq = plan.sequences[b];
    HeadData<Acc> head;
    head.rows = seq.rows;
    head.keys = seq.keys;
    head.d = shape.head_dim;
    head.dv = shape.head_dim_v;
    head.sink = sink_of<Acc>(plan.sinks, h);
    gather_rows(plan.q, b, h, head.rows, head.d, &head.q);
    gather_rows(plan.dout, b, h, head.rows, head.dv, &head.dout);
    gather_rows(plan.k, b, hk, head.keys, head.d, &head.k);
    gather_rows(plan.v, b, hk, head.keys, head.dv, &head.v);
    head.k_t = transpose(head.k, head.keys, head.d);
    head.v_t = transpose(head.v, head.keys, head.dv);

    KeyGradients<Acc> grads;
    grads.dk.assign(head.keys * head.d, Acc(0));
    grads.dv.assign(head.keys * head.dv, Acc(0));
    const RowMask mask(plan.mask, head.rows, head.keys, 0, head.keys);
    RowBlock<Acc> blk;
    std::vector<Acc> dq;
    for (int64_t r0 = 0; r0 < head.rows; r0 += kBlockRows) {
      compute_probabilities<Math>(head, mask, scaling, r0, std::min(r0 + kBlockRows, head.rows),
                                  &blk);
      backward_block<Math>(head, scaling, &blk, &grads, &dq, &dsink_terms[item]);
      for (int64_t r = 0; r < blk.rows; ++r)
        plan.dq.store_row(b, r0 + r, h, head.d, &dq[r * head.d]);
    }
    const std::vector<Acc> zeros(std::max(head.d, head.dv), Acc(0));
    for (int64_t i = seq.rows; i < seq.row_capacity; ++i) plan.dq.store_row(b, i, h, head.d, zeros.data());
    for (Acc& x : grads.dk) x = Math::round(scaling.scale * x);
    for (Acc& x : grads.dv) x = Math::round(x);

    GroupGradients<Acc>& g = groups[b * shape.heads_kv + hk];
    const int64_t index_in_group = h % group;
    std::unique_lock<std::mutex> lock(g.mutex);
    g.turn.wait(lock, [&] { return g.heads_added == index_in_group; });
    if (index_in_group == 0) {
      g.sum = std::move(grads);
    } else {
      for (size_t i = 0; i < g.sum.dk.size(); ++i) g.sum.dk[i] += grads.dk[i];
      for (size_t i = 0; i < g.sum.dv.size(); ++i) g.sum.dv[i] += grads.dv[i];
    }
    if (++g.heads_added == group) {
      // A sum of rounded per-head gradients is rounded once more, as a framework's group sum.
      if (group > 1) {
        for (Acc& x : g.sum.dk) x = Math::round(x);
        for (Acc& x : g.sum.dv) x = Math::round(x);
      }
      for (int64_t j = 0; j < head.keys; ++j) {
        plan.dk.store_row(b, j, hk, head.d, &g.sum.dk[j * head.d]);
        plan.dv.store_row(b, j, hk, head.dv, &g.sum.dv[j * head.dv]);
      }
      for (int64_t j = head.keys; j < seq.key_capacity; ++j) {  // keys past seqused_k
        plan.dk.store_row(b, j, hk, head.d, zeros.data());
        plan.dv.store_row(b, j, hk, head.dv, zeros.data());
      }
      g.sum = {};
    }
    lock.unlock();
    g.turn.notify_all();
  });

  if (present(plan.dsink)) {
    for (int64_t h = 0; h < shape.heads_q; ++h) {
      Acc sum = 0;
      for (int64_t b = 0; b < shape.batch; ++b) sum += dsink_terms[b * shape.heads_q + h];
      store_element(plan.dsink, h * plan.dsink.stride[0], double(sum));
    }
  }
}

// ---- dispatch on the arithmetic --------------------------------------------------------------

template <class Run>
Status dispatch_math(const Options& options, int32_t q_dtype, const Run& run) {
  if (!options.emulate_low_precision) {
    run(ExactMath{});
    return {};
  }
  switch (q_dtype) {
    case FH_DTYPE_BF16: run(LowPrecisionMath<FH_DTYPE_BF16>{}); return {};
    case FH_DTYPE_FP16: run(LowPrecisionMath<FH_DTYPE_FP16>{}); return {};
    case FH_DTYPE_FP32: run(LowPrecisionMath<FH_DTYPE_FP32>{}); return {};
    case FH_DTYPE_FP8_E4M3: run(Fp8Math{}); return {};
    default:
      return failure(FH_ERROR_NOT_SUPPORTED,
                     std::string("emulate_low_precision needs q in bf16, fp16, fp8_e4m3 or fp32, not ") +
                         dtype_name(q_dtype));
  }
}

// learnable_sink [Hq] (fp32 or fp64, host memory), read into `sinks`. A logit may be -inf (that
// head has no sink) but neither NaN nor +inf, which would leave no defined softmax.
Status read_sinks(const Tensor& t, int64_t heads, std::vector<double>* sinks) {
  sinks->clear();
  if (!present(t)) return {};
  if (t.dtype != FH_DTYPE_FP32 && t.dtype != FH_DTYPE_FP64) {
    return invalid(std::string("learnable_sink has dtype ") + dtype_name(t.dtype) +
                   "; expected fp32 or fp64");
  }
  FLASHHOPPER_REFERENCE_CHECK(check_shape(t, "learnable_sink", {heads}));
  sinks->resize(heads);
  for (int64_t h = 0; h < heads; ++h) {
    const double x = load_element(t, h * t.stride[0]);
    if (std::isnan(x) || x == std::numeric_limits<double>::infinity()) {
      return invalid("learnable_sink[" + std::to_string(h) + "] is " + std::to_string(x) +
                     "; a sink logit must be finite or -inf (no sink)");
    }
    (*sinks)[h] = x;
  }
  return {};
}

Status check_heads(const ProblemShape& shape) {
  if (shape.heads_kv <= 0 || shape.heads_q % shape.heads_kv != 0) {
    return invalid("query heads (" + std::to_string(shape.heads_q) +
                   ") must be a multiple of key/value heads (" + std::to_string(shape.heads_kv) +
                   ")");
  }
  if (shape.head_dim < 1 || shape.head_dim_v < 1) {
    return invalid("head dims (" + std::to_string(shape.head_dim) + ", " + std::to_string(shape.head_dim_v) +
                   ") must be at least 1");
  }
  return {};
}

}  // namespace

// ---- entry points ----------------------------------------------------------------------------

Status forward(const ForwardParams& p, const Options& options, const Tensor* out_partial,
               const Tensor* lse_partial) {
  const bool varlen_q = present(p.cu_seqlens_q);
  const bool varlen_k = present(p.cu_seqlens_k);
  const bool paged = present(p.page_table);
  const bool append = present(p.k_new);
  const int q_rank = varlen_q ? 3 : 4;
  const int k_rank = (varlen_k && !paged) ? 3 : 4;
  FLASHHOPPER_REFERENCE_CHECK(check_input(p.q, "q", q_rank));
  FLASHHOPPER_REFERENCE_CHECK(check_input(p.k, "k", k_rank));
  FLASHHOPPER_REFERENCE_CHECK(check_input(p.v, "v", k_rank));
  if (varlen_q) FLASHHOPPER_REFERENCE_CHECK(check_int32(p.cu_seqlens_q, "cu_seqlens_q", 1));
  if (varlen_k) FLASHHOPPER_REFERENCE_CHECK(check_int32(p.cu_seqlens_k, "cu_seqlens_k", 1));
  if (paged) FLASHHOPPER_REFERENCE_CHECK(check_int32(p.page_table, "page_table", 2));

  ForwardPlan plan;
  plan.shape = detail::forward_shape(p);
  const ProblemShape& shape = plan.shape;
  FLASHHOPPER_REFERENCE_CHECK(check_heads(shape));
  const int64_t B = shape.batch, Hq = shape.heads_q, Hkv = shape.heads_kv;
  const int64_t d = shape.head_dim, dv = shape.head_dim_v;
  const std::vector<int64_t> q_shape = varlen_q ? std::vector<int64_t>{shape.total_q, Hq, d}
                                                : std::vector<int64_t>{B, shape.seqlen_q, Hq, d};
  const std::vector<int64_t> out_shape = varlen_q ? std::vector<int64_t>{shape.total_q, Hq, dv}
                                                  : std::vector<int64_t>{B, shape.seqlen_q, Hq, dv};
  std::vector<int64_t> k_shape, v_shape;
  if (paged) {
    k_shape = {shape.num_pages, shape.page_size, Hkv, d};
    v_shape = {shape.num_pages, shape.page_size, Hkv, dv};
  } else if (varlen_k) {
    k_shape = {shape.total_k, Hkv, d};
    v_shape = {shape.total_k, Hkv, dv};
  } else {
    const int64_t rows = present(p.cache_batch_idx) ? p.k.shape[0] : B;  // cache rows, indexed per sequence
    k_shape = {rows, shape.seqlen_k, Hkv, d};
    v_shape = {rows, shape.seqlen_k, Hkv, dv};
  }
  FLASHHOPPER_REFERENCE_CHECK(check_shape(p.k, "k", k_shape));
  FLASHHOPPER_REFERENCE_CHECK(check_shape(p.v, "v", v_shape));
  if (present(p.qv)) {
    FLASHHOPPER_REFERENCE_CHECK(check_input(p.qv, "qv", q_rank));
    FLASHHOPPER_REFERENCE_CHECK(check_shape(p.qv, "qv", out_shape));
    plan.qv = varlen_q ? TokenLayout::packed(p.qv, p.cu_seqlens_q) : TokenLayout::dense(p.qv);
    plan.has_qv = true;
  }
  if (varlen_q) FLASHHOPPER_REFERENCE_CHECK(check_shape(p.cu_seqlens_q, "cu_seqlens_q", {B + 1}));
  if (varlen_k) FLASHHOPPER_REFERENCE_CHECK(check_shape(p.cu_seqlens_k, "cu_seqlens_k", {B + 1}));
  if (paged)
    FLASHHOPPER_REFERENCE_CHECK(check_shape(p.page_table, "page_table", {B, shape.max_pages}));
  const Tensor* lengths_1d[] = {&p.seqused_q, &p.seqused_k, &p.cache_seqlens};
  const char* lengths_names[] = {"seqused_q", "seqused_k", "cache_seqlens"};
  for (int i = 0; i < 3; ++i) {
    if (!present(*lengths_1d[i])) continue;
    FLASHHOPPER_REFERENCE_CHECK(check_int32(*lengths_1d[i], lengths_names[i], 1));
    FLASHHOPPER_REFERENCE_CHECK(check_shape(*lengths_1d[i], lengths_names[i], {B}));
  }
  if (append) {
    if (!present(p.cache_seqlens)) return invalid("k_new needs cache_seqlens (where to append)");
    FLASHHOPPER_REFERENCE_CHECK(check_input(p.k_new, "k_new", 4));
    FLASHHOPPER_REFERENCE_CHECK(check_input(p.v_new, "v_new", 4));
    FLASHHOPPER_REFERENCE_CHECK(check_shape(p.k_new, "k_new", {B, shape.seqlen_new, Hkv, d}));
    FLASHHOPPER_REFERENCE_CHECK(check_shape(p.v_new, "v_new", {B, shape.seqlen_new, Hkv, dv}));
  }

  plan.num_splits = std::max<int64_t>(1, p.num_splits);
  if (plan.num_splits > 1) {
    if (!out_partial || !lse_partial) {
      return invalid("num_splits > 1 writes partials: pass out_partial and lse_partial");
    }
    const int64_t S = plan.num_splits;
    FLASHHOPPER_REFERENCE_CHECK(check_output(*out_partial, "out_partial", varlen_q ? 4 : 5));
    FLASHHOPPER_REFERENCE_CHECK(check_output(*lse_partial, "lse_partial", varlen_q ? 3 : 4));
    FLASHHOPPER_REFERENCE_CHECK(
        check_shape(*out_partial, "out_partial",
                    varlen_q ? std::vector<int64_t>{S, Hq, shape.total_q, dv}
                             : std::vector<int64_t>{S, B, Hq, shape.seqlen_q, dv}));
    FLASHHOPPER_REFERENCE_CHECK(check_shape(*lse_partial, "lse_partial",
                                            varlen_q
                                                ? std::vector<int64_t>{S, Hq, shape.total_q}
                                                : std::vector<int64_t>{S, B, Hq, shape.seqlen_q}));
    plan.out_partial = RowLayout{*out_partial, p.cu_seqlens_q, true};
    plan.lse_partial = RowLayout{*lse_partial, p.cu_seqlens_q, true};
  } else {
    FLASHHOPPER_REFERENCE_CHECK(check_output(p.out, "out", q_rank));
    FLASHHOPPER_REFERENCE_CHECK(check_shape(p.out, "out", out_shape));
    if (present(p.lse)) {
      FLASHHOPPER_REFERENCE_CHECK(check_output(p.lse, "lse", varlen_q ? 2 : 3));
      FLASHHOPPER_REFERENCE_CHECK(check_shape(p.lse, "lse",
                                              varlen_q
                                                  ? std::vector<int64_t>{Hq, shape.total_q}
                                                  : std::vector<int64_t>{B, Hq, shape.seqlen_q}));
    }
  }

  const Tensor* cache_indices[] = {&p.cache_batch_idx, &p.cache_leftpad};
  const char* cache_index_names[] = {"cache_batch_idx", "cache_leftpad"};
  for (int i = 0; i < 2; ++i) {
    if (!present(*cache_indices[i])) continue;
    if (paged || varlen_k) return invalid(std::string(cache_index_names[i]) + " needs a dense cache");
    FLASHHOPPER_REFERENCE_CHECK(check_int32(*cache_indices[i], cache_index_names[i], 1));
    FLASHHOPPER_REFERENCE_CHECK(check_shape(*cache_indices[i], cache_index_names[i], {B}));
  }
  if (present(p.cache_leftpad) && !present(p.cache_seqlens)) return invalid("cache_leftpad needs cache_seqlens");

  LengthSources lengths{p.cu_seqlens_q,  p.cu_seqlens_k, p.seqused_q,       p.seqused_k,
                        p.cache_seqlens, p.page_table,   shape.seqlen_new, p.cache_batch_idx,
                        p.cache_leftpad, p.k.shape[0]};
  FLASHHOPPER_REFERENCE_CHECK(sequence_lengths(shape, lengths, &plan.sequences));
  FLASHHOPPER_REFERENCE_CHECK(rotary_plan(p, shape, plan.sequences, &plan.rotary));
  FLASHHOPPER_REFERENCE_CHECK(read_descale(p, p.q_descale, "q_descale", shape, &plan.descale[0]));
  FLASHHOPPER_REFERENCE_CHECK(read_descale(p, p.k_descale, "k_descale", shape, &plan.descale[1]));
  FLASHHOPPER_REFERENCE_CHECK(read_descale(p, p.v_descale, "v_descale", shape, &plan.descale[2]));

  FLASHHOPPER_REFERENCE_CHECK(read_sinks(p.learnable_sink, Hq, &plan.sinks));
  plan.mask = detail::mask_spec(p);
  plan.scale = detail::forward_scale(p, shape);
  plan.softcap = p.softcap > 0 ? double(p.softcap) : 0.0;
  plan.q = varlen_q ? TokenLayout::packed(p.q, p.cu_seqlens_q) : TokenLayout::dense(p.q);
  plan.out = varlen_q ? TokenLayout::packed(p.out, p.cu_seqlens_q) : TokenLayout::dense(p.out);
  plan.lse = RowLayout{p.lse, p.cu_seqlens_q, false};
  if (paged) {
    plan.k = TokenLayout::paged(p.k, p.page_table);
    plan.v = TokenLayout::paged(p.v, p.page_table);
  } else if (varlen_k) {
    plan.k = TokenLayout::packed(p.k, p.cu_seqlens_k);
    plan.v = TokenLayout::packed(p.v, p.cu_seqlens_k);
  } else {
    plan.k = TokenLayout::dense(p.k);
    plan.v = TokenLayout::dense(p.v);
    for (TokenLayout* layout : {&plan.k, &plan.v}) {
      layout->cache_row = p.cache_batch_idx;
      layout->first_token = p.cache_leftpad;
    }
  }

  if (options.emulate_low_precision && p.q.dtype != FH_DTYPE_BF16 && p.q.dtype != FH_DTYPE_FP16 &&
      p.q.dtype != FH_DTYPE_FP32 && p.q.dtype != FH_DTYPE_FP8_E4M3) {
    return failure(FH_ERROR_NOT_SUPPORTED,
                   std::string("emulate_low_precision needs q in bf16, fp16, fp8_e4m3 or fp32, not ") +
                       dtype_name(p.q.dtype));
  }
  if (append) append_new_keys(plan, p);
  const int threads = thread_count(options);
  return dispatch_math(options, p.q.dtype,
                       [&](auto math) { run_forward<decltype(math)>(plan, threads); });
}

Status backward(const BackwardParams& p, const Options& options) {
  const bool varlen_q = present(p.cu_seqlens_q);
  const bool varlen_k = present(p.cu_seqlens_k);
  const int q_rank = varlen_q ? 3 : 4;
  const int k_rank = varlen_k ? 3 : 4;
  for (const auto& [tensor, name] : {std::pair{&p.q, "q"}, {&p.k, "k"}, {&p.v, "v"}, {&p.dout, "dout"}}) {
    if (tensor->dtype == FH_DTYPE_FP8_E4M3) {
      return failure(FH_ERROR_NOT_SUPPORTED, std::string(name) + " is fp8_e4m3: there is no fp8 backward");
    }
  }
  FLASHHOPPER_REFERENCE_CHECK(check_input(p.q, "q", q_rank));
  FLASHHOPPER_REFERENCE_CHECK(check_input(p.k, "k", k_rank));
  FLASHHOPPER_REFERENCE_CHECK(check_input(p.v, "v", k_rank));
  FLASHHOPPER_REFERENCE_CHECK(check_input(p.dout, "dout", q_rank));
  FLASHHOPPER_REFERENCE_CHECK(check_output(p.dq, "dq", q_rank));
  FLASHHOPPER_REFERENCE_CHECK(check_output(p.dk, "dk", k_rank));
  FLASHHOPPER_REFERENCE_CHECK(check_output(p.dv, "dv", k_rank));
  if (varlen_q) FLASHHOPPER_REFERENCE_CHECK(check_int32(p.cu_seqlens_q, "cu_seqlens_q", 1));
  if (varlen_k) FLASHHOPPER_REFERENCE_CHECK(check_int32(p.cu_seqlens_k, "cu_seqlens_k", 1));

  BackwardPlan plan;
  plan.shape = detail::backward_shape(p);
  const ProblemShape& shape = plan.shape;
  FLASHHOPPER_REFERENCE_CHECK(check_heads(shape));
  const int64_t B = shape.batch, Hq = shape.heads_q, Hkv = shape.heads_kv;
  const int64_t d = shape.head_dim, dv = shape.head_dim_v;
  auto token_shape = [](bool varlen, int64_t batch, int64_t total, int64_t seqlen, int64_t heads,
                        int64_t dim) {
    return varlen ? std::vector<int64_t>{total, heads, dim}
                  : std::vector<int64_t>{batch, seqlen, heads, dim};
  };
  const auto q_shape = token_shape(varlen_q, B, shape.total_q, shape.seqlen_q, Hq, d);
  const auto o_shape = token_shape(varlen_q, B, shape.total_q, shape.seqlen_q, Hq, dv);
  const auto k_shape = token_shape(varlen_k, B, shape.total_k, shape.seqlen_k, Hkv, d);
  const auto v_shape = token_shape(varlen_k, B, shape.total_k, shape.seqlen_k, Hkv, dv);
  FLASHHOPPER_REFERENCE_CHECK(check_shape(p.v, "v", v_shape));
  FLASHHOPPER_REFERENCE_CHECK(check_shape(p.k, "k", k_shape));
  FLASHHOPPER_REFERENCE_CHECK(check_shape(p.dout, "dout", o_shape));
  FLASHHOPPER_REFERENCE_CHECK(check_shape(p.dq, "dq", q_shape));
  FLASHHOPPER_REFERENCE_CHECK(check_shape(p.dk, "dk", k_shape));
  FLASHHOPPER_REFERENCE_CHECK(check_shape(p.dv, "dv", v_shape));
  if (varlen_q) FLASHHOPPER_REFERENCE_CHECK(check_shape(p.cu_seqlens_q, "cu_seqlens_q", {B + 1}));
  if (varlen_k) FLASHHOPPER_REFERENCE_CHECK(check_shape(p.cu_seqlens_k, "cu_seqlens_k", {B + 1}));
  if (present(p.seqused_q)) {
    FLASHHOPPER_REFERENCE_CHECK(check_int32(p.seqused_q, "seqused_q", 1));
    FLASHHOPPER_REFERENCE_CHECK(check_shape(p.seqused_q, "seqused_q", {B}));
  }
  if (present(p.seqused_k)) {
    FLASHHOPPER_REFERENCE_CHECK(check_int32(p.seqused_k, "seqused_k", 1));
    FLASHHOPPER_REFERENCE_CHECK(check_shape(p.seqused_k, "seqused_k", {B}));
  }

  LengthSources lengths{p.cu_seqlens_q, p.cu_seqlens_k, p.seqused_q, p.seqused_k, {}, {}, 0};
  FLASHHOPPER_REFERENCE_CHECK(sequence_lengths(shape, lengths, &plan.sequences));

  FLASHHOPPER_REFERENCE_CHECK(read_sinks(p.learnable_sink, Hq, &plan.sinks));
  if (present(p.dsink)) {
    if (!present(p.learnable_sink)) return invalid("dsink needs learnable_sink");
    if (p.dsink.dtype != FH_DTYPE_FP32 && p.dsink.dtype != FH_DTYPE_FP64) {
      return invalid(std::string("dsink has dtype ") + dtype_name(p.dsink.dtype) +
                     "; the CPU reference writes fp32 or fp64");
    }
    FLASHHOPPER_REFERENCE_CHECK(check_shape(p.dsink, "dsink", {Hq}));
    plan.dsink = p.dsink;
  }
  plan.mask = detail::mask_spec(p);
  plan.scale = detail::default_scale(p.softmax_scale, d);
  plan.softcap = p.softcap > 0 ? double(p.softcap) : 0.0;
  auto q_layout = [&](const Tensor& t) {
    return varlen_q ? TokenLayout::packed(t, p.cu_seqlens_q) : TokenLayout::dense(t);
  };
  auto k_layout = [&](const Tensor& t) {
    return varlen_k ? TokenLayout::packed(t, p.cu_seqlens_k) : TokenLayout::dense(t);
  };
  plan.q = q_layout(p.q);
  plan.dout = q_layout(p.dout);
  plan.dq = q_layout(p.dq);
  plan.k = k_layout(p.k);
  plan.v = k_layout(p.v);
  plan.dk = k_layout(p.dk);
  plan.dv = k_layout(p.dv);

  const int threads = thread_count(options);
  return dispatch_math(options, p.q.dtype,
                       [&](auto math) { run_backward<decltype(math)>(plan, threads); });
}

Status combine(const CombineParams& p, const Options& options) {
  // Varlen partials [S, H, total, dv] are the dense ones [S, B, H, sq, dv] with B = 1 and
  // sq = total: give them a batch dim of extent 1 and read both alike.
  const bool varlen = present(p.out_partial) && p.out_partial.ndim == 4;
  FLASHHOPPER_REFERENCE_CHECK(check_input(p.out_partial, "out_partial", varlen ? 4 : 5));
  FLASHHOPPER_REFERENCE_CHECK(check_input(p.lse_partial, "lse_partial", varlen ? 3 : 4));
  FLASHHOPPER_REFERENCE_CHECK(check_output(p.out, "out", varlen ? 3 : 4));
  if (present(p.lse)) FLASHHOPPER_REFERENCE_CHECK(check_output(p.lse, "lse", varlen ? 2 : 3));

  auto with_unit_dim = [](Tensor t, int at) {
    if (!present(t)) return t;
    for (int i = t.ndim; i > at; --i) {
      t.shape[i] = t.shape[i - 1];
      t.stride[i] = t.stride[i - 1];
    }
    t.shape[at] = 1;
    t.stride[at] = 0;
    ++t.ndim;
    return t;
  };
  const Tensor out_partial = varlen ? with_unit_dim(p.out_partial, 1) : p.out_partial;
  const Tensor lse_partial = varlen ? with_unit_dim(p.lse_partial, 1) : p.lse_partial;
  const Tensor out = varlen ? with_unit_dim(p.out, 0) : p.out;
  const Tensor lse = varlen ? with_unit_dim(p.lse, 0) : p.lse;

  const int64_t S = out_partial.shape[0], B = out_partial.shape[1], H = out_partial.shape[2];
  const int64_t sq = out_partial.shape[3], dv = out_partial.shape[4];
  FLASHHOPPER_REFERENCE_CHECK(check_shape(lse_partial, "lse_partial", {S, B, H, sq}));
  FLASHHOPPER_REFERENCE_CHECK(check_shape(out, "out", {B, sq, H, dv}));
  if (present(lse)) FLASHHOPPER_REFERENCE_CHECK(check_shape(lse, "lse", {B, H, sq}));

  const TokenLayout out_layout = TokenLayout::dense(out);
  const RowLayout out_partial_layout{out_partial, {}, true};
  const RowLayout lse_partial_layout{lse_partial, {}, true};
  const RowLayout lse_layout{lse, {}, false};
  parallel_for(B * H, thread_count(options), [&](int64_t item) {
    const int64_t b = item / H, h = item % H;
    std::vector<double> split_lse(S), split_out(dv), o(dv);
    for (int64_t i = 0; i < sq; ++i) {
      double max_lse = -std::numeric_limits<double>::infinity();
      for (int64_t s = 0; s < S; ++s) {
        split_lse[s] = load_element(lse_partial, lse_partial_layout.offset(s, b, h, i));
        max_lse = std::max(max_lse, split_lse[s]);
      }
      std::fill(o.begin(), o.end(), 0.0);
      double row_lse = -std::numeric_limits<double>::infinity();
      if (max_lse > -std::numeric_limits<double>::infinity()) {
        double sum = 0;
        for (int64_t s = 0; s < S; ++s) sum += std::exp(split_lse[s] - max_lse);
        row_lse = max_lse + std::log(sum);
        for (int64_t s = 0; s < S; ++s) {
          const double weight = std::exp(split_lse[s] - row_lse);
          if (weight == 0) continue;  // a split that saw no key: its O_s is not read
          load_strided(out_partial, out_partial_layout.offset(s, b, h, i),
                       out_partial_layout.dim_stride(), dv, split_out.data());
          for (int64_t c = 0; c < dv; ++c) o[c] += weight * split_out[c];
        }
      }
      out_layout.store_row(b, i, h, dv, o.data());
      if (present(lse)) store_element(lse, lse_layout.offset(0, b, h, i), row_lse);
    }
  });
  return {};
}

}  // namespace flashhopper::reference
