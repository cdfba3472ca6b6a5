// One compiled kernel family: a row of the manifest (scripts/kernel_manifest.py, generated into
// launch/kernel_manifest.hpp). Plain types: the host API reads the table too.
#pragma once

#include "flashhopper/flashhopper.h"

namespace flashhopper::launch {

enum class Pass { kForward, kBackward };

struct KernelFamily {
  Pass pass;
  fh_dtype dtype;
  int head_dim;
  int head_dim_v;
  int first_set;  // index into kKernelSets of the smallest set that compiles it
  bool qv;        // forward: runs the calls with qv (S = Q K^T + Qv V^T), and only those
};

}  // namespace flashhopper::launch
