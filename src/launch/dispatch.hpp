// The switch from a call's family (compiled_families.hpp: family_for) to a compiled
// instantiation, shared by both passes. visit_built_family hands `f` the family's dtype, head dim
// and value head dim as integral_constant tags; with_variant adds the mask kind and softcap (the
// variants of scripts/kernel_manifest.py); visit_instantiation is both at once, what a pass's
// run_* calls. Only the families this build compiled are visited. with_forward_features picks the
// forward's feature set (the manifest's FORWARD_FEATURE_SETS).
#pragma once

#include <cstddef>
#include <type_traits>
#include <utility>

#include "plan/problem_shape.hpp"
#include "hopper/common/mask_kind.hpp"
#include "launch/compiled_families.hpp"

namespace flashhopper::launch {

template <class Params>
hopper::MaskKind mask_kind(const Params& p) {
  const detail::MaskSpec m = detail::mask_spec(p);
  if (m.is_causal()) return hopper::MaskKind::kCausal;
  return m.is_local() ? hopper::MaskKind::kLocal : hopper::MaskKind::kNone;
}

namespace dispatch_detail {

template <Pass kPass, size_t kIndex, class R, class F>
bool visit_if(const KernelFamily* family, F& f, R* result) {
  constexpr KernelFamily kFamily = kKernelFamilies[kIndex];
  if constexpr (kFamily.pass == kPass && built(kFamily)) {
    if (family == &kKernelFamilies[kIndex]) {
      *result = f(std::integral_constant<fh_dtype, kFamily.dtype>{}, std::integral_constant<int, kFamily.head_dim>{},
                  std::integral_constant<int, kFamily.head_dim_v>{});
      return true;
    }
  }
  return false;
}

template <Pass kPass, class R, class F, size_t... kIndex>
R visit(std::index_sequence<kIndex...>, const KernelFamily* family, R otherwise, F& f) {
  R result = otherwise;
  (visit_if<kPass, kIndex>(family, f, &result) || ...);
  return result;
}

}  // namespace dispatch_detail

// f(dtype, head_dim, head_dim_v) for `family` (a row of kKernelFamilies) when this build compiled
// it for kPass; else `otherwise`.
template <Pass kPass, class R, class F>
R visit_built_family(const KernelFamily* family, R otherwise, F&& f) {
  return dispatch_detail::visit<kPass>(std::make_index_sequence<std::size(kKernelFamilies)>{}, family, otherwise, f);
}

// f(mask, softcap) with both as integral_constant tags.
template <class F>
auto with_variant(hopper::MaskKind mask, bool softcap, F&& f) {
  auto with_softcap = [&](auto mask_tag) {
    return softcap ? f(mask_tag, std::true_type{}) : f(mask_tag, std::false_type{});
  };
  using hopper::MaskKind;
  switch (mask) {
    case MaskKind::kCausal:
      return with_softcap(std::integral_constant<MaskKind, MaskKind::kCausal>{});
    case MaskKind::kLocal:
      return with_softcap(std::integral_constant<MaskKind, MaskKind::kLocal>{});
    default:
      return with_softcap(std::integral_constant<MaskKind, MaskKind::kNone>{});
  }
}

namespace dispatch_detail {
// Set kIndex, if a family of that qv-ness compiled it (a qv family only the sets with kQv, the
// others only those without) and it holds `needed`.
template <bool kQvFamily, size_t kIndex, class R, class F>
bool try_feature_set(hopper::ForwardFeatures needed, F& f, R* result) {
  constexpr hopper::ForwardFeatures kSet = kForwardFeatureSets[kIndex];
  if constexpr (hopper::holds(kSet, hopper::ForwardFeatures::kQv) == kQvFamily) {
    if (hopper::holds(kSet, needed)) {
      *result = f(std::integral_constant<hopper::ForwardFeatures, kSet>{});
      return true;
    }
  }
  return false;
}

template <bool kQvFamily, size_t... kIndex, class R, class F>
R with_feature_set(std::index_sequence<kIndex...>, hopper::ForwardFeatures needed, R otherwise, F& f) {
  R result = otherwise;
  (try_feature_set<kQvFamily, kIndex>(needed, f, &result) || ...);
  return result;
}
}  // namespace dispatch_detail

// f(features) with the first forward feature set that a family of this qv-ness compiled and that
// holds `needed`, as a tag; `otherwise` when none does.
template <bool kQvFamily, class R, class F>
R with_forward_features(hopper::ForwardFeatures needed, R otherwise, F&& f) {
  return dispatch_detail::with_feature_set<kQvFamily>(std::make_index_sequence<std::size(kForwardFeatureSets)>{},
                                                      needed, otherwise, f);
}

// run(dtype, head_dim, head_dim_v, mask, softcap), all as tags, for `family`'s instantiation of
// that mask kind and softcap; cudaErrorInvalidValue when this build did not compile the family.
template <Pass kPass, class Run>
cudaError_t visit_instantiation(const KernelFamily* family, hopper::MaskKind mask, bool softcap, Run&& run) {
  return visit_built_family<kPass>(family, cudaErrorInvalidValue, [&](auto dtype, auto head_dim, auto head_dim_v) {
    return with_variant(mask, softcap, [&](auto mask_tag, auto softcap_tag) {
      return run(dtype, head_dim, head_dim_v, mask_tag, softcap_tag);
    });
  });
}

}  // namespace flashhopper::launch
