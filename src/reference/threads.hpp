// Work items on a few plain threads, handed out in increasing order.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <thread>
#include <vector>

#include "reference/reference.hpp"

namespace flashhopper::reference::detail {

inline int thread_count(const Options& options) {
  if (options.num_threads > 0) return options.num_threads;
  return std::max(1u, std::thread::hardware_concurrency());
}

// Calls work(i) for every i in [0, count) on up to `num_threads` threads. Items are handed out
// in increasing order, which the backward's ordered dK/dV sums rely on.
template <class Work>
void parallel_for(int64_t count, int num_threads, const Work& work) {
  const int64_t threads = std::min<int64_t>(num_threads, count);
  if (threads <= 1) {
    for (int64_t i = 0; i < count; ++i) work(i);
    return;
  }
  std::atomic<int64_t> next{0};
  auto worker = [&] {
    for (int64_t i = next.fetch_add(1); i < count; i = next.fetch_add(1)) work(i);
  };
  std::vector<std::thread> pool;
  for (int64_t t = 1; t < threads; ++t) pool.emplace_back(worker);
  worker();
  for (std::thread& thread : pool) thread.join();
}

}  // namespace flashhopper::reference::detail
