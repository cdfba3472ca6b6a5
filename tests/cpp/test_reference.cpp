// The CPU reference on its own: its backward against finite differences of its forward, and
// the identities that tie the features together (masks, chunks, learnable sinks, GQA, varlen,
// seqused, paged KV, appending, split-KV). Inputs are random (fixed seeds, one per test) and fp64
// unless a test is about low precision.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "flashhopper/flashhopper.hpp"
#include "plan/packed_decode.hpp"
#include "reference/reference.hpp"
#include "test_util.hpp"

namespace {

namespace fh = flashhopper;
namespace ref = flashhopper::reference;
using fh::test::HostTensor;
using fh::test::int32_tensor;
using fh::test::max_abs;
using fh::test::max_abs_diff;
using fh::test::narrow;
using fh::test::random_tensor;
using fh::test::round_to_bf16;
using fh::test::round_to_fp16;
using fh::test::sequence_view;
using fh::test::unsqueeze;

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kSameMaths = 1e-12;  // two routes to the same double-precision result

ref::Options one_thread() {
  ref::Options options;
  options.num_threads = 1;
  return options;
}

#define EXPECT_OK(expr)                           \
  do {                                            \
    const fh::Status status_ = (expr);            \
    EXPECT_TRUE(status_.ok()) << status_.message; \
  } while (0)
#define ASSERT_OK(expr)                           \
  do {                                            \
    const fh::Status status_ = (expr);            \
    ASSERT_TRUE(status_.ok()) << status_.message; \
  } while (0)

struct Mask {
  int causal = 0;
  int window_left = -1, window_right = -1;
  int sinks = 0;
  float softcap = 0;
  float scale = 0;
  int chunk = 0;  // attention_chunk
};

template <class Params>
void apply(const Mask& m, Params* p) {
  p->causal = m.causal;
  p->window_left = m.window_left;
  p->window_right = m.window_right;
  p->num_sink_tokens = m.sinks;
  p->softcap = m.softcap;
  p->softmax_scale = m.scale;
  p->attention_chunk = m.chunk;
}

Mask chunked(Mask m, int chunk) {
  m.chunk = chunk;
  return m;
}

// Learnable sink logits [Hq] in fp64, around 1.5 so that e^sigma weighs like a few keys.
HostTensor sink_logits(int64_t heads, uint32_t seed) {
  HostTensor sink = random_tensor(FH_DTYPE_FP64, {heads}, seed);
  for (int64_t h = 0; h < heads; ++h) sink.set({h}, sink.get({h}) + 1.5);
  return sink;
}

struct Dims {
  int64_t batch = 2, sq = 5, sk = 7, hq = 2, hkv = 2, d = 4, dv = 4;
};

// Dense q [B, sq, Hq, d], k/v [B, sk, Hkv, d|dv] with unit-normal entries, dO likewise, and
// fp64 outputs.
struct DenseCase {
  Dims n;
  HostTensor q, k, v, dout, out, lse, dq, dk, dv;

  DenseCase(const Dims& dims, uint32_t seed, int32_t dtype = FH_DTYPE_FP64)
      : n(dims),
        q(random_tensor(dtype, {n.batch, n.sq, n.hq, n.d}, seed)),
        k(random_tensor(dtype, {n.batch, n.sk, n.hkv, n.d}, seed + 1)),
        v(random_tensor(dtype, {n.batch, n.sk, n.hkv, n.dv}, seed + 2)),
        dout(random_tensor(FH_DTYPE_FP64, {n.batch, n.sq, n.hq, n.dv}, seed + 3)),
        out(FH_DTYPE_FP64, {n.batch, n.sq, n.hq, n.dv}),
        lse(FH_DTYPE_FP64, {n.batch, n.hq, n.sq}),
        dq(FH_DTYPE_FP64, {n.batch, n.sq, n.hq, n.d}),
        dk(FH_DTYPE_FP64, {n.batch, n.sk, n.hkv, n.d}),
        dv(FH_DTYPE_FP64, {n.batch, n.sk, n.hkv, n.dv}) {}

  fh::ForwardParams forward(const Mask& m = {}) const {
    fh::ForwardParams p = fh::default_forward_params();
    p.q = q.view();
    p.k = k.view();
    p.v = v.view();
    p.out = out.view();
    p.lse = lse.view();
    apply(m, &p);
    return p;
  }
  fh::BackwardParams backward(const Mask& m = {}) const {
    fh::BackwardParams p = fh::default_backward_params();
    p.q = q.view();
    p.k = k.view();
    p.v = v.view();
    p.dout = dout.view();
    p.dq = dq.view();
    p.dk = dk.view();
    p.dv = dv.view();
    apply(m, &p);
    return p;
  }
};

// Two masks that must mean the same: forward and backward of the same inputs (a, b seeded alike)
// under each give identical out, lse, dq, dk and dv.
void expect_same_results(const DenseCase& a, const Mask& mask_a, const DenseCase& b, const Mask& mask_b) {
  ASSERT_OK(ref::forward(a.forward(mask_a)));
  ASSERT_OK(ref::forward(b.forward(mask_b)));
  EXPECT_EQ(max_abs_diff(a.out.view(), b.out.view()), 0);
  EXPECT_EQ(max_abs_diff(a.lse.view(), b.lse.view()), 0);
  ASSERT_OK(ref::backward(a.backward(mask_a)));
  ASSERT_OK(ref::backward(b.backward(mask_b)));
  EXPECT_EQ(max_abs_diff(a.dq.view(), b.dq.view()), 0);
  EXPECT_EQ(max_abs_diff(a.dk.view(), b.dk.view()), 0);
  EXPECT_EQ(max_abs_diff(a.dv.view(), b.dv.view()), 0);
}

// Packed q [total_q, Hq, d], k/v [total_k, Hkv, d|dv] with cu_seqlens.
struct VarlenCase {
  std::vector<int32_t> cu_q, cu_k;
  int64_t hq, hkv, d, dv_dim;
  HostTensor cu_q_tensor, cu_k_tensor, q, k, v, dout, out, lse, dq, dk, dv;

  VarlenCase(std::vector<int32_t> cu_seqlens_q, std::vector<int32_t> cu_seqlens_k, int64_t heads_q,
             int64_t heads_kv, int64_t head_dim, int64_t head_dim_v, uint32_t seed)
      : cu_q(std::move(cu_seqlens_q)),
        cu_k(std::move(cu_seqlens_k)),
        hq(heads_q),
        hkv(heads_kv),
        d(head_dim),
        dv_dim(head_dim_v),
        cu_q_tensor(int32_tensor(cu_q)),
        cu_k_tensor(int32_tensor(cu_k)),
        q(random_tensor(FH_DTYPE_FP64, {cu_q.back(), hq, d}, seed)),
        k(random_tensor(FH_DTYPE_FP64, {cu_k.back(), hkv, d}, seed + 1)),
        v(random_tensor(FH_DTYPE_FP64, {cu_k.back(), hkv, dv_dim}, seed + 2)),
        dout(random_tensor(FH_DTYPE_FP64, {cu_q.back(), hq, dv_dim}, seed + 3)),
        out(FH_DTYPE_FP64, {cu_q.back(), hq, dv_dim}),
        lse(FH_DTYPE_FP64, {hq, cu_q.back()}),
        dq(FH_DTYPE_FP64, {cu_q.back(), hq, d}),
        dk(FH_DTYPE_FP64, {cu_k.back(), hkv, d}),
        dv(FH_DTYPE_FP64, {cu_k.back(), hkv, dv_dim}) {}

  int64_t batch() const { return int64_t(cu_q.size()) - 1; }
  int32_t max_len(const std::vector<int32_t>& cu) const {
    int32_t m = 0;
    for (size_t b = 0; b + 1 < cu.size(); ++b) m = std::max(m, cu[b + 1] - cu[b]);
    return m;
  }

  fh::ForwardParams forward(const Mask& m = {}) const {
    fh::ForwardParams p = fh::default_forward_params();
    p.q = q.view();
    p.k = k.view();
    p.v = v.view();
    p.out = out.view();
    p.lse = lse.view();
    p.cu_seqlens_q = cu_q_tensor.view();
    p.cu_seqlens_k = cu_k_tensor.view();
    p.max_seqlen_q = max_len(cu_q);
    p.max_seqlen_k = max_len(cu_k);
    apply(m, &p);
    return p;
  }
  fh::BackwardParams backward(const Mask& m = {}) const {
    fh::BackwardParams p = fh::default_backward_params();
    p.q = q.view();
    p.k = k.view();
    p.v = v.view();
    p.dout = dout.view();
    p.dq = dq.view();
    p.dk = dk.view();
    p.dv = dv.view();
    p.cu_seqlens_q = cu_q_tensor.view();
    p.cu_seqlens_k = cu_k_tensor.view();
    p.max_seqlen_q = max_len(cu_q);
    p.max_seqlen_k = max_len(cu_k);
    apply(m, &p);
    return p;
  }
};

// ---- finite differences --------------------------------------------------------------------

// loss = sum(O * dO) of the forward `params` (whose out is `out`).
double loss(const fh::ForwardParams& params, const fh::Tensor& dout) {
  const fh::Status status = ref::forward(params, one_thread());
  EXPECT_TRUE(status.ok()) << status.message;
  double sum = 0;
  fh::test::for_each_index(fh::test::shape_of(params.out), [&](const std::vector<int64_t>& i) {
    sum += fh::test::read(params.out, i) * fh::test::read(dout, i);
  });
  return sum;
}

// Every element of dq, dk, dv against the central difference of the loss in q, k, v.
void expect_backward_matches_finite_differences(const fh::ForwardParams& forward,
                                                const fh::BackwardParams& backward,
                                                const std::vector<HostTensor*>& inputs,
                                                const fh::Tensor& dout) {
  ASSERT_OK(ref::backward(backward, one_thread()));
  const fh::Tensor grads[3] = {backward.dq, backward.dk, backward.dv};
  const char* names[3] = {"dq", "dk", "dv"};
  constexpr double h = 1e-5;
  for (int t = 0; t < 3; ++t) {
    HostTensor& x = *inputs[t];
    double worst = 0;
    fh::test::for_each_index(x.shape(), [&](const std::vector<int64_t>& i) {
      const double x0 = x.get(i);
      x.set(i, x0 + h);
      const double up = loss(forward, dout);
      x.set(i, x0 - h);
      const double down = loss(forward, dout);
      x.set(i, x0);
      const double numeric = (up - down) / (2 * h);
      const double analytic = fh::test::read(grads[t], i);
      worst = std::max(worst, std::fabs(numeric - analytic) / (1 + std::fabs(numeric)));
    });
    EXPECT_LT(worst, 1e-7) << names[t];
    EXPECT_GT(max_abs(grads[t]), 1e-2) << names[t] << " is (nearly) all zero: nothing was tested";
    EXPECT_FALSE(fh::test::has_nan(grads[t])) << names[t];
  }
}

void check_dense_gradients(const Dims& dims, const Mask& mask, uint32_t seed) {
  DenseCase c(dims, seed);
  expect_backward_matches_finite_differences(c.forward(mask), c.backward(mask), {&c.q, &c.k, &c.v},
                                             c.dout.view());
}

// dq/dk/dv and dsink with a learnable sink, each against the central difference of the loss.
void check_sink_gradients(const Dims& dims, const Mask& mask, uint32_t seed) {
  DenseCase c(dims, seed);
  HostTensor sink = sink_logits(dims.hq, seed + 7);
  HostTensor dsink(FH_DTYPE_FP64, {dims.hq});
  fh::ForwardParams f = c.forward(mask);
  f.learnable_sink = sink.view();
  fh::BackwardParams g = c.backward(mask);
  g.learnable_sink = sink.view();
  g.dsink = dsink.view();
  expect_backward_matches_finite_differences(f, g, {&c.q, &c.k, &c.v}, c.dout.view());

  constexpr double h = 1e-5;
  double worst = 0;
  for (int64_t head = 0; head < dims.hq; ++head) {
    const double x0 = sink.get({head});
    sink.set({head}, x0 + h);
    const double up = loss(f, c.dout.view());
    sink.set({head}, x0 - h);
    const double down = loss(f, c.dout.view());
    sink.set({head}, x0);
    const double numeric = (up - down) / (2 * h);
    worst = std::max(worst, std::fabs(numeric - dsink.get({head})) / (1 + std::fabs(numeric)));
  }
  EXPECT_LT(worst, 1e-7) << "dsink";
  EXPECT_GT(max_abs(dsink.view()), 1e-2) << "dsink is (nearly) all zero: nothing was tested";
  EXPECT_FALSE(fh::test::has_nan(dsink.view()));
}

TEST(ReferenceGradients, Plain) { check_dense_gradients(Dims{}, Mask{}, 101); }

TEST(ReferenceGradients, CausalMoreKeysThanQueries) {
  check_dense_gradients(Dims{2, 4, 7, 2, 2, 4, 4}, Mask{1}, 111);
}

TEST(ReferenceGradients, CausalMoreQueriesThanKeys) {  // the first rows see no key
  check_dense_gradients(Dims{2, 7, 4, 2, 2, 4, 4}, Mask{1}, 121);
}

TEST(ReferenceGradients, LocalWindowWithSinks) {
  Mask mask;
  mask.window_left = 2;
  mask.window_right = 1;
  mask.sinks = 2;
  check_dense_gradients(Dims{2, 6, 9, 2, 2, 4, 4}, mask, 131);
}

TEST(ReferenceGradients, Softcap) {
  Mask mask;
  mask.softcap = 1.5f;
  mask.scale = 1.0f;  // scores of a few units, so tanh is far from linear
  check_dense_gradients(Dims{}, mask, 141);
}

TEST(ReferenceGradients, GroupedQueryAttention) {
  check_dense_gradients(Dims{2, 5, 6, 6, 2, 4, 4}, Mask{1}, 151);
}

TEST(ReferenceGradients, HeadDimVDiffersFromHeadDim) {
  check_dense_gradients(Dims{2, 5, 7, 2, 1, 4, 6}, Mask{}, 161);
}

TEST(ReferenceGradients, AttentionChunk) {
  check_dense_gradients(Dims{2, 6, 9, 2, 2, 4, 4}, chunked(Mask{}, 3), 181);
}

TEST(ReferenceGradients, AttentionChunkCausalWithWindowAndSinkTokens) {
  check_dense_gradients(Dims{2, 6, 9, 2, 2, 4, 4}, chunked(Mask{1}, 4), 183);
  check_dense_gradients(Dims{2, 6, 9, 2, 2, 4, 4}, chunked(Mask{0, 2, 1, 2}, 4), 185);
}

TEST(ReferenceGradients, LearnableSink) {
  check_sink_gradients(Dims{2, 5, 7, 3, 1, 4, 4}, Mask{}, 191);
}

TEST(ReferenceGradients, LearnableSinkCausalWithBlindRows) {  // sq > sk: the first rows see no key
  check_sink_gradients(Dims{2, 7, 4, 2, 2, 4, 4}, Mask{1}, 193);
}

TEST(ReferenceGradients, LearnableSinkWithAttentionChunk) {
  check_sink_gradients(Dims{2, 6, 9, 4, 2, 4, 5}, chunked(Mask{}, 4), 195);
  check_sink_gradients(Dims{2, 8, 6, 2, 1, 4, 4}, chunked(Mask{1}, 3), 197);  // rows with p < 0
}

TEST(ReferenceGradients, Varlen) {
  VarlenCase c({0, 3, 7, 12}, {0, 5, 6, 13}, 4, 2, 4, 5, 171);
  Mask mask;
  mask.causal = 1;
  expect_backward_matches_finite_differences(c.forward(mask), c.backward(mask), {&c.q, &c.k, &c.v},
                                             c.dout.view());
}

// ---- identities ----------------------------------------------------------------------------

TEST(ReferenceIdentities, CausalIsWindowMinusOneZero) {
  for (Dims dims : {Dims{2, 5, 9, 2, 1, 8, 8}, Dims{2, 9, 5, 2, 1, 8, 8}}) {
    DenseCase a(dims, 201), b(dims, 201);
    Mask causal;
    causal.causal = 1;
    Mask window;
    window.window_left = -1;
    window.window_right = 0;
    ASSERT_NO_FATAL_FAILURE(expect_same_results(a, causal, b, window));
  }
}

// GQA equals plain multi-head attention with each K/V head repeated for its group; dK/dV of a
// key head are the sums of the repeated heads' gradients.
TEST(ReferenceIdentities, GroupedQueryAttentionIsRepeatedHeads) {
  const Dims gqa{2, 6, 8, 6, 2, 8, 5};
  Dims mha = gqa;
  mha.hkv = gqa.hq;
  const int64_t group = gqa.hq / gqa.hkv;
  DenseCase g(gqa, 211), m(mha, 211);
  for (int64_t b = 0; b < gqa.batch; ++b)
    for (int64_t j = 0; j < gqa.sk; ++j)
      for (int64_t h = 0; h < gqa.hq; ++h) {
        for (int64_t c = 0; c < gqa.d; ++c) m.k.set({b, j, h, c}, g.k.get({b, j, h / group, c}));
        for (int64_t c = 0; c < gqa.dv; ++c) m.v.set({b, j, h, c}, g.v.get({b, j, h / group, c}));
      }
  Mask mask;
  mask.window_left = 3;
  mask.window_right = 1;
  ASSERT_OK(ref::forward(g.forward(mask)));
  ASSERT_OK(ref::forward(m.forward(mask)));
  EXPECT_LE(max_abs_diff(g.out.view(), m.out.view()), kSameMaths);
  EXPECT_LE(max_abs_diff(g.lse.view(), m.lse.view()), kSameMaths);
  ASSERT_OK(ref::backward(g.backward(mask)));
  ASSERT_OK(ref::backward(m.backward(mask)));
  EXPECT_LE(max_abs_diff(g.dq.view(), m.dq.view()), kSameMaths);
  HostTensor dk_sum(FH_DTYPE_FP64, {gqa.batch, gqa.sk, gqa.hkv, gqa.d});
  HostTensor dv_sum(FH_DTYPE_FP64, {gqa.batch, gqa.sk, gqa.hkv, gqa.dv});
  for (int64_t b = 0; b < gqa.batch; ++b)
    for (int64_t j = 0; j < gqa.sk; ++j)
      for (int64_t h = 0; h < gqa.hq; ++h) {
        for (int64_t c = 0; c < gqa.d; ++c)
          dk_sum.set({b, j, h / group, c},
                     dk_sum.get({b, j, h / group, c}) + m.dk.get({b, j, h, c}));
        for (int64_t c = 0; c < gqa.dv; ++c)
          dv_sum.set({b, j, h / group, c},
                     dv_sum.get({b, j, h / group, c}) + m.dv.get({b, j, h, c}));
      }
  EXPECT_LE(max_abs_diff(g.dk.view(), dk_sum.view()), kSameMaths);
  EXPECT_LE(max_abs_diff(g.dv.view(), dv_sum.view()), kSameMaths);
}

// A packed batch equals one dense call per sequence on views of the same memory.
TEST(ReferenceIdentities, VarlenIsDensePerSequence) {
  VarlenCase c({0, 4, 4, 11, 14}, {0, 6, 9, 12, 20}, 4, 2, 8, 6, 221);
  Mask mask;
  mask.window_left = 2;
  mask.window_right = 0;
  mask.sinks = 1;
  ASSERT_OK(ref::forward(c.forward(mask)));
  ASSERT_OK(ref::backward(c.backward(mask)));
  for (int64_t b = 0; b < c.batch(); ++b) {
    const int64_t q0 = c.cu_q[b], sq = c.cu_q[b + 1] - q0;
    const int64_t k0 = c.cu_k[b], sk = c.cu_k[b + 1] - k0;
    HostTensor out(FH_DTYPE_FP64, {1, sq, c.hq, c.dv_dim}), lse(FH_DTYPE_FP64, {1, c.hq, sq});
    HostTensor dq(FH_DTYPE_FP64, {1, sq, c.hq, c.d}), dk(FH_DTYPE_FP64, {1, sk, c.hkv, c.d});
    HostTensor dv(FH_DTYPE_FP64, {1, sk, c.hkv, c.dv_dim});
    fh::ForwardParams f = fh::default_forward_params();
    f.q = sequence_view(c.q.view(), q0, sq);
    f.k = sequence_view(c.k.view(), k0, sk);
    f.v = sequence_view(c.v.view(), k0, sk);
    f.out = out.view();
    f.lse = lse.view();
    apply(mask, &f);
    ASSERT_OK(ref::forward(f));
    EXPECT_EQ(max_abs_diff(out.view(), sequence_view(c.out.view(), q0, sq)), 0) << "sequence " << b;
    EXPECT_EQ(max_abs_diff(lse.view(), unsqueeze(narrow(c.lse.view(), 1, q0, sq), 0)), 0);
    fh::BackwardParams g = fh::default_backward_params();
    g.q = f.q;
    g.k = f.k;
    g.v = f.v;
    g.dout = sequence_view(c.dout.view(), q0, sq);
    g.dq = dq.view();
    g.dk = dk.view();
    g.dv = dv.view();
    apply(mask, &g);
    ASSERT_OK(ref::backward(g));
    EXPECT_EQ(max_abs_diff(dq.view(), sequence_view(c.dq.view(), q0, sq)), 0) << "sequence " << b;
    EXPECT_EQ(max_abs_diff(dk.view(), sequence_view(c.dk.view(), k0, sk)), 0) << "sequence " << b;
    EXPECT_EQ(max_abs_diff(dv.view(), sequence_view(c.dv.view(), k0, sk)), 0) << "sequence " << b;
  }
}

// seqused_q/k equal a call on the truncated sequences; rows past seqused_q get O = 0,
// LSE = -inf and dQ = 0, keys past seqused_k dK = dV = 0.
TEST(ReferenceIdentities, SequsedIsTruncatedCall) {
  const Dims dims{3, 6, 8, 2, 1, 8, 8};
  DenseCase c(dims, 231);
  const std::vector<int32_t> used_q = {6, 3, 4}, used_k = {8, 5, 0};
  const HostTensor seqused_q = int32_tensor(used_q), seqused_k = int32_tensor(used_k);
  constexpr double kSentinel = 42;
  for (HostTensor* t : {&c.out, &c.lse, &c.dq, &c.dk, &c.dv}) t->fill(kSentinel);
  Mask mask;
  mask.causal = 1;
  fh::ForwardParams f = c.forward(mask);
  f.seqused_q = seqused_q.view();
  f.seqused_k = seqused_k.view();
  ASSERT_OK(ref::forward(f));
  fh::BackwardParams g = c.backward(mask);
  g.seqused_q = seqused_q.view();
  g.seqused_k = seqused_k.view();
  ASSERT_OK(ref::backward(g));

  for (int64_t b = 0; b < dims.batch; ++b) {
    const int64_t sq = used_q[b], sk = used_k[b];
    auto rows = [&](const HostTensor& t, int64_t n) {
      return narrow(narrow(t.view(), 0, b, 1), 1, 0, n);
    };
    auto rows_after = [&](const HostTensor& t, int64_t n, int64_t extent) {
      return narrow(narrow(t.view(), 0, b, 1), 1, n, extent - n);
    };
    HostTensor out(FH_DTYPE_FP64, {1, sq, dims.hq, dims.dv}), lse(FH_DTYPE_FP64, {1, dims.hq, sq});
    HostTensor dq(FH_DTYPE_FP64, {1, sq, dims.hq, dims.d}),
        dk(FH_DTYPE_FP64, {1, sk, dims.hkv, dims.d});
    HostTensor dv(FH_DTYPE_FP64, {1, sk, dims.hkv, dims.dv});
    fh::ForwardParams fb = fh::default_forward_params();
    fb.q = rows(c.q, sq);
    fb.k = rows(c.k, sk);
    fb.v = rows(c.v, sk);
    fb.out = out.view();
    fb.lse = lse.view();
    apply(mask, &fb);
    ASSERT_OK(ref::forward(fb));
    EXPECT_EQ(max_abs_diff(out.view(), rows(c.out, sq)), 0) << "sequence " << b;
    EXPECT_EQ(max_abs_diff(lse.view(), narrow(narrow(c.lse.view(), 0, b, 1), 2, 0, sq)), 0);
    EXPECT_EQ(max_abs(rows_after(c.out, sq, dims.sq)), 0) << "rows past seqused_q";
    for (int64_t i = sq; i < dims.sq; ++i) EXPECT_EQ(c.lse.get({b, 0, i}), -kInf) << "row " << i;
    fh::BackwardParams gb = fh::default_backward_params();
    gb.q = fb.q;
    gb.k = fb.k;
    gb.v = fb.v;
    gb.dout = rows(c.dout, sq);
    gb.dq = dq.view();
    gb.dk = dk.view();
    gb.dv = dv.view();
    apply(mask, &gb);
    ASSERT_OK(ref::backward(gb));
    EXPECT_EQ(max_abs_diff(dq.view(), rows(c.dq, sq)), 0) << "sequence " << b;
    EXPECT_EQ(max_abs_diff(dk.view(), rows(c.dk, sk)), 0) << "sequence " << b;
    EXPECT_EQ(max_abs_diff(dv.view(), rows(c.dv, sk)), 0) << "sequence " << b;
    EXPECT_EQ(max_abs(rows_after(c.dq, sq, dims.sq)), 0);
    EXPECT_EQ(max_abs(rows_after(c.dk, sk, dims.sk)), 0);
    EXPECT_EQ(max_abs(rows_after(c.dv, sk, dims.sk)), 0);
  }
  // Sequence 2 has no keys: its rows see nothing.
  EXPECT_EQ(max_abs(narrow(narrow(c.out.view(), 0, 2, 1), 1, 0, 4)), 0);
  EXPECT_EQ(c.lse.get({2, 0, 0}), -kInf);
}

// A paged cache [num_pages, page_size, Hkv, d]: copies a dense cache [B, max_pages*page_size,
// Hkv, d] page by page into randomly permuted pages; entries past a sequence's pages are -1.
struct PagedCache {
  HostTensor k, v, page_table;
  PagedCache(const HostTensor& dense_k, const HostTensor& dense_v,
             const std::vector<int32_t>& lengths, int64_t page_size, int64_t num_pages,
             uint32_t seed) {
    const std::vector<int64_t>& ks = dense_k.shape();
    const int64_t batch = ks[0], max_pages = ks[1] / page_size, heads = ks[2];
    const int64_t d = ks[3], dv = dense_v.shape()[3];
    k = random_tensor(dense_k.dtype(), {num_pages, page_size, heads, d},
                      seed);  // unused pages: noise
    v = random_tensor(dense_v.dtype(), {num_pages, page_size, heads, dv}, seed + 1);
    std::vector<int32_t> pages(num_pages);
    std::iota(pages.begin(), pages.end(), 0);
    std::shuffle(pages.begin(), pages.end(), std::mt19937(seed + 2));
    std::vector<int32_t> table(batch * max_pages, -1);
    int next = 0;
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t used_pages = (lengths[b] + page_size - 1) / page_size;
      for (int64_t p = 0; p < used_pages; ++p) {
        const int32_t page = pages[next++];
        table[b * max_pages + p] = page;
        for (int64_t t = 0; t < page_size; ++t)
          for (int64_t h = 0; h < heads; ++h) {
            for (int64_t c = 0; c < d; ++c)
              k.set({page, t, h, c}, dense_k.get({b, p * page_size + t, h, c}));
            for (int64_t c = 0; c < dv; ++c)
              v.set({page, t, h, c}, dense_v.get({b, p * page_size + t, h, c}));
          }
      }
    }
    page_table = int32_tensor(table, {batch, max_pages});
  }
};

