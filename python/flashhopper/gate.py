"""The speed gate: a fixed set of rows timed against a recorded baseline.

    python -m flashhopper.bench --gate [--baseline CSV] [--rounds N] [--update] [--rows SUBSTRING ...]

Rows (bf16): the dense grid (16k tokens, model dim 2048; hdim 128 at 1k, 4k, 16k, hdims 64 and 256
at 8k, causal and not), the feature rows (GQA 32/8, hdim 128: windows, softcap, learnable sinks, a
packed batch; hdims 64 and 256: a window and softcap), forward and backward, and three decode rows
against a KV cache (dense and paged).
Every row is FlashHopper alone: the peers are the side-by-side benchmarks' business. The rows are
timed in interleaved rounds (each round times every row once, `calls` back-to-back calls between
CUDA events), and each row's median is compared with the baseline: the best figure measured for it
on this kind of GPU (bench/baseline_h200.csv, bench/baseline_h100.csv). A row fails when it falls
below its baseline by more than noise: 3% from 4k tokens, 8% below (and for the decode rows, whose
calls take tens of microseconds). The exit status is 1 when a row fails, 0 otherwise. The GPU
runs the rows back to back with no rest, so its figures sit below the side-by-side benchmarks'
(clocks under sustained load): compare them only with the gate's own.

--update writes the baseline back with each row's better figure (a change that wins updates the
baseline in the same commit); rows without a baseline get this run's figure.
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import os
import subprocess
import sys
from typing import Callable, Optional

FIELDS = ["row", "pass", "unit", "value", "date", "gpu", "commit"]
DENSE_TOKENS, MODEL_DIM = 16384, 2048
HEADS_Q, HEADS_KV, FEATURE_HDIM = 32, 8, 128
PACKED_11 = (2048, 2048, 128, 1000, 3000, 2048, 2048, 1000, 2048, 1000, 16)


@dataclasses.dataclass(frozen=True)
class Row:
    name: str
    pass_: str       # "fwd", "bwd" or "decode"
    tokens: int      # the sequence length that decides the noise allowance
    make: Callable   # make() -> (fn, work per call: FLOP or bytes); needs torch and a GPU
    unit: str = "TFLOP/s"

    @property
    def tolerance(self) -> float:
        return allowed_drop(self.tokens, self.pass_)


def allowed_drop(tokens: int, pass_: str) -> float:
    """How far below its baseline a row may fall before it fails: run-to-run noise."""
    if pass_ == "decode" or tokens < 4096:
        return 0.08
    return 0.03


def verdict(measured: float, baseline: Optional[float], tolerance: float) -> str:
    """"ok", "FAIL", "new" (no baseline yet) or "not run" (the row could not run)."""
    if measured != measured:  # NaN
        return "not run"
    if baseline is None:
        return "new"
    return "ok" if measured >= baseline * (1.0 - tolerance) else "FAIL"


def read_baseline(path: str) -> dict:
    """{(row, pass): float} from a baseline CSV; empty when the file does not exist."""
    if not os.path.exists(path):
        return {}
    with open(path, newline="") as f:
        return {(r["row"], r["pass"]): float(r["value"]) for r in csv.DictReader(f) if r["value"]}


def updated_baseline(path: Optional[str], measured: dict, units: dict, gpu: str, date: str, commit: str) -> list:
    """The rows of the baseline at `path` (None: none) with each measured figure that beats (or
    adds to) it; unchanged rows keep their date, GPU and commit."""
    rows = {}
    if path is not None and os.path.exists(path):
        with open(path, newline="") as f:
            rows = {(r["row"], r["pass"]): r for r in csv.DictReader(f)}
    for key, value in measured.items():
        old = rows.get(key)
        if value == value and (old is None or not old["value"] or value > float(old["value"])):
            rows[key] = {"row": key[0], "pass": key[1], "unit": units[key], "value": f"{value:.1f}",
                         "date": date, "gpu": gpu, "commit": commit}
    return list(rows.values())


def write_baseline(path: str, rows: list) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)


def default_baseline(gpu: str) -> Optional[str]:
    """bench/baseline_<kind>.csv of the checkout this package sits in, by the GPU's name."""
    kind = "h200" if "H200" in gpu else "h100" if "H100" in gpu else None
    if kind is None:
        return None
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir)
    return os.path.normpath(os.path.join(root, "bench", f"baseline_{kind}.csv"))


def _commit() -> str:
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        return subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


# ---------------------------------------------------------------------------------------------------
# The rows (torch imported inside: the helpers above run without it)

def visible_pairs(seqlen: int, window=(-1, -1), causal: bool = False) -> int:
    """Visible (row, key) pairs of one head, sq = sk = seqlen (bottom-right aligned)."""
    left, right = window
    if causal:
        right = 0
    total = 0
    for i in range(seqlen):
        lo = 0 if left < 0 else max(0, i - left)
        hi = seqlen if right < 0 else min(seqlen, i + right + 1)
        total += max(0, hi - lo)
    return total


