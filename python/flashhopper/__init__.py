"""FlashHopper: fused exact attention for Hopper GPUs (H100/H200).

A thin layer over the library's C ABI: PyTorch tensors in, PyTorch tensors out, on PyTorch's
current stream. The full FlashAttention-compatible package (autograd, torch.compile) is its
own piece of work; this module is what the benchmarks and tests call today."""
from ._ffi import FlashHopperError
from .interface import backward, forward

__all__ = ["forward", "backward", "FlashHopperError"]
