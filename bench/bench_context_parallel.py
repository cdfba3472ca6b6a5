#!/usr/bin/env python3
"""Context parallelism's speed: flashhopper.distributed.ring_attention over the GPUs of one host
beside one GPU's flash_attn_func over the whole sequence (issue 23's 1.8x on two GPUs).

    torchrun --nproc-per-node 2 bench/bench_context_parallel.py --seqlens 131072 524288 --out DIR

bf16, hdim 128, GQA 32/8 (--heads, --heads-kv), batch 1, zigzag shards; for each sequence length,
mask (causal or not) and strategy (ring, all_gather), the forward and the forward + backward.
Each time is the slowest rank's (CUDA events around one call after warm-up, every rank starting
at a barrier), the median of --rounds. TFLOP/s: FlashAttention's count for the whole sequence
(4 B H S^2 d forward, half of it causal, 2.5 times that backward) over that time, i.e. summed over
the GPUs; "1 GPU" is rank 0 alone on the whole sequence (flash_attn_func), where it fits.
Rank 0 prints a table last and writes bench_context_parallel_<date>.csv into --out.

--smoke runs the same script on the CPU (gloo, the float64 steps of tests/python/support.py, a
tiny sequence) to check it end to end without GPUs:
    torchrun --nproc-per-node 2 bench/bench_context_parallel.py --smoke
"""
import argparse
import csv
import datetime
import os
import pathlib
import statistics
import sys
import time

import torch
import torch.distributed as dist

from flashhopper import distributed


def flops(seqlen, heads, head_dim, causal, backward):
    forward = 4 * heads * seqlen * seqlen * head_dim * (0.5 if causal else 1.0)
    return forward * (3.5 if backward else 1.0)  # forward + backward: 1 + 2.5


def slowest_seconds(fn, rounds, device):
    """The median over rounds of the slowest rank's time for one call (after a warm-up call)."""
    fn()
    times = []
    for _ in range(rounds):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(elapsed.item())
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqlens", type=int, nargs="+", default=[131072, 524288])
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--heads-kv", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=".")
    parser.add_argument("--smoke", action="store_true", help="gloo on the CPU, float64 reference steps, tiny sizes")
    args = parser.parse_args()

    if args.smoke:
        sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests" / "python"))
        from support import reference_step_backward, reference_step_forward
        kernels = distributed.StepKernels(reference_step_forward, reference_step_backward)
        dist.init_process_group("gloo")
        device, dtype = torch.device("cpu"), torch.float64
        args.seqlens, args.heads, args.heads_kv, args.head_dim, args.rounds = [64], 4, 2, 16, 2
    else:
        kernels = distributed.LIBRARY_KERNELS
        dist.init_process_group("nccl")
        device, dtype = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))), torch.bfloat16
        torch.cuda.set_device(device)
    rank, world_size = dist.get_rank(), dist.get_world_size()

    rows = []
    for seqlen, causal in [(s, c) for s in args.seqlens for c in (False, True)]:
        shard = seqlen // world_size
        q = torch.randn(1, shard, args.heads, args.head_dim, device=device, dtype=dtype, requires_grad=True)
        k, v = (torch.randn(1, shard, args.heads_kv, args.head_dim, device=device, dtype=dtype, requires_grad=True)
                for _ in range(2))
        dout = torch.randn_like(q)
        for strategy in ("ring", "all_gather"):
            def forward():
                return distributed.ring_attention(q, k, v, causal=causal, strategy=strategy, kernels=kernels)

            def step():
                torch.autograd.grad(forward(), (q, k, v), dout)
            for backward, fn in ((False, forward), (True, step)):
                seconds = slowest_seconds(fn, args.rounds, device)
                rows.append((seqlen, causal, f"{strategy} x{world_size}", "fwd+bwd" if backward else "fwd", seconds,
                             flops(seqlen, args.heads, args.head_dim, causal, backward) / seconds / 1e12))
        del q, k, v, dout
    if rank == 0 and not args.smoke:  # one GPU on the whole sequence, the others wait
        from flashhopper import flash_attn_func
        for seqlen, causal, backward in [(s, c, b) for s in args.seqlens for c in (False, True) for b in (False, True)]:
            try:
                q = torch.randn(1, seqlen, args.heads, args.head_dim, device=device, dtype=dtype, requires_grad=True)
                k, v = (torch.randn(1, seqlen, args.heads_kv, args.head_dim, device=device, dtype=dtype,
                                    requires_grad=True) for _ in range(2))
                dout = torch.randn_like(q)

                def fn():
                    out = flash_attn_func(q, k, v, causal=causal)
                    if backward:
                        torch.autograd.grad(out, (q, k, v), dout)
                fn()
                torch.cuda.synchronize(device)
                times = []
                for _ in range(args.rounds):
                    start = time.perf_counter()
                    fn()
                    torch.cuda.synchronize(device)
                    times.append(time.perf_counter() - start)
            except torch.OutOfMemoryError:
                print(f"1 GPU: {seqlen} tokens ({'fwd+bwd' if backward else 'fwd'}) do not fit")
                continue
            finally:
                q = k = v = dout = None
                torch.cuda.empty_cache()
            seconds = statistics.median(times)
            rows.append((seqlen, causal, "1 GPU", "fwd+bwd" if backward else "fwd", seconds,
                         flops(seqlen, args.heads, args.head_dim, causal, backward) / seconds / 1e12))
    dist.barrier()
    if rank == 0:
        header = ("seqlen", "causal", "how", "pass", "ms", "TFLOP/s")
        print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
        for seqlen, causal, how, pass_, seconds, tflops in rows:
            print(f"| {seqlen} | {int(causal)} | {how} | {pass_} | {seconds * 1e3:.2f} | {tflops:.1f} |")
        if not args.smoke:
            out = pathlib.Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            with open(out / f"bench_context_parallel_{datetime.date.today()}.csv", "w", newline="") as f:
                writer = csv.writer(f)
                writer.writerow(header)
                writer.writerows(rows)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
