// Concurrent calls on the GPU (CTest label "gpu"): several host threads, each on its own stream,
// and one thread with work in flight on several streams, each call with its own outputs and
// workspace, give bit for bit what the same calls give one after another (flashhopper.h, "Threads").
// The threaded test runs first, while the library's per-process caches (device attributes, the
// kernels' shared-memory opt-in, the known device allocations) are still cold, so their first
// fills race. Backward runs are deterministic, so results can be compared bit for bit.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "attention_run.hpp"
#include "flashhopper/flashhopper.h"
#include "flashhopper/flashhopper.hpp"
#include "gpu_test_util.hpp"
#include "test_util.hpp"

namespace flashhopper::test {
namespace {

constexpr int kThreads = 8, kRounds = 3;

// A mix of the compiled forward families (both passes) and masks, small enough to run many.
std::vector<Problem> problems() {
  std::vector<GridCase> cases;
  for (const auto& [dtype, head_dim] : compiled_families(/*backward=*/true)) {
    cases.push_back({dtype, head_dim, false, 2, 300, 257, 4, 2, false});
    cases.push_back({dtype, head_dim, true, 1, 1000, 513, 4, 1, false});
    cases.push_back({dtype, head_dim, false, 1, 400, 700, 4, 2, false, {64, 0, 0, 0, 5.f}});
    cases.push_back({dtype, head_dim, true, 2, 300, 300, 4, 2, false, {-1, -1, 0, 0, 0.f, true}});
  }
  std::vector<Problem> out;
  for (size_t i = 0; i < cases.size() && out.size() < 2 * kThreads; ++i) out.push_back(Problem::random(cases[i], 40 + i));
  return out;
}

void expect_same(const Results& want, const Results& got, const std::string& where) {
  EXPECT_TRUE(bit_identical(want.out.view(), got.out.view())) << where << ": out";
  EXPECT_TRUE(bit_identical(want.lse.view(), got.lse.view())) << where << ": lse";
  EXPECT_TRUE(bit_identical(want.dq.view(), got.dq.view())) << where << ": dq";
  EXPECT_TRUE(bit_identical(want.dk.view(), got.dk.view())) << where << ": dk";
  EXPECT_TRUE(bit_identical(want.dv.view(), got.dv.view())) << where << ": dv";
  EXPECT_TRUE(bit_identical(want.dsink.view(), got.dsink.view())) << where << ": dsink";
}

// The problems one after another on the default stream.
std::vector<Results> serial(const std::vector<Problem>& ps) {
  std::vector<Results> out(ps.size());
  for (size_t i = 0; i < ps.size(); ++i) {
    Status status;
    EXPECT_EQ(run_and_wait(ps[i], true, &out[i], &status), "");
    EXPECT_TRUE(status.ok()) << status.message;
  }
  return out;
}

TEST(Concurrency, ThreadsWithTheirOwnStreamsMatchSerialCalls) {
  const std::vector<Problem> ps = problems();
  ASSERT_FALSE(ps.empty()) << "no family with both passes in this build";
  // Thread t runs problems t, t + kThreads, ... kRounds times; all start together.
  std::vector<std::vector<Results>> got(kThreads);
  std::vector<std::string> failures(kThreads);
  std::atomic<int> ready{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t] {
      cudaStream_t stream = nullptr;
      std::string& failure = failures[t];
      if (!(failure = cuda_failure("stream", cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking))).empty()) {
        ready.fetch_add(1);
        return;
      }
      std::vector<AttentionRun> runs(ps.size());
      for (size_t i = t; i < ps.size() && failure.empty(); i += kThreads) failure = runs[i].prepare(ps[i], true);
      ready.fetch_add(1);
      while (ready.load() < kThreads) std::this_thread::yield();
      for (int round = 0; round < kRounds && failure.empty(); ++round)
        for (size_t i = t; i < ps.size() && failure.empty(); i += kThreads) {
          Status status;
          failure = runs[i].enqueue(stream, &status);
          if (failure.empty() && !status.ok()) failure = status.message;
          if (failure.empty()) failure = cuda_failure("synchronize", cudaStreamSynchronize(stream));
          if (failure.empty()) got[t].push_back(runs[i].results());
        }
      cudaStreamDestroy(stream);
    });
  for (std::thread& th : threads) th.join();
  for (int t = 0; t < kThreads; ++t) ASSERT_EQ(failures[t], "") << "thread " << t;

