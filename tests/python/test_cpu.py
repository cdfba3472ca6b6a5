"""CPU-side tests (no GPU, no library load): the package imports, the ops are registered with the
right schemas, FA3's API is matched, argument checks raise the right error naming the argument
before anything reaches the library, and the fake (meta) implementations infer shapes, dtypes and
strides, also through autograd."""
import inspect
import os
import subprocess
import sys

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import flashhopper
import flashhopper.flash_attn_interface as fa3
from flashhopper import _ffi, flash_attn_func

from support import attention_reference


@pytest.fixture(autouse=True)
def library_must_not_be_called(monkeypatch):
    """Every check under test happens in Python, before the library (and so before any launch)."""
    def refuse():
        raise AssertionError("the library was reached; the argument check should have refused first")
    monkeypatch.setattr(_ffi, "lib", refuse)


def qkv(batch=2, seqlen_q=64, seqlen_k=96, heads_q=8, heads_kv=2, head_dim=128, dtype=torch.bfloat16, device="cpu",
        requires_grad=False):
    q = torch.randn(batch, seqlen_q, heads_q, head_dim, dtype=dtype, device=device, requires_grad=requires_grad)
    k = torch.randn(batch, seqlen_k, heads_kv, head_dim, dtype=dtype, device=device, requires_grad=requires_grad)
    v = torch.randn(batch, seqlen_k, heads_kv, head_dim, dtype=dtype, device=device, requires_grad=requires_grad)
    return q, k, v


# ----------------------------------------------------------------------------------------------
# Import, registration, API shape

def test_import_and_exports():
    assert flashhopper.flash_attn_func is fa3.flash_attn_func
    for name in ("flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func", "flash_attn_with_kvcache",
                 "flash_attn_combine", "forward", "backward", "use_as_sdpa_flash_backend", "FlashHopperError"):
        assert hasattr(flashhopper, name), name
    assert issubclass(flashhopper.FlashHopperNotSupported, NotImplementedError)
    assert issubclass(flashhopper.FlashHopperInvalidArgument, ValueError)
    assert issubclass(flashhopper.FlashHopperError, RuntimeError)


def test_ops_registered():
    fwd_schema = str(torch.ops.flashhopper.fwd.default._schema)
    bwd_schema = str(torch.ops.flashhopper.bwd.default._schema)
    assert fwd_schema == ("flashhopper::fwd(Tensor q, Tensor k, Tensor v, float? softmax_scale=None, "
                          "bool causal=False, bool deterministic=False) -> (Tensor, Tensor)")
    assert bwd_schema == ("flashhopper::bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
                          "float? softmax_scale=None, bool causal=False, bool deterministic=False) "
                          "-> (Tensor, Tensor, Tensor)")


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
    "flash_attn_qkvpacked_func": [("qkv", None), ("softmax_scale", None), ("causal", False), ("q_descale", None),
                                  ("k_descale", None), ("v_descale", None), ("window_size", (-1, -1)),
                                  ("attention_chunk", 0), ("softcap", 0.0), ("deterministic", False),
                                  ("num_heads_q", None), ("sm_margin", 0), ("return_attn_probs", False)],
}


@pytest.mark.parametrize("name", sorted(FA3_SIGNATURES))
def test_fa3_signatures(name):
    params = inspect.signature(getattr(fa3, name)).parameters.values()
    got = [(p.name, None if p.default is inspect.Parameter.empty else p.default) for p in params]
    assert got == FA3_SIGNATURES[name]


def test_module_alias_import():
    code = "import flashhopper.flash_attn_interface as fa3; print(fa3.flash_attn_func.__module__)"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "flashhopper.flash_attn_interface"


# ----------------------------------------------------------------------------------------------
# What the kernels cannot do yet: NotImplementedError naming the argument, before device checks

