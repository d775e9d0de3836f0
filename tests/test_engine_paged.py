"""Paged KV cache, prefix cache, chunked prefill and preemption (CPU, float32, debug model).

Every engine variant must produce what a one-page-per-sequence engine (the old slot layout:
block_size = max_seq_len, no prefix cache, no chunking, no preemption) produces: the same greedy
tokens and seeded samples, log-probs within float rounding."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from helpers.debug_weights import spread_debug_versions

from services.common.config import EngineConfig
from services.common.schemas import GenerateRequest, GenerateResponse, SamplingParams
from services.engine import InvalidRequest, LLMEngine
from services.engine.block_manager import BlockManager, block_hash, root_hash
from trainer.model import build_model, load_weights_dir

BASE = dict(device="cpu", max_batch_size=16, max_seq_len=64)
# The old slot engine's layout: one page holds a whole sequence.
SLOT = EngineConfig(**BASE, block_size=64, enable_prefix_caching=False)  # type: ignore[arg-type]
PAGED = EngineConfig(**BASE, block_size=4)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two debug-model weight versions with spread-out next-token distributions."""
    return spread_debug_versions(tmp_path_factory.mktemp("paged"))


def req(prompt: list[int], **sampling: object) -> GenerateRequest:
    return GenerateRequest(input_ids=prompt, sampling=SamplingParams(**sampling))  # type: ignore[arg-type]


def cfg(**kw: object) -> EngineConfig:
    return EngineConfig(**{**PAGED.model_dump(), **kw})


def same(a: list[GenerateResponse], b: list[GenerateResponse], tol: float = 1e-5) -> None:
    for x, y in zip(a, b, strict=True):
        assert [c.output_ids for c in x.choices] == [c.output_ids for c in y.choices]
        for cx, cy in zip(x.choices, y.choices, strict=True):
            assert cx.logprobs == pytest.approx(cy.logprobs, abs=tol)
            assert cx.finish_reason == cy.finish_reason


PROMPTS = [list(range(3, 3 + n)) for n in (3, 9, 1, 17)] + [[7, 7, 8, 9, 10, 11]]


