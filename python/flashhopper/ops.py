"""torch.library custom ops over the C ABI, so that autograd, torch.compile (fullgraph) and CUDA
graphs see one opaque op per pass:

    torch.ops.flashhopper.fwd(q, k, v, softmax_scale=None, causal=False, deterministic=False,
                              window_left=-1, window_right=-1, softcap=0.0, attention_chunk=0,
                              learnable_sink=None, cu_seqlens_q=None, cu_seqlens_k=None,
                              max_seqlen_q=None, max_seqlen_k=None, seqused_q=None, seqused_k=None,
                              num_splits=1, sm_margin=0, q_descale=None, k_descale=None, v_descale=None)
        -> (out [B, sq, Hq, d], lse [B, Hq, sq] float32), varlen (out [total_q, Hq, d], lse [Hq, total_q])
    torch.ops.flashhopper.bwd(dout, q, k, v, out, lse, softmax_scale=None, causal=False,
                              deterministic=False, window_left=-1, window_right=-1, softcap=0.0,
                              attention_chunk=0, learnable_sink=None, cu_seqlens_q=None,
                              cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                              seqused_q=None, seqused_k=None, sm_margin=0)
        -> (dq, dk, dv, dsink)

    torch.ops.flashhopper.fwd_kvcache(q, k_cache, v_cache, k_new=None, v_new=None, qv=None,
                                      rotary_cos=None, rotary_sin=None, rotary_seqlens=None,
                                      rotary_interleaved=True, cache_seqlens=None, cache_batch_idx=None,
                                      cache_leftpad=None, page_table=None, cu_seqlens_q=None,
                                      max_seqlen_q=None, softmax_scale=None, causal=False, window_left=-1,
                                      window_right=-1, softcap=0.0, attention_chunk=0, num_splits=0,
                                      cu_seqlens_k_new=None, cu_seqlens_k=None, max_seqlen_k=None,
                                      seqused_q=None, seqused_k=None, learnable_sink=None, sm_margin=0,
                                      q_descale=None, k_descale=None, v_descale=None)
        -> (out, lse), as interface.forward_with_kvcache with return_lse; it appends k_new/v_new
        into k_cache/v_cache in place (both marked mutated), so that flash_attn_with_kvcache can be
        traced (torch.compile, torch.export). Forward only; Python only (no C++ op yet).

The options added after `deterministic` come last so that positional calls written for the first
six arguments keep their meaning. cu_seqlens_q/k (int32 [B + 1]), max_seqlen_q/k (ints) and the
optional seqused_q/k (int32 [B]) select FlashAttention's packed (varlen) layout, as
interface.Varlen describes: q [total_q, Hq, d], k/v [total_k, Hkv, d]; all of them None is the
dense layout; they get no gradient. The mask follows FlashAttention-3: window (left, right)
bottom-right aligned (within each sequence), -1 unbounded, causal forces right = 0, a bound
covering the whole sequence (max_seqlen in the packed layout) is no bound; attention_chunk c > 0
restricts each row to its chunk of c keys on top of the window; softcap > 0 caps the scores
(softcap * tanh(s / softcap)); learnable_sink (float32 [Hq], or None) adds exp(sink[h]) to every
row's softmax denominator, and lse includes it; fwd's num_splits splits the keys (split-KV, as
interface.forward; 0 lets the library choose), which changes nothing in bwd; sm_margin (both ops)
leaves that many SMs free for other kernels (FA3's argument); q/k/v_descale (float32 [B, Hkv]) are
fp8's factors (float8_e4m3fn q, k, v give a bf16 out; forward only, as in FA3: a gradient through
such a call is refused by the library's backward rule). bwd always returns four
tensors: dsink is float32 [Hq] (d loss / d learnable_sink, summed over batch and rows) when
learnable_sink is given and an empty float32 tensor of shape [0] otherwise.

fwd's `deterministic` does nothing in the forward (which is always deterministic); autograd hands
it to bwd (or'ed with torch.are_deterministic_algorithms_enabled()). lse is marked
non-differentiable: a loss that uses it gets no gradient through it (FlashAttention-3 drops that
gradient silently). learnable_sink gets a gradient when it requires one. Both ops allocate their
outputs with PyTorch's caching allocator and launch on torch.cuda.current_stream(); neither
synchronises with the host. bwd accepts dout in any layout (autograd may hand over an expanded or
unaligned one) and copies it when the kernels need that; every other argument must already satisfy
the kernels' layout rules (see interface.py).

Two implementations of the CUDA kernels, one library call underneath (the C ABI):
- C++ (src/torch/ops.cpp, libflashhopper_torch.so next to libflashhopper.so), registered through
  PyTorch's stable ABI: what AOTInductor's runtime can call, and less host work. Used when present
  (a build against torch >= 2.9) unless FLASHHOPPER_TORCH_OPS=0; then the C++ side owns the schemas.
- Python (below, over interface.forward / backward): the fallback, with the same schemas.
`NATIVE` says which one runs. The CPU kernels, the fake functions and autograd are Python in both
cases. Errors from the C++ kernels reach Python as RuntimeError("flashhopper (<status>): ...");
`fwd` and `bwd` here re-raise them as the Python layer's classes (interface.FlashHopperError...).
"""
import logging
import os
from typing import NamedTuple, Optional

