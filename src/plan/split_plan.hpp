// How many splits of the keys a forward with num_splits = 0 runs (split-KV), from the shapes alone
// (never the lengths in device memory), so that a CUDA graph captured with it stays valid. Host
// only (no CUDA), so that the CPU tests can check its rules.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace flashhopper::detail {

// The most splits whose float32 partials (O and LSE, `partial_bytes_per_split` a split) stay
// within 1% of the K and V bytes the call reads; at least 1.
inline int64_t most_splits_for_workspace(double kv_bytes, double partial_bytes_per_split) {
  return std::max<int64_t>(1, int64_t(kv_bytes / (100 * partial_bytes_per_split)));
}

// Split the keys when the query tiles leave most SMs idle (decoding: a few query rows against long
// keys): the fewest splits whose waves of tiles use the SMs within 85% as well as the best count
// does, each split at least two key blocks, at most most_splits.
inline int choose_num_splits(int64_t tiles, int64_t key_blocks, int num_sms, int64_t most_splits) {
  if (tiles <= 0 || num_sms <= 0 || tiles * 5 >= int64_t(num_sms) * 4) return 1;
  const int most = int(std::min<int64_t>({key_blocks / 2, 128, 2 * int64_t(num_sms), most_splits}));
  auto efficiency = [&](int splits) {
    const double waves = double(tiles * splits) / num_sms;
    return waves / std::ceil(waves);
  };
  double best = 0;
  for (int splits = 1; splits <= most; ++splits) best = std::max(best, efficiency(splits));
  for (int splits = 1; splits <= most; ++splits)
    if (efficiency(splits) >= 0.85 * best) return splits;
  return 1;
}

}  // namespace flashhopper::detail
