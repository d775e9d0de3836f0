"""The tuned FP8 GEMM table and the kernels it can name, on CPU:

- the table file (ops/fp8/fp8_configs.json) validates, the dispatch reads it
  (dense per M bucket, the fused-linear flag, grouped tiles by rows per expert) and falls back to
  the heuristic for shapes it does not list; a malformed file is an error naming the field;
- the new kernels under the Triton interpreter equal the dequantised reference: split-K reduced
  in-kernel (same bits as the two-kernel reduction, counters reset), large-M tiles with ragged M,
  the fused quantise+GEMM with the reciprocal
  correction (same bits as the div_rn quantiser + GEMM), the grouped kernel with table tiles.
"""

from __future__ import annotations

import json
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pydantic
import pytest
import torch
from helpers import triton_interp

from ops.fp8 import dispatch as fl
from ops.fp8 import triton_gemm as kern

REPO = Path(__file__).resolve().parents[1]
CUDA = torch.device("cuda")  # only its type is read: table lookups never touch a GPU
CPU = torch.device("cpu")


def _table(dense: list[dict], grouped: list[dict] | None = None, buckets: list[int] | None = None) -> dict:
    return {
        "version": 1,
        "m_buckets": buckets or sorted({e["m"] for e in dense}),
        "dense": dense,
        "grouped": grouped or [],
    }


@pytest.fixture
def table_file(tmp_path: Path) -> Iterator[Path]:
    """A scratch table loaded into the module; the committed one is restored afterwards."""
    path = tmp_path / "fp8_configs.json"
    yield path
    kern.reload_table()


SPLIT_FR = {"block_m": 32, "block_n": 128, "split_k": 4, "fused_reduce": True, "num_stages": 6}
LARGE = {"block_m": 128, "block_n": 256, "group_m": 8, "num_warps": 8, "num_stages": 3}


def test_committed_table_validates_and_is_loaded() -> None:
    table = kern.load_table(kern.TABLE_PATH)
    assert table.dense and table.grouped
    assert kern.M_BUCKETS == tuple(sorted(set(table.m_buckets)))
    for e in table.dense:
        got = kern.tuned_choice(e.m, e.n, e.k)
        assert got == (e.config.gemm() if e.choice == "triton" else e.choice), e  # type: ignore[union-attr]
        assert e.source, e  # every entry says which run measured it


