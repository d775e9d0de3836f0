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
and fused kernels still on."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from helpers.parallel import TINY, run_ranks, tiny_moe
from test_parallel_engine import drive, weights

from services.common.config import EngineConfig, ModelConfig, ParallelConfig
from services.engine import LLMEngine
from services.engine.parallel.engine import ParallelEngine
from services.engine.parallel.group import init_engine_groups
from services.engine.parallel.runner import run_worker

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="gloo process groups run on Linux")

TOL = 1e-5
# The paged kernels need a power-of-two head_dim >= 16.
MODELS = {
    "qwen3-tp2": (ModelConfig(**dict(TINY, head_dim=16), max_seq_len=64, n_kv_heads=2), ParallelConfig(tp=2)),
    "moe-ep2": (tiny_moe(64).model_copy(update={"head_dim": 16}), ParallelConfig(tp=2, ep=2)),
}
# 12 pages of 4 tokens: the first round preempts (tests/test_parallel_engine.py).
CFG = EngineConfig(device="cpu", max_batch_size=8, max_seq_len=64, block_size=4, num_kv_blocks=12)
FAST = CFG.model_copy(update={"attention_backend": "triton"})


def worker(rank: int, init: str, name: str, dirs: list[str], out_dir: str) -> None:
    m, par = MODELS[name]
    groups = init_engine_groups(par, rank, init, "gloo", timeout_s=120)
    if rank != 0:
        run_worker(FAST, par, groups, device_path=True)
        run_worker(CFG, par, groups)
        return
    fast = ParallelEngine(dirs[0], FAST, par, groups, device_path=True)
    runner = fast.runner
    ordered: list[int | None] = []
    choose = runner.graph_size
    runner.graph_size = lambda spans: ordered.append(choose(spans)) or ordered[-1]  # type: ignore[method-assign]
    got = drive(fast, m.is_moe, dirs[1])
    fast.close()
    info = {
        "backend": runner.attention_backend,
        "fused": runner.model.fused_elementwise,
        "graphs": None if runner.graphs is None else runner.graphs.sizes,
        "ordered": ordered,
    }
    eager = ParallelEngine(dirs[0], CFG, par, groups)
    assert eager.runner.attention_backend == "torch" and eager.runner.graphs is None
    mine = drive(eager, m.is_moe, dirs[1])
    eager.close()
    want = drive(LLMEngine(dirs[0], CFG), m.is_moe, dirs[1])
    Path(out_dir, f"{name}.json").write_text(json.dumps({"got": got, "eager": mine, "want": want, **info}))


def same(got: dict[str, object], want: dict[str, object], moe: bool) -> None:
    rids = [f"{rnd}-{x}" for rnd in ("r1", "r2") for x in "abc"] + ["r3-a"]
    for rid in rids:
        for g, w in zip(got[rid], want[rid], strict=True):  # type: ignore[call-overload]
            assert g["output_ids"] == w["output_ids"], rid
            assert g["versions"] == w["versions"] and g["finish_reason"] == w["finish_reason"], rid
            assert max(abs(a - b) for a, b in zip(g["logprobs"], w["logprobs"], strict=True)) <= TOL, rid
            for tg, tw in zip(g["top_logprobs"] or [], w["top_logprobs"] or [], strict=True):
                assert [t for t, _ in tg] == [t for t, _ in tw], rid
                assert max(abs(a[1] - b[1]) for a, b in zip(tg, tw, strict=True)) <= TOL, rid
            assert (g["routed_experts"] is not None) == moe
            assert g["routed_experts"] == w["routed_experts"], rid
    for key in ("preemptions", "prefix_hits", "r3_hits"):
        assert got[key] == want[key], key


@pytest.mark.parametrize("name", ["qwen3-tp2", pytest.param("moe-ep2", marks=pytest.mark.full)])
def test_multi_rank_fast_path_generates_what_one_rank_does(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    m, par = MODELS[name]
    dirs = [str(weights(m, tmp_path / f"step_{v}", v)) for v in (0, 1)]
    # The ranks are fresh processes: Triton reads this at its first import there.
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    run_ranks(worker, par.ranks, tmp_path, name, dirs, str(tmp_path))
    r = json.loads((tmp_path / f"{name}.json").read_text())
    assert r["backend"] == "triton" and r["fused"] is True
    if par.ep > 1:  # the expert-parallel all-to-all cannot be captured: every step eager
        assert r["graphs"] is None and not any(r["ordered"])
    else:
        assert r["graphs"] == [1, 2, 4, 8]
        # Decode steps of 1, 2 and 3-4 sequences ran the 1, 2 and 4 graphs (padding rows); steps
        # carrying prompt tokens ran eagerly.
        assert {1, 2, 4} <= set(r["ordered"]) and None in r["ordered"]
    assert r["got"]["preemptions"] > 0 and r["got"]["prefix_hits"] > 0
    assert {0, 1} <= set(r["got"]["r1-a"][0]["versions"])
    same(r["got"], r["eager"], m.is_moe)
    same(r["got"], r["want"], m.is_moe)
