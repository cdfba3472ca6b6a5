"""fp8 (e4m3) forward beside bf16, same GPU, same run: FlashHopper's forward on float8_e4m3fn q, k, v
(with q/k/v_descale of ones, so the descale path runs) against its own bf16 forward on the same
values (the fp8 tensors converted to bf16, so both compute the same attention) and against PyTorch
SDPA's cuDNN backend in bf16, and cuDNN on the fp8 tensors where this PyTorch's SDPA takes them
(else its column stays empty and says why once); and the fp8 forward with v column-major (stored
[B, H, D, S], keys contiguous: FA3's V_colmajor, which needs no transpose in the kernel). TFLOP/s
with FlashAttention's count (4 * B * H * sq * sk * d, halved when causal); medians of interleaved
rounds of back-to-back calls, as python -m flashhopper.bench. fp8_vs_bf16 is the fp8 time's
speed-up over our bf16; max_diff the largest absolute difference of the fp8 out from the bf16 one
(P rounded to e4m3 is most of it).

Writes bench_fp8_<date>.csv (after every row) into --out and prints the table last.

    python -m flashhopper.bench --fp8 [--hdims 64 128 256] [--seqlens 1024 ...] [--causal 0 1] [--out DIR]
"""
import argparse
import csv
import datetime
import os
import sys
import time

import torch
from torch.nn.attention import SDPBackend

from . import interface as flashhopper
from .bench import _fmt, _sdpa, _time_row, flops
from .bench_timing import can_time_here

BACKENDS = ("fp8", "fp8_vcol", "bf16", "cudnn_bf16", "cudnn_fp8")
FIELDS = ["date", "gpu", "hdim", "causal", "seqlen", "batch", "heads",
          *(f"{name}_{unit}" for name in BACKENDS for unit in ("ms", "tflops")), "fp8_vs_bf16", "max_diff"]


