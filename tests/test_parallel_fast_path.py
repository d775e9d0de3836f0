"""The multi-rank engine on the fast path (services/engine/parallel/runner.RankRunner.prepare), on
2 gloo ranks in float32 with the Triton kernels under the interpreter in every rank's process:
the paged attention kernels on each rank's shard (its own heads and KV heads), the fused
residual-add + RMSNorm / SiLU-mul kernels with fused q/k/v and gate/up GEMMs, and at TP 2 the
decode steps on the decode graphs' static batch (padded to the ladder's size, uncaptured off CUDA:
the work a captured graph replays; rank 0 names the graph in each StepOrder). The requests of
tests/test_parallel_engine.py (forks, truncated sampling, top-n log-probs, a preemption, a weight
update mid-generation, prefix-cache hits) give the tokens, versions, log-probs and top-n (1e-5)
and routed ids of the eager multi-rank engine and of the single-rank LLMEngine. At EP 2 the
expert-parallel all-to-all (sizes read on the host) keeps the steps eager: no graphs, the paged
and fused kernels still on. Those runs are `full` (spawning ranks that interpret every kernel
costs tens of seconds); in `make test` a short TP 2 scenario (paged kernels and decode graphs, the
fused elementwise kernels off) runs on tests/test_parallel_engine.py's qwen3-tp2 ranks
(`serve`, `scenario`, `check`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from helpers.moe import small_nemotron
from helpers.parallel import TINY, run_ranks, tiny_moe
from test_parallel_engine import GLM5, drive, same_choices, weights
from test_parallel_engine import MODELS as MODELS_1

from services.common.config import EngineConfig, ModelConfig, ParallelConfig
from services.common.schemas import GenerateRequest, SamplingParams
from services.engine import LLMEngine
from services.engine.parallel.engine import ParallelEngine
from services.engine.parallel.group import EngineGroups, init_engine_groups
from services.engine.parallel.runner import run_worker

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="gloo process groups run on Linux")

# The paged kernels need a power-of-two head_dim >= 16 (MLA: kv_lora_rank).
MODELS = {
    "qwen3-tp2": (ModelConfig(**dict(TINY, head_dim=16), max_seq_len=64, n_kv_heads=2), ParallelConfig(tp=2)),
    "moe-ep2": (tiny_moe(64).model_copy(update={"head_dim": 16}), ParallelConfig(tp=2, ep=2)),
    # GLM-5: MLA (its decode on the MLA kernel at each rank's 2 heads, prompt chunks on the torch
    # route) with the DSA indexer, experts at EP 2.
    "glm5-ep2": (GLM5, ParallelConfig(tp=2, ep=2)),
    # DeepSeek-V3 with tensor-parallel experts (no all-to-all): MLA decode steps on the graphs.
    "deepseek-tp2": (MODELS_1["deepseek-ep2"][0], ParallelConfig(tp=2)),
    # Nemotron-H: each rank's Mamba-2 heads' states in the graphs' static state slots (no fused
    # elementwise kernels: its forward has none, as on one rank).
    "nemotron-tp2": (small_nemotron(head_dim=16), ParallelConfig(tp=2)),
}
# 12 pages of 4 tokens: the first round preempts (tests/test_parallel_engine.py).
CFG = EngineConfig(device="cpu", max_batch_size=8, max_seq_len=64, block_size=4, num_kv_blocks=12)
FAST = CFG.model_copy(update={"attention_backend": "triton"})
SHORT = FAST.model_copy(update={"fused_kernels": False})


def fast_dirs(tmp: Path) -> list[str]:
    """The short scenario's weights (versions 0 and 1), for the ranks of another test."""
    m = MODELS["qwen3-tp2"][0]
    return [str(weights(m, tmp / f"fast_{v}", v)) for v in (0, 1)]


def serve(groups: EngineGroups) -> None:
    """A worker rank's part of the short scenario."""
    run_worker(SHORT, MODELS["qwen3-tp2"][1], groups, device_path=True)


def scenario(dirs: list[str], out_dir: str, groups: EngineGroups) -> None:
    """Rank 0's part of the short scenario: the fast engine, then one rank alone."""
    out = fast_run(dirs, groups, SHORT, "qwen3-tp2", full=False)
    Path(out_dir, "fast-short.json").write_text(json.dumps(out))


def check(tmp_path: Path) -> None:
    """The short scenario: prefill eagerly on the paged kernels, then decode steps of 3 sequences
    on the 4 graph's static batch, across a weight update: one rank's tokens and log-probs."""
    r = json.loads((tmp_path / "fast-short.json").read_text())
    assert r["backend"] == "triton" and r["fused"] is False
    assert r["graphs"] == [1, 2, 4, 8]
    assert r["ordered"][0] is None and r["ordered"].count(4) >= 3
    assert {0, 1} <= set(r["got"]["s-b"][0]["versions"])
    same_choices(r["got"], r["want"], MODELS["qwen3-tp2"][0], ["s-a", "s-b"])


