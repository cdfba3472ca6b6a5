"""PyTorch tensors -> the C ABI's parameter structs -> one library call.

`forward` and `backward` are the plain (no autograd) entry points; `flashhopper.ops` wraps them as
torch.library custom ops and `flashhopper.flash_attn_interface` offers FlashAttention-3's API on top.
Both take the dense layout (q [B, sq, Hq, d]) or, given `varlen` (a `Varlen`: cu_seqlens_q/k,
max_seqlen_q/k, seqused_q/k), FlashAttention's packed one (q [total_q, Hq, d], lse [Hq, total_q]).

Argument checks: this layer refuses what the C ABI cannot see (Python types, torch dtypes without a
C counterpart, values that would change on their way into the C types: ValueError naming the
argument; fp8 dtypes but float8_e4m3fn: NotImplementedError), then the library's own check
(fh_forward_check, fh_backward_check), which holds every rule on dtypes, ranks, shapes, strides,
lengths and option ranges and names the argument (FlashHopperError: FlashHopperInvalidArgument is
also a ValueError, FlashHopperNotSupported also a NotImplementedError), then devices. Nothing is
launched on any error.
These checks depend only on the tensors' metadata and the options, so they run once per kind of
call (see "Launch plans"); the library checks every call again in full, data pointers included.
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
if hasattr(torch, "float8_e4m3fn"):  # fp8 inputs (forward; the library's rules say where)
    _DTYPES[torch.float8_e4m3fn] = _ffi.DTYPE_FP8_E4M3
_FP8_DTYPES = tuple(getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                                      "float8_e5m2fnuz") if hasattr(torch, name))
# FH_MAX_HEAD_DIM, FH_MAX_BACKWARD_HEAD_DIM and FH_MAX_SPLITS of include/flashhopper/flashhopper.h
# (a CPU test compares).
MAX_HEAD_DIM = 512
MAX_BACKWARD_HEAD_DIM = 512
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
    value head dim). A call runs on the family of its pass and dtype, of those with head dims at
    least its own, that pads least (the smallest head dim plus value head dim)."""
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
    if (cu_seqlens_q is None and cu_seqlens_k is None and max_seqlen_q is None and max_seqlen_k is None
            and seqused_q is None and seqused_k is None):  # each eager autograd call: no generator
        return None
    return Varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k)


def varlen_tensors(varlen: Optional[Varlen]) -> list:
    """(name, tensor) of varlen's tensors, for the device checks; [] for the dense layout."""
    if varlen is None:
        return []
    return [("cu_seqlens_q", varlen.cu_seqlens_q), ("cu_seqlens_k", varlen.cu_seqlens_k),
            ("seqused_q", varlen.seqused_q), ("seqused_k", varlen.seqused_k)]


def lse_shape(q: torch.Tensor) -> tuple:
    """lse's shape: [B, Hq, sq] for q [B, sq, Hq, d], [Hq, total_q] for packed q [total_q, Hq, d]."""
    if q.dim() == 4:
        return q.shape[0], q.shape[2], q.shape[1]
    return q.shape[1], q.shape[0]


# ---------------------------------------------------------------------------------------------
# Argument checks. The rules on dtypes, ranks, shapes, strides, lengths and option ranges live in
# the C library alone (fh_forward_check, fh_backward_check), which the C ABI, the C++ ops and this
# package share. This layer checks only what the C ABI cannot see: Python types (a tensor, an int,
# a float), torch dtypes without a C counterpart, values that conversion to the C types would
# change, and devices. The C check reads no data, so it runs before anything is allocated, on the
# tensors' addresses where they have them and on stand-ins where not (fake tensors under
# torch.compile; the outputs the call would allocate). A call whose sizes or options are symbolic
# (torch.compile's dynamic shapes) is checked when it runs.

_STAND_IN_SPACING = 1 << 40  # the i-th stand-in address: (i + 1) << 40, disjoint and aligned


