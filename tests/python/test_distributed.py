"""flashhopper.distributed: several processes with the gloo backend run the ring and all-gather
strategies against the unsharded reference (out, lse, dq, dk, dv), causal and not, GQA. On the
CPU (CI) each step's attention is a float64 PyTorch implementation of the kernels' (support's
reference_step_forward / _backward), zigzag and contiguous shards, 2 and 3 ranks. On a GPU the
steps are the library's kernels (bf16, the ranks sharing one GPU, the transfers through gloo on
the host), held to the pass rule."""
import itertools
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flashhopper import distributed
from flashhopper.interface import FlashHopperInvalidArgument, FlashHopperNotSupported
from support import attention_reference, reference_step_backward, reference_step_forward, requires_gpu

KERNELS = distributed.StepKernels(reference_step_forward, reference_step_backward)
# (strategy, layout, causal, window_size): the ring takes full and causal attention, all-gather
# also windows (look-back, two-sided, with causal), smaller and larger than a shard.
CONFIGS = [(strategy, layout, causal, (-1, -1)) for strategy, layout, causal in
           itertools.product(("ring", "all_gather"), ("zigzag", "contiguous"), (False, True))]
CONFIGS += [("all_gather", layout, causal, window) for layout in ("zigzag", "contiguous")
            for causal, window in ((True, (4, -1)), (False, (7, 2)), (False, (-1, 5)), (True, (13, 0)))]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _shard(x, rank, world_size, layout, dim=1):
    if layout == "zigzag":
        return distributed.zigzag_shard(x, rank, world_size, dim)
    return x.chunk(world_size, dim)[rank]


def _worker(rank, world_size, port, failures):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        for strategy, layout, causal, window in CONFIGS:
            generator = torch.Generator().manual_seed(7)  # the same full inputs on every rank
            seqlen = 6 * world_size  # three rows a zigzag chunk
            q, k, v, dout = (torch.randn(2, seqlen, heads, 16, dtype=torch.float64, generator=generator)
                             for heads in (4, 2, 2, 4))
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            out_ref, lse_ref = attention_reference(*leaves, causal=causal, window_size=window, dtype=torch.float64)
            grads_ref = torch.autograd.grad(out_ref, leaves, dout)

            local = [_shard(t, rank, world_size, layout).clone().requires_grad_() for t in (q, k, v)]
            out, lse = distributed.ring_attention(*local, causal=causal, layout=layout, strategy=strategy,
                                                  window_size=window, return_lse=True, kernels=KERNELS)
            grads = torch.autograd.grad(out, local, _shard(dout, rank, world_size, layout))
            expected = [(name, _shard(t, rank, world_size, layout, dim)) for name, t, dim in
                        (("out", out_ref, 1), ("lse", lse_ref, 2), ("dq", grads_ref[0], 1), ("dk", grads_ref[1], 1),
                         ("dv", grads_ref[2], 1))]
            for (name, want), got in zip(expected, (out, lse, *grads)):
                error = (got.double() - want.double()).abs().max().item()
                if not error <= 1e-10:  # NaN fails too
                    failures.put(f"rank {rank}/{world_size} {strategy} {layout} causal={causal} window={window} "
                                 f"{name}: max error {error:.3g}")
    finally:
        dist.destroy_process_group()


def _failures_of_ranks(worker, world_size):
    """worker(rank, world_size, port, failures) in world_size processes; the failures they put."""
    failures = mp.get_context("spawn").SimpleQueue()
    mp.spawn(worker, args=(world_size, _free_port(), failures), nprocs=world_size, join=True)
    found = []
    while not failures.empty():
        found.append(failures.get())
    return found


