#!/usr/bin/env python3
"""Head dims side by side: FlashHopper's flash_attn_func against FlashAttention-4's sm90 path (when
`flash_attn.cute` imports: flash-attn-4==4.0.0b36) and cuDNN (PyTorch SDPA's CUDNN_ATTENTION
backend), forward and backward, bf16, dense batches of 16384 tokens, 2048 / d heads (at least 8),
for every (d, dv) row of ROWS: the compiled head dims, the padded ones between them (80, 112: they
run on the next compiled family), MLA's 192/128 and 512 (no peer runs it).

TFLOP/s: FlashAttention's count, 2 * B * H * sq * sk * (d + dv) forward (half of it causal), 2.5
times that backward. Backward is timed through autograd (the forward runs once with requires_grad
inputs; each timed call is torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)). Each
number is the median of interleaved rounds of flashhopper.bench_timing.time_all_ms (CUDA events around
back-to-back calls). A backend that cannot run a row leaves it empty ('-', NaN in the CSV) and
prints why. max_diff_vs_fa4 is the largest absolute difference of our out (fwd) or dq/dk/dv (bwd)
from FA4's. A row whose (d, dv) has no family of its own for the pass also times FlashHopper on
the same batch and heads at the family it runs on (family_hdim, family_ms): padded_vs_family is
its time over that one's (the issue's "within 5% of the next compiled size's time").

Writes bench_head_dims_<date>.csv (after every row) and .png into --out; prints a table last.

    PYTHONPATH=python FLASHHOPPER_LIBRARY=build/libflashhopper.so python3 bench/bench_head_dims.py --out DIR
"""
import argparse
import csv
import datetime
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "python"))

TOTAL_TOKENS, MODEL_DIM = 16384, 2048
ROWS = [(64, 64), (80, 80), (96, 96), (112, 112), (128, 128), (192, 128), (192, 192), (256, 256), (512, 512)]
BACKENDS = ("flashhopper", "fa4", "cudnn")
FIELDS = ["date", "gpu", "pass", "hdim", "hdim_v", "causal", "seqlen", "batch", "heads",
          *(f"{b}_{unit}" for b in BACKENDS for unit in ("ms", "tflops")), "ours_vs_fa4", "ours_vs_cudnn",
          "max_diff_vs_fa4", "family_hdim", "family_ms", "padded_vs_family"]
NAN = float("nan")


def flops(batch, heads, seqlen, d, dv, causal, pass_):
    fwd = 2.0 * batch * heads * seqlen * seqlen * (d + dv) * (0.5 if causal else 1.0)
    return fwd * (2.5 if pass_ == "bwd" else 1.0)


def family_of(families, pass_, d, dv):
    """(D, DV) of the family a bf16 call with head dims (d, dv) runs on: of those with D >= d and
    DV >= dv, the least D + DV, then the least D (the library's own rule, compiled_families.hpp), or
    None when the build has none."""
    fits = [(f.head_dim + f.head_dim_v, f.head_dim, f.head_dim_v) for f in families
            if f.pass_ == pass_ and f.dtype == torch.bfloat16 and f.head_dim >= d and f.head_dim_v >= dv]
    return min(fits)[1:] if fits else None


def _fmt(value, spec=".0f"):
    return "-" if value != value else format(value, spec)


