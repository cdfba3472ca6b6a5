"""Side-by-side attention speed: FlashHopper vs PyTorch SDPA (cuDNN and FLASH backends), same
GPU, same run, random bf16 inputs, forward and backward. TFLOP/s with FlashAttention's FLOP counts
(forward 4*B*H*sq*sk*d, halved when causal; backward 2.5 times the forward's). Each number is the
median of interleaved rounds of back-to-back calls: 15 rounds of 10 calls for the forward, 10 rounds
of 5 calls for the backward (--rounds/--calls, --bwd-rounds/--bwd-calls). Writes a CSV and a PNG
plot per pass (bench_forward.*, bench_backward.*) and prints a table per pass with the ratio to
cuDNN.

The backward is timed alone. FlashHopper: flashhopper.backward on out and lse computed once by
flashhopper.forward(..., return_lse=True). SDPA: the forward runs once with requires_grad under the
backend's context, then each call is torch.autograd.grad(out, (q, k, v), dout, retain_graph=True),
which runs that backend's backward kernel(s) only. dout is laid out like each backend's out. A
backend that cannot run a shape (or FlashHopper's backward while the library says it is not
supported) is recorded as unavailable: NaN in the CSV, '-' in the table, no bar in the plot.
max_diff_vs_cudnn is the largest absolute difference from cuDNN's out (forward) or dq/dk/dv
(backward). The backward rows also record each backend's peak memory over one forward + backward
step through autograd (torch.cuda.max_memory_allocated above what was allocated before it:
outputs, saved tensors, workspace and gradients; the *_step_peak_mib columns).
FlashAttention-4's sm90 path is a column too where `flash_attn.cute` imports (the
peers' install; its backward timed through autograd as SDPA's), with the ratio to it.

    python -m flashhopper.bench [--passes fwd bwd] [--hdims 64 128 ...] [--seqlens ...] [--causal 0 1] [--out DIR]
    (bench/benchmark_attention.py is the same script; scripts/device_check.sh bench runs it)
    python -m flashhopper.bench --decode [...]: decoding against a KV cache (flashhopper.bench_decode)
    python -m flashhopper.bench --gate [...]: the speed gate against bench/baseline_<gpu>.csv (flashhopper.gate)
    python -m flashhopper.bench --fp8 [...]: the fp8 forward beside bf16 and cuDNN (flashhopper.bench_fp8)

Each measured row prints one progress line: [row/total] the numbers, elapsed seconds. The PNG needs
matplotlib (imported only to plot); without it the plot is skipped with a message.
"""
import argparse
import csv
import datetime
import math
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from . import interface as flashhopper  # forward / backward, no autograd
from .flash_attn_interface import flash_attn_func  # the memory of a step through autograd
from .bench_timing import can_time_here, first_tensor, step_peak_mib, time_all_ms

BACKENDS = ("flashhopper", "cudnn", "flash", "flashhopper_det", "fa4")  # _det: deterministic=True (backward only)
PEAK_BACKENDS = ("flashhopper", "cudnn", "fa4")  # the backward rows' peak memory of a whole step
FIELDS = ["date", "gpu", "pass", "hdim", "causal", "seqlen", "batch", "heads", "sm_margin",
          *(f"{name}_{unit}" for name in BACKENDS for unit in ("ms", "tflops")), "max_diff_vs_cudnn",
          *(f"{name}_step_peak_mib" for name in PEAK_BACKENDS)]
PASS_NAMES = {"fwd": "forward", "bwd": "backward"}


def flops(batch, heads, seqlen, head_dim, causal):
    return 4.0 * batch * heads * seqlen * seqlen * head_dim * (0.5 if causal else 1.0)


