#!/usr/bin/env python3
"""Decoding side by side: one query token per sequence against a dense KV cache (every sequence
cache_len keys), GQA, bf16, hdim 128. FlashHopper's flash_attn_with_kvcache (num_splits=0, the
library's choice; eager, replayed from a CUDA graph, and on the same keys in a paged cache of
--page-size pages in shuffled order) against FlashAttention-3's flash_mha_with_kvcache
(flash-attn3-jax, when it imports; the best of num_splits 1, 4, 16, 32, as it has no heuristic of
its own, and with that count on the same paged cache), and PyTorch SDPA's cuDNN and FLASH
(FlashAttention-2) backends with enable_gqa.

Bandwidth: the K and V bytes a call must read (batch * cache_len * heads_kv * (d + dv) * 2) over
its time, beside the GPU's device-to-device copy bandwidth measured in the same run (a 4 GiB
copy: read + write bytes over its time). flashhopper_kernel_us: the GPU's time alone for our call
(its graph replayed with every replay queued ahead behind a busy-wait), which tells a short call's
fixed GPU costs from the host's. Times are medians of interleaved rounds (CUDA events
around back-to-back calls; FA3 through JAX: wall clock around back-to-back jitted calls, as
bench_varlen.py). max_diff_vs_fa3: our out's largest absolute difference from FA3's;
paged_vs_dense: the dense call's time over the paged one's; max_diff_paged: their outputs'
largest difference (0: the same kernel reading the same keys); paged_vs_fa3_paged: FA3's paged
time over ours. workspace_bytes: what the dense call allocates and frees again (the split-KV
partials), workspace_vs_kv: over the K and V bytes it reads.

Prefill rows (--prefill-lens): seqlen_q new tokens a sequence against a cache, causal, through
flash_attn_with_kvcache and through flash_attn_varlen_func on the same memory, TFLOP/s and their
ratio.

Packed decode rows (--packed-cache-lens): a batch of --packed-batch sequences of 1 to 8 query
tokens (b % 8 + 1), packed (cu_seqlens_q), against a dense cache: flash_attn_with_kvcache split
as the library chooses (0) and unsplit (1), beside the dense-query call of 4 tokens a sequence
(split, 0) and FA3's on those 4 tokens (its flash_mha_with_kvcache takes no packed queries; the
best of num_splits 1, 4, 16, 32), TFLOP/s (FlashAttention's count, 4 * rows * keys * Hq * d, no
mask) and K+V TB/s.

Speculative decoding rows (--spec-tokens): the verify step, --spec-tokens query tokens a sequence
at the end of --spec-cache-len cached keys (causal among themselves), --spec-batches sequences:
flash_attn_with_kvcache (num_splits=0; the query heads of a KV head share one tile with all their
tokens) against FA3's flash_mha_with_kvcache (is_causal, its best split count), K+V TB/s and
TFLOP/s (4 * visible pairs * Hq * d).

MLA rows (--mla-cache-lens): absorbed MLA decode as DeepSeek's models run it, 128 query heads on
one KV head, q of head dim 64 with qv against latent values of --mla-dvs widths (256, and 512 as
DeepSeek's, the qv families), 1 and 4 query tokens a sequence (causal), a dense cache and the same keys in
shuffled pages of --page-size: K+V TB/s (over the copy's) and TFLOP/s (2 * rows * keys * Hq *
(d + 2 dv): Q K^T, Qv V^T and P V).

Writes bench_decode_<date>.csv (after every row), .png, bench_prefill_<date>.csv,
bench_packed_decode_<date>.csv, bench_spec_decode_<date>.csv and bench_mla_decode_<date>.csv into
--out; prints the tables last.

    python -m flashhopper.bench --decode [--batches 1 8 ...] [--cache-lens 4096 ...] [--page-size 64] [--out DIR]
    (bench/bench_decode.py is the same script; scripts/device_check.sh decode_bench runs it)
"""
import argparse
import csv
import datetime
import itertools
import os

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from . import flash_attn_interface as fh
from .bench_timing import can_time_here, from_jax, time_all_ms, time_interleaved, to_jax

BACKENDS = ("flashhopper", "flashhopper_graph", "flashhopper_paged", "fa3", "fa3_paged", "cudnn", "flash2")
FIELDS = ["date", "gpu", "batch", "cache_len", "heads_q", "heads_kv", "hdim", "kv_gib",
          *(f"{b}_{unit}" for b in BACKENDS for unit in ("us", "tbps")), "fa3_splits", "copy_tbps",
          "ours_vs_copy", "ours_vs_fa3", "max_diff_vs_fa3", "page_size", "paged_vs_dense", "max_diff_paged",
          "paged_vs_fa3_paged", "workspace_bytes", "workspace_vs_kv", "flashhopper_kernel_us",
          "flashhopper_kernel_tbps"]