def main(argv=None):
    import flashhopper
    from flashhopper.bench import load_fa4, pass_setup
    from flashhopper.bench_timing import time_all_ms

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--causal", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--hdims", type=int, nargs="+", default=None,
                        help="only the rows of these head dims d (default: every row)")
    parser.add_argument("--out", default="bench")
    args = parser.parse_args(argv)
    rows_dv = [(d, dv) for d, dv in ROWS if args.hdims is None or d in args.hdims]
    if not rows_dv:
        parser.error(f"--hdims {args.hdims}: no row has these head dims (rows: {ROWS})")
    os.makedirs(args.out, exist_ok=True)
    fa4_func = load_fa4()
    families = flashhopper.compiled_families()
    gpu, date = torch.cuda.get_device_name(), datetime.date.today().isoformat()
    csv_path = os.path.join(args.out, f"bench_head_dims_{date}.csv")
    rows, started = [], time.monotonic()
    total = len(rows_dv) * len(args.causal) * len(args.seqlens) * 2
    torch.manual_seed(0)
    for d, dv in rows_dv:
        for causal in args.causal:
            for seqlen in args.seqlens:
                batch, heads = TOTAL_TOKENS // seqlen, max(8, MODEL_DIM // d)
                q, k = (torch.randn(batch, seqlen, heads, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
                v = torch.randn(batch, seqlen, heads, dv, device="cuda", dtype=torch.bfloat16)
                dout = torch.randn(batch, seqlen, heads, dv, device="cuda", dtype=torch.bfloat16)

                def cudnn(q_, k_, v_):
                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                        out = F.scaled_dot_product_attention(q_.transpose(1, 2), k_.transpose(1, 2),
                                                             v_.transpose(1, 2), is_causal=bool(causal))
                    return out.transpose(1, 2)

                calls = {"flashhopper": lambda q_, k_, v_: flashhopper.flash_attn_func(q_, k_, v_, causal=bool(causal)),
                         "cudnn": cudnn}
                if fa4_func is not None:
                    calls["fa4"] = lambda q_, k_, v_: fa4_func(q_, k_, v_, causal=bool(causal))
                for pass_ in ("fwd", "bwd"):
                    fns, results = {}, {}
                    family = family_of(families, "forward" if pass_ == "fwd" else "backward", d, dv)
                    padded = family is not None and family != (d, dv)
                    setups = [(name, call, (q, k, v), dout) for name, call in calls.items()]
                    if padded:  # the same batch and heads at the family's own head dims
                        fq, fk = (torch.randn(batch, seqlen, heads, family[0], device="cuda", dtype=torch.bfloat16)
                                  for _ in range(2))
                        fv, fdout = (torch.randn(batch, seqlen, heads, family[1], device="cuda", dtype=torch.bfloat16)
                                     for _ in range(2))
                        setups.append(("family", calls["flashhopper"], (fq, fk, fv), fdout))
                    for name, call, inputs, grad_out in setups:
                        try:
                            fns[name], results[name] = pass_setup(pass_, call, inputs, grad_out)
                        except Exception as error:
                            message = str(error).splitlines()[0] if str(error) else type(error).__name__
                            print(f"  d{d}/{dv} {pass_} {name}: {type(error).__name__}: {message[:160]}", flush=True)
                    ms = time_all_ms(fns, warmup=3, rounds=args.rounds, calls=args.calls) if fns else {}
                    row = {"date": date, "gpu": gpu, "pass": pass_, "hdim": d, "hdim_v": dv, "causal": causal,
                           "seqlen": seqlen, "batch": batch, "heads": heads}
                    work = flops(batch, heads, seqlen, d, dv, causal, pass_)
                    for name in BACKENDS:
                        t = ms.get(name, NAN)
                        row[f"{name}_ms"] = t
                        row[f"{name}_tflops"] = work / (t * 1e-3) / 1e12 if t == t else NAN
                    for peer in ("fa4", "cudnn"):
                        a, b = row["flashhopper_tflops"], row[f"{peer}_tflops"]
                        row[f"ours_vs_{peer}"] = a / b if a == a and b == b else NAN
                    row["max_diff_vs_fa4"] = (max((x.float() - y.float()).abs().max().item()
                                                  for x, y in zip(results["flashhopper"], results["fa4"]))
                                              if "flashhopper" in results and "fa4" in results else NAN)
                    row["family_hdim"] = f"{family[0]}/{family[1]}" if family else ""
                    row["family_ms"] = ms.get("family", NAN)
                    row["padded_vs_family"] = row["flashhopper_ms"] / row["family_ms"]
                    rows.append(row)
                    with open(csv_path, "w", newline="") as f:
                        writer = csv.DictWriter(f, fieldnames=FIELDS)
                        writer.writeheader()
                        writer.writerows(rows)
                    print(f"[{len(rows)}/{total}] {pass_} d{d}/{dv} causal={causal} s={seqlen}: ours "
                          f"{_fmt(row['flashhopper_tflops'])}, FA4 {_fmt(row['fa4_tflops'])}, cuDNN "
                          f"{_fmt(row['cudnn_tflops'])} TFLOP/s ({time.monotonic() - started:.0f} s)", flush=True)
                    del fns, results, setups
                del q, k, v, dout
    _plot(rows, os.path.join(args.out, f"bench_head_dims_{date}.png"))
    print(f"\n{gpu}, {date}, bf16, {TOTAL_TOKENS} tokens; TFLOP/s\n")
    print("| pass | d/dv | causal | seqlen | FlashHopper | FA4 | cuDNN | ours/FA4 | ours/cuDNN | runs on "
          "| time / its |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['pass']} | {r['hdim']}/{r['hdim_v']} | {r['causal']} | {r['seqlen']} | "
              f"{_fmt(r['flashhopper_tflops'])} | {_fmt(r['fa4_tflops'])} | {_fmt(r['cudnn_tflops'])} | "
              f"{_fmt(r['ours_vs_fa4'], '.2f')} | {_fmt(r['ours_vs_cudnn'], '.2f')} | {r['family_hdim'] or '-'} | "
              f"{_fmt(r['padded_vs_family'], '.2f')} |")


def _plot(rows, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot", flush=True)
        return
    panels = sorted({(r["pass"], r["causal"], r["seqlen"]) for r in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.8), squeeze=False)
    for ax, (pass_, causal, seqlen) in zip(axes[0], panels):
        sel = [r for r in rows if (r["pass"], r["causal"], r["seqlen"]) == (pass_, causal, seqlen)]
        labels = [f"{r['hdim']}/{r['hdim_v']}" if r["hdim"] != r["hdim_v"] else str(r["hdim"]) for r in sel]
        width = 0.27
        for i, name in enumerate(BACKENDS):
            ax.bar([x + (i - 1) * width for x in range(len(sel))], [r[f"{name}_tflops"] for r in sel], width,
                   label=name)
        ax.set_xticks(range(len(sel)))
        ax.set_xticklabels(labels, rotation=45)
        ax.set_title(f"{pass_}, {'causal' if causal else 'full'}, {seqlen}")
        ax.set_ylabel("TFLOP/s")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}", flush=True)


if __name__ == "__main__":
    main()
