"""CPU-side tests (no GPU, no library load): the package imports, the ops are registered with the
right schemas, FA3's API is matched (plus FA4's learnable_sink), argument checks (tensors, window_size,
softcap, attention_chunk, learnable_sink, and varlen's cu_seqlens, seqused and max_seqlen) raise the
right error naming the argument before anything reaches the library, the parameter structs carry the
options (and the packed layout) as the C ABI reads them and mirror the header's layout, and the fake
(meta) implementations infer shapes, dtypes and strides, dense and varlen, also through autograd and
torch.compile."""
import ctypes
import inspect
import itertools
import math
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import flashhopper
import flashhopper.flash_attn_interface as fa3
from flashhopper import _ffi, flash_attn_func, interface

from support import attention_reference, recording_backend, varlen_attention_reference, visible_keys


_LIBRARY_RULES = {"fh_window_from_fa3", "fh_forward_params_init", "fh_backward_params_init", "fh_forward_check",
                  "fh_backward_check", "fh_last_error"}


@pytest.fixture(autouse=True)
def library_must_not_be_called(monkeypatch):
    """Every refusal under test comes before any launch, workspace query or allocation on a device:
    only the library's pure rule functions stay reachable, which the Python layer calls on the
    arguments' metadata (the checks, their structs' defaults and messages, FlashAttention's window
    convention)."""
    real = _ffi.lib

    class RulesOnly:
        def __getattr__(self, name):
            if name not in _LIBRARY_RULES:
                raise AssertionError(f"the library was reached ({name}); the argument check should have refused "
                                     "first")
            try:
                return getattr(real(), name)
            except OSError as error:  # no build here: the tests that need the rules skip, saying so
                pytest.skip(f"needs the library's {name}: {error}")
    monkeypatch.setattr(_ffi, "lib", RulesOnly)


def qkv(batch=2, seqlen_q=64, seqlen_k=96, heads_q=8, heads_kv=2, head_dim=128, dtype=torch.bfloat16, device="cpu",
        requires_grad=False):
    q = torch.randn(batch, seqlen_q, heads_q, head_dim, dtype=dtype, device=device, requires_grad=requires_grad)
    k = torch.randn(batch, seqlen_k, heads_kv, head_dim, dtype=dtype, device=device, requires_grad=requires_grad)
    v = torch.randn(batch, seqlen_k, heads_kv, head_dim, dtype=dtype, device=device, requires_grad=requires_grad)
    return q, k, v


VARLEN_SEQLENS_Q = (3, 0, 50, 11)  # zero-length sequences in the middle and at the end, sq != sk
VARLEN_SEQLENS_K = (5, 9, 40, 0)


def cu_seqlens(lengths, device="cpu"):
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)


def varlen_args(seqlens_q=VARLEN_SEQLENS_Q, seqlens_k=VARLEN_SEQLENS_K, heads_q=8, heads_kv=2, head_dim=128,
                dtype=torch.bfloat16, device="cpu", requires_grad=False):
    """flash_attn_varlen_func's first seven arguments: packed q [total_q, Hq, d], k/v [total_k, Hkv, d],
    cu_seqlens_q/k, max_seqlen_q/k."""
    def randn(total, heads):
        return torch.randn(total, heads, head_dim, dtype=dtype, device=device, requires_grad=requires_grad)
    return (randn(sum(seqlens_q), heads_q), randn(sum(seqlens_k), heads_kv), randn(sum(seqlens_k), heads_kv),
            cu_seqlens(seqlens_q, device), cu_seqlens(seqlens_k, device), max(seqlens_q), max(seqlens_k))


# ----------------------------------------------------------------------------------------------
# Import, registration, API shape

def test_import_and_exports():
    assert flashhopper.flash_attn_func is fa3.flash_attn_func
    for name in ("flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func", "flash_attn_with_kvcache",
                 "flash_attn_combine", "forward", "backward", "Varlen", "use_as_sdpa_flash_backend",
                 "FlashHopperError"):
        assert hasattr(flashhopper, name), name
    assert issubclass(flashhopper.FlashHopperNotSupported, NotImplementedError)
    assert issubclass(flashhopper.FlashHopperInvalidArgument, ValueError)
    assert issubclass(flashhopper.FlashHopperError, RuntimeError)


def test_ops_registered():
    fwd_schema = str(torch.ops.flashhopper.fwd.default._schema)
    bwd_schema = str(torch.ops.flashhopper.bwd.default._schema)
    options = ("SymInt window_left=-1, SymInt window_right=-1, float softcap=0., SymInt attention_chunk=0, "
               "Tensor? learnable_sink=None, Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, "
               "SymInt? max_seqlen_q=None, SymInt? max_seqlen_k=None, Tensor? seqused_q=None, Tensor? seqused_k=None")
    assert fwd_schema == ("flashhopper::fwd(Tensor q, Tensor k, Tensor v, float? softmax_scale=None, "
                          f"bool causal=False, bool deterministic=False, {options}, SymInt num_splits=1, "
                          "SymInt sm_margin=0, Tensor? q_descale=None, Tensor? k_descale=None, "
                          "Tensor? v_descale=None) -> (Tensor, Tensor)")
    assert bwd_schema == ("flashhopper::bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
                          f"float? softmax_scale=None, bool causal=False, bool deterministic=False, {options}, "
                          "SymInt sm_margin=0) -> (Tensor, Tensor, Tensor, Tensor)")


def test_cpp_ops_load_where_the_build_made_them():
    """Where the build made libflashhopper_torch.so (a torch >= 2.9 was found), the package uses it:
    the C++ ops own the schemas, which are ops.py's (the Python fallback's) exactly."""
    from flashhopper import _ffi, ops
    if _ffi.torch_ops_library() is None:
        pytest.skip("this build has no C++ PyTorch ops (no CUDA torch >= 2.9 at configure time)")
    assert ops.NATIVE
    assert str(torch.ops.flashhopper.fwd.default._schema) == "flashhopper::" + ops.FWD_SCHEMA
    assert str(torch.ops.flashhopper.bwd.default._schema) == "flashhopper::" + ops.BWD_SCHEMA


def test_python_ops_when_the_cpp_ones_are_switched_off():
    """FLASHHOPPER_TORCH_OPS=0: the Python ops, with the same schemas and the same checks."""
    code = ("import torch, flashhopper\n"
            "from flashhopper import ops\n"
            "assert not ops.NATIVE\n"
            "assert str(torch.ops.flashhopper.fwd.default._schema) == 'flashhopper::' + ops.FWD_SCHEMA\n"
            "assert str(torch.ops.flashhopper.bwd.default._schema) == 'flashhopper::' + ops.BWD_SCHEMA\n"
            "q = torch.zeros(1, 8, 2, 64, dtype=torch.bfloat16)\n"
            "try:\n"
            "    torch.ops.flashhopper.fwd(q, q, q)\n"
            "except flashhopper.FlashHopperInvalidArgument as e:\n"
            "    assert 'q: must be a CUDA tensor' in str(e)\n"
            "else:\n"
            "    raise AssertionError('no refusal')\n")
    env = dict(os.environ, FLASHHOPPER_TORCH_OPS="0")
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]


# FlashAttention-3's hopper/flash_attn_interface.py parameter lists (names, order and defaults).
FA3_SIGNATURES = {
    "flash_attn_func": [("q", None), ("k", None), ("v", None), ("softmax_scale", None), ("causal", False),
                        ("qv", None), ("q_descale", None), ("k_descale", None), ("v_descale", None),
                        ("window_size", (-1, -1)), ("attention_chunk", 0), ("softcap", 0.0), ("num_splits", 1),
                        ("pack_gqa", None), ("deterministic", False), ("sm_margin", 0),
                        ("return_attn_probs", False)],
    "flash_attn_varlen_func": [("q", None), ("k", None), ("v", None), ("cu_seqlens_q", None),
                               ("cu_seqlens_k", None), ("max_seqlen_q", None), ("max_seqlen_k", None),
                               ("seqused_q", None), ("seqused_k", None), ("softmax_scale", None), ("causal", False),
                               ("qv", None), ("q_descale", None), ("k_descale", None), ("v_descale", None),
                               ("window_size", (-1, -1)), ("attention_chunk", 0), ("softcap", 0.0),
                               ("num_splits", 1), ("pack_gqa", None), ("deterministic", False), ("sm_margin", 0),
                               ("return_attn_probs", False)],
    "flash_attn_with_kvcache": [("q", None), ("k_cache", None), ("v_cache", None), ("k", None), ("v", None),
                                ("qv", None), ("rotary_cos", None), ("rotary_sin", None), ("cache_seqlens", None),
                                ("cache_batch_idx", None), ("cache_leftpad", None), ("page_table", None),
                                ("cu_seqlens_q", None), ("cu_seqlens_k_new", None), ("max_seqlen_q", None),
                                ("rotary_seqlens", None), ("q_descale", None), ("k_descale", None),
                                ("v_descale", None), ("softmax_scale", None), ("causal", False),
                                ("window_size", (-1, -1)), ("attention_chunk", 0), ("softcap", 0.0),
                                ("rotary_interleaved", True), ("scheduler_metadata", None), ("num_splits", 0),
                                ("pack_gqa", None), ("sm_margin", 0), ("return_softmax_lse", False)],
    "flash_attn_combine": [("out_partial", None), ("lse_partial", None), ("out", None), ("out_dtype", None)],
    "get_scheduler_metadata": [("batch_size", None), ("max_seqlen_q", None), ("max_seqlen_k", None),
                               ("num_heads_q", None), ("num_heads_kv", None), ("headdim", None),
                               ("cache_seqlens", None), ("qkv_dtype", torch.bfloat16), ("headdim_v", None),
                               ("cu_seqlens_q", None), ("cu_seqlens_k_new", None), ("cache_leftpad", None),
                               ("page_size", None), ("max_seqlen_k_new", 0), ("causal", False),
                               ("window_size", (-1, -1)), ("attention_chunk", 0), ("has_softcap", False),
                               ("num_splits", 0), ("pack_gqa", None), ("sm_margin", 0)],
    "flash_attn_qkvpacked_func": [("qkv", None), ("softmax_scale", None), ("causal", False), ("q_descale", None),
                                  ("k_descale", None), ("v_descale", None), ("window_size", (-1, -1)),
                                  ("attention_chunk", 0), ("softcap", 0.0), ("deterministic", False),
                                  ("num_heads_q", None), ("sm_margin", 0), ("return_attn_probs", False)],
}


# FlashAttention-4's learnable_sink, accepted as a keyword after FA3's parameters (so that FA3's
# positional calls keep their meaning), and then flash_attn_varlen_func's page_table (paged keys).
FA4_EXTRAS = {"flash_attn_func": [("learnable_sink", None)],
              "flash_attn_varlen_func": [("learnable_sink", None), ("page_table", None)],
              "flash_attn_qkvpacked_func": [("learnable_sink", None)]}


@pytest.mark.parametrize("name", sorted(FA3_SIGNATURES))
def test_fa3_signatures(name):
    params = inspect.signature(getattr(fa3, name)).parameters.values()
    got = [(p.name, None if p.default is inspect.Parameter.empty else p.default) for p in params]
    assert got == FA3_SIGNATURES[name] + FA4_EXTRAS.get(name, [])


def test_module_alias_import():
    code = "import flashhopper.flash_attn_interface as fa3; print(fa3.flash_attn_func.__module__)"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "flashhopper.flash_attn_interface"


# ----------------------------------------------------------------------------------------------
# What the kernels cannot do yet: NotImplementedError naming the argument, before device checks

@pytest.mark.parametrize("kwargs, argument", [
    (dict(softmax_scale=0.0), "softmax_scale"),
])
def test_not_implemented_arguments(kwargs, argument):
    q, k, v = qkv()  # CPU tensors: the NotImplementedError must come before the device check
    with pytest.raises(NotImplementedError, match=argument):
        flash_attn_func(q, k, v, **kwargs)
    with pytest.raises(NotImplementedError, match=argument):
        fa3.flash_attn_varlen_func(*varlen_args(), **kwargs)


def test_forward_only_head_dims_refuse_a_gradient(monkeypatch):
    """Every head dim the forward takes has a backward (512 both passes): a call that asks for a
    gradient at 512 or a padded 320 is not refused. Were the backward's bound below the forward's,
    such a call would be refused at its forward (after the library's check, which the stub stands
    for), naming the bound: checked with the bound lowered to 256. (The forward itself runs on the
    GPU only: stubbed.)"""
    monkeypatch.setattr(fa3.ops, "fwd_eager",
                        lambda q, k, v, *rest, **options: (torch.empty(*q.shape[:-1], v.shape[-1]), None))
    assert interface.MAX_BACKWARD_HEAD_DIM == interface.MAX_HEAD_DIM == 512
    for head_dim in (512, 320, 256):
        q, k, v = (torch.randn(1, 8, 2, head_dim, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        assert flash_attn_func(q, k, v).shape == (1, 8, 2, head_dim)
    monkeypatch.setattr(interface, "MAX_BACKWARD_HEAD_DIM", 256)
    for head_dim in (512, 320):
        q, k, v = (torch.randn(1, 8, 2, head_dim, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        with pytest.raises(NotImplementedError, match=rf"q: head dims \({head_dim}, {head_dim}\) run forward only "
                                                      r"\(the backward takes head dims up to 256\)"):
            flash_attn_func(q, k, v)


def test_not_implemented_dtypes():
    """fp8 dtypes other than float8_e4m3fn (FA3's) are refused by name."""
    q, k, v = qkv()
    for name in ("float8_e5m2", "float8_e4m3fnuz"):
        if hasattr(torch, name):
            with pytest.raises(NotImplementedError, match="q: dtype .* takes torch.float8_e4m3fn alone"):
                flash_attn_func(*(t.to(getattr(torch, name)) for t in (q, k, v)))


@pytest.mark.parametrize("name", ["q_descale", "k_descale", "v_descale"])
def test_descales_apply_to_fp8_inputs_only(name):
    """Descale factors with bf16 inputs: the library's rule, naming the factor (dense and packed)."""
    q, k, v = qkv()
    with pytest.raises(ValueError, match=rf"{name}: is given but q is bf16; descale factors apply to fp8_e4m3"):
        flash_attn_func(q, k, v, **{name: torch.ones(2, 2)})
    with pytest.raises(ValueError, match=rf"{name}: is given but q is bf16"):
        fa3.flash_attn_varlen_func(*varlen_args(), **{name: torch.ones(2, 2)})


def test_fp8_is_forward_only_eager_and_dense():
    """fp8 inputs: out is bf16 (the library's check runs on a bf16 stand-in for it); a call that
    asks for a gradient, one with qv or a page table is refused by name before any device check."""
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("this PyTorch has no float8_e4m3fn")
    q, k, v = (t.to(torch.float8_e4m3fn) for t in qkv())
    with pytest.raises(ValueError, match="q: expected a CUDA tensor|must be on a CUDA device|device"):
        flash_attn_func(q, k, v)  # checked as fp8 with a bf16 out, then refused for the CPU device
    descale = torch.ones(2, 2)
    q_grad = q.to(torch.float32).requires_grad_().to(torch.float8_e4m3fn)
    with pytest.raises(NotImplementedError, match="fp8 attention has no backward"):
        flash_attn_func(q_grad, k, v, q_descale=descale)
    with pytest.raises(NotImplementedError, match="qv: not with fp8 inputs"):
        flash_attn_func(q, k, v, qv=torch.zeros(2, 64, 2, 64, dtype=torch.bfloat16))


def test_fp8_column_major_v_passes_the_checks():
    """fp8's v may be column-major (keys contiguous, FA3's V_colmajor): the library's check takes it
    (the call then stops at the device check); a bf16 one is refused by the last-dim rule."""
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("this PyTorch has no float8_e4m3fn")
    q, k = (torch.randn(2, 64, h, 64).to(torch.float8_e4m3fn) for h in (8, 2))
    v = torch.randn(2, 2, 64, 64).to(torch.float8_e4m3fn).permute(0, 3, 1, 2)
    with pytest.raises(ValueError, match="q: must be a CUDA tensor"):
        flash_attn_func(q, k, v)
    with pytest.raises(ValueError, match=r"v: stride\[3\] is 64 but the last dim must be contiguous"):
        flash_attn_func(q.to(torch.bfloat16), k.to(torch.bfloat16), v.to(torch.bfloat16))


def test_fp8_kvcache_takes_descales_eagerly():
    """flash_attn_with_kvcache hands fp8's descales to the library, which checks them ([B, Hkv]);
    get_scheduler_metadata plans float8_e4m3fn calls and refuses the other fp8 dtypes naming
    qkv_dtype."""
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("this PyTorch has no float8_e4m3fn")
    q = torch.randn(2, 1, 8, 64).to(torch.float8_e4m3fn)
    cache = torch.randn(2, 128, 2, 64).to(torch.float8_e4m3fn)
    lengths = torch.tensor([5, 9], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"q_descale: shape\[0\] \(batch size\) is 3"):
        fa3.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=lengths, q_descale=torch.ones(3, 2))
    with pytest.raises(ValueError, match="v_descale: dtype"):
        fa3.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=lengths, v_descale=torch.ones(2, 2).double())
    with pytest.raises(ValueError, match="q: must be a CUDA tensor"):  # checked as fp8 with a bf16 out
        fa3.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=lengths, k_descale=torch.ones(2, 2))
    plan = fa3.get_scheduler_metadata(2, 1, 128, 8, 2, 64, lengths, qkv_dtype=torch.float8_e4m3fn)
    assert plan.tolist() == [0]
    if hasattr(torch, "float8_e5m2"):
        with pytest.raises(NotImplementedError, match="qkv_dtype=torch.float8_e5m2"):
            fa3.get_scheduler_metadata(2, 1, 128, 8, 2, 64, lengths, qkv_dtype=torch.float8_e5m2)


def test_fp8_calls_trace_as_the_ops():
    """Traced (make_fx over fake tensors, as torch.compile and torch.export see them), fp8 calls with
    descales run as one flashhopper op with its descales as inputs: flash_attn_func and
    flash_attn_varlen_func as fwd, flash_attn_with_kvcache and the paged varlen call as
    fwd_kvcache; out is bf16, lse float32; the fake functions run the library's check, so a
    descale of the wrong shape is refused by name."""
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("this PyTorch has no float8_e4m3fn")

    def fake(*shape, dtype=torch.float8_e4m3fn):
        return torch.empty(*shape, dtype=dtype, device="cuda")

    def traced_calls(fn, *args):
        graph = make_fx(fn, tracing_mode="fake")(*args)
        calls = [n for n in graph.graph.nodes if n.op == "call_function" and "flashhopper" in str(n.target)]
        assert len(calls) == 1
        # the descales are the op's last three inputs, traced as the placeholders given
        assert [a.name if hasattr(a, "name") else a for a in calls[0].args[-3:]] == ["q_descale_1", "k_descale_1",
                                                                                     "v_descale_1"]
        return str(calls[0].target)

    def dense(q, k, v, q_descale, k_descale, v_descale):
        out, lse = flash_attn_func(q, k, v, causal=True, q_descale=q_descale, k_descale=k_descale,
                                   v_descale=v_descale, return_attn_probs=True)
        assert out.dtype == torch.bfloat16 and out.shape == q.shape and lse.shape == (2, 8, 64)
        return out

    def kvcache(q, k, v, q_descale, k_descale, v_descale):
        lengths = torch.full((2,), 100, dtype=torch.int32, device="cuda")
        out = fa3.flash_attn_with_kvcache(q, k, v, cache_seqlens=lengths, causal=True, q_descale=q_descale,
                                          k_descale=k_descale, v_descale=v_descale)
        assert out.dtype == torch.bfloat16 and out.shape == q.shape
        return out

    def paged(q, k, v, q_descale, k_descale, v_descale):
        cu_q = torch.tensor([0, 64, 128], dtype=torch.int32, device="cuda")
        cu_k = torch.tensor([0, 100, 228], dtype=torch.int32, device="cuda")
        table = torch.arange(8, dtype=torch.int32, device="cuda").view(2, 4)
        out = fa3.flash_attn_varlen_func(q.flatten(0, 1), k.view(8, 32, 2, 128), v.view(8, 32, 2, 128), cu_q,
                                         cu_k, 64, 128, page_table=table, q_descale=q_descale,
                                         k_descale=k_descale, v_descale=v_descale)
        assert out.dtype == torch.bfloat16 and out.shape == (128, 8, 128)
        return out

    with FakeTensorMode():
        args = (fake(2, 64, 8, 128), fake(2, 128, 2, 128), fake(2, 128, 2, 128),
                *(fake(2, 2, dtype=torch.float32) for _ in range(3)))
        assert traced_calls(dense, *args) == "flashhopper.fwd.default"
        assert traced_calls(kvcache, *args) == "flashhopper.fwd_kvcache.default"
        assert traced_calls(paged, *args) == "flashhopper.fwd_kvcache.default"
        with pytest.raises(ValueError, match=r"k_descale: shape\[0\] \(batch size\) is 3"):
            make_fx(dense, tracing_mode="fake")(*args[:4], fake(3, 2, dtype=torch.float32), args[5])


@pytest.mark.parametrize("head_dim, head_dim_v", [(128, 64), (192, 128), (64, 256), (64, 512), (96, 59)])
def test_value_head_dim_other_than_head_dim(head_dim, head_dim_v):
    """out takes v's head dim (dense and packed), under fake tensors; past 256 it is refused."""
    with FakeTensorMode():
        q, k, v = qkv(head_dim=head_dim, device="cuda")
        v = torch.empty(*v.shape[:-1], head_dim_v, dtype=v.dtype, device="cuda")
        assert flash_attn_func(q, k, v).shape == (*q.shape[:-1], head_dim_v)
        q, k, v, *varlen = varlen_args(head_dim=head_dim, device="cuda")
        v = torch.empty(*v.shape[:-1], head_dim_v, dtype=v.dtype, device="cuda")
        assert fa3.flash_attn_varlen_func(q, k, v, *varlen).shape == (*q.shape[:-1], head_dim_v)
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"v: shape\[3\] \(value head dim\) is 520; value head dims up to 512"):
        flash_attn_func(q, k, torch.randn(*v.shape[:-1], 520, dtype=v.dtype))


