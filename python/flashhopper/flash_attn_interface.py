"""FlashAttention-3's Python API (hopper/flash_attn_interface.py) over FlashHopper's kernels.

Same function names, argument names, defaults and return conventions, so that switching is one line:

    import flashhopper.flash_attn_interface as fa3      # instead of: import flash_attn_interface as fa3
    out = fa3.flash_attn_func(q, k, v, causal=True)

What the kernels do today: q [B, sq, Hq, d], k [B, sk, Hkv, d], v [B, sk, Hkv, dv] in bf16 or
fp16, any d and dv <= 512 (past 256 forward only; multiples of 8 run on the next compiled head dim,
flashhopper.compiled_families(); others are zero-padded here to the next multiple of 8, the scale
staying 1/sqrt(d); development builds of the library: bf16 and d, dv <= 128 only; others raise
FlashHopperNotSupported, a NotImplementedError), causal or not (bottom-right aligned), local
windows (window_size), chunked
attention (attention_chunk), softcap, FlashAttention-4's learnable_sink (float32 [Hq]: one logit per
query head in every row's softmax denominator, gpt-oss style; it gets a gradient), GQA/MQA, any sq
and sk, deterministic backward; and all of it over packed variable-length sequences with
flash_attn_varlen_func (q [total_q, Hq, d], cu_seqlens_q/k, max_seqlen_q/k, seqused_q/k; up to 8192
sequences). What a build of the library cannot run raises FlashHopperNotSupported with the
library's message. Every argument FlashHopper cannot honour yet raises NotImplementedError naming it
(a gradient through fp8 or qv, as FA3; rotary tables with fp8). sm_margin leaves that many SMs
free for other kernels (FA3's argument; the library refuses a margin that leaves the GPU none).
flash_attn_with_kvcache runs a dense KV cache (with the append, rotary and split-KV) and a paged one
(any page size). flash_attn_combine merges split-KV partials
(FA3's signature and layouts). Bad tensors (dtype, rank, shape, strides, device, alignment) and bad
options (window_size, softcap, attention_chunk, learnable_sink, cu_seqlens, seqused, max_seqlen)
raise ValueError naming the argument before anything is launched: the library's own check, the one
that C and C++ callers get, run on the arguments' metadata (flashhopper.interface).

Differences from FlashAttention-3 worth knowing:
- The returned softmax_lse does not require grad (it is marked non-differentiable); FA3 returns one
  that seems differentiable but drops its gradient.
- Inputs are not copied to make them contiguous: a last dim with stride != 1 (or other strides not
  a multiple of 16 bytes) raises ValueError; call .contiguous() yourself.
- window_size also takes None for an unbounded side (FlashAttention-4's spelling, as -1); its
  bounds must be ints >= -1 (FA3 converts with int()), given as ints or, as FA3 allows, a CPU
  integer tensor (a tensor on the GPU is refused: reading it would wait for the device).
  learnable_sink is a keyword after FA3's parameters, so FA3's positional calls keep their meaning.
- pack_gqa is a tuning hint in FA3 and is accepted and ignored here (the library packs a decode's
  query heads itself). num_splits > 1 splits the keys (split-KV), packed (varlen) queries too, and 0
  lets the library choose from the shapes, as FA3.

FA3's private _flash_attn_forward and _flash_attn_backward are here too (end of the module), and
flashhopper.fa3_ops registers FA3's operator names (torch.ops.flash_attn_3.*) on request.
"""
from typing import NamedTuple, Optional, Union

import torch

from . import interface, ops

__all__ = [
    "flash_attn_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_with_kvcache",
    "flash_attn_combine",
    "get_scheduler_metadata",
]


def _not_yet(argument: str, value, what: str):
    raise interface.not_supported(f"{argument}={value!r}: {what} is not supported by FlashHopper yet")


def _resolve_options(causal, window_size, attention_chunk, softcap, num_splits, sm_margin):
    """Checks the mask and score options (ValueError); returns (causal, window_left, window_right,
    softcap, attention_chunk) for the op, with FA3's rule that causal forces the right bound to 0.
    (The other FA3 rule, a bound covering the whole sequence is no bound, is applied by the op,
    where the lengths are concrete.)"""
    return _memoised(_check_options, causal, window_size, softcap, attention_chunk, num_splits, sm_margin)


def _check_options(causal, window_size, softcap, attention_chunk, num_splits, sm_margin):
    interface.check_num_splits(num_splits)
    interface.check_sm_margin(sm_margin)
    return interface.check_mask_args(causal, window_size, softcap, attention_chunk)


def _check_kvcache_options(causal, window_size, softcap, attention_chunk, sm_margin, softmax_scale):
    interface.check_sm_margin(sm_margin)
    interface.check_softmax_scale(softmax_scale)
    return interface.check_mask_args(causal, window_size, softcap, attention_chunk)


_CHECKED: dict = {}


def _memoised(check, *options):
    """check(*options) (the scalar options' checks: a result, or an exception naming the argument),
    run once per set of values with their types: it depends on nothing else, and runs on every
    call. Options that are not plain scalars or tuples of them are checked each time."""
    key = interface._plan_key(check.__name__, (), options)
    result = _CHECKED.get(key) if key is not None else None
    if result is None:
        result = check(*options)
        if key is not None:
            if len(_CHECKED) >= 256:
                _CHECKED.clear()
            _CHECKED[key] = result
    return result


def _pad_head_dims(q, k, v, softmax_scale):
    """Head dims (q/k's d, v's dv) that are not multiples of 8 (the kernels' 16-byte granule) and at
    most 256: zero-padded to the next multiple (differentiable, so the gradients come back
    unpadded), the scale staying 1/sqrt(d). Returns (q, k, v, softmax_scale, dv to cut out back to,
    or None)."""
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)
            and q.dim() and k.dim() and v.dim()):
        return q, k, v, softmax_scale, None
    d, dv = q.shape[-1], v.shape[-1]
    if d % 16 == 0 and dv % 16 == 0:  # on the granule of every dtype (this runs on every call)
        return q, k, v, softmax_scale, None
    granule = 16 // q.element_size()
    if k.shape[-1] != d or max(d, dv) > interface.MAX_HEAD_DIM or (d % granule == 0 and dv % granule == 0):
        return q, k, v, softmax_scale, None  # nothing to pad, or the checks refuse it

    def pad(t, dim):
        return torch.nn.functional.pad(t, (0, -dim % granule)) if dim % granule else t

    scale = d ** -0.5 if softmax_scale is None else softmax_scale
    return pad(q, d), pad(k, d), pad(v, dv), scale, (dv if dv % granule else None)


_PLAIN, _AUTOGRAD, _TRACED = range(3)
_EAGER_TENSORS = (torch.Tensor, torch.nn.Parameter)


