// Packed (varlen) batches on the Hopper kernels against the CPU reference (CTest label "gpu"):
// forward and backward, cu_seqlens with sequences of length 0 in the middle and at the end,
// sq != sk per sequence, seqused shorter than the sequences (their unused tokens hold garbage),
// and tokens after the last sequence that belong to none: the kernels must leave those rows of
// out, lse, dq, dk and dv poisoned. Pass rule as the dense tests (FlashAttention's): error versus
// the exact result at most twice a plain low-precision implementation's plus a tiny slack, NaN
// never passes. Without an sm_90 GPU every test skips and says so.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <memory>
#include <numeric>
#include <sstream>
#include <string>
#include <vector>

#include "flashhopper/flashhopper.hpp"
#include "gpu_test_util.hpp"
#include "reference/reference.hpp"
#include "test_util.hpp"

namespace flashhopper::test {
namespace {

constexpr int kExtraTokens = 37;   // after the last sequence, in no sequence
constexpr double kOutSlack = 1e-5;
constexpr double kGradSlack = 1e-4;  // as the dense backward test
constexpr int kRepeats = 20;

struct VarlenCase {
  fh_dtype dtype;
  int head_dim;
  bool causal;
  std::vector<int> lengths_q, lengths_k;
  std::vector<int> used_q, used_k;  // empty: no seqused
  int heads_q, heads_kv;
  Features features{};
  int num_splits = 1;  // the forward's split-KV (the reference runs unsplit)
  int page_size = 0;   // > 0: the forward reads K/V through a page table (the reference packed)

  std::string name() const {
    auto list = [](const std::vector<int>& v) {
      std::ostringstream s;
      for (size_t i = 0; i < v.size(); ++i) s << (i ? "_" : "") << v[i];
      return s.str();
    };
    std::ostringstream s;
    s << (dtype == FH_DTYPE_BF16 ? "bf16" : dtype == FH_DTYPE_FP16 ? "fp16" : "fp8") << "_d" << head_dim << (causal ? "_causal" : "_full") << "_q"
      << list(lengths_q) << "_k" << list(lengths_k);
    if (!used_q.empty()) s << "_usedq" << list(used_q);
    if (!used_k.empty()) s << "_usedk" << list(used_k);
    s << "_h" << heads_q << "_hkv" << heads_kv << features.tag();
    if (num_splits != 1) s << "_splits" << num_splits;
    if (page_size > 0) s << "_page" << page_size;
    return s.str();
  }
  int batch() const { return int(lengths_q.size()); }
  bool fp8() const { return dtype == FH_DTYPE_FP8_E4M3; }
  fh_dtype out_dtype() const { return fp8() ? FH_DTYPE_BF16 : dtype; }  // fp8 attention writes bf16
};

std::vector<int32_t> prefix_sums(const std::vector<int>& lengths) {
  std::vector<int32_t> cu(lengths.size() + 1, 0);
  for (size_t b = 0; b < lengths.size(); ++b) cu[b + 1] = cu[b] + lengths[b];
  return cu;
}

// Every element NaN: nothing wrote the (poisoned) view.
bool all_nan(const Tensor& t) {
  bool all = true;
  for_each_index(shape_of(t), [&](const std::vector<int64_t>& i) { all &= std::isnan(read(t, i)); });
  return all;
}

// A packed problem: host tensors (q, k, v, dout random; the tokens past seqused random too, as
// garbage the kernels must not attend), their device copies, and the parameters both passes share.
struct PackedProblem {
  VarlenCase c;
  int in_q = 0, in_k = 0;        // tokens inside the sequences
  int total_q = 0, total_k = 0;  // with the extra tokens
  HostTensor q, k, v, dout, cu_q, cu_k, used_q, used_k, sink;
  std::unique_ptr<DeviceTensor> d_q, d_k, d_v, d_dout, d_cu_q, d_cu_k, d_used_q, d_used_k, d_sink;
  // fp8: q/k/v_descale [B, Hkv], a factor a sequence and KV head.
  Descales descales;
  // page_size > 0: k and v in pages [num_pages, page_size, Hkv, d], sequence b's keys in row b of
  // the table from position 0 (unused rows and noise pages random), and cu_seqlens_k shifted by
  // 1000 on the device (only its differences count there).
  HostTensor paged_k, paged_v, page_table, shifted_cu_k;
  std::unique_ptr<DeviceTensor> d_paged_k, d_paged_v, d_page_table, d_shifted_cu_k;