def _row(row, batch, seqlen, heads, head_dim, causal, timing, reported):
    shape = (batch, seqlen, heads, head_dim)
    q8, k8, v8 = (torch.randn(shape, device="cuda").to(torch.float8_e4m3fn) for _ in range(3))
    q, k, v = (x.to(torch.bfloat16) for x in (q8, k8, v8))  # the same values in bf16
    ones = torch.ones(batch, heads, device="cuda")
    qt, kt, vt, q8t, k8t, v8t = (x.transpose(1, 2) for x in (q, k, v, q8, k8, v8))  # SDPA: [B, H, S, D]
    v8_columns = v8.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)  # the same values, keys contiguous
    setups = {
        "fp8": lambda: lambda: flashhopper.forward(q8, k8, v8, causal=bool(causal), q_descale=ones, k_descale=ones,
                                                   v_descale=ones),
        "fp8_vcol": lambda: lambda: flashhopper.forward(q8, k8, v8_columns, causal=bool(causal), q_descale=ones,
                                                        k_descale=ones, v_descale=ones),
        "bf16": lambda: lambda: flashhopper.forward(q, k, v, causal=bool(causal)),
        "cudnn_bf16": lambda: lambda: _sdpa(SDPBackend.CUDNN_ATTENTION, qt, kt, vt, causal),
        "cudnn_fp8": lambda: lambda: _sdpa(SDPBackend.CUDNN_ATTENTION, q8t, k8t, v8t, causal),
    }
    fns = _time_row(row, setups, flops(batch, heads, seqlen, head_dim, causal), timing, reported)
    row["fp8_vs_bf16"] = row["bf16_ms"] / row["fp8_ms"]
    row["max_diff"] = float("nan")
    if "fp8" in fns and "bf16" in fns:
        with torch.no_grad():
            row["max_diff"] = (fns["fp8"]().float() - fns["bf16"]().float()).abs().max().item()


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m flashhopper.bench --fp8", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hdims", type=int, nargs="+", default=None,
                        help="head dims (default: the fp8 forward families this build compiled)")
    parser.add_argument("--seqlens", type=int, nargs="+", default=[1024, 4096, 16384],
                        help="tokens a sequence (default: %(default)s)")
    parser.add_argument("--causal", type=int, nargs="+", default=[0, 1], choices=[0, 1],
                        help="causal settings to run (default: %(default)s)")
    parser.add_argument("--total-tokens", type=int, default=16384,
                        help="batch * seqlen, as the dense grid's (default: %(default)s)")
    parser.add_argument("--model-dim", type=int, default=2048, help="heads * head dim (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=15, help="interleaved rounds (default: %(default)s)")
    parser.add_argument("--calls", type=int, default=10, help="back-to-back calls a round (default: %(default)s)")
    parser.add_argument("--out", default="flashhopper-bench", help="folder for the CSV (default: %(default)s)")
    args = parser.parse_args(argv)
    if not hasattr(torch, "float8_e4m3fn"):
        print("python -m flashhopper.bench --fp8: this PyTorch has no float8_e4m3fn.", file=sys.stderr)
        return 1
    if not can_time_here("python -m flashhopper.bench --fp8"):
        return 1
    if args.hdims is None:
        args.hdims = sorted({f.head_dim for f in flashhopper.compiled_families()
                             if f.pass_ == "forward" and f.dtype == torch.float8_e4m3fn})
        if not args.hdims:
            print("python -m flashhopper.bench --fp8: this build has no fp8 kernels (the bench kernel set has them).",
                  file=sys.stderr)
            return 1
    os.makedirs(args.out, exist_ok=True)
    gpu, date = torch.cuda.get_device_name(), datetime.date.today().isoformat()
    path = os.path.join(args.out, f"bench_fp8_{date}.csv")
    timing = dict(warmup=10, rounds=args.rounds, calls=args.calls)
    torch.manual_seed(0)
    rows, reported, started = [], set(), time.monotonic()
    total = len(args.hdims) * len(args.causal) * len(args.seqlens)
    for head_dim in args.hdims:
        for causal in args.causal:
            for seqlen in args.seqlens:
                batch, heads = max(args.total_tokens // seqlen, 1), args.model_dim // head_dim
                row = {"date": date, "gpu": gpu, "hdim": head_dim, "causal": causal, "seqlen": seqlen,
                       "batch": batch, "heads": heads, "pass": "fwd"}
                _row(row, batch, seqlen, heads, head_dim, causal, timing, reported)
                del row["pass"]
                rows.append(row)
                print(f"[{len(rows)}/{total}] hdim {head_dim} causal {causal} seqlen {seqlen}: fp8 "
                      f"{_fmt(row['fp8_tflops'], '.0f')}, bf16 {_fmt(row['bf16_tflops'], '.0f')} TFLOP/s "
                      f"[{time.monotonic() - started:.0f} s]", flush=True)
                with open(path, "w", newline="") as f:
                    writer = csv.DictWriter(f, fieldnames=FIELDS)
                    writer.writeheader()
                    writer.writerows(rows)
    print(f"\n{gpu}, {date}, forward TFLOP/s, {args.total_tokens} tokens, model dim {args.model_dim} "
          "('-': not available)")
    print("| hdim | causal | seqlen | fp8 | fp8, V column-major | bf16 | fp8 / bf16 | cuDNN bf16 | cuDNN fp8 "
          "| max diff |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['hdim']} | {r['causal']} | {r['seqlen']} | {_fmt(r['fp8_tflops'], '.0f')} | "
              f"{_fmt(r['fp8_vcol_tflops'], '.0f')} | "
              f"{_fmt(r['bf16_tflops'], '.0f')} | {_fmt(r['fp8_vs_bf16'], '.2f')} | "
              f"{_fmt(r['cudnn_bf16_tflops'], '.0f')} | {_fmt(r['cudnn_fp8_tflops'], '.0f')} | "
              f"{_fmt(r['max_diff'], '.3f')} |")
    print(f"wrote {path}")
    return 0
