// Every host-side rule a call must satisfy, in one place, each failure naming the argument and
// the rule. Pure argument checks: no device access, nothing launched.
#pragma once

#include "flashhopper/flashhopper.hpp"

namespace flashhopper::detail {

// kKernel: the rules of the GPU kernels (device dtypes, TMA alignment).
// kHostReference: the CPU reference, which also accepts fp32/fp64 tensors and any alignment.
enum class Target { kKernel, kHostReference };

// The call with the arguments that have no effect in it cleared, as FA3 ignores them: rotary_seqlens
// without rotary tables (engines pass it on every step). validate() and the forward see this.
ForwardParams without_ignored_arguments(const ForwardParams& params);

Status validate(const ForwardParams& params, Target target);
Status validate(const BackwardParams& params, Target target);
Status validate(const CombineParams& params, Target target);

}  // namespace flashhopper::detail
