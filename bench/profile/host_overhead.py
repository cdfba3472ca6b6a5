#!/usr/bin/env python3
"""Host work per call: a timed loop of many back-to-back calls on a tiny problem (1 x 8 x 1 x 128
bf16, so the GPU finishes each call long before the host issues the next), FlashHopper's
flash_attn_func (without and with autograd), forward and flash_attn_with_kvcache beside PyTorch
SDPA's cuDNN and FLASH backends; microseconds per call from the Python side: the median of several
rounds that take every call in turn, the fastest round, and the median ratio to SDPA's cuDNN call
in the same round (which holds across machines and through a noisy host's slow spells; RESULTS.md,
2026-12-07). With --components (no GPU needed) it times the Python layer's own steps on CPU tensors
instead: the checks, the tensor views, the parameter struct and a repeated call's plan lookup.

    PYTHONPATH=python FLASHHOPPER_LIBRARY=build/libflashhopper.so python3 bench/profile/host_overhead.py
    PYTHONPATH=python python3 bench/profile/host_overhead.py --components
"""
import argparse
import statistics
import time

import torch


def interleaved_us(rows, calls, rounds, sync=lambda: None):
    """Microseconds per call of each row (name -> fn), timed in rounds that take every row in turn
    (so that a host slowing down for a while slows every row alike): name -> the rounds' samples,
    or the exception of a row that failed (its first call)."""
    samples = {}
    for name, fn in rows.items():
        try:
            fn()  # warm-up: first-call work (plans, the shared-memory opt-in)
            samples[name] = []
        except Exception as error:  # a backend this PyTorch build lacks
            samples[name] = error
    for _ in range(rounds):
        for name, fn in rows.items():
            if isinstance(samples[name], Exception):
                continue
            sync()
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            samples[name].append((time.perf_counter() - start) / calls * 1e6)
    sync()
    return samples


def host_table(samples, reference):
    """Markdown rows: each row's median and fastest round, and the median over rounds of its ratio
    to `reference`'s sample in the same round (a machine-independent figure: issue 50 counts host
    work against SDPA's)."""
    ref = samples.get(reference)
    lines = [f"| call | us per call (median) | fastest round | / {reference} (same round) |", "|---|---|---|---|"]
    for name, values in samples.items():
        if isinstance(values, Exception):
            lines.append(f"| {name} | - ({type(values).__name__}) | | |")
            continue
        ratio = (f"{statistics.median(v / r for v, r in zip(values, ref)):.2f}"
                 if isinstance(ref, list) and ref else "-")
        lines.append(f"| {name} | {statistics.median(values):.1f} | {min(values):.1f} | {ratio} |")
    return lines


def per_call_us(fn, calls, loops):
    fn()
    samples = []
    for _ in range(loops):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls * 1e6)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return statistics.median(samples)


def components(calls, loops):
    from flashhopper import _ffi, interface
    q = torch.randn(1, 1, 1, 128, dtype=torch.bfloat16)
    named = (("q", q), ("k", q), ("v", q), ("out", q), ("lse", None), ("learnable_sink", None))
    params = _ffi.ForwardParams()
    for field, t in named[:4]:
        setattr(params, field, interface._view(field, t))
    plan = interface._Plan(params, interface._pointer_offsets(params, named), 0)
    steps = {
        "check_mask_args": lambda: interface.check_mask_args(False, (-1, -1), 0.0, 0),
        "check_forward (the library's check on stand-ins)": lambda: interface.check_forward(q, q, q),
        "tensor view (_view) x 5": lambda: [interface._view("q", q) for _ in range(5)],
        "ForwardParams()": lambda: _ffi.ForwardParams(),
        "torch.empty (out)": lambda: torch.empty((1, 1, 1, 128), dtype=torch.bfloat16),
        "plan key (a repeated call's lookup)":
            lambda: interface._plan_key("forward", (q, q, q, None, None), (False, None, False, (-1, -1), 0.0, 0)),
        "plan's struct with this call's pointers": lambda: interface._bound_params(plan, named),
    }
    print("| Python step (CPU tensors) | us per call |\n|---|---|")
    for name, fn in steps.items():
        print(f"| {name} | {per_call_us(fn, calls, loops):.2f} |")


def end_to_end(calls, loops):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import flashhopper
    q = torch.randn(1, 8, 1, 128, device="cuda", dtype=torch.bfloat16)  # cuDNN refuses a single key
    qt = q.transpose(1, 2)
    q_decode, lengths = q[:, :1], torch.full((1,), 8, dtype=torch.int32, device="cuda")
    q_grad = q.clone().requires_grad_()
    rows = {"flashhopper.flash_attn_func (no autograd: the library call)":
                lambda: flashhopper.flash_attn_func(q, q, q),
            "flashhopper.flash_attn_func (inputs require grad: eager autograd)":
                lambda: flashhopper.flash_attn_func(q_grad, q_grad, q_grad),
            "flashhopper.forward (no op)": lambda: flashhopper.forward(q, q, q),
            "torch.ops.flashhopper.fwd with autograd (inputs require grad)":
                lambda: torch.ops.flashhopper.fwd.default(q_grad, q_grad, q_grad),
            f"torch.ops.flashhopper.fwd ({'C++' if flashhopper.ops.NATIVE else 'Python'} kernel, no autograd)":
                lambda: torch.ops.flashhopper.fwd.default(q, q, q),
            "flashhopper.flash_attn_with_kvcache (1 token)":
                lambda: flashhopper.flash_attn_with_kvcache(q_decode, q, q, cache_seqlens=lengths)}
    for name, backend in (("SDPA cuDNN", SDPBackend.CUDNN_ATTENTION), ("SDPA FLASH", SDPBackend.FLASH_ATTENTION)):
        def call(backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qt, qt, qt)
        rows[name] = call
    samples = interleaved_us(rows, calls, loops, sync=torch.cuda.synchronize)
    print(f"{torch.cuda.get_device_name()}; 1 x 8 x 1 x 128 bf16 forward; {loops} rounds of {calls} calls a row\n")
    print("\n".join(host_table(samples, "SDPA cuDNN")))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--components", action="store_true", help="time the Python layer's steps on the CPU")
    parser.add_argument("--calls", type=int, default=2000, help="calls per timed loop (default 2000)")
    parser.add_argument("--loops", type=int, default=7,
                        help="timed loops (rounds over every row, end to end); the median is reported (default 7)")
    args = parser.parse_args()
    if args.components:
        components(args.calls, args.loops)
    elif not torch.cuda.is_available():
        print("host_overhead: no CUDA GPU here; run with --components for the Python layer's steps")
    else:
        end_to_end(args.calls, args.loops)


if __name__ == "__main__":
    main()
