// CPU reference backward (reference.hpp): per query head, dQ, dK and dV over blocks of rows,
// and the GQA group sums of dK/dV in head order.
#include "reference/reference.hpp"

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <limits>
#include <mutex>
#include <string>
#include <utility>
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

}  // namespace

// ---- entry point -----------------------------------------------------------------------------

Status backward(const BackwardParams& p, const Options& options) {
  // The library's rules first (the one home of every argument rule); the checks below guard what
  // this code dereferences.
  FLASHHOPPER_REFERENCE_CHECK(flashhopper::detail::validate(p, flashhopper::detail::Target::kHostReference));
  const bool varlen_q = present(p.cu_seqlens_q);
  const bool varlen_k = present(p.cu_seqlens_k);
  for (const auto& [tensor, name] :
       {std::pair{&p.q, "q"}, {&p.k, "k"}, {&p.v, "v"}, {&p.dout, "dout"}, {&p.dq, "dq"}, {&p.dk, "dk"},
        {&p.dv, "dv"}, {&p.dsink, "dsink"}, {&p.cu_seqlens_q, "cu_seqlens_q"}, {&p.cu_seqlens_k, "cu_seqlens_k"},
        {&p.seqused_q, "seqused_q"}, {&p.seqused_k, "seqused_k"}}) {
    FLASHHOPPER_REFERENCE_CHECK(check_dereferenceable(*tensor, name));
  }

  BackwardPlan plan;
  plan.shape = flashhopper::detail::backward_shape(p);
  const ProblemShape& shape = plan.shape;
  const int64_t Hq = shape.heads_q;
  const int64_t d = shape.head_dim;

  LengthSources lengths{p.cu_seqlens_q, p.cu_seqlens_k, p.seqused_q, p.seqused_k, {}, {}, 0};
  FLASHHOPPER_REFERENCE_CHECK(sequence_lengths(shape, lengths, &plan.sequences));

  FLASHHOPPER_REFERENCE_CHECK(read_sinks(p.learnable_sink, Hq, &plan.sinks));
  plan.dsink = p.dsink;
  plan.mask = flashhopper::detail::mask_spec(p);
  plan.scale = flashhopper::detail::default_scale(p.softmax_scale, d);
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

}  // namespace flashhopper::reference