def _dtype_code(name: str, t) -> int:
    """The C ABI's dtype of tensor argument `name`, or the refusal naming it."""
    if not isinstance(t, torch.Tensor):
        raise invalid_argument(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    code = _DTYPES.get(t.dtype)
    if code is None:
        if t.dtype in _FP8_DTYPES:
            raise not_supported(f"{name}: dtype {t.dtype}: of the fp8 dtypes FlashHopper takes torch.float8_e4m3fn "
                                "alone (FA3's)")
        raise invalid_argument(f"{name}: dtype {t.dtype} is not supported (torch.bfloat16 or torch.float16 inputs, "
                               "torch.float32 lse and sinks, torch.int32 lengths and indices)")
    return code


def _concrete(*values) -> bool:
    """True when every value is a plain int (none is a torch.compile SymInt)."""
    return all(type(value) is int for value in values)


def _stand_in(index: int, code: int, shape, strides=None, offset_bytes: int = 0) -> _ffi.Tensor:
    """A view of dtype `code` and this shape (and strides; None: contiguous) at the index-th
    stand-in address plus offset_bytes (which keeps a tensor's alignment)."""
    if strides is None:
        strides, step = [], 1
        for extent in reversed(shape):
            strides.insert(0, step)
            step *= max(extent, 1)
    return _ffi.make_tensor((index + 1) * _STAND_IN_SPACING + offset_bytes, code, shape, strides)


def _data_address(t: torch.Tensor) -> int:
    """t's data pointer; 0 where it has none (no elements, a meta tensor) or where asking would be
    wrong (a subclass: the fake tensors of torch.compile)."""
    return t.data_ptr() if type(t) in (torch.Tensor, torch.nn.Parameter) else 0


def _metadata_views(named) -> Optional[list]:
    """(field, view) for the (field, tensor) pairs present, each view with its tensor's dtype, shape,
    strides and address, or a stand-in address that keeps its alignment where it has none; None
    when a size is symbolic (the check waits for the run). Refuses, naming the field, what is not a
    tensor or has no C dtype."""
    views = []
    for index, (field, t) in enumerate(named):
        if t is None:
            continue
        code = _dtype_code(field, t)
        shape, strides, offset = tuple(t.shape), t.stride(), t.storage_offset()
        if not _concrete(*shape, *strides, offset):
            return None
        if len(shape) > _ffi.MAX_DIMS:
            raise invalid_argument(f"{field}: ndim is {len(shape)}, shape {shape}; the C ABI takes at most "
                                   f"{_ffi.MAX_DIMS} dims")
        address = _data_address(t)
        views.append((field, _ffi.make_tensor(address, code, shape, strides) if address else
                      _stand_in(index, code, shape, strides, offset * t.element_size())))
    return views


def output_dtype(q: torch.Tensor) -> torch.dtype:
    """The dtype of the out a call allocates: q's, bf16 for fp8 inputs (the library's rule)."""
    return torch.bfloat16 if _DTYPES.get(q.dtype) == _ffi.DTYPE_FP8_E4M3 else q.dtype


def _output_stand_ins(q, v, first_index: int, out: bool, lse: bool) -> list:
    """Stand-ins for the outputs a call allocates: out (*q.shape[:-1], v.shape[-1]) in output_dtype(q) and
    lse (lse_shape(q), float32), where q's and v's ranks let them be formed (else the C check
    refuses q or v first)."""
    if not (isinstance(q, torch.Tensor) and isinstance(v, torch.Tensor) and q.dim() in (3, 4) and v.dim() >= 1
            and _concrete(*q.shape, v.shape[-1])):
        return []
    views = []
    if out:
        _dtype_code("q", q)  # q's dtype refused by its name first
        views.append(("out", _stand_in(first_index, _DTYPES[output_dtype(q)], (*q.shape[:-1], v.shape[-1]))))
    if lse:
        views.append(("lse", _stand_in(first_index + 1, _ffi.DTYPE_FP32, lse_shape(q))))
    return views


def _run_library_check(params, views, check_fn) -> None:
    """Sets the views on params and runs the library's check on them (check_fn: fh_forward_check
    or fh_backward_check): its refusal, with its message, is the call's; a window bound's in the
    caller's terms (window_size)."""
    for field, view in views:
        setattr(params, field, view)
    try:
        _check(check_fn(ctypes.byref(params)))
    except FlashHopperError as error:
        raise _in_window_size_terms(error) from None


def _in_window_size_terms(error: FlashHopperError) -> FlashHopperError:
    """"window_left: is -3; ..." as "window_size: the left bound is -3; ...": the C ABI's two
    fields are one argument here."""
    _, _, message = str(error).partition("): ")
    name, sep, rest = message.partition(": ")
    side = {"window_left": "left", "window_right": "right"}.get(name)
    if not sep or side is None:
        return error
    return type(error)(_status_code(error), f"window_size: the {side} bound {rest}")


def _status_code(error: FlashHopperError) -> int:
    return {status_name: code for code, status_name in _ffi.STATUS_NAMES.items()}.get(error.status, 0)


def _int_option(name: str, value, what: str) -> int:
    """An int-like value (int, numpy integer; not bool, float or tensor) as an int, or ValueError
    naming `name`. A SymInt (torch.compile) is returned as it is: int() would specialise it, one
    recompile per value (max_seqlen changes from batch to batch)."""
    if type(value) is int:  # the common case, without the ABC checks below (host work per call)
        return value
    if isinstance(value, (bool, torch.Tensor)) or not isinstance(value, (numbers.Integral, torch.SymInt)):
        raise invalid_argument(f"{name}: {what} must be an int, got {type(value).__name__} {value!r}")
    return value if isinstance(value, torch.SymInt) else int(value)


def _int32_option(name: str, value, what: str, default=None):
    """_int_option for a field the C ABI holds in an int32: a value outside it would wrap on the way
    (the range within is the library's rule). None is `default` where one is given."""
    if value is None and default is not None:
        return default
    value = _int_option(name, value, what)
    if isinstance(value, int) and not -_INT32_MAX - 1 <= value <= _INT32_MAX:
        raise invalid_argument(f"{name}: {value} does not fit in int32 (the C ABI's type)")
    return value


def check_varlen(varlen: Optional[Varlen]) -> None:
    """A Varlen packs q and k alike, so it holds both cu_seqlens (the C ABI also takes one side
    packed alone; the Python API does not offer it); max_seqlen_q/k are ints (None reads as 0,
    which the library refuses by name). The tensors and the lengths' ranges are the library's to
    check."""
    if varlen is None:
        return
    for name in ("cu_seqlens_q", "cu_seqlens_k"):
        if getattr(varlen, name) is None:
            raise invalid_argument(f"{name}: is required in the packed layout (with cu_seqlens_q, cu_seqlens_k, "
                                   "max_seqlen_q or max_seqlen_k given), which packs q and k alike")
    for name in ("max_seqlen_q", "max_seqlen_k"):
        _int32_option(name, getattr(varlen, name), "the longest sequence's length", default=0)


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
    """window_size (left, right): ints, -1 (or None, FlashAttention-4's spelling) unbounded; as FA3,
    also a CPU integer tensor of two elements, or a pair of 0-d ones. Returns the pair as ints; None
    means (-1, -1). (Their range is the library's rule.)"""
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
        if isinstance(bound, int) and bound < -_INT32_MAX - 1:
            raise invalid_argument(f"window_size: the {side} bound {bound} does not fit in int32 (the C ABI's type)")
        resolved.append(bound)
    return resolved[0], resolved[1]


def check_softcap(softcap) -> float:
    """softcap as the C ABI's float32: a Python real number whose float32 is the same value's (a
    finite value beyond float32's range would become inf, a positive one that rounds to 0 would
    turn the cap off). Its range (finite, >= 0) is the library's rule."""
    if softcap is None or (type(softcap) is float and softcap == 0.0):  # the common case, fast
        return 0.0
    if isinstance(softcap, (bool, torch.Tensor)) or not isinstance(softcap, numbers.Real):
        raise invalid_argument(f"softcap: must be a Python float >= 0, got {type(softcap).__name__} {softcap!r}")
    _check_float32("softcap", softcap, "which would turn the cap off; pass 0.0 for no cap")
    return softcap if isinstance(softcap, float) else float(softcap)


def _check_float32(name: str, value, zero_means: str) -> None:
    """A finite value that float32 (the C ABI's type) cannot hold: beyond its range, or positive and
    rounding to 0 (zero_means: what 0 would do). Comparisons only: Dynamo traces them as constants."""
    if value == value and abs(value) != math.inf and abs(value) > _FLOAT32_MAX:
        raise invalid_argument(f"{name}: {value} exceeds float32's range (the C ABI's type)")
    if 0 < value <= _FLOAT32_HALF_MIN_SUBNORMAL:
        raise invalid_argument(f"{name}: {value} rounds to 0 in float32 (the C ABI's type), {zero_means}")


def check_attention_chunk(attention_chunk) -> int:
    """attention_chunk: an int (0 or None: none); c > 0 lets a row see keys of its own chunk of c
    only. (Its range is the library's rule.)"""
    if attention_chunk is None:
        return 0
    return _int32_option("attention_chunk", attention_chunk, "the chunk size")


def check_mask_args(causal, window_size, softcap, attention_chunk):
    """The mask and score options converted; returns (causal, window_left, window_right, softcap,
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
    """An int option whose range is the library's rule: only its type, and that it fits the C
    ABI's int32, are checked here."""
    if not isinstance(value, (int, torch.SymInt)) or isinstance(value, bool):
        raise invalid_argument(f"{name}: expected an int, got {type(value).__name__}")
    _int32_option(name, value, "it")


def check_num_splits(num_splits) -> None:
    _check_plain_int("num_splits", num_splits)


def check_sm_margin(sm_margin) -> None:
    _check_plain_int("sm_margin", sm_margin)


def check_softmax_scale(softmax_scale) -> None:
    """softmax_scale: None (1/sqrt(d)) or a real number the C ABI's float32 holds; 0.0 is refused
    here because the C ABI reads 0 as the default. (Its range is the library's rule.)"""
    if softmax_scale is None:
        return
    if isinstance(softmax_scale, (bool, torch.Tensor)) or not isinstance(softmax_scale, numbers.Real):
        raise invalid_argument(f"softmax_scale: must be a Python float or None, got {type(softmax_scale).__name__}")
    if softmax_scale == 0:
        raise not_supported("softmax_scale: 0.0 is not supported (the C ABI reads 0 as 1/sqrt(head_dim)); "
                            "pass None for the default")
    _check_float32("softmax_scale", softmax_scale, "which the C ABI reads as 1/sqrt(head_dim)")


def layout_ok(t: torch.Tensor) -> bool:
    """True when the library takes `t`'s strides (the last 1, the others multiples of 16 bytes) and
    no stride is 0 on a dim of more than one element: dout is made contiguous otherwise, as FA3's."""
    if t.stride(-1) != 1:
        return False
    granule = _TMA_BYTES // t.element_size()
    return all(t.stride(d) % granule == 0 and (t.stride(d) != 0 or t.shape[d] <= 1) for d in range(t.dim() - 1))


def check_devices(named) -> None:
    """All CUDA, all on one device (what the C ABI cannot see)."""
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


def _mask_seqlens(q, k, varlen) -> tuple:
    """The lengths that judge FA3's "a bound covering the whole sequence is no bound": q's and k's
    sequence dims, or max_seqlen_q/k in the packed layout (FA3's)."""
    if varlen is not None:
        return (_int32_option("max_seqlen_q", varlen.max_seqlen_q, "the longest sequence's length", default=0),
                _int32_option("max_seqlen_k", varlen.max_seqlen_k, "the longest sequence's length", default=0))
    return (q.shape[1] if q.dim() > 1 else 0), (k.shape[1] if k.dim() > 1 else 0)


def _set_options(params, mask, seqlens, softmax_scale, sm_margin, varlen) -> bool:
    """The scalar fields both parameter structs share (mask: check_mask_args's tuple; seqlens: the
    pair that judges the window); False, leaving params unfinished, when one is symbolic."""
    causal, left, right, softcap, chunk = mask
    if not _concrete(left, right, chunk, sm_margin, *seqlens):
        return False
    params.causal, params.window_left, params.window_right = library_mask(causal, left, right, *seqlens)
    params.softcap, params.attention_chunk = softcap, chunk
    params.softmax_scale = 0.0 if softmax_scale is None else float(softmax_scale)
    params.sm_margin = sm_margin
    if varlen is not None:
        params.max_seqlen_q, params.max_seqlen_k = seqlens
    return True


_NO_MASK = (False, -1, -1, 0.0, 0)


def check_forward(q, k, v, *, out=None, return_lse=False, learnable_sink=None, varlen=None, softmax_scale=None,
                  mask=_NO_MASK, num_splits=1, sm_margin=0, descales=(None, None, None)) -> None:
    """A forward call's arguments as forward() takes them (mask: check_mask_args's tuple): the
    conversions here, then the library's fh_forward_check on their metadata, with stand-ins for
    the outputs the call would allocate. No data is read; no device is needed."""
    check_num_splits(num_splits)
    check_sm_margin(sm_margin)
    check_softmax_scale(softmax_scale)
    check_varlen(varlen)
    named = [("q", q), ("k", k), ("v", v), ("out", out), ("learnable_sink", learnable_sink), *varlen_tensors(varlen),
             *_descale_tensors(descales)]
    views = _metadata_views(named)
    params = _ffi.ForwardParams()
    _ffi.lib().fh_forward_params_init(ctypes.byref(params))
    if views is None or not _concrete(num_splits) or \
            not _set_options(params, mask, _mask_seqlens(q, k, varlen), softmax_scale, sm_margin, varlen):
        return
    params.num_splits = num_splits
    views += _output_stand_ins(q, v, len(named), out=out is None, lse=return_lse)
    _run_library_check(params, views, _ffi.lib().fh_forward_check)


def check_backward(dout, q, k, v, out, lse, *, dq=None, dk=None, dv=None, learnable_sink=None, varlen=None,
                   softmax_scale=None, mask=_NO_MASK, deterministic=False, sm_margin=0,
                   dout_made_contiguous=False) -> None:
    """A backward call's arguments as backward() takes them: the conversions here, then the
    library's fh_backward_check on their metadata, with stand-ins for the gradients the call would
    allocate (contiguous) and for dout where the caller makes it contiguous first
    (dout_made_contiguous, the ops' way, FA3's)."""
    check_sm_margin(sm_margin)
    check_softmax_scale(softmax_scale)
    check_varlen(varlen)
    named = [("dout", dout), ("q", q), ("k", k), ("v", v), ("out", out), ("lse", lse), ("dq", dq), ("dk", dk),
             ("dv", dv), ("learnable_sink", learnable_sink), *varlen_tensors(varlen)]
    views = _metadata_views(named)
    params = _ffi.BackwardParams()
    _ffi.lib().fh_backward_params_init(ctypes.byref(params))
    if views is None or \
            not _set_options(params, mask, _mask_seqlens(q, k, varlen), softmax_scale, sm_margin, varlen):
        return
    params.deterministic = int(bool(deterministic))
    index = len(named)
    if dout_made_contiguous and not layout_ok(dout):
        views.append(("dout", _stand_in(index, _dtype_code("dout", dout), tuple(dout.shape))))
    for offset, (field, grad, like) in enumerate((("dq", dq, q), ("dk", dk, k), ("dv", dv, v))):
        if grad is None:
            views.append((field, _stand_in(index + 1 + offset, _dtype_code(field[1:], like), tuple(like.shape))))
    if learnable_sink is not None and q.dim() >= 2:
        views.append(("dsink", _stand_in(index + 4, _ffi.DTYPE_FP32, (q.shape[-2],))))
    _run_library_check(params, views, _ffi.lib().fh_backward_check)


def _view(name: str, t: torch.Tensor) -> _ffi.Tensor:
    return _ffi.make_tensor(t.data_ptr(), _dtype_code(name, t), t.shape, t.stride())


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
_SCALARS = frozenset((int, float, bool, type(None)))
_POINTER = struct.Struct("=Q")  # a Tensor's data field: a native 64-bit pointer


def _plan_key(kind: str, tensors, options):
    """kind, the options with their types (a tuple's, item by item) and each tensor's metadata (or
    None), as one tuple (equal keys: equal values of equal types, so 1, 1.0 and True never share
    one); None (the call is not memoised) when an argument is neither a tensor nor None, or an
    option not a plain scalar or a tuple of them. Every call computes one: kept lean."""
    types = []
    for option in options:
        cls = type(option)
        if cls is tuple:
            cls = tuple(map(type, option))
            if not _SCALARS.issuperset(cls):
                return None
        elif cls not in _SCALARS:
            return None
        types.append(cls)
    metadata = []
    for t in tensors:
        if t is None:
            metadata.append(None)
        elif isinstance(t, torch.Tensor):
            metadata.append((t.dtype, t.device, t.shape, t.stride()))
        else:
            return None
    return kind, options, tuple(types), tuple(metadata)


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
    _remember(key, plan)
    return plan


def _remember(key, plan: _Plan) -> None:
    """plan memoised under key (None: not memoised)."""
    if key is not None:
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        _PLANS[key] = plan


def _bound_params(plan: _Plan, named) -> ctypes.Structure:
    """A copy of the plan's struct (calls may run at once in several threads) with the data
    pointers of this call's (field, tensor) pairs (any iterable, read once)."""
    params = type(plan.params).from_buffer_copy(plan.params)
    pointers = [t.data_ptr() for _, t in named if t is not None]
    for offset, pointer in zip(plan.pointer_offsets, pointers):
        _POINTER.pack_into(params, offset, pointer)
    return params


# The current device and the raw handle of PyTorch's current stream, without torch.cuda's Python
# layers (torch.cuda.current_stream builds a Stream object on every call: microseconds of host
# work per launch); the public calls where a PyTorch build lacks these (Inductor uses both).
_current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _current_stream_handle(device: torch.device) -> int:
    """The cudaStream_t of PyTorch's current stream on `device` (a CUDA device with its index)."""
    if _raw_stream is not None:
        return _raw_stream(device.index)
    return torch.cuda.current_stream(device).cuda_stream


def _launch(plan: _Plan, named, run_fn, device) -> None:
    """The plan's struct with this call's data pointers; the workspace from PyTorch's caching
    allocator (512-byte aligned); the pass enqueued on PyTorch's current stream of `device`."""
    params = _bound_params(plan, named)
    size = plan.workspace_bytes
    workspace = torch.empty(size, dtype=torch.uint8, device=device) if size else None
    pointer = workspace.data_ptr() if size else None
    if device.index == _current_device():  # the library launches on the current device
        _check(run_fn(ctypes.byref(params), pointer, size, _current_stream_handle(device)))
        return
    with torch.cuda.device(device):
        _check(run_fn(ctypes.byref(params), pointer, size, _current_stream_handle(device)))


def _set_views(params, named) -> None:
    """The struct's tensor fields of the (field, tensor) pairs; None leaves a field absent."""
    for field, t in named:
        if t is not None:
            setattr(params, field, _view(field, t))


# The packed layout's fields both parameter structs share, all absent (dense) when varlen is None.
def _varlen_fields(varlen) -> tuple:
    return () if varlen is None else (varlen.cu_seqlens_q, varlen.cu_seqlens_k, varlen.seqused_q, varlen.seqused_k)


def _varlen_sizes(varlen) -> tuple:
    return () if varlen is None else (varlen.max_seqlen_q, varlen.max_seqlen_k)


def _descale_tensors(descales) -> list:
    """fp8's (q_descale, k_descale, v_descale) as named tensors."""
    return list(zip(("q_descale", "k_descale", "v_descale"), descales))


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
            softmax_scale: float | None = None, out: torch.Tensor | None = None,
            return_lse: bool = False, *, window_size=(-1, -1), softcap: float = 0.0,
            attention_chunk: int = 0, learnable_sink: torch.Tensor | None = None, varlen: Varlen | None = None,
            num_splits: int = 1, sm_margin: int = 0, q_descale: torch.Tensor | None = None,
            k_descale: torch.Tensor | None = None, v_descale: torch.Tensor | None = None, caller_key=None):
    """Attention forward. q [B, sq, Hq, d], k [B, sk, Hkv, d], v [B, sk, Hkv, d] on one CUDA
    device (bf16, fp16, or float8_e4m3fn with a bf16 out: dense batches, forward only). Returns
    out [B, sq, Hq, d] (and lse [B, Hq, sq] float32 when return_lse). softmax_scale None means
    1/sqrt(d); causal is aligned bottom-right. fp8: q_descale, k_descale, v_descale float32
    [B, Hkv] (each optional) are the factors of the stored values (true = stored * factor).
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
    leaves that many SMs free for other kernels (FA3's argument). caller_key: the caller's own plan
    key (from its unconverted arguments), under which this call's plan is memoised too;
    run_forward_plan runs it."""
    descales = (q_descale, k_descale, v_descale)
    key = _plan_key("forward", (q, k, v, out, learnable_sink, *_varlen_fields(varlen), *descales),
                    (causal, softmax_scale, return_lse, window_size, softcap, attention_chunk, num_splits, sm_margin,
                     *_varlen_sizes(varlen)))
    plan = _PLANS.get(key) if key is not None else None
    if plan is None:
        mask = check_mask_args(causal, window_size, softcap, attention_chunk)
        check_forward(q, k, v, out=out, return_lse=return_lse, learnable_sink=learnable_sink, varlen=varlen,
                      softmax_scale=softmax_scale, mask=mask, num_splits=num_splits, sm_margin=sm_margin,
                      descales=descales)
        check_devices([("q", q), ("k", k), ("v", v), ("out", out), ("learnable_sink", learnable_sink)]
                      + varlen_tensors(varlen) + _descale_tensors(descales))
    out, lse = _new_outputs(q, v, return_lse, out)
    named = tuple(_forward_named(q, k, v, out, lse, learnable_sink, varlen, descales))
    lib = _ffi.lib()
    if plan is None:
        params = _ffi.ForwardParams()
        lib.fh_forward_params_init(ctypes.byref(params))
        _set_views(params, named)
        _set_options(params, mask, _mask_seqlens(q, k, varlen), softmax_scale, sm_margin, varlen)
        params.num_splits = num_splits
        plan = _make_plan(key, params, named, lib.fh_forward_workspace_size)
    _remember(caller_key, plan)
    _launch(plan, named, lib.fh_forward, q.device)
    return (out, lse) if return_lse else out