def pass_setup(pass_, call, inputs, dout):
    """(timed function, its result as a list of tensors) for one backend's call(*inputs): "fwd"
    times the call; "bwd" runs the forward once on requires_grad copies of the inputs and times
    torch.autograd.grad(out, inputs, dout, retain_graph=True), that backend's backward alone. Runs
    it once (raises if the backend cannot)."""
    if pass_ == "fwd":
        def fn():
            return first_tensor(call(*inputs))
        return fn, [fn()]
    leaves = [x.detach().requires_grad_() for x in inputs]
    out = first_tensor(call(*leaves))

    def fn():
        return torch.autograd.grad(out, leaves, dout, retain_graph=True)
    return fn, list(fn())


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--decode" in argv:  # the decode benchmark, with its own options
        from .bench_decode import main as decode_main
        return decode_main([a for a in argv if a != "--decode"])
    if "--fp8" in argv:  # fp8 forward beside bf16, with its own options
        from .bench_fp8 import main as fp8_main
        return fp8_main([a for a in argv if a != "--fp8"])
    if "--gate" in argv:  # the speed gate against the recorded baseline, with its own options
        from .gate import main as gate_main
        return gate_main([a for a in argv if a != "--gate"])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--decode", action="store_true",
                        help="time decoding against a KV cache instead (its options: --decode --help)")
    parser.add_argument("--gate", action="store_true",
                        help="run the speed gate against the recorded baseline instead (its options: --gate --help)")
    parser.add_argument("--passes", nargs="+", choices=["fwd", "bwd"], default=["fwd", "bwd"],
                        help="passes to time, in this order (default: %(default)s)")
    parser.add_argument("--hdims", type=int, nargs="+", default=None,
                        help="head dims (default: the bf16 forward families the library compiled)")
    parser.add_argument("--seqlens", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384],
                        help="sequence lengths (default: %(default)s)")
    parser.add_argument("--causal", type=int, nargs="+", default=[0, 1], choices=[0, 1],
                        help="0: full, 1: causal (default: %(default)s)")
    parser.add_argument("--total-tokens", type=int, default=16384,
                        help="batch = total tokens / seqlen (default: %(default)s)")
    parser.add_argument("--model-dim", type=int, default=2048,
                        help="heads = model dim / head dim (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=15, help="forward: interleaved rounds (default: %(default)s)")
    parser.add_argument("--calls", type=int, default=10,
                        help="forward: back-to-back calls per round (default: %(default)s)")
    parser.add_argument("--bwd-rounds", type=int, default=10,
                        help="backward: interleaved rounds (default: %(default)s)")
    parser.add_argument("--bwd-calls", type=int, default=5,
                        help="backward: back-to-back calls per round (default: %(default)s)")
    parser.add_argument("--sm-margin", type=int, default=0,
                        help="SMs FlashHopper's kernels leave free, as FA3's sm_margin (default: %(default)s)")
    parser.add_argument("--out", default="flashhopper-bench",
                        help="folder for the CSVs and plots, created when the run starts (default: %(default)s)")
    args = parser.parse_args(argv)
    if not can_time_here("flashhopper.bench"):
        return 1
    if args.hdims is None:
        args.hdims = sorted({f.head_dim for f in flashhopper.compiled_families()
                             if f.pass_ == "forward" and f.dtype == torch.bfloat16})
    os.makedirs(args.out, exist_ok=True)
    fa4 = load_fa4()
    gpu = torch.cuda.get_device_name()
    date = datetime.date.today().isoformat()
    timing = {"fwd": dict(warmup=10, rounds=args.rounds, calls=args.calls),
              "bwd": dict(warmup=3, rounds=args.bwd_rounds, calls=args.bwd_calls)}
    torch.manual_seed(0)

    passes = list(dict.fromkeys(args.passes))  # in the order given, each once
    total = len(passes) * len(args.hdims) * len(args.causal) * len(args.seqlens)
    done, started = 0, time.monotonic()
    print(f"{gpu}, {date}: {total} rows ({', '.join(passes)}), results in {args.out}/", flush=True)
    tables = []
    for pass_ in passes:  # in the order given, each once
        name = PASS_NAMES[pass_]
        csv_path = os.path.join(args.out, f"bench_{name}.csv")
        rows, reported = [], set()
        for head_dim in args.hdims:
            for causal in args.causal:
                for seqlen in args.seqlens:
                    batch, heads = args.total_tokens // seqlen, args.model_dim // head_dim
                    row = {"date": date, "gpu": gpu, "pass": pass_, "hdim": head_dim, "causal": causal,
                           "seqlen": seqlen, "batch": batch, "heads": heads, "sm_margin": args.sm_margin}
                    measure = _forward_row if pass_ == "fwd" else _backward_row
                    measure(row, batch, seqlen, heads, head_dim, causal, timing[pass_], reported, args.sm_margin, fa4)
                    rows.append(row)
                    done += 1
                    _progress(done, total, started, row)
                    _write_csv(rows, csv_path)  # after every row, so a run cut short keeps what it measured
        _plot(rows, os.path.join(args.out, f"bench_{name}.png"), gpu, date, name)
        tables.append((name, rows, csv_path))

    for name, rows, csv_path in tables:
        margin = f", flashhopper with sm_margin {args.sm_margin}" if args.sm_margin else ""
        print(f"\n{gpu}, {date}, {name} TFLOP/s (ratio = flashhopper / cudnn; '-': not available{margin})")
        print("| hdim | causal | seqlen | flashhopper | cudnn | flash | FA4 | ratio | ours / FA4 | deterministic | "
              "det / default |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            det = r["flashhopper_det_tflops"]
            print(f"| {r['hdim']} | {r['causal']} | {r['seqlen']} | {_fmt(r['flashhopper_tflops'], '.0f')} | "
                  f"{_fmt(r['cudnn_tflops'], '.0f')} | {_fmt(r['flash_tflops'], '.0f')} | "
                  f"{_fmt(r['fa4_tflops'], '.0f')} | {_fmt(_ratio(r), '.2f')} | "
                  f"{_fmt(r['flashhopper_tflops'] / r['fa4_tflops'], '.2f')} | "
                  f"{_fmt(det, '.0f')} | {_fmt(det / r['flashhopper_tflops'], '.2f')} |")
        print(f"wrote {csv_path}")
    print(f"done: {done} rows in {time.monotonic() - started:.0f} s")


def _progress(done, total, started, row):
    """One line per measured row: count/total, the row's numbers, elapsed time."""
    det = row["flashhopper_det_tflops"]
    print(f"[{done:{len(str(total))}d}/{total}] {row['pass']} hdim {row['hdim']:3d} causal {row['causal']} "
          f"seqlen {row['seqlen']:5d}: flashhopper {_fmt(row['flashhopper_tflops'], '6.1f')}  "
          f"cudnn {_fmt(row['cudnn_tflops'], '6.1f')}  flash {_fmt(row['flash_tflops'], '6.1f')}"
          + ("" if math.isnan(det) else f"  det {_fmt(det, '6.1f')}")
          + f" TFLOP/s  ratio {_fmt(_ratio(row), '.2f')}  [{time.monotonic() - started:6.0f} s]", flush=True)


def load_fa4():
    """FlashAttention-4's flash_attn_func (its sm90 path), or None (said once) where it does not import."""
    try:
        from flash_attn.cute import flash_attn_func
    except Exception as error:  # not installed, or its DSL missing: the column stays empty
        print(f"FlashAttention-4 not available ({type(error).__name__}: {error}): its columns stay empty", flush=True)
        return None
    return flash_attn_func


def _inputs(batch, seqlen, heads, head_dim):
    q, k, v = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    return q, k, v


def _forward_row(row, batch, seqlen, heads, head_dim, causal, timing, reported, sm_margin=0, fa4=None):
    q, k, v = _inputs(batch, seqlen, heads, head_dim)
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))  # SDPA wants [B, H, S, D]
    setups = {
        "flashhopper": lambda: lambda: flashhopper.forward(q, k, v, causal=bool(causal), sm_margin=sm_margin),
        "cudnn": lambda: lambda: _sdpa(SDPBackend.CUDNN_ATTENTION, qt, kt, vt, causal),
        "flash": lambda: lambda: _sdpa(SDPBackend.FLASH_ATTENTION, qt, kt, vt, causal),
    }
    if fa4 is not None:
        setups["fa4"] = lambda: pass_setup("fwd", lambda *x: fa4(*x, causal=bool(causal)), (q, k, v), None)[0]
    else:
        row["fa4_ms"] = row["fa4_tflops"] = float("nan")
    fns = _time_row(row, setups, flops(batch, heads, seqlen, head_dim, causal), timing, reported)
    row["flashhopper_det_ms"] = row["flashhopper_det_tflops"] = float("nan")  # the forward has no such mode
    row["max_diff_vs_cudnn"] = float("nan")
    if "flashhopper" in fns and "cudnn" in fns:
        with torch.no_grad():
            ours = fns["flashhopper"]().float()
            ref = fns["cudnn"]().transpose(1, 2).float()
            row["max_diff_vs_cudnn"] = (ours - ref).abs().max().item()


