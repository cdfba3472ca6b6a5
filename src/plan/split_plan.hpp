// How many splits of the keys a forward with num_splits = 0 runs (split-KV), from the shapes alone
// (never the lengths in device memory), so that a CUDA graph captured with it stays valid. Host
// only (no CUDA), so that the CPU tests can check its rules.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace flashhopper::detail {

// Split the keys when the query tiles leave most SMs idle (decoding: a few query rows against long
// keys). A split count's estimated time: the bytes it moves, K and V once plus each split's
// float32 partials written and read back by the combine, over the share of the SMs its waves of
// tiles keep busy (one tile an SM reads at about the whole GPU's rate per SM: absorbed MLA,
// 2026-12-06, batch 128 at 0.86 of copy, batch 32 at 0.26). partial_fraction: one split's partials
// (O and LSE, float32) over the K and V bytes; small for GQA, about 5% for absorbed MLA at 4k
// keys (128 query heads' 256-wide partials on one 320-wide KV head). The fewest splits whose time
// is within 1/0.85 of the best count's, each split at least kFewestKeyBlocksPerSplit key blocks,
// the partials at most half the K and V bytes.
//
// Each split at least 8 key blocks: below that, a tile's time is its fixed costs (prologue, first
// loads, the combine's launch), which splitting does not shorten. GQA 32/8 decode at 1k keys ran
// 0.81-0.87 of one split's speed with 2-16 splits (H100, 2026-12-06, bench/RESULTS.md).
inline constexpr int64_t kFewestKeyBlocksPerSplit = 8;

inline int choose_num_splits(int64_t tiles, int64_t key_blocks, int num_sms, double partial_fraction) {
  if (tiles <= 0 || num_sms <= 0 || tiles * 5 >= int64_t(num_sms) * 4) return 1;
  int64_t most = std::min<int64_t>({key_blocks / kFewestKeyBlocksPerSplit, 128, 2 * int64_t(num_sms)});
  if (partial_fraction > 0) most = std::min<int64_t>(most, std::max<int64_t>(1, int64_t(0.5 / partial_fraction)));
  auto time = [&](int64_t splits) {
    const double waves = double(tiles * splits) / num_sms;
    return (1 + 2 * splits * partial_fraction) * std::ceil(waves) / waves;
  };
  double best = time(1);
  for (int64_t splits = 2; splits <= most; ++splits) best = std::min(best, time(splits));
  for (int64_t splits = 1; splits <= most; ++splits)
    if (0.85 * time(splits) <= best) return int(splits);
  return 1;
}

}  // namespace flashhopper::detail