def _varlen_worker(rank, world_size, port, failures):
    """A packed batch of three sequences of different lengths, each sharded zigzag."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        for causal in (False, True):
            generator = torch.Generator().manual_seed(5)
            lengths = [2 * world_size * c for c in (3, 1, 5)]
            full = [[torch.randn(n, heads, 16, dtype=torch.float64, generator=generator) for heads in (4, 2, 2, 4)]
                    for n in lengths]  # per sequence: q, k, v, dout

            def local(t):
                return distributed.zigzag_shard(t, rank, world_size, dim=0)
            expected = {name: [] for name in ("out", "lse", "dq", "dk", "dv")}
            for q, k, v, dout in full:
                leaves = [t.clone().requires_grad_() for t in (q, k, v)]
                out_ref, lse_ref = attention_reference(*(t[None] for t in leaves), causal=causal, dtype=torch.float64)
                grads_ref = torch.autograd.grad(out_ref, leaves, dout[None])
                for name, t in zip(expected, (out_ref[0], lse_ref[0].t(), *grads_ref)):
                    expected[name].append(local(t.detach()))
            shards = [torch.cat([local(seq[i]) for seq in full]) for i in range(4)]
            leaves = [t.clone().requires_grad_() for t in shards[:3]]
            cu = torch.tensor([0] + list(itertools.accumulate(n // world_size for n in lengths)), dtype=torch.int32)
            out, lse = distributed.ring_attention_varlen(*leaves, cu, max(lengths) // world_size, causal=causal,
                                                         return_lse=True, kernels=KERNELS)
            grads = torch.autograd.grad(out, leaves, shards[3])
            for name, got in zip(expected, (out, lse.t(), *grads)):
                error = (got - torch.cat(expected[name])).abs().max().item()
                if not error <= 1e-10:
                    failures.put(f"rank {rank}/{world_size} varlen causal={causal} {name}: max error {error:.3g}")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world_size", [2, 3])
def test_context_parallel_matches_the_unsharded_attention(world_size):
    found = _failures_of_ranks(_worker, world_size)
    assert not found, "\n".join(found)


@pytest.mark.parametrize("world_size", [2, 3])
def test_context_parallel_over_a_packed_batch(world_size):
    found = _failures_of_ranks(_varlen_worker, world_size)
    assert not found, "\n".join(found)


def test_zigzag_shard_round_trip_and_balance():
    """zigzag_unshard inverts zigzag_shard; rank r holds chunks r and 2W - 1 - r."""
    x = torch.arange(2 * 12).view(2, 12)
    shards = [distributed.zigzag_shard(x, r, 3, dim=1) for r in range(3)]
    assert shards[0][0].tolist() == [0, 1, 10, 11] and shards[2][0].tolist() == [4, 5, 6, 7]
    assert torch.equal(distributed.zigzag_unshard(shards, dim=1), x)
    with pytest.raises(FlashHopperInvalidArgument, match=r"not a multiple of 6"):
        distributed.zigzag_shard(torch.zeros(1, 10), 0, 3)


def test_refusals_name_the_argument():
    q = torch.zeros(1, 4, 2, 16)
    with pytest.raises(FlashHopperNotSupported, match="window_size: the ring strategy takes full and causal"):
        distributed.ring_attention(q, q, q, window_size=(8, 0))
    with pytest.raises(FlashHopperInvalidArgument, match=r"window_size: \(-2, 0\); each bound is -1"):
        distributed.ring_attention(q, q, q, window_size=(-2, 0), strategy="all_gather")
    with pytest.raises(FlashHopperInvalidArgument, match="layout"):
        distributed.ring_attention(q, q, q, layout="striped")
    with pytest.raises(FlashHopperInvalidArgument, match="strategy"):
        distributed.ring_attention(q, q, q, strategy="tree")
    with pytest.raises(FlashHopperInvalidArgument, match="torch.distributed is not initialized"):
        distributed.ring_attention(q, q, q)
    with pytest.raises(FlashHopperInvalidArgument, match=r"q: shape\[1\] is 3; a zigzag shard is two chunks"):
        distributed.ring_attention(q[:, :3], q[:, :3], q[:, :3])
    packed = torch.zeros(10, 2, 16)
    with pytest.raises(FlashHopperInvalidArgument, match="cu_seqlens: expected an int32 tensor"):
        distributed.ring_attention_varlen(packed, packed, packed, torch.tensor([0, 4, 10]), 6)
    with pytest.raises(FlashHopperInvalidArgument, match=r"cu_seqlens: the shards' lengths \[3, 7\] must be even"):
        distributed.ring_attention_varlen(packed, packed, packed, torch.tensor([0, 3, 10], dtype=torch.int32), 8)
    with pytest.raises(FlashHopperInvalidArgument, match="max_seqlen: 4 is below the longest shard"):
        distributed.ring_attention_varlen(packed, packed, packed, torch.tensor([0, 4, 10], dtype=torch.int32), 4)
    with pytest.raises(FlashHopperInvalidArgument, match="q: expected a 3-dim tensor"):
        distributed.ring_attention_varlen(q, q, q, torch.tensor([0, 4], dtype=torch.int32), 4)


def _library_steps_on_the_gpu():
    """LIBRARY_KERNELS on cuda:0 for host float64 tensors (bf16 values): the ring's transfers stay
    on the host (gloo), each step's attention runs on the GPU."""
    from flashhopper import interface
    library = distributed.LIBRARY_KERNELS

    def gpu(t):
        return t.to("cuda", torch.bfloat16)

    def on_gpu(varlen):
        return None if varlen is None else interface.Varlen(
            *(t.cuda() if isinstance(t, torch.Tensor) else t for t in varlen))

    def forward(q, k, v, causal, scale, varlen=None, window_size=(-1, -1)):
        out, lse = library.forward(gpu(q), gpu(k), gpu(v), causal, scale, varlen=on_gpu(varlen),
                                   window_size=window_size)
        return out.double().cpu(), lse.double().cpu()

    def backward(dout, q, k, v, out, lse, causal, scale, varlen=None, window_size=(-1, -1)):
        lse = lse.to("cuda", torch.float32).contiguous()
        grads = library.backward(gpu(dout), gpu(q), gpu(k), gpu(v), gpu(out), lse, causal, scale,
                                 varlen=on_gpu(varlen), window_size=window_size)
        return tuple(g.double().cpu() for g in grads)
    return distributed.StepKernels(forward, backward)


