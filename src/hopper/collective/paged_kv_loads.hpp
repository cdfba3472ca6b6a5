// The forward producer's loads from a paged KV cache. K and Vt are viewed per page:
// (page_size, d, heads, pages) and (dv, page_size, heads, pages). Where the pages hold whole
// chunks of 32 keys (else of 16), a stage loads as such chunks, one TMA box each, each from its own
// page. Other page sizes are gathered: the producer warpgroup's threads copy the stage 16 bytes at
// a time (cp.async), each key from its page; so are keys that start mid-page (cache_leftpad), whose
// chunks would straddle pages. Fewer keys a box load slower; the gather slower still
// (bench/RESULTS.md). A sequence's row of the page table is its batch_k (cache_batch_idx picks it)
// and its key i the position offset_k + i (cache_leftpad) of that row. ForwardMainloop compiles
// this in only with ForwardFeatures::kPagedKv. kVAsStored (fp8): V is viewed and staged as K is,
// (page_size, dv, heads, pages) into (N, dv) stages that the kernel transposes itself; such a
// kernel's producer has one warp for loads (its other three transpose), so that warp gathers alone.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/cutlass.h>
#include <cutlass/fast_math.h>

#include "hopper/common/seqlen.hpp"
#include "hopper/common/utils.hpp"

