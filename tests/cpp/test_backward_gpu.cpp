// The Hopper backward kernel against the CPU reference (CTest label "gpu"). Without an sm_90
// GPU every test skips and says so, and so does a case whose (dtype, head dim) this build did not
// compile (FH_ERROR_NOT_SUPPORTED). Inputs: random q, k, v, dout; out and lse come from the exact CPU
// forward, out rounded once to the input dtype as a real forward hands it over. Pass rule
// (FlashAttention's): for each of dq, dk, dv the kernel's error versus the exact gradient is at
// most twice the error of a plain low-precision implementation, plus a small absolute slack; NaN
// never passes; the gradients and the workspace are poisoned before each run.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <array>
#include <cstring>
#include <functional>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "flashhopper/flashhopper.hpp"
#include "gpu_test_util.hpp"
#include "reference/reference.hpp"
#include "test_util.hpp"

namespace flashhopper::test {
namespace {

// The forward test's slack is 1e-5 for O, whose entries are at most max|v| (about 4). Gradients
// are sums over up to 2048 rows or keys and reach tens, so float32 accumulation alone leaves
// ~1e-5 there; the slack only matters where the plain implementation is (nearly) exact, as for a
// row that sees a single key.
constexpr double kAbsSlack = 1e-4;
constexpr int kRepeats = 20;  // runs of the determinism and spread tests

// dq, dk, dv on the host, contiguous [B, S, H, d or dv] (with the case's guard columns for the
// kernel's outputs); dsink [Hq] (float32, or float64 for the exact
// reference), used only with a learnable sink.
struct Gradients {
  HostTensor dq, dk, dv, dsink;
};

Gradients make_gradients(int32_t dtype, const GridCase& c, bool with_guard = false) {
  const int d = with_guard ? c.output_columns(c.head_dim) : c.head_dim;
  const int dv = with_guard ? c.output_columns(c.value_dim()) : c.value_dim();
  return {HostTensor(dtype, {c.batch, c.seqlen_q, c.heads_q, d}),
          HostTensor(dtype, {c.batch, c.seqlen_k, c.heads_kv, d}),
          HostTensor(dtype, {c.batch, c.seqlen_k, c.heads_kv, dv}),
          HostTensor(dtype == FH_DTYPE_FP64 ? FH_DTYPE_FP64 : FH_DTYPE_FP32, {c.heads_q})};
}

constexpr std::array<const char*, 3> kGradientNames = {"dq", "dk", "dv"};

std::array<const HostTensor*, 3> list(const Gradients& g) { return {&g.dq, &g.dk, &g.dv}; }
std::array<HostTensor*, 3> list(Gradients& g) { return {&g.dq, &g.dk, &g.dv}; }

// The exact gradients (double), the plain low-precision implementation's, and the plain one's
// errors: the yardstick of the pass rule.
struct Expected {
  Gradients exact, plain;
  std::array<double, 3> plain_err{};
  // dsink from the inputs as the kernel gets them (out rounded to the dtype, lse float32), in
  // double: what the kernel's fixed-order float32 sum must reproduce, and how far the rounding of
  // those inputs alone moves dsink from the exact one.
  std::vector<double> dsink_given;
};

Tensor bshd_device_view(const DeviceTensor& t, bool heads_major) {
  return heads_major ? permute(t.view(), {0, 2, 1, 3}) : t.view();
}

// One backward problem: host inputs, their device copies, device gradients and the workspace.
// Methods assert (fatal failures); callers wrap them in ASSERT_NO_FATAL_FAILURE.
class BackwardProblem {
 public:
  // Random q, k, v, dout; out and lse from the exact CPU forward; device copies of all of them.
  void init(const GridCase& c) {
    c_ = c;
    const bool hm = c.heads_major_layout;
    const uint32_t seed = uint32_t(std::hash<std::string>{}(c.name()));
    q_ = make_input(c.dtype, c.batch, c.seqlen_q, c.heads_q, c.head_dim, hm, seed);
    k_ = make_input(c.dtype, c.batch, c.seqlen_k, c.heads_kv, c.head_dim, hm, seed + 1);
    v_ = make_input(c.dtype, c.batch, c.seqlen_k, c.heads_kv, c.value_dim(), hm, seed + 2);
    dout_ = make_input(c.dtype, c.batch, c.seqlen_q, c.heads_q, c.value_dim(), hm, seed + 3);
    // Written in the tensors' dtypes: out is the exact forward rounded once, lse float32.
    out_ = HostTensor(c.dtype, {c.batch, c.seqlen_q, c.heads_q, c.value_dim()});
    lse_ = HostTensor(FH_DTYPE_FP32, {c.batch, c.heads_q, c.seqlen_q});
    ForwardParams f = default_forward_params();
    f.q = bshd_view(q_, hm);
    f.k = bshd_view(k_, hm);
    f.v = bshd_view(v_, hm);
    f.out = out_.view();
    f.lse = lse_.view();
    f.causal = c.causal;
    c.features.apply(f);
    sink_ = make_sink_logits(c.heads_q, seed + 4);
    if (c.features.learnable_sink) f.learnable_sink = sink_.view();
    const Status status = reference::forward(f);
    ASSERT_TRUE(status.ok()) << status.message;

    const Gradients shapes = make_gradients(c.dtype, c, /*with_guard=*/true);
    d_q_ = std::make_unique<DeviceTensor>(q_);
    d_k_ = std::make_unique<DeviceTensor>(k_);
    d_v_ = std::make_unique<DeviceTensor>(v_);
    d_dout_ = std::make_unique<DeviceTensor>(dout_);
    d_out_ = std::make_unique<DeviceTensor>(out_);
    d_lse_ = std::make_unique<DeviceTensor>(lse_);
    d_dq_ = std::make_unique<DeviceTensor>(shapes.dq);
    d_dk_ = std::make_unique<DeviceTensor>(shapes.dk);
    d_dv_ = std::make_unique<DeviceTensor>(shapes.dv);
    d_sink_ = std::make_unique<DeviceTensor>(sink_);
    d_dsink_ = std::make_unique<DeviceTensor>(shapes.dsink);
    for (const DeviceTensor* t : {d_q_.get(), d_k_.get(), d_v_.get(), d_dout_.get(), d_out_.get(), d_lse_.get(),
                                  d_dq_.get(), d_dk_.get(), d_dv_.get(), d_sink_.get(), d_dsink_.get()}) {
      ASSERT_TRUE(t->ok()) << "cudaMalloc failed";
    }
    CUDA_CHECK(d_q_->upload(q_));
    CUDA_CHECK(d_k_->upload(k_));
    CUDA_CHECK(d_v_->upload(v_));
    CUDA_CHECK(d_dout_->upload(dout_));
    CUDA_CHECK(d_out_->upload(out_));
    CUDA_CHECK(d_lse_->upload(lse_));
    CUDA_CHECK(d_sink_->upload(sink_));

    params_ = default_backward_params();
    params_.q = bshd_device_view(*d_q_, hm);
    params_.k = bshd_device_view(*d_k_, hm);
    params_.v = bshd_device_view(*d_v_, hm);
    params_.dout = bshd_device_view(*d_dout_, hm);
    params_.out = d_out_->view();
    params_.lse = d_lse_->view();
    params_.dq = narrow(d_dq_->view(), 3, 0, c.head_dim);
    params_.dk = narrow(d_dk_->view(), 3, 0, c.head_dim);
    params_.dv = narrow(d_dv_->view(), 3, 0, c.value_dim());
    params_.causal = c.causal;
    c.features.apply(params_);
    if (c.features.learnable_sink) {
      params_.learnable_sink = d_sink_->view();
      params_.dsink = d_dsink_->view();
    }
  }

