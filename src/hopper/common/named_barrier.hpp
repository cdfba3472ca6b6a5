// Named barriers of the forward and backward kernels, numbered past CUTLASS's reserved ids
// (user ids 0..7).
#pragma once

#include <cutlass/arch/barrier.h>

namespace flashhopper::hopper {

enum class FwdBarrier : uint32_t {
  kEpilogue = 0,          // all consumer warpgroups: done with sQ before O overwrites it
  kWarpScheduler0 = 1,    // ping-pong turn of consumer warpgroup 0; 1 and 2 follow
  kScoreExchange = 4,     // warpgroups splitting O: both halves of S are in shared memory
};

enum class BwdBarrier : uint32_t {
  kPdS = 0,       // both MMA warpgroups: P and dS of this query block are in shared memory
  kDqEmpty0 = 1,  // TMA path: dQ buffer 0 may be written (MMA warpgroups + dQ writer); 1 follows
  kDqFull0 = 3,   // TMA path: dQ buffer 0 is written; buffer 1 follows
  kDqTurn0 = 5,   // atomicAdd path, deterministic: warpgroup 0 holds the turn; 1 follows
  kPExchange = 7,  // S and dP by operand: warpgroup 0's P is in shared memory for warpgroup 1
};

// The backward's dQ kernel (its own ids: it runs apart from the main kernel).
enum class BwdDqBarrier : uint32_t {
  kPExchange = 0,   // S and dP by operand: warpgroup 0's P is in the exchange buffer
  kDsExchange = 1,  // and warpgroup 1's dS, over it
};

template <class Barrier>
CUTLASS_DEVICE void named_barrier_sync(int num_threads, Barrier barrier, int offset = 0) {
  cutlass::arch::NamedBarrier::sync(num_threads, static_cast<uint32_t>(barrier) + offset);
}

template <class Barrier>
CUTLASS_DEVICE void named_barrier_arrive(int num_threads, Barrier barrier, int offset = 0) {
  cutlass::arch::NamedBarrier::arrive(num_threads, static_cast<uint32_t>(barrier) + offset);
}

}  // namespace flashhopper::hopper
