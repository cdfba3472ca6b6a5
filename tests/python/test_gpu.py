"""GPU tests (sm_90 only; each skips with its reason elsewhere, or when the library says this build
lacks the case's (dtype, head dim, mask or option)): outputs, LSE and gradients against a float64
reference with FlashAttention's rule (our error <= 2 x the error of plain PyTorch in the input dtype +
slack), also with local windows, softcap, attention_chunk and learnable_sink (and its gradient), and
for packed variable-length sequences (flash_attn_varlen_func, against the reference per sequence,
with seqused); determinism, torch.compile(fullgraph=True), torch.export, CUDA-graph capture and
replay, opcheck, the SDPA backend and the error paths on CUDA tensors."""
import itertools
import math
import os
import pathlib
import random
import shutil
import subprocess
import sys

import pytest
import torch

import flashhopper
import flashhopper.flash_attn_interface as fa3
from flashhopper import FlashHopperNotSupported, flash_attn_func

from support import (FA3_NAMES, attention_block_and_input, attention_reference, capture_graph, cross_layer_cases,
                     expect_replay_matches_eager, refused_argument, requires_gpu, varlen_attention_reference,
                     visible_keys)

OUT_SLACK = 1e-5
GRAD_SLACK = 1e-4


def run_or_skip(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except FlashHopperNotSupported as error:
        pytest.skip(f"not in this build of the library: {error}")


def make_inputs(batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, dtype, seed=0, requires_grad=True):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    def randn(*shape):
        return torch.randn(*shape, device="cuda", dtype=dtype, generator=generator).requires_grad_(requires_grad)
    return (randn(batch, seqlen_q, heads_q, head_dim), randn(batch, seqlen_k, heads_kv, head_dim),
            randn(batch, seqlen_k, heads_kv, head_dim))


def max_error(a, b, finite_only=False):
    a, b = a.double(), b.double()
    if finite_only:
        both_inf = torch.isinf(a) & torch.isinf(b) & (torch.sign(a) == torch.sign(b))
        a, b = torch.where(both_inf, 0.0, a), torch.where(both_inf, 0.0, b)
    return (a - b).abs().max().item()


def dsink_from_outputs(out, lse, dout, sink):
    """(d loss / d sink, the sum of its terms' magnitudes), both float64 [Hq], from a forward's out
    and lse: a sink is a logit with no value, so dsink[h] = -sum over rows of
    exp(sink[h] - lse) * (dout . out). Dense (out [B, sq, Hq, dv], lse [B, Hq, sq]) or packed (out
    [total, Hq, dv], lse [Hq, total]); rows that take no part (out 0) add nothing."""
    d = (dout.double() * out.double()).sum(-1).transpose(-1, -2)  # lse's layout: the head at dim -2
    terms = torch.where(d == 0, 0.0, torch.exp(sink.double().view(-1, 1) - lse.double()) * d)
    heads = terms.movedim(-2, 0).reshape(sink.shape[0], -1)
    return -heads.sum(1), heads.abs().sum(1)


def assert_matches_reference(out, lse, grads, leaves, dout, dtype, reference):
    """FlashAttention's rule against reference(leaves, dtype) -> (out, lse), computed in float64 (the
    exact one) and in the input dtype (plain PyTorch), each on its own copy of the leaves (q, k, v
    and the sink, if any; `grads` are ours for them): no NaN, lse -inf exactly where the reference
    has it, out exactly 0 on the rows where the reference's is (rows that see no key), and out, lse
    and every gradient within 2 x plain PyTorch's error + slack. dsink, a few sums over every row,
    is instead held to the float32 rounding of its formula applied to our out and lse (whose own
    errors the rule bounds): with the rule, plain PyTorch's error on so few numbers is sometimes
    small by chance, and the test failed about once in seven runs."""
    leaves_ref = [t.detach().double().requires_grad_() for t in leaves]
    leaves_pt = [t.detach().clone().requires_grad_() for t in leaves]
    out_ref, lse_ref = reference(leaves_ref, torch.float64)
    out_pt, lse_pt = reference(leaves_pt, dtype)
    grads_ref = torch.autograd.grad(out_ref, leaves_ref, dout.double())
    grads_pt = torch.autograd.grad(out_pt, leaves_pt, dout)
    names = ("dq", "dk", "dv", "dsink")
    for name, t in (("out", out), ("lse", lse)) + tuple(zip(names, grads)):
        assert not torch.isnan(t).any(), f"{name} has NaN"
    assert torch.equal(torch.isinf(lse), torch.isinf(lse_ref))
    assert torch.all(out[(out_ref == 0).all(dim=-1)] == 0)
    assert max_error(out, out_ref) <= 2 * max_error(out_pt, out_ref) + OUT_SLACK
    assert max_error(lse, lse_ref, finite_only=True) <= 2 * max_error(lse_pt.float(), lse_ref, True) + GRAD_SLACK
    for name, ours, ref, plain in zip(names, grads, grads_ref, grads_pt):
        assert ours.shape == ref.shape and ours.dtype == (torch.float32 if name == "dsink" else dtype), name
        if name == "dsink":
            expected, magnitude = dsink_from_outputs(out, lse, dout, leaves[3])
            err = (ours.double() - expected).abs()
            assert torch.all(err <= 1e-4 * magnitude + 1e-6), f"dsink: error {err.max():.3g} against its formula"
            continue
        err, err_pt = max_error(ours, ref), max_error(plain, ref)
        assert err <= 2 * err_pt + GRAD_SLACK, f"{name}: error {err:.3g} vs plain PyTorch's {err_pt:.3g}"


# (batch, seqlen_q, seqlen_k, heads_q, heads_kv, causal): sq != sk both ways (sq > sk causal has
# rows that see no key), single-row decode, GQA and MQA, non-multiples of the tile sizes.
SHAPES = [
    (2, 128, 128, 4, 4, False),
    (2, 113, 203, 4, 2, True),
    (1, 1, 239, 8, 1, True),
    (2, 300, 150, 4, 4, True),
    (1, 257, 511, 6, 2, False),
    (3, 64, 1, 2, 2, False),
]
DTYPES_AND_HEAD_DIMS = [(torch.bfloat16, 128), (torch.bfloat16, 64), (torch.bfloat16, 256),
                        (torch.float16, 64), (torch.float16, 128), (torch.float16, 256)]


def _cases():
    rng = random.Random(1234)
    cases = []
    for dtype, head_dim in DTYPES_AND_HEAD_DIMS:
        # every shape for the development build's (bf16, 128); four of them for the others
        shapes = SHAPES if (dtype, head_dim) == (torch.bfloat16, 128) else rng.sample(SHAPES, 4)
        for shape in shapes:
            cases.append(pytest.param(dtype, head_dim, *shape,
                                      id=f"{str(dtype)[6:]}-d{head_dim}-b{shape[0]}-q{shape[1]}-k{shape[2]}-"
                                         f"h{shape[3]}x{shape[4]}-{'causal' if shape[5] else 'full'}"))
    return cases


@pytest.mark.parametrize("dtype, head_dim, batch, seqlen_q, seqlen_k, heads_q, heads_kv, causal", _cases())
@requires_gpu
def test_against_reference(dtype, head_dim, batch, seqlen_q, seqlen_k, heads_q, heads_kv, causal):
    q, k, v = make_inputs(batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, dtype,
                          seed=seqlen_q * 1000 + seqlen_k + head_dim)
    scale = None if seqlen_q % 2 else 0.7 / math.sqrt(head_dim)  # the default and an explicit scale
    out, lse = run_or_skip(flash_attn_func, q, k, v, softmax_scale=scale, causal=causal, return_attn_probs=True)
    assert out.shape == q.shape and out.dtype == dtype
    assert lse.shape == (batch, heads_q, seqlen_q) and lse.dtype == torch.float32 and not lse.requires_grad
    dout = torch.randn_like(out)
    grads = run_or_skip(torch.autograd.grad, out, (q, k, v), dout)
    assert_matches_reference(out, lse, grads, (q, k, v), dout, dtype, lambda leaves, in_dtype: attention_reference(
        *leaves, causal=causal, softmax_scale=scale, dtype=in_dtype))


@pytest.mark.parametrize("num_splits, causal", [(3, True), (7, False), (0, False)])
@requires_gpu
def test_flash_attn_func_split_kv_against_reference(num_splits, causal):
    """flash_attn_func split over the keys (forced, and chosen by the library on a decode-like
    shape that it splits): out, lse and the gradients (the backward reads the combined out and lse)
    against float64 with the pass rule."""
    q, k, v = make_inputs(2, 4, 3000, 8, 2, 128, torch.bfloat16, seed=num_splits)
    out, lse = run_or_skip(flash_attn_func, q, k, v, causal=causal, num_splits=num_splits, return_attn_probs=True)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert_matches_reference(out, lse, grads, (q, k, v), dout, torch.bfloat16, lambda leaves, in_dtype:
                             attention_reference(*leaves, causal=causal, dtype=in_dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
@requires_gpu
def test_mla_prefill_head_dims_against_reference(dtype, causal):
    """Head dim 192 with value head dim 128 (MLA prefill; a family of its own in both passes), GQA,
    sq != sk: out (128 wide), lse and dq, dk, dv against float64 with the pass rule."""
    q, k, _ = make_inputs(2, 300, 257, 8, 2, 192, dtype, seed=192 + causal)
    v = make_inputs(2, 300, 257, 8, 2, 128, dtype, seed=128 + causal)[2]
    out, lse = run_or_skip(flash_attn_func, q, k, v, causal=causal, return_attn_probs=True)
    assert out.shape == (2, 300, 8, 128) and out.dtype == dtype
    dout = torch.randn_like(out)
    grads = run_or_skip(torch.autograd.grad, out, (q, k, v), dout)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    assert_matches_reference(out, lse, grads, (q, k, v), dout, dtype, lambda leaves, in_dtype: attention_reference(
        *leaves, causal=causal, dtype=in_dtype))


@pytest.mark.parametrize("dv", [256, 192])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@requires_gpu
def test_latent_value_head_dims_against_reference(dtype, causal, dv):
    """Head dim 64 with value head dim 256 (MLA's latent values) without qv: on 256/256 (192: on
    192/192), GQA 16/1, a window's both sides for the masked paths: out, lse and the gradients
    against float64 with the pass rule."""
    q, k, _ = make_inputs(2, 257, 300, 16, 1, 64, dtype, seed=dv + causal)
    v = make_inputs(2, 257, 300, 16, 1, dv, dtype, seed=dv + 1 + causal)[2]
    window = (-1, -1) if causal else (100, 30)
    out, lse = run_or_skip(flash_attn_func, q, k, v, causal=causal, window_size=window, return_attn_probs=True)
    assert out.shape == (2, 257, 16, dv) and out.dtype == dtype
    dout = torch.randn_like(out)
    grads = run_or_skip(torch.autograd.grad, out, (q, k, v), dout)
    assert_matches_reference(out, lse, grads, (q, k, v), dout, dtype, lambda leaves, in_dtype: attention_reference(
        *leaves, causal=causal, window_size=window, dtype=in_dtype))


# (seqlen_q, causal, num_splits, paged): absorbed MLA decode (1 token, packed GQA 128/1 with and
# without splits, pages of 64) and a few query tokens (causal, MTP).
QV_CASES = [(1, False, 1, False), (1, False, 0, False), (1, True, 3, True), (4, True, 1, False), (4, False, 0, True)]


@pytest.mark.parametrize("seqlen_q, causal, num_splits, paged", QV_CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dv", [256, 512])
@requires_gpu
def test_qv_decode_against_reference(dv, dtype, seqlen_q, causal, num_splits, paged):
    """flash_attn_with_kvcache with qv (S = Q K^T + Qv V^T, FA3's absorbed MLA): the attention of
    [q, qv] against [k, v] over the values v with scale 1/sqrt(d + dv), in float64; out within twice
    the error of the same attention in plain low precision, lse close. 128 query heads on one KV
    head, cache lengths of 1, 700 and all 1024 keys; latent widths 256 and 512 (DeepSeek's, whose
    kernels split O over two warpgroups)."""
    heads_q, d, capacity = 128, 64, 1024
    generator = torch.Generator(device="cuda").manual_seed(seqlen_q * 10 + num_splits + paged + dv)
    randn = lambda *shape: torch.randn(*shape, device="cuda", dtype=dtype, generator=generator)  # noqa: E731
    q, qv = randn(3, seqlen_q, heads_q, d), randn(3, seqlen_q, heads_q, dv)
    k_cache, v_cache = randn(3, capacity, 1, d), randn(3, capacity, 1, dv)
    lengths = [1, 700, capacity]
    cache_seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    cache = dict(k_cache=k_cache, v_cache=v_cache)
    if paged:  # pages of 64 in a shuffled pool
        page, pages = 64, capacity // 64
        order = torch.randperm(3 * pages, device="cuda", generator=generator)
        page_table = order.view(3, pages).to(torch.int32)
        pool_k = torch.empty(3 * pages, page, 1, d, device="cuda", dtype=dtype)
        pool_v = torch.empty(3 * pages, page, 1, dv, device="cuda", dtype=dtype)
        pool_k[order] = k_cache.view(3 * pages, page, 1, d)
        pool_v[order] = v_cache.view(3 * pages, page, 1, dv)
        cache = dict(k_cache=pool_k, v_cache=pool_v, page_table=page_table)
    out, lse = run_or_skip(fa3.flash_attn_with_kvcache, q, cache.pop("k_cache"), cache.pop("v_cache"), qv=qv,
                           cache_seqlens=cache_seqlens, causal=causal, num_splits=num_splits,
                           return_softmax_lse=True, **cache)
    assert out.shape == (3, seqlen_q, heads_q, dv) and out.dtype == dtype
    scale = (d + dv) ** -0.5
    for b, length in enumerate(lengths):
        keys = torch.cat([k_cache[b:b + 1, :length], v_cache[b:b + 1, :length]], dim=-1)
        queries = torch.cat([q[b:b + 1], qv[b:b + 1]], dim=-1)
        values = v_cache[b:b + 1, :length]
        ref64, lse64 = attention_reference(queries.double(), keys.double(), values.double(), causal=causal,
                                           softmax_scale=scale)
        plain, _ = attention_reference(queries, keys, values, causal=causal, softmax_scale=scale)
        ours = out[b:b + 1].double()
        assert not ours.isnan().any()
        ours_err = (ours - ref64).abs().max().item()
        plain_err = (plain.double() - ref64).abs().max().item()
        assert ours_err <= 2 * plain_err + 1e-5, (b, ours_err, plain_err)
        torch.testing.assert_close(lse[b:b + 1].double(), lse64, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dv", [256, 512])
@requires_gpu
def test_qv_flash_attn_func_against_reference(causal, dv):
    """flash_attn_func with qv, forward only (inputs that do not require grad): prefill of absorbed
    MLA, GQA 16/1, sq != sk, latent widths 256 and 512, against [q, qv] . [k, v] over v in float64
    with the pass rule."""
    q, k, _ = make_inputs(2, 300, 413, 16, 1, 64, torch.bfloat16, seed=3 + causal, requires_grad=False)
    qv = make_inputs(2, 300, 413, 16, 1, dv, torch.bfloat16, seed=5 + causal, requires_grad=False)[0]
    v = make_inputs(2, 300, 413, 16, 1, dv, torch.bfloat16, seed=7 + causal, requires_grad=False)[2]
    out, lse = run_or_skip(flash_attn_func, q, k, v, qv=qv, causal=causal, return_attn_probs=True)
    assert out.shape == (2, 300, 16, dv)
    queries, keys, scale = torch.cat([q, qv], -1), torch.cat([k, v], -1), (64 + dv) ** -0.5
    ref64, lse64 = attention_reference(queries.double(), keys.double(), v.double(), causal=causal, softmax_scale=scale)
    plain, _ = attention_reference(queries, keys, v, causal=causal, softmax_scale=scale)
    ours_err = (out.double() - ref64).abs().max().item()
    assert ours_err <= 2 * (plain.double() - ref64).abs().max().item() + OUT_SLACK
    torch.testing.assert_close(lse.double(), lse64, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
@requires_gpu
def test_head_dim_512_against_reference(dtype, causal):
    """Head dim 512 (Gemma-style; 32-key blocks and the dQ kernel's shared rows in the backward):
    flash_attn_func's out, lse and dq, dk, dv against float64 with the pass rule, GQA 8/2,
    sq != sk, a window's both sides for the masked path's partial blocks."""
    q, k, v = make_inputs(2, 200, 333, 8, 2, 512, dtype, seed=11 + causal)
    window = (-1, -1) if causal else (90, 40)
    out, lse = run_or_skip(flash_attn_func, q, k, v, causal=causal, window_size=window, return_attn_probs=True)
    assert out.shape == q.shape and out.dtype == dtype
    dout = torch.randn_like(out)
    grads = run_or_skip(torch.autograd.grad, out, (q, k, v), dout)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    assert_matches_reference(out, lse, grads, (q, k, v), dout, dtype, lambda leaves, in_dtype: attention_reference(
        *leaves, causal=causal, window_size=window, dtype=in_dtype))


def dequantised(t, factors):
    """An fp8 [B, s, Hkv or Hq, d] tensor times its descale factors [B, Hkv], in float64."""
    heads_kv = factors.shape[1]
    return t.double() * factors.double().view(factors.shape[0], 1, heads_kv, 1).repeat_interleave(
        t.shape[2] // heads_kv, dim=2)


def plain_fp8_attention(qd, kd, vd, causal, scale):
    """The plain fp8 implementation over dequantised [B, s, H, d] inputs: float32 scores and
    softmax, P rounded to e4m3 as it is, O to bf16 (0 for a row that sees no key)."""
    group = qd.shape[2] // kd.shape[2]
    kf, vf = (t.float().repeat_interleave(group, 2) for t in (kd, vd))
    scores = (qd.float().transpose(1, 2) * scale) @ kf.permute(0, 2, 3, 1)
    visible = visible_keys(qd.shape[1], kd.shape[1], causal, (-1, -1), 0, device=qd.device)
    scores = scores.masked_fill(~visible, float("-inf"))
    row_max = scores.amax(-1, keepdim=True)
    p = torch.exp(scores - torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max))
    denom = p.sum(-1, True)
    plain = (p.to(torch.float8_e4m3fn).float() @ vf.transpose(1, 2)) / torch.where(denom == 0, 1.0, denom)
    return plain.to(torch.bfloat16).transpose(1, 2)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@requires_gpu
def test_fp8_forward_against_reference(head_dim, causal):
    """fp8 (float8_e4m3fn) with descales [B, Hkv] in [0, 2): flash_attn_func's bf16 out against float64
    attention on the dequantised inputs, within twice the error of a plain fp8 implementation (P
    rounded to e4m3 as it is, O to bf16) plus the slack; lse close; GQA 8/2, sq != sk."""
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("this PyTorch has no float8_e4m3fn")
    generator = torch.Generator(device="cuda").manual_seed(head_dim + causal)
    q, k, v = (torch.randn(2, length, heads, head_dim, device="cuda", generator=generator).to(torch.float8_e4m3fn)
               for length, heads in ((300, 8), (517, 2), (517, 2)))
    q_descale, k_descale, v_descale = (2 * torch.rand(2, 2, device="cuda", generator=generator) for _ in range(3))
    out, lse = run_or_skip(flash_attn_func, q, k, v, causal=causal, q_descale=q_descale, k_descale=k_descale,
                           v_descale=v_descale, return_attn_probs=True)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape and not out.isnan().any()
    qd, kd, vd = (dequantised(t, factor) for t, factor in ((q, q_descale), (k, k_descale), (v, v_descale)))
    ref64, lse64 = attention_reference(qd, kd, vd, causal=causal, softmax_scale=head_dim ** -0.5)
    plain = plain_fp8_attention(qd, kd, vd, causal, head_dim ** -0.5)
    ours_err = (out.double() - ref64).abs().max().item()
    plain_err = (plain.double() - ref64).abs().max().item()
    assert ours_err <= 2 * plain_err + OUT_SLACK, (ours_err, plain_err)
    torch.testing.assert_close(lse.double(), lse64, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@requires_gpu
def test_fp8_column_major_v(head_dim, causal):
    """fp8 with v column-major (stored [B, Hkv, d, S], passed as its [B, S, Hkv, d] view: FA3's
    V_colmajor, which the kernels load without transposing): the same bits as the row-major call,
    and within twice the plain fp8 error of float64 attention."""
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("this PyTorch has no float8_e4m3fn")
    generator = torch.Generator(device="cuda").manual_seed(head_dim + 7 * causal)
    fp8 = lambda *shape: torch.randn(*shape, device="cuda", generator=generator).to(torch.float8_e4m3fn)  # noqa: E731
    q, k, v_storage = fp8(2, 300, 8, head_dim), fp8(2, 512, 2, head_dim), fp8(2, 2, head_dim, 512)
    v = v_storage.permute(0, 3, 1, 2)
    assert v.stride(1) == 1
    descales = [2 * torch.rand(2, 2, device="cuda", generator=generator) for _ in range(3)]
    options = dict(causal=causal, q_descale=descales[0], k_descale=descales[1], v_descale=descales[2],
                   return_attn_probs=True)
    out, lse = run_or_skip(flash_attn_func, q, k, v, **options)
    row_major_out, row_major_lse = flash_attn_func(q, k, v.contiguous(), **options)
    assert torch.equal(out, row_major_out) and torch.equal(lse, row_major_lse)
    qd, kd, vd = (dequantised(t, f) for t, f in zip((q, k, v), descales))
    ref64, lse64 = attention_reference(qd, kd, vd, causal=causal, softmax_scale=head_dim ** -0.5)
    plain = plain_fp8_attention(qd, kd, vd, causal, head_dim ** -0.5)
    ours_err, plain_err = (out.double() - ref64).abs().max().item(), (plain.double() - ref64).abs().max().item()
    assert not out.isnan().any() and ours_err <= 2 * plain_err + OUT_SLACK, (ours_err, plain_err)
    torch.testing.assert_close(lse.double(), lse64, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@requires_gpu
def test_fp8_kvcache_and_varlen_against_reference(head_dim):
    """fp8 with descales beyond dense batches: flash_attn_with_kvcache over an unpaged cache
    (cache_seqlens of the whole cache, 0, 1 and part of it; two causal query tokens; split-KV
    chosen and forced; two new keys appended) and over the same keys in shuffled pages of 1, 16, 24
    and 64 (with and without cache_leftpad), flash_attn_varlen_func over those pages and over packed sequences (an empty one among them),
    each sequence against float64 attention on its dequantised inputs within twice the plain fp8
    error plus the slack, lse close; rows that see no key give 0; the append writes its keys and
    values bit for bit and nothing else."""
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("this PyTorch has no float8_e4m3fn")
    generator = torch.Generator(device="cuda").manual_seed(head_dim)
    fp8 = lambda *shape: torch.randn(*shape, device="cuda", generator=generator).to(torch.float8_e4m3fn)  # noqa: E731
    factors = lambda batch: [2 * torch.rand(batch, 2, device="cuda", generator=generator) for _ in range(3)]  # noqa: E731
    scale = head_dim ** -0.5

    def check(out, lse, q, k, v, descales, causal):  # one sequence: [1, s, H, d], lse [1, H, sq]
        qd, kd, vd = (dequantised(t, f) for t, f in zip((q, k, v), descales))
        ref64, lse64 = attention_reference(qd, kd, vd, causal=causal, softmax_scale=scale)
        plain = plain_fp8_attention(qd, kd, vd, causal, scale)
        assert not out.isnan().any()
        ours_err, plain_err = (out.double() - ref64).abs().max().item(), (plain.double() - ref64).abs().max().item()
        assert ours_err <= 2 * plain_err + OUT_SLACK, (ours_err, plain_err)
        torch.testing.assert_close(lse.double(), lse64, rtol=1e-3, atol=1e-3)

    q, k_cache, v_cache = fp8(4, 2, 8, head_dim), fp8(4, 1000, 2, head_dim), fp8(4, 1000, 2, head_dim)
    lengths = [1000, 0, 1, 613]
    descales = factors(4)
    for num_splits in (0, 3):
        out, lse = run_or_skip(fa3.flash_attn_with_kvcache, q, k_cache, v_cache,
                               cache_seqlens=torch.tensor(lengths, dtype=torch.int32, device="cuda"), causal=True,
                               q_descale=descales[0], k_descale=descales[1], v_descale=descales[2],
                               num_splits=num_splits, return_softmax_lse=True)
        assert out.dtype == torch.bfloat16 and out.shape == q.shape
        for b, length in enumerate(lengths):
            if length == 0:
                assert (out[b] == 0).all() and (lse[b] == float("-inf")).all()
                continue
            check(out[b:b + 1], lse[b:b + 1], q[b:b + 1], k_cache[b:b + 1, :length], v_cache[b:b + 1, :length],
                  [f[b:b + 1] for f in descales], causal=True)

    # Two new keys and values appended (as stored) to a copy of the cache, then attended to.
    k_new, v_new = fp8(4, 2, 2, head_dim), fp8(4, 2, 2, head_dim)
    k_appended, v_appended = k_cache.clone(), v_cache.clone()
    before = [min(length, 998) for length in lengths]
    out, lse = run_or_skip(fa3.flash_attn_with_kvcache, q, k_appended, v_appended, k=k_new, v=v_new,
                           cache_seqlens=torch.tensor(before, dtype=torch.int32, device="cuda"), causal=True,
                           q_descale=descales[0], k_descale=descales[1], v_descale=descales[2], return_softmax_lse=True)
    bits = lambda t: t.view(torch.uint8)  # noqa: E731
    for b, length in enumerate(before):
        for cache, appended, new in ((k_cache, k_appended, k_new), (v_cache, v_appended, v_new)):
            assert torch.equal(bits(appended[b, length:length + 2]), bits(new[b]))
            assert torch.equal(bits(appended[b, :length]), bits(cache[b, :length]))
            assert torch.equal(bits(appended[b, length + 2:]), bits(cache[b, length + 2:]))
        keys = slice(0, length + 2)
        check(out[b:b + 1], lse[b:b + 1], q[b:b + 1], k_appended[b:b + 1, keys], v_appended[b:b + 1, keys],
              [f[b:b + 1] for f in descales], causal=True)

    # The same keys in shuffled pages (noise in the pages no sequence uses): whole 16-key chunks
    # load by TMA, pages of 1 and 24 keys are gathered.
    lengths_t = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    for page_size in (1, 16, 24, 64):
        per_sequence = -(-1000 // page_size)
        shuffle = torch.randperm(4 * per_sequence + 3, generator=torch.Generator().manual_seed(page_size))
        table = shuffle[:4 * per_sequence].view(4, per_sequence).to(device="cuda", dtype=torch.int32)
        k_pages = fp8(4 * per_sequence + 3, page_size, 2, head_dim)
        v_pages = fp8(4 * per_sequence + 3, page_size, 2, head_dim)
        for b in range(4):
            for i in range(per_sequence):
                rows = slice(i * page_size, min((i + 1) * page_size, 1000))
                k_pages[table[b, i], :rows.stop - rows.start] = k_cache[b, rows]
                v_pages[table[b, i], :rows.stop - rows.start] = v_cache[b, rows]
        out, lse = run_or_skip(fa3.flash_attn_with_kvcache, q, k_pages, v_pages, cache_seqlens=lengths_t,
                               page_table=table, causal=True, q_descale=descales[0], k_descale=descales[1],
                               v_descale=descales[2], return_softmax_lse=True)
        cu_keys = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device="cuda")
        cu_queries = torch.arange(0, 9, 2, dtype=torch.int32, device="cuda")
        packed_out, packed_lse = run_or_skip(
            fa3.flash_attn_varlen_func, q.flatten(0, 1), k_pages, v_pages, cu_queries, cu_keys, 2, max(lengths),
            page_table=table, causal=True, q_descale=descales[0], k_descale=descales[1], v_descale=descales[2],
            return_attn_probs=True)
        for b, length in enumerate(lengths):
            if length == 0:
                assert (out[b] == 0).all() and (packed_out[2 * b:2 * b + 2] == 0).all()
                continue
            inputs = (q[b:b + 1], k_cache[b:b + 1, :length], v_cache[b:b + 1, :length], [f[b:b + 1] for f in descales])
            check(out[b:b + 1], lse[b:b + 1], *inputs, causal=True)
            check(packed_out[2 * b:2 * b + 2][None], packed_lse[:, 2 * b:2 * b + 2][None], *inputs, causal=True)
        # cache_leftpad over the pages: each sequence's keys from its leftpad on (gathered at any page size).
        leftpad = [5, 0, 0, 100]
        out, lse = run_or_skip(fa3.flash_attn_with_kvcache, q, k_pages, v_pages, cache_seqlens=lengths_t,
                               cache_leftpad=torch.tensor(leftpad, dtype=torch.int32, device="cuda"),
                               page_table=table, causal=True, q_descale=descales[0], k_descale=descales[1],
                               v_descale=descales[2], return_softmax_lse=True)
        for b, (start, length) in enumerate(zip(leftpad, lengths)):
            if length == start:
                assert (out[b] == 0).all()
                continue
            check(out[b:b + 1], lse[b:b + 1], q[b:b + 1], k_cache[b:b + 1, start:length],
                  v_cache[b:b + 1, start:length], [f[b:b + 1] for f in descales], causal=True)

    seqlens_q, seqlens_k = [3, 0, 200, 64], [500, 7, 200, 1000]
    q, k, v = fp8(sum(seqlens_q), 8, head_dim), fp8(sum(seqlens_k), 2, head_dim), fp8(sum(seqlens_k), 2, head_dim)
    descales = factors(4)
    cu = lambda lengths: torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device="cuda")  # noqa: E731
    out, lse = run_or_skip(fa3.flash_attn_varlen_func, q, k, v, cu(seqlens_q), cu(seqlens_k), max(seqlens_q),
                           max(seqlens_k), causal=True, q_descale=descales[0], k_descale=descales[1],
                           v_descale=descales[2], return_attn_probs=True)
    assert out.dtype == torch.bfloat16 and lse.shape == (8, sum(seqlens_q))
    q0, k0 = 0, 0
    for b, (length_q, length_k) in enumerate(zip(seqlens_q, seqlens_k)):
        rows, keys = slice(q0, q0 + length_q), slice(k0, k0 + length_k)
        q0, k0 = q0 + length_q, k0 + length_k
        if length_q > 0:
            check(out[rows][None], lse[:, rows][None], q[rows][None], k[keys][None], v[keys][None],
                  [f[b:b + 1] for f in descales], causal=True)


@pytest.mark.parametrize("causal", [False, True])
@requires_gpu
def test_qv_varlen_against_reference(causal):
    """flash_attn_varlen_func with qv, forward only: packed sequences (one and four query tokens, a
    longer one, an empty one) of 16 query heads on one KV head against [q, qv] . [k, v] over v per
    sequence in float64 with the pass rule; lse close."""
    seqlens_q, seqlens_k, heads_q, d, dv = [1, 4, 0, 37], [700, 300, 5, 413], 16, 64, 256
    generator = torch.Generator(device="cuda").manual_seed(11 + causal)
    randn = lambda *shape: torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=generator)  # noqa: E731
    q, qv = randn(sum(seqlens_q), heads_q, d), randn(sum(seqlens_q), heads_q, dv)
    k, v = randn(sum(seqlens_k), 1, d), randn(sum(seqlens_k), 1, dv)
    cu = lambda lengths: torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device="cuda")  # noqa: E731
    out, lse = run_or_skip(fa3.flash_attn_varlen_func, q, k, v, cu(seqlens_q), cu(seqlens_k), max(seqlens_q),
                           max(seqlens_k), qv=qv, causal=causal, return_attn_probs=True)
    assert out.shape == (sum(seqlens_q), heads_q, dv) and lse.shape == (heads_q, sum(seqlens_q))
    scale, q0, k0 = (d + dv) ** -0.5, 0, 0
    for length_q, length_k in zip(seqlens_q, seqlens_k):
        rows, keys = slice(q0, q0 + length_q), slice(k0, k0 + length_k)
        q0, k0 = q0 + length_q, k0 + length_k
        if length_q == 0:
            continue
        queries = torch.cat([q[rows], qv[rows]], -1)[None]
        both = torch.cat([k[keys], v[keys]], -1)[None]
        ref64, lse64 = attention_reference(queries.double(), both.double(), v[keys][None].double(), causal=causal,
                                           softmax_scale=scale)
        plain, _ = attention_reference(queries, both, v[keys][None], causal=causal, softmax_scale=scale)
        ours = out[rows][None].double()
        assert not ours.isnan().any()
        assert (ours - ref64).abs().max().item() <= 2 * (plain.double() - ref64).abs().max().item() + OUT_SLACK
        torch.testing.assert_close(lse[:, rows].double(), lse64[0], rtol=1e-3, atol=1e-3)


# (id, dtype, head_dim, batch, seqlen_q, seqlen_k, heads_q, heads_kv, options for flash_attn_func, with_sink).
# Windows (both sides, one side, with causal, the diagonal only), chunks (multiples of the tile sizes
# or not, with a window, with causal), softcap (loose and tight), sinks (with rows that see no key,
# decode, GQA/MQA), and all of them at once; sq != sk both ways.
OPTION_CASES = [
    ("window-both", torch.bfloat16, 128, 2, 256, 256, 4, 2, dict(window_size=(64, 64)), False),
    ("window-left-causal", torch.bfloat16, 128, 2, 300, 300, 4, 4, dict(window_size=(100, -1), causal=True), False),
    ("window-right-only", torch.bfloat16, 128, 1, 200, 333, 4, 2, dict(window_size=(-1, 32)), False),
    ("window-empty-rows", torch.bfloat16, 128, 2, 300, 150, 4, 4, dict(window_size=(20, 0)), False),
    ("window-diagonal", torch.bfloat16, 128, 1, 190, 190, 2, 2, dict(window_size=(0, 0)), False),
    ("window-sq-lt-sk", torch.bfloat16, 128, 2, 113, 503, 4, 1, dict(window_size=(77, 5)), False),
    ("softcap", torch.bfloat16, 128, 2, 128, 200, 4, 2, dict(softcap=30.0), False),
    ("softcap-tight-causal", torch.bfloat16, 128, 2, 257, 257, 4, 2, dict(softcap=2.0, causal=True), False),
    ("chunk-causal", torch.bfloat16, 128, 2, 256, 256, 4, 2, dict(attention_chunk=64, causal=True), False),
    ("chunk-odd", torch.bfloat16, 128, 1, 250, 410, 4, 2, dict(attention_chunk=100), False),
    ("chunk-window", torch.bfloat16, 128, 2, 384, 384, 4, 4, dict(attention_chunk=128, window_size=(50, 0)), False),
    ("chunk-empty-rows", torch.bfloat16, 128, 1, 200, 120, 2, 2, dict(attention_chunk=48), False),
    ("sink", torch.bfloat16, 128, 2, 256, 256, 4, 2, dict(), True),
    ("sink-causal-empty-rows", torch.bfloat16, 128, 2, 300, 150, 4, 4, dict(causal=True), True),
    ("sink-decode-mqa", torch.bfloat16, 128, 3, 1, 239, 8, 1, dict(causal=True), True),
    ("sink-window", torch.bfloat16, 128, 2, 200, 260, 6, 2, dict(window_size=(40, 0)), True),
    ("all", torch.bfloat16, 128, 2, 333, 397, 4, 2,
     dict(softcap=15.0, window_size=(96, 8), attention_chunk=160, softmax_scale=0.1), True),
    ("all-causal", torch.bfloat16, 128, 1, 256, 512, 4, 4,
     dict(softcap=20.0, window_size=(128, 64), causal=True, attention_chunk=96), True),
    ("window-fp16-d64", torch.float16, 64, 2, 200, 200, 4, 2, dict(window_size=(30, 30)), False),
    ("all-fp16-d64", torch.float16, 64, 2, 150, 220, 4, 2,
     dict(softcap=10.0, window_size=(50, 0), attention_chunk=64), True),
    ("all-bf16-d256", torch.bfloat16, 256, 1, 200, 300, 4, 2,
     dict(softcap=25.0, window_size=(64, 16), attention_chunk=128), True),
]


def make_sink(heads_q, seed, requires_grad=True):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    sink = torch.randn(heads_q, device="cuda", dtype=torch.float32, generator=generator) * 2
    return sink.requires_grad_(requires_grad)


@pytest.mark.parametrize("dtype, head_dim, batch, seqlen_q, seqlen_k, heads_q, heads_kv, options, with_sink",
                         [pytest.param(*case[1:], id=case[0]) for case in OPTION_CASES])
@requires_gpu
def test_options_against_reference(dtype, head_dim, batch, seqlen_q, seqlen_k, heads_q, heads_kv, options,
                                   with_sink):
    """window_size, softcap, attention_chunk and learnable_sink against the float64 reference with
    the mask materialised (support.visible_keys): out, lse, dq, dk, dv and dsink."""
    q, k, v = make_inputs(batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, dtype,
                          seed=seqlen_q * 1000 + seqlen_k + head_dim + 7)
    sink = make_sink(heads_q, seed=seqlen_q + 3) if with_sink else None
    out, lse = run_or_skip(flash_attn_func, q, k, v, return_attn_probs=True, learnable_sink=sink, **options)
    assert out.shape == q.shape and out.dtype == dtype
    assert lse.shape == (batch, heads_q, seqlen_q) and lse.dtype == torch.float32 and not lse.requires_grad
    dout = torch.randn_like(out)
    leaves = (q, k, v) + ((sink,) if with_sink else ())
    grads = run_or_skip(torch.autograd.grad, out, leaves, dout)
    # rows that see no key: lse -inf without a sink (the sink's logit with one), out 0
    assert_matches_reference(out, lse, grads, leaves, dout, dtype, lambda leaves, in_dtype: attention_reference(
        *leaves[:3], dtype=in_dtype, learnable_sink=leaves[3] if with_sink else None, **options))


@requires_gpu
def test_sink_without_grad_and_deterministic_options():
    """A sink that does not require grad gets none (q, k, v still do); the deterministic backward with
    every option is bit-reproducible, dsink included."""
    q, k, v = make_inputs(2, 256, 300, 4, 2, 128, torch.bfloat16, seed=31)
    sink = make_sink(4, seed=2, requires_grad=False)
    options = dict(softcap=20.0, window_size=(64, 0), attention_chunk=128)
    out = run_or_skip(flash_attn_func, q, k, v, learnable_sink=sink, **options)
    run_or_skip(out.sum().backward)
    assert sink.grad is None and q.grad is not None
    sink.requires_grad_()
    out = flash_attn_func(q, k, v, learnable_sink=sink, deterministic=True, **options)
    dout = torch.randn_like(out)
    first = torch.autograd.grad(out, (q, k, v, sink), dout, retain_graph=True)
    for _ in range(2):
        again = torch.autograd.grad(out, (q, k, v, sink), dout, retain_graph=True)
        assert all(torch.equal(a, b) for a, b in zip(first, again))


@requires_gpu
def test_plain_calls_match_flash_attn_func_with_options():
    """flashhopper.forward / backward with the same options give flash_attn_func's out, lse and
    gradients, dsink included (deterministic backward on both sides)."""
    q, k, v = make_inputs(2, 200, 264, 4, 2, 128, torch.bfloat16, seed=41)
    sink = make_sink(4, seed=4)
    options = dict(causal=True, window_size=(80, 40), softcap=18.0, attention_chunk=120)
    out, lse = run_or_skip(flash_attn_func, q, k, v, learnable_sink=sink, deterministic=True,
                           return_attn_probs=True, **options)
    dout = torch.randn_like(out)
    grads = run_or_skip(torch.autograd.grad, out, (q, k, v, sink), dout)
    detached = [t.detach() for t in (q, k, v)]
    out2, lse2 = flashhopper.forward(*detached, return_lse=True, learnable_sink=sink.detach(), **options)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)
    grads2 = flashhopper.backward(dout, *detached, out2, lse2, deterministic=True, learnable_sink=sink.detach(),
                                  **options)
    assert len(grads2) == 4
    for name, a, b in zip(("dq", "dk", "dv", "dsink"), grads, grads2):
        assert torch.equal(a, b), name


@requires_gpu
def test_torch_compile_fullgraph_with_softcap_window_sink():
    q, k, v = make_inputs(2, 256, 320, 8, 2, 128, torch.bfloat16, seed=17)
    sink = make_sink(8, seed=5)

    def attention_block(q, k, v, sink):
        out = flash_attn_func(q, k, v, causal=True, window_size=(96, -1), softcap=25.0, attention_chunk=128,
                              learnable_sink=sink)
        return (out.float() * 1.5).to(q.dtype)

    eager = run_or_skip(attention_block, q, k, v, sink)
    dout = torch.randn_like(eager)
    eager_grads = run_or_skip(torch.autograd.grad, eager, (q, k, v, sink), dout)
    torch._dynamo.reset()
    compiled = torch.compile(attention_block, fullgraph=True)
    out = compiled(q, k, v, sink)
    grads = torch.autograd.grad(out, (q, k, v, sink), dout)
    torch._dynamo.reset()
    assert torch.allclose(out.float(), eager.float(), atol=1e-2, rtol=0)
    for a, b in zip(grads, eager_grads):
        assert torch.allclose(a.float(), b.float(), atol=2e-2, rtol=1e-3)


@requires_gpu
def test_cuda_graph_with_options():
    """Capture and replay with softcap, a window, a chunk and a sink (dsink included): no host sync."""
    q, k, v = make_inputs(2, 192, 256, 4, 2, 128, torch.bfloat16, seed=23)
    sink = make_sink(4, seed=8)
    dout = torch.randn(2, 192, 4, 128, device="cuda", dtype=torch.bfloat16)
    options = dict(softcap=12.0, window_size=(48, 16), attention_chunk=96, learnable_sink=sink, deterministic=True)
    run_or_skip(flash_attn_func, q, k, v, **options)

    def step():
        out = flash_attn_func(q, k, v, **options)
        return (out, *torch.autograd.grad(out, (q, k, v, sink), dout))

    graph, captured = capture_graph(step)
    new_q, _, _ = make_inputs(2, 192, 256, 4, 2, 128, torch.bfloat16, seed=24, requires_grad=False)
    with torch.no_grad():
        q.copy_(new_q), sink.mul_(0.5)
    expect_replay_matches_eager(graph, captured, step, ("out", "dq", "dk", "dv", "dsink"))


@requires_gpu
def test_sm_margin_leaves_the_results_unchanged():
    """sm_margin (SMs left free) only shrinks the persistent kernels' grids: dense, causal packed
    and KV-cache forwards and the deterministic backward give the same bits with margins of 8 and
    of all SMs but one; a margin of every SM is refused by name."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    q, k, v = make_inputs(2, 1000, 1000, 8, 2, 128, torch.bfloat16, seed=41)
    qv, kv, vv, cu_q, cu_k = make_varlen_inputs(MIX, MIX, 8, 2, 128, torch.bfloat16, seed=42)
    dout = torch.randn_like(q)
    cache_k, cache_v = (torch.randn(4, 4096, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    lengths = torch.tensor([4000, 17, 0, 2048], dtype=torch.int32, device="cuda")
    decode_q = torch.randn(4, 1, 8, 128, device="cuda", dtype=torch.bfloat16)

    def run(sm_margin):
        out = run_or_skip(flash_attn_func, q, k, v, causal=True, deterministic=True, sm_margin=sm_margin)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        packed = fa3.flash_attn_varlen_func(qv, kv, vv, cu_q, cu_k, max(MIX), max(MIX), causal=True,
                                            sm_margin=sm_margin)
        decode = fa3.flash_attn_with_kvcache(decode_q, cache_k, cache_v, cache_seqlens=lengths, num_splits=3,
                                             sm_margin=sm_margin)
        return (out, *grads, packed, decode)

    base = run(0)
    for margin in (8, sms - 1):
        for name, a, b in zip(("out", "dq", "dk", "dv", "varlen out", "decode out"), run(margin), base):
            assert torch.equal(a, b), f"{name} differs with sm_margin={margin}"
    with pytest.raises(NotImplementedError, match=f"sm_margin {sms} leaves no SM"):
        flash_attn_func(q.detach(), k.detach(), v.detach(), sm_margin=sms)


@requires_gpu
def test_deterministic_backward_is_bitwise_reproducible():
    q, k, v = make_inputs(2, 384, 384, 8, 2, 128, torch.bfloat16, seed=7)
    out = run_or_skip(flash_attn_func, q, k, v, causal=True, deterministic=True)
    dout = torch.randn_like(out)
    first = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    for _ in range(3):
        again = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
        assert all(torch.equal(a, b) for a, b in zip(first, again))


@requires_gpu
def test_qkvpacked_matches_unpacked():
    qkv = torch.randn(2, 200, 3, 4, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out = run_or_skip(fa3_qkvpacked, qkv)
    q, k, v = (t.detach().clone().requires_grad_() for t in qkv.unbind(2))
    ref = flash_attn_func(q, k, v, causal=True)
    assert torch.equal(out, ref)
    dout = torch.randn_like(out)
    (dqkv,) = torch.autograd.grad(out, qkv, dout)
    grads = torch.autograd.grad(ref, (q, k, v), dout)
    assert torch.equal(dqkv, torch.stack(grads, dim=2))


def fa3_qkvpacked(qkv):
    return flashhopper.flash_attn_qkvpacked_func(qkv, causal=True)


@requires_gpu
def test_lse_matches_plain_forward_and_zero_dout():
    """The op's out and lse equal flashhopper.forward's; a zero dout (as autograd hands it over,
    possibly expanded) gives zero gradients."""
    q, k, v = make_inputs(1, 100, 100, 2, 2, 128, torch.bfloat16, seed=3)
    out, lse = run_or_skip(flash_attn_func, q, k, v, return_attn_probs=True)
    out2, lse2 = flashhopper.forward(q.detach(), k.detach(), v.detach(), return_lse=True)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)
    (out.float().sum() * 0).backward()  # dout = 0 expanded (stride 0): copied to a dense layout first
    assert torch.count_nonzero(q.grad) == 0


@requires_gpu
def test_torch_compile_fullgraph():
    q, k, v = make_inputs(2, 256, 320, 8, 2, 128, torch.bfloat16, seed=11)

    def attention_block(q, k, v):
        out = flash_attn_func(q, k, v, causal=True)
        return (out.float() * 1.5).to(q.dtype)

    eager = run_or_skip(attention_block, q, k, v)
    dout = torch.randn_like(eager)
    eager_grads = torch.autograd.grad(eager, (q, k, v), dout)
    torch._dynamo.reset()
    compiled = torch.compile(attention_block, fullgraph=True)
    out = compiled(q, k, v)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert torch.allclose(out.float(), eager.float(), atol=1e-2, rtol=0)
    for a, b in zip(grads, eager_grads):
        assert torch.allclose(a.float(), b.float(), atol=2e-2, rtol=0)


@requires_gpu
def test_torch_export():
    """torch.export sees the forward as one op (no graph break) and the exported program computes
    the same output as eager."""
    q, k, v = make_inputs(2, 256, 320, 8, 2, 128, torch.bfloat16, seed=13, requires_grad=False)

    class Attention(torch.nn.Module):
        def forward(self, q, k, v):
            return flash_attn_func(q, k, v, causal=True)

    eager = run_or_skip(Attention(), q, k, v)
    exported = torch.export.export(Attention(), (q, k, v))
    calls = [node for node in exported.graph.nodes if node.target is torch.ops.flashhopper.fwd.default]
    assert len(calls) == 1
    assert torch.equal(exported.module()(q, k, v), eager)


@pytest.mark.parametrize("deterministic", [False, True])
@requires_gpu
def test_cuda_graph_capture_and_replay(deterministic):
    q, k, v = make_inputs(2, 192, 256, 4, 2, 128, torch.bfloat16, seed=5)
    dout = torch.randn(2, 192, 4, 128, device="cuda", dtype=torch.bfloat16)
    run_or_skip(flash_attn_func, q, k, v, causal=True)

    def step():
        out = flash_attn_func(q, k, v, causal=True, deterministic=deterministic)
        return (out, *torch.autograd.grad(out, (q, k, v), dout))

    graph, captured = capture_graph(step)

    for seed in (21, 22):
        new_q, new_k, new_v = make_inputs(2, 192, 256, 4, 2, 128, torch.bfloat16, seed=seed, requires_grad=False)
        with torch.no_grad():
            q.copy_(new_q), k.copy_(new_k), v.copy_(new_v), dout.copy_(torch.randn_like(dout))
        graph.replay()
        torch.cuda.synchronize()
        eager = step()
        assert torch.equal(captured[0], eager[0]), "out: replay differs from eager"
        for name, a, b in zip(("dq", "dk", "dv"), captured[1:], eager[1:]):
            if deterministic:
                assert torch.equal(a, b), f"{name}: replay differs from eager"
            else:  # the order of the float32 dQ additions may differ
                assert torch.allclose(a.float(), b.float(), atol=1e-2, rtol=0), f"{name}: replay differs"


@requires_gpu
def test_opcheck():
    q, k, v = make_inputs(1, 96, 160, 4, 2, 128, torch.bfloat16, seed=9)
    run_or_skip(flash_attn_func, q, k, v)
    torch.library.opcheck(torch.ops.flashhopper.fwd.default, (q, k, v, None, True, False))
    out, lse = torch.ops.flashhopper.fwd(q.detach(), k.detach(), v.detach(), None, True, False)
    dout = torch.randn_like(out)
    torch.library.opcheck(torch.ops.flashhopper.bwd.default,
                          (dout, q.detach(), k.detach(), v.detach(), out, lse, None, True, False))


@requires_gpu
def test_opcheck_with_options_and_sink():
    q, k, v = make_inputs(1, 96, 160, 4, 2, 128, torch.bfloat16, seed=10)
    sink = make_sink(4, seed=1)
    options = (32, 16, 20.0, 64, sink)  # window_left, window_right, softcap, attention_chunk, learnable_sink
    # deterministic=True: opcheck compares gradients of repeated runs, which the default mode's dQ
    # additions may round differently.
    run_or_skip(torch.ops.flashhopper.fwd, q.detach(), k.detach(), v.detach(), None, False, True, *options)
    torch.library.opcheck(torch.ops.flashhopper.fwd.default, (q, k, v, None, False, True, *options))
    out, lse = torch.ops.flashhopper.fwd(q.detach(), k.detach(), v.detach(), None, False, True, *options[:4],
                                         sink.detach())
    dout = torch.randn_like(out)
    args = (dout, q.detach(), k.detach(), v.detach(), out, lse, None, False, True, *options[:4], sink.detach())
    run_or_skip(torch.ops.flashhopper.bwd, *args)
    torch.library.opcheck(torch.ops.flashhopper.bwd.default, args)
    dq, dk, dv, dsink = torch.ops.flashhopper.bwd(*args)
    assert dsink.shape == (4,) and dsink.dtype == torch.float32
    *_, no_dsink = torch.ops.flashhopper.bwd(dout, q.detach(), k.detach(), v.detach(), out, lse, None, True, False)
    assert no_dsink.shape == (0,) and no_dsink.dtype == torch.float32


@requires_gpu
def test_sdpa_flash_backend():
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = make_inputs(2, 256, 256, 8, 8, 128, torch.bfloat16, seed=13)
    ours = run_or_skip(flash_attn_func, q, k, v, causal=True)
    dout = torch.randn_like(ours)
    our_grads = torch.autograd.grad(ours, (q, k, v), dout)
    try:
        flashhopper.use_as_sdpa_flash_backend()
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 is_causal=True).transpose(1, 2)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    finally:
        flashhopper.restore_sdpa_flash_backend()
    assert torch.equal(out, ours)
    for a, b in zip(grads, our_grads):
        assert torch.allclose(a.float(), b.float(), atol=1e-2, rtol=0)


# ----------------------------------------------------------------------------------------------
# flash_attn_varlen_func: packed variable-length sequences

def cu_seqlens(lengths):
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device="cuda")


def make_varlen_inputs(seqlens_q, seqlens_k, heads_q, heads_kv, head_dim, dtype, seed=0, requires_grad=True):
    """Packed q [total_q, Hq, d], k/v [total_k, Hkv, d] (total = the sum of the lengths) and
    cu_seqlens_q/k."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    def randn(total, heads):
        return torch.randn(total, heads, head_dim, device="cuda", dtype=dtype,
                           generator=generator).requires_grad_(requires_grad)
    return (randn(sum(seqlens_q), heads_q), randn(sum(seqlens_k), heads_kv), randn(sum(seqlens_k), heads_kv),
            cu_seqlens(seqlens_q), cu_seqlens(seqlens_k))


def past_seqused(seqlens, seqused):
    """[total] bool: the tokens of each sequence past its first seqused[b]."""
    return torch.tensor([i >= used for length, used in zip(seqlens, seqused) for i in range(length)], device="cuda")


MIX = [1, 7, 113, 0, 1000, 300]

# (id, dtype, head_dim, seqlens_q, seqlens_k, heads_q, heads_kv, options, with_sink, seqused_q, seqused_k):
# zero-length sequences in the middle and at the end, sq != sk per sequence both ways (also sk = 0
# and sq > sk causal: rows that see no key), GQA/MQA, causal, windows, every option with a sink,
# seqused shorter than the lengths (also 0), bf16 and fp16, head dims 64/128/256.
VARLEN_CASES = [
    ("mix", torch.bfloat16, 128, MIX, MIX, 4, 4, dict(), False, None, None),
    ("mix-causal-gqa", torch.bfloat16, 128, MIX, [5, 7, 60, 0, 1200, 300], 8, 2, dict(causal=True), False, None,
     None),
    ("zeros-at-end-window", torch.bfloat16, 128, [64, 0, 257, 0], [100, 0, 200, 0], 4, 2,
     dict(window_size=(32, 8)), False, None, None),
    ("no-keys-causal", torch.bfloat16, 128, [30, 200, 17, 5], [0, 150, 40, 0], 4, 4, dict(causal=True), False,
     None, None),
    ("sink-causal", torch.bfloat16, 128, MIX, [1, 20, 113, 0, 700, 300], 8, 2, dict(causal=True), True, None,
     None),
    ("all-options-sink-d64", torch.bfloat16, 64, MIX, [3, 7, 200, 0, 1100, 256], 4, 2,
     dict(softcap=15.0, window_size=(96, 8), attention_chunk=160, softmax_scale=0.1), True, None, None),
    ("causal-d256", torch.bfloat16, 256, [1, 7, 113, 0, 600, 300], [1, 7, 200, 0, 600, 250], 4, 2,
     dict(causal=True), False, None, None),
    ("fp16-d64-causal", torch.float16, 64, MIX, MIX, 4, 2, dict(causal=True), False, None, None),
    ("fp16-d128-window-mqa", torch.float16, 128, [77, 0, 513, 1], [200, 3, 500, 1], 6, 1,
     dict(window_size=(64, 0)), False, None, None),
    ("fp16-d256", torch.float16, 256, [130, 0, 257], [64, 1, 300], 2, 1, dict(), False, None, None),
    ("seqused-causal", torch.bfloat16, 128, [100, 0, 257, 64], [120, 5, 300, 64], 4, 2, dict(causal=True), False,
     [60, 0, 257, 1], [120, 0, 100, 64]),
    ("seqused-window-fp16", torch.float16, 64, MIX, MIX, 4, 4, dict(window_size=(50, 50)), False,
     [1, 3, 113, 0, 999, 0], [1, 7, 50, 0, 1000, 300]),
]


@pytest.mark.parametrize("dtype, head_dim, seqlens_q, seqlens_k, heads_q, heads_kv, options, with_sink, seqused_q, "
                         "seqused_k", [pytest.param(*case[1:], id=case[0]) for case in VARLEN_CASES])
@requires_gpu
def test_varlen_against_reference(dtype, head_dim, seqlens_q, seqlens_k, heads_q, heads_kv, options, with_sink,
                                  seqused_q, seqused_k):
    """Out, lse, dq, dk, dv (and dsink) against the reference run on each sequence on its own
    (support.varlen_attention_reference); rows past seqused give out 0, lse -inf and zero dq, keys
    past seqused_k zero dk and dv."""
    q, k, v, cu_q, cu_k = make_varlen_inputs(seqlens_q, seqlens_k, heads_q, heads_kv, head_dim, dtype,
                                             seed=sum(seqlens_q) * 1000 + sum(seqlens_k) + head_dim)
    sink = make_sink(heads_q, seed=len(seqlens_q)) if with_sink else None
    seqused = {name: torch.tensor(used, dtype=torch.int32, device="cuda")
               for name, used in (("seqused_q", seqused_q), ("seqused_k", seqused_k)) if used is not None}
    out, lse = run_or_skip(fa3.flash_attn_varlen_func, q, k, v, cu_q, cu_k, max(seqlens_q), max(seqlens_k),
                           return_attn_probs=True, learnable_sink=sink, **seqused, **options)
    assert out.shape == q.shape and out.dtype == dtype
    assert lse.shape == (heads_q, q.shape[0]) and lse.dtype == torch.float32 and not lse.requires_grad
    dout = torch.randn_like(out)
    leaves = (q, k, v) + ((sink,) if with_sink else ())
    grads = run_or_skip(torch.autograd.grad, out, leaves, dout)
    assert_matches_reference(out, lse, grads, leaves, dout, dtype, lambda leaves, in_dtype: varlen_attention_reference(
        *leaves[:3], seqlens_q, seqlens_k, seqused_q, seqused_k, dtype=in_dtype,
        learnable_sink=leaves[3] if with_sink else None, **options))
    if seqused_q is not None:
        unused = past_seqused(seqlens_q, seqused_q)
        assert torch.all(out[unused] == 0) and torch.all(lse[:, unused] == float("-inf"))
        assert torch.all(grads[0][unused] == 0)
    if seqused_k is not None:
        unused = past_seqused(seqlens_k, seqused_k)
        assert torch.all(grads[1][unused] == 0) and torch.all(grads[2][unused] == 0)


@pytest.mark.parametrize("num_splits, causal", [(3, False), (0, True), (7, True)])
@requires_gpu
def test_varlen_split_kv_against_reference(num_splits, causal):
    """flash_attn_varlen_func with num_splits (split-KV over packed queries; 0: the library's choice):
    decode-like sequences of 1-4 queries over thousands of keys beside an empty one and a long
    one, out and lse against float64 within twice the error of plain bf16, and the unsplit call's
    gradients (the backward never splits)."""
    seqlens_q, seqlens_k = [1, 4, 0, 2, 300], [3000, 1500, 20, 0, 2048]
    q, k, v, cu_q, cu_k = make_varlen_inputs(seqlens_q, seqlens_k, 16, 2, 128, torch.bfloat16, seed=num_splits)
    call = dict(causal=causal, return_attn_probs=True)
    out, lse = run_or_skip(fa3.flash_attn_varlen_func, q, k, v, cu_q, cu_k, max(seqlens_q), max(seqlens_k),
                           num_splits=num_splits, **call)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    ref64, lse64 = varlen_attention_reference(q.double(), k.double(), v.double(), seqlens_q, seqlens_k,
                                              dtype=torch.float64, causal=causal)
    plain, _ = varlen_attention_reference(q, k, v, seqlens_q, seqlens_k, causal=causal)
    ours_err = (out.double() - ref64).abs().max().item()
    plain_err = (plain.double() - ref64).abs().max().item()
    assert ours_err <= 2 * plain_err + 1e-5, (ours_err, plain_err)
    torch.testing.assert_close(lse.double(), lse64, rtol=1e-3, atol=1e-3)
    dout = torch.randn_like(out)
    split_grads = torch.autograd.grad(out, (q, k, v), dout)
    unsplit, _ = fa3.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(seqlens_q), max(seqlens_k), **call)
    for ours, theirs in zip(split_grads, torch.autograd.grad(unsplit, (q, k, v), dout)):
        torch.testing.assert_close(ours, theirs, rtol=2e-2, atol=2e-2)


def paged_keys(seqlens_k, page_size, heads_kv, head_dim, dtype, seed, share_first_page=False):
    """Random k and v pages [num_pages, page_size, Hkv, d] (leaves), a shuffled page table [B,
    max_pages] with pages no row uses, and rows: the flat page rows of the packed keys, so that
    pages.flatten(0, 1)[rows] are the packed keys sequence by sequence. share_first_page: sequence 1
    reads sequence 0's first page (prefix sharing; its own first page then goes unused)."""
    batch, max_pages = len(seqlens_k), -(-max(seqlens_k) // page_size)
    num_pages = batch * max_pages + 2
    generator = torch.Generator().manual_seed(seed)
    table = torch.randperm(num_pages, generator=generator)[:batch * max_pages].view(batch, max_pages)
    if share_first_page:
        table[1, 0] = table[0, 0]
    rows = [int(table[b, j // page_size]) * page_size + j % page_size
            for b, length in enumerate(seqlens_k) for j in range(length)]
    def pages():
        return torch.randn(num_pages, page_size, heads_kv, head_dim, device="cuda", dtype=dtype).requires_grad_()
    return pages(), pages(), table.to(device="cuda", dtype=torch.int32), torch.tensor(rows, device="cuda")


# (page_size, seqlens_k, options, with_sink, seqused_k, share_first_page): pages loaded in TMA chunks
# (16, 64) and key by key (1, 24); empty sequences, seqused_k, windows, softcap with the sink.
PAGED_VARLEN_CASES = [
    (16, [5, 7, 200, 0, 700, 300], dict(causal=True), False, None, True),
    (1, [5, 7, 200, 0, 700, 300], dict(window_size=(64, 0), softcap=20.0), True, None, False),
    (64, [64, 7, 200, 0, 700, 300], dict(causal=True), False, [5, 0, 100, 0, 600, 300], True),
    (24, [5, 70, 200, 0, 700, 300], dict(window_size=(100, 30)), False, None, False),
]


@pytest.mark.parametrize("page_size, seqlens_k, options, with_sink, seqused_k, share_first_page", PAGED_VARLEN_CASES)
@requires_gpu
def test_varlen_paged_keys_against_reference(page_size, seqlens_k, options, with_sink, seqused_k, share_first_page):
    """flash_attn_varlen_func with page_table (a packed batch over paged keys, cu_seqlens_k shifted:
    only its differences count): out, lse, dq, and dk/dv on the pages against the reference over
    the gathered keys (autograd sums a shared page's gradients and gives unused pages zeros), by
    FlashAttention's rule; and the forward equals flash_attn_with_kvcache's paged call over the
    same lengths bit for bit (the same kernel)."""
    seqlens_q = [1, 7, 113, 0, 600, 300]
    q, _, _, cu_q, cu_k = make_varlen_inputs(seqlens_q, seqlens_k, 8, 2, 128, torch.bfloat16, seed=page_size)
    k_pages, v_pages, table, rows = paged_keys(seqlens_k, page_size, 2, 128, torch.bfloat16, page_size,
                                               share_first_page)
    sink = make_sink(8, seed=page_size) if with_sink else None
    extras = dict(options, learnable_sink=sink)
    if seqused_k is not None:
        extras["seqused_k"] = torch.tensor(seqused_k, dtype=torch.int32, device="cuda")
    out, lse = run_or_skip(fa3.flash_attn_varlen_func, q, k_pages, v_pages, cu_q, cu_k + 1000, max(seqlens_q),
                           max(seqlens_k), return_attn_probs=True, page_table=table, **extras)
    dout = torch.randn_like(out)
    leaves = (q, k_pages, v_pages) + ((sink,) if with_sink else ())
    grads = torch.autograd.grad(out, leaves, dout)

    def reference(leaves, in_dtype):
        k, v = (pages.flatten(0, 1)[rows] for pages in leaves[1:3])
        return varlen_attention_reference(leaves[0], k, v, seqlens_q, seqlens_k, None, seqused_k, dtype=in_dtype,
                                          learnable_sink=leaves[3] if with_sink else None, **options)
    assert_matches_reference(out, lse, grads, leaves, dout, torch.bfloat16, reference)
    if sink is None:
        lengths = torch.tensor(seqused_k or seqlens_k, dtype=torch.int32, device="cuda")
        cache_out, cache_lse = fa3.flash_attn_with_kvcache(q, k_pages, v_pages, cache_seqlens=lengths, page_table=table,
                                                           cu_seqlens_q=cu_q, max_seqlen_q=max(seqlens_q),
                                                           num_splits=1, return_softmax_lse=True, **options)
        assert torch.equal(out, cache_out) and torch.equal(lse, cache_lse)


@requires_gpu
def test_varlen_deterministic_backward_is_bitwise_reproducible():
    q, k, v, cu_q, cu_k = make_varlen_inputs(MIX, MIX, 8, 2, 128, torch.bfloat16, seed=61)
    sink = make_sink(8, seed=6)
    out = run_or_skip(fa3.flash_attn_varlen_func, q, k, v, cu_q, cu_k, max(MIX), max(MIX), causal=True,
                      learnable_sink=sink, deterministic=True)
    dout = torch.randn_like(out)
    first = run_or_skip(torch.autograd.grad, out, (q, k, v, sink), dout, retain_graph=True)
    again = torch.autograd.grad(out, (q, k, v, sink), dout, retain_graph=True)
    for name, a, b in zip(("dq", "dk", "dv", "dsink"), first, again):
        assert torch.equal(a, b), f"{name}: not bit-identical run to run"


@requires_gpu
def test_varlen_torch_compile_fullgraph():
    seqlens_k = [5, 7, 60, 0, 1200, 300]
    q, k, v, cu_q, cu_k = make_varlen_inputs(MIX, seqlens_k, 8, 2, 128, torch.bfloat16, seed=71)

    def attention_block(q, k, v, cu_q, cu_k, max_q, max_k):
        out = fa3.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=True, window_size=(256, 0))
        return (out.float() * 1.5).to(q.dtype)

    eager = run_or_skip(attention_block, q, k, v, cu_q, cu_k, max(MIX), max(seqlens_k))
    dout = torch.randn_like(eager)
    eager_grads = run_or_skip(torch.autograd.grad, eager, (q, k, v), dout)
    torch._dynamo.reset()
    compiled = torch.compile(attention_block, fullgraph=True)
    out = compiled(q, k, v, cu_q, cu_k, max(MIX), max(seqlens_k))
    grads = torch.autograd.grad(out, (q, k, v), dout)
    torch._dynamo.reset()
    assert torch.allclose(out.float(), eager.float(), atol=1e-2, rtol=0)
    for a, b in zip(grads, eager_grads):
        assert torch.allclose(a.float(), b.float(), atol=2e-2, rtol=0)


@requires_gpu
def test_varlen_cuda_graph_capture_and_replay():
    """Capture forward and backward once, then move the sequence boundaries in place (same totals,
    lengths within max_seqlen) and change q: the replay equals eager, so the graph reads cu_seqlens
    on the device and nothing of them was copied to the host at capture."""
    q, k, v, cu_q, cu_k = make_varlen_inputs([100, 0, 257, 64], [120, 5, 300, 64], 4, 2, 128, torch.bfloat16,
                                             seed=51)
    max_q = max_k = 400
    sink = make_sink(4, seed=9)
    dout = torch.randn_like(q)  # out is shaped like q
    options = dict(causal=True, learnable_sink=sink, deterministic=True)
    run_or_skip(fa3.flash_attn_varlen_func, q, k, v, cu_q, cu_k, max_q, max_k, **options)

    def step():
        out = fa3.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, **options)
        return (out, *torch.autograd.grad(out, (q, k, v, sink), dout))

    graph, captured = capture_graph(step)

    new_q, _, _, new_cu_q, new_cu_k = make_varlen_inputs([150, 50, 157, 64], [20, 105, 300, 64], 4, 2, 128,
                                                         torch.bfloat16, seed=52, requires_grad=False)
    with torch.no_grad():
        q.copy_(new_q), cu_q.copy_(new_cu_q), cu_k.copy_(new_cu_k)
    expect_replay_matches_eager(graph, captured, step, ("out", "dq", "dk", "dv", "dsink"))


@requires_gpu
def test_varlen_opcheck():
    q, k, v, cu_q, cu_k = make_varlen_inputs([30, 0, 97], [50, 10, 60], 4, 2, 128, torch.bfloat16, seed=81)
    varlen = (cu_q, cu_k, 97, 60, None, torch.tensor([50, 3, 40], dtype=torch.int32, device="cuda"))
    # deterministic=True: opcheck compares gradients of repeated runs
    run_or_skip(torch.ops.flashhopper.fwd, q.detach(), k.detach(), v.detach(), None, True, True, -1, -1, 0.0, 0,
                None, *varlen)
    torch.library.opcheck(torch.ops.flashhopper.fwd.default, (q, k, v, None, True, True, -1, -1, 0.0, 0, None, *varlen))
    out, lse = torch.ops.flashhopper.fwd(q.detach(), k.detach(), v.detach(), None, True, True, -1, -1, 0.0, 0, None,
                                         *varlen)
    assert lse.shape == (4, q.shape[0])
    args = (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out, lse, None, True, True, -1, -1, 0.0, 0,
            None, *varlen)
    run_or_skip(torch.ops.flashhopper.bwd, *args)
    torch.library.opcheck(torch.ops.flashhopper.bwd.default, args)


@requires_gpu
def test_varlen_errors_on_cuda_tensors():
    q, k, v, cu_q, cu_k = make_varlen_inputs([10, 20], [10, 20], 4, 2, 128, torch.bfloat16, requires_grad=False)
    with pytest.raises(ValueError, match="cu_seqlens_q: must be a CUDA tensor, got device cpu"):
        fa3.flash_attn_varlen_func(q, k, v, cu_q.cpu(), cu_k, 20, 20)
    with pytest.raises(ValueError, match="cu_seqlens_k: dtype torch.int64 is not supported"):
        fa3.flash_attn_varlen_func(q, k, v, cu_q, cu_k.long(), 20, 20)
    with pytest.raises(ValueError, match="seqused_q: must be a CUDA tensor, got device cpu"):
        fa3.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 20, 20, seqused_q=torch.tensor([1, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match="max_seqlen_k: is 0; varlen"):
        fa3.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 20, 0)
    with pytest.raises(ValueError, match=r"q: ndim is 4 but varlen \(cu_seqlens_q given\) q must be 3-d"):
        fa3.flash_attn_varlen_func(q[None], k, v, cu_q, cu_k, 20, 20)
    many = torch.zeros(8194, dtype=torch.int32, device="cuda")  # 8193 (empty) sequences: more than the library takes
    with pytest.raises(FlashHopperNotSupported):
        fa3.flash_attn_varlen_func(q, k, v, many, many, 20, 20)
    if torch.cuda.device_count() > 1:
        with pytest.raises(ValueError, match="cu_seqlens_k: is on cuda:1"):
            fa3.flash_attn_varlen_func(q, k, v, cu_q, cu_k.to("cuda:1"), 20, 20)


# ----------------------------------------------------------------------------------------------
# Error paths on CUDA tensors

@requires_gpu
def test_errors_on_cuda_tensors():
    q, k, v = make_inputs(2, 64, 64, 4, 2, 128, torch.bfloat16, requires_grad=False)
    with pytest.raises(ValueError, match="q: dtype is float32; must be bf16, fp16"):
        flash_attn_func(q.float(), k.float(), v.float())
    with pytest.raises(ValueError, match="k: must be a CUDA tensor"):
        flash_attn_func(q, k.cpu(), v)
    with pytest.raises(ValueError, match=r"q: stride\[3\] is \d+ but the last dim must be contiguous"):
        flash_attn_func(q.transpose(-1, -2).contiguous().transpose(-1, -2), k, v)
    flat = torch.empty(q.numel() + 1, device="cuda", dtype=q.dtype)
    misaligned = flat[1:].view(q.shape)  # 2-byte offset; strides fine
    with pytest.raises(ValueError, match="q: data pointer .* not 16-byte aligned"):
        flash_attn_func(misaligned, k, v)
    with pytest.raises(ValueError, match=r"num_splits: is -1; must be in \[0, "):
        flash_attn_func(q, k, v, num_splits=-1)
    with pytest.raises(ValueError, match="softcap: is -5; must be finite and >= 0"):
        flash_attn_func(q, k, v, softcap=-5.0)
    with pytest.raises(ValueError, match="window_size: the left bound is -2"):
        flash_attn_func(q, k, v, window_size=(-2, 8))
    with pytest.raises(ValueError, match="learnable_sink: must be a CUDA tensor, got device cpu"):
        flash_attn_func(q, k, v, learnable_sink=torch.zeros(4))
    with pytest.raises(ValueError, match="learnable_sink: dtype is bf16; must be float32"):
        flash_attn_func(q, k, v, learnable_sink=torch.zeros(4, device="cuda", dtype=torch.bfloat16))
    if torch.cuda.device_count() > 1:
        with pytest.raises(ValueError, match="k: is on cuda:1"):
            flash_attn_func(q, k.to("cuda:1"), v)
        with pytest.raises(ValueError, match="learnable_sink: is on cuda:1"):
            flash_attn_func(q, k, v, learnable_sink=torch.zeros(4, device="cuda:1"))


@requires_gpu
def test_unsupported_build_case_is_not_implemented():
    """A head dim whose family the build lacks raises FlashHopperNotSupported (a NotImplementedError)
    naming the family and launching nothing; a compiled family's head dim runs. Families are keyed
    by (head dim, value head dim): a build with 192/128 but not 192/192 refuses hdim 192."""
    compiled = {(f.dtype, f.head_dim, f.head_dim_v) for f in flashhopper.compiled_families() if f.pass_ == "forward"}
    assert (torch.bfloat16, 128, 128) in compiled
    for dtype in (torch.bfloat16, torch.float16):
        for head_dim in (64, 96, 128, 192, 256):
            q, k, v = make_inputs(1, 32, 32, 2, 2, head_dim, dtype, requires_grad=False)
            try:
                flash_attn_func(q, k, v)
            except FlashHopperNotSupported as error:
                assert (dtype, head_dim, head_dim) not in compiled
                assert "kernels, which this build" in str(error) and "did not compile" in str(error)
                assert isinstance(error, NotImplementedError)


# Head dims between the compiled ones (run on the next compiled family, the columns past d
# zero-filled) and off the 8-element granule (59, 111: padded by flash_attn_func).
PADDED_HEAD_DIMS = [(torch.bfloat16, d) for d in (32, 59, 80, 96, 111, 160, 200)] + [
    (torch.float16, d) for d in (40, 111, 224)]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype, head_dim", PADDED_HEAD_DIMS)
@requires_gpu
def test_padded_head_dims_against_reference(dtype, head_dim, causal):
    q, k, v = make_inputs(2, 113, 203, 4, 2, head_dim, dtype, seed=head_dim)
    out, lse = run_or_skip(flash_attn_func, q, k, v, causal=causal, return_attn_probs=True)
    assert out.shape == q.shape and out.is_contiguous()
    dout = torch.randn_like(out)
    grads = run_or_skip(torch.autograd.grad, out, (q, k, v), dout)
    assert_matches_reference(out, lse, grads, (q, k, v), dout, dtype, lambda leaves, in_dtype: attention_reference(
        *leaves, causal=causal, dtype=in_dtype))

@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("splits", [1, 5, 64])
@requires_gpu
def test_flash_attn_combine_against_reference(splits, out_dtype):
    """FA3's layouts: out_partial [S, B, sq, H, d], lse_partial [S, B, sq, H] (here a transposed view,
    contiguous in sq, as FA3's kernels write it). Against the combine in float64: splits at -inf add
    nothing, rows no split saw give 0 and -inf; out poisoned first when given."""
    torch.manual_seed(splits)
    batch, seqlen, heads, head_dim = 2, 33, 4, 72
    out_partial = torch.randn(splits, batch, seqlen, heads, head_dim, device="cuda")
    lse_partial = (4 * torch.randn(splits, batch, heads, seqlen, device="cuda")).transpose(2, 3)
    if splits > 1:
        lse_partial[1:, :, ::3] = -math.inf  # only split 0 saw these rows
    lse_partial[:, 1, 5] = -math.inf  # no split saw this row
    out = None if out_dtype is None else torch.full((batch, seqlen, heads, head_dim), math.nan, dtype=out_dtype,
                                                    device="cuda")
    result, lse = fa3.flash_attn_combine(out_partial, lse_partial, out=out, out_dtype=out_dtype)
    if out is not None:
        assert result is out
    assert result.dtype == (out_dtype or torch.float32) and lse.shape == (batch, seqlen, heads)
    lse64 = torch.logsumexp(lse_partial.double(), dim=0)
    weights = torch.exp(lse_partial.double() - lse64).nan_to_num(0.0)  # rows at -inf: weight 0
    exact = (weights.unsqueeze(-1) * out_partial.double()).sum(0)
    assert not torch.isnan(result).any() and not torch.isnan(lse).any()
    assert torch.all(lse[1, 5] == -math.inf) and torch.all(result[1, 5] == 0)
    finite = lse64 > -math.inf
    torch.testing.assert_close(lse.double()[finite], lse64[finite], rtol=1e-5, atol=1e-5)
    tolerance = {None: 1e-5, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}[out_dtype]
    torch.testing.assert_close(result.double(), exact, rtol=tolerance, atol=1e-5)


@requires_gpu
def test_flash_attn_with_kvcache_refusals_use_fa3_names():
    """The library's own refusals use FA3's names (v_cache, not the C ABI's v)."""
    q = torch.randn(2, 1, 8, 64, device="cuda", dtype=torch.bfloat16)
    k_cache = torch.randn(2, 128, 2, 64, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    with pytest.raises(ValueError, match=r"^flashhopper \(invalid argument\): v_cache: "):
        fa3.flash_attn_with_kvcache(q, k_cache, v_cache[:, :64], cache_seqlens=17)


@pytest.mark.parametrize("seqlen_q, causal, num_splits", [(1, False, 1), (4, True, 1), (1, False, 0), (4, True, 3)])
@requires_gpu
def test_flash_attn_with_kvcache_dense_cache_against_reference(seqlen_q, causal, num_splits):
    """Decoding against a dense cache: sequence b reads cache row cache_batch_idx[b], keys
    [cache_leftpad[b], cache_seqlens[b]); against attention over exactly those keys in float64,
    within twice the error of the same attention in plain bf16; unsplit, split-KV chosen by the
    library (0) and forced."""
    torch.manual_seed(seqlen_q)
    q = torch.randn(3, seqlen_q, 8, 128, device="cuda", dtype=torch.bfloat16)  # every build has hdim 128
    k_cache = torch.randn(4, 2048, 2, 128, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    lengths, firsts, rows = [1500, 1, 2048], [10, 0, 0], [3, 0, 1]
    to_int32 = lambda values: torch.tensor(values, dtype=torch.int32, device="cuda")  # noqa: E731
    out, lse = fa3.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=to_int32(lengths),
                                           cache_batch_idx=to_int32(rows), cache_leftpad=to_int32(firsts),
                                           causal=causal, num_splits=num_splits, return_softmax_lse=True)
    for b in range(3):
        keys = k_cache[rows[b], firsts[b]:lengths[b]].unsqueeze(0)
        values = v_cache[rows[b], firsts[b]:lengths[b]].unsqueeze(0)
        ref64, lse64 = attention_reference(q[b:b + 1].double(), keys.double(), values.double(), causal=causal)
        plain, _ = attention_reference(q[b:b + 1], keys, values, causal=causal)
        ours_err = (out[b:b + 1].double() - ref64).abs().max().item()
        plain_err = (plain.double() - ref64).abs().max().item()
        assert ours_err <= 2 * plain_err + 1e-5, (b, ours_err, plain_err)
        torch.testing.assert_close(lse[b:b + 1].double(), lse64, rtol=1e-3, atol=1e-3)

@requires_gpu
def test_flash_attn_with_kvcache_repeated_steps_run_the_first_steps_plan():
    """Decode steps of one shape with an append, as an engine runs them: from the second step on
    the call runs the first one's plan (its own arguments' key, interface.run_kvcache_plan). Each
    step against float64 attention over the keys cached so far, the new key included, within twice
    plain bf16's error; each step's new key written at its cache_seqlens."""
    from flashhopper import interface
    torch.manual_seed(23)
    interface._PLANS.clear()  # a cache: this test counts the plans it makes
    k_cache = torch.randn(2, 256, 2, 128, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    lengths = [37, 200]
    for step in range(3):
        q = torch.randn(2, 1, 8, 128, device="cuda", dtype=torch.bfloat16)
        k_new, v_new = torch.randn_like(k_cache[:, :1]), torch.randn_like(v_cache[:, :1])
        cache_seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
        out, lse = fa3.flash_attn_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new, cache_seqlens=cache_seqlens,
                                               causal=True, return_softmax_lse=True)
        call_keys = {key for key in interface._PLANS if key[0] == "flash_attn_with_kvcache"}
        first_keys = call_keys if step == 0 else first_keys
        assert call_keys == first_keys and len(call_keys) == 1  # no new plan after the first step
        assert not torch.isnan(out).any() and not torch.isnan(lse).any()
        for b, length in enumerate(lengths):
            assert torch.equal(k_cache[b, length], k_new[b, 0]) and torch.equal(v_cache[b, length], v_new[b, 0])
            keys_b, values_b = k_cache[b:b + 1, :length + 1], v_cache[b:b + 1, :length + 1]
            ref64, lse64 = attention_reference(q[b:b + 1].double(), keys_b.double(), values_b.double(), causal=True)
            plain, _ = attention_reference(q[b:b + 1], keys_b, values_b, causal=True)
            ours_err = (out[b:b + 1].double() - ref64).abs().max().item()
            plain_err = (plain.double() - ref64).abs().max().item()
            assert ours_err <= 2 * plain_err + 1e-5, (step, b, ours_err, plain_err)
            torch.testing.assert_close(lse[b:b + 1].double(), lse64, rtol=1e-3, atol=1e-3)
        lengths = [length + 1 for length in lengths]


@requires_gpu
def test_flash_attn_with_kvcache_torch_compile_fullgraph():
    """A decode step with the append under torch.compile(fullgraph=True) (the fwd_kvcache op): the
    eager call's out and lse bit for bit, the new keys written into the caller's cache at
    cache_seqlens, and the rest of the cache unchanged."""
    torch.manual_seed(11)
    q = torch.randn(3, 1, 8, 128, device="cuda", dtype=torch.bfloat16)
    k_cache = torch.randn(3, 512, 2, 128, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    k_new, v_new = torch.randn_like(k_cache[:, :1]), torch.randn_like(v_cache[:, :1])
    lengths = torch.tensor([100, 0, 511], dtype=torch.int32, device="cuda")

    def step(q, k_cache, v_cache, k_new, v_new, lengths):
        return fa3.flash_attn_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new, cache_seqlens=lengths, causal=True,
                                           return_softmax_lse=True)

    eager_k, eager_v = k_cache.clone(), v_cache.clone()
    before_k = k_cache.clone()
    out, lse = step(q, eager_k, eager_v, k_new, v_new, lengths)
    compiled_out, compiled_lse = torch.compile(step, fullgraph=True)(q, k_cache, v_cache, k_new, v_new, lengths)
    assert torch.equal(compiled_out, out) and torch.equal(compiled_lse, lse)
    assert torch.equal(k_cache, eager_k) and torch.equal(v_cache, eager_v)
    for b, length in enumerate(lengths.tolist()):
        assert torch.equal(k_cache[b, length], k_new[b, 0])
        assert torch.equal(k_cache[b, :length], before_k[b, :length])
        assert torch.equal(k_cache[b, length + 1:], before_k[b, length + 1:])


@requires_gpu
def test_fp8_torch_compile_fullgraph():
    """fp8 with descales under torch.compile(fullgraph=True): flash_attn_func (the fwd op),
    flash_attn_with_kvcache with an append into pages of 16 and flash_attn_varlen_func over those
    pages (the fwd_kvcache op) give the eager calls' out and lse bit for bit, the append the same
    cache."""
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("this PyTorch has no float8_e4m3fn")
    generator = torch.Generator(device="cuda").manual_seed(19)
    fp8 = lambda *shape: torch.randn(*shape, device="cuda", generator=generator).to(torch.float8_e4m3fn)  # noqa: E731
    descales = [2 * torch.rand(2, 2, device="cuda", generator=generator) for _ in range(3)]
    q, k, v = fp8(2, 300, 8, 128), fp8(2, 500, 2, 128), fp8(2, 500, 2, 128)

    def dense(q, k, v, qd, kd, vd):
        return fa3.flash_attn_func(q, k, v, causal=True, q_descale=qd, k_descale=kd, v_descale=vd,
                                   return_attn_probs=True)

    with torch.no_grad():
        out, lse = run_or_skip(dense, q, k, v, *descales)
        compiled_out, compiled_lse = torch.compile(dense, fullgraph=True)(q, k, v, *descales)
    assert out.dtype == torch.bfloat16 and torch.equal(compiled_out, out) and torch.equal(compiled_lse, lse)

    k_pages, v_pages = fp8(70, 16, 2, 128), fp8(70, 16, 2, 128)
    table = torch.randperm(70, device="cuda", generator=generator)[:64].view(2, 32).to(torch.int32)
    k_new, v_new = fp8(2, 3, 2, 128), fp8(2, 3, 2, 128)
    lengths = torch.tensor([100, 509], dtype=torch.int32, device="cuda")

    def step(q, k_pages, v_pages, k_new, v_new, lengths, table, qd, kd, vd):
        return fa3.flash_attn_with_kvcache(q, k_pages, v_pages, k=k_new, v=v_new, cache_seqlens=lengths,
                                           page_table=table, causal=True, q_descale=qd, k_descale=kd, v_descale=vd,
                                           return_softmax_lse=True)

    def packed(q, k_pages, v_pages, cu_q, cu_k, table, qd, kd, vd):
        return fa3.flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, 3, 512, page_table=table, causal=True,
                                          q_descale=qd, k_descale=kd, v_descale=vd, return_attn_probs=True)

    q_step = q[:, :3].contiguous()
    eager_k, eager_v = k_pages.clone(), v_pages.clone()
    with torch.no_grad():
        out, lse = step(q_step, eager_k, eager_v, k_new, v_new, lengths, table, *descales)
        compiled_out, compiled_lse = torch.compile(step, fullgraph=True)(q_step, k_pages, v_pages, k_new, v_new,
                                                                         lengths, table, *descales)
    assert torch.equal(compiled_out, out) and torch.equal(compiled_lse, lse)
    assert torch.equal(k_pages.view(torch.uint8), eager_k.view(torch.uint8))
    assert torch.equal(v_pages.view(torch.uint8), eager_v.view(torch.uint8))
    cu_q = torch.tensor([0, 3, 6], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 103, 615], dtype=torch.int32, device="cuda")
    with torch.no_grad():
        args = (q_step.flatten(0, 1), k_pages, v_pages, cu_q, cu_k, table, *descales)
        out, lse = packed(*args)
        compiled_out, compiled_lse = torch.compile(packed, fullgraph=True)(*args)
    assert torch.equal(compiled_out, out) and torch.equal(compiled_lse, lse)


def paged_copy(dense_k, dense_v, page_size):
    """A dense cache [rows, capacity, Hkv, d] as pages of page_size keys in shuffled order, two
    pages of noise that no row uses among them: (paged_k, paged_v, page_table [rows, pages a row])."""
    rows, capacity = dense_k.shape[:2]
    pages_per_row = capacity // page_size
    order = torch.randperm(rows * pages_per_row + 2, device=dense_k.device)
    table = order[:rows * pages_per_row].view(rows, pages_per_row).to(torch.int32)
    paged = []
    for dense in (dense_k, dense_v):
        pages = torch.randn(order.numel(), page_size, *dense.shape[2:], device=dense.device, dtype=dense.dtype)
        pages[table.long()] = dense.view(rows, pages_per_row, page_size, *dense.shape[2:])
        paged.append(pages)
    return paged[0], paged[1], table


@pytest.mark.parametrize("page_size", [1, 4, 16, 48, 256])
@requires_gpu
def test_flash_attn_with_kvcache_paged_is_the_dense_cache_paged(page_size):
    """A paged cache holding the dense cache's keys in shuffled pages: the same out and lse bit for
    bit (the same kernel, only the loads differ), and the appended keys land in the pages the
    table names."""
    torch.manual_seed(page_size)
    batch, capacity, heads_kv = 3, 768, 2
    q = torch.randn(batch, 1, 8, 128, device="cuda", dtype=torch.bfloat16)
    dense_k = torch.randn(batch, capacity, heads_kv, 128, device="cuda", dtype=torch.bfloat16)
    dense_v = torch.randn_like(dense_k)
    k_new, v_new = torch.randn_like(dense_k[:, :1]), torch.randn_like(dense_v[:, :1])
    paged_k, paged_v, table = paged_copy(dense_k, dense_v, page_size)
    lengths = torch.tensor([capacity - 1, 0, 300], dtype=torch.int32, device="cuda")
    dense = fa3.flash_attn_with_kvcache(q, dense_k, dense_v, k=k_new, v=v_new, cache_seqlens=lengths, causal=True,
                                        return_softmax_lse=True)
    paged = fa3.flash_attn_with_kvcache(q, paged_k, paged_v, k=k_new, v=v_new, cache_seqlens=lengths,
                                        page_table=table, causal=True, return_softmax_lse=True)
    assert not torch.isnan(paged[0]).any()
    assert torch.equal(paged[0], dense[0]) and torch.equal(paged[1], dense[1])
    shape = (batch, capacity, heads_kv, 128)
    assert torch.equal(paged_k[table.long()].view(shape), dense_k)
    assert torch.equal(paged_v[table.long()].view(shape), dense_v)


@pytest.mark.parametrize("page_size", [16, 24, 128])
@requires_gpu
def test_flash_attn_with_kvcache_paged_batch_idx_and_leftpad_are_the_dense_ones(page_size):
    """cache_batch_idx picks each sequence's row of the page table and cache_leftpad its first
    position, as they do in a dense cache: the same out and lse bit for bit as the dense cache that
    holds the same keys, and the appended keys land in the pages of the picked rows (FA3's
    semantics for these arguments with page_table)."""
    torch.manual_seed(page_size + 1)
    rows, capacity, heads_kv = 4, 768, 2
    q = torch.randn(3, 2, 8, 128, device="cuda", dtype=torch.bfloat16)
    dense_k = torch.randn(rows, capacity, heads_kv, 128, device="cuda", dtype=torch.bfloat16)
    dense_v = torch.randn_like(dense_k)
    k_new = torch.randn(3, 1, heads_kv, 128, device="cuda", dtype=torch.bfloat16)
    v_new = torch.randn_like(k_new)
    paged_k, paged_v, table = paged_copy(dense_k, dense_v, page_size)
    to_int32 = lambda values: torch.tensor(values, dtype=torch.int32, device="cuda")  # noqa: E731
    extras = dict(k=k_new, v=v_new, cache_seqlens=to_int32([700, 5, 300]), cache_batch_idx=to_int32([3, 0, 2]),
                  cache_leftpad=to_int32([17, 5, 0]), causal=True, return_softmax_lse=True)
    dense = fa3.flash_attn_with_kvcache(q, dense_k, dense_v, **extras)
    paged = fa3.flash_attn_with_kvcache(q, paged_k, paged_v, page_table=table, **extras)
    assert not torch.isnan(paged[0]).any()
    assert torch.equal(paged[0], dense[0]) and torch.equal(paged[1], dense[1])
    shape = (rows, capacity, heads_kv, 128)
    assert torch.equal(paged_k[table.long()].view(shape), dense_k)
    assert torch.equal(paged_v[table.long()].view(shape), dense_v)


@pytest.mark.parametrize("paged, num_splits", [(False, 0), (True, 3), (False, 5)])
@requires_gpu
def test_flash_attn_with_kvcache_packed_new_keys_continuous_batching(paged, num_splits):
    """Continuous batching's step: queries packed (cu_seqlens_q) and their new keys packed too
    (cu_seqlens_k_new, k/v [total_new, Hkv, d]), sequences of 3, 1, 0 and 5 new tokens appending
    into a dense or paged cache, unsplit or split over the keys (5: planned by
    get_scheduler_metadata): each sequence's new keys land at cache_seqlens in its row, the rest of
    the cache unchanged, and its rows attend causally over its cached and new keys, against float64
    within twice the error of the same attention in plain bf16."""
    torch.manual_seed(5 + paged + num_splits)
    counts, cached = [3, 1, 0, 5], [700, 0, 40, 1000]
    batch, capacity, heads_kv = len(counts), 1024, 2
    cu = torch.tensor([0] + list(itertools.accumulate(counts)), dtype=torch.int32, device="cuda")
    total = int(cu[-1])
    q = torch.randn(total, 8, 128, device="cuda", dtype=torch.bfloat16)
    k_new = torch.randn(total, heads_kv, 128, device="cuda", dtype=torch.bfloat16)
    v_new = torch.randn_like(k_new)
    dense_k = torch.randn(batch, capacity, heads_kv, 128, device="cuda", dtype=torch.bfloat16)
    dense_v = torch.randn_like(dense_k)
    before_k = dense_k.clone()
    lengths = torch.tensor(cached, dtype=torch.int32, device="cuda")
    if paged:
        k_cache, v_cache, table = paged_copy(dense_k, dense_v, 64)
        extras = dict(page_table=table)
    else:
        k_cache, v_cache, extras = dense_k, dense_v, {}
    if num_splits == 5:
        extras["scheduler_metadata"] = fa3.get_scheduler_metadata(
            batch, max(counts), capacity, 8, heads_kv, 128, lengths, cu_seqlens_q=cu, cu_seqlens_k_new=cu,
            causal=True, num_splits=num_splits)
    else:
        extras["num_splits"] = num_splits
    out, lse = fa3.flash_attn_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new, cache_seqlens=lengths,
                                           cu_seqlens_q=cu, max_seqlen_q=max(counts), cu_seqlens_k_new=cu,
                                           causal=True, return_softmax_lse=True, **extras)
    cache_k = k_cache[table.long()].view(dense_k.shape) if paged else k_cache
    cache_v = v_cache[table.long()].view(dense_v.shape) if paged else v_cache
    for b in range(batch):
        first, n, c = int(cu[b]), counts[b], cached[b]
        assert torch.equal(cache_k[b, c:c + n], k_new[first:first + n]), b
        assert torch.equal(cache_v[b, c:c + n], v_new[first:first + n]), b
        assert torch.equal(cache_k[b, :c], before_k[b, :c]) and torch.equal(cache_k[b, c + n:], before_k[b, c + n:])
        if n == 0:
            continue
        rows, keys, values = q[first:first + n][None], cache_k[b:b + 1, :c + n], cache_v[b:b + 1, :c + n]
        ref64, lse64 = attention_reference(rows.double(), keys.double(), values.double(), causal=True)
        plain, _ = attention_reference(rows, keys, values, causal=True)
        ours_err = (out[first:first + n][None].double() - ref64).abs().max().item()
        plain_err = (plain.double() - ref64).abs().max().item()
        assert ours_err <= 2 * plain_err + 1e-5, (b, ours_err, plain_err)
        torch.testing.assert_close(lse[:, first:first + n][None].double(), lse64, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("index", range(len(cross_layer_cases())), ids=[case[0] for case in cross_layer_cases()])
@requires_gpu
def test_cpp_ops_refuse_as_the_c_abi(index):
    """The C++ op torch.ops.flashhopper.fwd (where the build has it; else ops.py's) refuses each
    call of support.cross_layer_cases naming the argument the C ABI's check names, or runs it where
    the check accepts it (test_library.py compares the Python API with the C ABI)."""
    _, call, c_name = cross_layer_cases("cuda")[index]
    call = dict(call)
    q, k, v = call.pop("q"), call.pop("k"), call.pop("v")
    left, right = call.get("window_size", (-1, -1))
    name = None
    try:
        torch.ops.flashhopper.fwd(q, k, v, call.get("softmax_scale"), call.get("causal", False), False, left, right,
                                  call.get("softcap", 0.0), call.get("attention_chunk", 0),
                                  call.get("learnable_sink"), None, None, None, None, None, None,
                                  call.get("num_splits", 1))
        torch.cuda.synchronize()
    except (RuntimeError, ValueError, NotImplementedError) as error:
        name = refused_argument(error)
    assert name in (c_name, FA3_NAMES.get(c_name, c_name))  # (ops.py's implementation says window_size)


@requires_gpu
def test_scheduler_metadata_plans_the_same_call():
    """flash_attn_with_kvcache with get_scheduler_metadata's plan: the same bits as the call given
    the plan's num_splits itself, chosen (0) and forced."""
    q = torch.randn(4, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    k_cache = torch.randn(4, 4096, 8, 128, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    lengths = torch.tensor([4096, 1, 0, 3000], dtype=torch.int32, device="cuda")
    for splits in (0, 3):
        plan = fa3.get_scheduler_metadata(4, 1, 4096, 32, 8, 128, lengths, num_splits=splits)
        planned = fa3.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, scheduler_metadata=plan)
        direct = fa3.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, num_splits=splits)
        assert not torch.isnan(planned).any() and torch.equal(planned, direct)


@pytest.mark.parametrize("page_size", [0, 16, 1])
@requires_gpu
def test_decode_step_cuda_graph_replays_with_other_lengths(page_size):
    """A decode step (append one token with rotary, attend, split-KV chosen by the library) captured
    in a CUDA graph and replayed after cache_seqlens, q, the new token and (paged: page_size > 0)
    the page table changed in place: the same out, lse and cache as eager calls on the same
    inputs."""
    torch.manual_seed(3 + page_size)
    batch, cache_len, heads_q, heads_kv, d = 4, 4096, 16, 4, 128
    q = torch.randn(batch, 1, heads_q, d, device="cuda", dtype=torch.bfloat16)
    k_new, v_new = (torch.randn(batch, 1, heads_kv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k_cache, v_cache = (torch.randn(batch, cache_len, heads_kv, d, device="cuda", dtype=torch.bfloat16)
                        for _ in range(2))
    table = None
    if page_size:
        k_cache, v_cache, table = paged_copy(k_cache, v_cache, page_size)
    angle = torch.rand(cache_len, 32, device="cuda", dtype=torch.float64) * 6
    cos, sin = angle.cos().bfloat16(), angle.sin().bfloat16()
    lengths = torch.tensor([100, 4000, 0, 2047], dtype=torch.int32, device="cuda")
    caches = (k_cache.clone(), v_cache.clone())

    def step():
        return fa3.flash_attn_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new, rotary_cos=cos, rotary_sin=sin,
                                           cache_seqlens=lengths, page_table=table, causal=True, num_splits=0,
                                           return_softmax_lse=True)
    run_or_skip(step)
    graph, captured = capture_graph(step)
    with torch.no_grad():
        lengths.copy_(torch.tensor([3000, 7, 4095, 1], dtype=torch.int32))
        q.normal_(), k_new.normal_(), v_new.normal_()
        k_cache.copy_(caches[0]), v_cache.copy_(caches[1])
        if table is not None:  # the rows' pages swapped around: other keys behind every position
            table.copy_(table.roll(1, dims=0).flip(1))
    graph.replay()
    torch.cuda.synchronize()
    replayed = [t.clone() for t in (*captured, k_cache, v_cache)]
    k_cache.copy_(caches[0]), v_cache.copy_(caches[1])
    eager = (*step(), k_cache, v_cache)
    for name, a, b in zip(("out", "lse", "k_cache", "v_cache"), replayed, eager):
        assert torch.equal(a, b), f"{name}: replay differs from eager"


@requires_gpu
def test_eager_autograd_matches_the_op_bit_for_bit():
    """Eager flash_attn_func with autograd (ops._EagerAttention: the library's forward under the op's
    autograd) and the fwd op with its registered autograd give the same out, lse, dq, dk, dv and
    dsink bits (a window, softcap and a learnable sink, GQA; the deterministic backward, whose bits
    repeat)."""
    q, k, v = make_inputs(2, 300, 300, 8, 2, 128, torch.bfloat16, seed=5)
    sink = torch.randn(8, device="cuda", dtype=torch.float32, requires_grad=True)
    dout = torch.randn_like(q)
    out, lse = flash_attn_func(q, k, v, causal=True, window_size=(100, -1), softcap=20.0, learnable_sink=sink,
                               deterministic=True, return_attn_probs=True)
    assert type(out.grad_fn).__name__ == "_EagerAttentionBackward"
    eager = (out, lse, *torch.autograd.grad(out, (q, k, v, sink), dout))
    op_out, op_lse = torch.ops.flashhopper.fwd(q, k, v, None, True, True, 100, 0, 20.0, 0, sink)
    through_op = (op_out, op_lse, *torch.autograd.grad(op_out, (q, k, v, sink), dout))
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv", "dsink"), eager, through_op):
        assert torch.equal(a, b), f"{name} differs between eager autograd and the op"


@requires_gpu
def test_repeated_autograd_calls_run_the_first_calls_plan():
    """flash_attn_func and flash_attn_varlen_func with autograd, called again with new data of the
    same shapes and options: from the second call on they run the first one's plan (their own
    arguments' key); each call's out, lse and gradients equal the fwd op's with its registered
    autograd on that call's data, bit for bit (deterministic backward; a window, softcap, a sink)."""
    from flashhopper import interface
    interface._PLANS.clear()  # a cache: this test counts the plans it makes
    cu = torch.tensor([0, 100, 100, 333], dtype=torch.int32, device="cuda")
    for seed in range(3):
        q, k, v = make_inputs(2, 300, 300, 8, 2, 128, torch.bfloat16, seed=40 + seed)
        sink = torch.randn(8, device="cuda", dtype=torch.float32, requires_grad=True)
        dout = torch.randn_like(q)
        options = dict(causal=True, window_size=(100, -1), softcap=20.0, deterministic=True)
        out, lse = flash_attn_func(q, k, v, learnable_sink=sink, return_attn_probs=True, **options)
        ours = (out, lse, *torch.autograd.grad(out, (q, k, v, sink), dout))
        op_out, op_lse = torch.ops.flashhopper.fwd(q, k, v, None, True, True, 100, 0, 20.0, 0, sink)
        through_op = (op_out, op_lse, *torch.autograd.grad(op_out, (q, k, v, sink), dout))
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv", "dsink"), ours, through_op):
            assert torch.equal(a, b), f"call {seed}: {name} differs from the op's"
        packed = [t.detach().reshape(600, *t.shape[2:])[:333].clone().requires_grad_() for t in (q, k, v)]
        out = fa3.flash_attn_varlen_func(*packed, cu, cu, 233, 233, **options)
        ours = (out, *torch.autograd.grad(out, packed, dout.reshape(600, 8, 128)[:333]))
        op_out, _ = torch.ops.flashhopper.fwd(*packed, None, True, True, 100, 0, 20.0, 0, None, cu, cu, 233, 233)
        through_op = (op_out, *torch.autograd.grad(op_out, packed, dout.reshape(600, 8, 128)[:333]))
        for name, a, b in zip(("packed out", "dq", "dk", "dv"), ours, through_op):
            assert torch.equal(a, b), f"call {seed}: {name} differs from the op's"
        call_keys = {key for key in interface._PLANS if key[0] in ("flash_attn_func", "flash_attn_varlen_func")}
        first_keys = call_keys if seed == 0 else first_keys
        assert call_keys == first_keys and len(call_keys) == 2  # no new plan after the first call


@requires_gpu
def test_calls_without_autograd_skip_the_op_and_reuse_their_plan(monkeypatch):
    """With no gradient to track flash_attn_func runs the library call without the custom op (host
    work), to the same bits as with autograd; a repeated call of the same kind (its memoised plan)
    on new data gives that data's result, and a tensor on another dtype is still refused."""
    q, k, v = make_inputs(2, 300, 300, 8, 2, 128, torch.bfloat16, seed=3)
    through_op = flash_attn_func(q, k, v, causal=True)
    assert through_op.requires_grad

    def no_op(*args, **kwargs):
        raise AssertionError("the custom op ran for a call without autograd")

    monkeypatch.setattr(flashhopper.ops, "fwd", no_op)
    with torch.no_grad():
        direct = flash_attn_func(q, k, v, causal=True)
        assert torch.equal(direct, through_op.detach())
        q2, k2, v2 = make_inputs(2, 300, 300, 8, 2, 128, torch.bfloat16, seed=4, requires_grad=False)
        again, lse = flash_attn_func(q2, k2, v2, causal=True, return_attn_probs=True)
        out64, lse64 = attention_reference(q2, k2, v2, causal=True, dtype=torch.float64)
        plain = attention_reference(q2, k2, v2, causal=True)[0]
        assert max_error(again, out64) <= 2 * max_error(plain, out64) + 1e-5
        assert max_error(lse, lse64) <= 1e-3
        with pytest.raises(ValueError, match="k: dtype is fp16 but q's is bf16"):
            flash_attn_func(q2, k2.half(), v2, causal=True)


# ---- The C++ ops (src/torch/ops.cpp) and AOTInductor -------------------------------------------

def requires_cpp_ops(test):
    return pytest.mark.skipif(not flashhopper.ops.NATIVE,
                              reason="this build has no C++ PyTorch ops (libflashhopper_torch.so)")(test)


@requires_cpp_ops
@requires_gpu
def test_cpp_ops_match_the_python_ops_bitwise():
    """The C++ kernels of torch.ops.flashhopper.fwd / bwd and the Python ones (ops.py) make the same
    library call: the same bits, dense and packed, with the mask options and a learnable sink, and a
    dout that needs its copy (expanded)."""
    from flashhopper import ops
    q, k, v = make_inputs(2, 200, 264, 8, 2, 128, torch.bfloat16, seed=31, requires_grad=False)
    sink = make_sink(8, seed=32, requires_grad=False)
    options = (0.1, True, True, 48, 0, 20.0, 0, sink)
    native = torch.ops.flashhopper.fwd.default(q, k, v, *options)
    python = ops._fwd_python(q, k, v, *options)
    for a, b in zip(native, python):
        assert torch.equal(a, b)
    out, lse = native
    dout = torch.randn(1, 1, 8, 128, device="cuda", dtype=torch.bfloat16).expand_as(out)
    native = torch.ops.flashhopper.bwd.default(dout, q, k, v, out, lse, *options)
    python = ops._bwd_python(dout, q, k, v, out, lse, *options)
    for name, a, b in zip(("dq", "dk", "dv", "dsink"), native, python):
        assert torch.equal(a, b), name
    vq, vk, vv, cu_q, cu_k = make_varlen_inputs([37, 0, 120], [64, 5, 200], 4, 2, 128, torch.bfloat16, seed=33,
                                                requires_grad=False)
    varlen = (cu_q, cu_k, 120, 200)
    native = torch.ops.flashhopper.fwd.default(vq, vk, vv, None, True, False, -1, -1, 0.0, 0, None, *varlen)
    python = ops._fwd_python(vq, vk, vv, None, True, False, -1, -1, 0.0, 0, None, *varlen)
    for a, b in zip(native, python):
        assert torch.equal(a, b)


@requires_cpp_ops
@requires_gpu
def test_cpp_op_refusals_name_the_argument():
    """A refusal by the library, reached through the C++ kernel with no Python check before it (a k
    whose data is not 16-byte aligned), comes back as RuntimeError('flashhopper (invalid argument):
    k...'), which ops.fwd raises as FlashHopperInvalidArgument."""
    from flashhopper import ops
    q, k, v = make_inputs(1, 64, 64, 2, 2, 128, torch.bfloat16, requires_grad=False)
    strided_k = torch.empty(1, 64, 2, 136, device="cuda", dtype=torch.bfloat16)[..., 1:129]
    with pytest.raises(RuntimeError, match=r"flashhopper \(invalid argument\): k"):
        torch.ops.flashhopper.fwd.default(q, strided_k, v)
    with pytest.raises(flashhopper.FlashHopperInvalidArgument, match="^flashhopper \\(invalid argument\\): k"):
        ops.fwd(q, strided_k, v)


@requires_gpu
def test_model_through_torch_compile_trains_as_eager():
    block, x = attention_block_and_input(41)
    x.requires_grad_()
    eager = run_or_skip(block, x)
    grads = torch.autograd.grad(eager.sum(), (x, *block.parameters()))
    compiled = torch.compile(block, fullgraph=True)(x)
    compiled_grads = torch.autograd.grad(compiled.sum(), (x, *block.parameters()))
    assert torch.equal(compiled, eager)
    for a, b in zip(compiled_grads, grads):
        assert torch.equal(a, b)


def _compiler_libstdcxx():
    """The C++ compiler's libstdc++ (AOTInductor builds the package's .so with that compiler), or None."""
    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        return None
    path = subprocess.run([compiler, "-print-file-name=libstdc++.so.6"], capture_output=True, text=True).stdout.strip()
    return path if os.path.isabs(path) and os.path.exists(path) else None


@pytest.mark.parametrize("kind", ["bf16", "fp8"])
@requires_cpp_ops
@requires_gpu
def test_model_through_aot_inductor_package_runs_as_eager(tmp_path, kind):
    """torch.export -> aoti_compile_and_package -> aoti_load_package (tests/python/aoti_roundtrip.py,
    in its own process): the package calls the C++ op (AOTInductor's runtime cannot call a Python
    one) and gives eager's bits, on the export's input and on a new one; fp8: float8_e4m3fn q, k,
    v with descales through the C++ op's fp8 path (skipped without the fp8 kernels). The process
    preloads the compiler's libstdc++: on the H200 machine the package loader crashed in std::regex without it,
    for any model (a Linear alone too), and ran with it (README, Python usage)."""
    env = dict(os.environ)
    libstdcxx = _compiler_libstdcxx()
    if libstdcxx is not None:
        env["LD_PRELOAD"] = libstdcxx + (":" + env["LD_PRELOAD"] if env.get("LD_PRELOAD") else "")
    script = pathlib.Path(__file__).with_name("aoti_roundtrip.py")
    result = subprocess.run([sys.executable, str(script), str(tmp_path / "block.pt2"), kind], env=env,
                            capture_output=True, text=True, timeout=600)
    if result.returncode == 3:
        pytest.skip(result.stdout.strip()[-500:])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "package == eager: True True" in result.stdout, result.stdout[-3000:]


@pytest.mark.parametrize("causal", [False, True])
@requires_gpu
def test_fa3_private_entry_points_against_reference(causal):
    """FA3's _flash_attn_forward / _flash_attn_backward (as ring-attention libraries call them):
    the same bits as flash_attn_func and its autograd, the backward written into the caller's dq,
    dk, dv (poisoned first), softmax_d the rows' sums of dout * out, and the pass rule against the
    float64 reference."""
    q, k, v = make_inputs(2, 200, 333, 8, 2, 128, torch.bfloat16, seed=71)
    out_ref, lse_ref = run_or_skip(flash_attn_func, q, k, v, causal=causal, deterministic=True, return_attn_probs=True)
    dout = torch.randn_like(out_ref)
    grads_ref = torch.autograd.grad(out_ref, (q, k, v), dout)
    qd, kd, vd = (t.detach() for t in (q, k, v))
    out_ = torch.full_like(out_ref, float("nan"))
    out, lse, out_accum, lse_accum = fa3._flash_attn_forward(qd, kd, vd, out_=out_, causal=causal)
    assert out.data_ptr() == out_.data_ptr() and torch.equal(out, out_ref) and torch.equal(lse, lse_ref)
    assert out_accum.numel() == 0 and lse_accum.numel() == 0
    dq, dk, dv = (torch.full_like(t, float("nan")) for t in (qd, kd, vd))
    softmax_d = fa3._flash_attn_backward(dout, qd, kd, vd, out, lse, dq=dq, dk=dk, dv=dv, is_causal=causal,
                                         deterministic=True)
    for ours, theirs in zip((dq, dk, dv), grads_ref):
        assert torch.equal(ours, theirs)
    expected_d = (dout.double() * out.double()).sum(-1).transpose(1, 2)
    assert softmax_d.shape == (2, 8, 200) and softmax_d.dtype == torch.float32
    assert max_error(softmax_d, expected_d) < 1e-3 * expected_d.abs().max().item() + 1e-4
    assert_matches_reference(out, lse, (dq, dk, dv), (q, k, v), dout, torch.bfloat16,
                             lambda leaves, in_dtype: attention_reference(*leaves, causal=causal, dtype=in_dtype))


@requires_gpu
def test_fa3_private_forward_varlen_and_kvcache_forms():
    """_flash_attn_forward picks the packed form from cu_seqlens and the KV-cache form from
    seqused_k over dense keys (FA3's cache_seqlens): the same bits as the public functions."""
    lengths = [37, 0, 200, 65]
    cu = torch.tensor([0] + list(itertools.accumulate(lengths)), dtype=torch.int32, device="cuda")
    total = int(cu[-1])
    q, k, v = (torch.randn(total, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    expected = run_or_skip(fa3.flash_attn_varlen_func, q, k, v, cu, cu, max(lengths), max(lengths), causal=True,
                           return_attn_probs=True)
    got = fa3._flash_attn_forward(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lengths),
                                  max_seqlen_k=max(lengths), causal=True)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    qc = torch.randn(4, 3, 8, 128, device="cuda", dtype=torch.bfloat16)
    kc, vc = (torch.randn(4, 512, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    cache_seqlens = torch.tensor([1, 100, 512, 300], dtype=torch.int32, device="cuda")
    expected = run_or_skip(fa3.flash_attn_with_kvcache, qc, kc, vc, cache_seqlens=cache_seqlens, causal=True,
                           num_splits=1, return_softmax_lse=True)
    got = fa3._flash_attn_forward(qc, kc, vc, seqused_k=cache_seqlens, causal=True, num_splits=1)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


@requires_gpu
def test_fa3_named_ops_export_and_run():
    """After register_fa3_ops(), torch.ops.flash_attn_3.fwd/bwd run on FlashHopper with FA3's
    argument order, and a module exported through the FA3-named fwd op runs with eager's bits."""
    import flashhopper.fa3_ops as fa3_ops
    try:
        fa3_ops.register_fa3_ops()
    except RuntimeError as error:
        pytest.skip(str(error))
    q, k, v = make_inputs(2, 256, 320, 8, 2, 128, torch.bfloat16, seed=29, requires_grad=False)
    eager, eager_lse = run_or_skip(flash_attn_func, q, k, v, causal=True, return_attn_probs=True)
    out, lse, _, _ = torch.ops.flash_attn_3.fwd(q, k, v, is_causal=True, num_splits=1)
    assert torch.equal(out, eager) and torch.equal(lse, eager_lse)
    dout = torch.randn_like(out)
    dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
    softmax_d, lse_log2, *_ = torch.ops.flash_attn_3.bwd(dout, q, k, v, out, lse, dq, dk, dv, is_causal=True)
    assert not any(torch.isnan(t).any() for t in (dq, dk, dv, softmax_d))
    assert torch.allclose(lse_log2, lse * math.log2(math.e))

    class Attention(torch.nn.Module):
        def forward(self, q, k, v):
            return torch.ops.flash_attn_3.fwd(q, k, v, is_causal=True, num_splits=1)[0]

    exported = torch.export.export(Attention(), (q, k, v))
    assert [n for n in exported.graph.nodes if n.target is torch.ops.flash_attn_3.fwd.default]
    assert torch.equal(exported.module()(q, k, v), eager)
