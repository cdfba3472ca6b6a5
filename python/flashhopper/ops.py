"""torch.library custom ops over the C ABI, so that autograd, torch.compile (fullgraph) and CUDA
graphs see one opaque op per pass:

    torch.ops.flashhopper.fwd(q, k, v, softmax_scale=None, causal=False, deterministic=False,
                              window_left=-1, window_right=-1, softcap=0.0, attention_chunk=0,
                              learnable_sink=None, cu_seqlens_q=None, cu_seqlens_k=None,
                              max_seqlen_q=None, max_seqlen_k=None, seqused_q=None, seqused_k=None,
                              num_splits=1)
        -> (out [B, sq, Hq, d], lse [B, Hq, sq] float32), varlen (out [total_q, Hq, d], lse [Hq, total_q])
    torch.ops.flashhopper.bwd(dout, q, k, v, out, lse, softmax_scale=None, causal=False,
                              deterministic=False, window_left=-1, window_right=-1, softcap=0.0,
                              attention_chunk=0, learnable_sink=None, cu_seqlens_q=None,
                              cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                              seqused_q=None, seqused_k=None)
        -> (dq, dk, dv, dsink)

The options added after `deterministic` come last so that positional calls written for the first
six arguments keep their meaning. cu_seqlens_q/k (int32 [B + 1]), max_seqlen_q/k (ints) and the
optional seqused_q/k (int32 [B]) select FlashAttention's packed (varlen) layout, as
interface.Varlen describes: q [total_q, Hq, d], k/v [total_k, Hkv, d]; all of them None is the
dense layout; they get no gradient. The mask follows FlashAttention-3: window (left, right)
bottom-right aligned (within each sequence), -1 unbounded, causal forces right = 0, a bound
covering the whole sequence (max_seqlen in the packed layout) is no bound; attention_chunk c > 0
restricts each row to its chunk of c keys on top of the window; softcap > 0 caps the scores
(softcap * tanh(s / softcap)); learnable_sink (float32 [Hq], or None) adds exp(sink[h]) to every
row's softmax denominator, and lse includes it; fwd's num_splits splits the keys (split-KV, as
interface.forward; 0 lets the library choose), which changes nothing in bwd. bwd always returns four
tensors: dsink is float32 [Hq] (d loss / d learnable_sink, summed over batch and rows) when
learnable_sink is given and an empty float32 tensor of shape [0] otherwise.

fwd's `deterministic` does nothing in the forward (which is always deterministic); autograd hands
it to bwd (or'ed with torch.are_deterministic_algorithms_enabled()). lse is marked
non-differentiable: a loss that uses it gets no gradient through it (FlashAttention-3 drops that
gradient silently). learnable_sink gets a gradient when it requires one. Both ops allocate their
outputs with PyTorch's caching allocator and launch on torch.cuda.current_stream(); neither
synchronises with the host. bwd accepts dout in any layout (autograd may hand over an expanded or
unaligned one) and copies it when the kernels need that; every other argument must already satisfy
the kernels' layout rules (see interface.py).
"""
from typing import Optional

import torch

from . import interface

Tensor = torch.Tensor

_NUM_FWD_INPUTS = 18
_SINK_INPUT = 10  # learnable_sink's position among fwd's inputs


@torch.library.custom_op("flashhopper::fwd", mutates_args=())
def fwd(q: Tensor, k: Tensor, v: Tensor, softmax_scale: Optional[float] = None, causal: bool = False,
        deterministic: bool = False, window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
        attention_chunk: int = 0, learnable_sink: Optional[Tensor] = None, cu_seqlens_q: Optional[Tensor] = None,
        cu_seqlens_k: Optional[Tensor] = None, max_seqlen_q: Optional[int] = None,
        max_seqlen_k: Optional[int] = None, seqused_q: Optional[Tensor] = None,
        seqused_k: Optional[Tensor] = None, num_splits: int = 1) -> tuple[Tensor, Tensor]:
    varlen = interface.as_varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k)
    out, lse = interface.forward(q, k, v, causal=causal, softmax_scale=softmax_scale, return_lse=True,
                                 window_size=(window_left, window_right), softcap=softcap,
                                 attention_chunk=attention_chunk, learnable_sink=learnable_sink, varlen=varlen,
                                 num_splits=num_splits)
    return out, lse