import torch

from . import _ffi, interface

Tensor = torch.Tensor

_NUM_FWD_INPUTS = 22
_SINK_INPUT = 10  # learnable_sink's position among fwd's inputs


_log = logging.getLogger(__name__)

# The schemas' one home is op_schemas.py (the C++ registration, where it runs, owns the ops).
from .op_schemas import BWD_SCHEMA, FWD_SCHEMA  # noqa: E402


def _fwd_python(q: Tensor, k: Tensor, v: Tensor, softmax_scale: Optional[float] = None, causal: bool = False,
                deterministic: bool = False, window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
                attention_chunk: int = 0, learnable_sink: Optional[Tensor] = None,
                cu_seqlens_q: Optional[Tensor] = None, cu_seqlens_k: Optional[Tensor] = None,
                max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None, seqused_q: Optional[Tensor] = None,
                seqused_k: Optional[Tensor] = None, num_splits: int = 1, sm_margin: int = 0,
                q_descale: Optional[Tensor] = None, k_descale: Optional[Tensor] = None,
                v_descale: Optional[Tensor] = None, *, caller_key=None) -> tuple[Tensor, Tensor]:
    """The op's kernel (caller_key: interface.forward's, for eager calls)."""
    varlen = interface.as_varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k)
    out, lse = interface.forward(q, k, v, causal=causal, softmax_scale=softmax_scale, return_lse=True,
                                 window_size=(window_left, window_right), softcap=softcap,
                                 attention_chunk=attention_chunk, learnable_sink=learnable_sink, varlen=varlen,
                                 num_splits=num_splits, sm_margin=sm_margin, q_descale=q_descale,
                                 k_descale=k_descale, v_descale=v_descale, caller_key=caller_key)
    return out, lse


def _fwd_fake(q, k, v, softmax_scale=None, causal=False, deterministic=False, window_left=-1, window_right=-1,
              softcap=0.0, attention_chunk=0, learnable_sink=None, cu_seqlens_q=None, cu_seqlens_k=None,
              max_seqlen_q=None, max_seqlen_k=None, seqused_q=None, seqused_k=None, num_splits=1, sm_margin=0,
              q_descale=None, k_descale=None, v_descale=None):
    varlen = interface.as_varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k)
    mask = interface.check_mask_args(causal, (window_left, window_right), softcap, attention_chunk)
    interface.check_forward(q, k, v, return_lse=True, learnable_sink=learnable_sink, varlen=varlen,
                            softmax_scale=softmax_scale, mask=mask, num_splits=num_splits, sm_margin=sm_margin,
                            descales=(q_descale, k_descale, v_descale))
    out = q.new_empty((*q.shape[:-1], v.shape[-1]), dtype=interface.output_dtype(q))
    lse = q.new_empty(interface.lse_shape(q), dtype=torch.float32)
    return out, lse


KVCACHE_SCHEMA = ("fwd_kvcache(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor? k_new=None, "
                  "Tensor? v_new=None, Tensor? qv=None, Tensor? rotary_cos=None, Tensor? rotary_sin=None, "
                  "Tensor? rotary_seqlens=None, bool rotary_interleaved=True, Tensor? cache_seqlens=None, "
                  "Tensor? cache_batch_idx=None, Tensor? cache_leftpad=None, Tensor? page_table=None, "
                  "Tensor? cu_seqlens_q=None, SymInt? max_seqlen_q=None, float? softmax_scale=None, "
                  "bool causal=False, SymInt window_left=-1, SymInt window_right=-1, float softcap=0., "
                  "SymInt attention_chunk=0, SymInt num_splits=0, Tensor? cu_seqlens_k_new=None, "
                  "Tensor? cu_seqlens_k=None, SymInt? max_seqlen_k=None, Tensor? seqused_q=None, "
                  "Tensor? seqused_k=None, Tensor? learnable_sink=None, SymInt sm_margin=0, Tensor? q_descale=None, "
                  "Tensor? k_descale=None, Tensor? v_descale=None) -> (Tensor, Tensor)")