def test_dispatch_reads_table_and_falls_back(table_file: Path) -> None:
    dense = [
        {"m": 64, "n": 2048, "k": 7168, "choice": "triton", "config": SPLIT_FR, "linear": "fused",
         "fused_config": SPLIT_FR, "source": "test"},
        {"m": 128, "n": 2048, "k": 7168, "choice": "torch", "source": "test"},
        {"m": 4096, "n": 2048, "k": 7168, "choice": "triton", "config": LARGE, "source": "test"},
    ]  # fmt: skip
    grouped = [
        {"rows_per_expert": 8.0, "e": 32, "t": 256, "n": 4096, "k": 7168, "block_m": 16, "block_n": 256,
         "num_warps": 4, "num_stages": 5},
        {"rows_per_expert": 512.0, "e": 32, "t": 16384, "n": 4096, "k": 7168, "block_m": 128,
         "block_n": 128, "num_warps": 8, "num_stages": 3},
    ]  # fmt: skip
    table_file.write_text(json.dumps(_table(dense, grouped)))
    kern.reload_table(table_file)
    split = kern.GemmConfig(**SPLIT_FR)
    large = kern.GemmConfig(**LARGE)
    assert kern.TableConfig(**SPLIT_FR).gemm() == split  # omitted fields: GemmConfig's defaults
    # Buckets: M uses the smallest bucket >= M; above the largest, the largest.
    for m in (1, 64):
        assert fl.auto_choice(m, 2048, 7168, CUDA) == split
        assert kern.tuned_linear_fused(m, 2048, 7168) == split
    for m in (65, 128):
        assert fl.auto_choice(m, 2048, 7168, CUDA) == kern.TORCH
        assert kern.tuned_linear_fused(m, 2048, 7168) is None
        assert fl.resolve_backend("auto", m, CUDA, 2048, 7168) == "torch"
    for m in (129, 4096, 50000):
        assert fl.auto_choice(m, 2048, 7168, CUDA) == large
        assert fl.resolve_backend("auto", m, CUDA, 2048, 7168) == "triton"
    # Unseen (N, K): the heuristic up to TRITON_MAX_M, cuBLAS above; CPU never uses the table.
    # (a CPU device here: the heuristic reads the SM count of a CUDA one)
    assert fl.auto_choice(64, 3072, 7168, CPU) == kern.pick_config(64, 3072, 7168)
    assert fl.auto_choice(fl.TRITON_MAX_M + 1, 3072, 7168, CPU) == kern.TORCH
    assert kern.tuned_choice(64, 2048, 7169) is None
    assert fl.resolve_backend("auto", 64, CPU, 2048, 7168) == "reference"
    # Grouped: nearest rows-per-expert entry of the same (N, K) within 4x, else the heuristic.
    assert kern.grouped_launch(256, 32, 4096, 7168) == (16, 256, 4, 5)  # 8 rows per expert
    assert kern.grouped_launch(512, 32, 4096, 7168) == (16, 256, 4, 5)  # 16: 2x off, still nearest
    assert kern.grouped_launch(16384 * 2, 32, 4096, 7168) == (128, 128, 8, 3)
    assert kern.tuned_grouped(2048, 32, 4096, 7168) is None  # 64 per expert: 8x from both
    assert kern.grouped_launch(2048, 32, 4096, 7168) == (kern.pick_grouped_block_m(2048, 32), 128, 4, 4)
    assert kern.grouped_launch(256, 32, 7168, 2048) == (16, 128, 4, 4)  # other (N, K): heuristic
    assert kern.grouped_launch(256, 32, 4096, 7168, block_m=64) == (64, 128, 4, 4)  # explicit wins


