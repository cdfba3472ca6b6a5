"""Shared pieces of the Python tests (imported by the test files): the GPU skip rule and a
small attention reference, dense and per sequence of the packed (varlen) layout.

Run: PYTHONPATH=python FLASHHOPPER_LIBRARY=build/libflashhopper.so python -m pytest tests/python -q -rs
The CPU tests never load the library; the GPU tests skip (with the reason) unless PyTorch sees an
sm_90 GPU and the library loads with its CUDA kernels."""
import functools

import pytest
import torch


@functools.lru_cache(maxsize=None)
def gpu_skip_reason():
    """None when the GPU tests can run, else why not."""
    if not torch.cuda.is_available():
        return "no CUDA device visible to PyTorch (torch.cuda.is_available() is False)"
    capability = torch.cuda.get_device_capability()
    if capability != (9, 0):
        return f"FlashHopper's kernels need an sm_90 GPU (H100/H200); this one is sm_{capability[0]}{capability[1]}"
    try:
        from flashhopper import _ffi
        lib = _ffi.lib()
    except OSError as error:
        return f"libflashhopper could not be loaded ({error}); set FLASHHOPPER_LIBRARY"
    if not lib.fh_built_with_cuda():
        return "libflashhopper was built without CUDA kernels (FLASHHOPPER_CUDA=OFF)"
    return None