def _call_kind(*tensors) -> int:
    """_TRACED (torch.compile, torch.export, fake tensors: the fwd op), _AUTOGRAD (eager, a
    gradient can flow: the op's autograd around the library call) or _PLAIN (the library call
    alone). One pass over the arguments: this runs on every call."""
    if torch.compiler.is_compiling():
        return _TRACED
    wants_grad = False
    for t in tensors:
        if type(t) in _EAGER_TENSORS:
            wants_grad = wants_grad or t.requires_grad
        elif isinstance(t, torch.Tensor):
            return _TRACED
    return _AUTOGRAD if wants_grad and torch.is_grad_enabled() else _PLAIN


def _fwd_op_args(q, k, v, varlen, softmax_scale, mask, deterministic, learnable_sink, num_splits, sm_margin,
                 descales=()):
    """The fwd op's inputs, positional (the descales last, where given)."""
    causal, window_left, window_right, softcap, attention_chunk = mask
    return (q, k, v, softmax_scale, causal, bool(deterministic), window_left, window_right, softcap, attention_chunk,
            learnable_sink, *((None,) * 6 if varlen is None else varlen), num_splits, sm_margin, *descales)


def _traced_forward(args, varlen, descales=()):
    """Traced (torch.compile, torch.export, make_fx): the fwd op on _fwd_op_args's inputs, whose fake
    function runs the library's check; the devices are checked here."""
    q, k, v, learnable_sink = args[0], args[1], args[2], args[10]
    interface.check_devices([("q", q), ("k", k), ("v", v), ("learnable_sink", learnable_sink)]
                            + interface.varlen_tensors(varlen) + interface._descale_tensors(descales))
    return ops.fwd(*args)


def _attention(q, k, v, varlen, softmax_scale, causal, qv, q_descale, k_descale, v_descale, window_size,
               attention_chunk, softcap, num_splits, deterministic, sm_margin, return_attn_probs, learnable_sink,
               page_table=None):
    """flash_attn_func and flash_attn_varlen_func: the argument checks (flashhopper.interface), then
    the fwd op (whose autograd runs bwd), or the library call alone when no gradient can flow;
    varlen None is the dense layout. With page_table (varlen only), k and v are pages."""
    # A call like an earlier one (the same tensor metadata and options, of the same types, and the
    # same kind) runs the plan that call made, without its checks and conversions again.
    call_key = None
    if qv is None and page_table is None and q_descale is None and k_descale is None and v_descale is None:
        kind = _call_kind(q, k, v, learnable_sink)
        if kind != _TRACED:
            call_key = _attention_key(kind, q, k, v, varlen, learnable_sink, softmax_scale, causal, window_size,
                                      attention_chunk, softcap, num_splits, deterministic, sm_margin,
                                      return_attn_probs)
            call = interface._PLANS.get(call_key) if call_key is not None else None
            if type(call) is _CallPlan:  # (a bare plan: a call refused after its launch)
                if kind == _AUTOGRAD:
                    out, softmax_lse = ops.fwd_replay(call.plan, call.saved_options, q, k, v, learnable_sink, varlen)
                    return (out, softmax_lse) if return_attn_probs else out
                return interface.run_forward_plan(call.plan, q, k, v, learnable_sink, varlen, bool(return_attn_probs))
    mask = _resolve_options(causal, window_size, attention_chunk, softcap, num_splits, sm_margin)
    descales = (q_descale, k_descale, v_descale)
    if (q_descale is not None or k_descale is not None or v_descale is not None
            or (isinstance(q, torch.Tensor) and interface.output_dtype(q) != q.dtype)):
        return _fp8_attention(q, k, v, varlen, softmax_scale, mask, num_splits, sm_margin, return_attn_probs,
                              learnable_sink, page_table, qv, descales)
    if qv is not None:
        return _qv_attention(q, k, v, qv, softmax_scale, mask, num_splits, learnable_sink, sm_margin,
                             return_attn_probs, varlen, page_table)
    padded = _pad_head_dims(q, k, v, softmax_scale)
    if padded[0] is not q or padded[1] is not k or padded[2] is not v:
        call_key = None  # its plan is the padded tensors'
    q, k, v, softmax_scale, unpadded_dim = padded
    if page_table is not None:
        out, softmax_lse = _paged_varlen_attention(q, k, v, page_table, varlen, softmax_scale, mask, num_splits,
                                                   bool(deterministic), learnable_sink, sm_margin)
    elif (kind := _call_kind(q, k, v, learnable_sink)) != _PLAIN:
        args = _fwd_op_args(q, k, v, varlen, softmax_scale, mask, deterministic, learnable_sink, num_splits,
                            sm_margin)
        if kind == _TRACED:
            out, softmax_lse = _traced_forward(args, varlen)
        else:  # eager with autograd: the op's autograd without the dispatcher (the library checks)
            out, softmax_lse = ops.fwd_eager(*args, caller_key=call_key)
            # Head dims past the backward's: refused here, once the library has checked the call,
            # rather than in the backward, far from the call.
            if max(q.shape[-1], v.shape[-1]) > interface.MAX_BACKWARD_HEAD_DIM:
                raise interface.not_supported(
                    f"q: head dims ({q.shape[-1]}, {v.shape[-1]}) run forward only (the backward takes head dims up "
                    f"to {interface.MAX_BACKWARD_HEAD_DIM}); call it under torch.no_grad() or with inputs that do "
                    "not require grad")
            _remember_call(call_key, ops.saved_options(args))
    else:
        result = _library_forward(q, k, v, varlen, softmax_scale, mask, num_splits, sm_margin, return_attn_probs,
                                  learnable_sink, caller_key=call_key)
        out, softmax_lse = result if return_attn_probs else (result, None)
        _remember_call(call_key, None)
    if unpadded_dim is not None:
        out = out[..., :unpadded_dim].contiguous()
    return (out, softmax_lse) if return_attn_probs else out