def _backward_row(row, batch, seqlen, heads, head_dim, causal, timing, reported, sm_margin=0, fa4=None):
    q, k, v = _inputs(batch, seqlen, heads, head_dim)
    dout = torch.randn_like(q)

    def flashhopper_setup():
        out, lse = flashhopper.forward(q, k, v, causal=bool(causal), return_lse=True)
        return lambda: flashhopper.backward(dout, q, k, v, out, lse, causal=bool(causal), sm_margin=sm_margin)

    def flashhopper_det_setup():
        out, lse = flashhopper.forward(q, k, v, causal=bool(causal), return_lse=True)
        return lambda: flashhopper.backward(dout, q, k, v, out, lse, causal=bool(causal), deterministic=True,
                                            sm_margin=sm_margin)

    def sdpa_setup(backend):
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        qt, kt, vt = (x.transpose(1, 2) for x in leaves)  # SDPA wants [B, H, S, D]; grads are taken here
        with sdpa_kernel(backend):
            out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=bool(causal))
        dout_t = torch.empty_like(out).copy_(dout.transpose(1, 2))  # same strides as this backend's out
        # grads come back [B, H, S, D]; transposed to [B, S, H, D] (a view) to compare with ours
        return lambda: [g.transpose(1, 2) for g in
                        torch.autograd.grad(out, (qt, kt, vt), dout_t, retain_graph=True)]

    setups = {
        "flashhopper": flashhopper_setup,
        "cudnn": lambda: sdpa_setup(SDPBackend.CUDNN_ATTENTION),
        "flash": lambda: sdpa_setup(SDPBackend.FLASH_ATTENTION),
        "flashhopper_det": flashhopper_det_setup,
    }
    if fa4 is not None:
        setups["fa4"] = lambda: pass_setup("bwd", lambda *x: fa4(*x, causal=bool(causal)), (q, k, v), dout)[0]
    else:
        row["fa4_ms"] = row["fa4_tflops"] = float("nan")
    fns = _time_row(row, setups, 2.5 * flops(batch, heads, seqlen, head_dim, causal), timing, reported)
    steps = {"flashhopper": lambda *x: flash_attn_func(*x, causal=bool(causal), sm_margin=sm_margin),
             "cudnn": lambda *x: _sdpa(SDPBackend.CUDNN_ATTENTION, *(t.transpose(1, 2) for t in x), causal)}
    if fa4 is not None:
        steps["fa4"] = lambda *x: fa4(*x, causal=bool(causal))
    for name in PEAK_BACKENDS:
        row[f"{name}_step_peak_mib"] = step_peak_mib(steps[name], (q, k, v)) if name in fns else float("nan")
    row["max_diff_vs_cudnn"] = float("nan")
    if "flashhopper" in fns and "cudnn" in fns:
        ours, ref = fns["flashhopper"](), fns["cudnn"]()
        row["max_diff_vs_cudnn"] = max((a.float() - b.float()).abs().max().item() for a, b in zip(ours, ref))