NAN = float("nan")
MAX_KV_GIB = 36  # rows whose cache would not leave room for the peers' copies are skipped


def copy_tbps():
    """Device-to-device copy bandwidth: bytes read plus written over the median time of a copy."""
    src = torch.empty(2 ** 31, dtype=torch.int16, device="cuda")
    dst = torch.empty_like(src)
    ms = time_all_ms({"copy": lambda: dst.copy_(src)}, warmup=3, rounds=9, calls=3)["copy"]
    return 2 * src.numel() * src.element_size() / (ms * 1e-3) / 1e12


def workspace_bytes(fn):
    """The bytes a call allocates and frees again (its workspace: split partials, plans): the peak
    of PyTorch's allocator during the call less what is still allocated after it (its out)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    result = fn()
    torch.cuda.synchronize()
    peak, after = torch.cuda.max_memory_allocated(), torch.cuda.memory_allocated()
    del result
    return peak - after


def graphed(fn):
    """fn replayed from a CUDA graph (captured after a warm-up call on a side stream)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def _load_fa3():
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # JAX allocates as it goes, beside PyTorch
    try:
        import jax
        import jax.numpy as jnp
        from flash_attn3_jax import flash_mha_with_kvcache
        if jax.default_backend() != "gpu":
            raise RuntimeError(f"JAX's default backend is {jax.default_backend()!r}, not 'gpu'")
    except Exception as error:  # FA3 (JAX) missing: its columns stay empty
        print(f"FlashAttention-3 (JAX) not available ({error!r}): its columns stay empty", flush=True)
        return None
    return jax, jnp, flash_mha_with_kvcache


