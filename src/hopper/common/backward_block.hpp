// What a backward CTA works on, the one per-tile object its mainloop and epilogue share.
#pragma once

#include "hopper/common/seqlen.hpp"

namespace flashhopper::hopper {

// What a (key block, key head, sequence) CTA works on: it owns one key head's K and V and
// walks every query head of its group (GQA), so dK and dV sum the group in registers.
struct BackwardBlock {
  int n_block;
  int head_kv;
  SeqlenInfo seq;
  int m_block_min;
  int m_block_max;
};

}  // namespace flashhopper::hopper
