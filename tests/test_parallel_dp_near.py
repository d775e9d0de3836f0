"""The near KV tier (services/kvstore/near_cache.py) with data-parallel attention, in-process on gloo
ranks: a decode engine of 2 attention groups wired as the decode service wires it (router.attach_near,
a PagePublisher to a real in-process gateway) serves two agents' first turns, one in each group, and
publishes their pages through the near tier; other prompts then evict them from both groups' prefix
caches. Each agent's second turn pulls its history from the near tier (no gateway round trip), the
pages land in the pool of the group the request is placed in and in no other, only the tokens after
them are computed, and the tokens and log-probs are a 1-rank engine's that recomputes everything
(1e-5); the pages each group published are the 1-rank engine's pages. With group 0's pool filled
by a running request, a prefix in the near tier is still pulled whole into idle group 1. On tiny GLM-5 (tp 1 x
dp_attention 2, on tests/test_parallel_engine.py's glm5-dp2 ranks in `make test`) and on Qwen3-MoE
with tp 2 inside each group (KV heads split: pages gathered from and scattered to a group's two
ranks; its moe-tp2-dp2 ranks, `full`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from helpers.debug_weights import random_model_dir
from helpers.parallel import run_ranks
from test_kv_near_cache import MB, Gateway
from test_parallel_dp_kv import CFG, PAR, M, Published, page_diffs, worker

from services.common.config import EngineConfig, KVNearSection, ParallelConfig, RunConfig
from services.common.schemas import GenerateRequest, SamplingParams
from services.engine import LLMEngine
from services.engine.parallel.engine import ParallelEngine
from services.engine.parallel.group import EngineGroups
from services.kvstore.client import KVStoreClient, PagePublisher
from services.kvstore.router import attach_near, prompt_keys, pull_prefix

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="gloo process groups run on Linux")

TURN1 = [[3, 17, 5, 9, 30, 2, 11, 7, 1, 40, 22, 6, 13], [8, 21, 34, 12, 4, 19, 27, 33, 10, 2, 44, 15, 26]]
MORE = [[14, 29, 3, 38, 7, 20, 1, 9], [36, 5, 23, 11, 42, 16, 8, 31]]
# Two rounds of two long prompts (16 pages each, one per group): the second round evicts the
# first turns' cached pages from both 24-page pools.
THIRD = [(5 * i + 2) % 47 for i in range(17)]  # 4 full pages, then the last token
BUSY = [(3 * i + 1) % 47 for i in range(40)]  # 10 pages, then 6 more for each of 2 samples
FILLERS = [[[(7 * i + 13 * r + 5 * j) % 47 for i in range(56)] for j in range(2)] for r in range(2)]


def request(prompt: list[int], agent: int, max_tokens: int) -> GenerateRequest:
    s = (
        SamplingParams(temperature=1.0, seed=5 + agent, max_tokens=max_tokens, logprobs=2, ignore_eos=True)
        if agent == 0
        else SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=2, ignore_eos=True)
    )
    return GenerateRequest(input_ids=prompt, sampling=s)


def run_all(eng: LLMEngine, reqs: list[GenerateRequest]) -> tuple[list[dict], list[int]]:
    """The requests added together and run to the end: their first choices, and their groups
    (a multi-rank engine with data-parallel attention; [] otherwise)."""
    states = [eng.add_request(r) for r in reqs]
    grouped = getattr(eng, "grouped", None)
    placed = [grouped.group_of[s] for s in states] if grouped is not None else []
    while not all(s.finished for s in states):
        eng.step()
    return [s.response().model_dump(mode="json")["choices"][0] for s in states], placed


def scenario(
    model_dir: str, out_dir: str, groups: EngineGroups, cfg: EngineConfig, par: ParallelConfig
) -> None:
    """Rank 0's part (the other ranks run run_worker with `cfg`); writes dp_near.json."""
    gw = Gateway()
    eng = ParallelEngine(model_dir, cfg, par, groups, check_orders=True)
    client = gw.client()
    run_cfg = RunConfig()
    run_cfg.kvstore.near = KVNearSection(bytes=1 * MB)
    attach_near(eng, client, run_cfg)
    near = client.near
    assert near is not None and eng.pages.host_pages is not None
    publisher = PagePublisher(client, eng.pages.page_bytes)
    seen = Published()  # what the engine exported, as bytes (copied out of the near slots)

    def sink(keys: list[bytes], data: object, finished: list[str]) -> None:
        blob = data.tobytes() if hasattr(data, "tobytes") else data
        seen(keys, blob, finished)  # type: ignore[arg-type]
        publisher(keys, data, finished)  # type: ignore[arg-type]

    eng.pages.sink = sink
    first, placed1 = run_all(eng, [request(p, a, 6) for a, p in enumerate(TURN1)])
    for rnd in FILLERS:
        run_all(eng, [request(p, 1, 2) for p in rnd])
    publisher.flush()
    grouped = eng.grouped
    assert grouped is not None
    turn2 = [p + c["output_ids"] + m for p, c, m in zip(TURN1, first, MORE, strict=True)]
    keys = [prompt_keys(eng, p) for p in turn2]
    evicted = [grouped.groups[g].blocks.lookup(k[0]) is None for g in (0, 1) for k in keys]
    in_near = [near.run_length(k) for k in keys]
    hits, ram_hits = near.hits, gw.store.stats().tiers[0].hits
    pulled = [pull_prefix(eng, client, k) for k in keys]
    near_hits, gateway_hits = near.hits - hits, gw.store.stats().tiers[0].hits - ram_hits
    computed0 = eng.stats.computed_tokens_total
    second, placed2 = run_all(eng, [request(p, a, 6) for a, p in enumerate(turn2)])
    held = [
        [grouped.groups[g].blocks.lookup(x) is not None for x in k[: in_near[i]]]
        for g in (0, 1)
        for i, k in enumerate(keys)
    ]
    computed = eng.stats.computed_tokens_total - computed0
    near_bytes = eng.pages.near_import_bytes_total
    page_bytes = eng.pages.page_bytes
    third = busy_group_then_pull(eng, client, model_dir, cfg)
    eng.close()
    publisher.close()
    client.close()
    gw.close()
    ref = LLMEngine(model_dir, cfg)
    ref_pages = Published()
    ref.pages.sink = ref_pages
    want1, _ = run_all(ref, [request(p, a, 6) for a, p in enumerate(TURN1)])
    want2, _ = run_all(LLMEngine(model_dir, cfg), [request(p, a, 6) for a, p in enumerate(turn2)])
    diffs = page_diffs(ref, seen, ref_pages)  # the first turns' pages (ref has no filler's)
    result = {
        "placed": [placed1, placed2],
        "evicted": evicted,
        "in_near": in_near,
        "pulled": pulled,
        "near_hits": near_hits,
        "gateway_hits": gateway_hits,
        "held": held,
        "computed": computed,
        "lens": [len(p) for p in turn2],
        "near_bytes": near_bytes,
        "page_bytes": page_bytes,
        "got": first + second,
        "want": want1 + want2,
        "diffs": diffs,
        "ref_pages": len(ref_pages.pages),
        "third": third,
    }
    Path(out_dir, "dp_near.json").write_text(json.dumps(result))


