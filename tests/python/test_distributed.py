"""flashhopper.distributed on the CPU: several processes with the gloo backend run the ring and
all-gather strategies with a float64 PyTorch implementation of each step's attention (support's
reference_step_forward / _backward), against the unsharded reference (out, lse, dq, dk, dv),
causal and not, zigzag and contiguous shards, GQA, 2 and 3 ranks."""
import itertools
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flashhopper import distributed
from flashhopper.interface import FlashHopperInvalidArgument, FlashHopperNotSupported
from support import attention_reference, reference_step_backward, reference_step_forward

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


@pytest.mark.parametrize("world_size", [2, 3])
def test_context_parallel_matches_the_unsharded_attention(world_size):
    failures = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_worker, args=(world_size, _free_port(), failures), nprocs=world_size, join=True)
    found = []
    while not failures.empty():
        found.append(failures.get())
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