def _new_outputs(q, v, return_lse: bool, out=None):
    """A forward call's out over q and v (allocated when None) and lse (None without return_lse)."""
    if out is None:
        out = torch.empty((*q.shape[:-1], v.shape[-1]), dtype=output_dtype(q), device=q.device)
    lse = torch.empty(lse_shape(q), dtype=torch.float32, device=q.device) if return_lse else None
    return out, lse


# forward()'s tensors, by the C ABI's names, in the order its plans take them.
_FORWARD_FIELDS = ("q", "k", "v", "out", "lse", "learnable_sink", "cu_seqlens_q", "cu_seqlens_k", "seqused_q",
                   "seqused_k", "q_descale", "k_descale", "v_descale")

_DENSE = (None, None, None, None)  # a dense call's varlen tensors
_NO_DESCALES = (None, None, None)  # a bf16/fp16 call's


def _forward_named(q, k, v, out, lse, learnable_sink, varlen, descales=_NO_DESCALES):
    """forward()'s (field, tensor) pairs, None where absent (an iterator, read once; a dense
    call's end without tensors left off)."""
    tensors = (q, k, v, out, lse, learnable_sink)
    if varlen is not None or descales[0] is not None or descales[1] is not None or descales[2] is not None:
        tensors += (*(_varlen_fields(varlen) or _DENSE), *descales)
    return zip(_FORWARD_FIELDS, tensors)


