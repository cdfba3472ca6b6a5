// The masks: the keys each query row of a sequence sees (docs/masks.md).
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>

#include "plan/problem_shape.hpp"

namespace flashhopper::reference::detail {

using flashhopper::detail::MaskSpec;

struct KeyRange {
  int64_t begin = 0;
  int64_t end = 0;  // exclusive; begin == end: empty
};

// The keys a query row sees, as two disjoint ascending ranges: the sink tokens not already in
// the window, then the window (each cut to the row's chunk with attention_chunk).
using VisibleKeys = std::array<KeyRange, 2>;

// The mask of docs/masks.md for one sequence, aligned at the bottom-right, restricted to the keys
// [key_begin, key_end) (a split's share; all keys otherwise).
class RowMask {
 public:
  RowMask(const MaskSpec& spec, int64_t rows, int64_t keys, int64_t key_begin, int64_t key_end)
      : spec_(spec), rows_(rows), keys_(keys), key_begin_(key_begin), key_end_(key_end) {}

  VisibleKeys visible(int64_t i) const {
    const int64_t diagonal = i + keys_ - rows_;  // the key row i is aligned with
    const int64_t last =
        spec_.window_right < 0 ? keys_ - 1 : std::min(keys_ - 1, diagonal + spec_.window_right);
    const int64_t first =
        spec_.window_left < 0 ? 0 : std::max<int64_t>(0, diagonal - spec_.window_left);
    const int64_t sink_end = std::min({int64_t(spec_.num_sink_tokens), last + 1, first});
    KeyRange sinks{0, sink_end}, window{first, last + 1};
    if (spec_.attention_chunk > 0) {
      // The chunk [floor(p / c) * c, + c) holds the diagonal; floor division, so that a row with
      // p < 0 gets a chunk of keys before the first one and sees nothing. Sinks are cut too.
      const int64_t c = spec_.attention_chunk;
      const int64_t chunk = diagonal >= 0 ? diagonal / c : -((-diagonal + c - 1) / c);
      sinks = intersect(sinks, chunk * c, chunk * c + c);
      window = intersect(window, chunk * c, chunk * c + c);
    }
    return {intersect(sinks, key_begin_, key_end_), intersect(window, key_begin_, key_end_)};
  }

 private:
  // r cut to [lo, hi); an empty result has begin == end.
  static KeyRange intersect(KeyRange r, int64_t lo, int64_t hi) {
    r.begin = std::max(r.begin, lo);
    r.end = std::max(r.begin, std::min(r.end, hi));
    return r;
  }

  MaskSpec spec_;
  int64_t rows_, keys_, key_begin_, key_end_;
};

}  // namespace flashhopper::reference::detail
