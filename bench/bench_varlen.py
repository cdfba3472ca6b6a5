#!/usr/bin/env python3
"""Variable-length (packed, cu_seqlens) attention side by side: FlashHopper's flash_attn_varlen_func
against FlashAttention-4's sm90 path (when `flash_attn.cute` imports: flash-attn-4==4.0.0b36) and
FlashAttention-3 through JAX (when `flash_attn3_jax` imports: flash-attn3-jax==0.2.3), forward and
backward, bf16, GQA 32/8, head dim 128, causal (bottom-right aligned) unless the row says otherwise.

Rows: "packed 11", the issue's batch of 11 sequences (16 to 3000 tokens, 16384 in all; FA4 measured
512 fwd / 402 bwd TFLOP/s on it in a peers run on our H200, 2026-12-01); "train mix 16k" and "train mix 64k",
lengths drawn uniformly from 64..8192 (random.Random(0) and (1)) until the total reaches 16384 /
65536 tokens, the last one cut; "equal 8x2048", eight sequences of 2048, where FlashHopper's dense
flash_attn_func also runs on the same data viewed [8, 2048, H, d] (goal: varlen within 3% of dense);
"packed 11 non-causal".

TFLOP/s count the visible (query, key) pairs, summed over the sequences: 4 * Hq * d * pairs forward,
2.5x that backward. Backward is timed through autograd: the forward runs once with requires_grad
inputs, each timed call is torch.autograd.grad(out, (q, k, v), dout, retain_graph=True) (FA3: jax.vjp
once, each timed call a jitted call of the returned function). Each number is the median of
interleaved rounds: every round times each PyTorch backend with flashhopper.bench_timing.time_all_ms (CUDA
events around `calls` back-to-back calls), then FA3 (wall clock around `calls` back-to-back jitted
calls and one jax.block_until_ready). A backend that fails to run a row leaves its columns empty
(NaN in the CSV, '-' in the table, no bar) and its error is printed. max_diff_vs_* is the largest
absolute difference of FlashHopper's out (fwd) or dq/dk/dv (bwd) from that backend's. Backward rows
also give the peak memory of one forward + backward step through autograd, ours and FA4's
(*_step_peak_mib: MiB above what was allocated before it, flashhopper.bench_timing.step_peak_mib).

Writes bench_varlen_<date>.csv (after every row) and bench_varlen_<date>.png into --out and prints a
markdown table last.

    PYTHONPATH=python FLASHHOPPER_LIBRARY=build/libflashhopper.so python3 bench/bench_varlen.py --out DIR
    python3 bench/bench_varlen.py --selftest     # lengths, pair counts, CSV/plot/table code; no GPU
"""
import argparse
import csv
import datetime
import inspect
import math
import os
import random
import sys
import tempfile
import time

# JAX must not grab most of the GPU's memory up front: PyTorch shares the GPU. Set before jax is imported.
os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"

try:
    import torch
except ImportError:  # only --selftest runs without torch
    torch = None

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "python"))

HEADS_Q, HEADS_KV, HEAD_DIM = 32, 8, 128
PACKED_11 = (2048, 2048, 128, 1000, 3000, 2048, 2048, 1000, 2048, 1000, 16)
FA4_REFERENCE = {"packed 11": (512, 402)}  # TFLOP/s fwd / bwd: FA4 measured on our H200, 2026-12-01
BACKENDS = ("flashhopper", "fa4", "fa3", "dense")
PEAK_BACKENDS = ("flashhopper", "fa4")  # backward rows: peak memory of one forward + backward step
LABELS = {"flashhopper": "FlashHopper varlen", "fa4": "FlashAttention-4", "fa3": "FlashAttention-3 (JAX)",
          "dense": "FlashHopper dense"}
FIELDS = ["date", "gpu", "row", "pass", "causal", "seqs", "total_tokens", "max_seqlen", "pairs",
          *(f"{b}_{unit}" for b in BACKENDS for unit in ("ms", "tflops")),
          "ours_vs_fa4", "ours_vs_fa3", "varlen_vs_dense", "max_diff_vs_fa4", "max_diff_vs_fa3",
          "max_diff_vs_dense", *(f"{b}_step_peak_mib" for b in PEAK_BACKENDS), "lengths"]
