"""ctypes mirror of include/flashhopper/flashhopper.h: the C ABI, nothing else.

The library is FLASHHOPPER_LIBRARY when set, else the one next to this file (pip install .), else
the repository's build/ (a checkout with PYTHONPATH=python), else on the loader's path. No PyTorch
here: this layer speaks pointers, shapes and strides."""
import ctypes
import os
import pathlib

MAX_DIMS = 5

DTYPE_BF16, DTYPE_FP16, DTYPE_FP8_E4M3, DTYPE_FP32, DTYPE_INT32, DTYPE_FP64 = range(6)

# The library's fh_status_name for each status (tests/python/test_library.py compares them): the
# Python layer names its own refusals before any library is loaded.
STATUS_NAMES = {
    0: "success",
    1: "invalid argument",
    2: "not supported",
    3: "no device",
    4: "CUDA error",
    5: "workspace",
}


class Tensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("dtype", ctypes.c_int32),
        ("ndim", ctypes.c_int32),
        ("shape", ctypes.c_int64 * MAX_DIMS),
        ("stride", ctypes.c_int64 * MAX_DIMS),
    ]


class ForwardParams(ctypes.Structure):
    _fields_ = [
        ("q", Tensor), ("k", Tensor), ("v", Tensor), ("out", Tensor), ("lse", Tensor),
        ("cu_seqlens_q", Tensor), ("cu_seqlens_k", Tensor), ("seqused_q", Tensor), ("seqused_k", Tensor),
        ("max_seqlen_q", ctypes.c_int32), ("max_seqlen_k", ctypes.c_int32),
        ("page_table", Tensor), ("cache_seqlens", Tensor), ("k_new", Tensor), ("v_new", Tensor),
        ("q_descale", Tensor), ("k_descale", Tensor), ("v_descale", Tensor),
        ("softmax_scale", ctypes.c_float), ("softcap", ctypes.c_float),
        ("causal", ctypes.c_int32), ("window_left", ctypes.c_int32), ("window_right", ctypes.c_int32),
        ("num_sink_tokens", ctypes.c_int32), ("num_splits", ctypes.c_int32),
        ("attention_chunk", ctypes.c_int32), ("learnable_sink", Tensor), ("qv", Tensor),
        ("cache_batch_idx", Tensor), ("cache_leftpad", Tensor), ("rotary_cos", Tensor), ("rotary_sin", Tensor),
        ("rotary_seqlens", Tensor), ("rotary_interleaved", ctypes.c_int32), ("cu_seqlens_k_new", Tensor),
        ("sm_margin", ctypes.c_int32),
    ]


class BackwardParams(ctypes.Structure):
    _fields_ = [
        ("q", Tensor), ("k", Tensor), ("v", Tensor), ("out", Tensor), ("dout", Tensor), ("lse", Tensor),
        ("dq", Tensor), ("dk", Tensor), ("dv", Tensor),
        ("cu_seqlens_q", Tensor), ("cu_seqlens_k", Tensor), ("seqused_q", Tensor), ("seqused_k", Tensor),
        ("max_seqlen_q", ctypes.c_int32), ("max_seqlen_k", ctypes.c_int32),
        ("softmax_scale", ctypes.c_float), ("softcap", ctypes.c_float),
        ("causal", ctypes.c_int32), ("window_left", ctypes.c_int32), ("window_right", ctypes.c_int32),
        ("num_sink_tokens", ctypes.c_int32), ("deterministic", ctypes.c_int32),
        ("attention_chunk", ctypes.c_int32), ("learnable_sink", Tensor), ("dsink", Tensor),
        ("sm_margin", ctypes.c_int32),
    ]


class CombineParams(ctypes.Structure):
    _fields_ = [("out_partial", Tensor), ("lse_partial", Tensor), ("out", Tensor), ("lse", Tensor)]


class KernelFamilyStruct(ctypes.Structure):
    _fields_ = [("backward", ctypes.c_int32), ("dtype", ctypes.c_int32), ("head_dim", ctypes.c_int32),
                ("head_dim_v", ctypes.c_int32)]


