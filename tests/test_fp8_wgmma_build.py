"""The CUDA FP8 GEMM (ops/fp8/cuda/fp8_wgmma.cu) still builds, and its variant table
is what the Python side expects. Its numerics and speed are checked on the GPU by bench/fp8/wgmma.py; here
there is no GPU, so this covers what can rot without one: the nvcc build (sm_90a wgmma, TMA,
setmaxnreg), the exported symbols, the shared-memory budget of every variant, and argument checks."""

from __future__ import annotations

import ctypes

import pytest
import torch

from ops.fp8.cuda import fp8_wgmma, nvcc

H100_MAX_DYNAMIC_SMEM = 227 * 1024


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    if nvcc.nvcc_path() is None:
        pytest.skip("nvcc not installed")
    path = fp8_wgmma.build(tmp_path_factory.mktemp("wgmma") / "lib.so")
    return fp8_wgmma.load(path)


def test_the_table_holds_the_dense_and_the_grouped_gemm(built: ctypes.CDLL) -> None:
    table = fp8_wgmma.describe(built)
    assert len(table) == 2
    assert not table[fp8_wgmma.DENSE].grouped and table[fp8_wgmma.GROUPED].grouped
    assert table[fp8_wgmma.DENSE].name == "n256s4_tma_ovl_c2"
    assert table[fp8_wgmma.GROUPED].name == "n256s4_tma_ovl_grouped_c1"  # no clusters across experts
    out = (ctypes.c_int * 4)()
    assert built.relay_fp8_gemm_describe(len(table), out) == -10