def measure_row(batch, cache_len, heads_q, heads_kv, d, fa3, copy, args):
    q = torch.randn(batch, 1, heads_q, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, cache_len, heads_kv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    lengths = torch.full((batch,), cache_len, dtype=torch.int32, device="cuda")
    torch_fns, jax_fns, outs = {}, {}, {}

    def ours():
        return fh.flash_attn_with_kvcache(q, k, v, cache_seqlens=lengths, num_splits=0)
    outs["flashhopper"] = ours()
    torch_fns["flashhopper"] = ours
    workspace = workspace_bytes(ours)
    torch_fns["flashhopper_graph"] = graphed(ours)
    # The same keys in a paged cache: pages of page_size keys in shuffled order.
    page = args.page_size
    order = torch.randperm(batch * cache_len // page, device="cuda")
    paged_k, paged_v = torch.empty_like(k).view(-1, page, heads_kv, d), torch.empty_like(v).view(-1, page, heads_kv, d)
    paged_k[order], paged_v[order] = k.view(-1, page, heads_kv, d), v.view(-1, page, heads_kv, d)
    table = order.view(batch, -1).to(torch.int32)

    def ours_paged():
        return fh.flash_attn_with_kvcache(q, paged_k, paged_v, cache_seqlens=lengths, page_table=table, num_splits=0)
    outs["flashhopper_paged"] = ours_paged()
    torch_fns["flashhopper_paged"] = ours_paged
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))  # SDPA's [B, H, S, d]
    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash2", SDPBackend.FLASH_ATTENTION)):
        def sdpa(backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
        try:
            sdpa()
            torch_fns[name] = sdpa
        except Exception as error:
            print(f"  {name}: cannot run this row ({str(error).splitlines()[0][:100]})", flush=True)
    fa3_splits = NAN
    if fa3 is not None:
        jax, _, mha = fa3
        jq, jk, jv = (to_jax(fa3, x) for x in (q, k, v))
        jax_fns["fa3"], fa3_splits = _fa3_best_split(fa3, jq, jk, jv, cache_len, args.calls)
        outs["fa3"] = from_jax(fa3, jax.block_until_ready(jax_fns["fa3"]()))
        # FA3 on the same paged cache, with the split count that was best on the dense one.
        jpk, jpv, jtable = (to_jax(fa3, x) for x in (paged_k, paged_v, table))
        paged_jitted = jax.jit(lambda a, b, c, t: mha(a, b, c, cache_seqlens=cache_len, page_table=t,
                                                      num_splits=fa3_splits))
        jax_fns["fa3_paged"] = lambda: paged_jitted(jq, jpk, jpv, jtable)
        jax.block_until_ready(jax_fns["fa3_paged"]())
    ms = time_interleaved(torch_fns, jax_fns, (fa3[0].block_until_ready if fa3 else None), 5, args.rounds,
                          args.calls)
    kv_bytes = 2 * batch * cache_len * heads_kv * d * k.element_size()
    row = {"batch": batch, "cache_len": cache_len, "heads_q": heads_q, "heads_kv": heads_kv, "hdim": d,
           "kv_gib": kv_bytes / 2 ** 30, "fa3_splits": fa3_splits, "copy_tbps": copy}
    for b in BACKENDS:
        us = ms[b] * 1e3 if b in ms else NAN
        row[f"{b}_us"], row[f"{b}_tbps"] = us, kv_bytes / (us * 1e-6) / 1e12
    row["ours_vs_copy"] = row["flashhopper_tbps"] / copy
    row["ours_vs_fa3"] = row["fa3_us"] / row["flashhopper_us"]
    row["max_diff_vs_fa3"] = ((outs["flashhopper"].float() - outs["fa3"].float()).abs().max().item()
                              if "fa3" in outs else NAN)
    row["page_size"] = page
    row["paged_vs_dense"] = row["flashhopper_us"] / row["flashhopper_paged_us"]
    row["max_diff_paged"] = (outs["flashhopper"].float() - outs["flashhopper_paged"].float()).abs().max().item()
    row["paged_vs_fa3_paged"] = row["fa3_paged_us"] / row["flashhopper_paged_us"]
    row["workspace_bytes"], row["workspace_vs_kv"] = workspace, workspace / kv_bytes
    # The GPU's time alone: the graph's replays all queued behind a busy-wait long enough to issue
    # them (150 us of host time each at most), so no gap between them is the host's.
    kernel_ms = time_all_ms({"graph": torch_fns["flashhopper_graph"]}, warmup=2, rounds=5, calls=args.calls,
                            lead_cycles=args.calls * 300_000)["graph"]
    row["flashhopper_kernel_us"] = kernel_ms * 1e3
    row["flashhopper_kernel_tbps"] = kv_bytes / (kernel_ms * 1e-3) / 1e12
    return row


def _fa3_best_split(fa3, jq, jk, jv, cache_len, calls, is_causal=False):
    """FA3's flash_mha_with_kvcache of jq against jk, jv (cache_len keys a sequence) at the fastest
    of num_splits 1, 4, 16, 32 (it has no heuristic of its own): (that call, its count)."""
    jax, _, mha = fa3
    best = None
    for splits in (1, 4, 16, 32):
        jitted = jax.jit(lambda a, b, c, s=splits: mha(a, b, c, cache_seqlens=cache_len, num_splits=s,
                                                       is_causal=is_causal))
        fn = lambda jitted=jitted: jitted(jq, jk, jv)  # noqa: E731
        ms = time_interleaved({}, {"fa3": fn}, jax.block_until_ready, 3, 3, calls)["fa3"]
        if best is None or ms < best[0]:
            best = (ms, splits, fn)
    return best[2], best[1]


def _fa3_beside(fa3, q, k, v, cache_len, calls, ours, is_causal=False):
    """FA3's call on our tensors q, k, v at its best split count (_fa3_best_split) and its output's
    largest difference from ours() (a call of ours on the same tensors): (FA3's call, that diff)."""
    jq, jk, jv = (to_jax(fa3, x) for x in (q, k, v))
    fn, _ = _fa3_best_split(fa3, jq, jk, jv, cache_len, calls, is_causal)
    fa3_out = from_jax(fa3, fa3[0].block_until_ready(fn()))
    return fn, (fa3_out.float() - ours().float()).abs().max().item()


def _fmt(value, spec):
    """value formatted by spec, or '-' (NaN: not measured) as wide."""
    return format("-", ">" + spec.split(".")[0]) if value != value else format(value, spec)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m flashhopper.bench --decode", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64, 128],
                        help="sequences a call (default: %(default)s)")
    parser.add_argument("--cache-lens", type=int, nargs="+", default=[4096, 16384, 131072],
                        help="keys cached a sequence (default: %(default)s)")
    parser.add_argument("--heads", type=int, nargs=2, default=[32, 8], metavar=("HQ", "HKV"),
                        help="query and KV heads (default: %(default)s)")
    parser.add_argument("--page-size", type=int, default=64, help="the paged column's page size (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=9, help="interleaved rounds (default: %(default)s)")
    parser.add_argument("--calls", type=int, default=20, help="back-to-back calls a round (default: %(default)s)")
    parser.add_argument("--prefill-lens", type=int, nargs="*", default=[512, 1024, 2048, 4096],
                        help="prefill rows: query tokens a sequence against the cache, causal, through "
                             "flash_attn_with_kvcache and through flash_attn_varlen_func (default: %(default)s; "
                             "none: no prefill rows)")
    parser.add_argument("--prefill-cache", type=int, default=16384,
                        help="prefill rows: keys cached a sequence, the new ones included (default: %(default)s)")
    parser.add_argument("--prefill-batch", type=int, default=4, help="prefill rows: sequences (default: %(default)s)")
    parser.add_argument("--packed-cache-lens", type=int, nargs="*", default=[8192, 65536],
                        help="packed decode rows: keys cached a sequence (default: %(default)s; none: no such rows)")
    parser.add_argument("--packed-batch", type=int, default=64,
                        help="packed decode rows: sequences (default: %(default)s)")
    parser.add_argument("--spec-tokens", type=int, nargs="*", default=[2, 4, 8],
                        help="speculative decoding rows: query tokens a sequence (none: no such rows)")
    parser.add_argument("--spec-batches", type=int, nargs="+", default=[1, 8, 32, 64],
                        help="speculative decoding rows: sequences (default: %(default)s)")
    parser.add_argument("--spec-cache-len", type=int, default=16384,
                        help="speculative decoding rows: cached keys a sequence (default: %(default)s)")
    parser.add_argument("--mla-cache-lens", type=int, nargs="*", default=[4096, 16384, 65536],
                        help="MLA (qv) decode rows: keys cached a sequence (default: %(default)s; none: no such rows)")
    parser.add_argument("--mla-batches", type=int, nargs="+", default=[32, 128],
                        help="MLA (qv) decode rows: sequences (default: %(default)s)")
    parser.add_argument("--mla-dvs", type=int, nargs="+", default=[256, 512],
                        help="MLA (qv) decode rows: latent widths dv (default: %(default)s; 512 is DeepSeek's)")
    parser.add_argument("--out", default="flashhopper-bench",
                        help="folder for the CSVs and plot, created when the run starts (default: %(default)s)")
    args = parser.parse_args(argv)
    if not can_time_here("flashhopper.bench --decode"):
        return 1
    os.makedirs(args.out, exist_ok=True)
    fa3 = _load_fa3()
    gpu, date = torch.cuda.get_device_name(), datetime.date.today().isoformat()
    csv_path = os.path.join(args.out, f"bench_decode_{date}.csv")
    copy = copy_tbps()
    print(f"device-to-device copy: {copy:.2f} TB/s", flush=True)
    heads_q, heads_kv = args.heads
    rows = []
    for cache_len in args.cache_lens:
        for batch in args.batches:
            kv_gib = 2 * batch * cache_len * heads_kv * 128 * 2 / 2 ** 30  # dense; the paged copy as much again
            if kv_gib > MAX_KV_GIB:
                print(f"skip batch {batch} x {cache_len}: {kv_gib:.0f} GiB of cache", flush=True)
                continue
            row = {"date": date, "gpu": gpu, **measure_row(batch, cache_len, heads_q, heads_kv, 128, fa3, copy, args)}
            rows.append(row)
            print(f"batch {batch:4d} cache {cache_len:6d}: ours {row['flashhopper_us']:8.1f} us "
                  f"{row['flashhopper_tbps']:.2f} TB/s, FA3 {_fmt(row['fa3_us'], '8.1f')} us", flush=True)
            _write_csv(csv_path, rows, FIELDS)
            torch.cuda.empty_cache()
    _plot(rows, os.path.join(args.out, f"bench_decode_{date}.png"), gpu, date, copy)
    prefill = [{"date": date, "gpu": gpu, **measure_prefill_row(args.prefill_batch, seqlen_q, args.prefill_cache,
                                                                heads_q, heads_kv, 128, args)}
               for seqlen_q in args.prefill_lens]
    if prefill:
        _write_csv(os.path.join(args.out, f"bench_prefill_{date}.csv"), prefill, list(prefill[0]))
    packed = [{"date": date, "gpu": gpu, **measure_packed_row(args.packed_batch, cache_len, heads_q, heads_kv, 128,
                                                              fa3, args)}
              for cache_len in args.packed_cache_lens]
    if packed:
        _write_csv(os.path.join(args.out, f"bench_packed_decode_{date}.csv"), packed, list(packed[0]))
    spec = []
    for batch, tokens in itertools.product(args.spec_batches, args.spec_tokens):
        spec.append({"date": date, "gpu": gpu, **measure_spec_row(batch, tokens, args.spec_cache_len, heads_q,
                                                                  heads_kv, 128, fa3, args)})
        _write_csv(os.path.join(args.out, f"bench_spec_decode_{date}.csv"), spec, list(spec[0]))
        torch.cuda.empty_cache()
    mla = []
    for dv, cache_len, batch, seqlen_q in itertools.product(args.mla_dvs, args.mla_cache_lens, args.mla_batches,
                                                            (1, 4)):
        row = measure_mla_row(batch, seqlen_q, cache_len, dv, copy, args)
        if row is not None:
            mla.append({"date": date, "gpu": gpu, **row})
            _write_csv(os.path.join(args.out, f"bench_mla_decode_{date}.csv"), mla, list(mla[0]))
        torch.cuda.empty_cache()
    print_tables(rows, prefill, gpu, copy)
    print_packed_table(packed, gpu)
    print_spec_table(spec, gpu, copy)
    print_mla_table(mla, gpu, copy)
    return 0


def _write_csv(path, rows, fields):
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)