def _attention_row(name, pass_, batch, seqlen, heads_q, heads_kv, hdim, causal=False, window=(-1, -1),
                   softcap=0.0, sink=False, lengths=None):
    def make():
        import torch
        from . import interface as fh
        if lengths is None:
            shape_q, shape_kv = (batch, seqlen, heads_q, hdim), (batch, seqlen, heads_kv, hdim)
            varlen, pairs = None, batch * visible_pairs(seqlen, window, causal)
        else:
            total = sum(lengths)
            shape_q, shape_kv = (total, heads_q, hdim), (total, heads_kv, hdim)
            cu = torch.tensor([0] + [sum(lengths[:i + 1]) for i in range(len(lengths))], dtype=torch.int32,
                              device="cuda")
            varlen = fh.Varlen(cu, cu, max(lengths), max(lengths))
            pairs = sum(visible_pairs(s, window, causal) for s in lengths)
        q = torch.randn(shape_q, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(shape_kv, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        learnable_sink = torch.randn(heads_q, device="cuda", dtype=torch.float32) if sink else None
        options = dict(window_size=window, softcap=softcap, learnable_sink=learnable_sink, varlen=varlen)
        flop = 4.0 * heads_q * hdim * pairs
        if pass_ == "fwd":
            return (lambda: fh.forward(q, k, v, causal=causal, **options)), flop
        out, lse = fh.forward(q, k, v, causal=causal, return_lse=True, **options)
        dout = torch.randn_like(out)
        return (lambda: fh.backward(dout, q, k, v, out, lse, causal=causal, **options)), 2.5 * flop
    return Row(name, pass_, max(lengths) if lengths else seqlen, make)


def _decode_row(name, batch, cache_len, page_size=0):
    def make():
        import torch
        from . import flash_attn_interface as fai
        q = torch.randn(batch, 1, HEADS_Q, FEATURE_HDIM, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(batch, cache_len, HEADS_KV, FEATURE_HDIM, device="cuda", dtype=torch.bfloat16)
                for _ in range(2))
        lengths = torch.full((batch,), cache_len, dtype=torch.int32, device="cuda")
        table = None
        if page_size:
            pages = batch * cache_len // page_size
            table = torch.randperm(pages, device="cuda").to(torch.int32).view(batch, -1)
            k, v = (x.view(pages, page_size, HEADS_KV, FEATURE_HDIM) for x in (k, v))
        read = 2.0 * batch * cache_len * HEADS_KV * FEATURE_HDIM * 2  # K and V once, bytes
        return (lambda: fai.flash_attn_with_kvcache(q, k, v, cache_seqlens=lengths, page_table=table,
                                                    num_splits=0)), read  # bytes: TB/s as flop gives TFLOP/s
    return Row(name, "decode", cache_len, make, unit="TB/s")


def rows() -> list:
    out = []
    for pass_ in ("fwd", "bwd"):
        for hdim, causal, seqlen in ((128, 0, 1024), (128, 0, 4096), (128, 0, 16384), (128, 1, 1024),
                                     (128, 1, 4096), (128, 1, 16384), (64, 0, 8192), (64, 1, 8192),
                                     (256, 0, 8192), (256, 1, 8192)):
            name = f"dense hdim {hdim} {'causal' if causal else 'full'} {seqlen}"
            out.append(_attention_row(name, pass_, DENSE_TOKENS // seqlen, seqlen, MODEL_DIM // hdim,
                                      MODEL_DIM // hdim, hdim, causal=bool(causal)))
        gqa = dict(heads_q=HEADS_Q, heads_kv=HEADS_KV, hdim=FEATURE_HDIM)
        out += [
            _attention_row("window 4095 16k", pass_, 1, 16384, window=(4095, 0), **gqa),
            _attention_row("window 1023 128k", pass_, 1, 131072, window=(1023, 0), **gqa),
            _attention_row("softcap 30 causal 16k", pass_, 1, 16384, causal=True, softcap=30.0, **gqa),
            _attention_row("learnable sink 16k", pass_, 1, 16384, sink=True, **gqa),
            _attention_row("learnable sink causal 16k", pass_, 1, 16384, causal=True, sink=True, **gqa),
            _attention_row("packed 11 causal", pass_, 1, 0, causal=True, lengths=PACKED_11, **gqa),
        ]
        # Windows and softcap at the other head dims' tiles (64: three warpgroups; 256: Q's
        # descriptors held or built per use), whose kernels differ from hdim 128's.
        for hdim in (64, 256):
            other = dict(heads_q=HEADS_Q, heads_kv=HEADS_KV, hdim=hdim)
            out += [
                _attention_row(f"window 4095 16k hdim {hdim}", pass_, 1, 16384, window=(4095, 0), **other),
                _attention_row(f"softcap 30 causal 16k hdim {hdim}", pass_, 1, 16384, causal=True, softcap=30.0,
                               **other),
            ]
    out += [_decode_row("decode 8 x 16k", 8, 16384), _decode_row("decode 64 x 16k", 64, 16384),
            _decode_row("decode paged 256, 32 x 16k", 32, 16384, page_size=256)]
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flashhopper.bench --gate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", default=None,
                        help="baseline CSV (default: bench/baseline_h200.csv or _h100.csv by the GPU's name)")
    parser.add_argument("--rounds", type=int, default=15, help="interleaved rounds (default: %(default)s)")
    parser.add_argument("--calls", type=int, default=5,
                        help="back-to-back calls a round, at least (default: %(default)s)")
    parser.add_argument("--min-round-ms", type=float, default=1.0,
                        help="more calls a round for short rows, until a round lasts this long (default: %(default)s)")
    # The GPU busy-waits before each round, so a short row's figure does not hold the host's time
    # to issue its first call: that differs between machines of one GPU model and failed the
    # 1k-token rows on an H100 with the forward kernel's SASS unchanged (bench/RESULTS.md).
    parser.add_argument("--lead-cycles", type=int, default=200_000,
                        help="GPU clock cycles of busy-wait queued before each round (0: none; default: %(default)s)")
    parser.add_argument("--rows", nargs="+", default=None, help="only rows whose name holds one of these")
    parser.add_argument("--passes", nargs="+", default=["fwd", "bwd", "decode"], choices=["fwd", "bwd", "decode"])
    parser.add_argument("--update", action="store_true", help="write the better figures back to the baseline")
    parser.add_argument("--out", default=None, help="also write this run's figures to this CSV")
    parser.add_argument("--commit", default=None,
                        help="the commit the figures are recorded under (default: the checkout's HEAD)")
    args = parser.parse_args(argv)

    import torch
    from .bench_timing import can_time_here, time_all_ms
    if not can_time_here("flashhopper.bench --gate"):
        return 1
    gpu = torch.cuda.get_device_name()
    path = args.baseline or default_baseline(gpu)
    if path is None:
        print(f"gate: no baseline for {gpu} (give --baseline)", file=sys.stderr)
        return 1
    baseline = read_baseline(path)
    chosen = [r for r in rows() if r.pass_ in args.passes and (not args.rows or any(s in r.name for s in args.rows))]
    torch.manual_seed(0)
    fns, work, skipped, broken = {}, {}, {}, {}
    for row in chosen:
        key = (row.name, row.pass_)
        try:
            fn, amount = row.make()
            fn()
        except Exception as error:
            message = str(error).splitlines()[0] if str(error) else type(error).__name__
            # A family this build did not compile (FlashHopperNotSupported, a NotImplementedError)
            # is not run; any other error fails the row.
            (skipped if isinstance(error, NotImplementedError) else broken)[key] = message
            continue
        fns[key], work[key] = fn, amount
    print(f"gate: {gpu}, {len(fns)} rows ({len(skipped)} not in this build, {len(broken)} failed to run), "
          f"{args.rounds} rounds of {args.calls} calls or {args.min_round_ms} ms, baseline {path}", flush=True)
    ms = time_all_ms(fns, warmup=3, rounds=args.rounds, calls=args.calls, min_round_ms=args.min_round_ms,
                     lead_cycles=args.lead_cycles) if fns else {}
    measured = {row_key: float("nan") for row_key in ((r.name, r.pass_) for r in chosen)}
    for key, t in ms.items():
        measured[key] = work[key] / t * 1e-9
    failures = 0
    print("| row | pass | baseline | measured | ratio | allowed | verdict |\n|---|---|---|---|---|---|---|")
    for row in chosen:
        key = (row.name, row.pass_)
        base, value = baseline.get(key), measured[key]
        result = "FAIL" if key in broken else verdict(value, base, row.tolerance)
        failures += result == "FAIL"
        ratio = f"{value / base:.3f}" if base and value == value else "-"
        note = f" ({skipped.get(key) or broken.get(key)})" if key in skipped or key in broken else ""
        print(f"| {row.name} | {row.pass_} | {base if base is not None else '-'} | "
              f"{value:.1f} {row.unit} | {ratio} | -{row.tolerance:.0%} | {result}{note} |")
    date = datetime.date.today().isoformat()
    units = {(r.name, r.pass_): r.unit for r in chosen}
    commit = args.commit or _commit()
    if args.out:
        write_baseline(args.out, updated_baseline(None, measured, units, gpu, date, commit))
    if args.update:
        write_baseline(path, updated_baseline(path, measured, units, gpu, date, commit))
        print(f"gate: baseline {path} updated")
    print(f"gate: {'FAILED' if failures else 'passed'} ({failures} of {len(chosen)} rows below their baseline "
          "or failing to run)")
    return 1 if failures else 0