def test_every_variant_fits_hopper_shared_memory(built: ctypes.CDLL) -> None:
    table = fp8_wgmma.describe(built)
    bm = fp8_wgmma.BLOCK
    for i, v in enumerate(table):
        got = built.relay_fp8_gemm_smem_bytes(i)
        # The stages of A (bm rows), B, the A and B scales, their barriers, the alignment slack.
        # Grouped variants: the per-expert tile and row tables too, and 4 more activation scales
        # per stage (rounded up to a 128-byte TMA destination).
        tables = 2 * (fp8_wgmma.MAX_GROUPS + 1) * 4 if v.grouped else 0
        sa = -(-(bm + 4) * 4 // 128) * 128 if v.grouped else bm * 4
        want = 1024 + v.stages * (bm * 128 + v.bn * 128 + sa + 128) + 2 * v.stages * 8 + tables
        assert got == want, (i, got, want)
        assert got <= H100_MAX_DYNAMIC_SMEM
    assert built.relay_fp8_gemm_smem_bytes(len(table)) == -1


def test_unknown_variant_is_refused_before_any_cuda_call(built: ctypes.CDLL) -> None:
    fn = built.relay_fp8_gemm
    fn.restype = ctypes.c_int
    args = [None, None, 4, None, None, 4, None, 4, 128, 128, 128, 132]
    assert fn(*args, len(fp8_wgmma.describe(built)), None) == -10
    assert fn(*args, -1, None) == -10


def test_python_side_names_what_it_cannot_run() -> None:
    a = torch.zeros(4, 128, dtype=torch.float8_e4m3fn)
    w = torch.zeros(256, 128, dtype=torch.float8_e4m3fn)
    assert fp8_wgmma.unsupported_reason(a, w) == "needs CUDA tensors"
    with pytest.raises(fp8_wgmma.WgmmaUnsupported, match="needs CUDA tensors"):
        fp8_wgmma.fp8_gemm(a, torch.ones(4, 1), w, torch.ones(2, 1))


@pytest.mark.parametrize(
    ("m", "kb", "col"), [(1, 1, False), (5, 1, True), (77, 16, True), (77, 16, False), (64, 3, True)]
)
def test_scales_reach_the_kernel_k_block_major_with_16_byte_rows(m: int, kb: int, col: bool) -> None:
    # The GPU self-check once failed here at M = 1: a (4, 1) tensor counts as column-major with
    # row pitch 1, which the tensor-map encoder refuses.
    a_scale = torch.rand(m, kb)
    if col:
        a_scale = a_scale.t().contiguous().t()
    s, pitch = fp8_wgmma._k_block_major(a_scale)
    assert pitch % 4 == 0 and pitch >= m and s.stride(0) == 1
    rows = torch.as_strided(s, (kb, m), (pitch, 1))  # what the kernel reads: row kb at kb * pitch
    assert torch.equal(rows, a_scale.t())
    if col and m % 4 == 0 and kb > 1:
        assert s.data_ptr() == a_scale.data_ptr()  # the Triton quantiser's layout: no copy


def test_dense_and_grouped_entry_points_refuse_each_others_variants(built: ctypes.CDLL) -> None:
    dense = built.relay_fp8_gemm
    dense.restype = ctypes.c_int
    grouped = built.relay_fp8_grouped_gemm
    grouped.restype = ctypes.c_int
    g = fp8_wgmma.GROUPED
    args = [None, None, 4, None, None, 4, None, 4, 128, 128, 128, 132]
    assert dense(*args, g, None) == -10  # a grouped variant through the dense entry
    gargs = [None, None, 4, None, None, 4, None, None, 1, 4, 128, 128, 128, 132]
    assert grouped(*gargs, fp8_wgmma.DENSE, None) == -10
    assert grouped(*gargs, g, None) == -11  # no offsets: refused before any CUDA call


def test_grouped_weight_scales_are_k_block_major_with_each_expert_padded_to_4_blocks() -> None:
    e, nb, kb = 3, 5, 7
    w_scale = torch.rand(e, nb, kb)
    s, pitch = fp8_wgmma.grouped_weight_scales(w_scale)
    nbp = 8
    assert pitch == e * nbp and pitch % 4 == 0 and tuple(s.shape) == (kb, e * nbp)
    for g in range(e):
        # the kernel's box for expert g starts at column g * nbp (a multiple of 4: 16-byte aligned)
        assert torch.equal(s[:, g * nbp : g * nbp + nb], w_scale[g].t())
        assert not s[:, g * nbp + nb : (g + 1) * nbp].any()


def test_grouped_python_side_names_what_it_cannot_run() -> None:
    a = torch.zeros(4, 128, dtype=torch.float8_e4m3fn)
    w = torch.zeros(2, 256, 128, dtype=torch.float8_e4m3fn)
    offs = torch.tensor([1, 4], dtype=torch.int32)
    assert fp8_wgmma.grouped_unsupported_reason(a, w, offs) == "needs CUDA tensors"
    assert "(E, N, K)" in str(fp8_wgmma.grouped_unsupported_reason(a, w[0], offs))
    with pytest.raises(fp8_wgmma.WgmmaUnsupported, match="needs CUDA tensors"):
        fp8_wgmma.fp8_grouped_gemm(a, torch.ones(4, 1), w, torch.ones(2, 2, 1), offs)


def test_a_call_the_kernel_does_not_take_is_not_a_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    """ "auto" hands the kernel a call it does not take (here: CPU tensors): cuBLAS serves it (None)
    and the kernel stays usable, where a build or launch failure is remembered."""
    from ops.fp8 import dispatch as fl

    monkeypatch.setattr(fl, "CUDA_FAILURE", [])
    a = torch.zeros(4, 128, dtype=torch.float8_e4m3fn)
    w = torch.zeros(256, 128, dtype=torch.float8_e4m3fn)
    assert fl._cuda_gemm(a, torch.ones(4, 1), w, torch.ones(2, 1), torch.bfloat16) is None
    assert fl.CUDA_FAILURE == []


def test_a_failed_build_is_an_error_the_engine_remembers(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pytest.TempPathFactory
) -> None:
    # No nvcc and nothing cached: the library cannot be had. The engine's load-time preparation
    # records that once, after which "auto" never picks the kernel (it would only fail again).
    from ops.fp8 import dispatch as fl

    assert not fl.prepare_cuda_kernel(torch.device("cpu"))  # nothing to prepare off the GPU
    monkeypatch.setenv("RELAY_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(nvcc, "nvcc_path", lambda: None)
    monkeypatch.setattr(fl, "CUDA_FAILURE", [])
    monkeypatch.setattr(fl, "cuda_kernel_usable", lambda device: not fl.CUDA_FAILURE)  # a Hopper GPU
    fp8_wgmma.library.cache_clear()
    try:
        with pytest.raises(fp8_wgmma.WgmmaError, match="nvcc not found"):
            fp8_wgmma.library()
        cuda = torch.device("cuda")
        assert not fl.prepare_cuda_kernel(cuda)
        assert fl.CUDA_FAILURE and "nvcc not found" in fl.CUDA_FAILURE[0]
        assert not fl.cuda_kernel_usable(cuda) and not fl.grouped_cuda_choice(1 << 20, 8, cuda)
    finally:
        fp8_wgmma.library.cache_clear()


def test_the_product_build_is_not_serialised_by_ptxas(built: ctypes.CDLL) -> None:
    """ptxas serialising a kernel's wgmmas (e.g. for want of registers once a loop is unrolled)
    undoes the overlap the kernel is built around; its build log would say so."""
    from pathlib import Path

    path = Path(built._name)
    log = nvcc.log_path(path)
    assert log.exists()  # nvcc.build keeps what nvcc printed next to the library
    assert not fp8_wgmma.serialised(path), [ln for ln in log.read_text().splitlines() if "C751" in ln]


def test_serialised_reads_ptxas_performance_warnings(tmp_path: pytest.TempPathFactory) -> None:
    from pathlib import Path

    lib = Path(str(tmp_path)) / "lib.so"
    assert not fp8_wgmma.serialised(lib)  # no log: nothing known against it
    warn = "ptxas info    : ({code}) {what} in the function '_Z15fp8_gemm_kernelILi256ELi4ELi28ELi2EEEv'\n"
    nvcc.log_path(lib).write_text(warn.format(code="C7517", what="warpgroup.wait is injected"))
    assert not fp8_wgmma.serialised(lib)  # an injected wait is not serialisation
    for code in ("C7511", "C7515", "C7518"):
        nvcc.log_path(lib).write_text(
            warn.format(code=code, what="wgmma.mma_async instructions are serialized")
        )
        assert fp8_wgmma.serialised(lib), code