  void init(const VarlenCase& vc) {
    c = vc;
    const uint32_t seed = uint32_t(std::hash<std::string>{}(c.name()));
    const std::vector<int32_t> cq = prefix_sums(c.lengths_q), ck = prefix_sums(c.lengths_k);
    in_q = cq.back();
    in_k = ck.back();
    total_q = in_q + kExtraTokens;
    total_k = in_k + kExtraTokens;
    q = random_tensor(c.dtype, {total_q, c.heads_q, c.head_dim}, seed);
    k = random_tensor(c.dtype, {total_k, c.heads_kv, c.head_dim}, seed + 1);
    v = random_tensor(c.dtype, {total_k, c.heads_kv, c.head_dim}, seed + 2);
    dout = random_tensor(c.dtype, {total_q, c.heads_q, c.head_dim}, seed + 3);
    cu_q = int32_tensor(cq);
    cu_k = int32_tensor(ck);
    if (!c.used_q.empty()) used_q = int32_tensor(std::vector<int32_t>(c.used_q.begin(), c.used_q.end()));
    if (!c.used_k.empty()) used_k = int32_tensor(std::vector<int32_t>(c.used_k.begin(), c.used_k.end()));
    sink = make_sink_logits(c.heads_q, seed + 4);
    d_q = std::make_unique<DeviceTensor>(q);
    d_k = std::make_unique<DeviceTensor>(k);
    d_v = std::make_unique<DeviceTensor>(v);
    d_dout = std::make_unique<DeviceTensor>(dout);
    d_cu_q = std::make_unique<DeviceTensor>(cu_q);
    d_cu_k = std::make_unique<DeviceTensor>(cu_k);
    d_used_q = std::make_unique<DeviceTensor>(c.used_q.empty() ? cu_q : used_q);
    d_used_k = std::make_unique<DeviceTensor>(c.used_k.empty() ? cu_k : used_k);
    d_sink = std::make_unique<DeviceTensor>(sink);
    for (auto* t : {d_q.get(), d_k.get(), d_v.get(), d_dout.get(), d_cu_q.get(), d_cu_k.get(), d_used_q.get(),
                    d_used_k.get(), d_sink.get()})
      ASSERT_TRUE(t->ok()) << "cudaMalloc failed";
    CUDA_CHECK(d_q->upload(q));
    CUDA_CHECK(d_k->upload(k));
    CUDA_CHECK(d_v->upload(v));
    CUDA_CHECK(d_dout->upload(dout));
    CUDA_CHECK(d_cu_q->upload(cu_q));
    CUDA_CHECK(d_cu_k->upload(cu_k));
    if (!c.used_q.empty()) CUDA_CHECK(d_used_q->upload(used_q));
    if (!c.used_k.empty()) CUDA_CHECK(d_used_k->upload(used_k));
    CUDA_CHECK(d_sink->upload(sink));
    if (c.page_size > 0) ASSERT_NO_FATAL_FAILURE(init_pages(seed + 5));
    if (c.fp8()) ASSERT_NO_FATAL_FAILURE(make_descales(c.batch(), c.heads_kv, seed + 10, &descales));
  }

  void init_pages(uint32_t seed) {
    const std::vector<int32_t> ck = prefix_sums(c.lengths_k);
    const int page_size = c.page_size, max_pages = (max_seqlen_k() + page_size - 1) / page_size;
    const int num_pages = c.batch() * max_pages + 3;
    paged_k = random_tensor(c.dtype, {num_pages, page_size, c.heads_kv, c.head_dim}, seed);
    paged_v = random_tensor(c.dtype, {num_pages, page_size, c.heads_kv, c.head_dim}, seed + 1);
    std::vector<int32_t> table(size_t(c.batch()) * max_pages);
    for (size_t i = 0; i < table.size(); ++i) table[i] = int32_t((i * 7919 + 5) % num_pages);  // a shuffle
    for (int b = 0; b < c.batch(); ++b)
      for (int j = 0; j < c.lengths_k[b]; ++j) {
        const int page = table[size_t(b) * max_pages + j / page_size], row = j % page_size;
        for (int h = 0; h < c.heads_kv; ++h)
          for (int x = 0; x < c.head_dim; ++x) {
            paged_k.set({page, row, h, x}, k.get({ck[b] + j, h, x}));
            paged_v.set({page, row, h, x}, v.get({ck[b] + j, h, x}));
          }
      }
    page_table = int32_tensor(table, {c.batch(), max_pages});
    std::vector<int32_t> shifted = ck;
    for (int32_t& at : shifted) at += 1000;
    shifted_cu_k = int32_tensor(shifted);
    d_paged_k = std::make_unique<DeviceTensor>(paged_k);
    d_paged_v = std::make_unique<DeviceTensor>(paged_v);
    d_page_table = std::make_unique<DeviceTensor>(page_table);
    d_shifted_cu_k = std::make_unique<DeviceTensor>(shifted_cu_k);
    for (auto* t : {d_paged_k.get(), d_paged_v.get(), d_page_table.get(), d_shifted_cu_k.get()})
      ASSERT_TRUE(t->ok()) << "cudaMalloc failed";
    CUDA_CHECK(d_paged_k->upload(paged_k));
    CUDA_CHECK(d_paged_v->upload(paged_v));
    CUDA_CHECK(d_page_table->upload(page_table));
    CUDA_CHECK(d_shifted_cu_k->upload(shifted_cu_k));
  }

  int max_seqlen_q() const { return std::max(1, *std::max_element(c.lengths_q.begin(), c.lengths_q.end())); }
  int max_seqlen_k() const { return std::max(1, *std::max_element(c.lengths_k.begin(), c.lengths_k.end())); }

  // The sequence fields of a forward or backward parameter struct: device or host copies.
  template <class Params>
  void set_sequences(Params& p, bool device) const {
    p.cu_seqlens_q = device ? d_cu_q->view() : cu_q.view();
    p.cu_seqlens_k = device ? d_cu_k->view() : cu_k.view();
    if (!c.used_q.empty()) p.seqused_q = device ? d_used_q->view() : used_q.view();
    if (!c.used_k.empty()) p.seqused_k = device ? d_used_k->view() : used_k.view();
    p.max_seqlen_q = max_seqlen_q();
    p.max_seqlen_k = max_seqlen_k();
    p.causal = c.causal;
    c.features.apply(p);
  }

