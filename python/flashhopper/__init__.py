"""FlashHopper: fused exact attention for Hopper GPUs (H100/H200).

A thin layer over the library's C ABI (ctypes; the ops also in C++ where libflashhopper_torch.so was built):

- FlashAttention-3's API: flash_attn_func and flash_attn_varlen_func (packed variable-length
  sequences; both with autograd, torch.compile, CUDA graphs), flash_attn_qkvpacked_func;
  flash_attn_combine (split-KV partials); flash_attn_with_kvcache (a dense or paged cache, with
  the append, rotary and split-KV; pages of 16 keys or a multiple).
  `import flashhopper.flash_attn_interface as fa3` stands in for `import flash_attn_interface`.
- Custom ops torch.ops.flashhopper.fwd / torch.ops.flashhopper.bwd (flashhopper.ops).
- forward / backward: plain calls without autograd (used by the benchmark); varlen=Varlen(...)
  selects the packed layout.
- use_as_sdpa_flash_backend(): FlashHopper behind torch.nn.functional.scaled_dot_product_attention's
  FLASH backend.
- compiled_families(): the kernel families (pass, dtype, head dims) the loaded library has;
  is_available() (can the kernels run here?), build_info() (version, library, families, GPU).
- Errors: every refusal is a FlashHopperError (a RuntimeError) and also ValueError
  (FlashHopperInvalidArgument) or NotImplementedError (FlashHopperNotSupported).
- python -m flashhopper.bench: side-by-side benchmark against PyTorch SDPA.
- flashhopper.distributed: attention over a sequence sharded across torch.distributed ranks
  (ring_attention; docs/context_parallel.md).
"""
from ._ffi import FlashHopperError


def _version() -> str:
    """The one version, CMakeLists.txt's project(VERSION): read there in a checkout, else from the
    installed distribution's metadata (the wheel takes it from the same line)."""
    import pathlib
    import re
    cmake = pathlib.Path(__file__).resolve().parents[2] / "CMakeLists.txt"
    if cmake.is_file():
        match = re.search(r"project\([^)]*VERSION\s+([0-9][0-9.]*)", cmake.read_text())
        if match:
            return match.group(1)
    try:
        from importlib.metadata import version
        return version("flashhopper")
    except Exception:
        return "unknown"


__version__ = _version()
try:
    import torch as _torch  # noqa: F401
except ImportError as _error:
    raise ImportError("flashhopper's Python API runs on PyTorch, which is not installed: pip install torch "
                      "(or pip install 'flashhopper[torch]')") from _error
from .interface import (FlashHopperInvalidArgument, FlashHopperNotSupported, KernelFamily, Varlen, backward,
                        build_info, compiled_families, forward, is_available)
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
    "is_available",
    "build_info",
    "__version__",
    "KernelFamily",
    "use_as_sdpa_flash_backend",
    "restore_sdpa_flash_backend",
    "FlashHopperError",
    "FlashHopperInvalidArgument",
    "FlashHopperNotSupported",
]
