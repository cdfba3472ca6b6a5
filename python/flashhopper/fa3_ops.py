"""FlashAttention-3's operator names over FlashHopper: torch.ops.flash_attn_3.fwd, .bwd, .fwd_combine
and .get_scheduler_metadata, with FA3's schemas (hopper/flash_api.cpp, TORCH_LIBRARY(flash_attn_3)).

A program exported with FA3 (torch.export, AOTInductor) calls these ops by name; after

    import flashhopper.fa3_ops
    flashhopper.fa3_ops.register_fa3_ops()

it runs on FlashHopper's kernels without FA3 installed. Opt-in: registering names of another
library is not something an import should do behind the user's back, and where FA3's own extension
is loaded its ops stay (register_fa3_ops refuses, naming it). The ops run through
flashhopper.flash_attn_interface's _flash_attn_forward/_flash_attn_backward, flash_attn_combine and
get_scheduler_metadata; what differs from FA3 is said there (no split partials returned,
softmax_d unpadded, scheduler metadata a CPU tensor). The backward's softmax_lse_log2 is
softmax_lse * log2(e), unpadded too, and its dq_accum/dk_accum/dv_accum are empty.
"""
import math
from typing import Optional

import torch

from . import flash_attn_interface as fai
from . import interface

Tensor = torch.Tensor
NAMESPACE = "flash_attn_3"

# FA3's schemas as it registers them (Dao-AILab/flash-attention, hopper/flash_api.cpp, 2026-08).
SCHEMAS = {
    "fwd": (
        "fwd(Tensor q, Tensor k, Tensor v, Tensor(k_new!)? k_new=None, Tensor(v_new!)? v_new=None, "
        "Tensor? q_v=None, Tensor(out!)? out=None, Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, "
        "Tensor? cu_seqlens_k_new=None, Tensor? seqused_q=None, Tensor? seqused_k=None, int? max_seqlen_q=None, "
        "int? max_seqlen_k=None, Tensor? page_table=None, Tensor? kv_batch_idx=None, Tensor? leftpad_k=None, "
        "Tensor? rotary_cos=None, Tensor? rotary_sin=None, Tensor? seqlens_rotary=None, Tensor? q_descale=None, "
        "Tensor? k_descale=None, Tensor? v_descale=None, float? softmax_scale=None, bool is_causal=False, "
        "int window_size_left=-1, int window_size_right=-1, int attention_chunk=0, float softcap=0.0, "
        "bool is_rotary_interleaved=False, Tensor? scheduler_metadata=None, int num_splits=0, "
        "bool? pack_gqa=None, int sm_margin=0) -> (Tensor(out!), Tensor, Tensor, Tensor)"),
    "bwd": (
        "bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor softmax_lse, Tensor(dq!)? dq=None, "
        "Tensor(dk!)? dk=None, Tensor(dv!)? dv=None, Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, "
        "Tensor? seqused_q=None, Tensor? seqused_k=None, int? max_seqlen_q=None, int? max_seqlen_k=None, "
        "float? softmax_scale=None, bool is_causal=False, int window_size_left=-1, int window_size_right=-1, "
        "float softcap=0.0, bool deterministic=False, int sm_margin=0) "
        "-> (Tensor, Tensor, Tensor, Tensor, Tensor)"),
    "fwd_combine": (
        "fwd_combine(Tensor out_partial, Tensor lse_partial, Tensor(out!)? out=None, ScalarType? out_dtype=None) "
        "-> (Tensor(out!), Tensor)"),
    "get_scheduler_metadata": (
        "get_scheduler_metadata(int batch_size, int max_seqlen_q, int max_seqlen_k, int num_heads, "
        "int num_heads_k, int headdim, int headdim_v, ScalarType qkv_dtype, Tensor seqused_k, "
        "Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, Tensor? cu_seqlens_k_new=None, "
        "Tensor? seqused_q=None, Tensor? leftpad_k=None, int? page_size=None, int max_seqlen_k_new=0, "
        "bool is_causal=False, int window_size_left=-1, int window_size_right=-1, int attention_chunk=0, "
        "bool has_softcap=False, int num_splits=0, bool? pack_gqa=None, int sm_margin=0) -> Tensor"),
}

_library: Optional[torch.library.Library] = None


def _empty(device) -> Tensor:
    return torch.empty(0, dtype=torch.float32, device=device)


def _fwd(q, k, v, k_new=None, v_new=None, q_v=None, out=None, cu_seqlens_q=None, cu_seqlens_k=None,
         cu_seqlens_k_new=None, seqused_q=None, seqused_k=None, max_seqlen_q=None, max_seqlen_k=None, page_table=None,
         kv_batch_idx=None, leftpad_k=None, rotary_cos=None, rotary_sin=None, seqlens_rotary=None, q_descale=None,
         k_descale=None, v_descale=None, softmax_scale=None, is_causal=False, window_size_left=-1,
         window_size_right=-1, attention_chunk=0, softcap=0.0, is_rotary_interleaved=False, scheduler_metadata=None,
         num_splits=0, pack_gqa=None, sm_margin=0):
    return fai._flash_attn_forward(
        q, k, v, k_new, v_new, q_v, out, cu_seqlens_q, cu_seqlens_k, cu_seqlens_k_new, seqused_q, seqused_k,
        max_seqlen_q, max_seqlen_k, page_table, kv_batch_idx, leftpad_k, rotary_cos, rotary_sin, seqlens_rotary,
        q_descale, k_descale, v_descale, softmax_scale, is_causal, window_size_left, window_size_right,
        attention_chunk, softcap, is_rotary_interleaved, scheduler_metadata, num_splits, pack_gqa, sm_margin)


