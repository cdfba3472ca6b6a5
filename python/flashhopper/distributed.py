"""Context parallelism: attention over a sequence sharded across the ranks of a torch.distributed
process group, forward and backward, as a thin layer over the kernels.

    out = ring_attention(q, k, v, group, causal=True)

Each rank passes its shard of one sequence batch: q [B, s, Hq, d], k and v [B, s, Hkv, d], the
same s on every rank. Shard the full sequence with `zigzag_shard` (two chunks a rank, one from
each end: with a causal mask every rank then does the same work) or take contiguous slices
(layout="contiguous"; fine without a mask); `zigzag_unshard` puts the outputs back in order.

Two strategies, one result:
- "ring" (the default): the K/V shards travel around the ring, one hop a step, by batched P2P
  sends (torch.distributed.batch_isend_irecv) that overlap each step's attention; the partial
  (out, lse) of each step are merged by their log-sum-exp. The backward sends K/V around again
  with their dK/dV accumulating beside them, which come home after the last step.
- "all_gather": K and V gathered once (all_gather_into_tensor), the local queries attend to the
  keys they see, dK/dV go back to their owners by reduce_scatter_tensor. Fewer, larger transfers:
  good where K/V are small (GQA with few KV heads).

The attention of a step runs on `StepKernels` (default: the library's forward and backward,
flashhopper.interface; the CPU tests pass a float64 PyTorch implementation). Full and causal
attention run on both strategies, a sliding window (window_size) on all_gather; softcap, chunks
and learnable sinks are not taken.
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch
import torch.distributed as dist

from . import interface

_LAYOUTS = ("zigzag", "contiguous")
_STRATEGIES = ("ring", "all_gather")


class StepKernels(NamedTuple):
    """The attention of one block pair: forward(q, k, v, causal, softmax_scale, varlen=None,
    window_size=(-1, -1)) -> (out, lse float32 [B, Hq, sq]); backward(dout, q, k, v, out, lse,
    causal, softmax_scale, varlen=None, window_size=(-1, -1)) -> (dq, dk, dv) where out and lse are
    the whole row's (the merged ones), as FlashAttention's backward takes them. causal and the
    window are aligned bottom-right (flash_attn_func's); a causal call here has sq == sk. varlen:
    None (dense), or an interface.Varlen over packed q [total, Hq, d], k/v [total, Hkv, d] (lse
    [Hq, total]), whose seqused_q/k pick the first rows or keys of each sequence: rows and keys it
    leaves out may hold anything (the ring masks them)."""
    forward: Callable
    backward: Callable


def _library_forward(q, k, v, causal, softmax_scale, varlen=None, window_size=(-1, -1)):
    return interface.forward(q, k, v, causal, softmax_scale, return_lse=True, varlen=varlen, window_size=window_size)


def _library_backward(dout, q, k, v, out, lse, causal, softmax_scale, varlen=None, window_size=(-1, -1)):
    # lse arrives as a slice of the shard's rows (strided); the kernels' row statistics are compact.
    return interface.backward(dout, q, k, v, out, lse.contiguous(), causal, softmax_scale, varlen=varlen,
                              window_size=window_size)


LIBRARY_KERNELS = StepKernels(_library_forward, _library_backward)


# ---- sharding ------------------------------------------------------------------------------------

def _chunks(x: torch.Tensor, parts: int, dim: int):
    if x.shape[dim] % parts:
        raise interface.invalid_argument(f"x: shape[{dim}] is {x.shape[dim]}, not a multiple of {parts} "
                                         f"(2 x world_size chunks of equal length)")
    return x.chunk(parts, dim)


def zigzag_shard(x: torch.Tensor, rank: int, world_size: int, dim: int = 1) -> torch.Tensor:
    """rank's shard of the full sequence x (its length a multiple of 2 * world_size): chunks rank
    and 2 * world_size - 1 - rank of 2 * world_size equal chunks along dim, in that order."""
    chunks = _chunks(x, 2 * world_size, dim)
    return torch.cat([chunks[rank], chunks[2 * world_size - 1 - rank]], dim=dim)


def zigzag_unshard(shards, dim: int = 1) -> torch.Tensor:
    """The full sequence from every rank's zigzag shard (in rank order): the inverse of
    zigzag_shard."""
    world_size = len(shards)
    halves = [s.chunk(2, dim) for s in shards]
    ordered = [halves[r][0] for r in range(world_size)] + [halves[r][1] for r in reversed(range(world_size))]
    return torch.cat(ordered, dim=dim)


# ---- the block pairs of one step -----------------------------------------------------------------

_ALL = slice(None)


class _Step(NamedTuple):
    """One step's call: the local queries' rows and the held keys' cols passed to the kernels (dense
    shards: slices), whether the diagonal mask applies (the two are the same chunks), and for
    packed shards the Varlen of the call with the rows and keys it covers (bool masks; None: all)."""
    rows: slice
    cols: slice
    causal: bool
    varlen: Optional[interface.Varlen] = None
    row_mask: Optional[torch.Tensor] = None
    key_mask: Optional[torch.Tensor] = None


class _DenseShards:
    """Shards [B, s, H, d] of one sequence batch. Contiguous layout: rank r holds positions
    [r s, (r + 1) s). Zigzag: chunks r and 2W - 1 - r (each s / 2 long); a query chunk sees a key
    chunk whole when it comes later in the sequence, causally when it is the same, not at all when
    it comes earlier."""

    def __init__(self, rank: int, shard_len: int, layout: str):
        self.rank, self.shard_len, self.layout = rank, shard_len, layout

    def step(self, src: int, causal: bool) -> Optional[_Step]:
        """The block pair of the local queries and the keys of rank src (None: no query sees them)."""
        if not causal:
            return _Step(_ALL, _ALL, False)
        if src == self.rank:
            return _Step(_ALL, _ALL, True)  # both layouts: the local causal block (zigzag: in local order)
        if self.layout == "contiguous":
            return _Step(_ALL, _ALL, False) if src < self.rank else None
        half = self.shard_len // 2
        if src < self.rank:  # keys: chunks src < r (seen by both query chunks), 2W-1-src > 2W-1-r (by neither)
            return _Step(_ALL, slice(0, half), False)
        # src > rank: only the later query chunk 2W-1-r sees them, both key chunks whole
        return _Step(slice(half, self.shard_len), _ALL, False)


class _PackedZigzagShards:
    """Packed zigzag shards [total, H, d]: sequence b of the batch (length 2 W c_b) gives every rank
    its chunks r and 2W - 1 - r, rows cu_seqlens[b] .. cu_seqlens[b + 1] - 1 of the local tensors
    (2 c_b of them). Each step is _DenseShards' pair for every sequence at once: the first halves
    of the held keys through seqused_k, the second halves of the queries through cu_seqlens_q
    moved by c_b and seqused_q."""

    def __init__(self, rank: int, cu_seqlens: torch.Tensor, max_seqlen: int):
        self.rank, self.cu, self.max_seqlen = rank, cu_seqlens, int(max_seqlen)
        halves = (cu_seqlens[1:] - cu_seqlens[:-1]) // 2
        self.halves = halves.to(torch.int32)
        self.cu_second = torch.cat([cu_seqlens[:-1] + halves, cu_seqlens[-1:]]).to(torch.int32)
        rows = torch.arange(int(cu_seqlens[-1]), device=cu_seqlens.device)
        seq = torch.searchsorted(cu_seqlens[1:].long(), rows, right=True)
        self.first_half = rows - cu_seqlens.long()[seq] < halves.long()[seq]

    def step(self, src: int, causal: bool) -> Optional[_Step]:
        cu, m = self.cu, self.max_seqlen
        if not causal or src == self.rank:
            return _Step(_ALL, _ALL, causal, interface.Varlen(cu, cu, m, m, None, None))
        if src < self.rank:  # every query, the first half of each sequence's keys
            return _Step(_ALL, _ALL, False, interface.Varlen(cu, cu, m, m, None, self.halves),
                         key_mask=self.first_half)
        # src > rank: the second half of each sequence's queries, every key. A moved sequence spans
        # its second half and the next one's first (at most m rows), of which seqused_q takes its own.
        return _Step(_ALL, _ALL, False, interface.Varlen(self.cu_second, cu, m, m, self.halves, None),
                     row_mask=~self.first_half)


def _step_forward(kernels, step, q, k, v, scale):
    """(out, lse) of a step, in the dense shape ([B, rows, Hq, dv], [B, Hq, rows]; packed as B = 1),
    rows the step leaves out at 0 and -inf."""
    if step.varlen is None:
        return kernels.forward(q[:, step.rows], k[:, step.cols], v[:, step.cols], step.causal, scale)
    out, lse = kernels.forward(q[0], k[0], v[0], step.causal, scale, step.varlen)
    if step.row_mask is not None:
        out = torch.where(step.row_mask[:, None, None], out, torch.zeros_like(out))
        lse = torch.where(step.row_mask, lse, torch.full_like(lse, float("-inf")))
    return out.unsqueeze(0), lse.unsqueeze(0)


def _step_backward(kernels, step, dout, q, k, v, out, lse, scale):
    """(dq, dk, dv) of a step over its rows and cols (packed: zero where it covers nothing)."""
    rows, cols = step.rows, step.cols
    if step.varlen is None:
        return kernels.backward(dout[:, rows], q[:, rows], k[:, cols], v[:, cols], out[:, rows], lse[:, :, rows],
                                step.causal, scale)
    dq, dk, dv = kernels.backward(dout[0], q[0], k[0], v[0], out[0], lse[0], step.causal, scale, step.varlen)
    if step.row_mask is not None:
        dq = torch.where(step.row_mask[:, None, None], dq, torch.zeros_like(dq))
    if step.key_mask is not None:
        dk = torch.where(step.key_mask[:, None, None], dk, torch.zeros_like(dk))
        dv = torch.where(step.key_mask[:, None, None], dv, torch.zeros_like(dv))
    return dq.unsqueeze(0), dk.unsqueeze(0), dv.unsqueeze(0)


def _merge(out, lse, out_step, lse_step, rows):
    """out [B, s, Hq, dv] and lse [B, Hq, s] (the accumulator dtype) updated in place with a step's
    partial result over `rows`, by the log-sum-exp of the two."""
    o, l = out[:, rows], lse[:, :, rows]
    lse_step = lse_step.to(l.dtype)
    new = torch.logaddexp(l, lse_step)
    # exp(-inf - -inf) is NaN: a row that has seen no key yet (or sees none in the step) keeps 0.
    w_old = torch.where(torch.isinf(new), torch.zeros_like(new), torch.exp(l - new))
    w_step = torch.where(torch.isinf(new), torch.zeros_like(new), torch.exp(lse_step - new))
    o.copy_(o * w_old.transpose(1, 2).unsqueeze(-1) + out_step.to(o.dtype) * w_step.transpose(1, 2).unsqueeze(-1))
    l.copy_(new)


# ---- communication -------------------------------------------------------------------------------

def _global_rank(group, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


class _Ring:
    """Neighbour exchange of a tuple of tensors: each rank sends to rank + 1 and receives from
    rank - 1 (of `group`), asynchronously."""

    def __init__(self, group):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.next = _global_rank(group, (self.rank + 1) % self.world_size)
        self.prev = _global_rank(group, (self.rank - 1) % self.world_size)

    def start(self, tensors):
        """Sends tensors on; returns (requests, the tensors that will arrive in their place)."""
        received = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t.contiguous(), self.next, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, r, self.prev, self.group) for r in received]
        return dist.batch_isend_irecv(ops), received

    @staticmethod
    def finish(pending):
        """The tensors of start's exchange, once arrived."""
        requests, received = pending
        for request in requests:
            request.wait()
        return tuple(received)


