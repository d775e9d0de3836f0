"""LLMEngine / AsyncEngine behaviour on the debug model (CPU, float32)."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest
import torch

from services.common.config import EngineConfig, load_config
from services.common.schemas import GenerateRequest, SamplingParams
from services.engine import AsyncEngine, InvalidRequest, LLMEngine, WeightsError
from services.engine.layers.sampler import truncate
from trainer.model import build_model, load_weights_dir, save_weights_dir

CPU = EngineConfig(device="cpu", max_batch_size=16, max_seq_len=64)


def make_model_dir(dest: Path, seed: int, version: int) -> Path:
    """A debug-model directory whose next-token distributions are spread out: the trainer's
    init mostly copies the last token (logprob ~ 0), which would make sampling tests vacuous."""
    m = load_config("debug").model
    state = build_model(m, seed=seed).state_dict()
    state["norm.weight"] = state["norm.weight"] * 0.3
    return save_weights_dir(m, state, dest, {"version": version})


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("engine")
    return make_model_dir(root / "step_0", 0, 0), make_model_dir(root / "step_1", 1, 1)


@pytest.fixture
def engine(dirs: tuple[Path, Path]) -> LLMEngine:
    return LLMEngine(dirs[0], CPU)


def req(prompt: list[int], **sampling: object) -> GenerateRequest:
    return GenerateRequest(input_ids=prompt, sampling=SamplingParams(**sampling))  # type: ignore[arg-type]


PROMPTS = [[5, 6, 7], [10, 11, 12, 13, 14, 15, 16, 17], [30], [40, 41, 42, 43, 44]]


def test_version_from_relay_json(engine: LLMEngine) -> None:
    assert engine.version == 0 and engine.max_seq_len == 64


def test_batched_greedy_equals_one_at_a_time(engine: LLMEngine) -> None:
    reqs = [req(p, temperature=0.0, max_tokens=12, ignore_eos=True) for p in PROMPTS]
    batched = engine.generate(reqs)
    single = [engine.generate([r])[0] for r in reqs]
    for b, s in zip(batched, single, strict=True):
        assert b.choices[0].output_ids == s.choices[0].output_ids
        assert len(b.choices[0].output_ids) == 12 and b.choices[0].finish_reason == "length"
        assert b.choices[0].logprobs == pytest.approx(s.choices[0].logprobs, abs=1e-5)


def test_requests_join_running_batch(engine: LLMEngine) -> None:
    """Continuous batching: a request added mid-generation runs alongside, and every step
    decodes all running sequences in one forward."""
    first = engine.add_request(req(PROMPTS[0], temperature=0.0, max_tokens=10, ignore_eos=True))
    for _ in range(3):
        engine.step()
    late = engine.add_request(req(PROMPTS[1], temperature=0.0, max_tokens=5, ignore_eos=True))
    steps_before = engine.stats.steps_total
    engine.step()
    assert len(first.seqs[0].output) == 4 and len(late.seqs[0].output) == 1  # same step
    while engine.has_work():
        engine.step()
    assert engine.stats.steps_total - steps_before == 7  # 1 + the 6 first still needed; late fit inside
    alone = engine.generate([req(PROMPTS[1], temperature=0.0, max_tokens=5, ignore_eos=True)])[0]
    assert late.response().choices[0].output_ids == alone.choices[0].output_ids


def test_seeded_sampling_independent_of_batch(engine: LLMEngine) -> None:
    target = req(PROMPTS[0], temperature=1.0, top_p=0.9, max_tokens=10, seed=123, n=3, ignore_eos=True)
    alone = engine.generate([target])[0]
    others = [req(p, temperature=1.0, max_tokens=14, ignore_eos=True) for p in PROMPTS[1:]]
    mixed = engine.generate([others[0], target, *others[1:]])[1]
    assert [c.output_ids for c in alone.choices] == [c.output_ids for c in mixed.choices]
    assert len({tuple(c.output_ids) for c in alone.choices}) > 1  # n samples are different draws


def full_logits(path: Path, tokens: list[int]) -> torch.Tensor:
    """Re-score a whole sequence with the trainer's model (torchtitan), as the trainer does."""
    m, state = load_weights_dir(path)
    tt = build_model(m)
    tt.load_state_dict(state)
    with torch.no_grad():
        return tt(torch.tensor([tokens]))[0].float()


