"""The multi-rank engine (services/engine/parallel/engine.py) on 2 gloo ranks against the
single-rank LLMEngine, float32 CPU: the same requests through the same steps give the same greedy
and seeded tokens, log-probs and top-n (1e-5) and routed expert ids, with forked samples (n = 2),
truncated sampling, preemption (a small KV pool), prefix-cache hits, and a weight update in the
middle of generation. Qwen3 at TP 2, Qwen3-MoE, GLM-5 and DeepSeek-V3 at EP 2 (attention heads
over the same 2 ranks); the MoE models with data-parallel attention (dp_attention 2: two attention
groups, their own requests and pages, one group idle while the other serves a lone request); and a
worker that dies makes rank 0's next step fail instead of hanging. Nemotron-H (Mamba-2, attention,
squared-ReLU MLP and MoE layers; no prefix cache) at TP 2, its Mamba-2 heads, B/C groups and state
slots split over the ranks, with its experts at EP 2, and at EP 2 x dp_attention 2 (each attention
group its own state slots)."""

from __future__ import annotations

import json
import sys
import time
from importlib import import_module
from pathlib import Path

import pytest
from helpers.debug_weights import random_model_dir
from helpers.moe import nemotron_model, small_nemotron
from helpers.parallel import TINY, run_ranks, tiny_moe
from helpers.triton_interp import set_interpret

from services.common.config import EngineConfig, ModelConfig, ParallelConfig
from services.common.schemas import GenerateRequest, SamplingParams
from services.engine import LLMEngine
from services.engine.parallel.engine import ParallelEngine
from services.engine.parallel.group import init_engine_groups
from services.engine.parallel.orders import receive
from services.engine.parallel.runner import build_runner, run_worker
from trainer.model import save_weights_dir

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="gloo process groups run on Linux")

TOL = 1e-5
BASE = dict(TINY, max_seq_len=64)
MODELS = {
    "qwen3-tp2": (ModelConfig(**BASE, n_kv_heads=2), ParallelConfig(tp=2)),
    "moe-ep2": (tiny_moe(64), ParallelConfig(tp=2, ep=2)),
}
# DeepSeek-V3 (MLA with low-rank q, sigmoid routing in 2 groups with the selection bias, a shared
# expert) and GLM-5 (the same plus the DSA indexer: each query's 8 best keys once a context is
# longer, which these prompts and outputs are): heads split over tp 2, latents on both ranks.
MLA = dict(
    BASE,
    head_dim=24,
    n_kv_heads=4,
    q_lora_rank=16,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=12,
    n_routed_experts=8,
    n_experts_per_tok=2,
    n_shared_experts=1,
    moe_hidden_dim=16,
    first_k_dense=1,
    router_score="sigmoid",
    n_group=2,
    topk_group=1,
    expert_bias=True,
    routed_scaling_factor=2.5,
    qk_norm=False,
    tie_embeddings=False,
)
MODELS["deepseek-ep2"] = (ModelConfig(**MLA, arch="deepseek_v3"), ParallelConfig(tp=2, ep=2))
GLM5 = ModelConfig(**MLA, arch="glm_moe_dsa", index_topk=8, index_n_heads=4, index_head_dim=16)
MODELS["glm5-ep2"] = (GLM5, ParallelConfig(tp=2, ep=2))
# Data-parallel attention: 2 attention groups of one rank, each with its own requests and pages,
# the experts split over both (GLM-5's layout, tp = 1, dp_attention = ep).
DP2 = ParallelConfig(dp_attention=2, ep=2)
MODELS["moe-dp2"] = (tiny_moe(64), DP2)
MODELS["glm5-dp2"] = (GLM5, DP2)
MODELS["deepseek-dp2"] = (MODELS["deepseek-ep2"][0], DP2)
# 2 attention groups of tp 2 (4 ranks): heads split inside a group, experts over all four.
MODELS["moe-tp2-dp2"] = (tiny_moe(64), ParallelConfig(tp=2, dp_attention=2, ep=4))
# Nemotron-H: 4 Mamba-2 heads in 2 B/C groups, 4 attention heads over 2 KV heads, MLP and expert
# widths split over tp 2 (its experts tensor-parallel), or its 8 experts over EP 2.
MODELS["nemotron-tp2"] = (small_nemotron(), ParallelConfig(tp=2))
MODELS["nemotron-ep2"] = (small_nemotron(), ParallelConfig(tp=2, ep=2))
MODELS["nemotron-dp2"] = (small_nemotron(), DP2)  # each attention group its own state slots
# 12 pages of 4 tokens: the first round's four sequences (two prompts, one forked in two) need
# more than that by their end, so the scheduler preempts and recomputes.
CFG = EngineConfig(device="cpu", max_batch_size=8, max_seq_len=64, block_size=4, num_kv_blocks=12)
# With dp_attention 2 every attention group schedules its own pool, so preemptions would fall on
# other steps than one pool's, and a sequence recomputed after the weight update continues from
# other KV: the pools are big enough that nobody is preempted (a group's preemption is the
# single-rank scheduler's, tested above).
DP_CFG = CFG.model_copy(update={"num_kv_blocks": 24})


