"""PyTorch tensors -> the C ABI's parameter structs -> one library call.

`forward` and `backward` are the plain (no autograd) entry points; `flashhopper.ops` wraps them as
torch.library custom ops and `flashhopper.flash_attn_interface` offers FlashAttention-3's API on top.
Both take the dense layout (q [B, sq, Hq, d]) or, given `varlen` (a `Varlen`: cu_seqlens_q/k,
max_seqlen_q/k, seqused_q/k), FlashAttention's packed one (q [total_q, Hq, d], lse [Hq, total_q]).

Argument checks run in this order, each naming the argument: what the kernels cannot do yet
(NotImplementedError), the mask and score options (window_size, softcap, attention_chunk: ValueError),
dtypes, ranks, shapes and strides, learnable_sink's dtype and shape, varlen's dtypes, shapes and
max_seqlen (ValueError), then devices and 16-byte alignment (ValueError); only then the library,
which checks everything again and refuses with FlashHopperError (FlashHopperInvalidArgument is also
a ValueError, FlashHopperNotSupported also a NotImplementedError). Nothing is launched on any error.
The checks here depend only on the tensors' metadata and the options, so they run once per kind of
call (see "Launch plans"); the alignment checks and the library's run on every call.
No call here synchronises with the host (cu_seqlens and seqused are never read here): outputs and
workspace come from PyTorch's caching allocator, the kernels go on PyTorch's current stream, so the
calls can be captured in a CUDA graph."""
import ctypes
import math
import numbers
import struct
from typing import NamedTuple, Optional

import torch

from . import _ffi
from ._ffi import FlashHopperError

_DTYPES = {torch.bfloat16: _ffi.DTYPE_BF16, torch.float16: _ffi.DTYPE_FP16, torch.float32: _ffi.DTYPE_FP32,
           torch.int32: _ffi.DTYPE_INT32}
INPUT_DTYPES = (torch.bfloat16, torch.float16)
_FP8_DTYPES = tuple(getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                                      "float8_e5m2fnuz") if hasattr(torch, name))
# FH_MAX_HEAD_DIM and FH_MAX_SPLITS of include/flashhopper/flashhopper.h (a CPU test compares).
MAX_HEAD_DIM = 256
MAX_SPLITS = 256
_TMA_BYTES = 16  # TMA: base addresses and all strides but the last (which is 1) multiples of 16 bytes
_INT32_MAX = 2**31 - 1
_FLOAT32_MAX = 3.4028234663852886e38
_FLOAT32_HALF_MIN_SUBNORMAL = 2.0 ** -150  # positive values at most this round to 0 in float32

_STATUS_INVALID_ARGUMENT = 1
_STATUS_NOT_SUPPORTED = 2


class FlashHopperInvalidArgument(FlashHopperError, ValueError):
    """The library refused an argument (FH_ERROR_INVALID_ARGUMENT)."""


class FlashHopperNotSupported(FlashHopperError, NotImplementedError):
    """A valid request that this build of the library cannot run (yet) (FH_ERROR_NOT_SUPPORTED),
    e.g. a (dtype, head dim) that a development build did not compile."""


# Every refusal, from the library or from the checks here, is a FlashHopperError (a RuntimeError,
# which FA3 callers catch) and also the builtin type it stands for: ValueError for a bad argument,
# NotImplementedError for what FlashHopper cannot do (yet).
def invalid_argument(message: str) -> FlashHopperInvalidArgument:
    return FlashHopperInvalidArgument(_STATUS_INVALID_ARGUMENT, message)


def not_supported(message: str) -> FlashHopperNotSupported:
    return FlashHopperNotSupported(_STATUS_NOT_SUPPORTED, message)


def library_error(status: int, message: str) -> FlashHopperError:
    """The exception for a library status (non-zero) and its message."""
    if status == _STATUS_INVALID_ARGUMENT:
        return FlashHopperInvalidArgument(status, message)
    if status == _STATUS_NOT_SUPPORTED:
        return FlashHopperNotSupported(status, message)
    return FlashHopperError(status, message)


def _check(status: int) -> None:
    if status != 0:
        raise library_error(status, _ffi.lib().fh_last_error().decode())


class KernelFamily(NamedTuple):
    """A compiled kernel family: one pass ("forward" or "backward") for one dtype and (head dim,
    value head dim). A call runs on its pass and dtype's family with the smallest head dim (then
    value head dim) at least its own."""
    pass_: str
    dtype: torch.dtype
    head_dim: int
    head_dim_v: int


def compiled_families() -> list:
    """The kernel families the loaded library compiled (none without CUDA), as KernelFamily."""
    lib = _ffi.lib()
    count = lib.fh_compiled_families(None, 0)
    families = (_ffi.KernelFamilyStruct * max(count, 1))()
    lib.fh_compiled_families(families, count)
    dtypes = {code: dtype for dtype, code in _DTYPES.items()}
    return [KernelFamily("backward" if f.backward else "forward", dtypes[f.dtype], f.head_dim, f.head_dim_v)
            for f in families[:count]]


def is_available() -> bool:
    """True when the kernels can run here: the library loads and has its CUDA kernels, and PyTorch
    sees an sm_90 GPU (H100/H200) as its current device. Never raises."""
    try:
        if not _ffi.lib().fh_built_with_cuda():
            return False
        return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
    except Exception:
        return False


def build_info() -> dict:
    """What the loaded library is: its version, its path, whether it has CUDA kernels and which
    families (compiled_families()), and the GPU PyTorch sees (None without one)."""
    lib = _ffi.lib()
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {"version": lib.fh_version().decode(), "library": lib._name, "cuda_kernels": bool(lib.fh_built_with_cuda()),
            "families": compiled_families(), "gpu": gpu, "available": is_available()}


class Varlen(NamedTuple):
    """The packed (variable-length) layout, FlashAttention's varlen: q [total_q, Hq, d] and k/v
    [total_k, Hkv, d] hold B sequences, sequence b being the rows cu_seqlens[b] .. cu_seqlens[b+1] - 1
    (cu_seqlens_q/k: int32 [B + 1] on q's device). max_seqlen_q/k bound the lengths; FA3's rule "a
    window bound covering the whole sequence is no bound" is judged against them. seqused_q/k (None
    or int32 [B]) let only the first seqused[b] tokens of sequence b take part: its other rows get
    out 0, lse -inf and zero gradients. That cu_seqlens is non-decreasing within [0, total], every
    length at most max_seqlen and seqused[b] at most sequence b's length is the caller's contract,
    not checked (that would copy the tensors to the host); tokens outside every sequence are
    neither read nor written."""
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    seqused_q: Optional[torch.Tensor] = None
    seqused_k: Optional[torch.Tensor] = None


