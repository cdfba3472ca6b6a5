// The Hopper forward kernel against the CPU reference (CTest label "gpu"). Without an sm_90
// GPU every test skips and says so. Pass rule (FlashAttention's): the kernel's error versus the
// exact result is at most twice the error of a plain low-precision implementation, plus a tiny
// absolute slack, for O and LSE; NaN never passes; outputs are poisoned before each run.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
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

// The call `host` describes (host tensors) as the CPU reference computes it: exactly (float64) into
// out_exact and lse_exact, and as a plain implementation in the inputs' precision into out_plain
// and lse_plain (the pass rule's yardstick).
void reference_outputs(ForwardParams host, HostTensor& out_exact, HostTensor& lse_exact, HostTensor& out_plain,
                       HostTensor& lse_plain) {
  host.out = out_exact.view();
  host.lse = lse_exact.view();
  Status status = reference::forward(host);
  ASSERT_TRUE(status.ok()) << status.message;
  host.out = out_plain.view();
  host.lse = lse_plain.view();
  reference::Options plain;
  plain.emulate_low_precision = true;
  status = reference::forward(host, plain);
  ASSERT_TRUE(status.ok()) << status.message;
}

class ForwardGpuTest : public ::testing::TestWithParam<GridCase> {};

TEST_P(ForwardGpuTest, MatchesReference) {
  const GridCase c = GetParam();
  const uint32_t seed = uint32_t(std::hash<std::string>{}(c.name()));
  HostTensor q = make_input(c.dtype, c.batch, c.seqlen_q, c.heads_q, c.head_dim, c.heads_major_layout, seed);
  HostTensor k = make_input(c.dtype, c.batch, c.seqlen_k, c.heads_kv, c.head_dim, c.heads_major_layout, seed + 1);
  HostTensor v =
      c.v_column_major
          ? random_tensor(c.dtype, {c.batch, c.heads_kv, c.value_dim(), c.seqlen_k}, seed + 2)
          : make_input(c.dtype, c.batch, c.seqlen_k, c.heads_kv, c.value_dim(), c.heads_major_layout, seed + 2);
  const bool fp8 = c.dtype == FH_DTYPE_FP8_E4M3;
  const fh_dtype out_dtype = fp8 ? FH_DTYPE_BF16 : c.dtype;  // fp8 attention writes bf16
  HostTensor out(out_dtype, {c.batch, c.seqlen_q, c.heads_q, c.output_columns(c.value_dim())});
  HostTensor lse(FH_DTYPE_FP32, {c.batch, c.heads_q, c.seqlen_q});

  HostTensor sink = make_sink_logits(c.heads_q, seed + 3);
  DeviceTensor d_q(q), d_k(k), d_v(v), d_out(out), d_lse(lse), d_sink(sink);
  ASSERT_TRUE(d_q.ok() && d_k.ok() && d_v.ok() && d_out.ok() && d_lse.ok() && d_sink.ok());
  CUDA_CHECK(d_sink.upload(sink));
  // fp8: q/k/v_descale [B, Hkv], each factor its own in [0, 2) (FA3's tests' range).
  Descales descales;
  if (fp8) ASSERT_NO_FATAL_FAILURE(make_descales(c.batch, c.heads_kv, seed + 10, &descales));
  CUDA_CHECK(d_q.upload(q));
  CUDA_CHECK(d_k.upload(k));
  CUDA_CHECK(d_v.upload(v));
  CUDA_CHECK(d_out.poison());
  CUDA_CHECK(d_lse.poison());

  ForwardParams p = default_forward_params();
  p.q = d_q.view();
  p.k = d_k.view();
  p.v = d_v.view();
  if (c.heads_major_layout) {
    p.q = permute(p.q, {0, 2, 1, 3});
    p.k = permute(p.k, {0, 2, 1, 3});
    p.v = permute(p.v, {0, 2, 1, 3});
  }
  if (c.v_column_major) p.v = permute(d_v.view(), {0, 3, 1, 2});  // keys contiguous
  p.out = narrow(d_out.view(), 3, 0, c.value_dim());
  p.lse = d_lse.view();
  p.causal = c.causal;
  p.num_splits = c.num_splits;
  c.features.apply(p);
  if (c.features.learnable_sink) p.learnable_sink = d_sink.view();
  if (fp8) set_descales(p, descales, /*on_device=*/true);

  size_t workspace_bytes = 0;
  Status status = workspace_size(p, &workspace_bytes);
  ASSERT_TRUE(status.ok()) << status.message;
  void* workspace = nullptr;
  if (workspace_bytes > 0) CUDA_CHECK(cudaMalloc(&workspace, workspace_bytes));
  status = forward(p, workspace, workspace_bytes, nullptr);
  if (status.code == FH_ERROR_NOT_SUPPORTED) {
    cudaFree(workspace);
    GTEST_SKIP() << "not in this build: " << status.message;
  }
  ASSERT_TRUE(status.ok()) << status.message;
  CUDA_CHECK(cudaDeviceSynchronize());
  CUDA_CHECK(d_out.download(out));
  CUDA_CHECK(d_lse.download(lse));
  cudaFree(workspace);

  // Exact and plain low-precision references on the host.
  ForwardParams host = p;
  host.num_splits = 1;  // the reference's split writes partials; the kernel's combine gives out and lse
  host.q = bshd_view(q, c.heads_major_layout);
  host.k = bshd_view(k, c.heads_major_layout);
  host.v = c.v_column_major ? permute(v.view(), {0, 3, 1, 2}) : bshd_view(v, c.heads_major_layout);
  if (c.features.learnable_sink) host.learnable_sink = sink.view();
  if (fp8) set_descales(host, descales, /*on_device=*/false);
  HostTensor out_exact(FH_DTYPE_FP64, {c.batch, c.seqlen_q, c.heads_q, c.value_dim()});
  HostTensor lse_exact(FH_DTYPE_FP64, {c.batch, c.heads_q, c.seqlen_q});
  HostTensor out_plain(out_dtype, {c.batch, c.seqlen_q, c.heads_q, c.value_dim()});
  HostTensor lse_plain(FH_DTYPE_FP32, {c.batch, c.heads_q, c.seqlen_q});
  ASSERT_NO_FATAL_FAILURE(reference_outputs(host, out_exact, lse_exact, out_plain, lse_plain));

  const int dv = c.value_dim();
  const Tensor out_view = narrow(out.view(), 3, 0, dv);
  EXPECT_EQ(count_not_nan(narrow(out.view(), 3, dv, c.output_columns(dv) - dv)), 0)
      << "out: columns past the head dim were written";
  const double out_err = max_abs_diff(out_view, out_exact.view());
  const double out_plain_err = max_abs_diff(out_plain.view(), out_exact.view());
  const double lse_err = max_abs_diff(lse.view(), lse_exact.view());
  const double lse_plain_err = max_abs_diff(lse_plain.view(), lse_exact.view());
  RecordProperty("out_err", std::to_string(out_err));
  RecordProperty("out_plain_err", std::to_string(out_plain_err));
  EXPECT_FALSE(has_nan(out_view)) << "unwritten (poisoned) or NaN elements in out";
  EXPECT_FALSE(has_nan(lse.view())) << "unwritten (poisoned) or NaN elements in lse";
  EXPECT_LE(out_err, 2 * out_plain_err + 1e-5) << "out: ours " << out_err << ", plain " << out_plain_err;
  // fp8: Hopper's 8-bit MMA keeps about 14 bits of the sum while accumulating (DeepSeek-V3's report
  // measured it), so S, and the LSE with it, carry error relative to S's size that the plain
  // implementation's float32 sums do not: fp8's LSE takes 1e-3 of its size more (the Python test's
  // rtol and atol; measured 1e-3 to 8e-3 on an H100; a wrong S is off by far more).
  const double lse_slack = fp8 ? 1e-3 * (1 + max_abs_finite(lse_exact.view())) : 1e-5;
  EXPECT_LE(lse_err, 2 * lse_plain_err + lse_slack)
      << "lse: ours " << lse_err << ", plain " << lse_plain_err << ", largest " << max_abs_finite(lse_exact.view());
}