# These cases' ranks then run the KV page scenarios with data-parallel attention (a second spawn of
# ranks would cost more than a scenario): tests/test_parallel_dp_kv.py (a handoff and a pulled
# prefix) and tests/test_parallel_dp_near.py (histories pulled from the near tier); moe-tp2-dp2's
# with tp 2 inside each attention group (KV heads split over a group's ranks).
KV_SCENARIOS = ("test_parallel_dp_kv", "test_parallel_dp_near")
KV_CASES = ("glm5-dp2", "moe-tp2-dp2")
# And these ranks the fast path's short scenario (tests/test_parallel_fast_path.py: the paged
# kernels and decode graphs' static batches under the Triton interpreter, a head_dim-16 model).
FAST_CASES = ("qwen3-tp2",)
FAST = "test_parallel_fast_path"


def engine_cfg(par: ParallelConfig) -> EngineConfig:
    return DP_CFG if par.dp_attention > 1 else CFG


def requests(moe: bool, tag: str) -> list[GenerateRequest]:
    prompt = [3, 17, 5, 9, 30, 2, 11, 7, 1]
    return [
        GenerateRequest(
            request_id=f"{tag}-a",
            input_ids=prompt,
            sampling=SamplingParams(
                temperature=1.0, seed=11, n=2, max_tokens=10, logprobs=3, ignore_eos=True
            ),
            return_routed_experts=moe,
        ),
        GenerateRequest(
            request_id=f"{tag}-b",
            input_ids=[40, 1, 8, 22, 5],
            sampling=SamplingParams(temperature=0.0, max_tokens=9, logprobs=2, ignore_eos=True),
            return_routed_experts=moe,
        ),
        GenerateRequest(
            request_id=f"{tag}-c",
            input_ids=prompt[:8] + [44],  # two full pages shared with -a: prefix-cache hits
            sampling=SamplingParams(temperature=0.8, top_k=6, seed=5, max_tokens=8, ignore_eos=True),
            return_routed_experts=moe,
        ),
    ]


