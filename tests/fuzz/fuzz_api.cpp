// A seeded random driver over the C ABI's checks and the CPU reference (build it with
// -DFLASHHOPPER_FUZZ=ON, which also turns on AddressSanitizer and UBSan). Each iteration takes a
// valid call (dense, packed, paged with an append, backward, combine) over a host arena, mutates a
// few fields (extents, strides, dtypes, ranks, pointers, scalars, the int32 lengths and pages) to
// ordinary, boundary or hostile values, and asks:
//   - the checks (fh_*_check): a success, or a refusal whose message is non-empty and is what
//     fh_last_error says;
//   - the CPU reference, where the mutated tensors still lie inside the arena (else the caller
//     would be lying about its memory): no crash, no sanitizer report, and a refusal that leaves
//     every output as it was.
// Usage: fuzz_api [--seed N] [--iterations N] [--seconds S]. Exit code 0: no finding.
// Built with -DFLASHHOPPER_LIBFUZZER (target fuzz_api_libfuzzer, clang only), the same iteration is
// libFuzzer's entry point: the input's bytes make the choices, so coverage guides them, and a
// finding aborts (libFuzzer then saves the input).
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "flashhopper/flashhopper.h"
#include "flashhopper/flashhopper.hpp"
#include "reference/reference.hpp"

namespace {

namespace fh = flashhopper;
using Wide = __int128;

// Where the driver's choices come from: a seeded generator (the random driver) or a libFuzzer
// input, one byte a choice and 0 past its end (small choices, rng() % n, are most of them). Both
// are uniform random bit generators to the code below.
class Choices {
 public:
  using result_type = uint64_t;
  explicit Choices(uint64_t seed) : generator_(seed) {}
  Choices(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  static constexpr result_type min() { return 0; }
  static constexpr result_type max() { return std::numeric_limits<result_type>::max(); }
  result_type operator()() {
    if (data_ == nullptr) return generator_();
    return next_ < size_ ? data_[next_++] : 0;
  }

 private:
  std::mt19937_64 generator_;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0, next_ = 0;
};

constexpr size_t kArenaDoubles = 1 << 17;  // 1 MiB of float inputs and outputs
constexpr size_t kArenaInts = 1 << 12;     // the int32 lengths and page tables

struct Arena {
  std::vector<double> floats = std::vector<double>(kArenaDoubles);
  std::vector<int32_t> ints = std::vector<int32_t>(kArenaInts);
  size_t next_float = 0, next_int = 0;