namespace flashhopper::hopper {

using namespace cute;

template <class Element, int kBlockN, int kHeadDim, int kHeadDimV, class SmemLayoutK, class SmemLayoutVt,
          class ShapeQKV, class StrideQK, class StrideVt, class Pipeline, class PipelineState, bool kVAsStored = false>
struct PagedKvLoads {
  static constexpr int kPageRowsLarge = 32;
  static constexpr int kPageRowsSmall = 16;
  static constexpr bool kLargeChunks = kBlockN % kPageRowsLarge == 0;
  static_assert(kBlockN % kPageRowsSmall == 0, "a key block is a whole number of 16-key chunks");
  static constexpr int kGatherThreads = kVAsStored ? cutlass::NumThreadsPerWarp : cutlass::NumThreadsPerWarpGroup;
  template <int kRows>
  using PageChunkK = Shape<Int<kRows>, Int<kHeadDim>>;
  template <int kRows>
  using PageChunkVt =
      cute::conditional_t<kVAsStored, Shape<Int<kRows>, Int<kHeadDimV>>, Shape<Int<kHeadDimV>, Int<kRows>>>;
  // The TMA loads of one chunk of kRows keys, K's and Vt's (V's as stored with kVAsStored).
  template <int kRows_>
  struct PageChunkTmas {
    static constexpr int kRows = kRows_;
    using SmemLayoutK1 = decltype(layout<0>(zipped_divide(take<0, 2>(SmemLayoutK{}), PageChunkK<kRows>{})));
    using SmemLayoutVt1 = decltype(layout<0>(zipped_divide(take<0, 2>(SmemLayoutVt{}), PageChunkVt<kRows>{})));
    using TmaK1 = decltype(make_tma_copy(
        SM90_TMA_LOAD{}, make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), ShapeQKV{}, StrideQK{}),
        SmemLayoutK1{}, PageChunkK<kRows>{}, _1{}));
    using TmaVt1 = decltype(make_tma_copy(
        SM90_TMA_LOAD{}, make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), ShapeQKV{}, StrideVt{}),
        SmemLayoutVt1{}, PageChunkVt<kRows>{}, _1{}));
    TmaK1 k;
    TmaVt1 vt;

    template <class TensorK, class TensorVt>
    static PageChunkTmas make(TensorK const& mK, TensorVt const& mVt) {
      return {make_tma_copy(SM90_TMA_LOAD{}, mK, SmemLayoutK1{}, PageChunkK<kRows>{}, _1{}),
              make_tma_copy(SM90_TMA_LOAD{}, mVt, SmemLayoutVt1{}, PageChunkVt<kRows>{}, _1{})};
    }
    CUTLASS_DEVICE void prefetch() const {
      cute::prefetch_tma_descriptor(k.get_tma_descriptor());
      cute::prefetch_tma_descriptor(vt.get_tma_descriptor());
    }
  };
  struct NoPageChunkTmas {
    static constexpr int kRows = 0;
    template <class TensorK, class TensorVt>
    static NoPageChunkTmas make(TensorK const&, TensorVt const&) {
      return {};
    }
    CUTLASS_DEVICE void prefetch() const {}
  };
  // Where the gather reads K (or V): key `row` of page `page` for KV head h at
  // ptr + page * page_stride + row * row_stride + h * head_stride.
  struct GatherSource {
    Element const* ptr = nullptr;
    int64_t page_stride = 0, row_stride = 0, head_stride = 0;
    int dim = 0;  // the call's head dim: columns past it are zero-filled
  };
  enum class PagedMode : int { kNone, kLargeChunks, kSmallChunks, kGather };
  // A paged call's loads (only the chunk loads its page size takes are encoded: each descriptor
  // costs host time per call) and its page table: position i of table row r lies in page
  // page_table[r * page_table_stride + i / page_size], r < page_table_rows.
  struct Params {
    cute::conditional_t<kLargeChunks, PageChunkTmas<kPageRowsLarge>, NoPageChunkTmas> large;
    PageChunkTmas<kPageRowsSmall> small;
    GatherSource k, v;
    PagedMode mode = PagedMode::kNone;
    int const* page_table = nullptr;
    int64_t page_table_stride = 0;
    int page_table_rows = 0;
    int page_size = 0;
    cutlass::FastDivmod page_size_divmod{1};
  };

  // Where the gather reads a per-page view (keys and head dim in modes 0 and 1, either order; then
  // heads, pages): its keys in mode kKeyMode.
  template <int kKeyMode, class TensorPages>
  static GatherSource gather_source(TensorPages const& t) {
    return {raw_pointer_cast(t.data()), get<3>(t.stride()), get<kKeyMode>(t.stride()), get<2>(t.stride()),
            int(get<1 - kKeyMode>(t.shape()))};
  }

  // mK, mVt: the per-page views of K and Vt (V as stored with kVAsStored; the gather reads their
  // pointers and strides).
  // keys_start_mid_page: sequences may start anywhere in a page (cache_leftpad), so gather.
  template <class TensorK, class TensorVt>
  static Params make(TensorK const& mK, TensorVt const& mVt, int const* page_table, int64_t page_table_stride,
                     int page_table_rows, int page_size, bool keys_start_mid_page) {
    Params params;
    if (kLargeChunks && !keys_start_mid_page && page_size % kPageRowsLarge == 0) {
      params.mode = PagedMode::kLargeChunks;
      params.large = decltype(params.large)::make(mK, mVt);
    } else if (!keys_start_mid_page && page_size % kPageRowsSmall == 0) {
      params.mode = PagedMode::kSmallChunks;
      params.small = PageChunkTmas<kPageRowsSmall>::make(mK, mVt);
    } else {
      params.mode = PagedMode::kGather;
      params.k = gather_source</*kKeyMode=*/0>(mK);
      params.v = gather_source<kVAsStored ? 0 : 1>(mVt);
    }
    params.page_table = page_table;
    params.page_table_stride = page_table_stride;
    params.page_table_rows = page_table_rows;
    params.page_size = page_size;
    params.page_size_divmod = cutlass::FastDivmod(page_size);
    return params;
  }

  // The producer's threads: the warpgroup when it gathers, a warp when it loads TMA chunks (each
  // lane its own), one thread without pages.
  CUTLASS_HOST_DEVICE static int producer_threads(Params const& params) {
    return params.mode == PagedMode::kGather ? kGatherThreads
           : params.mode == PagedMode::kNone ? 1
                                             : cutlass::NumThreadsPerWarp;
  }
  // Sequence seq's row of the page table, or null where its batch_k is no row of it (a
  // cache_batch_idx out of range: the caller's contract; its keys then load as zeros).
  CUTLASS_DEVICE static int const* table_row(Params const& params, SeqlenInfo const& seq) {
    const bool valid = seq.batch_k >= 0 && seq.batch_k < params.page_table_rows;
    return valid ? params.page_table + seq.batch_k * params.page_table_stride : nullptr;
  }
  CUTLASS_DEVICE static void prefetch(Params const& params) {
    if (params.mode == PagedMode::kLargeChunks) params.large.prefetch();
    if (params.mode == PagedMode::kSmallChunks) params.small.prefetch();
  }

  // One stage (K, or Vt with kIsV) of key block n_block in TMA chunks (the page size's mode).
  // page_shape: the per-page view's shape (K's or Vt's).
  template <bool kIsV, class TensorStages>
  CUTLASS_DEVICE static void load_chunks_stage(Params const& params, ShapeQKV const& page_shape, Pipeline& pipeline,
                                               PipelineState& state, TensorStages const& stages,
                                               SeqlenInfo const& seq, int head_kv, int n_block) {
    auto load = [&](auto const& tmas) {
      constexpr int kRows = cute::remove_cvref_t<decltype(tmas)>::kRows;
      if constexpr (kRows > 0) {
        if constexpr (kIsV) {
          load_chunks<kIsV, kRows>(params, page_shape, pipeline, state, tmas.vt, stages, seq, head_kv, n_block);
        } else {
          load_chunks<kIsV, kRows>(params, page_shape, pipeline, state, tmas.k, stages, seq, head_kv, n_block);
        }
      }
    };
    if (params.mode == PagedMode::kLargeChunks) {
      load(params.large);
    } else {
      load(params.small);
    }
  }

  // Paged, TMA chunks: one stage of key block n_block as kBlockN / kRows chunk loads on the
  // stage's barrier (their bytes add up to the stage's), issued by the producer warp, lane l taking
  // chunks l, l + 32, ... Each lane reads its chunks' page numbers before the stage is free, so the
  // page table's latency hides behind that wait. A chunk past the sequence's keys reads rows beyond
  // its page's extent, which the TMA fills with zeros: the page table is read only within the
  // sequence and no stale value reaches P V.
  template <bool kIsV, int kRows, class Tma, class TensorStages>
  CUTLASS_DEVICE static void load_chunks(Params const& params, ShapeQKV const& page_shape, Pipeline& pipeline,
                                         PipelineState& state, Tma const& tma, TensorStages const& stages,
                                         SeqlenInfo const& seq, int head_kv, int n_block) {
    constexpr int kChunks = kBlockN / kRows;
    constexpr int kChunksPerLane = (kChunks + 31) / 32;
    const int lane = cutlass::canonical_lane_idx();
    int const* table = table_row(params, seq);
    // Each chunk's first key as its row in the cache seen as one column of pages (page *
    // page_size + row in the page), or -1 past the sequence. (Chunk modes only run with
    // offset_k = 0: make() gathers keys that start mid-page.)
    int cache_row[kChunksPerLane];
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kChunksPerLane; ++i) {
      const int key = n_block * kBlockN + (lane + 32 * i) * kRows;
      int page_index, row_in_page;
      params.page_size_divmod(page_index, row_in_page, key);
      cache_row[i] = key < seq.seqlen_k && table != nullptr
                         ? __ldg(table + page_index) * params.page_size + row_in_page
                         : -1;
    }
    pipeline.producer_acquire(state);  // every lane waits; thread 0 arms the barrier
    __syncwarp();
    auto& barrier = *pipeline.producer_get_barrier(state);
    Tensor pages = tma.get_tma_tensor(page_shape);
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kChunksPerLane; ++i) {
      const int chunk = lane + 32 * i;
      if (kChunks % 32 == 0 || chunk < kChunks) {
        int page = 0, row = params.page_size;  // past the page: zeros
        if (cache_row[i] >= 0) params.page_size_divmod(page, row, cache_row[i]);
        Tensor g = key_chunk<kIsV, kRows>(pages(_, _, head_kv, page), row / kRows);
        Tensor s = key_chunk<kIsV, kRows>(stages(_, _, state.index()), chunk);
        auto [src, dst] = tma_partition(tma, _0{}, Layout<_1>{}, group_modes<0, 2>(s), group_modes<0, 2>(g));
        copy(tma.with(barrier), src, dst);
      }
    }
    ++state;
  }

  // Paged, gathered: the producer's gathering warps (kGatherThreads: the warpgroup, or warp 0 with
  // kVAsStored) copy key block n_block into the stage, warp w of W the keys [w, w + 1) * kBlockN / W,
  // 16 bytes a lane and copy; keys past the sequence and columns past the call's head dim as
  // zeros. A warp's copy covers 8 keys x 64 bytes (4 lanes a key), so that a lane's keys are 8
  // apart: one swizzle atom's rows, at a fixed distance in the stage, so its addresses are one add
  // apart. Lane l finds where its warp's keys l, l + 32, ... lie in the cache (page table and
  // strides) before the stage is free, so the page table's latency hides behind that wait, and
  // hands those addresses to the lanes that copy the keys: each lane takes its key's address once
  // (a shuffle, a bit test) and copies its pieces of the row at constant offsets from it, so a
  // 16-byte copy costs about one add and the cp.async to a 32-bit shared address, with no
  // page-table read, division or 64-bit arithmetic (a copy that looked its key up cost about 14
  // instructions: the gather was bound by their issue; bench/RESULTS.md, 2026-12-07). The
  // stage's barrier counts thread 0's arrival (producer_acquire) and one of each thread, made when
  // its copies land (kv_stage_completion): the phase completes with the last copy. The counting
  // form of cp.async.mbarrier.arrive under a single expected arrival and a cancelled byte count is
  // as correct, but synccheck reports it (scripts/probes/cp_async_barrier_probe.cu).
  template <bool kIsV, class TensorStages>
  CUTLASS_DEVICE static void gather_stage(Params const& params, Pipeline& pipeline, PipelineState& state,
                                          TensorStages const& stages, SeqlenInfo const& seq, int head_kv,
                                          int n_block) {
    constexpr int kWarps = kGatherThreads / cutlass::NumThreadsPerWarp;
    constexpr int kKeysPerWarp = kBlockN / kWarps;
    constexpr int kLookups = (kKeysPerWarp + 31) / 32;
    constexpr int kPieceElements = 16 / int(sizeof(Element));
    constexpr int kPiecesPerKey = (kIsV ? kHeadDimV : kHeadDim) / kPieceElements;
    constexpr int kLanesPerKey = 4;
    constexpr int kKeysPerCopy = cutlass::NumThreadsPerWarp / kLanesPerKey;  // 8: a swizzle atom's rows
    constexpr int kKeyGroups = (kKeysPerWarp + kKeysPerCopy - 1) / kKeysPerCopy;
    static_assert(kBlockN % kWarps == 0 && kLookups <= 8 && kPiecesPerKey % kLanesPerKey == 0);
    GatherSource const& source = kIsV ? params.v : params.k;
    const int lane = cutlass::canonical_lane_idx();
    const int first_row = cutlass::canonical_warp_idx() * kKeysPerWarp;  // in the stage
    const int first_key = n_block * kBlockN + first_row;
    int const* table = table_row(params, seq);
    Element const* head = source.ptr + head_kv * source.head_stride;
    // Key first_key + lane + 32 r's first element's address; past the sequence the KV head's first
    // element's with bit 0 set (rows are 16-byte aligned: the bit is free), copied with no byte
    // read. The key is at position offset_k + key of the table row (cache_leftpad).
    uint64_t key_address[kLookups];
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < kLookups; ++r) {
      const int key = first_key + lane + 32 * r;
      int page_index, row_in_page;
      params.page_size_divmod(page_index, row_in_page, seq.offset_k + key);
      key_address[r] = lane + 32 * r < kKeysPerWarp && key < seq.seqlen_k && table != nullptr
                           ? reinterpret_cast<uint64_t>(head + __ldg(table + page_index) * source.page_stride +
                                                        row_in_page * source.row_stride)
                           : reinterpret_cast<uint64_t>(head) | 1;
    }
    // The stages' layout over their base's shared-space address, so that an element's "pointer"
    // is its 32-bit shared address, swizzle included: the swizzle acts on address bits below the
    // base's 1024-byte alignment, the same in the generic and the shared space. Its elements are
    // only ever addressed, never read or written.
    using StageLayout = cute::conditional_t<kIsV, SmemLayoutVt, SmemLayoutK>;
    const uint32_t stage_base = cute::cast_smem_ptr_to_uint(raw_pointer_cast(stages.data()));
    Tensor shared_addresses =
        make_tensor(make_smem_ptr(reinterpret_cast<Element*>(uintptr_t(stage_base))), StageLayout{});
    const int stage = state.index();
    auto shared_address = [&](int key, int col) {
      Element const& e = kIsV && !kVAsStored ? shared_addresses(col, key, stage) : shared_addresses(key, col, stage);
      return uint32_t(reinterpret_cast<uintptr_t>(&e));
    };
    const uint32_t key_group_bytes = shared_address(kKeysPerCopy, 0) - shared_address(0, 0);
    const int lane_key = lane / kLanesPerKey;  // keys lane_key + 8 m of the warp's
    const int col0 = (lane % kLanesPerKey) * kPieceElements;  // then every kLanesPerKey pieces
    constexpr int kSteps = kPiecesPerKey / kLanesPerKey;
    constexpr int kStepElements = kLanesPerKey * kPieceElements;
    // The lane's shared addresses of its first key, one a column step: the keys 8 apart lie
    // key_group_bytes apart in each (one swizzle atom's rows).
    uint32_t to[kSteps];
    CUTLASS_PRAGMA_UNROLL
    for (int step = 0; step < kSteps; ++step) {
      to[step] = shared_address(first_row + lane_key, col0 + kStepElements * step);
    }
    pipeline.producer_acquire(state);
    uint64_t* barrier = pipeline.producer_get_barrier(state);
    // A key's address is shuffled in and checked once, then its kSteps pieces copied at constant
    // offsets from it: the gather was bound by its instruction issue (about 14 instructions a
    // 16-byte copy when each copy looked its key up; bench/RESULTS.md, 2026-12-07).
    auto copy_keys = [&](auto full_rows) {
      CUTLASS_PRAGMA_UNROLL
      for (int m = 0; m < kKeyGroups; ++m) {
        const int key = lane_key + kKeysPerCopy * m;
        // Keys 32 r .. 32 r + 31 of the warp are held in key_address[r]: the same r for the whole warp.
        const uint64_t address = __shfl_sync(0xffffffff, key_address[kKeysPerCopy * m / 32], key % 32);
        if (kKeysPerWarp % kKeysPerCopy == 0 || key < kKeysPerWarp) {
          const bool key_valid = (address & 1) == 0;
          Element const* row = reinterpret_cast<Element const*>(address & ~uint64_t(1));
          CUTLASS_PRAGMA_UNROLL
          for (int step = 0; step < kSteps; ++step) {
            const int col = col0 + kStepElements * step;
            if constexpr (decltype(full_rows)::value) {  // every column of the row is the call's
              cp_async_16_zfill(to[step] + m * key_group_bytes, row + col, key_valid);
            } else {  // columns past the call's head dim: zeros, no byte read (from the row's start)
              const bool valid = key_valid && col < source.dim;
              cp_async_16_zfill(to[step] + m * key_group_bytes, row + (valid ? col : 0), valid);
            }
          }
        }
      }
    };
    if (source.dim == kPiecesPerKey * kPieceElements) {
      copy_keys(cute::true_type{});
    } else {
      copy_keys(cute::false_type{});
    }
    cutlass::arch::cpasync_barrier_arrive_noinc(barrier);  // once this thread's copies have landed
    ++state;
  }

  // Chunk c of kRows keys of a K tile (keys, d) or a Vt tile (dv, keys) (a V tile (keys, dv) with
  // kVAsStored).
  template <bool kIsV, int kRows, class Tensor2>
  CUTLASS_DEVICE static auto key_chunk(Tensor2 const& tile, int c) {
    if constexpr (kIsV && kVAsStored) {
      return local_tile(tile, PageChunkVt<kRows>{}, make_coord(c, _0{}));
    } else if constexpr (kIsV) {
      return local_tile(tile, PageChunkVt<kRows>{}, make_coord(_0{}, c));
    } else {
      return local_tile(tile, PageChunkK<kRows>{}, make_coord(c, _0{}));
    }
  }
};

}  // namespace flashhopper::hopper