def print_tables(rows, prefill, gpu, copy):
    """The decode table (TB/s a backend, ours against FA3 and the copy, the workspace), then the
    prefill one, if any."""
    if rows:
        print(f"\ndecode, GQA {rows[0]['heads_q']}/{rows[0]['heads_kv']}, hdim {rows[0]['hdim']}, bf16, {gpu}; "
              f"K+V TB/s (copy {copy:.2f})")
        print(f"{'batch':>5} {'cache':>7} {'ours':>6} {'graph':>6} {'paged':>6} {'FA3':>6} {'FA3 pg':>6} "
              f"{'cuDNN':>6} {'FA2':>6} {'ours us':>8} {'FA3 us':>8} {'vs FA3':>6} {'vs copy':>7} {'ws %KV':>7} "
              f"{'GPU us':>7}")
    for r in rows:
        print(f"{r['batch']:5d} {r['cache_len']:7d} " + " ".join(_fmt(r[f'{b}_tbps'], '6.2f') for b in BACKENDS)
              + f" {_fmt(r['flashhopper_us'], '8.1f')} {_fmt(r['fa3_us'], '8.1f')} {_fmt(r['ours_vs_fa3'], '6.2f')}"
              f" {_fmt(r['ours_vs_copy'], '7.2f')} {_fmt(100 * r['workspace_vs_kv'], '7.3f')}"
              f" {_fmt(r['flashhopper_kernel_us'], '7.1f')}")
    if prefill:
        r = prefill[0]
        print(f"\nprefill against a cache of {r['cache_len']} keys, batch {r['batch']}, causal, "
              f"GQA {r['heads_q']}/{r['heads_kv']}, hdim {r['hdim']}, bf16; TFLOP/s")
        print(f"{'sq':>5} {'kvcache':>8} {'varlen':>8} {'kvcache/varlen':>15} {'max diff':>9}")
    for r in prefill:
        print(f"{r['seqlen_q']:5d} {_fmt(r['kvcache_tflops'], '8.0f')} {_fmt(r['varlen_tflops'], '8.0f')} "
              f"{_fmt(r['kvcache_vs_varlen'], '15.3f')} {_fmt(r['max_diff'], '9.2g')}")