class FlashHopperError(RuntimeError):
    """A call the library refused or that failed; `status` names the kind."""

    def __init__(self, status: int, message: str):
        self.status = STATUS_NAMES.get(status, str(status))
        super().__init__(f"flashhopper ({self.status}): {message}")


def _find_library() -> str:
    explicit = os.environ.get("FLASHHOPPER_LIBRARY")  # an explicit choice wins
    if explicit:
        return explicit
    package_dir = pathlib.Path(__file__).resolve().parent
    installed = package_dir / "libflashhopper.so"  # put there by pip install .
    if installed.exists():
        return str(installed)
    repo_build = package_dir.parent.parent / "build" / "libflashhopper.so"  # scripts/build.sh
    return str(repo_build) if repo_build.exists() else "libflashhopper.so"


def torch_ops_library():
    """libflashhopper_torch.so (the C++ PyTorch ops, src/torch/ops.cpp) beside the library that
    lib() loads, or None where there is none (a build without torch, or a library from the path)."""
    path = pathlib.Path(_find_library())
    if path.parent == pathlib.Path("."):
        return None
    ops = path.parent / "libflashhopper_torch.so"
    return str(ops) if ops.exists() else None


_lib = None


def lib() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        path = _find_library()
        try:
            handle = ctypes.CDLL(path)
        except OSError as e:
            raise OSError(f"flashhopper: cannot load the library ({e}). Install the package with "
                          "`pip install .`, or build it (scripts/build.sh) and set "
                          "FLASHHOPPER_LIBRARY=<build>/libflashhopper.so") from e
        for name, params_type in (("forward", ForwardParams), ("backward", BackwardParams)):
            params = ctypes.POINTER(params_type)
            getattr(handle, f"fh_{name}_params_init").argtypes = [params]
            getattr(handle, f"fh_{name}_params_init").restype = None
            getattr(handle, f"fh_{name}_workspace_size").argtypes = [params, ctypes.POINTER(ctypes.c_size_t)]
            getattr(handle, f"fh_{name}_workspace_size").restype = ctypes.c_int
            getattr(handle, f"fh_{name}_check").argtypes = [params]
            getattr(handle, f"fh_{name}_check").restype = ctypes.c_int
            getattr(handle, f"fh_{name}").argtypes = [params, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
            getattr(handle, f"fh_{name}").restype = ctypes.c_int
        handle.fh_combine_params_init.argtypes = [ctypes.POINTER(CombineParams)]
        handle.fh_combine_params_init.restype = None
        handle.fh_combine.argtypes = [ctypes.POINTER(CombineParams), ctypes.c_void_p]
        handle.fh_combine.restype = ctypes.c_int
        handle.fh_last_error.argtypes = []
        handle.fh_last_error.restype = ctypes.c_char_p
        handle.fh_window_from_fa3.argtypes = [ctypes.c_int32, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                              ctypes.c_int64, ctypes.POINTER(ctypes.c_int32),
                                              ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_int64)]
        handle.fh_window_from_fa3.restype = None
        handle.fh_built_with_cuda.argtypes = []
        handle.fh_built_with_cuda.restype = ctypes.c_int32
        handle.fh_compiled_families.argtypes = [ctypes.POINTER(KernelFamilyStruct), ctypes.c_int32]
        handle.fh_compiled_families.restype = ctypes.c_int32
        handle.fh_version.argtypes = []
        handle.fh_version.restype = ctypes.c_char_p
        _lib = handle
    return _lib


def make_tensor(data_ptr: int, dtype: int, shape, stride) -> Tensor:
    t = Tensor()
    t.data = data_ptr
    t.dtype = dtype
    ndim = len(shape)
    t.ndim = ndim
    t.shape[:ndim] = shape  # slice assignment: one call, not one per dim (host work per call)
    t.stride[:ndim] = stride
    return t