@pytest.mark.parametrize("kwargs, argument", [
    (dict(window_size=(16, 16)), "window_size"),
    (dict(window_size=(-1, 16)), "window_size"),
    (dict(window_size=(16, -1)), "window_size"),
    (dict(window_size=(16, 0), causal=True), "window_size"),
    (dict(softcap=30.0), "softcap"),
    (dict(num_splits=2), "num_splits"),
    (dict(attention_chunk=128), "attention_chunk"),
    (dict(sm_margin=8), "sm_margin"),
    (dict(q_descale=torch.ones(2, 2)), "q_descale"),
    (dict(k_descale=torch.ones(2, 2)), "k_descale"),
    (dict(v_descale=torch.ones(2, 2)), "v_descale"),
    (dict(qv=torch.zeros(1)), "qv"),
    (dict(softmax_scale=0.0), "softmax_scale"),
])
def test_not_implemented_arguments(kwargs, argument):
    q, k, v = qkv()  # CPU tensors: the NotImplementedError must come before the device check
    with pytest.raises(NotImplementedError, match=argument):
        flash_attn_func(q, k, v, **kwargs)


def test_not_implemented_dtypes_and_head_dim_v():
    q, k, v = qkv()
    if hasattr(torch, "float8_e4m3fn"):
        with pytest.raises(NotImplementedError, match="q: dtype"):
            flash_attn_func(*(t.to(torch.float8_e4m3fn) for t in (q, k, v)))
    with pytest.raises(NotImplementedError, match="v: head dim 64"):
        flash_attn_func(q, k, v[..., :64].contiguous())


@pytest.mark.parametrize("function, args", [
    (fa3.flash_attn_varlen_func, (None,) * 7),
    (fa3.flash_attn_with_kvcache, (None,) * 3),
    (fa3.flash_attn_combine, (None, None)),
])
def test_not_implemented_functions(function, args):
    with pytest.raises(NotImplementedError, match=function.__name__):
        function(*args)


@pytest.mark.parametrize("kwargs", [
    dict(), dict(causal=True), dict(window_size=(-1, 0)), dict(window_size=(95, 0)), dict(window_size=(-1, 63)),
    dict(window_size=(200, 200)), dict(num_splits=0), dict(pack_gqa=True), dict(deterministic=True),
])
def test_supported_options_reach_the_device_check(kwargs):
    """Windows equal to causal or to no window (FA3's rule: a bound covering the sequence is no
    bound), num_splits 0/1 and the pack_gqa hint are accepted: the next refusal is the CPU device."""
    q, k, v = qkv()  # seqlen_q 64, seqlen_k 96
    with pytest.raises(ValueError, match="q: must be a CUDA tensor"):
        flash_attn_func(q, k, v, **kwargs)


# ----------------------------------------------------------------------------------------------
# Bad tensors: ValueError naming the argument (checked on CPU tensors, before the device check)

def _misaligned_stride_q():
    batch, seqlen, heads, head_dim = 2, 64, 8, 128
    flat = torch.randn(batch, seqlen * heads * head_dim + 4, dtype=torch.bfloat16)[:, : seqlen * heads * head_dim]
    return flat.view(batch, seqlen, heads, head_dim)  # stride[0] = n + 4, not a multiple of 8


