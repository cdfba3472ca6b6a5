#!/usr/bin/env python3
"""Decoding side by side: FlashHopper's flash_attn_with_kvcache (dense cache, CUDA graph, paged)
against FlashAttention-3 and PyTorch SDPA's cuDNN and FLASH backends, K and V read in TB/s beside
the GPU's copy bandwidth.

The benchmark lives in the package (python/flashhopper/bench_decode.py, `python -m flashhopper.bench
--decode`); this script is the same thing at the path scripts/device_check.sh runs (see --help).

    PYTHONPATH=python FLASHHOPPER_LIBRARY=build/libflashhopper.so python3 bench/bench_decode.py --out DIR
"""
import os
import sys

try:
    from flashhopper.bench_decode import main
except ImportError:  # run from a checkout without PYTHONPATH=python
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "python"))
    from flashhopper.bench_decode import main

if __name__ == "__main__":
    sys.exit(main())