  void reset(std::mt19937_64& values) {  // the input values: not choices (they decide nothing)
    std::normal_distribution<double> normal;
    for (double& x : floats) x = normal(values);
    next_float = next_int = 0;
  }
  fh::Tensor floats_of(std::initializer_list<int64_t> shape) {
    int64_t count = 1;
    for (int64_t e : shape) count *= e;
    fh::Tensor t = fh::make_tensor(floats.data() + next_float, FH_DTYPE_FP64, shape);
    next_float += size_t(count);
    return t;
  }
  fh::Tensor ints_of(const std::vector<int32_t>& values) {
    std::copy(values.begin(), values.end(), ints.begin() + long(next_int));
    fh::Tensor t = fh::make_tensor(ints.data() + next_int, FH_DTYPE_INT32, {int64_t(values.size())});
    next_int += values.size();
    return t;
  }
  fh::Tensor ints_2d(const std::vector<int32_t>& values, int64_t rows, int64_t cols) {
    std::copy(values.begin(), values.end(), ints.begin() + long(next_int));
    fh::Tensor t = fh::make_tensor(ints.data() + next_int, FH_DTYPE_INT32, {rows, cols});
    next_int += values.size();
    return t;
  }
  // Whether the memory `t` describes lies inside the arena (extents and strides non-negative).
  bool holds(const fh::Tensor& t) const {
    if (t.data == nullptr) return true;
    if (t.ndim < 0 || t.ndim > FH_MAX_DIMS) return true;  // refused before any access
    Wide end = 1;
    for (int d = 0; d < t.ndim; ++d) {
      if (t.shape[d] < 0 || t.stride[d] < 0) return true;  // refused before any access
      if (t.shape[d] == 0) return true;                     // nothing to read
      end += Wide(t.shape[d] - 1) * t.stride[d];
      if (end > (Wide(1) << 40)) return false;
    }
    const auto begin = reinterpret_cast<uintptr_t>(t.data);
    const size_t bytes = t.dtype == FH_DTYPE_FP64 ? 8 : t.dtype == FH_DTYPE_FP32 || t.dtype == FH_DTYPE_INT32 ? 4 : 2;
    auto inside = [&](const void* base, size_t size) {
      const auto lo = reinterpret_cast<uintptr_t>(base);
      return begin >= lo && Wide(begin - lo) + end * Wide(bytes) <= Wide(size);
    };
    return inside(floats.data(), floats.size() * sizeof(double)) || inside(ints.data(), ints.size() * sizeof(int32_t));
  }
};

// A value from one of the classes that break code: ordinary, boundary, hostile.
int64_t pick_extent(Choices& rng, int64_t ordinary) {
  static const int64_t hostile[] = {0,  -1, 1, 2, 7, 8, 63, 64, 65, 256, 257, int64_t(1) << 31, int64_t(1) << 32,
                                    std::numeric_limits<int64_t>::max(), std::numeric_limits<int64_t>::min()};
  switch (rng() % 4) {
    case 0: return hostile[rng() % (sizeof(hostile) / sizeof(hostile[0]))];
    case 1: {  // near the current value (which an earlier mutation may have made extreme)
      int64_t near = 0;
      return __builtin_add_overflow(ordinary, int64_t(rng() % 5) - 2, &near) ? ordinary : near;
    }
    default: return ordinary;
  }
}

void mutate_tensor(Choices& rng, fh::Tensor& t) {
  switch (rng() % 7) {
    case 0: t.shape[rng() % FH_MAX_DIMS] = pick_extent(rng, t.shape[0]); break;
    case 1: {  // near the last dim's stride (ndim itself may be mutated past FH_MAX_DIMS)
      const int last = std::min(FH_MAX_DIMS - 1, std::max(0, t.ndim - 1));
      t.stride[rng() % FH_MAX_DIMS] = pick_extent(rng, t.stride[last]);
      break;
    }
    case 2: t.dtype = int32_t(rng() % 8) - 1; break;
    case 3: t.ndim = int32_t(rng() % 8) - 1; break;
    case 4:  // absent, or misaligned (an absent tensor stays absent: no offset from a null pointer)
      t.data = rng() % 2 || t.data == nullptr ? nullptr : static_cast<char*>(t.data) + 1 + rng() % 8;
      break;
    case 5: t = fh::Tensor{}; break;
    default: break;
  }
}

void mutate_ints(Choices& rng, const fh::Tensor& t) {
  if (t.data == nullptr || t.dtype != FH_DTYPE_INT32 || t.ndim < 1 || t.shape[0] < 1 || t.shape[0] > 64) return;
  if (reinterpret_cast<uintptr_t>(t.data) % alignof(int32_t) != 0) return;  // a mutated pointer: not ours to write
  static const int32_t hostile[] = {-1, 0, 1, 7, 1000, std::numeric_limits<int32_t>::max(),
                                    std::numeric_limits<int32_t>::min()};
  auto* values = static_cast<int32_t*>(t.data);
  values[rng() % uint64_t(t.shape[0])] = hostile[rng() % (sizeof(hostile) / sizeof(hostile[0]))];
}

void mutate_scalars(Choices& rng, int32_t* ints[], size_t n_ints, float* floats[], size_t n_floats) {
  static const int32_t hostile_ints[] = {-2, -1, 0, 1, 2, 7, 64, std::numeric_limits<int32_t>::max(),
                                         std::numeric_limits<int32_t>::min()};
  static const float hostile_floats[] = {0.f, -1.f, 1e-30f, 1e30f, std::numeric_limits<float>::infinity(),
                                         std::numeric_limits<float>::quiet_NaN(), 0.125f};
  if (rng() % 2) {
    *ints[rng() % n_ints] = hostile_ints[rng() % (sizeof(hostile_ints) / sizeof(hostile_ints[0]))];
  } else {
    *floats[rng() % n_floats] = hostile_floats[rng() % (sizeof(hostile_floats) / sizeof(hostile_floats[0]))];
  }
}

struct Findings {
  long count = 0;
  void report(const char* what, long iteration, const std::string& detail) {
    if (count++ < 20) std::printf("FINDING at iteration %ld: %s (%s)\n", iteration, what, detail.c_str());
  }
};

void expect_answer(fh_status code, Findings& findings, long iteration, const char* call) {
  const std::string message = fh_last_error();
  if (code != FH_SUCCESS && message.empty()) findings.report("a refusal without a message", iteration, call);
  if (code < FH_SUCCESS || code > FH_ERROR_WORKSPACE) findings.report("an unknown status code", iteration, call);
}

std::vector<char> snapshot(const Arena& arena);

// The reference's answer: a refusal carries a message and leaves the arena as it was.
void expect_reference_answer(const fh::Status& status, const std::vector<char>& before, const Arena& arena,
                             Findings& findings, long iteration, const char* call) {
  if (status.ok()) return;
  if (status.message.empty()) findings.report("reference refusal without a message", iteration, call);
  if (snapshot(arena) != before)
    findings.report("reference wrote although it refused", iteration, std::string(call) + ": " + status.message);
}

std::vector<char> snapshot(const Arena& arena) {
  std::vector<char> bytes(arena.floats.size() * sizeof(double));
  std::memcpy(bytes.data(), arena.floats.data(), bytes.size());
  return bytes;
}

// The valid calls the mutations start from. Inputs come first in the arena, outputs after them.
enum class Kind { kDense, kVarlen, kPagedAppend, kBackward, kCombine };

// One mutated call over `arena`, whose values the caller has set.
void run_one(Choices& rng, Arena& arena, Findings& findings, long iteration) {
  const Kind kind = Kind(rng() % 5);
  const int64_t batch = 2, sq = 5, sk = 9, hq = 4, hkv = 2, d = 8;
  fh::reference::Options options;
  options.num_threads = 2;
  if (kind == Kind::kCombine) {
    fh::CombineParams c{};
    fh_combine_params_init(&c);
    c.out_partial = arena.floats_of({3, batch, hq, sq, d});
    c.lse_partial = arena.floats_of({3, batch, hq, sq});
    c.out = arena.floats_of({batch, sq, hq, d});
    c.lse = arena.floats_of({batch, hq, sq});
    fh::Tensor* tensors[] = {&c.out_partial, &c.lse_partial, &c.out, &c.lse};
    for (int m = 0, n = 1 + int(rng() % 3); m < n; ++m) mutate_tensor(rng, *tensors[rng() % 4]);
    expect_answer(fh_combine_check(&c), findings, iteration, "fh_combine_check");
    for (const fh::Tensor* t : tensors)
      if (!arena.holds(*t)) return;
    const std::vector<char> before = snapshot(arena);
    expect_reference_answer(fh::reference::combine(c, options), before, arena, findings, iteration, "combine");
    return;
  }
  fh::ForwardParams f = fh::default_forward_params();
  const bool varlen = kind == Kind::kVarlen, paged = kind == Kind::kPagedAppend;
  const int64_t page_size = 4, pages = 8, max_pages = 4, s_new = 2;
  if (varlen) {
    f.q = arena.floats_of({batch * sq, hq, d});
    f.cu_seqlens_q = arena.ints_of({0, int32_t(sq - 2), int32_t(batch * sq)});
    if (rng() % 3 == 0) {  // the keys paged (page_table with cu_seqlens_k: only its differences count)
      f.k = arena.floats_of({pages, page_size, hkv, d});
      f.v = arena.floats_of({pages, page_size, hkv, d});
      f.page_table = arena.ints_2d({3, 1, 2, 0, 4, 5, 6, 7}, batch, max_pages);
      f.cu_seqlens_k = arena.ints_of({5, int32_t(5 + sk), int32_t(5 + batch * sk)});
    } else {
      f.k = arena.floats_of({batch * sk, hkv, d});
      f.v = arena.floats_of({batch * sk, hkv, d});
      f.cu_seqlens_k = arena.ints_of({0, int32_t(sk), int32_t(batch * sk)});
    }
    f.seqused_k = arena.ints_of({int32_t(sk - 1), int32_t(sk)});
    f.max_seqlen_q = int32_t(sq + 2);
    f.max_seqlen_k = int32_t(sk);
  } else {
    f.q = arena.floats_of({batch, sq, hq, d});
    if (paged) {
      f.k = arena.floats_of({pages, page_size, hkv, d});
      f.v = arena.floats_of({pages, page_size, hkv, d});
      f.page_table = arena.ints_2d({0, 1, 2, 3, 4, 5, 6, 7}, batch, max_pages);
      f.cache_seqlens = arena.ints_of({3, 10});
      f.k_new = arena.floats_of({batch, s_new, hkv, d});
      f.v_new = arena.floats_of({batch, s_new, hkv, d});
      if (rng() % 2) {  // the table's rows by cache_batch_idx, left padding
        f.cache_batch_idx = arena.ints_of({1, 0});
        f.cache_leftpad = arena.ints_of({1, 0});
      }
    } else {
      f.k = arena.floats_of({batch, sk, hkv, d});
      f.v = arena.floats_of({batch, sk, hkv, d});
      if (rng() % 2) {  // a dense cache: rows by cache_batch_idx, left padding, an append with rotary
        f.cache_seqlens = arena.ints_of({3, 6});
        f.cache_batch_idx = arena.ints_of({1, 0});
        f.cache_leftpad = arena.ints_of({1, 0});
        if (rng() % 3 == 0) {  // the new keys packed: 2 and 1 of them
          f.k_new = arena.floats_of({3, hkv, d});
          f.v_new = arena.floats_of({3, hkv, d});
          f.cu_seqlens_k_new = arena.ints_of({0, 2, 3});
        } else {
          f.k_new = arena.floats_of({batch, s_new, hkv, d});
          f.v_new = arena.floats_of({batch, s_new, hkv, d});
        }
        f.rotary_cos = arena.floats_of({sk + 8, d / 4});
        f.rotary_sin = arena.floats_of({sk + 8, d / 4});
        f.rotary_seqlens = arena.ints_of({0, 2});
        f.rotary_interleaved = int32_t(rng() % 2);
      }
    }
  }
  f.causal = int32_t(rng() % 2);
  const fh::Tensor dout = varlen ? arena.floats_of({batch * sq, hq, d}) : arena.floats_of({batch, sq, hq, d});
  f.out = varlen ? arena.floats_of({batch * sq, hq, d}) : arena.floats_of({batch, sq, hq, d});
  f.lse = varlen ? arena.floats_of({hq, batch * sq}) : arena.floats_of({batch, hq, sq});
  if (kind != Kind::kBackward && rng() % 3 == 0)  // the scores' extra operand, shaped like out
    f.qv = varlen ? arena.floats_of({batch * sq, hq, d}) : arena.floats_of({batch, sq, hq, d});

  if (kind == Kind::kBackward) {
    fh::BackwardParams b = fh::default_backward_params();
    b.q = f.q, b.k = f.k, b.v = f.v, b.out = f.out, b.lse = f.lse, b.dout = dout;
    b.dq = arena.floats_of({batch, sq, hq, d});
    b.dk = arena.floats_of({batch, sk, hkv, d});
    b.dv = arena.floats_of({batch, sk, hkv, d});
    b.causal = f.causal;
    fh::Tensor* tensors[] = {&b.q, &b.k, &b.v, &b.out, &b.dout, &b.lse, &b.dq, &b.dk, &b.dv};
    int32_t* ints[] = {&b.causal, &b.window_left, &b.window_right, &b.num_sink_tokens, &b.deterministic,
                       &b.attention_chunk, &b.sm_margin};
    float* floats[] = {&b.softmax_scale, &b.softcap};
    for (int m = 0, n = 1 + int(rng() % 3); m < n; ++m) {
      if (rng() % 3) mutate_tensor(rng, *tensors[rng() % 9]);
      else mutate_scalars(rng, ints, 7, floats, 2);
    }
    expect_answer(fh_backward_check(&b), findings, iteration, "fh_backward_check");
    for (const fh::Tensor* t : tensors)
      if (!arena.holds(*t)) return;
    const std::vector<char> before = snapshot(arena);
    expect_reference_answer(fh::reference::backward(b, options), before, arena, findings, iteration, "backward");
    return;
  }
  fh::Tensor* tensors[] = {&f.q, &f.k, &f.v, &f.out, &f.lse, &f.cu_seqlens_q, &f.cu_seqlens_k, &f.seqused_k,
                           &f.page_table, &f.cache_seqlens, &f.k_new, &f.v_new, &f.qv, &f.cache_batch_idx,
                           &f.cache_leftpad, &f.rotary_cos, &f.rotary_sin, &f.rotary_seqlens, &f.cu_seqlens_k_new};
  const int int_tensors[] = {5, 6, 7, 8, 9, 13, 14, 17, 18};  // the int32 metadata among them
  int32_t* ints[] = {&f.causal, &f.window_left, &f.window_right, &f.num_sink_tokens, &f.attention_chunk,
                     &f.num_splits, &f.max_seqlen_q, &f.max_seqlen_k, &f.rotary_interleaved, &f.sm_margin};
  float* floats[] = {&f.softmax_scale, &f.softcap};
  for (int m = 0, n = 1 + int(rng() % 3); m < n; ++m) {
    const uint64_t what = rng() % 4;
    if (what == 0) mutate_scalars(rng, ints, 10, floats, 2);
    else if (what == 1) mutate_ints(rng, *tensors[int_tensors[rng() % 9]]);
    else mutate_tensor(rng, *tensors[rng() % 19]);
  }
  expect_answer(fh_forward_check(&f), findings, iteration, "fh_forward_check");
  if (f.num_splits > 1) return;  // the reference then writes partials it is given: not driven here
  for (const fh::Tensor* t : tensors)
    if (!arena.holds(*t)) return;
  // A refused call writes nothing: not the outputs, and not the cache an append would write.
  const std::vector<char> before = snapshot(arena);
  expect_reference_answer(fh::reference::forward(f, options), before, arena, findings, iteration, "forward");
}

}  // namespace

#ifdef FLASHHOPPER_LIBFUZZER
extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static Arena arena;
  static const std::vector<double> values = [] {  // the same input values every time: only choices vary
    std::mt19937_64 generator(1);
    arena.reset(generator);
    return arena.floats;
  }();
  arena.floats = values;
  arena.next_float = arena.next_int = 0;
  Findings findings;
  Choices choices(data, size);
  run_one(choices, arena, findings, 0);
  if (findings.count > 0) std::abort();
  return 0;
}
#else
int main(int argc, char** argv) {
  uint64_t seed = 1;
  long iterations = 20000;
  double seconds = 0;  // 0: no time limit
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--seed") seed = std::strtoull(argv[i + 1], nullptr, 10);
    else if (flag == "--iterations") iterations = std::strtol(argv[i + 1], nullptr, 10);
    else if (flag == "--seconds") seconds = std::strtod(argv[i + 1], nullptr);
    else {
      std::fprintf(stderr, "usage: fuzz_api [--seed N] [--iterations N] [--seconds S]\n");
      return 2;
    }
  }
  Choices choices(seed);
  std::mt19937_64 values(seed);
  Arena arena;
  Findings findings;
  const auto start = std::chrono::steady_clock::now();
  long done = 0;
  for (; done < iterations; ++done) {
    if (seconds > 0 && std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() > seconds) break;
    arena.reset(values);
    run_one(choices, arena, findings, done);
  }
  std::printf("fuzz_api: seed %llu, %ld iterations, %ld findings\n", static_cast<unsigned long long>(seed), done,
              findings.count);
  return findings.count == 0 ? 0 : 1;
}
#endif
