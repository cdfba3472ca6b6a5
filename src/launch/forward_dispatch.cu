// Forward dispatch: what this build can run, and the switch to the compiled instantiation.
#include "hopper/common/tile_size.hpp"
#include "launch/dispatch.hpp"
#include "launch/forward_launch.hpp"
#include "launch/launch.hpp"
#include "launch/varlen_plan.hpp"

namespace flashhopper::launch {

namespace {
const KernelFamily* forward_family(const ForwardParams& p, const detail::ProblemShape& s) {
  return family_for(Pass::kForward, static_cast<fh_dtype>(p.q.dtype), s.head_dim, s.head_dim_v);
}
}  // namespace

std::string forward_unsupported_reason(const ForwardParams& p, const detail::ProblemShape& s) {
  const detail::MaskSpec mask = detail::mask_spec(p);
  if (const char* reason = varlen_batch_reason(s)) return reason;
  // A dense KV cache runs (cache_seqlens, cache_leftpad, cache_batch_idx: the sequence lengths),
  // with the append and rotary (a kernel before the attention); a paged one does not yet.
  if (s.paged) return "a paged KV cache (page_table) is not supported by the kernels yet";
  if (detail::present(p.cache_seqlens) && s.varlen_k) return "cache_seqlens with cu_seqlens_k is not supported";
  if (p.q.dtype == FH_DTYPE_FP8_E4M3) return "fp8 e4m3 inputs are not supported yet";
  if (mask.num_sink_tokens > 0 && mask.attention_chunk > 0)
    return "num_sink_tokens together with attention_chunk is not supported by the kernels";
  if (p.num_splits > 1) return "split-KV (num_splits > 1) is not supported yet";
  if (detail::present(p.qv)) return "qv (scores Q K^T + Qv V^T) is not supported by the kernels yet";
  return family_unsupported_reason(Pass::kForward, static_cast<fh_dtype>(p.q.dtype), s.head_dim, s.head_dim_v);
}

namespace {
// Packed queries: the planned tile list (launch/varlen_plan.hpp), at the workspace's start.
size_t planned_tiles_workspace(const ForwardParams& p, const detail::ProblemShape& s) {
  if (!s.varlen_q) return 0;
  return visit_built_family<Pass::kForward>(forward_family(p, s), size_t(0), [&](auto, auto head_dim, auto head_dim_v) {
    using Unmasked = hopper::ForwardTileSize<decltype(head_dim)::value, decltype(head_dim_v)::value, false>;
    using Masked = hopper::ForwardTileSize<decltype(head_dim)::value, decltype(head_dim_v)::value, true>;
    constexpr int kBlockM = Unmasked::kBlockM;
    static_assert(kBlockM == Masked::kBlockM);
    return planned_tiles_bytes(max_planned_tiles(s.total_q, s.seqlen_q, s.batch, s.heads_q, kBlockM));
  });
}
}  // namespace

// The planned tiles, then (an append with rotary) the rotated copy of q.
size_t forward_workspace_size(const ForwardParams& p, const detail::ProblemShape& s) {
  return planned_tiles_workspace(p, s) + rotated_q_bytes(p, s);
}

int run_forward(const ForwardParams& params, const detail::ProblemShape& shape, void* workspace, fh_stream_t stream) {
  ForwardParams attention = params;
  if (shape.append_kv) {
    void* q_rotated = static_cast<char*>(workspace) + planned_tiles_workspace(params, shape);
    if (const int err = run_kv_append(params, shape, q_rotated, stream); err != 0) return err;
    if (rotated_q_bytes(params, shape) > 0) attention.q = rotated_q_view(params, q_rotated);
  }
  return visit_instantiation<Pass::kForward>(
      forward_family(attention, shape), mask_kind(attention), attention.softcap > 0.f,
      [&](auto dtype, auto head_dim, auto head_dim_v, auto mask, auto softcap) {
        return run_forward_hdim<dtype.value, head_dim.value, head_dim_v.value, mask.value, softcap.value>(
            attention, shape, workspace, stream);
      });
}

}  // namespace flashhopper::launch