def requires_gpu(fn):
    """Skips at run time (so that collecting the tests never touches CUDA)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        reason = gpu_skip_reason()
        if reason is not None:
            pytest.skip(reason)
        return fn(*args, **kwargs)
    return wrapper


def visible_keys(seqlen_q, seqlen_k, causal=False, window_size=(-1, -1), attention_chunk=0, device=None):
    """The explicit [seqlen_q, seqlen_k] boolean mask of FlashAttention's conventions, aligned
    bottom-right (p = i + seqlen_k - seqlen_q): query i sees key j iff j >= p - left (left >= 0),
    j <= p + right (right >= 0; causal forces right = 0), and, with attention_chunk c > 0,
    floor(p / c) * c <= j < floor(p / c) * c + c. -1 or None: unbounded."""
    left, right = (-1 if w is None else int(w) for w in window_size)
    if causal:
        right = 0
    rows = torch.arange(seqlen_q, device=device)[:, None]
    cols = torch.arange(seqlen_k, device=device)[None, :]
    p = rows + (seqlen_k - seqlen_q)
    visible = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if left >= 0:
        visible &= cols >= p - left
    if right >= 0:
        visible &= cols <= p + right
    if attention_chunk > 0:
        start = torch.div(p, attention_chunk, rounding_mode="floor") * attention_chunk
        visible &= (cols >= start) & (cols < start + attention_chunk)
    return visible


def attention_reference(q, k, v, causal=False, softmax_scale=None, dtype=None, window_size=(-1, -1), softcap=0.0,
                        attention_chunk=0, learnable_sink=None):
    """softmax(q k^T * scale + mask) v with FlashAttention's conventions, computed in `dtype`
    (float64 for the reference, the input dtype for the "plain PyTorch" comparison).

    q [B, sq, Hq, d], k/v [B, sk, Hkv, d]; GQA by repeat_interleave; the mask of visible_keys
    (causal, window_size, attention_chunk; bottom-right aligned); softcap > 0 caps the scaled
    scores, s -> softcap * tanh(s / softcap); learnable_sink [Hq] is one more logit per row with no
    value (a column of the softmax whose probability is dropped), so lse includes it. Rows that see
    no key give out 0 and lse -inf (the sink's logit with a sink), and no NaN anywhere (also in
    autograd). Returns out [B, sq, Hq, d] and lse [B, Hq, sq]."""
    dtype = dtype or q.dtype
    batch, seqlen_q, heads_q = q.shape[:3]
    seqlen_k = k.shape[1]
    group = heads_q // k.shape[2]
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    qh = q.to(dtype).transpose(1, 2)                                     # [B, Hq, sq, d]
    kh = k.to(dtype).repeat_interleave(group, dim=2).transpose(1, 2)     # [B, Hq, sk, d]
    vh = v.to(dtype).repeat_interleave(group, dim=2).transpose(1, 2)
    scores = (qh * scale) @ kh.transpose(-1, -2)                         # [B, Hq, sq, sk]
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    visible = visible_keys(seqlen_q, seqlen_k, causal, window_size, attention_chunk, device=q.device)
    scores = scores.masked_fill(~visible, float("-inf"))
    if learnable_sink is not None:
        sink = learnable_sink.to(dtype).view(1, heads_q, 1, 1).expand(batch, heads_q, seqlen_q, 1)
        scores = torch.cat([scores, sink], dim=-1)                       # [B, Hq, sq, sk + 1]
    if scores.shape[-1] == 0:  # no key at all (a varlen sequence of length 0): amax needs a column
        row_max = scores.new_zeros((*scores.shape[:-1], 1))
    else:
        row_max = scores.amax(dim=-1, keepdim=True).detach()
    row_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
    exp = torch.exp(scores - row_max)
    denom = exp.sum(dim=-1, keepdim=True)
    probs = exp / torch.where(denom == 0, torch.ones_like(denom), denom)
    out = (probs[..., :seqlen_k] @ vh).transpose(1, 2)                   # [B, sq, Hq, d]
    lse = (torch.log(denom) + row_max).squeeze(-1)                       # log(0) = -inf for empty rows
    return out, lse


def varlen_attention_reference(q, k, v, seqlens_q, seqlens_k, seqused_q=None, seqused_k=None, **options):
    """attention_reference on each sequence of the packed layout on its own: q [total_q, Hq, d],
    k/v [total_k, Hkv, d] hold the sequences of host lengths seqlens_q/seqlens_k one after the other
    (total = the sum of the lengths); with seqused_q/k (host lists) only the first seqused[b] tokens
    of sequence b take part (its mask aligned bottom-right on those), its other rows give out 0 and
    lse -inf. `options` are attention_reference's (dtype, causal, window_size, learnable_sink, ...).
    Returns out [total_q, Hq, d] and lse [Hq, total_q], differentiable in q, k, v and the sink."""
    heads_q, head_dim_v = q.shape[1], v.shape[-1]
    outs, lses = [], []
    start_q = start_k = 0
    for b, (len_q, len_k) in enumerate(zip(seqlens_q, seqlens_k)):
        used_q = len_q if seqused_q is None else seqused_q[b]
        used_k = len_k if seqused_k is None else seqused_k[b]
        out, lse = attention_reference(q[None, start_q:start_q + used_q], k[None, start_k:start_k + used_k],
                                       v[None, start_k:start_k + used_k], **options)
        outs += [out[0], out.new_zeros((len_q - used_q, heads_q, head_dim_v))]
        lses += [lse[0], lse.new_full((heads_q, len_q - used_q), float("-inf"))]
        start_q += len_q
        start_k += len_k
    return torch.cat(outs), torch.cat(lses, dim=1)


def capture_graph(step):
    """Warms `step` up off the capture stream (as torch.cuda.graph asks), captures one call in a
    CUDA graph and returns (graph, the captured call's outputs)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    return graph, captured


def expect_replay_matches_eager(graph, captured, step, names):
    """Replays `graph` (after the caller changed its inputs in place) and asserts that each
    captured output is bitwise what an eager `step()` gives now."""
    graph.replay()
    torch.cuda.synchronize()
    eager = step()
    for name, a, b in zip(names, captured, eager):
        assert torch.equal(a, b), f"{name}: replay differs from eager"


def recording_backend(graphs):
    """A torch.compile backend that appends each compiled graph's call targets to `graphs` and
    runs it through AOT autograd unchanged."""
    def backend(gm, example_inputs):
        graphs.append([node.target for node in gm.graph.nodes if node.op == "call_function"])
        from torch._dynamo.backends.common import aot_autograd
        from functorch.compile import make_boxed_func
        boxed = lambda g, _: make_boxed_func(g.forward)
        return aot_autograd(fw_compiler=boxed, bw_compiler=boxed)(gm, example_inputs)
    return backend


class AttentionBlock(torch.nn.Module):
    """Projections around flash_attn_func (causal, deterministic backward). No bias: the matmuls
    stay cuBLAS calls, so that a compiled graph can be held to eager's bits."""

    def __init__(self, dim=512, heads=4, head_dim=128):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.qkv = torch.nn.Linear(dim, 3 * heads * head_dim, bias=False)
        self.proj = torch.nn.Linear(heads * head_dim, dim, bias=False)

    def forward(self, x):
        from flashhopper import flash_attn_func
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, self.head_dim).unbind(2)
        out = flash_attn_func(q, k, v, causal=True, deterministic=True)
        return self.proj(out.reshape(b, s, -1))