@fwd.register_fake
def _fwd_fake(q, k, v, softmax_scale=None, causal=False, deterministic=False, window_left=-1, window_right=-1,
              softcap=0.0, attention_chunk=0, learnable_sink=None, cu_seqlens_q=None, cu_seqlens_k=None,
              max_seqlen_q=None, max_seqlen_k=None, seqused_q=None, seqused_k=None, num_splits=1):
    varlen = interface.as_varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k)
    interface.check_mask_args(causal, (window_left, window_right), softcap, attention_chunk)
    interface.check_num_splits(num_splits)
    interface.check_forward_args(q, k, v, softmax_scale, learnable_sink, varlen)
    out = q.new_empty((*q.shape[:-1], v.shape[-1]))
    lse = q.new_empty(interface.lse_shape(q), dtype=torch.float32)
    return out, lse


def _normalize_dout(dout: Tensor) -> Tensor:
    if not interface.layout_ok(dout):
        return dout.contiguous()
    return dout


def _no_dsink(q: Tensor) -> Tensor:
    return q.new_empty((0,), dtype=torch.float32)


@torch.library.custom_op("flashhopper::bwd", mutates_args=())
def bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
        softmax_scale: Optional[float] = None, causal: bool = False, deterministic: bool = False,
        window_left: int = -1, window_right: int = -1, softcap: float = 0.0, attention_chunk: int = 0,
        learnable_sink: Optional[Tensor] = None, cu_seqlens_q: Optional[Tensor] = None,
        cu_seqlens_k: Optional[Tensor] = None, max_seqlen_q: Optional[int] = None,
        max_seqlen_k: Optional[int] = None, seqused_q: Optional[Tensor] = None,
        seqused_k: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    varlen = interface.as_varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k)
    dout = _normalize_dout(dout)
    if dout.data_ptr() % 16 != 0:
        dout = dout.clone(memory_format=torch.contiguous_format)
    grads = interface.backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=softmax_scale,
                               deterministic=deterministic, window_size=(window_left, window_right),
                               softcap=softcap, attention_chunk=attention_chunk, learnable_sink=learnable_sink,
                               varlen=varlen)
    if learnable_sink is None:
        return (*grads, _no_dsink(q))
    return grads


@bwd.register_fake
def _bwd_fake(dout, q, k, v, out, lse, softmax_scale=None, causal=False, deterministic=False, window_left=-1,
              window_right=-1, softcap=0.0, attention_chunk=0, learnable_sink=None, cu_seqlens_q=None,
              cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, seqused_q=None, seqused_k=None):
    varlen = interface.as_varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k)
    interface.check_mask_args(causal, (window_left, window_right), softcap, attention_chunk)
    interface.check_backward_args(dout, q, k, v, out, lse, softmax_scale, check_dout_layout=False,
                                  learnable_sink=learnable_sink, varlen=varlen)
    if learnable_sink is None:
        dsink = _no_dsink(q)
    else:
        dsink = q.new_empty((q.shape[-2],), dtype=torch.float32)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dsink


def _setup_context(ctx, inputs, output):
    (q, k, v, softmax_scale, causal, deterministic, window_left, window_right, softcap, attention_chunk,
     learnable_sink, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k, _) = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, learnable_sink, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
    ctx.softmax_scale = softmax_scale
    ctx.causal = causal
    ctx.deterministic = deterministic
    ctx.window_left = window_left
    ctx.window_right = window_right
    ctx.softcap = softcap
    ctx.attention_chunk = attention_chunk
    ctx.max_seqlen_q = max_seqlen_q
    ctx.max_seqlen_k = max_seqlen_k
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)  # no zero-filled gradient for lse


def _backward(ctx, dout, dlse):
    if dout is None:
        return (None,) * _NUM_FWD_INPUTS
    q, k, v, out, lse, learnable_sink, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k = ctx.saved_tensors
    deterministic = bool(ctx.deterministic) or torch.are_deterministic_algorithms_enabled()
    dq, dk, dv, dsink = bwd(dout, q, k, v, out, lse, ctx.softmax_scale, ctx.causal, deterministic,
                            ctx.window_left, ctx.window_right, ctx.softcap, ctx.attention_chunk, learnable_sink,
                            cu_seqlens_q, cu_seqlens_k, ctx.max_seqlen_q, ctx.max_seqlen_k, seqused_q, seqused_k)
    sink_grad = dsink if learnable_sink is not None and ctx.needs_input_grad[_SINK_INPUT] else None
    grads = [None] * _NUM_FWD_INPUTS
    grads[:3] = dq, dk, dv
    grads[_SINK_INPUT] = sink_grad
    return tuple(grads)


fwd.register_autograd(_backward, setup_context=_setup_context)