def _fwd_kvcache_python(q, k_cache, v_cache, k_new=None, v_new=None, qv=None, rotary_cos=None, rotary_sin=None,
                        rotary_seqlens=None, rotary_interleaved=True, cache_seqlens=None, cache_batch_idx=None,
                        cache_leftpad=None, page_table=None, cu_seqlens_q=None, max_seqlen_q=None, softmax_scale=None,
                        causal=False, window_left=-1, window_right=-1, softcap=0.0, attention_chunk=0, num_splits=0,
                        cu_seqlens_k_new=None, cu_seqlens_k=None, max_seqlen_k=None, seqused_q=None, seqused_k=None,
                        learnable_sink=None, sm_margin=0, q_descale=None, k_descale=None, v_descale=None,
                        check_only=False):
    """The op's call (check_only: its argument checks alone, the fake function's)."""
    mask = interface.check_mask_args(causal, (window_left, window_right), softcap, attention_chunk)
    return interface.forward_with_kvcache(
        q, k_cache, v_cache, k_new=k_new, v_new=v_new, qv=qv, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
        rotary_seqlens=rotary_seqlens, rotary_interleaved=rotary_interleaved, cache_seqlens=cache_seqlens,
        cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad, page_table=page_table, cu_seqlens_q=cu_seqlens_q,
        max_seqlen_q=max_seqlen_q, softmax_scale=softmax_scale, mask=mask, num_splits=num_splits, return_lse=True,
        cu_seqlens_k_new=cu_seqlens_k_new, cu_seqlens_k=cu_seqlens_k, max_seqlen_k=max_seqlen_k, seqused_q=seqused_q,
        seqused_k=seqused_k, learnable_sink=learnable_sink, sm_margin=sm_margin, check_only=check_only,
        descales=(q_descale, k_descale, v_descale))


def _fwd_kvcache_fake(q, k_cache, v_cache, *args, **kwargs):
    _fwd_kvcache_python(q, k_cache, v_cache, *args, check_only=True, **kwargs)
    out = q.new_empty((*q.shape[:-1], v_cache.shape[-1]), dtype=interface.output_dtype(q))
    lse = q.new_empty(interface.lse_shape(q), dtype=torch.float32)
    return out, lse


def _normalize_dout(dout: Tensor) -> Tensor:
    if not interface.layout_ok(dout):
        return dout.contiguous()
    return dout


def _no_dsink(q: Tensor) -> Tensor:
    return q.new_empty((0,), dtype=torch.float32)


def _bwd_python(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                softmax_scale: Optional[float] = None, causal: bool = False, deterministic: bool = False,
                window_left: int = -1, window_right: int = -1, softcap: float = 0.0, attention_chunk: int = 0,
                learnable_sink: Optional[Tensor] = None, cu_seqlens_q: Optional[Tensor] = None,
                cu_seqlens_k: Optional[Tensor] = None, max_seqlen_q: Optional[int] = None,
                max_seqlen_k: Optional[int] = None, seqused_q: Optional[Tensor] = None,
                seqused_k: Optional[Tensor] = None, sm_margin: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    varlen = interface.as_varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k)
    dout = _normalize_dout(dout)
    if dout.data_ptr() % 16 != 0:
        dout = dout.clone(memory_format=torch.contiguous_format)
    grads = interface.backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=softmax_scale,
                               deterministic=deterministic, window_size=(window_left, window_right),
                               softcap=softcap, attention_chunk=attention_chunk, learnable_sink=learnable_sink,
                               varlen=varlen, sm_margin=sm_margin)
    if learnable_sink is None:
        return (*grads, _no_dsink(q))
    return grads


