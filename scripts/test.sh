#!/usr/bin/env bash
# Builds FlashHopper and runs its tests: CTest, then the Python tests (tests/python, pytest) against
# the library just built. On a machine without an sm_90 GPU the GPU tests skip and say so;
# everything else runs. Usage: scripts/test.sh [extra cmake -D options]
# The Python tests need torch and pytest in FLASHHOPPER_PYTHON (default python3); without them
# they are skipped with a note, unless FLASHHOPPER_PYTHON was set (CI), where that is an error.
set -euo pipefail  # pipefail: ctest's status survives the tee below
root="$(cd "$(dirname "$0")/.." && pwd)"
build="$root/${BUILD_DIR:-build}"
"$root/scripts/build.sh" "$@"
ctest --test-dir "$build" --output-on-failure | tee "$build/ctest_last.log"
# CTest shows a skipped test without its reason; the GPU tests print theirs when they skip.
if grep -q "Skipped" "$build/ctest_last.log"; then
  reason="$(ctest --test-dir "$build" -R '^forward_gpu$' -V 2>/dev/null | grep -o "GPU tests skipped: .*" || true)"
  echo "${reason:-(some tests were skipped; ctest -V shows why)}"
fi

python="${FLASHHOPPER_PYTHON:-python3}"
if [ ! -d "$root/tests/python" ]; then
  echo "Python tests: none (no tests/python)"
elif ! "$python" -c "import torch, pytest" 2>/dev/null; then
  if [ -n "${FLASHHOPPER_PYTHON:-}" ]; then
    echo "error: FLASHHOPPER_PYTHON=$python cannot import torch and pytest" >&2
    exit 1
  fi
  echo "Python tests SKIPPED: $python cannot import torch and pytest" \
       "(pip install torch pytest, or set FLASHHOPPER_PYTHON to a Python that has them)"
else
  # The package from the checkout, with the library from this build (not an installed copy).
  status=0
  (cd "$root" && PYTHONPATH="$root/python${PYTHONPATH:+:$PYTHONPATH}" \
     FLASHHOPPER_LIBRARY="$build/libflashhopper.so" "$python" -m pytest tests/python -q) || status=$?
  # pytest exit code 5: no tests collected (tests/python holds none yet).
  [ "$status" -eq 0 ] || [ "$status" -eq 5 ] || exit "$status"
fi
