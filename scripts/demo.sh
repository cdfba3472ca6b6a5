#!/usr/bin/env bash
# Builds FlashHopper and runs its demo: on an sm_90 GPU it runs the forward and backward kernels,
# checks them against the CPU reference and times them; elsewhere it runs the CPU reference and
# says so.
usage="usage: scripts/demo.sh [seqlen [head_dim]] [-DNAME=VALUE ...] [-- more cmake options]
  seqlen: tokens per sequence (default 1024); head_dim: a multiple of 8 up to 256 (default 128).
  -D options (e.g. -DFLASHHOPPER_CUDA=OFF) and those after -- or in FLASHHOPPER_CMAKE_ARGS go to CMake."
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
program=()
cmake_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) echo "$usage"; exit 0 ;;
    --) shift; cmake_args+=("$@"); break ;;
    -D*) cmake_args+=("$1"); shift ;;
    -*) echo "demo.sh: unknown option '$1' (CMake options go after --)" >&2; echo "$usage" >&2; exit 2 ;;
    *)
      if ! [[ "$1" =~ ^[1-9][0-9]*$ ]] || [ ${#program[@]} -ge 2 ]; then
        echo "demo.sh: '$1' is not a positive integer seqlen or head_dim" >&2; echo "$usage" >&2; exit 2
      fi
      program+=("$1"); shift ;;
  esac
done
BUILD_TARGET=flashhopper_demo "$root/scripts/build.sh" "${cmake_args[@]}"
"$root/${BUILD_DIR:-build}/examples/flashhopper_demo" "${program[@]}"
