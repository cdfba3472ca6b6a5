"""CPU tests of FA3's private entry points and operator names (flash_attn_interface._flash_attn_forward,
_flash_attn_backward; flashhopper.fa3_ops): signatures and schemas as FA3 publishes them, which form
a call takes, the refusals; the GPU runs are in test_gpu.py."""
import inspect

import pytest
import torch

import flashhopper.fa3_ops as fa3_ops
import flashhopper.flash_attn_interface as fa3

# FA3's registrations as published (Dao-AILab/flash-attention, hopper/flash_api.cpp, 2026-08), one
# argument per line as there; fa3_ops keeps its own copy, which must stay compatible with these.
PUBLISHED = {
    "fwd": """fwd(Tensor q, Tensor k, Tensor v, Tensor(k_new!)? k_new = None, Tensor(v_new!)? v_new = None,
        Tensor? q_v = None, Tensor(out!)? out = None, Tensor? cu_seqlens_q = None, Tensor? cu_seqlens_k = None,
        Tensor? cu_seqlens_k_new = None, Tensor? seqused_q = None, Tensor? seqused_k = None,
        int? max_seqlen_q = None, int? max_seqlen_k = None, Tensor? page_table = None,
        Tensor? kv_batch_idx = None, Tensor? leftpad_k = None, Tensor? rotary_cos = None,
        Tensor? rotary_sin = None, Tensor? seqlens_rotary = None, Tensor? q_descale = None,
        Tensor? k_descale = None, Tensor? v_descale = None, float? softmax_scale = None,
        bool is_causal = False, int window_size_left = -1, int window_size_right = -1,
        int attention_chunk = 0, float softcap = 0.0, bool is_rotary_interleaved = False,
        Tensor? scheduler_metadata = None, int num_splits = 0, bool? pack_gqa = None,
        int sm_margin = 0) -> (Tensor(out!), Tensor, Tensor, Tensor)""",
    "bwd": """bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor softmax_lse,
        Tensor(dq!)? dq = None, Tensor(dk!)? dk = None, Tensor(dv!)? dv = None,
        Tensor? cu_seqlens_q = None, Tensor? cu_seqlens_k = None, Tensor? seqused_q = None,
        Tensor? seqused_k = None, int? max_seqlen_q = None, int? max_seqlen_k = None,
        float? softmax_scale = None, bool is_causal = False, int window_size_left = -1,
        int window_size_right = -1, float softcap = 0.0, bool deterministic = False,
        int sm_margin = 0) -> (Tensor, Tensor, Tensor, Tensor, Tensor)""",
    "fwd_combine": """fwd_combine(Tensor out_partial, Tensor lse_partial, Tensor(out!)? out = None,
        ScalarType? out_dtype = None) -> (Tensor(out!), Tensor)""",
    "get_scheduler_metadata": """get_scheduler_metadata(int batch_size, int max_seqlen_q, int max_seqlen_k,
        int num_heads, int num_heads_k, int headdim, int headdim_v, ScalarType qkv_dtype, Tensor seqused_k,
        Tensor? cu_seqlens_q = None, Tensor? cu_seqlens_k = None, Tensor? cu_seqlens_k_new = None,
        Tensor? seqused_q = None, Tensor? leftpad_k = None, int? page_size = None, int max_seqlen_k_new = 0,
        bool is_causal = False, int window_size_left = -1, int window_size_right = -1,
        int attention_chunk = 0, bool has_softcap = False, int num_splits = 0, bool? pack_gqa = None,
        int sm_margin = 0) -> Tensor""",
}