TEST(ReferenceIdentities, PagedIsContiguous) {
  const Dims dims{2, 3, 12, 4, 2, 8, 6};
  DenseCase dense(dims, 241), paged(dims, 241);
  const std::vector<int32_t> lengths = {9, 5};
  const HostTensor cache_seqlens = int32_tensor(lengths);
  const PagedCache cache(dense.k, dense.v, lengths, /*page_size=*/4, /*num_pages=*/8, 245);
  Mask mask;
  mask.causal = 1;
  fh::ForwardParams f = dense.forward(mask);
  f.seqused_k = cache_seqlens.view();
  ASSERT_OK(ref::forward(f));
  fh::ForwardParams p = paged.forward(mask);
  p.k = cache.k.view();
  p.v = cache.v.view();
  p.page_table = cache.page_table.view();
  p.cache_seqlens = cache_seqlens.view();
  ASSERT_OK(ref::forward(p));
  EXPECT_EQ(max_abs_diff(dense.out.view(), paged.out.view()), 0);
  EXPECT_EQ(max_abs_diff(dense.lse.view(), paged.lse.view()), 0);
}

// Appending k_new/v_new at cache_seqlens, into a dense or a paged cache, equals attending over
// a contiguous copy with the new keys written after each sequence's cached ones; and the cache
// holds them afterwards.
TEST(ReferenceIdentities, AppendIsConcatenation) {
  const Dims dims{2, 3, 12, 4, 2, 8, 6};
  const int64_t s_new = dims.sq;
  const std::vector<int32_t> cached = {4, 9};
  std::vector<int32_t> total(cached.size());
  for (size_t b = 0; b < cached.size(); ++b) total[b] = cached[b] + int32_t(s_new);
  const HostTensor cache_seqlens = int32_tensor(cached), seqused_k = int32_tensor(total);
  const HostTensor k_new = random_tensor(FH_DTYPE_FP64, {dims.batch, s_new, dims.hkv, dims.d}, 251);
  const HostTensor v_new =
      random_tensor(FH_DTYPE_FP64, {dims.batch, s_new, dims.hkv, dims.dv}, 252);
  Mask mask;
  mask.causal = 1;

  // Expected: the new keys written by hand, then a plain call over seqused_k = cached + new.
  DenseCase expected(dims, 253);
  for (int64_t b = 0; b < dims.batch; ++b)
    for (int64_t t = 0; t < s_new; ++t)
      for (int64_t h = 0; h < dims.hkv; ++h) {
        for (int64_t c = 0; c < dims.d; ++c)
          expected.k.set({b, cached[b] + t, h, c}, k_new.get({b, t, h, c}));
        for (int64_t c = 0; c < dims.dv; ++c)
          expected.v.set({b, cached[b] + t, h, c}, v_new.get({b, t, h, c}));
      }
  fh::ForwardParams e = expected.forward(mask);
  e.seqused_k = seqused_k.view();
  ASSERT_OK(ref::forward(e));

  {  // dense cache
    DenseCase c(dims, 253);
    fh::ForwardParams p = c.forward(mask);
    p.k_new = k_new.view();
    p.v_new = v_new.view();
    p.cache_seqlens = cache_seqlens.view();
    ASSERT_OK(ref::forward(p));
    EXPECT_EQ(max_abs_diff(c.out.view(), expected.out.view()), 0);
    EXPECT_EQ(max_abs_diff(c.lse.view(), expected.lse.view()), 0);
    EXPECT_EQ(max_abs_diff(c.k.view(), expected.k.view()), 0) << "the cache holds the new keys";
    EXPECT_EQ(max_abs_diff(c.v.view(), expected.v.view()), 0);
  }
  {  // paged cache, built from the cache before appending
    DenseCase c(dims, 253);
    PagedCache cache(c.k, c.v, total, /*page_size=*/4, /*num_pages=*/9, 255);
    fh::ForwardParams p = c.forward(mask);
    p.k = cache.k.view();
    p.v = cache.v.view();
    p.page_table = cache.page_table.view();
    p.k_new = k_new.view();
    p.v_new = v_new.view();
    p.cache_seqlens = cache_seqlens.view();
    ASSERT_OK(ref::forward(p));
    EXPECT_EQ(max_abs_diff(c.out.view(), expected.out.view()), 0);
    EXPECT_EQ(max_abs_diff(c.lse.view(), expected.lse.view()), 0);
    const PagedCache expected_cache(expected.k, expected.v, total, 4, 9, 255);
    for (int64_t b = 0; b < dims.batch; ++b)
      for (int64_t j = 0; j < total[b]; ++j) {
        const int64_t page = int64_t(cache.page_table.get({b, j / 4}));
        for (int64_t c2 = 0; c2 < dims.d; ++c2)
          ASSERT_EQ(cache.k.get({page, j % 4, 0, c2}), expected.k.get({b, j, 0, c2}))
              << b << " " << j;
      }
  }
}