def _reference_and_plain(q, k, v, dout, causal, window=(-1, -1)):
    """(out, lse, dq, dk, dv) in float64 and (out, dq, dk, dv) of plain bf16 PyTorch, [B, s, H, d]."""
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out_ref, lse_ref = attention_reference(*leaves, causal=causal, window_size=window, dtype=torch.float64)
    exact = (out_ref.detach(), lse_ref, *torch.autograd.grad(out_ref, leaves, dout))
    plain = [t.bfloat16().requires_grad_() for t in (q, k, v)]
    out_plain, _ = attention_reference(*plain, causal=causal, window_size=window, dtype=torch.bfloat16)
    return exact, (out_plain.detach(), *torch.autograd.grad(out_plain, plain, dout.bfloat16()))


def _put_pass_rule_failures(failures, tag, ours, exact, plain):
    """FlashAttention's rule for out, dq, dk, dv (2 x plain bf16's error + slack) and lse (1e-3)."""
    lse_error = (ours[1] - exact[1]).abs().max().item()
    if not lse_error <= 1e-3:
        failures.put(f"{tag} lse: max error {lse_error:.3g}")
    for name, got, want, pt, slack in zip(("out", "dq", "dk", "dv"), (ours[0], *ours[2:]), (exact[0], *exact[2:]),
                                          plain, (1e-5, 1e-4, 1e-4, 1e-4)):
        error, plain_error = (got - want).abs().max().item(), (pt.double() - want).abs().max().item()
        if not error <= 2 * plain_error + slack:
            failures.put(f"{tag} {name}: error {error:.3g} against plain bf16's {plain_error:.3g}")


def _gpu_worker(rank, world_size, port, failures):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        kernels = _library_steps_on_the_gpu()

        def local(t, dim=1):
            return distributed.zigzag_shard(t, rank, world_size, dim)
        configs = [(strategy, causal, (-1, -1)) for strategy in ("ring", "all_gather") for causal in (False, True)]
        configs += [("all_gather", True, (100, -1)), ("all_gather", False, (64, 64))]
        for strategy, causal, window in configs:
            generator = torch.Generator().manual_seed(11)
            q, k, v, dout = (torch.randn(1, 512, heads, 128, generator=generator).bfloat16().double()
                             for heads in (4, 2, 2, 4))
            exact, plain = _reference_and_plain(q, k, v, dout, causal, window)
            leaves = [local(t).requires_grad_() for t in (q, k, v)]
            out, lse = distributed.ring_attention(*leaves, causal=causal, strategy=strategy, window_size=window,
                                                  return_lse=True, kernels=kernels)
            grads = torch.autograd.grad(out, leaves, local(dout))
            _put_pass_rule_failures(failures, f"rank {rank} {strategy} causal={causal} window={window}",
                                    (out, lse, *grads),
                                    [local(t, 2 if i == 1 else 1) for i, t in enumerate(exact)],
                                    [local(t) for t in plain])
        for causal in (False, True):  # a packed batch of two sequences
            generator = torch.Generator().manual_seed(13)
            sequences = [[torch.randn(1, n, heads, 128, generator=generator).bfloat16().double()
                          for heads in (4, 2, 2, 4)] for n in (128, 384)]
            checks = [_reference_and_plain(*seq, causal) for seq in sequences]
            # per sequence [1, n, ...] (lse [1, Hq, n]) -> this rank's shards, packed (lse [Hq, total])
            exact = [torch.cat([local(c[0][i], 2 if i == 1 else 1)[0] for c in checks], dim=1 if i == 1 else 0)
                     for i in range(5)]
            plain = [torch.cat([local(c[1][i])[0] for c in checks]) for i in range(4)]
            packed = [torch.cat([local(seq[i])[0] for seq in sequences]) for i in range(4)]
            leaves = [t.clone().requires_grad_() for t in packed[:3]]
            cu = torch.tensor([0, 128 // world_size, 512 // world_size], dtype=torch.int32)
            out, lse = distributed.ring_attention_varlen(*leaves, cu, 384 // world_size, causal=causal,
                                                         return_lse=True, kernels=kernels)
            grads = torch.autograd.grad(out, leaves, packed[3])
            _put_pass_rule_failures(failures, f"rank {rank} varlen causal={causal}", (out, lse, *grads), exact, plain)
    finally:
        dist.destroy_process_group()


@requires_gpu
def test_context_parallel_on_the_library_kernels():
    """Two ranks on one GPU, the steps on the library's bf16 kernels (hdim 128, GQA 4/2, 512
    tokens in zigzag shards; and a packed batch of 128 and 384 tokens): out, lse and the gradients
    against float64 with the pass rule."""
    found = _failures_of_ranks(_gpu_worker, 2)
    assert not found, "\n".join(found)
