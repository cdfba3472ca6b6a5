#!/usr/bin/env python3
"""Masks and score transforms side by side: FlashHopper against FlashAttention-4's sm90 path (when
`flash_attn.cute` imports: pip package flash-attn-4==4.0.0b36) and against FlashHopper's
own call without the feature, forward and backward, bf16, GQA 32/8 (--kv-heads 32: MHA), head dim
128 (--hdims: any of the built ones, each row once per head dim).

Rows (the default set): sliding window (4095, 0) at 16k and (1023, 0) at 128k tokens, softcap 30
causal at 16k (and the same call without softcap), learnable sinks at 16k, non-causal and causal
(and the same calls without). --rows grid: issue 48's set at --tokens (default 16384; 4096 too):
windows (1023, 0), (4095, 0), (1023, 1023) and (4095, 4095), chunks of 8192 causal, softcap 30
causal and not, learnable sinks causal and not, each beside the same call without the feature.
TFLOP/s count the visible (query, key) pairs: 4 * heads * d * pairs forward, 2.5x that backward.
Median of interleaved rounds (flashhopper.bench_timing.time_all_ms). The backward rows also give
each backend's peak memory over one forward + backward step through autograd (flash_attn_func;
FA4's flash_attn_func), MiB above what was allocated before it.

    PYTHONPATH=python FLASHHOPPER_LIBRARY=build/libflashhopper.so python3 bench/bench_features.py --out DIR
    ... bench/bench_features.py --rows grid --hdims 64 128 256 --tokens 4096 16384 --passes fwd
"""
import argparse
import csv
import datetime
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "python"))
import flashhopper  # noqa: E402
from flashhopper.bench_timing import step_peak_mib, time_all_ms  # noqa: E402

try:
    from flash_attn.cute import flash_attn_func as fa4_func
except Exception as error:  # FA4 missing: its columns stay empty
    fa4_func = None
    FA4_ERROR = repr(error)
else:
    FA4_ERROR = ""

HEADS_Q = 32