def test_logprobs_match_full_reforward(engine: LLMEngine, dirs: tuple[Path, Path]) -> None:
    prompt = PROMPTS[1]
    plain = engine.generate([req(prompt, max_tokens=16, seed=0, n=2)])[0]
    for ch in plain.choices:
        logits = full_logits(dirs[0], prompt + ch.output_ids)
        ref = torch.log_softmax(logits, -1)[len(prompt) - 1 : -1].gather(
            1, torch.tensor(ch.output_ids)[:, None]
        )
        assert ch.logprobs == pytest.approx(ref[:, 0].tolist(), abs=1e-4)

    # temperature + top-k + top-p: the distribution the token was drawn from, renormalised
    ch = engine.generate([req(prompt, max_tokens=16, seed=1, temperature=0.8, top_k=10, top_p=0.9)])[
        0
    ].choices[0]
    logits = full_logits(dirs[0], prompt + ch.output_ids)[len(prompt) - 1 : -1] / 0.8
    n = len(ch.output_ids)
    trunc = truncate(logits, torch.full((n,), 10), torch.full((n,), 0.9))
    ref = torch.log_softmax(trunc, -1).gather(1, torch.tensor(ch.output_ids)[:, None])[:, 0]
    assert all(math.isfinite(x) for x in ref.tolist())
    assert ch.logprobs == pytest.approx(ref.tolist(), abs=1e-4)


def test_weight_update_between_steps_tags_versions(engine: LLMEngine, dirs: tuple[Path, Path]) -> None:
    baseline = engine.generate([req(PROMPTS[0], max_tokens=10, seed=5, ignore_eos=True)])[0].choices[0]
    state = engine.add_request(req(PROMPTS[0], max_tokens=10, seed=5, ignore_eos=True))
    for _ in range(4):
        engine.step()
    engine.load_weights(dirs[1], 1)
    while not state.finished:
        engine.step()
    ch = state.response().choices[0]
    assert ch.versions == [0] * 4 + [1] * 6
    assert ch.output_ids[:4] == baseline.output_ids[:4]
    assert ch.logprobs[:4] == pytest.approx(baseline.logprobs[:4], abs=1e-6)
    assert ch.logprobs[4:] != pytest.approx(baseline.logprobs[4:], abs=1e-3)  # new weights in use
    assert engine.version == 1 and engine.stats.weight_updates_total == 1


def test_bad_weights_rejected_naming_path(engine: LLMEngine, tmp_path: Path) -> None:
    with pytest.raises(WeightsError, match=str(tmp_path / "nope")):
        engine.load_weights(tmp_path / "nope", 3)
    (tmp_path / "empty").mkdir()
    with pytest.raises(WeightsError, match="config.json"):
        engine.load_weights(tmp_path / "empty", 3)
    assert engine.version == 0


def test_capacity_overflow_queues(dirs: tuple[Path, Path]) -> None:
    small = LLMEngine(dirs[0], EngineConfig(device="cpu", max_batch_size=2, max_seq_len=64))
    reqs = [req(p, temperature=0.0, max_tokens=6, n=3, ignore_eos=True) for p in PROMPTS]
    out = small.generate(reqs)
    big = LLMEngine(dirs[0], CPU).generate(reqs)
    assert max(small.stats.batch_size_buckets[3:]) == 0  # never more than 2 sequences per step
    for a, b in zip(out, big, strict=True):
        assert [c.output_ids for c in a.choices] == [c.output_ids for c in b.choices]
        assert all(c.output_ids == a.choices[0].output_ids for c in a.choices)  # greedy: n identical
    assert small.kv.num_free == small.kv.num_blocks  # every page free or evictable