NAN = float("nan")


# ---------------------------------------------------------------------------------------------------
# Pure-Python helpers (no torch, no GPU): lengths, pair and FLOP counts

def train_mix(total, seed, low=64, high=8192):
    """Lengths drawn uniformly from low..high (inclusive) with random.Random(seed) until their sum
    reaches `total`; the last one is cut so that the sum is exactly `total`."""
    rng = random.Random(seed)
    lengths, left = [], total
    while left > 0:
        s = min(rng.randint(low, high), left)
        lengths.append(s)
        left -= s
    return tuple(lengths)


def visible_pairs(seqlen_q, seqlen_k, causal):
    """Visible (row, key) pairs of one head of one sequence. Causal is bottom-right aligned: row i
    sees keys j <= i + seqlen_k - seqlen_q (s * (s + 1) / 2 when seqlen_q == seqlen_k == s)."""
    if not causal:
        return seqlen_q * seqlen_k
    if seqlen_q == seqlen_k:
        return seqlen_q * (seqlen_q + 1) // 2
    offset = seqlen_k - seqlen_q
    return sum(min(seqlen_k, max(0, i + offset + 1)) for i in range(seqlen_q))


def row_pairs(lengths_q, lengths_k, causal):
    return sum(visible_pairs(sq, sk, causal) for sq, sk in zip(lengths_q, lengths_k))


def cu_seqlens(lengths):
    """[0, l0, l0 + l1, ...]: B + 1 offsets."""
    out = [0]
    for s in lengths:
        out.append(out[-1] + s)
    return out


def flops(pairs, pass_):
    """FlashAttention's count: 4 * Hq * d per visible pair forward, 2.5 times that backward."""
    return 4.0 * HEADS_Q * HEAD_DIM * pairs * (2.5 if pass_ == "bwd" else 1.0)


def tflops(pairs, pass_, ms):
    return flops(pairs, pass_) / (ms * 1e-3) / 1e12 if ms == ms else NAN


ROWS = [
    # name, lengths (queries = keys), causal, also time the dense call on the same data
    ("packed 11", PACKED_11, True, False),
    ("train mix 16k", train_mix(16384, seed=0), True, False),
    ("train mix 64k", train_mix(65536, seed=1), True, False),
    ("equal 8x2048", (2048,) * 8, True, True),
    ("packed 11 non-causal", PACKED_11, False, False),
]


def _ratio(a, b):
    return a / b if (a == a and b == b and b != 0) else NAN


def _fmt(value, spec):
    return "-" if value != value else format(value, spec)


# ---------------------------------------------------------------------------------------------------
# Peers (optional)

def _load_fa4():
    try:
        from flash_attn.cute import flash_attn_varlen_func as fa4_varlen
    except Exception as error:  # FA4 missing: its columns stay empty
        return None, repr(error)
    return fa4_varlen, ""


def _load_fa3():
    try:
        import jax
        import jax.numpy as jnp
        from flash_attn3_jax import flash_mha_varlen
        if jax.default_backend() != "gpu":
            raise RuntimeError(f"JAX's default backend is {jax.default_backend()!r}, not 'gpu'")
    except Exception as error:  # FA3 (JAX) missing: its columns stay empty
        return None, repr(error)
    return (jax, jnp, flash_mha_varlen), ""


def _fa3_keywords(fn):
    """Names of flash_mha_varlen's arguments. flash-attn3-jax 0.2.3: flash_mha_varlen(q, k, v,
    cu_seqlens_q, cu_seqlens_k=None, seqused_k=None, max_seqlen_q=-1, max_seqlen_k=-1,
    softmax_scale=None, is_causal=False, window_size=(-1, -1)); looked up at run time in case the
    installed version spells them differently."""
    try:
        params = set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        params = set()

    def pick(*names):
        return next((n for n in names if n in params), names[0])

    return {"cu_q": pick("cu_seqlens_q", "cu_seqlens"), "cu_k": pick("cu_seqlens_k", "cu_seqlens_kv"),
            "max_q": pick("max_seqlen_q"), "max_k": pick("max_seqlen_k", "max_seqlen_kv"),
            "causal": pick("is_causal", "causal")}


# ---------------------------------------------------------------------------------------------------
# Timing

def _first(result):
    return result[0] if isinstance(result, (tuple, list)) else result