def _fp8_attention(q, k, v, varlen, softmax_scale, mask, num_splits, sm_margin, return_attn_probs, learnable_sink,
                   page_table, qv, descales):
    """flash_attn_func and flash_attn_varlen_func with fp8 inputs (float8_e4m3fn, FA3's descale
    factors; or descales given, which the library refuses for other dtypes): forward only, as in
    FA3; out is bf16; traced (torch.compile, torch.export), the fwd op with its descales. With
    page_table (varlen), k and v are pages, read through the KV-cache call. The library says which
    calls its fp8 kernels run."""
    if qv is not None:
        raise interface.not_supported("qv: not with fp8 inputs (FlashHopper's fp8 path takes plain q, k, v)")
    kind = _call_kind(q, k, v, learnable_sink, *descales)
    if kind == _TRACED and page_table is None:
        args = _fwd_op_args(q, k, v, varlen, softmax_scale, mask, False, learnable_sink, num_splits, sm_margin,
                            descales)
        out, lse = _traced_forward(args, varlen, descales)
        return (out, lse) if return_attn_probs else out
    if kind == _AUTOGRAD:
        raise interface.not_supported("q: fp8 attention has no backward (as in FA3); call it under torch.no_grad() "
                                      "or with inputs that do not require grad")
    if page_table is not None:
        interface.check_varlen(varlen)
        out, lse = _paged_forward(q, k, v, page_table, varlen, softmax_scale, mask, num_splits, learnable_sink,
                                  sm_margin, return_lse=bool(return_attn_probs), descales=descales)
        return (out, lse) if return_attn_probs else out
    return _library_forward(q, k, v, varlen, softmax_scale, mask, num_splits, sm_margin, return_attn_probs,
                            learnable_sink, descales)


def _library_forward(q, k, v, varlen, softmax_scale, mask, num_splits, sm_margin, return_lse, learnable_sink,
                     descales=(None, None, None), caller_key=None):
    """The library call alone (no gradient can flow): interface.forward's out, or (out, lse)."""
    causal, window_left, window_right, softcap, attention_chunk = mask
    q_descale, k_descale, v_descale = descales
    return interface.forward(q, k, v, causal, softmax_scale, return_lse=bool(return_lse),
                             window_size=(window_left, window_right), softcap=softcap,
                             attention_chunk=attention_chunk, learnable_sink=learnable_sink,
                             varlen=None if varlen is None else interface.as_varlen(*varlen),
                             num_splits=num_splits, sm_margin=sm_margin, q_descale=q_descale,
                             k_descale=k_descale, v_descale=v_descale, caller_key=caller_key)


class _CallPlan(NamedTuple):
    """What a call of _attention like an earlier one reuses (memoised under _attention_key)."""
    plan: object                    # interface.forward's plan for that call
    saved_options: Optional[tuple]  # ops.saved_options of its fwd op inputs (None: no autograd)


def _attention_key(kind, q, k, v, varlen, learnable_sink, *options):
    """_attention's plan key from its unconverted arguments (None: not memoised)."""
    if varlen is None:
        return interface._plan_key("flash_attn_func", (q, k, v, learnable_sink), (kind, *options))
    return interface._plan_key("flash_attn_varlen_func",
                               (q, k, v, learnable_sink, varlen.cu_seqlens_q, varlen.cu_seqlens_k, varlen.seqused_q,
                                varlen.seqused_k), (kind, varlen.max_seqlen_q, varlen.max_seqlen_k, *options))


def _remember_call(call_key, saved_options) -> None:
    """The plan interface.forward memoised under call_key, kept there with what the autograd saves."""
    plan = interface._PLANS.get(call_key) if call_key is not None else None
    if plan is not None:
        interface._PLANS[call_key] = _CallPlan(plan, saved_options)


def _qv_attention(q, k, v, qv, softmax_scale, mask, num_splits, learnable_sink, sm_margin, return_attn_probs,
                  varlen=None, page_table=None):
    """flash_attn_func and flash_attn_varlen_func with qv (S = Q K^T + Qv V^T, absorbed MLA): forward
    only, as in FA3, through the KV-cache call over k and v as a whole cache (packed sequences: its
    cu_seqlens and seqused; page_table: k and v are pages), the fwd_kvcache op when traced; refused
    where a gradient would be asked for."""
    if _call_kind(q, k, v, qv, learnable_sink) == _AUTOGRAD:
        raise interface.not_supported(
            "qv: attention with qv has no backward (nor in FA3); call it under torch.no_grad() or with inputs "
            "that do not require grad")
    packed = {} if varlen is None else dict(
        cu_seqlens_q=varlen.cu_seqlens_q, max_seqlen_q=varlen.max_seqlen_q, cu_seqlens_k=varlen.cu_seqlens_k,
        max_seqlen_k=varlen.max_seqlen_k, seqused_q=varlen.seqused_q, seqused_k=varlen.seqused_k)
    out, softmax_lse = _kvcache_forward(q, k, v, mask, softmax_scale, num_splits, qv=qv, learnable_sink=learnable_sink,
                                        page_table=page_table, return_lse=True, names={}, sm_margin=sm_margin,
                                        **packed)
    return (out, softmax_lse) if return_attn_probs else out


def _kvcache_forward(q, k_cache, v_cache, mask, softmax_scale, num_splits, *, k=None, v=None, qv=None,
                     rotary_cos=None, rotary_sin=None, rotary_seqlens=None, rotary_interleaved=True,
                     cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, page_table=None, cu_seqlens_q=None,
                     max_seqlen_q=None, cu_seqlens_k_new=None, cu_seqlens_k=None, max_seqlen_k=None, seqused_q=None,
                     seqused_k=None, learnable_sink=None, return_lse=True, names=interface._KVCACHE_NAMES,
                     sm_margin=0, descales=(None, None, None), caller_key=None):
    """(out, lse) of the library's forward with the KV-cache fields: traced (torch.compile,
    torch.export), the fwd_kvcache op, which tells the tracer that an append writes k_cache and
    v_cache; eager, the library call without the dispatcher's host work (lse None unless
    return_lse; names as interface.forward_with_kvcache's). descales: fp8's factors; caller_key as
    forward_with_kvcache's."""
    if _call_kind(q, k_cache, v_cache, *descales) == _TRACED:
        causal, window_left, window_right, softcap, attention_chunk = mask
        return ops.fwd_kvcache(
            q, k_cache, v_cache, k, v, qv, rotary_cos, rotary_sin, rotary_seqlens, bool(rotary_interleaved),
            cache_seqlens, cache_batch_idx, cache_leftpad, page_table, cu_seqlens_q, max_seqlen_q, softmax_scale,
            causal, window_left, window_right, softcap, attention_chunk, num_splits, cu_seqlens_k_new, cu_seqlens_k,
            max_seqlen_k, seqused_q, seqused_k, learnable_sink, sm_margin, *descales)
    result = interface.forward_with_kvcache(
        q, k_cache, v_cache, k_new=k, v_new=v, qv=qv, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
        rotary_seqlens=rotary_seqlens, rotary_interleaved=rotary_interleaved, cache_seqlens=cache_seqlens,
        cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad, page_table=page_table, cu_seqlens_q=cu_seqlens_q,
        max_seqlen_q=max_seqlen_q, softmax_scale=softmax_scale, mask=mask, num_splits=num_splits,
        return_lse=return_lse, cu_seqlens_k_new=cu_seqlens_k_new, cu_seqlens_k=cu_seqlens_k, max_seqlen_k=max_seqlen_k,
        seqused_q=seqused_q, seqused_k=seqused_k, learnable_sink=learnable_sink, names=names, sm_margin=sm_margin,
        descales=descales, caller_key=caller_key)
    return result if return_lse else (result, None)