  // Poisons the gradients and the workspace (the kernel must write every gradient element and
  // initialise what it uses of the workspace), runs the backward and waits for it. A refusal
  // comes back in *status (the caller skips on FH_ERROR_NOT_SUPPORTED).
  void run(int deterministic, Status* status) {
    params_.deterministic = deterministic;
    const Status query = workspace_size(params_, &workspace_needed_);
    ASSERT_TRUE(query.ok()) << query.message;
    if (workspace_needed_ > workspace_.bytes()) CUDA_CHECK(workspace_.allocate(workspace_needed_));
    CUDA_CHECK(workspace_.poison());
    ASSERT_NO_FATAL_FAILURE(poison_gradients());
    CUDA_CHECK(cudaDeviceSynchronize());
    *status = backward(params_, workspace_.data(), workspace_needed_, nullptr);
    if (!status->ok()) return;
    CUDA_CHECK(cudaGetLastError());
    CUDA_CHECK(cudaDeviceSynchronize());
  }

  void poison_gradients() {
    CUDA_CHECK(d_dq_->poison());
    CUDA_CHECK(d_dk_->poison());
    CUDA_CHECK(d_dv_->poison());
    CUDA_CHECK(d_dsink_->poison());
  }

  void download(Gradients* grads) const {
    CUDA_CHECK(d_dq_->download(grads->dq));
    CUDA_CHECK(d_dk_->download(grads->dk));
    CUDA_CHECK(d_dv_->download(grads->dv));
    if (c_.features.learnable_sink) CUDA_CHECK(d_dsink_->download(grads->dsink));
  }

