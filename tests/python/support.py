"""Shared pieces of the Python tests (imported by the test files): the GPU skip rule and a
small attention reference.

Run: PYTHONPATH=python FLASHHOPPER_LIBRARY=build/libflashhopper.so python -m pytest tests/python -q -rs
The CPU tests never load the library; the GPU tests skip (with the reason) unless PyTorch sees an
sm_90 GPU and the library loads with its CUDA kernels."""
import functools

import pytest
import torch


@functools.lru_cache(maxsize=None)
def gpu_skip_reason():
    """None when the GPU tests can run, else why not."""
    if not torch.cuda.is_available():
        return "no CUDA device visible to PyTorch (torch.cuda.is_available() is False)"
    capability = torch.cuda.get_device_capability()
    if capability != (9, 0):
        return f"FlashHopper's kernels need an sm_90 GPU (H100/H200); this one is sm_{capability[0]}{capability[1]}"
    try:
        from flashhopper import _ffi
        lib = _ffi.lib()
    except OSError as error:
        return f"libflashhopper could not be loaded ({error}); set FLASHHOPPER_LIBRARY"
    if not lib.fh_built_with_cuda():
        return "libflashhopper was built without CUDA kernels (FLASHHOPPER_CUDA=OFF)"
    return None


def requires_gpu(fn):
    """Skips at run time (so that collecting the tests never touches CUDA)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        reason = gpu_skip_reason()
        if reason is not None:
            pytest.skip(reason)
        return fn(*args, **kwargs)
    return wrapper


def attention_reference(q, k, v, causal=False, softmax_scale=None, dtype=None):
    """softmax(q k^T * scale + mask) v with FlashAttention's conventions, computed in `dtype`
    (float64 for the reference, the input dtype for the "plain PyTorch" comparison).

    q [B, sq, Hq, d], k/v [B, sk, Hkv, d]; GQA by repeat_interleave; causal aligned bottom-right
    (query i sees key j iff j <= i + sk - sq). Rows that see no key give out 0 and lse -inf, and no
    NaN anywhere (also in autograd). Returns out [B, sq, Hq, d] and lse [B, Hq, sq]."""
    dtype = dtype or q.dtype
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    group = q.shape[2] // k.shape[2]
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    qh = q.to(dtype).transpose(1, 2)                                     # [B, Hq, sq, d]
    kh = k.to(dtype).repeat_interleave(group, dim=2).transpose(1, 2)     # [B, Hq, sk, d]
    vh = v.to(dtype).repeat_interleave(group, dim=2).transpose(1, 2)
    scores = (qh * scale) @ kh.transpose(-1, -2)                         # [B, Hq, sq, sk]
    if causal:
        rows = torch.arange(seqlen_q, device=q.device)[:, None]
        cols = torch.arange(seqlen_k, device=q.device)[None, :]
        visible = cols <= rows + (seqlen_k - seqlen_q)
        scores = scores.masked_fill(~visible, float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True).detach()
    row_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
    exp = torch.exp(scores - row_max)
    denom = exp.sum(dim=-1, keepdim=True)
    probs = exp / torch.where(denom == 0, torch.ones_like(denom), denom)
    out = (probs @ vh).transpose(1, 2)                                   # [B, sq, Hq, d]
    lse = (torch.log(denom) + row_max).squeeze(-1)                       # log(0) = -inf for empty rows
    return out, lse