def mixed_requests(max_tokens: int = 10) -> list[GenerateRequest]:
    return [
        req(PROMPTS[0], temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
        req(PROMPTS[1], temperature=1.0, top_p=0.9, seed=4, n=3, max_tokens=max_tokens, ignore_eos=True),
        req(PROMPTS[2], temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
        req(PROMPTS[3], temperature=0.7, top_k=20, seed=9, n=2, max_tokens=max_tokens, ignore_eos=True),
        req(PROMPTS[4], temperature=1.0, seed=1, max_tokens=max_tokens, ignore_eos=True),
    ]


# ---------------------------------------------------------------------- block manager


def test_block_manager_refcounts_free_list_and_lru() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    a, b = bm.allocate(), bm.allocate()
    assert (a, b) == (0, 1) and bm.num_free == 2 and bm.ref[a] == 1
    bm.acquire(a)  # shared by a second sequence
    bm.release(a)
    assert bm.ref[a] == 1 and bm.num_free == 2
    ha, hb = block_hash(root_hash(0), [1, 2]), block_hash(root_hash(0), [3, 4])
    bm.register(a, ha)
    bm.register(b, hb)
    bm.release(b)
    bm.release(a)  # a released last: most recently used
    assert bm.num_free == 4 and bm.num_cached == 2 and bm.lookup(ha) == a
    # Never-cached pages go first; then the least recently released cached page (b) is evicted.
    assert {bm.allocate(), bm.allocate()} == {2, 3}
    assert bm.allocate() == b and bm.lookup(hb) is None and bm.lookup(ha) == a
    # A hit on a page nobody holds takes it out of the evictable pool.
    bm.acquire(a)
    assert bm.ref[a] == 1 and bm.num_free == 0
    with pytest.raises(RuntimeError, match="KV cache full"):
        bm.allocate()
    bm.release(a)
    assert bm.num_free == 1 and bm.lookup(ha) == a


def test_hash_chain_depends_on_prefix_and_version() -> None:
    h0 = block_hash(root_hash(0), [1, 2])
    assert block_hash(h0, [3, 4]) == block_hash(block_hash(root_hash(0), [1, 2]), [3, 4])
    assert block_hash(h0, [3, 4]) != block_hash(block_hash(root_hash(0), [9, 2]), [3, 4])
    assert block_hash(root_hash(1), [1, 2]) != h0


# ---------------------------------------------------------------------- equivalence


def test_paged_equals_slot_layout(dirs: tuple[Path, Path]) -> None:
    reqs = mixed_requests()
    same(LLMEngine(dirs[0], PAGED).generate(reqs), LLMEngine(dirs[0], SLOT).generate(reqs))


def test_greedy_and_sampled_logprobs_match_full_reforward(dirs: tuple[Path, Path]) -> None:
    m, state = load_weights_dir(dirs[0])
    tt = build_model(m)
    tt.load_state_dict(state)
    eng = LLMEngine(dirs[0], PAGED)
    greedy, sampled = eng.generate(
        [
            req(PROMPTS[3], temperature=0.0, max_tokens=20, ignore_eos=True),
            req(PROMPTS[1], temperature=1.0, seed=3, max_tokens=20, ignore_eos=True),
        ]
    )
    for resp, prompt in ((greedy, PROMPTS[3]), (sampled, PROMPTS[1])):
        ch = resp.choices[0]
        with torch.no_grad():
            logp = torch.log_softmax(tt(torch.tensor([prompt + ch.output_ids]))[0].float(), -1)
        logp = logp[len(prompt) - 1 : -1]
        if resp is greedy:
            assert ch.output_ids == logp.argmax(-1).tolist()
        ref = logp.gather(1, torch.tensor(ch.output_ids)[:, None])[:, 0]
        assert ch.logprobs == pytest.approx(ref.tolist(), abs=1e-5)


def test_chunked_prefill_equals_unchunked(dirs: tuple[Path, Path]) -> None:
    long = list(range(3, 50))  # 47 tokens: 6 chunks of 8
    reqs = [req(long, temperature=0.0, max_tokens=8, ignore_eos=True), *mixed_requests(8)]
    chunked = LLMEngine(dirs[0], cfg(max_num_batched_tokens=8))
    out = chunked.generate(reqs)
    same(out, LLMEngine(dirs[0], SLOT).generate(reqs))
    # No step fed more than the budget, and the long prompt took several steps.
    assert chunked.stats.computed_tokens_total <= 8 * chunked.stats.steps_total
    assert chunked.stats.steps_total >= 47 // 8 + 8


# ---------------------------------------------------------------------- prefix cache


def test_prefix_cache_hit_computes_only_new_tokens(dirs: tuple[Path, Path]) -> None:
    eng = LLMEngine(dirs[0], PAGED)
    shared = list(range(10, 30))  # 20 tokens: 5 full pages
    first = eng.generate([req(shared + [1, 2], temperature=0.0, max_tokens=5, ignore_eos=True)])
    computed, hits = eng.stats.computed_tokens_total, eng.stats.prefix_cache_hit_tokens
    second_req = req(shared + [5, 6, 7], seed=2, max_tokens=5, ignore_eos=True)
    second = eng.generate([second_req])
    assert eng.stats.prefix_cache_hit_tokens - hits == 20
    # Only the 3 new prompt tokens were prefilled, then 4 decode steps (the 5th token is not fed).
    assert eng.stats.computed_tokens_total - computed == 3 + 4
    assert 0 < eng.stats.prefix_cache_hit_rate < 1
    fresh = LLMEngine(dirs[0], SLOT)
    same(second, fresh.generate([second_req]))
    same(first, fresh.generate([req(shared + [1, 2], temperature=0.0, max_tokens=5, ignore_eos=True)]))

    # A prompt that is exactly cached still computes its last token (its logits are needed).
    hits = eng.stats.prefix_cache_hit_tokens
    again = eng.generate([req(shared, temperature=0.0, max_tokens=3, ignore_eos=True)])
    assert eng.stats.prefix_cache_hit_tokens - hits == 16
    same(again, fresh.generate([req(shared, temperature=0.0, max_tokens=3, ignore_eos=True)]))


def test_weight_update_invalidates_prefix_cache(dirs: tuple[Path, Path]) -> None:
    eng = LLMEngine(dirs[0], PAGED)
    r = req(list(range(10, 30)), seed=5, max_tokens=6, ignore_eos=True)
    eng.generate([r])
    eng.load_weights(dirs[1], 1)
    hits = eng.stats.prefix_cache_hit_tokens
    out = eng.generate([r])
    assert eng.stats.prefix_cache_hit_tokens == hits  # version-0 pages are never reused
    same([out[0]], LLMEngine(dirs[1], SLOT).generate([r]))
    assert out[0].choices[0].versions == [1] * 6
    eng.generate([r])
    assert eng.stats.prefix_cache_hit_tokens - hits == 16  # version-1 pages are


def test_n_samples_share_prompt_pages(dirs: tuple[Path, Path]) -> None:
    eng = LLMEngine(dirs[0], PAGED)
    state = eng.add_request(req(list(range(10, 20)), seed=1, n=4, max_tokens=3, ignore_eos=True))
    eng.step()
    assert eng.stats.computed_tokens_total == 10  # the prompt was prefilled once
    tables = [s.block_table for s in state.seqs]
    assert all(t[:2] == tables[0][:2] for t in tables)  # 2 full pages shared by all 4 samples
    assert all(eng.kv.blocks.ref[b] == 4 for b in tables[0][:2])
    assert len({t[2] for t in tables}) == 4  # each its own copy of the partly filled page
    while eng.has_work():
        eng.step()
    out = state.response()
    same(
        [out],
        LLMEngine(dirs[0], SLOT).generate(
            [req(list(range(10, 20)), seed=1, n=4, max_tokens=3, ignore_eos=True)]
        ),
    )


# ---------------------------------------------------------------------- preemption, abort, limits


def test_pool_exhaustion_preempts_and_completes(dirs: tuple[Path, Path]) -> None:
    reqs = mixed_requests(16)
    # 12 pages of 4 tokens: any one sequence fits (<= 33 tokens), 8 sequences together do not.
    tiny = LLMEngine(dirs[0], cfg(num_kv_blocks=12))
    out = tiny.generate(reqs)
    assert tiny.stats.preemptions_total > 0
    same(out, LLMEngine(dirs[0], SLOT).generate(reqs))
    assert tiny.kv.num_free == 12


def test_request_larger_than_pool_rejected(dirs: tuple[Path, Path]) -> None:
    tiny = LLMEngine(dirs[0], cfg(num_kv_blocks=3))
    with pytest.raises(InvalidRequest, match=r"input_ids: prompt of 10 tokens .* needs 4 KV pages .* has 3"):
        tiny.add_request(req(list(range(3, 13)), max_tokens=6))
    # 3 + 9 tokens fit in 3 pages of 4: served to the end (unseeded sampling could hit EOS first).
    out = tiny.generate([req([3, 4, 5], max_tokens=9, ignore_eos=True)])[0].choices[0]
    assert out.finish_reason == "length" and len(out.output_ids) == 9


def test_abort_and_timeout_free_pages(dirs: tuple[Path, Path]) -> None:
    eng = LLMEngine(dirs[0], cfg(request_timeout_s=0.2))
    a = eng.add_request(req(list(range(3, 20)), n=2, max_tokens=40, ignore_eos=True))
    b = eng.add_request(req(list(range(3, 9)), max_tokens=40, ignore_eos=True))
    eng.step()
    assert eng.kv.num_free < eng.kv.num_blocks
    eng.abort(a)
    assert a.finished and a.response().choices[0].finish_reason == "abort"
    time.sleep(0.25)
    assert eng.step() == [b] and b.response().choices[0].finish_reason == "abort"
    assert not eng.has_work() and eng.stats.requests_timed_out == 1
    assert eng.kv.num_free == eng.kv.num_blocks
