// CPU reference forward (reference.hpp): the KV-cache append, rotary, fp8 descaling and
// split-KV partials around the per-head math of head_math.hpp.
#include "reference/reference.hpp"

#include <algorithm>
#include <array>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "plan/problem_shape.hpp"
#include "reference/arithmetic.hpp"
#include "api/validate.hpp"
#include "reference/checks.hpp"
#include "reference/head_math.hpp"
#include "reference/row_mask.hpp"
#include "reference/sequences.hpp"
#include "reference/tensor_access.hpp"
#include "reference/threads.hpp"

namespace flashhopper::reference {
using namespace detail;  // the internal helpers (reference::detail), unqualified below
namespace {

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
  rotary->rows_advance = flashhopper::detail::mask_spec(p).is_masked();
  rotary->offsets.resize(shape.batch);
  for (int64_t b = 0; b < shape.batch; ++b) {
    const int64_t offset = int_at(offsets, b);
    const int64_t capacity = sequences[b].row_capacity;  // q's rows (all are rotated)
    const int64_t rows = rotary->rows_advance ? capacity : std::min<int64_t>(1, capacity);
    const int64_t last = offset + std::max(sequences[b].new_keys, rows) - 1;
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

// Writes k_new/v_new (dense, or packed by cu_seqlens_k_new) into the cache at positions
// cache_seqlens[b].. of each sequence.
void append_new_keys(const ForwardPlan& plan, const ForwardParams& p) {
  const ProblemShape& shape = plan.shape;
  const auto layout = [&](const Tensor& t) {
    return shape.varlen_k_new ? TokenLayout::packed(t, p.cu_seqlens_k_new) : TokenLayout::dense(t);
  };
  const TokenLayout k_new = layout(p.k_new), v_new = layout(p.v_new);
  std::vector<double> row(std::max(shape.head_dim, shape.head_dim_v));
  for (int64_t b = 0; b < shape.batch; ++b) {
    const Sequence& seq = plan.sequences[b];
    // The layout counts tokens from the sequence's first key, cache_leftpad[b].
    const int64_t start = int_at(p.cache_seqlens, b) - (present(p.cache_leftpad) ? int_at(p.cache_leftpad, b) : 0);
    for (int64_t t = 0; t < seq.new_keys; ++t) {
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

}  // namespace

// ---- entry point -----------------------------------------------------------------------------

Status forward(const ForwardParams& p, const Options& options, const Tensor* out_partial,
               const Tensor* lse_partial) {
  // The library's rules first (the one home of every argument rule); the checks below guard what
  // this code dereferences.
  FLASHHOPPER_REFERENCE_CHECK(flashhopper::detail::validate(p, flashhopper::detail::Target::kHostReference));
  const bool varlen_q = present(p.cu_seqlens_q);
  const bool varlen_k = present(p.cu_seqlens_k);
  const bool paged = present(p.page_table);
  const bool append = present(p.k_new);
  for (const auto& [tensor, name] :
       {std::pair{&p.q, "q"}, {&p.k, "k"}, {&p.v, "v"}, {&p.out, "out"}, {&p.lse, "lse"}, {&p.qv, "qv"},
        {&p.k_new, "k_new"}, {&p.v_new, "v_new"}, {&p.cu_seqlens_q, "cu_seqlens_q"}, {&p.cu_seqlens_k, "cu_seqlens_k"},
        {&p.cu_seqlens_k_new, "cu_seqlens_k_new"}, {&p.page_table, "page_table"}, {&p.seqused_q, "seqused_q"},
        {&p.seqused_k, "seqused_k"}, {&p.cache_seqlens, "cache_seqlens"}, {&p.cache_batch_idx, "cache_batch_idx"},
        {&p.cache_leftpad, "cache_leftpad"}}) {
    FLASHHOPPER_REFERENCE_CHECK(check_dereferenceable(*tensor, name));
  }

  ForwardPlan plan;
  plan.shape = flashhopper::detail::forward_shape(p);
  const ProblemShape& shape = plan.shape;
  const int64_t B = shape.batch, Hq = shape.heads_q;
  const int64_t dv = shape.head_dim_v;
  if (present(p.qv)) {
    plan.qv = varlen_q ? TokenLayout::packed(p.qv, p.cu_seqlens_q) : TokenLayout::dense(p.qv);
    plan.has_qv = true;
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
  }

  LengthSources lengths{p.cu_seqlens_q,  p.cu_seqlens_k, p.seqused_q,       p.seqused_k,
                        p.cache_seqlens, p.page_table,   shape.seqlen_new, p.cache_batch_idx,
                        p.cache_leftpad, paged ? p.page_table.shape[0] : p.k.shape[0],
                        shape.varlen_k_new ? p.cu_seqlens_k_new : Tensor{}};
  FLASHHOPPER_REFERENCE_CHECK(sequence_lengths(shape, lengths, &plan.sequences));
  FLASHHOPPER_REFERENCE_CHECK(rotary_plan(p, shape, plan.sequences, &plan.rotary));
  FLASHHOPPER_REFERENCE_CHECK(read_descale(p, p.q_descale, "q_descale", shape, &plan.descale[0]));
  FLASHHOPPER_REFERENCE_CHECK(read_descale(p, p.k_descale, "k_descale", shape, &plan.descale[1]));
  FLASHHOPPER_REFERENCE_CHECK(read_descale(p, p.v_descale, "v_descale", shape, &plan.descale[2]));

  FLASHHOPPER_REFERENCE_CHECK(read_sinks(p.learnable_sink, Hq, &plan.sinks));
  plan.mask = flashhopper::detail::mask_spec(p);
  plan.scale = flashhopper::detail::forward_scale(p, shape);
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
  }
  if (!varlen_k || paged) {
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

}  // namespace flashhopper::reference