def as_varlen(cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, seqused_q=None,
              seqused_k=None) -> Optional[Varlen]:
    """The custom ops' flat varlen arguments as a Varlen, or None (the dense layout) when none is
    given; a partial set is a Varlen too, which check_varlen refuses naming what is missing."""
    args = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k)
    return None if all(arg is None for arg in args) else Varlen(*args)


def varlen_tensors(varlen: Optional[Varlen]) -> list:
    """(name, tensor) of varlen's tensors, for the device checks; [] for the dense layout."""
    if varlen is None:
        return []
    return [("cu_seqlens_q", varlen.cu_seqlens_q), ("cu_seqlens_k", varlen.cu_seqlens_k),
            ("seqused_q", varlen.seqused_q), ("seqused_k", varlen.seqused_k)]


def _layout(varlen: Optional[Varlen]):
    """(rank, q's dims, k's and v's dims, lse's dims) of the dense or the packed layout."""
    if varlen is None:
        return (4, "[batch, seqlen_q, heads_q, head_dim]", "[batch, seqlen_k, heads_kv, head_dim]",
                "[batch, heads_q, seqlen_q]")
    return 3, "[total_q, heads_q, head_dim]", "[total_k, heads_kv, head_dim]", "[heads_q, total_q]"


def lse_shape(q: torch.Tensor) -> tuple:
    """lse's shape: [B, Hq, sq] for q [B, sq, Hq, d], [Hq, total_q] for packed q [total_q, Hq, d]."""
    if q.dim() == 4:
        return q.shape[0], q.shape[2], q.shape[1]
    return q.shape[1], q.shape[0]


# ---------------------------------------------------------------------------------------------
# Checks on metadata only (dtype, shape, strides): they work on fake tensors (torch.compile) and on
# CPU tensors, so they run first.