def attention_block_and_input(seed):
    """An AttentionBlock in bf16 on the GPU and an input x [2, 300, 512], from `seed`."""
    torch.manual_seed(seed)
    block = AttentionBlock().to("cuda", torch.bfloat16)
    return block, torch.randn(2, 300, 512, device="cuda", dtype=torch.bfloat16)


# ---- the same calls through every layer ------------------------------------------------------------

def cross_layer_cases(device="cpu"):
    """Bad (and borderline) forward calls as flash_attn_func takes them, and the argument the C
    ABI's check names for the same call (None: it accepts it): (id, call, name). Every call has q
    [2, 64, 8, 128], k and v [2, 96, 2, 128] bf16 on `device` but for its changes."""
    def tensor(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, dtype=dtype, device=device)

    def call(**changes):
        base = dict(q=tensor(2, 64, 8, 128), k=tensor(2, 96, 2, 128), v=tensor(2, 96, 2, 128))
        base.update(changes)
        return base
    return [
        ("head dim", call(k=tensor(2, 96, 2, 64)), "k"),
        ("heads", call(k=tensor(2, 96, 3, 128), v=tensor(2, 96, 3, 128)), "k"),
        ("key length", call(v=tensor(2, 80, 2, 128)), "v"),
        ("dtype", call(k=tensor(2, 96, 2, 128, dtype=torch.float16)), "k"),
        ("float32 inputs", call(q=tensor(2, 64, 8, 128, dtype=torch.float32),
                                k=tensor(2, 96, 2, 128, dtype=torch.float32),
                                v=tensor(2, 96, 2, 128, dtype=torch.float32)), "q"),
        ("sink heads", call(learnable_sink=tensor(4, dtype=torch.float32)), "learnable_sink"),
        ("sink dtype", call(learnable_sink=tensor(8)), "learnable_sink"),
        ("softcap", call(softcap=-1.0), "softcap"),
        ("chunk", call(attention_chunk=-1), "attention_chunk"),
        ("window", call(window_size=(-2, 0)), "window_left"),
        ("splits", call(num_splits=300), "num_splits"),
        ("scale", call(softmax_scale=float("nan")), "softmax_scale"),
        ("subnormal softcap", call(softcap=1e-40), None),
        ("causal window", call(window_size=(200, 5), causal=True), None),
    ]


# The Python API's names where they are FA3's rather than the C ABI's.
FA3_NAMES = {"window_left": "window_size", "window_right": "window_size"}


def refused_argument(error):
    """The argument a refusal names: its message is "flashhopper (<status>): <argument>: ..."."""
    return str(error).split("): ", 1)[1].split(":", 1)[0]


