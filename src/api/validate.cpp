// Every host-side rule of forward, backward and combine. Each check runs in stages, so that the
// first failure reported is the most useful one: presence and combinations of arguments, ranks,
// dtypes, extents, shape agreement, head-dim limits, strides and alignment, index-type sizes,
// then the scalar parameters. A stage may rely on everything the stages before it checked (the
// shape stages read dims that the rank stage made meaningful; the size stage multiplies extents
// that the extent stage bounded).
//
// Pure argument checks: pointers are compared and aligned, never dereferenced.
#include "api/validate.hpp"

#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <initializer_list>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "plan/problem_shape.hpp"

// Returns the Status of `expr` from the enclosing function when it is a failure.
#define FLASHHOPPER_RETURN_IF_INVALID(expr) \
  do {                                      \
    Status status_ = (expr);                \
    if (!status_.ok()) return status_;      \
  } while (0)

namespace flashhopper::detail {
namespace {

constexpr int64_t kMaxHeadDim = FH_MAX_HEAD_DIM;  // largest compiled head dim (docs/conventions.md, layouts)
constexpr int64_t kMaxSplits = FH_MAX_SPLITS;     // split-KV partials the combine kernel merges
constexpr int64_t kTileRows = 64;           // smallest query tile: bounds the scheduler's tile index
constexpr int64_t kTmaAlignment = 16;       // bytes: TMA's granularity for base addresses and strides
constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();
constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();

// Products of two int64 values, formed without overflow (a GCC/Clang extension).
__extension__ typedef __int128 WideInt;

const Tensor kAbsent{};  // stands in for arguments a pass does not have (the backward's page table)

using NamedTensor = std::pair<const Tensor*, const char*>;
using NamedTensors = std::initializer_list<NamedTensor>;

// ---- Messages ---------------------------------------------------------------------------------

// A message part as text. No iostreams in the library: inside PyTorch processes on the GPU machine
// ostream's number formatting crashed in our library (every refusal with a number in it), which
// std::to_string and snprintf do not.
void append_part(std::string& text, const char* part) { text += part; }
void append_part(std::string& text, const std::string& part) { text += part; }
void append_part(std::string& text, double part) {
  char digits[32];
  std::snprintf(digits, sizeof(digits), "%g", part);
  text += digits;
}
template <typename Integer, std::enable_if_t<std::is_integral_v<Integer>, int> = 0>
void append_part(std::string& text, Integer part) {
  text += std::to_string(part);
}

// "name: <parts...>", the one format of every refusal.
template <typename... Parts>
Status invalid(const char* name, const Parts&... parts) {
  std::string message = std::string(name) + ": ";
  (append_part(message, parts), ...);
  return Status{FH_ERROR_INVALID_ARGUMENT, message};
}

std::string dtype_name(int32_t dtype) {
  switch (dtype) {
    case FH_DTYPE_BF16: return "bf16";
    case FH_DTYPE_FP16: return "fp16";
    case FH_DTYPE_FP8_E4M3: return "fp8_e4m3";
    case FH_DTYPE_FP32: return "float32";
    case FH_DTYPE_INT32: return "int32";
    case FH_DTYPE_FP64: return "float64";
  }
  return "unknown (" + std::to_string(dtype) + ")";
}

// The dtypes an argument may have: a few, kept inline (every call builds some; no heap on the
// success path).
class DTypes {
 public:
  DTypes(std::initializer_list<fh_dtype> dtypes) {
    for (fh_dtype dtype : dtypes) push_back(dtype);
  }
  void push_back(fh_dtype dtype) {
    if (count_ < kCapacity) items_[count_++] = dtype;
  }
  const fh_dtype* begin() const { return items_; }
  const fh_dtype* end() const { return items_ + count_; }
  size_t size() const { return size_t(count_); }
  fh_dtype operator[](size_t i) const { return items_[i]; }

 private:
  static constexpr int kCapacity = 8;  // more than any rule lists
  fh_dtype items_[kCapacity] = {};
  int count_ = 0;
};

// "bf16, fp16 or fp8_e4m3"
std::string dtype_list(const DTypes& dtypes) {
  std::string text;
  for (size_t i = 0; i < dtypes.size(); ++i) {
    if (i > 0) text += (i + 1 == dtypes.size()) ? " or " : ", ";
    text += dtype_name(dtypes[i]);
  }
  return text;
}

// "[2, 128, 8, 128]": a tensor's shape or strides, for messages.
std::string bracketed(const int64_t* values, int32_t count) {
  std::string text = "[";
  for (int32_t i = 0; i < count; ++i) text += (i ? ", " : "") + std::to_string(values[i]);
  return text + "]";
}

int64_t element_bytes(const Tensor& t) { return static_cast<int64_t>(dtype_size(static_cast<DType>(t.dtype))); }

// ---- Per-tensor rules, shared by every pass -----------------------------------------------------

// How the kernels reach a tensor, which decides its stride and alignment rules.
enum class Access {
  kTma,      // bulk tensor copies: last dim contiguous, other strides and the base 16-byte aligned
  kTmaColumnMajor,  // as kTma with dim 1 contiguous instead: fp8's v [B, S, Hkv, dv], keys contiguous
  kRows,     // element loads/stores along a contiguous last dim (lse, sequence lengths, page table, sinks)
  kStrided,  // element loads at any stride (descale factors)
};

struct Arg {
  const Tensor* tensor;
  const char* name;
  Access access;
};

// A list of arguments without owning them (a local array's): no heap on the success path.
class Args {
 public:
  template <size_t kCount>
  Args(const Arg (&args)[kCount]) : begin_(args), end_(args + kCount) {}  // NOLINT: implicit by design
  const Arg* begin() const { return begin_; }
  const Arg* end() const { return end_; }
  size_t size() const { return size_t(end_ - begin_); }
  const Arg& operator[](size_t i) const { return begin_[i]; }

