/* FlashHopper public C ABI.
 *
 * Plain C so that any binding (ctypes, another language, a different C++ ABI) can call the
 * library. The C++ API in flashhopper.hpp is a thin layer over these same structs.
 *
 * Conventions (see docs/conventions.md): shapes and strides are in elements; a tensor whose `data` is
 * NULL is "absent" (optional arguments). Masks are aligned at the bottom-right. LSE is the
 * natural-log sum of exponentials, float32, -inf for rows that see no key.
 */
#ifndef FLASHHOPPER_FLASHHOPPER_H
#define FLASHHOPPER_FLASHHOPPER_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Same type as cudaStream_t, declared here so that the header needs no CUDA include. */
typedef struct CUstream_st* fh_stream_t;

typedef enum fh_dtype {
  FH_DTYPE_BF16 = 0,
  FH_DTYPE_FP16 = 1,
  FH_DTYPE_FP8_E4M3 = 2, /* forward inputs only */
  FH_DTYPE_FP32 = 3,     /* lse, descale factors, split partials, CPU reference */
  FH_DTYPE_INT32 = 4,    /* cu_seqlens, seqused, page tables */
  FH_DTYPE_FP64 = 5      /* CPU reference only */
} fh_dtype;

typedef enum fh_status {
  FH_SUCCESS = 0,
  FH_ERROR_INVALID_ARGUMENT = 1, /* the message names the argument and the rule */
  FH_ERROR_NOT_SUPPORTED = 2,    /* a valid request that this build cannot run (yet) */
  FH_ERROR_NO_DEVICE = 3,        /* no sm_90 GPU, or the library was built without CUDA */
  FH_ERROR_CUDA = 4,             /* a CUDA call failed; the message carries CUDA's text */
  FH_ERROR_WORKSPACE = 5         /* workspace pointer or size does not satisfy the query */
} fh_status;

#define FH_MAX_DIMS 5
/* Limits of the arguments: the checks and the kernels take them from here (the Python package
   mirrors them, and a test compares). */
#define FH_MAX_HEAD_DIM 512 /* head dim d and value head dim dv */
#define FH_MAX_BACKWARD_HEAD_DIM 512 /* the backward's families: d and dv past it run forward only */
#define FH_MAX_SPLITS 256   /* num_splits, and the splits fh_combine merges */

/* A strided view of device (or, for the CPU reference, host) memory. */
typedef struct fh_tensor {
  void* data;                     /* NULL: absent */
  int32_t dtype;                  /* fh_dtype */
  int32_t ndim;
  int64_t shape[FH_MAX_DIMS];
  int64_t stride[FH_MAX_DIMS];    /* in elements */
} fh_tensor;