  ForwardParams forward_params(bool device) const {
    ForwardParams p = default_forward_params();
    p.q = device ? d_q->view() : q.view();
    p.k = device ? d_k->view() : k.view();
    p.v = device ? d_v->view() : v.view();
    set_sequences(p, device);
    if (c.features.learnable_sink) p.learnable_sink = device ? d_sink->view() : sink.view();
    if (device) p.num_splits = c.num_splits;
    if (c.fp8()) set_descales(p, descales, device);
    if (device && c.page_size > 0) {
      p.k = d_paged_k->view();
      p.v = d_paged_v->view();
      p.page_table = d_page_table->view();
      p.cu_seqlens_k = d_shifted_cu_k->view();
    }
    return p;
  }

  // The rows inside the sequences of a [total, H, x] tensor, and of a [H, total] lse.
  Tensor inside_q(const HostTensor& t) const { return narrow(t.view(), 0, 0, in_q); }
  Tensor inside_k(const HostTensor& t) const { return narrow(t.view(), 0, 0, in_k); }
  Tensor inside_lse(const HostTensor& t) const { return narrow(t.view(), 1, 0, in_q); }
};

// Runs a forward over host or device tensors of the problem (host: the CPU reference).
Status run_reference_forward(const PackedProblem& pp, HostTensor& out, HostTensor& lse, bool plain) {
  ForwardParams p = pp.forward_params(/*device=*/false);
  p.out = out.view();
  p.lse = lse.view();
  reference::Options options;
  options.emulate_low_precision = plain;
  return reference::forward(p, options);
}

// with_fp8: the fp8 families too (forward only).
std::vector<VarlenCase> varlen_cases(bool with_fp8 = false) {
  struct Row {
    bool causal;
    std::vector<int> lengths_q, lengths_k, used_q, used_k;
    int heads_q, heads_kv;
    Features f;
  };
  const std::vector<Row> rows = {
      {true, {1, 7, 113, 0, 1000, 300, 0}, {1, 7, 113, 0, 1000, 300, 0}, {}, {}, 4, 2, {}},
      {false, {1, 7, 113, 0, 1000, 300, 0}, {1, 7, 113, 0, 1000, 300, 0}, {}, {}, 4, 2, {}},
      {false, {113, 0, 57, 640, 1}, {300, 5, 0, 1000, 77}, {}, {}, 4, 1, {64, 16}},
      {true, {200, 513, 64, 0}, {200, 513, 64, 0}, {150, 513, 0, 0}, {200, 100, 64, 0}, 2, 2, {}},
      {true, {300, 129, 0, 700}, {300, 129, 0, 700}, {}, {}, 4, 2, {-1, -1, 0, 0, 30.f, true}},
      {false, {300, 129, 0, 700}, {500, 129, 3, 600}, {}, {}, 4, 2, {100, 0, 2, 0, 0.f, true}},
      // More tiles than an H200 has CTAs in every kernel (184 to 368), so CTAs take several
      // tiles from the planned list's counter.
      {true, {700, 300, 1000, 5, 513}, {700, 300, 1000, 5, 513}, {}, {}, 16, 8, {}},
  };
  std::vector<VarlenCase> cases;
  auto add = [&](fh_dtype dtype, int head_dim, const Row& r) {
    cases.push_back(
        {dtype, head_dim, r.causal, r.lengths_q, r.lengths_k, r.used_q, r.used_k, r.heads_q, r.heads_kv, r.f});
  };
  for (const auto& [dtype, head_dim] : compiled_families(/*backward=*/false, with_fp8)) {
    for (const Row& r : rows) add(dtype, head_dim, r);
    // A long sequence beside short ones (head dim 128 only: it costs the reference seconds).
    if (head_dim == 128) cases.push_back({dtype, 128, true, {4097, 1, 0}, {4097, 1, 0}, {}, {}, 2, 1, {}});
  }
  // Head dims between the compiled ones (padded_head_dim_cases: the same dims, dense).
  for (const GridCase& g : padded_head_dim_cases(/*backward=*/false))
    if ((g.head_dim == 80 || g.head_dim == 200) && g.causal) {
      add(g.dtype, g.head_dim, rows[0]);
      add(g.dtype, g.head_dim, rows[3]);
    }
  return cases;
}

// ---- forward ----------------------------------------------------------------------------------

class VarlenForwardGpuTest : public ::testing::TestWithParam<VarlenCase> {};

TEST_P(VarlenForwardGpuTest, MatchesReference) {
  PackedProblem pp;
  ASSERT_NO_FATAL_FAILURE(pp.init(GetParam()));
  const VarlenCase& c = pp.c;
  HostTensor out(c.out_dtype(), {pp.total_q, c.heads_q, c.head_dim});
  HostTensor lse(FH_DTYPE_FP32, {c.heads_q, pp.total_q});
  DeviceTensor d_out(out), d_lse(lse);
  ASSERT_TRUE(d_out.ok() && d_lse.ok());
  CUDA_CHECK(d_out.poison());
  CUDA_CHECK(d_lse.poison());

  ForwardParams p = pp.forward_params(/*device=*/true);
  p.out = d_out.view();
  p.lse = d_lse.view();
  size_t workspace_bytes = 0;
  Status status = workspace_size(p, &workspace_bytes);
  ASSERT_TRUE(status.ok()) << status.message;
  DeviceBuffer workspace;
  if (workspace_bytes > 0) CUDA_CHECK(workspace.allocate(workspace_bytes));
  CUDA_CHECK(workspace.poison());
  status = forward(p, workspace.data(), workspace_bytes, nullptr);
  if (status.code == FH_ERROR_NOT_SUPPORTED) GTEST_SKIP() << "not in this build: " << status.message;
  ASSERT_TRUE(status.ok()) << status.message;
  CUDA_CHECK(cudaDeviceSynchronize());
  CUDA_CHECK(d_out.download(out));
  CUDA_CHECK(d_lse.download(lse));

  HostTensor out_exact(FH_DTYPE_FP64, {pp.total_q, c.heads_q, c.head_dim});
  HostTensor lse_exact(FH_DTYPE_FP64, {c.heads_q, pp.total_q});
  HostTensor out_plain(c.out_dtype(), {pp.total_q, c.heads_q, c.head_dim});
  HostTensor lse_plain(FH_DTYPE_FP32, {c.heads_q, pp.total_q});
  status = run_reference_forward(pp, out_exact, lse_exact, /*plain=*/false);
  ASSERT_TRUE(status.ok()) << status.message;
  status = run_reference_forward(pp, out_plain, lse_plain, /*plain=*/true);
  ASSERT_TRUE(status.ok()) << status.message;

  const double out_err = max_abs_diff(pp.inside_q(out), pp.inside_q(out_exact));
  const double out_plain_err = max_abs_diff(pp.inside_q(out_plain), pp.inside_q(out_exact));
  const double lse_err = max_abs_diff(pp.inside_lse(lse), pp.inside_lse(lse_exact));
  const double lse_plain_err = max_abs_diff(pp.inside_lse(lse_plain), pp.inside_lse(lse_exact));
  EXPECT_FALSE(has_nan(pp.inside_q(out))) << "unwritten (poisoned) or NaN rows of out inside the sequences";
  EXPECT_FALSE(has_nan(pp.inside_lse(lse))) << "unwritten (poisoned) or NaN lse inside the sequences";
  EXPECT_LE(out_err, 2 * out_plain_err + kOutSlack) << "out: ours " << out_err << ", plain " << out_plain_err;
  // fp8's LSE takes 1e-3 of its size more: its S GEMM accumulates with fewer bits (test_forward_gpu.cpp).
  const double lse_slack = c.fp8() ? 1e-3 * (1 + max_abs_finite(pp.inside_lse(lse_exact))) : kOutSlack;
  EXPECT_LE(lse_err, 2 * lse_plain_err + lse_slack) << "lse: ours " << lse_err << ", plain " << lse_plain_err;
  EXPECT_TRUE(all_nan(narrow(out.view(), 0, pp.in_q, kExtraTokens))) << "out written outside every sequence";
  EXPECT_TRUE(all_nan(narrow(lse.view(), 1, pp.in_q, kExtraTokens))) << "lse written outside every sequence";
}

INSTANTIATE_TEST_SUITE_P(Varlen, VarlenForwardGpuTest, ::testing::ValuesIn(varlen_cases(/*with_fp8=*/true)),
                         [](const ::testing::TestParamInfo<VarlenCase>& info) { return info.param.name(); });

// Split-KV over packed queries: each planned tile a split, the partials [S, Hq, total_q, dv] and
// their combine over packed rows. Splits forced (3, 7, more than any sequence has key blocks:
// empty splits) and chosen (0), decode-like rows of one query token beside long ones, empty
// sequences, seqused, a window, softcap with the learnable sink (counted once).
std::vector<VarlenCase> varlen_split_cases() {
  std::vector<VarlenCase> cases;
  for (const auto& [dtype, head_dim] : compiled_families(/*backward=*/false, /*with_fp8=*/true)) {
    if (head_dim != 128 && head_dim != 256) continue;
    cases.push_back({dtype, head_dim, false, {1, 1, 0, 3, 1}, {3000, 17, 500, 0, 1024}, {}, {}, 8, 2, {}, 3});
    cases.push_back({dtype, head_dim, true, {1, 7, 113, 0, 1000, 300, 0}, {1, 7, 113, 0, 1000, 300, 0}, {}, {},
                     4, 2, {}, 7});
    cases.push_back({dtype, head_dim, true, {200, 513, 64, 0}, {2000, 513, 64, 0}, {150, 513, 0, 0},
                     {2000, 100, 64, 0}, 2, 2, {}, 0});
    cases.push_back({dtype, head_dim, false, {300, 129, 0, 700}, {500, 129, 3, 600}, {}, {}, 4, 2,
                     {100, 0, 2, 0, 0.f, true}, 5});
    cases.push_back({dtype, head_dim, true, {4, 1, 2}, {800, 3000, 40}, {}, {}, 16, 2,
                     {-1, -1, 0, 0, 30.f, true}, 256});
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(VarlenSplitKv, VarlenForwardGpuTest, ::testing::ValuesIn(varlen_split_cases()),
                         [](const ::testing::TestParamInfo<VarlenCase>& info) { return info.param.name(); });

// A packed batch over paged keys (page_table with cu_seqlens_k: chunked prefill over a paged
// cache): the reference reads the same keys packed. Pages loaded in TMA chunks (16, 64, 256) and
// key by key (1, 24); empty sequences, seqused_k, a window with sink tokens, softcap with the
// learnable sink, split-KV.
std::vector<VarlenCase> varlen_paged_cases() {
  std::vector<VarlenCase> cases;
  for (const auto& [dtype, head_dim] : compiled_families(/*backward=*/false)) {
    if (head_dim != 128 && head_dim != 64) continue;
    for (int page_size : {1, 16, 24, 64, 256}) {
      VarlenCase c{dtype, head_dim, true, {1, 7, 113, 0, 1000, 300, 0}, {1, 7, 113, 0, 1000, 300, 0}, {}, {},
                   4, 2, {}};
      c.page_size = page_size;
      cases.push_back(c);
    }
    VarlenCase used{dtype, head_dim, true, {200, 513, 64, 0}, {200, 513, 64, 0}, {150, 513, 0, 0},
                    {200, 100, 64, 0}, 2, 2, {}};
    used.page_size = 16;
    cases.push_back(used);
    VarlenCase window{dtype, head_dim, false, {300, 129, 0, 700}, {500, 129, 3, 600}, {}, {}, 4, 2,
                      {100, 0, 2, 0, 0.f, true}};
    window.page_size = 64;
    cases.push_back(window);
    VarlenCase split{dtype, head_dim, true, {4, 1, 2}, {800, 3000, 40}, {}, {}, 16, 2, {-1, -1, 0, 0, 30.f, true},
                     5};
    split.page_size = 16;
    cases.push_back(split);
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(VarlenPaged, VarlenForwardGpuTest, ::testing::ValuesIn(varlen_paged_cases()),
                         [](const ::testing::TestParamInfo<VarlenCase>& info) { return info.param.name(); });

// ---- backward ---------------------------------------------------------------------------------

struct VarlenGradients {
  HostTensor dq, dk, dv, dsink;
  VarlenGradients(int32_t dtype, const PackedProblem& pp)
      : dq(dtype, {pp.total_q, pp.c.heads_q, pp.c.head_dim}),
        dk(dtype, {pp.total_k, pp.c.heads_kv, pp.c.head_dim}),
        dv(dtype, {pp.total_k, pp.c.heads_kv, pp.c.head_dim}),
        dsink(dtype == FH_DTYPE_FP64 ? FH_DTYPE_FP64 : FH_DTYPE_FP32, {pp.c.heads_q}) {}
};

class VarlenBackward {
 public:
  void init(const VarlenCase& c) {
    ASSERT_NO_FATAL_FAILURE(pp_.init(c));
    // out and lse from the exact forward, out rounded once to the dtype, as a real forward hands them over.
    out_ = HostTensor(c.dtype, {pp_.total_q, c.heads_q, c.head_dim});
    lse_ = HostTensor(FH_DTYPE_FP32, {c.heads_q, pp_.total_q});
    const Status status = run_reference_forward(pp_, out_, lse_, /*plain=*/false);
    ASSERT_TRUE(status.ok()) << status.message;
    const VarlenGradients shapes(c.dtype, pp_);
    d_out_ = std::make_unique<DeviceTensor>(out_);
    d_lse_ = std::make_unique<DeviceTensor>(lse_);
    d_dq_ = std::make_unique<DeviceTensor>(shapes.dq);
    d_dk_ = std::make_unique<DeviceTensor>(shapes.dk);
    d_dv_ = std::make_unique<DeviceTensor>(shapes.dv);
    d_dsink_ = std::make_unique<DeviceTensor>(shapes.dsink);
    for (auto* t : {d_out_.get(), d_lse_.get(), d_dq_.get(), d_dk_.get(), d_dv_.get(), d_dsink_.get()})
      ASSERT_TRUE(t->ok()) << "cudaMalloc failed";
    CUDA_CHECK(d_out_->upload(out_));
    CUDA_CHECK(d_lse_->upload(lse_));
  }

  BackwardParams params(bool device, const VarlenGradients* host_grads) const {
    BackwardParams p = default_backward_params();
    p.q = device ? pp_.d_q->view() : pp_.q.view();
    p.k = device ? pp_.d_k->view() : pp_.k.view();
    p.v = device ? pp_.d_v->view() : pp_.v.view();
    p.dout = device ? pp_.d_dout->view() : pp_.dout.view();
    p.out = device ? d_out_->view() : out_.view();
    p.lse = device ? d_lse_->view() : lse_.view();
    p.dq = device ? d_dq_->view() : host_grads->dq.view();
    p.dk = device ? d_dk_->view() : host_grads->dk.view();
    p.dv = device ? d_dv_->view() : host_grads->dv.view();
    pp_.set_sequences(p, device);
    if (pp_.c.features.learnable_sink) {
      p.learnable_sink = device ? pp_.d_sink->view() : pp_.sink.view();
      p.dsink = device ? d_dsink_->view() : host_grads->dsink.view();
    }
    return p;
  }

  void run(int deterministic, Status* status) {
    BackwardParams p = params(/*device=*/true, nullptr);
    p.deterministic = deterministic;
    size_t bytes = 0;
    const Status query = workspace_size(p, &bytes);
    ASSERT_TRUE(query.ok()) << query.message;
    if (bytes > workspace_.bytes()) CUDA_CHECK(workspace_.allocate(bytes));
    CUDA_CHECK(workspace_.poison());
    for (DeviceTensor* t : {d_dq_.get(), d_dk_.get(), d_dv_.get(), d_dsink_.get()}) CUDA_CHECK(t->poison());
    CUDA_CHECK(cudaDeviceSynchronize());
    *status = backward(p, workspace_.data(), bytes, nullptr);
    if (!status->ok()) return;
    CUDA_CHECK(cudaDeviceSynchronize());
  }

  void download(VarlenGradients* g) const {
    CUDA_CHECK(d_dq_->download(g->dq));
    CUDA_CHECK(d_dk_->download(g->dk));
    CUDA_CHECK(d_dv_->download(g->dv));
    if (pp_.c.features.learnable_sink) CUDA_CHECK(d_dsink_->download(g->dsink));
  }

  // The pass rule for dq, dk, dv (rows inside the sequences) and dsink; the rows outside every
  // sequence still poisoned.
  void expect_matches(VarlenGradients& ours) const {
    VarlenGradients exact(FH_DTYPE_FP64, pp_), plain(pp_.c.dtype, pp_);
    Status status = reference::backward(params(false, &exact));
    ASSERT_TRUE(status.ok()) << status.message;
    reference::Options options;
    options.emulate_low_precision = true;
    status = reference::backward(params(false, &plain), options);
    ASSERT_TRUE(status.ok()) << status.message;
    const std::array<const char*, 3> names = {"dq", "dk", "dv"};
    const std::array<HostTensor*, 3> mine = {&ours.dq, &ours.dk, &ours.dv};
    const std::array<HostTensor*, 3> exacts = {&exact.dq, &exact.dk, &exact.dv};
    const std::array<HostTensor*, 3> plains = {&plain.dq, &plain.dk, &plain.dv};
    for (int i = 0; i < 3; ++i) {
      auto inside = [&](const HostTensor& t) { return i == 0 ? pp_.inside_q(t) : pp_.inside_k(t); };
      const double err = max_abs_diff(inside(*mine[i]), inside(*exacts[i]));
      const double plain_err = max_abs_diff(inside(*plains[i]), inside(*exacts[i]));
      EXPECT_FALSE(has_nan(inside(*mine[i]))) << "unwritten (poisoned) or NaN rows of " << names[i];
      EXPECT_LE(err, 2 * plain_err + kGradSlack) << names[i] << ": ours " << err << ", plain " << plain_err;
      const int inside_rows = i == 0 ? pp_.in_q : pp_.in_k;
      EXPECT_TRUE(all_nan(narrow(mine[i]->view(), 0, inside_rows, kExtraTokens)))
          << names[i] << " written outside every sequence";
    }
    if (pp_.c.features.learnable_sink) {
      // dsink from the rounded out and the float32 lse the kernel reads, as the dense test judges it.
      std::vector<double> given(pp_.c.heads_q, 0.0);
      const std::vector<int32_t> cq = prefix_sums(pp_.c.lengths_q);
      for (int b = 0; b < pp_.c.batch(); ++b) {
        const int used = pp_.c.used_q.empty() ? pp_.c.lengths_q[b] : pp_.c.used_q[b];
        for (int h = 0; h < pp_.c.heads_q; ++h)
          for (int i = cq[b]; i < cq[b] + used; ++i) {
            double d = 0;
            for (int x = 0; x < pp_.c.head_dim; ++x) d += read(pp_.dout.view(), {i, h, x}) * read(out_.view(), {i, h, x});
            given[h] -= std::exp(read(pp_.sink.view(), {h}) - read(lse_.view(), {h, i})) * d;
          }
      }
      expect_dsink_matches(ours.dsink.view(), exact.dsink.view(), plain.dsink.view(), given, kGradSlack);
    }
  }

  const PackedProblem& problem() const { return pp_; }

 private:
  PackedProblem pp_;
  HostTensor out_, lse_;
  std::unique_ptr<DeviceTensor> d_out_, d_lse_, d_dq_, d_dk_, d_dv_, d_dsink_;
  DeviceBuffer workspace_;
};

class VarlenBackwardGpuTest : public ::testing::TestWithParam<VarlenCase> {};

TEST_P(VarlenBackwardGpuTest, MatchesReference) {
  VarlenBackward problem;
  ASSERT_NO_FATAL_FAILURE(problem.init(GetParam()));
  Status status;
  ASSERT_NO_FATAL_FAILURE(problem.run(/*deterministic=*/0, &status));
  if (status.code == FH_ERROR_NOT_SUPPORTED) GTEST_SKIP() << "not in this build: " << status.message;
  ASSERT_TRUE(status.ok()) << status.message;
  VarlenGradients ours(GetParam().dtype, problem.problem());
  ASSERT_NO_FATAL_FAILURE(problem.download(&ours));
  problem.expect_matches(ours);
}

INSTANTIATE_TEST_SUITE_P(Varlen, VarlenBackwardGpuTest, ::testing::ValuesIn(varlen_cases()),
                         [](const ::testing::TestParamInfo<VarlenCase>& info) { return info.param.name(); });

// Deterministic mode over a packed batch: the first run passes and kRepeats - 1 more repeat its bits.
class VarlenBackwardRepeatTest : public ::testing::TestWithParam<VarlenCase> {};

TEST_P(VarlenBackwardRepeatTest, DeterministicIsBitIdentical) {
  const VarlenCase c = GetParam();
  VarlenBackward problem;
  ASSERT_NO_FATAL_FAILURE(problem.init(c));
  Status status;
  ASSERT_NO_FATAL_FAILURE(problem.run(/*deterministic=*/1, &status));
  if (status.code == FH_ERROR_NOT_SUPPORTED) GTEST_SKIP() << "not in this build: " << status.message;
  ASSERT_TRUE(status.ok()) << status.message;
  VarlenGradients first(c.dtype, problem.problem()), again(c.dtype, problem.problem());
  ASSERT_NO_FATAL_FAILURE(problem.download(&first));
  problem.expect_matches(first);
  auto same = [](HostTensor& a, HostTensor& b) { return std::memcmp(a.data(), b.data(), a.bytes()) == 0; };
  int differing = 0;
  for (int run = 1; run < kRepeats; ++run) {
    ASSERT_NO_FATAL_FAILURE(problem.run(/*deterministic=*/1, &status));
    ASSERT_TRUE(status.ok()) << status.message;
    ASSERT_NO_FATAL_FAILURE(problem.download(&again));
    const bool sink_same = !c.features.learnable_sink || same(first.dsink, again.dsink);
    if (!same(first.dq, again.dq) || !same(first.dk, again.dk) || !same(first.dv, again.dv) || !sink_same)
      ++differing;
  }
  EXPECT_EQ(differing, 0) << differing << " of " << kRepeats - 1 << " runs differ from the first in their bits";
}

std::vector<VarlenCase> repeat_cases() {
  std::vector<VarlenCase> cases;
  for (int head_dim : {64, 128, 256}) {
    cases.push_back({FH_DTYPE_BF16, head_dim, true, {1000, 0, 513, 7}, {1000, 0, 513, 7}, {}, {}, 4, 2, {}});
    cases.push_back({FH_DTYPE_BF16, head_dim, false, {600, 129, 0, 300}, {700, 129, 5, 300}, {}, {}, 4, 2,
                     {100, 0, 2, 0, 0.f, true}});
    cases.push_back({FH_DTYPE_BF16, head_dim, true, {700, 300, 1000, 5, 513}, {700, 300, 1000, 5, 513}, {}, {}, 16, 8,
                     {}});  // several tiles a CTA (see varlen_cases)
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Varlen, VarlenBackwardRepeatTest, ::testing::ValuesIn(repeat_cases()),
                         [](const ::testing::TestParamInfo<VarlenCase>& info) { return info.param.name(); });

// ---- a dense batch with seqused ---------------------------------------------------------------

// seqused without cu_seqlens: a dense [B, S, H, d] batch whose rows past seqused take no part
// (out 0, lse -inf, zero gradients). Both passes must run it on the kernels for packed batches:
// the dense ones are compiled without seqused and would attend the unused rows.
TEST(DenseSequsedGpuTest, BothPassesMatchReference) {
  const fh_dtype dtype = FH_DTYPE_BF16;
  const int batch = 3, seqlen = 300, heads_q = 4, heads_kv = 2, head_dim = 128;
  const HostTensor q = random_tensor(dtype, {batch, seqlen, heads_q, head_dim}, 91);
  const HostTensor k = random_tensor(dtype, {batch, seqlen, heads_kv, head_dim}, 92);
  const HostTensor v = random_tensor(dtype, {batch, seqlen, heads_kv, head_dim}, 93);
  const HostTensor dout = random_tensor(dtype, {batch, seqlen, heads_q, head_dim}, 94);
  const HostTensor used_q = int32_tensor({300, 17, 0}), used_k = int32_tensor({120, 300, 5});
  DeviceTensor d_q(q), d_k(k), d_v(v), d_dout(dout), d_used_q(used_q), d_used_k(used_k);
  for (DeviceTensor* t : {&d_q, &d_k, &d_v, &d_dout, &d_used_q, &d_used_k}) ASSERT_TRUE(t->ok()) << "cudaMalloc failed";
  CUDA_CHECK(d_q.upload(q));
  CUDA_CHECK(d_k.upload(k));
  CUDA_CHECK(d_v.upload(v));
  CUDA_CHECK(d_dout.upload(dout));
  CUDA_CHECK(d_used_q.upload(used_q));
  CUDA_CHECK(d_used_k.upload(used_k));
  const std::vector<int64_t> q_shape{batch, seqlen, heads_q, head_dim}, kv_shape{batch, seqlen, heads_kv, head_dim};
  const std::vector<int64_t> lse_shape{batch, heads_q, seqlen};

  // Forward: ours against the exact and the plain reference.
  auto forward_params = [&](bool device) {
    ForwardParams p = default_forward_params();
    p.q = device ? d_q.view() : q.view();
    p.k = device ? d_k.view() : k.view();
    p.v = device ? d_v.view() : v.view();
    p.seqused_q = device ? d_used_q.view() : used_q.view();
    p.seqused_k = device ? d_used_k.view() : used_k.view();
    p.causal = 1;
    return p;
  };
  HostTensor out(dtype, q_shape), lse(FH_DTYPE_FP32, lse_shape);
  DeviceTensor d_out(out), d_lse(lse);
  ASSERT_TRUE(d_out.ok() && d_lse.ok());
  CUDA_CHECK(d_out.poison());
  CUDA_CHECK(d_lse.poison());
  ForwardParams fp = forward_params(/*device=*/true);
  fp.out = d_out.view();
  fp.lse = d_lse.view();
  size_t bytes = 0;
  Status status = workspace_size(fp, &bytes);
  ASSERT_TRUE(status.ok()) << status.message;
  DeviceBuffer workspace;
  if (bytes > 0) CUDA_CHECK(workspace.allocate(bytes));
  status = forward(fp, workspace.data(), bytes, nullptr);
  if (status.code == FH_ERROR_NOT_SUPPORTED) GTEST_SKIP() << "not in this build: " << status.message;
  ASSERT_TRUE(status.ok()) << status.message;
  CUDA_CHECK(cudaDeviceSynchronize());
  CUDA_CHECK(d_out.download(out));
  CUDA_CHECK(d_lse.download(lse));
  HostTensor out_exact(FH_DTYPE_FP64, q_shape), lse_exact(FH_DTYPE_FP64, lse_shape);
  HostTensor out_plain(dtype, q_shape), lse_plain(FH_DTYPE_FP32, lse_shape);
  reference::Options plain;
  plain.emulate_low_precision = true;
  ForwardParams hp = forward_params(/*device=*/false);
  hp.out = out_exact.view();
  hp.lse = lse_exact.view();
  status = reference::forward(hp);
  ASSERT_TRUE(status.ok()) << status.message;
  hp.out = out_plain.view();
  hp.lse = lse_plain.view();
  status = reference::forward(hp, plain);
  ASSERT_TRUE(status.ok()) << status.message;
  EXPECT_FALSE(has_nan(out.view()) || has_nan(lse.view())) << "unwritten (poisoned) or NaN out/lse";
  const double out_err = max_abs_diff(out.view(), out_exact.view());
  const double out_plain_err = max_abs_diff(out_plain.view(), out_exact.view());
  const double lse_err = max_abs_diff(lse.view(), lse_exact.view());
  const double lse_plain_err = max_abs_diff(lse_plain.view(), lse_exact.view());
  EXPECT_LE(out_err, 2 * out_plain_err + kOutSlack) << "out: ours " << out_err << ", plain " << out_plain_err;
  EXPECT_LE(lse_err, 2 * lse_plain_err + kOutSlack) << "lse: ours " << lse_err << ", plain " << lse_plain_err;

  // Backward from the exact forward's out (rounded to the dtype) and lse, as a real forward hands them over.
  HostTensor out_in(dtype, q_shape), lse_in(FH_DTYPE_FP32, lse_shape);
  hp.out = out_in.view();
  hp.lse = lse_in.view();
  status = reference::forward(hp);
  ASSERT_TRUE(status.ok()) << status.message;
  DeviceTensor d_out_in(out_in), d_lse_in(lse_in);
  HostTensor dq(dtype, q_shape), dk(dtype, kv_shape), dv(dtype, kv_shape);
  DeviceTensor d_dq(dq), d_dk(dk), d_dv(dv);
  for (DeviceTensor* t : {&d_out_in, &d_lse_in, &d_dq, &d_dk, &d_dv}) ASSERT_TRUE(t->ok()) << "cudaMalloc failed";
  CUDA_CHECK(d_out_in.upload(out_in));
  CUDA_CHECK(d_lse_in.upload(lse_in));
  for (DeviceTensor* t : {&d_dq, &d_dk, &d_dv}) CUDA_CHECK(t->poison());
  struct Grads {
    HostTensor dq, dk, dv;
  };
  auto backward_params = [&](bool device, Grads* host) {
    BackwardParams p = default_backward_params();
    p.q = device ? d_q.view() : q.view();
    p.k = device ? d_k.view() : k.view();
    p.v = device ? d_v.view() : v.view();
    p.dout = device ? d_dout.view() : dout.view();
    p.out = device ? d_out_in.view() : out_in.view();
    p.lse = device ? d_lse_in.view() : lse_in.view();
    p.dq = device ? d_dq.view() : host->dq.view();
    p.dk = device ? d_dk.view() : host->dk.view();
    p.dv = device ? d_dv.view() : host->dv.view();
    p.seqused_q = device ? d_used_q.view() : used_q.view();
    p.seqused_k = device ? d_used_k.view() : used_k.view();
    p.causal = 1;
    return p;
  };
  BackwardParams bp = backward_params(/*device=*/true, nullptr);
  status = workspace_size(bp, &bytes);
  ASSERT_TRUE(status.ok()) << status.message;
  DeviceBuffer bwd_workspace;
  if (bytes > 0) CUDA_CHECK(bwd_workspace.allocate(bytes));
  CUDA_CHECK(bwd_workspace.poison());
  status = backward(bp, bwd_workspace.data(), bytes, nullptr);
  if (status.code == FH_ERROR_NOT_SUPPORTED) GTEST_SKIP() << "not in this build: " << status.message;
  ASSERT_TRUE(status.ok()) << status.message;
  CUDA_CHECK(cudaDeviceSynchronize());
  CUDA_CHECK(d_dq.download(dq));
  CUDA_CHECK(d_dk.download(dk));
  CUDA_CHECK(d_dv.download(dv));
  Grads exact{HostTensor(FH_DTYPE_FP64, q_shape), HostTensor(FH_DTYPE_FP64, kv_shape),
              HostTensor(FH_DTYPE_FP64, kv_shape)};
  Grads plain_grads{HostTensor(dtype, q_shape), HostTensor(dtype, kv_shape), HostTensor(dtype, kv_shape)};
  status = reference::backward(backward_params(false, &exact));
  ASSERT_TRUE(status.ok()) << status.message;
  status = reference::backward(backward_params(false, &plain_grads), plain);
  ASSERT_TRUE(status.ok()) << status.message;
  const std::array<std::pair<const char*, const HostTensor*>, 3> ours{{{"dq", &dq}, {"dk", &dk}, {"dv", &dv}}};
  const std::array<const HostTensor*, 3> exacts{&exact.dq, &exact.dk, &exact.dv};
  const std::array<const HostTensor*, 3> plains{&plain_grads.dq, &plain_grads.dk, &plain_grads.dv};
  for (size_t i = 0; i < ours.size(); ++i) {
    const double err = max_abs_diff(ours[i].second->view(), exacts[i]->view());
    const double plain_err = max_abs_diff(plains[i]->view(), exacts[i]->view());
    EXPECT_FALSE(has_nan(ours[i].second->view())) << ours[i].first << ": unwritten (poisoned) or NaN elements";
    EXPECT_LE(err, 2 * plain_err + kGradSlack) << ours[i].first << ": ours " << err << ", plain " << plain_err;
  }
}

}  // namespace
}  // namespace flashhopper::test

// Without an sm_90 GPU nothing here can run: say so and exit with CTest's skip code (77).
int main(int argc, char** argv) { return flashhopper::test::gpu_test_main(argc, argv); }
