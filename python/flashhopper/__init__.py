"""FlashHopper: fused exact attention for Hopper GPUs (H100/H200).

A thin layer over the library's C ABI (ctypes; nothing compiled against PyTorch):

- FlashAttention-3's API: flash_attn_func and flash_attn_varlen_func (packed variable-length
  sequences; both with autograd, torch.compile, CUDA graphs), flash_attn_qkvpacked_func;
  flash_attn_with_kvcache and flash_attn_combine exist with FA3's signatures but raise
  NotImplementedError for now.
  `import flashhopper.flash_attn_interface as fa3` stands in for `import flash_attn_interface`.
- Custom ops torch.ops.flashhopper.fwd / torch.ops.flashhopper.bwd (flashhopper.ops).
- forward / backward: plain calls without autograd (used by the benchmark); varlen=Varlen(...)
  selects the packed layout.
- use_as_sdpa_flash_backend(): FlashHopper behind torch.nn.functional.scaled_dot_product_attention's
  FLASH backend.
- compiled_families(): the kernel families (pass, dtype, head dims) the loaded library has.
- python -m flashhopper.bench: side-by-side benchmark against PyTorch SDPA.
"""
from ._ffi import FlashHopperError
from .interface import (FlashHopperInvalidArgument, FlashHopperNotSupported, KernelFamily, Varlen, backward,
                        compiled_families, forward)
from . import ops  # registers torch.ops.flashhopper.fwd / bwd
from . import flash_attn_interface
from .flash_attn_interface import (
    flash_attn_combine,
    flash_attn_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_with_kvcache,
)
from .sdpa import restore_sdpa_flash_backend, use_as_sdpa_flash_backend

__all__ = [
    "flash_attn_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_with_kvcache",
    "flash_attn_combine",
    "forward",
    "backward",
    "Varlen",
    "compiled_families",
    "KernelFamily",
    "use_as_sdpa_flash_backend",
    "restore_sdpa_flash_backend",
    "FlashHopperError",
    "FlashHopperInvalidArgument",
    "FlashHopperNotSupported",
]
