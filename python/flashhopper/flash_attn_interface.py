"""FlashAttention-3's Python API (hopper/flash_attn_interface.py) over FlashHopper's kernels.

Same function names, argument names, defaults and return conventions, so that switching is one line:

    import flashhopper.flash_attn_interface as fa3      # instead of: import flash_attn_interface as fa3
    out = fa3.flash_attn_func(q, k, v, causal=True)

What the kernels do today: q [B, sq, Hq, d], k/v [B, sk, Hkv, d] in bf16 or fp16, d in 64/128/256
(development builds of the library: bf16 and d = 128 only; others raise FlashHopperNotSupported, a
NotImplementedError), causal or not (bottom-right aligned), GQA/MQA, any sq and sk, deterministic
backward. Every argument the kernels cannot honour yet raises NotImplementedError naming it
(window_size other than (-1, -1) or causal's, attention_chunk, softcap, num_splits > 1, qv, fp8
descales, sm_margin); flash_attn_varlen_func, flash_attn_with_kvcache and flash_attn_combine raise
NotImplementedError as a whole. Bad tensors (dtype, rank, shape, strides, device, alignment) raise
ValueError naming the argument before anything is launched.

Differences from FlashAttention-3 worth knowing:
- The returned softmax_lse does not require grad (it is marked non-differentiable); FA3 returns one
  that seems differentiable but drops its gradient.
- Inputs are not copied to make them contiguous: a last dim with stride != 1 (or other strides not
  a multiple of 16 bytes) raises ValueError; call .contiguous() yourself.
- pack_gqa is a tuning hint in FA3 and is accepted and ignored here; num_splits 0 (FA3's "choose
  for me") and 1 both mean one split.
"""
from typing import Optional, Union

import torch

from . import interface, ops

__all__ = [
    "flash_attn_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_with_kvcache",
    "flash_attn_combine",
    "get_scheduler_metadata",
]


def _not_yet(argument: str, value, what: str):
    raise NotImplementedError(f"{argument}={value!r}: {what} is not supported by FlashHopper yet")


def _resolve_options(q, k, causal, qv, q_descale, k_descale, v_descale, window_size, attention_chunk, softcap,
                     num_splits, sm_margin) -> bool:
    """Refuses what the kernels cannot do yet; returns the effective causal flag."""
    if qv is not None:
        _not_yet("qv", "<tensor>", "the extra qv operand (hdim 64 x 512 MLA-style attention)")
    for name, descale in (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale)):
        if descale is not None:
            _not_yet(name, "<tensor>", "fp8 attention (descale factors)")
    if attention_chunk not in (0, None):
        _not_yet("attention_chunk", attention_chunk, "chunked attention")
    if softcap != 0.0:
        _not_yet("softcap", softcap, "softcapping")
    if num_splits not in (0, 1):
        _not_yet("num_splits", num_splits, "split-KV")
    if sm_margin != 0:
        _not_yet("sm_margin", sm_margin, "leaving SMs free")
    if window_size is None:
        window_size = (-1, -1)
    try:
        left, right = (int(w) for w in window_size)
    except (TypeError, ValueError):
        raise ValueError(f"window_size: expected a pair of ints (left, right), got {window_size!r}") from None
    # FlashAttention's rule: a bound that covers the whole sequence is no bound.
    if isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and q.dim() == 4 and k.dim() == 4:
        seqlen_q, seqlen_k = q.shape[1], k.shape[1]
        if left >= seqlen_k - 1:
            left = -1
        if right >= seqlen_q - 1:
            right = -1
    if causal:  # FA3: causal is the window (left, 0); with left < 0 plain causal
        right = 0
    if left < 0 and right < 0:
        return bool(causal)
    if left < 0 and right == 0:
        return True
    _not_yet("window_size", tuple(window_size), "local (sliding window) attention")


def flash_attn_func(
    q,
    k,
    v,
    softmax_scale=None,
    causal=False,
    qv=None,
    q_descale=None, k_descale=None, v_descale=None,
    window_size=(-1, -1),
    attention_chunk=0,
    softcap=0.0,
    num_splits=1,
    pack_gqa=None,
    deterministic=False,
    sm_margin=0,
    return_attn_probs=False,
):
    """Exact attention, FlashAttention-3's flash_attn_func.

    q: (batch_size, seqlen_q, nheads, headdim); k, v: (batch_size, seqlen_k, nheads_k, headdim),
    nheads % nheads_k == 0 (query heads h*g .. h*g+g-1 use key/value head h). causal=True masks
    bottom-right aligned (query i sees keys j <= i + seqlen_k - seqlen_q); a row that sees no key
    gives 0 and lse -inf. softmax_scale defaults to 1/sqrt(headdim). deterministic=True makes the
    backward bit-reproducible.

    Returns out (batch_size, seqlen_q, nheads, headdim), or (out, softmax_lse) with
    softmax_lse (batch_size, nheads, seqlen_q) float32 (natural log) when return_attn_probs=True.
    """
    effective_causal = _resolve_options(q, k, causal, qv, q_descale, k_descale, v_descale, window_size,
                                        attention_chunk, softcap, num_splits, sm_margin)
    interface.check_forward_args(q, k, v, softmax_scale)
    interface.check_devices((("q", q), ("k", k), ("v", v)))
    out, softmax_lse = ops.fwd(q, k, v, softmax_scale, effective_causal, bool(deterministic))
    return (out, softmax_lse) if return_attn_probs else out