def test_flash_attn_with_kvcache_checks_its_arguments():
    """FA3's names in every refusal, before the library: what FlashHopper cannot do yet is a
    NotImplementedError naming the argument, a bad tensor a ValueError."""
    q = torch.randn(2, 1, 8, 64, dtype=torch.bfloat16)
    k_cache = v_cache = torch.randn(2, 128, 2, 64, dtype=torch.bfloat16)
    new = torch.randn(2, 1, 2, 64, dtype=torch.bfloat16)
    lengths = torch.tensor([5, 9], dtype=torch.int32)
    refusals = [
        (dict(q=q[0]), ValueError, "q: ndim is 3 but dense (no cu_seqlens_q) q must be 4-d"),
        (dict(k_cache=k_cache.half()), ValueError, "k_cache: dtype is fp16 but q's is bf16"),
        (dict(k=new), ValueError, "v: is required together with k"),
        (dict(cache_seqlens=lengths.long()), ValueError, "cache_seqlens: dtype torch.int64 is not supported"),
        (dict(cache_leftpad=lengths[:1]), ValueError, "cache_leftpad: shape[0] (batch size) is 1 but q's batch size is 2"),
        (dict(q=q[:, 0], cu_seqlens_q=torch.tensor([0, 1, 2], dtype=torch.int32)), ValueError, "max_seqlen_q"),
        (dict(window_size=(-2, 0)), ValueError, "window_size"),
        (dict(k_descale=torch.ones(2, 2)), ValueError, "k_descale: is given but q is bf16; descale factors apply"),
        (dict(k=new, v=new, cu_seqlens_k_new=lengths), ValueError,
         "k: ndim is 4 but"),
        (dict(k=new[:, 0], v=new[:, 0], cu_seqlens_k_new=lengths), ValueError,
         "cu_seqlens_k_new: shape[0] is 2 but must be batch size + 1 = 3"),
        (dict(cu_seqlens_k_new=lengths), ValueError, "q: must be a CUDA tensor"),  # ignored without k and v
        (dict(num_splits=2.0), ValueError, "num_splits: expected an int, got float"),
        (dict(scheduler_metadata=lengths), ValueError, "scheduler_metadata: expected the plan"),
        (dict(scheduler_metadata=fa3.get_scheduler_metadata(2, 1, 128, 8, 2, 64, lengths, num_splits=3),
              num_splits=2), ValueError, "num_splits: 2 differs from scheduler_metadata's 3"),
        (dict(), ValueError, "q: must be a CUDA tensor"),  # all valid but on the CPU
    ]
    for kwargs, error, message in refusals:
        args = dict(q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=lengths)
        args.update(kwargs)
        with pytest.raises(error, match=re.escape(message)):
            fa3.flash_attn_with_kvcache(**args)


def test_get_scheduler_metadata_is_the_split_count(monkeypatch):
    """get_scheduler_metadata checks the shapes as flash_attn_with_kvcache would and returns the
    plan, the split-KV count (0: chosen from the shapes at the call), which the call then uses."""
    lengths = torch.tensor([5, 9], dtype=torch.int32)
    plan = fa3.get_scheduler_metadata(2, 1, 128, 8, 2, 64, lengths)
    assert plan.dtype == torch.int32 and plan.device.type == "cpu" and plan.tolist() == [0]
    assert fa3.get_scheduler_metadata(2, 1, 128, 8, 2, 64, lengths, page_size=64, num_splits=7).tolist() == [7]
    refusals = [
        (dict(num_heads_kv=3), ValueError, "k_cache: shape[2] (number of key/value heads) is 3, which does not divide q's number of query heads 8"),
        (dict(batch_size=0), ValueError, "batch_size: is 0; must be at least 1"),
        (dict(headdim=520), ValueError, "q: shape[3] (head dim) is 520; head dims up to 512 are supported"),
        (dict(cache_seqlens=lengths[:1]), ValueError, "cache_seqlens: shape[0] (batch size) is 1 but q's batch size is 2"),
        (dict(num_splits=300), ValueError, "num_splits: is 300; must be in [0, 256]"),
        (dict(window_size=(-2, 0)), ValueError, "window_size"),
        (dict(qkv_dtype=torch.float32), ValueError, "q: dtype is float32; must be bf16, fp16"),
        (dict(page_size=0), ValueError, "page_size: is 0; must be at least 1"),
        (dict(sm_margin=4.0), ValueError, "sm_margin: expected an int, got float"),
    ]
    for kwargs, error, message in refusals:
        args = dict(batch_size=2, max_seqlen_q=1, max_seqlen_k=128, num_heads_q=8, num_heads_kv=2, headdim=64,
                    cache_seqlens=lengths)
        args.update(kwargs)
        with pytest.raises(error, match=re.escape(message)):
            fa3.get_scheduler_metadata(**args)
    captured = _captured_params(monkeypatch)
    q = torch.randn(2, 1, 8, 64, dtype=torch.bfloat16)
    k_cache = v_cache = torch.randn(2, 128, 2, 64, dtype=torch.bfloat16)
    fa3.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths,
                                scheduler_metadata=fa3.get_scheduler_metadata(2, 1, 128, 8, 2, 64, lengths,
                                                                              num_splits=5))
    assert captured[0].num_splits == 5


def test_host_overhead_components_run_without_a_gpu():
    """bench/profile/host_overhead.py --components times the Python layer's steps on the CPU (its
    GPU mode needs a GPU); a short run prints its table."""
    script = pathlib.Path(__file__).resolve().parents[2] / "bench" / "profile" / "host_overhead.py"
    result = subprocess.run([sys.executable, str(script), "--components", "--calls", "20", "--loops", "1"],
                            capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(script.parents[2] / "python")})
    assert result.returncode == 0, result.stderr
    assert "| check_forward (the library's check on stand-ins) |" in result.stdout


def test_host_overhead_rounds_take_every_row_in_turn():
    """host_overhead.py's end-to-end timing: each round times every row in turn (after one warm-up
    call each), a row that fails its first call is reported by its error and skipped, and the table
    gives the median, the fastest round and the median same-round ratio to the reference row."""
    import importlib.util
    script = pathlib.Path(__file__).resolve().parents[2] / "bench" / "profile" / "host_overhead.py"
    spec = importlib.util.spec_from_file_location("host_overhead", script)
    host_overhead = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(host_overhead)
    order = []

    def fails():
        order.append("b")
        raise RuntimeError("no such backend")

    rows = {"a": lambda: order.append("a"), "b": fails, "ref": lambda: order.append("ref")}
    samples = host_overhead.interleaved_us(rows, calls=2, rounds=3, sync=lambda: order.append("|"))
    assert order == ["a", "b", "ref"] + ["|", "a", "a", "|", "ref", "ref"] * 3 + ["|"]
    assert len(samples["a"]) == len(samples["ref"]) == 3 and isinstance(samples["b"], RuntimeError)
    table = host_overhead.host_table({"a": [2.0, 9.0, 3.0], "b": samples["b"], "ref": [1.0, 3.0, 2.0]}, "ref")
    assert table[0] == "| call | us per call (median) | fastest round | / ref (same round) |"
    assert table[2:] == ["| a | 3.0 | 2.0 | 2.00 |", "| b | - (RuntimeError) | | |", "| ref | 2.0 | 1.0 | 1.00 |"]


def test_library_refusals_take_the_callers_names():
    """flash_attn_with_kvcache's k_cache is the C ABI's k, its k the C ABI's k_new: a library
    refusal naming those is re-raised with FA3's name, the same type and status."""
    from flashhopper import interface
    error = interface.invalid_argument("k_new: shape[1] is 3 but must be 1 (number of new tokens)")
    renamed = interface._renamed(error, interface._KVCACHE_NAMES)
    assert isinstance(renamed, interface.FlashHopperInvalidArgument) and renamed.status == error.status
    assert str(renamed) == "flashhopper (invalid argument): k: shape[1] is 3 but must be 1 (number of new tokens)"
    assert str(interface._renamed(interface.invalid_argument("v: bad"), interface._KVCACHE_NAMES)).endswith(
        "v_cache: bad")
    other = interface.not_supported("forward: the KV cache is not supported")
    assert interface._renamed(other, interface._KVCACHE_NAMES) is other


def test_flash_attn_combine_checks_its_arguments():
    """FA3's layout: out_partial [num_splits, B, sq, H, d], lse_partial [num_splits, B, sq, H], both
    float32; out [B, sq, H, d] in out_dtype. Refused before the library, naming the argument."""
    out_partial, lse_partial = torch.randn(3, 2, 5, 4, 8), torch.randn(3, 2, 5, 4)
    cases = [
        ((out_partial[0], lse_partial), {}, "out_partial: expected 5 dims"),
        ((out_partial.bfloat16(), lse_partial), {}, "out_partial: dtype torch.bfloat16"),
        ((out_partial, lse_partial[:, :, :4]), {}, "lse_partial: shape"),
        ((out_partial, lse_partial.double()), {}, "lse_partial: dtype"),
        ((out_partial, lse_partial), dict(out_dtype=torch.int32), "out_dtype"),
        ((out_partial, lse_partial), dict(out=torch.empty(2, 5, 4, 7)), "out: dtype"),
        ((out_partial, lse_partial), dict(out=torch.empty(2, 5, 4, 8), out_dtype=torch.bfloat16), "out: dtype"),
    ]
    for args, kwargs, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            fa3.flash_attn_combine(*args, **kwargs)


@pytest.mark.parametrize("kwargs", [
    dict(), dict(causal=True), dict(window_size=(-1, 0)), dict(window_size=(95, 0)), dict(window_size=(-1, 63)),
    dict(window_size=(200, 200)), dict(num_splits=0), dict(num_splits=3), dict(pack_gqa=True),
    dict(deterministic=True),
    dict(window_size=(16, 16)), dict(window_size=(-1, 16)), dict(window_size=(16, -1)), dict(window_size=(0, 0)),
    dict(window_size=(16, 0), causal=True), dict(window_size=(16, 16), causal=True), dict(window_size=None),
    dict(window_size=(None, 0)), dict(window_size=[8, 8]), dict(softcap=30.0), dict(softcap=1),
    dict(attention_chunk=128), dict(attention_chunk=None), dict(attention_chunk=32, causal=True),
    dict(softcap=15.0, window_size=(32, 0), attention_chunk=64),
    dict(learnable_sink=torch.zeros(8)),  # CPU: refused by the device check, after q's
])
def test_supported_options_reach_the_device_check(kwargs):
    """Local windows, causal with a window, chunks, softcap and learnable_sink are accepted, as are
    num_splits and the pack_gqa hint, dense and varlen: the next refusal is the CPU device."""
    q, k, v = qkv()  # seqlen_q 64, seqlen_k 96
    with pytest.raises(ValueError, match="q: must be a CUDA tensor"):
        flash_attn_func(q, k, v, **kwargs)
    with pytest.raises(ValueError, match="q: must be a CUDA tensor"):
        fa3.flash_attn_varlen_func(*varlen_args(), **kwargs)


# ----------------------------------------------------------------------------------------------
# Bad tensors: ValueError naming the argument (checked on CPU tensors, before the device check)

def _misaligned_stride_q():
    batch, seqlen, heads, head_dim = 2, 64, 8, 128
    flat = torch.randn(batch, seqlen * heads * head_dim + 4, dtype=torch.bfloat16)[:, : seqlen * heads * head_dim]
    return flat.view(batch, seqlen, heads, head_dim)  # stride[0] = n + 4, not a multiple of 8


@pytest.mark.parametrize("make, pattern", [
    (lambda q, k, v: (q.float(), k.float(), v.float()), "q: dtype is float32; must be bf16, fp16"),
    (lambda q, k, v: (q, k.half(), v), "k: dtype is fp16 but q's is bf16"),
    (lambda q, k, v: (q, k, v.half()), "v: dtype is fp16 but q's is bf16"),
    (lambda q, k, v: (q[0], k, v), r"q: ndim is 3 but dense \(no cu_seqlens_q\) q must be 4-d"),
    (lambda q, k, v: (q, k[0], v), r"k: ndim is 3 but dense \(no cu_seqlens_k, no page_table\) k must be 4-d"),
    (lambda q, k, v: (q, k, v.unsqueeze(0)), r"v: ndim is 5 but dense \(no cu_seqlens_k, no page_table\) v must be"),
    (lambda q, k, v: (q, k[:1], v[:1]), "k: shape\\[0\\] \\(batch size\\) is 1 but q's batch size is 2"),
    (lambda q, k, v: (q, k, v[:, :50]), "v: shape"),
    (lambda q, k, v: (q, k[..., :64], v), "k: shape\\[3\\] \\(head dim\\) is 64 but q's head dim is 128"),
    (lambda q, k, v: (q, torch.cat([k, k[:, :, :1]], 2), torch.cat([v, v[:, :, :1]], 2)), "k: shape\\[2\\] \\(number of key/value heads\\) is 3, which does not divide"),
    (lambda q, k, v: tuple(torch.randn(2, 16, 2, 520, dtype=torch.bfloat16) for _ in range(3)), "q: shape\\[3\\] \\(head dim\\) is 520; head dims up to 512"),
    (lambda q, k, v: (q.transpose(-1, -2).contiguous().transpose(-1, -2), k, v), "q: stride\\[3\\] is 8 but the last dim must be contiguous"),
    (lambda q, k, v: (q, k, v.transpose(-1, -2).contiguous().transpose(-1, -2)), "v: stride\\[3\\] is 2 but the last dim must be contiguous"),
    (lambda q, k, v: (_misaligned_stride_q(), k, v), r"q: stride\[0\]"),
    (lambda q, k, v: ("q", k, v), "q: expected a torch.Tensor"),
    (lambda q, k, v: (q, k, v), "q: must be a CUDA tensor"),
])
def test_bad_tensors(make, pattern):
    with pytest.raises(ValueError, match=pattern):
        flash_attn_func(*make(*qkv()))


def test_refusals_are_flashhopper_errors_of_the_builtin_type():
    """A bad argument is a FlashHopperInvalidArgument: a FlashHopperError, a RuntimeError (what FA3
    callers catch) and a ValueError; what FlashHopper cannot do is a FlashHopperNotSupported, also a
    NotImplementedError."""
    q, k, v = qkv()
    with pytest.raises(flashhopper.FlashHopperInvalidArgument, match="q: dtype is float32; must be bf16, fp16") as info:
        flash_attn_func(q.float(), k.float(), v.float())
    assert isinstance(info.value, (flashhopper.FlashHopperError)) and isinstance(info.value, RuntimeError)
    assert isinstance(info.value, ValueError)
    with pytest.raises(flashhopper.FlashHopperNotSupported, match="qv: not with fp8 inputs") as info:
        fa3.flash_attn_varlen_func(*varlen_args(), q_descale=torch.ones(3, 2), qv=torch.zeros(1))
    assert isinstance(info.value, flashhopper.FlashHopperError) and isinstance(info.value, NotImplementedError)
    with pytest.raises(flashhopper.FlashHopperInvalidArgument, match="window_size"):
        fa3.flash_attn_varlen_func(*varlen_args(), window_size=(-2, 0))


def test_sdpa_layout_gets_a_hint():
    """[B, H, S, D] tensors (SDPA's layout) whose shapes break FA3's [B, S, H, D] rules are refused
    with a hint to transpose."""
    q = torch.randn(2, 8, 64, 128, dtype=torch.bfloat16)   # [B, H, S, D]
    k = torch.randn(2, 2, 96, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"k: shape\[2\] \(number of key/value heads\) is 96, which does not divide q's number of query heads 64; .*transpose\(1, 2\)"):
        flash_attn_func(q, k, k)


def test_bad_softmax_scale():
    with pytest.raises(ValueError, match="softmax_scale"):
        flash_attn_func(*qkv(), softmax_scale=-1.0)
    with pytest.raises(ValueError, match="softmax_scale"):
        flash_attn_func(*qkv(), softmax_scale=float("nan"))


