// Forward dispatch: what this build can run, the split-KV plan, the workspace's layout and the
// switch to the compiled instantiation.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "plan/packed_decode.hpp"
#include "plan/split_plan.hpp"
#include "hopper/common/tile_size.hpp"
#include "launch/device_info.hpp"
#include "launch/dispatch.hpp"
#include "launch/forward_launch.hpp"
#include "launch/launch.hpp"
#include "launch/varlen_plan.hpp"

namespace flashhopper::launch {

namespace {
const KernelFamily* forward_family(const ForwardParams& p, const detail::ProblemShape& s) {
  return family_for(Pass::kForward, static_cast<fh_dtype>(p.q.dtype), s.head_dim, s.head_dim_v,
                    detail::present(p.qv));
}

// The call's tile (rows, key columns), from its family and mask; 0 x 0 when not built.
struct TileExtent {
  int block_m = 0, block_n = 0;
};
TileExtent forward_tile(const ForwardParams& p, const detail::ProblemShape& s) {
  const bool masked = mask_kind(p) != hopper::MaskKind::kNone;
  const KernelFamily* family = forward_family(p, s);
  return visit_built_family<Pass::kForward>(family, TileExtent{}, [&](auto dtype, auto head_dim, auto head_dim_v) {
    constexpr bool kFp8 = dtype.value == FH_DTYPE_FP8_E4M3;
    using Unmasked = hopper::ForwardTile<kFp8, decltype(head_dim)::value, decltype(head_dim_v)::value, false>;
    using Masked = hopper::ForwardTile<kFp8, decltype(head_dim)::value, decltype(head_dim_v)::value, true>;
    static_assert(Unmasked::kBlockM == Masked::kBlockM);
    return masked ? TileExtent{Masked::kBlockM, Masked::kBlockN} : TileExtent{Unmasked::kBlockM, Unmasked::kBlockN};
  });
}

// The rows of one split's partials, as out holds them (times its heads): [B, Hq, sq] dense,
// [Hq, total_q] packed.
int64_t partial_rows(const detail::ProblemShape& s) {
  return s.heads_q * (s.varlen_q ? s.total_q : s.batch * s.seqlen_q);
}

int forward_num_splits(const ForwardParams& p, const detail::ProblemShape& s) {
  if (p.num_splits != 0) return p.num_splits;
  const TileExtent tile = forward_tile(p, s);
  int num_sms = 0, l2_bytes = 0;
  if (tile.block_m == 0 || usable_sms_and_l2(p.sm_margin, &num_sms, &l2_bytes) != cudaSuccess) return 1;
  // Packed queries: the most tiles the sequences can have (their lengths are in device memory).
  const int64_t tiles = s.varlen_q ? max_planned_tiles(s.total_q, s.seqlen_q, s.batch, s.heads_q, tile.block_m)
                                   : (s.seqlen_q + tile.block_m - 1) / tile.block_m * s.heads_q * s.batch;
  // One split's partials (float32 O and LSE) against the K and V bytes the call reads.
  const double kv_bytes = double(s.batch) * s.seqlen_k * s.heads_kv * (s.head_dim + s.head_dim_v) *
                          dtype_size(static_cast<fh_dtype>(p.k.dtype));
  const double split_bytes = double(partial_rows(s)) * (s.head_dim_v + 1) * sizeof(float);
  return detail::choose_num_splits(tiles, (s.seqlen_k + tile.block_n - 1) / tile.block_n, num_sms,
                                   kv_bytes > 0 ? split_bytes / kv_bytes : 1.0);
}

size_t round_up_256(size_t bytes) { return (bytes + 255) / 256 * 256; }
}  // namespace

std::string forward_unsupported_reason(const ForwardParams& p, const detail::ProblemShape& s) {
  const detail::MaskSpec mask = detail::mask_spec(p);
  if (const char* reason = varlen_batch_reason(s)) return reason;
  if (std::string reason = sm_margin_reason(p.sm_margin); !reason.empty()) return reason;
  // A KV cache runs dense (cache_seqlens, cache_leftpad, cache_batch_idx) or paged with any page
  // size, with the append and rotary (a kernel before the attention). The producer numbers a
  // paged cache's rows (page * page_size + row) in int32.
  if (s.paged && s.num_pages * s.page_size > INT32_MAX)
    return "a paged KV cache of " + std::to_string(s.num_pages) + " pages of " + std::to_string(s.page_size) +
           " tokens: the kernels take at most 2^31 - 1 cached tokens";
  if (mask.num_sink_tokens > 0 && mask.attention_chunk > 0)
    return "num_sink_tokens together with attention_chunk is not supported by the kernels";
  // fp8 appends as stored; rotating e4m3 values through e4m3 tables would lose the angle's precision.
  if (s.append_kv && p.q.dtype == FH_DTYPE_FP8_E4M3 && detail::present(p.rotary_cos))
    return "rotary_cos: fp8_e4m3 inputs take no rotary embedding in the append (rotate before quantising)";
  if (detail::v_column_major(p) && (s.paged || s.append_kv))
    return std::string("v: column-major (keys contiguous) runs without ") +
           (s.paged ? "page_table" : "k_new and v_new") + "; pages and appends take a row-major v";
  return family_unsupported_reason(Pass::kForward, static_cast<fh_dtype>(p.q.dtype), s.head_dim, s.head_dim_v,
                                   detail::present(p.qv));
}

ForwardPlan plan_forward(const ForwardParams& p, const detail::ProblemShape& s) {
  ForwardPlan plan;
  plan.params = &p;
  plan.shape = &s;
  plan.call = detail::kernel_call(p, s);
  const int block_m = forward_tile(p, s).block_m;  // 0: a family this build lacks (refused before)
  plan.num_splits = forward_num_splits(plan.call.params, plan.call.shape);
  if (s.varlen_q && block_m > 0) {  // a tile a split, of the call the kernels run (run_forward_hdim's count)
    const detail::ProblemShape& rows = plan.call.shape;
    plan.planned_tiles = planned_tiles_bytes(
        max_planned_tiles(rows.total_q, rows.seqlen_q, rows.batch, rows.heads_q, block_m) * plan.num_splits);
  }
  plan.rotated_q = rotated_q_bytes(p, s);
  if (plan.num_splits > 1 || plan.call.combine_always) {  // the kernels' rows (packed GQA's padding too)
    const size_t rows = size_t(plan.num_splits) * partial_rows(plan.call.shape);
    plan.out_partial = round_up_256(rows * s.head_dim_v * sizeof(float));
    plan.lse_partial = round_up_256(rows * sizeof(float));
  }
  plan.gathered_q = round_up_256(gathered_q_bytes(plan.call));
  return plan;
}

int run_forward(const ForwardPlan& plan, void* workspace, fh_stream_t stream) {
  const ForwardParams& params = *plan.params;
  const detail::ProblemShape& shape = *plan.shape;
  char* const base = static_cast<char*>(workspace);
  const detail::KernelCall* attention = &plan.call;
  detail::KernelCall rotated;
  if (shape.append_kv) {
    void* q_rotated = base + plan.planned_tiles;
    if (const int err = run_kv_append(params, shape, q_rotated, stream); err != 0) return err;
    if (plan.rotated_q > 0) {  // the attention reads the rotated copy of q
      ForwardParams with_rotated_q = params;
      with_rotated_q.q = rotated_q_view(params, q_rotated);
      rotated = detail::kernel_call(with_rotated_q, shape);
      attention = &rotated;
    }
  }
  detail::KernelCall gathered;
  if (detail::present(attention->gather_source)) {  // q's rows of each KV head into one stride
    void* rows = base + plan.planned_tiles + plan.rotated_q + plan.out_partial + plan.lse_partial;
    if (const int err = run_query_gather(*attention, rows, stream); err != 0) return err;
    gathered = *attention;
    gathered.params.q.data = rows;
    attention = &gathered;
  }
  const detail::KernelCall& call = *attention;
  ForwardWorkspace parts;
  parts.planned_tiles = base;
  parts.num_splits = plan.num_splits;
  if (plan.out_partial > 0) {
    parts.out_partial = reinterpret_cast<float*>(base + plan.planned_tiles + plan.rotated_q);
    parts.lse_partial = reinterpret_cast<float*>(base + plan.planned_tiles + plan.rotated_q + plan.out_partial);
  }
  const hopper::ForwardFeatures features = forward_features(call.params, call.shape, parts.out_partial != nullptr);
  const int err = visit_instantiation<Pass::kForward>(
      forward_family(call.params, call.shape), mask_kind(call.params), call.params.softcap > 0.f,
      [&](auto dtype, auto head_dim, auto head_dim_v, auto mask, auto softcap) {
        constexpr bool kQvFamily = forward_family_takes_qv(dtype.value, head_dim.value, head_dim_v.value);
        return with_forward_features<kQvFamily>(features, cudaErrorInvalidValue, [&](auto feature_set) {
          return run_forward_hdim<dtype.value, head_dim.value, head_dim_v.value, mask.value, softcap.value,
                                  feature_set.value>(call.params, call.shape, parts, stream);
        });
      });
  if (err != 0 || parts.out_partial == nullptr) return err;
  if (call.shape.rows_per_token > 1)  // several query tokens packed: into the call's own out and lse
    return run_split_kv_combine(params, shape, parts.out_partial, parts.lse_partial, parts.num_splits, stream,
                                call.shape.rows_per_token);
  return run_split_kv_combine(call.params, call.shape, parts.out_partial, parts.lse_partial, parts.num_splits,
                              stream);
}

}  // namespace flashhopper::launch