def run_forward_plan(plan: _Plan, q, k, v, learnable_sink, varlen, return_lse: bool):
    """A forward() call in bf16/fp16 (out allocated here) whose plan an earlier call memoised under
    the same caller_key, so its arguments passed every check; out, or (out, lse)."""
    out, lse = _new_outputs(q, v, return_lse)
    _launch(plan, _forward_named(q, k, v, out, lse, learnable_sink, varlen), _ffi.lib().fh_forward, q.device)
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
        check_backward(dout, q, k, v, out, lse, dq=dq, dk=dk, dv=dv, learnable_sink=learnable_sink, varlen=varlen,
                       softmax_scale=softmax_scale, mask=mask, deterministic=deterministic, sm_margin=sm_margin)
        check_devices([("dout", dout), ("q", q), ("k", k), ("v", v), ("out", out), ("lse", lse), ("dq", dq),
                       ("dk", dk), ("dv", dv), ("learnable_sink", learnable_sink)] + varlen_tensors(varlen))
    dq = torch.empty_like(q) if dq is None else dq
    dk = torch.empty_like(k) if dk is None else dk
    dv = torch.empty_like(v) if dv is None else dv
    # the library writes every element of dsink (a fixed-order sum of per-CTA shares): no zero fill
    dsink = None if learnable_sink is None else torch.empty(q.shape[-2], dtype=torch.float32, device=q.device)
    named = (("dout", dout), ("q", q), ("k", k), ("v", v), ("out", out), ("lse", lse), ("dq", dq), ("dk", dk),
             ("dv", dv), ("learnable_sink", learnable_sink), ("dsink", dsink), *varlen_tensors(varlen))
    lib = _ffi.lib()
    if plan is None:
        params = _ffi.BackwardParams()
        lib.fh_backward_params_init(ctypes.byref(params))
        _set_views(params, named)
        _set_options(params, mask, _mask_seqlens(q, k, varlen), softmax_scale, sm_margin, varlen)
        params.deterministic = int(bool(deterministic))
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
    _set_views(params, (("out_partial", out_partial), ("lse_partial", lse_partial), ("out", out), ("lse", lse)))
    with torch.cuda.device(out.device):
        _check(lib.fh_combine(ctypes.byref(params), _current_stream_handle(out.device)))