def busy_group_then_pull(
    eng: ParallelEngine, client: KVStoreClient, model_dir: str, cfg: EngineConfig
) -> dict:
    """Group 0's pool filled by a running request (two samples of a long prompt) while group 1 is
    idle: a prompt whose pages are in the near tier is still pulled whole (the roomiest group's
    free pages bound the pull), placed in group 1 and continued from them."""
    near, grouped = client.near, eng.grouped
    assert near is not None and grouped is not None
    pre = LLMEngine(model_dir, cfg)  # the prompt's pages, as a 1-rank engine publishes them
    pre_pages = Published()
    pre.pages.sink = pre_pages
    want = pre.generate([request(THIRD, 1, 6)])[0].model_dump(mode="json")["choices"][0]
    keys = prompt_keys(eng, THIRD)
    assert near.put(keys, b"".join(pre_pages.pages[k].numpy().tobytes() for k in keys)) == len(keys)
    sampling = SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=24, ignore_eos=True)
    busy = eng.add_request(GenerateRequest(input_ids=BUSY, sampling=sampling))
    while grouped.groups[0].blocks.num_free >= len(keys):
        eng.step()
    free = [s.blocks.num_free for s in grouped.groups]
    pulled = pull_prefix(eng, client, keys)
    state = eng.add_request(request(THIRD, 1, 6))
    held = [[s.blocks.lookup(k) is not None for k in keys] for s in grouped.groups]
    placed = [grouped.group_of[busy], grouped.group_of[state]]
    while not (busy.finished and state.finished):
        eng.step()
    got = state.response().model_dump(mode="json")["choices"][0]
    return {
        "free": free,
        "pulled": pulled,
        "keys": len(keys),
        "held": held,
        "placed": placed,
        "got": got,
        "want": want,
    }