/* Forward pass.
 * Dense:  q [B, sq, Hq, d], k [B, sk, Hkv, d], v [B, sk, Hkv, dv], out [B, sq, Hq, dv],
 *         lse [B, Hq, sq].
 * Varlen (cu_seqlens_q and cu_seqlens_k present): q [total_q, Hq, d], k [total_k, Hkv, d],
 *         v [total_k, Hkv, dv], out [total_q, Hq, dv], lse [Hq, total_q]. Sequence b is the rows
 *         [cu_seqlens[b], cu_seqlens[b+1]); cu_seqlens (device memory, int32) must be
 *         non-decreasing within [0, total] and every length at most max_seqlen: the caller's
 *         contract, not checked (that would need a host copy). If it is broken the kernels still
 *         never read or write outside the tensors or the workspace (each sequence is clamped into
 *         [0, total] and to max_seqlen), but the results are undefined. Tokens outside every
 *         sequence are neither read as keys nor written.
 * seqused_q/seqused_k (dense or varlen, device int32 [B]): only the first seqused[b] tokens of
 *         sequence b take part; its other rows get O = 0, LSE = -inf and zero dQ, its other keys
 *         zero dK and dV. Those tokens may be loaded into a tile and multiplied by zero, so they
 *         must hold finite values (any garbage but Inf/NaN).
 * Paged KV (page_table present): k [num_pages, page_size, Hkv, d], v likewise with dv,
 *         page_table [B, max_pages], cache_seqlens [B]; k_new/v_new [B, s_new, Hkv, d|dv]
 *         are written into the cache at cache_seqlens before attending. Position i of
 *         sequence b is row i % page_size of page page_table[b, i / page_size].
 *         A packed batch over paged keys (chunked prefill over a paged cache) gives
 *         cu_seqlens_k [B+1] and max_seqlen_k instead of cache_seqlens: sequence b's keys are
 *         positions [0, cu_seqlens_k[b+1] - cu_seqlens_k[b]) of its row (only the differences
 *         count), shortened by seqused_k when given; q may be dense or packed. At most
 *         max_pages * page_size keys a sequence (the caller's contract, as the lengths above).
 *         Forward only: no append (k_new needs cache_seqlens), no cache_batch_idx/leftpad.
 * KV cache extras (FA3's flash_attn_with_kvcache), all optional, dense or paged cache:
 *   cache_batch_idx [B] int32: sequence b's cache is k[cache_batch_idx[b]], or with page_table
 *         the pages of row cache_batch_idx[b] of the table; k and v (or page_table) then hold
 *         any number of cache rows.
 *   cache_leftpad [B] int32: sequence b's keys start at cache position
 *         cache_leftpad[b] (the slots before it are padding); its keys are the positions
 *         [cache_leftpad[b], cache_seqlens[b] + s_new), and the masks align to them.
 *   cu_seqlens_k_new [B+1] int32 (with k_new): the new keys packed, k_new [total_new, Hkv, d]
 *         and v_new [total_new, Hkv, dv]; sequence b appends the rows
 *         [cu_seqlens_k_new[b], cu_seqlens_k_new[b+1]) (continuous batching's append).
 *   rotary_cos/rotary_sin [seqlen_ro, rotary_dim / 2] (with k_new): rotary embedding on the
 *         first rotary_dim dims of the new keys, at positions r + t (t = 0 .. s_new-1), before
 *         they are written into the cache, and of q: row i at r + i with a mask (causal,
 *         window, chunk), else every row at r. r = rotary_seqlens[b] when given, else
 *         cache_seqlens[b]. rotary_interleaved 1 rotates the pairs (2i, 2i+1) (GPT-J), 0 the
 *         pairs (i, i + rotary_dim/2) (GPT-NeoX). q itself is not written.
 * Split-KV (num_splits > 1): partials out_partial [num_splits, B, Hq, sq, dv] and
 *         lse_partial [num_splits, B, Hq, sq] (packed queries: [num_splits, Hq, total_q, dv]
 *         and [num_splits, Hq, total_q]) in float32 live in the workspace, then combined.
 *         num_splits 0 lets the library choose the count from the shapes alone (never the
 *         lengths in device memory, so a captured CUDA graph stays valid): more than one when
 *         the query tiles would leave most SMs idle (packed: the most tiles the batch can have).
 * qv (optional, forward only; FA3's argument for absorbed MLA decode): like out, [B, sq, Hq, dv]
 *         or [total_q, Hq, dv], q's dtype; the scores become S = Q K^T + Qv V^T (before scale,
 *         softcap and mask) and the default scale 1/sqrt(d + dv). There is no backward with qv. */