// A negative cache_seqlens is refused before the append, which would write before the sequence's
// first key (dense) or read page_table[b, -1] (paged); the cache is left as it was.
TEST(ReferenceErrors, NegativeCacheSeqlensRefusedWithoutWriting) {
  const Dims dims{2, 3, 12, 4, 2, 8, 6};
  const HostTensor cache_seqlens = int32_tensor({-1, 9});
  const HostTensor k_new = random_tensor(FH_DTYPE_FP64, {dims.batch, dims.sq, dims.hkv, dims.d}, 261);
  const HostTensor v_new = random_tensor(FH_DTYPE_FP64, {dims.batch, dims.sq, dims.hkv, dims.dv}, 262);
  DenseCase c(dims, 263), untouched(dims, 263);
  fh::ForwardParams p = c.forward();
  p.k_new = k_new.view();
  p.v_new = v_new.view();
  p.cache_seqlens = cache_seqlens.view();
  const fh::Status status = ref::forward(p);
  EXPECT_EQ(status.code, FH_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(status.message.find("cache_seqlens[0] = -1 is negative"), std::string::npos) << status.message;
  EXPECT_EQ(max_abs_diff(c.k.view(), untouched.k.view()), 0);
  EXPECT_EQ(max_abs_diff(c.v.view(), untouched.v.view()), 0);
}

// Negative extents and a head dim of 0 are refused with a Status (no exception, no undefined
// behaviour), before anything is sized or written. (Empty sequences, extent 0, stay allowed.)
TEST(ReferenceErrors, BadExtentsRefused) {
  std::vector<double> buffer(4096, 0.0);
  const std::vector<std::vector<int64_t>> shapes = {{1, -3, 2, 8}, {1, 4, 2, 0}, {-1, 4, 2, 8}};
  for (const std::vector<int64_t>& q : shapes) {
    fh::ForwardParams p = fh::default_forward_params();
    p.q = fh::make_tensor(buffer.data(), FH_DTYPE_FP64, {q[0], q[1], q[2], q[3]});
    p.k = fh::make_tensor(buffer.data(), FH_DTYPE_FP64, {1, 4, 2, q[3]});
    p.v = fh::make_tensor(buffer.data(), FH_DTYPE_FP64, {1, 4, 2, q[3]});
    p.out = fh::make_tensor(buffer.data(), FH_DTYPE_FP64, {q[0], q[1], q[2], q[3]});
    const fh::Status status = ref::forward(p);
    EXPECT_EQ(status.code, FH_ERROR_INVALID_ARGUMENT);
    const bool named = status.message.find("must not be negative") != std::string::npos ||
                       status.message.find("head dims (0, 0) must be at least 1") != std::string::npos;
    EXPECT_TRUE(named) << status.message;
  }
}

// A data pointer not aligned to its elements is refused (the reference would load and store
// misaligned doubles; found by tests/fuzz).
TEST(ReferenceErrors, MisalignedPointerRefused) {
  DenseCase c(Dims{}, 271);
  fh::ForwardParams p = c.forward();
  p.out.data = static_cast<char*>(p.out.data) + 3;
  const fh::Status status = ref::forward(p);
  EXPECT_EQ(status.code, FH_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(status.message.find("out's data pointer is not aligned"), std::string::npos) << status.message;
}

// Split-KV partials combined equal the unsplit result, including splits that see no key for
// some rows (causal) and an empty last split.
TEST(ReferenceIdentities, CombinedSplitsAreUnsplit) {
  const Dims dims{2, 6, 11, 4, 2, 8, 6};
  for (int num_splits : {2, 3, 5}) {
    DenseCase whole(dims, 261), parts(dims, 261);
    Mask mask;
    mask.causal = 1;
    ASSERT_OK(ref::forward(whole.forward(mask)));
    HostTensor out_partial(FH_DTYPE_FP64, {num_splits, dims.batch, dims.hq, dims.sq, dims.dv});
    HostTensor lse_partial(FH_DTYPE_FP64, {num_splits, dims.batch, dims.hq, dims.sq});
    fh::ForwardParams p = parts.forward(mask);
    p.num_splits = num_splits;
    const fh::Tensor op = out_partial.view(), lp = lse_partial.view();
    ASSERT_OK(ref::forward(p, {}, &op, &lp));
    EXPECT_EQ(max_abs(parts.out.view()), 0) << "out is left to the combine";
    fh::CombineParams c{};
    c.out_partial = op;
    c.lse_partial = lp;
    c.out = parts.out.view();
    c.lse = parts.lse.view();
    ASSERT_OK(ref::combine(c));
    EXPECT_LE(max_abs_diff(parts.out.view(), whole.out.view()), kSameMaths) << num_splits;
    EXPECT_LE(max_abs_diff(parts.lse.view(), whole.lse.view()), kSameMaths) << num_splits;
  }
  {  // varlen: partials [S, Hq, total_q, dv]
    VarlenCase whole({0, 5, 7}, {0, 9, 19}, 2, 1, 8, 8, 265),
        parts({0, 5, 7}, {0, 9, 19}, 2, 1, 8, 8, 265);
    ASSERT_OK(ref::forward(whole.forward()));
    const int64_t S = 3, total_q = 7;
    HostTensor out_partial(FH_DTYPE_FP64, {S, 2, total_q, 8}),
        lse_partial(FH_DTYPE_FP64, {S, 2, total_q});
    fh::ForwardParams p = parts.forward();
    p.num_splits = S;
    const fh::Tensor op = out_partial.view(), lp = lse_partial.view();
    ASSERT_OK(ref::forward(p, {}, &op, &lp));
    fh::CombineParams c{};
    c.out_partial = op;
    c.lse_partial = lp;
    c.out = parts.out.view();
    c.lse = parts.lse.view();
    ASSERT_OK(ref::combine(c));
    EXPECT_LE(max_abs_diff(parts.out.view(), whole.out.view()), kSameMaths);
    EXPECT_LE(max_abs_diff(parts.lse.view(), whole.lse.view()), kSameMaths);
  }
}

TEST(ReferenceIdentities, HugeSoftcapIsNoSoftcap) {
  const Dims dims{2, 6, 9, 4, 2, 8, 8};
  DenseCase capped(dims, 271), plain(dims, 271);
  Mask mask;
  mask.softcap = 1e30f;
  ASSERT_OK(ref::forward(capped.forward(mask)));
  ASSERT_OK(ref::forward(plain.forward()));
  EXPECT_LE(max_abs_diff(capped.out.view(), plain.out.view()), kSameMaths);
  EXPECT_LE(max_abs_diff(capped.lse.view(), plain.lse.view()), kSameMaths);
  ASSERT_OK(ref::backward(capped.backward(mask)));
  ASSERT_OK(ref::backward(plain.backward()));
  EXPECT_LE(max_abs_diff(capped.dq.view(), plain.dq.view()), kSameMaths);
  EXPECT_LE(max_abs_diff(capped.dk.view(), plain.dk.view()), kSameMaths);
  EXPECT_LE(max_abs_diff(capped.dv.view(), plain.dv.view()), kSameMaths);
}

// Rows that see no key: O = 0, LSE = -inf, no gradient; keys no row sees: dK = dV = 0.
TEST(ReferenceIdentities, FullyMaskedRowsAreZero) {
  {  // causal with sq > sk: rows i < sq - sk see nothing
    const Dims dims{2, 7, 4, 2, 1, 8, 8};
    DenseCase c(dims, 281);
    Mask mask;
    mask.causal = 1;
    ASSERT_OK(ref::forward(c.forward(mask)));
    ASSERT_OK(ref::backward(c.backward(mask)));
    for (const HostTensor* t : {&c.out, &c.lse, &c.dq, &c.dk, &c.dv})
      EXPECT_FALSE(fh::test::has_nan(t->view()));
    const int64_t blind = dims.sq - dims.sk;
    EXPECT_EQ(max_abs(narrow(c.out.view(), 1, 0, blind)), 0);
    EXPECT_EQ(max_abs(narrow(c.dq.view(), 1, 0, blind)), 0);
    EXPECT_GT(max_abs(narrow(c.dq.view(), 1, blind, dims.sq - blind)), 0);
    for (int64_t b = 0; b < dims.batch; ++b)
      for (int64_t h = 0; h < dims.hq; ++h) {
        for (int64_t i = 0; i < blind; ++i) EXPECT_EQ(c.lse.get({b, h, i}), -kInf);
        EXPECT_TRUE(std::isfinite(c.lse.get({b, h, blind})));
      }
  }
  {  // window (0, 0) with sk > sq: keys before the first diagonal are seen by no row
    const Dims dims{1, 3, 8, 2, 2, 8, 8};
    DenseCase c(dims, 283);
    Mask mask;
    mask.window_left = 0;
    mask.window_right = 0;
    ASSERT_OK(ref::backward(c.backward(mask)));
    EXPECT_EQ(max_abs(narrow(c.dk.view(), 1, 0, 5)), 0);
    EXPECT_EQ(max_abs(narrow(c.dv.view(), 1, 0, 5)), 0);
    EXPECT_GT(max_abs(narrow(c.dv.view(), 1, 5, 3)), 0);
  }
  {  // no key at all in any sequence (seqused_k = 0), with splits and combine too
    const Dims dims{2, 4, 6, 2, 1, 8, 8};
    DenseCase c(dims, 285);
    const HostTensor none = int32_tensor({0, 0});
    fh::ForwardParams f = c.forward();
    f.seqused_k = none.view();
    ASSERT_OK(ref::forward(f));
    EXPECT_EQ(max_abs(c.out.view()), 0);
    for (int64_t i = 0; i < dims.sq; ++i) EXPECT_EQ(c.lse.get({1, 1, i}), -kInf);
    fh::BackwardParams g = c.backward();
    g.seqused_k = none.view();
    c.dq.fill(7);
    ASSERT_OK(ref::backward(g));
    EXPECT_EQ(max_abs(c.dq.view()), 0);
    HostTensor op(FH_DTYPE_FP32, {3, dims.batch, dims.hq, dims.sq, dims.dv});
    HostTensor lp(FH_DTYPE_FP32, {3, dims.batch, dims.hq, dims.sq});
    f.num_splits = 3;
    const fh::Tensor opv = op.view(), lpv = lp.view();
    ASSERT_OK(ref::forward(f, {}, &opv, &lpv));
    c.out.fill(7);
    c.lse.fill(7);
    fh::CombineParams comb{};
    comb.out_partial = opv;
    comb.lse_partial = lpv;
    comb.out = c.out.view();
    comb.lse = c.lse.view();
    ASSERT_OK(ref::combine(comb));
    EXPECT_EQ(max_abs(c.out.view()), 0);
    EXPECT_EQ(c.lse.get({0, 1, 2}), -kInf);
  }
}

// O and LSE against docs/conventions.md's definition written out literally (visibility, softcap,
// softmax, log-sum-exp), for each kind of mask with sq < sk and sq > sk.
TEST(ReferenceIdentities, MatchesDirectDefinition) {
  struct Config {
    Dims dims;
    Mask mask;
  };
  std::vector<Config> configs;
  for (Dims dims : {Dims{2, 5, 9, 4, 2, 8, 6}, Dims{2, 9, 5, 4, 2, 8, 6}}) {
    configs.push_back({dims, Mask{0, -1, -1, 0, 0, 0.3f}});  // none, explicit scale
    configs.push_back({dims, Mask{1}});                      // causal
    configs.push_back({dims, Mask{0, 2, 1, 2}});             // local with sinks
    configs.push_back({dims, Mask{0, 0, 0, 1}});             // diagonal only, one sink
    configs.push_back({dims, Mask{0, -1, 2}});               // right bound only
    configs.push_back({dims, Mask{0, 3, -1, 0, 2.0f}});      // left bound only, softcap
  }
  uint32_t seed = 291;
  for (const Config& config : configs) {
    const Dims& n = config.dims;
    const Mask& m = config.mask;
    DenseCase c(n, seed += 10);
    ASSERT_OK(ref::forward(c.forward(m)));
    const double scale = m.scale > 0 ? double(m.scale) : 1 / std::sqrt(double(n.d));
    const int64_t off = n.sk - n.sq;
    auto visible = [&](int64_t i, int64_t j) {
      const bool right_ok = m.window_right < 0 || j <= i + off + m.window_right;
      const bool left_ok = m.window_left < 0 || j >= i + off - m.window_left;
      return (m.causal ? j <= i + off : right_ok && (left_ok || j < m.sinks));
    };
    double worst = 0;
    for (int64_t b = 0; b < n.batch; ++b)
      for (int64_t h = 0; h < n.hq; ++h)
        for (int64_t i = 0; i < n.sq; ++i) {
          const int64_t hk = h / (n.hq / n.hkv);
          std::vector<double> e(n.sk, 0.0);
          double sum = 0;
          for (int64_t j = 0; j < n.sk; ++j) {
            if (!visible(i, j)) continue;
            double s = 0;
            for (int64_t x = 0; x < n.d; ++x) s += c.q.get({b, i, h, x}) * c.k.get({b, j, hk, x});
            s *= scale;
            if (m.softcap > 0) s = m.softcap * std::tanh(s / m.softcap);
            e[j] = std::exp(s);
            sum += e[j];
          }
          const double lse = sum > 0 ? std::log(sum) : -kInf;
          const double got_lse = c.lse.get({b, h, i});
          worst = std::max(worst, lse == got_lse ? 0.0 : std::fabs(lse - got_lse));
          for (int64_t x = 0; x < n.dv; ++x) {
            double o = 0;
            for (int64_t j = 0; j < n.sk; ++j)
              if (e[j] > 0) o += e[j] / sum * c.v.get({b, j, hk, x});
            worst = std::max(worst, std::fabs(o - c.out.get({b, i, h, x})));
          }
        }
    EXPECT_LE(worst, kSameMaths) << "sq " << n.sq << " sk " << n.sk << " causal " << m.causal
                                 << " window (" << m.window_left << ", " << m.window_right
                                 << ") sinks " << m.sinks << " softcap " << m.softcap;
  }
}

// ---- chunks and learnable sinks --------------------------------------------------------------

// problem_shape.hpp's visibility rule, written out apart from the reference's key ranges.
bool visible_by_definition(const Mask& m, int64_t sq, int64_t sk, int64_t i, int64_t j) {
  if (j < 0 || j >= sk) return false;
  const int64_t p = i + sk - sq;
  const int64_t wl = m.causal ? -1 : m.window_left, wr = m.causal ? 0 : m.window_right;
  bool seen = (wl < 0 || j >= p - wl || j < m.sinks) && (wr < 0 || j <= p + wr);
  if (m.chunk > 0) {
    const int64_t start = int64_t(std::floor(double(p) / m.chunk)) * m.chunk;
    seen = seen && start <= j && j < start + m.chunk;
  }
  return seen;
}

// The largest difference of c's O and LSE (after ref::forward) from a brute-force attention
// over visible_by_definition, with `sinks` ([Hq], empty: none) in each row's denominator.
double difference_from_brute_force(const DenseCase& c, const Mask& m,
                                   const std::vector<double>& sinks) {
  const Dims& n = c.n;
  const double scale = m.scale > 0 ? double(m.scale) : 1 / std::sqrt(double(n.d));
  double worst = 0;
  for (int64_t b = 0; b < n.batch; ++b)
    for (int64_t h = 0; h < n.hq; ++h)
      for (int64_t i = 0; i < n.sq; ++i) {
        const int64_t hk = h / (n.hq / n.hkv);
        std::vector<double> e(n.sk, 0.0);
        double denominator = sinks.empty() ? 0.0 : std::exp(sinks[h]);
        for (int64_t j = 0; j < n.sk; ++j) {
          if (!visible_by_definition(m, n.sq, n.sk, i, j)) continue;
          double s = 0;
          for (int64_t x = 0; x < n.d; ++x) s += c.q.get({b, i, h, x}) * c.k.get({b, j, hk, x});
          s *= scale;
          if (m.softcap > 0) s = m.softcap * std::tanh(s / m.softcap);
          e[j] = std::exp(s);
          denominator += e[j];
        }
        const double lse = denominator > 0 ? std::log(denominator) : -kInf;
        const double got_lse = c.lse.get({b, h, i});
        worst = std::max(worst, lse == got_lse ? 0.0 : std::fabs(lse - got_lse));
        for (int64_t x = 0; x < n.dv; ++x) {
          double o = 0;
          for (int64_t j = 0; j < n.sk; ++j)
            if (e[j] > 0) o += e[j] / denominator * c.v.get({b, j, hk, x});
          worst = std::max(worst, std::fabs(o - c.out.get({b, i, h, x})));
        }
      }
  return worst;
}

TEST(ReferenceIdentities, ChunksAndSinksMatchBruteForce) {
  uint32_t seed = 401;
  for (Dims dims :
       {Dims{2, 5, 11, 4, 2, 8, 6}, Dims{2, 11, 5, 4, 2, 8, 6}, Dims{1, 9, 9, 2, 1, 8, 8}}) {
    for (const Mask& mask : {chunked(Mask{}, 3), chunked(Mask{1}, 4), chunked(Mask{1}, 1),
                             chunked(Mask{0, 2, 1, 2}, 4), chunked(Mask{0, -1, 2}, 5),
                             chunked(Mask{0, 3, -1, 0, 2.0f}, 2), Mask{1}, Mask{0, 2, 0, 1}}) {
      for (bool with_sink : {false, true}) {
        DenseCase c(dims, seed += 10);
        const HostTensor sink = sink_logits(dims.hq, seed + 5);
        std::vector<double> sinks;
        fh::ForwardParams f = c.forward(mask);
        if (with_sink) {
          f.learnable_sink = sink.view();
          for (int64_t h = 0; h < dims.hq; ++h) sinks.push_back(sink.get({h}));
        }
        ASSERT_OK(ref::forward(f));
        EXPECT_LE(difference_from_brute_force(c, mask, sinks), kSameMaths)
            << "sq " << dims.sq << " sk " << dims.sk << " causal " << mask.causal << " window ("
            << mask.window_left << ", " << mask.window_right << ") sinks " << mask.sinks
            << " chunk " << mask.chunk << " learnable sink " << with_sink;
      }
    }
  }
}

// A sink of -inf adds e^-inf = 0 to each denominator: the same bits as no sink, dsink = 0.
TEST(ReferenceIdentities, SinkOfMinusInfinityIsNoSink) {
  const Dims dims{2, 6, 9, 4, 2, 8, 8};
  for (bool emulate : {false, true}) {
    SCOPED_TRACE(emulate ? "emulated bf16" : "exact");
    const int32_t dtype = emulate ? FH_DTYPE_BF16 : FH_DTYPE_FP64;
    ref::Options options;
    options.emulate_low_precision = emulate;
    DenseCase with(dims, 411, dtype), without(dims, 411, dtype);
    HostTensor sink(FH_DTYPE_FP32, {dims.hq}), dsink(FH_DTYPE_FP32, {dims.hq});
    sink.fill(-kInf);
    dsink.fill(7);
    Mask mask;
    mask.causal = 1;
    fh::ForwardParams f = with.forward(mask);
    f.learnable_sink = sink.view();
    ASSERT_OK(ref::forward(f, options));
    ASSERT_OK(ref::forward(without.forward(mask), options));
    EXPECT_EQ(max_abs_diff(with.out.view(), without.out.view()), 0);
    EXPECT_EQ(max_abs_diff(with.lse.view(), without.lse.view()), 0);
    fh::BackwardParams g = with.backward(mask);
    g.learnable_sink = sink.view();
    g.dsink = dsink.view();
    ASSERT_OK(ref::backward(g, options));
    ASSERT_OK(ref::backward(without.backward(mask), options));
    EXPECT_EQ(max_abs_diff(with.dq.view(), without.dq.view()), 0);
    EXPECT_EQ(max_abs_diff(with.dk.view(), without.dk.view()), 0);
    EXPECT_EQ(max_abs_diff(with.dv.view(), without.dv.view()), 0);
    EXPECT_EQ(max_abs(dsink.view()), 0);
    EXPECT_FALSE(fh::test::has_nan(dsink.view()));
  }
  {  // per head: a -inf head is that head without a sink, whatever the other heads' sinks
    DenseCase with(dims, 413), without(dims, 413);
    HostTensor sink = sink_logits(dims.hq, 414);
    sink.set({1}, -kInf);
    fh::ForwardParams f = with.forward();
    f.learnable_sink = sink.view();
    ASSERT_OK(ref::forward(f));
    ASSERT_OK(ref::forward(without.forward()));
    auto head_out = [](const DenseCase& c, int64_t h) { return narrow(c.out.view(), 2, h, 1); };
    auto head_lse = [](const DenseCase& c, int64_t h) { return narrow(c.lse.view(), 1, h, 1); };
    EXPECT_EQ(max_abs_diff(head_out(with, 1), head_out(without, 1)), 0);
    EXPECT_EQ(max_abs_diff(head_lse(with, 1), head_lse(without, 1)), 0);
    EXPECT_GT(max_abs_diff(head_out(with, 0), head_out(without, 0)), 1e-3) << "head 0 has a sink";
  }
}

// With sq <= sk every row's p = i + sk - sq is in [0, sk), so a chunk of sk keys or more holds
// all of them.
TEST(ReferenceIdentities, ChunkCoveringAllKeysIsNoChunk) {
  for (Dims dims : {Dims{2, 5, 9, 4, 2, 8, 6}, Dims{2, 7, 7, 2, 1, 8, 8}}) {
    for (int causal : {0, 1}) {
      for (int64_t chunk : {dims.sk, dims.sk + 5}) {
        SCOPED_TRACE(testing::Message() << "sq " << dims.sq << " sk " << dims.sk << " causal "
                                        << causal << " chunk " << chunk);
        DenseCase a(dims, 421), b(dims, 421);
        Mask plain;
        plain.causal = causal;
        const Mask chunk_mask = chunked(plain, int(chunk));
        ASSERT_NO_FATAL_FAILURE(expect_same_results(a, chunk_mask, b, plain));
      }
    }
  }
}

// Window (-1, -1) is no mask, and so is a window wider than the sequences on both sides.
TEST(ReferenceIdentities, UnboundedWindowIsNoMask) {
  for (Dims dims : {Dims{2, 5, 9, 4, 2, 8, 6}, Dims{2, 9, 5, 4, 2, 8, 6}}) {
    DenseCase none(dims, 431), unbounded(dims, 431), wide(dims, 431);
    fh::ForwardParams f = fh::default_forward_params();  // the mask fields as a caller leaves them
    f.q = none.q.view();
    f.k = none.k.view();
    f.v = none.v.view();
    f.out = none.out.view();
    f.lse = none.lse.view();
    const Mask unbounded_mask{0, -1, -1};
    const int wide_bound = int(dims.sq + dims.sk);
    const Mask wide_mask{0, wide_bound, wide_bound};
    ASSERT_OK(ref::forward(f));
    ASSERT_OK(ref::forward(unbounded.forward(unbounded_mask)));
    ASSERT_OK(ref::forward(wide.forward(wide_mask)));
    for (const DenseCase* c : {&unbounded, &wide}) {
      EXPECT_EQ(max_abs_diff(c->out.view(), none.out.view()), 0);
      EXPECT_EQ(max_abs_diff(c->lse.view(), none.lse.view()), 0);
    }
    ASSERT_OK(ref::backward(none.backward()));
    ASSERT_OK(ref::backward(unbounded.backward(unbounded_mask)));
    ASSERT_OK(ref::backward(wide.backward(wide_mask)));
    for (const DenseCase* c : {&unbounded, &wide}) {
      EXPECT_EQ(max_abs_diff(c->dq.view(), none.dq.view()), 0);
      EXPECT_EQ(max_abs_diff(c->dk.view(), none.dk.view()), 0);
      EXPECT_EQ(max_abs_diff(c->dv.view(), none.dv.view()), 0);
    }
  }
}

// A row that sees no key but has a finite sink: the denominator is e^sigma alone, so O = 0 and
// LSE = sigma (not -inf), and the row passes no gradient on. Causal with sq > sk, and a chunk
// holding no key for rows with p < 0.
TEST(ReferenceIdentities, BlindRowWithSinkHasZeroOutputAndSinkLse) {
  const Dims dims{2, 7, 4, 2, 1, 8, 8};
  const int64_t blind = dims.sq - dims.sk;
  for (const Mask& mask : {Mask{1}, chunked(Mask{}, 2)}) {
    for (bool emulate : {false, true}) {
      SCOPED_TRACE(testing::Message()
                   << "chunk " << mask.chunk << (emulate ? " emulated fp32" : " exact"));
      ref::Options options;
      options.emulate_low_precision = emulate;
      DenseCase c(dims, 441, emulate ? FH_DTYPE_FP32 : FH_DTYPE_FP64);
      const HostTensor sink = sink_logits(dims.hq, 442);
      HostTensor dsink(FH_DTYPE_FP64, {dims.hq});
      fh::ForwardParams f = c.forward(mask);
      f.learnable_sink = sink.view();
      ASSERT_OK(ref::forward(f, options));
      EXPECT_EQ(max_abs(narrow(c.out.view(), 1, 0, blind)), 0);
      EXPECT_GT(max_abs(narrow(c.out.view(), 1, blind, dims.sq - blind)), 0);
      for (int64_t b = 0; b < dims.batch; ++b)
        for (int64_t h = 0; h < dims.hq; ++h)
          for (int64_t i = 0; i < blind; ++i) {
            const double sigma = emulate ? double(float(sink.get({h}))) : sink.get({h});
            EXPECT_EQ(c.lse.get({b, h, i}), sigma) << b << " " << h << " " << i;
          }
      fh::BackwardParams g = c.backward(mask);
      g.learnable_sink = sink.view();
      g.dsink = dsink.view();
      c.dq.fill(7);
      ASSERT_OK(ref::backward(g, options));
      EXPECT_EQ(max_abs(narrow(c.dq.view(), 1, 0, blind)), 0);
      for (const HostTensor* t : {&c.out, &c.lse, &c.dq, &c.dk, &c.dv, &dsink})
        EXPECT_FALSE(fh::test::has_nan(t->view()));
    }
  }
}

// The sink joins split 0's partial only: combined, it is counted once, as unsplit.
TEST(ReferenceIdentities, CombinedSplitsWithSinkAreUnsplit) {
  const Dims dims{2, 6, 11, 4, 2, 8, 6};
  const HostTensor sink = sink_logits(dims.hq, 451);
  for (int num_splits : {2, 3, 5}) {
    DenseCase whole(dims, 452), parts(dims, 452);
    Mask mask;
    mask.causal = 1;
    fh::ForwardParams w = whole.forward(mask);
    w.learnable_sink = sink.view();
    ASSERT_OK(ref::forward(w));
    HostTensor out_partial(FH_DTYPE_FP64, {num_splits, dims.batch, dims.hq, dims.sq, dims.dv});
    HostTensor lse_partial(FH_DTYPE_FP64, {num_splits, dims.batch, dims.hq, dims.sq});
    fh::ForwardParams p = parts.forward(mask);
    p.learnable_sink = sink.view();
    p.num_splits = num_splits;
    const fh::Tensor op = out_partial.view(), lp = lse_partial.view();
    ASSERT_OK(ref::forward(p, {}, &op, &lp));
    fh::CombineParams c{};
    c.out_partial = op;
    c.lse_partial = lp;
    c.out = parts.out.view();
    c.lse = parts.lse.view();
    ASSERT_OK(ref::combine(c));
    EXPECT_LE(max_abs_diff(parts.out.view(), whole.out.view()), kSameMaths) << num_splits;
    EXPECT_LE(max_abs_diff(parts.lse.view(), whole.lse.view()), kSameMaths) << num_splits;
  }
}

// dsink sums over sequences and rows in one order whatever the thread count: same bits.
TEST(ReferenceIdentities, ThreadCountDoesNotChangeDsinkBits) {
  const Dims dims{3, 37, 41, 8, 2, 16, 16};
  const HostTensor sink = sink_logits(dims.hq, 461);
  HostTensor dsink_one(FH_DTYPE_FP32, {dims.hq}), dsink_many(FH_DTYPE_FP32, {dims.hq});
  ref::Options many;
  many.num_threads = 5;
  for (bool emulate : {false, true}) {
    ref::Options one = one_thread();
    one.emulate_low_precision = many.emulate_low_precision = emulate;
    DenseCase a(dims, 462, FH_DTYPE_BF16), b(dims, 462, FH_DTYPE_BF16);
    fh::BackwardParams ga = a.backward(chunked(Mask{1}, 16)), gb = b.backward(chunked(Mask{1}, 16));
    ga.learnable_sink = gb.learnable_sink = sink.view();
    ga.dsink = dsink_one.view();
    gb.dsink = dsink_many.view();
    ASSERT_OK(ref::backward(ga, one));
    ASSERT_OK(ref::backward(gb, many));
    EXPECT_EQ(std::memcmp(dsink_one.data(), dsink_many.data(), dsink_one.bytes()), 0);
    EXPECT_GT(max_abs(dsink_one.view()), 0);
  }
}

// Any strides (padded, permuted, last dim not contiguous) equal contiguous tensors.
TEST(ReferenceIdentities, StridedIsContiguous) {
  const Dims dims{2, 5, 7, 4, 2, 8, 6};
  DenseCase c(dims, 301);
  // q stored [B, Hq, sq, d]; k padded; v stored [B, dv, sk, Hkv] so its last dim is strided.
  HostTensor q_bhsd(FH_DTYPE_FP64, {dims.batch, dims.hq, dims.sq, dims.d});
  HostTensor k_padded(FH_DTYPE_FP64, {dims.batch, dims.sk, dims.hkv, dims.d},
                      {dims.batch, dims.sk + 2, dims.hkv + 1, dims.d + 8});
  HostTensor v_bdsh(FH_DTYPE_FP64, {dims.batch, dims.dv, dims.sk, dims.hkv});
  const fh::Tensor q = fh::test::permute(q_bhsd.view(), {0, 2, 1, 3});
  const fh::Tensor k = k_padded.view();
  const fh::Tensor v = fh::test::permute(v_bdsh.view(), {0, 2, 3, 1});
  fh::test::for_each_index(
      c.q.shape(), [&](const std::vector<int64_t>& i) { fh::test::write(q, i, c.q.get(i)); });
  fh::test::for_each_index(
      c.k.shape(), [&](const std::vector<int64_t>& i) { fh::test::write(k, i, c.k.get(i)); });
  fh::test::for_each_index(
      c.v.shape(), [&](const std::vector<int64_t>& i) { fh::test::write(v, i, c.v.get(i)); });
  HostTensor out(FH_DTYPE_FP64, {dims.batch, dims.sq, dims.hq, dims.dv},
                 {dims.batch, dims.sq + 1, dims.hq, dims.dv + 2});
  HostTensor dq(FH_DTYPE_FP64, {dims.batch, dims.sq, dims.hq, dims.d},
                {dims.batch + 1, dims.sq, dims.hq + 3, dims.d});
  HostTensor dk_bhsd(FH_DTYPE_FP64, {dims.batch, dims.hkv, dims.sk, dims.d});
  HostTensor dv(FH_DTYPE_FP64, {dims.batch, dims.sk, dims.hkv, dims.dv},
                {dims.batch, dims.sk, dims.hkv, dims.dv + 5});
  Mask mask;
  mask.window_left = 3;
  mask.window_right = 2;
  ASSERT_OK(ref::forward(c.forward(mask)));
  ASSERT_OK(ref::backward(c.backward(mask)));
  fh::ForwardParams f = c.forward(mask);
  f.q = q;
  f.k = k;
  f.v = v;
  f.out = out.view();
  ASSERT_OK(ref::forward(f));
  EXPECT_EQ(max_abs_diff(out.view(), c.out.view()), 0);
  fh::BackwardParams g = c.backward(mask);
  g.q = q;
  g.k = k;
  g.v = v;
  g.dq = dq.view();
  g.dk = fh::test::permute(dk_bhsd.view(), {0, 2, 1, 3});
  g.dv = dv.view();
  ASSERT_OK(ref::backward(g));
  EXPECT_EQ(max_abs_diff(dq.view(), c.dq.view()), 0);
  EXPECT_EQ(max_abs_diff(g.dk, c.dk.view()), 0);
  EXPECT_EQ(max_abs_diff(dv.view(), c.dv.view()), 0);
}

// The backward's GQA sums do not depend on how many threads run it: same bits.
TEST(ReferenceIdentities, ThreadCountDoesNotChangeBits) {
  const Dims dims{2, 37, 41, 8, 2, 16, 16};
  DenseCase a(dims, 311), b(dims, 311);
  Mask mask;
  mask.causal = 1;
  ref::Options many;
  many.num_threads = 5;
  ASSERT_OK(ref::forward(a.forward(mask), one_thread()));
  ASSERT_OK(ref::forward(b.forward(mask), many));
  ASSERT_OK(ref::backward(a.backward(mask), one_thread()));
  ASSERT_OK(ref::backward(b.backward(mask), many));
  const std::vector<std::pair<HostTensor*, HostTensor*>> results = {
      {&a.out, &b.out}, {&a.lse, &b.lse}, {&a.dq, &b.dq}, {&a.dk, &b.dk}, {&a.dv, &b.dv}};
  for (const auto& [x, y] : results) EXPECT_EQ(std::memcmp(x->data(), y->data(), x->bytes()), 0);
}

// ---- low precision -------------------------------------------------------------------------

TEST(ReferenceLowPrecision, EmulationErrorIsPlausible) {
  const Dims dims{1, 256, 256, 2, 2, 64, 64};
  for (int32_t dtype : {FH_DTYPE_BF16, FH_DTYPE_FP16}) {
    DenseCase exact(dims, 321, dtype), plain(dims, 321, dtype);
    ref::Options emulate;
    emulate.emulate_low_precision = true;
    ASSERT_OK(ref::forward(exact.forward()));
    ASSERT_OK(ref::forward(plain.forward(), emulate));
    ASSERT_OK(ref::backward(exact.backward()));
    ASSERT_OK(ref::backward(plain.backward(), emulate));
    const double out_error = max_abs_diff(exact.out.view(), plain.out.view());
    const double lse_error = max_abs_diff(exact.lse.view(), plain.lse.view());
    const double dq_error =
        max_abs_diff(exact.dq.view(), plain.dq.view()) / max_abs(exact.dq.view());
    const double dk_error =
        max_abs_diff(exact.dk.view(), plain.dk.view()) / max_abs(exact.dk.view());
    const double dv_error =
        max_abs_diff(exact.dv.view(), plain.dv.view()) / max_abs(exact.dv.view());
    std::printf(
        "[ emulation %s ] max |plain - exact|: O %.3g, LSE %.3g; relative to max |grad|: dQ %.3g, "
        "dK %.3g, dV %.3g\n",
        dtype == FH_DTYPE_BF16 ? "bf16" : "fp16", out_error, lse_error, dq_error, dk_error,
        dv_error);
    const double low = dtype == FH_DTYPE_BF16 ? 1e-4 : 1e-5;
    const double high = dtype == FH_DTYPE_BF16 ? 5e-2 : 1e-2;
    for (double error : {out_error, dq_error, dk_error, dv_error}) {
      EXPECT_GT(error, low);
      EXPECT_LT(error, high);
    }
    EXPECT_LT(lse_error, high);
  }
}

TEST(ReferenceLowPrecision, EmulationWithSinkIsPlausible) {
  const Dims dims{1, 128, 128, 2, 2, 64, 64};
  const HostTensor sink = sink_logits(dims.hq, 471);
  DenseCase exact(dims, 472, FH_DTYPE_BF16), plain(dims, 472, FH_DTYPE_BF16);
  HostTensor dsink_exact(FH_DTYPE_FP64, {dims.hq}), dsink_plain(FH_DTYPE_FP32, {dims.hq});
  ref::Options emulate;
  emulate.emulate_low_precision = true;
  fh::ForwardParams fe = exact.forward(), fp = plain.forward();
  fe.learnable_sink = fp.learnable_sink = sink.view();
  ASSERT_OK(ref::forward(fe));
  ASSERT_OK(ref::forward(fp, emulate));
  fh::BackwardParams ge = exact.backward(), gp = plain.backward();
  ge.learnable_sink = gp.learnable_sink = sink.view();
  ge.dsink = dsink_exact.view();
  gp.dsink = dsink_plain.view();
  ASSERT_OK(ref::backward(ge));
  ASSERT_OK(ref::backward(gp, emulate));
  const double out_error = max_abs_diff(exact.out.view(), plain.out.view());
  const double lse_error = max_abs_diff(exact.lse.view(), plain.lse.view());
  const double dsink_error =
      max_abs_diff(dsink_exact.view(), dsink_plain.view()) / max_abs(dsink_exact.view());
  EXPECT_GT(out_error, 1e-4);
  EXPECT_LT(out_error, 5e-2);
  EXPECT_LT(lse_error, 5e-2);
  EXPECT_LT(dsink_error, 5e-2);
}

TEST(ReferenceLowPrecision, OutputsInBf16AndFp16AreRoundedExactResults) {
  const Dims dims{1, 8, 8, 2, 2, 8, 8};
  DenseCase c(dims, 331);
  ASSERT_OK(ref::forward(c.forward()));
  for (int32_t dtype : {FH_DTYPE_BF16, FH_DTYPE_FP16, FH_DTYPE_FP32}) {
    HostTensor out(dtype, {dims.batch, dims.sq, dims.hq, dims.dv});
    fh::ForwardParams f = c.forward();
    f.out = out.view();
    ASSERT_OK(ref::forward(f));
    fh::test::for_each_index(out.shape(), [&](const std::vector<int64_t>& i) {
      const double exact = c.out.get(i);
      const double expected = dtype == FH_DTYPE_BF16   ? round_to_bf16(exact)
                              : dtype == FH_DTYPE_FP16 ? round_to_fp16(exact)
                                                       : double(float(exact));
      ASSERT_EQ(out.get(i), expected);
    });
  }
}

TEST(ReferenceHostDtype, RoundToNearestEven) {
  using namespace fh::test;
  EXPECT_EQ(float_to_bf16_bits(1.0f), 0x3F80);
  EXPECT_EQ(float_to_bf16_bits(1.0f + std::ldexp(1.0f, -8)), 0x3F80);      // tie: to even
  EXPECT_EQ(float_to_bf16_bits(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3F82);  // tie: to even
  EXPECT_EQ(float_to_bf16_bits(-2.0f), 0xC000);
  EXPECT_EQ(float_to_bf16_bits(3.4e38f), 0x7F80);  // overflow: inf
  EXPECT_TRUE(std::isnan(bf16_bits_to_float(float_to_bf16_bits(NAN))));
  EXPECT_EQ(float_to_fp16_bits(1.0f), 0x3C00);
  EXPECT_EQ(float_to_fp16_bits(-2.0f), 0xC000);
  EXPECT_EQ(float_to_fp16_bits(65504.f), 0x7BFF);
  EXPECT_EQ(float_to_fp16_bits(65519.f), 0x7BFF);
  EXPECT_EQ(float_to_fp16_bits(65520.f), 0x7C00);                       // tie past max: inf
  EXPECT_EQ(float_to_fp16_bits(std::ldexp(1.0f, -24)), 0x0001);         // smallest subnormal
  EXPECT_EQ(float_to_fp16_bits(std::ldexp(1.0f, -25)), 0x0000);         // tie: to even (0)
  EXPECT_EQ(float_to_fp16_bits(3 * std::ldexp(1.0f, -25)), 0x0002);     // tie: to even
  EXPECT_EQ(float_to_fp16_bits(1.0f + std::ldexp(1.0f, -11)), 0x3C00);  // tie: to even
  EXPECT_TRUE(std::isnan(fp16_bits_to_float(float_to_fp16_bits(NAN))));
  // Every finite pattern survives bits -> float -> bits.
  for (uint32_t bits = 0; bits < 0x10000; ++bits) {
    const float b = bf16_bits_to_float(uint16_t(bits)), h = fp16_bits_to_float(uint16_t(bits));
    if (!std::isnan(b)) {
      ASSERT_EQ(float_to_bf16_bits(b), bits) << std::hex << bits;
    }
    if (!std::isnan(h)) {
      ASSERT_EQ(float_to_fp16_bits(h), bits) << std::hex << bits;
    }
  }
}

// ---- refusals ------------------------------------------------------------------------------

TEST(ReferenceRefusals, Fp8BackwardAndBadMetadataAreRefusedWithAMessage) {
  DenseCase c(Dims{}, 341);
  fh::BackwardParams b = c.backward();
  b.q.dtype = FH_DTYPE_FP8_E4M3;
  fh::Status status = ref::backward(b);  // the library's rule: the backward takes no fp8
  EXPECT_EQ(status.code, FH_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(status.message.find("the backward takes no fp8"), std::string::npos) << status.message;
  fh::ForwardParams f = c.forward();

  ref::Options emulate;
  emulate.emulate_low_precision = true;
  status = ref::forward(c.forward(), emulate);  // fp64 q: nothing to emulate
  EXPECT_EQ(status.code, FH_ERROR_NOT_SUPPORTED) << status.message;

  const HostTensor too_long = int32_tensor({3, 99});
  f = c.forward();
  f.seqused_k = too_long.view();
  status = ref::forward(f);
  EXPECT_EQ(status.code, FH_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(status.message.find("sequence 1"), std::string::npos) << status.message;
}

TEST(ReferenceRefusals, SinkArgumentsAreChecked) {
  const Dims dims{};
  DenseCase c(dims, 361);
  HostTensor sink = sink_logits(dims.hq, 362);
  const HostTensor wrong_shape = sink_logits(dims.hq + 1, 363);
  const HostTensor wrong_dtype(FH_DTYPE_BF16, {dims.hq});
  HostTensor dsink(FH_DTYPE_FP64, {dims.hq});
  fh::ForwardParams f = c.forward();
  for (const HostTensor* bad : {&wrong_shape, &wrong_dtype}) {
    f.learnable_sink = bad->view();
    const fh::Status status = ref::forward(f);
    EXPECT_EQ(status.code, FH_ERROR_INVALID_ARGUMENT);
    EXPECT_NE(status.message.find("learnable_sink"), std::string::npos) << status.message;
  }
  f.learnable_sink = sink.view();
  sink.set({1}, std::nan(""));
  fh::Status status = ref::forward(f);
  EXPECT_EQ(status.code, FH_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(status.message.find("learnable_sink[1]"), std::string::npos) << status.message;
  sink.set({1}, kInf);
  EXPECT_EQ(ref::forward(f).code, FH_ERROR_INVALID_ARGUMENT);

  fh::BackwardParams g = c.backward();
  g.dsink = dsink.view();
  status = ref::backward(g);
  EXPECT_EQ(status.code, FH_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(status.message.find("dsink: is given but learnable_sink is absent"), std::string::npos) << status.message;
}

// ---- speed ---------------------------------------------------------------------------------

// ---- qv: S = Q K^T + Qv V^T ---------------------------------------------------------------------

// qv [B, sq, Hq, dv] with unit-normal entries next to a dense case.
HostTensor make_qv(const Dims& n, uint32_t seed) {
  return random_tensor(FH_DTYPE_FP64, {n.batch, n.sq, n.hq, n.dv}, seed);
}

// qv is one more block of head-dim columns: S = [Q | Qv] [K | V]^T. So a call with qv gives what
// the call without it gives on q' = [q | qv] and k' = [k | v] (v unchanged), with the same
// default scale 1/sqrt(d + dv), every mask and transform alike.
TEST(ReferenceIdentities, QvIsConcatenatedHeadDims) {
  std::vector<std::pair<Dims, Mask>> configs;
  for (Dims dims : {Dims{2, 5, 9, 4, 2, 8, 6}, Dims{1, 9, 5, 2, 1, 4, 16}}) {
    configs.push_back({dims, Mask{}});
    configs.push_back({dims, Mask{1}});                    // causal
    configs.push_back({dims, Mask{0, 2, 1, 1, 3.0f}});     // window with a sink token, softcap
    configs.push_back({dims, Mask{0, -1, -1, 0, 0, 0.2f}});  // explicit scale
  }
  uint32_t seed = 1501;
  for (const auto& [n, mask] : configs) {
    SCOPED_TRACE(testing::Message() << "sq " << n.sq << " sk " << n.sk << " d " << n.d << " dv " << n.dv
                                    << " causal " << mask.causal << " window " << mask.window_left);
    DenseCase with_qv(n, seed += 10);
    const HostTensor qv = make_qv(n, seed + 7);
    fh::ForwardParams p = with_qv.forward(mask);
    p.qv = qv.view();
    ASSERT_OK(ref::forward(p));

    Dims wide = n;
    wide.d = n.d + n.dv;
    DenseCase concatenated(wide, seed);
    for (int64_t b = 0; b < n.batch; ++b) {
      for (int64_t h = 0; h < n.hq; ++h)
        for (int64_t i = 0; i < n.sq; ++i)
          for (int64_t x = 0; x < wide.d; ++x)
            concatenated.q.set({b, i, h, x}, x < n.d ? with_qv.q.get({b, i, h, x}) : qv.get({b, i, h, x - n.d}));
      for (int64_t h = 0; h < n.hkv; ++h)
        for (int64_t j = 0; j < n.sk; ++j) {
          for (int64_t x = 0; x < wide.d; ++x)
            concatenated.k.set({b, j, h, x},
                               x < n.d ? with_qv.k.get({b, j, h, x}) : with_qv.v.get({b, j, h, x - n.d}));
          for (int64_t x = 0; x < n.dv; ++x) concatenated.v.set({b, j, h, x}, with_qv.v.get({b, j, h, x}));
        }
    }
    ASSERT_OK(ref::forward(concatenated.forward(mask)));
    EXPECT_LE(max_abs_diff(with_qv.out.view(), concatenated.out.view()), kSameMaths);
    EXPECT_LE(max_abs_diff(with_qv.lse.view(), concatenated.lse.view()), kSameMaths);
  }
}

// qv = 0 adds nothing to the scores: with the scale given, the call without qv.
TEST(ReferenceIdentities, QvOfZerosIsNoQv) {
  const Dims n{2, 5, 9, 4, 2, 8, 6};
  for (int causal : {0, 1}) {
    DenseCase a(n, 1601), b(n, 1601);
    HostTensor zeros(FH_DTYPE_FP64, {n.batch, n.sq, n.hq, n.dv});
    Mask mask;
    mask.causal = causal;
    mask.scale = 0.35f;
    fh::ForwardParams p = a.forward(mask);
    p.qv = zeros.view();
    ASSERT_OK(ref::forward(p));
    ASSERT_OK(ref::forward(b.forward(mask)));
    EXPECT_EQ(max_abs_diff(a.out.view(), b.out.view()), 0);
    EXPECT_EQ(max_abs_diff(a.lse.view(), b.lse.view()), 0);
    // Without a scale the default counts qv's columns: 1/sqrt(d + dv), not 1/sqrt(d).
    mask.scale = 0;
    p = a.forward(mask);
    p.qv = zeros.view();
    ASSERT_OK(ref::forward(p));
    mask.scale = float(1 / std::sqrt(double(n.d + n.dv)));
    ASSERT_OK(ref::forward(b.forward(mask)));
    EXPECT_LE(max_abs_diff(a.out.view(), b.out.view()), 1e-6);  // the scale rounded to float once
  }
}

TEST(ReferenceRefusals, QvOfTheWrongShapeIsRefused) {
  const Dims n{2, 5, 9, 4, 2, 8, 6};
  DenseCase c(n, 1701);
  HostTensor qv(FH_DTYPE_FP64, {n.batch, n.sq, n.hq, n.d + 1});  // dv + 3 columns
  fh::ForwardParams p = c.forward();
  p.qv = qv.view();
  const fh::Status status = ref::forward(p);
  EXPECT_EQ(status.code, FH_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(status.message.find("qv"), std::string::npos) << status.message;
}

// ---- KV cache extras: cache_batch_idx, cache_leftpad, rotary, varlen queries ----------------------

// Sequence b reading cache row cache_batch_idx[b] (and appending there) is the call on the cache
// rows gathered in that order; the rows no sequence names are left alone.
TEST(ReferenceIdentities, CacheBatchIdxIsGatheredCache) {
  const Dims dims{2, 3, 12, 4, 2, 8, 6};
  const int64_t cache_rows = 3, s_new = 2;
  const std::vector<int64_t> rows = {2, 0};
  const HostTensor batch_idx = int32_tensor({2, 0}), cache_seqlens = int32_tensor({5, 9});
  const HostTensor k_new = random_tensor(FH_DTYPE_FP64, {dims.batch, s_new, dims.hkv, dims.d}, 1801);
  const HostTensor v_new = random_tensor(FH_DTYPE_FP64, {dims.batch, s_new, dims.hkv, dims.dv}, 1802);
  const HostTensor k_before = random_tensor(FH_DTYPE_FP64, {cache_rows, dims.sk, dims.hkv, dims.d}, 1803);
  const HostTensor v_cache = random_tensor(FH_DTYPE_FP64, {cache_rows, dims.sk, dims.hkv, dims.dv}, 1804);
  for (int causal : {0, 1}) {
    SCOPED_TRACE(causal);
    Mask mask;
    mask.causal = causal;
    DenseCase gathered(dims, 1805), indexed(dims, 1805);
    for (int64_t b = 0; b < dims.batch; ++b)
      for (int64_t j = 0; j < dims.sk; ++j)
        for (int64_t h = 0; h < dims.hkv; ++h) {
          for (int64_t x = 0; x < dims.d; ++x) gathered.k.set({b, j, h, x}, k_before.get({rows[b], j, h, x}));
          for (int64_t x = 0; x < dims.dv; ++x) gathered.v.set({b, j, h, x}, v_cache.get({rows[b], j, h, x}));
        }
    fh::ForwardParams g = gathered.forward(mask);
    g.k_new = k_new.view();
    g.v_new = v_new.view();
    g.cache_seqlens = cache_seqlens.view();
    ASSERT_OK(ref::forward(g));

    HostTensor k_rows = k_before, v_rows = v_cache;  // fresh copies: the call appends into them
    fh::ForwardParams p = indexed.forward(mask);
    p.k = k_rows.view();
    p.v = v_rows.view();
    p.cache_batch_idx = batch_idx.view();
    p.k_new = k_new.view();
    p.v_new = v_new.view();
    p.cache_seqlens = cache_seqlens.view();
    ASSERT_OK(ref::forward(p));
    EXPECT_EQ(max_abs_diff(indexed.out.view(), gathered.out.view()), 0);
    EXPECT_EQ(max_abs_diff(indexed.lse.view(), gathered.lse.view()), 0);
    for (int64_t b = 0; b < dims.batch; ++b)  // the appended keys landed in each sequence's row
      for (int64_t j = 0; j < dims.sk; ++j)
        EXPECT_EQ(k_rows.get({rows[b], j, 1, 3}), gathered.k.get({b, j, 1, 3})) << b << " " << j;
    EXPECT_EQ(max_abs_diff(narrow(k_rows.view(), 0, 1, 1), narrow(k_before.view(), 0, 1, 1)), 0)
        << "cache row 1 belongs to no sequence";
  }
}

// A sequence whose keys start at cache position cache_leftpad[b] is the call on a cache shifted
// left by that much: masks align to its own keys, and the append lands at cache_seqlens[b].
TEST(ReferenceIdentities, LeftpadIsShiftedCache) {
  const Dims dims{2, 3, 12, 4, 2, 8, 6};
  const int64_t s_new = 2;
  const std::vector<int32_t> leftpad = {3, 0}, cached = {7, 5};
  const HostTensor leftpad_t = int32_tensor(leftpad), cache_seqlens = int32_tensor(cached);
  std::vector<int32_t> shifted_lengths(2);
  for (int b = 0; b < 2; ++b) shifted_lengths[b] = cached[b] - leftpad[b];
  const HostTensor shifted_seqlens = int32_tensor(shifted_lengths);
  const HostTensor k_new = random_tensor(FH_DTYPE_FP64, {dims.batch, s_new, dims.hkv, dims.d}, 1901);
  const HostTensor v_new = random_tensor(FH_DTYPE_FP64, {dims.batch, s_new, dims.hkv, dims.dv}, 1902);
  for (const Mask& mask : {Mask{}, Mask{1}, Mask{0, 2, 0, 1, 4.0f}}) {
    SCOPED_TRACE(testing::Message() << "causal " << mask.causal << " window " << mask.window_left);
    DenseCase padded(dims, 1903), shifted(dims, 1903);
    for (int64_t b = 0; b < dims.batch; ++b)
      for (int64_t j = 0; j + leftpad[b] < dims.sk; ++j)
        for (int64_t h = 0; h < dims.hkv; ++h) {
          for (int64_t x = 0; x < dims.d; ++x) shifted.k.set({b, j, h, x}, padded.k.get({b, j + leftpad[b], h, x}));
          for (int64_t x = 0; x < dims.dv; ++x) shifted.v.set({b, j, h, x}, padded.v.get({b, j + leftpad[b], h, x}));
        }
    fh::ForwardParams s = shifted.forward(mask);
    s.k_new = k_new.view();
    s.v_new = v_new.view();
    s.cache_seqlens = shifted_seqlens.view();
    ASSERT_OK(ref::forward(s));
    fh::ForwardParams p = padded.forward(mask);
    p.cache_leftpad = leftpad_t.view();
    p.k_new = k_new.view();
    p.v_new = v_new.view();
    p.cache_seqlens = cache_seqlens.view();
    ASSERT_OK(ref::forward(p));
    EXPECT_EQ(max_abs_diff(padded.out.view(), shifted.out.view()), 0);
    EXPECT_EQ(max_abs_diff(padded.lse.view(), shifted.lse.view()), 0);
    for (int64_t b = 0; b < dims.batch; ++b)
      for (int64_t t = 0; t < s_new; ++t)
        EXPECT_EQ(padded.k.get({b, cached[b] + t, 1, 2}), k_new.get({b, t, 1, 2})) << "appended at cache_seqlens";
  }
}

// New keys packed ([total_new, Hkv, d], sequence b's rows [cu[b], cu[b + 1])) append as each
// sequence's own dense k_new would: 2, 0 and 3 new keys, rotary on them and on q, queries packed
// too (continuous batching's step). Each sequence against a call of its own, bit for bit, and the
// cache afterwards alike (the row of the sequence without new keys untouched).
TEST(ReferenceIdentities, PackedNewKeysAreEachSequencesAppend) {
  const Dims dims{3, 3, 12, 4, 2, 8, 6};
  const std::vector<int32_t> cached = {4, 9, 0}, cu = {0, 2, 2, 5};  // new keys and query rows alike
  const HostTensor cu_t = int32_tensor(cu), cache_seqlens = int32_tensor(cached);
  const int64_t total = cu.back();
  const HostTensor k_new = random_tensor(FH_DTYPE_FP64, {total, dims.hkv, dims.d}, 2501);
  const HostTensor v_new = random_tensor(FH_DTYPE_FP64, {total, dims.hkv, dims.dv}, 2502);
  const HostTensor q = random_tensor(FH_DTYPE_FP64, {total, dims.hq, dims.d}, 2503);
  HostTensor cos(FH_DTYPE_FP64, {16, 2}), sin(FH_DTYPE_FP64, {16, 2});
  fh::test::for_each_index({16, 2}, [&](const std::vector<int64_t>& i) {
    cos.set(i, std::cos(0.3 * double(i[0] + 1) * double(i[1] + 1)));
    sin.set(i, std::sin(0.3 * double(i[0] + 1) * double(i[1] + 1)));
  });
  Mask mask;
  mask.causal = 1;
  DenseCase packed(dims, 2504), alone(dims, 2504);  // the same cache: one for each side to append into
  HostTensor out(FH_DTYPE_FP64, {total, dims.hq, dims.dv}), lse(FH_DTYPE_FP64, {dims.hq, total});
  fh::ForwardParams p = packed.forward(mask);
  p.q = q.view();
  p.out = out.view();
  p.lse = lse.view();
  p.cu_seqlens_q = cu_t.view();
  p.max_seqlen_q = 3;
  p.k_new = k_new.view();
  p.v_new = v_new.view();
  p.cu_seqlens_k_new = cu_t.view();
  p.cache_seqlens = cache_seqlens.view();
  p.rotary_cos = cos.view();
  p.rotary_sin = sin.view();
  ASSERT_OK(ref::forward(p));
  for (int64_t b : {0, 2}) {
    SCOPED_TRACE(b);
    const int64_t n = cu[b + 1] - cu[b];
    HostTensor out_b(FH_DTYPE_FP64, {1, n, dims.hq, dims.dv}), lse_b(FH_DTYPE_FP64, {1, dims.hq, n});
    const HostTensor cached_b = int32_tensor({cached[b]});
    fh::ForwardParams s = alone.forward(mask);
    s.q = sequence_view(q.view(), cu[b], n);
    s.k = narrow(alone.k.view(), 0, b, 1);
    s.v = narrow(alone.v.view(), 0, b, 1);
    s.out = out_b.view();
    s.lse = lse_b.view();
    s.k_new = sequence_view(k_new.view(), cu[b], n);
    s.v_new = sequence_view(v_new.view(), cu[b], n);
    s.cache_seqlens = cached_b.view();
    s.rotary_cos = cos.view();
    s.rotary_sin = sin.view();
    ASSERT_OK(ref::forward(s));
    EXPECT_EQ(max_abs_diff(sequence_view(out.view(), cu[b], n), out_b.view()), 0);
    EXPECT_EQ(max_abs_diff(unsqueeze(narrow(lse.view(), 1, cu[b], n), 0), lse_b.view()), 0);
  }
  EXPECT_EQ(max_abs_diff(packed.k.view(), alone.k.view()), 0) << "the cache after the appends";
  EXPECT_EQ(max_abs_diff(packed.v.view(), alone.v.view()), 0);
  EXPECT_EQ(max_abs_diff(narrow(packed.k.view(), 0, 1, 1), narrow(DenseCase(dims, 2504).k.view(), 0, 1, 1)), 0);
}

// A paged cache addressed as a dense one: sequence b reads (and appends to) row
// cache_batch_idx[b] of the page table from position cache_leftpad[b] on, as it would row
// cache_batch_idx[b] of a dense cache, bit for bit; the pages of the rows no sequence names keep
// their keys. A table row out of range is refused by name.
TEST(ReferenceIdentities, PagedCacheIndexAndLeftpadAreDenseOnes) {
  const Dims dims{2, 3, 12, 4, 2, 8, 6};
  const int64_t cache_rows = 3, s_new = 2, page_size = 4;
  const HostTensor batch_idx = int32_tensor({2, 0}), leftpad = int32_tensor({3, 1});
  const HostTensor cache_seqlens = int32_tensor({7, 9});
  const HostTensor k_new = random_tensor(FH_DTYPE_FP64, {dims.batch, s_new, dims.hkv, dims.d}, 2401);
  const HostTensor v_new = random_tensor(FH_DTYPE_FP64, {dims.batch, s_new, dims.hkv, dims.dv}, 2402);
  const HostTensor k_before = random_tensor(FH_DTYPE_FP64, {cache_rows, dims.sk, dims.hkv, dims.d}, 2403);
  const HostTensor v_before = random_tensor(FH_DTYPE_FP64, {cache_rows, dims.sk, dims.hkv, dims.dv}, 2404);
  const std::vector<int32_t> row_lengths(cache_rows, int32_t(dims.sk));  // every row paged whole
  for (const Mask& mask : {Mask{}, Mask{1}, Mask{0, 2, 0, 1, 4.0f}}) {
    SCOPED_TRACE(testing::Message() << "causal " << mask.causal << " window " << mask.window_left);
    auto with_cache_extras = [&](fh::ForwardParams p) {
      p.cache_batch_idx = batch_idx.view();
      p.cache_leftpad = leftpad.view();
      p.cache_seqlens = cache_seqlens.view();
      p.k_new = k_new.view();
      p.v_new = v_new.view();
      return p;
    };
    DenseCase dense(dims, 2405), paged(dims, 2405);
    HostTensor k_rows = k_before, v_rows = v_before;  // fresh copies: the calls append into them
    fh::ForwardParams d = with_cache_extras(dense.forward(mask));
    d.k = k_rows.view();
    d.v = v_rows.view();
    ASSERT_OK(ref::forward(d));

    PagedCache cache(k_before, v_before, row_lengths, page_size, /*num_pages=*/11, 2406);
    fh::ForwardParams p = with_cache_extras(paged.forward(mask));
    p.k = cache.k.view();
    p.v = cache.v.view();
    p.page_table = cache.page_table.view();
    ASSERT_OK(ref::forward(p));
    EXPECT_EQ(max_abs_diff(paged.out.view(), dense.out.view()), 0);
    EXPECT_EQ(max_abs_diff(paged.lse.view(), dense.lse.view()), 0);
    for (int64_t r = 0; r < cache_rows; ++r)  // the pages hold the dense rows after the append
      for (int64_t j = 0; j < dims.sk; ++j) {
        const int64_t page = int64_t(cache.page_table.get({r, j / page_size}));
        for (int64_t x = 0; x < dims.d; ++x)
          ASSERT_EQ(cache.k.get({page, j % page_size, 1, x}), k_rows.get({r, j, 1, x})) << r << " " << j;
        for (int64_t x = 0; x < dims.dv; ++x)
          ASSERT_EQ(cache.v.get({page, j % page_size, 0, x}), v_rows.get({r, j, 0, x})) << r << " " << j;
      }
  }
  DenseCase paged(dims, 2405);
  PagedCache cache(k_before, v_before, row_lengths, page_size, 11, 2406);
  const HostTensor past_the_table = int32_tensor({0, 3});
  fh::ForwardParams p = paged.forward();
  p.k = cache.k.view();
  p.v = cache.v.view();
  p.page_table = cache.page_table.view();
  p.cache_seqlens = cache_seqlens.view();
  p.cache_batch_idx = past_the_table.view();
  const fh::Status status = ref::forward(p);
  EXPECT_EQ(status.code, FH_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(status.message.find("cache_batch_idx[1] = 3 is not a row of page_table"), std::string::npos)
      << status.message;
}

// Rotary, by its definition: x' = x cos - y sin, y' = x sin + y cos for the pairs (x, y) = (2i,
// 2i + 1) (interleaved) or (i, i + r/2), at position p of the tables.
void rotate_by_hand(HostTensor* t, int64_t b, int64_t token, int64_t head, int64_t position, const HostTensor& cos,
                    const HostTensor& sin, bool interleaved) {
  const int64_t half = cos.shape()[1];
  for (int64_t i = 0; i < half; ++i) {
    const int64_t ix = interleaved ? 2 * i : i, iy = interleaved ? 2 * i + 1 : i + half;
    const double x = t->get({b, token, head, ix}), y = t->get({b, token, head, iy});
    const double c = cos.get({position, i}), s = sin.get({position, i});
    t->set({b, token, head, ix}, x * c - y * s);
    t->set({b, token, head, iy}, x * s + y * c);
  }
}

// Rotary on the appended keys and q equals the call without it on inputs rotated by hand: keys
// at offset + t, q's rows at offset + i with a mask, all at the offset without one; the cache
// holds the rotated keys. Interleaved or not, a rotary dim below d, offsets from cache_seqlens or
// rotary_seqlens.
TEST(ReferenceIdentities, RotaryIsRotatedInputs) {
  const Dims dims{2, 3, 12, 4, 2, 8, 6};
  const int64_t s_new = 2, positions = 16;
  const std::vector<int32_t> cached = {4, 9}, rotary_start = {1, 6};
  const HostTensor cache_seqlens = int32_tensor(cached), rotary_seqlens = int32_tensor(rotary_start);
  HostTensor angle = random_tensor(FH_DTYPE_FP64, {positions, 3}, 2001);
  HostTensor cos(FH_DTYPE_FP64, {positions, 3}), sin(FH_DTYPE_FP64, {positions, 3});  // rotary_dim 6 < d = 8
  for (int64_t p = 0; p < positions; ++p)
    for (int64_t i = 0; i < 3; ++i) {
      cos.set({p, i}, std::cos(3 * angle.get({p, i})));
      sin.set({p, i}, std::sin(3 * angle.get({p, i})));
    }
  const HostTensor k_new = random_tensor(FH_DTYPE_FP64, {dims.batch, s_new, dims.hkv, dims.d}, 2002);
  const HostTensor v_new = random_tensor(FH_DTYPE_FP64, {dims.batch, s_new, dims.hkv, dims.dv}, 2003);
  for (bool interleaved : {true, false})
    for (int causal : {0, 1})
      for (bool own_offsets : {false, true}) {
        SCOPED_TRACE(testing::Message() << "interleaved " << interleaved << " causal " << causal << " rotary_seqlens "
                                        << own_offsets);
        const std::vector<int32_t>& start = own_offsets ? rotary_start : cached;
        Mask mask;
        mask.causal = causal;
        DenseCase by_hand(dims, 2004), rotary(dims, 2004);
        HostTensor k_rotated = k_new;
        for (int64_t b = 0; b < dims.batch; ++b)
          for (int64_t h = 0; h < dims.hkv; ++h)
            for (int64_t t = 0; t < s_new; ++t)
              rotate_by_hand(&k_rotated, b, t, h, start[b] + t, cos, sin, interleaved);
        for (int64_t b = 0; b < dims.batch; ++b)
          for (int64_t h = 0; h < dims.hq; ++h)
            for (int64_t i = 0; i < dims.sq; ++i)
              rotate_by_hand(&by_hand.q, b, i, h, start[b] + (causal ? i : 0), cos, sin, interleaved);
        fh::ForwardParams e = by_hand.forward(mask);
        e.k_new = k_rotated.view();
        e.v_new = v_new.view();
        e.cache_seqlens = cache_seqlens.view();
        ASSERT_OK(ref::forward(e));

        const HostTensor q_before = rotary.q;
        fh::ForwardParams p = rotary.forward(mask);
        p.k_new = k_new.view();
        p.v_new = v_new.view();
        p.cache_seqlens = cache_seqlens.view();
        p.rotary_cos = cos.view();
        p.rotary_sin = sin.view();
        p.rotary_interleaved = interleaved ? 1 : 0;
        if (own_offsets) p.rotary_seqlens = rotary_seqlens.view();
        ASSERT_OK(ref::forward(p));
        EXPECT_LE(max_abs_diff(rotary.out.view(), by_hand.out.view()), kSameMaths);
        EXPECT_LE(max_abs_diff(rotary.lse.view(), by_hand.lse.view()), kSameMaths);
        EXPECT_LE(max_abs_diff(rotary.k.view(), by_hand.k.view()), kSameMaths) << "the cache holds rotated keys";
        EXPECT_EQ(max_abs_diff(rotary.q.view(), q_before.view()), 0) << "q is not written";
        EXPECT_GT(max_abs_diff(by_hand.q.view(), q_before.view()), 0.01) << "the rotation did something";
      }
}

// Angle 0 everywhere (cos 1, sin 0) is no rotary at all.
TEST(ReferenceIdentities, RotaryOfAngleZeroIsNoRotary) {
  const Dims dims{2, 3, 12, 4, 2, 8, 6};
  HostTensor cos(FH_DTYPE_FP64, {16, 4}), sin(FH_DTYPE_FP64, {16, 4});
  for (int64_t p = 0; p < 16; ++p)
    for (int64_t i = 0; i < 4; ++i) cos.set({p, i}, 1.0);
  const HostTensor cache_seqlens = int32_tensor({4, 9});
  const HostTensor k_new = random_tensor(FH_DTYPE_FP64, {dims.batch, 2, dims.hkv, dims.d}, 2101);
  const HostTensor v_new = random_tensor(FH_DTYPE_FP64, {dims.batch, 2, dims.hkv, dims.dv}, 2102);
  DenseCase plain(dims, 2103), rotary(dims, 2103);
  for (DenseCase* c : {&plain, &rotary}) {
    fh::ForwardParams p = c->forward(Mask{1});
    p.k_new = k_new.view();
    p.v_new = v_new.view();
    p.cache_seqlens = cache_seqlens.view();
    if (c == &rotary) {
      p.rotary_cos = cos.view();
      p.rotary_sin = sin.view();
    }
    ASSERT_OK(ref::forward(p));
  }
  EXPECT_EQ(max_abs_diff(plain.out.view(), rotary.out.view()), 0);
  EXPECT_EQ(max_abs_diff(plain.k.view(), rotary.k.view()), 0);
}

// Packed queries (cu_seqlens_q) against a paged cache: each sequence is its own dense call.
TEST(ReferenceIdentities, VarlenQueriesAgainstPagedCacheArePerSequence) {
  const std::vector<int32_t> rows = {3, 0, 5}, keys = {9, 4, 12};
  const int64_t hq = 4, hkv = 2, d = 8, dv = 6, sk = 12;
  const HostTensor cu_q = int32_tensor({0, 3, 3, 8}), cache_seqlens = int32_tensor(keys);
  HostTensor q = random_tensor(FH_DTYPE_FP64, {8, hq, d}, 2201);
  HostTensor out(FH_DTYPE_FP64, {8, hq, dv}), lse(FH_DTYPE_FP64, {hq, 8});
  const HostTensor k = random_tensor(FH_DTYPE_FP64, {3, sk, hkv, d}, 2202);
  const HostTensor v = random_tensor(FH_DTYPE_FP64, {3, sk, hkv, dv}, 2203);
  const PagedCache cache(k, v, keys, /*page_size=*/4, /*num_pages=*/10, 2204);
  fh::ForwardParams p = fh::default_forward_params();
  p.q = q.view();
  p.k = cache.k.view();
  p.v = cache.v.view();
  p.out = out.view();
  p.lse = lse.view();
  p.cu_seqlens_q = cu_q.view();
  p.max_seqlen_q = 5;
  p.page_table = cache.page_table.view();
  p.cache_seqlens = cache_seqlens.view();
  p.causal = 1;
  ASSERT_OK(ref::forward(p));
  for (int64_t b = 0, row0 = 0; b < 3; row0 += rows[b], ++b) {
    if (rows[b] == 0) continue;
    HostTensor q1(FH_DTYPE_FP64, {1, rows[b], hq, d}), k1(FH_DTYPE_FP64, {1, keys[b], hkv, d});
    HostTensor v1(FH_DTYPE_FP64, {1, keys[b], hkv, dv}), out1(FH_DTYPE_FP64, {1, rows[b], hq, dv});
    for (int64_t i = 0; i < rows[b]; ++i)
      for (int64_t h = 0; h < hq; ++h)
        for (int64_t x = 0; x < d; ++x) q1.set({0, i, h, x}, q.get({row0 + i, h, x}));
    for (int64_t j = 0; j < keys[b]; ++j)
      for (int64_t h = 0; h < hkv; ++h) {
        for (int64_t x = 0; x < d; ++x) k1.set({0, j, h, x}, k.get({b, j, h, x}));
        for (int64_t x = 0; x < dv; ++x) v1.set({0, j, h, x}, v.get({b, j, h, x}));
      }
    fh::ForwardParams one = fh::default_forward_params();
    one.q = q1.view();
    one.k = k1.view();
    one.v = v1.view();
    one.out = out1.view();
    one.causal = 1;
    ASSERT_OK(ref::forward(one));
    for (int64_t i = 0; i < rows[b]; ++i)
      for (int64_t h = 0; h < hq; ++h)
        for (int64_t x = 0; x < dv; ++x)
          ASSERT_EQ(out.get({row0 + i, h, x}), out1.get({0, i, h, x})) << b << " " << i << " " << h;
  }
}

// A packed batch over paged keys (page_table with cu_seqlens_k): sequence b's keys are the first
// cu_seqlens_k[b + 1] - cu_seqlens_k[b] positions of table row b, so the call equals the packed
// one whose sequence b holds those keys, bit for bit; only the prefix sums' differences count
// (they start at 100 here), seqused_k shortens as in a packed batch, and unused pages are noise.
TEST(ReferenceIdentities, PagedPackedBatchIsThePackedOne) {
  VarlenCase packed({0, 4, 4, 11, 14}, {0, 6, 9, 12, 22}, 4, 2, 8, 6, 2601);
  const int64_t batch = packed.batch(), max_keys = 12, page_size = 4;
  std::vector<int32_t> lengths, shifted_cu;
  for (int64_t b = 0; b < batch; ++b) lengths.push_back(packed.cu_k[b + 1] - packed.cu_k[b]);
  for (int32_t at : packed.cu_k) shifted_cu.push_back(at + 100);
  HostTensor dense_k(FH_DTYPE_FP64, {batch, max_keys, packed.hkv, packed.d});
  HostTensor dense_v(FH_DTYPE_FP64, {batch, max_keys, packed.hkv, packed.dv_dim});
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t j = 0; j < lengths[b]; ++j)
      for (int64_t h = 0; h < packed.hkv; ++h) {
        for (int64_t x = 0; x < packed.d; ++x) dense_k.set({b, j, h, x}, packed.k.get({packed.cu_k[b] + j, h, x}));
        for (int64_t x = 0; x < packed.dv_dim; ++x)
          dense_v.set({b, j, h, x}, packed.v.get({packed.cu_k[b] + j, h, x}));
      }
  const PagedCache cache(dense_k, dense_v, lengths, page_size, /*num_pages=*/16, 2602);
  const HostTensor cu_k = int32_tensor(shifted_cu), seqused_k = int32_tensor({5, 0, 3, 10});
  for (const bool used : {false, true}) {
    for (const Mask& mask : {Mask{}, Mask{1}, Mask{0, 3, 1, 1, 5.0f}}) {
      SCOPED_TRACE(testing::Message() << "seqused_k " << used << " causal " << mask.causal);
      fh::ForwardParams f = packed.forward(mask);
      if (used) f.seqused_k = seqused_k.view();
      ASSERT_OK(ref::forward(f));
      HostTensor out(FH_DTYPE_FP64, packed.out.shape()), lse(FH_DTYPE_FP64, packed.lse.shape());
      fh::ForwardParams p = f;
      p.k = cache.k.view();
      p.v = cache.v.view();
      p.page_table = cache.page_table.view();
      p.cu_seqlens_k = cu_k.view();
      p.out = out.view();
      p.lse = lse.view();
      ASSERT_OK(ref::forward(p));
      EXPECT_EQ(max_abs_diff(out.view(), packed.out.view()), 0);
      EXPECT_EQ(max_abs_diff(lse.view(), packed.lse.view()), 0);
    }
  }
  // A sequence longer than its table row holds is refused by name.
  const HostTensor too_long = int32_tensor({100, 106, 109, 112, 125});
  HostTensor out(FH_DTYPE_FP64, packed.out.shape());
  fh::ForwardParams p = packed.forward();
  p.k = cache.k.view();
  p.v = cache.v.view();
  p.page_table = cache.page_table.view();
  p.cu_seqlens_k = too_long.view();
  p.out = out.view();
  p.lse = {};
  const fh::Status status = ref::forward(p);
  EXPECT_EQ(status.code, FH_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(status.message.find("sequence 3: 13 cache positions used"), std::string::npos) << status.message;
}

TEST(ReferenceRefusals, KvCacheExtrasOutOfRangeAreRefused) {
  const Dims dims{2, 3, 12, 4, 2, 8, 6};
  const HostTensor cache_seqlens = int32_tensor({4, 9});
  const HostTensor k_new = random_tensor(FH_DTYPE_FP64, {dims.batch, 2, dims.hkv, dims.d}, 2301);
  const HostTensor v_new = random_tensor(FH_DTYPE_FP64, {dims.batch, 2, dims.hkv, dims.dv}, 2302);
  HostTensor cos(FH_DTYPE_FP64, {10, 4}), sin(FH_DTYPE_FP64, {10, 4});  // positions up to 9 only
  struct Case {
    const char* what;
    HostTensor batch_idx, leftpad;
    bool rotary;
    const char* keyword;
  };
  const Case cases[] = {
      {"cache row out of range", int32_tensor({0, 2}), {}, false, "cache_batch_idx[1] = 2"},
      {"leftpad past the cached keys", {}, int32_tensor({5, 0}), false, "cache_leftpad[0] = 5"},
      {"rotary past the table", {}, {}, true, "rotary positions 9..10"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    DenseCase dense(dims, 2303);
    const HostTensor k_before = dense.k;
    fh::ForwardParams p = dense.forward();
    p.k_new = k_new.view();
    p.v_new = v_new.view();
    p.cache_seqlens = cache_seqlens.view();
    if (!c.batch_idx.shape().empty()) p.cache_batch_idx = c.batch_idx.view();
    if (!c.leftpad.shape().empty()) p.cache_leftpad = c.leftpad.view();
    if (c.rotary) {
      p.rotary_cos = cos.view();
      p.rotary_sin = sin.view();
    }
    const fh::Status status = ref::forward(p);
    EXPECT_EQ(status.code, FH_ERROR_INVALID_ARGUMENT);
    EXPECT_NE(status.message.find(c.keyword), std::string::npos) << status.message;
    EXPECT_EQ(max_abs_diff(dense.k.view(), k_before.view()), 0) << "nothing appended";
  }
}


// ---- fp8 (e4m3) ------------------------------------------------------------------------------------

using flashhopper::reference::double_to_e4m3_bits;
using flashhopper::reference::e4m3_bits_to_float;
using flashhopper::reference::round_to_e4m3;
using fh::test::for_each_index;

// Every e4m3 bit pattern decodes and encodes back to itself (NaN to the canonical 0x7F), and the
// rounding ties to even between neighbours; beyond 448 is NaN (no inf in e4m3fn).
TEST(ReferenceHostDtype, E4m3RoundTripsAndRounds) {
  for (int bits = 0; bits < 256; ++bits) {
    const float x = e4m3_bits_to_float(uint8_t(bits));
    if (std::isnan(x)) {
      EXPECT_EQ(bits & 0x7F, 0x7F) << bits;
      continue;
    }
    EXPECT_EQ(double_to_e4m3_bits(x), bits == 0x80 ? 0x80 : bits) << bits;  // -0 stays -0
  }
  EXPECT_EQ(e4m3_bits_to_float(0x7E), 448.f);
  EXPECT_EQ(e4m3_bits_to_float(0x01), std::ldexp(1.f, -9));  // smallest subnormal
  EXPECT_EQ(e4m3_bits_to_float(0x08), std::ldexp(1.f, -6));  // smallest normal
  EXPECT_EQ(round_to_e4m3(1.0625), 1.0);    // halfway between 1 and 1.125: to even (1)
  EXPECT_EQ(round_to_e4m3(1.1875), 1.25);   // halfway between 1.125 and 1.25: to even (1.25)
  EXPECT_EQ(round_to_e4m3(0.0009765625), 0.0);  // 2^-10, half the smallest subnormal: to even (0)
  EXPECT_TRUE(std::isnan(round_to_e4m3(1000.0)));
}

// fp8 q, k, v with descale factors [B, Hkv] are the exact call on the dequantised values
// (stored value times its head's factor), whatever the mask.
TEST(ReferenceIdentities, Fp8IsDequantisedExact) {
  const Dims n{2, 5, 9, 4, 2, 8, 6};
  const HostTensor q8 = random_tensor(FH_DTYPE_FP8_E4M3, {n.batch, n.sq, n.hq, n.d}, 2401);
  const HostTensor k8 = random_tensor(FH_DTYPE_FP8_E4M3, {n.batch, n.sk, n.hkv, n.d}, 2402);
  const HostTensor v8 = random_tensor(FH_DTYPE_FP8_E4M3, {n.batch, n.sk, n.hkv, n.dv}, 2403);
  std::array<HostTensor, 3> descale;
  for (int i = 0; i < 3; ++i) {  // in [0.5, 2)
    descale[i] = HostTensor(FH_DTYPE_FP32, {n.batch, n.hkv});
    for (int64_t b = 0; b < n.batch; ++b)
      for (int64_t h = 0; h < n.hkv; ++h) descale[i].set({b, h}, 0.5 + 0.25 * double((b * 7 + h * 3 + i) % 6));
  }
  for (const Mask& mask : {Mask{}, Mask{1}, Mask{0, 2, 1, 1, 3.0f}}) {
    DenseCase dequantised(n, 2404);
    const int64_t group = n.hq / n.hkv;
    for_each_index({n.batch, n.sq, n.hq, n.d}, [&](const std::vector<int64_t>& i) {
      dequantised.q.set(i, q8.get(i) * descale[0].get({i[0], i[2] / group}));
    });
    for_each_index({n.batch, n.sk, n.hkv, n.d}, [&](const std::vector<int64_t>& i) {
      dequantised.k.set(i, k8.get(i) * descale[1].get({i[0], i[2]}));
    });
    for_each_index({n.batch, n.sk, n.hkv, n.dv}, [&](const std::vector<int64_t>& i) {
      dequantised.v.set(i, v8.get(i) * descale[2].get({i[0], i[2]}));
    });
    ASSERT_OK(ref::forward(dequantised.forward(mask)));
    DenseCase fp8(n, 2404);
    fh::ForwardParams p = fp8.forward(mask);
    p.q = q8.view();
    p.k = k8.view();
    p.v = v8.view();
    p.q_descale = descale[0].view();
    p.k_descale = descale[1].view();
    p.v_descale = descale[2].view();
    ASSERT_OK(ref::forward(p));
    EXPECT_LE(max_abs_diff(fp8.out.view(), dequantised.out.view()), kSameMaths);
    EXPECT_LE(max_abs_diff(fp8.lse.view(), dequantised.lse.view()), kSameMaths);
  }
}

// The plain fp8 implementation (P in e4m3, O in bf16) is further from the exact result than the
// bf16 one on the same values, and not wildly: the yardstick fp8 kernels are held to.
TEST(ReferenceLowPrecision, Fp8EmulationErrorIsPlausible) {
  const Dims n{1, 64, 128, 2, 1, 64, 64};
  const HostTensor q8 = random_tensor(FH_DTYPE_FP8_E4M3, {n.batch, n.sq, n.hq, n.d}, 2501);
  const HostTensor k8 = random_tensor(FH_DTYPE_FP8_E4M3, {n.batch, n.sk, n.hkv, n.d}, 2502);
  const HostTensor v8 = random_tensor(FH_DTYPE_FP8_E4M3, {n.batch, n.sk, n.hkv, n.dv}, 2503);
  HostTensor q16(FH_DTYPE_BF16, {n.batch, n.sq, n.hq, n.d}), k16(FH_DTYPE_BF16, {n.batch, n.sk, n.hkv, n.d});
  HostTensor v16(FH_DTYPE_BF16, {n.batch, n.sk, n.hkv, n.dv});
  for (auto [from, to] : {std::pair{&q8, &q16}, {&k8, &k16}, {&v8, &v16}})  // e4m3 values are bf16 values
    for_each_index(from->shape(), [&](const std::vector<int64_t>& i) { to->set(i, from->get(i)); });
  ref::Options emulate;
  emulate.emulate_low_precision = true;
  std::array<double, 3> err{};
  HostTensor exact(FH_DTYPE_FP64, {n.batch, n.sq, n.hq, n.dv});
  for (int run = 0; run < 3; ++run) {
    DenseCase c(n, 2504);
    fh::ForwardParams p = c.forward(Mask{1});
    p.q = run == 2 ? q16.view() : q8.view();
    p.k = run == 2 ? k16.view() : k8.view();
    p.v = run == 2 ? v16.view() : v8.view();
    ASSERT_OK(ref::forward(p, run == 0 ? ref::Options{} : emulate));
    if (run == 0) exact = c.out;
    err[run] = max_abs_diff(c.out.view(), exact.view());
  }
  EXPECT_EQ(err[0], 0);
  EXPECT_GT(err[1], err[2]) << "fp8 emulation " << err[1] << ", bf16 " << err[2];
  EXPECT_GT(err[2], 0);
  EXPECT_LT(err[1], 0.1);
}

TEST(ReferenceRefusals, DescalesNeedFp8AndTheirShape) {
  const Dims n{2, 5, 9, 4, 2, 8, 6};
  DenseCase c(n, 2601);
  HostTensor descale(FH_DTYPE_FP32, {n.batch, n.hkv}), wrong(FH_DTYPE_FP32, {n.batch, n.hq});
  fh::ForwardParams p = c.forward();
  p.k_descale = descale.view();
  fh::Status status = ref::forward(p);  // fp64 q
  EXPECT_EQ(status.code, FH_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(status.message.find("k_descale: is given but q is float64"), std::string::npos) << status.message;
  const HostTensor q8 = random_tensor(FH_DTYPE_FP8_E4M3, {n.batch, n.sq, n.hq, n.d}, 2602);
  const HostTensor k8 = random_tensor(FH_DTYPE_FP8_E4M3, {n.batch, n.sk, n.hkv, n.d}, 2603);
  const HostTensor v8 = random_tensor(FH_DTYPE_FP8_E4M3, {n.batch, n.sk, n.hkv, n.dv}, 2604);
  p.q = q8.view();
  p.k = k8.view();
  p.v = v8.view();
  p.k_descale = wrong.view();
  status = ref::forward(p);
  EXPECT_EQ(status.code, FH_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(status.message.find("k_descale"), std::string::npos) << status.message;
}


TEST(ReferenceSpeed, Forward2kBy2k16HeadsHeadDim128) {
  const Dims dims{1, 2048, 2048, 16, 16, 128, 128};
  const HostTensor q = random_tensor(FH_DTYPE_BF16, {1, 2048, 16, 128}, 351);
  const HostTensor k = random_tensor(FH_DTYPE_BF16, {1, 2048, 16, 128}, 352);
  const HostTensor v = random_tensor(FH_DTYPE_BF16, {1, 2048, 16, 128}, 353);
  HostTensor out(FH_DTYPE_FP32, {1, 2048, 16, 128}), lse(FH_DTYPE_FP32, {1, 16, 2048});
  fh::ForwardParams f = fh::default_forward_params();
  f.q = q.view();
  f.k = k.view();
  f.v = v.view();
  f.out = out.view();
  f.lse = lse.view();
  for (bool emulate : {false, true}) {
    ref::Options options;
    options.emulate_low_precision = emulate;
    const auto start = std::chrono::steady_clock::now();
    ASSERT_OK(ref::forward(f, options));
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::printf("[ speed ] reference forward %s, B=1 sq=sk=2048 H=16 d=128, %u threads: %.2f s\n",
                emulate ? "emulated bf16" : "exact", std::thread::hardware_concurrency(), seconds);
  }
  (void)dims;
}

// ---- Decoding with GQA as the kernels run it (plan/packed_decode.hpp) ---------------------------

// One query token per sequence: the query heads of a KV head read as the rows of one head (strided
// views of q, out and lse) give the same attention, over a KV cache with its extras, causal or
// not, a right bound, softcap; the calls the rewrite does not hold for are left as they are.
TEST(PackedDecode, QueryHeadsAsRowsIsTheSameAttention) {
  const int64_t batch = 3, heads_q = 8, heads_kv = 2, d = 16, dv = 8, cache_rows = 4, cache_len = 40;
  const HostTensor q = random_tensor(FH_DTYPE_FP64, {batch, 1, heads_q, d}, 2101);
  const HostTensor k = random_tensor(FH_DTYPE_FP64, {cache_rows, cache_len, heads_kv, d}, 2102);
  const HostTensor v = random_tensor(FH_DTYPE_FP64, {cache_rows, cache_len, heads_kv, dv}, 2103);
  const HostTensor lengths = int32_tensor({40, 0, 17}), firsts = int32_tensor({3, 0, 17});
  const HostTensor rows = int32_tensor({2, 0, 3});
  struct Variant {
    const char* name;
    int causal, window_right;
    float softcap;
  };
  for (const Variant& m : {Variant{"none", 0, -1, 0.f}, Variant{"causal", 1, -1, 0.f},
                           Variant{"right bound", 0, 5, 0.f}, Variant{"softcap", 1, -1, 7.f}}) {
    SCOPED_TRACE(m.name);
    HostTensor out(FH_DTYPE_FP64, {batch, 1, heads_q, dv}), lse(FH_DTYPE_FP64, {batch, heads_q, 1});
    fh::ForwardParams p = fh::default_forward_params();
    p.q = q.view();
    p.k = k.view();
    p.v = v.view();
    p.out = out.view();
    p.lse = lse.view();
    p.cache_seqlens = lengths.view();
    p.cache_leftpad = firsts.view();
    p.cache_batch_idx = rows.view();
    p.causal = m.causal;
    p.window_right = m.window_right;
    p.softcap = m.softcap;
    ASSERT_OK(ref::forward(p));
    const fh::detail::KernelCall call = fh::detail::kernel_call(p, fh::detail::forward_shape(p));
    EXPECT_EQ(call.shape.seqlen_q, heads_q / heads_kv);
    EXPECT_EQ(call.shape.heads_q, heads_kv);
    EXPECT_FALSE(fh::detail::mask_spec(call.params).is_masked());
    HostTensor packed_out(FH_DTYPE_FP64, out.shape()), packed_lse(FH_DTYPE_FP64, lse.shape());
    fh::ForwardParams packed = call.params;  // the same views, into fresh outputs
    packed.out.data = packed_out.view().data;
    packed.lse.data = packed_lse.view().data;
    ASSERT_OK(ref::forward(packed));
    EXPECT_LE(max_abs_diff(packed_out.view(), out.view()), kSameMaths);
    EXPECT_LE(max_abs_diff(packed_lse.view(), lse.view()), kSameMaths);
  }
  {  // qv (absorbed MLA decode) takes the view of q, its rows as q's
    SCOPED_TRACE("qv");
    const HostTensor qv = random_tensor(FH_DTYPE_FP64, {batch, 1, heads_q, dv}, 2106);
    HostTensor out(FH_DTYPE_FP64, {batch, 1, heads_q, dv}), lse(FH_DTYPE_FP64, {batch, heads_q, 1});
    fh::ForwardParams p = fh::default_forward_params();
    p.q = q.view();
    p.qv = qv.view();
    p.k = k.view();
    p.v = v.view();
    p.out = out.view();
    p.lse = lse.view();
    p.cache_seqlens = lengths.view();
    p.cache_batch_idx = rows.view();
    p.causal = 1;
    ASSERT_OK(ref::forward(p));
    const fh::detail::KernelCall call = fh::detail::kernel_call(p, fh::detail::forward_shape(p));
    EXPECT_EQ(call.params.qv.shape[1], heads_q / heads_kv);
    EXPECT_EQ(call.params.qv.stride[2], call.params.qv.stride[1] * (heads_q / heads_kv));
    HostTensor packed_out(FH_DTYPE_FP64, out.shape()), packed_lse(FH_DTYPE_FP64, lse.shape());
    fh::ForwardParams packed = call.params;
    packed.out.data = packed_out.view().data;
    packed.lse.data = packed_lse.view().data;
    ASSERT_OK(ref::forward(packed));
    EXPECT_LE(max_abs_diff(packed_out.view(), out.view()), kSameMaths);
    EXPECT_LE(max_abs_diff(packed_lse.view(), lse.view()), kSameMaths);
    fh::ForwardParams no_qv = p;  // and qv matters: the same call without it differs
    HostTensor plain_out(FH_DTYPE_FP64, out.shape());
    no_qv.qv = fh::Tensor{};
    no_qv.out = plain_out.view();
    no_qv.lse = fh::Tensor{};
    ASSERT_OK(ref::forward(no_qv));
    EXPECT_GT(max_abs_diff(plain_out.view(), out.view()), 1e-3);
  }
  // Left as they are: no GQA, a left window, a learnable sink; two query rows over these 40 keys
  // (fewer than the several-token rewrite below packs).
  fh::ForwardParams p = fh::default_forward_params();
  HostTensor out(FH_DTYPE_FP64, {batch, 1, heads_q, dv});
  p.q = q.view();
  p.k = k.view();
  p.v = v.view();
  p.out = out.view();
  const HostTensor sink = random_tensor(FH_DTYPE_FP32, {heads_q}, 2104);
  HostTensor q2 = random_tensor(FH_DTYPE_FP64, {batch, 2, heads_q, d}, 2105);
  HostTensor out2(FH_DTYPE_FP64, {batch, 2, heads_q, dv});
  fh::ForwardParams two_rows = p, left_window = p, with_sink = p, tokens_used = p;
  two_rows.q = q2.view();
  two_rows.out = out2.view();
  left_window.window_left = 10;
  with_sink.learnable_sink = sink.view();
  const HostTensor used = int32_tensor({1, 0, 1});  // seqused_q counts tokens; packed, rows
  tokens_used.seqused_q = used.view();
  for (const fh::ForwardParams& kept : {two_rows, left_window, with_sink, tokens_used}) {
    const fh::detail::KernelCall call = fh::detail::kernel_call(kept, fh::detail::forward_shape(kept));
    EXPECT_EQ(call.shape.heads_q, heads_q);
    EXPECT_EQ(call.params.q.stride[2], kept.q.stride[2]);
  }
}

// Whether a query at key position pos sees key j under a window and chunk mask (no sink tokens),
// the packed decode tests' own statement of the rule (causal: a right bound of 0).
bool position_sees_key(const fh::detail::MaskSpec& mask, int64_t pos, int64_t j) {
  const bool left = mask.window_left < 0 || j >= pos - mask.window_left;
  const bool right = mask.window_right < 0 || j <= pos + mask.window_right;
  const int64_t chunk0 = mask.attention_chunk > 0 ? pos / mask.attention_chunk * mask.attention_chunk : 0;
  const bool chunk = mask.attention_chunk == 0 || (j >= chunk0 && j < chunk0 + mask.attention_chunk);
  return left && right && chunk;
}

// Several query tokens on one KV head (MQA, absorbed MLA, speculative decoding): the tokens' query
// heads as the rows of one head, row r being token r / Hq's head r % Hq, its position for the mask
// r / Hq + sk - sq (AttentionMask's kGroupedRows). The views name the same elements, and attention
// row by row over them with that position gives the call's out, and its lse where the epilogue
// writes row r's (the lse as given, at head r % Hq and token r / Hq); with several KV heads or heads
// not adjacent to tokens the call is left as it is.
TEST(PackedDecode, SeveralTokensOfOneKvHeadAsRowsIsTheSameAttention) {
  const int64_t batch = 2, sq = 3, heads_q = 4, sk = 11, d = 8, dv = 16;
  const HostTensor q = random_tensor(FH_DTYPE_FP64, {batch, sq, heads_q, d}, 2111);
  const HostTensor qv = random_tensor(FH_DTYPE_FP64, {batch, sq, heads_q, dv}, 2112);
  const HostTensor k = random_tensor(FH_DTYPE_FP64, {batch, sk, 1, d}, 2113);
  const HostTensor v = random_tensor(FH_DTYPE_FP64, {batch, sk, 1, dv}, 2114);
  struct Variant {
    const char* name;
    int causal, window_left, window_right, chunk;
    bool with_qv;
  };
  for (const Variant& m : {Variant{"none", 0, -1, -1, 0, true}, Variant{"causal", 1, -1, -1, 0, true},
                           Variant{"window", 0, 4, 1, 0, true}, Variant{"chunk", 1, -1, -1, 5, true}}) {
    SCOPED_TRACE(m.name);
    HostTensor out(FH_DTYPE_FP64, {batch, sq, heads_q, dv}), lse(FH_DTYPE_FP64, {batch, heads_q, sq});
    fh::ForwardParams p = fh::default_forward_params();
    p.q = q.view();
    p.k = k.view();
    p.v = v.view();
    p.out = out.view();
    p.lse = lse.view();
    if (m.with_qv) p.qv = qv.view();
    p.causal = m.causal;
    p.window_left = m.window_left;
    p.window_right = m.window_right;
    p.attention_chunk = m.chunk;
    p.softmax_scale = 0.5f;
    ASSERT_OK(ref::forward(p));
    const fh::detail::KernelCall call = fh::detail::kernel_call(p, fh::detail::forward_shape(p));
    ASSERT_EQ(call.shape.rows_per_token, heads_q);
    ASSERT_EQ(call.shape.seqlen_q, sq * heads_q);
    ASSERT_EQ(call.shape.heads_q, 1);
    for (int i = 0; i < 3; ++i) {  // the lse as given
      EXPECT_EQ(call.params.lse.shape[i], p.lse.shape[i]);
      EXPECT_EQ(call.params.lse.stride[i], p.lse.stride[i]);
    }
    const fh::detail::MaskSpec mask = fh::detail::mask_spec(call.params);
    HostTensor packed_out(FH_DTYPE_FP64, out.shape()), packed_lse(FH_DTYPE_FP64, lse.shape());
    fh::Tensor packed_o = call.params.out;
    packed_o.data = packed_out.view().data;
    for (int64_t b = 0; b < batch; ++b) {
      for (int64_t r = 0; r < call.shape.seqlen_q; ++r) {
        const int64_t token = r / heads_q, head = r % heads_q;
        const int64_t pos = r / call.shape.rows_per_token + sk - sq;  // the kernels' position of row r
        std::vector<double> scores(sk, -INFINITY);
        double max_score = -INFINITY;
        for (int64_t j = 0; j < sk; ++j) {
          if (!position_sees_key(mask, pos, j)) continue;
          double s = 0;
          for (int64_t c = 0; c < d; ++c) {
            const double qe = fh::test::read(call.params.q, {b, r, 0, c});
            ASSERT_EQ(qe, q.get({b, token, head, c}));  // the view names the token's head
            s += qe * k.get({b, j, 0, c});
          }
          for (int64_t c = 0; m.with_qv && c < dv; ++c) s += fh::test::read(call.params.qv, {b, r, 0, c}) * v.get({b, j, 0, c});
          scores[j] = s * 0.5;
          max_score = std::max(max_score, scores[j]);
        }
        double sum = 0;
        for (double& s : scores) sum += (s = std::exp(s - max_score));
        const int64_t g = call.shape.rows_per_token;
        packed_lse.set({b, r % g, r / g}, max_score + std::log(sum));
        for (int64_t c = 0; c < dv; ++c) {
          double o = 0;
          for (int64_t j = 0; j < sk; ++j) o += scores[j] / sum * v.get({b, j, 0, c});
          fh::test::write(packed_o, {b, r, 0, c}, o);
        }
      }
    }
    EXPECT_LE(max_abs_diff(packed_out.view(), out.view()), 1e-12);
    EXPECT_LE(max_abs_diff(packed_lse.view(), lse.view()), 1e-12);
  }
  // Left as they are (with qv): two KV heads, heads not adjacent to tokens (q [B, Hq, sq, d] seen as
  // [B, sq, Hq, d]), more tokens than kMostTokensPacked (a prefill: the dense kernels). Without qv
  // (MQA) such calls take the rewrite of the test below.
  HostTensor out(FH_DTYPE_FP64, {batch, sq, heads_q, dv});
  const HostTensor k2 = random_tensor(FH_DTYPE_FP64, {batch, sk, 2, d}, 2115);
  const HostTensor v2 = random_tensor(FH_DTYPE_FP64, {batch, sk, 2, dv}, 2116);
  fh::ForwardParams p = fh::default_forward_params();
  p.q = q.view();
  p.qv = qv.view();
  p.k = k.view();
  p.v = v.view();
  p.out = out.view();
  const HostTensor qv_long = random_tensor(FH_DTYPE_FP64, {batch, fh::detail::kMostTokensPacked + 1, heads_q, dv}, 2118);
  const HostTensor q_long = random_tensor(FH_DTYPE_FP64, {batch, fh::detail::kMostTokensPacked + 1, heads_q, d}, 2117);
  HostTensor out_long(FH_DTYPE_FP64, {batch, fh::detail::kMostTokensPacked + 1, heads_q, dv});
  fh::ForwardParams two_kv_heads = p, heads_outer = p, long_prefill = p;
  long_prefill.q = q_long.view();
  long_prefill.qv = qv_long.view();
  long_prefill.out = out_long.view();
  two_kv_heads.k = k2.view();
  two_kv_heads.v = v2.view();
  std::swap(heads_outer.q.stride[1], heads_outer.q.stride[2]);
  std::swap(heads_outer.qv.stride[1], heads_outer.qv.stride[2]);
  for (const fh::ForwardParams& kept : {two_kv_heads, heads_outer, long_prefill}) {
    const fh::detail::KernelCall call = fh::detail::kernel_call(kept, fh::detail::forward_shape(kept));
    EXPECT_EQ(call.shape.rows_per_token, 1);
    EXPECT_EQ(call.shape.heads_q, heads_q);
  }
}

// A row of one split's partials, as the kernels write them (here in double): from the row's
// scaled scores (-inf where it sees no key) its LSE, returned, and O = softmax(scores) V into o,
// value(j, c) reading V.
template <class Value>
double partial_row(std::vector<double> scores, int64_t dv, const Value& value, double* o) {
  double max_score = -INFINITY;
  for (double s : scores) max_score = std::max(max_score, s);
  double sum = 0;
  for (double& s : scores) sum += (s = std::exp(s - max_score));
  for (int64_t c = 0; c < dv; ++c) {
    double acc = 0;
    for (size_t j = 0; j < scores.size(); ++j) acc += scores[j] / sum * value(int64_t(j), c);
    o[c] = acc;
  }
  return max_score + std::log(sum);
}

// The combine of one split's grouped partials (detail::grouped_partials' strides) against the
// reference's out and lse: the largest differences {out, lse} over batches x query heads x
// tokens, lse_at(b, h, t) and out_at(b, t, h, c) reading the reference.
template <class LseAt, class OutAt>
std::pair<double, double> grouped_combine_errors(const fh::detail::GroupedPartials& strides,
                                                 const std::vector<double>& o_partial,
                                                 const std::vector<double>& lse_partial, int64_t batch,
                                                 int64_t heads_q, int64_t ratio, int64_t tokens, int64_t dv,
                                                 const LseAt& lse_at, const OutAt& out_at) {
  double out_error = 0, lse_error = 0;
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t h = 0; h < heads_q; ++h)
      for (int64_t t = 0; t < tokens; ++t) {
        const int64_t group = h / ratio, within = h % ratio;
        const int64_t l = b * strides.lse[1] + group * strides.lse[2] + within * strides.lse[3] + t * strides.lse[4];
        lse_error = std::max(lse_error, std::abs(lse_partial[size_t(l)] - lse_at(b, h, t)));
        for (int64_t c = 0; c < dv; ++c) {
          const int64_t o = b * strides.out[1] + group * strides.out[2] + within * strides.out[3] +
                            t * strides.out[4] + c * strides.out[5];
          out_error = std::max(out_error, std::abs(o_partial[size_t(o)] - out_at(b, t, h, c)));
        }
      }
  return {out_error, lse_error};
}

// Several query tokens without qv (speculative decoding with GQA or MQA): KV head g's rows
// r = t * G + j (G the ratio rounded up to a power of two) are token t's query head g * ratio + j
// for j < ratio and zeros past it, gathered (several KV heads, heads not adjacent to tokens, or
// padding) into [B, Hkv, sq, G, d] as the call's q views it, positions r >> log2(G) + sk - sq
// (RowGrouping::kShift). The kernels write float32 partials [1, B, Hkv, rows, dv] (one split),
// which the combine reads through grouped_partials into out and lse as given: that path gives the
// reference's attention.
TEST(PackedDecode, SeveralTokensOfEachKvHeadGatheredAsRowsIsTheSameAttention) {
  const int64_t batch = 2, sq = 3, sk = fh::detail::kFewestKeysGathered, d = 8, dv = 16;
  struct Shape {
    int64_t heads_q, heads_kv;
    bool heads_outer;  // q [B, Hq, sq, d] seen as [B, sq, Hq, d]: gathered even with one KV head
  };
  // Ratios 4, 1 (as one head's rows, or gathered), 3 and 7 (rows padded to 4 and 8 a token).
  for (const Shape& h : {Shape{8, 2, false}, Shape{4, 1, false}, Shape{4, 1, true}, Shape{16, 4, true},
                         Shape{6, 2, false}, Shape{7, 1, false}}) {
    SCOPED_TRACE(std::to_string(h.heads_q) + "/" + std::to_string(h.heads_kv) +
                 (h.heads_outer ? " heads outer" : ""));
    const int64_t ratio = h.heads_q / h.heads_kv, group = ratio == 3 ? 4 : ratio == 7 ? 8 : ratio;
    HostTensor q = random_tensor(FH_DTYPE_FP64, {batch, sq, h.heads_q, d}, 2121);
    fh::Tensor q_view = q.view();
    if (h.heads_outer) {
      q = random_tensor(FH_DTYPE_FP64, {batch, h.heads_q, sq, d}, 2121);
      q_view = q.view();
      std::swap(q_view.shape[1], q_view.shape[2]);
      std::swap(q_view.stride[1], q_view.stride[2]);
    }
    const HostTensor k = random_tensor(FH_DTYPE_FP64, {batch, sk, h.heads_kv, d}, 2122);
    const HostTensor v = random_tensor(FH_DTYPE_FP64, {batch, sk, h.heads_kv, dv}, 2123);
    Mask none, causal, window, chunk;
    none.scale = causal.scale = window.scale = chunk.scale = 0.5f;
    causal.causal = chunk.causal = 1;
    window.window_left = 4;
    window.window_right = 1;
    chunk.chunk = 5;
    for (const auto& [name, m] : {std::pair{"none", none}, std::pair{"causal", causal}, std::pair{"window", window},
                                  std::pair{"chunk", chunk}}) {
      SCOPED_TRACE(name);
      HostTensor out(FH_DTYPE_FP64, {batch, sq, h.heads_q, dv}), lse(FH_DTYPE_FP64, {batch, h.heads_q, sq});
      fh::ForwardParams p = fh::default_forward_params();
      p.q = q_view;
      p.k = k.view();
      p.v = v.view();
      p.out = out.view();
      p.lse = lse.view();
      apply(m, &p);
      ASSERT_OK(ref::forward(p));
      const fh::detail::ProblemShape given = fh::detail::forward_shape(p);
      fh::detail::KernelCall call = fh::detail::kernel_call(p, given);
      ASSERT_TRUE(call.combine_always);
      ASSERT_EQ(call.shape.rows_per_token, group);
      ASSERT_EQ(call.shape.seqlen_q, sq * group);
      ASSERT_EQ(call.shape.heads_q, h.heads_kv);
      ASSERT_FALSE(fh::detail::present(call.params.lse));  // the combine writes it
      const int64_t rows = call.shape.seqlen_q;
      HostTensor gathered(FH_DTYPE_FP64, {batch, h.heads_kv, sq, group, d});  // zeros past the ratio
      if (fh::detail::present(call.gather_source)) {  // QueryGatherKernel's copy, element by element
        ASSERT_EQ(call.params.q.data, nullptr);      // bound at run time
        for (int64_t b = 0; b < batch; ++b)
          for (int64_t g = 0; g < h.heads_kv; ++g)
            for (int64_t t = 0; t < sq; ++t)
              for (int64_t j = 0; j < ratio; ++j)
                for (int64_t c = 0; c < d; ++c)
                  gathered.set({b, g, t, j, c}, fh::test::read(call.gather_source, {b, t, g * ratio + j, c}));
        call.params.q.data = gathered.view().data;
      } else {
        ASSERT_FALSE(h.heads_kv > 1 || h.heads_outer || group != ratio);
      }
      // The kernels: one split's partials, rows of each KV head, positions shifted.
      const int shift = fh::detail::rows_per_token_log2(call.shape);
      const fh::detail::MaskSpec mask = fh::detail::mask_spec(call.params);
      const size_t partial_rows = size_t(batch * h.heads_kv * rows);
      std::vector<double> o_partial(partial_rows * size_t(dv)), lse_partial(partial_rows);
      for (int64_t b = 0; b < batch; ++b) {
        for (int64_t g = 0; g < h.heads_kv; ++g) {
          for (int64_t r = 0; r < rows; ++r) {
            const int64_t pos = (r >> shift) + sk - sq;
            std::vector<double> scores(sk, -INFINITY);
            for (int64_t j = 0; j < sk; ++j) {
              if (!position_sees_key(mask, pos, j)) continue;
              double s = 0;
              for (int64_t c = 0; c < d; ++c) {
                const double qe = fh::test::read(call.params.q, {b, r, g, c});
                const int64_t j_row = r % group;  // the token's head, or padding
                ASSERT_EQ(qe, j_row < ratio ? fh::test::read(p.q, {b, r / group, g * ratio + j_row, c}) : 0.0);
                s += qe * k.get({b, j, g, c});
              }
              scores[j] = s * 0.5;
            }
            const int64_t row = (b * h.heads_kv + g) * rows + r;
            auto value = [&](int64_t j, int64_t c) { return v.get({b, j, g, c}); };
            lse_partial[size_t(row)] = partial_row(scores, dv, value, &o_partial[size_t(row * dv)]);
          }
        }
      }
      // The combine (one split: its partials as they are), through the grouped strides.
      const fh::detail::GroupedPartials strides = fh::detail::grouped_partials(given, call.shape.rows_per_token);
      const auto [out_error, lse_error] = grouped_combine_errors(
          strides, o_partial, lse_partial, batch, h.heads_q, ratio, sq, dv,
          [&](int64_t b, int64_t hq, int64_t t) { return lse.get({b, hq, t}); },
          [&](int64_t b, int64_t t, int64_t hq, int64_t c) { return out.get({b, t, hq, c}); });
      EXPECT_LE(out_error, 1e-12);
      EXPECT_LE(lse_error, 1e-12);
    }
  }
  // At a ratio of 2: a learnable sink (a logit a query head), qv with two KV heads, fewer keys than
  // kFewestKeysGathered and seqused_q over dense queries: as they are.
  const HostTensor q4 = random_tensor(FH_DTYPE_FP64, {batch, sq, 4, d}, 2127);
  const HostTensor k2 = random_tensor(FH_DTYPE_FP64, {batch, sk, 2, d}, 2125);
  HostTensor out4(FH_DTYPE_FP64, {batch, sq, 4, d});
  const HostTensor sink = random_tensor(FH_DTYPE_FP32, {4}, 2126);
  fh::ForwardParams with_sink = fh::default_forward_params();
  with_sink.q = q4.view();
  with_sink.k = k2.view();
  with_sink.v = k2.view();
  with_sink.out = out4.view();
  fh::ForwardParams with_qv = with_sink, few_keys = with_sink, tokens_used = with_sink;
  with_sink.learnable_sink = sink.view();
  with_qv.qv = q4.view();
  const HostTensor k_short = random_tensor(FH_DTYPE_FP64, {batch, sk - 1, 2, d}, 2128);
  few_keys.k = k_short.view();
  few_keys.v = k_short.view();
  const HostTensor used = int32_tensor({3, 2});  // tokens of dense queries: not rows
  tokens_used.seqused_q = used.view();
  for (const fh::ForwardParams& kept : {with_sink, with_qv, few_keys, tokens_used}) {
    const fh::detail::KernelCall call = fh::detail::kernel_call(kept, fh::detail::forward_shape(kept));
    EXPECT_EQ(call.shape.rows_per_token, 1);
    EXPECT_FALSE(call.combine_always);
    EXPECT_FALSE(fh::detail::present(call.gather_source));
  }
}

// The same rewrite over packed queries (cu_seqlens_q: sequences of 2, 3 and 1 tokens, continuous
// batching's decode step with speculative tokens): q [total_q, Hq, d] gathered as one batch, rows
// of sequence b from cu_seqlens_q[b] * ratio (SeqlenParams::q_rows_log2), the combine reading the
// packed partials [1, Hkv, total_q * ratio, dv] into out [total_q, Hq, dv] and lse [Hq, total_q].
TEST(PackedDecode, PackedQueriesOfEachKvHeadGatheredAsRowsIsTheSameAttention) {
  const std::vector<int32_t> tokens = {2, 3, 1};
  const int64_t heads_q = 8, heads_kv = 2, ratio = 4, d = 8, dv = 16, sk = fh::detail::kFewestKeysGathered + 8;
  const int64_t batch = int64_t(tokens.size()), total_q = 6;
  std::vector<int32_t> cu_q = {0}, cu_k = {0};
  for (int32_t n : tokens) {
    cu_q.push_back(cu_q.back() + n);
    cu_k.push_back(cu_k.back() + int32_t(sk));
  }
  const VarlenCase c(cu_q, cu_k, heads_q, heads_kv, d, dv, 2131);
  const HostTensor &q = c.q, &k = c.k, &v = c.v, &out = c.out, &lse = c.lse;
  Mask causal;
  causal.causal = 1;
  causal.scale = 0.5f;
  const fh::ForwardParams p = c.forward(causal);
  ASSERT_OK(ref::forward(p));
  const fh::detail::ProblemShape given = fh::detail::forward_shape(p);
  fh::detail::KernelCall call = fh::detail::kernel_call(p, given);
  ASSERT_TRUE(call.combine_always);
  ASSERT_EQ(call.shape.rows_per_token, ratio);
  ASSERT_EQ(call.shape.total_q, total_q * ratio);
  ASSERT_EQ(call.shape.seqlen_q, 3 * ratio);
  ASSERT_TRUE(fh::detail::present(call.gather_source));
  ASSERT_EQ(call.gather_source.ndim, 4);
  HostTensor gathered(FH_DTYPE_FP64, {1, heads_kv, total_q, ratio, d});
  for (int64_t g = 0; g < heads_kv; ++g)
    for (int64_t t = 0; t < total_q; ++t)
      for (int64_t j = 0; j < ratio; ++j)
        for (int64_t c = 0; c < d; ++c)
          gathered.set({0, g, t, j, c}, fh::test::read(call.gather_source, {0, t, g * ratio + j, c}));
  call.params.q.data = gathered.view().data;
  const int64_t rows = total_q * ratio;
  std::vector<double> o_partial(size_t(heads_kv * rows * dv)), lse_partial(size_t(heads_kv * rows));
  for (int64_t b = 0; b < batch; ++b) {
    // The kernels' sequence: rows [cu_q[b] * ratio, cu_q[b + 1] * ratio), keys of sequence b.
    const int64_t first_row = cu_q[size_t(b)] * ratio, seq_rows = tokens[size_t(b)] * ratio;
    for (int64_t g = 0; g < heads_kv; ++g) {
      for (int64_t r = 0; r < seq_rows; ++r) {
        const int64_t pos = (r >> 2) + sk - tokens[size_t(b)];  // causal, bottom-right aligned
        std::vector<double> scores(static_cast<size_t>(sk));
        for (int64_t j = 0; j < sk; ++j) {
          double s = 0;
          for (int64_t c = 0; c < d; ++c) {
            const double qe = fh::test::read(call.params.q, {first_row + r, g, c});
            ASSERT_EQ(qe, q.get({cu_q[size_t(b)] + r / ratio, g * ratio + r % ratio, c}));
            s += qe * k.get({b * sk + j, g, c});
          }
          scores[size_t(j)] = j <= pos ? s * 0.5 : -INFINITY;
        }
        const int64_t row = g * rows + first_row + r;
        auto value = [&](int64_t j, int64_t c) { return v.get({b * sk + j, g, c}); };
        lse_partial[size_t(row)] = partial_row(scores, dv, value, &o_partial[size_t(row * dv)]);
      }
    }
  }
  const fh::detail::GroupedPartials strides = fh::detail::grouped_partials(given, ratio);
  const auto [out_error, lse_error] = grouped_combine_errors(
      strides, o_partial, lse_partial, /*batch=*/1, heads_q, ratio, total_q, dv,
      [&](int64_t, int64_t h, int64_t t) { return lse.get({h, t}); },
      [&](int64_t, int64_t t, int64_t h, int64_t c) { return out.get({t, h, c}); });
  EXPECT_LE(out_error, 1e-12);
  EXPECT_LE(lse_error, 1e-12);
}

}  // namespace