def check(out_dir: Path, block_size: int) -> None:
    """What scenario() wrote, against what it must be."""
    r = json.loads((out_dir / "dp_near.json").read_text())
    # Each turn's two requests go one to each group (least work, then the lowest index).
    assert r["placed"] == [[0, 1], [0, 1]]
    assert r["evicted"] == [True] * 4  # neither group's prefix cache holds either history
    # Each history's full pages (its first turn's prompt and output but the last token) are in the
    # near tier and are pulled from there alone.
    lens1 = [len(p) + 6 for p in TURN1]
    assert r["in_near"] == [(n - 1) // block_size for n in lens1]
    assert r["pulled"] == r["in_near"] and r["near_hits"] == sum(r["in_near"]) and r["gateway_hits"] == 0
    # Agent 0's pages landed in group 0's pool only, agent 1's in group 1's only.
    n0, n1 = r["in_near"]
    assert r["held"] == [[True] * n0, [False] * n1, [False] * n0, [True] * n1]
    assert r["near_bytes"] == (n0 + n1) * r["page_bytes"]
    # Only the tokens after the near pages are computed, then one a generated token but the last.
    assert r["computed"] == sum(n - k * block_size + 5 for n, k in zip(r["lens"], r["in_near"], strict=True))
    for g, w in zip(r["got"], r["want"], strict=True):
        assert g["output_ids"] == w["output_ids"]
        assert max(abs(a - b) for a, b in zip(g["logprobs"], w["logprobs"], strict=True)) <= 1e-5
        for tg, tw in zip(g["top_logprobs"], w["top_logprobs"], strict=True):
            assert [t for t, _ in tg] == [t for t, _ in tw]
    t = r["third"]
    # Group 0 busy (fewer free pages than the pull), group 1 idle: the whole prefix is pulled into
    # group 1, where the request goes, and it continues as the 1-rank engine does.
    assert t["free"][0] < t["keys"] <= t["free"][1] and t["pulled"] == t["keys"] == 4
    assert t["placed"] == [0, 1] and t["held"] == [[False] * 4, [True] * 4]
    assert t["got"]["output_ids"] == t["want"]["output_ids"]
    assert max(abs(a - b) for a, b in zip(t["got"]["logprobs"], t["want"]["logprobs"], strict=True)) <= 1e-5
    # The first turns' pages, published from both groups, are the 1-rank engine's.
    assert len(r["diffs"]) == r["ref_pages"] >= n0 + n1
    assert max(r["diffs"].values()) <= 1e-5, r["diffs"]


@pytest.mark.full  # `make test` runs the scenario in test_parallel_engine's glm5-dp2 ranks
def test_two_attention_groups_pull_their_histories_from_the_near_tier(tmp_path: Path) -> None:
    d = random_model_dir(M, tmp_path / "w", seed=3, std=0.2)
    run_ranks(worker, PAR.ranks, tmp_path, str(d), str(tmp_path), "test_parallel_dp_near")
    check(tmp_path, CFG.block_size)
