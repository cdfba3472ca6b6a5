// Extreme and non-finite input values on the GPU (CTest label "gpu"), tested against what
// docs/conventions.md ("Extreme and non-finite values") promises:
// - Extreme finite values (magnitudes near the dtype's limit, all-equal scores, a tiny or huge
//   softmax_scale) whose float32 intermediates stay finite give finite results within the pass
//   rule of the other GPU tests, forward and backward.
// - A NaN or inf input reaches exactly the outputs that depend on it: those are non-finite, and
//   every output that does not depend on it is bit-identical to the run without it (other
//   batches, other KV heads; for q and k also the other rows of the same head).
// Backward runs are deterministic, so that unaffected gradients can be compared bit for bit.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "attention_run.hpp"
#include "flashhopper/flashhopper.hpp"
#include "gpu_test_util.hpp"
#include "reference/reference.hpp"
#include "test_util.hpp"

namespace flashhopper::test {
namespace {

// The head dim the cases of `dtype` run at: 128 when compiled (for both passes), else the
// smallest compiled one; 0 when no family of the dtype has both passes.
int head_dim_for(fh_dtype dtype) {
  std::vector<int> both;
  for (const auto& [d_type, d] : compiled_families(/*backward=*/false))
    for (const auto& [b_type, b] : compiled_families(/*backward=*/true))
      if (d_type == dtype && b_type == dtype && d == b) both.push_back(d);
  if (both.empty()) return 0;
  return std::count(both.begin(), both.end(), 128) ? 128 : *std::min_element(both.begin(), both.end());
}

void fill_uniform(HostTensor& t, double bound, uint32_t seed) {
  std::mt19937 generator(seed);
  std::uniform_real_distribution<double> uniform(-bound, bound);
  const Tensor view = t.view();
  for_each_index(shape_of(view), [&](const std::vector<int64_t>& i) { write(view, i, uniform(generator)); });
}

void multiply(HostTensor& t, double factor) {
  const Tensor view = t.view();
  for_each_index(shape_of(view), [&](const std::vector<int64_t>& i) { write(view, i, read(view, i) * factor); });
}

bool all_finite(const Tensor& t) {
  bool finite = true;
  for_each_index(shape_of(t), [&](const std::vector<int64_t>& i) { finite = finite && std::isfinite(read(t, i)); });
  return finite;
}

// Every key of a (batch, head) the copy of its first: all scores of a row equal, P uniform.
void make_keys_equal(Problem& p) {
  const Tensor k = p.k.view();
  for_each_index(shape_of(k), [&](const std::vector<int64_t>& i) { write(k, i, read(k, {i[0], 0, i[2], i[3]})); });
}

// ---- extreme finite values ------------------------------------------------------------------

struct ExtremeCase {
  std::string name;
  fh_dtype dtype;
  bool causal;
  bool backward;  // also the backward (where the exact gradients fit the dtype)
  float softmax_scale;
  std::function<void(Problem&)> shape_inputs;  // rewrites the random inputs
  Features features{};                          // a window, softcap
};

std::ostream& operator<<(std::ostream& os, const ExtremeCase& c) { return os << c.name; }

std::vector<ExtremeCase> extreme_cases() {
  return {
      // fp16's limits (docs/conventions.md): q and k near 8e3 (scaled scores up to 1.5e8, below
      // fp16's 2^28), values near 6e4, O a single row of v.
      {"fp16_qk_near_8e3_values_near_6e4", FH_DTYPE_FP16, false, false, 0.f,
       [](Problem& p) {
         fill_uniform(p.q, 8e3, 11);
         fill_uniform(p.k, 8e3, 12);
         fill_uniform(p.v, 6e4, 13);
       }},
      // Values at fp16's limit under peaked scores; dout / 64 keeps dP = dout.v (2.9e4) and the
      // backward's dS = P (dP - D), rounded to fp16 for its products, below 65504.
      {"fp16_values_near_6e4", FH_DTYPE_FP16, true, true, 0.f,
       [](Problem& p) {
         multiply(p.q, 30);
         multiply(p.k, 30);
         fill_uniform(p.v, 6e4, 13);
         multiply(p.dout, 1.0 / 64);
       }},
      // bf16 q and k near 1e4 (scaled scores near 5e7, below the 2^30 of docs/conventions.md) and
      // values near 1e30.
      {"bf16_scores_near_5e7", FH_DTYPE_BF16, false, false, 0.f,
       [](Problem& p) {
         fill_uniform(p.q, 1e4, 11);
         fill_uniform(p.k, 1e4, 12);
         multiply(p.v, 1e30);
       }},
      {"bf16_values_near_1e30", FH_DTYPE_BF16, true, true, 0.f,
       [](Problem& p) {
         multiply(p.q, 30);
         multiply(p.k, 30);
         multiply(p.v, 1e30);
       }},
      {"bf16_equal_scores", FH_DTYPE_BF16, true, true, 0.f,
       make_keys_equal},
      {"fp16_equal_scores", FH_DTYPE_FP16, false, true, 0.f,
       make_keys_equal},
      {"bf16_scale_1e_minus_30", FH_DTYPE_BF16, true, true, 1e-30f, [](Problem&) {}},
      {"fp16_scale_1e_minus_30", FH_DTYPE_FP16, false, true, 1e-30f, [](Problem&) {}},
      {"bf16_scale_1e3", FH_DTYPE_BF16, false, true, 1e3f, [](Problem&) {}},
      // A huge scale: scaled scores up to 9e8 (fp16: 8e7 at 1e6, below its 2^28), one key a row.
      // Its gradients are the scale times rounding noise, beyond the dtype: forward only.
      {"bf16_scale_1e7", FH_DTYPE_BF16, true, false, 1e7f, [](Problem&) {}},
      {"fp16_scale_1e6", FH_DTYPE_FP16, false, false, 1e6f, [](Problem&) {}},
      // Softcap saturated: scaled scores near 5e7 (fp16: 4e11, beyond the dtype) capped at +-30,
      // so tanh is +-1 and its gradient factor exactly 0 on most scores.
      {"bf16_softcap_scores_near_5e7", FH_DTYPE_BF16, false, true, 0.f,
       [](Problem& p) {
         fill_uniform(p.q, 1e4, 11);
         fill_uniform(p.k, 1e4, 12);
       },
       Features{-1, -1, 0, 0, 30.f}},
      {"fp16_softcap_inputs_near_6e4", FH_DTYPE_FP16, true, false, 0.f,
       [](Problem& p) {
         fill_uniform(p.q, 6e4, 11);
         fill_uniform(p.k, 6e4, 12);
         fill_uniform(p.v, 6e4, 13);
       },
       Features{-1, -1, 0, 0, 30.f}},
      {"bf16_window_equal_scores", FH_DTYPE_BF16, false, true, 0.f, make_keys_equal, Features{64, 0}},
      // A huge scale under a two-sided window and a cap: every score at +-20.
      {"bf16_window_softcap_scale_1e3", FH_DTYPE_BF16, false, true, 1e3f, [](Problem&) {},
       Features{100, 20, 0, 0, 20.f}},
  };
}

HostTensor to_fp32(const HostTensor& t) {
  HostTensor r(FH_DTYPE_FP32, t.shape());
  const Tensor from = t.view(), to = r.view();
  for_each_index(t.shape(), [&](const std::vector<int64_t>& i) { write(to, i, read(from, i)); });
  return r;
}

// The pass rule's yardstick for one output: the plain implementation's error in the inputs'
// dtype. Where that one overflows (fp16 scores or dP beyond 65504: PyTorch's plain fp16 attention
// gives inf there), the plain float32 implementation's error on the same values plus half an ulp
// of the dtype at the result's size (rounding the exact result into the output).
struct Yardstick {
  double plain_err, fp32_err, rounding;
  double bound(double slack) const { return std::isfinite(plain_err) ? 2 * plain_err + slack : 2 * (fp32_err + rounding) + slack; }
};

double half_ulp(int32_t dtype) { return dtype == FH_DTYPE_FP16 ? 0x1p-11 : dtype == FH_DTYPE_BF16 ? 0x1p-8 : 0.0; }

class ExtremeValuesTest : public ::testing::TestWithParam<ExtremeCase> {};

TEST_P(ExtremeValuesTest, FiniteAndWithinThePassRule) {
  const ExtremeCase& e = GetParam();
  const int head_dim = head_dim_for(e.dtype);
  if (head_dim == 0) GTEST_SKIP() << "no family of this dtype in this build";
  const GridCase c{e.dtype, head_dim, e.causal, 2, 300, 257, 4, 2, false, e.features};
  Problem problem = Problem::random(c, 7);
  problem.softmax_scale = e.softmax_scale;
  e.shape_inputs(problem);
  Results ours;
  Status status;
  const std::string err = run_and_wait(problem, e.backward, &ours, &status);
  ASSERT_EQ(err, "");
  ASSERT_TRUE(status.ok()) << status.message;
  std::vector<std::pair<const char*, const HostTensor*>> outputs = {{"out", &ours.out}, {"lse", &ours.lse}};
  if (e.backward) outputs.insert(outputs.end(), {{"dq", &ours.dq}, {"dk", &ours.dk}, {"dv", &ours.dv}});

  // The reference's results for the outputs above: exact (double), plain in the dtype, plain in
  // float32 (inputs converted).
  const HostTensor q32 = to_fp32(problem.q), k32 = to_fp32(problem.k), v32 = to_fp32(problem.v),
                   dout32 = to_fp32(problem.dout);
  auto reference_outputs = [&](int32_t dtype, bool low_precision, bool fp32_inputs, std::vector<HostTensor>* r) {
    for (const auto& [name, t] : outputs)
      r->emplace_back(std::string(name) == "lse" ? (dtype == FH_DTYPE_FP64 ? dtype : FH_DTYPE_FP32) : dtype,
                      t->shape());
    reference::Options options;
    options.emulate_low_precision = low_precision;
    ForwardParams f = default_forward_params();
    f.q = fp32_inputs ? q32.view() : problem.q.view();
    f.k = fp32_inputs ? k32.view() : problem.k.view();
    f.v = fp32_inputs ? v32.view() : problem.v.view();
    f.causal = c.causal;
    f.softmax_scale = e.softmax_scale;
    e.features.apply(f);
    f.out = (*r)[0].view();
    f.lse = (*r)[1].view();
    ASSERT_TRUE(reference::forward(f, options).ok());
    if (!e.backward) return;
    BackwardParams b = default_backward_params();
    b.q = f.q;
    b.k = f.k;
    b.v = f.v;
    b.dout = fp32_inputs ? dout32.view() : problem.dout.view();
    b.out = f.out;  // not read: the reference recomputes the forward
    b.lse = f.lse;
    b.causal = c.causal;
    b.softmax_scale = e.softmax_scale;
    e.features.apply(b);
    b.dq = (*r)[2].view();
    b.dk = (*r)[3].view();
    b.dv = (*r)[4].view();
    ASSERT_TRUE(reference::backward(b, options).ok());
  };
  std::vector<HostTensor> exact, plain, plain32;
  ASSERT_NO_FATAL_FAILURE(reference_outputs(FH_DTYPE_FP64, false, false, &exact));
  ASSERT_NO_FATAL_FAILURE(reference_outputs(c.dtype, true, false, &plain));
  ASSERT_NO_FATAL_FAILURE(reference_outputs(FH_DTYPE_FP32, true, true, &plain32));
  for (size_t i = 0; i < outputs.size(); ++i) {
    const auto& [name, t] = outputs[i];
    // Finite where the exact result is (rows that see no key have LSE = -inf).
    EXPECT_EQ(all_finite(t->view()), all_finite(exact[i].view())) << name << ": NaN or inf";
    const double size = max_abs(exact[i].view());
    const Yardstick y{max_abs_diff(plain[i].view(), exact[i].view()), max_abs_diff(plain32[i].view(), exact[i].view()),
                      (i == 1 ? 0.0 : half_ulp(c.dtype)) * size};
    // The slack scales with the result (values near 1e30 leave float32 sums of that size).
    const double slack = (i < 2 ? 1e-5 : 1e-4) * std::max(1.0, size);
    const double ours_err = max_abs_diff(t->view(), exact[i].view());
    EXPECT_LE(ours_err, y.bound(slack)) << name << ": ours " << ours_err << ", plain " << y.plain_err
                                        << ", plain float32 " << y.fp32_err;
  }
}

INSTANTIATE_TEST_SUITE_P(Extreme, ExtremeValuesTest, ::testing::ValuesIn(extreme_cases()),
                         [](const auto& info) { return info.param.name; });

// ---- NaN and inf inputs ---------------------------------------------------------------------

// One non-finite element in batch 0: q at row kRow of head 1 (KV head 0), k or v at key kKey of
// KV head 0, or dout at row kRow of head 1; always column kColumn. Batch 1 and KV head 1 (query
// heads 2 and 3) never see it.
constexpr int kRow = 200, kKey = 150, kColumn = 5, kSeq = 300, kHeads = 4, kHeadsKv = 2;

struct PoisonCase {
  char input;  // 'q', 'k', 'v', or 'o' for dout
  double value;
  bool causal;
  int num_splits;  // > 1: the forward's split-KV path and combine (forward only)
  Features features{};  // a window (what a row sees) or softcap
  std::string name() const {
    const std::string v = std::isnan(value) ? "nan" : value > 0 ? "inf" : "minus_inf";
    return std::string(input == 'o' ? "dout" : std::string(1, input)) + "_" + v + (causal ? "_causal" : "_full") +
           features.tag() + (num_splits > 1 ? "_splits" + std::to_string(num_splits) : "");
  }
};

std::ostream& operator<<(std::ostream& os, const PoisonCase& c) { return os << c.name(); }

std::vector<PoisonCase> poison_cases() {
  const double nan = std::numeric_limits<double>::quiet_NaN(), inf = std::numeric_limits<double>::infinity();
  // Not an inf in k: -inf there is a valid score (the key drops out of those rows), not an error.
  const std::vector<std::pair<char, double>> poisons = {{'q', nan}, {'q', inf}, {'k', nan}, {'v', nan},
                                                        {'v', inf}, {'v', -inf}, {'o', nan}, {'o', inf}};
  std::vector<PoisonCase> cases;
  for (bool causal : {false, true})
    for (const auto& [input, value] : poisons) {
      cases.push_back({input, value, causal, 1});
      if (input != 'o') cases.push_back({input, value, causal, 3});
    }
  // Under a window (one-sided, two-sided) and softcap: one poison of each input.
  const std::vector<std::pair<bool, Features>> featured = {
      {false, Features{64, 0}}, {false, Features{40, 30}}, {true, Features{-1, -1, 0, 0, 30.f}}};
  for (const auto& [causal, features] : featured)
    for (const auto& [input, value] : std::vector<std::pair<char, double>>{{'q', nan}, {'k', nan}, {'v', inf}, {'o', nan}}) {
      cases.push_back({input, value, causal, 1, features});
      if (input != 'o') cases.push_back({input, value, causal, 3, features});
    }
  return cases;
}

class NonFiniteInputTest : public ::testing::TestWithParam<PoisonCase> {};

TEST_P(NonFiniteInputTest, ReachesOnlyWhatDependsOnIt) {
  const PoisonCase pc = GetParam();
  const fh_dtype dtype = head_dim_for(FH_DTYPE_BF16) ? FH_DTYPE_BF16 : FH_DTYPE_FP16;
  const int head_dim = head_dim_for(dtype);
  if (head_dim == 0) GTEST_SKIP() << "no family with both passes in this build";
  GridCase c{dtype, head_dim, pc.causal, 2, kSeq, kSeq, kHeads, kHeadsKv, false, pc.features};
  c.num_splits = pc.num_splits;
  const Problem clean = Problem::random(c, 3);
  Problem poisoned = clean;
  switch (pc.input) {
    case 'q': poisoned.q.set({0, kRow, 1, kColumn}, pc.value); break;
    case 'k': poisoned.k.set({0, kKey, 0, kColumn}, pc.value); break;
    case 'v': poisoned.v.set({0, kKey, 0, kColumn}, pc.value); break;
    default: poisoned.dout.set({0, kRow, 1, kColumn}, pc.value);
  }
  const bool backward = pc.num_splits == 1;
  Results a, b;
  Status status;
  ASSERT_EQ(run_and_wait(clean, backward, &a, &status), "");
  ASSERT_TRUE(status.ok()) << status.message;
  ASSERT_EQ(run_and_wait(poisoned, backward, &b, &status), "");
  ASSERT_TRUE(status.ok()) << status.message;

  const int group = kHeads / kHeadsKv;
  auto sees = [&](int row, int key) {  // sq = sk: no offset
    const Features& f = pc.features;
    return (!pc.causal || key <= row) && (f.window_left < 0 || key >= row - f.window_left) &&
           (f.window_right < 0 || key <= row + f.window_right);
  };
  // Whether query row (batch, row, head) depends on the poisoned element in the forward.
  auto row_affected = [&](int batch, int row, int head) {
    if (batch != 0 || head / group != 0) return false;
    if (pc.input == 'q') return row == kRow && head == 1;
    return (pc.input == 'k' || pc.input == 'v') && sees(row, kKey);
  };
  // Bit-equality / the finite elements of the part of a tensor at a leading index.
  auto part = [](const HostTensor& x, const std::vector<int64_t>& at) {
    Tensor v = x.view();
    for (int d = 0; d < int(at.size()); ++d) v = narrow(v, d, at[d], 1);
    return v;
  };
  auto same = [&](const HostTensor& x, const HostTensor& y, const std::vector<int64_t>& at) {
    return bit_identical(part(x, at), part(y, at));
  };
  auto finite_count = [&](const HostTensor& x, const std::vector<int64_t>& at) {
    const Tensor v = part(x, at);
    int64_t n = 0;
    for_each_index(shape_of(v), [&](const std::vector<int64_t>& i) { n += std::isfinite(read(v, i)); });
    return n;
  };

  // Forward: out and lse row by row.
  int64_t wrong = 0, checked_affected = 0;
  for (int batch = 0; batch < c.batch; ++batch)
    for (int head = 0; head < kHeads; ++head)
      for (int row = 0; row < kSeq; ++row) {
        const std::vector<int64_t> out_row = {batch, row, head}, lse_at = {batch, head, row};
        const bool affected = row_affected(batch, row, head);
        const bool lse_same = same(a.lse, b.lse, lse_at), out_same = same(a.out, b.out, out_row);
        if (pc.input == 'o') {
          wrong += !lse_same || !out_same;  // the forward does not read dout
        } else if (affected) {
          ++checked_affected;
          if (pc.input == 'v') {  // only column kColumn of O depends on it; lse not at all
            wrong += !lse_same || finite_count(b.out, {batch, row, head, kColumn}) != 0;
          } else {
            wrong += finite_count(b.out, out_row) != 0 || finite_count(b.lse, lse_at) != 0;
          }
        } else if (pc.input == 'v' && batch == 0 && head / group == 0) {
          wrong += !lse_same;  // rows masked from the key share its tile: only lse is promised
        } else {
          wrong += !lse_same || !out_same;
        }
      }
  EXPECT_EQ(wrong, 0) << "forward rows that break the promise";
  if (pc.input != 'o') {
    EXPECT_GT(checked_affected, 0);
  }
  if (!backward) return;

  // Backward: nothing of batch 1 or of KV head 1 changes; the gradients that depend on the
  // element are non-finite.
  wrong = 0;
  for (int batch = 0; batch < c.batch; ++batch)
    for (int head = 0; head < kHeads; ++head)
      for (int row = 0; row < kSeq; ++row)
        if (batch == 1 || head / group == 1) wrong += !same(a.dq, b.dq, {batch, row, head});
  for (int batch = 0; batch < c.batch; ++batch)
    for (int key = 0; key < kSeq; ++key)
      for (int kv = 0; kv < kHeadsKv; ++kv)
        if (batch == 1 || kv == 1 || pc.input == 'v') {  // dv never depends on v
          wrong += !same(a.dv, b.dv, {batch, key, kv});
          if (pc.input != 'v' || batch == 1 || kv == 1) wrong += !same(a.dk, b.dk, {batch, key, kv});
        }
  EXPECT_EQ(wrong, 0) << "gradients that do not depend on the element changed";

  int64_t finite_where_affected = 0;
  const bool from_row = pc.input == 'q' || pc.input == 'o';  // a query row's element
  if (from_row) {
    finite_where_affected += finite_count(b.dq, {0, kRow, 1});
    for (int key = 0; key < kSeq; ++key)
      if (sees(kRow, key)) {
        finite_where_affected += finite_count(b.dk, {0, key, 0});
        finite_where_affected += pc.input == 'q' ? finite_count(b.dv, {0, key, 0}) : finite_count(b.dv, {0, key, 0, kColumn});
      }
  } else {
    finite_where_affected += finite_count(b.dk, {0, kKey, 0});
    if (pc.input == 'k') finite_where_affected += finite_count(b.dv, {0, kKey, 0});
    for (int head = 0; head < group; ++head)
      for (int row = 0; row < kSeq; ++row)
        if (sees(row, kKey)) finite_where_affected += finite_count(b.dq, {0, row, head});
  }
  EXPECT_EQ(finite_where_affected, 0) << "gradients that depend on the element came out finite";
}

INSTANTIATE_TEST_SUITE_P(NonFinite, NonFiniteInputTest, ::testing::ValuesIn(poison_cases()),
                         [](const auto& info) { return info.param.name(); });

}  // namespace
}  // namespace flashhopper::test

int main(int argc, char** argv) { return flashhopper::test::gpu_test_main(argc, argv); }