# ---- ring strategy ---------------------------------------------------------------------------------

def _accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for the kernels' 16-bit inputs (lse is float32 there), float64 for float64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def _ring_forward(q, k, v, group, causal, scale, shards, kernels):
    """q, k, v [B, s, H, d] (packed shards as B = 1); shards: their _DenseShards or
    _PackedZigzagShards."""
    ring = _Ring(group)
    batch, shard_len, heads_q = q.shape[:3]
    acc = _accumulator_dtype(q.dtype)
    out = torch.zeros((*q.shape[:-1], v.shape[-1]), dtype=acc, device=q.device)
    lse = torch.full((batch, heads_q, shard_len), float("-inf"), dtype=acc, device=q.device)
    held = (k, v)
    for step in range(ring.world_size):
        # The next step's keys travel while this step computes.
        pending = ring.start(held) if step + 1 < ring.world_size else None
        pair = shards.step((ring.rank - step) % ring.world_size, causal)
        if pair is not None:
            out_step, lse_step = _step_forward(kernels, pair, q, *held, scale)
            _merge(out, lse, out_step, lse_step, pair.rows)
        if pending is not None:
            held = _Ring.finish(pending)
    return out.to(q.dtype), lse


def _ring_backward(dout, q, k, v, out, lse, group, causal, scale, shards, kernels):
    ring = _Ring(group)
    acc = _accumulator_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    # The held keys travel ahead; their gradients (accumulated at every rank they visit) follow one
    # computation behind, so that each step's transfer of the keys overlaps its attention.
    held = (k, v)
    grads = (torch.zeros(k.shape, dtype=acc, device=k.device), torch.zeros(v.shape, dtype=acc, device=v.device))
    for step in range(ring.world_size):
        pending_keys = ring.start(held) if step + 1 < ring.world_size else None
        pair = shards.step((ring.rank - step) % ring.world_size, causal)
        if pair is not None:
            dq_step, dk_step, dv_step = _step_backward(kernels, pair, dout, q, *held, out, lse, scale)
            dq[:, pair.rows] += dq_step
            grads[0][:, pair.cols] += dk_step
            grads[1][:, pair.cols] += dv_step
        # The gradients go where the keys went; after the last step that is their owner (rank + 1).
        if ring.world_size > 1:
            grads = _Ring.finish(ring.start(grads))
        if pending_keys is not None:
            held = _Ring.finish(pending_keys)
    return dq.to(q.dtype), grads[0].to(k.dtype), grads[1].to(v.dtype)


