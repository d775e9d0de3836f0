"""FP8 in the multi-rank engine, CPU (the FP8 reference GEMMs), 2 gloo ranks against the
single-rank FP8 engine (quantization = "fp8", float32 activations): the same requests through the
same steps (forks, seeded and greedy sampling, preemption, prefix-cache hits) give the same tokens,
routed expert ids and log-probs. Each run starts from one kind of weights directory and updates
mid-generation to the other: an FP8 checkpoint (each rank copies its slices' E4M3 bits and
128x128 scales) and a float32 one (each rank quantises its slices at load). Qwen3 at TP 2,
Qwen3-MoE at EP 2 (its FP8 experts split over the ranks, attention at TP 2) and at TP 2 (every
expert's width split), GLM-5 at EP 2 with TP 2 attention and in its own layout, EP 2 x
data-parallel attention 2; Nemotron-H at TP 2 x EP 2 (a rank's Mamba-2 in_proj rows: its part
of z, x, B, C, dt, the dt rows half of a tile whose scale the rank takes) and EP 2 x
data-parallel attention 2. A cut that does not fall on the 128x128 tiles is refused, naming the
tensor (a Mamba-2 in_proj's on the config alone, at start).

Tolerance: 1e-5, as for the bf16/float32 multi-rank engine (tests/test_parallel_engine.py): the
largest difference measured here is ~1e-6. The shapes give each rank one 128-column tile of every
row-parallel input (o_proj, down_proj): the CPU reference GEMM sums its K tiles in order, so one
tile a rank makes the all-reduce's sum the single-rank GEMM's sum. With several tiles a rank the
all-reduce adds them in another order (a float32 last-bit difference), and an activation's 1x128
FP8 quantisation downstream can turn that into one E4M3 step of an element: on a tiny model with
4 tiles (2 a rank) in o_proj the tokens and expert ids stayed equal but log-probs moved by up to
3e-2 (docs/parallel.md, FP8).

`make test` runs Qwen3-MoE at EP 2 (FP8 experts over the ranks and attention at TP 2); the other
layouts are `full`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from helpers.debug_weights import random_model_dir
from helpers.fp8_dirs import fp8_model_dir
from helpers.moe import small_nemotron
from helpers.parallel import TINY, run_ranks
from test_parallel_engine import MLA, drive, engine_cfg, same_choices, weights
from torch import nn

from ops.fp8.checkpoint import is_fp8_weight
from services.common.config import EngineConfig, ModelConfig, ParallelConfig
from services.common.weights_dir import SCALE_SUFFIX
from services.common.weights_slice import SliceSpec
from services.engine import LLMEngine
from services.engine.layers.fp8 import Fp8Linear
from services.engine.loader import WeightsError, read_checkpoint
from services.engine.parallel.engine import ParallelEngine
from services.engine.parallel.fp8 import mamba_in_proj_pairs
from services.engine.parallel.group import init_engine_groups
from services.engine.parallel.model import mamba_runs
from services.engine.parallel.runner import check_engine, run_worker

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="gloo process groups run on Linux")

TOL = 1e-5
# Every tensor-parallel cut on a 128 boundary: 2 heads of 128 (q/k/v rows and o_proj columns 128
# per rank), an FFN of 256, experts of width 128 (256 where tp splits them).
ATTN = dict(TINY, dim=64, n_heads=2, n_kv_heads=2, head_dim=128, hidden_dim=256, max_seq_len=64)
MOE = dict(
    ATTN,
    arch="qwen3_moe",
    n_routed_experts=4,
    n_experts_per_tok=2,
    moe_hidden_dim=128,
    first_k_dense=1,
    tie_embeddings=False,
)
# MLA heads of 64 + 64 (q_b_proj rows 128 a head, kv_b_proj 128 with v_head_dim 64), 4 heads:
# 2 a rank, o_proj's 128 columns a rank.
GLM5 = dict(
    MLA,
    dim=64,
    hidden_dim=256,
    n_heads=4,
    head_dim=128,
    qk_nope_head_dim=64,
    qk_rope_head_dim=64,
    v_head_dim=64,
    n_routed_experts=4,
    moe_hidden_dim=256,  # the shared expert's too: tp splits it
    arch="glm_moe_dsa",
    index_topk=8,
    index_n_heads=4,
    index_head_dim=16,
)
# Nemotron-H with every Mamba-2 in_proj run a rank holds on the 128-row tiles: z, x of 4 heads of
# 64 (128 rows a rank), B, C of 2 groups of 128 (128 a rank), then each rank's 2 dt rows inside
# the one tile of the 4 (its scale that whole tile's); attention, MLP and shared expert as above.
NEMOTRON = small_nemotron(
    dim=64,
    n_heads=2,
    n_kv_heads=2,
    head_dim=128,
    hidden_dim=256,
    mamba_n_heads=4,
    mamba_head_dim=64,
    ssm_state_size=128,
    moe_hidden_dim=128,
    shared_expert_hidden_dim=256,
)
# name: (model, parallel layout, which weights come first: "fp8" checkpoint or float32 "hp")
MODELS = {
    "qwen3-tp2": (ModelConfig(**ATTN), ParallelConfig(tp=2), "fp8"),
    "moe-ep2": (ModelConfig(**MOE), ParallelConfig(tp=2, ep=2), "hp"),
    "moe-tp2": (ModelConfig(**MOE | {"moe_hidden_dim": 256}), ParallelConfig(tp=2), "fp8"),
    "glm5-ep2": (ModelConfig(**GLM5), ParallelConfig(tp=2, ep=2), "fp8"),
    # GLM-5's own layout: data-parallel attention (tp 1), the FP8 experts over the ranks.
    "glm5-dp2": (ModelConfig(**GLM5), ParallelConfig(dp_attention=2, ep=2), "fp8"),
    "nemotron-ep2": (NEMOTRON, ParallelConfig(tp=2, ep=2), "hp"),
    "nemotron-dp2": (NEMOTRON, ParallelConfig(dp_attention=2, ep=2), "fp8"),
}


def fp8_cfg(par: ParallelConfig) -> EngineConfig:
    return engine_cfg(par).model_copy(update={"quantization": "fp8"})


def worker(rank: int, init: str, name: str, dirs: list[str], out_dir: str) -> None:
    m, par, _ = MODELS[name]
    groups = init_engine_groups(par, rank, init, "gloo", timeout_s=60)
    cfg = fp8_cfg(par)
    if rank != 0:
        run_worker(cfg, par, groups)
        return
    eng = ParallelEngine(dirs[0], cfg, par, groups, check_orders=True)
    got = drive(eng, m.is_moe, dirs[1])
    eng.close()
    want = drive(LLMEngine(dirs[0], cfg), m.is_moe, dirs[1])
    Path(out_dir, f"{name}.json").write_text(json.dumps({"got": got, "want": want}))


def weight_dirs(m: ModelConfig, root: Path, first: str) -> list[str]:
    """Versions 0 and 1: one an FP8 checkpoint, the other float32 (`first` says which is 0)."""
    out = []
    for v, kind in enumerate([first, "hp" if first == "fp8" else "fp8"]):
        if m.is_hybrid:  # decisive routing (test_parallel_engine.weights)
            hp = weights(m, root / f"hp_{v}", v)
        else:
            hp = random_model_dir(m, root / f"hp_{v}", seed=3 + v, version=v, std=0.2)
        out.append(str(hp if kind == "hp" else fp8_model_dir(hp, m, root / f"fp8_{v}", version=v)[0]))
    return out


@pytest.mark.parametrize(
    "name",
    [
        "qwen3-tp2",
        "moe-ep2",
        pytest.param("moe-tp2", marks=pytest.mark.full),
        pytest.param("glm5-ep2", marks=pytest.mark.full),
        pytest.param("glm5-dp2", marks=pytest.mark.full),
        pytest.param("nemotron-ep2", marks=pytest.mark.full),
        pytest.param("nemotron-dp2", marks=pytest.mark.full),
    ],
)
def test_fp8_multi_rank_engine_generates_what_one_fp8_rank_does(name: str, tmp_path: Path) -> None:
    m, par, first = MODELS[name]
    dirs = weight_dirs(m, tmp_path, first)
    assert read_checkpoint(dirs[first == "hp"]).fp8  # one of the two really is an FP8 checkpoint
    run_ranks(worker, par.ranks, tmp_path, name, dirs, str(tmp_path))
    r = json.loads((tmp_path / f"{name}.json").read_text())
    got, want = r["got"], r["want"]
    if m.is_hybrid:  # no prefix cache: test_parallel_engine's checks
        preempted = got["preemptions"] == want["preemptions"]
        assert preempted and (want["preemptions"] > 0) == (par.dp_attention == 1)
        same_choices(got, want, m)
        assert {0, 1} <= set(got["r1-a"][0]["versions"])
        return
    if par.dp_attention > 1:  # pools big enough that nobody is preempted (test_parallel_engine.py)
        assert got["preemptions"] == want["preemptions"] == 0
    else:
        assert got["preemptions"] == want["preemptions"] > 0
        assert got["prefix_hits"] == want["prefix_hits"] > 0
    worst = 0.0
    assert got["r3_hits"] == want["r3_hits"] == 8
    for rid in [f"{rnd}-{x}" for rnd in ("r1", "r2") for x in "abc"] + ["r3-a"]:
        for g, w in zip(got[rid], want[rid], strict=True):
            assert g["output_ids"] == w["output_ids"], rid
            assert g["versions"] == w["versions"] and g["finish_reason"] == w["finish_reason"], rid
            worst = max(worst, *(abs(a - b) for a, b in zip(g["logprobs"], w["logprobs"], strict=True)))
            for tg, tw in zip(g["top_logprobs"] or [], w["top_logprobs"] or [], strict=True):
                assert [t for t, _ in tg] == [t for t, _ in tw], rid
                worst = max(worst, *(abs(a[1] - b[1]) for a, b in zip(tg, tw, strict=True)))
            assert (g["routed_experts"] is not None) == m.is_moe
            assert g["routed_experts"] == w["routed_experts"], rid
    assert worst <= TOL, worst
    assert {0, 1} <= set(got["r1-a"][0]["versions"])  # the update landed mid-generation
    assert got["r1-a"][0]["output_ids"] != got["r1-a"][1]["output_ids"]  # the fork really samples


def test_a_cut_off_the_fp8_tiles_is_refused_naming_the_tensor(tmp_path: Path) -> None:
    """TINY's 4 heads of 8: tp 2 cuts q_proj's 32 rows at 16. An FP8 checkpoint's scales cannot
    follow that cut, and an FP8 engine would quantise other tiles than one rank does: both are
    refused when the rank reads its slices (a weight update too), naming the tensor."""
    m = ModelConfig(**TINY, max_seq_len=64, n_kv_heads=2)
    hp = random_model_dir(m, tmp_path / "hp")
    fp8, _ = fp8_model_dir(hp, m, tmp_path / "fp8")
    spec = SliceSpec(tp_rank=1, tp_size=2, kv_heads=2)
    cut = r"model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj\.weight: tp_size 2 cuts dim [01] \(size \d+\)"
    with pytest.raises(WeightsError, match=cut):
        read_checkpoint(fp8, spec)
    with pytest.raises(WeightsError, match=cut):
        read_checkpoint(hp, spec, tiled=is_fp8_weight)
    assert read_checkpoint(hp, spec).state  # a bf16/float32 engine may cut anywhere


def test_a_mamba_in_proj_off_the_fp8_tiles_is_refused_at_start() -> None:
    """4 heads of 48: a rank's z rows (96) and the first 32 of its x rows make its first tile, from
    two tiles of the whole in_proj: an FP8 engine is refused on the config alone, naming the key
    and the tensor; the tile-aligned one starts."""
    cfg = fp8_cfg(ParallelConfig(tp=2))
    with pytest.raises(
        ValueError, match=r"parallel\.tp: quantization fp8: backbone\.layers\.0\.mixer\.in_proj"
    ):
        check_engine(cfg, small_nemotron(mamba_head_dim=48), ParallelConfig(tp=2))
    check_engine(cfg, NEMOTRON, ParallelConfig(tp=2, ep=2))


def test_a_ranks_mamba_in_proj_tiles_are_the_single_rank_ones(tmp_path: Path) -> None:
    """Each rank's FP8 in_proj equals the single-rank engine's rows and tiles: from an FP8
    checkpoint (its rows' bits, the scales of the tiles they lie in) and from a float32 one
    (parallel/fp8.mamba_in_proj_pairs quantises the whole tiles), and the dt tile a rank holds
    part of has another scale than its own rows alone would get."""
    m = NEMOTRON
    hp = weights(m, tmp_path / "hp", 0)
    fp8, _ = fp8_model_dir(hp, m, tmp_path / "fp8")
    name = "backbone.layers.0.mixer.in_proj.weight"
    scale = name + SCALE_SUFFIX
    whole = read_checkpoint(fp8).state
    full = read_checkpoint(hp).state[name]
    differs = []
    for rank in range(2):
        spec = SliceSpec(rank, 2, rank, 2, kv_heads=m.n_kv_heads, mamba=mamba_runs(m))  # tp 2, ep 2
        runs = spec.mamba_rows(name)
        assert runs is not None
        rows = torch.cat([torch.arange(a, b) for a, b in runs])
        tiles = spec.mamba_tiles(name, whole[name].shape[0], 128)
        want_q, want_s = whole[name][rows].view(torch.uint8), whole[scale][tiles]
        got = read_checkpoint(fp8, spec).state
        assert torch.equal(got[name].view(torch.uint8), want_q) and torch.equal(got[scale], want_s)
        state = read_checkpoint(hp, spec, tiled=is_fp8_weight).state
        mod = Fp8Linear(m.dim, len(rows))
        own = mod.quantize(state[name])[1]
        model = nn.Module()
        model.add_module("backbone", nn.ModuleDict({"layers": nn.ModuleDict({"0": nn.ModuleDict({"mixer": nn.ModuleDict({"in_proj": mod})})})}))  # fmt: skip
        pairs = {name: state[name]}
        mamba_in_proj_pairs(model, pairs, hp, spec)
        # The single-rank engine quantising the whole float32 in_proj.
        q, s = Fp8Linear(m.dim, len(full)).quantize(full)
        assert torch.equal(pairs[name].view(torch.uint8), q[rows].view(torch.uint8))
        assert torch.equal(pairs[scale], s[tiles])
        differs.append(not torch.equal(own[-1], s[tiles][-1]))
    assert any(differs)  # the dt tile: one rank's rows alone would get another scale