std::vector<GridCase> forward_cases() {
  struct Shape {
    int batch, seqlen_q, seqlen_k, heads_q, heads_kv;
    bool heads_major;
  };
  const std::vector<Shape> shapes = {
      {1, 1, 1, 1, 1, false},          {2, 7, 7, 3, 3, false},       {1, 113, 200, 4, 2, false},
      {3, 128, 128, 2, 2, false},      {2, 1000, 513, 4, 1, false},  {1, 257, 1000, 2, 2, false},
      {1, 2048, 2048, 2, 1, false},    {4, 300, 300, 16, 4, true},   {1, 4097, 4097, 1, 1, false},
  };
  std::vector<GridCase> cases;
  for (const auto& [dtype, head_dim] : compiled_families(/*backward=*/false, /*with_fp8=*/true))
    for (bool causal : {false, true})
      for (const Shape& s : shapes)
        cases.push_back({dtype, head_dim, causal, s.batch, s.seqlen_q, s.seqlen_k, s.heads_q, s.heads_kv,
                         s.heads_major});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Grid, ForwardGpuTest, ::testing::ValuesIn(forward_cases()),
                         [](const ::testing::TestParamInfo<GridCase>& info) { return info.param.name(); });
INSTANTIATE_TEST_SUITE_P(Features, ForwardGpuTest, ::testing::ValuesIn(feature_cases(/*backward=*/false)),
                         [](const ::testing::TestParamInfo<GridCase>& info) { return info.param.name(); });
// A row of the suites below, over the compiled forward families (fp8's too).
struct SuiteRow {
  bool causal;
  int batch, seqlen_q, seqlen_k, heads_q, heads_kv, num_splits;
  Features f;
};
std::vector<GridCase> suite_cases(const std::vector<SuiteRow>& rows, bool fp8_only = false,
                                  bool v_column_major = false) {
  std::vector<GridCase> cases;
  for (const auto& [dtype, head_dim] : compiled_families(/*backward=*/false, /*with_fp8=*/true)) {
    if (fp8_only && dtype != FH_DTYPE_FP8_E4M3) continue;
    for (const SuiteRow& r : rows) {
      GridCase c{dtype, head_dim, r.causal, r.batch, r.seqlen_q, r.seqlen_k, r.heads_q, r.heads_kv, false, r.f};
      c.num_splits = r.num_splits;
      c.v_column_major = v_column_major;
      cases.push_back(c);
    }
  }
  return cases;
}

// Split-KV: keys split into parts that the combine kernel merges, under every mask and transform;
// more splits than key blocks (empty splits), the learnable sink (counted once), and 0 (the
// library's choice from the shapes).
std::vector<GridCase> split_kv_cases() {
  return suite_cases({
      {false, 2, 1, 3000, 8, 2, 2},
      {true, 1, 300, 2000, 4, 1, 3},
      {false, 1, 64, 1000, 4, 4, 7, {100, 0}},
      {false, 1, 3, 5000, 8, 1, 32, {-1, -1, 0, 0, 30.f, true}},
      {true, 2, 5, 4096, 16, 2, 0},
      {false, 3, 1, 8192, 4, 1, 0, {-1, -1, 0, 0, 0.f, true}},
      {false, 1, 200, 300, 2, 2, 256, {-1, -1, 0, 0, 0.f, true}},
      {false, 2, 130, 1500, 4, 2, 5, {128, 0, 4}},
      {true, 1, 7, 777, 2, 1, 4, {-1, -1, 0, 100}},
  });
}

INSTANTIATE_TEST_SUITE_P(SplitKv, ForwardGpuTest, ::testing::ValuesIn(split_kv_cases()),
                         [](const ::testing::TestParamInfo<GridCase>& info) { return info.param.name(); });
// fp8 with v column-major ([B, Hkv, dv, S] storage: FA3's V_colmajor, loaded with no transpose):
// causal and not, decode-like and GQA rows, a window with sink tokens, split-KV. Key counts are
// multiples of 16 (v's dv stride is S bytes, which the TMA needs 16-byte aligned).
std::vector<GridCase> v_column_major_cases() {
  return suite_cases({{false, 2, 300, 512, 4, 2, 1},
                      {true, 2, 300, 512, 4, 2, 1},
                      {false, 1, 1, 2048, 8, 1, 1},
                      {true, 3, 128, 128, 2, 2, 1},
                      {false, 1, 257, 1008, 2, 2, 1, {100, 0, 4}},
                      {true, 1, 64, 4096, 4, 1, 3}},
                     /*fp8_only=*/true, /*v_column_major=*/true);
}

INSTANTIATE_TEST_SUITE_P(VColumnMajor, ForwardGpuTest, ::testing::ValuesIn(v_column_major_cases()),
                         [](const ::testing::TestParamInfo<GridCase>& info) { return info.param.name(); });