def _check_input(name: str, t, rank: int, layout: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise invalid_argument(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype in _FP8_DTYPES:
        raise not_supported(f"{name}: dtype {t.dtype}: fp8 attention is not supported by FlashHopper "
                                  "yet (bfloat16 or float16)")
    if t.dtype not in INPUT_DTYPES:
        raise invalid_argument(f"{name}: dtype {t.dtype} is not supported (torch.bfloat16 or torch.float16)")
    if t.dim() != rank:
        raise invalid_argument(f"{name}: expected {rank} dims {layout}, got shape {tuple(t.shape)}")


def check_layout(name: str, t: torch.Tensor) -> None:
    """Last dim contiguous, other strides multiples of 16 bytes (what the kernels' TMA loads need)."""
    strides = t.stride()  # once: each call crosses into C++ (host work per call)
    if strides[-1] != 1:
        raise invalid_argument(f"{name}: the last dim must be contiguous (stride 1), got strides {tuple(strides)}; "
                         "call .contiguous()")
    granule = _TMA_BYTES // t.element_size()
    for dim, stride in enumerate(strides[:-1]):
        if stride % granule != 0:
            raise invalid_argument(f"{name}: stride[{dim}] is {stride}, not a multiple of {granule} elements "
                             f"(16 bytes), got strides {tuple(strides)}; call .contiguous()")


def layout_ok(t: torch.Tensor) -> bool:
    """True when `t` passes check_layout and no stride is 0 on a dim of more than one element."""
    if t.stride(-1) != 1:
        return False
    granule = _TMA_BYTES // t.element_size()
    return all(t.stride(d) % granule == 0 and (t.stride(d) != 0 or t.shape[d] <= 1) for d in range(t.dim() - 1))


def check_forward_args(q, k, v, softmax_scale=None, learnable_sink=None, varlen=None) -> None:
    """Dtypes, ranks, shapes, strides, softmax_scale, learnable_sink's dtype and shape, and varlen's
    metadata when given (the packed layout: check_varlen); no device access."""
    rank, q_dims, kv_dims, _ = _layout(varlen)
    _check_input("q", q, rank, q_dims)
    _check_input("k", k, rank, kv_dims)
    _check_input("v", v, rank, kv_dims)
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise invalid_argument(
                f"{name}: dtype {t.dtype} differs from q's {q.dtype}; q, k and v must have one dtype")
    q_shape, k_shape, v_shape = q.shape, k.shape, v.shape  # once each (host work per call)
    heads_q, head_dim = q_shape[-2], q_shape[-1]
    if varlen is None and k_shape[0] != q_shape[0]:
        raise invalid_argument(f"k: batch size {k_shape[0]} differs from q's {q_shape[0]} (shapes q {tuple(q_shape)}, "
                         f"k {tuple(k_shape)})")
    if v_shape[:-1] != k_shape[:-1]:
        raise invalid_argument(
            f"v: shape {tuple(v_shape)} must match k's {tuple(k_shape)} in all dims but the head dim")
    if k_shape[-1] != head_dim:
        raise invalid_argument(f"k: head dim {k_shape[-1]} differs from q's {head_dim}")
    granule = _TMA_BYTES // q.element_size()
    for name, what, dim in (("q", "head dim", head_dim), ("v", "value head dim", v_shape[-1])):
        if dim > MAX_HEAD_DIM:
            raise invalid_argument(f"{name}: {what} {dim} is larger than {MAX_HEAD_DIM}")
        if dim % granule != 0:
            raise invalid_argument(f"{name}: {what} {dim} is not a multiple of {granule} (flash_attn_func pads it; "
                             "the plain calls do not)")
    heads_kv = k_shape[-2]
    if heads_kv == 0 or heads_q % heads_kv != 0:
        hint = ""
        if varlen is None and q.dim() == 4 and k_shape[1] > 0 and q_shape[1] % k_shape[1] == 0:
            # [B, H, S, D] (PyTorch SDPA's layout) read as FA3's [B, S, H, D] looks exactly so.
            hint = ("; if these are [batch, heads, seqlen, head_dim] (PyTorch SDPA's layout), pass "
                    "q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2): flash_attn_func takes "
                    "[batch, seqlen, heads, head_dim]")
        raise invalid_argument(f"k: {heads_kv} key/value heads do not divide q's {heads_q} query heads (GQA/MQA "
                               f"needs heads_q % heads_kv == 0){hint}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_layout(name, t)
    check_softmax_scale(softmax_scale)
    check_learnable_sink(learnable_sink, heads_q)
    if varlen is not None:
        check_varlen(varlen)


def _check_contiguous_vector(name: str, t: torch.Tensor) -> None:
    """The library reads 1-d tensors (sinks, sequence lengths) as rows: stride 1."""
    if t.shape[0] > 1 and t.stride(0) != 1:
        raise invalid_argument(f"{name}: must be contiguous (stride 1), got stride {t.stride(0)}; call .contiguous()")


def _check_int32_vector(name: str, t, length, what: str) -> None:
    """An int32 1-d tensor of `length` entries (None: any), contiguous; `what` its expected shape."""
    expected = f"an int32 tensor of shape {what}"
    if not isinstance(t, torch.Tensor):
        raise invalid_argument(f"{name}: expected {expected}, got {type(t).__name__}")
    if t.dtype != torch.int32 or t.dim() != 1 or (length is not None and t.shape[0] != length):
        raise invalid_argument(f"{name}: expected {expected}, got dtype {t.dtype} shape {tuple(t.shape)}")
    _check_contiguous_vector(name, t)


def check_varlen(varlen: Varlen) -> None:
    """cu_seqlens_q/k int32 [B + 1] with B >= 1, seqused_q/k None or int32 [B], max_seqlen_q/k ints
    in [1, INT32_MAX]. The tensors' values are the caller's contract (see Varlen): reading them
    would synchronise with the host."""
    _check_int32_vector("cu_seqlens_q", varlen.cu_seqlens_q, None, "[batch + 1] (prefix sums of the lengths)")
    entries = varlen.cu_seqlens_q.shape[0]
    if entries < 2:
        raise invalid_argument(f"cu_seqlens_q: shape ({entries},) is too short; it holds batch + 1 prefix sums, so at "
                         "least 2 entries")
    _check_int32_vector("cu_seqlens_k", varlen.cu_seqlens_k, entries, f"[batch + 1] = ({entries},), as cu_seqlens_q")
    for name, t in (("seqused_q", varlen.seqused_q), ("seqused_k", varlen.seqused_k)):
        if t is not None:
            _check_int32_vector(name, t, entries - 1, f"[batch] = ({entries - 1},) (tokens used per sequence)")
    for name, value in (("max_seqlen_q", varlen.max_seqlen_q), ("max_seqlen_k", varlen.max_seqlen_k)):
        length = _int_option(name, value, "the longest sequence's length")
        if length < 1 or length > _INT32_MAX:
            raise invalid_argument(f"{name}: {length} must be in [1, {_INT32_MAX}] (an int32 in the C ABI)")


def check_learnable_sink(learnable_sink, heads_q) -> None:
    """learnable_sink: None, or one float32 logit per query head, [heads_q], contiguous."""
    if learnable_sink is None:
        return
    expected = f"a torch.float32 tensor of shape [heads_q] = ({heads_q},) (one logit per query head)"
    if not isinstance(learnable_sink, torch.Tensor):
        raise invalid_argument(f"learnable_sink: expected None or {expected}, got {type(learnable_sink).__name__}")
    if (learnable_sink.dtype != torch.float32 or learnable_sink.dim() != 1
            or learnable_sink.shape[0] != heads_q):
        raise invalid_argument(f"learnable_sink: expected {expected}, got dtype {learnable_sink.dtype} shape "
                         f"{tuple(learnable_sink.shape)}")
    _check_contiguous_vector("learnable_sink", learnable_sink)


def _int_option(name: str, value, what: str) -> int:
    """An int-like value (int, numpy integer; not bool, float or tensor) as an int, or ValueError
    naming `name`. A SymInt (torch.compile) is returned as it is: int() would specialise it, one
    recompile per value (max_seqlen changes from batch to batch)."""
    if type(value) is int:  # the common case, without the ABC checks below (host work per call)
        return value
    if isinstance(value, (bool, torch.Tensor)) or not isinstance(value, (numbers.Integral, torch.SymInt)):
        raise invalid_argument(f"{name}: {what} must be an int, got {type(value).__name__} {value!r}")
    return value if isinstance(value, torch.SymInt) else int(value)


def _host_ints(name: str, t: torch.Tensor, what: str) -> list:
    """The integers of a CPU tensor (FA3 accepts window_size as a tensor pair); a tensor on a GPU is
    refused by name, since reading it would make the call wait for the device."""
    if t.device.type != "cpu":
        raise invalid_argument(f"{name}: {what} is a tensor on {t.device}; reading it would make the call wait for "
                               "the device: pass ints or a CPU tensor")
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise invalid_argument(f"{name}: {what} must be an int, got a {t.dtype} tensor")
    return t.tolist()


def check_window_size(window_size) -> tuple[int, int]:
    """window_size (left, right): ints >= -1, -1 (or None, FlashAttention-4's spelling) unbounded;
    as FA3, also a CPU integer tensor of two elements, or a pair of 0-d ones. Returns the pair as
    ints; None means (-1, -1)."""
    if window_size is None:
        return -1, -1
    if type(window_size) is tuple and len(window_size) == 2:  # the common case, fast (host work per call)
        left, right = window_size
        if type(left) is int and type(right) is int and left >= -1 and right >= -1:
            return left, right
    if isinstance(window_size, torch.Tensor):
        if window_size.dim() != 1 or window_size.numel() != 2:
            raise invalid_argument(f"window_size: expected a pair of ints (left, right), got a tensor of shape "
                                   f"{list(window_size.shape)}")
        window_size = tuple(_host_ints("window_size", window_size, "the pair"))
    if isinstance(window_size, (str, bytes)):
        raise invalid_argument(f"window_size: expected a pair of ints (left, right), got {window_size!r}")
    try:
        bounds = tuple(window_size)
    except TypeError:
        raise invalid_argument(f"window_size: expected a pair of ints (left, right), got {window_size!r}") from None
    if len(bounds) != 2:
        raise invalid_argument(f"window_size: expected a pair of ints (left, right), got {window_size!r}")
    resolved = []
    for side, bound in zip(("left", "right"), bounds):
        if isinstance(bound, torch.Tensor) and bound.dim() == 0:
            bound = _host_ints("window_size", bound, f"the {side} bound")
        bound = -1 if bound is None else _int_option("window_size", bound, f"the {side} bound")
        if bound < -1:
            raise invalid_argument(f"window_size: the {side} bound is {bound}; must be >= -1 (-1 means unbounded), "
                             f"got {window_size!r}")
        resolved.append(bound)
    return resolved[0], resolved[1]


def check_softcap(softcap) -> float:
    """softcap: a finite float >= 0 (0 disables it); scores become softcap * tanh(scores / softcap)."""
    if softcap is None or (type(softcap) is float and softcap == 0.0):  # the common case, fast
        return 0.0
    if isinstance(softcap, (bool, torch.Tensor)) or not isinstance(softcap, numbers.Real):
        raise invalid_argument(f"softcap: must be a Python float >= 0, got {type(softcap).__name__} {softcap!r}")
    # comparisons only (no math.isfinite, no float() of a float): Dynamo traces them as constants
    if softcap != softcap or softcap < 0 or softcap == math.inf:
        raise invalid_argument(f"softcap: {softcap} must be finite and >= 0 (0 disables it)")
    # The C ABI takes a float32 and refuses what is not finite; what it cannot see is a positive
    # value that rounds to 0 there, which would turn the cap off. (Subnormals it takes, as it does.)
    if softcap > _FLOAT32_MAX:
        raise invalid_argument(f"softcap: {softcap} exceeds float32's range (the C ABI's type)")
    if 0 < softcap <= _FLOAT32_HALF_MIN_SUBNORMAL:
        raise invalid_argument(f"softcap: {softcap} rounds to 0 in float32 (the C ABI's type), which would "
                               "turn the cap off; pass 0.0 for no cap")
    return softcap if isinstance(softcap, float) else float(softcap)


def check_attention_chunk(attention_chunk) -> int:
    """attention_chunk: an int >= 0 (0: none); c > 0 lets a row see keys of its own chunk of c only."""
    if attention_chunk is None:
        return 0
    chunk = _int_option("attention_chunk", attention_chunk, "the chunk size")
    if chunk < 0:
        raise invalid_argument(f"attention_chunk: {chunk} must be >= 0 (0 means no chunking)")
    if chunk > _INT32_MAX:
        raise invalid_argument(f"attention_chunk: {chunk} does not fit in int32 (the C ABI's type)")
    return chunk


def check_mask_args(causal, window_size, softcap, attention_chunk):
    """Checks the mask and score options; returns (causal, window_left, window_right, softcap,
    attention_chunk) with FlashAttention-3's rule that causal forces the right bound to 0 (causal
    with window (left, *) is the window (left, 0))."""
    left, right = check_window_size(window_size)
    softcap = check_softcap(softcap)
    chunk = check_attention_chunk(attention_chunk)
    causal = bool(causal)
    if causal:
        right = 0
    return causal, left, right, softcap, chunk


def library_mask(causal: bool, window_left: int, window_right: int, seqlen_q: int, seqlen_k: int):
    """(causal, window_left, window_right) as the C ABI takes them, which refuses causal together
    with a window: FlashAttention's rules, applied by the library (fh_window_from_fa3, their one
    home: a bound that covers the whole sequence is no bound, causal forces right = 0, and the
    window (-1, 0) is causal)."""
    out_causal, out_left, out_right = ctypes.c_int32(), ctypes.c_int64(), ctypes.c_int64()
    huge = 2 ** 62  # any bound past the sequence is none: this keeps Python's ints within int64
    _ffi.lib().fh_window_from_fa3(int(bool(causal)), min(window_left, huge), min(window_right, huge), seqlen_q,
                                  seqlen_k, ctypes.byref(out_causal), ctypes.byref(out_left), ctypes.byref(out_right))
    for side, bound in (("left", out_left.value), ("right", out_right.value)):
        if bound > 2 ** 31 - 1:  # within a sequence longer than that (the library refuses it later)
            raise invalid_argument(f"window_size: the {side} bound {bound} exceeds INT32_MAX")
    return out_causal.value, out_left.value, out_right.value


def _check_plain_int(name: str, value) -> None:
    """An int option whose range is the library's rule: only its type is checked here."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise invalid_argument(f"{name}: expected an int, got {type(value).__name__}")


def check_num_splits(num_splits) -> None:
    """num_splits is an int (the library checks its range)."""
    _check_plain_int("num_splits", num_splits)


def check_sm_margin(sm_margin) -> None:
    """sm_margin is an int (the library checks its range: >= 0, and that the device keeps an SM)."""
    _check_plain_int("sm_margin", sm_margin)


def check_softmax_scale(softmax_scale) -> None:
    if softmax_scale is None:
        return
    if isinstance(softmax_scale, torch.Tensor):
        raise invalid_argument("softmax_scale: must be a Python float or None, not a tensor")
    if softmax_scale != softmax_scale or softmax_scale < 0 or softmax_scale == math.inf:  # NaN, < 0, inf
        raise invalid_argument(f"softmax_scale: {softmax_scale} must be finite and > 0")
    if softmax_scale == 0:
        raise not_supported("softmax_scale: 0.0 is not supported (the C ABI reads 0 as 1/sqrt(head_dim)); "
                                  "pass None for the default")


def check_backward_args(dout, q, k, v, out, lse, softmax_scale=None, check_dout_layout=True,
                        learnable_sink=None, varlen=None) -> None:
    check_forward_args(q, k, v, softmax_scale, learnable_sink, varlen)
    rank, q_dims, _, lse_dims = _layout(varlen)
    expected = (*q.shape[:-1], v.shape[-1])
    for name, t in (("out", out), ("dout", dout)):
        _check_input(name, t, rank, q_dims)
        if t.dtype != q.dtype:
            raise invalid_argument(f"{name}: dtype {t.dtype} differs from q's {q.dtype}")
        if tuple(t.shape) != tuple(expected):
            raise invalid_argument(f"{name}: shape {tuple(t.shape)}, expected {tuple(expected)}")
    check_layout("out", out)
    if check_dout_layout:
        check_layout("dout", dout)
    if not isinstance(lse, torch.Tensor):
        raise invalid_argument(f"lse: expected a torch.Tensor, got {type(lse).__name__}")
    if lse.dtype != torch.float32:
        raise invalid_argument(f"lse: dtype {lse.dtype}, expected torch.float32 (as returned by the forward)")
    expected_lse = tuple(lse_shape(q))
    if tuple(lse.shape) != expected_lse:
        raise invalid_argument(f"lse: shape {tuple(lse.shape)}, expected {lse_dims} = {expected_lse}")


# ---------------------------------------------------------------------------------------------
# Checks that need real tensors: device and alignment.

def check_devices(named) -> None:
    """All CUDA, all on one device."""
    device = None
    for name, t in named:
        if t is None:
            continue
        if not t.is_cuda:
            raise invalid_argument(f"{name}: must be a CUDA tensor, got device {t.device}")
        if device is None:
            device = t.device
        elif t.device != device:
            raise invalid_argument(f"{name}: is on {t.device} but the other tensors are on {device}")


def check_alignment(named) -> None:
    for name, t in named:
        if t is not None and t.data_ptr() % _TMA_BYTES != 0:
            raise invalid_argument(f"{name}: data pointer 0x{t.data_ptr():x} is not 16-byte aligned (a view with an "
                             "element offset?); call .clone() or .contiguous()")


def _view(t: torch.Tensor) -> _ffi.Tensor:
    if t.dtype not in _DTYPES:
        raise invalid_argument(f"dtype {t.dtype} is not supported (bf16, fp16, float32, int32)")
    return _ffi.make_tensor(t.data_ptr(), _DTYPES[t.dtype], t.shape, t.stride())


def _scale(softmax_scale) -> float:
    return 0.0 if softmax_scale is None else float(softmax_scale)


# ---------------------------------------------------------------------------------------------
# Launch plans. A call's checks, parameter struct and workspace size depend on its tensors'
# metadata (dtype, device, shape, strides) and its options, never on the data: the first call of a
# kind runs every check here, fills the struct and asks the library for the workspace; a later call
# of the same kind only sets the data pointers and checks their alignment (host work per call).
# The library still validates every call in full.

class _Plan(NamedTuple):
    params: ctypes.Structure  # every field, with the data pointers of the call that built it
    pointer_offsets: tuple    # where in params each present tensor's data pointer lies, in the call's order
    workspace_bytes: int


_PLANS: dict = {}
_MAX_PLANS = 4096
_SCALARS = (int, float, bool, type(None))
_POINTER = struct.Struct("=Q")  # a Tensor's data field: a native 64-bit pointer


def _plan_key(kind: str, tensors, options):
    """kind, each option with its type (a tuple's items likewise, after its length) and each
    tensor's metadata (or None), as one flat tuple (each part parses one way, so distinct calls never
    share a key); None (the call is not memoised) when an argument is neither a tensor nor None, or
    an option not a plain scalar or a tuple of them."""
    keyed = [kind]
    for option in options:
        cls = type(option)
        if cls in _SCALARS:
            keyed += (cls, option)
        elif cls is tuple:
            keyed += (tuple, len(option))
            for item in option:
                if type(item) not in _SCALARS:
                    return None
                keyed += (type(item), item)
        else:
            return None
    for t in tensors:
        if t is None:
            keyed.append(None)
        elif isinstance(t, torch.Tensor):
            keyed += (t.dtype, t.device, t.shape, t.stride())
        else:
            return None
    return tuple(keyed)


def _pointer_offsets(params, named) -> tuple:
    """The byte offsets in params of the data pointers of the (field, tensor) pairs present."""
    cls, data = type(params), _ffi.Tensor.data.offset
    return tuple(getattr(cls, name).offset + data for name, t in named if t is not None)


def _make_plan(key, params, named, workspace_size_fn) -> _Plan:
    """The plan of a call whose checks passed: its struct as filled and the library's workspace
    size (which validates it); memoised under key (None: not memoised)."""
    workspace_bytes = ctypes.c_size_t(0)
    _check(workspace_size_fn(ctypes.byref(params), ctypes.byref(workspace_bytes)))
    plan = _Plan(params, _pointer_offsets(params, named), workspace_bytes.value)
    if key is not None:
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        _PLANS[key] = plan
    return plan


def _bound_params(plan: _Plan, named) -> ctypes.Structure:
    """A copy of the plan's struct (calls may run at once in several threads) with the data
    pointers of this call's (field, tensor) pairs."""
    params = type(plan.params).from_buffer_copy(plan.params)
    pointers = [t.data_ptr() for _, t in named if t is not None]
    for offset, pointer in zip(plan.pointer_offsets, pointers):
        _POINTER.pack_into(params, offset, pointer)
    return params


def _launch(plan: _Plan, named, run_fn, device) -> None:
    """The plan's struct with this call's data pointers; the workspace from PyTorch's caching
    allocator (512-byte aligned); the pass enqueued on PyTorch's current stream of `device`."""
    params = _bound_params(plan, named)
    size = plan.workspace_bytes
    workspace = torch.empty(size, dtype=torch.uint8, device=device) if size else None
    pointer = workspace.data_ptr() if size else None
    if device.index == torch.cuda.current_device():  # the library launches on the current device
        _check(run_fn(ctypes.byref(params), pointer, size, torch.cuda.current_stream(device).cuda_stream))
        return
    with torch.cuda.device(device):
        _check(run_fn(ctypes.byref(params), pointer, size, torch.cuda.current_stream(device).cuda_stream))


def _set_views(params, named) -> None:
    """The struct's tensor fields of the (field, tensor) pairs; None leaves a field absent."""
    for field, t in named:
        if t is not None:
            setattr(params, field, _view(t))


def _set_mask(params, q, k, varlen, mask) -> None:
    """The mask and score fields both parameter structs share; `mask` from check_mask_args. The
    sequence lengths that judge the window are max_seqlen_q/k in the packed layout (FA3's)."""
    causal, left, right, softcap, chunk = mask
    seqlen_q, seqlen_k = (q.shape[1], k.shape[1]) if varlen is None else (varlen.max_seqlen_q, varlen.max_seqlen_k)
    params.causal, params.window_left, params.window_right = library_mask(causal, left, right, seqlen_q, seqlen_k)
    params.softcap = softcap
    params.attention_chunk = chunk


# The packed layout's fields both parameter structs share, all absent (dense) when varlen is None.
def _varlen_fields(varlen) -> tuple:
    return () if varlen is None else (varlen.cu_seqlens_q, varlen.cu_seqlens_k, varlen.seqused_q, varlen.seqused_k)


def _varlen_sizes(varlen) -> tuple:
    return () if varlen is None else (varlen.max_seqlen_q, varlen.max_seqlen_k)


def _set_varlen_sizes(params, varlen) -> None:
    if varlen is not None:
        params.max_seqlen_q, params.max_seqlen_k = int(varlen.max_seqlen_q), int(varlen.max_seqlen_k)


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
            softmax_scale: float | None = None, out: torch.Tensor | None = None,
            return_lse: bool = False, *, window_size=(-1, -1), softcap: float = 0.0,
            attention_chunk: int = 0, learnable_sink: torch.Tensor | None = None, varlen: Varlen | None = None,
            num_splits: int = 1, sm_margin: int = 0):
    """Attention forward. q [B, sq, Hq, d], k [B, sk, Hkv, d], v [B, sk, Hkv, d] on one CUDA
    device (bf16 or fp16). Returns out [B, sq, Hq, d] (and lse [B, Hq, sq] float32 when
    return_lse). softmax_scale None means 1/sqrt(d); causal is aligned bottom-right.
    With varlen (a Varlen: cu_seqlens, max_seqlen, seqused), the packed layout: q [total_q, Hq, d],
    k/v [total_k, Hkv, d], out [total_q, Hq, d], lse [Hq, total_q]; the mask is aligned
    bottom-right within each sequence.

    Keyword options, as flash_attn_func's: window_size (left, right) bottom-right aligned, -1
    unbounded (causal forces right = 0; a bound covering the whole sequence is no bound); softcap
    > 0 replaces scores s by softcap * tanh(s / softcap); attention_chunk c > 0 lets query row i
    see key j only within its chunk (floor(p / c) * c <= j < floor(p / c) * c + c, p = i + sk - sq),
    on top of the window; learnable_sink float32 [Hq] adds exp(sink[h]) to every row's softmax
    denominator (lse includes it). num_splits > 1 splits the keys into that many parts whose
    partials are combined (split-KV; dense or packed queries), 0 lets the library choose from the shapes
    (more than one only where the query tiles leave most SMs idle), 1 does not split. sm_margin
    leaves that many SMs free for other kernels (FA3's argument)."""
    key = _plan_key("forward", (q, k, v, out, learnable_sink, *_varlen_fields(varlen)),
                    (causal, softmax_scale, return_lse, window_size, softcap, attention_chunk, num_splits, sm_margin,
                     *_varlen_sizes(varlen)))
    plan = _PLANS.get(key) if key is not None else None
    if plan is None:
        mask = check_mask_args(causal, window_size, softcap, attention_chunk)
        check_num_splits(num_splits)
        check_sm_margin(sm_margin)
        check_forward_args(q, k, v, softmax_scale, learnable_sink, varlen)
        check_devices([("q", q), ("k", k), ("v", v), ("out", out), ("learnable_sink", learnable_sink)]
                      + varlen_tensors(varlen))
        if out is not None and (out.dtype != q.dtype or tuple(out.shape) != (*q.shape[:-1], v.shape[-1])):
            raise invalid_argument(f"out: dtype {out.dtype} shape {tuple(out.shape)}, expected {q.dtype} "
                                   f"{(*q.shape[:-1], v.shape[-1])}")
        if out is not None:
            check_layout("out", out)
    if out is None:
        out = torch.empty((*q.shape[:-1], v.shape[-1]), dtype=q.dtype, device=q.device)
    lse = torch.empty(lse_shape(q), dtype=torch.float32, device=q.device) if return_lse else None
    check_alignment((("q", q), ("k", k), ("v", v), ("out", out)))
    named = (("q", q), ("k", k), ("v", v), ("out", out), ("lse", lse), ("learnable_sink", learnable_sink),
             *varlen_tensors(varlen))
    lib = _ffi.lib()
    if plan is None:
        params = _ffi.ForwardParams()
        lib.fh_forward_params_init(ctypes.byref(params))
        _set_views(params, named)
        params.softmax_scale = _scale(softmax_scale)
        _set_mask(params, q, k, varlen, mask)
        _set_varlen_sizes(params, varlen)
        params.num_splits = num_splits
        params.sm_margin = sm_margin
        plan = _make_plan(key, params, named, lib.fh_forward_workspace_size)
    _launch(plan, named, lib.fh_forward, q.device)
    return (out, lse) if return_lse else out


def backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
             lse: torch.Tensor, causal: bool = False, softmax_scale: float | None = None,
             deterministic: bool = False, dq: torch.Tensor | None = None, dk: torch.Tensor | None = None,
             dv: torch.Tensor | None = None, *, window_size=(-1, -1), softcap: float = 0.0,
             attention_chunk: int = 0, learnable_sink: torch.Tensor | None = None,
             varlen: Varlen | None = None, sm_margin: int = 0):
    """Attention backward. q, k, v, out and lse ([B, Hq, sq], or [Hq, total_q] with varlen; float32)
    as from forward(..., return_lse=True) with the same causal, softmax_scale, window_size, softcap,
    attention_chunk, learnable_sink and varlen; dout like out.
    Returns (dq, dk, dv), shaped like q, k, v (allocated with empty_like when not given), and with
    learnable_sink (dq, dk, dv, dsink): dsink float32 [Hq], d loss / d learnable_sink summed over
    the batch and the rows. deterministic=True gives bit-identical results run to run (slightly
    slower). sm_margin as forward's."""
    key = _plan_key("backward", (dout, q, k, v, out, lse, dq, dk, dv, learnable_sink, *_varlen_fields(varlen)),
                    (causal, softmax_scale, deterministic, window_size, softcap, attention_chunk, sm_margin,
                     *_varlen_sizes(varlen)))
    plan = _PLANS.get(key) if key is not None else None
    if plan is None:
        mask = check_mask_args(causal, window_size, softcap, attention_chunk)
        check_sm_margin(sm_margin)
        check_backward_args(dout, q, k, v, out, lse, softmax_scale, learnable_sink=learnable_sink, varlen=varlen)
        check_devices([("dout", dout), ("q", q), ("k", k), ("v", v), ("out", out), ("lse", lse), ("dq", dq),
                       ("dk", dk), ("dv", dv), ("learnable_sink", learnable_sink)] + varlen_tensors(varlen))
        for name, grad, like in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
            if grad is not None:
                if grad.dtype != like.dtype or grad.shape != like.shape:
                    raise invalid_argument(f"{name}: dtype {grad.dtype} shape {tuple(grad.shape)}, expected "
                                           f"{like.dtype} {tuple(like.shape)}")
                check_layout(name, grad)
    dq = torch.empty_like(q) if dq is None else dq
    dk = torch.empty_like(k) if dk is None else dk
    dv = torch.empty_like(v) if dv is None else dv
    # the library writes every element of dsink (a fixed-order sum of per-CTA shares): no zero fill
    dsink = None if learnable_sink is None else torch.empty(q.shape[-2], dtype=torch.float32, device=q.device)
    named = (("dout", dout), ("q", q), ("k", k), ("v", v), ("out", out), ("lse", lse), ("dq", dq), ("dk", dk),
             ("dv", dv), ("learnable_sink", learnable_sink), ("dsink", dsink), *varlen_tensors(varlen))
    check_alignment(named[:5] + named[6:9])
    lib = _ffi.lib()
    if plan is None:
        params = _ffi.BackwardParams()
        lib.fh_backward_params_init(ctypes.byref(params))
        _set_views(params, named)
        params.softmax_scale = _scale(softmax_scale)
        params.deterministic = int(bool(deterministic))
        params.sm_margin = sm_margin
        _set_mask(params, q, k, varlen, mask)
        _set_varlen_sizes(params, varlen)
        plan = _make_plan(key, params, named, lib.fh_backward_workspace_size)
    _launch(plan, named, lib.fh_backward, q.device)
    return (dq, dk, dv) if dsink is None else (dq, dk, dv, dsink)


def combine(out_partial: torch.Tensor, lse_partial: torch.Tensor, out: torch.Tensor,
            lse: torch.Tensor | None = None) -> None:
    """The split-KV combine in the C ABI's layout: out_partial [num_splits, B, Hq, sq, dv] and
    lse_partial [num_splits, B, Hq, sq] (float32, any strides with the last dim contiguous) into
    out [B, sq, Hq, dv] (bf16, fp16 or float32) and lse [B, Hq, sq] (float32, optional):
    LSE = log sum_s exp(LSE_s), O = sum_s exp(LSE_s - LSE) O_s. The library checks shapes and
    strides and names what it refuses."""
    check_devices([("out_partial", out_partial), ("lse_partial", lse_partial), ("out", out), ("lse", lse)])
    params = _ffi.CombineParams()
    lib = _ffi.lib()
    lib.fh_combine_params_init(ctypes.byref(params))
    params.out_partial, params.lse_partial, params.out = _view(out_partial), _view(lse_partial), _view(out)
    if lse is not None:
        params.lse = _view(lse)
    with torch.cuda.device(out.device):
        _check(lib.fh_combine(ctypes.byref(params), torch.cuda.current_stream(out.device).cuda_stream))


# The C ABI's names of flash_attn_with_kvcache's tensors, where FA3 names them otherwise.
_KVCACHE_NAMES = {"k": "k_cache", "v": "v_cache", "k_new": "k", "v_new": "v"}


def _renamed(error: FlashHopperError, names: dict) -> FlashHopperError:
    """The library's refusal with its leading argument name in the caller's words (the library
    message starts with "<name>: ")."""
    _, _, message = str(error).partition("): ")  # after "flashhopper (<status>): "
    name, sep, rest = message.partition(": ")
    if not sep or name not in names:
        return error
    code = {status_name: code for code, status_name in _ffi.STATUS_NAMES.items()}.get(error.status, 0)
    return type(error)(code, f"{names[name]}: {rest}")


def forward_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *, k_new=None, v_new=None,
                         qv=None, rotary_cos=None, rotary_sin=None, rotary_seqlens=None, rotary_interleaved=True,
                         cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, page_table=None,
                         cu_seqlens_q=None, max_seqlen_q=None, softmax_scale=None, mask=(False, -1, -1, 0.0, 0),
                         num_splits=0, return_lse=False, cu_seqlens_k_new=None, cu_seqlens_k=None,
                         max_seqlen_k=None, seqused_q=None, seqused_k=None, learnable_sink=None,
                         names=_KVCACHE_NAMES, sm_margin=0):
    """Attention against a KV cache, in FA3's flash_attn_with_kvcache's terms (k_new/v_new are its k
    and v; packed [total_new, Hkv, d] with cu_seqlens_k_new, which is ignored without them): the C
    ABI's fields of include/flashhopper/flashhopper.h ("KV cache extras"). With page_table,
    cu_seqlens_k and max_seqlen_k instead of cache_seqlens make it a packed batch over paged keys
    (flash_attn_varlen_func's page_table). mask is check_mask_args's tuple; num_splits 0 lets the
    library choose the split-KV count from the shapes. Returns out, or (out, lse) with return_lse.
    The library checks what is not checked here and names the argument as the caller does (names:
    the C ABI's names to the caller's; flash_attn_varlen_func's are the C ABI's own)."""
    if k_new is None and v_new is None:
        cu_seqlens_k_new = None  # nothing appended (as FA3, which ignores it then)
    inputs = (("q", q), ("k", k_cache), ("v", v_cache), ("k_new", k_new), ("v_new", v_new), ("qv", qv),
              ("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin), ("cache_seqlens", cache_seqlens),
              ("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad), ("page_table", page_table),
              ("cu_seqlens_q", cu_seqlens_q), ("rotary_seqlens", rotary_seqlens),
              ("cu_seqlens_k_new", cu_seqlens_k_new), ("cu_seqlens_k", cu_seqlens_k), ("seqused_q", seqused_q),
              ("seqused_k", seqused_k), ("learnable_sink", learnable_sink))  # the C ABI's names
    key = _plan_key("forward_with_kvcache", [t for _, t in inputs],
                    (max_seqlen_q, max_seqlen_k, rotary_interleaved, softmax_scale, mask, num_splits, return_lse,
                     sm_margin))
    plan = _PLANS.get(key) if key is not None else None
    if plan is None:
        check_sm_margin(sm_margin)
        check_kvcache_args(q, k_cache, v_cache, k_new, v_new, qv, rotary_seqlens, cache_seqlens, cache_batch_idx,
                           cache_leftpad, cu_seqlens_q, max_seqlen_q, num_splits, cu_seqlens_k_new, cu_seqlens_k,
                           max_seqlen_k, seqused_q, seqused_k, learnable_sink,
                           (names.get("k", "k"), names.get("v", "v")))
        check_devices([(names.get(name, name), t) for name, t in inputs])
    varlen_q = cu_seqlens_q is not None
    out = torch.empty((*q.shape[:-1], v_cache.shape[-1]), dtype=q.dtype, device=q.device)
    lse = torch.empty(lse_shape(q), dtype=torch.float32, device=q.device) if return_lse else None
    named = (*inputs, ("out", out), ("lse", lse))
    lib = _ffi.lib()
    try:
        if plan is None:
            params = _ffi.ForwardParams()
            lib.fh_forward_params_init(ctypes.byref(params))
            _set_views(params, named)
            if varlen_q:
                params.max_seqlen_q = int(max_seqlen_q)
            if cu_seqlens_k is not None:
                params.max_seqlen_k = int(max_seqlen_k)
            params.rotary_interleaved = int(bool(rotary_interleaved))
            params.softmax_scale = _scale(softmax_scale)
            params.num_splits = num_splits
            params.sm_margin = sm_margin
            causal, left, right, softcap, chunk = mask
            # FA3's rule "a bound covering the whole sequence is no bound", against the cache's capacity.
            # (A packed batch's keys: against max_seqlen_k, as flash_attn_varlen_func.)
            seqlen_k = page_table.shape[1] * k_cache.shape[1] if page_table is not None else k_cache.shape[1]
            if cu_seqlens_k is not None:
                seqlen_k = int(max_seqlen_k)
            seqlen_q = int(max_seqlen_q) if varlen_q else q.shape[1]
            params.causal, params.window_left, params.window_right = library_mask(causal, left, right, seqlen_q,
                                                                                  seqlen_k)
            params.softcap, params.attention_chunk = softcap, chunk
            plan = _make_plan(key, params, named, lib.fh_forward_workspace_size)
        _launch(plan, named, lib.fh_forward, q.device)
    except FlashHopperError as error:
        raise _renamed(error, names) from None
    return (out, lse) if return_lse else out


def check_kvcache_args(q, k_cache, v_cache, k_new, v_new, qv, rotary_seqlens, cache_seqlens, cache_batch_idx,
                       cache_leftpad, cu_seqlens_q, max_seqlen_q, num_splits, cu_seqlens_k_new=None,
                       cu_seqlens_k=None, max_seqlen_k=None, seqused_q=None, seqused_k=None,
                       learnable_sink=None, cache_names=("k_cache", "v_cache")) -> None:
    """forward_with_kvcache's metadata checks here (the library checks the rest): types, ranks,
    dtypes, the int32 vectors' lengths."""
    check_num_splits(num_splits)
    varlen_q = cu_seqlens_q is not None
    rank, layout = (3, "[total_q, H, d] (cu_seqlens_q given)") if varlen_q else (4, "[B, sq, H, d]")
    _check_input("q", q, rank, layout)
    for name, t in zip(cache_names, (k_cache, v_cache)):
        _check_input(name, t, 4, "[B_cache, S, Hkv, d] or [num_pages, page_size, Hkv, d] (page_table given)")
        if t.dtype != q.dtype:
            raise invalid_argument(f"{name}: dtype {t.dtype} differs from q's {q.dtype}")
    packed_new = cu_seqlens_k_new is not None and (k_new is not None or v_new is not None)
    new_rank, new_layout = (3, "[total_new, Hkv, d] (cu_seqlens_k_new given)") if packed_new else \
        (4, "[B, s_new, Hkv, d]")
    for name, t in (("k", k_new), ("v", v_new), ("qv", qv)):
        if t is not None:
            _check_input(name, t, new_rank if name != "qv" else rank, new_layout if name != "qv" else layout)
    if (k_new is None) != (v_new is None):
        raise invalid_argument("k: k and v (the new keys and values) go together")
    batch = cu_seqlens_q.shape[0] - 1 if varlen_q else q.shape[0]
    if packed_new:
        _check_int32_vector("cu_seqlens_k_new", cu_seqlens_k_new, batch + 1, f"[{batch + 1}] (the batch size + 1)")
    for name, t in (("cache_seqlens", cache_seqlens), ("cache_batch_idx", cache_batch_idx),
                    ("cache_leftpad", cache_leftpad), ("rotary_seqlens", rotary_seqlens), ("seqused_q", seqused_q),
                    ("seqused_k", seqused_k)):
        if t is not None:
            _check_int32_vector(name, t, batch, f"[{batch}] (the batch size)")
    if cu_seqlens_k is not None:
        _check_int32_vector("cu_seqlens_k", cu_seqlens_k, batch + 1, f"[{batch + 1}] (the batch size + 1)")
        length = _int_option("max_seqlen_k", max_seqlen_k, "the longest sequence's key count (required with "
                                                             "cu_seqlens_k)")
        if isinstance(length, int) and not 1 <= length <= _INT32_MAX:
            raise invalid_argument(f"max_seqlen_k: {length} must be in [1, {_INT32_MAX}] (an int32 in the C ABI)")
    check_learnable_sink(learnable_sink, q.shape[-2])
    if varlen_q:
        _check_int32_vector("cu_seqlens_q", cu_seqlens_q, None, "[B + 1]")
        if max_seqlen_q is None:
            raise invalid_argument("max_seqlen_q: is required with cu_seqlens_q")
