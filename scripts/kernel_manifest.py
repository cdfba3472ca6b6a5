"""The kernel families FlashHopper compiles, in one table.

scripts/generate_kernels.py writes from it the instantiation files
(src/hopper/instantiations/), the CMake source lists (cmake/kernel_manifest.cmake) and the
dispatch table (src/launch/kernel_manifest.hpp), from which the library answers which families
a build has (fh_compiled_families) and picks the family a call runs on: of those whose head dim and
value head dim are at least the call's, the one with the least padded work (head dim plus value
head dim; the smaller head dim on a tie), so head dims between the compiled ones run padded.

Adding a head dim: one line in HEAD_DIMS, a tile-table entry in src/hopper/common/tile_size.hpp,
then `python3 scripts/generate_kernels.py`.
"""
from __future__ import annotations

import dataclasses

DTYPES = {"bf16": "FH_DTYPE_BF16", "fp16": "FH_DTYPE_FP16", "fp8": "FH_DTYPE_FP8_E4M3"}
# fp8 (e4m3) inputs: forward only, on the rows that ask for it (HeadDims.fp8), every forward
# feature.
FP8 = "fp8"
FP8_SET = "bench"  # the kernel set that first compiles the fp8 families
PASSES = {"fwd": "kForward", "bwd": "kBackward"}

# Kernel sets, each a superset of the one before: "dev" is what CI and quick checks compile;
# "bench" adds the bf16 head dims the speed gate and the dense grid time (64 and 256), so a device
# run can build what it measures in minutes rather than the full set's quarter hour.
KERNEL_SETS = ("dev", "bench", "full")

# Compiled into every family (template parameters of its launch): the mask kind and softcap.
MASKS = {"full": "kNone", "causal": "kCausal", "local": "kLocal"}
SOFTCAP = {"": "false", "_softcap": "true"}

# And into every forward family: the features its kernels handle beyond a dense batch
# (src/hopper/common/forward_features.hpp), file suffix -> ForwardFeatures enumerator. A call
# runs on the first set, in this order, that holds every feature it uses: a dense call on a
# kernel without any of their code, any other on the one with all of them. A qv row's sets carry
# kQv besides (QV_FEATURE).
FORWARD_FEATURE_SETS = {"": "kNone", "_general": "kAll"}
QV_FEATURE = "kQv"

# And into every backward family: whether its kernels take packed batches (cu_seqlens, seqused),
# file suffix -> kPacked. A call with packed batches runs on "true", any other on "false", which
# carries none of their code (src/launch/backward_dispatch.cu).
BACKWARD_FEATURE_SETS = {"": "false", "_packed": "true"}


@dataclasses.dataclass(frozen=True)
class HeadDims:
    head_dim: int
    head_dim_v: int
    passes: tuple[str, ...] = ("fwd", "bwd")
    bf16_set: str = "full"  # the smallest kernel set that compiles its bf16 kernels (fp16: "full")
    # The passes whose tiles (src/hopper/common/tile_size.hpp) use a WGMMA N outside CuTe's default
    # shapes: "fwd", "fwd_unmasked" (the forward without a mask only) or "bwd". Those instantiations
    # alone read CuTe's extended shapes (gmma_extended_shapes.hpp), a large part of an instantiation's
    # compile time; the launches assert that this matches the tiles (src/hopper/common/gmma_shapes.hpp).
    extended_gmma: tuple[str, ...] = ()
    # Forward only: its kernels compute S = Q K^T + Qv V^T (FA3's qv, absorbed MLA) and run the calls
    # with qv, and only those (a call without qv never runs on it, one with qv only on such a row).
    qv: bool = False
    # Whether it has an fp8 forward family too (bench set: its speed marks are timed there).
    fp8: bool = False