def _paged_forward(q, k_cache, v_cache, page_table, varlen, softmax_scale, mask, num_splits, learnable_sink, sm_margin,
                   return_lse=True, descales=(None, None, None)):
    """flash_attn_varlen_func's forward over pages: a packed batch (varlen) whose keys the page
    table finds, through the KV-cache call; (out, lse)."""
    return _kvcache_forward(q, k_cache, v_cache, mask, softmax_scale, num_splits, page_table=page_table,
                            cu_seqlens_q=varlen.cu_seqlens_q, max_seqlen_q=varlen.max_seqlen_q,
                            cu_seqlens_k=varlen.cu_seqlens_k, max_seqlen_k=varlen.max_seqlen_k,
                            seqused_q=varlen.seqused_q, seqused_k=varlen.seqused_k, learnable_sink=learnable_sink,
                            return_lse=return_lse, names={}, sm_margin=sm_margin, descales=descales)


def _paged_rows(page_table, num_pages, page_size, max_seqlen_k):
    """[B * max_seqlen_k] int64: the row of k viewed as [num_pages * page_size, Hkv, d] that holds
    position i of sequence b, at b * max_seqlen_k + i (past a row's pages clamped to some row:
    the positions past a sequence's length are masked by whoever reads them)."""
    positions = torch.arange(max_seqlen_k, device=page_table.device)
    pages = page_table[:, (positions // page_size).clamp_(max=page_table.shape[1] - 1)].long()
    return (pages * page_size + positions % page_size).clamp_(0, num_pages * page_size - 1).flatten()


class _PagedVarlenAttention(torch.autograd.Function):
    """flash_attn_varlen_func with page_table: the forward over the pages (the library's packed
    batch over paged keys), the backward over a packed copy of each sequence's max_seqlen_k
    positions (sequence b at rows b * max_seqlen_k .., zeros past its length: unused rows must be
    finite), its dk/dv added back into the pages."""

    @staticmethod
    def forward(ctx, q, k_cache, v_cache, learnable_sink, page_table, varlen, softmax_scale, mask, num_splits,
                deterministic, sm_margin):
        out, lse = _paged_forward(q, k_cache, v_cache, page_table, varlen, softmax_scale, mask, num_splits,
                                  learnable_sink, sm_margin)
        ctx.save_for_backward(q, k_cache, v_cache, learnable_sink, page_table, out, lse, varlen.cu_seqlens_q,
                              varlen.cu_seqlens_k, varlen.seqused_q, varlen.seqused_k)
        ctx.options = (varlen.max_seqlen_q, varlen.max_seqlen_k, softmax_scale, mask, deterministic, sm_margin)
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        if dout is None:
            return (None,) * 11
        q, k_cache, v_cache, sink, page_table, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k = \
            ctx.saved_tensors
        max_seqlen_q, max_seqlen_k, softmax_scale, mask, deterministic, sm_margin = ctx.options
        batch = page_table.shape[0]
        lengths = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).clamp_(min=0)
        if seqused_k is not None:
            lengths = torch.minimum(lengths, seqused_k)
        lengths = lengths.to(torch.int32)
        num_pages, page_size = k_cache.shape[:2]
        rows = _paged_rows(page_table, num_pages, page_size, max_seqlen_k)
        used = (torch.arange(max_seqlen_k, device=q.device) < lengths[:, None]).flatten()[:, None, None]
        packed = [torch.where(used, cache.reshape(num_pages * page_size, *cache.shape[2:])[rows], 0)
                  for cache in (k_cache, v_cache)]
        cu_packed = torch.arange(0, (batch + 1) * max_seqlen_k, max_seqlen_k, device=q.device, dtype=torch.int32)
        causal, window_left, window_right, softcap, attention_chunk = mask
        deterministic = deterministic or torch.are_deterministic_algorithms_enabled()
        dq, dk, dv, dsink = ops.bwd(dout, q, packed[0], packed[1], out, lse, softmax_scale, causal, deterministic,
                                    window_left, window_right, softcap, attention_chunk, sink, cu_seqlens_q,
                                    cu_packed, max_seqlen_q, max_seqlen_k, seqused_q, lengths, sm_margin)
        # index_put_ with accumulate sorts the rows first: a shared page's sum in a fixed order.
        grads = [torch.zeros((num_pages * page_size, *cache.shape[2:]), dtype=grad.dtype, device=grad.device)
                 .index_put_((rows,), grad, accumulate=True).view(cache.shape)
                 for cache, grad in ((k_cache, dk), (v_cache, dv))]
        sink_grad = dsink if sink is not None and ctx.needs_input_grad[3] else None
        return dq, grads[0], grads[1], sink_grad, None, None, None, None, None, None, None


def _paged_varlen_attention(q, k, v, page_table, varlen, softmax_scale, mask, num_splits, deterministic,
                            learnable_sink, sm_margin):
    """flash_attn_varlen_func's page_table path: (out, softmax_lse)."""
    interface.check_varlen(varlen)  # names a max_seqlen that is not an int (the backward needs one)
    return _PagedVarlenAttention.apply(q, k, v, learnable_sink, page_table, varlen, softmax_scale, mask, num_splits,
                                       deterministic, sm_margin)


def flash_attn_func(
    q,
    k,
    v,
    softmax_scale=None,
    causal=False,
    qv=None,
    q_descale=None, k_descale=None, v_descale=None,
    window_size=(-1, -1),
    attention_chunk=0,
    softcap=0.0,
    num_splits=1,
    pack_gqa=None,
    deterministic=False,
    sm_margin=0,
    return_attn_probs=False,
    learnable_sink=None,
):
    """Exact attention, FlashAttention-3's flash_attn_func.

    q: (batch_size, seqlen_q, nheads, headdim); k, v: (batch_size, seqlen_k, nheads_k, headdim),
    nheads % nheads_k == 0 (query heads h*g .. h*g+g-1 use key/value head h). causal=True masks
    bottom-right aligned (query i sees keys j <= i + seqlen_k - seqlen_q); a row that sees no key
    gives 0 and lse -inf. softmax_scale defaults to 1/sqrt(headdim). deterministic=True makes the
    backward bit-reproducible.

    window_size=(left, right): query i sees keys i + sk - sq - left .. i + sk - sq + right; -1 (or
    None) unbounded; with causal=True the right bound is 0. attention_chunk=c > 0: query i sees only
    the keys of its chunk, floor(p / c) * c <= j < floor(p / c) * c + c with p = i + sk - sq, on top
    of the window. softcap > 0: scores s become softcap * tanh(s / softcap). learnable_sink
    (FlashAttention-4's argument; keyword, after FA3's): a float32 tensor [nheads] on q's device, one
    logit per query head added to every row's softmax denominator with no value:
    out_i = sum_j exp(s_ij) v_j / (sum_j exp(s_ij) + exp(sink_h)); softmax_lse includes it, and it
    gets a gradient when it requires one.

    Returns out (batch_size, seqlen_q, nheads, headdim), or (out, softmax_lse) with
    softmax_lse (batch_size, nheads, seqlen_q) float32 (natural log) when return_attn_probs=True.
    """
    return _attention(q, k, v, None, softmax_scale, causal, qv, q_descale, k_descale, v_descale, window_size,
                      attention_chunk, softcap, num_splits, deterministic, sm_margin, return_attn_probs, learnable_sink)


def flash_attn_qkvpacked_func(
    qkv,
    softmax_scale=None,
    causal=False,
    q_descale=None, k_descale=None, v_descale=None,
    window_size=(-1, -1),
    attention_chunk=0,
    softcap=0.0,
    deterministic=False,
    num_heads_q=None,
    sm_margin=0,
    return_attn_probs=False,
    learnable_sink=None,
):
    """FlashAttention-3's flash_attn_qkvpacked_func: qkv (batch_size, seqlen, 3, nheads, headdim), or
    (batch_size, seqlen, nheads_q + 2 * nheads_k, headdim) with num_heads_q given (GQA).
    learnable_sink as flash_attn_func's."""
    if not isinstance(qkv, torch.Tensor):
        raise interface.invalid_argument(f"qkv: expected a torch.Tensor, got {type(qkv).__name__}")
    if qkv.dim() == 5:
        if qkv.shape[2] != 3:
            raise interface.invalid_argument(
                f"qkv: expected shape (batch, seqlen, 3, nheads, headdim), got {tuple(qkv.shape)}")
        q, k, v = qkv.unbind(dim=2)
    elif qkv.dim() == 4:
        if num_heads_q is None:
            raise interface.invalid_argument(
                "num_heads_q: required when qkv has 4 dims (batch, seqlen, heads, headdim)")
        num_heads_k = (qkv.shape[2] - num_heads_q) // 2
        if num_heads_k <= 0 or num_heads_q + 2 * num_heads_k != qkv.shape[2]:
            raise interface.invalid_argument(
                f"qkv: {qkv.shape[2]} heads is not num_heads_q ({num_heads_q}) + 2 * nheads_k")
        q, k, v = qkv.split([num_heads_q, num_heads_k, num_heads_k], dim=2)
    else:
        raise interface.invalid_argument(f"qkv: expected 5 dims (or 4 with num_heads_q), got shape {tuple(qkv.shape)}")
    return flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=causal, q_descale=q_descale,
                           k_descale=k_descale, v_descale=v_descale, window_size=window_size,
                           attention_chunk=attention_chunk, softcap=softcap, deterministic=deterministic,
                           sm_margin=sm_margin, return_attn_probs=return_attn_probs,
                           learnable_sink=learnable_sink)


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    seqused_q=None,
    seqused_k=None,
    softmax_scale=None,
    causal=False,
    qv=None,
    q_descale=None, k_descale=None, v_descale=None,
    window_size=(-1, -1),
    attention_chunk=0,
    softcap=0.0,
    num_splits=1,
    pack_gqa=None,
    deterministic=False,
    sm_margin=0,
    return_attn_probs=False,
    learnable_sink=None,
    page_table=None,
):
    """Exact attention over packed variable-length sequences, FlashAttention-3's flash_attn_varlen_func.

    q: (total_q, nheads, headdim); k, v: (total_k, nheads_k, headdim), nheads % nheads_k == 0.
    cu_seqlens_q, cu_seqlens_k: int32 (batch_size + 1,) on q's device, the prefix sums of the
    sequence lengths: sequence b is the rows cu_seqlens[b] .. cu_seqlens[b+1] - 1 of q (of k and
    v); zero-length sequences are fine. max_seqlen_q, max_seqlen_k: Python ints >= 1 bounding the
    lengths. seqused_q, seqused_k: None or int32 (batch_size,): only the first seqused[b] tokens of
    sequence b take part; its other rows give 0, softmax_lse -inf and zero gradients. That
    cu_seqlens is non-decreasing, ends at most at total, and that no length exceeds max_seqlen (nor
    seqused the length) is the caller's contract and not checked: checking it would copy the
    tensors to the host, which CUDA graphs and torch.compile cannot have. Tokens outside every
    sequence (past cu_seqlens[-1]) are neither read nor written: their rows of out, softmax_lse and
    the gradients are unspecified.

    Every other argument as flash_attn_func's, applied to each sequence on its own: causal and
    window_size aligned bottom-right per sequence (query i of a sequence of lengths sq, sk sees
    keys j <= i + sk - sq), a window bound covering max_seqlen is no bound (FA3's rule),
    attention_chunk, softcap, learnable_sink (float32 [nheads], same for every sequence),
    deterministic, and the same NotImplementedError/ValueError for what FlashHopper cannot do or
    what is malformed. cu_seqlens, seqused and max_seqlen get no gradient. More than 8192
    sequences raise FlashHopperNotSupported (a NotImplementedError).

    page_table (keyword, beyond FA3; int32 [batch_size, max_pages] on q's device): k and v are a
    paged cache, (num_pages, page_size, nheads_k, headdim), and sequence b's keys are positions
    0 .. cu_seqlens_k[b+1] - cu_seqlens_k[b] - 1 of its row (position i: row i % page_size of page
    page_table[b, i // page_size]); only cu_seqlens_k's differences count, and each length is at
    most max_seqlen_k and max_pages * page_size (the caller's contract). Chunked prefill and
    training over a paged cache: the forward reads the pages; the backward gathers each
    sequence's max_seqlen_k positions into a packed copy (memory as a dense K/V of that length),
    runs the packed backward, and adds the gradients into tensors shaped as k and v, pages no
    sequence reads getting zeros (a page shared by several sequences gets the sum).

    Returns out (total_q, nheads, headdim), or (out, softmax_lse) with softmax_lse
    (nheads, total_q) float32 (natural log) when return_attn_probs=True.
    """
    varlen = interface.Varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k)
    return _attention(q, k, v, varlen, softmax_scale, causal, qv, q_descale, k_descale, v_descale, window_size,
                      attention_chunk, softcap, num_splits, deterministic, sm_margin, return_attn_probs, learnable_sink,
                      page_table)


