"""torch.library custom ops over the C ABI, so that autograd, torch.compile (fullgraph) and CUDA
graphs see one opaque op per pass:

    torch.ops.flashhopper.fwd(q, k, v, softmax_scale=None, causal=False, deterministic=False,
                              window_left=-1, window_right=-1, softcap=0.0, attention_chunk=0,
                              learnable_sink=None)
        -> (out [B, sq, Hq, d], lse [B, Hq, sq] float32)
    torch.ops.flashhopper.bwd(dout, q, k, v, out, lse, softmax_scale=None, causal=False,
                              deterministic=False, window_left=-1, window_right=-1, softcap=0.0,
                              attention_chunk=0, learnable_sink=None)
        -> (dq, dk, dv, dsink)

The options added after `deterministic` come last so that positional calls written for the first
six arguments keep their meaning. The mask follows FlashAttention-3: window (left, right)
bottom-right aligned, -1 unbounded, causal forces right = 0, a bound covering the whole sequence is
no bound; attention_chunk c > 0 restricts each row to its chunk of c keys on top of the window;
softcap > 0 caps the scores (softcap * tanh(s / softcap)); learnable_sink (float32 [Hq], or None)
adds exp(sink[h]) to every row's softmax denominator, and lse includes it. bwd always returns four
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

_NUM_FWD_INPUTS = 11
_SINK_INPUT = 10  # learnable_sink's position among fwd's inputs


@torch.library.custom_op("flashhopper::fwd", mutates_args=())
def fwd(q: Tensor, k: Tensor, v: Tensor, softmax_scale: Optional[float] = None, causal: bool = False,
        deterministic: bool = False, window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
        attention_chunk: int = 0, learnable_sink: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    out, lse = interface.forward(q, k, v, causal=causal, softmax_scale=softmax_scale, return_lse=True,
                                 window_size=(window_left, window_right), softcap=softcap,
                                 attention_chunk=attention_chunk, learnable_sink=learnable_sink)
    return out, lse


@fwd.register_fake
def _fwd_fake(q, k, v, softmax_scale=None, causal=False, deterministic=False, window_left=-1, window_right=-1,
              softcap=0.0, attention_chunk=0, learnable_sink=None):
    interface.check_mask_args(causal, (window_left, window_right), softcap, attention_chunk)
    interface.check_forward_args(q, k, v, softmax_scale, learnable_sink)
    batch, seqlen_q, heads_q, _ = q.shape
    out = q.new_empty((batch, seqlen_q, heads_q, v.shape[-1]))
    lse = q.new_empty((batch, heads_q, seqlen_q), dtype=torch.float32)
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
        learnable_sink: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    dout = _normalize_dout(dout)
    if dout.data_ptr() % 16 != 0:
        dout = dout.clone(memory_format=torch.contiguous_format)
    grads = interface.backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=softmax_scale,
                               deterministic=deterministic, window_size=(window_left, window_right),
                               softcap=softcap, attention_chunk=attention_chunk, learnable_sink=learnable_sink)
    if learnable_sink is None:
        return (*grads, _no_dsink(q))
    return grads


@bwd.register_fake
def _bwd_fake(dout, q, k, v, out, lse, softmax_scale=None, causal=False, deterministic=False, window_left=-1,
              window_right=-1, softcap=0.0, attention_chunk=0, learnable_sink=None):
    interface.check_mask_args(causal, (window_left, window_right), softcap, attention_chunk)
    interface.check_backward_args(dout, q, k, v, out, lse, softmax_scale, check_dout_layout=False,
                                  learnable_sink=learnable_sink)
    if learnable_sink is None:
        dsink = _no_dsink(q)
    else:
        dsink = q.new_empty((q.shape[2],), dtype=torch.float32)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dsink


def _setup_context(ctx, inputs, output):
    (q, k, v, softmax_scale, causal, deterministic, window_left, window_right, softcap, attention_chunk,
     learnable_sink) = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, learnable_sink)
    ctx.softmax_scale = softmax_scale
    ctx.causal = causal
    ctx.deterministic = deterministic
    ctx.window_left = window_left
    ctx.window_right = window_right
    ctx.softcap = softcap
    ctx.attention_chunk = attention_chunk
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)  # no zero-filled gradient for lse


def _backward(ctx, dout, dlse):
    if dout is None:
        return (None,) * _NUM_FWD_INPUTS
    q, k, v, out, lse, learnable_sink = ctx.saved_tensors
    deterministic = bool(ctx.deterministic) or torch.are_deterministic_algorithms_enabled()
    dq, dk, dv, dsink = bwd(dout, q, k, v, out, lse, ctx.softmax_scale, ctx.causal, deterministic,
                            ctx.window_left, ctx.window_right, ctx.softcap, ctx.attention_chunk, learnable_sink)
    sink_grad = dsink if learnable_sink is not None and ctx.needs_input_grad[_SINK_INPUT] else None
    return dq, dk, dv, None, None, None, None, None, None, None, sink_grad


fwd.register_autograd(_backward, setup_context=_setup_context)
