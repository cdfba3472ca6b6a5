#!/usr/bin/env python3
"""Decode time over the split-KV count: flash_attn_with_kvcache with num_splits = 1, 2, ... beside
the count the library picks (num_splits = 0), K+V TB/s against the copy bandwidth, the median of
interleaved rounds, on random data. For tuning the num_splits = 0 heuristic
(src/plan/split_plan.hpp) where one KV head serves many query heads (absorbed MLA: 128 heads, d 64
plus qv against dv 256) or GQA.

    PYTHONPATH=python FLASHHOPPER_LIBRARY=build/libflashhopper.so python3 bench/profile/split_sweep.py \
        --mla --batches 32 128 --cache-lens 4096 16384 --seqlens-q 1 4
"""
import argparse

import torch

from flashhopper import flash_attn_interface as fh
from flashhopper.bench_decode import copy_tbps
from flashhopper.bench_timing import time_all_ms


def sweep(batch, seqlen_q, cache_len, heads_q, heads_kv, d, dv, mla, splits, copy):
    q = torch.randn(batch, seqlen_q, heads_q, d, device="cuda", dtype=torch.bfloat16)
    qv = torch.randn(batch, seqlen_q, heads_q, dv, device="cuda", dtype=torch.bfloat16) if mla else None
    k = torch.randn(batch, cache_len, heads_kv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(batch, cache_len, heads_kv, dv, device="cuda", dtype=torch.bfloat16)
    lengths = torch.full((batch,), cache_len, dtype=torch.int32, device="cuda")
    causal = seqlen_q > 1
    fns = {n: (lambda n=n: fh.flash_attn_with_kvcache(q, k, v, qv=qv, cache_seqlens=lengths, causal=causal,
                                                      num_splits=n)) for n in [0, *splits]}
    ms = time_all_ms(fns, warmup=5, rounds=9, calls=10)
    kv_bytes = batch * cache_len * heads_kv * (d + dv) * 2
    cells = "  ".join(f"{n or 'auto'}:{kv_bytes / (ms[n] * 1e-3) / 1e12:4.2f}" for n in fns)
    best = min(splits, key=lambda n: ms[n])
    print(f"batch {batch:4d} sq {seqlen_q} cache {cache_len:6d}: TB/s by splits {cells}  "
          f"(copy {copy:.2f}; best {best}, auto at {ms[best] / ms[0]:.2f} of best's speed)", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mla", action="store_true", help="absorbed MLA: 128 heads on 1, d 64 + qv, dv --mla-dv")
    parser.add_argument("--mla-dv", type=int, default=256, help="absorbed MLA's latent width (256 or 512)")
    parser.add_argument("--heads", type=int, nargs=2, default=[32, 8], metavar=("HQ", "HKV"))
    parser.add_argument("--hdim", type=int, default=128)
    parser.add_argument("--batches", type=int, nargs="+", default=[32])
    parser.add_argument("--cache-lens", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--seqlens-q", type=int, nargs="+", default=[1])
    parser.add_argument("--splits", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8, 12, 16])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("split_sweep: no CUDA device")
    heads_q, heads_kv, d, dv = (128, 1, 64, args.mla_dv) if args.mla else (*args.heads, args.hdim, args.hdim)
    copy = copy_tbps()
    for seqlen_q in args.seqlens_q:
        for batch in args.batches:
            for cache_len in args.cache_lens:
                sweep(batch, seqlen_q, cache_len, heads_q, heads_kv, d, dv, args.mla, args.splits, copy)


if __name__ == "__main__":
    main()