# FA3's Python functions' parameters and defaults (hopper/flash_attn_interface.py, same version).
FORWARD_PARAMETERS = [
    ("q", inspect.Parameter.empty), ("k", inspect.Parameter.empty), ("v", inspect.Parameter.empty),
    ("k_new", None), ("v_new", None), ("qv", None), ("out_", None), ("cu_seqlens_q", None), ("cu_seqlens_k", None),
    ("cu_seqlens_k_new", None), ("seqused_q", None), ("seqused_k", None), ("max_seqlen_q", None),
    ("max_seqlen_k", None), ("page_table", None), ("kv_batch_idx", None), ("leftpad_k", None), ("rotary_cos", None),
    ("rotary_sin", None), ("seqlens_rotary", None), ("q_descale", None), ("k_descale", None), ("v_descale", None),
    ("softmax_scale", None), ("causal", False), ("window_size_left", -1), ("window_size_right", -1),
    ("attention_chunk", 0), ("softcap", 0.0), ("rotary_interleaved", True), ("scheduler_metadata", None),
    ("num_splits", 1), ("pack_gqa", None), ("sm_margin", 0)]
BACKWARD_PARAMETERS = [
    ("dout", inspect.Parameter.empty), ("q", inspect.Parameter.empty), ("k", inspect.Parameter.empty),
    ("v", inspect.Parameter.empty), ("out", inspect.Parameter.empty), ("softmax_lse", inspect.Parameter.empty),
    ("cu_seqlens_q", None), ("cu_seqlens_k", None), ("sequed_q", None), ("sequed_k", None), ("max_seqlen_q", None),
    ("max_seqlen_k", None), ("dq", None), ("dk", None), ("dv", None), ("softmax_scale", None), ("is_causal", False),
    ("window_size_left", -1), ("window_size_right", -1), ("softcap", 0.0), ("deterministic", False),
    ("sm_margin", 0)]


def parameters(fn):
    return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()]


def test_private_entry_points_have_fa3_signatures():
    assert parameters(fa3._flash_attn_forward) == FORWARD_PARAMETERS
    assert parameters(fa3._flash_attn_backward) == BACKWARD_PARAMETERS


def test_registered_ops_have_fa3_schemas():
    fa3_ops.register_fa3_ops()
    fa3_ops.register_fa3_ops()  # a second call does nothing
    assert fa3_ops.fa3_ops_registered()
    for name, text in PUBLISHED.items():
        published = torch._C.parse_schema(f"flash_attn_3::{' '.join(text.split())}")
        ours = getattr(torch.ops.flash_attn_3, name).default._schema
        # Both ways: a program written against either runs against the other.
        assert ours.is_backward_compatible_with(published), (name, str(ours))
        assert published.is_backward_compatible_with(ours), (name, str(ours))


def test_register_refuses_names_already_taken(monkeypatch):
    """Where FA3's extension (here: a stand-in in another namespace) defined the ops first,
    register_fa3_ops refuses and names them rather than shadowing them."""
    namespace = "flashhopper_fa3_probe"
    taken = torch.library.Library(namespace, "FRAGMENT")
    taken.define("fwd(Tensor q) -> Tensor")
    monkeypatch.setattr(fa3_ops, "NAMESPACE", namespace)
    monkeypatch.setattr(fa3_ops, "_library", None)
    with pytest.raises(RuntimeError, match=f"{namespace}::fwd already defined"):
        fa3_ops.register_fa3_ops()
    assert not fa3_ops.fa3_ops_registered()


@pytest.mark.parametrize("arguments, cache", [
    ({}, False),
    ({"seqused_k": 1, "cu_seqlens_k": 1}, False),  # packed keys with used lengths
    ({"seqused_k": 1}, True),  # FA3's cache_seqlens
    ({"page_table": 1}, True),
    ({"kv_batch_idx": 1}, True),
    ({"leftpad_k": 1}, True),
    ({"k_new": 1, "v_new": 1}, True),
    ({"rotary_cos": 1, "rotary_sin": 1}, True),
    ({"cu_seqlens_k_new": 1}, True),
])
def test_private_forward_picks_the_kv_cache_form(arguments, cache):
    names = ("k_new", "v_new", "page_table", "kv_batch_idx", "leftpad_k", "rotary_cos", "rotary_sin",
             "cu_seqlens_k_new", "seqused_k", "cu_seqlens_k")
    assert fa3._cache_call(*(arguments.get(name) for name in names)) is cache


