// The host-side argument checks: each valid kind of call passes, and each rule refuses one
// mutated field with FH_ERROR_INVALID_ARGUMENT and a message that opens with the argument's name
// and says the rule. Runs without a GPU: the tensors point at fake, aligned addresses that the
// checks must never dereference.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "plan/split_plan.hpp"
#include "api/validate.hpp"
#include "launch/compiled_families.hpp"
#include "flashhopper/flashhopper.h"
#include "flashhopper/flashhopper.hpp"

namespace {

namespace fh = flashhopper;
using fh::detail::Target;
using ::testing::HasSubstr;
using ::testing::Not;
using ::testing::StartsWith;

// Distinct, 64 KiB-apart, 16-byte aligned addresses; never dereferenced.
void* fake_pointer(int index) { return reinterpret_cast<void*>(uintptr_t{0x10000} * uintptr_t(index + 1)); }

void* misaligned(void* pointer, uintptr_t by) {
  return reinterpret_cast<void*>(reinterpret_cast<uintptr_t>(pointer) + by);
}

constexpr int64_t kBatch = 2, kSeqQ = 128, kSeqK = 256, kHeadsQ = 8, kHeadsKV = 2, kDim = 128, kDimV = 128;

// ---- Valid calls, one per kind ----------------------------------------------------------------

fh::ForwardParams dense_forward(fh::DType dtype = FH_DTYPE_BF16) {
  fh::ForwardParams p = fh::default_forward_params();
  p.q = fh::make_tensor(fake_pointer(0), dtype, {kBatch, kSeqQ, kHeadsQ, kDim});
  p.k = fh::make_tensor(fake_pointer(1), dtype, {kBatch, kSeqK, kHeadsKV, kDim});
  p.v = fh::make_tensor(fake_pointer(2), dtype, {kBatch, kSeqK, kHeadsKV, kDimV});
  p.out = fh::make_tensor(fake_pointer(3), dtype, {kBatch, kSeqQ, kHeadsQ, kDimV});
  p.lse = fh::make_tensor(fake_pointer(4), FH_DTYPE_FP32, {kBatch, kHeadsQ, kSeqQ});
  return p;
}

// Three sequences packed into 300 query and 500 key tokens.
constexpr int64_t kVarlenBatch = 3, kTotalQ = 300, kTotalK = 500;

fh::ForwardParams varlen_forward() {
  fh::ForwardParams p = fh::default_forward_params();
  p.q = fh::make_tensor(fake_pointer(0), FH_DTYPE_BF16, {kTotalQ, kHeadsQ, kDim});
  p.k = fh::make_tensor(fake_pointer(1), FH_DTYPE_BF16, {kTotalK, kHeadsKV, kDim});
  p.v = fh::make_tensor(fake_pointer(2), FH_DTYPE_BF16, {kTotalK, kHeadsKV, kDimV});
  p.out = fh::make_tensor(fake_pointer(3), FH_DTYPE_BF16, {kTotalQ, kHeadsQ, kDimV});
  p.lse = fh::make_tensor(fake_pointer(4), FH_DTYPE_FP32, {kHeadsQ, kTotalQ});
  p.cu_seqlens_q = fh::make_tensor(fake_pointer(5), FH_DTYPE_INT32, {kVarlenBatch + 1});
  p.cu_seqlens_k = fh::make_tensor(fake_pointer(6), FH_DTYPE_INT32, {kVarlenBatch + 1});
  p.seqused_k = fh::make_tensor(fake_pointer(7), FH_DTYPE_INT32, {kVarlenBatch});
  p.max_seqlen_q = 128;
  p.max_seqlen_k = 256;
  return p;
}

// Decoding one token per sequence against a paged cache, appending one new key/value.
constexpr int64_t kPages = 64, kPageSize = 64, kMaxPages = 16;

fh::ForwardParams paged_forward() {
  fh::ForwardParams p = fh::default_forward_params();
  p.q = fh::make_tensor(fake_pointer(0), FH_DTYPE_BF16, {kBatch, 1, kHeadsQ, kDim});
  p.k = fh::make_tensor(fake_pointer(1), FH_DTYPE_BF16, {kPages, kPageSize, kHeadsKV, kDim});
  p.v = fh::make_tensor(fake_pointer(2), FH_DTYPE_BF16, {kPages, kPageSize, kHeadsKV, kDimV});
  p.out = fh::make_tensor(fake_pointer(3), FH_DTYPE_BF16, {kBatch, 1, kHeadsQ, kDimV});
  p.lse = fh::make_tensor(fake_pointer(4), FH_DTYPE_FP32, {kBatch, kHeadsQ, 1});
  p.page_table = fh::make_tensor(fake_pointer(5), FH_DTYPE_INT32, {kBatch, kMaxPages});
  p.cache_seqlens = fh::make_tensor(fake_pointer(6), FH_DTYPE_INT32, {kBatch});
  p.k_new = fh::make_tensor(fake_pointer(7), FH_DTYPE_BF16, {kBatch, 1, kHeadsKV, kDim});
  p.v_new = fh::make_tensor(fake_pointer(8), FH_DTYPE_BF16, {kBatch, 1, kHeadsKV, kDimV});
  return p;
}

fh::ForwardParams fp8_forward() {
  fh::ForwardParams p = dense_forward(FH_DTYPE_FP8_E4M3);
  p.out.dtype = FH_DTYPE_BF16;
  p.q_descale = fh::make_tensor(fake_pointer(10), FH_DTYPE_FP32, {kBatch, kHeadsKV});
  p.k_descale = fh::make_tensor(fake_pointer(11), FH_DTYPE_FP32, {kBatch, kHeadsKV});
  p.v_descale = fh::make_tensor(fake_pointer(12), FH_DTYPE_FP32, {kBatch, kHeadsKV});
  return p;
}

fh::BackwardParams dense_backward() {
  const fh::ForwardParams f = dense_forward();
  fh::BackwardParams p = fh::default_backward_params();
  p.q = f.q;
  p.k = f.k;
  p.v = f.v;
  p.out = f.out;
  p.lse = f.lse;
  p.dout = fh::make_tensor(fake_pointer(5), FH_DTYPE_BF16, {kBatch, kSeqQ, kHeadsQ, kDimV});
  p.dq = fh::make_tensor(fake_pointer(6), FH_DTYPE_BF16, {kBatch, kSeqQ, kHeadsQ, kDim});
  p.dk = fh::make_tensor(fake_pointer(7), FH_DTYPE_BF16, {kBatch, kSeqK, kHeadsKV, kDim});
  p.dv = fh::make_tensor(fake_pointer(8), FH_DTYPE_BF16, {kBatch, kSeqK, kHeadsKV, kDimV});
  return p;
}

fh::BackwardParams varlen_backward() {
  const fh::ForwardParams f = varlen_forward();
  fh::BackwardParams p = fh::default_backward_params();
  p.q = f.q;
  p.k = f.k;
  p.v = f.v;
  p.out = f.out;
  p.lse = f.lse;
  p.cu_seqlens_q = f.cu_seqlens_q;
  p.cu_seqlens_k = f.cu_seqlens_k;
  p.max_seqlen_q = f.max_seqlen_q;
  p.max_seqlen_k = f.max_seqlen_k;
  p.dout = fh::make_tensor(fake_pointer(8), FH_DTYPE_BF16, {kTotalQ, kHeadsQ, kDimV});
  p.dq = fh::make_tensor(fake_pointer(9), FH_DTYPE_BF16, {kTotalQ, kHeadsQ, kDim});
  p.dk = fh::make_tensor(fake_pointer(10), FH_DTYPE_BF16, {kTotalK, kHeadsKV, kDim});
  p.dv = fh::make_tensor(fake_pointer(11), FH_DTYPE_BF16, {kTotalK, kHeadsKV, kDimV});
  return p;
}

constexpr int64_t kSplits = 4;

fh::CombineParams combine_call() {
  fh::CombineParams p{};
  p.out_partial = fh::make_tensor(fake_pointer(0), FH_DTYPE_FP32, {kSplits, kBatch, kHeadsQ, 1, kDimV});
  p.lse_partial = fh::make_tensor(fake_pointer(1), FH_DTYPE_FP32, {kSplits, kBatch, kHeadsQ, 1});
  p.out = fh::make_tensor(fake_pointer(2), FH_DTYPE_BF16, {kBatch, 1, kHeadsQ, kDimV});
  p.lse = fh::make_tensor(fake_pointer(3), FH_DTYPE_FP32, {kBatch, kHeadsQ, 1});
  return p;
}

template <typename Params>
fh::Status check_for_reference(const Params& p) {
  return fh::detail::validate(p, Target::kHostReference);
}

// The refusal every rule gives: the code, the message opening with "name: ", and the rule's word.
::testing::AssertionResult refused(const fh::Status& status, const std::string& name, const std::string& keyword) {
  if (status.code != FH_ERROR_INVALID_ARGUMENT) {
    return ::testing::AssertionFailure() << "status " << status.code << " (\"" << status.message
                                         << "\"), expected FH_ERROR_INVALID_ARGUMENT";
  }
  if (status.message.rfind(name + ": ", 0) != 0) {
    return ::testing::AssertionFailure() << "message \"" << status.message << "\" does not start with \"" << name
                                         << ": \"";
  }
  if (status.message.find(keyword) == std::string::npos) {
    return ::testing::AssertionFailure() << "message \"" << status.message << "\" lacks \"" << keyword << "\"";
  }
  return ::testing::AssertionSuccess() << status.message;
}

#define EXPECT_REFUSED(status, name, keyword) EXPECT_TRUE(refused((status), (name), (keyword)))
#define EXPECT_PASSES(status)                                   \
  do {                                                          \
    const fh::Status status_ = (status);                        \
    EXPECT_EQ(status_.code, FH_SUCCESS) << status_.message;     \
  } while (0)

// ---- Valid calls pass -------------------------------------------------------------------------

TEST(ValidCalls, Pass) {
  EXPECT_PASSES(fh::check(dense_forward()));
  EXPECT_PASSES(fh::check(dense_forward(FH_DTYPE_FP16)));
  EXPECT_PASSES(fh::check(varlen_forward()));
  EXPECT_PASSES(fh::check(paged_forward()));
  EXPECT_PASSES(fh::check(fp8_forward()));
  EXPECT_PASSES(fh::check(dense_backward()));
  EXPECT_PASSES(fh::check(varlen_backward()));
  EXPECT_PASSES(fh::check(combine_call()));
}

TEST(ValidCalls, PassForTheHostReferenceToo) {
  EXPECT_PASSES(check_for_reference(dense_forward()));
  EXPECT_PASSES(check_for_reference(varlen_forward()));
  EXPECT_PASSES(check_for_reference(paged_forward()));
  EXPECT_PASSES(check_for_reference(fp8_forward()));
  EXPECT_PASSES(check_for_reference(dense_backward()));
  EXPECT_PASSES(check_for_reference(combine_call()));
}

TEST(ValidCalls, OptionalArgumentsMayBeAbsent) {
  fh::ForwardParams forward = dense_forward();
  forward.lse = {};
  EXPECT_PASSES(fh::check(forward));
  fh::ForwardParams fp8 = fp8_forward();
  fp8.q_descale = fp8.k_descale = fp8.v_descale = {};
  EXPECT_PASSES(fh::check(fp8));
  fh::CombineParams combine = combine_call();
  combine.lse = {};
  EXPECT_PASSES(fh::check(combine));
}

TEST(ValidCalls, ValueHeadDimMayDifferFromHeadDim) {
  fh::ForwardParams p = dense_forward();
  p.q = fh::make_tensor(p.q.data, FH_DTYPE_BF16, {kBatch, kSeqQ, kHeadsQ, 192});
  p.k = fh::make_tensor(p.k.data, FH_DTYPE_BF16, {kBatch, kSeqK, kHeadsKV, 192});
  EXPECT_PASSES(fh::check(p));
}

TEST(ValidCalls, OuterStridesMayBePadded) {
  // Strides beyond the contiguous ones, e.g. q sliced out of a packed qkv tensor.
  fh::ForwardParams p = dense_forward();
  const int64_t qkv_row = 3 * kHeadsQ * kDim;
  p.q = fh::make_tensor(p.q.data, FH_DTYPE_BF16, {kBatch, kSeqQ, kHeadsQ, kDim},
                        {kSeqQ * qkv_row, qkv_row, kDim, 1});
  EXPECT_PASSES(fh::check(p));
}

// ---- Presence and combinations ----------------------------------------------------------------

TEST(ForwardPresence, QKVAndOutAreRequired) {
  const char* names[] = {"q", "k", "v", "out"};
  for (int i = 0; i < 4; ++i) {
    SCOPED_TRACE(names[i]);
    fh::ForwardParams p = dense_forward();
    fh::Tensor* tensors[] = {&p.q, &p.k, &p.v, &p.out};
    tensors[i]->data = nullptr;
    EXPECT_REFUSED(fh::check(p), names[i], "required");
  }
}

// A packed batch over paged keys: cu_seqlens_k counts each sequence's keys in its table row.
fh::ForwardParams paged_varlen_forward() {
  fh::ForwardParams p = paged_forward();
  p.k_new = p.v_new = p.cache_seqlens = {};
  p.cu_seqlens_k = fh::make_tensor(fake_pointer(20), FH_DTYPE_INT32, {kBatch + 1});
  p.max_seqlen_k = 64;
  return p;
}

TEST(ForwardPresence, PageTableWithCuSeqlensKNeedsNoCacheSeqlens) {
  EXPECT_PASSES(fh::check(paged_varlen_forward()));
  EXPECT_PASSES(check_for_reference(paged_varlen_forward()));
}

TEST(ForwardPresence, CacheSeqlensExcludesCuSeqlensK) {
  fh::ForwardParams p = paged_varlen_forward();
  p.cache_seqlens = fh::make_tensor(fake_pointer(6), FH_DTYPE_INT32, {kBatch});
  EXPECT_REFUSED(fh::check(p), "cache_seqlens", "cu_seqlens_k");
  p.page_table = {};  // a packed K/V likewise
  p.k = fh::make_tensor(fake_pointer(1), FH_DTYPE_BF16, {40, kHeadsKV, kDim});
  p.v = fh::make_tensor(fake_pointer(2), FH_DTYPE_BF16, {40, kHeadsKV, kDimV});
  EXPECT_REFUSED(fh::check(p), "cache_seqlens", "cu_seqlens_k");
}

TEST(ForwardPresence, PagedPackedBatchStillNeedsItsPrefixSums) {
  fh::ForwardParams p = paged_varlen_forward();
  p.cu_seqlens_k = fh::make_tensor(fake_pointer(20), FH_DTYPE_INT32, {kBatch});
  EXPECT_REFUSED(fh::check(p), "cu_seqlens_k", "batch size + 1");
  p = paged_varlen_forward();
  p.max_seqlen_k = 0;
  EXPECT_REFUSED(fh::check(p), "max_seqlen_k", ">= 1");
}

TEST(ForwardPresence, PageTableNeedsCacheSeqlens) {
  fh::ForwardParams p = paged_forward();
  p.k_new = p.v_new = {};
  p.cache_seqlens = {};
  EXPECT_REFUSED(fh::check(p), "cache_seqlens", "required with page_table");
}

TEST(ForwardPresence, KNewAndVNewComeTogether) {
  fh::ForwardParams p = paged_forward();
  p.v_new = {};
  EXPECT_REFUSED(fh::check(p), "v_new", "together with k_new");
  p = paged_forward();
  p.k_new = {};
  EXPECT_REFUSED(fh::check(p), "k_new", "together with v_new");
}

TEST(ForwardPresence, KNewNeedsCacheSeqlens) {
  // Appending into a dense cache: where to append is cache_seqlens.
  fh::ForwardParams p = dense_forward();
  p.k_new = fh::make_tensor(fake_pointer(20), FH_DTYPE_BF16, {kBatch, 1, kHeadsKV, kDim});
  p.v_new = fh::make_tensor(fake_pointer(21), FH_DTYPE_BF16, {kBatch, 1, kHeadsKV, kDimV});
  EXPECT_REFUSED(fh::check(p), "cache_seqlens", "k_new");
  p.cache_seqlens = fh::make_tensor(fake_pointer(22), FH_DTYPE_INT32, {kBatch});
  EXPECT_PASSES(fh::check(p));
}

// ---- KV cache extras: cache_batch_idx, cache_leftpad, rotary ------------------------------------

// A dense cache of 5 rows for kBatch sequences, one appended token each, rotary on half of d.
fh::ForwardParams dense_cache_forward() {
  fh::ForwardParams p = dense_forward();
  p.k = fh::make_tensor(fake_pointer(1), FH_DTYPE_BF16, {5, kSeqK, kHeadsKV, kDim});
  p.v = fh::make_tensor(fake_pointer(2), FH_DTYPE_BF16, {5, kSeqK, kHeadsKV, kDimV});
  p.cache_seqlens = fh::make_tensor(fake_pointer(20), FH_DTYPE_INT32, {kBatch});
  p.cache_batch_idx = fh::make_tensor(fake_pointer(21), FH_DTYPE_INT32, {kBatch});
  p.cache_leftpad = fh::make_tensor(fake_pointer(22), FH_DTYPE_INT32, {kBatch});
  p.k_new = fh::make_tensor(fake_pointer(23), FH_DTYPE_BF16, {kBatch, 1, kHeadsKV, kDim});
  p.v_new = fh::make_tensor(fake_pointer(24), FH_DTYPE_BF16, {kBatch, 1, kHeadsKV, kDimV});
  p.rotary_cos = fh::make_tensor(fake_pointer(25), FH_DTYPE_BF16, {kSeqK, kDim / 4});
  p.rotary_sin = fh::make_tensor(fake_pointer(26), FH_DTYPE_BF16, {kSeqK, kDim / 4});
  p.rotary_seqlens = fh::make_tensor(fake_pointer(27), FH_DTYPE_INT32, {kBatch});
  p.rotary_interleaved = 1;
  return p;
}

TEST(ForwardKvCache, ExtrasPass) {
  EXPECT_PASSES(fh::check(dense_cache_forward()));
  EXPECT_PASSES(check_for_reference(dense_cache_forward()));
}

// New keys packed for a packed batch (cu_seqlens_k_new): k_new/v_new [total_new, Hkv, d|dv] and
// batch + 1 prefix sums; ignored without an append, as FlashAttention-3 ignores it.
fh::ForwardParams packed_append_forward() {
  fh::ForwardParams p = dense_cache_forward();
  p.q = fh::make_tensor(fake_pointer(0), FH_DTYPE_BF16, {7, kHeadsQ, kDim});
  p.out = fh::make_tensor(fake_pointer(3), FH_DTYPE_BF16, {7, kHeadsQ, kDimV});
  p.lse = fh::make_tensor(fake_pointer(4), FH_DTYPE_FP32, {kHeadsQ, 7});
  p.cu_seqlens_q = fh::make_tensor(fake_pointer(5), FH_DTYPE_INT32, {kBatch + 1});
  p.max_seqlen_q = 4;
  p.k_new = fh::make_tensor(fake_pointer(23), FH_DTYPE_BF16, {7, kHeadsKV, kDim});
  p.v_new = fh::make_tensor(fake_pointer(24), FH_DTYPE_BF16, {7, kHeadsKV, kDimV});
  p.cu_seqlens_k_new = fh::make_tensor(fake_pointer(28), FH_DTYPE_INT32, {kBatch + 1});
  return p;
}

TEST(ForwardKvCache, PackedNewKeys) {
  EXPECT_PASSES(fh::check(packed_append_forward()));
  EXPECT_PASSES(check_for_reference(packed_append_forward()));
  fh::ForwardParams p = packed_append_forward();
  p.cu_seqlens_k_new.shape[0] = kBatch + 2;
  EXPECT_REFUSED(fh::check(p), "cu_seqlens_k_new", "batch size + 1");
  p = packed_append_forward();
  p.cu_seqlens_k_new.dtype = FH_DTYPE_FP32;
  EXPECT_REFUSED(fh::check(p), "cu_seqlens_k_new", "int32");
  p = packed_append_forward();
  p.k_new = fh::make_tensor(fake_pointer(23), FH_DTYPE_BF16, {kBatch, 1, kHeadsKV, kDim});
  EXPECT_REFUSED(fh::check(p), "k_new", "[total_new, Hkv, d]");
  p = packed_append_forward();
  p.v_new.shape[0] = 6;
  EXPECT_REFUSED(fh::check(p), "v_new", "total new tokens");
  p = packed_append_forward();
  p.k_new = p.v_new = p.rotary_cos = p.rotary_sin = {};  // nothing to append: cu_seqlens_k_new ignored
  EXPECT_PASSES(fh::check(p));
  p.cu_seqlens_k_new.dtype = FH_DTYPE_FP32;
  EXPECT_PASSES(fh::check(p));
}

// A dense cache or a paged one (FlashAttention-3 picks the page table's row and offsets the
// positions the same way), never packed keys.
TEST(ForwardKvCache, BatchIdxAndLeftpadIndexADenseOrPagedCache) {
  for (const char* name : {"cache_batch_idx", "cache_leftpad"}) {
    fh::ForwardParams p = paged_forward();
    (std::string(name) == "cache_batch_idx" ? p.cache_batch_idx : p.cache_leftpad) =
        fh::make_tensor(fake_pointer(21), FH_DTYPE_INT32, {kBatch});
    EXPECT_PASSES(fh::check(p));
    EXPECT_PASSES(check_for_reference(p));
    fh::ForwardParams v = varlen_forward();
    (std::string(name) == "cache_batch_idx" ? v.cache_batch_idx : v.cache_leftpad) =
        fh::make_tensor(fake_pointer(21), FH_DTYPE_INT32, {kBatch});
    v.cache_seqlens = fh::make_tensor(fake_pointer(20), FH_DTYPE_INT32, {kBatch});
    EXPECT_REFUSED(fh::check(v), name, "cu_seqlens_k");
  }
  fh::ForwardParams p = dense_cache_forward();
  p.k_new = p.v_new = p.rotary_cos = p.rotary_sin = p.rotary_seqlens = {};
  p.cache_seqlens = {};
  EXPECT_REFUSED(fh::check(p), "cache_leftpad", "cache_seqlens");
}

TEST(ForwardKvCache, BatchIdxLetsTheCacheHaveAnyRows) {
  fh::ForwardParams p = dense_cache_forward();
  p.v = fh::make_tensor(fake_pointer(2), FH_DTYPE_BF16, {4, kSeqK, kHeadsKV, kDimV});
  EXPECT_REFUSED(fh::check(p), "v", "number of cache rows");
  p = dense_cache_forward();
  p.cache_batch_idx = {};  // without it the cache has one row a sequence
  EXPECT_REFUSED(fh::check(p), "k", "batch size");
  p = dense_cache_forward();
  p.cache_batch_idx = fh::make_tensor(fake_pointer(21), FH_DTYPE_INT32, {kBatch + 1});
  EXPECT_REFUSED(fh::check(p), "cache_batch_idx", "batch size");
  p.cache_batch_idx = fh::make_tensor(fake_pointer(21), FH_DTYPE_FP32, {kBatch});
  EXPECT_REFUSED(fh::check(p), "cache_batch_idx", "int32");
}

TEST(ForwardKvCache, RotaryRules) {
  fh::ForwardParams p = dense_cache_forward();
  p.rotary_sin = {};
  EXPECT_REFUSED(fh::check(p), "rotary_sin", "together with rotary_cos");
  p = dense_cache_forward();
  p.k_new = p.v_new = {};
  EXPECT_REFUSED(fh::check(p), "rotary_cos", "k_new");
  // As FA3: rotary_seqlens without the tables has no effect, and is neither refused nor checked
  // (an int32 [B] tensor or not: it is not read).
  p = dense_cache_forward();
  p.rotary_cos = p.rotary_sin = {};
  EXPECT_PASSES(fh::check(p));
  p.rotary_seqlens = fh::make_tensor(fake_pointer(27), FH_DTYPE_FP32, {kBatch + 3});
  EXPECT_PASSES(fh::check(p));
  EXPECT_EQ(fh::detail::without_ignored_arguments(p).rotary_seqlens.data, nullptr);
  p.rotary_cos = dense_cache_forward().rotary_cos;  // with the tables it is checked again
  p.rotary_sin = dense_cache_forward().rotary_sin;
  EXPECT_REFUSED(fh::check(p), "rotary_seqlens", "");
  p = dense_cache_forward();
  p.rotary_cos.shape[1] = p.rotary_sin.shape[1] = kDim / 2 + 1;
  EXPECT_REFUSED(fh::check(p), "rotary_cos", "at most the head dim");
  p = dense_cache_forward();
  p.rotary_sin.shape[0] = kSeqK / 2;
  EXPECT_REFUSED(fh::check(p), "rotary_sin", "seqlen_ro");
  p = dense_cache_forward();
  p.rotary_cos.dtype = FH_DTYPE_FP16;
  EXPECT_REFUSED(fh::check(p), "rotary_cos", "q's dtype");
  p.rotary_cos.dtype = FH_DTYPE_FP32;  // the CPU reference also takes float32 tables
  EXPECT_PASSES(check_for_reference(p));
  p = dense_cache_forward();
  p.rotary_interleaved = 2;
  EXPECT_REFUSED(fh::check(p), "rotary_interleaved", "0 or 1");
  p = dense_cache_forward();
  p.rotary_cos = fh::make_tensor(fake_pointer(25), FH_DTYPE_BF16, {kSeqK});
  EXPECT_REFUSED(fh::check(p), "rotary_cos", "");
}

// ---- Ranks ------------------------------------------------------------------------------------

TEST(ForwardRank, DenseQIsFourDimensional) {
  fh::ForwardParams p = dense_forward();
  p.q = fh::make_tensor(p.q.data, FH_DTYPE_BF16, {kBatch * kSeqQ, kHeadsQ, kDim});
  EXPECT_REFUSED(fh::check(p), "q", "dense (no cu_seqlens_q) q must be 4-d [B, sq, Hq, d]");
}

TEST(ForwardRank, VarlenQIsThreeDimensional) {
  fh::ForwardParams p = varlen_forward();
  p.q = fh::make_tensor(p.q.data, FH_DTYPE_BF16, {1, kTotalQ, kHeadsQ, kDim});
  EXPECT_REFUSED(fh::check(p), "q", "varlen (cu_seqlens_q given) q must be 3-d");
}

TEST(ForwardRank, OutFollowsQ) {
  fh::ForwardParams p = dense_forward();
  p.out = fh::make_tensor(p.out.data, FH_DTYPE_BF16, {kBatch * kSeqQ, kHeadsQ, kDimV});
  EXPECT_REFUSED(fh::check(p), "out", "4-d");
}

TEST(ForwardRank, DenseKVAreFourDimensional) {
  fh::ForwardParams p = dense_forward();
  p.k = fh::make_tensor(p.k.data, FH_DTYPE_BF16, {kBatch * kSeqK, kHeadsKV, kDim});
  EXPECT_REFUSED(fh::check(p), "k", "dense (no cu_seqlens_k, no page_table) k must be 4-d [B, sk, Hkv, d]");
  p = dense_forward();
  p.v = fh::make_tensor(p.v.data, FH_DTYPE_BF16, {kBatch * kSeqK, kHeadsKV, kDimV});
  EXPECT_REFUSED(fh::check(p), "v", "4-d");
}

TEST(ForwardRank, VarlenKVAreThreeDimensional) {
  fh::ForwardParams p = varlen_forward();
  p.k = fh::make_tensor(p.k.data, FH_DTYPE_BF16, {1, kTotalK, kHeadsKV, kDim});
  EXPECT_REFUSED(fh::check(p), "k", "varlen (cu_seqlens_k given) k must be 3-d");
}

TEST(ForwardRank, PagedKVAreFourDimensional) {
  fh::ForwardParams p = paged_forward();
  p.k = fh::make_tensor(p.k.data, FH_DTYPE_BF16, {kPages * kPageSize, kHeadsKV, kDim});
  EXPECT_REFUSED(fh::check(p), "k", "paged (page_table given) k must be 4-d [num_pages, page_size, Hkv, d]");
}

TEST(ForwardRank, LseIsThreeDimensionalDenseAndTwoVarlen) {
  fh::ForwardParams p = dense_forward();
  p.lse = fh::make_tensor(p.lse.data, FH_DTYPE_FP32, {kHeadsQ, kBatch * kSeqQ});
  EXPECT_REFUSED(fh::check(p), "lse", "3-d [B, Hq, sq]");
  p = varlen_forward();
  p.lse = fh::make_tensor(p.lse.data, FH_DTYPE_FP32, {1, kHeadsQ, kTotalQ});
  EXPECT_REFUSED(fh::check(p), "lse", "2-d [Hq, total_q]");
}

TEST(ForwardRank, OptionalTensorsHaveTheirRanks) {
  fh::ForwardParams p = varlen_forward();
  p.cu_seqlens_q = fh::make_tensor(p.cu_seqlens_q.data, FH_DTYPE_INT32, {1, kVarlenBatch + 1});
  EXPECT_REFUSED(fh::check(p), "cu_seqlens_q", "1-d [B + 1]");
  p = varlen_forward();
  p.seqused_k = fh::make_tensor(p.seqused_k.data, FH_DTYPE_INT32, {kVarlenBatch, 1});
  EXPECT_REFUSED(fh::check(p), "seqused_k", "1-d [B]");
  p = paged_forward();
  p.page_table = fh::make_tensor(p.page_table.data, FH_DTYPE_INT32, {kBatch * kMaxPages});
  EXPECT_REFUSED(fh::check(p), "page_table", "2-d [B, max_pages]");
  p = paged_forward();
  p.cache_seqlens = fh::make_tensor(p.cache_seqlens.data, FH_DTYPE_INT32, {kBatch, 1});
  EXPECT_REFUSED(fh::check(p), "cache_seqlens", "1-d");
  p = paged_forward();
  p.v_new = fh::make_tensor(p.v_new.data, FH_DTYPE_BF16, {kBatch, kHeadsKV, kDimV});
  EXPECT_REFUSED(fh::check(p), "v_new", "4-d");
  p = fp8_forward();
  p.v_descale = fh::make_tensor(p.v_descale.data, FH_DTYPE_FP32, {kBatch * kHeadsKV});
  EXPECT_REFUSED(fh::check(p), "v_descale", "2-d [B, Hkv]");
}

// ---- Dtypes -----------------------------------------------------------------------------------

TEST(ForwardDtype, InputsAreBf16Fp16OrFp8) {
  fh::ForwardParams p = dense_forward();
  p.q.dtype = p.k.dtype = p.v.dtype = p.out.dtype = FH_DTYPE_INT32;
  EXPECT_REFUSED(fh::check(p), "q", "dtype is int32; must be bf16, fp16 or fp8_e4m3");
  p.q.dtype = p.k.dtype = p.v.dtype = p.out.dtype = FH_DTYPE_FP32;
  EXPECT_REFUSED(fh::check(p), "q", "dtype is float32");
}

TEST(ForwardDtype, UnknownDtypeValueIsNamed) {
  fh::ForwardParams p = dense_forward();
  p.q.dtype = 42;
  EXPECT_REFUSED(fh::check(p), "q", "unknown (42)");
}

TEST(ForwardDtype, QKVShareOneDtype) {
  fh::ForwardParams p = dense_forward();
  p.k.dtype = FH_DTYPE_FP16;
  EXPECT_REFUSED(fh::check(p), "k", "q, k and v must have the same dtype");
  p = dense_forward();
  p.v.dtype = FH_DTYPE_FP8_E4M3;
  EXPECT_REFUSED(fh::check(p), "v", "same dtype");
}

TEST(ForwardDtype, OutHasQsDtype) {
  fh::ForwardParams p = dense_forward();
  p.out.dtype = FH_DTYPE_FP16;
  EXPECT_REFUSED(fh::check(p), "out", "dtype is fp16; must be bf16");
}

TEST(ForwardDtype, Fp8InputsNeedBf16Out) {
  fh::ForwardParams p = fp8_forward();
  p.out.dtype = FH_DTYPE_FP8_E4M3;
  EXPECT_REFUSED(fh::check(p), "out", "fp8 inputs give a bf16 output");
  p.out.dtype = FH_DTYPE_FP16;
  EXPECT_REFUSED(fh::check(p), "out", "bf16");
}

TEST(ForwardDtype, LseIsFloat32) {
  fh::ForwardParams p = dense_forward();
  p.lse.dtype = FH_DTYPE_BF16;
  EXPECT_REFUSED(fh::check(p), "lse", "must be float32");
  p.lse.dtype = FH_DTYPE_FP64;
  EXPECT_REFUSED(fh::check(p), "lse", "float32");
}

TEST(ForwardDtype, IndexTensorsAreInt32) {
  fh::ForwardParams p = varlen_forward();
  p.cu_seqlens_q.dtype = FH_DTYPE_FP32;
  EXPECT_REFUSED(fh::check(p), "cu_seqlens_q", "must be int32");
  p = varlen_forward();
  p.cu_seqlens_k.dtype = FH_DTYPE_FP64;
  EXPECT_REFUSED(fh::check(p), "cu_seqlens_k", "int32");
  p = varlen_forward();
  p.seqused_k.dtype = FH_DTYPE_BF16;
  EXPECT_REFUSED(fh::check(p), "seqused_k", "int32");
  p = paged_forward();
  p.page_table.dtype = FH_DTYPE_FP32;
  EXPECT_REFUSED(fh::check(p), "page_table", "int32");
  p = paged_forward();
  p.cache_seqlens.dtype = FH_DTYPE_FP16;
  EXPECT_REFUSED(fh::check(p), "cache_seqlens", "int32");
}

TEST(ForwardDtype, AppendedKVHaveTheCachesDtype) {
  fh::ForwardParams p = paged_forward();
  p.k_new.dtype = FH_DTYPE_FP16;
  EXPECT_REFUSED(fh::check(p), "k_new", "cache's dtype");
}

TEST(ForwardDtype, DescaleIsFloat32) {
  fh::ForwardParams p = fp8_forward();
  p.q_descale.dtype = FH_DTYPE_BF16;
  EXPECT_REFUSED(fh::check(p), "q_descale", "must be float32");
}

TEST(ForwardDtype, DescaleOnlyWithFp8) {
  fh::ForwardParams p = dense_forward();
  p.k_descale = fh::make_tensor(fake_pointer(20), FH_DTYPE_FP32, {kBatch, kHeadsKV});
  EXPECT_REFUSED(fh::check(p), "k_descale", "fp8_e4m3 inputs only");
}

TEST(ForwardDtype, HostReferenceAcceptsFloat32AndFloat64) {
  fh::ForwardParams p = dense_forward(FH_DTYPE_FP64);
  p.lse.dtype = FH_DTYPE_FP64;
  EXPECT_PASSES(check_for_reference(p));
  EXPECT_REFUSED(fh::check(p), "q", "dtype");
  p = dense_forward(FH_DTYPE_FP32);
  EXPECT_PASSES(check_for_reference(p));
  // Whatever the inputs, the reference may write float32/float64 out.
  p = dense_forward(FH_DTYPE_BF16);
  p.out.dtype = FH_DTYPE_FP64;
  EXPECT_PASSES(check_for_reference(p));
  EXPECT_REFUSED(fh::check(p), "out", "dtype");
  p = fp8_forward();
  p.out.dtype = FH_DTYPE_FP32;
  EXPECT_PASSES(check_for_reference(p));
  // Still one dtype for q, k and v.
  p = dense_forward(FH_DTYPE_FP32);
  p.v.dtype = FH_DTYPE_FP64;
  EXPECT_REFUSED(check_for_reference(p), "v", "same dtype");
}

// ---- Extents ----------------------------------------------------------------------------------

TEST(ForwardExtent, EveryExtentAtLeastOne) {
  fh::ForwardParams p = dense_forward();
  p.q.shape[1] = 0;
  EXPECT_REFUSED(fh::check(p), "q", "shape[1] is 0; every extent must be at least 1");
  p = dense_forward();
  p.v.shape[2] = -3;
  EXPECT_REFUSED(fh::check(p), "v", "at least 1");
  p = paged_forward();
  p.page_table.shape[1] = -1;  // the CPU reference takes extents of 0 (empty sequences), not negative ones
  EXPECT_REFUSED(check_for_reference(p), "page_table", "shape[1] is -1; extents must not be negative");
}

// The CPU reference takes extents of 0 (an empty sequence's view) but never heads or head dims of
// 0, which the checks and the reference divide by.
TEST(ForwardExtent, ReferenceTakesEmptySequencesNotEmptyHeads) {
  fh::ForwardParams p = dense_forward();
  p.q = fh::make_tensor(p.q.data, FH_DTYPE_BF16, {kBatch, 0, kHeadsQ, kDim});
  p.out = fh::make_tensor(p.out.data, FH_DTYPE_BF16, {kBatch, 0, kHeadsQ, kDimV});
  p.lse = fh::make_tensor(p.lse.data, FH_DTYPE_FP32, {kBatch, kHeadsQ, 0});
  EXPECT_PASSES(check_for_reference(p));
  EXPECT_REFUSED(fh::check(p), "q", "every extent must be at least 1");
  p = dense_forward();
  p.k = fh::make_tensor(p.k.data, FH_DTYPE_BF16, {kBatch, kSeqK, 0, kDim});
  p.v = fh::make_tensor(p.v.data, FH_DTYPE_BF16, {kBatch, kSeqK, 0, kDimV});
  EXPECT_REFUSED(check_for_reference(p), "k", "has 0 key/value heads; must have at least 1");
  p = dense_forward();
  p.q = fh::make_tensor(p.q.data, FH_DTYPE_BF16, {kBatch, kSeqQ, kHeadsQ, 0});
  p.k = fh::make_tensor(p.k.data, FH_DTYPE_BF16, {kBatch, kSeqK, kHeadsKV, 0});
  EXPECT_REFUSED(check_for_reference(p), "q", "head dims (0, ");
}

TEST(ForwardExtent, CuSeqlensHoldsAtLeastOneSequence) {
  fh::ForwardParams p = varlen_forward();
  p.cu_seqlens_q.shape[0] = 1;
  EXPECT_REFUSED(fh::check(p), "cu_seqlens_q", "batch size would be less than 1");
}

TEST(ForwardExtent, KernelExtentsFitInt32) {
  fh::ForwardParams p = dense_forward();
  p.q.shape[1] = int64_t{1} << 31;
  EXPECT_REFUSED(fh::check(p), "q", "INT32_MAX");
}

// ---- Shape agreement --------------------------------------------------------------------------

TEST(ForwardShape, BatchAgrees) {
  fh::ForwardParams p = dense_forward();
  p.k.shape[0] = 3;
  EXPECT_REFUSED(fh::check(p), "k", "shape[0] (batch size) is 3 but q's batch size is 2");
  p = dense_forward();
  p.v.shape[0] = 3;
  EXPECT_REFUSED(fh::check(p), "v", "batch size");
  p = dense_forward();
  p.out.shape[0] = 3;
  EXPECT_REFUSED(fh::check(p), "out", "batch size");
  p = dense_forward();
  p.lse.shape[0] = 3;
  EXPECT_REFUSED(fh::check(p), "lse", "batch size");
}

TEST(ForwardShape, KeySequenceLengthAgrees) {
  fh::ForwardParams p = dense_forward();
  p.v.shape[1] = kSeqK / 2;
  EXPECT_REFUSED(fh::check(p), "v", "key sequence length");
  p = varlen_forward();
  p.v.shape[0] = kTotalK - 1;
  EXPECT_REFUSED(fh::check(p), "v", "total key tokens");
}

TEST(ForwardShape, QueryHeadsAgree) {
  fh::ForwardParams p = dense_forward();
  p.out.shape[2] = kHeadsQ / 2;
  EXPECT_REFUSED(fh::check(p), "out", "number of query heads");
  p = dense_forward();
  p.lse.shape[1] = kHeadsQ * 2;
  EXPECT_REFUSED(fh::check(p), "lse", "number of query heads");
}

TEST(ForwardShape, KeyValueHeadsAgree) {
  fh::ForwardParams p = dense_forward();
  p.v.shape[2] = 1;
  EXPECT_REFUSED(fh::check(p), "v", "number of key/value heads");
}

TEST(ForwardShape, HeadDimAgrees) {
  fh::ForwardParams p = dense_forward();
  p.k = fh::make_tensor(p.k.data, FH_DTYPE_BF16, {kBatch, kSeqK, kHeadsKV, 96});
  const fh::Status status = fh::check(p);
  EXPECT_EQ(status.code, FH_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(status.message,
            "k: shape[3] (head dim) is 96 but q's head dim is 128; q and k must have the same head dim");
}

TEST(ForwardShape, ValueHeadDimAgrees) {
  fh::ForwardParams p = dense_forward();
  p.out = fh::make_tensor(p.out.data, FH_DTYPE_BF16, {kBatch, kSeqQ, kHeadsQ, 64});
  EXPECT_REFUSED(fh::check(p), "out", "value head dim");
}

TEST(ForwardShape, QuerySequenceLengthAgrees) {
  fh::ForwardParams p = dense_forward();
  p.out.shape[1] = kSeqQ + 1;
  EXPECT_REFUSED(fh::check(p), "out", "query sequence length");
  p = dense_forward();
  p.lse.shape[2] = kSeqQ + 1;
  EXPECT_REFUSED(fh::check(p), "lse", "query sequence length");
}

TEST(ForwardShape, VarlenLseIsHeadsByTotalTokens) {
  fh::ForwardParams p = varlen_forward();
  p.lse = fh::make_tensor(p.lse.data, FH_DTYPE_FP32, {kHeadsQ, kTotalQ - 1});
  EXPECT_REFUSED(fh::check(p), "lse", "total query tokens");
  p = varlen_forward();
  p.out.shape[0] = kTotalQ + 1;
  EXPECT_REFUSED(fh::check(p), "out", "total query tokens");
}

TEST(ForwardShape, HeadDimAtMost512) {
  fh::ForwardParams p = dense_forward();
  p.q = fh::make_tensor(p.q.data, FH_DTYPE_BF16, {kBatch, kSeqQ, kHeadsQ, 520});
  p.k = fh::make_tensor(p.k.data, FH_DTYPE_BF16, {kBatch, kSeqK, kHeadsKV, 520});
  EXPECT_REFUSED(fh::check(p), "q", "head dims up to 512");
  EXPECT_REFUSED(check_for_reference(p), "q", "512");
  p.q = fh::make_tensor(p.q.data, FH_DTYPE_BF16, {kBatch, kSeqQ, kHeadsQ, 512});
  p.k = fh::make_tensor(p.k.data, FH_DTYPE_BF16, {kBatch, kSeqK, kHeadsKV, 512});
  EXPECT_PASSES(fh::check(p));
}

TEST(ForwardShape, ValueHeadDimAtMost512) {
  fh::ForwardParams p = dense_forward();
  p.v = fh::make_tensor(p.v.data, FH_DTYPE_BF16, {kBatch, kSeqK, kHeadsKV, 512});
  p.out = fh::make_tensor(p.out.data, FH_DTYPE_BF16, {kBatch, kSeqQ, kHeadsQ, 512});
  EXPECT_PASSES(fh::check(p));
  p.v = fh::make_tensor(p.v.data, FH_DTYPE_BF16, {kBatch, kSeqK, kHeadsKV, 520});
  p.out = fh::make_tensor(p.out.data, FH_DTYPE_BF16, {kBatch, kSeqQ, kHeadsQ, 520});
  EXPECT_REFUSED(fh::check(p), "v", "value head dims up to 512");
}

// qv takes out's shape (dense and packed) and q's dtype, and is never written over by out.
TEST(ForwardShape, QvHasTheShapeOfOutAndTheDtypeOfQ) {
  fh::ForwardParams p = dense_forward();
  p.qv = fh::make_tensor(fake_pointer(9), FH_DTYPE_BF16, {kBatch, kSeqQ, kHeadsQ, kDimV});
  EXPECT_PASSES(fh::check(p));
  p.qv.shape[3] = kDim / 2;
  EXPECT_REFUSED(fh::check(p), "qv", "value head dim");
  p.qv = fh::make_tensor(fake_pointer(9), FH_DTYPE_FP16, {kBatch, kSeqQ, kHeadsQ, kDimV});
  EXPECT_REFUSED(fh::check(p), "qv", "q's dtype");
  p.qv = fh::make_tensor(fake_pointer(9), FH_DTYPE_BF16, {kBatch, kSeqQ, kHeadsQ});
  EXPECT_REFUSED(fh::check(p), "qv", "");
  p.qv = p.out;
  EXPECT_REFUSED(fh::check(p), "out", "qv");
  fh::ForwardParams packed = varlen_forward();
  packed.qv = fh::make_tensor(fake_pointer(9), FH_DTYPE_BF16, {kTotalQ, kHeadsQ, kDimV});
  EXPECT_PASSES(fh::check(packed));
  packed.qv = fh::make_tensor(fake_pointer(9), FH_DTYPE_BF16, {kTotalQ + 1, kHeadsQ, kDimV});
  EXPECT_REFUSED(fh::check(packed), "qv", "total query tokens");
}

TEST(ForwardShape, QueryHeadsAreAMultipleOfKeyValueHeads) {
  fh::ForwardParams p = dense_forward();
  p.k.shape[2] = p.v.shape[2] = 3;
  const fh::Status status = fh::check(p);
  EXPECT_REFUSED(status, "k", "Hq % Hkv");
  EXPECT_THAT(status.message, HasSubstr("is 3"));
  EXPECT_THAT(status.message, HasSubstr("query heads 8"));
  EXPECT_THAT(status.message, Not(HasSubstr("SDPA")));  // 128 query positions read as heads: 3 does not divide them
}

// [B, H, S, D] (PyTorch SDPA's layout) passed as [B, S, H, D]: the sequence lengths are read as
// heads, and the message says how to pass such tensors.
TEST(ForwardShape, SdpaLayoutGetsAHint) {
  fh::ForwardParams p = dense_forward();
  p.q = fh::make_tensor(p.q.data, FH_DTYPE_BF16, {kBatch, kHeadsQ, kSeqQ, kDim});
  p.k = fh::make_tensor(p.k.data, FH_DTYPE_BF16, {kBatch, kHeadsKV, kSeqK, kDim});
  p.v = fh::make_tensor(p.v.data, FH_DTYPE_BF16, {kBatch, kHeadsKV, kSeqK, kDimV});
  p.out = fh::make_tensor(p.out.data, FH_DTYPE_BF16, {kBatch, kHeadsQ, kSeqQ, kDimV});
  p.lse = fh::make_tensor(p.lse.data, FH_DTYPE_FP32, {kBatch, kSeqQ, kHeadsQ});
  const fh::Status status = fh::check(p);
  EXPECT_REFUSED(status, "k", "Hq % Hkv");
  EXPECT_THAT(status.message, HasSubstr("PyTorch SDPA's layout), pass their transpose(1, 2)"));
}

// ---- Kernel layout: strides, alignment, head-dim granularity ----------------------------------

TEST(ForwardLayout, LastDimContiguous) {
  fh::ForwardParams p = dense_forward();
  p.q.stride[3] = 2;
  EXPECT_REFUSED(fh::check(p), "q", "last dim must be contiguous (stride 1)");
  EXPECT_PASSES(check_for_reference(p));
  p = paged_forward();
  p.v_new.stride[3] = 2;
  EXPECT_REFUSED(fh::check(p), "v_new", "contiguous");
}

TEST(ForwardLayout, StridesAreMultiplesOf16Bytes) {
  fh::ForwardParams p = dense_forward();
  p.k.stride[1] = kHeadsKV * kDim + 4;
  EXPECT_REFUSED(fh::check(p), "k", "not a multiple of 8 elements (16 bytes of bf16)");
  EXPECT_PASSES(check_for_reference(p));
  p = fp8_forward();
  p.k.stride[1] = kHeadsKV * kDim + 8;  // 8 bytes of fp8
  EXPECT_REFUSED(fh::check(p), "k", "not a multiple of 16 elements (16 bytes of fp8_e4m3)");
}

TEST(ForwardLayout, BaseAddressIs16ByteAligned) {
  fh::ForwardParams p = dense_forward();
  p.v.data = misaligned(p.v.data, 8);
  EXPECT_REFUSED(fh::check(p), "v", "is not 16-byte aligned");
  EXPECT_PASSES(check_for_reference(p));
}

TEST(ForwardLayout, ElementTensorsAreElementAligned) {
  fh::ForwardParams p = dense_forward();
  p.lse.data = misaligned(p.lse.data, 4);  // 4-byte aligned is enough for float32 rows
  EXPECT_PASSES(fh::check(p));
  p.lse.data = misaligned(p.lse.data, 2);
  EXPECT_REFUSED(fh::check(p), "lse", "4-byte aligned");
}

TEST(ForwardLayout, HeadDimsAreMultiplesOf16Bytes) {
  fh::ForwardParams p = dense_forward();
  p.q = fh::make_tensor(p.q.data, FH_DTYPE_BF16, {kBatch, kSeqQ, kHeadsQ, 100});
  p.k = fh::make_tensor(p.k.data, FH_DTYPE_BF16, {kBatch, kSeqK, kHeadsKV, 100});
  EXPECT_REFUSED(fh::check(p), "q", "not a multiple of 8");
  EXPECT_PASSES(check_for_reference(p));
  p = dense_forward();
  p.v = fh::make_tensor(p.v.data, FH_DTYPE_BF16, {kBatch, kSeqK, kHeadsKV, 60});
  p.out = fh::make_tensor(p.out.data, FH_DTYPE_BF16, {kBatch, kSeqQ, kHeadsQ, 60});
  EXPECT_REFUSED(fh::check(p), "v", "value head dim");
  p = fp8_forward();
  p.q = fh::make_tensor(p.q.data, FH_DTYPE_FP8_E4M3, {kBatch, kSeqQ, kHeadsQ, 72});
  p.k = fh::make_tensor(p.k.data, FH_DTYPE_FP8_E4M3, {kBatch, kSeqK, kHeadsKV, 72});
  EXPECT_REFUSED(fh::check(p), "q", "not a multiple of 16");
}

TEST(ForwardLayout, LseLastDimContiguous) {
  fh::ForwardParams p = dense_forward();
  p.lse.stride[2] = kHeadsQ;
  EXPECT_REFUSED(fh::check(p), "lse", "contiguous");
}

TEST(ForwardLayout, IndexArraysContiguous) {
  fh::ForwardParams p = varlen_forward();
  p.cu_seqlens_k.stride[0] = 2;
  EXPECT_REFUSED(fh::check(p), "cu_seqlens_k", "contiguous");
  EXPECT_PASSES(check_for_reference(p));
}

TEST(ForwardLayout, DescaleFactorsMayBeStrided) {
  fh::ForwardParams p = fp8_forward();
  p.k_descale = fh::make_tensor(p.k_descale.data, FH_DTYPE_FP32, {kBatch, kHeadsKV}, {1, kBatch});
  EXPECT_PASSES(fh::check(p));
}

TEST(ForwardLayout, NegativeStridesRefused) {
  fh::ForwardParams p = dense_forward();
  p.out.stride[1] = -kHeadsQ * kDimV;
  EXPECT_REFUSED(fh::check(p), "out", "negative strides");
  EXPECT_REFUSED(check_for_reference(p), "out", "negative strides");
}

// ---- Sizes within the kernels' index types ----------------------------------------------------

TEST(ForwardSize, TileCountFitsInt32) {
  // 4096 sequences x 8 heads x 65536 row tiles = 2^31 tiles, though each extent fits int32.
  const int64_t batch = 4096, seqlen = int64_t{1} << 22;
  fh::ForwardParams p = fh::default_forward_params();
  p.q = fh::make_tensor(fake_pointer(0), FH_DTYPE_BF16, {batch, seqlen, kHeadsQ, kDim});
  p.k = fh::make_tensor(fake_pointer(1), FH_DTYPE_BF16, {batch, 64, kHeadsKV, kDim});
  p.v = fh::make_tensor(fake_pointer(2), FH_DTYPE_BF16, {batch, 64, kHeadsKV, kDimV});
  p.out = fh::make_tensor(fake_pointer(3), FH_DTYPE_BF16, {batch, seqlen, kHeadsQ, kDimV});
  EXPECT_REFUSED(fh::check(p), "q", "row tiles exceeds INT32_MAX");
  EXPECT_PASSES(check_for_reference(p));  // the CPU reference has no tile index
  p.q.shape[0] = p.k.shape[0] = p.v.shape[0] = p.out.shape[0] = batch / 2;
  EXPECT_PASSES(fh::check(p));
}

TEST(ForwardSize, ElementCountsFitInt64) {
  // Sizes derived from extents (batch x seqlen) are formed in int64, for the reference too.
  fh::ForwardParams p = dense_forward();
  p.q.shape[0] = p.k.shape[0] = p.v.shape[0] = p.out.shape[0] = int64_t{1} << 40;
  p.q.shape[1] = p.out.shape[1] = int64_t{1} << 40;
  EXPECT_REFUSED(check_for_reference(p), "q", "more elements than int64 can count");
  p = paged_forward();
  p.page_table.shape[1] = p.k.shape[1] = p.v.shape[1] = int64_t{1} << 40;
  EXPECT_REFUSED(check_for_reference(p), "page_table", "overflows int64");
}

TEST(ForwardSize, ElementOffsetsFitInt64) {
  fh::ForwardParams p = dense_forward();
  p.q.stride[0] = int64_t{1} << 62;  // a multiple of 8; byte offset 2^63 overflows
  EXPECT_REFUSED(fh::check(p), "q", "below 2^40 bytes");  // the kernels' TMA limit comes first
  EXPECT_REFUSED(check_for_reference(p), "q", "int64 range");
  p.q.stride[0] = int64_t{1} << 60;
  EXPECT_PASSES(check_for_reference(p));
  // Extent x stride products beyond 2^64 must not wrap around into a small, accepted offset.
  p.q.stride[0] = p.q.stride[1] = p.q.stride[2] = std::numeric_limits<int64_t>::max() - 7;
  EXPECT_REFUSED(check_for_reference(p), "q", "int64 range");
}

// ---- Varlen -----------------------------------------------------------------------------------

TEST(ForwardVarlen, CuSeqlensKHasBatchPlusOneEntries) {
  fh::ForwardParams p = varlen_forward();
  p.cu_seqlens_k.shape[0] = kVarlenBatch;
  EXPECT_REFUSED(fh::check(p), "cu_seqlens_k", "must be batch size + 1 = 4");
}

TEST(ForwardVarlen, MaxSeqlenQGivenWithCuSeqlensQ) {
  fh::ForwardParams p = varlen_forward();
  p.max_seqlen_q = 0;
  EXPECT_REFUSED(fh::check(p), "max_seqlen_q", "needs max_seqlen_q >= 1");
}

TEST(ForwardVarlen, MaxSeqlenKGivenWithCuSeqlensK) {
  fh::ForwardParams p = varlen_forward();
  p.max_seqlen_k = -1;
  EXPECT_REFUSED(fh::check(p), "max_seqlen_k", ">= 1");
}

TEST(ForwardVarlen, SequsedHasBatchEntries) {
  fh::ForwardParams p = varlen_forward();
  p.seqused_k.shape[0] = kVarlenBatch + 1;
  EXPECT_REFUSED(fh::check(p), "seqused_k", "batch size");
  p = dense_forward();
  p.seqused_q = fh::make_tensor(fake_pointer(20), FH_DTYPE_INT32, {kBatch});
  EXPECT_PASSES(fh::check(p));
  p.seqused_q.shape[0] = kBatch + 1;
  EXPECT_REFUSED(fh::check(p), "seqused_q", "q's batch size is 2");
}

TEST(ForwardVarlen, CuSeqlensKAloneTakesTheBatchFromQ) {
  fh::ForwardParams p = dense_forward();
  p.k = fh::make_tensor(p.k.data, FH_DTYPE_BF16, {kTotalK, kHeadsKV, kDim});
  p.v = fh::make_tensor(p.v.data, FH_DTYPE_BF16, {kTotalK, kHeadsKV, kDimV});
  p.cu_seqlens_k = fh::make_tensor(fake_pointer(20), FH_DTYPE_INT32, {kBatch + 1});
  p.max_seqlen_k = 256;
  EXPECT_PASSES(fh::check(p));
  p.cu_seqlens_k.shape[0] = kBatch + 2;
  EXPECT_REFUSED(fh::check(p), "cu_seqlens_k", "batch size 2 from q");
}

// ---- Paged KV cache ---------------------------------------------------------------------------

TEST(ForwardPaged, PageTableRowsAreTheBatch) {
  fh::ForwardParams p = paged_forward();
  p.page_table = fh::make_tensor(p.page_table.data, FH_DTYPE_INT32, {kBatch + 1, kMaxPages});
  EXPECT_REFUSED(fh::check(p), "page_table", "batch size");
  p.cache_batch_idx = fh::make_tensor(fake_pointer(21), FH_DTYPE_INT32, {kBatch});  // it picks the rows
  EXPECT_PASSES(fh::check(p));
}

TEST(ForwardPaged, KAndVShareTheirPages) {
  fh::ForwardParams p = paged_forward();
  p.v.shape[0] = kPages - 1;
  EXPECT_REFUSED(fh::check(p), "v", "number of pages");
  p = paged_forward();
  p.v = fh::make_tensor(p.v.data, FH_DTYPE_BF16, {kPages, kPageSize / 2, kHeadsKV, kDimV});
  EXPECT_REFUSED(fh::check(p), "v", "page size");
}

TEST(ForwardPaged, CacheSeqlensHasBatchEntries) {
  fh::ForwardParams p = paged_forward();
  p.cache_seqlens.shape[0] = kBatch + 1;
  EXPECT_REFUSED(fh::check(p), "cache_seqlens", "batch size");
}

TEST(ForwardPaged, NewKeysValuesMatchTheCache) {
  fh::ForwardParams p = paged_forward();
  p.k_new.shape[2] = kHeadsKV + 1;
  EXPECT_REFUSED(fh::check(p), "k_new", "number of key/value heads");
  p = paged_forward();
  p.k_new = fh::make_tensor(p.k_new.data, FH_DTYPE_BF16, {kBatch, 1, kHeadsKV, 64});
  EXPECT_REFUSED(fh::check(p), "k_new", "head dim");
  p = paged_forward();
  p.v_new.shape[1] = 2;
  EXPECT_REFUSED(fh::check(p), "v_new", "number of new tokens");
  p = paged_forward();
  p.v_new.shape[0] = kBatch + 1;
  EXPECT_REFUSED(fh::check(p), "v_new", "batch size");
}

// ---- fp8 --------------------------------------------------------------------------------------

TEST(ForwardFp8, DescaleIsBatchByKeyValueHeads) {
  fh::ForwardParams p = fp8_forward();
  p.k_descale.shape[1] = kHeadsQ;
  EXPECT_REFUSED(fh::check(p), "k_descale", "number of key/value heads");
  p = fp8_forward();
  p.q_descale.shape[0] = kBatch + 1;
  EXPECT_REFUSED(fh::check(p), "q_descale", "batch size");
}

// fp8's v may be column-major, [B, S, Hkv, dv] with the keys contiguous (FA3's V_colmajor): its
// other strides 16-byte multiples like any TMA operand's. Other dtypes keep the last-dim rule.
TEST(ForwardFp8, ValueMayBeColumnMajor) {
  auto column_major = [](fh::Tensor v) {  // [B, Hkv, dv, S] storage seen as [B, S, Hkv, dv]
    const int64_t s = v.shape[1], h = v.shape[2], dv = v.shape[3];
    v.stride[0] = h * dv * s;
    v.stride[1] = 1;
    v.stride[2] = dv * s;
    v.stride[3] = s;
    return v;
  };
  fh::ForwardParams p = fp8_forward();
  p.v = column_major(p.v);
  EXPECT_PASSES(fh::check(p));
  p.v.shape[1] = p.k.shape[1] = kSeqK - 8;  // dv stride of 248 bytes
  p.v = column_major(p.v);
  EXPECT_REFUSED(fh::check(p), "v", "stride[3] is 248, not a multiple of 16 elements");
  fh::ForwardParams bf16 = dense_forward();
  bf16.v = column_major(bf16.v);
  EXPECT_REFUSED(fh::check(bf16), "v", "the last dim must be contiguous");
}

// ---- Scalars ----------------------------------------------------------------------------------

TEST(ForwardScalar, SoftmaxScaleFiniteAndNonNegative) {
  for (float scale : {std::nanf(""), std::numeric_limits<float>::infinity(), -0.5f}) {
    SCOPED_TRACE(scale);
    fh::ForwardParams p = dense_forward();
    p.softmax_scale = scale;
    EXPECT_REFUSED(fh::check(p), "softmax_scale", "finite and >= 0");
  }
  fh::ForwardParams p = dense_forward();
  p.softmax_scale = 0.125f;
  EXPECT_PASSES(fh::check(p));
}

TEST(ForwardScalar, SoftcapFiniteAndNonNegative) {
  for (float softcap : {std::nanf(""), -std::numeric_limits<float>::infinity(), -1.f}) {
    SCOPED_TRACE(softcap);
    fh::ForwardParams p = dense_forward();
    p.softcap = softcap;
    EXPECT_REFUSED(fh::check(p), "softcap", "finite and >= 0");
  }
  fh::ForwardParams p = dense_forward();
  p.softcap = 30.f;
  EXPECT_PASSES(fh::check(p));
}

TEST(ForwardScalar, WindowBoundsAtLeastMinusOne) {
  fh::ForwardParams p = dense_forward();
  p.window_left = -2;
  EXPECT_REFUSED(fh::check(p), "window_left", ">= -1");
  p = dense_forward();
  p.window_right = -7;
  EXPECT_REFUSED(fh::check(p), "window_right", ">= -1");
  p = dense_forward();
  p.window_left = 128;
  p.window_right = 0;
  EXPECT_PASSES(fh::check(p));
}

TEST(ForwardScalar, CausalExcludesOtherWindows) {
  fh::ForwardParams p = dense_forward();
  p.causal = 1;
  EXPECT_PASSES(fh::check(p));  // window (-1, -1)
  p.window_right = 0;
  EXPECT_PASSES(fh::check(p));  // window (-1, 0) is causal itself
  p.window_left = 4;
  const fh::Status status = fh::check(p);
  EXPECT_REFUSED(status, "causal", "window_left/window_right (4, 0)");
}

TEST(ForwardScalar, SinkTokensNonNegative) {
  fh::ForwardParams p = dense_forward();
  p.window_left = 64;
  p.num_sink_tokens = -1;
  EXPECT_REFUSED(fh::check(p), "num_sink_tokens", ">= 0");
}

TEST(ForwardScalar, SinkTokensNeedALocalWindow) {
  fh::ForwardParams p = dense_forward();
  p.num_sink_tokens = 4;
  EXPECT_REFUSED(fh::check(p), "num_sink_tokens", "local window");
  p.causal = 1;
  EXPECT_REFUSED(fh::check(p), "num_sink_tokens", "local window");
  p.causal = 0;
  p.window_left = 64;
  p.window_right = 0;
  EXPECT_PASSES(fh::check(p));
}

TEST(ForwardScalar, CausalIsZeroOrOne) {
  for (int32_t causal : {7, -1, 2}) {
    SCOPED_TRACE(causal);
    fh::ForwardParams p = dense_forward();
    p.causal = causal;
    EXPECT_REFUSED(fh::check(p), "causal", "is " + std::to_string(causal) + "; must be 0 or 1");
    EXPECT_REFUSED(check_for_reference(p), "causal", "must be 0 or 1");
  }
  fh::ForwardParams p = dense_forward();
  p.causal = 1;
  EXPECT_PASSES(fh::check(p));
}

TEST(ForwardScalar, AttentionChunkNonNegative) {
  for (int32_t chunk : {-1, -128}) {
    SCOPED_TRACE(chunk);
    fh::ForwardParams p = dense_forward();
    p.attention_chunk = chunk;
    EXPECT_REFUSED(fh::check(p), "attention_chunk", "must be >= 0 (0 disables it)");
  }
  fh::ForwardParams p = dense_forward();
  p.attention_chunk = 64;
  EXPECT_PASSES(fh::check(p));
  p.causal = 1;  // chunks combine with causal, windows and sink tokens
  EXPECT_PASSES(fh::check(p));
  p.causal = 0;
  p.window_left = 32;
  p.window_right = 0;
  p.num_sink_tokens = 4;
  EXPECT_PASSES(fh::check(p));
  p = varlen_forward();
  p.attention_chunk = 1;
  EXPECT_PASSES(fh::check(p));
}

TEST(ForwardScalar, NumSplitsInRange) {
  for (int32_t splits : {-1, 257}) {
    SCOPED_TRACE(splits);
    fh::ForwardParams p = dense_forward();
    p.num_splits = splits;
    EXPECT_REFUSED(fh::check(p), "num_splits", "[0, 256]");
  }
  for (int32_t splits : {0, 256}) {
    fh::ForwardParams p = dense_forward();
    p.num_splits = splits;
    EXPECT_PASSES(fh::check(p));
  }
}

// sm_margin: the SMs left free. Negative is refused in both passes; any positive margin passes the
// checks (the device's SM count is the dispatch's to judge), and the CPU reference ignores it.
TEST(Scalars, SmMarginNotNegative) {
  fh::ForwardParams f = dense_forward();
  fh::BackwardParams b = dense_backward();
  f.sm_margin = b.sm_margin = -1;
  EXPECT_REFUSED(fh::check(f), "sm_margin", ">= 0");
  EXPECT_REFUSED(fh::check(b), "sm_margin", ">= 0");
  f.sm_margin = b.sm_margin = 8;
  EXPECT_PASSES(fh::check(f));
  EXPECT_PASSES(fh::check(b));
  EXPECT_PASSES(check_for_reference(f));
  EXPECT_EQ(fh::default_forward_params().sm_margin, 0);
  EXPECT_EQ(fh::default_backward_params().sm_margin, 0);
}

// ---- Order: the first failure is the most useful one ------------------------------------------

TEST(ForwardOrder, PresenceThenRankThenShapeThenStride) {
  fh::ForwardParams p = dense_forward();
  p.q.stride[3] = 2;   // a stride rule
  p.out.shape[2] = 1;  // a shape rule
  p.k = fh::make_tensor(p.k.data, FH_DTYPE_BF16, {kBatch * kSeqK, kHeadsKV, kDim});  // a rank rule
  p.v.data = nullptr;  // a presence rule
  EXPECT_REFUSED(fh::check(p), "v", "required");
  p.v = dense_forward().v;
  EXPECT_REFUSED(fh::check(p), "k", "4-d");
  p.k = dense_forward().k;
  EXPECT_REFUSED(fh::check(p), "out", "number of query heads");
  p.out = dense_forward().out;
  EXPECT_REFUSED(fh::check(p), "q", "contiguous");
}

// ---- Backward ---------------------------------------------------------------------------------

TEST(Backward, AllTensorsRequired) {
  const char* names[] = {"q", "k", "v", "out", "dout", "lse", "dq", "dk", "dv"};
  for (int i = 0; i < 9; ++i) {
    SCOPED_TRACE(names[i]);
    fh::BackwardParams p = dense_backward();
    fh::Tensor* tensors[] = {&p.q, &p.k, &p.v, &p.out, &p.dout, &p.lse, &p.dq, &p.dk, &p.dv};
    tensors[i]->data = nullptr;
    EXPECT_REFUSED(fh::check(p), names[i], "required");
  }
}

TEST(Backward, HostReferenceNeedsNeitherOutNorLse) {
  // The CPU reference recomputes the forward, so out and lse are optional there.
  fh::BackwardParams p = dense_backward();
  p.out = p.lse = {};
  EXPECT_PASSES(check_for_reference(p));
  p.dout = {};
  EXPECT_REFUSED(check_for_reference(p), "dout", "required");
}

TEST(Backward, NoFp8) {
  fh::BackwardParams p = dense_backward();
  for (fh::Tensor* t : {&p.q, &p.k, &p.v, &p.out, &p.dout, &p.dq, &p.dk, &p.dv}) t->dtype = FH_DTYPE_FP8_E4M3;
  EXPECT_REFUSED(fh::check(p), "q", "the backward takes no fp8");
}

TEST(Backward, GradientRanksFollowTheirTensors) {
  fh::BackwardParams p = dense_backward();
  p.dq = fh::make_tensor(p.dq.data, FH_DTYPE_BF16, {kBatch * kSeqQ, kHeadsQ, kDim});
  EXPECT_REFUSED(fh::check(p), "dq", "4-d");
  p = varlen_backward();
  p.dk = fh::make_tensor(p.dk.data, FH_DTYPE_BF16, {1, kTotalK, kHeadsKV, kDim});
  EXPECT_REFUSED(fh::check(p), "dk", "varlen (cu_seqlens_k given) dk must be 3-d");
  p = dense_backward();
  p.dout = fh::make_tensor(p.dout.data, FH_DTYPE_BF16, {kBatch * kSeqQ, kHeadsQ, kDimV});
  EXPECT_REFUSED(fh::check(p), "dout", "4-d");
}

TEST(Backward, GradientShapesMatchTheirTensors) {
  fh::BackwardParams p = dense_backward();
  p.dq.shape[2] = kHeadsQ / 2;
  EXPECT_REFUSED(fh::check(p), "dq", "must have the same shape as q");
  p = dense_backward();
  p.dk.shape[1] = kSeqK / 2;
  EXPECT_REFUSED(fh::check(p), "dk", "same shape as k");
  p = dense_backward();
  p.dv = fh::make_tensor(p.dv.data, FH_DTYPE_BF16, {kBatch, kSeqK, kHeadsKV, 64});
  EXPECT_REFUSED(fh::check(p), "dv", "same shape as v");
  p = dense_backward();
  p.dout.shape[1] = kSeqQ * 2;
  EXPECT_REFUSED(fh::check(p), "dout", "query sequence length");
}

TEST(Backward, GradientDtypesAreQs) {
  const char* names[] = {"dout", "dq", "dk", "dv"};
  for (int i = 0; i < 4; ++i) {
    SCOPED_TRACE(names[i]);
    fh::BackwardParams p = dense_backward();
    fh::Tensor* tensors[] = {&p.dout, &p.dq, &p.dk, &p.dv};
    tensors[i]->dtype = FH_DTYPE_FP16;
    EXPECT_REFUSED(fh::check(p), names[i], "the dtype of q");
  }
  fh::BackwardParams p = dense_backward();
  p.dq.dtype = p.dk.dtype = p.dv.dtype = FH_DTYPE_FP64;  // the reference may write float64
  EXPECT_PASSES(check_for_reference(p));
}

TEST(Backward, LseIsFloat32) {
  fh::BackwardParams p = dense_backward();
  p.lse.dtype = FH_DTYPE_FP16;
  EXPECT_REFUSED(fh::check(p), "lse", "float32");
}

TEST(Backward, VarlenShapes) {
  fh::BackwardParams p = varlen_backward();
  p.lse = fh::make_tensor(p.lse.data, FH_DTYPE_FP32, {kHeadsQ, kTotalQ + 8});
  EXPECT_REFUSED(fh::check(p), "lse", "total query tokens");
  p = varlen_backward();
  p.max_seqlen_k = 0;
  EXPECT_REFUSED(fh::check(p), "max_seqlen_k", ">= 1");
}

TEST(Backward, DeterministicIsZeroOrOne) {
  fh::BackwardParams p = dense_backward();
  p.deterministic = 1;
  EXPECT_PASSES(fh::check(p));
  p.deterministic = 2;
  EXPECT_REFUSED(fh::check(p), "deterministic", "0 or 1");
}

TEST(Backward, SharesTheForwardsRules) {
  fh::BackwardParams p = dense_backward();
  p.causal = 1;
  p.window_left = 16;
  EXPECT_REFUSED(fh::check(p), "causal", "window");
  p = dense_backward();
  p.softmax_scale = std::nanf("");
  EXPECT_REFUSED(fh::check(p), "softmax_scale", "finite");
  p = dense_backward();
  p.k.shape[2] = p.v.shape[2] = p.dk.shape[2] = p.dv.shape[2] = 3;
  EXPECT_REFUSED(fh::check(p), "k", "Hq % Hkv");
  p = dense_backward();
  p.dq.stride[3] = 2;
  EXPECT_REFUSED(fh::check(p), "dq", "contiguous");
  p = dense_backward();
  p.dk.data = misaligned(p.dk.data, 2);
  EXPECT_REFUSED(fh::check(p), "dk", "16-byte aligned");
  p = dense_backward();
  p.num_sink_tokens = 2;
  EXPECT_REFUSED(fh::check(p), "num_sink_tokens", "local window");
}

// ---- Learnable sink ---------------------------------------------------------------------------

fh::Tensor sink_tensor(int index, fh::DType dtype = FH_DTYPE_FP32) {
  return fh::make_tensor(fake_pointer(index), dtype, {kHeadsQ});
}

TEST(LearnableSink, ValidSinksPass) {
  fh::ForwardParams p = dense_forward();
  p.learnable_sink = sink_tensor(20);
  EXPECT_PASSES(fh::check(p));
  EXPECT_PASSES(check_for_reference(p));
  p = varlen_forward();
  p.learnable_sink = sink_tensor(20);
  EXPECT_PASSES(fh::check(p));
  p = paged_forward();
  p.learnable_sink = sink_tensor(20);
  EXPECT_PASSES(fh::check(p));
  fh::BackwardParams b = dense_backward();
  b.learnable_sink = sink_tensor(20);
  EXPECT_PASSES(fh::check(b));  // without dsink: the sink's gradient is not asked for
  b.dsink = sink_tensor(21);
  EXPECT_PASSES(fh::check(b));
  EXPECT_PASSES(check_for_reference(b));
  b = varlen_backward();
  b.learnable_sink = sink_tensor(20);
  b.dsink = sink_tensor(21);
  EXPECT_PASSES(fh::check(b));
}

TEST(LearnableSink, IsOneDimensional) {
  fh::ForwardParams p = dense_forward();
  p.learnable_sink = fh::make_tensor(fake_pointer(20), FH_DTYPE_FP32, {1, kHeadsQ});
  EXPECT_REFUSED(fh::check(p), "learnable_sink", "ndim is 2 but learnable_sink must be 1-d [Hq]");
  p.learnable_sink = fh::make_tensor(fake_pointer(20), FH_DTYPE_FP32, {});
  EXPECT_REFUSED(fh::check(p), "learnable_sink", "1-d [Hq]");
  fh::BackwardParams b = dense_backward();
  b.learnable_sink = fh::make_tensor(fake_pointer(20), FH_DTYPE_FP32, {kBatch, kHeadsQ});
  EXPECT_REFUSED(fh::check(b), "learnable_sink", "1-d [Hq]");
}

TEST(LearnableSink, IsFloat32) {
  for (fh::DType dtype : {FH_DTYPE_BF16, FH_DTYPE_FP16, FH_DTYPE_INT32}) {
    fh::ForwardParams p = dense_forward();
    p.learnable_sink = sink_tensor(20, dtype);
    EXPECT_REFUSED(fh::check(p), "learnable_sink", "; must be float32");
    EXPECT_REFUSED(check_for_reference(p), "learnable_sink", "must be float32 or float64");
  }
  fh::ForwardParams p = dense_forward();
  p.learnable_sink = sink_tensor(20, FH_DTYPE_FP64);
  EXPECT_REFUSED(fh::check(p), "learnable_sink", "dtype is float64; must be float32");
  EXPECT_PASSES(check_for_reference(p));  // the reference also reads float64, as for lse
  fh::BackwardParams b = dense_backward();
  b.learnable_sink = sink_tensor(20, FH_DTYPE_BF16);
  EXPECT_REFUSED(fh::check(b), "learnable_sink", "must be float32");
}

TEST(LearnableSink, HasOneLogitPerQueryHead) {
  for (int64_t heads : {kHeadsKV, kHeadsQ + 1}) {
    SCOPED_TRACE(heads);
    fh::ForwardParams p = dense_forward();
    p.learnable_sink = fh::make_tensor(fake_pointer(20), FH_DTYPE_FP32, {heads});
    EXPECT_REFUSED(fh::check(p), "learnable_sink",
                   "shape[0] (number of query heads) is " + std::to_string(heads) +
                       " but q's number of query heads is 8");
    fh::BackwardParams b = dense_backward();
    b.learnable_sink = p.learnable_sink;
    EXPECT_REFUSED(fh::check(b), "learnable_sink", "number of query heads");
  }
  fh::ForwardParams p = dense_forward();
  p.learnable_sink = fh::make_tensor(fake_pointer(20), FH_DTYPE_FP32, {0});
  EXPECT_REFUSED(fh::check(p), "learnable_sink", "at least 1");
}

TEST(LearnableSink, KernelsNeedStrideOne) {
  fh::ForwardParams p = dense_forward();
  p.learnable_sink = fh::make_tensor(fake_pointer(20), FH_DTYPE_FP32, {kHeadsQ}, {2});
  EXPECT_REFUSED(fh::check(p), "learnable_sink", "stride[0] is 2 but the last dim must be contiguous (stride 1)");
  EXPECT_PASSES(check_for_reference(p));  // the reference reads at any stride
  p.learnable_sink = sink_tensor(20);
  p.learnable_sink.data = misaligned(p.learnable_sink.data, 2);
  EXPECT_REFUSED(fh::check(p), "learnable_sink", "4-byte aligned");
  p.learnable_sink = fh::make_tensor(fake_pointer(20), FH_DTYPE_FP32, {kHeadsQ}, {-1});
  EXPECT_REFUSED(check_for_reference(p), "learnable_sink", "negative strides");
}

TEST(LearnableSink, DsinkNeedsTheSink) {
  fh::BackwardParams b = dense_backward();
  b.dsink = sink_tensor(21);
  EXPECT_REFUSED(fh::check(b), "dsink", "is given but learnable_sink is absent");
  EXPECT_REFUSED(check_for_reference(b), "dsink", "learnable_sink is absent");
}

TEST(LearnableSink, DsinkIsFloat32PerQueryHead) {
  fh::BackwardParams b = dense_backward();
  b.learnable_sink = sink_tensor(20);
  b.dsink = fh::make_tensor(fake_pointer(21), FH_DTYPE_FP32, {kHeadsQ, 1});
  EXPECT_REFUSED(fh::check(b), "dsink", "ndim is 2 but dsink must be 1-d [Hq]");
  b.dsink = fh::make_tensor(fake_pointer(21), FH_DTYPE_FP32, {kHeadsKV});
  EXPECT_REFUSED(fh::check(b), "dsink", "shape[0] (number of query heads) is 2 but q's number of query heads is 8");
  b.dsink = sink_tensor(21, FH_DTYPE_BF16);
  EXPECT_REFUSED(fh::check(b), "dsink", "dtype is bf16; must be float32");
  b.dsink = sink_tensor(21, FH_DTYPE_FP64);
  EXPECT_REFUSED(fh::check(b), "dsink", "must be float32");
  EXPECT_PASSES(check_for_reference(b));
  b.dsink = fh::make_tensor(fake_pointer(21), FH_DTYPE_FP32, {kHeadsQ}, {4});
  EXPECT_REFUSED(fh::check(b), "dsink", "contiguous (stride 1)");
}

TEST(LearnableSink, DsinkDoesNotAliasTheSink) {
  fh::BackwardParams b = dense_backward();
  b.learnable_sink = sink_tensor(20);
  b.dsink = sink_tensor(20);
  EXPECT_REFUSED(fh::check(b), "dsink", "overlaps learnable_sink in memory");
  EXPECT_REFUSED(check_for_reference(b), "dsink", "overlaps");
  b.dsink.data = misaligned(b.learnable_sink.data, 4 * (kHeadsQ - 1));  // shares the last logit
  EXPECT_REFUSED(fh::check(b), "dsink", "overlaps");
  b.dsink.data = misaligned(b.learnable_sink.data, 4 * kHeadsQ);  // right after it
  EXPECT_PASSES(fh::check(b));
  b.dsink = sink_tensor(20);
  b.learnable_sink.data = misaligned(b.dsink.data, 4 * kHeadsQ);
  EXPECT_PASSES(fh::check(b));
  // Strided (the reference accepts it): the span from the first to the last element counts.
  b = dense_backward();
  b.learnable_sink = fh::make_tensor(fake_pointer(20), FH_DTYPE_FP32, {kHeadsQ}, {2});
  b.dsink = sink_tensor(20);
  b.dsink.data = misaligned(b.dsink.data, 4);  // between the sink's elements, inside its span
  EXPECT_REFUSED(check_for_reference(b), "dsink", "overlaps");
}

TEST(LearnableSink, BackwardChecksTheNewScalarsToo) {
  fh::BackwardParams b = dense_backward();
  b.attention_chunk = -1;
  EXPECT_REFUSED(fh::check(b), "attention_chunk", ">= 0");
  b.attention_chunk = 256;
  EXPECT_PASSES(fh::check(b));
  b = dense_backward();
  b.causal = 7;
  EXPECT_REFUSED(fh::check(b), "causal", "must be 0 or 1");
  b.causal = -1;
  EXPECT_REFUSED(fh::check(b), "causal", "must be 0 or 1");
}

// ---- Combine ----------------------------------------------------------------------------------

TEST(Combine, PartialsAndOutRequired) {
  const char* names[] = {"out_partial", "lse_partial", "out"};
  for (int i = 0; i < 3; ++i) {
    SCOPED_TRACE(names[i]);
    fh::CombineParams p = combine_call();
    fh::Tensor* tensors[] = {&p.out_partial, &p.lse_partial, &p.out};
    tensors[i]->data = nullptr;
    EXPECT_REFUSED(fh::check(p), names[i], "required");
  }
}

TEST(Combine, Ranks) {
  fh::CombineParams p = combine_call();
  p.out_partial = fh::make_tensor(p.out_partial.data, FH_DTYPE_FP32, {kSplits, kBatch, kHeadsQ, kDimV});
  EXPECT_REFUSED(fh::check(p), "out_partial", "5-d [num_splits, B, Hq, sq, dv]");
  p = combine_call();
  p.lse_partial = fh::make_tensor(p.lse_partial.data, FH_DTYPE_FP32, {kSplits, kBatch, kHeadsQ});
  EXPECT_REFUSED(fh::check(p), "lse_partial", "4-d");
  p = combine_call();
  p.lse = fh::make_tensor(p.lse.data, FH_DTYPE_FP32, {kBatch, kHeadsQ});
  EXPECT_REFUSED(fh::check(p), "lse", "3-d");
}

// Varlen (out of rank 3): the partials drop the batch dim, as the CPU reference writes them.
TEST(Combine, VarlenLayout) {
  constexpr int64_t kTotalQ = 37;
  fh::CombineParams p{};
  p.out_partial = fh::make_tensor(fake_pointer(0), FH_DTYPE_FP32, {kSplits, kHeadsQ, kTotalQ, kDimV});
  p.lse_partial = fh::make_tensor(fake_pointer(1), FH_DTYPE_FP32, {kSplits, kHeadsQ, kTotalQ});
  p.out = fh::make_tensor(fake_pointer(2), FH_DTYPE_BF16, {kTotalQ, kHeadsQ, kDimV});
  p.lse = fh::make_tensor(fake_pointer(3), FH_DTYPE_FP32, {kHeadsQ, kTotalQ});
  EXPECT_TRUE(fh::check(p).ok()) << fh::check(p).message;
  fh::CombineParams bad = p;
  bad.out_partial = fh::make_tensor(fake_pointer(0), FH_DTYPE_FP32, {kSplits, 1, kHeadsQ, kTotalQ, kDimV});
  EXPECT_REFUSED(fh::check(bad), "out_partial", "4-d");
  bad = p;
  bad.lse = fh::make_tensor(fake_pointer(3), FH_DTYPE_FP32, {kHeadsQ, kTotalQ + 1});
  EXPECT_REFUSED(fh::check(bad), "lse", "total query tokens");
}

TEST(Combine, PartialsAreFloat32) {
  fh::CombineParams p = combine_call();
  p.out_partial.dtype = FH_DTYPE_BF16;
  EXPECT_REFUSED(fh::check(p), "out_partial", "float32");
  p = combine_call();
  p.lse_partial.dtype = FH_DTYPE_FP64;
  EXPECT_REFUSED(fh::check(p), "lse_partial", "float32");
  EXPECT_PASSES(check_for_reference(p));  // the CPU reference's own partials are float64
  p.lse_partial.dtype = FH_DTYPE_BF16;
  EXPECT_REFUSED(check_for_reference(p), "lse_partial", "float32 or float64");
}

TEST(Combine, OutIsBf16Fp16OrFloat32) {
  fh::CombineParams p = combine_call();
  p.out.dtype = FH_DTYPE_FP32;
  EXPECT_PASSES(fh::check(p));
  p.out.dtype = FH_DTYPE_FP8_E4M3;
  EXPECT_REFUSED(fh::check(p), "out", "bf16, fp16 or float32");
  p.out.dtype = FH_DTYPE_FP64;
  EXPECT_REFUSED(fh::check(p), "out", "dtype");
  EXPECT_PASSES(check_for_reference(p));
  p = combine_call();
  p.lse.dtype = FH_DTYPE_BF16;
  EXPECT_REFUSED(fh::check(p), "lse", "float32");
}

TEST(Combine, ShapesAgree) {
  fh::CombineParams p = combine_call();
  p.lse_partial.shape[0] = kSplits - 1;
  EXPECT_REFUSED(fh::check(p), "lse_partial", "number of splits");
  p = combine_call();
  p.out.shape[2] = kHeadsQ + 1;
  EXPECT_REFUSED(fh::check(p), "out", "number of query heads");
  p = combine_call();
  p.out.shape[3] = kDimV / 2;
  EXPECT_REFUSED(fh::check(p), "out", "value head dim");
  p = combine_call();
  p.lse.shape[0] = kBatch + 1;
  EXPECT_REFUSED(fh::check(p), "lse", "batch size");
}

TEST(Combine, SplitsInRange) {
  fh::CombineParams p = combine_call();
  p.out_partial.shape[0] = p.lse_partial.shape[0] = 257;
  EXPECT_REFUSED(fh::check(p), "out_partial", "[1, 256]");
  p.out_partial.shape[0] = p.lse_partial.shape[0] = 256;
  EXPECT_PASSES(fh::check(p));
  p.out_partial.shape[0] = p.lse_partial.shape[0] = 0;
  EXPECT_REFUSED(fh::check(p), "out_partial", "at least 1");
}

TEST(Combine, Layout) {
  fh::CombineParams p = combine_call();
  p.out.stride[3] = 2;
  EXPECT_REFUSED(fh::check(p), "out", "contiguous");
  p = combine_call();
  p.lse_partial.stride[1] = -1;
  EXPECT_REFUSED(fh::check(p), "lse_partial", "negative");
}

// ---- The C ABI --------------------------------------------------------------------------------

TEST(CAbi, CheckReportsThroughLastError) {
  fh_forward_params p;
  fh_forward_params_init(&p);
  EXPECT_EQ(fh_forward_check(&p), FH_ERROR_INVALID_ARGUMENT);
  EXPECT_THAT(std::string(fh_last_error()), StartsWith("q: is required"));

  p = dense_forward();
  EXPECT_EQ(fh_forward_check(&p), FH_SUCCESS);
  EXPECT_STREQ(fh_last_error(), "");

  p.num_splits = -1;
  EXPECT_EQ(fh_forward_check(&p), FH_ERROR_INVALID_ARGUMENT);
  EXPECT_THAT(std::string(fh_last_error()), HasSubstr("num_splits: is -1"));

  const fh_backward_params backward = dense_backward();
  EXPECT_EQ(fh_backward_check(&backward), FH_SUCCESS);

  fh_backward_params with_dsink = dense_backward();
  with_dsink.dsink = sink_tensor(21);
  EXPECT_EQ(fh_backward_check(&with_dsink), FH_ERROR_INVALID_ARGUMENT);
  EXPECT_THAT(std::string(fh_last_error()), StartsWith("dsink: is given but learnable_sink is absent"));
  const fh_combine_params combine = combine_call();
  EXPECT_EQ(fh_combine_check(&combine), FH_SUCCESS);
}

TEST(CAbi, NullParamsRefused) {
  EXPECT_EQ(fh_forward_check(nullptr), FH_ERROR_INVALID_ARGUMENT);
  EXPECT_THAT(std::string(fh_last_error()), StartsWith("params: "));
  EXPECT_EQ(fh_backward_check(nullptr), FH_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(fh_combine_check(nullptr), FH_ERROR_INVALID_ARGUMENT);
  EXPECT_THAT(std::string(fh_last_error()), StartsWith("params: "));
}

// ---- Running never succeeds on fake pointers, and never crashes -------------------------------

TEST(Forward, FakePointersNeverRun) {
  // Without CUDA (or without a GPU) the answer is NO_DEVICE or NOT_SUPPORTED; with a GPU the
  // pointer check refuses the fake addresses. Either way nothing is launched.
  const fh::Status status = fh::forward(dense_forward(), nullptr, 0, nullptr);
  EXPECT_NE(status.code, FH_SUCCESS);
  EXPECT_FALSE(status.message.empty());
  if (!fh_built_with_cuda()) {
    EXPECT_TRUE(status.code == FH_ERROR_NO_DEVICE || status.code == FH_ERROR_NOT_SUPPORTED) << status.message;
  }
  const fh::Status invalid = fh::forward(fh::default_forward_params(), nullptr, 0, nullptr);
  EXPECT_REFUSED(invalid, "q", "required");  // argument errors come first, before any device question
}

}  // namespace

// ---- Kernel families: the manifest's table picks the family a call runs on -----------------------

namespace {

using flashhopper::launch::family_for;
using flashhopper::launch::Pass;

TEST(KernelFamilies, HeadDimsRunOnTheNextFamily) {
  // The manifest holds 64, 128 and 256 at least; whatever lies between runs on the next one up.
  for (const auto& [asked, runs_on] : std::vector<std::pair<int, int>>{{8, 64}, {64, 64}, {72, 128}, {128, 128}}) {
    const auto* f = family_for(Pass::kForward, FH_DTYPE_BF16, asked, asked);
    ASSERT_NE(f, nullptr) << asked;
    EXPECT_LE(f->head_dim, runs_on) << asked;
    EXPECT_GE(f->head_dim, asked);
    for (const auto& other : flashhopper::launch::kKernelFamilies)  // no smaller family holds it
      if (other.pass == Pass::kForward && other.dtype == FH_DTYPE_BF16 && other.head_dim >= asked)
        EXPECT_GE(other.head_dim, f->head_dim) << asked;
  }
  EXPECT_EQ(family_for(Pass::kBackward, FH_DTYPE_FP16, 256, 256)->head_dim, 256);
  // Past 256: 512, both passes; past 512 nothing. FH_MAX_BACKWARD_HEAD_DIM is the backward
  // families' largest, FH_MAX_HEAD_DIM the forward's.
  int largest_backward = 0, largest_forward = 0;
  for (const auto& f : flashhopper::launch::kKernelFamilies) {
    int& largest = f.pass == Pass::kBackward ? largest_backward : largest_forward;
    largest = std::max(largest, f.head_dim);
  }
  EXPECT_EQ(largest_backward, FH_MAX_BACKWARD_HEAD_DIM);
  EXPECT_EQ(largest_forward, FH_MAX_HEAD_DIM);
  EXPECT_EQ(family_for(Pass::kForward, FH_DTYPE_BF16, 264, 264)->head_dim, 512);
  EXPECT_EQ(family_for(Pass::kBackward, FH_DTYPE_BF16, 264, 264)->head_dim, 512);
  EXPECT_EQ(family_for(Pass::kBackward, FH_DTYPE_BF16, 520, 520), nullptr);
  EXPECT_EQ(family_for(Pass::kForward, FH_DTYPE_BF16, 520, 520), nullptr);
  EXPECT_EQ(family_for(Pass::kForward, FH_DTYPE_FP32, 128, 128), nullptr);
}

TEST(KernelFamilies, ValueHeadDimsRunOnTheirOwnFamily) {
  // MLA prefill's 192/128 has a family of its own in both passes: calls of those sizes, or of
  // smaller ones that no smaller family holds, run there rather than on 192/192.
  for (Pass pass : {Pass::kForward, Pass::kBackward})
    for (fh_dtype dtype : {FH_DTYPE_BF16, FH_DTYPE_FP16})
      for (const auto& [asked, runs_on] : std::vector<std::pair<std::pair<int, int>, std::pair<int, int>>>{
               {{192, 128}, {192, 128}}, {{160, 64}, {192, 128}}, {{192, 136}, {192, 192}}, {{192, 192}, {192, 192}}}) {
        const auto* f = family_for(pass, dtype, asked.first, asked.second);
        ASSERT_NE(f, nullptr) << asked.first << "/" << asked.second;
        EXPECT_EQ(std::make_pair(f->head_dim, f->head_dim_v), runs_on)
            << (pass == Pass::kForward ? "forward " : "backward ") << asked.first << "/" << asked.second;
      }
}

TEST(KernelFamilies, CallsRunOnTheFamilyThatPadsLeast) {
  // Of the families that hold a call, the one of least d + dv: (64, 128) on 128/128 (256 of work),
  // not 192/128 (320); (160, 64) on 192/128, not 192/192.
  for (fh_dtype dtype : {FH_DTYPE_BF16, FH_DTYPE_FP16})
    for (const auto& [asked, runs_on] : std::vector<std::pair<std::pair<int, int>, std::pair<int, int>>>{
             {{64, 128}, {128, 128}}, {{64, 64}, {64, 64}}, {{160, 64}, {192, 128}}, {{64, 192}, {192, 192}}}) {
      const auto* f = family_for(Pass::kForward, dtype, asked.first, asked.second);
      ASSERT_NE(f, nullptr) << asked.first << "/" << asked.second;
      EXPECT_EQ(std::make_pair(f->head_dim, f->head_dim_v), runs_on) << asked.first << "/" << asked.second;
    }
}

TEST(KernelFamilies, QvCallsRunOnTheQvFamiliesAlone) {
  // The forward's 64/256 qv family (absorbed MLA) takes the calls with qv of d <= 64 and
  // dv <= 256, the 64/512 one those of dv <= 512, and no call without qv: (64, 256) without qv pads
  // to 256/256. A qv call no qv family holds is refused by name; the backward has no qv.
  for (fh_dtype dtype : {FH_DTYPE_BF16, FH_DTYPE_FP16}) {
    for (const auto& [d, dv] : std::vector<std::pair<int, int>>{{64, 256}, {64, 192}, {32, 128}, {64, 64}}) {
      const auto* f = family_for(Pass::kForward, dtype, d, dv, /*qv=*/true);
      ASSERT_NE(f, nullptr) << d << "/" << dv;
      EXPECT_TRUE(f->qv);
      EXPECT_EQ(std::make_pair(f->head_dim, f->head_dim_v), std::make_pair(64, 256)) << d << "/" << dv;
    }
    const auto* plain = family_for(Pass::kForward, dtype, 64, 256);
    ASSERT_NE(plain, nullptr);
    EXPECT_FALSE(plain->qv);
    EXPECT_EQ(std::make_pair(plain->head_dim, plain->head_dim_v), std::make_pair(256, 256));
    for (int dv : {264, 384, 512}) {
      const auto* wide = family_for(Pass::kForward, dtype, 64, dv, /*qv=*/true);
      ASSERT_NE(wide, nullptr) << dv;
      EXPECT_EQ(std::make_pair(wide->head_dim, wide->head_dim_v), std::make_pair(64, 512)) << dv;
    }
    EXPECT_EQ(family_for(Pass::kForward, dtype, 64, 512)->head_dim, 512);  // without qv: padded to 512/512
    EXPECT_EQ(family_for(Pass::kForward, dtype, 72, 256, /*qv=*/true), nullptr);
    EXPECT_EQ(family_for(Pass::kForward, dtype, 64, 520, /*qv=*/true), nullptr);
    EXPECT_EQ(family_for(Pass::kBackward, dtype, 64, 256, /*qv=*/true), nullptr);
    EXPECT_TRUE(flashhopper::launch::forward_family_takes_qv(dtype, 64, 256));
    EXPECT_FALSE(flashhopper::launch::forward_family_takes_qv(dtype, 128, 128));
  }
  const std::string reason =
      flashhopper::launch::family_unsupported_reason(Pass::kForward, FH_DTYPE_BF16, 128, 128, /*qv=*/true);
  EXPECT_THAT(reason, HasSubstr("head dim 128 and qv: no kernel family with qv holds it"));
  EXPECT_THAT(reason, HasSubstr("64/256"));
}

TEST(KernelFamilies, CompiledFamiliesQuery) {
  const int32_t count = fh_compiled_families(nullptr, 0);
  if (!fh_built_with_cuda()) {
    EXPECT_EQ(count, 0);
    return;
  }
  ASSERT_GT(count, 0);
  std::vector<fh_kernel_family> families(size_t(count) + 1, fh_kernel_family{-1, -1, -1, -1});
  EXPECT_EQ(fh_compiled_families(families.data(), 1), count);  // writes only what fits
  EXPECT_EQ(families[1].head_dim, -1);
  EXPECT_EQ(fh_compiled_families(families.data(), count), count);
  EXPECT_EQ(families[size_t(count)].head_dim, -1);
  bool forward_bf16_128 = false, backward_bf16_128 = false;  // in every kernel set
  for (int32_t i = 0; i < count; ++i) {
    const fh_kernel_family& f = families[size_t(i)];
    EXPECT_TRUE(f.dtype == FH_DTYPE_BF16 || f.dtype == FH_DTYPE_FP16 ||
                (f.dtype == FH_DTYPE_FP8_E4M3 && !f.backward));  // fp8: forward families only
    const auto* row = family_for(f.backward ? Pass::kBackward : Pass::kForward, fh_dtype(f.dtype), f.head_dim,
                                 f.head_dim_v);
    ASSERT_NE(row, nullptr);
    EXPECT_EQ(row->head_dim, f.head_dim);  // a row of the manifest
    forward_bf16_128 |= !f.backward && f.dtype == FH_DTYPE_BF16 && f.head_dim == 128;
    backward_bf16_128 |= f.backward && f.dtype == FH_DTYPE_BF16 && f.head_dim == 128;
  }
  EXPECT_TRUE(forward_bf16_128 && backward_bf16_128);
}

bool compiled(bool backward, fh_dtype dtype, int head_dim) {
  std::vector<fh_kernel_family> families(size_t(fh_compiled_families(nullptr, 0)));
  fh_compiled_families(families.data(), int32_t(families.size()));
  for (const fh_kernel_family& f : families)
    if ((f.backward != 0) == backward && f.dtype == dtype && f.head_dim == head_dim) return true;
  return false;
}

TEST(KernelFamilies, UncompiledFamilyIsRefusedByName) {
  if (!fh_built_with_cuda()) GTEST_SKIP() << "a build without CUDA refuses every run as NO_DEVICE";
  // Head dim 200 runs on hdim 256; a build without that family refuses it by name, before any
  // device question.
  fh::ForwardParams p = fh::default_forward_params();
  p.q = fh::make_tensor(fake_pointer(0), FH_DTYPE_BF16, {kBatch, kSeqQ, kHeadsQ, 200});
  p.k = fh::make_tensor(fake_pointer(1), FH_DTYPE_BF16, {kBatch, kSeqK, kHeadsKV, 200});
  p.v = fh::make_tensor(fake_pointer(2), FH_DTYPE_BF16, {kBatch, kSeqK, kHeadsKV, 200});
  p.out = fh::make_tensor(fake_pointer(3), FH_DTYPE_BF16, {kBatch, kSeqQ, kHeadsQ, 200});
  const fh::Status status = fh::forward(p, nullptr, 0, nullptr);
  EXPECT_NE(status.code, FH_SUCCESS);
  if (compiled(false, FH_DTYPE_BF16, 256)) {
    EXPECT_NE(status.code, FH_ERROR_NOT_SUPPORTED) << status.message;
  } else {
    EXPECT_EQ(status.code, FH_ERROR_NOT_SUPPORTED);
    EXPECT_THAT(status.message, HasSubstr("head dim 200 runs on the forward bf16 hdim 256 kernels"));
    EXPECT_THAT(status.message, HasSubstr("-DFLASHHOPPER_KERNELS=bench"));
  }
}

// A refusal names this build's kernel set, the one its compiled families show. The library must
// answer from its own copy of the inline functions that say it (linked -Bsymbolic-functions), not
// from this program's: this file includes them compiled without the build's set ("none"), and
// without that option the shared library's calls bound to this program's copy (ELF interposition),
// which then refused every family but the dev set's as uncompiled.
TEST(KernelFamilies, RefusalNamesThisBuildsKernelSet) {
  if (!fh_built_with_cuda()) GTEST_SKIP() << "a build without CUDA refuses every run as NO_DEVICE";
  std::vector<fh_kernel_family> families(size_t(fh_compiled_families(nullptr, 0)));
  fh_compiled_families(families.data(), int32_t(families.size()));
  int built_set = -1;
  for (const fh_kernel_family& f : families)
    for (const auto& row : flashhopper::launch::kKernelFamilies)
      if ((row.pass == Pass::kBackward) == (f.backward != 0) && row.dtype == f.dtype && row.head_dim == f.head_dim &&
          row.head_dim_v == f.head_dim_v && !row.qv)
        built_set = std::max(built_set, row.first_set);
  ASSERT_GE(built_set, 0) << "a CUDA build compiles the dev set at least";
  const flashhopper::launch::KernelFamily* missing = nullptr;
  for (const auto& row : flashhopper::launch::kKernelFamilies)
    if (missing == nullptr && row.first_set > built_set && row.pass == Pass::kForward && !row.qv &&
        row.dtype != FH_DTYPE_FP8_E4M3)
      missing = &row;
  if (missing == nullptr) GTEST_SKIP() << "this build compiles every 16-bit forward family";
  fh::ForwardParams p = fh::default_forward_params();
  const auto d = int64_t(missing->head_dim), dv = int64_t(missing->head_dim_v);
  const auto dtype = static_cast<fh_dtype>(missing->dtype);
  p.q = fh::make_tensor(fake_pointer(0), dtype, {kBatch, kSeqQ, kHeadsQ, d});
  p.k = fh::make_tensor(fake_pointer(1), dtype, {kBatch, kSeqK, kHeadsKV, d});
  p.v = fh::make_tensor(fake_pointer(2), dtype, {kBatch, kSeqK, kHeadsKV, dv});
  p.out = fh::make_tensor(fake_pointer(3), dtype, {kBatch, kSeqQ, kHeadsQ, dv});
  const fh::Status status = fh::forward(p, nullptr, 0, nullptr);
  EXPECT_EQ(status.code, FH_ERROR_NOT_SUPPORTED) << status.message;
  EXPECT_THAT(status.message,
              HasSubstr(std::string("this build (kernel set '") + flashhopper::launch::kKernelSets[built_set] + "')"));
}

// fp8 inputs run on the fp8 families (the bench set up), with every feature but a rotated append:
// a build without them refuses by the family's name and the set that has it; one with them runs
// split-KV, packed rows, pages of any size (gathered where no multiple of 16 keys), cache_leftpad
// with pages and the append, and refuses rotary tables by name.
TEST(KernelFamilies, Fp8RunsFromTheBenchSet) {
  if (!fh_built_with_cuda()) GTEST_SKIP() << "a build without CUDA refuses every run as NO_DEVICE";
  fh::ForwardParams p = fh::default_forward_params();
  p.q = fh::make_tensor(fake_pointer(0), FH_DTYPE_FP8_E4M3, {kBatch, kSeqQ, kHeadsQ, 128});
  p.k = fh::make_tensor(fake_pointer(1), FH_DTYPE_FP8_E4M3, {kBatch, kSeqK, kHeadsKV, 128});
  p.v = fh::make_tensor(fake_pointer(2), FH_DTYPE_FP8_E4M3, {kBatch, kSeqK, kHeadsKV, 128});
  p.out = fh::make_tensor(fake_pointer(3), FH_DTYPE_BF16, {kBatch, kSeqQ, kHeadsQ, 128});
  fh::Status status = fh::forward(p, nullptr, 0, nullptr);
  EXPECT_NE(status.code, FH_SUCCESS);
  if (!compiled(false, FH_DTYPE_FP8_E4M3, 128)) {
    EXPECT_EQ(status.code, FH_ERROR_NOT_SUPPORTED);
    EXPECT_THAT(status.message, HasSubstr("runs on the forward fp8_e4m3 hdim 128 kernels"));
    EXPECT_THAT(status.message, HasSubstr("-DFLASHHOPPER_KERNELS=bench"));
    return;
  }
  EXPECT_NE(status.code, FH_ERROR_NOT_SUPPORTED) << status.message;
  p.num_splits = 3;
  status = fh::forward(p, nullptr, 0, nullptr);
  EXPECT_NE(status.code, FH_ERROR_NOT_SUPPORTED) << status.message;

  fh::ForwardParams paged = paged_forward();  // pages of 64 keys
  paged.k_new = paged.v_new = {};
  for (fh::Tensor* t : {&paged.q, &paged.k, &paged.v}) t->dtype = FH_DTYPE_FP8_E4M3;
  status = fh::forward(paged, nullptr, 0, nullptr);
  EXPECT_NE(status.code, FH_ERROR_NOT_SUPPORTED) << status.message;
  fh::ForwardParams odd_pages = paged;
  odd_pages.k.shape[1] = odd_pages.v.shape[1] = 24;
  status = fh::forward(odd_pages, nullptr, 0, nullptr);
  EXPECT_NE(status.code, FH_ERROR_NOT_SUPPORTED) << status.message;
  fh::ForwardParams leftpad = paged;
  leftpad.cache_leftpad = fh::make_tensor(fake_pointer(9), FH_DTYPE_INT32, {kBatch});
  status = fh::forward(leftpad, nullptr, 0, nullptr);
  EXPECT_NE(status.code, FH_ERROR_NOT_SUPPORTED) << status.message;

  fh::ForwardParams paged_columns = paged;  // pages of [64, Hkv, dv] with the keys contiguous
  paged_columns.v.stride[1] = 1;
  paged_columns.v.stride[2] = kDimV * kPageSize;
  paged_columns.v.stride[3] = kPageSize;
  status = fh::forward(paged_columns, nullptr, 0, nullptr);
  EXPECT_EQ(status.code, FH_ERROR_NOT_SUPPORTED);
  EXPECT_THAT(status.message, HasSubstr("v: column-major (keys contiguous) runs without page_table"));

  fh::ForwardParams append = paged_forward();
  append.page_table = {};
  append.k = fh::make_tensor(fake_pointer(1), FH_DTYPE_FP8_E4M3, {kBatch, kSeqK, kHeadsKV, kDim});
  append.v = fh::make_tensor(fake_pointer(2), FH_DTYPE_FP8_E4M3, {kBatch, kSeqK, kHeadsKV, kDimV});
  for (fh::Tensor* t : {&append.q, &append.k_new, &append.v_new}) t->dtype = FH_DTYPE_FP8_E4M3;
  status = fh::forward(append, nullptr, 0, nullptr);
  EXPECT_NE(status.code, FH_ERROR_NOT_SUPPORTED) << status.message;
  append.rotary_cos = fh::make_tensor(fake_pointer(25), FH_DTYPE_FP8_E4M3, {kSeqK, kDim / 4});
  append.rotary_sin = fh::make_tensor(fake_pointer(26), FH_DTYPE_FP8_E4M3, {kSeqK, kDim / 4});
  status = fh::forward(append, nullptr, 0, nullptr);
  EXPECT_EQ(status.code, FH_ERROR_NOT_SUPPORTED);
  EXPECT_THAT(status.message, HasSubstr("rotary_cos: fp8_e4m3 inputs take no rotary embedding"));
}

}  // namespace

// ---- Hostile extents and strides: refused, never overflowed ------------------------------------

namespace {

TEST(HostileShapes, HugeStridesOfAnIndexTensorAreRefused) {
  // cu_seqlens_q of shape {INT64_MAX} and stride {INT64_MAX}: its byte range overflows even 128 bits.
  // cu_seqlens_k of the same length but stride 0 (one element), so only cu_seqlens_q's range is wrong.
  fh::ForwardParams p = varlen_forward();
  p.seqused_k = fh::Tensor{};
  p.cu_seqlens_q.shape[0] = p.cu_seqlens_k.shape[0] = std::numeric_limits<int64_t>::max();
  p.cu_seqlens_q.stride[0] = std::numeric_limits<int64_t>::max();
  p.cu_seqlens_k.stride[0] = 0;
  for (Target target : {Target::kHostReference, Target::kKernel}) {
    const fh::Status status = fh::detail::validate(p, target);
    EXPECT_EQ(status.code, FH_ERROR_INVALID_ARGUMENT);
    EXPECT_THAT(status.message, StartsWith("cu_seqlens_q: ")) << status.message;
  }
}

TEST(HostileShapes, BatchTimesKeysDoesNotOverflow) {
  // q [2^32, 1, 1, 8] and k/v [1, 2^32, 1, 8]: batch from q, sequence from k; refused by name.
  const int64_t big = int64_t(1) << 32;
  fh::ForwardParams p = fh::default_forward_params();
  p.q = fh::make_tensor(fake_pointer(0), FH_DTYPE_BF16, {big, 1, 1, 8});
  p.k = fh::make_tensor(fake_pointer(1), FH_DTYPE_BF16, {1, big, 1, 8});
  p.v = fh::make_tensor(fake_pointer(2), FH_DTYPE_BF16, {1, big, 1, 8});
  p.out = fh::make_tensor(fake_pointer(3), FH_DTYPE_BF16, {big, 1, 1, 8});
  for (Target target : {Target::kHostReference, Target::kKernel}) {
    const fh::Status status = fh::detail::validate(p, target);
    EXPECT_EQ(status.code, FH_ERROR_INVALID_ARGUMENT) << status.message;
    EXPECT_FALSE(status.message.empty());
  }
}

TEST(HostileShapes, MakeTensorRefusesWhatItCannotHold) {
  // More than FH_MAX_DIMS dims: not silently cut to five but marked invalid (ndim 0 is refused
  // by every check as "expected N dims").
  const fh::Tensor six = fh::make_tensor(fake_pointer(0), FH_DTYPE_BF16, {1, 2, 3, 4, 5, 6});
  EXPECT_EQ(six.ndim, 0);
  // Contiguous strides that overflow int64: saturated, so the range check refuses the tensor.
  const int64_t big = int64_t(1) << 40;
  const fh::Tensor huge = fh::make_tensor(fake_pointer(0), FH_DTYPE_BF16, {8, big, big, 8});
  EXPECT_EQ(huge.stride[0], std::numeric_limits<int64_t>::max());
  fh::ForwardParams p = dense_forward();
  p.q = huge;
  EXPECT_EQ(fh::detail::validate(p, Target::kHostReference).code, FH_ERROR_INVALID_ARGUMENT);
}

TEST(HostileShapes, OutputsMustNotAlias) {
  fh::ForwardParams p = dense_forward();
  p.out.data = p.q.data;
  EXPECT_REFUSED(fh::check(p), "out", "same address as q");
  p = dense_forward();
  p.out.stride[0] = 0;  // batch 2 written into one place
  EXPECT_REFUSED(fh::check(p), "out", "stride[0] is 0");
  fh::BackwardParams b = dense_backward();
  b.dk.data = b.v.data;
  EXPECT_REFUSED(fh::check(b), "dk", "same address as v");
  b = dense_backward();
  b.dv.data = b.dq.data;
  EXPECT_REFUSED(fh::check(b), "dv", "same address as dq");
  EXPECT_PASSES(fh::check(dense_backward()));  // distinct buffers pass
}

TEST(HostileShapes, TmaStridesBelowTwoToTheForty) {
  fh::ForwardParams p = dense_forward();
  p.k.stride[0] = (int64_t(1) << 39);  // 2^40 bytes of bf16
  EXPECT_REFUSED(fh::detail::validate(p, Target::kKernel), "k", "below 2^40 bytes");
  EXPECT_PASSES(fh::detail::validate(p, Target::kHostReference));  // the CPU reference reads any stride
}

TEST(HostileShapes, BooleansAreZeroOrOne) {
  fh::ForwardParams p = dense_forward();
  for (int32_t causal : {7, -1}) {
    p.causal = causal;
    EXPECT_REFUSED(fh::check(p), "causal", "must be 0 or 1");
  }
  fh::BackwardParams b = dense_backward();
  b.deterministic = 2;
  EXPECT_REFUSED(fh::check(b), "deterministic", "must be 0 or 1");
}

}  // namespace

// ---- Threads: the last error is per thread ----------------------------------------------------

namespace {

TEST(Threads, LastErrorIsPerThread) {
  // Each thread makes its own bad call many times over and must read back its own message,
  // whatever the others do meanwhile.
  constexpr int kThreads = 8, kCalls = 2000;
  std::vector<int> mismatches(kThreads, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([t, &mismatches] {
      fh::ForwardParams p = dense_forward();
      p.window_left = -2 - t;  // a refusal that names this thread's value
      const std::string expected = "window_left: is " + std::to_string(-2 - t);
      for (int i = 0; i < kCalls; ++i) {
        if (fh_forward_check(&p) != FH_ERROR_INVALID_ARGUMENT ||
            std::string(fh_last_error()).rfind(expected, 0) != 0)
          ++mismatches[size_t(t)];
        fh::ForwardParams ok = dense_forward();
        if (fh_forward_check(&ok) != FH_SUCCESS || std::string(fh_last_error()) != "") ++mismatches[size_t(t)];
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (int t = 0; t < kThreads; ++t) EXPECT_EQ(mismatches[size_t(t)], 0) << "thread " << t;
}

}  // namespace

// ---- The split-KV count of num_splits = 0 (plan/split_plan.hpp) ------------------------------

TEST(SplitPlan, NoSplitWhenTheTilesFillTheGpu) {
  EXPECT_EQ(fh::detail::choose_num_splits(/*tiles=*/132, /*key_blocks=*/800, /*num_sms=*/132, 0.0), 1);
  EXPECT_EQ(fh::detail::choose_num_splits(106, 800, 132, 0.0), 1);  // 106 * 5 >= 132 * 4
  EXPECT_EQ(fh::detail::choose_num_splits(0, 800, 132, 0.0), 1);
}

TEST(SplitPlan, NoSplitOfShortKeys) {
  // GQA 32/8 decode at 1k keys (7 blocks of 160): one tile's fixed costs are the time, so one split.
  for (int64_t batch : {1, 2, 4}) EXPECT_EQ(fh::detail::choose_num_splits(8 * batch, 7, 132, 0.0), 1) << batch;
  // 2k keys (13 blocks): still one split; 4k (26 blocks): at most three.
  EXPECT_EQ(fh::detail::choose_num_splits(8, 13, 132, 0.0), 1);
  const int at_4k = fh::detail::choose_num_splits(8, 26, 132, 0.0);
  EXPECT_GT(at_4k, 1);
  EXPECT_LE(at_4k, 3);
}

TEST(SplitPlan, DecodeSplitsWithinItsBounds) {
  // Decoding, GQA 32/8 packed: 8 tiles a sequence; key blocks of 160 keys.
  for (int64_t batch : {1, 2, 4, 8}) {
    for (int64_t keys : {4096, 16384, 131072}) {
      const int64_t tiles = 8 * batch, key_blocks = (keys + 159) / 160;
      const int splits = fh::detail::choose_num_splits(tiles, key_blocks, 132, /*partial_fraction=*/0.0);
      SCOPED_TRACE("batch " + std::to_string(batch) + ", keys " + std::to_string(keys));
      EXPECT_GT(splits, 1);               // 8 to 64 tiles leave most of 132 SMs idle
      EXPECT_LE(splits, key_blocks / fh::detail::kFewestKeyBlocksPerSplit);  // each split long enough to pay
      // Its waves use the SMs within 85% as well as any other count allowed does.
      auto efficiency = [&](int64_t n) {
        const double waves = double(tiles * n) / 132;
        return waves / std::ceil(waves);
      };
      const int64_t most = std::min<int64_t>(key_blocks / fh::detail::kFewestKeyBlocksPerSplit, 128);
      for (int64_t other = 1; other <= most; ++other)
        EXPECT_GE(efficiency(splits), 0.85 * efficiency(other)) << other << " splits";
    }
  }
}

TEST(SplitPlan, SplitsPayForTheirPartials) {
  // The estimated time of a count: K/V plus its partials written and read, over the SMs' busy share.
  auto time = [](int64_t tiles, int64_t splits, double fraction) {
    const double waves = double(tiles * splits) / 132;
    return (1 + 2 * splits * fraction) * std::ceil(waves) / waves;
  };
  // Absorbed MLA, 128 query heads on one KV head packed into one tile a sequence: one split's
  // float32 partials (128 x 257) against a sequence's K and V (d 64 + dv 256, bf16).
  for (int64_t batch : {8, 32, 64}) {
    for (int64_t keys : {4096, 16384, 65536}) {
      const double fraction = (128.0 * 257 * 4) / (double(keys) * 320 * 2);
      const int64_t key_blocks = (keys + 63) / 64;
      const int splits = fh::detail::choose_num_splits(batch, key_blocks, 132, fraction);
      SCOPED_TRACE("batch " + std::to_string(batch) + ", keys " + std::to_string(keys));
      EXPECT_GT(splits, 1);                                          // 8 to 64 tiles leave SMs idle
      EXPECT_LT(time(batch, splits, fraction), time(batch, 1, fraction));  // and splitting pays
      EXPECT_LE(splits * fraction, 0.5);                             // partials within half the K/V
      const int64_t most = std::min<int64_t>(key_blocks / fh::detail::kFewestKeyBlocksPerSplit, 128);
      for (int64_t other = 1; other <= most; ++other)
        if (other * fraction <= 0.5) EXPECT_LE(0.85 * time(batch, splits, fraction), time(batch, other, fraction));
    }
  }
  // Partials as large as the keys and values: no split pays.
  EXPECT_EQ(fh::detail::choose_num_splits(8, 1000, 132, 1.0), 1);
  EXPECT_EQ(fh::detail::choose_num_splits(8, 1000, 132, 0.6), 1);
  // GQA 32/8, hdim 128, 16k keys: the partials are small, so the count is about the SMs' alone.
  for (int64_t batch : {1, 8}) {
    const double fraction = (32.0 * 129 * 4) / (16384.0 * 8 * 256 * 2);
    const int with = fh::detail::choose_num_splits(8 * batch, 16384 / 160, 132, fraction);
    const int without = fh::detail::choose_num_splits(8 * batch, 16384 / 160, 132, 0.0);
    EXPECT_GT(with, 1);
    EXPECT_LE(std::abs(with - without), 2) << with << " against " << without;
  }
}

namespace {

// FlashAttention's window convention in the parameter structs' terms, the one rule that the
// Python package and the PyTorch ops call (fh_window_from_fa3): a bound covering the sequence is
// none, causal forces the right bound to 0, the window (-1, 0) is causal.
TEST(WindowFromFa3, FlashAttentionsConvention) {
  struct Row {
    int32_t causal;
    int64_t left, right, seqlen_q, seqlen_k;
    int32_t want_causal;
    int64_t want_left, want_right;
  };
  const Row rows[] = {
      {0, -1, -1, 64, 96, 0, -1, -1},
      {1, -1, -1, 64, 96, 1, -1, -1},
      {0, -1, 0, 64, 96, 1, -1, -1},     // the window (-1, 0) is causal
      {0, 95, 0, 64, 96, 1, -1, -1},     // left covers every key: no bound
      {0, 94, 0, 64, 96, 0, 94, 0},
      {0, -1, 63, 64, 96, 0, -1, -1},    // right covers every row
      {1, 16, 16, 64, 96, 0, 16, 0},     // causal forces right = 0 and leaves a window
      {1, 200, 5, 64, 96, 1, -1, -1},
      {1, -1, -1, 1, 96, 1, -1, -1},     // a single row stays causal
      {0, 0, 0, 1, 1, 0, -1, -1},        // one row, one key: both bounds cover it
      {0, -5, 3, 64, 96, 0, -5, 3},      // below -1 passes through, for the checks to refuse
      {0, int64_t{1} << 40, -1, 64, 96, 0, -1, -1},
  };
  for (const Row& r : rows) {
    int32_t causal = -7;
    int64_t left = -7, right = -7;
    fh_window_from_fa3(r.causal, r.left, r.right, r.seqlen_q, r.seqlen_k, &causal, &left, &right);
    EXPECT_EQ(causal, r.want_causal) << r.causal << " (" << r.left << ", " << r.right << ")";
    EXPECT_EQ(left, r.want_left) << r.causal << " (" << r.left << ", " << r.right << ")";
    EXPECT_EQ(right, r.want_right) << r.causal << " (" << r.left << ", " << r.right << ")";
  }
  fh_window_from_fa3(1, -1, -1, 8, 8, nullptr, nullptr, nullptr);  // no outputs: nothing written, no crash
}

}  // namespace