# The C ABI's names of flash_attn_with_kvcache's tensors, where FA3 names them otherwise.
_KVCACHE_NAMES = {"k": "k_cache", "v": "v_cache", "k_new": "k", "v_new": "v"}


def _renamed(error: FlashHopperError, names: dict) -> FlashHopperError:
    """The library's refusal with its leading argument name in the caller's words (the library
    message starts with "<name>: ")."""
    _, _, message = str(error).partition("): ")  # after "flashhopper (<status>): "
    name, sep, rest = message.partition(": ")
    if not sep or name not in names:
        return error
    return type(error)(_status_code(error), f"{names[name]}: {rest}")


# forward_with_kvcache's tensors, by the C ABI's names, in the order it takes them.
_KVCACHE_FIELDS = ("q", "k", "v", "k_new", "v_new", "qv", "rotary_cos", "rotary_sin", "cache_seqlens",
                   "cache_batch_idx", "cache_leftpad", "page_table", "cu_seqlens_q", "rotary_seqlens",
                   "cu_seqlens_k_new", "cu_seqlens_k", "seqused_q", "seqused_k", "learnable_sink", "q_descale",
                   "k_descale", "v_descale")


def forward_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *, k_new=None, v_new=None,
                         qv=None, rotary_cos=None, rotary_sin=None, rotary_seqlens=None, rotary_interleaved=True,
                         cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, page_table=None,
                         cu_seqlens_q=None, max_seqlen_q=None, softmax_scale=None, mask=(False, -1, -1, 0.0, 0),
                         num_splits=0, return_lse=False, cu_seqlens_k_new=None, cu_seqlens_k=None,
                         max_seqlen_k=None, seqused_q=None, seqused_k=None, learnable_sink=None,
                         names=_KVCACHE_NAMES, sm_margin=0, check_only=False, descales=(None, None, None),
                         caller_key=None):
    """Attention against a KV cache, in FA3's flash_attn_with_kvcache's terms (k_new/v_new are its k
    and v; packed [total_new, Hkv, d] with cu_seqlens_k_new, which is ignored without them): the C
    ABI's fields of include/flashhopper/flashhopper.h ("KV cache extras"). With page_table,
    cu_seqlens_k and max_seqlen_k instead of cache_seqlens make it a packed batch over paged keys
    (flash_attn_varlen_func's page_table). mask is check_mask_args's tuple; num_splits 0 lets the
    library choose the split-KV count from the shapes. Returns out, or (out, lse) with return_lse.
    The library checks what is not checked here and names the argument as the caller does (names:
    the C ABI's names to the caller's; flash_attn_varlen_func's are the C ABI's own). check_only:
    the argument checks but the devices' alone, for fake tensors (the fake op's); returns None.
    descales: fp8's (q_descale, k_descale, v_descale), as forward()'s. caller_key: the caller's own
    plan key (from its unconverted arguments, which give these tensors in _KVCACHE_FIELDS's order
    and these options), under which this call's plan is memoised too: run_kvcache_plan runs it."""
    if k_new is None and v_new is None:
        cu_seqlens_k_new = None  # nothing appended (as FA3, which ignores it then)
    tensors = (q, k_cache, v_cache, k_new, v_new, qv, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
               cache_leftpad, page_table, cu_seqlens_q, rotary_seqlens, cu_seqlens_k_new, cu_seqlens_k, seqused_q,
               seqused_k, learnable_sink, *descales)
    inputs = tuple(zip(_KVCACHE_FIELDS, tensors))
    key = _plan_key("forward_with_kvcache", tensors,
                    (max_seqlen_q, max_seqlen_k, rotary_interleaved, softmax_scale, mask, num_splits, return_lse,
                     sm_margin))
    plan = _PLANS.get(key) if key is not None else None
    if plan is None:
        options = _KvCacheOptions(q, k_cache, page_table, cu_seqlens_q, max_seqlen_q, cu_seqlens_k, max_seqlen_k,
                                  rotary_interleaved, softmax_scale, mask, num_splits, sm_margin)
    lib = _ffi.lib()
    try:
        if plan is None:
            check_kvcache(inputs, v_cache, return_lse, options)
        if check_only:  # a plan's key matches fake tensors too: an eager call's plan passed this check
            return None
        if plan is None:
            check_devices([(names.get(name, name), t) for name, t in inputs])
        out, lse, named = _kvcache_outputs(inputs, return_lse)
        if plan is None:
            params = _ffi.ForwardParams()
            lib.fh_forward_params_init(ctypes.byref(params))
            _set_views(params, named)
            _set_kvcache_options(params, options)
            plan = _make_plan(key, params, named, lib.fh_forward_workspace_size)
        _remember(caller_key, plan)
        _launch(plan, named, lib.fh_forward, q.device)
    except FlashHopperError as error:
        raise _renamed(error, names) from None
    return (out, lse) if return_lse else out


