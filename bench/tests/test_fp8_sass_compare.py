"""bench/fp8/sass_compare.py: the SASS parser and K-loop finder on a synthetic dump, the variants'
kernel names, and (where nvcc is installed) the real kernel's K loops."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from bench.kernels import fp8_wgmma_variants as variants

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str):
    sys.path.insert(0, str(ROOT / "bench" / "fp8"))
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / "fp8" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


sass_compare = _load("sass_compare")

# A function with a producer loop (no wgmma), a K loop (two wgmmas, three FFMAs, a conditional
# back-edge) and, after EXIT, a retry stub that returns into the K loop unconditionally.
DUMP = """
	code for sm_90a
		Function : kernel_a
	.headerflags	@"EF_CUDA_SM90"
        /*0000*/                   MOV R1, c[0x0][0x28] ;                          /* 0x00000a00ff017b82 */
                                                                                   /* 0x000fe20000000f00 */
        /*0010*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R2 ;  /* 0x0000000000000000 */
        /*0020*/               @!P0 BRA 0x10 ;                                     /* 0x0000000000000000 */
        /*0030*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR5], R3 ;  /* 0x0000000000000000 */
        /*0040*/               @!P1 BRA 0xa0 ;                                     /* 0x0000000000000000 */
        /*0050*/                   QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR8], RZ, !UPT ; /* 0x0 */
        /*0060*/                   QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR12], R24, gsb0 ; /* 0x0 */
        /*0070*/                   FFMA R100, R24, R2, R100 ;                      /* 0x0000000000000000 */
        /*0080*/                   FFMA R101, R25, R2, R101 ;                      /* 0x0000000000000000 */
        /*0090*/               @P2 BRA 0x30 ;                                      /* 0x0000000000000000 */
        /*00a0*/                   EXIT ;                                          /* 0x0000000000000000 */
        /*00b0*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR5], R3 ;  /* 0x0000000000000000 */
        /*00c0*/                   BRA 0x50 ;                                      /* 0x0000000000000000 */
		Function : kernel_b
        /*0000*/                   EXIT ;                                          /* 0x0000000000000000 */
"""


def test_sass_functions_splits_by_function_and_reads_addresses() -> None:
    functions = sass_compare.sass_functions(DUMP)
    assert list(functions) == ["kernel_a", "kernel_b"]
    assert [i.addr for i in functions["kernel_a"]] == list(range(0, 0xD0, 0x10))
    assert functions["kernel_a"][5].opcode == "QGMMA"
    assert functions["kernel_a"][2].opcode == "BRA"  # the predicate guard is not the opcode


def test_k_loop_is_the_smallest_conditional_loop_issuing_wgmmas() -> None:
    loop = sass_compare.k_loop(sass_compare.sass_functions(DUMP)["kernel_a"])
    # 0x30..0x90: the stub's unconditional return (0xc0 -> 0x50) is not a loop, and the
    # producer's retry (0x20 -> 0x10) issues no wgmma.
    assert (loop.instructions, loop.wgmmas, loop.ffmas) == (7, 2, 2)
    assert loop.non_ffma_per_wgmma == pytest.approx(2.5)
    assert loop.opcodes["SYNCS"] == 1


def test_k_loop_refuses_a_function_without_wgmma() -> None:
    with pytest.raises(ValueError, match="no loop"):
        sass_compare.k_loop(sass_compare.sass_functions(DUMP)["kernel_b"])


def test_every_variant_names_its_own_kernel() -> None:
    assert sass_compare.kernel_symbol_part(variants.DEFAULT) == "fp8_gemm_kernelILi256ELi4ELi20ELi2EE"
    values = {sass_compare.kernel_symbol_part(v) for v in range(len(variants.VARIANTS))}
    assert len(values) == len(variants.VARIANTS)  # no two variants share a kernel


@pytest.fixture(scope="module")
def loops() -> dict[str, object]:
    from ops.fp8.cuda import nvcc

    if nvcc.nvcc_path() is None:
        pytest.skip("nvcc not installed")
    try:
        sass_compare.cuobjdump_path()
    except nvcc.BuildError:
        pytest.skip("cuobjdump not installed")
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        return sass_compare.ours(list(range(len(variants.VARIANTS))), Path(tmp))


def test_every_variant_has_a_k_loop_in_the_real_kernel(loops: dict[str, object]) -> None:
    for name, loop in loops.items():
        # One or two K blocks' m64nNk32 groups (4 per 128-wide K block and partial sum): the K
        # loop, not a tile loop around it; and not implausibly long for one.
        assert loop.wgmmas in (4, 8), name
        assert loop.non_ffma_per_wgmma < 32, name


def test_default_variant_keeps_its_wgmma_descriptors_in_uniform_registers(loops: dict[str, object]) -> None:
    # Descriptors built from a run-time-aligned pointer and a warpgroup index the
    # compiler could not prove uniform cost 14.8 non-FFMA instructions per wgmma (vector 64-bit
    # arithmetic and R2UR moves before every wgmma); uniform, the default issues 11.5. A change
    # that sends them back to vector registers lands above 13.
    loop = loops[f"ours v{variants.DEFAULT}"]
    assert loop.wgmmas == 8
    assert loop.non_ffma_per_wgmma < 13