def _bwd_fake(dout, q, k, v, out, lse, softmax_scale=None, causal=False, deterministic=False, window_left=-1,
              window_right=-1, softcap=0.0, attention_chunk=0, learnable_sink=None, cu_seqlens_q=None,
              cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, seqused_q=None, seqused_k=None, sm_margin=0):
    varlen = interface.as_varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k)
    mask = interface.check_mask_args(causal, (window_left, window_right), softcap, attention_chunk)
    interface.check_backward(dout, q, k, v, out, lse, learnable_sink=learnable_sink, varlen=varlen,
                             softmax_scale=softmax_scale, mask=mask, deterministic=deterministic, sm_margin=sm_margin,
                             dout_made_contiguous=True)
    if learnable_sink is None:
        dsink = _no_dsink(q)
    else:
        dsink = q.new_empty((q.shape[-2],), dtype=torch.float32)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dsink


def _setup_context(ctx, inputs, output):
    out, lse = output  # inputs[10]: learnable_sink; 11, 12, 15, 16: cu_seqlens_q/k, seqused_q/k
    _save(ctx, inputs[0], inputs[1], inputs[2], out, lse, inputs[10], (inputs[11], inputs[12], inputs[15], inputs[16]),
          saved_options(inputs))


def saved_options(inputs) -> tuple:
    """What the backward takes of fwd's inputs besides tensors (ctx.options): softmax_scale, causal,
    deterministic, window_left/right, softcap, attention_chunk (3-9), max_seqlen_q/k, sm_margin."""
    return (*inputs[3:10], inputs[13], inputs[14], inputs[18])


def _save(ctx, q, k, v, out, lse, learnable_sink, varlen_tensors, options):
    """What _gradients reads: the tensors, and the options as one attribute, not ten (each is a
    store on every eager call)."""
    ctx.save_for_backward(q, k, v, out, lse, learnable_sink, *varlen_tensors)
    ctx.options = options
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)  # no zero-filled gradient for lse


def _gradients(ctx, dout):
    """(dq, dk, dv, dsink) of the forward whose inputs _setup_context saved, by the bwd op."""
    q, k, v, out, lse, learnable_sink, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k = ctx.saved_tensors
    (softmax_scale, causal, deterministic, window_left, window_right, softcap, attention_chunk, max_seqlen_q,
     max_seqlen_k, sm_margin) = ctx.options
    deterministic = bool(deterministic) or torch.are_deterministic_algorithms_enabled()
    return bwd(dout, q, k, v, out, lse, softmax_scale, causal, deterministic, window_left, window_right, softcap,
               attention_chunk, learnable_sink, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q,
               seqused_k, sm_margin)


def _backward(ctx, dout, dlse):
    """The fwd op's backward: one gradient for each of its 22 inputs."""
    grads = [None] * _NUM_FWD_INPUTS
    if dout is not None:
        dq, dk, dv, dsink = _gradients(ctx, dout)
        grads[:3] = dq, dk, dv
        needs = ctx.needs_input_grad  # as long as the call's arguments (defaults left out)
        if len(needs) > _SINK_INPUT and needs[_SINK_INPUT]:
            grads[_SINK_INPUT] = dsink
    return tuple(grads)


class _EagerAttention(torch.autograd.Function):
    """The fwd op's autograd (_setup_context, _gradients, which runs the bwd op) around its Python
    kernel, for eager calls that need a gradient: torch.library's autograd wrapper of the op costs
    several times the call itself in host work (bench/RESULTS.md, host work). Traced calls keep the
    op, which is what torch.compile and torch.export see. Function.apply's own work grows with its
    arguments (with a separate setup_context it also binds them through inspect.signature), so it
    takes the four that can need a gradient and the rest as one argument, and forward takes ctx:
    (the other inputs, caller_key) for a first call, or the _Replay of an earlier call like it."""
    @staticmethod
    def forward(ctx, q, k, v, learnable_sink, call):
        if type(call) is _Replay:
            out, lse = interface.run_forward_plan(call.plan, q, k, v, learnable_sink, call.varlen, True)
            _save(ctx, q, k, v, out, lse, learnable_sink, interface._varlen_fields(call.varlen) or interface._DENSE,
                  call.saved_options)
            return out, lse
        options, caller_key = call
        inputs = (q, k, v, *options[:_SINK_INPUT - 3], learnable_sink, *options[_SINK_INPUT - 3:])
        output = _fwd_python(*inputs, caller_key=caller_key)
        _setup_context(ctx, inputs, output)
        return output

    @staticmethod
    def backward(ctx, dout, dlse):
        if dout is None:
            return None, None, None, None, None
        dq, dk, dv, dsink = _gradients(ctx, dout)
        return dq, dk, dv, (dsink if ctx.needs_input_grad[3] else None), None


