// CPU reference combine (reference.hpp): the split-KV partials into O and LSE, always exact.
#include "reference/reference.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "api/validate.hpp"
#include "reference/checks.hpp"
#include "reference/sequences.hpp"
#include "reference/tensor_access.hpp"
#include "reference/threads.hpp"

namespace flashhopper::reference {
using namespace detail;  // the internal helpers (reference::detail), unqualified below

// ---- entry point -----------------------------------------------------------------------------

Status combine(const CombineParams& p, const Options& options) {
  // The library's rules first (the one home of every argument rule); the checks below guard what
  // this code dereferences.
  FLASHHOPPER_REFERENCE_CHECK(flashhopper::detail::validate(p, flashhopper::detail::Target::kHostReference));
  for (const auto& [tensor, name] : {std::pair{&p.out_partial, "out_partial"}, {&p.lse_partial, "lse_partial"},
                                     {&p.out, "out"}, {&p.lse, "lse"}}) {
    FLASHHOPPER_REFERENCE_CHECK(check_dereferenceable(*tensor, name));
  }
  // Varlen (out of rank 3, the library's test) partials [S, H, total, dv] are the dense ones
  // [S, B, H, sq, dv] with B = 1 and sq = total: give them a batch dim of extent 1 and read both
  // alike.
  const bool varlen = p.out.ndim == 3;

  auto with_unit_dim = [](Tensor t, int at) {
    if (!present(t)) return t;
    for (int i = t.ndim; i > at; --i) {
      t.shape[i] = t.shape[i - 1];
      t.stride[i] = t.stride[i - 1];
    }
    t.shape[at] = 1;
    t.stride[at] = 0;
    ++t.ndim;
    return t;
  };
  const Tensor out_partial = varlen ? with_unit_dim(p.out_partial, 1) : p.out_partial;
  const Tensor lse_partial = varlen ? with_unit_dim(p.lse_partial, 1) : p.lse_partial;
  const Tensor out = varlen ? with_unit_dim(p.out, 0) : p.out;
  const Tensor lse = varlen ? with_unit_dim(p.lse, 0) : p.lse;

  const int64_t S = out_partial.shape[0], B = out_partial.shape[1], H = out_partial.shape[2];
  const int64_t sq = out_partial.shape[3], dv = out_partial.shape[4];

  const TokenLayout out_layout = TokenLayout::dense(out);
  const RowLayout out_partial_layout{out_partial, {}, true};
  const RowLayout lse_partial_layout{lse_partial, {}, true};
  const RowLayout lse_layout{lse, {}, false};
  parallel_for(B * H, thread_count(options), [&](int64_t item) {
    const int64_t b = item / H, h = item % H;
    std::vector<double> split_lse(S), split_out(dv), o(dv);
    for (int64_t i = 0; i < sq; ++i) {
      double max_lse = -std::numeric_limits<double>::infinity();
      for (int64_t s = 0; s < S; ++s) {
        split_lse[s] = load_element(lse_partial, lse_partial_layout.offset(s, b, h, i));
        max_lse = std::max(max_lse, split_lse[s]);
      }
      std::fill(o.begin(), o.end(), 0.0);
      double row_lse = -std::numeric_limits<double>::infinity();
      if (max_lse > -std::numeric_limits<double>::infinity()) {
        double sum = 0;
        for (int64_t s = 0; s < S; ++s) sum += std::exp(split_lse[s] - max_lse);
        row_lse = max_lse + std::log(sum);
        for (int64_t s = 0; s < S; ++s) {
          const double weight = std::exp(split_lse[s] - row_lse);
          if (weight == 0) continue;  // a split that saw no key: its O_s is not read
          load_strided(out_partial, out_partial_layout.offset(s, b, h, i),
                       out_partial_layout.dim_stride(), dv, split_out.data());
          for (int64_t c = 0; c < dv; ++c) o[c] += weight * split_out[c];
        }
      }
      out_layout.store_row(b, i, h, dv, o.data());
      if (present(lse)) store_element(lse, lse_layout.offset(0, b, h, i), row_lse);
    }
  });
  return {};
}

}  // namespace flashhopper::reference