def flash_attn_qkvpacked_func(
    qkv,
    softmax_scale=None,
    causal=False,
    q_descale=None, k_descale=None, v_descale=None,
    window_size=(-1, -1),
    attention_chunk=0,
    softcap=0.0,
    deterministic=False,
    num_heads_q=None,
    sm_margin=0,
    return_attn_probs=False,
):
    """FlashAttention-3's flash_attn_qkvpacked_func: qkv (batch_size, seqlen, 3, nheads, headdim), or
    (batch_size, seqlen, nheads_q + 2 * nheads_k, headdim) with num_heads_q given (GQA)."""
    if not isinstance(qkv, torch.Tensor):
        raise ValueError(f"qkv: expected a torch.Tensor, got {type(qkv).__name__}")
    if qkv.dim() == 5:
        if qkv.shape[2] != 3:
            raise ValueError(f"qkv: expected shape (batch, seqlen, 3, nheads, headdim), got {tuple(qkv.shape)}")
        q, k, v = qkv.unbind(dim=2)
    elif qkv.dim() == 4:
        if num_heads_q is None:
            raise ValueError("num_heads_q: required when qkv has 4 dims (batch, seqlen, heads, headdim)")
        num_heads_k = (qkv.shape[2] - num_heads_q) // 2
        if num_heads_k <= 0 or num_heads_q + 2 * num_heads_k != qkv.shape[2]:
            raise ValueError(f"qkv: {qkv.shape[2]} heads is not num_heads_q ({num_heads_q}) + 2 * nheads_k")
        q, k, v = qkv.split([num_heads_q, num_heads_k, num_heads_k], dim=2)
    else:
        raise ValueError(f"qkv: expected 5 dims (or 4 with num_heads_q), got shape {tuple(qkv.shape)}")
    return flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=causal, q_descale=q_descale,
                           k_descale=k_descale, v_descale=v_descale, window_size=window_size,
                           attention_chunk=attention_chunk, softcap=softcap, deterministic=deterministic,
                           sm_margin=sm_margin, return_attn_probs=return_attn_probs)


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    seqused_q=None,
    seqused_k=None,
    softmax_scale=None,
    causal=False,
    qv=None,
    q_descale=None, k_descale=None, v_descale=None,
    window_size=(-1, -1),
    attention_chunk=0,
    softcap=0.0,
    num_splits=1,
    pack_gqa=None,
    deterministic=False,
    sm_margin=0,
    return_attn_probs=False,
):
    """FlashAttention-3's varlen attention (packed sequences, cu_seqlens). Not supported yet: the
    library declares varlen in its C ABI but has no varlen kernels; raises NotImplementedError."""
    raise NotImplementedError("flash_attn_varlen_func: variable-length (cu_seqlens) attention is not supported "
                              "by FlashHopper yet; pad to a dense batch and use flash_attn_func")


def flash_attn_with_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    qv=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens: Optional[Union[int, torch.Tensor]] = None,
    cache_batch_idx: Optional[torch.Tensor] = None,
    cache_leftpad: Optional[torch.Tensor] = None,
    page_table: Optional[torch.Tensor] = None,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_k_new: Optional[torch.Tensor] = None,
    max_seqlen_q: Optional[int] = None,
    rotary_seqlens: Optional[torch.Tensor] = None,
    q_descale: Optional[torch.Tensor] = None,
    k_descale: Optional[torch.Tensor] = None,
    v_descale: Optional[torch.Tensor] = None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    attention_chunk=0,
    softcap=0.0,
    rotary_interleaved=True,
    scheduler_metadata=None,
    num_splits=0,
    pack_gqa=None,
    sm_margin=0,
    return_softmax_lse=False,
):
    """FlashAttention-3's KV-cache attention (decoding: cache_seqlens, paged KV, in-place append,
    rotary). Not supported yet; raises NotImplementedError. (FA3 returns out, or (out, softmax_lse,
    ...) with return_softmax_lse=True.)"""
    raise NotImplementedError("flash_attn_with_kvcache: KV-cache attention (cache_seqlens, page_table, k/v "
                              "append, rotary) is not supported by FlashHopper yet")


def flash_attn_combine(out_partial, lse_partial, out=None, out_dtype=None):
    """FlashAttention-3's combine of split-KV partials. Not supported yet; raises NotImplementedError."""
    raise NotImplementedError("flash_attn_combine: the split-KV combine is not supported by FlashHopper yet")


def get_scheduler_metadata(*args, **kwargs):
    """FlashAttention-3's scheduler metadata for flash_attn_with_kvcache. Not supported yet."""
    raise NotImplementedError("get_scheduler_metadata: KV-cache scheduling is not supported by FlashHopper yet")