def visible_pairs(seqlen, window=(-1, -1), causal=False, chunk=0):
    """Number of visible (row, key) pairs of one head, sq = sk = seqlen."""
    rows = torch.arange(seqlen, dtype=torch.int64)
    left, right = window
    if causal:
        right = 0
    lo = torch.zeros_like(rows) if left < 0 else (rows - left).clamp(min=0)
    hi = torch.full_like(rows, seqlen) if right < 0 else (rows + right + 1).clamp(max=seqlen)
    if chunk > 0:  # the row's chunk of keys, on top of the window
        lo = torch.maximum(lo, rows // chunk * chunk)
        hi = torch.minimum(hi, rows // chunk * chunk + chunk)
    return int((hi - lo).clamp(min=0).sum())


ROWS = [
    # name, seqlen, batch, options (flashhopper/FA4 keyword arguments), baseline options
    ("window 4095", 16384, 1, dict(window_size=(4095, 0)), dict(causal=True)),
    ("window 1023", 131072, 1, dict(window_size=(1023, 0)), None),
    ("softcap 30 causal", 16384, 1, dict(causal=True, softcap=30.0), dict(causal=True)),
    ("learnable sink", 16384, 1, dict(learnable_sink=True), dict()),
    ("learnable sink causal", 16384, 1, dict(causal=True, learnable_sink=True), dict(causal=True)),
]


def grid_rows(tokens):
    """Issue 48's rows at `tokens` tokens (one sequence), each beside the call without the feature."""
    causal, full = dict(causal=True), dict()
    return [
        ("window 1023", tokens, 1, dict(window_size=(1023, 0)), causal),
        ("window 4095", tokens, 1, dict(window_size=(4095, 0)), causal),
        ("window 1023 two-sided", tokens, 1, dict(window_size=(1023, 1023)), full),
        ("window 4095 two-sided", tokens, 1, dict(window_size=(4095, 4095)), full),
        ("chunk 8192 causal", tokens, 1, dict(causal=True, attention_chunk=8192), causal),
        ("softcap 30 causal", tokens, 1, dict(causal=True, softcap=30.0), causal),
        ("softcap 30", tokens, 1, dict(softcap=30.0), full),
        ("learnable sink", tokens, 1, dict(learnable_sink=True), full),
        ("learnable sink causal", tokens, 1, dict(causal=True, learnable_sink=True), causal),
    ]


def pairs_of(seqlen, options):
    return visible_pairs(seqlen, options.get("window_size", (-1, -1)), options.get("causal", False),
                         options.get("attention_chunk", 0))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--passes", nargs="+", choices=("fwd", "bwd"), default=["fwd", "bwd"],
                        help="which passes to time (a forward-only build: --passes fwd)")
    parser.add_argument("--hdims", type=int, nargs="+", default=[128], help="head dims (each built family)")
    parser.add_argument("--kv-heads", type=int, default=8, help="KV heads beside 32 query heads (32: MHA)")
    parser.add_argument("--rows", choices=("default", "grid"), default="default",
                        help="the default rows, or issue 48's grid at each of --tokens")
    parser.add_argument("--tokens", type=int, nargs="+", default=[16384], help="--rows grid: tokens a row")
    args = parser.parse_args()
    if HEADS_Q % args.kv_heads != 0:
        parser.error(f"--kv-heads {args.kv_heads} must divide the {HEADS_Q} query heads")
    row_set = ROWS if args.rows == "default" else [r for tokens in args.tokens for r in grid_rows(tokens)]
    # A row's label names its head dim, heads and tokens where they are not the default set's.
    labelled = args.hdims != [128] or args.kv_heads != 8 or args.rows == "grid"
    os.makedirs(args.out, exist_ok=True)
    gpu = torch.cuda.get_device_name()
    date = datetime.date.today().isoformat()
    if fa4_func is None:
        print(f"FlashAttention-4 not available ({FA4_ERROR}): its columns stay empty", flush=True)
    results = []
    for hdim, (row_name, seqlen, batch, options, baseline) in [(d, r) for d in args.hdims for r in row_set]:
        name = f"{row_name} d{hdim} {HEADS_Q}/{args.kv_heads} {seqlen // 1024}k" if labelled else row_name
        q = torch.randn(batch, seqlen, HEADS_Q, hdim, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(batch, seqlen, args.kv_heads, hdim, device="cuda", dtype=torch.bfloat16)
                for _ in range(2))
        dout = torch.randn_like(q)
        sink = torch.randn(HEADS_Q, device="cuda", dtype=torch.float32)

        def ours_kwargs(opts):
            kw = dict(opts)
            if kw.pop("learnable_sink", False):
                kw["learnable_sink"] = sink
            return kw

        calls = {}
        kw = ours_kwargs(options)
        calls["flashhopper"] = kw
        if baseline is not None:
            calls["flashhopper_without"] = ours_kwargs(baseline)
        pair_count = {"flashhopper": pairs_of(seqlen, options), "flashhopper_without": pairs_of(seqlen, baseline or {}),
                      "fa4": pairs_of(seqlen, options)}
        for pass_ in args.passes:
            fns = {}
            for backend, kwargs in calls.items():
                try:
                    if pass_ == "fwd":
                        flashhopper.forward(q, k, v, **kwargs)
                        fns[backend] = (lambda kwargs=kwargs: flashhopper.forward(q, k, v, **kwargs))
                    else:
                        out, lse = flashhopper.forward(q, k, v, return_lse=True, **kwargs)
                        fns[backend] = (lambda kwargs=kwargs, out=out, lse=lse:
                                        flashhopper.backward(dout, q, k, v, out, lse, **kwargs))
                        fns[backend]()
                except Exception as error:
                    print(f"  {name} {pass_} {backend}: {error}", flush=True)
            if fa4_func is not None:
                try:
                    fkw = ours_kwargs(options)
                    if pass_ == "fwd":
                        fa4_func(q, k, v, **fkw)
                        fns["fa4"] = lambda fkw=fkw: fa4_func(q, k, v, **fkw)
                    else:
                        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
                        out = fa4_func(*leaves, **fkw)[0]
                        fns["fa4"] = (lambda leaves=leaves, out=out:
                                      torch.autograd.grad(out, leaves, dout, retain_graph=True))
                        fns["fa4"]()
                except Exception as error:
                    print(f"  {name} {pass_} fa4: {error}", flush=True)
            torch.cuda.synchronize()
            times = time_all_ms(fns, warmup=3, rounds=args.rounds, calls=args.calls)
            row = {"date": date, "gpu": gpu, "row": name, "pass": pass_, "seqlen": seqlen, "hdim": hdim,
                   "heads_q": HEADS_Q, "heads_kv": args.kv_heads}
            for backend in ("flashhopper", "flashhopper_without", "fa4"):
                ms = times.get(backend, float("nan"))
                fl = 4.0 * batch * HEADS_Q * hdim * pair_count[backend] * (2.5 if pass_ == "bwd" else 1.0)
                row[f"{backend}_ms"] = ms
                row[f"{backend}_tflops"] = fl / (ms * 1e-3) / 1e12 if ms == ms else float("nan")
            if pass_ == "bwd":
                steps = {"flashhopper": lambda *t: flashhopper.flash_attn_func(*t, **kw)}
                if "fa4" in fns:
                    steps["fa4"] = lambda *t: fa4_func(*t, **ours_kwargs(options))
                for backend in ("flashhopper", "fa4"):
                    row[f"{backend}_step_peak_mib"] = (step_peak_mib(steps[backend], (q, k, v))
                                                       if backend in steps and backend in fns else float("nan"))
            results.append(row)
            print(f"{name:>22} {pass_}: ours {row['flashhopper_tflops']:7.1f}  without "
                  f"{row['flashhopper_without_tflops']:7.1f}  FA4 {row['fa4_tflops']:7.1f} TFLOP/s", flush=True)
    path = os.path.join(args.out, f"bench_features_{date}.csv")
    fields = list(dict.fromkeys(key for r in results for key in r))  # the backward rows' peak columns too
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, restval=float("nan"))
        writer.writeheader()
        writer.writerows(results)
    print("\n".join(table_lines(results)))
    print(f"written: {path}")
    _plot(results, os.path.join(args.out, "bench_features.png"), gpu, date,
          f"GQA {HEADS_Q}/{args.kv_heads}, hdim {'/'.join(map(str, args.hdims))}")


