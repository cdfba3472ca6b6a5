// Which family a call runs on and whether this build compiled it. A call of head dims (d, dv)
// runs on the family of its pass and dtype with head dim >= d and value head dim >= dv that pads
// least (the smallest d + dv: the GEMMs' depth and width per key; on a tie the smaller head dim):
// the kernels zero-fill the columns past d on load and never write them. A call with qv runs on
// the families marked qv alone, one without on the others.
// FLASHHOPPER_KERNEL_SET (cmake/kernels.cmake) is the index of the set this build compiled.
#pragma once

#include <cstdint>
#include <string>

#include "launch/kernel_manifest.hpp"

namespace flashhopper::launch {

#ifdef FLASHHOPPER_KERNEL_SET
inline constexpr int kBuiltKernelSet = FLASHHOPPER_KERNEL_SET;
#else
inline constexpr int kBuiltKernelSet = -1;  // no kernels (a build without CUDA)
#endif

constexpr bool built(const KernelFamily& f) { return f.first_set <= kBuiltKernelSet; }

// Null when no family of the manifest holds (d, dv) (with qv: no qv family).
constexpr const KernelFamily* family_for(Pass pass, fh_dtype dtype, int64_t head_dim, int64_t head_dim_v,
                                         bool qv = false) {
  const KernelFamily* best = nullptr;
  for (const KernelFamily& f : kKernelFamilies) {
    if (f.pass != pass || f.dtype != dtype || f.qv != qv || f.head_dim < head_dim || f.head_dim_v < head_dim_v)
      continue;
    const int64_t work = f.head_dim + f.head_dim_v;
    const int64_t best_work = best == nullptr ? 0 : best->head_dim + best->head_dim_v;
    if (best == nullptr || work < best_work || (work == best_work && f.head_dim < best->head_dim)) best = &f;
  }
  return best;
}

// Whether the forward family of these compiled sizes is a qv one (a (d, dv) is one manifest row).
constexpr bool forward_family_takes_qv(fh_dtype dtype, int head_dim, int head_dim_v) {
  for (const KernelFamily& f : kKernelFamilies)
    if (f.pass == Pass::kForward && f.dtype == dtype && f.head_dim == head_dim && f.head_dim_v == head_dim_v)
      return f.qv;
  return false;
}

// "bf16", "fp16" or "fp8_e4m3": a kernel dtype as messages name it.
constexpr const char* dtype_label(fh_dtype dtype) {
  return dtype == FH_DTYPE_BF16 ? "bf16" : dtype == FH_DTYPE_FP16 ? "fp16" : "fp8_e4m3";
}

// "forward bf16 hdim 128", "backward fp16 hdim 192, dv 128" or "forward bf16 hdim 64, dv 256, qv".
inline std::string family_name(const KernelFamily& f) {
  std::string name = std::string(f.pass == Pass::kForward ? "forward " : "backward ") + dtype_label(f.dtype) +
                     " hdim " + std::to_string(f.head_dim);
  if (f.head_dim_v != f.head_dim) name += ", dv " + std::to_string(f.head_dim_v);
  if (f.qv) name += ", qv";
  return name;
}

// Empty when this build runs (d, dv) (with qv or not), else a sentence saying why not.
inline std::string family_unsupported_reason(Pass pass, fh_dtype dtype, int64_t head_dim, int64_t head_dim_v,
                                             bool qv = false) {
  const std::string dims = "head dim " + std::to_string(head_dim) +
                           (head_dim_v != head_dim ? " with value head dim " + std::to_string(head_dim_v) : "") +
                           (qv ? " and qv" : "");
  if (dtype != FH_DTYPE_BF16 && dtype != FH_DTYPE_FP16 && dtype != FH_DTYPE_FP8_E4M3)
    return "only bf16, fp16 and fp8_e4m3 kernels exist";
  const KernelFamily* f = family_for(pass, dtype, head_dim, head_dim_v, qv);
  if (f == nullptr) {
    std::string known;
    for (const KernelFamily& k : kKernelFamilies)
      if (k.pass == pass && k.dtype == dtype && k.qv == qv)
        known += (known.empty() ? "" : ", ") + std::to_string(k.head_dim) + "/" + std::to_string(k.head_dim_v);
    const std::string dtype_name = dtype == FH_DTYPE_FP8_E4M3 ? " for fp8_e4m3" : "";
    if (known.empty()) return dims + ": no kernel family" + (qv ? " with qv" : "") + dtype_name + " exists";
    return dims + ": no kernel family" + (qv ? " with qv" : "") + dtype_name +
           " holds it (head dim / value head dim: " + known + ")";
  }
  if (!built(*f)) {
    const std::string set = kBuiltKernelSet < 0 ? "none" : kKernelSets[kBuiltKernelSet];
    return dims + " runs on the " + family_name(*f) + " kernels, which this build (kernel set '" + set +
           "') did not compile; configure with -DFLASHHOPPER_KERNELS=" + kKernelSets[f->first_set];
  }
  return {};
}

}  // namespace flashhopper::launch
