"""Device time of every kernel of one FlashHopper call, varlen against dense on the same data
(torch.profiler; no ncu needed): which kernel a varlen call spends its time in beyond the dense
call's (the tile planner, pre/postprocess, the attention kernel itself).

    PYTHONPATH=python FLASHHOPPER_LIBRARY=build/libflashhopper.so python3 bench/profile/kernel_times.py \
        [--lengths 2048,2048,...] [--noncausal] [--calls 20]

Prints, per pass (fwd, bwd) and path (dense when all lengths are equal, varlen), each kernel's mean
device time per call in microseconds and the sum.
"""
import argparse
import collections

import torch
from torch.profiler import ProfilerActivity, profile

import flashhopper

HEADS_Q, HEADS_KV, HEAD_DIM = 32, 8, 128


def kernel_times(fn, calls):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    times = collections.Counter()
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            times[event.name] += event.device_time / calls
    return times


def report(title, times):
    print(f"\n{title}: {sum(times.values()):.1f} us per call")
    for name, us in times.most_common():
        print(f"  {us:9.1f} us  {name[:110]}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="2048,2048,2048,2048,2048,2048,2048,2048")
    parser.add_argument("--noncausal", action="store_true")
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args()
    lengths = [int(s) for s in args.lengths.split(",")]
    causal = not args.noncausal
    total = sum(lengths)
    torch.manual_seed(0)
    q = torch.randn(total, HEADS_Q, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(total, HEADS_KV, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    dout = torch.randn_like(q)
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), device="cuda", dtype=torch.int32)
    varlen = flashhopper.Varlen(cu, cu, max(lengths), max(lengths))
    paths = {"varlen": (q, k, v, dout, varlen)}
    if len(set(lengths)) == 1:  # the same data as a dense batch
        b, s = len(lengths), lengths[0]
        paths["dense"] = (q.view(b, s, HEADS_Q, HEAD_DIM), k.view(b, s, HEADS_KV, HEAD_DIM),
                          v.view(b, s, HEADS_KV, HEAD_DIM), dout.view(b, s, HEADS_Q, HEAD_DIM), None)
    print(f"lengths {lengths}, causal {causal}, Hq {HEADS_Q}, Hkv {HEADS_KV}, d {HEAD_DIM}, bf16")
    for name, (q_, k_, v_, dout_, varlen_) in paths.items():
        out, lse = flashhopper.forward(q_, k_, v_, causal=causal, return_lse=True, varlen=varlen_)
        report(f"fwd {name}", kernel_times(
            lambda: flashhopper.forward(q_, k_, v_, causal=causal, varlen=varlen_), args.calls))
        report(f"bwd {name}", kernel_times(
            lambda: flashhopper.backward(dout_, q_, k_, v_, out, lse, causal=causal, varlen=varlen_), args.calls))


if __name__ == "__main__":
    main()