_KVCACHE_OUTPUT_FIELDS = (*_KVCACHE_FIELDS, "out", "lse")  # _kvcache_outputs's order


def _kvcache_outputs(inputs, return_lse: bool):
    """out, lse (None without return_lse) and the call's (field, tensor) pairs with them, for
    inputs in _KVCACHE_FIELDS's order."""
    out, lse = _new_outputs(inputs[0][1], inputs[2][1], return_lse)
    return out, lse, (*inputs, ("out", out), ("lse", lse))


def run_kvcache_plan(plan: _Plan, tensors, return_lse: bool, names=_KVCACHE_NAMES):
    """A KV-cache call whose plan an earlier call memoised under the same caller_key (so its
    arguments passed every check): tensors in _KVCACHE_FIELDS's order; out, or (out, lse)."""
    q = tensors[0]
    out, lse = _new_outputs(q, tensors[2], return_lse)
    try:
        _launch(plan, zip(_KVCACHE_OUTPUT_FIELDS, (*tensors, out, lse)), _ffi.lib().fh_forward, q.device)
    except FlashHopperError as error:
        raise _renamed(error, names) from None
    return (out, lse) if return_lse else out


class _KvCacheOptions(NamedTuple):
    """What forward_with_kvcache's scalar fields come from."""
    q: torch.Tensor
    k_cache: torch.Tensor
    page_table: Optional[torch.Tensor]
    cu_seqlens_q: Optional[torch.Tensor]
    max_seqlen_q: Optional[int]
    cu_seqlens_k: Optional[torch.Tensor]
    max_seqlen_k: Optional[int]
    rotary_interleaved: bool
    softmax_scale: Optional[float]
    mask: tuple
    num_splits: int
    sm_margin: int