def _fwd_fake(q, k, v, k_new=None, v_new=None, q_v=None, out=None, cu_seqlens_q=None, cu_seqlens_k=None,
              cu_seqlens_k_new=None, seqused_q=None, seqused_k=None, max_seqlen_q=None, *args, **kwargs):
    """Shapes only (torch.export, torch.compile): out like q with v's head dim (bf16 for fp8 q), lse
    [B, Hq, sq] or packed [Hq, total_q]; no partials."""
    dv = v.shape[-1]
    if out is None:
        out = q.new_empty((*q.shape[:-1], dv), dtype=interface.output_dtype(q))
    if cu_seqlens_q is not None:
        lse = q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
    else:
        lse = q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)
    return out, lse, _empty(q.device), _empty(q.device)


def _bwd(dout, q, k, v, out, softmax_lse, dq=None, dk=None, dv=None, cu_seqlens_q=None, cu_seqlens_k=None,
         seqused_q=None, seqused_k=None, max_seqlen_q=None, max_seqlen_k=None, softmax_scale=None, is_causal=False,
         window_size_left=-1, window_size_right=-1, softcap=0.0, deterministic=False, sm_margin=0):
    softmax_d = fai._flash_attn_backward(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, seqused_q,
                                         seqused_k, max_seqlen_q, max_seqlen_k, dq, dk, dv, softmax_scale, is_causal,
                                         window_size_left, window_size_right, softcap, deterministic, sm_margin)
    return softmax_d, softmax_lse * math.log2(math.e), _empty(q.device), _empty(q.device), _empty(q.device)


def _bwd_fake(dout, q, k, v, out, softmax_lse, *args, **kwargs):
    return (softmax_lse.new_empty(softmax_lse.shape), softmax_lse.new_empty(softmax_lse.shape), _empty(q.device),
            _empty(q.device), _empty(q.device))


def _fwd_combine(out_partial, lse_partial, out=None, out_dtype=None):
    return fai.flash_attn_combine(out_partial, lse_partial, out, out_dtype)


def _fwd_combine_fake(out_partial, lse_partial, out=None, out_dtype=None):
    dtype = out_dtype if out_dtype is not None else (out.dtype if out is not None else torch.float32)
    if out is None:
        out = out_partial.new_empty(out_partial.shape[1:], dtype=dtype)
    return out, lse_partial.new_empty(lse_partial.shape[1:])


def _get_scheduler_metadata(batch_size, max_seqlen_q, max_seqlen_k, num_heads, num_heads_k, headdim, headdim_v,
                            qkv_dtype, seqused_k, cu_seqlens_q=None, cu_seqlens_k=None, cu_seqlens_k_new=None,
                            seqused_q=None, leftpad_k=None, page_size=None, max_seqlen_k_new=0, is_causal=False,
                            window_size_left=-1, window_size_right=-1, attention_chunk=0, has_softcap=False,
                            num_splits=0, pack_gqa=None, sm_margin=0):
    for name, value in (("cu_seqlens_k", cu_seqlens_k), ("seqused_q", seqused_q)):
        if value is not None:
            fai._not_yet(name, "<tensor>", "scheduler metadata for calls with " + name)
    return fai.get_scheduler_metadata(
        batch_size, max_seqlen_q, max_seqlen_k, num_heads, num_heads_k, headdim, seqused_k, qkv_dtype=qkv_dtype,
        headdim_v=headdim_v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k_new=cu_seqlens_k_new, cache_leftpad=leftpad_k,
        page_size=page_size, max_seqlen_k_new=max_seqlen_k_new, causal=is_causal,
        window_size=(window_size_left, window_size_right), attention_chunk=attention_chunk, has_softcap=has_softcap,
        num_splits=num_splits, pack_gqa=pack_gqa, sm_margin=sm_margin)


def _get_scheduler_metadata_fake(*args, **kwargs):
    return torch.empty(1, dtype=torch.int32)


_IMPLEMENTATIONS = {
    "fwd": (_fwd, _fwd_fake),
    "bwd": (_bwd, _bwd_fake),
    "fwd_combine": (_fwd_combine, _fwd_combine_fake),
    "get_scheduler_metadata": (_get_scheduler_metadata, _get_scheduler_metadata_fake),
}


def fa3_ops_registered() -> bool:
    """Whether register_fa3_ops() has run in this process."""
    return _library is not None


def register_fa3_ops() -> None:
    """Defines torch.ops.flash_attn_3.{fwd, bwd, fwd_combine, get_scheduler_metadata} with FA3's
    schemas, run by FlashHopper (CUDA and, so that a host tensor gets a message naming it, CPU).
    A second call does nothing. Raises RuntimeError where FA3's extension (or anything else) has
    already defined one of these ops: loading both would leave it unclear which one a program runs."""
    global _library
    if _library is not None:
        return
    taken = [name for name in SCHEMAS if _defined(name)]
    if taken:
        raise RuntimeError(f"register_fa3_ops: {', '.join(f'{NAMESPACE}::{n}' for n in taken)} already defined "
                           "(FlashAttention-3's extension is loaded?); use its ops, or FlashHopper's without it")
    library = torch.library.Library(NAMESPACE, "FRAGMENT")
    for name, schema in SCHEMAS.items():
        real, fake = _IMPLEMENTATIONS[name]
        library.define(schema)
        library.impl(name, real, "CUDA")
        library.impl(name, real, "CPU")
        torch.library.register_fake(f"{NAMESPACE}::{name}", fake, lib=library)
    _library = library


def _defined(name: str) -> bool:
    try:
        getattr(getattr(torch.ops, NAMESPACE), name)
        return True
    except (AttributeError, RuntimeError):
        return False