def test_cuda_entry_runs_only_where_the_cuda_kernel_can(
    table_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    table_file.write_text(json.dumps(_table([{"m": 4096, "n": 2048, "k": 7168, "choice": "cuda"}])))
    kern.reload_table(table_file)
    assert kern.tuned_choice(5000, 2048, 7168) == kern.CUDA
    monkeypatch.setattr(fl, "cuda_kernel_usable", lambda device: True)  # a Hopper GPU
    assert fl.auto_choice(5000, 2048, 7168, CUDA) == kern.CUDA
    assert fl.resolve_backend("auto", 5000, CUDA, 2048, 7168) == "cuda"
    monkeypatch.setattr(fl, "cuda_kernel_usable", lambda device: False)  # another GPU, or no nvcc
    assert fl.auto_choice(5000, 2048, 7168, CUDA) == kern.TORCH
    assert fl.resolve_backend("auto", 5000, CUDA, 2048, 7168) == "torch"
    monkeypatch.undo()
    # CPU never, and a remembered build/launch failure turns it off before any device query.
    assert fl.resolve_backend("auto", 5000, CPU, 2048, 7168) == "reference"
    assert not fl.cuda_kernel_usable(CPU)
    monkeypatch.setattr(fl, "CUDA_FAILURE", ["nvcc not found"])
    assert not fl.cuda_kernel_usable(CUDA)
    with pytest.raises(RuntimeError, match="'cuda' needs CUDA tensors"):
        fl.resolve_backend("cuda", 5000, CPU, 2048, 7168)


def test_grouped_gemms_take_the_cuda_kernel_from_32_rows_per_expert(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fl, "cuda_kernel_usable", lambda device: True)  # a Hopper GPU
    e = 32
    assert fl.grouped_cuda_choice(fl.GROUPED_CUDA_MIN_ROWS * e, e, CUDA)
    assert not fl.grouped_cuda_choice(fl.GROUPED_CUDA_MIN_ROWS * e - 1, e, CUDA)  # decode: Triton
    monkeypatch.setattr(fl, "cuda_kernel_usable", lambda device: False)
    assert not fl.grouped_cuda_choice(1 << 20, e, CUDA)
    a = torch.zeros(64, 128, dtype=torch.float8_e4m3fn)
    w = torch.zeros(2, 256, 128, dtype=torch.float8_e4m3fn)
    with pytest.raises(RuntimeError, match="'cuda' needs CUDA tensors"):
        fl.grouped_fp8_gemm_dispatch(
            a, torch.ones(64, 1), w, torch.ones(2, 2, 1), torch.tensor([32, 64]), torch.bfloat16, "cuda"
        )


def test_empty_or_missing_table_means_heuristic(table_file: Path) -> None:
    kern.reload_table(table_file)  # does not exist
    assert kern.M_BUCKETS == () and kern.tuned_choice(64, 7168, 2048) is None
    assert fl.auto_choice(64, 7168, 2048, CPU) == kern.pick_config(64, 7168, 2048)
    assert fl.auto_choice(4096, 7168, 2048, CPU) == kern.TORCH


def test_env_var_names_another_table(table_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    table_file.write_text(json.dumps(_table([{"m": 64, "n": 256, "k": 256, "choice": "torch"}])))
    monkeypatch.setenv(kern.TABLE_ENV, str(table_file))
    kern.reload_table()
    assert kern.tuned_choice(3, 256, 256) == kern.TORCH and kern.M_BUCKETS == (64,)


@pytest.mark.parametrize(
    ("entry", "field"),
    [
        ({"m": 64, "n": 256, "k": 256, "choice": "cublas"}, "choice"),
        ({"m": 64, "n": 256, "k": 256, "choice": "triton", "config": {"block_m": 64}}, "block_n"),
        ({"m": 64, "n": 256, "k": 256, "choice": "torch", "speed": 1.0}, "speed"),
        ({"m": 0, "n": 256, "k": 256, "choice": "torch"}, "m"),
    ],
)
def test_bad_table_is_an_error_naming_the_field(table_file: Path, entry: dict, field: str) -> None:
    table_file.write_text(json.dumps(_table([entry], buckets=[64])))
    with pytest.raises(pydantic.ValidationError, match=field):
        kern.load_table(table_file)


def test_inconsistent_table_is_rejected(table_file: Path) -> None:
    table_file.write_text(
        json.dumps(_table([{"m": 64, "n": 256, "k": 256, "choice": "torch"}], buckets=[128]))
    )
    with pytest.raises(ValueError, match="m_buckets"):
        kern.load_table(table_file)
    table_file.write_text(json.dumps(_table([{"m": 64, "n": 256, "k": 256, "choice": "triton"}])))
    with pytest.raises(ValueError, match="without a config"):
        kern.load_table(table_file)
    with pytest.raises(ValueError, match="block_m"):
        kern.GemmConfig(block_m=48)
    with pytest.raises(ValueError, match="lag"):  # candidate-only options are not table fields
        kern.TableConfig(block_m=128, block_n=128, lag=True)


KERNEL_CHECK = textwrap.dedent(
    """
    import dataclasses, json, torch
    from ops.fp8.recipe import quantize_act, quantize_weight, fp8_gemm_reference, grouped_fp8_gemm
    from ops.fp8 import triton_gemm as kern
    from ops.fp8.triton_gemm import GemmConfig
    g = torch.Generator().manual_seed(0)
    res = {"dense": [], "fused": [], "grouped": None}
    cases = [((70, 200, 1100), GemmConfig(16, 64, 3, 1, 4, 2, fused_reduce=True)),
             ((64, 256, 1024), GemmConfig(64, 128, 4, 1, 4, 3, fused_reduce=True)),
             ((130, 272, 640), GemmConfig(128, 128, 1, 8, 8, 3)),
             ((300, 256, 512), GemmConfig(128, 256, 1, 8, 8, 3))]
    for (m, n, k), cfg in cases:
        x, w = torch.randn(m, k, generator=g) * 3, torch.randn(n, k, generator=g)
        aq, as_ = quantize_act(x); wq, ws = quantize_weight(w)
        want = fp8_gemm_reference(aq, as_, wq, ws)
        got = kern.triton_fp8_gemm(aq, as_, wq, ws, torch.float32, cfg)
        case = {"cfg": cfg.name(), "err": ((got - want).norm() / want.norm()).item()}
        if cfg.fused_reduce:
            again = kern.triton_fp8_gemm(aq, as_, wq, ws, torch.float32, cfg)
            two = kern.triton_fp8_gemm(aq, as_, wq, ws, torch.float32, dataclasses.replace(cfg, fused_reduce=False))
            case["repeat_equal"] = bool(torch.equal(got, again))
            case["two_kernel_equal"] = bool(torch.equal(got, two))
            case["counters_zero"] = all(int(c.abs().sum()) == 0 for c in kern._COUNTERS.values())
        res["dense"].append(case)
    for (m, n, k), cfg, pow2, dt in [((5, 200, 300), GemmConfig(16, 64, 2, 1, 4, 2, fused_reduce=True), False, torch.float32),
                                     ((37, 130, 1100), GemmConfig(64, 128, 3, 1, 4, 2), True, torch.float32),
                                     ((40, 256, 640), GemmConfig(32, 256, 1, 1, 8, 3), False, torch.bfloat16)]:
        # wide dynamic range within each 128-block: many quotients far below the block max
        x = (torch.randn(m, k, generator=g) * torch.exp(3 * torch.randn(m, k, generator=g))).to(dt)
        wq, ws = quantize_weight(torch.randn(n, k, generator=g))
        q, s = kern.triton_quantize_act(x, pow2)
        two = kern.triton_fp8_gemm(q, s, wq, ws, torch.float32, cfg)
        fused = kern.triton_fp8_linear_fused(x, wq, ws, torch.float32, cfg, pow2)
        res["fused"].append(bool(torch.equal(two, fused)))
    sizes = [10, 0, 25, 3]; t, n, k = sum(sizes), 160, 300
    x, w = torch.randn(t, k, generator=g), torch.randn(len(sizes), n, k, generator=g)
    aq, as_ = quantize_act(x); qs = [quantize_weight(w[e]) for e in range(len(sizes))]
    wq = torch.stack([q for q, _ in qs]); ws = torch.stack([s for _, s in qs])
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    want = grouped_fp8_gemm(aq, as_, wq, ws, offs, torch.float32, backend="reference")
    got = kern.triton_grouped_fp8_gemm(aq, as_, wq, ws, offs, torch.float32, 16, 256, 4, 5)
    res["grouped"] = ((got - want).abs().max() / want.abs().max()).item()
    print(json.dumps(res))
    """
)


@pytest.mark.slow  # the Triton interpreter runs every program in Python (~30-60 s)
def test_new_kernels_match_reference_under_interpreter() -> None:
    res = triton_interp.run_script_interpreted(KERNEL_CHECK, timeout_s=900)
    assert len(res["dense"]) == 4
    for case in res["dense"]:
        assert case["err"] < 1e-5, case  # fp32 output: summation order only
        if "_fr" in case["cfg"]:
            # in-kernel reduction: deterministic, the two-kernel path's bits, counters left at 0
            assert case["repeat_equal"] and case["two_kernel_equal"] and case["counters_zero"], case
    # reciprocal + Markstein correction == the IEEE quotient of the div_rn quantiser, bit for bit
    assert res["fused"] == [True, True, True]
    assert res["grouped"] < 1e-5
