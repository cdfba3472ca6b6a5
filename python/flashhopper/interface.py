"""PyTorch tensors -> the C ABI's parameter structs -> one library call."""
import ctypes

import torch

from . import _ffi

_DTYPES = {torch.bfloat16: _ffi.DTYPE_BF16, torch.float16: _ffi.DTYPE_FP16, torch.float32: _ffi.DTYPE_FP32}


def _view(t: torch.Tensor) -> _ffi.Tensor:
    if t.dtype not in _DTYPES:
        raise ValueError(f"dtype {t.dtype} is not supported (bf16, fp16)")
    return _ffi.make_tensor(t.data_ptr(), _DTYPES[t.dtype], t.shape, t.stride())


def _require_cuda(named) -> None:
    for name, t in named:
        if not t.is_cuda:
            raise ValueError(f"{name}: must be a CUDA tensor, got device {t.device}")


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
            softmax_scale: float | None = None, out: torch.Tensor | None = None,
            return_lse: bool = False):
    """Attention forward. q [B, sq, Hq, d], k [B, sk, Hkv, d], v [B, sk, Hkv, dv] on one CUDA
    device. Returns out [B, sq, Hq, dv] (and lse [B, Hq, sq] float32 when return_lse)."""
    _require_cuda((("q", q), ("k", k), ("v", v)))
    batch, seqlen_q, heads_q, _ = q.shape
    if out is None:
        out = torch.empty((batch, seqlen_q, heads_q, v.shape[-1]), dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, heads_q, seqlen_q), dtype=torch.float32, device=q.device) if return_lse else None
    params = _ffi.ForwardParams()
    lib = _ffi.lib()
    lib.fh_forward_params_init(ctypes.byref(params))
    params.q, params.k, params.v, params.out = _view(q), _view(k), _view(v), _view(out)
    if lse is not None:
        params.lse = _view(lse)
    params.causal = int(causal)
    params.softmax_scale = 0.0 if softmax_scale is None else float(softmax_scale)
    workspace_bytes = ctypes.c_size_t(0)
    _ffi.check(lib.fh_forward_workspace_size(ctypes.byref(params), ctypes.byref(workspace_bytes)))
    workspace = torch.empty(workspace_bytes.value, dtype=torch.uint8, device=q.device) if workspace_bytes.value else None
    stream = torch.cuda.current_stream(q.device).cuda_stream
    with torch.cuda.device(q.device):
        _ffi.check(lib.fh_forward(ctypes.byref(params), workspace.data_ptr() if workspace is not None else None,
                                  workspace_bytes.value, stream))
    return (out, lse) if return_lse else out


def backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
             lse: torch.Tensor, causal: bool = False, softmax_scale: float | None = None,
             deterministic: bool = False, dq: torch.Tensor | None = None, dk: torch.Tensor | None = None,
             dv: torch.Tensor | None = None):
    """Attention backward. q, k, v, out and lse [B, Hq, sq] float32 as from
    forward(..., return_lse=True) with the same causal and softmax_scale; dout like out.
    Returns (dq, dk, dv), shaped like q, k, v (allocated with empty_like when not given)."""
    named = [("dout", dout), ("q", q), ("k", k), ("v", v), ("out", out), ("lse", lse)]
    named += [(name, t) for name, t in (("dq", dq), ("dk", dk), ("dv", dv)) if t is not None]
    _require_cuda(named)
    dq = torch.empty_like(q) if dq is None else dq
    dk = torch.empty_like(k) if dk is None else dk
    dv = torch.empty_like(v) if dv is None else dv
    params = _ffi.BackwardParams()
    lib = _ffi.lib()
    lib.fh_backward_params_init(ctypes.byref(params))
    params.q, params.k, params.v, params.out = _view(q), _view(k), _view(v), _view(out)
    params.dout, params.lse = _view(dout), _view(lse)
    params.dq, params.dk, params.dv = _view(dq), _view(dk), _view(dv)
    params.causal = int(causal)
    params.softmax_scale = 0.0 if softmax_scale is None else float(softmax_scale)
    params.deterministic = int(deterministic)
    workspace_bytes = ctypes.c_size_t(0)
    _ffi.check(lib.fh_backward_workspace_size(ctypes.byref(params), ctypes.byref(workspace_bytes)))
    workspace = torch.empty(workspace_bytes.value, dtype=torch.uint8, device=q.device) if workspace_bytes.value else None
    stream = torch.cuda.current_stream(q.device).cuda_stream
    with torch.cuda.device(q.device):
        _ffi.check(lib.fh_backward(ctypes.byref(params), workspace.data_ptr() if workspace is not None else None,
                                   workspace_bytes.value, stream))
    return dq, dk, dv