 private:
  const Arg* begin_;
  const Arg* end_;
};

// Which ranks a tensor may have, and how the message describes the expected layout.
struct Layout {
  int32_t rank;
  const char* mode;             // "dense", "varlen (cu_seqlens_q given)", ... or "" when there is one layout
  const char* dims;             // "[B, sq, Hq, d]", or its head "[B, sq, Hq, " when `last` names the last dim
  const char* last = nullptr;   // "d" or "dv"
  std::string described_dims() const { return last ? std::string(dims) + last + "]" : std::string(dims); }
};

// One expected extent of a tensor's shape; `value < 0` leaves that dim free.
struct Extent {
  int64_t value;
  const char* what;    // "head dim"
  const char* source;  // the argument the value was read from
};
constexpr Extent kFree{-1, "", ""};

Status require_present(const Tensor& t, const char* name) {
  if (!present(t)) return invalid(name, "is required (data is null)");
  return {};
}

Status check_rank(const Tensor& t, const char* name, const Layout& layout) {
  if (t.ndim == layout.rank) return {};
  const std::string expected = *layout.mode == '\0' ? std::string(name) : std::string(layout.mode) + " " + name;
  return invalid(name, "ndim is ", t.ndim, " but ", expected, " must be ", layout.rank, "-d ", layout.described_dims());
}

Status check_dtype(const Tensor& t, const char* name, const DTypes& allowed,
                   const char* reason = "") {
  for (fh_dtype dtype : allowed) {
    if (t.dtype == dtype) return {};
  }
  return invalid(name, "dtype is ", dtype_name(t.dtype), "; must be ", dtype_list(allowed), reason);
}

Status check_shape(const Tensor& t, const char* name, std::initializer_list<Extent> extents) {
  int dim = 0;
  for (const Extent& e : extents) {
    if (e.value >= 0 && t.shape[dim] != e.value) {
      return invalid(name, "shape[", dim, "] (", e.what, ") is ", t.shape[dim], " but ", e.source, "'s ", e.what,
                     " is ", e.value, "; ", e.source, " and ", name, " must have the same ", e.what);
    }
    ++dim;
  }
  return {};
}

// A gradient has exactly the shape of the tensor it is the gradient of.
Status check_same_shape(const Tensor& t, const char* name, const Tensor& like, const char* like_name) {
  for (int dim = 0; dim < t.ndim; ++dim) {
    if (t.shape[dim] != like.shape[dim]) {
      return invalid(name, "shape[", dim, "] is ", t.shape[dim], " but ", like_name, "'s shape[", dim, "] is ",
                     like.shape[dim], "; ", name, " must have the same shape as ", like_name, " ",
                     bracketed(like.shape, like.ndim));
    }
  }
  return {};
}

// For the kernels every extent at least 1 and within int32, the type they index sizes with; the
// CPU reference also takes extents of 0 (an empty sequence's view; the heads and head dims are
// checked to be at least 1 before anything divides by them). The element count fits int64 for
// every target, so that sizes derived from extents (total tokens = batch x seqlen) can be formed
// in int64.
Status check_extents(const Arg& arg, Target target) {
  const Tensor& t = *arg.tensor;
  WideInt elements = 1;
  for (int dim = 0; dim < t.ndim; ++dim) {
    if (target == Target::kKernel && t.shape[dim] < 1) {
      return invalid(arg.name, "shape[", dim, "] is ", t.shape[dim], "; every extent must be at least 1");
    }
    if (t.shape[dim] < 0) {
      return invalid(arg.name, "shape[", dim, "] is ", t.shape[dim], "; extents must not be negative");
    }
    if (target == Target::kKernel && t.shape[dim] > kInt32Max) {
      return invalid(arg.name, "shape[", dim, "] is ", t.shape[dim], ", more than INT32_MAX (", kInt32Max,
                     "); the kernels index sizes with 32-bit integers");
    }
    elements *= t.shape[dim];
    if (elements > kInt64Max) {
      return invalid(arg.name, "shape ", bracketed(t.shape, t.ndim), " holds more elements than int64 can count");
    }
  }
  return {};
}

// Strides never negative; for the kernels, the contiguity and alignment their loads need.
Status check_strides_and_alignment(const Arg& arg, Target target) {
  const Tensor& t = *arg.tensor;
  const int last = t.ndim - 1;
  for (int dim = 0; dim < t.ndim; ++dim) {
    if (t.stride[dim] < 0) {
      return invalid(arg.name, "stride[", dim, "] is ", t.stride[dim], "; negative strides are not supported");
    }
  }
  if (target != Target::kKernel) return {};  // the CPU reference reads any layout

  const int64_t bytes = element_bytes(t);
  const bool tma = arg.access == Access::kTma || arg.access == Access::kTmaColumnMajor;
  const int contiguous = arg.access == Access::kTmaColumnMajor ? 1 : last;
  if (arg.access != Access::kStrided && t.stride[contiguous] != 1) {
    const char* rule = arg.access == Access::kTmaColumnMajor
                           ? " but a column-major v must have its keys contiguous"
                           : " but the last dim must be contiguous (stride 1) for the kernels";
    return invalid(arg.name, "stride[", contiguous, "] is ", t.stride[contiguous], rule);
  }
  if (tma) {
    // Element sizes divide 16, so "stride * bytes is a multiple of 16" is this, without overflow.
    const int64_t granule = kTmaAlignment / bytes;
    for (int dim = 0; dim <= last; ++dim) {
      if (dim == contiguous) continue;
      if (t.stride[dim] % granule != 0) {
        return invalid(arg.name, "stride[", dim, "] is ", t.stride[dim], ", not a multiple of ", granule,
                       " elements (16 bytes of ", dtype_name(t.dtype), "); TMA needs 16-byte aligned strides");
      }
      // A TMA descriptor holds strides below 2^40 bytes (CuTe only asserts it, and release builds
      // drop asserts).
      if (t.stride[dim] >= (int64_t(1) << 40) / bytes) {
        return invalid(arg.name, "stride[", dim, "] is ", t.stride[dim], " elements (", dtype_name(t.dtype),
                       "), 2^40 bytes or more; TMA descriptors take strides below 2^40 bytes");
      }
    }
  }
  const int64_t alignment = tma ? kTmaAlignment : bytes;
  const auto address = reinterpret_cast<uintptr_t>(t.data);
  if (address % static_cast<uintptr_t>(alignment) != 0) {
    char hex[24];
    std::snprintf(hex, sizeof(hex), "0x%llx", static_cast<unsigned long long>(address));
    return invalid(arg.name, "data pointer ", hex, " is not ", alignment, "-byte aligned",
                   tma ? "; TMA needs 16-byte aligned base addresses" : "");
  }
  return {};
}

// The byte just past the tensor's last element must be addressable with int64 offsets. Extents
// and strides are int64 each, so their products are formed in 128 bits.
Status check_offset_range(const Arg& arg) {
  const Tensor& t = *arg.tensor;
  WideInt end = 1;  // in elements: the largest offset, plus one
  for (int dim = 0; dim < t.ndim; ++dim) {
    end += static_cast<WideInt>(t.shape[dim] - 1) * t.stride[dim];
    if (end > kInt64Max) break;  // stop before the sum itself could overflow
  }
  if (end > kInt64Max / static_cast<WideInt>(element_bytes(t))) {  // end * bytes, without overflowing
    return invalid(arg.name, "shape ", bracketed(t.shape, t.ndim), " with stride ", bracketed(t.stride, t.ndim),
                   " reaches past the int64 range of byte offsets");
  }
  return {};
}

// Runs `rule` on each present argument, stopping at the first failure.
template <typename Rule>
Status for_each_present(Args args, Rule rule) {
  for (const Arg& arg : args) {
    if (present(*arg.tensor)) FLASHHOPPER_RETURN_IF_INVALID(rule(arg));
  }
  return {};
}

Status check_tensors_extents(Args args, Target target) {
  return for_each_present(args, [&](const Arg& arg) { return check_extents(arg, target); });
}

Status check_tensors_layout(Args args, Target target) {
  FLASHHOPPER_RETURN_IF_INVALID(
      for_each_present(args, [&](const Arg& arg) { return check_strides_and_alignment(arg, target); }));
  return for_each_present(args, [](const Arg& arg) { return check_offset_range(arg); });
}

Status check_int32_index(const Tensor& t, const char* name) {
  if (!present(t)) return {};
  return check_dtype(t, name, {FH_DTYPE_INT32});
}

// ---- The attention problem, shared by forward and backward -------------------------------------

// The arguments the forward and the backward have in common, read off either struct.
struct AttentionArgs {
  const Tensor& q;
  const Tensor& k;
  const Tensor& v;
  const Tensor& out;
  const Tensor& lse;
  const Tensor& cu_seqlens_q;
  const Tensor& cu_seqlens_k;
  const Tensor& seqused_q;
  const Tensor& seqused_k;
  const Tensor& page_table;  // absent in the backward
  int32_t max_seqlen_q;
  int32_t max_seqlen_k;
  float softmax_scale;
  float softcap;
  int32_t causal;
  int32_t window_left;
  int32_t window_right;
  int32_t num_sink_tokens;
  int32_t attention_chunk;
  const Tensor& learnable_sink;
  const Tensor& cache_batch_idx;  // absent in the backward