  const std::vector<Results> want = serial(ps);
  for (int t = 0; t < kThreads; ++t) {
    size_t n = 0;
    for (int round = 0; round < kRounds; ++round)
      for (size_t i = t; i < ps.size(); i += kThreads)
        expect_same(want[i], got[t][n++], "thread " + std::to_string(t) + ", round " + std::to_string(round) +
                                              ", problem " + ps[i].c.name());
  }
}

TEST(Concurrency, WorkInFlightOnSeveralStreamsMatchesSerialCalls) {
  const std::vector<Problem> ps = problems();
  ASSERT_FALSE(ps.empty()) << "no family with both passes in this build";
  constexpr int kStreams = 4;
  cudaStream_t streams[kStreams];
  for (cudaStream_t& s : streams) CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  std::vector<AttentionRun> runs(ps.size());
  for (size_t i = 0; i < ps.size(); ++i) ASSERT_EQ(runs[i].prepare(ps[i], true), "");
  // Everything enqueued before anything is waited for.
  for (size_t i = 0; i < ps.size(); ++i) {
    Status status;
    ASSERT_EQ(runs[i].enqueue(streams[i % kStreams], &status), "");
    ASSERT_TRUE(status.ok()) << status.message;
  }
  for (cudaStream_t s : streams) CUDA_CHECK(cudaStreamSynchronize(s));
  const std::vector<Results> want = serial(ps);
  for (size_t i = 0; i < ps.size(); ++i) expect_same(want[i], runs[i].results(), "problem " + ps[i].c.name());
  for (cudaStream_t s : streams) CUDA_CHECK(cudaStreamDestroy(s));
}

// Threads that interleave refused calls with kernel launches read their own last error.
TEST(Concurrency, LastErrorStaysWithItsThread) {
  const std::vector<Problem> ps = problems();
  ASSERT_FALSE(ps.empty()) << "no family with both passes in this build";
  std::vector<std::string> failures(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t] {
      AttentionRun run;
      std::string& failure = failures[t];
      failure = run.prepare(ps[t % ps.size()], false);
      for (int i = 0; i < 50 && failure.empty(); ++i) {
        // Thread t's refused call names its own value; the real calls between succeed.
        fh_forward_params bad = run.forward_params();
        bad.window_left = -2 - t;
        const std::string expected = "window_left: is " + std::to_string(-2 - t);
        if (fh_forward(&bad, nullptr, 0, nullptr) != FH_ERROR_INVALID_ARGUMENT) failure = "window_left was accepted";
        if (failure.empty() && std::string(fh_last_error()).rfind(expected, 0) != 0)
          failure = std::string("another thread's message? ") + fh_last_error();
        Status status;
        if (failure.empty()) failure = run.enqueue(nullptr, &status);
        if (failure.empty() && !status.ok()) failure = status.message;
        // The C++ calls above leave the C ABI's message alone; a successful C ABI call clears it.
        const fh_forward_params good = run.forward_params();
        if (failure.empty() && fh_forward_check(&good) != FH_SUCCESS) failure = fh_last_error();
        if (failure.empty() && std::string(fh_last_error()) != "")
          failure = std::string("a success left a message: ") + fh_last_error();
      }
      if (failure.empty()) failure = cuda_failure("synchronize", cudaDeviceSynchronize());
    });
  for (std::thread& th : threads) th.join();
  for (int t = 0; t < kThreads; ++t) EXPECT_EQ(failures[t], "") << "thread " << t;
}

}  // namespace
}  // namespace flashhopper::test

int main(int argc, char** argv) { return flashhopper::test::gpu_test_main(argc, argv); }