def test_stop_conditions(engine: LLMEngine) -> None:
    greedy = engine.generate([req(PROMPTS[0], temperature=0.0, max_tokens=8, ignore_eos=True)])[0].choices[0]
    stop_at = greedy.output_ids[2]
    ch = engine.generate([req(PROMPTS[0], temperature=0.0, max_tokens=8, stop_token_ids=[stop_at])])[
        0
    ].choices[0]
    first = greedy.output_ids.index(stop_at)
    assert ch.output_ids == greedy.output_ids[: first + 1] and ch.finish_reason == "stop"

    engine.eos_token_ids = {stop_at}
    ch = engine.generate([req(PROMPTS[0], temperature=0.0, max_tokens=8)])[0].choices[0]
    assert ch.output_ids[-1] == stop_at and ch.finish_reason == "stop"
    ch = engine.generate([req(PROMPTS[0], temperature=0.0, max_tokens=8, ignore_eos=True)])[0].choices[0]
    assert len(ch.output_ids) == 8 and ch.finish_reason == "length"

    long_prompt = list(range(3, 63))  # 60 tokens: 4 positions left of max_seq_len 64
    ch = engine.generate([req(long_prompt, max_tokens=50, ignore_eos=True)])[0].choices[0]
    assert len(ch.output_ids) == 4 and ch.finish_reason == "length"


def test_invalid_requests_name_input_ids(engine: LLMEngine) -> None:
    with pytest.raises(InvalidRequest, match=r"input_ids: token id 64 at position 1"):
        engine.add_request(req([3, 64]))
    with pytest.raises(InvalidRequest, match=r"input_ids: token id -1"):
        engine.add_request(req([-1]))
    with pytest.raises(InvalidRequest, match=r"input_ids: prompt has 64 tokens; max_seq_len is 64"):
        engine.add_request(req([3] * 64))
    assert not engine.has_work()


def test_async_engine_batches_pauses_and_updates(dirs: tuple[Path, Path]) -> None:
    async def scenario() -> None:
        eng = AsyncEngine(LLMEngine(dirs[0], CPU)).start()
        try:
            # concurrent submissions are batched and equal the synchronous results
            reqs = [req(p, temperature=0.0, max_tokens=6, ignore_eos=True) for p in PROMPTS]
            outs = await asyncio.gather(*(eng.submit(r) for r in reqs))
            ref = LLMEngine(dirs[0], CPU).generate(reqs)
            assert [o.choices[0].output_ids for o in outs] == [r.choices[0].output_ids for r in ref]
            assert eng.engine.stats.batch_size_sum / eng.engine.stats.steps_total > 1

            # paused: requests queue and nothing runs; resume finishes them
            await asyncio.to_thread(eng.pause)
            task = asyncio.ensure_future(eng.submit(req(PROMPTS[0], max_tokens=4)))
            await asyncio.sleep(0.3)
            assert not task.done() and eng.paused and eng.num_waiting == 1
            steps = eng.engine.stats.steps_total
            eng.resume()
            assert len((await asyncio.wait_for(task, 10)).choices[0].output_ids) <= 4
            assert eng.engine.stats.steps_total > steps

            # a weight update lands between steps of a running request
            base = eng.engine.stats.generated_tokens_total
            long = asyncio.ensure_future(eng.submit(req(PROMPTS[1], max_tokens=50, ignore_eos=True)))
            while eng.engine.stats.generated_tokens_total < base + 3:  # let it get going
                await asyncio.sleep(0.001)
            assert await eng.load_weights(dirs[1], 1) == 1
            versions = (await asyncio.wait_for(long, 10)).choices[0].versions
            assert versions[0] == 0 and versions[-1] == 1 and versions == sorted(versions)

            with pytest.raises(InvalidRequest):
                await eng.submit(req([99]))
            with pytest.raises(WeightsError):
                await eng.load_weights(dirs[0] / "missing", 2)
            assert eng.engine.stats.idle_seconds_total > 0

            # stopping completes queued requests with finish_reason "abort"
            await asyncio.to_thread(eng.pause)
            pending = asyncio.ensure_future(eng.submit(req(PROMPTS[2], max_tokens=4)))
            await asyncio.sleep(0.1)
            await asyncio.to_thread(eng.stop)
            assert (await asyncio.wait_for(pending, 5)).choices[0].finish_reason == "abort"
        finally:
            eng.stop()

    asyncio.run(scenario())
