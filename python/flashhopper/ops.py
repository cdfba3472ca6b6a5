"""torch.library custom ops over the C ABI, so that autograd, torch.compile (fullgraph) and CUDA
graphs see one opaque op per pass:

    torch.ops.flashhopper.fwd(q, k, v, softmax_scale=None, causal=False, deterministic=False)
        -> (out [B, sq, Hq, d], lse [B, Hq, sq] float32)
    torch.ops.flashhopper.bwd(dout, q, k, v, out, lse, softmax_scale=None, causal=False,
                              deterministic=False) -> (dq, dk, dv)

fwd's `deterministic` does nothing in the forward (which is always deterministic); autograd hands
it to bwd (or'ed with torch.are_deterministic_algorithms_enabled()). lse is marked
non-differentiable: a loss that uses it gets no gradient through it (FlashAttention-3 drops that
gradient silently). Both ops allocate their outputs with PyTorch's caching allocator and launch on
torch.cuda.current_stream(); neither synchronises with the host. bwd accepts dout in any layout
(autograd may hand over an expanded or unaligned one) and copies it when the kernels need that;
every other argument must already satisfy the kernels' layout rules (see interface.py).
"""
from typing import Optional

import torch

from . import interface

Tensor = torch.Tensor


@torch.library.custom_op("flashhopper::fwd", mutates_args=())
def fwd(q: Tensor, k: Tensor, v: Tensor, softmax_scale: Optional[float] = None, causal: bool = False,
        deterministic: bool = False) -> tuple[Tensor, Tensor]:
    out, lse = interface.forward(q, k, v, causal=causal, softmax_scale=softmax_scale, return_lse=True)
    return out, lse


@fwd.register_fake
def _fwd_fake(q, k, v, softmax_scale=None, causal=False, deterministic=False):
    interface.check_forward_args(q, k, v, softmax_scale)
    batch, seqlen_q, heads_q, _ = q.shape
    out = q.new_empty((batch, seqlen_q, heads_q, v.shape[-1]))
    lse = q.new_empty((batch, heads_q, seqlen_q), dtype=torch.float32)
    return out, lse


def _normalize_dout(dout: Tensor) -> Tensor:
    if not interface.layout_ok(dout):
        return dout.contiguous()
    return dout


@torch.library.custom_op("flashhopper::bwd", mutates_args=())
def bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
        softmax_scale: Optional[float] = None, causal: bool = False,
        deterministic: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    dout = _normalize_dout(dout)
    if dout.data_ptr() % 16 != 0:
        dout = dout.clone(memory_format=torch.contiguous_format)
    return interface.backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=softmax_scale,
                              deterministic=deterministic)


@bwd.register_fake
def _bwd_fake(dout, q, k, v, out, lse, softmax_scale=None, causal=False, deterministic=False):
    interface.check_backward_args(dout, q, k, v, out, lse, softmax_scale, check_dout_layout=False)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, softmax_scale, causal, deterministic = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.softmax_scale = softmax_scale
    ctx.causal = causal
    ctx.deterministic = deterministic
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)  # no zero-filled gradient for lse


def _backward(ctx, dout, dlse):
    if dout is None:
        return None, None, None, None, None, None
    q, k, v, out, lse = ctx.saved_tensors
    deterministic = bool(ctx.deterministic) or torch.are_deterministic_algorithms_enabled()
    dq, dk, dv = bwd(dout, q, k, v, out, lse, ctx.softmax_scale, ctx.causal, deterministic)
    return dq, dk, dv, None, None, None


fwd.register_autograd(_backward, setup_context=_setup_context)