def test_qkvpacked_checks():
    with pytest.raises(ValueError, match="num_heads_q"):
        fa3.flash_attn_qkvpacked_func(torch.randn(2, 16, 12, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="q: must be a CUDA tensor"):
        fa3.flash_attn_qkvpacked_func(torch.randn(2, 16, 3, 4, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="q: must be a CUDA tensor"):  # GQA packing: 8 + 2 * 2 heads
        fa3.flash_attn_qkvpacked_func(torch.randn(2, 16, 12, 64, dtype=torch.bfloat16), num_heads_q=8)


def test_op_and_plain_calls_check_too():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="q: must be a CUDA tensor"):
        torch.ops.flashhopper.fwd(q, k, v, None, False, False)
    with pytest.raises(ValueError, match="k: dtype"):
        flashhopper.forward(q, k.half(), v)
    out = torch.empty_like(q)
    lse = torch.empty(2, 8, 64)
    with pytest.raises(ValueError, match="lse: dtype"):
        flashhopper.backward(out, q, k, v, out, lse.double())
    with pytest.raises(ValueError, match="lse: shape"):
        flashhopper.backward(out, q, k, v, out, lse[:, :4])
    with pytest.raises(ValueError, match="dout: shape"):
        flashhopper.backward(out[:, :10], q, k, v, out, lse)
    with pytest.raises(ValueError, match="dout: must be a CUDA tensor"):
        flashhopper.backward(out, q, k, v, out, lse)
    with pytest.raises(ValueError, match="dout: must be a CUDA tensor"):
        torch.ops.flashhopper.bwd(out, q, k, v, out, lse, None, False, False)


def test_devices_must_match_under_fake_tensors():
    with FakeTensorMode():
        q, k, v = qkv(device="cuda")
        with pytest.raises(ValueError, match="v: must be a CUDA tensor"):
            flash_attn_func(q, k, torch.empty(v.shape, dtype=v.dtype, device="cpu"))


# ----------------------------------------------------------------------------------------------
# flash_attn_varlen_func's own arguments and the packed layout: ValueError naming the argument
# (on CPU tensors, so before the device check). Four sequences: q 64 rows, k/v 54 rows.

def _replacing(**changes):
    return lambda args: dict(args, **changes)


@pytest.mark.parametrize("change, pattern", [
    (lambda a: dict(a, cu_seqlens_q=a["cu_seqlens_q"].long()),
     r"cu_seqlens_q: dtype torch.int64 is not supported"),
    (lambda a: dict(a, cu_seqlens_k=a["cu_seqlens_k"].float()),
     r"cu_seqlens_k: dtype is float32; must be int32"),
    (lambda a: dict(a, cu_seqlens_q=a["cu_seqlens_q"][None]), r"cu_seqlens_q: ndim is 2 but cu_seqlens_q must be 1-d \[B \+ 1\]"),
    (_replacing(cu_seqlens_q=[0, 3, 3, 53, 64]), r"cu_seqlens_q: expected a torch.Tensor, got list"),
    (_replacing(cu_seqlens_k=None), r"cu_seqlens_k: is required in the packed layout"),
    (_replacing(cu_seqlens_q=torch.zeros(1, dtype=torch.int32)),
     r"cu_seqlens_q: shape\[0\] is 1; it holds batch size \+ 1 prefix sums"),
    (lambda a: dict(a, cu_seqlens_k=a["cu_seqlens_k"][:4]),
     r"cu_seqlens_k: shape\[0\] is 4 but must be batch size \+ 1 = 5 \(batch size 4 from cu_seqlens_q\)"),
    (_replacing(cu_seqlens_q=torch.arange(10, dtype=torch.int32)[::2]),
     r"cu_seqlens_q: stride\[0\] is 2 but the last dim must be contiguous \(stride 1\)"),
    (_replacing(seqused_q=torch.ones(4, dtype=torch.int64)),
     r"seqused_q: dtype torch.int64 is not supported"),
    (_replacing(seqused_k=torch.ones(5, dtype=torch.int32)),
     r"seqused_k: shape\[0\] \(batch size\) is 5 but cu_seqlens_q's batch size is 4"),
    (_replacing(seqused_k=torch.ones(4, 1, dtype=torch.int32)), r"seqused_k: ndim is 2 but seqused_k must be 1-d \[B\]"),
    (_replacing(seqused_q=4), r"seqused_q: expected a torch.Tensor, got int"),
    (_replacing(max_seqlen_q=0), r"max_seqlen_q: is 0; varlen \(cu_seqlens_q given\) needs max_seqlen_q >= 1"),
    (_replacing(max_seqlen_k=-3), r"max_seqlen_k: is -3; varlen \(cu_seqlens_k given\) needs max_seqlen_k >= 1"),
    (_replacing(max_seqlen_k=2**31), r"max_seqlen_k: 2147483648 does not fit in int32"),
    (_replacing(max_seqlen_q=True), r"max_seqlen_q: the longest sequence's length must be an int, got bool"),
    (_replacing(max_seqlen_q=50.0), r"max_seqlen_q: .* must be an int, got float 50.0"),
    (_replacing(max_seqlen_k=torch.tensor(40)), r"max_seqlen_k: .* must be an int, got Tensor"),
    (_replacing(max_seqlen_k=None), r"max_seqlen_k: is 0; varlen \(cu_seqlens_k given\) needs max_seqlen_k >= 1"),
    (lambda a: dict(a, q=a["q"][None]),
     r"q: ndim is 4 but varlen \(cu_seqlens_q given\) q must be 3-d \[total_q, Hq, d\]"),
    (lambda a: dict(a, k=a["k"][None], v=a["v"][None]), r"k: ndim is 4 but varlen \(cu_seqlens_k given\) k must be 3-d \[total_k, Hkv, d\]"),
    (lambda a: dict(a, v=a["v"][:-1]), r"v: shape\[0\] \(total key tokens\) is 53 but k's total key tokens is 54"),
    (lambda a: dict(a, k=a["k"][..., :64]), r"k: shape\[2\] \(head dim\) is 64 but q's head dim is 128"),
    (lambda a: dict(a, k=a["k"][:, :1].repeat(1, 3, 1), v=a["v"][:, :1].repeat(1, 3, 1)),
     r"k: shape\[1\] \(number of key/value heads\) is 3, which does not divide q's number of query heads 8"),
    (lambda a: dict(a, q=a["q"].float()), r"q: dtype is float32; must be bf16, fp16"),
    (lambda a: dict(a, k=a["k"].half()), r"k: dtype is fp16 but q's is bf16"),
    (lambda a: dict(a, q=a["q"].transpose(-1, -2).contiguous().transpose(-1, -2)),
     r"q: stride\[2\] is 8 but the last dim must be contiguous"),
    (_replacing(softmax_scale=-1.0), r"softmax_scale: is -1; must be finite and >= 0"),
    (_replacing(), r"q: must be a CUDA tensor"),  # a well-formed call: the next refusal is the CPU device
    (_replacing(seqused_q=torch.ones(4, dtype=torch.int32), seqused_k=torch.ones(4, dtype=torch.int32)),
     r"q: must be a CUDA tensor"),
])
def test_varlen_bad_arguments(change, pattern):
    names = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")
    args = change(dict(zip(names, varlen_args())))
    with pytest.raises(ValueError, match=pattern):
        fa3.flash_attn_varlen_func(**args)


def test_varlen_paged_keys_bad_arguments():
    """flash_attn_varlen_func with page_table: k and v must be pages (named k and v, the caller's
    names), the page table and the varlen lengths are checked as for packed keys, and a
    well-formed call goes on to the device check."""
    q, k, v, cu_q, cu_k, max_q, max_k = varlen_args()
    pages = torch.randn(8, 16, 2, 128, dtype=torch.bfloat16)
    table = torch.zeros(4, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"k: ndim is 3 but paged \(page_table given\) k must be 4-d \[num_pages, page_size, Hkv, d\]"):
        fa3.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, page_table=table)
    with pytest.raises(ValueError, match=r"v: dtype is fp16 but q's is bf16"):
        fa3.flash_attn_varlen_func(q, pages, pages.half(), cu_q, cu_k, max_q, max_k, page_table=table)
    with pytest.raises(ValueError, match=r"max_seqlen_k: is 0; varlen \(cu_seqlens_k given\) needs max_seqlen_k >= 1"):
        fa3.flash_attn_varlen_func(q, pages, pages, cu_q, cu_k, max_q, None, page_table=table)
    with pytest.raises(ValueError, match=r"cu_seqlens_k: shape\[0\] is 4 but must be batch size \+ 1 = 5"):
        fa3.flash_attn_varlen_func(q, pages, pages, cu_q, cu_k[:4], max_q, max_k, page_table=table)
    with pytest.raises(ValueError, match=r"seqused_k: shape\[0\] \(batch size\) is 3 but cu_seqlens_q's batch size is 4"):
        fa3.flash_attn_varlen_func(q, pages, pages, cu_q, cu_k, max_q, max_k, page_table=table,
                                   seqused_k=torch.ones(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="q: must be a CUDA tensor"):
        fa3.flash_attn_varlen_func(q, pages, pages, cu_q, cu_k, max_q, max_k, page_table=table)


@pytest.mark.parametrize("seqused_k", [None, [4, 0, 7]])
def test_varlen_paged_keys_gather_and_scatter(monkeypatch, seqused_k):
    """The page_table path's own work, on the CPU with the reference standing in for the kernels
    (float64, so exact up to rounding): the backward gathers each sequence's keys from the pages
    into the packed copy it hands the kernels, and adds dk/dv back into page-shaped gradients:
    equal to autograd through an explicit gather, a page two sequences share getting the sum and
    the pages none reads zeros."""
    from flashhopper import ops as fh_ops
    seqlens_q, seqlens_k, page_size, max_k = [3, 0, 5], [6, 2, 9], 4, 12
    table = torch.tensor([[5, 1, 7], [5, 0, 2], [3, 6, 4]], dtype=torch.int32)  # page 5 shared, 8 unused
    lengths = seqused_k or seqlens_k
    cu_q = torch.tensor([0, 3, 3, 8], dtype=torch.int32)
    cu_k = torch.tensor([0, 6, 8, 17], dtype=torch.int32) + 50

    def packed_reference(q, k, v, lens_k, causal):
        return varlen_attention_reference(q, k, v, seqlens_q, lens_k, None, None, dtype=torch.float64, causal=causal)

    def kernel_forward(q, k_cache, v_cache, mask, softmax_scale, num_splits, **kw):
        assert kw["cu_seqlens_k"] is cu_k and kw["page_table"] is table and kw["max_seqlen_k"] == max_k
        keys = [int(table[b, j // page_size]) * page_size + j % page_size for b in range(3) for j in range(lengths[b])]
        return packed_reference(q, k_cache.flatten(0, 1)[keys], v_cache.flatten(0, 1)[keys], lengths, mask[0])

    def kernel_backward(dout, q, k, v, out, lse, softmax_scale, causal, deterministic, wl, wr, softcap, chunk, sink,
                        cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k, sm_margin):
        assert torch.equal(cu_seqlens_k, torch.arange(0, 4 * max_k, max_k, dtype=torch.int32))
        assert seqused_k.tolist() == lengths
        for b in range(3):  # the gathered copy: the sequence's keys, then zeros
            assert torch.all(k[b * max_k + lengths[b]:(b + 1) * max_k] == 0)
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        keep = [b * max_k + j for b in range(3) for j in range(lengths[b])]
        with torch.enable_grad():  # (autograd runs backward functions without it)
            o, _ = packed_reference(leaves[0], leaves[1][keep], leaves[2][keep], lengths, causal)
            return (*torch.autograd.grad(o, leaves, dout), torch.empty(0))

    monkeypatch.setattr(fa3, "_kvcache_forward", kernel_forward)
    monkeypatch.setattr(fh_ops, "bwd", kernel_backward)
    generator = torch.Generator().manual_seed(3)
    q = torch.randn(8, 4, 8, dtype=torch.float64, generator=generator).requires_grad_()
    k_pages, v_pages = (torch.randn(9, page_size, 2, 8, dtype=torch.float64, generator=generator).requires_grad_()
                        for _ in range(2))
    extras = {} if seqused_k is None else dict(seqused_k=torch.tensor(seqused_k, dtype=torch.int32))
    out = fa3.flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, 5, max_k, causal=True, page_table=table,
                                     **extras)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k_pages, v_pages), dout)
    keys = [int(table[b, j // page_size]) * page_size + j % page_size for b in range(3) for j in range(lengths[b])]
    expected_out, _ = packed_reference(q, k_pages.flatten(0, 1)[keys], v_pages.flatten(0, 1)[keys], lengths, True)
    expected = torch.autograd.grad(expected_out, (q, k_pages, v_pages), dout)
    torch.testing.assert_close(out, expected_out)
    for ours, theirs in zip(grads, expected):
        torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)
    assert torch.all(grads[1][8] == 0) and torch.any(grads[1][5] != 0)


def test_varlen_checks_in_the_ops_and_plain_calls():
    """The ops and the plain calls check the packed layout the same way; a partial set of the ops'
    varlen arguments names what is missing (none of them: the dense layout)."""
    from flashhopper import interface
    q, k, v, cu_q, cu_k, max_q, max_k = varlen_args()
    with pytest.raises(ValueError, match=r"cu_seqlens_k: is required in the packed layout"):
        torch.ops.flashhopper.fwd(q, k, v, None, False, False, -1, -1, 0.0, 0, None, cu_q, None, max_q, max_k)
    with pytest.raises(ValueError, match=r"max_seqlen_q: is 0; varlen \(cu_seqlens_q given\) needs max_seqlen_q >= 1"):
        torch.ops.flashhopper.fwd(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_k=max_k)
    with pytest.raises(ValueError, match=r"q: ndim is 3 but dense \(no cu_seqlens_q\) q must be 4-d"):  # no varlen argument: the dense layout
        torch.ops.flashhopper.fwd(q, k, v)
    varlen = interface.Varlen(cu_q, cu_k, max_q, max_k)
    with pytest.raises(ValueError, match="q: must be a CUDA tensor"):
        flashhopper.forward(q, k, v, varlen=varlen)
    with pytest.raises(ValueError, match=r"cu_seqlens_q: shape\[0\] is 1; it holds batch size \+ 1 prefix sums"):
        flashhopper.forward(q, k, v, varlen=varlen._replace(cu_seqlens_q=cu_q[:1]))
    out, lse = torch.empty_like(q), torch.empty(8, 64)
    with pytest.raises(ValueError, match=r"lse: ndim is 3 but varlen \(cu_seqlens_q given\) lse must be 2-d \[Hq, total_q\]"):
        flashhopper.backward(out, q, k, v, out, torch.empty(2, 8, 64), varlen=varlen)
    with pytest.raises(ValueError, match=r"dout: shape\[0\] \(total query tokens\) is 60 but q's total query tokens is 64"):
        flashhopper.backward(out[:60], q, k, v, out, lse, varlen=varlen)
    with pytest.raises(ValueError, match=r"out: ndim is 4 but varlen \(cu_seqlens_q given\) out must be 3-d \[total_q, Hq, dv\]"):
        torch.ops.flashhopper.bwd(out, q, k, v, out[None], lse, None, False, False, -1, -1, 0.0, 0, None, cu_q, cu_k,
                                  max_q, max_k)
    with pytest.raises(ValueError, match=r"seqused_k: shape\[0\] \(batch size\) is 3 but cu_seqlens_q's batch size is 4"):
        flashhopper.backward(out, q, k, v, out, lse, varlen=varlen._replace(seqused_k=torch.ones(3, dtype=torch.int32)))
    with pytest.raises(ValueError, match="dout: must be a CUDA tensor"):
        flashhopper.backward(out, q, k, v, out, lse, varlen=varlen)


def test_varlen_devices_must_match_under_fake_tensors():
    """cu_seqlens and seqused must be on q's device (no copies behind the caller's back)."""
    with FakeTensorMode():
        q, k, v, cu_q, cu_k, max_q, max_k = varlen_args(device="cuda")
        with pytest.raises(ValueError, match="cu_seqlens_q: must be a CUDA tensor, got device cpu"):
            fa3.flash_attn_varlen_func(q, k, v, cu_q.cpu(), cu_k, max_q, max_k)
        with pytest.raises(ValueError, match="seqused_k: must be a CUDA tensor, got device cpu"):
            fa3.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, seqused_k=torch.ones(4, dtype=torch.int32))
        if torch.cuda.is_available() and torch.cuda.device_count() < 2:
            return  # fake tensors on a cuda:1 that does not exist fail in PyTorch where CUDA is real
        q0, k0, v0, cu_q0 = (torch.empty(t.shape, dtype=t.dtype, device="cuda:0") for t in (q, k, v, cu_q))
        with pytest.raises(ValueError, match="cu_seqlens_k: is on cuda:1 but the other tensors are on cuda:0"):
            fa3.flash_attn_varlen_func(q0, k0, v0, cu_q0, torch.empty(5, dtype=torch.int32, device="cuda:1"), max_q,
                                       max_k)


# ----------------------------------------------------------------------------------------------
# Bad mask and score options, bad learnable_sink: ValueError naming the argument, before devices

@pytest.mark.parametrize("kwargs, pattern", [
    (dict(window_size=(-2, 0)), r"window_size: the left bound is -2; must be >= -1"),
    (dict(window_size=(0, -5)), r"window_size: the right bound is -5; must be >= -1"),
    (dict(window_size=(-3, 4), causal=True), r"window_size: the left bound is -3"),
    (dict(window_size=(2.5, 0)), r"window_size: the left bound must be an int, got float 2.5"),
    (dict(window_size=(0, 1.0)), r"window_size: the right bound must be an int, got float 1.0"),
    (dict(window_size=(True, 0)), r"window_size: the left bound must be an int, got bool"),
    (dict(window_size=(8, torch.tensor(8.0))), r"window_size: the right bound must be an int, got a torch.float32"),
    (dict(window_size=torch.tensor([8, 8, 8])), r"window_size: expected a pair of ints .* shape \[3\]"),
    (dict(window_size=torch.tensor([-2, 0])), r"window_size: the left bound is -2; must be >= -1"),
    (dict(window_size=(1, 2, 3)), r"window_size: expected a pair of ints"),
    (dict(window_size=8), r"window_size: expected a pair of ints"),
    (dict(window_size="88"), r"window_size: expected a pair of ints"),
    (dict(softcap=-1.0), r"softcap: is -1; must be finite and >= 0"),
    (dict(softcap=float("nan")), r"softcap: is nan; must be finite"),
    (dict(softcap=float("inf")), r"softcap: is inf; must be finite"),
    (dict(softcap=1e39), r"softcap: .* exceeds float32's range"),
    (dict(softcap=1e-46), r"softcap: 1e-46 rounds to 0 in float32"),
    (dict(softcap=torch.tensor(30.0)), r"softcap: must be a Python float >= 0, got Tensor"),
    (dict(softcap="30"), r"softcap: must be a Python float >= 0, got str"),
    (dict(attention_chunk=-1), r"attention_chunk: is -1; must be >= 0"),
    (dict(attention_chunk=64.0), r"attention_chunk: the chunk size must be an int, got float 64.0"),
    (dict(attention_chunk=True), r"attention_chunk: the chunk size must be an int, got bool"),
    (dict(attention_chunk=2**31), r"attention_chunk: 2147483648 does not fit in int32"),
])
def test_bad_mask_options(kwargs, pattern):
    q, k, v = qkv()  # CPU tensors: the option check comes before the device check
    with pytest.raises(ValueError, match=pattern):
        flash_attn_func(q, k, v, **kwargs)
    with pytest.raises(ValueError, match=pattern):  # the plain calls check the same way
        flashhopper.forward(q, k, v, **kwargs)
    with pytest.raises(ValueError, match=pattern):
        fa3.flash_attn_varlen_func(*varlen_args(), **kwargs)


def test_window_size_as_fa3_writes_it():
    """FA3 takes window_size as any pair: a CPU integer tensor of two (its own tests draw it with
    torch.randint), or 0-d tensors; the same bounds as the ints. A tensor on a GPU is refused by
    name (reading it would wait for the device)."""
    from flashhopper import interface
    assert interface.check_window_size(torch.tensor([5, 0])) == (5, 0)
    assert interface.check_window_size(torch.tensor([-1, 3], dtype=torch.int32)) == (-1, 3)
    assert interface.check_window_size((torch.tensor(7), torch.tensor(-1))) == (7, -1)
    assert interface.check_window_size([torch.tensor(2), 4]) == (2, 4)
    meta = torch.tensor([4, 0], device="meta")
    with pytest.raises(ValueError, match=r"window_size: the pair is a tensor on meta; reading it would make"):
        interface.check_window_size(meta)
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"window_size: the left bound is -3"):
        flash_attn_func(q, k, v, window_size=torch.tensor([-3, 0]))


def test_bad_mask_options_in_the_ops_and_backward():
    q, k, v = qkv()
    out, lse = torch.empty_like(q), torch.empty(2, 8, 64)
    with pytest.raises(ValueError, match="window_size: the left bound is -2"):
        torch.ops.flashhopper.fwd(q, k, v, None, False, False, -2, 0)
    with pytest.raises(ValueError, match="softcap: is -2; must be finite"):
        torch.ops.flashhopper.fwd(q, k, v, None, False, False, -1, -1, -2.0)
    with pytest.raises(ValueError, match="attention_chunk: is -4; must be >= 0"):
        torch.ops.flashhopper.bwd(out, q, k, v, out, lse, None, False, False, -1, -1, 0.0, -4)
    with pytest.raises(ValueError, match="window_size: the right bound is -7"):
        flashhopper.backward(out, q, k, v, out, lse, window_size=(3, -7))
    with pytest.raises(ValueError, match="softcap: is nan"):
        flashhopper.backward(out, q, k, v, out, lse, softcap=math.nan)
    with FakeTensorMode():  # the fake implementations check them too
        fq, fk, fv = qkv(device="cuda")
        with pytest.raises(ValueError, match="attention_chunk: is -1"):
            torch.ops.flashhopper.fwd(fq, fk, fv, None, False, False, -1, -1, 0.0, -1)


@pytest.mark.parametrize("make_sink, pattern", [
    (lambda: torch.zeros(8, dtype=torch.bfloat16),
     r"learnable_sink: dtype is bf16; must be float32"),
    (lambda: torch.zeros(8, dtype=torch.float64), r"learnable_sink: dtype torch.float64 is not supported"),
    (lambda: torch.zeros(2), r"learnable_sink: shape\[0\] \(number of query heads\) is 2 but q's number of query "
                             r"heads is 8"),
    (lambda: torch.zeros(1, 8), r"learnable_sink: ndim is 2 but learnable_sink must be 1-d \[Hq\]"),
    (lambda: torch.zeros(()), r"learnable_sink: ndim is 0 but learnable_sink must be 1-d \[Hq\]"),
    (lambda: [0.0] * 8, r"learnable_sink: expected a torch.Tensor, got list"),
    (lambda: torch.zeros(16)[::2], r"learnable_sink: stride\[0\] is 2 but the last dim must be contiguous \(stride 1\)"),
])
def test_bad_learnable_sink(make_sink, pattern):
    q, k, v = qkv()  # heads_q 8; CPU tensors: the sink's dtype and shape come before the device check
    with pytest.raises(ValueError, match=pattern):
        flash_attn_func(q, k, v, learnable_sink=make_sink())
    with pytest.raises(ValueError, match=pattern):
        flashhopper.forward(q, k, v, learnable_sink=make_sink())
    with pytest.raises(ValueError, match=pattern):
        flashhopper.backward(q, q, k, v, q, torch.empty(2, 8, 64), learnable_sink=make_sink())
    with pytest.raises(ValueError, match=pattern):
        fa3.flash_attn_qkvpacked_func(torch.randn(2, 64, 3, 8, 64, dtype=torch.bfloat16), learnable_sink=make_sink())
    with pytest.raises(ValueError, match=pattern):
        fa3.flash_attn_varlen_func(*varlen_args(heads_q=8), learnable_sink=make_sink())


def test_learnable_sink_device_must_match():
    """Under fake tensors (no GPU needed): a sink on the CPU, or on another GPU than q's, is refused."""
    with FakeTensorMode():
        q, k, v = qkv(device="cuda")
        with pytest.raises(ValueError, match="learnable_sink: must be a CUDA tensor, got device cpu"):
            flash_attn_func(q, k, v, learnable_sink=torch.zeros(8, device="cpu"))
        with pytest.raises(ValueError, match="learnable_sink: must be a CUDA tensor, got device cpu"):
            flashhopper.forward(q, k, v, learnable_sink=torch.zeros(8, device="cpu"))
        if torch.cuda.is_available() and torch.cuda.device_count() < 2:
            return  # with a real GPU, fake tensors too must be on a device that exists
        q0, k0, v0 = (torch.empty(t.shape, dtype=t.dtype, device="cuda:0") for t in (q, k, v))
        with pytest.raises(ValueError, match="learnable_sink: is on cuda:1 but the other tensors are on cuda:0"):
            flash_attn_func(q0, k0, v0, learnable_sink=torch.zeros(8, device="cuda:1"))


@pytest.mark.parametrize("causal, window, seqlen_q, seqlen_k, expected", [
    (False, (-1, -1), 64, 96, (0, -1, -1)),
    (True, (-1, -1), 64, 96, (1, -1, -1)),
    (False, (-1, 0), 64, 96, (1, -1, -1)),        # the window (-1, 0) is causal
    (False, (95, 0), 64, 96, (1, -1, -1)),        # left covers all keys: no bound
    (False, (94, 0), 64, 96, (0, 94, 0)),
    (False, (-1, 63), 64, 96, (0, -1, -1)),       # right covers all rows: no bound
    (False, (-1, 62), 64, 96, (0, -1, 62)),
    (True, (16, 16), 64, 96, (0, 16, 0)),         # causal forces right = 0; the ABI gets no causal flag
    (True, (200, 5), 64, 96, (1, -1, -1)),
    (False, (16, 16), 64, 96, (0, 16, 16)),
    (True, (-1, -1), 1, 96, (1, -1, -1)),         # single-row decode stays causal
    (False, (0, 0), 1, 1, (0, -1, -1)),          # one row, one key: both bounds cover it
])
def test_library_mask(causal, window, seqlen_q, seqlen_k, expected):
    """What reaches the C ABI, which refuses causal together with a window: FA3's rules applied."""
    from flashhopper import interface
    resolved = interface.check_mask_args(causal, window, 0.0, 0)
    assert interface.library_mask(resolved[0], resolved[1], resolved[2], seqlen_q, seqlen_k) == expected


def _captured_params(monkeypatch):
    """Stands in for the library: interface's calls fill the parameter struct, which is kept instead
    of being run (CPU tensors, device check off)."""
    from flashhopper import interface
    captured = []
    rules = _ffi.lib()  # the fixture's: the library's rule functions only

    class FakeLib:
        fh_forward_workspace_size = fh_backward_workspace_size = staticmethod(lambda params, size: 0)
        fh_forward = fh_backward = None
        # the rules stay the library's: the struct defaults, the checks, the mask convention
        fh_forward_params_init, fh_backward_params_init = rules.fh_forward_params_init, rules.fh_backward_params_init
        fh_forward_check, fh_backward_check = rules.fh_forward_check, rules.fh_backward_check
        fh_last_error, fh_window_from_fa3 = rules.fh_last_error, rules.fh_window_from_fa3

    monkeypatch.setattr(_ffi, "lib", lambda: FakeLib)
    monkeypatch.setattr(interface, "check_devices", lambda named: None)
    monkeypatch.setattr(interface, "_PLANS", {})  # plans made here stay here
    monkeypatch.setattr(interface, "_launch",
                        lambda plan, named, run_fn, device: captured.append(interface._bound_params(plan, named)))
    return captured


def test_flash_attn_func_passes_num_splits(monkeypatch):
    """flash_attn_func's num_splits reaches the library (split-KV; 0: its choice from the shapes),
    through the plain call and through the autograd op; FA3's default is one split; a float is
    refused by name."""
    captured = _captured_params(monkeypatch)
    q, k, v = qkv()
    flash_attn_func(q, k, v)
    flash_attn_func(q, k, v, num_splits=3)
    flash_attn_func(q, k, v, num_splits=0)
    flash_attn_func(q.clone().requires_grad_(), k, v, num_splits=5)
    assert [params.num_splits for params in captured] == [1, 3, 0, 5]
    with pytest.raises(ValueError, match="num_splits: expected an int, got float"):
        flash_attn_func(q, k, v, num_splits=2.0)


def test_sm_margin_reaches_the_library(monkeypatch):
    """FA3's sm_margin (SMs left free for other kernels) reaches both passes' structs through the
    plain calls, the autograd op, the KV-cache call and FA3's private backward; 0 by default; a
    float is refused by name (the range is the library's rule: tests/cpp/test_validation.cpp)."""
    captured = _captured_params(monkeypatch)
    q, k, v = qkv()
    flash_attn_func(q, k, v)
    flash_attn_func(q, k, v, sm_margin=8)
    leaf = q.clone().requires_grad_()
    out = flash_attn_func(leaf, k, v, sm_margin=4)
    torch.autograd.grad(out, leaf, torch.ones_like(out))
    fa3.flash_attn_with_kvcache(q[:, :1], k, v, cache_seqlens=torch.tensor([5, 9], dtype=torch.int32), sm_margin=2)
    lse = torch.zeros(q.shape[0], q.shape[2], q.shape[1])
    fa3._flash_attn_backward(q, q, k, v, q, lse, sm_margin=6)
    assert [params.sm_margin for params in captured] == [0, 8, 4, 4, 2, 6]
    assert [type(params).__name__ for params in captured[2:4]] == ["ForwardParams", "BackwardParams"]
    with pytest.raises(ValueError, match="sm_margin: expected an int, got float"):
        flash_attn_func(q, k, v, sm_margin=2.0)


@pytest.mark.parametrize("causal, window, expected", [
    (False, (-1, -1), (0, -1, -1)), (True, (-1, -1), (1, -1, -1)), (True, (16, 16), (0, 16, 0)),
    (False, (-1, 0), (1, -1, -1)), (False, (16, 8), (0, 16, 8)), (False, (500, 500), (0, -1, -1)),
])
def test_plain_calls_fill_the_structs(monkeypatch, causal, window, expected):
    """flashhopper.forward / backward put the options where the C ABI reads them: causal folded
    in (never causal together with a window), softcap, attention_chunk, learnable_sink and dsink."""
    captured = _captured_params(monkeypatch)
    q, k, v = qkv(heads_q=8)
    sink = torch.randn(8)
    out, lse = flashhopper.forward(q, k, v, causal=causal, softmax_scale=0.25, return_lse=True, window_size=window,
                                   softcap=12.5, attention_chunk=40, learnable_sink=sink)
    dq, dk, dv, dsink = flashhopper.backward(out, q, k, v, out, lse, causal=causal, softmax_scale=0.25,
                                             deterministic=True, window_size=window, softcap=12.5,
                                             attention_chunk=40, learnable_sink=sink)
    assert dsink.shape == (8,) and dsink.dtype == torch.float32 and dsink.is_contiguous()
    fwd_params, bwd_params = captured
    for params in captured:
        assert (params.causal, params.window_left, params.window_right) == expected
        assert params.softcap == 12.5 and params.attention_chunk == 40 and params.softmax_scale == 0.25
        assert params.num_sink_tokens == 0
        sink_view = params.learnable_sink
        assert sink_view.data == sink.data_ptr() and sink_view.dtype == _ffi.DTYPE_FP32 and sink_view.ndim == 1
        assert sink_view.shape[0] == 8 and sink_view.stride[0] == 1
    assert bwd_params.deterministic == 1
    assert bwd_params.dsink.data == dsink.data_ptr() and bwd_params.dsink.shape[0] == 8
    assert fwd_params.lse.data == lse.data_ptr()
    # without a sink: the tensors stay absent and backward returns three gradients
    captured.clear()
    out = flashhopper.forward(q, k, v, causal=causal, window_size=window)
    grads = flashhopper.backward(out, q, k, v, out, lse, causal=causal, window_size=window)
    assert len(grads) == 3
    assert all(not params.learnable_sink.data and not params.softcap and not params.attention_chunk
               for params in captured)
    assert not captured[1].dsink.data


def test_plan_keys_tell_apart_what_calls_differ_in():
    """A plan key is equal only for equal option values of equal types (1, 1.0 and True apart, a
    tuple's items likewise) and equal tensor metadata; an option that is not a plain scalar or a
    tuple of them, or an argument neither a tensor nor None, gives no key (the call is checked)."""
    from flashhopper import interface
    q = torch.zeros(2, 8, 4, 64, dtype=torch.bfloat16)

    def key(options, tensors=(q,)):
        return interface._plan_key("k", tensors, options)

    assert key((1, (-1, -1))) == key((1, (-1, -1))) and hash(key((1, (-1, -1)))) == hash(key((1, (-1, -1))))
    distinct = [key((1,)), key((True,)), key((1.0,)), key((None,)), key(((1, 2),)), key(((1.0, 2),)),
                key(((True, 2),)), key(((1, 2, 3),)), key((1,), (None,)), key((1,), (q.float(),)),
                key((1,), (q.transpose(1, 2),)), key((1,), (q[:1],)), key((1,), (q, None)),
                interface._plan_key("other", (q,), (1,))]
    assert len(set(distinct)) == len(distinct)
    for refused in (key(([1, 2],)), key(((1, [2]),)), key(((1, (2,)),)), key(("causal",)), key((1,), (7,)),
                    key((1,), ("q",))):
        assert refused is None


def test_kvcache_calls_run_an_earlier_calls_plan(monkeypatch):
    """flash_attn_with_kvcache memoises its plan under its own arguments' key too: a call like an
    earlier one (tensor metadata, options and their types) runs that plan with its own pointers and
    none of the checks; another option, an int cache_seqlens or a cu_seqlens_k_new dropped without
    an append (not the tensors the plan was made of) go through the checks."""
    from flashhopper import interface
    captured = _captured_params(monkeypatch)
    checks = []
    real_check = interface.check_kvcache
    monkeypatch.setattr(interface, "check_kvcache", lambda *args: checks.append(1) or real_check(*args))

    def call_keys():
        return [key for key in interface._PLANS if key[0] == "flash_attn_with_kvcache"]

    q, k, v = qkv(seqlen_q=1)
    lengths = torch.tensor([5, 9], dtype=torch.int32)
    calls = [(q, lengths), (q.clone(), lengths.clone())]
    results = [fa3.flash_attn_with_kvcache(qi, k, v, cache_seqlens=li, causal=True, return_softmax_lse=True)
               for qi, li in calls]
    assert len(checks) == 1 and len(call_keys()) == 1 and len(captured) == 2
    first, second = captured
    for params, (qi, li), (out, lse) in zip(captured, calls, results):
        assert (params.q.data, params.cache_seqlens.data) == (qi.data_ptr(), li.data_ptr())
        assert (params.out.data, params.lse.data) == (out.data_ptr(), lse.data_ptr())
        assert out.shape == qi.shape and lse.shape == (2, 8, 1)
    assert bytes(first) != bytes(second)  # the pointers; everything else as the first call set it:
    for field in ("causal", "window_left", "window_right", "softmax_scale", "num_splits", "sm_margin"):
        assert getattr(first, field) == getattr(second, field)
    assert first.causal == 1
    out = fa3.flash_attn_with_kvcache(q, k, v, cache_seqlens=lengths, causal=True)  # no lse: another plan
    assert len(checks) == 2 and len(call_keys()) == 2 and not captured[-1].lse.data and torch.is_tensor(out)
    fa3.flash_attn_with_kvcache(q, k, v, cache_seqlens=lengths, causal=1)  # an int, not a bool: its own key,
    assert len(checks) == 2 and len(call_keys()) == 3  # whose options convert to those of the plan above
    assert captured[-1].causal == 1 and not captured[-1].lse.data
    fa3.flash_attn_with_kvcache(q, k, v, cache_seqlens=7)  # made into a tensor each call: no call key
    assert len(call_keys()) == 3 and captured[-1].cache_seqlens.data
    new_lengths = torch.tensor([0, 1, 2], dtype=torch.int32)
    for _ in range(2):  # cu_seqlens_k_new without k and v: ignored, so not among the plan's tensors
        fa3.flash_attn_with_kvcache(q, k, v, cache_seqlens=lengths, cu_seqlens_k_new=new_lengths)
        assert not captured[-1].cu_seqlens_k_new.data
    assert len(call_keys()) == 3


def test_attention_calls_run_an_earlier_calls_plan(monkeypatch):
    """flash_attn_func and flash_attn_varlen_func memoise their plan under their own arguments' key
    and call kind: a call like an earlier one runs that plan with its own pointers and none of the
    checks, with autograd too (its backward gets the first call's options and this call's
    tensors); another option value or type, another kind, an option that is no plain scalar or a
    padded head dim go through the conversions (and the checks, unless the library call's own plan
    holds them)."""
    from flashhopper import interface
    captured = _captured_params(monkeypatch)
    conversions = []  # of the options: the first step a memoised call skips
    real_resolve = fa3._resolve_options
    monkeypatch.setattr(fa3, "_resolve_options", lambda *args: conversions.append(1) or real_resolve(*args))

    def call_keys(name="flash_attn_func"):
        return [key for key in interface._PLANS if key[0] == name]

    calls = [qkv(), qkv()]
    results = [flash_attn_func(*t, causal=True, return_attn_probs=True) for t in calls]
    assert len(conversions) == 1 and len(call_keys()) == 1 and len(captured) == 2
    for params, (q, k, v), (out, lse) in zip(captured, calls, results):
        assert (params.q.data, params.k.data, params.v.data) == (q.data_ptr(), k.data_ptr(), v.data_ptr())
        assert (params.out.data, params.lse.data) == (out.data_ptr(), lse.data_ptr())
        assert out.shape == q.shape and lse.shape == (2, 8, 64) and params.causal == 1
    assert bytes(captured[0]) != bytes(captured[1])
    out = flash_attn_func(*calls[0], causal=True)  # no lse: another plan
    assert len(conversions) == 2 and len(call_keys()) == 2 and not captured[-1].lse.data and torch.is_tensor(out)
    flash_attn_func(*calls[0], causal=1)  # an int, not a bool: its own key
    flash_attn_func(*calls[0], causal=True, window_size=[-1, -1])  # a list: no key, checked each call
    flash_attn_func(*calls[0], causal=True, window_size=[-1, -1])
    assert len(conversions) == 5 and len(call_keys()) == 3
    # with autograd: the first call checks, the second runs its plan; each backward gets its options
    leaves = [tuple(t.clone().requires_grad_() for t in calls[i]) for i in (0, 1)]
    outs = [flash_attn_func(*leaf, causal=True, deterministic=True, window_size=(7, -1)) for leaf in leaves]
    assert len(conversions) == 6 and len(call_keys()) == 4
    assert [type(out.grad_fn).__name__ for out in outs] == ["_EagerAttentionBackward"] * 2
    for leaf, out in zip(leaves, outs):
        torch.autograd.grad(out, leaf, torch.ones_like(out))
        params = captured[-1]
        assert type(params).__name__ == "BackwardParams" and params.deterministic == 1
        assert (params.window_left, params.window_right, params.causal) == (7, 0, 0)
        assert (params.q.data, params.out.data) == (leaf[0].data_ptr(), out.data_ptr())
    flash_attn_func(*leaves[1], causal=True, deterministic=False, window_size=(7, -1))  # saved options differ
    assert len(conversions) == 7 and len(call_keys()) == 5
    # packed batches: the varlen tensors and max_seqlen are in the key
    args = varlen_args()
    fa3.flash_attn_varlen_func(*args, causal=True)
    fa3.flash_attn_varlen_func(*args[:3], args[3].clone(), *args[4:], causal=True)
    assert len(conversions) == 8 and len(call_keys("flash_attn_varlen_func")) == 1
    assert captured[-1].cu_seqlens_q.data != captured[-2].cu_seqlens_q.data
    fa3.flash_attn_varlen_func(*args[:5], args[5] + 1, args[6], causal=True)
    assert len(conversions) == 9 and len(call_keys("flash_attn_varlen_func")) == 2
    # a head dim the call pads: the plan is the padded tensors', so no key
    odd = qkv(head_dim=59)
    for _ in range(2):
        flash_attn_func(*odd)
    assert len(conversions) == 11 and len(call_keys()) == 5


def _struct_bytes(params, allocated):
    """params' bytes with the data pointers of the fields in `allocated` (what a call allocates
    afresh) zeroed."""
    copy = type(params).from_buffer_copy(params)
    for name in allocated:
        getattr(copy, name).data = None
    return bytes(copy)


def test_memoised_calls_fill_the_structs_as_first_calls(monkeypatch):
    """Random flash_attn_func and flash_attn_varlen_func calls (options of several values and types,
    plain and with autograd, dense and packed, with and without a sink), each run twice on the same
    tensors: through whatever plans the calls before it memoised, and with no plan at all. Both
    fill the forward struct, and after autograd the backward's, byte for byte alike but for the
    pointers of what each call allocates."""
    import random
    from flashhopper import interface
    captured = _captured_params(monkeypatch)
    rng = random.Random(7)
    dense, packed, sink = qkv(), varlen_args(), torch.randn(8)
    conversions = []  # the full path's first step, which a memoised call skips
    real_resolve = fa3._resolve_options
    monkeypatch.setattr(fa3, "_resolve_options", lambda *args: conversions.append(1) or real_resolve(*args))
    choices = dict(causal=[False, True, 1], window_size=[(-1, -1), (16, 0), (8, 8), (None, 4)],
                   softcap=[0.0, 5.0, 0], attention_chunk=[0, 32], num_splits=[1, 0, 3], deterministic=[False, True],
                   return_attn_probs=[False, True], learnable_sink=[None, sink])
    kinds = []  # a pool of call kinds drawn from again and again: pairs that differ in one option each
    for name in choices:
        for _ in range(2):
            varlen, grad = rng.random() < 0.4, name == "deterministic" or rng.random() < 0.5
            options = {key: rng.choice(values) for key, values in choices.items()}
            kinds.append((varlen, grad, options))
            other = [value for value in choices[name] if value is not options[name]]
            kinds.append((varlen, grad, {**options, name: rng.choice(other)}))
    hits = 0
    for _ in range(200):
        varlen, grad, options = rng.choice(kinds)
        leaves = [t.detach().requires_grad_(grad) for t in (packed[:3] if varlen else dense)]

        def call():
            if varlen:
                return fa3.flash_attn_varlen_func(*leaves, *packed[3:], **options)
            return flash_attn_func(*leaves, **options)

        structs = []
        for memoised in (True, False):
            plans = interface._PLANS
            if not memoised:
                interface._PLANS = {}
            calls_before, conversions_before = len(captured), len(conversions)
            result = call()
            hits += memoised and len(conversions) == conversions_before
            out = result[0] if options["return_attn_probs"] else result
            structs.append(_struct_bytes(captured[-1], ("out", "lse")))
            if grad:
                torch.autograd.grad(out, leaves, torch.ones_like(out))
                structs.append(_struct_bytes(captured[-1], ("out", "lse", "dout", "dq", "dk", "dv", "dsink")))
            assert len(captured) == calls_before + 1 + grad
            interface._PLANS = plans
        half = len(structs) // 2
        assert structs[:half] == structs[half:], options
    assert hits > 100  # most calls' keys came round again: the memoised path ran


def test_memoised_kvcache_calls_fill_the_struct_as_first_calls(monkeypatch):
    """The same for flash_attn_with_kvcache: decode and append calls from a pool of kinds in pairs
    that differ in one option or tensor, each run through the memoised plans and with none, fill
    the struct alike but for out and lse."""
    import random
    from flashhopper import interface
    captured = _captured_params(monkeypatch)
    rng = random.Random(11)
    q, k, v = qkv(seqlen_q=2)
    lengths, new_k, new_v = torch.tensor([5, 9], dtype=torch.int32), k[:, :2].clone(), v[:, :2].clone()
    leftpad, rows = torch.tensor([0, 3], dtype=torch.int32), torch.tensor([1, 0], dtype=torch.int32)
    choices = dict(causal=[False, True, 1], window_size=[(-1, -1), (16, 0), (None, 4)], softcap=[0.0, 5.0],
                   num_splits=[0, 1, 3], return_softmax_lse=[False, True], append=[False, True],
                   cache_leftpad=[None, leftpad], cache_batch_idx=[None, rows])
    kinds = []
    for name in choices:
        options = {key: rng.choice(values) for key, values in choices.items()}
        other = [value for value in choices[name] if value is not options[name]]
        kinds += [options, {**options, name: rng.choice(other)}]
    hits = 0
    for _ in range(120):
        options = dict(rng.choice(kinds))
        if options.pop("append"):
            options.update(k=new_k, v=new_v)
        structs = []
        for memoised in (True, False):
            plans = interface._PLANS
            if not memoised:
                interface._PLANS = {}
            before, plans_before = len(captured), len(interface._PLANS)
            fa3.flash_attn_with_kvcache(q, k, v, cache_seqlens=lengths, **options)
            hits += memoised and len(interface._PLANS) == plans_before  # no new plan: an earlier one ran
            assert len(captured) == before + 1
            structs.append(_struct_bytes(captured[-1], ("out", "lse")))
            interface._PLANS = plans
        assert structs[0] == structs[1], options
    assert hits > 60


def test_plans_memoise_the_checks_not_the_pointers(monkeypatch):
    """A second call of the same kind (metadata and options) reuses the first one's checks and
    struct but gets its own data pointers; whatever the plan does not cover (alignment, another
    dtype, shape or option) is checked again."""
    from flashhopper import interface
    captured = _captured_params(monkeypatch)
    first, second = qkv(), qkv()
    outs = [flashhopper.forward(*first, causal=True), flashhopper.forward(*second, causal=True)]
    assert len(interface._PLANS) == 1 and len(captured) == 2
    for params, (q, k, v), out in zip(captured, (first, second), outs):
        assert (params.q.data, params.k.data, params.v.data) == (q.data_ptr(), k.data_ptr(), v.data_ptr())
        assert params.out.data == out.data_ptr() and params.causal == 1
    q, k, v = second
    unaligned = torch.empty(q.numel() + 1, dtype=q.dtype)[1:].view(q.shape)  # same shape and strides
    flashhopper.forward(unaligned, k, v, causal=True)  # the plan's: the library checks its pointers every call
    assert len(interface._PLANS) == 1 and captured[-1].q.data == unaligned.data_ptr()
    interface._PLANS.clear()  # a first call checks the pointers as they are
    with pytest.raises(ValueError, match="q: data pointer 0x[0-9a-f]+ is not 16-byte aligned"):
        flashhopper.forward(unaligned, k, v, causal=True)
    assert len(interface._PLANS) == 0
    with pytest.raises(ValueError, match="k: dtype is fp16 but q's is bf16"):
        flashhopper.forward(q, k.half(), v, causal=True)
    with pytest.raises(ValueError, match="softcap"):
        flashhopper.forward(q, k, v, causal=True, softcap=-1.0)
    flashhopper.forward(q, k, v, causal=True)
    flashhopper.forward(q, k, v, causal=1)  # another option type: its own plan (and checks)
    assert len(interface._PLANS) == 2


def test_eager_autograd_runs_the_library_without_the_op(monkeypatch):
    """flash_attn_func with inputs that require grad, eager: the library's forward under the fwd op's
    autograd (ops._EagerAttention), not the op (whose torch.library autograd wrapper costs several
    times the call in host work); its backward hands the forward's options to the bwd op and
    returns dq, dk, dv (and dsink where the sink requires grad). A bad call is refused by the
    library's check, naming the argument."""
    monkeypatch.setattr(fa3.ops, "fwd", lambda *a: pytest.fail("eager autograd went through the op"))
    forwards, backwards = [], []

    def library_forward(q, k, v, **kw):
        forwards.append(kw)
        return torch.zeros(*q.shape[:-1], v.shape[-1], dtype=q.dtype), torch.zeros(interface.lse_shape(q))

    def bwd_op(dout, q, k, v, out, lse, *options):
        backwards.append(options)
        return torch.full_like(q, 1.0), torch.full_like(k, 2.0), torch.full_like(v, 3.0), torch.ones(q.shape[-2])
    monkeypatch.setattr(interface, "forward", library_forward)
    monkeypatch.setattr(fa3.ops, "bwd", bwd_op)
    q, k, v = qkv(requires_grad=True)
    sink = torch.nn.Parameter(torch.zeros(q.shape[-2]))
    out = flash_attn_func(q, k, v, causal=True, window_size=(5, -1), softcap=3.0, deterministic=True,
                          learnable_sink=sink)
    assert type(out.grad_fn).__name__ == "_EagerAttentionBackward" and len(forwards) == 1
    assert forwards[0]["causal"] and forwards[0]["window_size"] == (5, 0) and forwards[0]["softcap"] == 3.0
    out.sum().backward()
    (options,) = backwards
    assert options[:6] == (None, True, True, 5, 0, 3.0)  # softmax_scale (the default), causal, ...
    assert (q.grad == 1).all() and (k.grad == 2).all() and (v.grad == 3).all() and (sink.grad == 1).all()
    monkeypatch.undo()
    q, k, v = qkv(requires_grad=True)
    with pytest.raises(ValueError, match=r"k: shape\[3\] \(head dim\) is 64 but q's head dim is 128"):
        flash_attn_func(q, k[..., :64], v, causal=True)


def test_qv_is_forward_only():
    """flash_attn_func and flash_attn_varlen_func with qv (absorbed MLA) run the forward alone, as
    FA3: inputs that require grad are refused by name before any device check; without grad the
    call goes on to the checks (here: CPU tensors, refused by device)."""
    q, k, _ = qkv(head_dim=64, requires_grad=True)
    v = torch.randn(*k.shape[:-1], 256, dtype=k.dtype, requires_grad=True)
    qv = torch.randn(*q.shape[:-1], 256, dtype=q.dtype)
    with pytest.raises(flashhopper.FlashHopperNotSupported, match="qv: attention with qv has no backward"):
        flash_attn_func(q, k, v, qv=qv)
    with torch.no_grad(), pytest.raises(ValueError, match="must be a CUDA tensor"):
        flash_attn_func(q, k, v, qv=qv)
    q, k, v, *packing = varlen_args(head_dim=64, heads_kv=1)
    qv, v = torch.randn(*q.shape[:-1], 256, dtype=q.dtype), torch.randn(*k.shape[:-1], 256, dtype=k.dtype)
    with pytest.raises(flashhopper.FlashHopperNotSupported, match="qv: attention with qv has no backward"):
        fa3.flash_attn_varlen_func(q.requires_grad_(), k, v, *packing, qv=qv)
    with torch.no_grad(), pytest.raises(ValueError, match="must be a CUDA tensor"):
        fa3.flash_attn_varlen_func(q, k, v, *packing, qv=qv)


def test_option_checks_are_memoised_by_value_and_type():
    """flash_attn_func's option checks run once per set of (value, type): a repeated call reuses
    the result; the same value in another type is checked anew (sm_margin=True is refused after
    sm_margin=1 passed), and a refused value is refused on every call."""
    fa3._CHECKED.clear()
    plain = (False, (-1, -1), 0, 0.0, 1, 0)  # causal, window, chunk, softcap, num_splits, sm_margin
    first = fa3._resolve_options(*plain)
    assert first == (False, -1, -1, 0.0, 0) and fa3._resolve_options(*plain) is first and len(fa3._CHECKED) == 1
    assert fa3._resolve_options(1, *plain[1:]) == (True, -1, 0, 0.0, 0) and len(fa3._CHECKED) == 2
    assert fa3._resolve_options(*plain[:-1], 1) == first
    for _ in range(2):
        with pytest.raises(ValueError, match="sm_margin: expected an int, got bool"):
            fa3._resolve_options(*plain[:-1], True)
        with pytest.raises(ValueError, match="window_size"):
            fa3._resolve_options(False, (1.5, 0), 0, 0.0, 1, 0)
    assert fa3._resolve_options(False, [-1, -1], 0, 0.0, 1, 0) == first  # a list: not memoised


@pytest.mark.parametrize("causal, window, expected", [
    (False, (39, 0), (1, -1, -1)),   # left covers max_seqlen_k = 40 (not total_k = 54): no bound
    (False, (-1, 49), (0, -1, -1)),  # right covers max_seqlen_q = 50: no bound
    (False, (38, 48), (0, 38, 48)),
    (True, (20, 20), (0, 20, 0)),
])
def test_plain_calls_fill_the_varlen_fields(monkeypatch, causal, window, expected):
    """With a Varlen the structs carry cu_seqlens, seqused (int32 views) and max_seqlen, lse is
    [Hq, total_q], and the window is judged against max_seqlen (FA3's rule); without one they stay
    absent."""
    from flashhopper import interface
    captured = _captured_params(monkeypatch)
    q, k, v, cu_q, cu_k, max_q, max_k = varlen_args()
    used_q = torch.tensor([3, 0, 20, 11], dtype=torch.int32)
    varlen = interface.Varlen(cu_q, cu_k, max_q, max_k, seqused_q=used_q)
    sink = torch.randn(8)
    out, lse = flashhopper.forward(q, k, v, causal=causal, return_lse=True, window_size=window, learnable_sink=sink,
                                   varlen=varlen)
    assert out.shape == (64, 8, 128) and lse.shape == (8, 64) and lse.dtype == torch.float32
    dq, dk, dv, dsink = flashhopper.backward(out, q, k, v, out, lse, causal=causal, window_size=window,
                                             learnable_sink=sink, varlen=varlen)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape and dsink.shape == (8,)
    for params in captured:
        assert (params.causal, params.window_left, params.window_right) == expected
        assert (params.max_seqlen_q, params.max_seqlen_k) == (50, 40)
        for field, tensor in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k), ("seqused_q", used_q)):
            view = getattr(params, field)
            assert view.data == tensor.data_ptr() and view.dtype == _ffi.DTYPE_INT32 and view.ndim == 1, field
            assert view.shape[0] == tensor.shape[0] and view.stride[0] == 1, field
        assert not params.seqused_k.data
    assert captured[0].lse.shape[0] == 8 and captured[0].lse.shape[1] == 64
    captured.clear()
    dense = qkv()
    flashhopper.backward(dense[0], *dense, dense[0], torch.empty(2, 8, 64))
    flashhopper.forward(*dense)
    for params in captured:
        assert not (params.cu_seqlens_q.data or params.cu_seqlens_k.data or params.seqused_q.data
                    or params.seqused_k.data or params.max_seqlen_q or params.max_seqlen_k)