# ---- all-gather strategy ---------------------------------------------------------------------------

def _gather_order(world_size: int, layout: str):
    """Where chunk c of the full sequence lies in the gathered tensor (rank-ordered shards, each
    two chunks): a list, c -> index of the half-shard chunk."""
    if layout == "contiguous":
        return list(range(world_size))
    # shard r = chunks (r, 2W-1-r) at gathered positions (2r, 2r + 1)
    order = [0] * (2 * world_size)
    for r in range(world_size):
        order[r], order[2 * world_size - 1 - r] = 2 * r, 2 * r + 1
    return order


def _in_sequence_order(gathered, world_size, layout):
    """The gathered shards [W, B, s, H, d] as the full sequence [B, W s, H, d]."""
    parts = 2 * world_size if layout == "zigzag" else world_size
    chunks = gathered.movedim(0, 1).flatten(1, 2).chunk(parts, 1)  # in gathered order
    return torch.cat([chunks[i] for i in _gather_order(world_size, layout)], dim=1)


def _local_query_chunks(rank, world_size, shard_len, layout):
    """(rows of the local shard, the global chunk index, chunk length) of each local query chunk."""
    if layout == "contiguous":
        return [(slice(None), rank, shard_len)]
    half = shard_len // 2
    return [(slice(0, half), rank, half), (slice(half, shard_len), 2 * world_size - 1 - rank, half)]