INSTANTIATE_TEST_SUITE_P(PaddedHeadDims, ForwardGpuTest, ::testing::ValuesIn(padded_head_dim_cases(false)),
                         [](const ::testing::TestParamInfo<GridCase>& info) { return info.param.name(); });

// ---- split-KV combine -----------------------------------------------------------------------------

struct CombineCase {
  bool packed;
  fh_dtype out_dtype;
  int splits;
  std::string name() const {
    const char* dtype = out_dtype == FH_DTYPE_FP32 ? "fp32" : out_dtype == FH_DTYPE_BF16 ? "bf16" : "fp16";
    return std::string(packed ? "packed_" : "dense_") + dtype + "_splits" + std::to_string(splits);
  }
};

// The combine kernel against the CPU reference's exact combine: random partials, LSE spread over
// [-8, 8] with single splits and whole rows at -inf (a row no split saw: O = 0, LSE = -inf), out and
// lse poisoned first. out within twice the rounding to its dtype of the exact value (float32:
// 1e-5 relative, the sums' own rounding), plus 1e-6; lse within 1e-5 relative. NaN never passes.
class CombineGpuTest : public ::testing::TestWithParam<CombineCase> {};

TEST_P(CombineGpuTest, MatchesReference) {
  const CombineCase c = GetParam();
  const int64_t B = 3, H = 4, sq = 37, dv = 72, S = c.splits, total = B * sq;
  const std::vector<int64_t> out_partial_shape =
      c.packed ? std::vector<int64_t>{S, H, total, dv} : std::vector<int64_t>{S, B, H, sq, dv};
  const std::vector<int64_t> lse_partial_shape =
      c.packed ? std::vector<int64_t>{S, H, total} : std::vector<int64_t>{S, B, H, sq};
  const std::vector<int64_t> out_shape =
      c.packed ? std::vector<int64_t>{total, H, dv} : std::vector<int64_t>{B, sq, H, dv};
  const std::vector<int64_t> lse_shape = c.packed ? std::vector<int64_t>{H, total} : std::vector<int64_t>{B, H, sq};
  HostTensor out_partial = random_tensor(FH_DTYPE_FP32, out_partial_shape, 4101);
  HostTensor lse_partial = random_tensor(FH_DTYPE_FP32, lse_partial_shape, 4102);
  for_each_index(lse_partial_shape, [&](const std::vector<int64_t>& i) {
    const int64_t split = i[0], row = i.back();
    double v = 4 * lse_partial.get(i);
    if ((split + 3 * row) % 5 == 1 && S > 1) v = -INFINITY;  // this split saw no key of the row
    if (row % 11 == 5) v = -INFINITY;                         // no split saw one
    lse_partial.set(i, v);
  });
  HostTensor out(c.out_dtype, out_shape), lse(FH_DTYPE_FP32, lse_shape);
  DeviceTensor d_out_partial(out_partial), d_lse_partial(lse_partial), d_out(out), d_lse(lse);
  ASSERT_TRUE(d_out_partial.ok() && d_lse_partial.ok() && d_out.ok() && d_lse.ok());
  CUDA_CHECK(d_out_partial.upload(out_partial));
  CUDA_CHECK(d_lse_partial.upload(lse_partial));
  CUDA_CHECK(d_out.poison());
  CUDA_CHECK(d_lse.poison());
  CombineParams p{};
  fh_combine_params_init(&p);
  p.out_partial = d_out_partial.view();
  p.lse_partial = d_lse_partial.view();
  p.out = d_out.view();
  p.lse = d_lse.view();
  const Status status = combine(p, nullptr);
  ASSERT_TRUE(status.ok()) << status.message;
  CUDA_CHECK(cudaDeviceSynchronize());
  CUDA_CHECK(d_out.download(out));
  CUDA_CHECK(d_lse.download(lse));

  HostTensor out_exact(FH_DTYPE_FP64, out_shape), lse_exact(FH_DTYPE_FP64, lse_shape);
  CombineParams host = p;
  host.out_partial = out_partial.view();
  host.lse_partial = lse_partial.view();
  host.out = out_exact.view();
  host.lse = lse_exact.view();
  const Status reference = flashhopper::reference::combine(host);
  ASSERT_TRUE(reference.ok()) << reference.message;

  const double relative = c.out_dtype == FH_DTYPE_FP32   ? 1e-5
                           : c.out_dtype == FH_DTYPE_BF16 ? 2 * 0x1p-8
                                                          : 2 * 0x1p-11;
  int64_t bad = 0, rows_seen_by_none = 0;
  for_each_index(out_shape, [&](const std::vector<int64_t>& i) {
    const double ours = out.get(i), exact = out_exact.get(i);
    if (!(std::fabs(ours - exact) <= relative * std::fabs(exact) + 1e-6) && bad++ < 5)
      ADD_FAILURE() << "out at " << ::testing::PrintToString(i) << ": " << ours << " against " << exact;
  });
  for_each_index(lse_shape, [&](const std::vector<int64_t>& i) {
    const double ours = lse.get(i), exact = lse_exact.get(i);
    rows_seen_by_none += exact == -INFINITY;
    const bool ok = exact == -INFINITY ? ours == -INFINITY : std::fabs(ours - exact) <= 1e-5 * (1 + std::fabs(exact));
    if (!ok && bad++ < 10)
      ADD_FAILURE() << "lse at " << ::testing::PrintToString(i) << ": " << ours << " against " << exact;
  });
  EXPECT_EQ(bad, 0);
  EXPECT_GT(rows_seen_by_none, 0) << "the case has rows no split saw";
}

std::vector<CombineCase> combine_cases() {
  std::vector<CombineCase> cases;
  for (bool packed : {false, true})
    for (fh_dtype dtype : {FH_DTYPE_FP32, FH_DTYPE_BF16, FH_DTYPE_FP16})
      for (int splits : {1, 3, 7, 32, 256}) cases.push_back({packed, dtype, splits});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Combine, CombineGpuTest, ::testing::ValuesIn(combine_cases()),
                         [](const ::testing::TestParamInfo<CombineCase>& info) { return info.param.name(); });