def test_reference_masks_softcap_and_sink():
    """The test reference itself: the explicit mask (window, chunk, bottom-right), softcap, and the
    sink as a value-less logit, whose autograd gradient is FlashAttention's closed form
    dsink_h = -sum_{b,i} exp(sink_h - lse_bhi) * D_bhi with D = rowsum(dout * out)."""
    visible = visible_keys(3, 6, window_size=(1, 0))  # p = i + 3
    assert visible.int().tolist() == [[0, 0, 1, 1, 0, 0], [0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 1, 1]]
    assert torch.equal(visible_keys(3, 6, causal=True, window_size=(1, 5)), visible)
    chunks = visible_keys(4, 4, attention_chunk=2)  # p = i: rows 0, 1 see keys 0, 1; rows 2, 3 keys 2, 3
    assert chunks.int().tolist() == [[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 1, 1], [0, 0, 1, 1]]
    assert not visible_keys(4, 2, attention_chunk=4)[:2].any()  # p < 0: floor division, chunk [-4, 0)
    assert visible_keys(4, 2, attention_chunk=4)[2:].all()

    torch.manual_seed(0)
    q = torch.randn(2, 5, 4, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 7, 2, 8, dtype=torch.float64)
    v = torch.randn(2, 7, 2, 8, dtype=torch.float64)
    sink = torch.randn(4, dtype=torch.float64, requires_grad=True)
    out, lse = attention_reference(q, k, v, window_size=(2, 1), softcap=3.0, learnable_sink=sink)
    # the same by hand, per head
    kr, vr = k.repeat_interleave(2, dim=2), v.repeat_interleave(2, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, kr) / math.sqrt(8)
    s = 3.0 * torch.tanh(s / 3.0)
    s = s.masked_fill(~visible_keys(5, 7, window_size=(2, 1)), float("-inf"))
    denom = s.exp().sum(-1) + sink.view(1, 4, 1).exp()
    expected = torch.einsum("bhqk,bkhd->bqhd", s.exp() / denom[..., None], vr)
    assert torch.allclose(out, expected) and torch.allclose(lse, denom.log())
    dout = torch.randn_like(out)
    (dsink,) = torch.autograd.grad(out, sink, dout)
    D = (dout * out).sum(-1).transpose(1, 2)  # [B, Hq, sq]
    closed_form = -(torch.exp(sink.view(1, 4, 1) - lse) * D).sum(dim=(0, 2))
    assert torch.allclose(dsink, closed_form)
    # rows that see no key (causal, sq 5 > sk 2: rows 0-2): out 0, lse the sink's logit, no NaN in autograd
    out, lse = attention_reference(q, k[:, :2], v[:, :2], causal=True, learnable_sink=sink)
    assert torch.all(out[:, :3] == 0) and torch.equal(lse[:, :, :3], sink.view(1, 4, 1).expand(2, 4, 3))
    grads = torch.autograd.grad(out, (q, sink), torch.randn_like(out))
    assert not any(torch.isnan(g).any() for g in grads)


