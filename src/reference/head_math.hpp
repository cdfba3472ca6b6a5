// The math of one (batch, query head) that the forward and the backward share: the head's
// inputs, and a block of rows' scores, probabilities and output.
//
// Shape of the computation: one work item per (batch, query head). An item copies its
// sequence's Q, K, V (and dO) into contiguous arrays of the accumulation type, then walks the
// query rows a block at a time: scores of the block, softmax, output (and for the backward the
// gradients). Every row sees all of its keys at once, so there is no online softmax here: the
// maths reads as in the design page. Loops put contiguous keys (or head-dim elements)
// innermost so the compiler can vectorise them; summation order is fixed, so a result does not
// depend on the thread count.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "reference/row_mask.hpp"
#include "reference/sequences.hpp"

namespace flashhopper::reference::detail {

constexpr int64_t kBlockRows = 16;  // query rows whose scores are held at once

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
Acc sink_of(const std::vector<double>& sinks, int64_t h) {
  return sinks.empty() ? -std::numeric_limits<Acc>::infinity() : Acc(sinks[h]);
}

template <class Acc>
std::vector<Acc> transpose(const std::vector<Acc>& a, int64_t rows, int64_t cols) {
  std::vector<Acc> t(a.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) t[c * rows + r] = a[r * cols + c];
  return t;
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

}  // namespace flashhopper::reference::detail
