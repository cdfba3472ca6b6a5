#!/usr/bin/env python3
"""Side-by-side attention speed: FlashHopper vs PyTorch SDPA (cuDNN and FLASH backends), same
GPU, same run, random bf16 inputs. TFLOP/s with FlashAttention's FLOP counts (forward
4*B*H*sq*sk*d, halved when causal), median of 15 interleaved rounds of 10 back-to-back calls. Writes a CSV and a
PNG plot and prints a table with the ratio to cuDNN.

    PYTHONPATH=python FLASHHOPPER_LIBRARY=build/libflashhopper.so python3 bench/benchmark_attention.py
"""
import argparse
import csv
import datetime
import os
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashhopper


def flops(batch, heads, seqlen, head_dim, causal):
    return 4.0 * batch * heads * seqlen * seqlen * head_dim * (0.5 if causal else 1.0)


def time_all_ms(fns, warmup=10, rounds=15, calls=10):
    """Median per backend of `rounds` timings, each the mean of `calls` back-to-back calls, after
    `warmup` calls. Rounds interleave the backends (A, B, C, A, B, C, ...) so that clock and power
    drift during the run falls on all of them alike; back-to-back calls let each backend's host
    launch cost overlap its previous call's GPU work, as in a model's forward."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls):
                fn()
            stop.record()
            stop.synchronize()
            times[name].append(start.elapsed_time(stop) / calls)
    return {name: statistics.median(t) for name, t in times.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hdims", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--causal", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--total-tokens", type=int, default=16384)
    parser.add_argument("--model-dim", type=int, default=2048)
    parser.add_argument("--out", default="bench")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    gpu = torch.cuda.get_device_name()
    date = datetime.date.today().isoformat()
    torch.manual_seed(0)

    rows = []
    for head_dim in args.hdims:
        for causal in args.causal:
            for seqlen in args.seqlens:
                batch, heads = args.total_tokens // seqlen, args.model_dim // head_dim
                q, k, v = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16)
                           for _ in range(3))
                qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))  # SDPA wants [B, H, S, D]
                fl = flops(batch, heads, seqlen, head_dim, causal)
                result = {"date": date, "gpu": gpu, "pass": "fwd", "hdim": head_dim, "causal": causal,
                          "seqlen": seqlen, "batch": batch, "heads": heads}
                candidates = {
                    "flashhopper": lambda: flashhopper.forward(q, k, v, causal=bool(causal)),
                    "cudnn": lambda: _sdpa(SDPBackend.CUDNN_ATTENTION, qt, kt, vt, causal),
                    "flash": lambda: _sdpa(SDPBackend.FLASH_ATTENTION, qt, kt, vt, causal),
                }
                runnable = {}
                for name, fn in candidates.items():
                    try:
                        fn()
                        runnable[name] = fn
                    except Exception as error:  # a backend that cannot run this shape
                        result[f"{name}_ms"] = result[f"{name}_tflops"] = float("nan")
                        print(f"  {name} hdim={head_dim} causal={causal} seqlen={seqlen}: {error}".splitlines()[0])
                for name, ms in time_all_ms(runnable).items():
                    result[f"{name}_ms"] = ms
                    result[f"{name}_tflops"] = fl / ms * 1e-9
                with torch.no_grad():
                    ours = flashhopper.forward(q, k, v, causal=bool(causal)).float()
                    ref = _sdpa(SDPBackend.CUDNN_ATTENTION, qt, kt, vt, causal).transpose(1, 2).float()
                    result["max_diff_vs_cudnn"] = (ours - ref).abs().max().item()
                rows.append(result)
                print(f"hdim {head_dim:3d} causal {causal} seqlen {seqlen:5d}: "
                      f"flashhopper {result['flashhopper_tflops']:6.1f}  cudnn {result['cudnn_tflops']:6.1f}  "
                      f"flash {result['flash_tflops']:6.1f} TFLOP/s  "
                      f"ratio {result['flashhopper_tflops'] / result['cudnn_tflops']:.2f}", flush=True)

    csv_path = os.path.join(args.out, "bench_forward.csv")
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
        writer.writeheader()
        writer.writerows(rows)
    _plot(rows, os.path.join(args.out, "bench_forward.png"), gpu, date)
    print(f"\n{gpu}, {date}, forward TFLOP/s (ratio = flashhopper / cudnn)")
    print("| hdim | causal | seqlen | flashhopper | cudnn | flash | ratio |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['hdim']} | {r['causal']} | {r['seqlen']} | {r['flashhopper_tflops']:.0f} | "
              f"{r['cudnn_tflops']:.0f} | {r['flash_tflops']:.0f} | {r['flashhopper_tflops'] / r['cudnn_tflops']:.2f} |")
    print(f"wrote {csv_path}")


def _sdpa(backend, q, k, v, causal):
    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(q, k, v, is_causal=bool(causal))


def _plot(rows, path, gpu, date):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hdims = sorted({r["hdim"] for r in rows})
    causals = sorted({r["causal"] for r in rows})
    fig, axes = plt.subplots(len(causals), len(hdims), figsize=(5 * len(hdims), 3.8 * len(causals)), squeeze=False)
    for i, causal in enumerate(causals):
        for j, hdim in enumerate(hdims):
            ax = axes[i][j]
            sel = [r for r in rows if r["hdim"] == hdim and r["causal"] == causal]
            labels = [str(r["seqlen"]) for r in sel]
            width = 0.27
            for n, (name, color) in enumerate((("flashhopper", "tab:red"), ("cudnn", "tab:green"),
                                               ("flash", "tab:blue"))):
                xs = [x + (n - 1) * width for x in range(len(sel))]
                ax.bar(xs, [r[f"{name}_tflops"] for r in sel], width, label=name, color=color)
            ax.set_xticks(range(len(sel)), labels)
            ax.set_title(f"forward, hdim {hdim}, {'causal' if causal else 'non-causal'}")
            ax.set_xlabel("sequence length (16k tokens total)")
            ax.set_ylabel("TFLOP/s")
            ax.legend(fontsize=8)
    fig.suptitle(f"FlashHopper vs PyTorch SDPA, bf16, {gpu}, {date}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