# ----------------------------------------------------------------------------------------------
# The ctypes structs mirror include/flashhopper/flashhopper.h

HEADER = pathlib.Path(__file__).resolve().parents[2] / "include" / "flashhopper" / "flashhopper.h"
_C_TYPES = {"fh_tensor": _ffi.Tensor, "int32_t": ctypes.c_int32, "float": ctypes.c_float, "void*": ctypes.c_void_p,
            "int64_t": ctypes.c_int64}


def _header_fields(struct_name):
    """(name, ctypes type) of a struct in the header, in declaration order (comments stripped)."""
    text = re.sub(r"/\*.*?\*/", "", HEADER.read_text(), flags=re.S)
    body = re.search(r"typedef struct %s \{(.*?)\} %s;" % (struct_name, struct_name), text, re.S).group(1)
    fields = []
    for declaration in body.split(";"):
        declaration = declaration.strip()
        if not declaration:
            continue
        type_name, names = re.match(r"(fh_tensor|int32_t|int64_t|float|void\*)\s+(.*)", declaration).groups()
        for name in names.split(","):
            name = name.strip()
            array = re.match(r"(\w+)\[(\w+)\]", name)
            if array:
                fields.append((array.group(1), _C_TYPES[type_name] * _ffi.MAX_DIMS))
            else:
                fields.append((name, _C_TYPES[type_name]))
    return fields