typedef struct fh_forward_params {
  fh_tensor q, k, v, out;
  fh_tensor lse;                  /* optional, float32 */

  fh_tensor cu_seqlens_q;         /* optional int32 [B+1] */
  fh_tensor cu_seqlens_k;         /* optional int32 [B+1] */
  fh_tensor seqused_q;            /* optional int32 [B] */
  fh_tensor seqused_k;            /* optional int32 [B] */
  int32_t max_seqlen_q;           /* varlen: upper bound of the per-sequence lengths */
  int32_t max_seqlen_k;

  fh_tensor page_table;           /* optional int32 [B, max_pages] */
  fh_tensor cache_seqlens;        /* int32 [B], with k_new, or page_table without cu_seqlens_k */
  fh_tensor k_new, v_new;         /* optional [B, s_new, Hkv, d], [B, s_new, Hkv, dv] */

  fh_tensor q_descale, k_descale, v_descale; /* fp8 only: float32 [B, Hkv] */

  float softmax_scale;            /* 0: 1/sqrt(d) */
  float softcap;                  /* 0: none */
  int32_t causal;                 /* same as window (-1, 0) */
  int32_t window_left;            /* -1: unbounded */
  int32_t window_right;           /* -1: unbounded */
  int32_t num_sink_tokens;        /* local windows only */
  int32_t num_splits;             /* 1: no split; 0: chosen from the shapes */
  int32_t attention_chunk;        /* 0: none; c > 0: row i sees key j only in the same chunk of c keys */
  fh_tensor learnable_sink;       /* optional float32 [Hq]: a logit per query head in every row's
                                     softmax denominator, with no value (gpt-oss) */
  fh_tensor qv;                   /* optional, as out: S = Q K^T + Qv V^T (see above) */
  fh_tensor cache_batch_idx;      /* optional int32 [B] (KV cache extras above) */
  fh_tensor cache_leftpad;        /* optional int32 [B] */
  fh_tensor rotary_cos;           /* optional [seqlen_ro, rotary_dim / 2], with rotary_sin */
  fh_tensor rotary_sin;
  fh_tensor rotary_seqlens;       /* optional int32 [B]: rotary positions start here */
  int32_t rotary_interleaved;     /* 1: pairs (2i, 2i+1); 0: (i, i + rotary_dim / 2) */
  fh_tensor cu_seqlens_k_new;     /* optional int32 [B+1]: k_new/v_new packed (see above) */
  int32_t sm_margin;              /* SMs the kernels leave free (FA3's argument: communication
                                     kernels overlap attention there); 0: all of them. At least
                                     one SM must remain. */
} fh_forward_params;

/* Backward pass. Layouts as the forward; dq like q, dk like k, dv like v; lse from the
 * forward. For GQA, dk/dv of a key head sum over its group of query heads. */
typedef struct fh_backward_params {
  fh_tensor q, k, v, out, dout, lse;
  fh_tensor dq, dk, dv;

  fh_tensor cu_seqlens_q, cu_seqlens_k;
  fh_tensor seqused_q, seqused_k;
  int32_t max_seqlen_q, max_seqlen_k;

  float softmax_scale;
  float softcap;
  int32_t causal;
  int32_t window_left, window_right;
  int32_t num_sink_tokens;
  int32_t deterministic;          /* 1: bit-identical results run to run */
  int32_t attention_chunk;        /* as the forward's */
  fh_tensor learnable_sink;       /* optional float32 [Hq], as given to the forward */
  fh_tensor dsink;                /* optional float32 [Hq] output (with learnable_sink only):
                                     d loss / d learnable_sink, summed over batch and rows */
  int32_t sm_margin;              /* as the forward's */
} fh_backward_params;

/* Merge split-KV partials: out_partial [num_splits, B, Hq, sq, dv] and
 * lse_partial [num_splits, B, Hq, sq] (float32) into out [B, sq, Hq, dv] and lse [B, Hq, sq].
 * Varlen (out of rank 3): out_partial [num_splits, Hq, total_q, dv], lse_partial
 * [num_splits, Hq, total_q] into out [total_q, Hq, dv] and lse [Hq, total_q]. */
typedef struct fh_combine_params {
  fh_tensor out_partial, lse_partial;
  fh_tensor out, lse;
} fh_combine_params;

