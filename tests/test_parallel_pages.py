"""KV page export from a multi-rank engine (services/engine/parallel/pages.py) on 2 gloo ranks,
in-process: after the same prefill, the pages ParallelEngine exports are the single-rank engine's
pages (same layout id and byte size, values to 1e-5 in float32), for a GQA model whose one KV head
is replicated on both ranks (only one copy is kept) and for GLM-5 (MLA latent, DSA indexer keys and
the routing store: whole on every rank, taken from rank 0). The split-heads case (one KV head a rank)
runs over HTTP in tests/test_parallel_prefill.py. The other way: a multi-rank engine given whole
pages (as pulled from the store) continues from them as a single rank computes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from helpers.debug_weights import random_model_dir
from helpers.parallel import TINY, run_ranks
from test_parallel_engine import CFG, MODELS

from services.common.config import ModelConfig, ParallelConfig
from services.common.schemas import GenerateRequest, SamplingParams
from services.engine import LLMEngine
from services.engine.kv_transfer import pool_tensors
from services.engine.parallel.engine import ParallelEngine
from services.engine.parallel.group import EngineGroups, init_engine_groups
from services.engine.parallel.runner import run_worker

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="gloo process groups run on Linux")

CASES = {
    "kv1-tp2": (ModelConfig(**TINY, max_seq_len=64, n_kv_heads=1), ParallelConfig(tp=2)),
    "kv2-tp2": (ModelConfig(**TINY, max_seq_len=64, n_kv_heads=2), ParallelConfig(tp=2)),
    "glm5-ep2": MODELS["glm5-ep2"],
}
PROMPT = [3, 17, 5, 9, 30, 2, 11, 7, 1, 40, 22]


def greedy(max_tokens: int) -> GenerateRequest:
    return GenerateRequest(
        input_ids=PROMPT,
        sampling=SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=2),
        return_routed_experts=True,
    )


def prefilled(eng: LLMEngine) -> tuple[list[int], list[bytes]]:
    """Prefill PROMPT (one step) and return its full pages and their keys."""
    state = eng.add_request(greedy(4))
    eng.step()
    seq = state.seqs[0]
    full = len(PROMPT) // eng.kv.block_size
    return list(seq.block_table[:full]), list(seq.block_hashes[:full])


def as_floats(eng: LLMEngine, blob: torch.Tensor) -> list[torch.Tensor]:
    """A [n, page bytes] blob cut into its pools' values (float pools as float32, ids as ints)."""
    out, at = [], 0
    n = blob.shape[0]
    for t in pool_tensors(eng.kv):
        per = t.shape[0] * eng.kv.block_size * t[0, 0].numel() * t.element_size()
        out.append(blob[:, at : at + per].contiguous().view(t.dtype).reshape(n, -1))
        at += per
    assert at == blob.shape[1]
    return out


def worker(rank: int, init: str, name: str, model_dir: str, out_dir: str, mode: str) -> None:
    _, par = CASES[name]
    groups = init_engine_groups(par, rank, init, "gloo", timeout_s=30)
    if rank != 0:
        run_worker(CFG, par, groups)
        return
    (check_export if mode == "export" else check_import)(name, model_dir, out_dir, par, groups)


def check_export(name: str, model_dir: str, out_dir: str, par: ParallelConfig, groups: EngineGroups) -> None:
    """Both engines prefill PROMPT; the multi-rank one's exported pages against the single rank's."""
    eng = ParallelEngine(model_dir, CFG, par, groups)
    got = eng.pages.blob(prefilled(eng)[0])
    one = LLMEngine(model_dir, CFG)
    want = one.pages.blob(prefilled(one)[0])
    eng.close()
    diffs = [
        (g.float() - w.float()).abs().max().item() if g.is_floating_point() else float(not torch.equal(g, w))
        for g, w in zip(as_floats(one, got), as_floats(one, want), strict=True)
    ]
    result = {
        "layout": [eng.layout, one.layout],
        "page_bytes": [eng.pages.page_bytes, one.pages.page_bytes, got.shape[1]],
        "pages": got.shape[0],
        "diffs": diffs,
        # every float pool really holds the prompt's KV (not an untouched zero page)
        "filled": all(w.float().abs().min(dim=1).values.gt(0).all().item() for w in as_floats(one, want)[:1]),
    }
    Path(out_dir, f"{name}.json").write_text(json.dumps(result))


@pytest.mark.parametrize("name", ["kv1-tp2", pytest.param("glm5-ep2", marks=pytest.mark.full)])
def test_a_multi_rank_engine_exports_single_rank_pages(name: str, tmp_path: Path) -> None:
    m, par = CASES[name]
    d = random_model_dir(m, tmp_path / "w", seed=3, std=0.2)
    run_ranks(worker, par.ranks, tmp_path, name, str(d), str(tmp_path), "export")
    r = json.loads((tmp_path / f"{name}.json").read_text())
    assert r["layout"][0] == r["layout"][1] and "|tp" not in r["layout"][0]
    assert r["page_bytes"][0] == r["page_bytes"][1] == r["page_bytes"][2]
    assert r["pages"] == len(PROMPT) // CFG.block_size
    assert max(r["diffs"]) <= 1e-5, r["diffs"]
    assert r["filled"]


def check_import(name: str, model_dir: str, out_dir: str, par: ParallelConfig, groups: EngineGroups) -> None:
    """A multi-rank engine continues from pages a single-rank engine exported (as from the store)."""
    one = LLMEngine(model_dir, CFG)
    pages, keys = prefilled(one)
    data = one.pages.blob(pages).numpy().tobytes()
    eng = ParallelEngine(model_dir, CFG, par, groups)
    eng.pages.stage(keys, data)
    got = eng.generate([greedy(6)])[0]
    result = {
        "imported": eng.pages.imported_pages_total,
        "hits": eng.stats.prefix_cache_hit_tokens,
        "got": got.model_dump(mode="json")["choices"],
        "want": LLMEngine(model_dir, CFG).generate([greedy(6)])[0].model_dump(mode="json")["choices"],
    }
    eng.close()
    Path(out_dir, f"{name}.json").write_text(json.dumps(result))


@pytest.mark.parametrize(
    "name",
    # kv2-tp2 repeats in-process what tests/test_parallel_prefill.py's second turn shows over HTTP.
    [pytest.param("kv2-tp2", marks=pytest.mark.full), pytest.param("glm5-ep2", marks=pytest.mark.full)],
)
def test_a_multi_rank_engine_continues_from_imported_pages(name: str, tmp_path: Path) -> None:
    """Every rank writes its KV heads of each whole page (MLA: the whole latent); the prompt's full
    pages are then prefix-cache hits and the generation is the one a single rank computes."""
    m, par = CASES[name]
    d = random_model_dir(m, tmp_path / "w", seed=3, std=0.2)
    run_ranks(worker, par.ranks, tmp_path, name, str(d), str(tmp_path), "import")
    r = json.loads((tmp_path / f"{name}.json").read_text())
    full = len(PROMPT) // CFG.block_size
    assert r["imported"] == full and r["hits"] == full * CFG.block_size
    [g], [w] = r["got"], r["want"]
    assert g["output_ids"] == w["output_ids"] and g["routed_experts"] == w["routed_experts"]
    assert max(abs(a - b) for a, b in zip(g["logprobs"], w["logprobs"], strict=True)) <= 1e-5