def _ctypes_layout(fields):
    """sizeof and offsets by the C rules (each field at a multiple of its alignment)."""
    offset, align, offsets = 0, 1, []
    for _, ctype in fields:
        a = ctypes.alignment(ctype)
        offset = (offset + a - 1) // a * a
        offsets.append(offset)
        offset += ctypes.sizeof(ctype)
        align = max(align, a)
    return (offset + align - 1) // align * align, offsets


@pytest.mark.parametrize("struct_name, mirror", [
    ("fh_tensor", _ffi.Tensor), ("fh_forward_params", _ffi.ForwardParams), ("fh_backward_params", _ffi.BackwardParams),
    ("fh_combine_params", _ffi.CombineParams),
])
def test_ffi_structs_match_the_header(struct_name, mirror):
    if not HEADER.exists():
        pytest.skip(f"no header at {HEADER} (not a checkout)")
    expected = _header_fields(struct_name)
    got = [(name, ctype) for name, ctype in mirror._fields_]
    assert [name for name, _ in got] == [name for name, _ in expected]
    for (name, ours), (_, theirs) in zip(got, expected):
        assert ctypes.sizeof(ours) == ctypes.sizeof(theirs) and ctypes.alignment(ours) == ctypes.alignment(theirs), name
    size, offsets = _ctypes_layout(expected)
    assert ctypes.sizeof(mirror) == size
    assert [getattr(mirror, name).offset for name, _ in got] == offsets


def test_ffi_struct_sizes_and_new_fields():
    """The sizes on x86-64 (fh_tensor: 8 + 4 + 4 + 2 * 5 * 8 = 96 bytes), and the fields appended last."""
    assert ctypes.sizeof(_ffi.Tensor) == 96
    fwd_fields = [name for name, _ in _ffi.ForwardParams._fields_]
    bwd_fields = [name for name, _ in _ffi.BackwardParams._fields_]
    assert fwd_fields[-12:] == ["num_splits", "attention_chunk", "learnable_sink", "qv", "cache_batch_idx",
                                "cache_leftpad", "rotary_cos", "rotary_sin", "rotary_seqlens", "rotary_interleaved",
                                "cu_seqlens_k_new", "sm_margin"]
    assert bwd_fields[-5:] == ["deterministic", "attention_chunk", "learnable_sink", "dsink", "sm_margin"]
    # forward: 9 tensors, max_seqlen_q/k (2 x 4), 7 more tensors, softmax_scale .. num_splits (7 x 4),
    # attention_chunk (4; ends at a multiple of 8, so no padding before the tensor), learnable_sink, qv
    assert _ffi.ForwardParams.attention_chunk.offset == 16 * 96 + 8 + 28 == 1572
    assert _ffi.ForwardParams.learnable_sink.offset == 1576
    assert _ffi.ForwardParams.qv.offset == 1576 + 96
    assert _ffi.ForwardParams.rotary_interleaved.offset == 1576 + 7 * 96
    assert _ffi.ForwardParams.cu_seqlens_k_new.offset == 1576 + 7 * 96 + 8  # the int32 padded to 8
    assert _ffi.ForwardParams.sm_margin.offset == 1576 + 8 * 96 + 8
    assert ctypes.sizeof(_ffi.ForwardParams) == 1576 + 8 * 96 + 8 + 8  # sm_margin padded to 8
    # backward: 13 tensors, max_seqlen_q/k, softmax_scale .. deterministic (7 x 4), attention_chunk, 2 tensors
    assert _ffi.BackwardParams.attention_chunk.offset == 13 * 96 + 8 + 28 == 1284
    assert _ffi.BackwardParams.learnable_sink.offset == 1288
    assert _ffi.BackwardParams.dsink.offset == 1288 + 96
    assert _ffi.BackwardParams.sm_margin.offset == 1288 + 2 * 96
    assert ctypes.sizeof(_ffi.BackwardParams) == 1288 + 2 * 96 + 8  # sm_margin padded to 8


def test_ffi_structs_match_the_c_compiler(tmp_path):
    """sizeof and offsetof of every field as the C compiler lays the header out."""
    compiler = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None or not HEADER.exists():
        pytest.skip("no C compiler or no header")
    lines = []
    for struct_name, mirror in (("fh_forward_params", _ffi.ForwardParams), ("fh_backward_params", _ffi.BackwardParams),
                                ("fh_combine_params", _ffi.CombineParams), ("fh_tensor", _ffi.Tensor)):
        lines.append(f'printf("{struct_name} sizeof %zu\\n", sizeof({struct_name}));')
        for name, _ in mirror._fields_:
            lines.append(f'printf("{struct_name} {name} %zu\\n", offsetof({struct_name}, {name}));')
    source = tmp_path / "layout.c"
    source.write_text("#include <stdio.h>\n#include <stddef.h>\n#include <flashhopper/flashhopper.h>\n"
                      "int main(void) {\n" + "\n".join(lines) + "\nreturn 0;\n}\n")
    binary = tmp_path / "layout"
    subprocess.run([compiler, "-I", str(HEADER.parents[1]), str(source), "-o", str(binary)], check=True,
                   capture_output=True, timeout=120)
    output = subprocess.run([str(binary)], check=True, capture_output=True, text=True, timeout=60).stdout
    c_layout = {tuple(line.split()[:2]): int(line.split()[2]) for line in output.splitlines()}
    for struct_name, mirror in (("fh_forward_params", _ffi.ForwardParams), ("fh_backward_params", _ffi.BackwardParams),
                                ("fh_combine_params", _ffi.CombineParams), ("fh_tensor", _ffi.Tensor)):
        assert c_layout[(struct_name, "sizeof")] == ctypes.sizeof(mirror), struct_name
        for name, _ in mirror._fields_:
            assert c_layout[(struct_name, name)] == getattr(mirror, name).offset, f"{struct_name}.{name}"


# ----------------------------------------------------------------------------------------------
# Fake tensors: shape, dtype and stride inference without a GPU

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fake_forward_shapes(dtype):
    with FakeTensorMode():
        q, k, v = qkv(batch=3, seqlen_q=77, seqlen_k=130, heads_q=6, heads_kv=3, head_dim=64, dtype=dtype,
                      device="cuda")
        out, lse = torch.ops.flashhopper.fwd(q, k, v, None, True, False)
        assert out.shape == (3, 77, 6, 64) and out.dtype == dtype and out.is_contiguous()
        assert lse.shape == (3, 6, 77) and lse.dtype == torch.float32 and lse.is_contiguous()
        assert out.device.type == "cuda" and lse.device.type == "cuda"
        out2, lse2 = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
        assert out2.shape == out.shape and lse2.shape == lse.shape
        assert flash_attn_func(q, k, v).shape == out.shape


def test_fake_backward_strides():
    with FakeTensorMode():
        # q with a non-contiguous but dense layout ([B, H, S, D] memory viewed as [B, S, H, D])
        q = torch.empty(2, 4, 64, 128, dtype=torch.bfloat16, device="cuda").transpose(1, 2)
        k = torch.empty(2, 80, 2, 128, dtype=torch.bfloat16, device="cuda")
        v = torch.empty(2, 80, 2, 128, dtype=torch.bfloat16, device="cuda")
        out, lse = torch.ops.flashhopper.fwd(q, k, v, 0.1, False, False)
        dout = torch.empty(2, 64, 4, 128, dtype=torch.bfloat16, device="cuda").expand(2, 64, 4, 128)
        dq, dk, dv, dsink = torch.ops.flashhopper.bwd(dout, q, k, v, out, lse, 0.1, False, True)
        assert dsink.shape == (0,) and dsink.dtype == torch.float32  # no learnable_sink: empty
        assert dq.shape == q.shape and dq.stride() == q.stride()
        assert dk.shape == k.shape and dk.stride() == k.stride() and dv.shape == v.shape
        assert dq.dtype == dk.dtype == dv.dtype == torch.bfloat16


def test_fake_shapes_with_options_and_sink():
    """fwd with every option and a sink: same out/lse shapes; bwd returns dsink float32 [Hq] then."""
    with FakeTensorMode():
        q, k, v = qkv(batch=2, seqlen_q=70, seqlen_k=130, heads_q=6, heads_kv=2, head_dim=64, device="cuda")
        sink = torch.empty(6, device="cuda")
        out, lse = torch.ops.flashhopper.fwd(q, k, v, 0.2, False, False, 16, 4, 30.0, 64, sink)
        assert out.shape == (2, 70, 6, 64) and lse.shape == (2, 6, 70) and lse.dtype == torch.float32
        dq, dk, dv, dsink = torch.ops.flashhopper.bwd(out, q, k, v, out, lse, 0.2, False, False, 16, 4, 30.0, 64,
                                                      sink)
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
        assert dsink.shape == (6,) and dsink.dtype == torch.float32 and dsink.device.type == "cuda"
        out2, lse2 = flash_attn_func(q, k, v, window_size=(16, 4), softcap=30.0, attention_chunk=64,
                                     learnable_sink=sink, return_attn_probs=True)
        assert out2.shape == out.shape and lse2.shape == lse.shape
        with pytest.raises(ValueError, match=r"learnable_sink: shape\[0\] \(number of query heads\) is 8 but q's number of query heads is 6"):
            torch.ops.flashhopper.fwd(q, k, v, None, False, False, -1, -1, 0.0, 0, torch.empty(8, device="cuda"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fake_varlen_shapes(dtype):
    """The packed layout: fwd gives out [total_q, Hq, d] and lse [Hq, total_q] float32, bwd gradients
    shaped like q, k, v (dsink [Hq] with a sink); flash_attn_varlen_func returns out, or (out, lse)."""
    with FakeTensorMode():
        q, k, v, cu_q, cu_k, max_q, max_k = varlen_args(heads_q=6, heads_kv=3, head_dim=64, dtype=dtype, device="cuda")
        used = torch.empty(4, dtype=torch.int32, device="cuda")
        sink = torch.empty(6, device="cuda")
        varlen = (cu_q, cu_k, max_q, max_k, used, used)
        out, lse = torch.ops.flashhopper.fwd(q, k, v, 0.2, True, False, 16, 0, 30.0, 64, sink, *varlen)
        assert out.shape == (64, 6, 64) and out.dtype == dtype and out.is_contiguous() and out.device.type == "cuda"
        assert lse.shape == (6, 64) and lse.dtype == torch.float32 and lse.is_contiguous()
        dq, dk, dv, dsink = torch.ops.flashhopper.bwd(out, q, k, v, out, lse, 0.2, True, False, 16, 0, 30.0, 64, sink,
                                                      *varlen)
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape and dq.dtype == dtype
        assert dsink.shape == (6,) and dsink.dtype == torch.float32
        *_, no_dsink = torch.ops.flashhopper.bwd(out, q, k, v, out, lse, None, False, False, -1, -1, 0.0, 0, None,
                                                 *varlen)
        assert no_dsink.shape == (0,)
        assert fa3.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k).shape == out.shape
        out2, lse2 = fa3.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, seqused_q=used, causal=True,
                                                window_size=(16, 0), learnable_sink=sink, return_attn_probs=True)
        assert out2.shape == out.shape and lse2.shape == lse.shape and lse2.dtype == torch.float32
        with pytest.raises(ValueError, match=r"lse: shape\[0\] \(number of query heads\) is 64 but q's number of query heads is 6"):
            torch.ops.flashhopper.bwd(out, q, k, v, out, lse.t(), None, False, False, -1, -1, 0.0, 0, None, *varlen)
        with pytest.raises(ValueError, match=r"seqused_q: shape\[0\] \(batch size\) is 3 but cu_seqlens_q's batch size is 4"):
            torch.ops.flashhopper.fwd(q, k, v, None, False, False, -1, -1, 0.0, 0, None, cu_q, cu_k, max_q, max_k,
                                      used[:3])


def test_kvcache_op_registered():
    from flashhopper import ops
    assert str(torch.ops.flashhopper.fwd_kvcache.default._schema) == "flashhopper::" + ops.KVCACHE_SCHEMA
    schema = torch.ops.flashhopper.fwd_kvcache.default._schema
    written = [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    assert written == ["k_cache", "v_cache"]  # the append writes them; the tracer must know


def test_kvcache_call_traces_as_the_op():
    """With fake tensors (torch.export, torch.compile) flash_attn_with_kvcache runs as the
    fwd_kvcache op: out takes v_cache's head dim, lse is [B, H, sq] (or [H, total_q] packed), and
    the fake implementation checks the arguments by name as the eager call does."""
    with FakeTensorMode():
        q = torch.empty(2, 3, 8, 128, dtype=torch.bfloat16, device="cuda")
        k_cache = torch.empty(2, 256, 2, 128, dtype=torch.bfloat16, device="cuda")
        v_cache = torch.empty(2, 256, 2, 64, dtype=torch.bfloat16, device="cuda")
        k_new = torch.empty(2, 3, 2, 128, dtype=torch.bfloat16, device="cuda")
        v_new = torch.empty(2, 3, 2, 64, dtype=torch.bfloat16, device="cuda")
        out, lse = fa3.flash_attn_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new, cache_seqlens=16, causal=True,
                                               return_softmax_lse=True)
        assert out.shape == (2, 3, 8, 64) and out.dtype == torch.bfloat16
        assert lse.shape == (2, 8, 3) and lse.dtype == torch.float32
        packed = torch.empty(5, 8, 128, dtype=torch.bfloat16, device="cuda")
        cu_q = torch.tensor([0, 2, 5], dtype=torch.int32, device="cuda")
        out = fa3.flash_attn_with_kvcache(packed, k_cache, v_cache, cache_seqlens=16, cu_seqlens_q=cu_q,
                                          max_seqlen_q=3)
        assert out.shape == (5, 8, 64)
        with pytest.raises(ValueError, match="v_cache: dtype"):
            fa3.flash_attn_with_kvcache(q, k_cache, v_cache.to(torch.float16), cache_seqlens=16)
        with pytest.raises(ValueError, match="window_size"):
            fa3.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=16, window_size=(-2, 0))


def test_kvcache_schema_lets_inductor_write_the_cache_in_place():
    """The schema marks k_cache and v_cache written. Inductor must then write them in place, not
    copy a whole cache per decode step. The check uses an op of the same schema with a small CPU
    body, compiled on the CPU: the generated code has no copy of the cache, and the caller's
    cache holds the appended keys."""
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler for Inductor's CPU code")
    from torch._inductor.utils import run_and_get_code

    from flashhopper import ops
    lib = torch.library.Library("flashhopper_schema_check", "DEF")
    lib.define(ops.KVCACHE_SCHEMA)

    def append_first(q, k_cache, v_cache, k_new=None, v_new=None, *args, **kwargs):
        if k_new is not None:
            k_cache[:, :1].copy_(k_new)
            v_cache[:, :1].copy_(v_new)
        return q.new_zeros((*q.shape[:-1], v_cache.shape[-1])), q.new_zeros(flashhopper.interface.lse_shape(q))

    def fake(q, k_cache, v_cache, *args, **kwargs):
        return q.new_empty((*q.shape[:-1], v_cache.shape[-1])), q.new_empty(flashhopper.interface.lse_shape(q))

    lib.impl("fwd_kvcache", append_first, "CPU")
    torch.library.register_fake("flashhopper_schema_check::fwd_kvcache", fake, lib=lib)

    def step(q, k_cache, v_cache, k_new, v_new):
        out, _ = torch.ops.flashhopper_schema_check.fwd_kvcache(q, k_cache, v_cache, k_new, v_new)
        return out + 1

    q = torch.randn(2, 1, 8, 64)
    k_cache, v_cache = torch.randn(2, 4096, 2, 64), torch.randn(2, 4096, 2, 64)
    k_new, v_new = torch.randn(2, 1, 2, 64), torch.randn(2, 1, 2, 64)
    torch._dynamo.reset()
    _, code = run_and_get_code(torch.compile(step, fullgraph=True), q, k_cache, v_cache, k_new, v_new)
    copies = [line for line in "\n".join(code).splitlines() if "clone" in line or "copy_" in line]
    assert copies == []
    assert torch.equal(k_cache[:, :1], k_new) and torch.equal(v_cache[:, :1], v_new)


