"""The FP8 GEMM kernel's measured alternatives (`fp8_wgmma_variants.cu`: the product's header,
ops/fp8/cuda/fp8_wgmma.cuh, in more configurations), built with nvcc like the product's library,
optionally with its K loops unrolled another number of times (`unroll`).

    lib = library()                       # or library(unroll=8)
    fp8_wgmma.fp8_gemm(a, sa, w, sw, lib=lib, variant=DEFAULT)
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

from ops.fp8.cuda import fp8_wgmma, nvcc

SOURCE = Path(__file__).with_name("fp8_wgmma_variants.cu")
_TMA, _OVL, _GROUPED = (fp8_wgmma.MODE_FLAGS[f] for f in ("tma", "ovl", "grouped"))
# fp8_wgmma_variants.cu's table, in its order (a bench test checks the built library agrees).
VARIANTS: tuple[fp8_wgmma.Variant, ...] = tuple(
    fp8_wgmma.Variant(*v)
    for v in (
        (256, 4, _TMA | _OVL, 2),
        (256, 4, _TMA | _OVL, 1),
        (256, 4, _TMA, 2),
        (256, 4, _TMA, 1),
        (256, 4, 0, 2),
        (256, 4, 0, 1),
        (128, 6, _TMA, 2),
        (256, 4, _TMA | _OVL | _GROUPED, 1),
        (256, 4, _TMA | _GROUPED, 1),
    )
)
DEFAULT = 0  # the product's dense configuration (fp8_wgmma.cu's DENSE)
DEFAULT_GROUPED = 7  # and its grouped one
# fp8_wgmma.cuh's K_UNROLL default (a bench test checks the header still says so).
K_UNROLL = 4


def _flags(unroll: int | None) -> tuple[str, ...]:
    flags = fp8_wgmma.NVCC_FLAGS
    return flags if unroll in (None, K_UNROLL) else (*flags, f"-DRELAY_K_UNROLL={unroll}")


def library_path(unroll: int | None = None) -> Path:
    stem = "fp8_wgmma_variants" if unroll in (None, K_UNROLL) else f"fp8_wgmma_variants_u{unroll}"
    return nvcc.library_path(SOURCE, stem, _flags(unroll))


def build(out: Path | None = None, unroll: int | None = None) -> Path:
    """Compile the library (its K loops unrolled `unroll` times, default the header's) to `out`
    (default: the cache path); returns it."""
    try:
        return nvcc.build(SOURCE, out or library_path(unroll), _flags(unroll))
    except nvcc.BuildError as e:
        raise fp8_wgmma.WgmmaError(str(e)) from e


@functools.cache
def library(unroll: int | None = None) -> ctypes.CDLL:
    path = library_path(unroll)
    if not path.exists():
        build(path, unroll)
    return fp8_wgmma.load(path)


def dense() -> list[int]:
    return [i for i, v in enumerate(VARIANTS) if not v.grouped]


def grouped() -> list[int]:
    return [i for i, v in enumerate(VARIANTS) if v.grouped]
