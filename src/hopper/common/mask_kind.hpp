// The mask kinds the kernels are compiled for (a template parameter; what a kind leaves open, the
// window bounds, sink tokens and chunk size, is a run-time value). No CUDA include: the host-side
// dispatch names them too.
#pragma once

namespace flashhopper::hopper {

enum class MaskKind : int {
  kNone = 0,    // keys past the sequence only
  kCausal = 1,  // j <= i + seqlen_k - seqlen_q
  kLocal = 2,   // a window (either bound may be open), sink tokens, chunks
};

// sm_90's shared memory a block may take (227 KiB of the 228).
inline constexpr int kSmemLimitBytes = 227 * 1024;

}  // namespace flashhopper::hopper
