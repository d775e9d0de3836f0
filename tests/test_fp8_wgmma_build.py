"""The CUDA FP8 GEMM (services/engine/kernels/cuda/fp8_wgmma.cu) still builds, and its variant table
agrees with the Python side. Its numerics and speed are checked on the GPU by bench/fp8/wgmma.py; here
there is no GPU, so this covers what can rot without one: the nvcc build (sm_90a wgmma, TMA,
setmaxnreg), the exported symbols, the shared-memory budget of every variant, and argument checks."""

from __future__ import annotations

import ctypes

import pytest
import torch

from services.engine.kernels.cuda import fp8_wgmma, nvcc

H100_MAX_DYNAMIC_SMEM = 227 * 1024


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    if nvcc.nvcc_path() is None:
        pytest.skip("nvcc not installed")
    path = fp8_wgmma.build(tmp_path_factory.mktemp("wgmma") / "lib.so")
    return ctypes.CDLL(str(path))


def test_every_variant_fits_hopper_shared_memory(built: ctypes.CDLL) -> None:
    built.relay_fp8_gemm_smem_bytes.restype = ctypes.c_int
    for i, (bn, stages, _mode, _cluster) in enumerate(fp8_wgmma.VARIANTS):
        got = built.relay_fp8_gemm_smem_bytes(i)
        bm = fp8_wgmma.tile_rows(i)
        # The stages of A (bm rows), B, the A and B scales, their barriers, the alignment slack.
        # Grouped variants: the per-expert tile and row tables too, and 4 more activation scales
        # per stage (rounded up to a 128-byte TMA destination).
        grouped = fp8_wgmma.is_grouped(i)
        tables = 2 * (fp8_wgmma.MAX_GROUPS + 1) * 4 if grouped else 0
        sa = -(-(bm + 4) * 4 // 128) * 128 if grouped else bm * 4
        want = 1024 + stages * (bm * 128 + bn * 128 + sa + 128) + 2 * stages * 8 + tables
        assert got == want, (i, got, want)
        assert got <= H100_MAX_DYNAMIC_SMEM
    assert built.relay_fp8_gemm_smem_bytes(len(fp8_wgmma.VARIANTS)) == -1


def test_unknown_variant_is_refused_before_any_cuda_call(built: ctypes.CDLL) -> None:
    fn = built.relay_fp8_gemm
    fn.restype = ctypes.c_int
    args = [None, None, 4, None, None, 4, None, 4, 128, 128, 128, 132]
    assert fn(*args, len(fp8_wgmma.VARIANTS), None) == -10
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
    g = fp8_wgmma.DEFAULT_GROUPED_VARIANT
    assert fp8_wgmma.is_grouped(g) and not fp8_wgmma.is_grouped(fp8_wgmma.DEFAULT_VARIANT)
    args = [None, None, 4, None, None, 4, None, 4, 128, 128, 128, 132]
    assert dense(*args, g, None) == -10  # a grouped variant through the dense entry
    gargs = [None, None, 4, None, None, 4, None, None, 1, 4, 128, 128, 128, 132]
    assert grouped(*gargs, fp8_wgmma.DEFAULT_VARIANT, None) == -10
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
    from services.engine import fp8_linear as fl

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
    from services.engine import fp8_linear as fl

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


@pytest.fixture(scope="module")
def built_fixed(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    if nvcc.nvcc_path() is None:
        pytest.skip("nvcc not installed")
    path = fp8_wgmma.build(tmp_path_factory.mktemp("wgmma_fixed") / "lib.so", shape=(384, 256), unroll=8)
    return ctypes.CDLL(str(path))


def test_a_fixed_shape_library_holds_the_overlap_variants_for_its_shape_alone(
    built_fixed: ctypes.CDLL,
) -> None:
    """Built for (N, K) = (384, 256): only the dense OVERLAP variants are in it (the others answer
    -10 as unknown ones do), and a call of another shape is refused (-13) before any CUDA call."""
    built_fixed.relay_fp8_gemm_smem_bytes.restype = ctypes.c_int
    fn = built_fixed.relay_fp8_gemm
    fn.restype = ctypes.c_int
    in_fixed = [
        i
        for i, (_bn, _st, mode, _cl) in enumerate(fp8_wgmma.VARIANTS)
        if "ovl" in fp8_wgmma.mode_parts(mode)[1] and not fp8_wgmma.is_grouped(i)
    ]
    assert fp8_wgmma.DEFAULT_VARIANT in in_fixed
    for i in range(len(fp8_wgmma.VARIANTS)):
        assert (built_fixed.relay_fp8_gemm_smem_bytes(i) > 0) == (i in in_fixed), i
    other = [None, None, 4, None, None, 4, None, 4, 384, 128, 384, 132]  # K = 128, not 256
    assert fn(*other, fp8_wgmma.DEFAULT_VARIANT, None) == -13
    other[8], other[9] = 256, 256  # N = 256, not 384
    assert fn(*other, fp8_wgmma.DEFAULT_VARIANT, None) == -13
    not_in = next(i for i in range(len(fp8_wgmma.VARIANTS)) if i not in in_fixed)
    assert fn(*[None, None, 4, None, None, 4, None, 4, 384, 256, 384, 132], not_in, None) == -10


def test_fixed_shape_builds_only_for_shapes_the_kernel_takes() -> None:
    assert fp8_wgmma.shape_flags((7168, 2048), 8) == (
        "-DRELAY_SHAPE_N=7168",
        "-DRELAY_SHAPE_K=2048",
        "-DRELAY_K_UNROLL=8",
    )
    for bad in ((7167, 2048), (7168, 2000), (0, 128)):
        assert not fp8_wgmma.fixed_shape_ok(bad)
        with pytest.raises(ValueError, match="no fixed-shape build"):
            fp8_wgmma.shape_flags(bad, 8)
    with pytest.raises(ValueError, match="no fixed-shape build"):
        fp8_wgmma.shape_flags((7168, 2048), 0)
    # Each shape and unroll its own cache entry, apart from the generic library's.
    paths = {
        fp8_wgmma.library_path(),
        fp8_wgmma.library_path((7168, 2048)),
        fp8_wgmma.library_path((2048, 7168)),
        fp8_wgmma.library_path((2048, 7168), 1),
    }
    assert len(paths) == 4


def test_a_build_ptxas_serialised_is_passed_over_for_a_smaller_unroll(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pytest.TempPathFactory
) -> None:
    """Unrolled by 8, K = 1024's loop unrolls whole and ptxas serialises its wgmmas for want of
    registers (C7511); the build log says so, and build_fixed takes the next unroll (4), whose
    build ptxas leaves asynchronous. K = 2048 keeps DeepGEMM's 8."""
    if nvcc.nvcc_path() is None:
        pytest.skip("nvcc not installed")
    monkeypatch.setenv("RELAY_KERNEL_CACHE", str(tmp_path))
    assert fp8_wgmma.build_fixed((256, 1024)) == 4
    assert fp8_wgmma.serialised(fp8_wgmma.library_path((256, 1024), 8))
    assert not fp8_wgmma.serialised(fp8_wgmma.library_path((256, 1024), 4))
    assert not fp8_wgmma.library_path((256, 1024), 1).exists()  # never needed
    assert fp8_wgmma.build_fixed((256, 2048)) == 8


def test_gemm_runs_a_prepared_shape_from_its_fixed_library(monkeypatch: pytest.MonkeyPatch) -> None:
    """fp8_gemm's library choice (the launch itself needs a GPU: bench/fp8/deepgemm.py --fixed checks
    the numbers there): a shape prepare_shapes made ready runs from its own library unless told
    otherwise, every other shape from the generic one; a variant not in a fixed library is refused."""
    launched: list[object] = []
    monkeypatch.setattr(fp8_wgmma, "unsupported_reason", lambda a, w: None)
    real_unroll = fp8_wgmma._unroll
    monkeypatch.setattr(
        fp8_wgmma,
        "library",
        lambda shape=None, unroll=None: (shape, real_unroll(shape, unroll)) if shape else unroll,
    )
    monkeypatch.setattr(fp8_wgmma, "_launch", lambda *args, lib=None: launched.append(lib))
    monkeypatch.setattr(fp8_wgmma, "READY_SHAPES", {(256, 128): 4})

    def gemm(n: int, **kw: object) -> None:
        a = torch.zeros(4, 128, dtype=torch.float8_e4m3fn)
        w = torch.zeros(n, 128, dtype=torch.float8_e4m3fn)
        fp8_wgmma.fp8_gemm(a, torch.ones(4, 1), w, torch.ones(n // 128, 1), **kw)  # type: ignore[arg-type]

    gemm(256)  # prepared, with the unroll prepare_shapes chose
    gemm(384)
    gemm(256, fixed_shape=False)
    gemm(384, fixed_shape=True)  # not prepared: DeepGEMM's unroll
    gemm(256, fixed_shape=True, unroll=1)
    gemm(256, variant=17)  # no OVERLAP: the generic library, ready shape or not
    gemm(384, unroll=4)  # the generic library unrolled 4x
    assert launched == [((256, 128), 4), None, None, ((384, 128), 8), ((256, 128), 1), None, 4]
    with pytest.raises(ValueError, match="not in a fixed-shape library"):
        gemm(256, variant=17, fixed_shape=True)


def test_a_failed_shape_build_leaves_the_generic_kernel_in_use(monkeypatch: pytest.MonkeyPatch) -> None:
    from services.engine import fp8_linear as fl

    monkeypatch.setattr(fl, "CUDA_FAILURE", [])
    monkeypatch.setattr(fl, "cuda_kernel_usable", lambda device: not fl.CUDA_FAILURE)  # a Hopper GPU
    monkeypatch.setattr(fp8_wgmma, "library", lambda shape=None: None)  # the generic one is there
    asked: list[list[tuple[int, int]]] = []

    def fail(shapes: list[tuple[int, int]]) -> list[tuple[int, int]]:
        asked.append(shapes)
        raise fp8_wgmma.WgmmaError("nvcc failed (2)")

    monkeypatch.setattr(fp8_wgmma, "prepare_shapes", fail)
    assert fl.prepare_cuda_kernel(torch.device("cuda"), [(7168, 2048), (4096, 7168), (7168, 2048)])
    assert asked == [[(4096, 7168), (7168, 2048)]] and fl.CUDA_FAILURE == []