def table_lines(results):
    """The markdown table: TFLOP/s, the ratios, and for backward rows the step's peak MiB (ours / FA4's)."""
    lines = ["| row | pass | FlashHopper | without the feature | FA4 | ours / FA4 | ours / without | step peak MiB "
             "ours / FA4 |", "|---|---|---|---|---|---|---|---|"]
    nan = float("nan")
    for r in results:
        a, b, c = r["flashhopper_tflops"], r["flashhopper_without_tflops"], r["fa4_tflops"]
        ours, theirs = r.get("flashhopper_step_peak_mib", nan), r.get("fa4_step_peak_mib", nan)
        peak = "" if ours != ours else f"{ours:.0f} / {theirs:.0f}" if theirs == theirs else f"{ours:.0f} / -"
        lines.append(f"| {r['row']} | {r['pass']} | {a:.0f} | {b:.0f} | {c:.0f} | {a / c:.2f} | {a / b:.2f} | {peak} |")
    return lines


def _plot(results, path, gpu, date, shape="GQA 32/8, hdim 128"):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return
    labels = [f"{r['row']}\n{r['pass']}" for r in results]
    series = [("flashhopper", "FlashHopper"), ("flashhopper_without", "FlashHopper without the feature"),
              ("fa4", "FlashAttention-4")]
    fig, ax = plt.subplots(figsize=(max(8, 1.1 * len(results)), 4.5))
    width = 0.27
    for i, (key, name) in enumerate(series):
        ax.bar([x + (i - 1) * width for x in range(len(results))], [r[f"{key}_tflops"] for r in results], width,
               label=name)
    ax.set_xticks(range(len(results)))
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_ylabel("TFLOP/s (visible pairs)")
    ax.set_title(f"Masks and score transforms, bf16, {shape} ({gpu}, {date})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"written: {path}")


if __name__ == "__main__":
    main()