// Bad input through the real entry point: refused with the argument's name, nothing launched.
TEST(ForwardGpuErrors, HostPointerRefused) {
  HostTensor q = random_tensor(FH_DTYPE_BF16, {1, 64, 1, 128}, 1), out(FH_DTYPE_BF16, {1, 64, 1, 128});
  ForwardParams p = default_forward_params();
  p.q = q.view();
  p.k = q.view();
  p.v = q.view();
  p.out = out.view();
  const Status status = forward(p, nullptr, 0, nullptr);
  EXPECT_EQ(status.code, FH_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(status.message.find("q"), std::string::npos) << status.message;
}

// What the kernels do not run yet is refused by name, never run with the argument ignored: qv.
TEST(ForwardGpuErrors, QvIsRefusedNotIgnored) {
  HostTensor q = random_tensor(FH_DTYPE_BF16, {2, 8, 2, 128}, 1), out(FH_DTYPE_BF16, {2, 8, 2, 128});
  DeviceTensor d_q(q), d_out(out);
  ASSERT_TRUE(d_q.ok() && d_out.ok());
  CUDA_CHECK(d_q.upload(q));
  ForwardParams p = default_forward_params();
  p.q = p.k = p.v = p.qv = d_q.view();
  p.out = d_out.view();
  const Status status = forward(p, nullptr, 0, nullptr);
  EXPECT_EQ(status.code, FH_ERROR_NOT_SUPPORTED) << status.message;
  EXPECT_NE(status.message.find("qv"), std::string::npos) << status.message;
}

// ---- a dense KV cache ---------------------------------------------------------------------------

// The pass rule on a forward's out and lse against the reference's exact ones and those of a plain
// implementation in the inputs' precision: out within twice the plain error (NaN fails); lse within
// 1e-3 (relative) or twice the plain error (rotary rounds the rotated q to bf16 before Q K^T, as the
// plain one does and the exact one does not), -inf exactly where the exact one is.
// with_lse false: the call asked for no lse (out alone is checked).
void expect_forward_outputs_pass(const HostTensor& out, const HostTensor& lse, const HostTensor& out_exact,
                                 const HostTensor& lse_exact, const HostTensor& out_plain, const HostTensor& lse_plain,
                                 bool with_lse = true) {
  const double ours = max_abs_diff(out.view(), out_exact.view());
  const double plain = max_abs_diff(out_plain.view(), out_exact.view());
  EXPECT_LE(ours, 2 * plain + 1e-5) << "plain bf16 error " << plain;
  if (!with_lse) return;
  double lse_plain_err = 0;
  for_each_index(lse.shape(), [&](const std::vector<int64_t>& i) {
    if (lse_exact.get(i) != -INFINITY)
      lse_plain_err = std::max(lse_plain_err, std::fabs(lse_plain.get(i) - lse_exact.get(i)));
  });
  for_each_index(lse.shape(), [&](const std::vector<int64_t>& i) {
    const double a = lse.get(i), e = lse_exact.get(i);
    const double tolerance = std::max(1e-3 * (1 + std::fabs(e)), 2 * lse_plain_err + 1e-5);
    if (!(e == -INFINITY ? a == -INFINITY : std::fabs(a - e) <= tolerance))
      ADD_FAILURE() << "lse at " << ::testing::PrintToString(i) << ": " << a << " against " << e;
  });
}

struct KvCacheCase {
  int batch, seqlen_q, heads_q, heads_kv, cache_rows, cache_len;
  bool causal, leftpad, batch_idx;
  int window_left = -1;
  int seqlen_new = 0;  // keys appended (k_new/v_new) before attending
  int rotary_dim = 0;  // with an append: rotary on the new keys and q
  bool interleaved = true;
  int num_splits = 1;
  int page_size = 0;  // > 0: a paged cache, cache_len keys a sequence in shuffled pages
  bool packed_new = false;  // the new keys packed (cu_seqlens_k_new): sequences append 0..seqlen_new
  bool with_lse = true;  // false: no lse asked for
  fh_dtype dtype = FH_DTYPE_BF16;  // of q and the cache; fp8: with q/k/v_descale, out bf16
  bool used_q = false;  // seqused_q over the dense queries: sequence b's first b % (seqlen_q + 1) tokens
  std::string name() const {
    return std::string(dtype == FH_DTYPE_FP8_E4M3 ? "fp8_" : "") + "b" + std::to_string(batch) + "_sq" +
           std::to_string(seqlen_q) + "_h" + std::to_string(heads_q) + "_hkv" + std::to_string(heads_kv) + "_rows" +
           std::to_string(cache_rows) + "_S" + std::to_string(cache_len) +
           (causal ? "_causal" : "") + (leftpad ? "_leftpad" : "") + (batch_idx ? "_batchidx" : "") +
           (window_left >= 0 ? "_w" + std::to_string(window_left) : "") +
           (seqlen_new > 0 ? "_new" + std::to_string(seqlen_new) : "") +
           (rotary_dim > 0 ? "_rotary" + std::to_string(rotary_dim) + (interleaved ? "i" : "h") : "") +
           (num_splits != 1 ? "_splits" + std::to_string(num_splits) : "") +
           (page_size > 0 ? "_page" + std::to_string(page_size) : "") + (packed_new ? "_packednew" : "") +
           (with_lse ? "" : "_nolse") + (used_q ? "_usedq" : "");
  }
};

// Decoding against a dense cache k/v [cache_rows, S, Hkv, 128] bf16 (or fp8, descales [B, Hkv]):
// each sequence's keys are the positions [cache_leftpad, cache_seqlens + s_new) of its row
// (cache_batch_idx), lengths of 0, 1 and the whole cache among them, after appending s_new keys
// (rotated, with rotary, as q is). Or
// a paged cache [pages, page_size, Hkv, 128]: S / page_size pages a row of the page table (one a
// sequence, or cache_rows picked by cache_batch_idx), in shuffled order, and a few pages no row
// uses.
// Against the CPU reference with the pass rule, out and lse poisoned; the cache afterwards: the
// appended keys as the reference's (rotated ones within a bf16 rounding), the rest bit-unchanged.
class KvCacheGpuTest : public ::testing::TestWithParam<KvCacheCase> {};

TEST_P(KvCacheGpuTest, MatchesReference) {
  const KvCacheCase c = GetParam();
  const int d = 128;
  const bool fp8 = c.dtype == FH_DTYPE_FP8_E4M3;
  HostTensor q = random_tensor(c.dtype, {c.batch, c.seqlen_q, c.heads_q, d}, 5101);
  const bool paged = c.page_size > 0;
  const int table_rows = c.batch_idx ? c.cache_rows : c.batch;  // paged: cache_batch_idx picks a table row
  const int max_pages = paged ? c.cache_len / c.page_size : 0, num_pages = table_rows * max_pages + 3;
  const std::vector<int64_t> cache_shape = paged ? std::vector<int64_t>{num_pages, c.page_size, c.heads_kv, d}
                                                 : std::vector<int64_t>{c.cache_rows, c.cache_len, c.heads_kv, d};
  HostTensor k = random_tensor(c.dtype, cache_shape, 5102);
  HostTensor v = random_tensor(c.dtype, cache_shape, 5103);
  // fp8: a factor a sequence and KV head for each of q, k, v (the sequence's, not its cache row's).
  Descales descales;
  if (fp8) ASSERT_NO_FATAL_FAILURE(make_descales(c.batch, c.heads_kv, 5110, &descales));
  std::vector<int32_t> page_ids(size_t(std::max(num_pages, 1)));
  for (int i = 0; i < num_pages; ++i) page_ids[i] = (i * 7919 + 11) % num_pages;  // a shuffle (7919 is prime)
  page_ids.resize(size_t(std::max(table_rows * max_pages, 1)));
  const HostTensor page_table = int32_tensor(page_ids, {paged ? table_rows : 1, std::max(max_pages, 1)});
  std::vector<int32_t> lengths(c.batch), firsts(c.batch, 0), rows(c.batch);
  for (int b = 0; b < c.batch; ++b) {
    lengths[b] = b == 0 ? c.cache_len : b == 1 ? 0 : b == 2 ? 1 : (b * 977) % c.cache_len;
    lengths[b] = std::min(lengths[b], c.cache_len - c.seqlen_new);  // room for the append
    if (c.leftpad) firsts[b] = std::min(lengths[b], (b * 131) % 300);
    rows[b] = c.batch_idx ? (c.cache_rows - 1 - b) % c.cache_rows : b;
  }
  const HostTensor cache_seqlens = int32_tensor(lengths), leftpad = int32_tensor(firsts);
  const HostTensor batch_idx = int32_tensor(rows);
  std::vector<int32_t> used(c.batch);
  for (int b = 0; b < c.batch; ++b) used[b] = b % (c.seqlen_q + 1);
  const HostTensor seqused_q = int32_tensor(used);
  DeviceTensor d_used(seqused_q);
  ASSERT_TRUE(d_used.ok());
  CUDA_CHECK(d_used.upload(seqused_q));
  HostTensor out(FH_DTYPE_BF16, {c.batch, c.seqlen_q, c.heads_q, d});
  HostTensor lse(FH_DTYPE_FP32, {c.batch, c.heads_q, c.seqlen_q});
  DeviceTensor d_q(q), d_k(k), d_v(v), d_out(out), d_lse(lse), d_lengths(cache_seqlens), d_leftpad(leftpad),
      d_rows(batch_idx), d_table(page_table);
  for (auto [device, host] : {std::pair<DeviceTensor*, const HostTensor*>{&d_q, &q}, {&d_k, &k}, {&d_v, &v},
                              {&d_lengths, &cache_seqlens}, {&d_leftpad, &leftpad}, {&d_rows, &batch_idx},
                              {&d_table, &page_table}}) {
    ASSERT_TRUE(device->ok());
    CUDA_CHECK(device->upload(*host));
  }
  CUDA_CHECK(d_out.poison());
  CUDA_CHECK(d_lse.poison());
  const int s_new = std::max(c.seqlen_new, 1);  // tensors of at least one token (unused without an append)
  // Packed new keys: sequence b appends seqlen_new, seqlen_new - 1 or none of them.
  std::vector<int32_t> cu_new(c.batch + 1, 0);
  for (int b = 0; b < c.batch; ++b) cu_new[b + 1] = cu_new[b] + (b % 3 == 1 ? 0 : c.seqlen_new - b % 2);
  const std::vector<int64_t> new_shape = c.packed_new ? std::vector<int64_t>{std::max(cu_new.back(), 1), c.heads_kv, d}
                                                      : std::vector<int64_t>{c.batch, s_new, c.heads_kv, d};
  HostTensor k_new = random_tensor(c.dtype, new_shape, 5104);
  HostTensor v_new = random_tensor(c.dtype, new_shape, 5105);
  const HostTensor cu_seqlens_new = int32_tensor(cu_new);
  const int positions = c.cache_len + c.seqlen_q, half = std::max(c.rotary_dim / 2, 1);
  HostTensor angle = random_tensor(FH_DTYPE_FP64, {positions, half}, 5106);
  HostTensor cos(FH_DTYPE_BF16, {positions, half}), sin(FH_DTYPE_BF16, {positions, half});
  for_each_index({positions, half}, [&](const std::vector<int64_t>& i) {
    cos.set(i, std::cos(3 * angle.get(i)));
    sin.set(i, std::sin(3 * angle.get(i)));
  });
  DeviceTensor d_k_new(k_new), d_v_new(v_new), d_cos(cos), d_sin(sin), d_cu_new(cu_seqlens_new);
  for (auto [device, host] : {std::pair<DeviceTensor*, const HostTensor*>{&d_k_new, &k_new}, {&d_v_new, &v_new},
                              {&d_cos, &cos}, {&d_sin, &sin}, {&d_cu_new, &cu_seqlens_new}}) {
    ASSERT_TRUE(device->ok());
    CUDA_CHECK(device->upload(*host));
  }
  ForwardParams p = default_forward_params();
  p.q = d_q.view();
  p.k = d_k.view();
  p.v = d_v.view();
  p.out = d_out.view();
  if (c.with_lse) p.lse = d_lse.view();
  p.cache_seqlens = d_lengths.view();
  if (c.leftpad) p.cache_leftpad = d_leftpad.view();
  if (c.batch_idx) p.cache_batch_idx = d_rows.view();
  if (paged) p.page_table = d_table.view();
  if (c.used_q) p.seqused_q = d_used.view();
  p.causal = c.causal;
  p.num_splits = c.num_splits;
  p.window_left = c.window_left;
  if (c.window_left >= 0) p.window_right = 0, p.causal = 0;
  if (c.seqlen_new > 0) {
    p.k_new = d_k_new.view();
    p.v_new = d_v_new.view();
    if (c.packed_new) p.cu_seqlens_k_new = d_cu_new.view();
  }
  if (c.rotary_dim > 0) {
    p.rotary_cos = d_cos.view();
    p.rotary_sin = d_sin.view();
    p.rotary_interleaved = c.interleaved;
  }
  if (fp8) set_descales(p, descales, /*on_device=*/true);
  size_t workspace_bytes = 0;
  Status status = workspace_size(p, &workspace_bytes);
  ASSERT_TRUE(status.ok()) << status.message;
  DeviceBuffer workspace;
  CUDA_CHECK(workspace.allocate(workspace_bytes));
  status = forward(p, workspace.data(), workspace_bytes, nullptr);
  if (status.code == FH_ERROR_NOT_SUPPORTED) GTEST_SKIP() << "not in this build: " << status.message;
  ASSERT_TRUE(status.ok()) << status.message;
  CUDA_CHECK(cudaDeviceSynchronize());
  CUDA_CHECK(d_out.download(out));
  CUDA_CHECK(d_lse.download(lse));
  HostTensor k_ours = k, v_ours = v;  // the device cache after the call
  CUDA_CHECK(d_k.download(k_ours));
  CUDA_CHECK(d_v.download(v_ours));
  const HostTensor k_before = k, v_before = v;

  ForwardParams host = p;
  host.num_splits = 1;  // the same result without partials
  host.q = q.view();
  host.k = k.view();  // the reference appends into these host copies
  host.v = v.view();
  host.k_new = c.seqlen_new > 0 ? k_new.view() : Tensor{};
  host.v_new = c.seqlen_new > 0 ? v_new.view() : Tensor{};
  host.cu_seqlens_k_new = c.seqlen_new > 0 && c.packed_new ? cu_seqlens_new.view() : Tensor{};
  host.rotary_cos = c.rotary_dim > 0 ? cos.view() : Tensor{};
  host.rotary_sin = c.rotary_dim > 0 ? sin.view() : Tensor{};
  host.cache_seqlens = cache_seqlens.view();
  host.cache_leftpad = c.leftpad ? leftpad.view() : Tensor{};
  host.cache_batch_idx = c.batch_idx ? batch_idx.view() : Tensor{};
  host.page_table = paged ? page_table.view() : Tensor{};
  host.seqused_q = c.used_q ? seqused_q.view() : Tensor{};
  if (fp8) set_descales(host, descales, /*on_device=*/false);
  HostTensor out_exact(FH_DTYPE_FP64, {c.batch, c.seqlen_q, c.heads_q, d}), lse_exact(FH_DTYPE_FP64, lse.shape());
  HostTensor out_plain(FH_DTYPE_BF16, out.shape()), lse_plain(FH_DTYPE_FP32, lse.shape());
  ASSERT_NO_FATAL_FAILURE(reference_outputs(host, out_exact, lse_exact, out_plain, lse_plain));
  for (auto [ours, expected, before, name] :
       {std::tuple<const HostTensor*, const HostTensor*, const HostTensor*, const char*>{&k_ours, &k, &k_before, "k"},
        {&v_ours, &v, &v_before, "v"}}) {
    int64_t bad = 0;
    for_each_index(ours->shape(), [&](const std::vector<int64_t>& i) {
      const double a = ours->get(i), e = expected->get(i);
      const bool untouched = before->get(i) == e && a == before->get(i);
      const bool appended = std::fabs(a - e) <= 0x1p-7 * std::fabs(e) + 1e-6;  // a rotated key's rounding
      if (!(untouched || (before->get(i) != e && appended)) && bad++ < 5)
        ADD_FAILURE() << name << " cache at " << ::testing::PrintToString(i) << ": " << a << ", expected " << e;
    });
  }
  expect_forward_outputs_pass(out, lse, out_exact, lse_exact, out_plain, lse_plain, c.with_lse);
}

std::vector<KvCacheCase> kv_cache_cases() {
  std::vector<KvCacheCase> cases;
  for (bool causal : {false, true})
    for (int seqlen_q : {1, 3, 64}) {
      cases.push_back({6, seqlen_q, 8, 2, 6, 1000, causal, false, false});
      cases.push_back({6, seqlen_q, 8, 1, 9, 1000, causal, true, true});
    }
  cases.push_back({5, 4, 32, 8, 7, 4096, true, true, true});
  cases.push_back({5, 4, 4, 4, 5, 700, false, true, false, 100});  // a window over the cache
  // One KV head, several query tokens (MQA): without qv these are not packed (the qv cases of
  // QvGpuTest are), so a tile per query head, each row's mask its own (causal, a window, an append
  // with rotary, split, paged), with and without an lse (the causal ones with one are above).
  for (KvCacheCase c : {KvCacheCase{6, 3, 8, 1, 9, 1000, true, true, true}, KvCacheCase{6, 64, 8, 1, 9, 1000, true, true, true},
                        KvCacheCase{5, 4, 4, 1, 5, 700, false, true, false, 100},
                        KvCacheCase{4, 3, 8, 1, 6, 1024, true, true, true, -1, 3, 64, true},
                        KvCacheCase{4, 5, 16, 1, 4, 4096, true, false, false, -1, 0, 0, true, 3},
                        KvCacheCase{4, 3, 8, 1, 4, 1024, true, true, false, -1, 0, 0, true, 1, 16}}) {
    if (c.window_left >= 0 || c.seqlen_new > 0 || c.num_splits > 1 || c.page_size > 0) cases.push_back(c);
    c.with_lse = false;
    cases.push_back(c);
  }
  // GQA ratios 16 and 32, decoding (packed: 16 and 32 query heads a tile) and not.
  for (int seqlen_q : {1, 3}) {
    cases.push_back({3, seqlen_q, 32, 2, 4, 1500, seqlen_q > 1, true, true});
    cases.push_back({3, seqlen_q, 32, 1, 3, 1500, false, false, false});
  }
  // Appending, with rotary (interleaved or not, a rotary dim below d), q rotated at consecutive
  // positions (causal) or all at the offset.
  cases.push_back({4, 1, 8, 2, 4, 1000, false, false, false, -1, 1});
  cases.push_back({4, 3, 8, 2, 6, 1000, true, true, true, -1, 3, 64, true});
  cases.push_back({4, 3, 8, 2, 4, 1000, false, false, false, -1, 2, 128, false});
  cases.push_back({4, 5, 8, 8, 4, 600, true, false, true, -1, 5, 32, false});
  // Split-KV over the cache (lengths 0, 1 and full among the sequences): forced and chosen.
  for (int splits : {2, 3, 7, 32, 0}) {
    KvCacheCase c{6, splits == 7 ? 64 : 1, 32, 8, 7, 4096, splits % 2 == 1, true, true};
    c.num_splits = splits;
    if (splits == 3) c.seqlen_new = 3, c.rotary_dim = 64;
    if (splits == 32) c.window_left = 500;
    cases.push_back(c);
  }
  // Paged: pages of 16 keys (a block reads 10 pages at hdim 128), 48 (no block boundary on a page
  // boundary), 64, 128 and 256, and pages loaded key by key: 1, 4 and 24; decoding (packed GQA,
  // split-KV chosen and forced), an append with rotary, a prefill-like 64 rows, a window. Decodes
  // run unmasked (packed GQA: blocks of 160 keys), the appends causal (128): both take every chunk
  // size, 1, 16 and 32 keys.
  for (int page_size : {1, 4, 16, 24, 48, 64, 128, 256}) {
    KvCacheCase c{6, 1, 32, 8, 0, page_size * (2048 / page_size), page_size % 32 == 16, false, false};
    c.num_splits = page_size == 128 ? 3 : 0;
    c.page_size = page_size;
    cases.push_back(c);
  }
  for (int page_size : {4, 16, 64, 128}) {
    KvCacheCase c{4, 3, 8, 2, 0, 1024, true, false, false, -1, 3, 64, true};
    c.page_size = page_size;
    cases.push_back(c);
    c = KvCacheCase{3, 64, 8, 2, 0, 1536, false, false, false, page_size == 16 ? 300 : -1};
    c.page_size = page_size;
    cases.push_back(c);
  }
  // Paged with cache_batch_idx (a table of more rows than sequences) and cache_leftpad (keys from
  // mid-page: gathered whatever the page size): decoding with splits chosen and forced, an append
  // with rotary into the picked rows, a window.
  for (int page_size : {16, 24, 64, 128}) {
    KvCacheCase c{6, 1, 32, 8, 9, page_size * (2064 / page_size), false, page_size != 128, true};
    c.num_splits = page_size == 64 ? 3 : 0;
    c.page_size = page_size;
    cases.push_back(c);
    c = KvCacheCase{4, 3, 8, 2, 6, page_size * (1032 / page_size), true, true, page_size != 24, -1, 3, 64, true};
    c.page_size = page_size;
    cases.push_back(c);
  }
  // New keys packed (cu_seqlens_k_new): sequences appending 3, 2 or none, with rotary, into a dense
  // cache with its extras and into pages, unsplit and split.
  for (int page_size : {0, 16, 24}) {
    KvCacheCase c{6, 3, 8, 2, 6, 1032 - 1032 % std::max(page_size, 1), true, true, true, -1, 3, 64, true};
    c.page_size = page_size;
    c.num_splits = page_size == 16 ? 3 : 1;
    c.packed_new = true;
    cases.push_back(c);
  }
  // Split-KV with packed GQA (one query token: a KV head's query heads are one tile's rows) over
  // GQA ratios 8, 16 and 32 (4 above): unsplit, forced and chosen, a dense cache or pages of 16.
  for (const auto& [heads_q, heads_kv] : {std::pair{64, 8}, std::pair{32, 2}, std::pair{32, 1}}) {
    for (int splits : {0, 1, 3, 32}) {
      KvCacheCase c{4, 1, heads_q, heads_kv, 4, 4096, splits % 2 == 1, false, false};
      c.num_splits = splits;
      c.page_size = splits == 3 ? 16 : 0;
      cases.push_back(c);
    }
  }
  // Several query tokens with GQA (speculative decoding: a KV head's (token, head) rows gathered
  // into one tile, the combine writing out and lse) over ratios 4-32, split unsplit, forced and
  // chosen, a dense cache with its extras or pages of 16; ratios 3 and 7 with their rows padded to
  // 4 and 8 a token (Qwen's 28/4 among them).
  for (const auto& [heads_q, heads_kv] : {std::pair{32, 8}, std::pair{64, 8}, std::pair{32, 2}, std::pair{32, 1}}) {
    for (int splits : {0, 1, 3, 32}) {
      KvCacheCase c{4, 4, heads_q, heads_kv, splits == 0 ? 6 : 4, 4096, splits != 1, splits == 0, splits == 0};
      c.num_splits = splits;
      c.page_size = splits == 3 ? 16 : 0;
      c.with_lse = splits != 32;
      cases.push_back(c);
    }
  }
  cases.push_back({4, 4, 24, 8, 4, 2048, true, false, false});
  cases.push_back({4, 3, 28, 4, 4, 2048, true, false, false});
  KvCacheCase ratio7{4, 5, 28, 4, 6, 2048, false, true, true};
  ratio7.num_splits = 3;
  ratio7.page_size = 16;
  cases.push_back(ratio7);
  // seqused_q over dense queries (the C API's form): such calls are not packed, as seqused_q counts
  // tokens where a packed call's rows are heads too; one token (0 or 1 used) and four, split or not.
  for (int seqlen_q : {1, 4}) {
    KvCacheCase c{6, seqlen_q, 32, 8, 6, 2048, seqlen_q > 1, false, false};
    c.used_q = true;
    cases.push_back(c);
    c.num_splits = 0;
    cases.push_back(c);
  }
  KvCacheCase windowed{5, 4, 4, 4, 7, 704, false, true, true, 100};
  windowed.page_size = 16;
  cases.push_back(windowed);
  // fp8 (the bench set up): a dense cache with its extras and an append; pages in TMA chunks (16,
  // 64) and gathered by the producer's one loading warp (1, 24, and 16 with cache_leftpad), rows
  // picked by cache_batch_idx, an append into pages, split-KV.
  for (KvCacheCase c : {KvCacheCase{6, 3, 8, 2, 6, 1000, true, true, true, -1, 2},
                        KvCacheCase{6, 1, 32, 8, 6, 2048, false, false, false}}) {
    c.dtype = FH_DTYPE_FP8_E4M3;
    cases.push_back(c);
  }
  for (int page_size : {1, 16, 24, 64}) {
    KvCacheCase c{6, 1, 32, 8, 0, page_size * (2048 / page_size), page_size == 16, false, false};
    c.page_size = page_size;
    c.num_splits = page_size == 64 ? 3 : 0;
    c.dtype = FH_DTYPE_FP8_E4M3;
    cases.push_back(c);
    c = KvCacheCase{4, 3, 8, 2, 6, page_size * (1032 / page_size), true, page_size == 16, true, -1, 3};
    c.page_size = page_size;
    c.dtype = FH_DTYPE_FP8_E4M3;
    cases.push_back(c);
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(KvCache, KvCacheGpuTest, ::testing::ValuesIn(kv_cache_cases()),
                         [](const ::testing::TestParamInfo<KvCacheCase>& info) { return info.param.name(); });

// qv (absorbed MLA: S = Q K^T + Qv V^T, head dim 64, value head dim 256 or 512), on the qv families:
// dense (sq = sk, causal or not, GQA 16/1) and decoding a KV cache (128 query heads on one KV head,
// packed into one tile; split-KV chosen and forced; a few query tokens, causal). dv 512 (and 384,
// padded to it) runs the kernels that split O over two warpgroups. Against the CPU reference
// (which computes qv) with the pass rule; out and lse poisoned.
struct QvCase {
  int batch, seqlen_q, seqlen_k, heads_q;
  bool causal, kv_cache;
  int num_splits = 1;
  bool with_lse = true;
  int dv = 256;
  std::string name() const {
    return "b" + std::to_string(batch) + "_sq" + std::to_string(seqlen_q) + "_sk" + std::to_string(seqlen_k) + "_h" +
           std::to_string(heads_q) + (causal ? "_causal" : "") + (kv_cache ? "_cache" : "") +
           (num_splits != 1 ? "_splits" + std::to_string(num_splits) : "") + (with_lse ? "" : "_nolse") +
           (dv != 256 ? "_dv" + std::to_string(dv) : "");
  }
};

class QvGpuTest : public ::testing::TestWithParam<QvCase> {};

TEST_P(QvGpuTest, MatchesReference) {
  const QvCase c = GetParam();
  const int d = 64, dv = c.dv;
  HostTensor q = random_tensor(FH_DTYPE_BF16, {c.batch, c.seqlen_q, c.heads_q, d}, 5201);
  HostTensor qv = random_tensor(FH_DTYPE_BF16, {c.batch, c.seqlen_q, c.heads_q, dv}, 5202);
  HostTensor k = random_tensor(FH_DTYPE_BF16, {c.batch, c.seqlen_k, 1, d}, 5203);
  HostTensor v = random_tensor(FH_DTYPE_BF16, {c.batch, c.seqlen_k, 1, dv}, 5204);
  std::vector<int32_t> lengths(c.batch);
  for (int b = 0; b < c.batch; ++b) lengths[b] = b == 0 ? c.seqlen_k : b == 1 ? 1 : (b * 977) % c.seqlen_k;
  const HostTensor cache_seqlens = int32_tensor(lengths);
  HostTensor out(FH_DTYPE_BF16, {c.batch, c.seqlen_q, c.heads_q, dv});
  HostTensor lse(FH_DTYPE_FP32, {c.batch, c.heads_q, c.seqlen_q});
  DeviceTensor d_q(q), d_qv(qv), d_k(k), d_v(v), d_out(out), d_lse(lse), d_lengths(cache_seqlens);
  for (auto [device, host] : {std::pair<DeviceTensor*, const HostTensor*>{&d_q, &q}, {&d_qv, &qv}, {&d_k, &k},
                              {&d_v, &v}, {&d_lengths, &cache_seqlens}}) {
    ASSERT_TRUE(device->ok());
    CUDA_CHECK(device->upload(*host));
  }
  CUDA_CHECK(d_out.poison());
  CUDA_CHECK(d_lse.poison());
  ForwardParams p = default_forward_params();
  p.q = d_q.view();
  p.qv = d_qv.view();
  p.k = d_k.view();
  p.v = d_v.view();
  p.out = d_out.view();
  if (c.with_lse) p.lse = d_lse.view();
  p.causal = c.causal;
  p.num_splits = c.num_splits;
  if (c.kv_cache) p.cache_seqlens = d_lengths.view();
  size_t workspace_bytes = 0;
  Status status = workspace_size(p, &workspace_bytes);
  ASSERT_TRUE(status.ok()) << status.message;
  DeviceBuffer workspace;
  CUDA_CHECK(workspace.allocate(workspace_bytes));
  status = forward(p, workspace.data(), workspace_bytes, nullptr);
  if (status.code == FH_ERROR_NOT_SUPPORTED) GTEST_SKIP() << "not in this build: " << status.message;
  ASSERT_TRUE(status.ok()) << status.message;
  CUDA_CHECK(cudaDeviceSynchronize());
  CUDA_CHECK(d_out.download(out));
  CUDA_CHECK(d_lse.download(lse));

  ForwardParams host = p;
  host.num_splits = 1;
  host.q = q.view();
  host.qv = qv.view();
  host.k = k.view();
  host.v = v.view();
  host.cache_seqlens = c.kv_cache ? cache_seqlens.view() : Tensor{};
  HostTensor out_exact(FH_DTYPE_FP64, out.shape()), lse_exact(FH_DTYPE_FP64, lse.shape());
  HostTensor out_plain(FH_DTYPE_BF16, out.shape()), lse_plain(FH_DTYPE_FP32, lse.shape());
  ASSERT_NO_FATAL_FAILURE(reference_outputs(host, out_exact, lse_exact, out_plain, lse_plain));
  expect_forward_outputs_pass(out, lse, out_exact, lse_exact, out_plain, lse_plain, c.with_lse);
}

INSTANTIATE_TEST_SUITE_P(Qv, QvGpuTest,
                         ::testing::Values(QvCase{2, 300, 300, 16, false, false}, QvCase{2, 300, 300, 16, true, false},
                                           QvCase{1, 77, 1000, 8, false, false}, QvCase{3, 1, 1000, 128, false, true},
                                           QvCase{3, 1, 1000, 128, false, true, 0},
                                           QvCase{3, 1, 3000, 128, false, true, 5},
                                           QvCase{3, 4, 1000, 128, true, true},
                                           // Several tokens packed, with an lse and without: a cache,
                                           // split, and dense.
                                           QvCase{3, 4, 1000, 128, true, true, 1, false},
                                           QvCase{3, 4, 3000, 128, true, true, 5},
                                           QvCase{3, 4, 3000, 128, true, true, 5, false},
                                           QvCase{2, 3, 300, 16, true, false},
                                           QvCase{2, 3, 300, 16, true, false, 1, false},
                                           // dv 512: O split over two warpgroups.
                                           QvCase{2, 300, 300, 16, false, false, 1, true, 512},
                                           QvCase{2, 300, 300, 16, true, false, 1, true, 512},
                                           QvCase{1, 77, 1000, 8, false, false, 1, true, 384},
                                           QvCase{3, 1, 1000, 128, false, true, 1, true, 512},
                                           QvCase{3, 1, 3000, 128, false, true, 0, true, 512},
                                           QvCase{3, 1, 3000, 128, false, true, 5, true, 512},
                                           QvCase{3, 4, 1000, 128, true, true, 1, true, 512},
                                           QvCase{3, 4, 3000, 128, true, true, 5, false, 512}),
                         [](const ::testing::TestParamInfo<QvCase>& info) { return info.param.name(); });

}  // namespace
}  // namespace flashhopper::test

// Without an sm_90 GPU nothing here can run: say so and exit with CTest's skip code (77).
int main(int argc, char** argv) { return flashhopper::test::gpu_test_main(argc, argv); }
