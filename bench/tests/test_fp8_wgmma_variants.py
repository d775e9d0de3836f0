"""bench/kernels/fp8_wgmma_variants: the library of the FP8 GEMM's measured configurations builds
from the product's header, and its table is the one the Python side names (where nvcc is
installed; no GPU needed)."""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import pytest

from bench.kernels import fp8_wgmma_variants as variants
from ops.fp8.cuda import fp8_wgmma, nvcc


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[ctypes.CDLL, ctypes.CDLL]:
    """(the variants library, the product's)."""
    if nvcc.nvcc_path() is None:
        pytest.skip("nvcc not installed")
    tmp = tmp_path_factory.mktemp("variants")
    return fp8_wgmma.load(variants.build(tmp / "variants.so")), fp8_wgmma.load(
        fp8_wgmma.build(tmp / "product.so")
    )


def test_table_matches_the_library(built: tuple[ctypes.CDLL, ctypes.CDLL]) -> None:
    lib, product_lib = built
    assert fp8_wgmma.describe(lib) == variants.VARIANTS
    # The product's two configurations are in it, where the names say.
    product = fp8_wgmma.describe(product_lib)
    assert variants.VARIANTS[variants.DEFAULT] == product[fp8_wgmma.DENSE]
    assert variants.VARIANTS[variants.DEFAULT_GROUPED] == product[fp8_wgmma.GROUPED]


def test_k_unroll_is_the_headers_default() -> None:
    header = Path(fp8_wgmma.SOURCE).with_name("fp8_wgmma.cuh").read_text()
    default = re.search(r"constexpr int K_UNROLL = (\d+);", header)
    assert default and int(default.group(1)) == variants.K_UNROLL
    assert variants.library_path() == variants.library_path(variants.K_UNROLL)
    assert variants.library_path(8) != variants.library_path()