def test_kvcache_call_in_a_traced_graph():
    """make_fx over a decode step: one fwd_kvcache node, with the cache as its written inputs."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def step(q, k_cache, v_cache, k_new, v_new, lengths):
        return fa3.flash_attn_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new, cache_seqlens=lengths, causal=True)

    with FakeTensorMode():
        args = (torch.empty(2, 1, 8, 128, dtype=torch.bfloat16, device="cuda"),
                torch.empty(2, 256, 2, 128, dtype=torch.bfloat16, device="cuda"),
                torch.empty(2, 256, 2, 128, dtype=torch.bfloat16, device="cuda"),
                torch.empty(2, 1, 2, 128, dtype=torch.bfloat16, device="cuda"),
                torch.empty(2, 1, 2, 128, dtype=torch.bfloat16, device="cuda"),
                torch.empty(2, dtype=torch.int32, device="cuda"))
        graph = make_fx(step, tracing_mode="fake")(*args)
    calls = [n for n in graph.graph.nodes if n.op == "call_function" and "fwd_kvcache" in str(n.target)]
    assert len(calls) == 1


def test_fake_kvcache_after_an_eager_call_of_the_same_shapes(monkeypatch):
    """The fake fwd_kvcache returns after its check even where an eager call of the same shapes left
    a plan (a plan's key matches fake tensors): torch.compile after an eager decode step (found on
    the GPU: the fake function went on to launch with fake tensors)."""
    class EveryPlan(dict):
        def get(self, key, default=None):
            return object()

    monkeypatch.setattr(interface, "_PLANS", EveryPlan())
    with FakeTensorMode():
        q = torch.empty(3, 1, 8, 128, dtype=torch.bfloat16, device="cuda")
        k_cache = torch.empty(3, 512, 2, 128, dtype=torch.bfloat16, device="cuda")
        lengths = torch.empty(3, dtype=torch.int32, device="cuda")
        out, lse = torch.ops.flashhopper.fwd_kvcache(q, k_cache, k_cache, cache_seqlens=lengths, causal=True)
    assert out.shape == q.shape and lse.shape == (3, 8, 1)


def test_fake_impl_checks_shapes():
    with FakeTensorMode():
        q, k, v = qkv(device="cuda")
        with pytest.raises(ValueError, match=r"k: shape\[3\] \(head dim\) is 64 but q's head dim is 128"):
            torch.ops.flashhopper.fwd(q, k[..., :64], v, None, False, False)


def test_plain_calls_refuse_head_dims_off_the_granule():
    """flashhopper.forward takes head dims in multiples of 8 only; flash_attn_func pads the others."""
    q, k, v = (torch.randn(2, 16, 2, 12, dtype=torch.bfloat16) for _ in range(3))
    with pytest.raises(ValueError, match=r"q: shape\[3\] \(head dim\) is 12, not a multiple of 8"):
        flashhopper.forward(q, k, v)


@pytest.mark.parametrize("head_dim", [12, 59, 111, 250])
def test_flash_attn_func_pads_odd_head_dims(monkeypatch, head_dim):
    """A head dim off the 16-byte granule reaches the kernel zero-padded to the next multiple of 8, with
    the scale of the real head dim, and the output comes back unpadded and contiguous; gradients
    flow back to the unpadded inputs (autograd through the pad)."""
    seen = {}

    def fake_fwd(q, k, v, softmax_scale, *args, **options):
        seen.update(shape=tuple(q.shape), scale=softmax_scale,
                    tails_zero=all(bool((t[..., head_dim:] == 0).all()) for t in (q, k, v)))
        return attention_reference(q, k, v, softmax_scale=softmax_scale, dtype=q.dtype)

    monkeypatch.setattr(fa3.ops, "fwd_eager", fake_fwd)  # eager with autograd
    q, k, v = qkv(seqlen_q=9, seqlen_k=13, heads_q=2, heads_kv=2, head_dim=head_dim, requires_grad=True)
    out = flash_attn_func(q, k, v)
    padded = (head_dim + 7) // 8 * 8
    assert seen["shape"][-1] == padded and seen["tails_zero"]
    assert seen["scale"] == pytest.approx(head_dim ** -0.5)
    assert out.shape == q.shape and out.is_contiguous()
    expected, _ = attention_reference(q.detach(), k.detach(), v.detach(), dtype=torch.float64)
    assert (out.double() - expected).abs().max().item() < 0.05
    out.sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape


@pytest.mark.parametrize("return_lse", [False, True])
def test_flash_attn_func_unpads_without_autograd(monkeypatch, return_lse):
    """The plain path (no gradient can flow: the library call alone) cuts the padded head dim off too,
    with and without the lse."""
    def fake_forward(q, k, v, causal, softmax_scale, return_lse=False, **options):
        out = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=q.dtype)
        return (out, torch.zeros(q.shape[0], q.shape[2], q.shape[1])) if return_lse else out

    monkeypatch.setattr(fa3.interface, "forward", fake_forward)
    q, k, v = qkv(seqlen_q=9, seqlen_k=13, heads_q=2, heads_kv=2, head_dim=59)
    result = flash_attn_func(q, k, v, return_attn_probs=return_lse)
    out = result[0] if return_lse else result
    assert out.shape == q.shape and out.is_contiguous()


def test_fake_tensor_prop_through_flash_attn_func():
    """flash_attn_func's output under FakeTensorMode matches the reference's shapes."""
    q, k, v = qkv(seqlen_q=40, seqlen_k=72, heads_q=4, heads_kv=4)
    ref_out, ref_lse = attention_reference(q, k, v, causal=True, dtype=torch.float64)
    mode = FakeTensorMode()
    with mode:
        fq, fk, fv = (torch.empty(t.shape, dtype=t.dtype, device="cuda") for t in (q, k, v))
        out, lse = flash_attn_func(fq, fk, fv, causal=True, return_attn_probs=True)
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape


@pytest.mark.parametrize("deterministic", [False, True])
def test_autograd_graph(deterministic):
    """Autograd connects fwd to bwd with the flags; traced with make_fx on meta tensors (symbolic
    shapes), so no GPU is needed. lse comes out non-differentiable."""
    def loss_grads(q, k, v):
        out, lse = torch.ops.flashhopper.fwd(q, k, v, 0.125, True, deterministic)
        assert not lse.requires_grad
        return torch.autograd.grad((out.float() * 2).sum(), (q, k, v))

    q, k, v = qkv(batch=2, seqlen_q=48, seqlen_k=64, heads_q=4, heads_kv=2, device="meta", requires_grad=True)
    dq, dk, dv = loss_grads(q, k, v)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    graph = make_fx(loss_grads, tracing_mode="symbolic")(q, k, v)
    calls = {node.target: node for node in graph.graph.nodes if node.op == "call_function"}
    assert torch.ops.flashhopper.fwd.default in calls
    bwd = calls[torch.ops.flashhopper.bwd.default]
    flags = list(bwd.args[6:9])  # (softmax_scale, causal, deterministic); a default value may be left out
    flags += [False] * (3 - len(flags))
    assert flags == [0.125, True, deterministic]
    assert "learnable_sink" not in bwd.kwargs and len(bwd.args) <= 13  # no sink: none handed to bwd


@pytest.mark.parametrize("sink_requires_grad", [False, True])
def test_autograd_graph_with_options_and_sink(sink_requires_grad):
    """The options reach bwd unchanged, with the sink; the sink gets dsink when it requires grad."""
    def loss_grads(q, k, v, sink):
        out, _ = torch.ops.flashhopper.fwd(q, k, v, 0.125, True, False, 24, 0, 15.0, 32, sink)
        inputs = (q, k, v, sink) if sink_requires_grad else (q, k, v)
        return torch.autograd.grad(out.float().sum(), inputs)

    q, k, v = qkv(batch=2, seqlen_q=48, seqlen_k=64, heads_q=4, heads_kv=2, device="meta", requires_grad=True)
    sink = torch.zeros(4, device="meta", requires_grad=sink_requires_grad)
    grads = loss_grads(q, k, v, sink)
    if sink_requires_grad:
        assert grads[3].shape == (4,) and grads[3].dtype == torch.float32
    graph = make_fx(loss_grads, tracing_mode="symbolic")(q, k, v, sink)
    calls = {node.target: node for node in graph.graph.nodes if node.op == "call_function"}
    bwd = calls[torch.ops.flashhopper.bwd.default]
    assert list(bwd.args[6:13]) == [0.125, True, False, 24, 0, 15.0, 32]
    assert bwd.args[13].op == "placeholder"  # the sink itself
    if not sink_requires_grad:  # a sink without grad: no gradient is asked of it
        with pytest.raises(RuntimeError, match="does not require grad"):
            torch.autograd.grad(torch.ops.flashhopper.fwd(q, k, v, None, False, False, -1, -1, 0.0, 0, sink)[0].sum(),
                                (sink,))


@pytest.mark.parametrize("options", [False, True], ids=["causal", "softcap-window-sink"])
@pytest.mark.parametrize("dynamic", [False, True])
def test_torch_compile_fullgraph_traces(monkeypatch, dynamic, options):
    """Dynamo traces flash_attn_func (its checks included) into one graph with the op, and AOT
    autograd adds bwd: run on meta tensors with the CUDA-device check switched off. With softcap,
    a local window, a chunk, a scale and a learnable_sink that requires grad, the sink gets its
    gradient through the compiled backward."""
    from flashhopper import interface
    monkeypatch.setattr(interface, "check_devices", lambda named: None)
    torch._dynamo.reset()
    sink = torch.zeros(8, device="meta", requires_grad=True)

    def block(q, k, v):
        if options:
            out, lse = flash_attn_func(q, k, v, softmax_scale=0.1, causal=True, window_size=(32, 8), softcap=20.0,
                                       attention_chunk=48, return_attn_probs=True, learnable_sink=sink)
        else:
            out, lse = flash_attn_func(q, k, v, causal=True, return_attn_probs=True, deterministic=True)
        return out * 2, lse

    graphs = []

    backend = recording_backend(graphs)

    q, k, v = qkv(batch=2, seqlen_q=64, seqlen_k=96, device="meta", requires_grad=True)
    out, lse = torch.compile(block, fullgraph=True, dynamic=dynamic, backend=backend)(q, k, v)
    out.sum().backward()
    assert out.shape == q.shape and lse.shape == (2, 8, 64) and q.grad.shape == q.shape
    assert graphs and all(torch.ops.flashhopper.fwd.default in targets for targets in graphs)
    if options:
        assert sink.grad is not None and sink.grad.shape == (8,) and sink.grad.dtype == torch.float32
    else:
        assert sink.grad is None
    torch._dynamo.reset()


@pytest.mark.parametrize("sink_requires_grad", [False, True])
def test_autograd_graph_varlen(sink_requires_grad):
    """The packed layout's arguments reach bwd unchanged (cu_seqlens and seqused as the forward's
    tensors, max_seqlen as ints) and get no gradient; q, k, v (and the sink) get theirs."""
    def loss_grads(q, k, v, cu_q, cu_k, used_k, sink):
        out, lse = torch.ops.flashhopper.fwd(q, k, v, 0.125, True, True, -1, -1, 0.0, 0, sink, cu_q, cu_k, 50, 40, None,
                                             used_k)
        assert not lse.requires_grad
        inputs = (q, k, v, sink) if sink_requires_grad else (q, k, v)
        return torch.autograd.grad(out.float().sum(), inputs)

    q, k, v, cu_q, cu_k, _, _ = varlen_args(heads_q=4, heads_kv=2, device="meta", requires_grad=True)
    used_k = torch.empty(4, dtype=torch.int32, device="meta")
    sink = torch.zeros(4, device="meta", requires_grad=sink_requires_grad)
    grads = loss_grads(q, k, v, cu_q, cu_k, used_k, sink)
    assert [g.shape for g in grads[:3]] == [q.shape, k.shape, v.shape]
    if sink_requires_grad:
        assert grads[3].shape == (4,) and grads[3].dtype == torch.float32
    graph = make_fx(loss_grads, tracing_mode="symbolic")(q, k, v, cu_q, cu_k, used_k, sink)
    calls = {node.target: node for node in graph.graph.nodes if node.op == "call_function"}
    bwd = calls[torch.ops.flashhopper.bwd.default]
    placeholders = [node for node in graph.graph.nodes if node.op == "placeholder"]
    assert list(bwd.args[6:9]) == [0.125, True, True]
    assert bwd.args[13] is placeholders[6]  # the sink
    assert bwd.args[14:17] == (placeholders[3], placeholders[4], 50)
    assert bwd.args[17:20] == (40, None, placeholders[5])


@pytest.mark.parametrize("dynamic", [None, True])
def test_torch_compile_fullgraph_traces_varlen(monkeypatch, dynamic):
    """Dynamo traces flash_attn_varlen_func (its checks included) into one graph with the op, with
    max_seqlen as int arguments and seqused and a learnable_sink given; AOT autograd adds bwd, and
    q and the sink get their gradients (meta tensors, CUDA-device check off). New lengths and
    max_seqlen do not recompile once they are dynamic (at the second call by default)."""
    from flashhopper import interface
    monkeypatch.setattr(interface, "check_devices", lambda named: None)
    torch._dynamo.reset()
    sink = torch.zeros(8, device="meta", requires_grad=True)

    def block(q, k, v, cu_q, cu_k, max_q, max_k, used_q):
        out, lse = fa3.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, seqused_q=used_q, causal=True,
                                              window_size=(32, 0), softcap=20.0, return_attn_probs=True,
                                              learnable_sink=sink, deterministic=True)
        return out * 2, lse

    graphs = []

    backend = recording_backend(graphs)

    compiled = torch.compile(block, fullgraph=True, dynamic=dynamic, backend=backend)
    graphs_after_call = []
    for seqlens_q, seqlens_k in ((VARLEN_SEQLENS_Q, VARLEN_SEQLENS_K), ((7, 70, 1, 0), (9, 45, 30, 2)),
                                 ((100, 1, 1, 1), (3, 3, 90, 2))):
        q, k, v, cu_q, cu_k, max_q, max_k = varlen_args(seqlens_q, seqlens_k, device="meta", requires_grad=True)
        used_q = torch.empty(4, dtype=torch.int32, device="meta")
        out, lse = compiled(q, k, v, cu_q, cu_k, max_q, max_k, used_q)
        out.sum().backward()
        assert out.shape == q.shape and lse.shape == (8, q.shape[0]) and q.grad.shape == q.shape
        assert k.grad.shape == k.shape and sink.grad.shape == (8,)
        graphs_after_call.append(len(graphs))
    dynamic_from = 0 if dynamic else 1  # by default, ints and sizes become dynamic when they first change
    assert graphs_after_call[-1] == graphs_after_call[dynamic_from]
    assert all(torch.ops.flashhopper.fwd.default in targets for targets in graphs)
    torch._dynamo.reset()


def test_flash_attn_func_refuses_meta_tensors():
    """flash_attn_func refuses meta tensors (not CUDA): the op is the place for device-free tracing."""
    q, k, v = qkv(device="meta")
    with pytest.raises(ValueError, match="q: must be a CUDA tensor"):
        flash_attn_func(q, k, v)


# ----------------------------------------------------------------------------------------------
# SDPA registry and benchmark plumbing

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_generated_kernel_files_are_current():
    """The instantiations, CMake lists and dispatch table match scripts/kernel_manifest.py."""
    script = ROOT / "scripts" / "generate_kernels.py"
    if not script.exists():
        pytest.skip("not a checkout")
    result = subprocess.run([sys.executable, str(script), "--check"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_sdpa_backend_registration():
    from torch.nn import attention
    try:
        flashhopper.use_as_sdpa_flash_backend()
        assert flashhopper.sdpa.sdpa_flash_backend_active()
        if hasattr(attention, "current_flash_attention_impl"):
            assert attention.current_flash_attention_impl() == "FlashHopper"
            assert "FlashHopper" in attention.list_flash_attention_impls()
    finally:
        flashhopper.restore_sdpa_flash_backend()
    assert not flashhopper.sdpa.sdpa_flash_backend_active()
    if hasattr(attention, "current_flash_attention_impl"):
        assert attention.current_flash_attention_impl() is None


def test_bench_help_and_outputs(tmp_path):
    from flashhopper import bench
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--help"])
    assert exit_info.value.code == 0
    for mode in ("--decode", "--fp8"):
        with pytest.raises(SystemExit) as exit_info:
            bench.main([mode, "--help"])
        assert exit_info.value.code == 0
    # Where the kernels cannot run: one line, exit code 1, no output folder (every benchmark).
    assert bench.main(["--out", str(tmp_path / "never")]) == 1
    assert bench.main(["--decode", "--out", str(tmp_path / "never")]) == 1
    assert bench.main(["--fp8", "--out", str(tmp_path / "never")]) == 1
    assert not (tmp_path / "never").exists()
    nan = float("nan")
    rows = []
    for seqlen, fh in ((512, 300.0), (1024, nan)):
        row = {"date": "2026-01-01", "gpu": "test", "pass": "fwd", "hdim": 128, "causal": 0, "seqlen": seqlen,
               "batch": 1, "heads": 16, "max_diff_vs_cudnn": nan}
        for name in bench.BACKENDS:
            row[f"{name}_ms"], row[f"{name}_tflops"] = 1.0, fh if name == "flashhopper" else 400.0
        rows.append(row)
    bench._write_csv(rows, tmp_path / "bench_forward.csv")
    assert (tmp_path / "bench_forward.csv").read_text().count("\n") == 3
    pytest.importorskip("matplotlib")
    bench._plot(rows, str(tmp_path / "bench_forward.png"), "test", "2026-01-01", "forward")
    assert (tmp_path / "bench_forward.png").stat().st_size > 0


def test_bench_decode_tables_and_plot(tmp_path, capsys):
    """The decode benchmark's tables and plot from rows as measure_row and measure_prefill_row make
    them, the peers' columns missing (NaN, as without FA3): every field printed or '-', no error."""
    from flashhopper import bench_decode
    nan = float("nan")
    rows = []
    for batch in (1, 32):
        row = dict.fromkeys(bench_decode.FIELDS, nan)
        row.update(date="2026-01-01", gpu="test", batch=batch, cache_len=4096, heads_q=32, heads_kv=8, hdim=128,
                   page_size=64, workspace_bytes=0)
        for b in ("flashhopper", "flashhopper_graph", "flashhopper_paged", "cudnn", "flash2"):
            row[f"{b}_us"], row[f"{b}_tbps"] = 100.0, 3.5
        row.update(ours_vs_copy=0.8, workspace_vs_kv=0.001)
        rows.append(row)
    prefill = [{"date": "2026-01-01", "gpu": "test", "batch": 4, "seqlen_q": 512, "cache_len": 16384, "heads_q": 32,
                "heads_kv": 8, "hdim": 128, "kvcache_us": 10.0, "varlen_us": 10.0, "kvcache_tflops": 500.0,
                "varlen_tflops": 510.0, "kvcache_vs_varlen": 0.98, "max_diff": 0.0}]
    bench_decode.print_tables(rows, prefill, "test", 4.2)
    packed = {"batch": 64, "query_rows": 288, "cache_len": 8192, "heads_q": 32, "heads_kv": 8, "hdim": 128,
              "packed_vs_dense_q": 1.05, "packed_vs_fa3": nan, "max_diff_split": 0.0039, "max_diff_fa3": nan}
    for name, tflops in zip(bench_decode.PACKED_CALLS, (300.0, 120.0, nan, nan)):
        packed.update({f"{name}_us": 50.0, f"{name}_tflops": tflops, f"{name}_tbps": 2.5})
    bench_decode.print_packed_table([packed], "test")
    spec = {"batch": 8, "tokens": 4, "cache_len": 16384, "heads_q": 32, "heads_kv": 8, "hdim": 128, "ours_tbps": 2.9,
            "fa3_tbps": nan, "ours_vs_fa3": nan, "ours_tflops": 46.0, "fa3_tflops": nan, "max_diff_fa3": nan}
    bench_decode.print_spec_table([spec], "test", 3.05)
    mla = {"hdim_v": 512, "batch": 32, "seqlen_q": 4, "cache_len": 16384, "dense_tbps": 3.1, "dense_vs_copy": 0.8,
           "dense_tflops": 610.0, "paged_tbps": nan, "paged_tflops": nan, "max_diff_paged": 0.0}
    bench_decode.print_mla_table([mla], "test", 3.9)
    printed = capsys.readouterr().out
    assert "absorbed MLA decode (qv): 128 heads on 1 KV head, d 64 + qv against the latent dv" in printed
    assert "\n 512    32   4   16384       3.10    0.80     610          -       -          0" in printed
    assert "decode, GQA 32/8, hdim 128" in printed and "prefill against a cache of 16384 keys" in printed
    assert printed.count("\n   32    4096   3.50") == 1 and "  0.980" in printed
    assert "packed decode: 64 sequences of 1-8 query tokens (288 rows)" in printed
    assert "speculative decoding: query tokens a sequence (causal) at the end of 16384 cached keys" in printed
    assert "\n    8      4      2.90         -        -    0.95      46       -         -" in printed
    assert ("\n   8192    300 ( 2.50)    120 ( 2.50)      - ( 2.50)      - ( 2.50)          1.05           -"
            "      0.0039         -") in printed
    pytest.importorskip("matplotlib")
    bench_decode._plot(rows, str(tmp_path / "decode.png"), "test", "2026-01-01", 4.2)
    assert (tmp_path / "decode.png").stat().st_size > 0