def flash_attn_with_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    qv=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens: Optional[Union[int, torch.Tensor]] = None,
    cache_batch_idx: Optional[torch.Tensor] = None,
    cache_leftpad: Optional[torch.Tensor] = None,
    page_table: Optional[torch.Tensor] = None,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_k_new: Optional[torch.Tensor] = None,
    max_seqlen_q: Optional[int] = None,
    rotary_seqlens: Optional[torch.Tensor] = None,
    q_descale: Optional[torch.Tensor] = None,
    k_descale: Optional[torch.Tensor] = None,
    v_descale: Optional[torch.Tensor] = None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    attention_chunk=0,
    softcap=0.0,
    rotary_interleaved=True,
    scheduler_metadata=None,
    num_splits=0,
    pack_gqa=None,
    sm_margin=0,
    return_softmax_lse=False,
):
    """FlashAttention-3's KV-cache attention: q [B, sq, H, d] (or packed [total_q, H, d] with
    cu_seqlens_q and max_seqlen_q) against k_cache/v_cache, dense [B_cache, S, Hkv, d] or paged
    [num_pages, page_size, Hkv, d] with page_table [B, max_pages] (rows of either picked by
    cache_batch_idx, keys starting at cache_leftpad); cache_seqlens (int or int32 [B]) keys cached
    per sequence; k/v [B, s_new, Hkv, d] (or packed [total_new, Hkv, d] with cu_seqlens_k_new)
    appended in place at cache_seqlens first, with rotary (rotary_cos/sin [seqlen_ro, rotary_dim /
    2], rotary_seqlens, rotary_interleaved) on them and on q, as FA3 (the rules are in
    include/flashhopper/flashhopper.h). Returns out, or (out, softmax_lse) with return_softmax_lse.

    The arguments are checked (ValueError naming the argument). The kernels run all of that, split
    over the keys (num_splits; 0 chooses from the shapes), packed queries too; fp8 (float8_e4m3fn q
    and cache with q/k/v_descale [B, Hkv], out bf16), with pages of any size and appends without
    rotary (rotary tables raise FlashHopperNotSupported, a NotImplementedError);
    sm_margin leaves SMs free as flash_attn_func's.
    scheduler_metadata (from get_scheduler_metadata) gives the split-KV count. Under torch.compile
    or torch.export (fake tensors) it runs as the flashhopper::fwd_kvcache op, whose schema marks
    k_cache and v_cache as written."""
    if scheduler_metadata is not None:
        num_splits = _planned_splits(scheduler_metadata, num_splits)
    descales = (q_descale, k_descale, v_descale)
    # A call like an earlier one (the same tensor metadata and options, of the same types) runs the
    # plan that call made, without its checks and conversions again: a decode step's host work.
    call_key = None
    if _call_kind(q, k_cache, v_cache, *descales) != _TRACED:
        tensors = (q, k_cache, v_cache, k, v, qv, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                   cache_leftpad, page_table, cu_seqlens_q, rotary_seqlens, cu_seqlens_k_new, None, None, None, None,
                   *descales)
        if cu_seqlens_k_new is None or k is not None or v is not None:  # else it is dropped: not these tensors
            call_key = interface._plan_key(
                "flash_attn_with_kvcache", tensors, (max_seqlen_q, softmax_scale, causal, window_size, attention_chunk,
                                                     softcap, rotary_interleaved, num_splits, sm_margin,
                                                     return_softmax_lse))
        plan = interface._PLANS.get(call_key) if call_key is not None else None
        if plan is not None:
            return interface.run_kvcache_plan(plan, tensors, bool(return_softmax_lse))
    mask = _memoised(_check_kvcache_options, causal, window_size, softcap, attention_chunk, sm_margin, softmax_scale)
    if isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        if not isinstance(q, torch.Tensor):
            raise interface.invalid_argument(f"q: expected a torch.Tensor, got {type(q).__name__}")
        batch = q.shape[0] if cu_seqlens_q is None else cu_seqlens_q.shape[0] - 1
        cache_seqlens = torch.full((batch,), cache_seqlens, dtype=torch.int32, device=q.device)
    out, softmax_lse = _kvcache_forward(
        q, k_cache, v_cache, mask, softmax_scale, num_splits, k=k, v=v, qv=qv, rotary_cos=rotary_cos,
        rotary_sin=rotary_sin, rotary_seqlens=rotary_seqlens, rotary_interleaved=rotary_interleaved,
        cache_seqlens=cache_seqlens, cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad,
        page_table=page_table, cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_seqlen_q,
        cu_seqlens_k_new=cu_seqlens_k_new, return_lse=bool(return_softmax_lse), sm_margin=sm_margin,
        descales=descales, caller_key=call_key)
    return (out, softmax_lse) if return_softmax_lse else out


