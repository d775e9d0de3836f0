"""KV pages with data-parallel attention (tiny GLM-5, tp 1 x dp_attention 2 = ep 2: two attention
groups of one rank each, in-process on gloo ranks). A 1-rank engine plays the prefill: it hands off
one prompt (its full pages, its partial last page and its first token) and publishes another
prompt's pages. The 2-group decode places each request first (the second goes to the other group,
which takes its pulled pages), imports the pages into that group's pool only, and generates what a
colocated 1-rank engine generates (tokens equal, log-probs to 1e-5); the pages it then publishes
are read from each sequence's own group and are the 1-rank engine's pages. The same scenario runs
on tests/test_parallel_engine.py's glm5-dp2 ranks (`make test`) and on its moe-tp2-dp2 ranks (`full`:
tp 2 inside each group, a page's KV heads gathered from and scattered to the group's two ranks)."""

from __future__ import annotations

import json
import sys
from importlib import import_module
from pathlib import Path

import pytest
import torch
from helpers.debug_weights import random_model_dir
from helpers.parallel import run_ranks
from test_parallel_engine import DP_CFG, MODELS
from test_parallel_pages import as_floats

from services.common.config import EngineConfig, ParallelConfig
from services.common.schemas import GenerateRequest, SamplingParams
from services.engine import LLMEngine
from services.engine.kv_transfer import PromptTail, chain_hashes, prompt_tail_key
from services.engine.parallel.engine import ParallelEngine
from services.engine.parallel.group import EngineGroups, init_engine_groups
from services.engine.parallel.runner import run_worker

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="gloo process groups run on Linux")

M, PAR = MODELS["glm5-dp2"]
CFG = DP_CFG  # 24 pages of 4 tokens per attention group
HANDED = [3, 17, 5, 9, 30, 2, 11, 7, 1, 40, 22]  # 2 full pages and a tail of 3
PULLED = [(11 * i + 3) % 47 for i in range(17)]  # 4 full pages, then the last token


def handed(max_tokens: int) -> GenerateRequest:
    # (Top-n log-probs of a first token sampled by a prefill are not carried: none asked here.)
    s = SamplingParams(temperature=1.0, seed=7, max_tokens=max_tokens, ignore_eos=True)
    return GenerateRequest(request_id="handed", input_ids=HANDED, sampling=s)


def pulled(max_tokens: int) -> GenerateRequest:
    s = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=2, ignore_eos=True)
    return GenerateRequest(request_id="pulled", input_ids=PULLED, sampling=s)


class Published:
    """A page sink that keeps what it is given: key -> [page bytes] uint8."""

    def __init__(self) -> None:
        self.pages: dict[bytes, torch.Tensor] = {}

    def __call__(self, hashes: list[bytes], data: bytes, finished: list[str]) -> None:
        if hashes:
            rows = torch.frombuffer(bytearray(data), dtype=torch.uint8).reshape(len(hashes), -1)
            self.pages.update(zip(hashes, rows, strict=True))


def page_diffs(ref: LLMEngine, got: Published, want: Published) -> dict[str, float]:
    """Per page key both published (hex): the largest difference of its values (float pools) or
    1.0 where its ids differ (the routing store), as `ref`'s pools lay a page out."""
    diffs = {}
    for k, page in got.pages.items():
        if k in want.pages:
            parts = zip(as_floats(ref, page[None]), as_floats(ref, want.pages[k][None]), strict=True)
            diffs[k.hex()] = max(
                (a.float() - b.float()).abs().max().item()
                if a.is_floating_point()
                else float(not torch.equal(a, b))
                for a, b in parts
            )
    return diffs


def worker(rank: int, init: str, model_dir: str, out_dir: str, module: str = "test_parallel_dp_kv") -> None:
    """`module`'s scenario on rank 0 (this one's, or test_parallel_dp_near's), run_worker elsewhere."""
    groups = init_engine_groups(PAR, rank, init, "gloo", timeout_s=30)
    if rank != 0:
        run_worker(CFG, PAR, groups)
        return
    import_module(module).scenario(model_dir, out_dir, groups, CFG, PAR)


