// The kernels' tunables per head dim, in one table.
// Forward: shared memory holds Q, kStages K tiles and kStages V tiles,
// ((kBlockM + kStages * kBlockN) * d + kStages * kBlockN * dv) * 2 bytes, plus O's kBlockM * dv * 2
// where that still fits 227 KiB; otherwise O is stored from registers
// (ForwardKernel::kOStagedInSmem). Registers: each consumer warpgroup owns 64 rows, so O takes
// dv/2 and S kBlockN/2 floats a thread.
#pragma once

#include <type_traits>

namespace flashhopper::hopper {

// Per (head dim, value head dim), the families of scripts/kernel_manifest.py. kMasked: causal or
// local (blocks cross a mask boundary; narrower key blocks waste less there).
template <int kHeadDim, int kHeadDimV, bool kMasked>
struct ForwardTileSize;

// hdim 64: three consumer warpgroups (192 rows) amortise each K/V tile over more rows.
template <bool kMasked>
struct ForwardTileSize<64, 64, kMasked> {
  static constexpr int kBlockM = 192;
  static constexpr int kBlockN = 128;  // 192 spills: S, P and O exceed 160 registers
  static constexpr int kStages = 2;
};

// hdim 64 with dv 256 and qv (absorbed MLA, forward only): O is 128 registers a thread as at
// hdim 256, S 32 with 64 key columns. Q, Qv (64 KiB), three K and three V stages: 200 KiB, O from
// registers. A V stage is held from Qv V^T to the next block's P V, so a third one lets the next
// block's V load meanwhile. Not tuned yet.
template <bool kMasked>
struct ForwardTileSize<64, 256, kMasked> {
  static constexpr int kBlockM = 128;
  static constexpr int kBlockN = 64;
  static constexpr int kStages = 3;
};

// hdim 64 with dv 512 and qv (absorbed MLA at DeepSeek's latent width, forward only): O's 512
// columns are split over two warpgroups of the same 64 rows (ForwardMainloop::kSplitsO), each
// holding 128 floats of O; the halves of S meet in a 32 KiB exchange buffer. Q, Qv (64 KiB), three
// K and three V stages of 32 keys (108 KiB) and the exchange: 212 KiB, O from registers. Not tuned
// yet.
template <bool kMasked>
struct ForwardTileSize<64, 512, kMasked> {
  static constexpr int kBlockM = 64;
  static constexpr int kBlockN = 32;
  static constexpr int kStages = 3;
};

// hdim 512 (forward): O split over two warpgroups as at 64/512, each also taking half of Q K^T's
// contraction. Q (64 KiB), two K and two V stages of 32 keys (128 KiB) and the exchange (32 KiB):
// 224 KiB, O from registers. 64 rows of Q a K/V byte are half hdim 256's, yet sharing each K/V
// block between two CTAs (kClusterM = 2, TMA multicast) ran 1-3% slower than one CTA alone
// (A/B in one call on an H100, bench/RESULTS.md 2026-12-07): the L2 does not bound it.
template <bool kMasked>
struct ForwardTileSize<512, 512, kMasked> {
  static constexpr int kClusterM = 1;
  static constexpr int kBlockM = 64;
  static constexpr int kBlockN = 32;  // 512/512 forward
  // 64 keys (the next A/B: WGMMAs twice as wide; 32-50 local ops in the loop) fit one K and one V
  // stage (Q, K, V 192 KiB and the exchange 32 KiB).
  static constexpr int kStages = kBlockN == 32 ? 2 : 1;
};

// hdim 128: unmasked takes 160 key columns (2 stages and O staged in shared memory, 224 KiB), the
// fastest of 128-176; masked keeps 128 (192 KiB), so the blocks at a boundary waste less.
// (Measurements: bench/RESULTS.md, "Tile and schedule choices".)
template <bool kMasked>
struct ForwardTileSize<128, 128, kMasked> {
  static constexpr int kClusterM = 1;  // 128 forward: K/V multicast to CTA pairs (2) not yet timed
  static constexpr int kBlockM = 128;
  static constexpr int kBlockN = kMasked ? 128 : 160;
  static constexpr int kStages = 2;
};

// hdim 96: as hdim 128 (160 key columns unmasked, O staged: 168 KiB; 128 masked). Not tuned yet.
template <bool kMasked>
struct ForwardTileSize<96, 96, kMasked> {
  static constexpr int kBlockM = 128;
  static constexpr int kBlockN = kMasked ? 128 : 160;
  static constexpr int kStages = 2;
};

// hdim 192: 112 key columns, two stages: 216 KiB, O from registers; with dv 128 (MLA prefill)
// 188 KiB, and staging O fits (220 KiB). Not tuned yet.
template <int kHeadDimV, bool kMasked>
struct ForwardTileSize<192, kHeadDimV, kMasked> {
  static_assert(kHeadDimV == 128 || kHeadDimV == 192);
  static constexpr int kBlockM = 128;
  static constexpr int kBlockN = 112;
  static constexpr int kStages = 2;
};

// hdim 256: O alone is 128 registers a thread; 80 key columns keep S small and fit 224 KiB
// (O from registers).
template <bool kMasked>
struct ForwardTileSize<256, 256, kMasked> {
  static constexpr int kClusterM = 1;  // 256 forward: K/V multicast to CTA pairs (2) not yet timed
  static constexpr int kBlockM = 128;
  static constexpr int kBlockN = 80;
  static constexpr int kStages = 2;
};

// fp8 (e4m3) forward, per head dim: two consumer warpgroups (a third at head dim 64, as bf16's,
// builds since the V transpose needs few registers: bench/ab_fp8_tiles.sh's M64), key blocks in
// whole 32-key MMA slices. Shared memory counts V twice, staged as loaded and transposed:
// (kBlockM * d + kStages * kBlockN * (d + 2 dv)) bytes, O's bf16 kBlockM * dv * 2 beside it where
// that fits. Chosen to fit, not tuned yet.
// kConsumerRegisters: the MMA warpgroups' registers a thread; the producer keeps the rest of the
// launch's 3 x 168 (56 here, which its TMA issue and V transpose take without spilling). Wider key
// blocks need 240 (their S and P beside O), which leaves the producer 24: its TMA issue then spills
// to the stack, outside the consumers' loop.
template <int kHeadDim, int kHeadDimV, bool kMasked>
struct ForwardTileSizeFp8 {
  static_assert(kHeadDim == kHeadDimV && (kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 256));
  static constexpr int kBlockM = 128;  // fp8: two consumer warpgroups
  static constexpr int kBlockN = kHeadDim == 256 ? 64 : 128;  // 256: 128 K + 64 Q = 192 KiB
  static constexpr int kStages = 2;
  static constexpr int kConsumerRegisters = 224;
};

// The CTAs of a cluster that share each K/V block by TMA multicast, where the tile says (kClusterM),
// else 1. Dense 16-bit kernels, unmasked or causal, only (ForwardKernelOf): a pair can walk the
// same key blocks.
template <class Tile, class = void>
inline constexpr int kForwardClusterM = 1;
template <class Tile>
inline constexpr int kForwardClusterM<Tile, std::void_t<decltype(Tile::kClusterM)>> = Tile::kClusterM;

// The consumers' registers a thread where the tile says (kConsumerRegisters), else 0: the kernel's
// rule (ForwardKernel).
template <class Tile, class = void>
inline constexpr int kForwardConsumerRegisters = 0;
template <class Tile>
inline constexpr int kForwardConsumerRegisters<Tile, std::void_t<decltype(Tile::kConsumerRegisters)>> =
    Tile::kConsumerRegisters;

// The forward's tile of a family: fp8's table or the 16-bit one.
template <bool kFp8, int kHeadDim, int kHeadDimV, bool kMasked>
using ForwardTile = std::conditional_t<kFp8, ForwardTileSizeFp8<kHeadDim, kHeadDimV, kMasked>,
                                       ForwardTileSize<kHeadDim, kHeadDimV, kMasked>>;

// The backward's tunables per head dim. A CTA owns kBlockN keys (K, V and the dK, dV
// accumulators stay put) and walks the query blocks of kBlockM rows; two MMA warpgroups split S
// and dP by key columns, dK/dV by key rows (when kBlockN / 2 < 64, the WGMMA's minimum M, they
// compute dK^T and dV^T and split those by head dim) and dQ by head dim. Shared memory: K, V;
// kStages Q tiles and kStagesDo dO tiles, each with its kBlockM floats of LSE or D; dS twice (so
// one warpgroup may write block m + 1 while the other still reads block m) and P once, or twice
// when dK and dV are computed transposed (BackwardMainloop::kPBuffers); and the float32 dQ tile
// once, which the TMA bulk reduce-add adds to global memory. kDqKernel: dQ is computed by the dQ
// kernel instead (BackwardDqTileSize) and takes no shared memory here.
// Registers a thread: S and dP kBlockM * kBlockN / 256 floats each, dK and dV kBlockN * d / 256
// each, dQ kBlockM * d / 256.
template <int kHeadDim>
struct BackwardTileSize;

// hdim 64: 128-row query blocks halve the per-block costs (the barrier between the warpgroups, the
// fences after the P, dS and dQ stores, the dQ hand-off) of GEMMs only 64 deep. 226 KiB with P
// once: 2 Q and dO stages, one dQ buffer. 64-row blocks transposed (as hdim 128) ran 2-11% faster
// but 11-20% slower deterministic, twice the dQ turns (bench/RESULTS.md, 2026-12-07 evening).
template <>
struct BackwardTileSize<64> {
  static constexpr int kBlockM = 128;
  static constexpr int kBlockN = 128;
  static constexpr int kStages = 2;
  static constexpr int kStagesDo = 2;
  static constexpr bool kDqKernel = false;
};

// hdim 128: S and dP transposed (BackwardMainloop::kSdPTransposed), so P and dS feed dV and dK from
// registers and only dS is stored, for dQ: 193 KiB. A third Q stage did not pay (0.97-1.03 of two,
// bench/RESULTS.md).
template <>
struct BackwardTileSize<128> {
  static constexpr int kBlockM = 64;
  static constexpr int kBlockN = 128;
  static constexpr int kStages = 2;
  static constexpr int kStagesDo = 2;
  static constexpr bool kDqKernel = false;
  static constexpr bool kSdPTransposed = true;
};

// hdim 96: as hdim 128 (the same 64 x 128 block pair, dQ in this kernel), about 170 KiB. Its dQ GEMM's
// warpgroups take 48 head-dim columns each, so K and V sit in 32-byte swizzle atoms
// (BackwardMainloop::kKAtomCols). Not tuned yet; untransposed until measured (transposed, it
// compiles without local traffic in its loops: bench/RESULTS.md, 2026-12-07 noon).
template <>
struct BackwardTileSize<96> : BackwardTileSize<128> {
  static constexpr bool kSdPTransposed = false;
};

// hdim 192: as hdim 256 (the dQ kernel; 64 keys). Three 64-row atoms of d do not split in two,
// so the warpgroups split dK^T and dV^T by key columns (BackwardMainloop::kDkvSplitByKeys); the
// main kernel's dQ would split d in halves of 96 as well. 169 KiB. The 192/128 family (MLA
// prefill) takes the same tiles, its V and dO a third smaller. Not tuned yet.
template <>
struct BackwardTileSize<192> {
  static constexpr int kBlockM = 64;
  static constexpr int kBlockN = 64;
  static constexpr int kStages = 2;
  static constexpr int kStagesDo = 2;
  static constexpr bool kDqKernel = true;
};

// hdim 256: dQ by the dQ kernel. Added from here, its 64 KiB a block pair bound the kernel at the
// L2; the dQ kernel recomputes S and dP instead (7 GEMMs a block pair, not 5) and needs no adds
// and no turns in deterministic mode. (At hdim 64 and 128 the same split is slower.) 224 KiB: the
// freed dQ buffer holds a second dO stage.
template <>
struct BackwardTileSize<256> {
  static constexpr int kBlockM = 64;
  static constexpr int kBlockN = 64;
  static constexpr int kStages = 2;
  static constexpr int kStagesDo = 2;
  static constexpr bool kDqKernel = true;
};

// hdim 512: dQ by the dQ kernel. dK^T and dV^T of 32 keys are 128 floats a thread (64 keys would
// be 256); K and V (64 KiB), one Q and one dO stage (128 KiB), P and dS twice (16 KiB): 208 KiB.
// One stage each: the next query block's Q and dO load only once this one's dK and dV GEMMs are
// done. 0.48-0.51 of hdim 256's TFLOP/s (bench/RESULTS.md, 2026-12-06). kSdPByOperand (S in one
// warpgroup, dP in the other, each 32 keys wide; P's exchange adds 8 KiB) is the next A/B.
template <>
struct BackwardTileSize<512> {
  static constexpr int kBlockM = 64;
  static constexpr int kBlockN = 32;
  static constexpr int kStages = 1;
  static constexpr int kStagesDo = 1;
  static constexpr bool kDqKernel = true;
  static constexpr bool kSdPByOperand = false;
};

// Whether a backward tile has warpgroup 0 compute S and warpgroup 1 dP, each whole
// (BackwardMainloop::kSdPByOperand): the tiles that say so; the others split both by key columns.
template <class Tile, class = void>
inline constexpr bool kSdPByOperand = false;
template <class Tile>
inline constexpr bool kSdPByOperand<Tile, std::void_t<decltype(Tile::kSdPByOperand)>> = Tile::kSdPByOperand;

// Whether a backward tile computes S^T and dP^T, keys as the WGMMA's rows
// (BackwardMainloop::kSdPTransposed): the tiles that say so.
template <class Tile, class = void>
inline constexpr bool kSdPTransposed = false;
template <class Tile>
inline constexpr bool kSdPTransposed<Tile, std::void_t<decltype(Tile::kSdPTransposed)>> = Tile::kSdPTransposed;

// The dQ kernel's tunables (head dims whose BackwardTileSize has kDqKernel): a CTA owns kBlockM
// query rows (64 a warpgroup, or 64 shared by both: BackwardDqMainloop::kSharesRows) and streams K
// and V blocks of kBlockN keys through kStagesK and kStagesV buffers. Shared memory:
// (2 * kBlockM + (kStagesK + kStagesV) * kBlockN) * d * 2 bytes.
// Registers a thread: dQ kBlockM * d / 256 floats, S and dP kBlockM * kBlockN / 256 each.
template <int kHeadDim>
struct BackwardDqTileSize;

// hdim 192: as hdim 256, 168 KiB. Not tuned yet.
template <>
struct BackwardDqTileSize<192> {
  static constexpr int kBlockM = 128;
  static constexpr int kBlockN = 64;
  static constexpr int kStagesK = 2;
  static constexpr int kStagesV = 1;
};

// hdim 256: 224 KiB. V has one stage: only dP reads it, early in a block (faster than 48 keys
// with two K and two V stages).
template <>
struct BackwardDqTileSize<256> {
  static constexpr int kBlockM = 128;
  static constexpr int kBlockN = 64;
  static constexpr int kStagesK = 2;
  static constexpr int kStagesV = 1;
};

// hdim 512: 64 rows shared by the two warpgroups, each computing dQ for 256 columns (128 floats a
// thread) and all of S and dP for itself. Q and dO (128 KiB), two K stages and one V stage of 32
// keys (96 KiB): 224 KiB. Chosen to fit, not tuned yet. kSdPByOperand (S in one warpgroup, dP in
// the other; the exchange's 8 KiB leave room for one K stage) is the next A/B.
template <>
struct BackwardDqTileSize<512> {
  static constexpr bool kSdPByOperand = false;  // the dQ kernel's; true: one K stage
  static constexpr int kBlockM = 64;
  static constexpr int kBlockN = 32;
  static constexpr int kStagesK = kSdPByOperand ? 1 : 2;
  static constexpr int kStagesV = 1;
};

}  // namespace flashhopper::hopper