def fwd_eager(*args, caller_key=None) -> tuple[Tensor, Tensor]:
    """fwd's inputs (positional: the first 19, or all 22 with the descales) -> (out, lse), as fwd
    with autograd, for eager calls; caller_key as interface.forward's."""
    options = args[3:_SINK_INPUT] + args[_SINK_INPUT + 1:]
    return _EagerAttention.apply(args[0], args[1], args[2], args[_SINK_INPUT], (options, caller_key))


class _Replay(NamedTuple):
    plan: object          # interface.forward's plan (return_lse), from an earlier call like this one
    saved_options: tuple  # saved_options of that call's inputs
    varlen: Optional[interface.Varlen]


def fwd_replay(plan, saved_options, q, k, v, learnable_sink, varlen) -> tuple[Tensor, Tensor]:
    """fwd_eager for a call like an earlier one whose plan (under caller_key) and saved_options it
    gives: that call's checks and conversions passed, so only the library call and autograd's
    bookkeeping run."""
    return _EagerAttention.apply(q, k, v, learnable_sink, _Replay(plan, saved_options, varlen))


def _load_native() -> bool:
    """Loads libflashhopper_torch.so from beside the C ABI library when it is there (and
    FLASHHOPPER_TORCH_OPS is not 0); True when its ops are registered."""
    if os.environ.get("FLASHHOPPER_TORCH_OPS", "1") == "0":
        return False
    path = _ffi.torch_ops_library()
    if path is None:
        return False
    _ffi.lib()  # libflashhopper.so first, the one this package uses, which the ops library links
    try:
        torch.ops.load_library(path)
    except (OSError, RuntimeError) as e:
        _log.warning("flashhopper: the C++ ops in %s do not load (%s); using the Python ops", path, e)
        return False
    return True


NATIVE = _load_native()
_library = torch.library.Library("flashhopper", "FRAGMENT")
if not NATIVE:
    _library.define(FWD_SCHEMA)
    _library.define(BWD_SCHEMA)
    _library.impl("fwd", _fwd_python, "CUDA")
    _library.impl("bwd", _bwd_python, "CUDA")
# Host tensors: the Python checks name what is wrong (the device among the rest).
_library.impl("fwd", _fwd_python, "CPU")
_library.impl("bwd", _bwd_python, "CPU")
torch.library.register_fake("flashhopper::fwd", _fwd_fake, lib=_library)
torch.library.register_fake("flashhopper::bwd", _bwd_fake, lib=_library)
torch.library.register_autograd("flashhopper::fwd", _backward, setup_context=_setup_context, lib=_library)
_library.define(KVCACHE_SCHEMA)
_library.impl("fwd_kvcache", _fwd_kvcache_python, "CUDA")
_library.impl("fwd_kvcache", _fwd_kvcache_python, "CPU")  # host tensors: the checks name what is wrong
torch.library.register_fake("flashhopper::fwd_kvcache", _fwd_kvcache_fake, lib=_library)


def _raised_as_python(error: RuntimeError) -> Exception:
    """A C++ kernel's RuntimeError("flashhopper (<status>): <message>") as the Python layer raises
    it (FlashHopperInvalidArgument, FlashHopperNotSupported, FlashHopperError); others unchanged."""
    if isinstance(error, interface.FlashHopperError):
        return error
    text = str(error)
    for status, name in _ffi.STATUS_NAMES.items():
        prefix = f"flashhopper ({name}): "
        if status and text.startswith(prefix):
            return interface.library_error(status, text[len(prefix):])
    return error


def _calls(op):
    def call(*args):
        if torch.compiler.is_compiling():
            return op(*args)
        try:
            return op(*args)
        except RuntimeError as error:
            raised = _raised_as_python(error)
            if raised is error:
                raise
            raise raised from None
    call.__doc__ = f"{op}, with the library's errors raised as the Python layer's classes"
    return call


fwd = _calls(torch.ops.flashhopper.fwd.default)
bwd = _calls(torch.ops.flashhopper.bwd.default)
fwd_kvcache = _calls(torch.ops.flashhopper.fwd_kvcache.default)