  bool varlen_q() const { return present(cu_seqlens_q); }
  bool varlen_k() const { return present(cu_seqlens_k); }
  bool paged() const { return present(page_table); }
  // Where the batch size is read from: q's first dim, or the number of prefix sums.
  const char* batch_source() const { return varlen_q() ? "cu_seqlens_q" : "q"; }
};

AttentionArgs attention_args(const ForwardParams& p) {
  return {p.q,           p.k,           p.v,           p.out,         p.lse,
          p.cu_seqlens_q, p.cu_seqlens_k, p.seqused_q,   p.seqused_k,   p.page_table,
          p.max_seqlen_q, p.max_seqlen_k, p.softmax_scale, p.softcap,   p.causal,
          p.window_left,  p.window_right, p.num_sink_tokens, p.attention_chunk, p.learnable_sink,
          p.cache_batch_idx};
}

AttentionArgs attention_args(const BackwardParams& p) {
  return {p.q,           p.k,           p.v,           p.out,         p.lse,
          p.cu_seqlens_q, p.cu_seqlens_k, p.seqused_q,   p.seqused_k,   kAbsent,
          p.max_seqlen_q, p.max_seqlen_k, p.softmax_scale, p.softcap,   p.causal,
          p.window_left,  p.window_right, p.num_sink_tokens, p.attention_chunk, p.learnable_sink,
          kAbsent};
}

// Layouts on the query side (q, out, their gradients) and the key side (k, v, theirs).
// `last` names the last dim: "d" or "dv".
Layout query_layout(const AttentionArgs& a, const char* last) {
  if (a.varlen_q()) return {3, "varlen (cu_seqlens_q given)", "[total_q, Hq, ", last};
  return {4, "dense (no cu_seqlens_q)", "[B, sq, Hq, ", last};
}

Layout key_layout(const AttentionArgs& a, const char* last) {
  if (a.paged()) return {4, "paged (page_table given)", "[num_pages, page_size, Hkv, ", last};
  if (a.varlen_k()) return {3, "varlen (cu_seqlens_k given)", "[total_k, Hkv, ", last};
  return {4, "dense (no cu_seqlens_k, no page_table)", "[B, sk, Hkv, ", last};
}

Layout lse_layout(const AttentionArgs& a) {
  if (a.varlen_q()) return {2, "varlen (cu_seqlens_q given)", "[Hq, total_q]"};
  return {3, "dense (no cu_seqlens_q)", "[B, Hq, sq]"};
}

const Layout kSequenceLengths{1, "", "[B]"};
const Layout kPrefixSums{1, "", "[B + 1]"};
const Layout kPerQueryHead{1, "", "[Hq]"};  // learnable_sink, dsink

// One float32 per query head (float64 too for the CPU reference, as lse).
DTypes per_head_dtypes(Target target) {
  DTypes allowed{FH_DTYPE_FP32};
  if (target == Target::kHostReference) allowed.push_back(FH_DTYPE_FP64);
  return allowed;
}

Status check_attention_ranks(const AttentionArgs& a) {
  FLASHHOPPER_RETURN_IF_INVALID(check_rank(a.q, "q", query_layout(a, "d")));
  FLASHHOPPER_RETURN_IF_INVALID(check_rank(a.k, "k", key_layout(a, "d")));
  FLASHHOPPER_RETURN_IF_INVALID(check_rank(a.v, "v", key_layout(a, "dv")));
  if (present(a.out)) FLASHHOPPER_RETURN_IF_INVALID(check_rank(a.out, "out", query_layout(a, "dv")));
  if (present(a.lse)) FLASHHOPPER_RETURN_IF_INVALID(check_rank(a.lse, "lse", lse_layout(a)));
  if (a.varlen_q()) FLASHHOPPER_RETURN_IF_INVALID(check_rank(a.cu_seqlens_q, "cu_seqlens_q", kPrefixSums));
  if (a.varlen_k()) FLASHHOPPER_RETURN_IF_INVALID(check_rank(a.cu_seqlens_k, "cu_seqlens_k", kPrefixSums));
  if (present(a.seqused_q)) FLASHHOPPER_RETURN_IF_INVALID(check_rank(a.seqused_q, "seqused_q", kSequenceLengths));
  if (present(a.seqused_k)) FLASHHOPPER_RETURN_IF_INVALID(check_rank(a.seqused_k, "seqused_k", kSequenceLengths));
  if (present(a.learnable_sink)) {
    FLASHHOPPER_RETURN_IF_INVALID(check_rank(a.learnable_sink, "learnable_sink", kPerQueryHead));
  }
  return {};
}

// Outputs (and, in the backward, the gradients) have q's dtype; the CPU reference may write any
// float dtype whatever the inputs (it rounds its double results into it).
DTypes output_dtypes(fh_dtype input, Target target) {
  DTypes allowed{input};
  if (target == Target::kHostReference) {
    for (fh_dtype other : {FH_DTYPE_BF16, FH_DTYPE_FP16, FH_DTYPE_FP32, FH_DTYPE_FP64}) {
      if (other != input) allowed.push_back(other);
    }
  }
  return allowed;
}

Status check_attention_dtypes(const AttentionArgs& a, Target target, bool fp8_allowed) {
  DTypes inputs{FH_DTYPE_BF16, FH_DTYPE_FP16};
  if (fp8_allowed) inputs.push_back(FH_DTYPE_FP8_E4M3);
  if (target == Target::kHostReference) {
    inputs.push_back(FH_DTYPE_FP32);
    inputs.push_back(FH_DTYPE_FP64);
  }
  const char* reason = !fp8_allowed ? " (the backward takes no fp8)" : "";
  FLASHHOPPER_RETURN_IF_INVALID(check_dtype(a.q, "q", inputs, reason));
  const auto input = static_cast<fh_dtype>(a.q.dtype);
  for (const auto& [tensor, name] : NamedTensors{{&a.k, "k"}, {&a.v, "v"}}) {
    if (tensor->dtype != input) {
      return invalid(name, "dtype is ", dtype_name(tensor->dtype), " but q's is ", dtype_name(input),
                     "; q, k and v must have the same dtype");
    }
  }
  if (present(a.out)) {
    // fp8 attention writes bf16: an fp8 output would lose too much of what float32 accumulated.
    const fh_dtype out_dtype = input == FH_DTYPE_FP8_E4M3 ? FH_DTYPE_BF16 : input;
    FLASHHOPPER_RETURN_IF_INVALID(check_dtype(a.out, "out", output_dtypes(out_dtype, target),
                                              input == FH_DTYPE_FP8_E4M3 ? " (fp8 inputs give a bf16 output)"
                                                                          : " (the dtype of q)"));
  }
  if (present(a.lse)) {
    DTypes lse_dtypes{FH_DTYPE_FP32};
    if (target == Target::kHostReference) lse_dtypes.push_back(FH_DTYPE_FP64);
    FLASHHOPPER_RETURN_IF_INVALID(check_dtype(a.lse, "lse", lse_dtypes));
  }
  FLASHHOPPER_RETURN_IF_INVALID(check_int32_index(a.cu_seqlens_q, "cu_seqlens_q"));
  FLASHHOPPER_RETURN_IF_INVALID(check_int32_index(a.cu_seqlens_k, "cu_seqlens_k"));
  FLASHHOPPER_RETURN_IF_INVALID(check_int32_index(a.seqused_q, "seqused_q"));
  FLASHHOPPER_RETURN_IF_INVALID(check_int32_index(a.seqused_k, "seqused_k"));
  if (present(a.learnable_sink)) {
    FLASHHOPPER_RETURN_IF_INVALID(check_dtype(a.learnable_sink, "learnable_sink", per_head_dtypes(target)));
  }
  return {};
}

// out [B, sq, Hq, dv] or [total_q, Hq, dv]; also the shape of dout.
Status check_out_shape(const Tensor& t, const char* name, const AttentionArgs& a, const ProblemShape& s) {
  const Extent heads{s.heads_q, "number of query heads", "q"};
  const Extent head_dim_v{s.head_dim_v, "value head dim", "v"};
  if (a.varlen_q()) return check_shape(t, name, {{s.total_q, "total query tokens", "q"}, heads, head_dim_v});
  return check_shape(t, name, {{s.batch, "batch size", a.batch_source()},
                               {s.seqlen_q, "query sequence length", "q"}, heads, head_dim_v});
}

// Varlen: `cu_seqlens_*` holds batch + 1 prefix sums and `max_seqlen_*` bounds the lengths.
Status check_prefix_sums(const Tensor& cu_seqlens, const char* name, int32_t max_seqlen, const char* max_name,
                         const AttentionArgs& a, const ProblemShape& s) {
  if (cu_seqlens.shape[0] - 1 != s.batch) {  // shape[0] >= 1 and batch <= INT64_MAX: no overflow either way
    return invalid(name, "shape[0] is ", cu_seqlens.shape[0], " but must be batch size + 1 = ",
                   static_cast<uint64_t>(s.batch) + 1, " (batch size ", s.batch, " from ", a.batch_source(), ")");
  }
  if (max_seqlen < 1) {
    return invalid(max_name, "is ", max_seqlen, "; varlen (", name, " given) needs ", max_name, " >= 1");
  }
  return {};
}

Status check_attention_shapes(const AttentionArgs& a, const ProblemShape& s) {
  if (a.varlen_q() && a.cu_seqlens_q.shape[0] < 2) {
    return invalid("cu_seqlens_q", "shape[0] is ", a.cu_seqlens_q.shape[0],
                   "; it holds batch size + 1 prefix sums, so the batch size would be less than 1");
  }
  const Extent batch{s.batch, "batch size", a.batch_source()};
  const Extent head_dim{s.head_dim, "head dim", "q"};
  const Extent heads_kv{s.heads_kv, "number of key/value heads", "k"};
  if (a.paged()) {
    FLASHHOPPER_RETURN_IF_INVALID(check_shape(a.k, "k", {kFree, kFree, kFree, head_dim}));
    FLASHHOPPER_RETURN_IF_INVALID(check_shape(
        a.v, "v", {{s.num_pages, "number of pages", "k"}, {s.page_size, "page size", "k"}, heads_kv, kFree}));
  } else if (a.varlen_k()) {
    FLASHHOPPER_RETURN_IF_INVALID(check_shape(a.k, "k", {kFree, kFree, head_dim}));
    FLASHHOPPER_RETURN_IF_INVALID(check_shape(a.v, "v", {{s.total_k, "total key tokens", "k"}, heads_kv, kFree}));
  } else if (present(a.cache_batch_idx)) {  // any number of cache rows, indexed per sequence
    FLASHHOPPER_RETURN_IF_INVALID(check_shape(a.k, "k", {kFree, kFree, kFree, head_dim}));
    FLASHHOPPER_RETURN_IF_INVALID(check_shape(a.v, "v", {{a.k.shape[0], "number of cache rows", "k"},
                                                         {s.seqlen_k, "key sequence length", "k"}, heads_kv, kFree}));
  } else {
    FLASHHOPPER_RETURN_IF_INVALID(check_shape(a.k, "k", {batch, kFree, kFree, head_dim}));
    FLASHHOPPER_RETURN_IF_INVALID(
        check_shape(a.v, "v", {batch, {s.seqlen_k, "key sequence length", "k"}, heads_kv, kFree}));
  }
  if (present(a.out)) FLASHHOPPER_RETURN_IF_INVALID(check_out_shape(a.out, "out", a, s));
  if (present(a.lse)) {
    const Extent heads{s.heads_q, "number of query heads", "q"};
    FLASHHOPPER_RETURN_IF_INVALID(
        a.varlen_q() ? check_shape(a.lse, "lse", {heads, {s.total_q, "total query tokens", "q"}})
                     : check_shape(a.lse, "lse", {batch, heads, {s.seqlen_q, "query sequence length", "q"}}));
  }
  if (a.varlen_q()) {
    FLASHHOPPER_RETURN_IF_INVALID(
        check_prefix_sums(a.cu_seqlens_q, "cu_seqlens_q", a.max_seqlen_q, "max_seqlen_q", a, s));
  }
  if (a.varlen_k()) {
    FLASHHOPPER_RETURN_IF_INVALID(
        check_prefix_sums(a.cu_seqlens_k, "cu_seqlens_k", a.max_seqlen_k, "max_seqlen_k", a, s));
  }
  if (present(a.seqused_q)) FLASHHOPPER_RETURN_IF_INVALID(check_shape(a.seqused_q, "seqused_q", {batch}));
  if (present(a.seqused_k)) FLASHHOPPER_RETURN_IF_INVALID(check_shape(a.seqused_k, "seqused_k", {batch}));
  if (present(a.learnable_sink)) {
    FLASHHOPPER_RETURN_IF_INVALID(
        check_shape(a.learnable_sink, "learnable_sink", {{s.heads_q, "number of query heads", "q"}}));
  }
  return {};
}

Status check_head_dims(const AttentionArgs& a, const ProblemShape& s, Target target) {
  const int q_head_dim = a.q.ndim - 1;
  const int v_head_dim = a.v.ndim - 1;
  // (Only the CPU reference's extents may be 0; the kernels' are refused before this.)
  if (s.head_dim < 1 || s.head_dim_v < 1) {
    return invalid("q", "head dims (", s.head_dim, ", ", s.head_dim_v, ") must be at least 1");
  }
  if (s.heads_q < 1) return invalid("q", "has ", s.heads_q, " query heads; must have at least 1");
  if (s.heads_kv < 1) return invalid("k", "has ", s.heads_kv, " key/value heads; must have at least 1");
  if (s.head_dim > kMaxHeadDim) {
    return invalid("q", "shape[", q_head_dim, "] (head dim) is ", s.head_dim, "; head dims up to ", kMaxHeadDim,
                   " are supported");
  }
  if (s.head_dim_v > kMaxHeadDim) {
    return invalid("v", "shape[", v_head_dim, "] (value head dim) is ", s.head_dim_v, "; value head dims up to ",
                   kMaxHeadDim, " are supported");
  }
  if (s.heads_q % s.heads_kv != 0) {
    // [B, H, S, D] (PyTorch SDPA's layout) read as [B, S, H, D] looks exactly so: say how to pass it.
    const bool sdpa_layout = !a.varlen_q() && !a.varlen_k() && !a.paged() && a.q.ndim == 4 && a.k.ndim == 4 &&
                             a.k.shape[1] > 0 && a.q.shape[1] % a.k.shape[1] == 0;
    return invalid("k", "shape[", a.k.ndim - 2, "] (number of key/value heads) is ", s.heads_kv,
                   ", which does not divide q's number of query heads ", s.heads_q,
                   "; Hq % Hkv must be 0 (each key/value head serves a whole group of query heads)",
                   sdpa_layout ? "; if q, k and v are [B, H, S, D] (PyTorch SDPA's layout), pass their "
                                 "transpose(1, 2): the dense layout is [B, S, H, D]"
                               : "");
  }
  if (target == Target::kKernel) {
    // A row of q/k (d) or of v (dv) is one TMA box row: a whole number of 16-byte chunks.
    const int64_t bytes = element_bytes(a.q);
    const int64_t granule = kTmaAlignment / bytes;
    if (s.head_dim % granule != 0) {
      return invalid("q", "shape[", q_head_dim, "] (head dim) is ", s.head_dim, ", not a multiple of ", granule,
                     " (16 bytes of ", dtype_name(a.q.dtype), "), as the kernels need");
    }
    if (s.head_dim_v % granule != 0) {
      return invalid("v", "shape[", v_head_dim, "] (value head dim) is ", s.head_dim_v, ", not a multiple of ",
                     granule, " (16 bytes of ", dtype_name(a.v.dtype), "), as the kernels need");
    }
  }
  return {};
}

// The schedulers number (row tile, head, batch) work items with int32. Extents are already
// within int32 (kernel target), so the product fits 128 bits.
Status check_tile_count(const ProblemShape& s, const char* name, int64_t seqlen, const char* seqlen_what) {
  const WideInt tiles =
      static_cast<WideInt>(s.batch) * s.heads_q * ((seqlen + kTileRows - 1) / kTileRows);
  if (tiles > kInt32Max) {
    return invalid(name, "batch ", s.batch, " x ", s.heads_q, " query heads x ceil(", seqlen_what, " ", seqlen,
                   " / ", kTileRows, ") row tiles exceeds INT32_MAX (", kInt32Max,
                   "); the kernels' tile index is 32-bit");
  }
  return {};
}

Status check_mask_and_scale(const AttentionArgs& a) {
  if (!std::isfinite(a.softmax_scale) || a.softmax_scale < 0.f) {
    return invalid("softmax_scale", "is ", a.softmax_scale, "; must be finite and >= 0 (0 selects 1/sqrt(d))");
  }
  if (!std::isfinite(a.softcap) || a.softcap < 0.f) {
    return invalid("softcap", "is ", a.softcap, "; must be finite and >= 0 (0 disables it)");
  }
  for (const auto& [value, name] :
       {std::pair{a.window_left, "window_left"}, std::pair{a.window_right, "window_right"}}) {
    if (value < -1) return invalid(name, "is ", value, "; must be >= -1 (-1 means unbounded)");
  }
  if (a.causal != 0 && a.causal != 1) return invalid("causal", "is ", a.causal, "; must be 0 or 1");
  const bool window_unset = a.window_left == -1 && a.window_right == -1;
  const bool window_causal = a.window_left == -1 && a.window_right == 0;
  if (a.causal && !window_unset && !window_causal) {
    return invalid("causal", "is set together with window_left/window_right (", a.window_left, ", ",
                   a.window_right, "); causal is the window (-1, 0): give one or the other");
  }
  if (a.num_sink_tokens < 0) return invalid("num_sink_tokens", "is ", a.num_sink_tokens, "; must be >= 0");
  const MaskSpec mask = mask_spec(a);
  if (a.num_sink_tokens > 0 && mask.window_left < 0) {
    return invalid("num_sink_tokens", "is ", a.num_sink_tokens, " but window_left is ", mask.window_left,
                   "; sink tokens need a local window (window_left >= 0)");
  }
  if (a.attention_chunk < 0) {
    return invalid("attention_chunk", "is ", a.attention_chunk, "; must be >= 0 (0 disables it)");
  }
  return {};
}

// ---- Forward ------------------------------------------------------------------------------------

// forward_shape() forms a paged cache's key length as max_pages x page_size. The kernels' int32
// extents keep that small; the CPU reference's int64 extents need this bound first.
Status check_paged_capacity(const ForwardParams& p) {
  if (!present(p.page_table)) return {};
  const int64_t max_pages = p.page_table.shape[1];
  const int64_t page_size = p.k.shape[1];
  if (static_cast<WideInt>(max_pages) * page_size > kInt64Max) {
    return invalid("page_table", "shape[1] (max_pages) ", max_pages, " x k's page size ", page_size,
                   " tokens overflows int64");
  }
  return {};
}

std::array<NamedTensor, 3> descale_factors(const ForwardParams& p) {
  return {{{&p.q_descale, "q_descale"}, {&p.k_descale, "k_descale"}, {&p.v_descale, "v_descale"}}};
}

// The KV cache's int32 [B] extras, and the rotary tables.
std::array<NamedTensor, 3> per_sequence_indices(const ForwardParams& p) {
  return {{{&p.cache_batch_idx, "cache_batch_idx"}, {&p.cache_leftpad, "cache_leftpad"},
           {&p.rotary_seqlens, "rotary_seqlens"}}};
}
std::array<NamedTensor, 2> rotary_tables(const ForwardParams& p) {
  return {{{&p.rotary_cos, "rotary_cos"}, {&p.rotary_sin, "rotary_sin"}}};
}

Status check_forward_presence(const ForwardParams& p, const AttentionArgs& a) {
  for (const auto& [tensor, name] : NamedTensors{{&p.q, "q"}, {&p.k, "k"}, {&p.v, "v"}, {&p.out, "out"}}) {
    FLASHHOPPER_RETURN_IF_INVALID(require_present(*tensor, name));
  }
  // A paged K/V's lengths: cache_seqlens (a KV cache) or cu_seqlens_k (a packed batch, whose
  // sequence b holds the first cu_seqlens_k[b + 1] - cu_seqlens_k[b] keys of page-table row b).
  if (a.paged() && !present(p.cache_seqlens) && !a.varlen_k()) {
    return invalid("cache_seqlens", "is required with page_table (the number of cached tokens per sequence), "
                                    "unless cu_seqlens_k gives each sequence's keys");
  }
  if (present(p.k_new) != present(p.v_new)) {
    return present(p.k_new) ? invalid("v_new", "is required together with k_new")
                            : invalid("k_new", "is required together with v_new");
  }
  if (present(p.k_new) && !present(p.cache_seqlens)) {
    return invalid("cache_seqlens", "is required with k_new/v_new (where to append them in the cache)");
  }
  for (const auto& [tensor, name] :
       NamedTensors{{&p.cache_batch_idx, "cache_batch_idx"}, {&p.cache_leftpad, "cache_leftpad"}}) {
    if (present(*tensor) && a.varlen_k()) {
      return invalid(name, "is given with cu_seqlens_k; it indexes a cache, dense k [B_cache, sk, Hkv, d] or "
                           "paged through page_table (as in FlashAttention-3)");
    }
  }
  if (present(p.cache_seqlens) && a.varlen_k()) {
    return invalid("cache_seqlens", "is given with cu_seqlens_k; a sequence's keys are counted by one of them "
                                    "(cache_seqlens for a KV cache, cu_seqlens_k for a packed or paged batch)");
  }
  if (present(p.cache_leftpad) && !present(p.cache_seqlens)) {
    return invalid("cache_leftpad", "needs cache_seqlens: a sequence's keys are the cache positions "
                                    "[cache_leftpad, cache_seqlens + s_new)");
  }
  if (present(p.rotary_cos) != present(p.rotary_sin)) {
    return present(p.rotary_cos) ? invalid("rotary_sin", "is required together with rotary_cos")
                                 : invalid("rotary_cos", "is required together with rotary_sin");
  }
  if (present(p.rotary_cos) && !present(p.k_new)) {
    return invalid("rotary_cos", "is given without k_new/v_new; the rotary embedding applies to the appended "
                                 "keys and q (apply it yourself to a cache without an append)");
  }
  return {};  // (rotary_seqlens without the tables and cu_seqlens_k_new without an append are
              // ignored: without_ignored_arguments)
}

Status check_forward_ranks(const ForwardParams& p, const AttentionArgs& a) {
  FLASHHOPPER_RETURN_IF_INVALID(check_attention_ranks(a));
  if (a.paged()) FLASHHOPPER_RETURN_IF_INVALID(check_rank(p.page_table, "page_table", {2, "", "[B, max_pages]"}));
  if (present(p.cache_seqlens)) {
    FLASHHOPPER_RETURN_IF_INVALID(check_rank(p.cache_seqlens, "cache_seqlens", kSequenceLengths));
  }
  if (present(p.cu_seqlens_k_new)) {
    FLASHHOPPER_RETURN_IF_INVALID(check_rank(p.cu_seqlens_k_new, "cu_seqlens_k_new", kPrefixSums));
    FLASHHOPPER_RETURN_IF_INVALID(
        check_rank(p.k_new, "k_new", {3, "packed (cu_seqlens_k_new given)", "[total_new, Hkv, d]"}));
    FLASHHOPPER_RETURN_IF_INVALID(
        check_rank(p.v_new, "v_new", {3, "packed (cu_seqlens_k_new given)", "[total_new, Hkv, dv]"}));
  } else if (present(p.k_new)) {
    FLASHHOPPER_RETURN_IF_INVALID(check_rank(p.k_new, "k_new", {4, "", "[B, s_new, Hkv, d]"}));
    FLASHHOPPER_RETURN_IF_INVALID(check_rank(p.v_new, "v_new", {4, "", "[B, s_new, Hkv, dv]"}));
  }
  if (present(p.qv)) FLASHHOPPER_RETURN_IF_INVALID(check_rank(p.qv, "qv", query_layout(a, "dv")));
  for (const auto& [tensor, name] : per_sequence_indices(p)) {
    if (present(*tensor)) FLASHHOPPER_RETURN_IF_INVALID(check_rank(*tensor, name, kSequenceLengths));
  }
  for (const auto& [tensor, name] : rotary_tables(p)) {
    if (present(*tensor)) {
      FLASHHOPPER_RETURN_IF_INVALID(check_rank(*tensor, name, {2, "", "[seqlen_ro, rotary_dim / 2]"}));
    }
  }
  for (const auto& [tensor, name] : descale_factors(p)) {
    if (present(*tensor)) FLASHHOPPER_RETURN_IF_INVALID(check_rank(*tensor, name, {2, "", "[B, Hkv]"}));
  }
  return {};
}

Status check_forward_dtypes(const ForwardParams& p, const AttentionArgs& a, Target target) {
  FLASHHOPPER_RETURN_IF_INVALID(check_attention_dtypes(a, target, /*fp8_allowed=*/true));
  FLASHHOPPER_RETURN_IF_INVALID(check_int32_index(p.page_table, "page_table"));
  FLASHHOPPER_RETURN_IF_INVALID(check_int32_index(p.cache_seqlens, "cache_seqlens"));
  FLASHHOPPER_RETURN_IF_INVALID(check_int32_index(p.cu_seqlens_k_new, "cu_seqlens_k_new"));
  for (const auto& [tensor, name] : NamedTensors{{&p.k_new, "k_new"}, {&p.v_new, "v_new"}}) {
    if (present(*tensor) && tensor->dtype != p.k.dtype) {
      return invalid(name, "dtype is ", dtype_name(tensor->dtype), " but k's is ", dtype_name(p.k.dtype),
                     "; appended keys/values must have the cache's dtype");
    }
  }
  for (const auto& [tensor, name] : per_sequence_indices(p)) {
    FLASHHOPPER_RETURN_IF_INVALID(check_int32_index(*tensor, name));
  }
  DTypes rotary_dtypes{static_cast<fh_dtype>(p.q.dtype)};
  if (target == Target::kHostReference) {
    rotary_dtypes.push_back(FH_DTYPE_FP32);
    rotary_dtypes.push_back(FH_DTYPE_FP64);
  }
  for (const auto& [tensor, name] : rotary_tables(p)) {
    if (present(*tensor)) FLASHHOPPER_RETURN_IF_INVALID(check_dtype(*tensor, name, rotary_dtypes, " (q's dtype)"));
  }
  if (!(p.rotary_interleaved == 0 || p.rotary_interleaved == 1)) {
    return invalid("rotary_interleaved", "is ", p.rotary_interleaved, "; must be 0 or 1");
  }
  if (present(p.qv) && p.qv.dtype != p.q.dtype) {
    return invalid("qv", "dtype is ", dtype_name(p.qv.dtype), " but q's is ", dtype_name(p.q.dtype),
                   "; qv must have q's dtype");
  }
  for (const auto& [tensor, name] : descale_factors(p)) {
    if (!present(*tensor)) continue;
    if (p.q.dtype != FH_DTYPE_FP8_E4M3) {
      return invalid(name, "is given but q is ", dtype_name(p.q.dtype),
                     "; descale factors apply to fp8_e4m3 inputs only");
    }
    FLASHHOPPER_RETURN_IF_INVALID(check_dtype(*tensor, name, {FH_DTYPE_FP32}));
  }
  return {};
}

Status check_forward_shapes(const ForwardParams& p, const AttentionArgs& a, const ProblemShape& s) {
  FLASHHOPPER_RETURN_IF_INVALID(check_attention_shapes(a, s));
  const Extent batch{s.batch, "batch size", a.batch_source()};
  const Extent heads_kv{s.heads_kv, "number of key/value heads", "k"};
  if (a.paged()) {  // with cache_batch_idx, any number of rows (it picks each sequence's row)
    FLASHHOPPER_RETURN_IF_INVALID(
        check_shape(p.page_table, "page_table", {present(p.cache_batch_idx) ? kFree : batch, kFree}));
  }
  if (present(p.cache_seqlens)) FLASHHOPPER_RETURN_IF_INVALID(check_shape(p.cache_seqlens, "cache_seqlens", {batch}));
  if (s.varlen_k_new) {
    if (p.cu_seqlens_k_new.shape[0] - 1 != s.batch) {
      return invalid("cu_seqlens_k_new", "shape[0] is ", p.cu_seqlens_k_new.shape[0],
                     " but must be batch size + 1 = ", s.batch + 1, " (batch size ", s.batch, " from ",
                     a.batch_source(), ")");
    }
    FLASHHOPPER_RETURN_IF_INVALID(check_shape(p.k_new, "k_new", {kFree, heads_kv, {s.head_dim, "head dim", "q"}}));
    FLASHHOPPER_RETURN_IF_INVALID(check_shape(p.v_new, "v_new",
                                              {{s.seqlen_new, "total new tokens", "k_new"}, heads_kv,
                                               {s.head_dim_v, "value head dim", "v"}}));
  } else if (present(p.k_new)) {
    FLASHHOPPER_RETURN_IF_INVALID(
        check_shape(p.k_new, "k_new", {batch, kFree, heads_kv, {s.head_dim, "head dim", "q"}}));
    FLASHHOPPER_RETURN_IF_INVALID(check_shape(
        p.v_new, "v_new",
        {batch, {s.seqlen_new, "number of new tokens", "k_new"}, heads_kv, {s.head_dim_v, "value head dim", "v"}}));
  }
  for (const auto& [tensor, name] : descale_factors(p)) {
    if (present(*tensor)) FLASHHOPPER_RETURN_IF_INVALID(check_shape(*tensor, name, {batch, heads_kv}));
  }
  if (present(p.qv)) FLASHHOPPER_RETURN_IF_INVALID(check_out_shape(p.qv, "qv", a, s));
  for (const auto& [tensor, name] : per_sequence_indices(p)) {
    if (present(*tensor)) FLASHHOPPER_RETURN_IF_INVALID(check_shape(*tensor, name, {batch}));
  }
  if (present(p.rotary_cos)) {
    const int64_t half = p.rotary_cos.shape[1];
    if (half * 2 > s.head_dim) {
      return invalid("rotary_cos", "shape[1] (rotary_dim / 2) is ", half, "; rotary_dim ", half * 2,
                     " must be at most the head dim ", s.head_dim, " (from q)");
    }
    FLASHHOPPER_RETURN_IF_INVALID(check_shape(p.rotary_sin, "rotary_sin",
                                              {{p.rotary_cos.shape[0], "rotary positions (seqlen_ro)", "rotary_cos"},
                                               {half, "rotary_dim / 2", "rotary_cos"}}));
  }
  return {};
}

// The device's SM count is not known here (the checks run without a GPU); the dispatch refuses a
// margin that leaves none (launch::sm_margin_reason).
Status check_sm_margin(int32_t sm_margin) {
  if (sm_margin < 0) return invalid("sm_margin", "is ", sm_margin, "; must be >= 0 (the SMs left free)");
  return {};
}

Status check_forward_scalars(const ForwardParams& p, const AttentionArgs& a) {
  FLASHHOPPER_RETURN_IF_INVALID(check_mask_and_scale(a));
  if (p.num_splits < 0 || p.num_splits > kMaxSplits) {
    return invalid("num_splits", "is ", p.num_splits, "; must be in [0, ", kMaxSplits, "] (0: chosen from the shapes)");
  }
  return check_sm_margin(p.sm_margin);
}

// ---- Backward -----------------------------------------------------------------------------------

Status check_backward_presence(const BackwardParams& p, const AttentionArgs& a, Target target) {
  // The CPU reference recomputes the forward itself, so it needs neither out nor lse.
  const bool needs_forward_outputs = target == Target::kKernel;
  const NamedTensor required[] = {
      {&p.q, "q"}, {&p.k, "k"}, {&p.v, "v"}, {&p.out, "out"}, {&p.dout, "dout"},
      {&p.lse, "lse"}, {&p.dq, "dq"}, {&p.dk, "dk"}, {&p.dv, "dv"}};
  for (const auto& [tensor, name] : required) {
    const bool forward_output = tensor == &p.out || tensor == &p.lse;
    if (forward_output && !needs_forward_outputs) continue;
    FLASHHOPPER_RETURN_IF_INVALID(require_present(*tensor, name));
  }
  if (present(p.dsink) && !present(p.learnable_sink)) {
    return invalid("dsink", "is given but learnable_sink is absent; dsink is the gradient of learnable_sink "
                            "and needs it");
  }
  return {};
}

Status check_backward_ranks(const BackwardParams& p, const AttentionArgs& a) {
  FLASHHOPPER_RETURN_IF_INVALID(check_attention_ranks(a));
  FLASHHOPPER_RETURN_IF_INVALID(check_rank(p.dout, "dout", query_layout(a, "dv")));
  FLASHHOPPER_RETURN_IF_INVALID(check_rank(p.dq, "dq", query_layout(a, "d")));
  FLASHHOPPER_RETURN_IF_INVALID(check_rank(p.dk, "dk", key_layout(a, "d")));
  FLASHHOPPER_RETURN_IF_INVALID(check_rank(p.dv, "dv", key_layout(a, "dv")));
  if (present(p.dsink)) FLASHHOPPER_RETURN_IF_INVALID(check_rank(p.dsink, "dsink", kPerQueryHead));
  return {};
}

Status check_backward_dtypes(const BackwardParams& p, const AttentionArgs& a, Target target) {
  FLASHHOPPER_RETURN_IF_INVALID(check_attention_dtypes(a, target, /*fp8_allowed=*/false));
  const DTypes allowed = output_dtypes(static_cast<fh_dtype>(p.q.dtype), target);
  for (const auto& [tensor, name] : NamedTensors{{&p.dout, "dout"}, {&p.dq, "dq"}, {&p.dk, "dk"}, {&p.dv, "dv"}}) {
    FLASHHOPPER_RETURN_IF_INVALID(check_dtype(*tensor, name, allowed, " (the dtype of q)"));
  }
  if (present(p.dsink)) FLASHHOPPER_RETURN_IF_INVALID(check_dtype(p.dsink, "dsink", per_head_dtypes(target)));
  return {};
}

Status check_backward_shapes(const BackwardParams& p, const AttentionArgs& a, const ProblemShape& s) {
  FLASHHOPPER_RETURN_IF_INVALID(check_attention_shapes(a, s));
  FLASHHOPPER_RETURN_IF_INVALID(check_out_shape(p.dout, "dout", a, s));
  FLASHHOPPER_RETURN_IF_INVALID(check_same_shape(p.dq, "dq", p.q, "q"));
  FLASHHOPPER_RETURN_IF_INVALID(check_same_shape(p.dk, "dk", p.k, "k"));
  FLASHHOPPER_RETURN_IF_INVALID(check_same_shape(p.dv, "dv", p.v, "v"));
  if (present(p.dsink)) {
    FLASHHOPPER_RETURN_IF_INVALID(check_shape(p.dsink, "dsink", {{s.heads_q, "number of query heads", "q"}}));
  }
  return {};
}

// dsink is written while learnable_sink is read. Compares the byte ranges the two span; both are
// 1-d with extents and strides already checked.
Status check_dsink_not_aliased(const BackwardParams& p) {
  if (!present(p.dsink)) return {};
  auto byte_range = [](const Tensor& t) {
    const auto begin = static_cast<WideInt>(reinterpret_cast<uintptr_t>(t.data));
    return std::pair{begin, begin + ((t.shape[0] - 1) * static_cast<WideInt>(t.stride[0]) + 1) * element_bytes(t)};
  };
  const auto [sink_begin, sink_end] = byte_range(p.learnable_sink);
  const auto [dsink_begin, dsink_end] = byte_range(p.dsink);
  if (dsink_begin < sink_end && sink_begin < dsink_end) {
    return invalid("dsink", "overlaps learnable_sink in memory; the gradient must not alias the sink it is "
                            "the gradient of");
  }
  return {};
}

bool has_no_elements(const Tensor& t) {
  for (int dim = 0; dim < t.ndim; ++dim) {
    if (t.shape[dim] == 0) return true;
  }
  return false;
}

// Outputs written by many threads must not alias: not each other's or an input's first element,
// and no output dim of extent > 1 with stride 0 (its elements would be one). The cheap checks;
// interleaved views of one buffer (e.g. dk and dv as halves of a [.., 2, d] tensor) stay allowed.
// An output without elements (the CPU reference's empty sequences) is not written.
Status check_outputs_not_aliased(Args outputs, Args others) {
  for (size_t i = 0; i < outputs.size(); ++i) {
    const Tensor& t = *outputs[i].tensor;
    if (!present(t) || has_no_elements(t)) continue;
    for (int dim = 0; dim < t.ndim; ++dim) {
      if (t.stride[dim] == 0 && t.shape[dim] > 1) {
        return invalid(outputs[i].name, "stride[", dim, "] is 0 on a dim of extent ", t.shape[dim],
                       ": its elements would overwrite each other");
      }
    }
    auto same_start = [&](const Arg& other) {
      return present(*other.tensor) && !has_no_elements(*other.tensor) && other.tensor->data == t.data;
    };
    for (size_t j = i + 1; j < outputs.size(); ++j) {
      if (same_start(outputs[j])) {
        return invalid(outputs[j].name, "starts at the same address as ", outputs[i].name,
                       "; outputs must not overlap each other");
      }
    }
    for (const Arg& other : others) {
      if (same_start(other)) {
        return invalid(outputs[i].name, "starts at the same address as ", other.name,
                       "; outputs must not overlap the inputs");
      }
    }
  }
  return {};
}

Status check_backward_scalars(const BackwardParams& p, const AttentionArgs& a) {
  FLASHHOPPER_RETURN_IF_INVALID(check_mask_and_scale(a));
  if (p.deterministic != 0 && p.deterministic != 1) {
    return invalid("deterministic", "is ", p.deterministic, "; must be 0 or 1");
  }
  return check_sm_margin(p.sm_margin);
}

}  // namespace

// ---- Entry points -------------------------------------------------------------------------------

ForwardParams without_ignored_arguments(const ForwardParams& params) {
  ForwardParams p = params;
  if (!present(p.rotary_cos) && !present(p.rotary_sin)) p.rotary_seqlens = {};
  if (!present(p.k_new) && !present(p.v_new)) p.cu_seqlens_k_new = {};  // (FA3 ignores both too)
  return p;
}

Status validate(const ForwardParams& params, Target target) {
  const ForwardParams p = without_ignored_arguments(params);
  const AttentionArgs a = attention_args(p);
  FLASHHOPPER_RETURN_IF_INVALID(check_forward_presence(p, a));
  FLASHHOPPER_RETURN_IF_INVALID(check_forward_ranks(p, a));
  FLASHHOPPER_RETURN_IF_INVALID(check_forward_dtypes(p, a, target));
  const Arg tensors[] = {
      {&p.q, "q", Access::kTma},
      {&p.k, "k", Access::kTma},
      {&p.v, "v", v_column_major(p) ? Access::kTmaColumnMajor : Access::kTma},
      {&p.out, "out", Access::kTma},
      {&p.lse, "lse", Access::kRows},
      {&p.cu_seqlens_q, "cu_seqlens_q", Access::kRows},
      {&p.cu_seqlens_k, "cu_seqlens_k", Access::kRows},
      {&p.seqused_q, "seqused_q", Access::kRows},
      {&p.seqused_k, "seqused_k", Access::kRows},
      {&p.page_table, "page_table", Access::kRows},
      {&p.cache_seqlens, "cache_seqlens", Access::kRows},
      {&p.k_new, "k_new", Access::kTma},
      {&p.v_new, "v_new", Access::kTma},
      {&p.cu_seqlens_k_new, "cu_seqlens_k_new", Access::kRows},
      {&p.q_descale, "q_descale", Access::kStrided},
      {&p.k_descale, "k_descale", Access::kStrided},
      {&p.v_descale, "v_descale", Access::kStrided},
      {&p.learnable_sink, "learnable_sink", Access::kRows},
      {&p.qv, "qv", Access::kTma},
      {&p.cache_batch_idx, "cache_batch_idx", Access::kRows},
      {&p.cache_leftpad, "cache_leftpad", Access::kRows},
      {&p.rotary_cos, "rotary_cos", Access::kStrided},
      {&p.rotary_sin, "rotary_sin", Access::kStrided},
      {&p.rotary_seqlens, "rotary_seqlens", Access::kRows},
  };
  FLASHHOPPER_RETURN_IF_INVALID(check_tensors_extents(tensors, target));
  FLASHHOPPER_RETURN_IF_INVALID(check_paged_capacity(p));
  const ProblemShape shape = forward_shape(p);
  FLASHHOPPER_RETURN_IF_INVALID(check_forward_shapes(p, a, shape));
  FLASHHOPPER_RETURN_IF_INVALID(check_head_dims(a, shape, target));
  FLASHHOPPER_RETURN_IF_INVALID(check_tensors_layout(tensors, target));
  // (k and v are written too when k_new is appended: in place, by design.)
  const Arg outputs[] = {{&p.out, "out", Access::kTma}, {&p.lse, "lse", Access::kRows}};
  const Arg inputs[] = {{&p.q, "q", Access::kTma},         {&p.k, "k", Access::kTma},
                        {&p.v, "v", Access::kTma},         {&p.k_new, "k_new", Access::kTma},
                        {&p.v_new, "v_new", Access::kTma}, {&p.qv, "qv", Access::kTma}};
  FLASHHOPPER_RETURN_IF_INVALID(check_outputs_not_aliased(outputs, inputs));
  if (target == Target::kKernel) {
    FLASHHOPPER_RETURN_IF_INVALID(check_tile_count(shape, "q", shape.seqlen_q, "query sequence length"));
  }
  return check_forward_scalars(p, a);
}

Status validate(const BackwardParams& p, Target target) {
  const AttentionArgs a = attention_args(p);
  FLASHHOPPER_RETURN_IF_INVALID(check_backward_presence(p, a, target));
  FLASHHOPPER_RETURN_IF_INVALID(check_backward_ranks(p, a));
  FLASHHOPPER_RETURN_IF_INVALID(check_backward_dtypes(p, a, target));
  const Arg tensors[] = {
      {&p.q, "q", Access::kTma},
      {&p.k, "k", Access::kTma},
      {&p.v, "v", Access::kTma},
      {&p.out, "out", Access::kTma},
      {&p.dout, "dout", Access::kTma},
      {&p.lse, "lse", Access::kRows},
      {&p.dq, "dq", Access::kTma},
      {&p.dk, "dk", Access::kTma},
      {&p.dv, "dv", Access::kTma},
      {&p.cu_seqlens_q, "cu_seqlens_q", Access::kRows},
      {&p.cu_seqlens_k, "cu_seqlens_k", Access::kRows},
      {&p.seqused_q, "seqused_q", Access::kRows},
      {&p.seqused_k, "seqused_k", Access::kRows},
      {&p.learnable_sink, "learnable_sink", Access::kRows},
      {&p.dsink, "dsink", Access::kRows},
  };
  FLASHHOPPER_RETURN_IF_INVALID(check_tensors_extents(tensors, target));
  const ProblemShape shape = backward_shape(p);
  FLASHHOPPER_RETURN_IF_INVALID(check_backward_shapes(p, a, shape));
  FLASHHOPPER_RETURN_IF_INVALID(check_head_dims(a, shape, target));
  FLASHHOPPER_RETURN_IF_INVALID(check_tensors_layout(tensors, target));
  FLASHHOPPER_RETURN_IF_INVALID(check_dsink_not_aliased(p));
  const Arg gradients[] = {{&p.dq, "dq", Access::kTma}, {&p.dk, "dk", Access::kTma}, {&p.dv, "dv", Access::kTma}};
  const Arg inputs[] = {{&p.q, "q", Access::kTma},     {&p.k, "k", Access::kTma},       {&p.v, "v", Access::kTma},
                        {&p.out, "out", Access::kTma}, {&p.dout, "dout", Access::kTma}, {&p.lse, "lse", Access::kRows}};
  FLASHHOPPER_RETURN_IF_INVALID(check_outputs_not_aliased(gradients, inputs));
  if (target == Target::kKernel) {
    // The backward's main kernel walks key-row tiles; its pre/postprocessing walks query-row tiles.
    FLASHHOPPER_RETURN_IF_INVALID(check_tile_count(shape, "q", shape.seqlen_q, "query sequence length"));
    FLASHHOPPER_RETURN_IF_INVALID(check_tile_count(shape, "k", shape.seqlen_k, "key sequence length"));
  }
  return check_backward_scalars(p, a);
}

Status validate(const CombineParams& p, Target target) {
  const NamedTensor required[] = {
      {&p.out_partial, "out_partial"}, {&p.lse_partial, "lse_partial"}, {&p.out, "out"}};
  for (const auto& [tensor, name] : required) FLASHHOPPER_RETURN_IF_INVALID(require_present(*tensor, name));

  // Dense: out [B, sq, Hq, dv]. Varlen (out of rank 3): out [total_q, Hq, dv], and the partials
  // drop the batch dim: out_partial [num_splits, Hq, total_q, dv], lse_partial
  // [num_splits, Hq, total_q], lse [Hq, total_q].
  const bool varlen = p.out.ndim == 3;
  if (varlen) {
    const char* mode = "varlen (out of rank 3)";
    FLASHHOPPER_RETURN_IF_INVALID(
        check_rank(p.out_partial, "out_partial", {4, mode, "[num_splits, Hq, total_q, dv]"}));
    FLASHHOPPER_RETURN_IF_INVALID(check_rank(p.lse_partial, "lse_partial", {3, mode, "[num_splits, Hq, total_q]"}));
    if (present(p.lse)) FLASHHOPPER_RETURN_IF_INVALID(check_rank(p.lse, "lse", {2, mode, "[Hq, total_q]"}));
  } else {
    FLASHHOPPER_RETURN_IF_INVALID(check_rank(p.out, "out", {4, "", "[B, sq, Hq, dv] (or varlen [total_q, Hq, dv])"}));
    FLASHHOPPER_RETURN_IF_INVALID(check_rank(p.out_partial, "out_partial", {5, "", "[num_splits, B, Hq, sq, dv]"}));
    FLASHHOPPER_RETURN_IF_INVALID(check_rank(p.lse_partial, "lse_partial", {4, "", "[num_splits, B, Hq, sq]"}));
    if (present(p.lse)) FLASHHOPPER_RETURN_IF_INVALID(check_rank(p.lse, "lse", {3, "", "[B, Hq, sq]"}));
  }

  // The CPU reference also reads and writes float64 (its own partials, in double).
  const bool host = target == Target::kHostReference;
  DTypes out_dtypes{FH_DTYPE_BF16, FH_DTYPE_FP16, FH_DTYPE_FP32};
  DTypes lse_dtypes{FH_DTYPE_FP32};
  if (host) {
    out_dtypes.push_back(FH_DTYPE_FP64);
    lse_dtypes.push_back(FH_DTYPE_FP64);
  }
  FLASHHOPPER_RETURN_IF_INVALID(check_dtype(p.out_partial, "out_partial", lse_dtypes));
  FLASHHOPPER_RETURN_IF_INVALID(check_dtype(p.lse_partial, "lse_partial", lse_dtypes));
  FLASHHOPPER_RETURN_IF_INVALID(check_dtype(p.out, "out", out_dtypes));
  if (present(p.lse)) FLASHHOPPER_RETURN_IF_INVALID(check_dtype(p.lse, "lse", lse_dtypes));

  // The combine kernel reads and writes elements (SplitCombineKernel): no TMA alignment rules.
  const Arg tensors[] = {
      {&p.out_partial, "out_partial", Access::kRows},
      {&p.lse_partial, "lse_partial", Access::kRows},
      {&p.out, "out", Access::kRows},
      {&p.lse, "lse", Access::kRows},
  };
  FLASHHOPPER_RETURN_IF_INVALID(check_tensors_extents(tensors, target));

  // Everything is measured against out_partial: [num_splits, B, Hq, sq, dv], or
  // [num_splits, Hq, total_q, dv] when varlen.
  const int64_t* dims = p.out_partial.shape;
  const Extent splits{dims[0], "number of splits", "out_partial"};
  if (varlen) {
    const Extent heads{dims[1], "number of query heads", "out_partial"};
    const Extent tokens{dims[2], "total query tokens", "out_partial"};
    const Extent head_dim_v{dims[3], "value head dim", "out_partial"};
    FLASHHOPPER_RETURN_IF_INVALID(check_shape(p.lse_partial, "lse_partial", {splits, heads, tokens}));
    FLASHHOPPER_RETURN_IF_INVALID(check_shape(p.out, "out", {tokens, heads, head_dim_v}));
    if (present(p.lse)) FLASHHOPPER_RETURN_IF_INVALID(check_shape(p.lse, "lse", {heads, tokens}));
  } else {
    const Extent batch{dims[1], "batch size", "out_partial"};
    const Extent heads{dims[2], "number of query heads", "out_partial"};
    const Extent seqlen{dims[3], "query sequence length", "out_partial"};
    const Extent head_dim_v{dims[4], "value head dim", "out_partial"};
    FLASHHOPPER_RETURN_IF_INVALID(check_shape(p.lse_partial, "lse_partial", {splits, batch, heads, seqlen}));
    FLASHHOPPER_RETURN_IF_INVALID(check_shape(p.out, "out", {batch, seqlen, heads, head_dim_v}));
    if (present(p.lse)) FLASHHOPPER_RETURN_IF_INVALID(check_shape(p.lse, "lse", {batch, heads, seqlen}));
  }
  if (dims[0] > kMaxSplits) {
    return invalid("out_partial", "shape[0] (number of splits) is ", dims[0], "; must be in [1, ", kMaxSplits, "]");
  }
  return check_tensors_layout(tensors, target);
}

}  // namespace flashhopper::detail

#undef FLASHHOPPER_RETURN_IF_INVALID