def test_bench_features_table_gives_the_steps_peak_memory():
    """bench/bench_features.py's table: TFLOP/s and the ratios each row, and for backward rows the
    peak memory of a forward + backward step, ours against FA4's ('-' where FA4 did not run)."""
    import importlib.util
    script = pathlib.Path(__file__).resolve().parents[2] / "bench" / "bench_features.py"
    spec = importlib.util.spec_from_file_location("bench_features", script)
    bench_features = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_features)
    nan = float("nan")
    rows = [{"row": "window 4095", "pass": "fwd", "flashhopper_tflops": 546.0, "flashhopper_without_tflops": 582.0,
             "fa4_tflops": 600.0},
            {"row": "window 4095", "pass": "bwd", "flashhopper_tflops": 431.0, "flashhopper_without_tflops": 537.0,
             "fa4_tflops": 530.0, "flashhopper_step_peak_mib": 385.2, "fa4_step_peak_mib": 412.0},
            {"row": "softcap 30 causal", "pass": "bwd", "flashhopper_tflops": 409.0,
             "flashhopper_without_tflops": 523.0, "fa4_tflops": nan, "flashhopper_step_peak_mib": 385.0,
             "fa4_step_peak_mib": nan}]
    lines = bench_features.table_lines(rows)
    assert lines[0].endswith("| ours / without | step peak MiB ours / FA4 |") and len(lines) == 5
    assert lines[2] == "| window 4095 | fwd | 546 | 582 | 600 | 0.91 | 0.94 |  |"
    assert lines[3] == "| window 4095 | bwd | 431 | 537 | 530 | 0.81 | 0.80 | 385 / 412 |"
    assert lines[4] == "| softcap 30 causal | bwd | 409 | 523 | nan | nan | 0.78 | 385 / - |"


def test_bench_features_counts_the_visible_pairs_of_each_grid_row():
    """bench/bench_features.py's FLOP count: visible_pairs against a pair-by-pair count of the
    library's mask rules (windows bottom-right aligned, causal, chunks on top), and --rows grid's
    rows (issue 48's set), each beside a call without its feature."""
    import importlib.util
    script = pathlib.Path(__file__).resolve().parents[2] / "bench" / "bench_features.py"
    spec = importlib.util.spec_from_file_location("bench_features", script)
    bench_features = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_features)

    def brute(seqlen, window, causal, chunk):
        left, right = window
        right = 0 if causal else right
        count = 0
        for i in range(seqlen):
            for j in range(seqlen):
                seen = (left < 0 or j >= i - left) and (right < 0 or j <= i + right)
                if chunk > 0:
                    seen = seen and j // chunk == i // chunk
                count += seen
        return count

    for seqlen in (1, 7, 40):
        for window in ((-1, -1), (3, 0), (5, 5), (0, 2), (-1, 4)):
            for causal in (False, True):
                for chunk in (0, 1, 6, 64):
                    assert bench_features.visible_pairs(seqlen, window, causal, chunk) == \
                        brute(seqlen, window, causal, chunk), (seqlen, window, causal, chunk)
    rows = bench_features.grid_rows(4096)
    assert len(rows) == 9 and len({name for name, *_ in rows}) == 9
    for name, seqlen, batch, options, baseline in rows:
        assert seqlen == 4096 and batch == 1 and baseline is not None and options != baseline, name
        assert 0 < bench_features.pairs_of(seqlen, options) <= seqlen * seqlen


def test_ab_gate_table_sets_sides_and_passes_side_by_side(tmp_path):
    """bench/ab_gate_table.py: the gate CSVs of bench/ab_compare.sh's AB_GATE mode (written by the
    gate's own writer), each side's figures in pass order and its median over side a's; a row only
    one side ran shows '-' for the others."""
    import importlib.util
    from flashhopper import gate
    script = pathlib.Path(__file__).resolve().parents[2] / "bench" / "ab_gate_table.py"
    spec = importlib.util.spec_from_file_location("ab_gate_table", script)
    ab_gate_table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ab_gate_table)
    figures = {("a", 1): (400.0, 90.0), ("b", 1): (440.0, 99.0), ("a", 2): (410.0, 80.0),
               ("b", 2): (420.0, 81.0), ("a", 3): (390.0, 85.0), ("b", 3): (430.0, None)}
    for (side, pass_), (fwd, bwd) in figures.items():
        measured = {("dense hdim 64 causal 8192", "fwd"): fwd}
        if bwd is not None:
            measured[("window 4095 16384", "bwd")] = bwd
        units = {key: "TFLOP/s" for key in measured}
        gate.write_baseline(str(tmp_path / f"gate_{side}.{pass_}.csv"),
                            gate.updated_baseline(None, measured, units, "GPU", "2026-12-08", "abc"))
    (tmp_path / "gate_a.x.csv").write_text("not a pass\n")  # not of the pattern: ignored
    lines = ab_gate_table.table(ab_gate_table.read_runs(str(tmp_path)))
    assert lines[0] == "| row | pass | a | b | b/a |"
    assert lines[2] == "| dense hdim 64 causal 8192 | fwd | 400.0 / 410.0 / 390.0 | 440.0 / 420.0 / 430.0 | 1.075 |"
    assert lines[3] == "| window 4095 16384 | bwd | 90.0 / 80.0 / 85.0 | 99.0 / 81.0 | 1.059 |"
    assert ab_gate_table.table({}) == ["ab_gate_table: no gate_<side>.<pass>.csv found"]


def test_bench_varlen_selftest(tmp_path):
    """bench/bench_varlen.py --selftest: its pair counts and batches, and its CSV (every field, the
    step peak columns included), plot and table from made-up timings, without a GPU."""
    script = pathlib.Path(__file__).resolve().parents[2] / "bench" / "bench_varlen.py"
    result = subprocess.run([sys.executable, str(script), "--selftest", "--out", str(tmp_path)], capture_output=True,
                            text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(script.parents[1] / "python")})
    assert result.returncode == 0, result.stderr
    assert result.stdout.rstrip().endswith("selftest ok")
    assert "| step peak MiB ours / FA4 |" in result.stdout
    (csv_path,) = tmp_path.glob("bench_varlen_*.csv")
    header = csv_path.read_text().splitlines()[0].split(",")
    assert "flashhopper_step_peak_mib" in header and "fa4_step_peak_mib" in header


def test_bench_head_dims_picks_the_family_as_the_library_does():
    """bench_head_dims times a padded head dim against the family it runs on: of those at least the
    call's head dims, the least padded work (bf16, the pass's own families)."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))
    import bench_head_dims
    family = flashhopper.interface.KernelFamily
    families = [family("forward", torch.bfloat16, 96, 96), family("forward", torch.bfloat16, 192, 128),
                family("forward", torch.bfloat16, 192, 192), family("backward", torch.bfloat16, 128, 128),
                family("backward", torch.bfloat16, 192, 192), family("forward", torch.float16, 80, 80),
                family("forward", torch.bfloat16, 64, 256), family("forward", torch.bfloat16, 128, 128)]
    assert bench_head_dims.family_of(families, "forward", 80, 80) == (96, 96)
    assert bench_head_dims.family_of(families, "forward", 160, 128) == (192, 128)
    assert bench_head_dims.family_of(families, "backward", 192, 128) == (192, 192)
    assert bench_head_dims.family_of(families, "backward", 96, 96) == (128, 128)
    assert bench_head_dims.family_of(families, "backward", 256, 256) is None
    assert bench_head_dims.family_of(families, "forward", 64, 128) == (128, 128)  # 256 of work, not 320
    assert bench_head_dims.family_of(families, "forward", 64, 192) == (64, 256)  # 320, not 384


def test_reference_conventions():
    """The test reference itself: bottom-right causal mask, empty rows give 0 and -inf, GQA."""
    q = torch.randn(1, 5, 2, 8, dtype=torch.float64)
    k = torch.randn(1, 2, 1, 8, dtype=torch.float64)
    v = torch.randn(1, 2, 1, 8, dtype=torch.float64)
    out, lse = attention_reference(q, k, v, causal=True)
    assert torch.all(out[0, :3] == 0) and torch.all(torch.isinf(lse[0, :, :3]))
    assert torch.allclose(out[0, 3], v[0, 0].expand(2, 8))  # row 3 sees key 0 only
    full, _ = attention_reference(q, k, v)
    s = torch.einsum("bqhd,bkd->bhqk", q, k[:, :, 0]) / 8 ** 0.5
    assert torch.allclose(full, torch.einsum("bhqk,bkd->bqhd", s.softmax(-1), v[:, :, 0]))


def test_varlen_reference_conventions():
    """The test reference for the packed layout: equal-length sequences give the dense reference;
    each sequence is masked bottom-right on its own; zero-length sequences (q or k) and rows past
    seqused give out 0 and lse -inf, and their gradients are zero."""
    torch.manual_seed(0)
    q = torch.randn(3, 5, 4, 8, dtype=torch.float64)
    k = torch.randn(3, 7, 2, 8, dtype=torch.float64)
    v = torch.randn(3, 7, 2, 8, dtype=torch.float64)
    out, lse = attention_reference(q, k, v, causal=True, window_size=(2, 1))
    packed = [t.flatten(0, 1) for t in (q, k, v)]
    out_v, lse_v = varlen_attention_reference(*packed, [5] * 3, [7] * 3, causal=True, window_size=(2, 1))
    assert torch.allclose(out_v, out.flatten(0, 1)) and torch.allclose(lse_v, lse.transpose(0, 1).flatten(1))

    q, k, v = (t.requires_grad_() for t in (packed[0][:10], packed[1][:9], packed[2][:9]))
    seqlens_q, seqlens_k, used_q, used_k = [3, 0, 4, 3], [0, 2, 3, 4], [3, 0, 2, 3], [0, 2, 3, 3]
    out, lse = varlen_attention_reference(q, k, v, seqlens_q, seqlens_k, used_q, used_k, causal=True)
    assert out.shape == (10, 4, 8) and lse.shape == (4, 10)
    alone, alone_lse = attention_reference(q[None, 3:5], k[None, 2:5], v[None, 2:5], causal=True)
    assert torch.equal(out[3:5], alone[0]) and torch.equal(lse[:, 3:5], alone_lse[0])
    empty_rows = [0, 1, 2, 5, 6]  # no key (sequence 0), rows past seqused (sequence 2)
    assert torch.all(out[empty_rows] == 0) and torch.all(lse[:, empty_rows] == float("-inf"))
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    assert not any(torch.isnan(g).any() for g in (dq, dk, dv))
    assert torch.all(dq[empty_rows] == 0) and torch.all(dk[8] == 0) and torch.all(dv[8] == 0)  # past seqused_k


def test_sdpa_backend_refuses_non_square_causal():
    """SDPA's is_causal is top-left aligned, ours bottom-right: a non-square causal call must be
    refused, never answered with the other mask (checked before any device work)."""
    q = torch.zeros(1, 2, 8, 64, dtype=torch.bfloat16)
    k = torch.zeros(1, 2, 16, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="top-left"):
        flashhopper.sdpa._sdpa_forward(q, k, k, is_causal=True)



def test_gate_verdicts_and_baseline_files(tmp_path):
    """The speed gate's rules without a GPU: the noise allowance by length, each verdict, the
    baseline files (the recorded ones parse; --update keeps the better figure of each row)."""
    from flashhopper import gate
    assert gate.allowed_drop(4096, "fwd") == 0.03 and gate.allowed_drop(2048, "bwd") == 0.08
    assert gate.allowed_drop(16384, "decode") == 0.08
    assert gate.verdict(97.5, 100.0, 0.03) == "ok" and gate.verdict(96.9, 100.0, 0.03) == "FAIL"
    assert gate.verdict(float("nan"), 100.0, 0.03) == "not run" and gate.verdict(5.0, None, 0.03) == "new"
    assert gate.visible_pairs(4, causal=True) == 10 and gate.visible_pairs(5, window=(1, 0)) == 9
    names = [(r.name, r.pass_) for r in gate.rows()]
    assert len(names) == len(set(names))  # a row's name and pass are its key in the baseline
    for kind in ("h200", "h100"):
        recorded = gate.read_baseline(str(ROOT / "bench" / f"baseline_{kind}.csv"))
        assert set(recorded) <= set(names), f"baseline_{kind}.csv names rows the gate does not time"
    path = str(tmp_path / "baseline.csv")
    units = {("a", "fwd"): "TFLOP/s", ("b", "fwd"): "TFLOP/s", ("c", "decode"): "TB/s"}
    gate.write_baseline(path, gate.updated_baseline(None, {("a", "fwd"): 100.0, ("b", "fwd"): 50.0}, units,
                                                    "GPU", "2026-01-01", "x"))
    merged = gate.updated_baseline(path, {("a", "fwd"): 90.0, ("b", "fwd"): 60.0, ("c", "decode"): 3.0,
                                          ("d", "fwd"): float("nan")}, {**units, ("d", "fwd"): "TFLOP/s"},
                                   "GPU", "2026-01-02", "y")
    gate.write_baseline(path, merged)
    assert gate.read_baseline(path) == {("a", "fwd"): 100.0, ("b", "fwd"): 60.0, ("c", "decode"): 3.0}
    assert gate.default_baseline("NVIDIA H200").endswith(os.path.join("bench", "baseline_h200.csv"))
    assert gate.default_baseline("NVIDIA A100") is None


def test_limits_mirror_the_c_header():
    """The Python layer's limits are the C ABI's (include/flashhopper/flashhopper.h)."""
    from flashhopper import interface
    header = (ROOT / "include" / "flashhopper" / "flashhopper.h").read_text()
    limits = dict(re.findall(r"#define (FH_MAX_\w+) (\d+)", header))
    assert int(limits["FH_MAX_HEAD_DIM"]) == interface.MAX_HEAD_DIM
    assert int(limits["FH_MAX_BACKWARD_HEAD_DIM"]) == interface.MAX_BACKWARD_HEAD_DIM
    assert int(limits["FH_MAX_SPLITS"]) == interface.MAX_SPLITS


def test_kernel_resources_reads_cuobjdump_output():
    """scripts/kernel_resources.py's parsers on cuobjdump's formats: REG and STACK per kernel, and
    local loads/stores counted in all and between the first and last warpgroup MMA (with the R2UR
    moves there)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import kernel_resources
    finally:
        sys.path.pop(0)
    usage = kernel_resources.resource_usage(
        "Resource usage:\n Common:\n  GLOBAL:0\n Function _Z20forward_kernel_entryA:\n"
        "  REG:168 STACK:40 SHARED:0 LOCAL:0 CONSTANT[0]:3712\n")
    assert usage == {"_Z20forward_kernel_entryA": (168, 40)}
    sass = "\n".join([
        "\tFunction : _Z20forward_kernel_entryA",
        "        /*0000*/                   STL [R1], R2 ;",
        "        /*0010*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], RZ ;",
        "        /*0020*/                   LDL R3, [R1] ;",
        "        /*0028*/                   R2UR UR6, R7 ;",
        "        /*0030*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], R24 ;",
        "        /*0040*/                   LDL.64 R4, [R1+0x8] ;",
        "        /*0050*/                   EXIT ;"])
    assert kernel_resources.local_traffic(sass) == {"_Z20forward_kernel_entryA": (3, 1, 1)}


def test_throughput_report_reads_ncu_details_csv(tmp_path, capsys):
    """bench/profile/throughput_report.py on ncu's --page details --csv form: its own messages
    skipped, units scaled (Duration in us, L2 bytes in TB/s), a missing metric shown as '-'."""
    sys.path.insert(0, str(ROOT / "bench" / "profile"))
    try:
        import throughput_report
    finally:
        sys.path.pop(0)
    header = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size",'
              '"Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"')
    row = '"0","1","python3","h","forward_kernel","1","7","(384, 1, 1)","(132, 1, 1)","0","9.0",'
    csv_path = tmp_path / "throughput_fwd_8192_d512_c0.csv"
    csv_path.write_text("\n".join([
        "==PROF== Connected to process 1",
        header,
        row + '"GPU Speed Of Light Throughput","Duration","ms","1.5"',
        row + '"GPU Speed Of Light Throughput","L2 Cache Throughput","%","71.25"',
        row + '"Command line profiler metrics","lts__t_bytes.sum.per_second","Gbyte/second","5,310"',
    ]) + "\n")
    throughput_report.main([str(csv_path)])
    line = [l for l in capsys.readouterr().out.splitlines() if l.startswith("| fwd_8192_d512_c0")][0]
    cells = [c.strip() for c in line.strip("|").split("|")]
    columns = [c[0] for c in throughput_report.COLUMNS]
    values = dict(zip(["call"] + columns, cells))
    assert values["time us"] == "1500"
    assert values["L2 %"] == "71.2"
    assert values["L2 TB/s"] == "5.31"
    assert values["SM %"] == "-"


def test_benchmark_modules_import_no_cycle():
    """The benchmark modules (python -m flashhopper.bench, its --decode and --gate) take their shared
    helpers from bench_timing; none imports another that imports it back."""
    import ast
    package = ROOT / "python" / "flashhopper"
    names = ("bench", "bench_decode", "gate", "bench_timing")
    imports = {}
    for name in names:
        tree = ast.parse((package / f"{name}.py").read_text())
        found = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module in names:
                found.add(node.module)
        imports[name] = found
    for a in names:
        for b in imports[a]:
            assert a not in imports[b], f"{a} and {b} import each other"
    assert imports["bench_timing"] == set()
