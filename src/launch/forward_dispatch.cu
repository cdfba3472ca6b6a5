// Forward dispatch: what this build can run, and the switch to the compiled instantiation.
#include "launch/compiled_families.hpp"
#include "launch/dispatch.hpp"
#include "launch/forward_launch.hpp"
#include "launch/launch.hpp"
#include "launch/varlen_plan.hpp"
#include "hopper/common/tile_size.hpp"

namespace flashhopper::launch {

const char* forward_unsupported_reason(const ForwardParams& p, const detail::ProblemShape& s) {
  const detail::MaskSpec mask = detail::mask_spec(p);
  if (const char* reason = varlen_batch_reason(s)) return reason;
  if (s.paged || s.append_kv) return "the paged KV cache and k_new/v_new are not supported yet";
  if (p.q.dtype == FH_DTYPE_FP8_E4M3) return "fp8 e4m3 inputs are not supported yet";
  if (mask.num_sink_tokens > 0 && mask.attention_chunk > 0)
    return "num_sink_tokens together with attention_chunk is not supported by the kernels";
  if (p.num_splits > 1) return "split-KV (num_splits > 1) is not supported yet";
  if (s.head_dim != s.head_dim_v) return "head_dim_v different from head_dim is not supported yet";
  return compiled_family_reason(static_cast<fh_dtype>(p.q.dtype), s.head_dim);
}

// Packed queries: the planned tile list (launch/varlen_plan.hpp).
size_t forward_workspace_size(const ForwardParams&, const detail::ProblemShape& s) {
  if (!s.varlen_q) return 0;
  const int block_m = s.head_dim == 64 ? hopper::ForwardTileSize<64, false>::kBlockM
                                       : hopper::ForwardTileSize<128, false>::kBlockM;
  static_assert(hopper::ForwardTileSize<128, false>::kBlockM == hopper::ForwardTileSize<256, false>::kBlockM);
  return planned_tiles_bytes(max_planned_tiles(s.total_q, s.seqlen_q, s.batch, s.heads_q, block_m));
}

int run_forward(const ForwardParams& params, const detail::ProblemShape& shape, void* workspace,
                fh_stream_t stream) {
  return dispatch_family(params.q.dtype, shape.head_dim, mask_kind(params), params.softcap > 0.f,
                         [&](auto dtype, auto head_dim, auto mask, auto softcap) {
                           return run_forward_hdim<decltype(dtype)::value, decltype(head_dim)::value,
                                                   decltype(mask)::value, decltype(softcap)::value>(
                               params, shape, workspace, stream);
                         });
}

}  // namespace flashhopper::launch
