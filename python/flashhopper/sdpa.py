"""FlashHopper as the kernel behind torch.nn.functional.scaled_dot_product_attention's FLASH backend.

PyTorch (torch.nn.attention, since about 2.9/2.10) has a registry for this:
register_flash_attention_impl(name, register_fn=...) and activate_flash_attention_impl(name); the
register function overrides the CUDA kernels of aten::_scaled_dot_product_flash_attention and its
backward through torch.library (PyTorch's own FA3/FA4 adapters in torch/nn/attention/_fa3.py and
_fa4.py do exactly this). use_as_sdpa_flash_backend() registers "FlashHopper" there and activates it;
on a PyTorch without the registry it installs the same overrides directly. Nothing is activated
on import.

After activation, SDPA calls that PyTorch routes to its FLASH backend (its own rules decide:
fp16/bf16, head dim <= 256, no attention mask, ...; force it with
torch.nn.attention.sdpa_kernel(SDPBackend.FLASH_ATTENTION)) run FlashHopper's forward and backward.
A call FlashHopper cannot run (dropout_p > 0, return_debug_mask, a dtype or head dim this build
lacks) raises RuntimeError naming the reason, as PyTorch's FA3/FA4 adapters do: pick another SDPA
backend for those, or call restore_sdpa_flash_backend().
"""
import torch

from . import interface

IMPL_NAME = "FlashHopper"

_active_handle = None


class _Handle:
    """Keeps the torch.library overrides alive; remove() drops them (PyTorch's kernel is back)."""

    def __init__(self, library):
        self.library = library

    def remove(self) -> None:
        global _active_handle
        if self.library is not None:
            destroy = getattr(self.library, "_destroy", None)
            if destroy is not None:
                destroy()
            self.library = None
        if _active_handle is self:
            _active_handle = None


def _unsupported(reason: str):
    raise RuntimeError(f"FlashHopper SDPA flash backend: {reason}; use another SDPA backend "
                       "(torch.nn.attention.sdpa_kernel) or flashhopper.restore_sdpa_flash_backend()")


def _sdpa_forward(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
    if dropout_p != 0.0:
        _unsupported(f"dropout_p={dropout_p} (FlashHopper has no dropout)")
    if return_debug_mask:
        _unsupported("return_debug_mask=True")
    if is_causal and query.shape[-2] != key.shape[-2]:
        # SDPA's is_causal aligns the mask top-left; FlashHopper's causal aligns it bottom-right.
        _unsupported(f"is_causal with seqlen_q {query.shape[-2]} != seqlen_k {key.shape[-2]} (SDPA aligns that "
                     "mask top-left, FlashHopper bottom-right)")
    # SDPA's layout is [B, H, S, D]; FlashHopper's is [B, S, H, D]: transposed views, no copies.
    out_bhsd = torch.empty((*query.shape[:-1], value.shape[-1]), dtype=query.dtype, device=query.device)
    try:
        _, lse = interface.forward(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                                   causal=bool(is_causal), softmax_scale=scale, out=out_bhsd.transpose(1, 2),
                                   return_lse=True)
    except (ValueError, NotImplementedError) as error:
        _unsupported(str(error))
    rng_state = torch.zeros((2,), dtype=torch.uint64, device=query.device)
    unused = torch.zeros((), dtype=torch.uint64, device=query.device)
    debug_mask = torch.empty(0, dtype=query.dtype, device=query.device)
    return out_bhsd, lse, None, None, query.shape[2], key.shape[2], rng_state, unused, debug_mask


def _sdpa_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                   is_causal, philox_seed, philox_offset, *, scale=None):
    if dropout_p != 0.0:
        _unsupported(f"dropout_p={dropout_p} (FlashHopper has no dropout)")
    dq, dk, dv = (torch.empty_like(t) for t in (query, key, value))
    dout = grad_out.transpose(1, 2)
    if not interface.layout_ok(dout) or dout.data_ptr() % 16 != 0:
        dout = grad_out.contiguous().transpose(1, 2)
    try:
        interface.backward(dout, query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                           out.transpose(1, 2), logsumexp, causal=bool(is_causal), softmax_scale=scale,
                           deterministic=torch.are_deterministic_algorithms_enabled(),
                           dq=dq.transpose(1, 2), dk=dk.transpose(1, 2), dv=dv.transpose(1, 2))
    except (ValueError, NotImplementedError) as error:
        _unsupported(str(error))
    return dq, dk, dv


def _register() -> _Handle:
    library = torch.library.Library("aten", "IMPL", "CUDA")
    library.impl("_scaled_dot_product_flash_attention", _sdpa_forward, "CUDA")
    library.impl("_scaled_dot_product_flash_attention_backward", _sdpa_backward, "CUDA")
    global _active_handle
    _active_handle = _Handle(library)
    return _active_handle


def use_as_sdpa_flash_backend() -> None:
    """Make FlashHopper the kernel of SDPA's FLASH backend (until restore_sdpa_flash_backend()).

    Uses torch.nn.attention.register_flash_attention_impl / activate_flash_attention_impl when this
    PyTorch has them (name "FlashHopper"), else installs the same torch.library overrides directly.
    Only the dense SDPA ops are overridden (aten::_scaled_dot_product_flash_attention and its
    backward), not aten::_flash_attention_forward (varlen/nested), which FlashHopper cannot run yet.
    """
    attention = torch.nn.attention
    register = getattr(attention, "register_flash_attention_impl", None)
    activate = getattr(attention, "activate_flash_attention_impl", None)
    if register is not None and activate is not None:
        register(IMPL_NAME, register_fn=_register)
        activate(IMPL_NAME)
    else:
        restore_sdpa_flash_backend()
        _register()


def restore_sdpa_flash_backend() -> None:
    """Give SDPA's FLASH backend back to PyTorch's own kernel."""
    attention = torch.nn.attention
    current = getattr(attention, "current_flash_attention_impl", None)
    if current is not None and current() == IMPL_NAME:
        from torch.nn.attention import _registry
        _registry.restore_flash_attention_impl()
    if _active_handle is not None:
        _active_handle.remove()


def sdpa_flash_backend_active() -> bool:
    return _active_handle is not None