def _step_sequences(varlen):
    """(query rows, key rows) of each sequence of a Varlen, seqused applied (host slices)."""
    cu_q, cu_k = varlen.cu_seqlens_q.tolist(), varlen.cu_seqlens_k.tolist()
    for b in range(len(cu_q) - 1):
        used_q = cu_q[b + 1] - cu_q[b] if varlen.seqused_q is None else int(varlen.seqused_q[b])
        used_k = cu_k[b + 1] - cu_k[b] if varlen.seqused_k is None else int(varlen.seqused_k[b])
        yield slice(cu_q[b], cu_q[b] + used_q), slice(cu_k[b], cu_k[b] + used_k)


def reference_step_backward(dout, q, k, v, out, lse, causal, softmax_scale, varlen=None, window_size=(-1, -1)):
    """FlashAttention's backward of one block pair in the inputs' dtype, with the whole row's out
    and lse (as a kernel step of context parallelism takes them): P = exp(s * scale - lse) on the
    visible keys, dV = P^T dO, dS = P (dO V^T - rowsum(dO * O)), dQ = dS K scale, dK = dS^T Q
    scale; GQA sums each KV head's query heads; causal and window_size as visible_keys'. Returns
    dq, dk, dv shaped like q, k, v. varlen
    (an interface.Varlen): packed q [total, Hq, d] and lse [Hq, total], each sequence on its own;
    rows and keys outside every sequence get zeros."""
    if varlen is not None:
        grads = [torch.zeros_like(t) for t in (q, k, v)]
        for rows, keys in _step_sequences(varlen):
            dq, dk, dv = reference_step_backward(dout[None, rows], q[None, rows], k[None, keys], v[None, keys],
                                                 out[None, rows], lse[None, :, rows], causal, softmax_scale,
                                                 window_size=window_size)
            grads[0][rows] += dq[0]
            grads[1][keys] += dk[0]
            grads[2][keys] += dv[0]
        return tuple(grads)
    batch, seqlen_q, heads_q = q.shape[:3]
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    group = heads_q // heads_kv
    qh = q.transpose(1, 2)
    kh = k.repeat_interleave(group, dim=2).transpose(1, 2)
    vh = v.repeat_interleave(group, dim=2).transpose(1, 2)
    doh, oh = dout.transpose(1, 2), out.to(dout.dtype).transpose(1, 2)
    visible = visible_keys(seqlen_q, seqlen_k, causal, window_size, device=q.device)
    scores = (qh @ kh.transpose(-1, -2)) * softmax_scale
    probs = torch.where(visible, torch.exp(scores - lse.to(scores.dtype).unsqueeze(-1)), torch.zeros_like(scores))
    dv = probs.transpose(-1, -2) @ doh
    dp = doh @ vh.transpose(-1, -2)
    ds = probs * (dp - (doh * oh).sum(-1, keepdim=True))
    dq = (ds @ kh) * softmax_scale
    dk = (ds.transpose(-1, -2) @ qh) * softmax_scale

    def per_kv_head(t):  # [B, Hq, sk, x] -> [B, sk, Hkv, x]
        return t.unflatten(1, (heads_kv, group)).sum(2).transpose(1, 2)
    return dq.transpose(1, 2), per_kv_head(dk), per_kv_head(dv)


def reference_step_forward(q, k, v, causal, softmax_scale, varlen=None, window_size=(-1, -1)):
    """attention_reference in the inputs' dtype: (out, lse) of one block pair; varlen as
    reference_step_backward's (rows outside every sequence: out 0, lse -inf)."""
    if varlen is None:
        return attention_reference(q, k, v, causal=causal, softmax_scale=softmax_scale, dtype=q.dtype,
                                   window_size=window_size)
    out = q.new_zeros((*q.shape[:-1], v.shape[-1]))
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=q.dtype)
    for rows, keys in _step_sequences(varlen):
        o, l = attention_reference(q[None, rows], k[None, keys], v[None, keys], causal=causal,
                                   softmax_scale=softmax_scale, dtype=q.dtype, window_size=window_size)
        out[rows], lse[:, rows] = o[0], l[0]
    return out, lse