@pytest.mark.parametrize("make, pattern", [
    (lambda q, k, v: (q.float(), k.float(), v.float()), "q: dtype torch.float32"),
    (lambda q, k, v: (q, k.half(), v), "k: dtype torch.float16 differs"),
    (lambda q, k, v: (q, k, v.half()), "v: dtype torch.float16 differs"),
    (lambda q, k, v: (q[0], k, v), "q: expected 4 dims"),
    (lambda q, k, v: (q, k[0], v), "k: expected 4 dims"),
    (lambda q, k, v: (q, k, v.unsqueeze(0)), "v: expected 4 dims"),
    (lambda q, k, v: (q, k[:1], v[:1]), "k: batch size 1"),
    (lambda q, k, v: (q, k, v[:, :50]), "v: shape"),
    (lambda q, k, v: (q, k[..., :64], v), "k: head dim 64"),
    (lambda q, k, v: (q, torch.cat([k, k[:, :, :1]], 2), torch.cat([v, v[:, :, :1]], 2)), "k: 3 key/value heads"),
    (lambda q, k, v: tuple(torch.randn(2, 16, 2, 264, dtype=torch.bfloat16) for _ in range(3)), "q: head dim 264"),
    (lambda q, k, v: tuple(torch.randn(2, 16, 2, 12, dtype=torch.bfloat16) for _ in range(3)), "q: head dim 12"),
    (lambda q, k, v: (q.transpose(-1, -2).contiguous().transpose(-1, -2), k, v), "q: the last dim must be contiguous"),
    (lambda q, k, v: (q, k, v.transpose(-1, -2).contiguous().transpose(-1, -2)), "v: the last dim must be contiguous"),
    (lambda q, k, v: (_misaligned_stride_q(), k, v), r"q: stride\[0\]"),
    (lambda q, k, v: ("q", k, v), "q: expected a torch.Tensor"),
    (lambda q, k, v: (q, k, v), "q: must be a CUDA tensor"),
])
def test_bad_tensors(make, pattern):
    with pytest.raises(ValueError, match=pattern):
        flash_attn_func(*make(*qkv()))


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
        dq, dk, dv = torch.ops.flashhopper.bwd(dout, q, k, v, out, lse, 0.1, False, True)
        assert dq.shape == q.shape and dq.stride() == q.stride()
        assert dk.shape == k.shape and dk.stride() == k.stride() and dv.shape == v.shape
        assert dq.dtype == dk.dtype == dv.dtype == torch.bfloat16


def test_fake_impl_checks_shapes():
    with FakeTensorMode():
        q, k, v = qkv(device="cuda")
        with pytest.raises(ValueError, match="k: head dim"):
            torch.ops.flashhopper.fwd(q, k[..., :64], v, None, False, False)


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


@pytest.mark.parametrize("dynamic", [False, True])
def test_torch_compile_fullgraph_traces(monkeypatch, dynamic):
    """Dynamo traces flash_attn_func (its checks included) into one graph with the op, and AOT
    autograd adds bwd: run on meta tensors with the CUDA-device check switched off."""
    from flashhopper import interface
    monkeypatch.setattr(interface, "check_devices", lambda named: None)
    torch._dynamo.reset()

    def block(q, k, v):
        out, lse = flash_attn_func(q, k, v, causal=True, return_attn_probs=True, deterministic=True)
        return out * 2, lse

    graphs = []

    def backend(gm, example_inputs):
        graphs.append([node.target for node in gm.graph.nodes if node.op == "call_function"])
        from torch._dynamo.backends.common import aot_autograd
        from functorch.compile import make_boxed_func
        boxed = lambda g, _: make_boxed_func(g.forward)
        return aot_autograd(fw_compiler=boxed, bw_compiler=boxed)(gm, example_inputs)

    q, k, v = qkv(batch=2, seqlen_q=64, seqlen_k=96, device="meta", requires_grad=True)
    out, lse = torch.compile(block, fullgraph=True, dynamic=dynamic, backend=backend)(q, k, v)
    out.sum().backward()
    assert out.shape == q.shape and lse.shape == (2, 8, 64) and q.grad.shape == q.shape
    assert graphs and all(torch.ops.flashhopper.fwd.default in targets for targets in graphs)
    torch._dynamo.reset()


def test_flash_attn_func_refuses_meta_tensors():
    """flash_attn_func refuses meta tensors (not CUDA): the op is the place for device-free tracing."""
    q, k, v = qkv(device="meta")
    with pytest.raises(ValueError, match="q: must be a CUDA tensor"):
        flash_attn_func(q, k, v)


# ----------------------------------------------------------------------------------------------
# SDPA registry and benchmark plumbing

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


def test_sdpa_backend_refuses_non_square_causal():
    """SDPA's is_causal is top-left aligned, ours bottom-right: a non-square causal call must be
    refused, never answered with the other mask (checked before any device work)."""
    q = torch.zeros(1, 2, 8, 64, dtype=torch.bfloat16)
    k = torch.zeros(1, 2, 16, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="top-left"):
        flashhopper.sdpa._sdpa_forward(q, k, k, is_causal=True)