def short(engine: LLMEngine, update: str) -> dict[str, object]:
    """A greedy request with top-2 log-probs and a seeded one forked in two, the weights updated
    after 3 steps: decode steps of 3 sequences on the 4 graph (a padding row)."""
    reqs = [
        GenerateRequest(
            request_id="s-a",
            input_ids=[40, 1, 8, 22, 5],
            sampling=SamplingParams(temperature=0.0, max_tokens=5, logprobs=2, ignore_eos=True),
        ),
        GenerateRequest(
            request_id="s-b",
            input_ids=[3, 17, 5, 9, 30, 2],
            sampling=SamplingParams(temperature=1.0, seed=11, n=2, max_tokens=5, ignore_eos=True),
        ),
    ]
    states = [engine.add_request(r) for r in reqs]
    steps = 0
    while not all(s.finished for s in states):
        engine.step()
        steps += 1
        if steps == 3:
            engine.apply_weights(engine.read_weights(update), 1)
    return {s.request_id: [c.model_dump(mode="json") for c in s.response().choices] for s in states}


def worker(rank: int, init: str, name: str, dirs: list[str], out_dir: str) -> None:
    par = MODELS[name][1]
    groups = init_engine_groups(par, rank, init, "gloo", timeout_s=120)
    if rank != 0:
        run_worker(FAST, par, groups, device_path=True)
        run_worker(CFG, par, groups)
        return
    out = fast_run(dirs, groups, FAST, name, full=True)
    Path(out_dir, f"{name}.json").write_text(json.dumps(out))


def fast_run(
    dirs: list[str], groups: EngineGroups, cfg: EngineConfig, name: str, full: bool
) -> dict[str, object]:
    """Rank 0: the fast engine on `dirs` (the workers serve it), then (full) the eager one, then
    the single-rank engine; the graph each step ordered."""
    m, par = MODELS[name]
    fast = ParallelEngine(dirs[0], cfg, par, groups, device_path=True)
    runner = fast.runner
    ordered: list[int | None] = []
    choose = runner.graph_size
    runner.graph_size = lambda spans: ordered.append(choose(spans)) or ordered[-1]  # type: ignore[method-assign]
    got = drive(fast, m.is_moe, dirs[1]) if full else short(fast, dirs[1])
    fast.close()
    out: dict[str, object] = {
        "got": got,
        "backend": runner.attention_backend,
        "fused": runner.model.fused_elementwise,
        "graphs": None if runner.graphs is None else runner.graphs.sizes,
        "ordered": ordered,
    }
    if full:
        eager = ParallelEngine(dirs[0], CFG, par, groups)
        assert eager.runner.attention_backend == "torch" and eager.runner.graphs is None
        out["eager"] = drive(eager, m.is_moe, dirs[1])
        eager.close()
        out["want"] = drive(LLMEngine(dirs[0], CFG), m.is_moe, dirs[1])
    else:
        out["want"] = short(LLMEngine(dirs[0], CFG), dirs[1])
    return out


@pytest.mark.full
@pytest.mark.parametrize("name", ["qwen3-tp2", "moe-ep2", "glm5-ep2", "deepseek-tp2", "nemotron-tp2"])
def test_multi_rank_fast_path_generates_what_one_rank_does(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tests/test_parallel_engine.py's rounds: a preemption, a weight update, prefix-cache hits."""
    m, par = MODELS[name]
    dirs = [str(weights(m, tmp_path / f"step_{v}", v)) for v in (0, 1)]
    # The ranks are fresh processes: Triton reads this at its first import there.
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    run_ranks(worker, par.ranks, tmp_path, name, dirs, str(tmp_path))
    r = json.loads((tmp_path / f"{name}.json").read_text())
    assert r["backend"] == "triton" and r["fused"] is not m.is_hybrid
    if par.ep > 1:  # the expert-parallel all-to-all cannot be captured: every step eager
        assert r["graphs"] is None and not any(r["ordered"])
    else:
        assert r["graphs"] == [1, 2, 4, 8]
        # Decode steps of 1, 2 and 3-4 sequences ran the 1, 2 and 4 graphs (padding rows); steps
        # carrying prompt tokens ran eagerly.
        assert {1, 2, 4} <= set(r["ordered"]) and None in r["ordered"]
    got = r["got"]
    assert got["preemptions"] > 0  # type: ignore[index,operator]
    assert (got["prefix_hits"] > 0) is not m.is_hybrid  # type: ignore[index,operator]
    assert {0, 1} <= set(got["r1-a"][0]["versions"])  # type: ignore[index]
    for other in (r["eager"], r["want"]):
        same_choices(got, other, m)  # type: ignore[arg-type]
        for key in ("preemptions", "prefix_hits", "r3_hits"):
            assert got[key] == other[key], key  # type: ignore[index]
