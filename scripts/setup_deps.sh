#!/usr/bin/env bash
# Installs the pinned CUTLASS/CuTe headers (PyPI wheel nvidia-cutlass, headers only) into
# third_party/cutlass. Idempotent; nothing third-party is committed to the repository.
# Keep the version in step with build-system.requires in pyproject.toml (pip builds).
set -euo pipefail
CUTLASS_VERSION=4.2.0.0
root="$(cd "$(dirname "$0")/.." && pwd)"
dest="$root/third_party/cutlass"
stamp="$dest/.version"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$CUTLASS_VERSION" ]; then
  echo "cutlass $CUTLASS_VERSION already in $dest"
  exit 0
fi
rm -rf "$dest" "$dest.tmp"
python3 -m pip install --quiet --no-deps --target "$dest.tmp" "nvidia-cutlass==$CUTLASS_VERSION"
src="$(PYTHONPATH="$dest.tmp" python3 "$root/scripts/cutlass_root.py")"
mkdir -p "$dest"
# Keep only the C++ headers the build needs (include/ and tools/util/include): about 25 MiB.
cp -r "$src/include" "$dest/include"
mkdir -p "$dest/tools/util"
cp -r "$src/tools/util/include" "$dest/tools/util/include"
cp "$src/LICENSE.txt" "$dest/" 2>/dev/null || true
rm -rf "$dest.tmp"
echo "$CUTLASS_VERSION" > "$stamp"
echo "cutlass $CUTLASS_VERSION headers installed in $dest"
