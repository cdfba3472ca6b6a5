"""One FlashHopper call on the benchmark grid's shape, after two warm-up calls: the process that
`profile_stalls.sh` runs under ncu. Usage: one_call.py fwd|bwd SEQLEN HEAD_DIM CAUSAL [DETERMINISTIC]"""
import sys

import torch

import flashhopper

pass_, seqlen, head_dim, causal = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), bool(int(sys.argv[4]))
deterministic = len(sys.argv) > 5 and bool(int(sys.argv[5]))  # the backward's deterministic mode
batch, heads = 16384 // seqlen, 2048 // head_dim  # 16k tokens, model dim 2048 (docs/conventions.md)
q, k, v, dout = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(4))
out, lse = flashhopper.forward(q, k, v, causal=causal, return_lse=True)
for _ in range(3):
    if pass_ == "fwd":
        flashhopper.forward(q, k, v, causal=causal)
    else:
        flashhopper.backward(dout, q, k, v, out, lse, causal=causal, deterministic=deterministic)
torch.cuda.synchronize()