def drive(engine: LLMEngine, moe: bool, update: str) -> dict[str, object]:
    """Round 1: three requests, the weights updated after 4 steps; round 2: the same prompts again;
    round 3: the first prompt alone (its pages cached by round 2; with data-parallel attention
    the other attention group is idle). A hybrid model has no prefix cache: its round 3 is the
    second request then the forked first (with data-parallel attention: forked in group 1)."""
    out: dict[str, object] = {}
    for rnd in ("r1", "r2", "r3"):
        reqs = requests(moe, rnd)
        if rnd == "r3":
            first = reqs[0].model_copy(update={"sampling": reqs[1].sampling})
            reqs = [reqs[1], reqs[0]] if engine.model_config.is_hybrid else [first]
        hits = engine.stats.prefix_cache_hit_tokens
        states = [engine.add_request(r) for r in reqs]
        steps = 0
        while not all(s.finished for s in states):
            engine.step()
            steps += 1
            if rnd == "r1" and steps == 4:
                engine.apply_weights(engine.read_weights(update), 1)
        for s in states:
            resp = s.response()
            out[resp.request_id] = [c.model_dump(mode="json") for c in resp.choices]
        out[f"{rnd}_hits"] = engine.stats.prefix_cache_hit_tokens - hits
    out["pools"] = [p.num_blocks for p in engine.kv_pools]
    out["slots"] = [p.states.slots for p in engine.kv_pools if p.states is not None]
    out["preemptions"] = engine.stats.preemptions_total
    out["prefix_hits"] = engine.stats.prefix_cache_hit_tokens
    return out


def worker(rank: int, init: str, name: str, dirs: list[str], out_dir: str, die: bool) -> None:
    m, par = MODELS[name]
    cfg = engine_cfg(par)
    groups = init_engine_groups(par, rank, init, "gloo", timeout_s=30)
    if rank != 0:
        if die:  # build the shard, take one order, then leave without a word
            start = receive(groups)
            runner = build_runner(start.path, cfg, par, groups)
            runner.run(receive(groups))
            return
        for _ in range(1 + len(KV_SCENARIOS) * (name in KV_CASES)):
            run_worker(cfg, par, groups)
        if name in FAST_CASES:
            import_module(FAST).serve(groups)
        return
    eng = ParallelEngine(dirs[0], cfg, par, groups, check_orders=True)
    if die:
        eng.add_request(requests(False, "d")[1])
        eng.step()
        t0 = time.monotonic()
        try:
            for _ in range(20):
                eng.step()
            err = ""
        except RuntimeError as e:
            err = type(e).__name__
        Path(out_dir, "die.json").write_text(json.dumps({"error": err, "s": time.monotonic() - t0}))
        return
    got = drive(eng, m.is_moe, dirs[1])
    eng.close()
    want = drive(LLMEngine(dirs[0], cfg), m.is_moe, dirs[1])
    Path(out_dir, f"{name}.json").write_text(json.dumps({"got": got, "want": want}))
    if name in KV_CASES:  # the same ranks again: KV pages with data-parallel attention
        for mod in KV_SCENARIOS:
            import_module(mod).scenario(dirs[0], out_dir, groups, cfg, par)
    if name in FAST_CASES:
        import_module(FAST).scenario(dirs[2:], out_dir, groups)


def weights(m: ModelConfig, dest: Path, version: int) -> Path:
    if m.is_hybrid:  # the trainer's model with decisive routing (a random init's is near-uniform)
        state = nemotron_model(m, seed=3 + version).state_dict()
        return save_weights_dir(m, state, dest, {"version": version})
    return random_model_dir(m, dest, seed=3 + version, version=version, std=0.2)


def run(name: str, tmp_path: Path, die: bool = False) -> None:
    m, par = MODELS[name]
    dirs = [str(weights(m, tmp_path / f"step_{v}", v)) for v in (0, 1)]
    if name not in FAST_CASES or die:
        run_ranks(worker, par.ranks, tmp_path, name, dirs, str(tmp_path), die)
        return
    dirs += import_module(FAST).fast_dirs(tmp_path)
    # The ranks are fresh processes: Triton reads this at its first import there (the torch path
    # runs no Triton kernel on CPU).
    saved = set_interpret("1")
    try:
        run_ranks(worker, par.ranks, tmp_path, name, dirs, str(tmp_path), die)
    finally:
        set_interpret(saved)