def scenario(
    model_dir: str, out_dir: str, groups: EngineGroups, cfg: EngineConfig, par: ParallelConfig
) -> None:
    """Rank 0's part (the other ranks run run_worker with `cfg`); writes dp_kv.json."""
    bs = cfg.block_size
    # The prefill: hands off HANDED (sampling its first token) and publishes PULLED's pages.
    pre = LLMEngine(model_dir, cfg)
    store, tails = Published(), {}
    pre.pages.sink = store
    pre.pages.tail_sink = lambda key, blob: tails.__setitem__(key, blob.clone())
    first = pre.generate([handed(1), pulled(1)])[0].choices[0]
    eng = ParallelEngine(model_dir, cfg, par, groups, check_orders=True)
    assert eng.layout == pre.layout
    keys_h = chain_hashes(HANDED, eng.version, eng.layout, bs)
    keys_p = chain_hashes(PULLED, eng.version, eng.layout, bs)[: (len(PULLED) - 1) // bs]
    tail_key = prompt_tail_key(HANDED, eng.version, eng.layout, bs)
    assert tail_key in tails and all(k in store.pages for k in keys_h + keys_p)
    # What the router stages: the handoff's pages, tail and first token; the pulled prefix.
    eng.pages.stage(keys_h, torch.stack([store.pages[k] for k in keys_h]).numpy().tobytes())
    eng.pages.stage_tail("handed", PromptTail(tail_key, len(HANDED) % bs, tails[tail_key].reshape(-1)))
    eng.pages.stage_first("handed", [(first.output_ids[0], first.logprobs[0], first.versions[0])])
    eng.pages.stage_keys("handed", eng.version, keys_h)  # placement reads them; the pulled one hashes
    eng.pages.stage(keys_p, torch.stack([store.pages[k] for k in keys_p]).numpy().tobytes())
    published = Published()
    eng.pages.sink = published
    grouped = eng.grouped
    assert grouped is not None
    states = [eng.add_request(handed(10)), eng.add_request(pulled(8))]
    placed = [grouped.group_of[s] for s in states]
    held = [
        [grouped.groups[g].blocks.lookup(k) is not None for k in keys]
        for g in (0, 1)
        for keys in (keys_h, keys_p)
    ]
    computed0 = eng.stats.computed_tokens_total
    while eng.has_work():
        eng.step()
    computed = eng.stats.computed_tokens_total - computed0
    got = [s.response().model_dump(mode="json")["choices"][0] for s in states]
    eng.close()
    ref = LLMEngine(model_dir, cfg)
    ref_pages = Published()
    ref.pages.sink = ref_pages
    want = [r.model_dump(mode="json")["choices"][0] for r in ref.generate([handed(10), pulled(8)])]
    diffs = page_diffs(ref, published, ref_pages)
    result = {
        "placed": placed,
        "held": held,
        "imported": eng.pages.imported_pages_total,
        "computed": computed,
        "got": got,
        "want": want,
        "published": len(published.pages),
        "diffs": diffs,
    }
    Path(out_dir, "dp_kv.json").write_text(json.dumps(result))


@pytest.mark.full  # `make test` runs the scenario in test_parallel_engine's glm5-dp2 ranks
def test_two_attention_groups_continue_from_a_handoff_and_a_pulled_prefix(tmp_path: Path) -> None:
    d = random_model_dir(M, tmp_path / "w", seed=3, std=0.2)
    run_ranks(worker, PAR.ranks, tmp_path, str(d), str(tmp_path))
    check(tmp_path)


def check(out_dir: Path) -> None:
    """What scenario() wrote, against what it must be."""
    r = json.loads((out_dir / "dp_kv.json").read_text())
    # Placement first: the handoff's request in group 0, the pulled one in group 1 (less work),
    # each group's pool holding its own request's pages and not the other's.
    assert r["placed"] == [0, 1]
    assert r["held"] == [[True] * 2, [False] * 4, [False] * 2, [True] * 4]
    assert r["imported"] == 2 + 4
    # The handoff's request computes no prompt token (its tail written into group 0's rank); the
    # pulled one computes only its last prompt token; then one token per generated step.
    assert r["computed"] == (0 + 9) + (1 + 7)
    for g, w in zip(r["got"], r["want"], strict=True):
        assert g["output_ids"] == w["output_ids"]
        assert max(abs(a - b) for a, b in zip(g["logprobs"], w["logprobs"], strict=True)) <= 1e-5
        for tg, tw in zip(g["top_logprobs"] or [], w["top_logprobs"] or [], strict=True):
            assert [t for t, _ in tg] == [t for t, _ in tw]
    # Published from both groups (the generated full pages: 3 of the handed-off sequence, 2 of
    # the pulled one), each the 1-rank engine's page.
    assert r["published"] == 3 + 2 and len(r["diffs"]) == 5
    assert max(r["diffs"].values()) <= 1e-5, r["diffs"]
