"""pip's build backend (pyproject.toml): scikit-build-core's, with the pinned CUTLASS headers asked
for only when the build compiles kernels. A CPU-only build (-C cmake.define.FLASHHOPPER_CUDA=OFF,
or no nvcc, as CMake decides) and a checkout that has third_party/cutlass fetch nothing more."""
import os
import pathlib
import shutil

from scikit_build_core import build as _skbuild
from scikit_build_core.build import *  # noqa: F401,F403  (every other hook as scikit-build-core has it)

CUTLASS_REQUIREMENT = "nvidia-cutlass==4.2.0.0"  # the pin of scripts/setup_deps.sh
_ROOT = pathlib.Path(__file__).resolve().parent.parent


def _builds_kernels(config_settings) -> bool:
    """FLASHHOPPER_CUDA as CMakeLists.txt resolves it: the -C option when given, else whether an
    nvcc can be found (CUDACXX, the PATH, /usr/local/cuda)."""
    value = (config_settings or {}).get("cmake.define.FLASHHOPPER_CUDA")
    if value is not None:
        return str(value).upper() not in ("OFF", "0", "FALSE", "NO", "N")
    nvcc = os.environ.get("CUDACXX") or shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    return os.path.exists(nvcc)


def _with_cutlass(requires, config_settings):
    if _builds_kernels(config_settings) and not (_ROOT / "third_party" / "cutlass" / "include" / "cute").is_dir():
        return [*requires, CUTLASS_REQUIREMENT]
    return list(requires)


def get_requires_for_build_wheel(config_settings=None):
    return _with_cutlass(_skbuild.get_requires_for_build_wheel(config_settings), config_settings)


def get_requires_for_build_editable(config_settings=None):
    return _with_cutlass(_skbuild.get_requires_for_build_editable(config_settings), config_settings)