def _all_gather(x, group, world_size):
    """[W, *x.shape]: every rank's x in rank order."""
    x = x.contiguous()
    if dist.get_backend(group) == "nccl":
        gathered = torch.empty((world_size, *x.shape), dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(gathered, x, group=group)
        return gathered
    parts = [torch.empty_like(x) for _ in range(world_size)]  # gloo: the list form
    dist.all_gather(parts, x, group=group)
    return torch.stack(parts)


def _reduce_scatter(shards, group, world_size):
    """This rank's part of the sum over ranks of shards [W, ...] (part r to rank r)."""
    shards = shards.contiguous()
    if dist.get_backend(group) == "nccl":
        mine = torch.empty(shards.shape[1:], dtype=shards.dtype, device=shards.device)
        dist.reduce_scatter_tensor(mine, shards.flatten(0, 1), group=group)
        return mine
    dist.all_reduce(shards, group=group)  # gloo: no reduce-scatter; the sum of all, then this part
    return shards[dist.get_rank(group)].clone()


def _chunk_keys(chunk: int, length: int, seqlen: int, window):
    """The keys [start, end) of the whole sequence that query chunk `chunk` (rows chunk * length
    onwards) sees under the global window (left, right) (-1: unbounded; causal is right = 0), and
    the window that gives the same mask on those keys in the kernels' bottom-right terms (both
    bounds >= 0 or -1)."""
    left, right = window
    first = chunk * length
    start = 0 if left < 0 else max(0, first - left)
    end = seqlen if right < 0 else min(seqlen, first + length + right)
    local_left = -1 if left < 0 else end - length - first + left
    local_right = -1 if right < 0 else first + length + right - end
    return start, end, (local_left, local_right)


def _gather_forward(q, k, v, group, window, scale, layout, kernels):
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    k_all = _in_sequence_order(_all_gather(k, group, world_size), world_size, layout)
    v_all = _in_sequence_order(_all_gather(v, group, world_size), world_size, layout)
    outs, lses = [], []
    for rows, chunk, length in _local_query_chunks(rank, world_size, q.shape[1], layout):
        start, end, local_window = _chunk_keys(chunk, length, k_all.shape[1], window)
        out, lse = kernels.forward(q[:, rows], k_all[:, start:end], v_all[:, start:end], False, scale,
                                   window_size=local_window)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs, dim=1).to(q.dtype), torch.cat(lses, dim=2), (k_all, v_all)