def _time_row(row, setups, fl, timing, reported):
    """Sets up and tries each backend once; times the ones that ran. Returns them by name."""
    runnable = {}
    for name, setup in setups.items():
        try:
            fn = setup()
            fn()
            runnable[name] = fn
        except Exception as error:  # a backend that cannot run this shape, or a pass not built yet
            row[f"{name}_ms"] = row[f"{name}_tflops"] = float("nan")
            message = str(error).splitlines()[0] if str(error) else type(error).__name__
            if (name, message) not in reported:  # each distinct refusal once per pass
                reported.add((name, message))
                print(f"  {name} {row['pass']} hdim={row['hdim']} causal={row['causal']} seqlen={row['seqlen']} "
                      f"unavailable: {message}", flush=True)
    for name, ms in time_all_ms(runnable, **timing).items():
        row[f"{name}_ms"] = ms
        row[f"{name}_tflops"] = fl / ms * 1e-9
    return runnable


def _ratio(row):
    return row["flashhopper_tflops"] / row["cudnn_tflops"]


def _fmt(value, spec):
    return format("-", ">" + spec.split(".")[0]) if math.isnan(value) else format(value, spec)


def _write_csv(rows, path):
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)


def _sdpa(backend, q, k, v, causal):
    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(q, k, v, is_causal=bool(causal))


def _plot(rows, path, gpu, date, pass_name):
    try:
        import matplotlib
    except ImportError:
        print(f"matplotlib is not installed: skipping the plot {path}", file=sys.stderr, flush=True)
        return
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
            width = 0.2
            for n, (name, color) in enumerate((("flashhopper", "tab:red"), ("fa4", "tab:purple"),
                                               ("cudnn", "tab:green"), ("flash", "tab:blue"))):
                xs = [x + (n - 1.5) * width for x in range(len(sel))]
                heights = [r[f"{name}_tflops"] for r in sel]
                missing = all(math.isnan(h) for h in heights)
                ax.bar(xs, [0.0 if math.isnan(h) else h for h in heights], width,
                       label=f"{name} (n/a)" if missing else name, color=color)
            ax.set_xticks(range(len(sel)), labels)
            ax.set_title(f"{pass_name}, hdim {hdim}, {'causal' if causal else 'non-causal'}")
            ax.set_xlabel("sequence length (16k tokens total)")
            ax.set_ylabel("TFLOP/s")
            ax.legend(fontsize=8)
    fig.suptitle(f"FlashHopper vs FlashAttention-4 and PyTorch SDPA, {pass_name}, bf16, {gpu}, {date}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
