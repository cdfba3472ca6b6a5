#!/usr/bin/env python3
"""Side-by-side attention speed: FlashHopper vs PyTorch SDPA (cuDNN and FLASH backends).

The benchmark lives in the package (python/flashhopper/bench.py, `python -m flashhopper.bench`);
this script is the same thing at the path scripts/device_check.sh runs. Arguments: --passes
--hdims --seqlens --causal --total-tokens --model-dim --rounds --calls --bwd-rounds --bwd-calls
--out (see --help).

    PYTHONPATH=python FLASHHOPPER_LIBRARY=build/libflashhopper.so python3 bench/benchmark_attention.py
"""
import os
import sys

try:
    from flashhopper.bench import main
except ImportError:  # run from a checkout without PYTHONPATH=python
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "python"))
    from flashhopper.bench import main

if __name__ == "__main__":
    sys.exit(main())