def _gather_backward(dout, q, out, lse, gathered, group, window, scale, layout, kernels):
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    k_all, v_all = gathered
    acc = _accumulator_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk_all = torch.zeros(k_all.shape, dtype=acc, device=q.device)
    dv_all = torch.zeros(v_all.shape, dtype=acc, device=q.device)
    for rows, chunk, length in _local_query_chunks(rank, world_size, q.shape[1], layout):
        start, end, local_window = _chunk_keys(chunk, length, k_all.shape[1], window)
        dq_c, dk_c, dv_c = kernels.backward(dout[:, rows], q[:, rows], k_all[:, start:end], v_all[:, start:end],
                                            out[:, rows], lse[:, :, rows], False, scale, window_size=local_window)
        dq[:, rows] += dq_c
        dk_all[:, start:end] += dk_c
        dv_all[:, start:end] += dv_c
    return dq.to(q.dtype), _scatter_home(dk_all, group, world_size, layout), \
        _scatter_home(dv_all, group, world_size, layout)


def _scatter_home(grad_all, group, world_size, layout):
    """Each rank's shard of the summed gradients of the full sequence (reduce_scatter over the
    shards in rank order): the inverse of _in_sequence_order, then the sum."""
    parts = 2 * world_size if layout == "zigzag" else world_size
    chunks = grad_all.chunk(parts, 1)  # in sequence order
    order = _gather_order(world_size, layout)
    by_gathered = [None] * parts
    for c, position in enumerate(order):
        by_gathered[position] = chunks[c]
    stacked = torch.cat(by_gathered, dim=1)  # rank-ordered shards along the sequence
    shards = stacked.unflatten(1, (world_size, -1)).movedim(1, 0)  # [W, B, s, H, d]
    return _reduce_scatter(shards, group, world_size)


# ---- autograd ----------------------------------------------------------------------------------------

class _ContextParallelAttention(torch.autograd.Function):
    """q, k, v: dense shards [B, s, H, d], or packed ones [total, H, d] (shards a
    _PackedZigzagShards), which run as B = 1."""

    @staticmethod
    def forward(ctx, q, k, v, group, window, scale, shards, strategy, kernels):
        """window: (left, right) over the whole sequence; causal is (-1, 0), full (-1, -1), the two
        the ring takes."""
        causal = window[1] == 0
        packed = isinstance(shards, _PackedZigzagShards)
        if packed:
            q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
        if strategy == "ring":
            out, lse = _ring_forward(q, k, v, group, causal, scale, shards, kernels)
            ctx.save_for_backward(q, k, v, out, lse)
        else:
            out, lse, (k_all, v_all) = _gather_forward(q, k, v, group, window, scale, shards.layout, kernels)
            ctx.save_for_backward(q, k_all, v_all, out, lse)
        ctx.options = (group, window, scale, shards, strategy, kernels, packed)
        if packed:
            out, lse = out.squeeze(0), lse.squeeze(0)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        group, window, scale, shards, strategy, kernels, packed = ctx.options
        causal = window[1] == 0
        q, k, v, out, lse = ctx.saved_tensors
        dout = (dout.unsqueeze(0) if packed else dout).contiguous()
        if strategy == "ring":
            dq, dk, dv = _ring_backward(dout, q, k, v, out, lse, group, causal, scale, shards, kernels)
        else:
            dq, dk, dv = _gather_backward(dout, q, out, lse, (k, v), group, window, scale, shards.layout, kernels)
            dk, dv = dk.to(q.dtype), dv.to(q.dtype)
        if packed:
            dq, dk, dv = dq.squeeze(0), dk.squeeze(0), dv.squeeze(0)
        return dq, dk, dv, None, None, None, None, None, None


def _check_tensors(q, k, v, dims: int, layout_text: str):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != dims:
            raise interface.invalid_argument(f"{name}: expected a {dims}-dim tensor {layout_text}")
    rows = dims - 3  # the sequence dim
    if k.shape[rows] != q.shape[rows] or v.shape[rows] != q.shape[rows]:
        raise interface.invalid_argument(f"k, v: each rank's shard holds as many keys as queries "
                                         f"(q {q.shape[rows]}, k {k.shape[rows]}, v {v.shape[rows]})")