PACKED_CALLS = ("packed", "packed_unsplit", "dense_q", "fa3_dense_q")


def measure_packed_row(batch, cache_len, heads_q, heads_kv, d, fa3, args):
    """Sequences of b % 8 + 1 query tokens, packed, against cache_len cached keys each (no mask):
    the packed call split as the library chooses and unsplit, the dense-query call of 4 tokens a
    sequence, and FA3's (fa3: _load_fa3's, or None) on those 4 tokens (its flash_mha_with_kvcache
    takes no packed queries) at its best split count; TFLOP/s, K+V TB/s, the packed call's largest
    difference from the unsplit one and FA3's from our dense-query call."""
    counts = [b % 8 + 1 for b in range(batch)]
    cu_q = torch.tensor([0] + [sum(counts[:b + 1]) for b in range(batch)], dtype=torch.int32, device="cuda")
    total = sum(counts)
    q_packed = torch.randn(total, heads_q, d, device="cuda", dtype=torch.bfloat16)
    q_dense = torch.randn(batch, 4, heads_q, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, cache_len, heads_kv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    lengths = torch.full((batch,), cache_len, dtype=torch.int32, device="cuda")

    def packed(num_splits):
        return lambda: fh.flash_attn_with_kvcache(q_packed, k, v, cache_seqlens=lengths, cu_seqlens_q=cu_q,
                                                  max_seqlen_q=max(counts), num_splits=num_splits)
    fns = {"packed": packed(0), "packed_unsplit": packed(1),
           "dense_q": lambda: fh.flash_attn_with_kvcache(q_dense, k, v, cache_seqlens=lengths, num_splits=0)}
    diff = (fns["packed"]().float() - fns["packed_unsplit"]().float()).abs().max().item()
    jax_fns, fa3_diff = {}, NAN
    if fa3 is not None:
        jax_fns["fa3_dense_q"], fa3_diff = _fa3_beside(fa3, q_dense, k, v, cache_len, args.calls, fns["dense_q"])
    ms = time_interleaved(fns, jax_fns, (fa3[0].block_until_ready if fa3 else None), 5, args.rounds, args.calls)
    kv_bytes = 2 * batch * cache_len * heads_kv * d * k.element_size()
    row = {"batch": batch, "query_rows": total, "cache_len": cache_len, "heads_q": heads_q, "heads_kv": heads_kv,
           "hdim": d}
    for name in PACKED_CALLS:
        rows = total if name.startswith("packed") else 4 * batch
        row[f"{name}_us"] = ms[name] * 1e3 if name in ms else NAN
        row[f"{name}_tflops"] = 4 * rows * cache_len * heads_q * d / (row[f"{name}_us"] * 1e-6) / 1e12
        row[f"{name}_tbps"] = kv_bytes / (row[f"{name}_us"] * 1e-6) / 1e12
    row["packed_vs_dense_q"] = row["packed_tflops"] / row["dense_q_tflops"]
    row["packed_vs_fa3"] = row["packed_tflops"] / row["fa3_dense_q_tflops"]
    row["max_diff_split"] = diff
    row["max_diff_fa3"] = fa3_diff
    print(f"packed decode cache {cache_len:6d}: packed {row['packed_tflops']:.0f}, unsplit "
          f"{row['packed_unsplit_tflops']:.0f}, dense q {row['dense_q_tflops']:.0f} TFLOP/s", flush=True)
    return row


def print_packed_table(packed, gpu):
    if not packed:
        return
    r = packed[0]
    print(f"\npacked decode: {r['batch']} sequences of 1-8 query tokens ({r['query_rows']} rows), GQA "
          f"{r['heads_q']}/{r['heads_kv']}, hdim {r['hdim']}, bf16, {gpu}; TFLOP/s (K+V TB/s)")
    print(f"{'cache':>7} {'packed':>14} {'unsplit':>14} {'dense q (4)':>14} {'FA3 q (4)':>14} {'packed/dense':>13} "
          f"{'packed/FA3':>11} {'split diff':>11} {'FA3 diff':>9}")
    for r in packed:
        cells = " ".join(f"{_fmt(r[f'{c}_tflops'], '6.0f')} ({_fmt(r[f'{c}_tbps'], '5.2f')})" for c in PACKED_CALLS)
        ratios = f"{_fmt(r['packed_vs_dense_q'], '13.2f')} {_fmt(r['packed_vs_fa3'], '11.2f')}"
        diffs = f"{_fmt(r['max_diff_split'], '11.2g')} {_fmt(r['max_diff_fa3'], '9.2g')}"
        print(f"{r['cache_len']:7d} {cells} {ratios} {diffs}")


def measure_spec_row(batch, tokens, cache_len, heads_q, heads_kv, d, fa3, args):
    """Speculative decoding's verify step: `tokens` query tokens a sequence, causal at the end of
    cache_len cached keys, against a dense cache: ours (num_splits 0) and FA3's (fa3: _load_fa3's,
    or None; is_causal, its best split count). TB/s over the K and V bytes, TFLOP/s over the visible
    (query, key) pairs, FA3's largest difference from ours."""
    q = torch.randn(batch, tokens, heads_q, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, cache_len, heads_kv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    lengths = torch.full((batch,), cache_len, dtype=torch.int32, device="cuda")
    fns = {"ours": lambda: fh.flash_attn_with_kvcache(q, k, v, cache_seqlens=lengths, causal=True, num_splits=0)}
    jax_fns, fa3_diff = {}, NAN
    if fa3 is not None:
        jax_fns["fa3"], fa3_diff = _fa3_beside(fa3, q, k, v, cache_len, args.calls, fns["ours"], is_causal=True)
    ms = time_interleaved(fns, jax_fns, (fa3[0].block_until_ready if fa3 else None), 5, args.rounds, args.calls)
    kv_bytes = 2 * batch * cache_len * heads_kv * d * k.element_size()
    pairs = batch * (tokens * cache_len - tokens * (tokens - 1) // 2)  # token t sees cache_len - tokens + t + 1 keys
    row = {"batch": batch, "tokens": tokens, "cache_len": cache_len, "heads_q": heads_q, "heads_kv": heads_kv,
           "hdim": d}
    for name in SPEC_CALLS:
        us = ms[name] * 1e3 if name in ms else NAN
        row.update({f"{name}_us": us, f"{name}_tbps": kv_bytes / (us * 1e-6) / 1e12,
                    f"{name}_tflops": 4 * pairs * heads_q * d / (us * 1e-6) / 1e12})
    row["ours_vs_fa3"] = row["ours_tbps"] / row["fa3_tbps"]
    row["max_diff_fa3"] = fa3_diff
    print(f"spec decode batch {batch:3d} tokens {tokens}: ours {row['ours_tbps']:.2f} TB/s, FA3 "
          f"{_fmt(row['fa3_tbps'], '.2f')}", flush=True)
    return row


SPEC_CALLS = ("ours", "fa3")


def print_spec_table(spec, gpu, copy):
    if not spec:
        return
    r = spec[0]
    print(f"\nspeculative decoding: query tokens a sequence (causal) at the end of {r['cache_len']} cached keys, "
          f"GQA {r['heads_q']}/{r['heads_kv']}, hdim {r['hdim']}, bf16, {gpu}; K+V TB/s (copy {copy:.2f}), TFLOP/s")
    print(f"{'batch':>5} {'tokens':>6} {'ours TB/s':>9} {'FA3 TB/s':>9} {'ours/FA3':>8} {'vs copy':>7} "
          f"{'ours TF':>7} {'FA3 TF':>7} {'FA3 diff':>9}")
    for r in spec:
        print(f"{r['batch']:5d} {r['tokens']:6d} {_fmt(r['ours_tbps'], '9.2f')} {_fmt(r['fa3_tbps'], '9.2f')} "
              f"{_fmt(r['ours_vs_fa3'], '8.2f')} {_fmt(r['ours_tbps'] / copy, '7.2f')} "
              f"{_fmt(r['ours_tflops'], '7.0f')} {_fmt(r['fa3_tflops'], '7.0f')} {_fmt(r['max_diff_fa3'], '9.2g')}")


MLA_HEADS, MLA_D = 128, 64


def measure_mla_row(batch, seqlen_q, cache_len, dv, copy, args):
    """Absorbed MLA decode (qv): seqlen_q query tokens a sequence (causal) of 128 heads on one KV
    head against cache_len keys of latent width dv, dense and paged (the same keys in shuffled
    pages); None where this build has no qv kernels of that width or the cache would not fit."""
    kv_gib = 2 * batch * cache_len * (MLA_D + dv) * 2 / 2 ** 30  # dense and the paged copy
    if kv_gib > MAX_KV_GIB:
        print(f"skip MLA batch {batch} x {cache_len}: {kv_gib:.0f} GiB of cache", flush=True)
        return None
    q = torch.randn(batch, seqlen_q, MLA_HEADS, MLA_D, device="cuda", dtype=torch.bfloat16)
    qv = torch.randn(batch, seqlen_q, MLA_HEADS, dv, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, cache_len, 1, MLA_D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(batch, cache_len, 1, dv, device="cuda", dtype=torch.bfloat16)
    lengths = torch.full((batch,), cache_len, dtype=torch.int32, device="cuda")
    page = args.page_size
    pages = batch * cache_len // page
    order = torch.randperm(pages, device="cuda")
    page_table = order.view(batch, cache_len // page).to(torch.int32)
    k_pages = torch.empty(pages, page, 1, MLA_D, device="cuda", dtype=torch.bfloat16)
    v_pages = torch.empty(pages, page, 1, dv, device="cuda", dtype=torch.bfloat16)
    k_pages[order] = k.view(pages, page, 1, MLA_D)
    v_pages[order] = v.view(pages, page, 1, dv)
    causal = seqlen_q > 1
    fns = {"dense": lambda: fh.flash_attn_with_kvcache(q, k, v, qv=qv, cache_seqlens=lengths, causal=causal),
           "paged": lambda: fh.flash_attn_with_kvcache(q, k_pages, v_pages, qv=qv, cache_seqlens=lengths,
                                                       page_table=page_table, causal=causal)}
    try:
        diff = (fns["dense"]().float() - fns["paged"]().float()).abs().max().item()
    except NotImplementedError as error:
        print(f"skip MLA rows of dv {dv}: {error}", flush=True)
        return None
    ms = time_all_ms(fns, warmup=5, rounds=args.rounds, calls=args.calls)
    kv_bytes = batch * cache_len * (MLA_D + dv) * 2
    flops = 2 * batch * seqlen_q * MLA_HEADS * cache_len * (MLA_D + 2 * dv)
    row = {"batch": batch, "seqlen_q": seqlen_q, "cache_len": cache_len, "heads_q": MLA_HEADS, "hdim": MLA_D,
           "hdim_v": dv, "page_size": page, "copy_tbps": copy}
    for name in fns:
        row[f"{name}_us"] = ms[name] * 1e3
        row[f"{name}_tbps"] = kv_bytes / (ms[name] * 1e-3) / 1e12
        row[f"{name}_tflops"] = flops / (ms[name] * 1e-3) / 1e12
    row["dense_vs_copy"] = row["dense_tbps"] / copy
    row["max_diff_paged"] = diff
    print(f"MLA dv {dv} batch {batch:4d} sq {seqlen_q} cache {cache_len:6d}: {row['dense_tbps']:.2f} TB/s "
          f"{row['dense_tflops']:.0f} TFLOP/s, paged {row['paged_tbps']:.2f} TB/s", flush=True)
    return row


def print_mla_table(mla, gpu, copy):
    if not mla:
        return
    print(f"\nabsorbed MLA decode (qv): {MLA_HEADS} heads on 1 KV head, d {MLA_D} + qv against the latent dv, bf16, "
          f"{gpu}; K+V TB/s (copy {copy:.2f}) and TFLOP/s")
    print(f"{'dv':>4} {'batch':>5} {'sq':>3} {'cache':>7} {'dense TB/s':>10} {'vs copy':>7} {'TFLOP/s':>7} "
          f"{'paged TB/s':>10} {'TFLOP/s':>7} {'paged diff':>10}")
    for r in mla:
        print(f"{r['hdim_v']:4d} {r['batch']:5d} {r['seqlen_q']:3d} {r['cache_len']:7d} {_fmt(r['dense_tbps'], '10.2f')} "
              f"{_fmt(r['dense_vs_copy'], '7.2f')} {_fmt(r['dense_tflops'], '7.0f')} {_fmt(r['paged_tbps'], '10.2f')} "
              f"{_fmt(r['paged_tflops'], '7.0f')} {_fmt(r['max_diff_paged'], '10.2g')}")


def measure_prefill_row(batch, seqlen_q, cache_len, heads_q, heads_kv, d, args):
    """seqlen_q new query tokens a sequence at the end of cache_len cached keys (causal, bottom-right
    aligned), through flash_attn_with_kvcache and through flash_attn_varlen_func over the same
    memory (the cache as packed keys): TFLOP/s with FlashAttention's count of the visible pairs,
    their ratio (the issue's bound: within 5%) and the outputs' largest difference."""
    q = torch.randn(batch, seqlen_q, heads_q, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, cache_len, heads_kv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    lengths = torch.full((batch,), cache_len, dtype=torch.int32, device="cuda")
    cu_q = torch.arange(0, batch + 1, dtype=torch.int32, device="cuda") * seqlen_q
    cu_k = torch.arange(0, batch + 1, dtype=torch.int32, device="cuda") * cache_len
    packed_q, packed_k, packed_v = q.view(-1, heads_q, d), k.view(-1, heads_kv, d), v.view(-1, heads_kv, d)

    def kvcache():
        return fh.flash_attn_with_kvcache(q, k, v, cache_seqlens=lengths, causal=True)

    def varlen():
        return fh.flash_attn_varlen_func(packed_q, packed_k, packed_v, cu_q, cu_k, seqlen_q, cache_len, causal=True)
    diff = (kvcache().view(-1, heads_q, d).float() - varlen().float()).abs().max().item()
    ms = time_all_ms({"kvcache": kvcache, "varlen": varlen}, warmup=5, rounds=args.rounds, calls=args.calls)
    pairs = seqlen_q * cache_len - seqlen_q * (seqlen_q - 1) // 2  # row i sees cache_len - seqlen_q + i + 1 keys
    flop = 4 * batch * heads_q * pairs * d
    row = {"batch": batch, "seqlen_q": seqlen_q, "cache_len": cache_len, "heads_q": heads_q, "heads_kv": heads_kv,
           "hdim": d, "kvcache_us": ms["kvcache"] * 1e3, "varlen_us": ms["varlen"] * 1e3,
           "kvcache_tflops": flop / (ms["kvcache"] * 1e-3) / 1e12, "varlen_tflops": flop / (ms["varlen"] * 1e-3) / 1e12,
           "kvcache_vs_varlen": ms["varlen"] / ms["kvcache"], "max_diff": diff}
    print(f"prefill sq {seqlen_q:5d}: kvcache {row['kvcache_tflops']:.0f}, varlen {row['varlen_tflops']:.0f} TFLOP/s",
          flush=True)
    return row


def _plot(rows, path, gpu, date, copy):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    cache_lens = sorted({r["cache_len"] for r in rows})
    fig, axes = plt.subplots(1, len(cache_lens), figsize=(5 * len(cache_lens), 4), squeeze=False)
    for ax, cache_len in zip(axes[0], cache_lens):
        here = [r for r in rows if r["cache_len"] == cache_len]
        for b in BACKENDS:
            ax.plot([r["batch"] for r in here], [r[f"{b}_tbps"] for r in here], marker="o", label=b)
        ax.axhline(copy, color="gray", linestyle="--", label="copy")
        ax.set_xscale("log", base=2)
        ax.set_title(f"cache {cache_len}")
        ax.set_xlabel("batch")
        ax.set_ylabel("K+V read, TB/s")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"Decode (1 query token, GQA, hdim 128, bf16), {gpu}, {date}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