def test_private_entry_points_refuse_by_name():
    q = torch.randn(1, 8, 2, 64, dtype=torch.bfloat16)
    lse = torch.zeros(1, 2, 8)
    with pytest.raises(ValueError, match="sm_margin: expected an int"):
        fa3._flash_attn_forward(q, q, q, sm_margin=4.0)
    with pytest.raises(ValueError, match="sm_margin: expected an int"):
        fa3._flash_attn_backward(q, q, q, q, q, lse, sm_margin=None)
    with pytest.raises(ValueError, match="q_descale: is given but q is bf16"):
        fa3._flash_attn_forward(q, q, q, q_descale=torch.ones(1, 2))
    with pytest.raises(NotImplementedError, match="cu_seqlens_k"):  # a KV-cache call over packed keys
        fa3._flash_attn_forward(q, q, q, kv_batch_idx=torch.zeros(1, dtype=torch.int32),
                                cu_seqlens_k=torch.zeros(2, dtype=torch.int32))
    # page_table with cu_seqlens_k alone is flash_attn_varlen_func's paged path, which needs cu_seqlens_q.
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        fa3._flash_attn_forward(q, q, q, page_table=torch.zeros(1, 1, dtype=torch.int32),
                                cu_seqlens_k=torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="q: must be a CUDA tensor"):
        fa3._flash_attn_forward(q, q, q)
    with pytest.raises(ValueError, match="window_size"):
        fa3._flash_attn_backward(q, q, q, q, q, lse, window_size_left=-5)
    with pytest.raises(NotImplementedError, match="seqused_q"):
        fa3_ops._get_scheduler_metadata(1, 1, 8, 2, 2, 64, 64, torch.bfloat16, torch.zeros(1, dtype=torch.int32),
                                        seqused_q=torch.zeros(1, dtype=torch.int32))


def test_export_traces_the_fa3_named_op():
    """torch.export of a module written against FA3's op sees one flash_attn_3::fwd node (the
    fake function gives the shapes; nothing runs), as a program exported with FA3 holds it."""
    fa3_ops.register_fa3_ops()

    class Attention(torch.nn.Module):
        def forward(self, q, k, v):
            return torch.ops.flash_attn_3.fwd(q, k, v, is_causal=True, num_splits=1)[0]

    q = torch.randn(2, 64, 4, 64, dtype=torch.bfloat16)
    k = torch.randn(2, 80, 2, 64, dtype=torch.bfloat16)
    exported = torch.export.export(Attention(), (q, k, k))
    calls = [n for n in exported.graph.nodes if n.target is torch.ops.flash_attn_3.fwd.default]
    assert len(calls) == 1
    out_meta = calls[0].meta["val"]
    assert tuple(out_meta[0].shape) == (2, 64, 4, 64) and tuple(out_meta[1].shape) == (2, 4, 64)
    if hasattr(torch, "float8_e4m3fn"):  # FA3's fp8 forward writes a bf16 out
        class Fp8Attention(torch.nn.Module):
            def forward(self, q, k, v, descale):
                return torch.ops.flash_attn_3.fwd(q, k, v, q_descale=descale, k_descale=descale, v_descale=descale,
                                                  num_splits=1)[0]

        q8, k8 = q.to(torch.float8_e4m3fn), k.to(torch.float8_e4m3fn)
        exported = torch.export.export(Fp8Attention(), (q8, k8, k8, torch.ones(2, 2)))
        calls = [n for n in exported.graph.nodes if n.target is torch.ops.flash_attn_3.fwd.default]
        assert len(calls) == 1 and calls[0].meta["val"][0].dtype == torch.bfloat16
