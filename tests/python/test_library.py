"""Tests that load the library but need no GPU: what the build says it compiled."""
import ctypes
import pathlib
import sys

import pytest
import torch

import flashhopper
from flashhopper import _ffi

from support import FA3_NAMES, cross_layer_cases, refused_argument

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_compiled_families_are_manifest_rows():
    """flashhopper.compiled_families() (the library's fh_compiled_families) lists rows of the
    manifest only; a build with kernels has at least the development set (bf16, hdim 128)."""
    try:
        _ffi.lib()
    except OSError as error:
        pytest.skip(f"library not loadable: {error}")
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import kernel_manifest
    finally:
        sys.path.pop(0)
    names = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.float8_e4m3fn}
    rows = {("forward" if f.pass_ == "fwd" else "backward", names[f.dtype], f.head_dim, f.head_dim_v)
            for f in kernel_manifest.families()}
    families = flashhopper.compiled_families()
    assert all(tuple(f) in rows for f in families), families
    if _ffi.lib().fh_built_with_cuda():
        for pass_ in ("forward", "backward"):
            assert (pass_, torch.bfloat16, 128, 128) in families
    else:
        assert families == []


def test_one_version_everywhere():
    """flashhopper.__version__ (CMakeLists.txt's project version) is the library's fh_version()."""
    try:
        lib = _ffi.lib()
    except OSError as error:
        pytest.skip(f"library not loadable: {error}")
    assert flashhopper.__version__ == lib.fh_version().decode()
    assert flashhopper.__version__.count(".") == 2


def test_is_available_and_build_info():
    """is_available() says whether the kernels can run here (False without an sm_90 GPU or without
    kernels); build_info() reports the library, its version and families."""
    try:
        _ffi.lib()
    except OSError as error:
        pytest.skip(f"library not loadable: {error}")
    info = flashhopper.build_info()
    assert info["version"] == flashhopper.__version__
    assert info["cuda_kernels"] == bool(_ffi.lib().fh_built_with_cuda())
    assert info["families"] == flashhopper.compiled_families()
    expected = (info["cuda_kernels"] and torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0))
    assert flashhopper.is_available() == expected == info["available"]


def test_import_without_torch_says_how_to_install():
    """`import flashhopper` where torch is missing: an ImportError with the pip command."""
    import subprocess
    code = ("import sys; sys.modules['torch'] = None\n"
            "try:\n    import flashhopper\nexcept ImportError as e:\n    print(e)\n")
    env = {"PYTHONPATH": str(ROOT / "python"), "PATH": "/usr/bin:/bin"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert "pip install torch" in result.stdout, result.stdout + result.stderr


def test_status_names_are_the_library_s():
    """The Python layer's status names (its messages, and how it reads the C++ ops' errors) are
    the C library's fh_status_name, the names' one home."""
    try:
        lib = _ffi.lib()
    except OSError as error:
        pytest.skip(f"no library to compare with: {error}")
    lib.fh_status_name.restype = ctypes.c_char_p
    lib.fh_status_name.argtypes = [ctypes.c_int]
    for status, name in _ffi.STATUS_NAMES.items():
        assert lib.fh_status_name(status).decode() == name
    assert lib.fh_status_name(99).decode() == "unknown status"


@pytest.mark.parametrize("kwargs, c_name", [pytest.param(*case[1:], id=case[0]) for case in cross_layer_cases()])
def test_python_api_and_c_abi_refuse_alike(monkeypatch, kwargs, c_name):
    """The same call through flash_attn_func and through the C ABI's check (fh_forward_check, the
    rules' one home) is refused by both, naming the same argument, or accepted by both: the Python
    layer may refuse earlier, never differently. (The C++ ops run only on CUDA tensors: the GPU
    tests cover them.) The device check is stood in for, and an accepted call stops before the
    launch."""
    try:
        lib = _ffi.lib()
    except OSError as error:
        pytest.skip(f"no library to compare with: {error}")
    from flashhopper import interface
    from flashhopper.flash_attn_interface import flash_attn_func

    class Accepted(Exception):
        pass

    def accept(*args):
        raise Accepted()
    monkeypatch.setattr(interface, "check_devices", lambda named: None)
    monkeypatch.setattr(interface, "_launch", accept)
    monkeypatch.setattr(interface, "_PLANS", {})
    call = dict(kwargs)
    q, k, v = call.pop("q"), call.pop("k"), call.pop("v")
    python_name = None
    try:
        flash_attn_func(q, k, v, **call)
    except Accepted:
        pass
    except _ffi.FlashHopperError as error:
        python_name = refused_argument(error)

    params = _ffi.ForwardParams()
    lib.fh_forward_params_init(ctypes.byref(params))
    out = torch.empty(*q.shape[:-1], v.shape[-1], dtype=q.dtype)
    lse = torch.empty(q.shape[0], q.shape[2], q.shape[1])
    interface._set_views(params, [("q", q), ("k", k), ("v", v), ("out", out), ("lse", lse),
                                  ("learnable_sink", call.get("learnable_sink"))])
    left, right = call.get("window_size", (-1, -1))
    params.causal, params.window_left, params.window_right = (0, left, 0) if call.get("causal") else (0, left, right)
    params.softcap = call.get("softcap", 0.0)
    params.attention_chunk = call.get("attention_chunk", 0)
    params.num_splits = call.get("num_splits", 1)
    params.softmax_scale = call.get("softmax_scale", 0.0)
    lib.fh_forward_check.argtypes = [ctypes.POINTER(_ffi.ForwardParams)]
    lib.fh_forward_check.restype = ctypes.c_int
    lib.fh_last_error.restype = ctypes.c_char_p
    status = lib.fh_forward_check(ctypes.byref(params))
    message = lib.fh_last_error().decode()
    assert (status == 0) == (c_name is None), message
    if c_name is not None:
        assert message.split(":", 1)[0] == c_name, message
    assert python_name == (None if c_name is None else FA3_NAMES.get(c_name, c_name))