# The backward of a forward-only row runs on the next row that has one (padded).
HEAD_DIMS = [
    HeadDims(64, 64, bf16_set="bench", fp8=True),
    HeadDims(64, 256, passes=("fwd",), qv=True),  # absorbed MLA: qv against the latent values
    HeadDims(64, 512, passes=("fwd",), qv=True),  # absorbed MLA at DeepSeek's latent width: O split
    HeadDims(96, 96, extended_gmma=("fwd_unmasked", "bwd")),  # key blocks of 160; dQ's N = 48
    HeadDims(128, 128, bf16_set="dev", extended_gmma=("fwd_unmasked",), fp8=True),  # key blocks of 160
    HeadDims(192, 128, extended_gmma=("fwd",)),  # MLA prefill; key blocks of 112
    HeadDims(192, 192, extended_gmma=("fwd",)),  # key blocks of 112
    HeadDims(256, 256, bf16_set="bench", extended_gmma=("fwd",), fp8=True),  # key blocks of 80
    HeadDims(512, 512),  # Gemma-style; forward: O split over two warpgroups; backward: 32-key blocks
]


@dataclasses.dataclass(frozen=True)
class Family:
    pass_: str
    dtype: str
    head_dim: int
    head_dim_v: int
    first_set: str  # the smallest kernel set that compiles it
    extended_gmma: tuple[str, ...] = ()  # its row's
    qv: bool = False  # its row's

    def feature_sets(self) -> dict[str, str]:
        """{file suffix: the launch's last template argument (a ForwardFeatures expression, or kPacked)}."""
        if self.pass_ != "fwd":
            return BACKWARD_FEATURE_SETS
        return {suffix: forward_feature_set(v, self.qv) for suffix, v in FORWARD_FEATURE_SETS.items()}

    def units(self) -> dict[str, list[tuple[str, str, str, str]]]:
        """Its instantiation files, {file suffix: its variants}: one file a feature set, holding each
        mask kind and softcap. The variants of a file share most of the compiler's work (CuTe's
        layout algebra on the same tiles), so one file of six costs about what two files of one
        would; kernels of different feature sets share much less (docs/kernel_families.md, "Build
        time")."""
        return {features_suffix: [(f"{mask}{suffix}{features_suffix}", kind, softcap, feature_set)
                                  for mask, kind in MASKS.items() for suffix, softcap in SOFTCAP.items()]
                for features_suffix, feature_set in self.feature_sets().items()}

    def variants(self) -> list[tuple[str, str, str, str]]:
        """(name suffix, MaskKind enumerator, softcap, features) of each of its kernels."""
        return [variant for unit in self.units().values() for variant in unit]

    def uses_extended_gmma(self, mask_kind: str) -> bool:
        """Whether its instantiation with this MaskKind enumerator compiles CuTe's extended shapes."""
        if self.dtype == FP8:
            return False  # its tiles (ForwardTileSizeFp8) take 32-key slices of CuTe's default N
        return self.pass_ in self.extended_gmma or (
            self.pass_ == "fwd" and mask_kind == "kNone" and "fwd_unmasked" in self.extended_gmma)

    @property
    def stem(self) -> str:
        dv = "" if self.head_dim_v == self.head_dim else f"_dv{self.head_dim_v}"
        return f"{self.pass_}_{self.dtype}_hdim{self.head_dim}{dv}{'_qv' if self.qv else ''}"

    def in_set(self, kernel_set: str) -> bool:
        return KERNEL_SETS.index(kernel_set) >= KERNEL_SETS.index(self.first_set)


def families() -> list[Family]:
    out = []
    for row in HEAD_DIMS:
        for pass_ in PASSES:
            if pass_ not in row.passes:
                continue
            for dtype in DTYPES:
                if dtype == FP8 and not (row.fp8 and pass_ == "fwd"):
                    continue
                first = row.bf16_set if dtype == "bf16" else FP8_SET if dtype == FP8 else "full"
                out.append(Family(pass_, dtype, row.head_dim, row.head_dim_v, first, row.extended_gmma,
                                  row.qv and pass_ == "fwd"))
    dims = [(f.pass_, f.dtype, f.head_dim, f.head_dim_v) for f in out]
    assert len(dims) == len(set(dims)), "a (head dim, value head dim) is one row, qv or not"
    return out


def forward_feature_set(enumerator: str, qv: bool) -> str:
    """A forward feature set as a C++ constant expression, with kQv for a qv family."""
    feature_set = f"hopper::ForwardFeatures::{enumerator}"
    return f"{feature_set} | hopper::ForwardFeatures::{QV_FEATURE}" if qv else feature_set