  // The same problem over the host copies, writing into `grads` (for the CPU reference, and as
  // host-pointer stand-ins in the error tests).
  BackwardParams host_params(const Gradients& grads) const {
    BackwardParams p = params_;
    p.q = bshd_view(q_, c_.heads_major_layout);
    p.k = bshd_view(k_, c_.heads_major_layout);
    p.v = bshd_view(v_, c_.heads_major_layout);
    p.dout = bshd_view(dout_, c_.heads_major_layout);
    p.out = out_.view();  // the reference recomputes the forward; out/lse are not read
    p.lse = lse_.view();
    p.dq = grads.dq.view();
    p.dk = grads.dk.view();
    p.dv = grads.dv.view();
    if (c_.features.learnable_sink) {
      p.learnable_sink = sink_.view();
      p.dsink = grads.dsink.view();
    }
    return p;
  }

  // Exact gradients (double) and the plain low-precision implementation's (rounded as PyTorch
  // in the input dtype would), both from the CPU reference, which recomputes the forward.
  void compute_expected(Expected* e) const {
    e->exact = make_gradients(FH_DTYPE_FP64, c_);
    Status status = reference::backward(host_params(e->exact));
    ASSERT_TRUE(status.ok()) << status.message;
    e->plain = make_gradients(c_.dtype, c_);
    reference::Options plain;
    plain.emulate_low_precision = true;
    status = reference::backward(host_params(e->plain), plain);
    ASSERT_TRUE(status.ok()) << status.message;
    for (int i = 0; i < 3; ++i) e->plain_err[i] = max_abs_diff(list(e->plain)[i]->view(), list(e->exact)[i]->view());
    if (c_.features.learnable_sink) {
      e->dsink_given.assign(c_.heads_q, 0.0);
      for (int b = 0; b < c_.batch; ++b)
        for (int h = 0; h < c_.heads_q; ++h)
          for (int i = 0; i < c_.seqlen_q; ++i) {
            double d = 0;
            for (int x = 0; x < c_.value_dim(); ++x)
              d += read(bshd_view(dout_, c_.heads_major_layout), {b, i, h, x}) * read(out_.view(), {b, i, h, x});
            e->dsink_given[h] -= std::exp(read(sink_.view(), {h}) - read(lse_.view(), {b, h, i})) * d;
          }
    }
  }
  bool has_sink() const { return c_.features.learnable_sink; }

  const BackwardParams& params() const { return params_; }
  void* workspace() const { return workspace_.data(); }
  size_t workspace_needed() const { return workspace_needed_; }  // as workspace_size said for the last run

