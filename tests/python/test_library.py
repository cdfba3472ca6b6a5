"""Tests that load the library but need no GPU: what the build says it compiled."""
import pathlib
import sys

import pytest
import torch

import flashhopper
from flashhopper import _ffi

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
    names = {"bf16": torch.bfloat16, "fp16": torch.float16}
    rows = {("forward" if f.pass_ == "fwd" else "backward", names[f.dtype], f.head_dim, f.head_dim_v)
            for f in kernel_manifest.families()}
    families = flashhopper.compiled_families()
    assert all(tuple(f) in rows for f in families), families
    if _ffi.lib().fh_built_with_cuda():
        for pass_ in ("forward", "backward"):
            assert (pass_, torch.bfloat16, 128, 128) in families
    else:
        assert families == []