_COMBINE_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def flash_attn_combine(out_partial, lse_partial, out=None, out_dtype=None):
    """FlashAttention-3's combine of split-KV partials: out_partial [num_splits, B, sq, H, d] and
    lse_partial [num_splits, B, sq, H] (float32) into (out, softmax_lse): out [B, sq, H, d] in
    out_dtype (default: out's dtype if given, else float32), written into `out` when given, and
    softmax_lse [B, sq, H] float32 (a transposed view of [B, H, sq], as FA3 returns it).
    LSE = log sum_s exp(LSE_s), O = sum_s exp(LSE_s - LSE) O_s; a split with LSE_s = -inf adds
    nothing, and a row that no split saw gets O = 0 and LSE = -inf (never NaN)."""
    for name, t, rank, layout in (("out_partial", out_partial, 5, "[num_splits, B, sq, H, d]"),
                                  ("lse_partial", lse_partial, 4, "[num_splits, B, sq, H]")):
        if not isinstance(t, torch.Tensor):
            raise interface.invalid_argument(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dim() != rank:
            raise interface.invalid_argument(f"{name}: expected {rank} dims {layout}, got shape {tuple(t.shape)}")
        if t.dtype != torch.float32:
            raise interface.invalid_argument(f"{name}: dtype {t.dtype}; split-KV partials are torch.float32")
    if tuple(lse_partial.shape) != tuple(out_partial.shape[:4]):
        raise interface.invalid_argument(f"lse_partial: shape {tuple(lse_partial.shape)} but out_partial's "
                                         f"{tuple(out_partial.shape)} needs {tuple(out_partial.shape[:4])}")
    splits, batch, seqlen, heads, head_dim = out_partial.shape
    if out_dtype is None:
        out_dtype = out.dtype if out is not None else torch.float32
    if out_dtype not in _COMBINE_OUT_DTYPES:
        raise interface.invalid_argument(f"out_dtype: {out_dtype} is not supported (torch.float32, torch.bfloat16 "
                                         "or torch.float16)")
    if out is None:
        out = torch.empty(batch, seqlen, heads, head_dim, dtype=out_dtype, device=out_partial.device)
    elif out.dtype != out_dtype or tuple(out.shape) != (batch, seqlen, heads, head_dim):
        raise interface.invalid_argument(f"out: dtype {out.dtype} shape {tuple(out.shape)}, expected {out_dtype} "
                                         f"{(batch, seqlen, heads, head_dim)}")
    softmax_lse = torch.empty(batch, heads, seqlen, dtype=torch.float32, device=out_partial.device)
    interface.combine(out_partial.permute(0, 1, 3, 2, 4), lse_partial.permute(0, 1, 3, 2), out, softmax_lse)
    return out, softmax_lse.transpose(1, 2)


def get_scheduler_metadata(batch_size, max_seqlen_q, max_seqlen_k, num_heads_q, num_heads_kv, headdim, cache_seqlens,
                           qkv_dtype=torch.bfloat16, headdim_v=None, cu_seqlens_q=None, cu_seqlens_k_new=None,
                           cache_leftpad=None, page_size=None, max_seqlen_k_new=0, causal=False, window_size=(-1, -1),
                           attention_chunk=0, has_softcap=False, num_splits=0, pack_gqa=None, sm_margin=0):
    """FlashAttention-3's scheduling plan for flash_attn_with_kvcache calls of these shapes, to pass
    as its scheduler_metadata. FlashHopper plans a call on the host from its shapes alone (it never
    reads cache_seqlens or other device memory to do so, so a CUDA graph stays valid), and there is
    nothing to precompute on the GPU: the plan is the split-KV count, num_splits (0: the library's
    choice, which is the same for every call of these shapes), as an int32 CPU tensor of shape [1].
    The arguments are checked as flash_attn_with_kvcache checks them (ValueError naming the
    argument; NotImplementedError for what FlashHopper cannot run: fp8 other than float8_e4m3fn).
    pack_gqa is a hint and is ignored; so is sm_margin (the call's own sm_margin applies when the
    library chooses)."""
    sizes = {"batch_size": batch_size, "max_seqlen_q": max_seqlen_q, "num_heads_q": num_heads_q,
             "num_heads_kv": num_heads_kv, "headdim": headdim}
    for name, value in sizes.items():  # each is a tensor extent below, which must exist
        if interface._int_option(name, value, "it") < 1:
            raise interface.invalid_argument(f"{name}: is {value}; must be at least 1")
    for name, value in (("max_seqlen_k", max_seqlen_k), ("max_seqlen_k_new", max_seqlen_k_new)):
        if interface._int_option(name, value, "it") < 0:
            raise interface.invalid_argument(f"{name}: is {value}; must be at least 0")
    if headdim_v is not None and interface._int_option("headdim_v", headdim_v, "it") < 1:
        raise interface.invalid_argument(f"headdim_v: is {headdim_v}; must be at least 1")
    if page_size is not None and interface._int_option("page_size", page_size, "it") < 1:
        raise interface.invalid_argument(f"page_size: is {page_size}; must be at least 1")
    if not isinstance(qkv_dtype, torch.dtype):
        raise interface.invalid_argument(f"qkv_dtype: expected a torch.dtype, got {type(qkv_dtype).__name__}")
    if qkv_dtype in interface._FP8_DTYPES and qkv_dtype not in interface._DTYPES:
        _not_yet("qkv_dtype", qkv_dtype, "fp8 attention other than torch.float8_e4m3fn (FA3's)")
    splits = interface._int_option("num_splits", num_splits, "it")
    mask = interface.check_mask_args(causal, window_size, 0.0, attention_chunk)
    # The rest is the call's: the library checks the tensors these sizes describe (meta tensors:
    # nothing is allocated), as flash_attn_with_kvcache would, naming them.
    dv = headdim if headdim_v is None else headdim_v
    q_rows = (batch_size * max_seqlen_q,) if cu_seqlens_q is not None else (batch_size, max_seqlen_q)
    if page_size is not None:  # pages enough for every sequence's keys
        pages = -(-max(max_seqlen_k, 1) // page_size)
        page_table = torch.empty(batch_size, pages, dtype=torch.int32, device="meta")
        cache_batch, cache_rows = batch_size * pages, page_size
    else:
        page_table = None
        cache_batch, cache_rows = batch_size, max(max_seqlen_k, 1)

    def meta(*shape, dtype=qkv_dtype):
        return torch.empty(shape, dtype=dtype, device="meta")

    interface.forward_with_kvcache(
        meta(*q_rows, num_heads_q, headdim), meta(cache_batch, cache_rows, num_heads_kv, headdim),
        meta(cache_batch, cache_rows, num_heads_kv, dv), cache_seqlens=cache_seqlens, cache_leftpad=cache_leftpad,
        page_table=page_table, cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_seqlen_q, mask=mask, num_splits=splits,
        sm_margin=sm_margin, check_only=True)
    return torch.tensor([splits], dtype=torch.int32)


def _planned_splits(scheduler_metadata, num_splits: int) -> int:
    """The split-KV count of get_scheduler_metadata's plan; num_splits, if given (not 0), must agree."""
    if not (isinstance(scheduler_metadata, torch.Tensor) and scheduler_metadata.dtype == torch.int32
            and tuple(scheduler_metadata.shape) == (1,) and scheduler_metadata.device.type == "cpu"):
        raise interface.invalid_argument("scheduler_metadata: expected the plan get_scheduler_metadata returns (an "
                                         "int32 CPU tensor of shape [1])")
    planned = int(scheduler_metadata[0])
    if isinstance(num_splits, int) and num_splits not in (0, planned):
        raise interface.invalid_argument(f"num_splits: {num_splits} differs from scheduler_metadata's {planned}; "
                                         "give one of them")
    return planned


# ---------------------------------------------------------------------------------------------------
# FA3's private entry points (hopper/flash_attn_interface.py: _flash_attn_forward, _flash_attn_backward),
# which ring-attention libraries and FA3's own tests call directly: FA3's parameter names (its
# `sequed_q` spelling included), defaults and returns, over the public functions above. They build
# no autograd graph: their callers write their own backward.

def _cache_call(k_new, v_new, page_table, kv_batch_idx, leftpad_k, rotary_cos, rotary_sin, cu_seqlens_k_new,
                seqused_k, cu_seqlens_k) -> bool:
    """FA3's fwd is one entry for both: a call with any KV-cache argument (or seqused_k over dense
    keys, FA3's cache_seqlens) is flash_attn_with_kvcache's; page_table with cu_seqlens_k (and no
    other) is flash_attn_varlen_func's over paged keys."""
    cache_args = (k_new, v_new, kv_batch_idx, leftpad_k, rotary_cos, rotary_sin, cu_seqlens_k_new)
    if page_table is not None and cu_seqlens_k is not None and all(t is None for t in cache_args):
        return False
    return any(t is not None for t in cache_args + (page_table,)) or (seqused_k is not None and cu_seqlens_k is None)


def _flash_attn_forward(q, k, v, k_new=None, v_new=None, qv=None, out_=None, cu_seqlens_q=None, cu_seqlens_k=None,
                        cu_seqlens_k_new=None, seqused_q=None, seqused_k=None, max_seqlen_q=None, max_seqlen_k=None,
                        page_table=None, kv_batch_idx=None, leftpad_k=None, rotary_cos=None, rotary_sin=None,
                        seqlens_rotary=None, q_descale=None, k_descale=None, v_descale=None, softmax_scale=None,
                        causal=False, window_size_left=-1, window_size_right=-1, attention_chunk=0, softcap=0.0,
                        rotary_interleaved=True, scheduler_metadata=None, num_splits=1, pack_gqa=None, sm_margin=0):
    """FlashAttention-3's _flash_attn_forward: returns (out, softmax_lse, out_accum, softmax_lse_accum).

    out and softmax_lse as flash_attn_func / flash_attn_varlen_func / flash_attn_with_kvcache
    return them (which of the three runs: a call with k_new, v_new, page_table, kv_batch_idx,
    leftpad_k, rotary tables, cu_seqlens_k_new, or seqused_k without cu_seqlens_k is a KV-cache
    call, with seqused_k as cache_seqlens; else cu_seqlens_q/k make it packed, over paged keys with
    page_table, else dense). out_,
    when given, receives out (a copy) and is returned. out_accum and softmax_lse_accum, FA3's
    split-KV partials, are empty float32 tensors: FlashHopper combines the splits inside the call
    and keeps no partials. Arguments FlashHopper cannot honour raise as the public functions do."""
    window = (window_size_left, window_size_right)
    with torch.no_grad():
        if _cache_call(k_new, v_new, page_table, kv_batch_idx, leftpad_k, rotary_cos, rotary_sin, cu_seqlens_k_new,
                       seqused_k, cu_seqlens_k):
            for name, value in (("cu_seqlens_k", cu_seqlens_k), ("seqused_q", seqused_q)):
                if value is not None:
                    _not_yet(name, "<tensor>", "a KV-cache call with " + name)
            out, softmax_lse = flash_attn_with_kvcache(
                q, k, v, k=k_new, v=v_new, qv=qv, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
                cache_seqlens=seqused_k, cache_batch_idx=kv_batch_idx, cache_leftpad=leftpad_k, page_table=page_table,
                cu_seqlens_q=cu_seqlens_q, cu_seqlens_k_new=cu_seqlens_k_new, max_seqlen_q=max_seqlen_q,
                rotary_seqlens=seqlens_rotary, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
                softmax_scale=softmax_scale, causal=causal, window_size=window, attention_chunk=attention_chunk,
                softcap=softcap, rotary_interleaved=rotary_interleaved, scheduler_metadata=scheduler_metadata,
                num_splits=num_splits, pack_gqa=pack_gqa, sm_margin=sm_margin, return_softmax_lse=True)
        else:
            if scheduler_metadata is not None:
                num_splits = _planned_splits(scheduler_metadata, num_splits)
            options = dict(softmax_scale=softmax_scale, causal=causal, qv=qv, q_descale=q_descale,
                           k_descale=k_descale, v_descale=v_descale, window_size=window,
                           attention_chunk=attention_chunk, softcap=softcap, num_splits=num_splits,
                           pack_gqa=pack_gqa, sm_margin=sm_margin, return_attn_probs=True)
            if any(t is not None for t in (cu_seqlens_q, cu_seqlens_k, seqused_q, max_seqlen_q, max_seqlen_k)):
                out, softmax_lse = flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                          max_seqlen_k, seqused_q=seqused_q, seqused_k=seqused_k,
                                                          page_table=page_table, **options)
            else:
                out, softmax_lse = flash_attn_func(q, k, v, **options)
        if out_ is not None:
            if not isinstance(out_, torch.Tensor) or out_.shape != out.shape or out_.dtype != out.dtype or \
                    out_.device != out.device:
                raise interface.invalid_argument(
                    f"out_: expected a {out.dtype} tensor of shape {tuple(out.shape)} on {out.device}, got "
                    + (f"{out_.dtype} {tuple(out_.shape)} on {out_.device}" if isinstance(out_, torch.Tensor)
                       else type(out_).__name__))
            out = out_.copy_(out)
    no_partials = torch.empty(0, dtype=torch.float32, device=out.device)
    return out, softmax_lse, no_partials, no_partials.clone()


def _flash_attn_backward(dout, q, k, v, out, softmax_lse, cu_seqlens_q=None, cu_seqlens_k=None, sequed_q=None,
                         sequed_k=None, max_seqlen_q=None, max_seqlen_k=None, dq=None, dk=None, dv=None,
                         softmax_scale=None, is_causal=False, window_size_left=-1, window_size_right=-1, softcap=0.0,
                         deterministic=False, sm_margin=0):
    """FlashAttention-3's _flash_attn_backward: writes dq, dk, dv (allocated here when None, as FA3
    does, though the caller then never sees them) and returns softmax_d, float32, the rows' sums
    of dout * out: [B, Hq, sq], packed [Hq, total_q]. (FA3's rounds the row axis up to its tile:
    read the first sq rows of its softmax_d, which are these.) sequed_q/sequed_k are FA3's
    spelling of seqused_q/k; the packed layout follows from cu_seqlens_q/k as in
    flash_attn_varlen_func."""
    interface.check_sm_margin(sm_margin)
    causal, window_left, window_right, softcap, _ = interface.check_mask_args(
        is_causal, (window_size_left, window_size_right), softcap, 0)
    varlen = interface.as_varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, sequed_q, sequed_k)
    if isinstance(dout, torch.Tensor) and dout.dim() > 0 and dout.stride(-1) != 1:
        dout = dout.contiguous()  # as FA3: the kernels read rows of d contiguous values
    with torch.no_grad():
        dq = torch.empty_like(q) if dq is None else dq
        dk = torch.empty_like(k) if dk is None else dk
        dv = torch.empty_like(v) if dv is None else dv
        interface.backward(dout, q, k, v, out, softmax_lse, causal, softmax_scale, bool(deterministic), dq, dk, dv,
                           window_size=(window_left, window_right), softcap=softcap, varlen=varlen,
                           sm_margin=sm_margin)
        softmax_d = (dout.float() * out.float()).sum(-1)  # [B, sq, Hq] or [total_q, Hq]
    return softmax_d.transpose(-1, -2).contiguous()