@pytest.mark.parametrize(
    "name",
    [
        "qwen3-tp2",
        # the same layout with FP8 weights is test_parallel_fp8's moe-ep2 (make test)
        pytest.param("moe-ep2", marks=pytest.mark.full),
        "glm5-ep2",
        pytest.param("deepseek-ep2", marks=pytest.mark.full),
        pytest.param("moe-dp2", marks=pytest.mark.full),
        "glm5-dp2",
        pytest.param("deepseek-dp2", marks=pytest.mark.full),
        pytest.param("moe-tp2-dp2", marks=pytest.mark.full),
        "nemotron-tp2",
        pytest.param("nemotron-ep2", marks=pytest.mark.full),
        pytest.param("nemotron-dp2", marks=pytest.mark.full),
    ],
)
def test_multi_rank_engine_generates_what_one_rank_does(name: str, tmp_path: Path) -> None:
    run(name, tmp_path)
    if name in KV_CASES:  # the scenarios ran on these ranks too
        import_module("test_parallel_dp_kv").check(tmp_path)
        import_module("test_parallel_dp_near").check(tmp_path, DP_CFG.block_size)
    if name in FAST_CASES:
        import_module(FAST).check(tmp_path)
    r = json.loads((tmp_path / f"{name}.json").read_text())
    got, want = r["got"], r["want"]
    if MODELS[name][1].dp_attention > 1:
        assert got["pools"] == [24, 24] and want["pools"] == [24]  # a page pool per attention group
        assert got["preemptions"] == want["preemptions"] == 0
    else:
        assert got["preemptions"] == want["preemptions"] > 0
    if MODELS[name][0].is_hybrid:  # no prefix cache: a Mamba-2 state does not end at a page
        assert got["prefix_hits"] == want["prefix_hits"] == 0
        # A state slot per sequence that may run: max_batch_size, shared out over attention groups.
        assert want["slots"] == [8] and got["slots"] == [8 // MODELS[name][1].dp_attention] * len(
            got["pools"]
        )
    else:
        if MODELS[name][1].dp_attention == 1:
            assert got["prefix_hits"] == want["prefix_hits"] > 0
        # Round 3's prompt: its two full pages from round 2's first request (with data-parallel
        # attention: placed in the group that holds them; the other group idles through the MoE
        # layers).
        assert got["r3_hits"] == want["r3_hits"] == 8
    same_choices(got, want, MODELS[name][0])
    # The update landed mid-generation: round 1's tokens carry both versions.
    assert {0, 1} <= set(got["r1-a"][0]["versions"])
    assert got["r1-a"][0]["output_ids"] != got["r1-a"][1]["output_ids"]  # the fork really samples


def same_choices(got: dict, want: dict, m: ModelConfig, rids: list[str] | None = None) -> None:
    """`drive`'s requests (or `rids`) gave the same choices: tokens, versions, finish reasons,
    routed ids equal, log-probs and top-n to TOL."""
    if rids is None:
        rids = [f"{rnd}-{x}" for rnd in ("r1", "r2") for x in "abc"] + ["r3-a"] + ["r3-b"] * m.is_hybrid
    for rid in rids:
        for g, w in zip(got[rid], want[rid], strict=True):
            assert g["output_ids"] == w["output_ids"], rid
            assert g["versions"] == w["versions"] and g["finish_reason"] == w["finish_reason"], rid
            assert max(abs(a - b) for a, b in zip(g["logprobs"], w["logprobs"], strict=True)) <= TOL, rid
            for tg, tw in zip(g["top_logprobs"] or [], w["top_logprobs"] or [], strict=True):
                assert [t for t, _ in tg] == [t for t, _ in tw], rid
                assert max(abs(a[1] - b[1]) for a, b in zip(tg, tw, strict=True)) <= TOL, rid
            assert (g["routed_experts"] is not None) == m.is_moe
            assert g["routed_experts"] == w["routed_experts"], rid


def test_a_dead_worker_fails_the_step(tmp_path: Path) -> None:
    run("qwen3-tp2", tmp_path, die=True)
    r = json.loads((tmp_path / "die.json").read_text())
    assert r["error"] == "RuntimeError" and r["s"] < 30