def _global_window(causal: bool, window_size) -> tuple:
    """(left, right) over the whole sequence, flash_attn_func's rules: -1 (or None) unbounded,
    causal sets right to 0."""
    try:
        left, right = (-1 if w is None else int(w) for w in window_size)
    except (TypeError, ValueError):
        raise interface.invalid_argument(f"window_size: expected two ints (left, right), got {window_size!r}") from None
    if left < -1 or right < -1:
        raise interface.invalid_argument(f"window_size: {(left, right)}; each bound is -1 (unbounded) or >= 0")
    return left, 0 if causal else right


def _check_group():
    if not dist.is_available() or not dist.is_initialized():
        raise interface.invalid_argument("group: torch.distributed is not initialized (init_process_group first)")


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None, *, causal: bool = False,
                   softmax_scale: Optional[float] = None, layout: str = "zigzag", strategy: str = "ring",
                   return_lse: bool = False, kernels: StepKernels = LIBRARY_KERNELS, window_size=(-1, -1)):
    """Attention of this rank's query shard over the whole sequence's keys, the sequence sharded
    over `group` (None: the default group); with autograd. q [B, s, Hq, d], k/v [B, s, Hkv, d|dv]:
    this rank's shard (layout "zigzag": zigzag_shard's, s even; "contiguous": positions
    [rank s, (rank + 1) s)). causal and window_size as flash_attn_func's over the whole sequence
    (a window: strategy "all_gather" only). strategy "ring" or "all_gather" (see the module). Returns out [B, s, Hq, dv] in q's dtype (and lse [B, Hq, s]
    float32, the natural log, with return_lse)."""
    window = _global_window(causal, window_size)
    if window not in ((-1, -1), (-1, 0)) and strategy == "ring":
        raise interface.not_supported("window_size: the ring strategy takes full and causal attention only; "
                                      "strategy='all_gather' takes a sliding window")
    if layout not in _LAYOUTS:
        raise interface.invalid_argument(f"layout: '{layout}' is none of {_LAYOUTS}")
    if strategy not in _STRATEGIES:
        raise interface.invalid_argument(f"strategy: '{strategy}' is none of {_STRATEGIES}")
    _check_tensors(q, k, v, 4, "[B, s, heads, d]")
    if layout == "zigzag" and q.shape[1] % 2:
        raise interface.invalid_argument(f"q: shape[1] is {q.shape[1]}; a zigzag shard is two chunks of equal "
                                         "length (zigzag_shard of a sequence of 2 x world_size chunks)")
    _check_group()
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    shards = _DenseShards(dist.get_rank(group), q.shape[1], layout)
    out, lse = _ContextParallelAttention.apply(q, k, v, group, window, scale, shards, strategy, kernels)
    return (out, lse) if return_lse else out


def ring_attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                          max_seqlen: int, group=None, *, causal: bool = False,
                          softmax_scale: Optional[float] = None, return_lse: bool = False,
                          kernels: StepKernels = LIBRARY_KERNELS):
    """ring_attention over a packed batch (FlashAttention's varlen layout), the ring strategy: every
    sequence is sharded zigzag over `group` (zigzag_shard of each, on dim 0), and this rank's shards
    are packed, q [total, Hq, d], k/v [total, Hkv, d|dv], shard b at rows cu_seqlens[b] ..
    cu_seqlens[b + 1] - 1 (int32 [B + 1] on q's device; every shard length even), max_seqlen the
    longest shard. Returns out [total, Hq, dv] (and lse [Hq, total] float32 with return_lse)."""
    _check_tensors(q, k, v, 3, "[total, heads, d]")
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.dtype != torch.int32:
        raise interface.invalid_argument("cu_seqlens: expected an int32 tensor [B + 1]")
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()  # one host copy a call: the shards' halves
    if int(cu_seqlens[-1]) != q.shape[0] or any(n % 2 or n < 0 for n in lengths):
        raise interface.invalid_argument(f"cu_seqlens: the shards' lengths {lengths} must be even (two zigzag chunks "
                                         f"each) and end at q's {q.shape[0]} rows")
    if max(lengths, default=0) > max_seqlen:
        raise interface.invalid_argument(f"max_seqlen: {max_seqlen} is below the longest shard ({max(lengths)})")
    _check_group()
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    shards = _PackedZigzagShards(dist.get_rank(group), cu_seqlens, max_seqlen)
    window = (-1, 0) if causal else (-1, -1)
    out, lse = _ContextParallelAttention.apply(q, k, v, group, window, scale, shards, "ring", kernels)
    return (out, lse) if return_lse else out
