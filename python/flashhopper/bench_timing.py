"""Timing and peer helpers shared by the benchmarks (flashhopper.bench, bench_decode, gate): CUDA
events around back-to-back calls in interleaved rounds, JAX peers' tensors across, and whether the
kernels can run here. No benchmark module imports another one: each takes these from here."""
import math
import statistics
import sys
import time

import torch

from . import interface as flashhopper


def time_all_ms(fns, warmup=10, rounds=15, calls=10, min_round_ms=0.0, lead_cycles=0):
    """Median per backend of `rounds` timings, each the mean of `calls` back-to-back calls, after
    `warmup` calls. Rounds interleave the backends (A, B, C, A, B, C, ...) so that clock and power
    drift during the run falls on all of them alike; back-to-back calls let each backend's host
    launch cost overlap its previous call's GPU work, as in a model's forward.
    min_round_ms > 0 raises a backend's calls a round until its round lasts that long (from one
    timed round after the warm-up), so that short calls are timed over as long a span as long ones.
    lead_cycles > 0 queues a GPU busy-wait of that many clock cycles before each round's start
    event, so the round's first call is queued before the GPU reaches it: the host's time to issue
    it (which varies from machine to machine) stays out of the figure, as it does for the calls after."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    counts = {name: calls for name in fns}

    def round_ms(fn, n):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if lead_cycles:
            torch.cuda._sleep(lead_cycles)
        start.record()
        for _ in range(n):
            fn()
        stop.record()
        stop.synchronize()
        return start.elapsed_time(stop) / n

    if min_round_ms > 0:
        for name, fn in fns.items():
            per_call = round_ms(fn, calls)
            counts[name] = max(calls, math.ceil(min_round_ms / max(per_call, 1e-6)))
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(round_ms(fn, counts[name]))
    return {name: statistics.median(t) for name, t in times.items()}


def time_interleaved(torch_fns, jax_fns, block, warmup, rounds, calls):
    """Median per backend over `rounds` rounds; each round times every PyTorch backend once with
    time_all_ms (rounds=1: CUDA events around `calls` back-to-back calls) and then
    every JAX backend (wall clock around `calls` back-to-back calls and one block_until_ready)."""
    for fn in torch_fns.values():
        for _ in range(warmup):
            fn()
    for fn in jax_fns.values():
        for _ in range(warmup):
            block(fn())
    torch.cuda.synchronize()
    samples = {name: [] for name in (*torch_fns, *jax_fns)}
    for _ in range(rounds):
        if torch_fns:
            for name, ms in time_all_ms(torch_fns, warmup=0, rounds=1, calls=calls).items():
                samples[name].append(ms)
        for name, fn in jax_fns.items():
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(calls):
                result = fn()
            block(result)
            samples[name].append((time.perf_counter() - start) * 1e3 / calls)
            del result
    return {name: statistics.median(s) for name, s in samples.items()}


def first_tensor(result):
    """A backend's output: the first of a tuple (out, lse, ...) or the tensor itself."""
    return result[0] if isinstance(result, (tuple, list)) else result


def step_peak_mib(call, inputs):
    """MiB that one forward + backward step of call(*inputs) through autograd allocates at its
    peak, above what was allocated before it (the inputs excluded, their gradients included)."""
    leaves = [x.detach().requires_grad_() for x in inputs]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = first_tensor(call(*leaves))
    grads = torch.autograd.grad(out, leaves, torch.ones_like(out))
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del out, grads
    return peak / 2**20


# JAX peers (FlashAttention-3 through flash-attn3-jax): tensors across, by DLPack where it works.

def to_jax(fa3, t):
    """A torch CUDA tensor as a JAX array (fa3: the peer tuple whose first two items are jax and
    jax.numpy): through DLPack (zero copy), else through the host."""
    jax, jnp, _ = fa3
    t = t.detach().contiguous()
    torch.cuda.synchronize()
    try:
        return jax.dlpack.from_dlpack(t)
    except Exception:
        if t.dtype == torch.bfloat16:
            bits = jnp.asarray(t.view(torch.int16).cpu().numpy())
            return jax.lax.bitcast_convert_type(bits, jnp.bfloat16)
        return jnp.asarray(t.cpu().numpy())


def from_jax(fa3, x):
    """A JAX array as a torch CUDA tensor: through DLPack, else through the host."""
    jax, jnp, _ = fa3
    try:
        return torch.from_dlpack(x)
    except Exception:
        import numpy as np
        if x.dtype == jnp.bfloat16:
            bits = np.asarray(jax.lax.bitcast_convert_type(x, jnp.int16))
            return torch.from_numpy(bits).view(torch.bfloat16).cuda()
        return torch.from_numpy(np.asarray(x)).cuda()


def can_time_here(prog: str) -> bool:
    """Whether the kernels can run here; if not, one line on stderr saying why."""
    if flashhopper.is_available():
        return True
    reason = ("PyTorch sees no CUDA GPU" if not torch.cuda.is_available() else
              "the library has no CUDA kernels or the GPU is not an sm_90 (H100/H200)")
    print(f"{prog}: nothing to time here: {reason}.", file=sys.stderr)
    return False