def _set_kvcache_options(params, options: _KvCacheOptions) -> bool:
    """forward_with_kvcache's scalar fields; False when one is symbolic. FA3's rule "a bound
    covering the whole sequence is no bound" is judged against the cache's capacity (a packed
    batch's keys: against max_seqlen_k, as flash_attn_varlen_func)."""
    q, k_cache, page_table, cu_seqlens_q, max_seqlen_q, cu_seqlens_k, max_seqlen_k, rotary_interleaved, \
        softmax_scale, mask, num_splits, sm_margin = options
    if cu_seqlens_k is not None:
        seqlen_k = _int32_option("max_seqlen_k", max_seqlen_k, "the longest sequence's key count", default=0)
    elif page_table is not None and page_table.dim() == 2 and k_cache.dim() > 1:
        seqlen_k = page_table.shape[1] * k_cache.shape[1]
    else:
        seqlen_k = k_cache.shape[1] if k_cache.dim() > 1 else 0
    if cu_seqlens_q is not None:
        seqlen_q = _int32_option("max_seqlen_q", max_seqlen_q, "the longest sequence's length", default=0)
    else:
        seqlen_q = q.shape[1] if q.dim() > 1 else 0
    if not _concrete(num_splits) or not _set_options(params, mask, (seqlen_q, seqlen_k), softmax_scale, sm_margin,
                                                     None):
        return False
    if cu_seqlens_q is not None:
        params.max_seqlen_q = seqlen_q
    if cu_seqlens_k is not None:
        params.max_seqlen_k = seqlen_k
    params.rotary_interleaved = int(bool(rotary_interleaved))
    params.num_splits = num_splits
    return True


def check_kvcache(inputs, v_cache, return_lse: bool, options: _KvCacheOptions) -> None:
    """forward_with_kvcache's arguments (inputs: its (C ABI name, tensor) pairs): the conversions
    here, then the library's fh_forward_check on their metadata, as check_forward."""
    check_num_splits(options.num_splits)
    check_sm_margin(options.sm_margin)
    check_softmax_scale(options.softmax_scale)
    views = _metadata_views(inputs)
    params = _ffi.ForwardParams()
    _ffi.lib().fh_forward_params_init(ctypes.byref(params))
    if views is None or not _set_kvcache_options(params, options):
        return
    views += _output_stand_ins(options.q, v_cache, len(inputs), out=True, lse=return_lse)
    _run_library_check(params, views, _ffi.lib().fh_forward_check)
