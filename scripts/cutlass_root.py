#!/usr/bin/env python3
"""Prints the CUTLASS source root (holding include/cute and tools/util/include) of the nvidia-cutlass
wheel this Python can import; exits 1 when there is none.

One lookup for both ways the headers arrive: CMake calls it in pip builds (nvidia-cutlass is a build
requirement in pyproject.toml) and scripts/setup_deps.sh calls it on its pip --target folder."""
import importlib.util
import pathlib
import sys


def main() -> int:
    # find_spec locates the package without importing it (its __init__ needs numpy and friends).
    spec = importlib.util.find_spec("cutlass_library")
    for location in (spec.submodule_search_locations or []) if spec else []:
        root = pathlib.Path(location) / "source"
        if (root / "include" / "cute" / "tensor.hpp").is_file():
            print(root)
            return 0
    print("cutlass_root.py: no nvidia-cutlass package with C++ headers on this Python's path",
          file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