/* Defaults: every tensor absent, scale 0 (1/sqrt(d)), windows unbounded, one split. */
void fh_forward_params_init(fh_forward_params* params);
void fh_backward_params_init(fh_backward_params* params);
void fh_combine_params_init(fh_combine_params* params);

/* Argument checks only (no device needed): what forward/backward would refuse. */
fh_status fh_forward_check(const fh_forward_params* params);
fh_status fh_backward_check(const fh_backward_params* params);
fh_status fh_combine_check(const fh_combine_params* params);

/* Bytes of device workspace the call needs (may be 0). */
fh_status fh_forward_workspace_size(const fh_forward_params* params, size_t* bytes);
fh_status fh_backward_workspace_size(const fh_backward_params* params, size_t* bytes);

/* Enqueue the pass on `stream`. No host synchronisation. Nothing is launched on an error. */
fh_status fh_forward(const fh_forward_params* params, void* workspace, size_t workspace_bytes,
                     fh_stream_t stream);
fh_status fh_backward(const fh_backward_params* params, void* workspace, size_t workspace_bytes,
                      fh_stream_t stream);
fh_status fh_combine(const fh_combine_params* params, fh_stream_t stream);

/* The message of the last failed call on this thread ("" after a success).
 * Threads: every function here may be called from several host threads at once. The library
 * keeps no state between calls but this message, which is per thread. Calls on different streams
 * run concurrently when each has its own outputs and workspace; a workspace may not be shared by
 * calls in flight at the same time. */
const char* fh_last_error(void);

/* A status's name as the library's layers print it in messages ("invalid argument", "not
 * supported", "no device", "CUDA error", "workspace"; "success" for FH_SUCCESS), "unknown status"
 * for a value outside fh_status. The C++ ops and the Python package take their names from here. */
const char* fh_status_name(fh_status status);

/* FlashAttention's window arguments as the parameter structs take them (the one home of this
 * rule, which the Python package and the PyTorch ops call): a bound that covers the whole
 * sequence is no bound (window_left >= seqlen_k - 1, window_right >= seqlen_q - 1, then -1),
 * causal forces window_right = 0, and the window (-1, 0) is causal: *causal 1 and the window
 * (-1, -1); else *causal 0 and the window. seqlen_q/seqlen_k: the call's lengths (max_seqlen_q/k
 * when packed, a cache's capacity for the keys). Bounds below -1 pass through, for the checks to
 * refuse by name. */
void fh_window_from_fa3(int32_t causal, int64_t window_left, int64_t window_right, int64_t seqlen_q,
                        int64_t seqlen_k, int32_t* out_causal, int64_t* out_window_left,
                        int64_t* out_window_right);

/* 1 when the library was built with its CUDA kernels. */
int32_t fh_built_with_cuda(void);

/* The library's version, "MAJOR.MINOR.PATCH" (the SONAME carries MAJOR). */
const char* fh_version(void);

/* A compiled kernel family: one pass for one dtype and (head dim, value head dim). A call runs
 * on the family of its pass and dtype, of those with head dim and value head dim at least its own,
 * with the least padded work (the smallest head dim + value head dim; on a tie the smaller head
 * dim): head dims in between run padded. */
typedef struct fh_kernel_family {
  int32_t backward;               /* 0: forward, 1: backward */
  int32_t dtype;                  /* fh_dtype */
  int32_t head_dim;
  int32_t head_dim_v;
} fh_kernel_family;

/* The families this build compiled (none without CUDA): writes the first `capacity` of them to
 * `families` (may be null when capacity is 0) and returns how many there are. The families for
 * calls with qv (forward head dim 64 with value head dim 256, the full kernel set) are not listed:
 * they take no call without qv. */
int32_t fh_compiled_families(fh_kernel_family* families, int32_t capacity);

#ifdef __cplusplus
}
#endif

#endif /* FLASHHOPPER_FLASHHOPPER_H */