def _fa3_setup(pass_, fa3, inputs, dout, cu, max_seqlen, causal):
    jax, _, mha = fa3
    names = _fa3_keywords(mha)
    options = {names["max_q"]: max_seqlen, names["max_k"]: max_seqlen, names["causal"]: bool(causal)}

    def attn(q, k, v, cu_q):
        return _first(mha(q, k, v, **{names["cu_q"]: cu_q, names["cu_k"]: cu_q}, **options))

    q, k, v = inputs
    if pass_ == "fwd":
        jitted = jax.jit(attn)

        def fn():
            return jitted(q, k, v, cu)
        return fn, [jax.block_until_ready(fn())]
    _, vjp_fn = jax.vjp(lambda a, b, c: attn(a, b, c, cu), q, k, v)
    jitted = jax.jit(lambda f, do: f(do))  # vjp_fn is a jax.tree_util.Partial: passed as an argument

    def fn():
        return jitted(vjp_fn, dout)
    return fn, list(jax.block_until_ready(fn()))


def _max_diff(ours, theirs):
    return max((a.float() - b.float()).abs().max().item() for a, b in zip(ours, theirs))


def measure_row(name, lengths, causal, dense, args, peers, date, gpu, started):
    import flashhopper
    from flashhopper.bench import pass_setup
    from flashhopper.bench_timing import from_jax, step_peak_mib, time_interleaved, to_jax

    fa4_varlen, fa3 = peers
    total, max_seqlen, seqs = sum(lengths), max(lengths), len(lengths)
    pairs = row_pairs(lengths, lengths, causal)
    cu_list = cu_seqlens(lengths)
    cu = torch.tensor(cu_list, dtype=torch.int32, device="cuda")
    q = torch.randn(total, HEADS_Q, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(total, HEADS_KV, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    dout = torch.randn_like(q)

    def ours(q_, k_, v_):
        return flashhopper.flash_attn_varlen_func(q_, k_, v_, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                                  max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen,
                                                  causal=causal)

    def fa4(q_, k_, v_):  # keywords: FA4's 4th positional argument is qv
        return fa4_varlen(q_, k_, v_, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_seqlen,
                          max_seqlen_k=max_seqlen, causal=causal)

    def flash_dense(q_, k_, v_):
        return flashhopper.flash_attn_func(q_, k_, v_, causal=causal)

    fa3_inputs = fa3_dout = fa3_cu = None
    if fa3 is not None:
        try:
            fa3_inputs = [to_jax(fa3, x) for x in (q, k, v)]
            fa3_dout = to_jax(fa3, dout)
            fa3_cu = fa3[1].asarray(cu_list, dtype=fa3[1].int32)
        except Exception as error:
            print(f"  {name}: FA3 inputs: {error!r}", flush=True)
            fa3_inputs = None

    rows = []
    for pass_ in ("fwd", "bwd"):
        pass_started = time.monotonic()
        setups = {"flashhopper": lambda: pass_setup(pass_, ours, (q, k, v), dout)}
        if fa4_varlen is not None:
            setups["fa4"] = lambda: pass_setup(pass_, fa4, (q, k, v), dout)
        if dense:
            b, s = seqs, lengths[0]
            dense_inputs = (q.view(b, s, HEADS_Q, HEAD_DIM), k.view(b, s, HEADS_KV, HEAD_DIM),
                            v.view(b, s, HEADS_KV, HEAD_DIM))
            setups["dense"] = lambda: pass_setup(pass_, flash_dense, dense_inputs,
                                                   dout.view(b, s, HEADS_Q, HEAD_DIM))
        torch_fns, jax_fns, results = {}, {}, {}
        for backend, setup in setups.items():
            try:
                torch_fns[backend], results[backend] = setup()
            except Exception as error:
                message = str(error).splitlines()[0] if str(error) else type(error).__name__
                print(f"  {name} {pass_} {backend}: {type(error).__name__}: {message}", flush=True)
        if fa3_inputs is not None:
            try:
                jax_fns["fa3"], results["fa3"] = _fa3_setup(pass_, fa3, fa3_inputs, fa3_dout, fa3_cu,
                                                            max_seqlen, causal)
            except Exception as error:
                message = str(error).splitlines()[0] if str(error) else type(error).__name__
                print(f"  {name} {pass_} fa3: {type(error).__name__}: {message}", flush=True)
        torch.cuda.synchronize()
        block = fa3[0].block_until_ready if fa3 is not None else (lambda x: x)
        times = time_interleaved(torch_fns, jax_fns, block, warmup=3, rounds=args.rounds, calls=args.calls)

        row = {"date": date, "gpu": gpu, "row": name, "pass": pass_, "causal": int(causal), "seqs": seqs,
               "total_tokens": total, "max_seqlen": max_seqlen, "pairs": pairs}
        for backend in BACKENDS:
            ms = times.get(backend, NAN)
            row[f"{backend}_ms"] = ms
            row[f"{backend}_tflops"] = tflops(pairs, pass_, ms)
        row["ours_vs_fa4"] = _ratio(row["flashhopper_tflops"], row["fa4_tflops"])
        row["ours_vs_fa3"] = _ratio(row["flashhopper_tflops"], row["fa3_tflops"])
        row["varlen_vs_dense"] = _ratio(row["flashhopper_tflops"], row["dense_tflops"])
        for backend in ("fa4", "fa3", "dense"):
            row[f"max_diff_vs_{backend}"] = NAN
            if "flashhopper" in results and backend in results:
                try:
                    theirs = results[backend]
                    if backend == "fa3":
                        theirs = [from_jax(fa3, x) for x in theirs]
                    theirs = [t.reshape(o.shape) for o, t in zip(results["flashhopper"], theirs)]
                    row[f"max_diff_vs_{backend}"] = _max_diff(results["flashhopper"], theirs)
                except Exception as error:
                    print(f"  {name} {pass_}: max diff vs {backend}: {error!r}", flush=True)
        steps = {"flashhopper": ours, "fa4": fa4}
        for backend in PEAK_BACKENDS:
            row[f"{backend}_step_peak_mib"] = (step_peak_mib(steps[backend], (q, k, v))
                                               if pass_ == "bwd" and backend in torch_fns else NAN)
        row["lengths"] = " ".join(map(str, lengths))
        rows.append(row)
        del torch_fns, jax_fns, results
        print(f"{name:>20} {pass_}: ours {_fmt(row['flashhopper_tflops'], '6.1f')}  "
              f"FA4 {_fmt(row['fa4_tflops'], '6.1f')}  FA3 {_fmt(row['fa3_tflops'], '6.1f')}"
              + (f"  dense {_fmt(row['dense_tflops'], '6.1f')}" if dense else "")
              + f" TFLOP/s  [{time.monotonic() - pass_started:5.1f} s, total {time.monotonic() - started:5.0f} s]",
              flush=True)
    return rows


# ---------------------------------------------------------------------------------------------------
# Output

def write_csv(results, path):
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(results)


def print_table(results, gpu, date):
    print(f"\n{gpu}, {date}: varlen TFLOP/s, bf16, GQA 32/8, hdim 128 ('-': not available)")
    print("| row | seqs | tokens | pass | FlashHopper | FA4 | FA3 | ours / FA4 | ours / FA3 | dense | varlen / dense | "
          "step peak MiB ours / FA4 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        peak = (f"{_fmt(r['flashhopper_step_peak_mib'], '.0f')} / {_fmt(r['fa4_step_peak_mib'], '.0f')}"
                if r["pass"] == "bwd" else "")
        print(f"| {r['row']} | {r['seqs']} | {r['total_tokens']} | {r['pass']} | "
              f"{_fmt(r['flashhopper_tflops'], '.0f')} | {_fmt(r['fa4_tflops'], '.0f')} | "
              f"{_fmt(r['fa3_tflops'], '.0f')} | {_fmt(r['ours_vs_fa4'], '.2f')} | {_fmt(r['ours_vs_fa3'], '.2f')} | "
              f"{_fmt(r['dense_tflops'], '.0f')} | {_fmt(r['varlen_vs_dense'], '.2f')} | {peak} |")
    refs = "; ".join(f"{k} {f} fwd / {b} bwd" for k, (f, b) in FA4_REFERENCE.items())
    print(f"(FA4 reference, our H200 on 2026-12-01: {refs}; goal for equal 8x2048: varlen / dense >= 0.97)",
          flush=True)


def plot(results, path, gpu, date):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot", flush=True)
        return
    fig, axes = plt.subplots(2, 1, figsize=(11, 8))
    width = 0.2
    for ax, pass_ in zip(axes, ("fwd", "bwd")):
        sel = [r for r in results if r["pass"] == pass_]
        for i, backend in enumerate(BACKENDS):
            xs, heights = [], []
            for x, r in enumerate(sel):
                value = r[f"{backend}_tflops"]
                if isinstance(value, float) and math.isfinite(value):
                    xs.append(x + (i - 1.5) * width)
                    heights.append(value)
            if not heights:
                continue
            bars = ax.bar(xs, heights, width, label=LABELS[backend])
            ax.bar_label(bars, fmt="%.0f", fontsize=6)
        ax.set_xticks(range(len(sel)))
        ax.set_xticklabels([f"{r['row']}\n{r['seqs']} seqs, {r['total_tokens']} tok" for r in sel], fontsize=8)
        ax.set_ylabel("TFLOP/s (visible pairs)")
        ax.set_title({"fwd": "forward", "bwd": "backward"}[pass_], fontsize=10)
        ax.legend(fontsize=8)
    fig.suptitle(f"Varlen attention, bf16, GQA 32/8, hdim 128 ({gpu}, {date})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"written: {path}", flush=True)


# ---------------------------------------------------------------------------------------------------

def selftest(out_dir):
    """Checks the pure-Python helpers and the output code with made-up timings; touches no GPU."""
    for sq in range(0, 9):
        for sk in range(0, 9):
            for causal in (False, True):
                brute = sum(1 for i in range(sq) for j in range(sk) if not causal or j <= i + sk - sq)
                assert visible_pairs(sq, sk, causal) == brute, (sq, sk, causal)
    for s in (1, 16, 128, 1000, 2048, 3000):
        assert visible_pairs(s, s, True) == s * (s + 1) // 2 == sum(min(s, i + 1) for i in range(s))
    assert train_mix(16384, 0) == train_mix(16384, 0)
    assert cu_seqlens((3, 5, 2)) == [0, 3, 8, 10]
    expected_totals = {"packed 11": 16384, "train mix 16k": 16384, "train mix 64k": 65536,
                       "equal 8x2048": 16384, "packed 11 non-causal": 16384}
    for name, lengths, causal, dense in ROWS:
        assert sum(lengths) == expected_totals[name], (name, sum(lengths))
        assert all(1 <= s <= 8192 for s in lengths), name
        if name.startswith("train mix"):
            assert all(64 <= s for s in lengths[:-1]), name
        pairs = row_pairs(lengths, lengths, causal)
        print(f"{name}: {len(lengths)} seqs, {sum(lengths)} tokens, max {max(lengths)}, causal {int(causal)}, "
              f"pairs {pairs} ({pairs / sum(lengths) ** 2:.4f} of total^2), "
              f"fwd {flops(pairs, 'fwd') / 1e12:.3f} TFLOP, bwd {flops(pairs, 'bwd') / 1e12:.3f} TFLOP"
              + (", dense too" if dense else ""))
        print(f"  lengths {list(lengths)}")
        print(f"  cu_seqlens {cu_seqlens(lengths)}")
    # at 512 TFLOP/s the packed 11 forward takes flops / 512e12 s
    pairs = row_pairs(PACKED_11, PACKED_11, True)
    print(f"packed 11 at FA4's 512 / 402 TFLOP/s: fwd {flops(pairs, 'fwd') / 512e9:.3f} ms, "
          f"bwd {flops(pairs, 'bwd') / 402e9:.3f} ms")

    # The output code with made-up numbers (one backend missing, dense only on its row)
    date, gpu = datetime.date.today().isoformat(), "selftest (no GPU)"
    rng = random.Random(2)
    results = []
    for name, lengths, causal, dense in ROWS:
        for pass_ in ("fwd", "bwd"):
            pairs = row_pairs(lengths, lengths, causal)
            row = {"date": date, "gpu": gpu, "row": name, "pass": pass_, "causal": int(causal),
                   "seqs": len(lengths), "total_tokens": sum(lengths), "max_seqlen": max(lengths), "pairs": pairs}
            for backend in BACKENDS:
                ms = NAN if backend == "fa3" or (backend == "dense" and not dense) else rng.uniform(0.5, 3.0)
                row[f"{backend}_ms"], row[f"{backend}_tflops"] = ms, tflops(pairs, pass_, ms)
            row["ours_vs_fa4"] = _ratio(row["flashhopper_tflops"], row["fa4_tflops"])
            row["ours_vs_fa3"] = _ratio(row["flashhopper_tflops"], row["fa3_tflops"])
            row["varlen_vs_dense"] = _ratio(row["flashhopper_tflops"], row["dense_tflops"])
            row.update(max_diff_vs_fa4=0.0078125, max_diff_vs_fa3=NAN, max_diff_vs_dense=NAN if not dense else 0.0,
                       lengths=" ".join(map(str, lengths)))
            for backend in PEAK_BACKENDS:
                row[f"{backend}_step_peak_mib"] = rng.uniform(200, 400) if pass_ == "bwd" else NAN
            results.append(row)
    out_dir = out_dir or tempfile.mkdtemp(prefix="bench_varlen_selftest_")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"bench_varlen_{date}.csv")
    write_csv(results, path)
    with open(path) as f:
        back = list(csv.DictReader(f))
    assert len(back) == len(results) and list(back[0]) == FIELDS
    print(f"written: {path}")
    plot(results, os.path.join(out_dir, f"bench_varlen_{date}.png"), gpu, date)
    print_table(results, gpu, date)
    print("selftest ok")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="results folder (default bench/results; --selftest: a temporary one)")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--rows", nargs="+", help="only the rows whose name contains one of these")
    parser.add_argument("--no-fa4", action="store_true", help="skip FlashAttention-4")
    parser.add_argument("--no-fa3", action="store_true", help="skip FlashAttention-3 (JAX)")
    parser.add_argument("--max-seconds", type=float, default=330.0,
                        help="start no new row after this many seconds (the caller's timeout is 400 s)")
    parser.add_argument("--selftest", action="store_true", help="check the helpers and output code; no GPU")
    args = parser.parse_args()
    if args.selftest:
        selftest(args.out)
        return
    args.out = args.out or "bench/results"

    started = time.monotonic()
    os.makedirs(args.out, exist_ok=True)
    gpu = torch.cuda.get_device_name()
    date = datetime.date.today().isoformat()
    torch.manual_seed(0)
    fa4_varlen, fa4_error = (None, "--no-fa4") if args.no_fa4 else _load_fa4()
    if fa4_varlen is None:
        print(f"FlashAttention-4 not available ({fa4_error}): its columns stay empty", flush=True)
    fa3, fa3_error = (None, "--no-fa3") if args.no_fa3 else _load_fa3()
    if fa3 is None:
        print(f"FlashAttention-3 (JAX) not available ({fa3_error}): its columns stay empty", flush=True)
    else:
        print(f"FlashAttention-3 through JAX {fa3[0].__version__} on {fa3[0].devices()[0]}", flush=True)
    rows = [r for r in ROWS if not args.rows or any(sel in r[0] for sel in args.rows)]
    print(f"{gpu}, {date}: {len(rows)} rows, results in {args.out}/ [{time.monotonic() - started:.0f} s]", flush=True)
    path = os.path.join(args.out, f"bench_varlen_{date}.csv")
    results = []
    for name, lengths, causal, dense in rows:
        if time.monotonic() - started > args.max_seconds:
            print(f"{name}: skipped, past --max-seconds {args.max_seconds:.0f}", flush=True)
            continue
        try:
            results += measure_row(name, lengths, causal, dense, args, (fa4_varlen, fa3), date, gpu, started)
        except Exception as error:  # e.g. out of memory: the other rows still run
            print(f"{name}: failed: {error!r}", flush=True)
        torch.cuda.empty_cache()
        if results:
            write_csv(results, path)  # after every row, so a run cut short keeps what it measured
    if not results:
        print("nothing measured", flush=True)
        return
    print(f"written: {path}", flush=True)
    plot(results, os.path.join(args.out, f"bench_varlen_{date}.png"), gpu, date)
    print(f"done in {time.monotonic() - started:.0f} s", flush=True)
    print_table(results, gpu, date)


if __name__ == "__main__":
    main()
