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
CONFIGS = list(itertools.product(("ring", "all_gather"), ("zigzag", "contiguous"), (False, True)))


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
        for strategy, layout, causal in CONFIGS:
            generator = torch.Generator().manual_seed(7)  # the same full inputs on every rank
            seqlen = 6 * world_size  # three rows a zigzag chunk
            q, k, v, dout = (torch.randn(2, seqlen, heads, 16, dtype=torch.float64, generator=generator)
                             for heads in (4, 2, 2, 4))
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            out_ref, lse_ref = attention_reference(*leaves, causal=causal, dtype=torch.float64)
            grads_ref = torch.autograd.grad(out_ref, leaves, dout)

            local = [_shard(t, rank, world_size, layout).clone().requires_grad_() for t in (q, k, v)]
            out, lse = distributed.ring_attention(*local, causal=causal, layout=layout, strategy=strategy,
                                                  return_lse=True, kernels=KERNELS)
            grads = torch.autograd.grad(out, local, _shard(dout, rank, world_size, layout))
            expected = [(name, _shard(t, rank, world_size, layout, dim)) for name, t, dim in
                        (("out", out_ref, 1), ("lse", lse_ref, 2), ("dq", grads_ref[0], 1), ("dk", grads_ref[1], 1),
                         ("dv", grads_ref[2], 1))]
            for (name, want), got in zip(expected, (out, lse, *grads)):
                error = (got.double() - want.double()).abs().max().item()
                if not error <= 1e-10:  # NaN fails too
                    failures.put(f"rank {rank}/{world_size} {strategy} {layout} causal={causal} {name}: "
                                 f"max error {error:.3g}")
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
    with pytest.raises(FlashHopperNotSupported, match="window_size"):
        distributed.ring_attention(q, q, q, window_size=(8, 0))
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
    """StepKernels over the library on cuda:0 for host float64 tensors (bf16 values): the ring's
    transfers stay on the host (gloo), each step's attention runs on the GPU."""
    from flashhopper import interface

    def gpu(t):
        return t.to("cuda", torch.bfloat16)

    def forward(q, k, v, causal, scale):
        out, lse = interface.forward(gpu(q), gpu(k), gpu(v), causal, scale, return_lse=True)
        return out.double().cpu(), lse.double().cpu()

    def backward(dout, q, k, v, out, lse, causal, scale):
        grads = interface.backward(gpu(dout), gpu(q), gpu(k), gpu(v), gpu(out),
                                   lse.to("cuda", torch.float32).contiguous(), causal, scale)
        return tuple(g.double().cpu() for g in grads)
    return distributed.StepKernels(forward, backward)


def _gpu_worker(rank, world_size, port, failures):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        kernels = _library_steps_on_the_gpu()
        for strategy, causal in itertools.product(("ring", "all_gather"), (False, True)):
            generator = torch.Generator().manual_seed(11)
            q, k, v, dout = (torch.randn(1, 512, heads, 128, generator=generator).bfloat16().double()
                             for heads in (4, 2, 2, 4))
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            out_ref, lse_ref = attention_reference(*leaves, causal=causal, dtype=torch.float64)
            grads_ref = torch.autograd.grad(out_ref, leaves, dout)
            plain = [t.bfloat16().requires_grad_() for t in (q, k, v)]
            out_plain, _ = attention_reference(*plain, causal=causal, dtype=torch.bfloat16)
            grads_plain = torch.autograd.grad(out_plain, plain, dout.bfloat16())

            local = [distributed.zigzag_shard(t, rank, world_size).clone().requires_grad_() for t in (q, k, v)]
            out, lse = distributed.ring_attention(*local, causal=causal, strategy=strategy, return_lse=True,
                                                  kernels=kernels)
            grads = torch.autograd.grad(out, local, distributed.zigzag_shard(dout, rank, world_size))
            lse_error = (lse - distributed.zigzag_shard(lse_ref, rank, world_size, dim=2)).abs().max().item()
            if not lse_error <= 1e-3:
                failures.put(f"rank {rank} {strategy} causal={causal} lse: max error {lse_error:.3g}")
            for name, ours, ref, pt, slack in zip(("out", "dq", "dk", "dv"), (out, *grads), (out_ref, *grads_ref),
                                                  (out_plain, *grads_plain), (1e-5, 1e-4, 1e-4, 1e-4)):
                ref = distributed.zigzag_shard(ref.detach(), rank, world_size)
                error = (ours - ref).abs().max().item()
                plain_error = (distributed.zigzag_shard(pt.detach(), rank, world_size).double() - ref).abs().max().item()
                if not error <= 2 * plain_error + slack:
                    failures.put(f"rank {rank} {strategy} causal={causal} {name}: error {error:.3g} against "
                                 f"plain bf16's {plain_error:.3g}")
    finally:
        dist.destroy_process_group()


@requires_gpu
def test_context_parallel_on_the_library_kernels():
    """Two ranks on one GPU, the steps on the library's bf16 kernels (hdim 128, GQA 4/2, 512
    tokens in zigzag shards): out, lse and the gradients against float64 with the pass rule."""
    found = _failures_of_ranks(_gpu_worker, 2)
    assert not found, "\n".join(found)