 private:
  GridCase c_{};
  HostTensor q_, k_, v_, dout_, out_, lse_, sink_;
  std::unique_ptr<DeviceTensor> d_q_, d_k_, d_v_, d_dout_, d_out_, d_lse_, d_dq_, d_dk_, d_dv_, d_sink_, d_dsink_;
  DeviceBuffer workspace_;
  size_t workspace_needed_ = 0;
  BackwardParams params_{};
};

// The pass rule for dq, dk and dv; a failure message carries all three errors. Returns the
// kernel's errors.
std::array<double, 3> expect_matches(const Gradients& ours, const Expected& e, bool with_sink) {
  if (with_sink)
    expect_dsink_matches(ours.dsink.view(), e.exact.dsink.view(), e.plain.dsink.view(), e.dsink_given, kAbsSlack);
  std::array<double, 3> err{};
  std::array<Tensor, 3> views{};  // ours without the guard columns
  std::ostringstream summary;
  for (int i = 0; i < 3; ++i) {
    const int64_t head_dim = shape_of(list(e.exact)[i]->view())[3];
    const int64_t columns = shape_of(list(ours)[i]->view())[3];
    views[i] = narrow(list(ours)[i]->view(), 3, 0, head_dim);
    EXPECT_EQ(count_not_nan(narrow(list(ours)[i]->view(), 3, head_dim, columns - head_dim)), 0)
        << kGradientNames[i] << ": columns past the head dim were written";
    err[i] = max_abs_diff(views[i], list(e.exact)[i]->view());
    summary << (i ? "; " : "") << kGradientNames[i] << ": ours " << err[i] << ", plain " << e.plain_err[i];
  }
  for (int i = 0; i < 3; ++i) {
    EXPECT_FALSE(has_nan(views[i])) << "unwritten (poisoned) or NaN elements in " << kGradientNames[i];
    EXPECT_LE(err[i], 2 * e.plain_err[i] + kAbsSlack)
        << kGradientNames[i] << " out of tolerance (" << summary.str() << ")";
  }
  return err;
}

bool same_bits(HostTensor& a, HostTensor& b) {
  return a.bytes() == b.bytes() && std::memcmp(a.data(), b.data(), a.bytes()) == 0;
}

// Every byte still 0xff: nothing wrote the tensor since it was poisoned.
bool still_poisoned(HostTensor& t) {
  const unsigned char* bytes = static_cast<const unsigned char*>(t.data());
  return std::all_of(bytes, bytes + t.bytes(), [](unsigned char b) { return b == 0xff; });
}

std::vector<double> values(const HostTensor& t) {
  std::vector<double> out;
  const Tensor view = t.view();
  for_each_index(shape_of(view), [&](const std::vector<int64_t>& i) { out.push_back(read(view, i)); });
  return out;
}

// Whether `message` names argument `name` the way the API does ("dq: must point to device
// memory"), not merely contains its letters ("q" must not match "dq: ...").
bool names_argument(const std::string& message, const std::string& name) {
  const std::string tag = name + ":";
  for (size_t at = message.find(tag); at != std::string::npos; at = message.find(tag, at + 1)) {
    if (at == 0 || message[at - 1] == ' ') return true;
  }
  return false;
}

// ---- the grid ---------------------------------------------------------------------------------

class BackwardGpuTest : public ::testing::TestWithParam<GridCase> {};

TEST_P(BackwardGpuTest, MatchesReference) {
  const GridCase c = GetParam();
  BackwardProblem problem;
  ASSERT_NO_FATAL_FAILURE(problem.init(c));
  Status status;
  ASSERT_NO_FATAL_FAILURE(problem.run(/*deterministic=*/0, &status));
  if (status.code == FH_ERROR_NOT_SUPPORTED) GTEST_SKIP() << "not in this build: " << status.message;
  ASSERT_TRUE(status.ok()) << status.message;
  Gradients ours = make_gradients(c.dtype, c, /*with_guard=*/true);
  ASSERT_NO_FATAL_FAILURE(problem.download(&ours));

  Expected expected;
  ASSERT_NO_FATAL_FAILURE(problem.compute_expected(&expected));
  const std::array<double, 3> err = expect_matches(ours, expected, problem.has_sink());
  for (int i = 0; i < 3; ++i) {
    RecordProperty(std::string(kGradientNames[i]) + "_err", std::to_string(err[i]));
    RecordProperty(std::string(kGradientNames[i]) + "_plain_err", std::to_string(expected.plain_err[i]));
  }
}

std::vector<GridCase> backward_cases() {
  struct Shape {
    int batch, seqlen_q, seqlen_k, heads_q, heads_kv;
    bool heads_major;
  };
  // Every dtype, head dim and mask: these stay cheap for the double-precision CPU reference.
  const std::vector<Shape> small_shapes = {
      {1, 1, 1, 1, 1, false},      {2, 7, 7, 3, 3, false},      {1, 113, 200, 4, 2, false}, {3, 128, 128, 2, 2, false},
      {2, 1000, 513, 4, 1, false}, {1, 257, 1000, 2, 2, false}, {2, 333, 333, 6, 1, false}, {4, 300, 300, 16, 4, true},
  };
  // Head dim 128 only: one of these costs the reference seconds (it has only B * Hq work items).
  const std::vector<Shape> large_shapes = {{1, 2048, 2048, 2, 1, false}};
  std::vector<GridCase> cases;
  for (const auto& [dtype, head_dim, head_dim_v] : compiled_family_dims(/*backward=*/true))
    for (bool causal : {false, true}) {
      for (const Shape& s : small_shapes)
        cases.push_back({dtype, head_dim, causal, s.batch, s.seqlen_q, s.seqlen_k, s.heads_q, s.heads_kv, s.heads_major,
                         {}, false, head_dim_v});
      if (head_dim != 128) continue;
      for (const Shape& s : large_shapes)
        cases.push_back(
            {dtype, head_dim, causal, s.batch, s.seqlen_q, s.seqlen_k, s.heads_q, s.heads_kv, s.heads_major});
    }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Grid, BackwardGpuTest, ::testing::ValuesIn(backward_cases()),
                         [](const ::testing::TestParamInfo<GridCase>& info) { return info.param.name(); });
INSTANTIATE_TEST_SUITE_P(Features, BackwardGpuTest, ::testing::ValuesIn(feature_cases(/*backward=*/true)),
                         [](const ::testing::TestParamInfo<GridCase>& info) { return info.param.name(); });
INSTANTIATE_TEST_SUITE_P(PaddedHeadDims, BackwardGpuTest, ::testing::ValuesIn(padded_head_dim_cases(true)),
                         [](const ::testing::TestParamInfo<GridCase>& info) { return info.param.name(); });

// ---- repeated runs ------------------------------------------------------------------------------

// Deterministic mode: the first run matches the reference and the next kRepeats - 1 repeat its bits.
void expect_deterministic_bit_identical(const GridCase& c) {
  BackwardProblem problem;
  ASSERT_NO_FATAL_FAILURE(problem.init(c));
  Status status;
  ASSERT_NO_FATAL_FAILURE(problem.run(/*deterministic=*/1, &status));
  if (status.code == FH_ERROR_NOT_SUPPORTED) GTEST_SKIP() << "not in this build: " << status.message;
  ASSERT_TRUE(status.ok()) << status.message;
  Gradients first = make_gradients(c.dtype, c);
  ASSERT_NO_FATAL_FAILURE(problem.download(&first));
  Expected expected;
  ASSERT_NO_FATAL_FAILURE(problem.compute_expected(&expected));
  expect_matches(first, expected, problem.has_sink());

  Gradients again = make_gradients(c.dtype, c);
  std::array<int, 3> differing_runs{};
  std::array<double, 3> max_diff{};
  for (int run = 1; run < kRepeats; ++run) {
    ASSERT_NO_FATAL_FAILURE(problem.run(/*deterministic=*/1, &status));
    ASSERT_TRUE(status.ok()) << "run " << run << ": " << status.message;
    ASSERT_NO_FATAL_FAILURE(problem.download(&again));
    if (problem.has_sink()) {
      EXPECT_TRUE(same_bits(first.dsink, again.dsink)) << "run " << run << ": dsink differs from the first run";
    }
    for (int i = 0; i < 3; ++i) {
      if (same_bits(*list(first)[i], *list(again)[i])) continue;
      ++differing_runs[i];
      max_diff[i] = std::max(max_diff[i], max_abs_diff(list(first)[i]->view(), list(again)[i]->view()));
    }
  }
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(differing_runs[i], 0) << kGradientNames[i] << ": " << differing_runs[i] << " of " << kRepeats - 1
                                    << " repeated runs differ from the first in their bits (max |diff| " << max_diff[i]
                                    << ")";
  }
}

// Several query blocks per key block and two query heads per key head: the dq and GQA dk/dv sums
// are where the order of accumulation (and so the bits) could change from run to run.
class BackwardGpuRepeatTest : public ::testing::TestWithParam<GridCase> {};

TEST_P(BackwardGpuRepeatTest, DeterministicIsBitIdentical) { expect_deterministic_bit_identical(GetParam()); }

// The default mode may sum in any order: its spread is reported, not judged; NaN and the
// tolerance are judged on every run.
TEST_P(BackwardGpuRepeatTest, DefaultModeSpread) {
  const GridCase c = GetParam();
  BackwardProblem problem;
  ASSERT_NO_FATAL_FAILURE(problem.init(c));
  Status status;
  ASSERT_NO_FATAL_FAILURE(problem.run(/*deterministic=*/0, &status));
  if (status.code == FH_ERROR_NOT_SUPPORTED) GTEST_SKIP() << "not in this build: " << status.message;
  ASSERT_TRUE(status.ok()) << status.message;
  Expected expected;
  ASSERT_NO_FATAL_FAILURE(problem.compute_expected(&expected));

  Gradients ours = make_gradients(c.dtype, c);
  std::array<std::vector<double>, 3> low, high;
  for (int run = 0; run < kRepeats; ++run) {
    if (run > 0) {
      ASSERT_NO_FATAL_FAILURE(problem.run(/*deterministic=*/0, &status));
      ASSERT_TRUE(status.ok()) << "run " << run << ": " << status.message;
    }
    ASSERT_NO_FATAL_FAILURE(problem.download(&ours));
    {
      SCOPED_TRACE("run " + std::to_string(run));
      expect_matches(ours, expected, problem.has_sink());
    }
    if (HasFailure()) break;  // one failing run says it; the next 19 would repeat it
    for (int i = 0; i < 3; ++i) {
      const std::vector<double> x = values(*list(ours)[i]);
      if (run == 0) {
        low[i] = high[i] = x;
        continue;
      }
      for (size_t j = 0; j < x.size(); ++j) {
        low[i][j] = std::min(low[i][j], x[j]);
        high[i][j] = std::max(high[i][j], x[j]);
      }
    }
  }
  if (HasFailure()) return;
  std::ostringstream report;
  report << c.name() << ", default mode, " << kRepeats << " runs: max spread";
  for (int i = 0; i < 3; ++i) {
    double spread = 0;
    for (size_t j = 0; j < low[i].size(); ++j) spread = std::max(spread, high[i][j] - low[i][j]);
    report << (i ? ", " : " ") << kGradientNames[i] << " " << spread << " (plain error " << expected.plain_err[i]
           << ")";
    RecordProperty(std::string(kGradientNames[i]) + "_spread", std::to_string(spread));
  }
  std::cout << "[ spread   ] " << report.str() << std::endl;
}

std::vector<GridCase> repeat_cases() {
  std::vector<GridCase> cases;
  for (bool causal : {false, true}) {
    cases.push_back({FH_DTYPE_BF16, 64, causal, 2, 1000, 1000, 4, 2, false});
    cases.push_back({FH_DTYPE_BF16, 128, causal, 2, 1000, 1000, 4, 2, false});
  }
  // Head dims 192, 256 and 512 compute dQ in a kernel of its own, with no adds to order; causal
  // with sq != sk too (its key blocks walk different query ranges). At 512 the dQ kernel's two
  // warpgroups share their rows, each computing S and dP for itself.
  cases.push_back({FH_DTYPE_BF16, 256, false, 2, 1000, 1000, 4, 2, false});
  cases.push_back({FH_DTYPE_BF16, 256, true, 2, 1000, 900, 4, 2, false});
  cases.push_back({FH_DTYPE_BF16, 192, true, 2, 1000, 900, 4, 2, false});
  cases.push_back({FH_DTYPE_BF16, 512, false, 1, 700, 700, 4, 2, false});
  cases.push_back({FH_DTYPE_BF16, 512, true, 1, 700, 600, 4, 2, false});
  // Windows, sinks and chunks: a left bound means lower key blocks never reach some query blocks,
  // which the deterministic turns must not wait for; a learnable sink's gradient too.
  for (int head_dim : {64, 128, 256}) {
    cases.push_back({FH_DTYPE_BF16, head_dim, false, 2, 1000, 1000, 4, 2, false, {200, 0, 3}});
    cases.push_back({FH_DTYPE_BF16, head_dim, false, 1, 1000, 900, 4, 2, false, {100, 100, 0, 0, 0.f, true}});
    cases.push_back({FH_DTYPE_BF16, head_dim, true, 1, 900, 1000, 4, 2, false, {-1, -1, 0, 256, 10.f}});
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Repeat, BackwardGpuRepeatTest, ::testing::ValuesIn(repeat_cases()),
                         [](const ::testing::TestParamInfo<GridCase>& info) { return info.param.name(); });

// More tiles than a wave (135 or 138 on a 132-SM H200): the last head's key blocks run in two
// waves, so in deterministic mode key blocks wait for their turn on ones that ran in the wave
// before; causal with sq < sk, where most key blocks start at the same query block, and with
// sq = sk. (Head dims 64 and 128, whose main kernel adds dQ in turns; 128 keys a block.)
class BackwardGpuWavesTest : public ::testing::TestWithParam<GridCase> {};

TEST_P(BackwardGpuWavesTest, DeterministicIsBitIdentical) { expect_deterministic_bit_identical(GetParam()); }

std::vector<GridCase> waves_cases() {
  std::vector<GridCase> cases;
  for (bool causal : {false, true}) {
    cases.push_back({FH_DTYPE_BF16, 64, causal, 1, 1024, 45 * 128, 3, 3, false});  // 45 key blocks a head
    cases.push_back({FH_DTYPE_BF16, 128, causal, 1, 1024, 45 * 128, 3, 3, false});
  }
  cases.push_back({FH_DTYPE_BF16, 128, true, 1, 2880, 2880, 6, 6, false});  // causal, sq = sk: 23 key blocks a head
  // A window over two waves: each query block waits for only the key blocks of its window.
  cases.push_back({FH_DTYPE_BF16, 128, false, 1, 45 * 128, 45 * 128, 3, 3, false, {1000, 0, 4}});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Waves, BackwardGpuWavesTest, ::testing::ValuesIn(waves_cases()),
                         [](const ::testing::TestParamInfo<GridCase>& info) { return info.param.name(); });

// ---- bad input through the real entry point: refused with the argument's name, nothing launched

// Small, and in the development kernel set (bf16, head dim 128), so these run in every CUDA build.
const GridCase kErrorCase{FH_DTYPE_BF16, 128, false, 1, 64, 64, 2, 1, false};

TEST(BackwardGpuErrors, HostPointerRefused) {
  BackwardProblem problem;
  ASSERT_NO_FATAL_FAILURE(problem.init(kErrorCase));
  Status status;
  ASSERT_NO_FATAL_FAILURE(problem.run(/*deterministic=*/0, &status));
  if (status.code == FH_ERROR_NOT_SUPPORTED) GTEST_SKIP() << "not in this build: " << status.message;
  ASSERT_TRUE(status.ok()) << status.message;

  // Each pointer argument in turn replaced by host memory of the same shape.
  Gradients host_gradients = make_gradients(kErrorCase.dtype, kErrorCase);
  const BackwardParams host = problem.host_params(host_gradients);
  const std::pair<Tensor BackwardParams::*, const char*> arguments[] = {
      {&BackwardParams::q, "q"},     {&BackwardParams::k, "k"},       {&BackwardParams::v, "v"},
      {&BackwardParams::out, "out"}, {&BackwardParams::dout, "dout"}, {&BackwardParams::lse, "lse"},
      {&BackwardParams::dq, "dq"},   {&BackwardParams::dk, "dk"},     {&BackwardParams::dv, "dv"}};
  ASSERT_NO_FATAL_FAILURE(problem.poison_gradients());
  for (const auto& [member, name] : arguments) {
    BackwardParams p = problem.params();
    p.*member = host.*member;
    status = backward(p, problem.workspace(), problem.workspace_needed(), nullptr);
    EXPECT_EQ(status.code, FH_ERROR_INVALID_ARGUMENT) << name << " on the host: " << status.message;
    EXPECT_TRUE(names_argument(status.message, name)) << "the message should name " << name << ": " << status.message;
  }
  CUDA_CHECK(cudaDeviceSynchronize());
  Gradients after = make_gradients(kErrorCase.dtype, kErrorCase);
  ASSERT_NO_FATAL_FAILURE(problem.download(&after));
  for (int i = 0; i < 3; ++i) {
    EXPECT_TRUE(still_poisoned(*list(after)[i])) << kGradientNames[i] << " was written by a refused call";
  }
}

TEST(BackwardGpuErrors, SmallWorkspaceRefused) {
  BackwardProblem problem;
  ASSERT_NO_FATAL_FAILURE(problem.init(kErrorCase));
  bool tested = false;
  for (int deterministic : {0, 1}) {
    SCOPED_TRACE("deterministic = " + std::to_string(deterministic));
    Status status;
    ASSERT_NO_FATAL_FAILURE(problem.run(deterministic, &status));
    if (status.code == FH_ERROR_NOT_SUPPORTED) GTEST_SKIP() << "not in this build: " << status.message;
    ASSERT_TRUE(status.ok()) << status.message;
    const size_t needed = problem.workspace_needed();
    if (needed == 0) continue;  // nothing smaller to pass
    tested = true;
    BackwardParams p = problem.params();
    ASSERT_NO_FATAL_FAILURE(problem.poison_gradients());
    status = backward(p, problem.workspace(), needed - 1, nullptr);
    EXPECT_EQ(status.code, FH_ERROR_WORKSPACE) << needed - 1 << " of " << needed << " bytes: " << status.message;
    EXPECT_NE(status.message.find("workspace"), std::string::npos) << status.message;
    status = backward(p, nullptr, needed, nullptr);
    EXPECT_EQ(status.code, FH_ERROR_WORKSPACE) << "null workspace: " << status.message;
    CUDA_CHECK(cudaDeviceSynchronize());
    Gradients after = make_gradients(kErrorCase.dtype, kErrorCase);
    ASSERT_NO_FATAL_FAILURE(problem.download(&after));
    for (int i = 0; i < 3; ++i) {
      EXPECT_TRUE(still_poisoned(*list(after)[i])) << kGradientNames[i] << " was written by a refused call";
    }
  }
  if (!tested) GTEST_SKIP() << "workspace_size asks for no workspace: there is no smaller one to pass";
}

}  // namespace
}  // namespace flashhopper::test

// Without an sm_90 GPU nothing here can run: say so and exit with CTest's skip code (77).
int main(int argc, char** argv) { return flashhopper::test::gpu_test_main(argc, argv); }
