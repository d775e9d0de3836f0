"""The handoff into a real engine (router.pull_prefix(handoff=)), in one process: a prefill engine
with a shared near tier and a real gateway data plane, a decode engine that imports the handed-off
pages. A slot rewritten after the handoff ends the handed-off run there; the rest of the prefix
comes from the gateway, and the tokens equal an engine that recomputes everything."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.debug_weights import random_model_dir
from test_kv_near_cache import ENGINE, TINY, Gateway, gateway

from services.common.config import KVNearSection, RunConfig
from services.common.schemas import GenerateRequest, GenerateResponse, SamplingParams
from services.engine import LLMEngine
from services.engine.kv_transfer import page_nbytes
from services.kvstore.client import PagePublisher
from services.kvstore.handoff import HandoffLeases
from services.kvstore.router import HANDOFF_READER, attach_near, prompt_keys, pull_prefix

__all__ = ["gateway"]  # the real gateway fixture of test_kv_near_cache

MB = 1 << 20
ACK_URL = "http://127.0.0.1:9/v1/handoff/ack"  # nothing listens: the ack fails fast, the lease ends it


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return random_model_dir(TINY, tmp_path_factory.mktemp("kvhandoff") / "step_0", 0, 0, std=0.05)


def generate(eng: LLMEngine, prompt: list[int]) -> GenerateResponse:
    sampling = SamplingParams(temperature=1.0, seed=4, max_tokens=6, ignore_eos=True)
    return eng.generate([GenerateRequest(input_ids=prompt, sampling=sampling)])[0]


@pytest.mark.parametrize("rewrite_at", [None, 7])
def test_handed_off_pages_import_and_a_rewritten_slot_ends_the_run(
    weights: Path, gateway: Gateway, rewrite_at: int | None
) -> None:
    # The prefill: a shared near tier its exports go into, and a publisher to the gateway.
    prefill = LLMEngine(weights, ENGINE, version=0)
    pclient = gateway.client()
    cfg = RunConfig()
    cfg.kvstore.near = KVNearSection(bytes=1 * MB)
    attach_near(prefill, pclient, cfg, shared=True)
    near = pclient.near
    assert near is not None and near.shared
    publisher = PagePublisher(pclient, page_nbytes(prefill.kv))
    prefill.pages.sink = publisher
    leases = HandoffLeases(30.0, ACK_URL)
    prompt = [(7 * i + 3) % 500 for i in range(130)]
    try:
        generate(prefill, prompt)
        publisher.flush()
        keys = prompt_keys(prefill, prompt)
        assert len(keys) == 16
        run, refs = near.handoff(keys)
        handoff = leases.grant(run, refs)
        assert handoff is not None and len(handoff.slots) == 16
        if rewrite_at is not None:  # the writer starts rewriting that slot after the handoff
            seg, slot, _gen = refs[rewrite_at]
            seg.begin_write(slot)
        # The decode: a fresh engine, its own client of the same gateway.
        decode = LLMEngine(weights, ENGINE, version=0)
        dclient = gateway.client()
        stale = HANDOFF_READER.stale
        lookups = gateway.lookups
        assert pull_prefix(decode, dclient, prompt_keys(decode, prompt), handoff=handoff) == 16
        if rewrite_at is None:
            assert gateway.lookups == lookups  # every page came through the handoff
        else:
            assert HANDOFF_READER.stale - stale == 16 - rewrite_at  # from the rewritten slot on
            assert gateway.lookups > lookups  # ... those came from the gateway
        before = decode.stats.computed_tokens_total
        out = generate(decode, prompt)
        assert decode.pages.imported_pages_total == 16
        assert decode.stats.computed_tokens_total - before == len(prompt) - 16 * 8 + 5
        ref = generate(LLMEngine(weights, ENGINE, version=0), prompt)
        assert out.choices[0].output_ids == ref.choices[0].output_ids
        assert out.choices[0].logprobs == pytest.approx(ref.choices[0].logprobs, abs=1e-5)
        dclient.close()
    finally:
        leases.close()
        publisher.close()
        near.close()
        pclient.close()
