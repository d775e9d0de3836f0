"""Overlap scheduling (decode.engine.overlap_schedule, docs/engine.md): step N+1 is launched before
step N's tokens reach the host. On CPU (torch path: the same code, run synchronously) it must give
exactly what the engine gives with it off: tokens, log-probs, versions, top-n log-probs, finish
reasons, stop strings, EOS, max_tokens, abort, preemption and prefix caching, on the debug model
and on a tiny HF Qwen3."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.debug_weights import spread_debug_versions

from services.common.config import EngineConfig
from services.common.schemas import GenerateRequest, GenerateResponse, SamplingParams
from services.engine import AsyncEngine, LLMEngine
from services.engine.batch import HostBatch, Span
from services.engine.cuda_graphs import InputBuffers
from services.engine.overlap import Feed, feed_pending

REPO = Path(__file__).resolve().parents[1]
BASE = dict(device="cpu", max_batch_size=16, max_seq_len=64, block_size=4)


def cfg(overlap: bool, **kw: object) -> EngineConfig:
    return EngineConfig(**{**BASE, **kw, "overlap_schedule": overlap})  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two debug-model versions (char tokenizer) with spread-out next-token distributions."""
    return spread_debug_versions(tmp_path_factory.mktemp("overlap"))


def req(prompt: list[int], **sampling: object) -> GenerateRequest:
    return GenerateRequest(input_ids=prompt, sampling=SamplingParams(**sampling))  # type: ignore[arg-type]


PROMPTS = [list(range(3, 3 + n)) for n in (3, 9, 1, 17)] + [[7, 7, 8, 9, 10, 11]]


def mixed(max_tokens: int = 12) -> list[GenerateRequest]:
    """Greedy, seeded (top-p, top-k, n > 1: forks), top-n log-probs, stop tokens, EOS."""
    return [
        req(PROMPTS[0], temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
        req(PROMPTS[1], temperature=1.0, top_p=0.9, seed=4, n=3, max_tokens=max_tokens, ignore_eos=True),
        req(PROMPTS[2], temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=3),
        req(PROMPTS[3], temperature=0.7, top_k=20, seed=9, n=2, max_tokens=max_tokens, ignore_eos=True),
        # finishes early on a stop token (its step's successor already got one more token: discarded)
        req(PROMPTS[4], temperature=1.0, seed=1, max_tokens=max_tokens, stop_token_ids=list(range(20, 26))),
        req(PROMPTS[1], temperature=1.0, seed=7, n=2, max_tokens=max_tokens),  # EOS may end it
    ]


def run(engine: LLMEngine, reqs: list[GenerateRequest]) -> list[GenerateResponse]:
    out = engine.generate(reqs)
    assert not engine.has_work() and not engine.in_flight
    assert engine.kv.num_free == engine.kv.num_blocks  # every page freed, discarded tokens' too
    return out


def identical(a: list[GenerateResponse], b: list[GenerateResponse]) -> None:
    """Everything discrete equal: token ids, versions, finish reasons, text, stop strings, routed
    experts, top-n ids. Log-probs to 1e-5: a step that carries a discarded token has one row more
    than without overlap, and a CPU GEMM need not round the other rows identically (here they do)."""
    for x, y in zip(a, b, strict=True):
        for cx, cy in zip(x.choices, y.choices, strict=True):
            assert cx.output_ids == cy.output_ids and cx.versions == cy.versions
            assert cx.finish_reason == cy.finish_reason
            assert (cx.text, cx.stop_str, cx.routed_experts) == (cy.text, cy.stop_str, cy.routed_experts)
            assert cx.logprobs == pytest.approx(cy.logprobs, abs=1e-5)
            assert (cx.top_logprobs is None) == (cy.top_logprobs is None)
            for tx, ty in zip(cx.top_logprobs or [], cy.top_logprobs or [], strict=True):
                assert [t for t, _ in tx] == [t for t, _ in ty]
                assert [v for _, v in tx] == pytest.approx([v for _, v in ty], abs=1e-5)


def test_overlap_gives_the_same_outputs(dirs: tuple[Path, Path]) -> None:
    reqs = mixed()
    off, on = LLMEngine(dirs[0], cfg(False)), LLMEngine(dirs[0], cfg(True))
    a, b = run(off, reqs), run(on, reqs)
    identical(a, b)
    reasons = {c.finish_reason for r in a for c in r.choices}
    assert reasons == {"length", "stop"}  # both kinds of ending are covered
    assert a[2].choices[0].top_logprobs is not None and len(a[2].choices[0].top_logprobs[0]) == 3
    assert on.stats.generated_tokens_total == off.stats.generated_tokens_total


def test_finished_sequence_extra_token_is_discarded(dirs: tuple[Path, Path]) -> None:
    """A stop-token finish is known only when its token lands, after the next step was launched:
    that step computed one more token for it, which is never emitted. A max_tokens finish is known
    in advance and costs nothing."""
    greedy = run(LLMEngine(dirs[0], cfg(False)), [req(PROMPTS[3], temperature=0.0, max_tokens=12)])
    ids = greedy[0].choices[0].output_ids
    stop_at = 5
    stopper = req(PROMPTS[3], temperature=0.0, max_tokens=12, stop_token_ids=[ids[stop_at]])
    k = ids.index(ids[stop_at])  # the first occurrence ends it
    computed = {}
    for overlap in (False, True):
        eng = LLMEngine(dirs[0], cfg(overlap))
        [out] = run(eng, [stopper])
        ch = out.choices[0]
        assert ch.finish_reason == "stop" and ch.output_ids == ids[: k + 1]
        assert len(ch.logprobs) == len(ch.versions) == k + 1
        computed[overlap] = eng.stats.computed_tokens_total
    assert computed[True] == computed[False] + 1  # the discarded token's forward
    # length finishes: no extra forward with overlap on
    lengths = {}
    for overlap in (False, True):
        eng = LLMEngine(dirs[0], cfg(overlap))
        run(eng, [req(PROMPTS[3], temperature=0.0, max_tokens=12, ignore_eos=True)])
        lengths[overlap] = eng.stats.computed_tokens_total
    assert lengths[True] == lengths[False]


def test_stop_strings_and_detokenize(dirs: tuple[Path, Path]) -> None:
    probe = LLMEngine(dirs[0], cfg(False))
    assert probe.tokenizer is not None
    prompt = probe.tokenizer.encode("abc: ", add_special_tokens=False).ids
    base = dict(temperature=1.0, seed=11, max_tokens=30, ignore_eos=True)
    full = run(probe, [req(prompt, **base, detokenize=True)])
    text = full[0].choices[0].text
    assert text is not None and len(text) > 21 and len(set(text)) > 5  # some ids print nothing
    stops = [text[8:10], text[20:21]]  # a stop string spanning two tokens, and a one-token one
    reqs = [
        req(prompt, **base, stop=stops),
        req(prompt, temperature=0.0, max_tokens=30, stop=[text[4:5]], detokenize=True),
        req(prompt, **base, detokenize=True),
    ]
    a = run(LLMEngine(dirs[0], cfg(False)), reqs)
    b = run(LLMEngine(dirs[0], cfg(True)), reqs)
    identical(a, b)
    assert a[0].choices[0].finish_reason == "stop" and a[0].choices[0].stop_str in stops


def test_abort_mid_generation(dirs: tuple[Path, Path]) -> None:
    reqs = [req(p, temperature=0.0, max_tokens=20, ignore_eos=True) for p in PROMPTS[:3]]
    ref = run(LLMEngine(dirs[0], cfg(False)), reqs)
    eng = LLMEngine(dirs[0], cfg(True))
    states = [eng.add_request(r) for r in reqs]
    for _ in range(6):
        eng.step()
    assert eng.in_flight
    eng.abort(states[1])
    kept = list(states[1].seqs[0].output)
    while eng.has_work():
        eng.step()
    out = states[1].response().choices[0]
    # nothing lands after the abort (the in-flight token of the aborted request is discarded)
    assert out.finish_reason == "abort" and out.output_ids == kept
    assert kept == ref[1].choices[0].output_ids[: len(kept)] and len(kept) >= 4
    assert len(out.logprobs) == len(out.versions) == len(kept)
    identical([states[0].response(), states[2].response()], [ref[0], ref[2]])
    assert eng.kv.num_free == eng.kv.num_blocks


def test_preemption(dirs: tuple[Path, Path]) -> None:
    """A pool too small for everyone: sequences are preempted and recomputed (never one whose token
    is in flight). Pages free one step later with overlap, so who is preempted when may differ:
    the tokens may not, log-probs only by float rounding (recompute vs decode, as without overlap)."""
    reqs = mixed(16)
    outs = {}
    for overlap in (False, True):
        eng = LLMEngine(dirs[0], cfg(overlap, num_kv_blocks=12))
        outs[overlap] = run(eng, reqs)
        assert eng.stats.preemptions_total > 0
    for x, y in zip(outs[False], outs[True], strict=True):
        for cx, cy in zip(x.choices, y.choices, strict=True):
            assert cx.output_ids == cy.output_ids and cx.finish_reason == cy.finish_reason
            assert cx.logprobs == pytest.approx(cy.logprobs, abs=1e-5)


def test_prefix_caching(dirs: tuple[Path, Path]) -> None:
    shared = list(range(3, 22))
    wave1 = [req(shared + [30], temperature=0.0, max_tokens=9, ignore_eos=True)]
    wave2 = [
        req(shared + [31, 32], temperature=1.0, seed=2, max_tokens=9, ignore_eos=True),
        req(shared + [30], temperature=0.0, max_tokens=6, stop_token_ids=[40, 41, 42]),
    ]
    res = {}
    for overlap in (False, True):
        eng = LLMEngine(dirs[0], cfg(overlap))
        res[overlap] = (run(eng, wave1), run(eng, wave2), eng.stats.prefix_cache_hit_tokens)
    assert res[True][2] == res[False][2] > 0
    identical(res[False][0], res[True][0])
    identical(res[False][1], res[True][1])


def test_weight_update_between_steps(dirs: tuple[Path, Path]) -> None:
    """The step in flight when weights are swapped was computed by the old ones and is tagged so."""
    reqs = [req(p, temperature=1.0, seed=i, max_tokens=14, ignore_eos=True) for i, p in enumerate(PROMPTS)]
    out = {}
    for overlap in (False, True):
        eng = LLMEngine(dirs[0], cfg(overlap))
        states = [eng.add_request(r) for r in reqs]
        for _ in range(5):
            eng.step()
        eng.load_weights(dirs[1], 1)
        while eng.has_work():
            eng.step()
        out[overlap] = [s.response().choices for s in states]
    assert out[True] == out[False]
    versions = out[True][0][0].versions
    assert versions[0] == 0 and versions[-1] == 1


def test_tiny_qwen3(tmp_path: Path) -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        rope_theta=1000000.0,
        eos_token_id=1,
        bos_token_id=2,
        pad_token_id=0,
    )
    hf = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():  # peaked distributions (see test_engine_hf_parity)
            p.copy_(1 + 0.3 * torch.randn_like(p)) if "norm" in name else p.normal_(0, 0.12)
    hf.save_pretrained(tmp_path)
    prompts = [[5, 9, 14, 3], list(range(10, 40)), [7]]
    reqs = [
        req(prompts[0], temperature=0.0, max_tokens=24),
        req(prompts[1], temperature=1.0, seed=5, n=2, max_tokens=24),
        req(prompts[2], temperature=0.8, top_p=0.95, seed=6, max_tokens=24, logprobs=2),
    ]
    a = run(LLMEngine(tmp_path, cfg(False, max_seq_len=128)), reqs)
    b = run(LLMEngine(tmp_path, cfg(True, max_seq_len=128)), reqs)
    identical(a, b)
    # a stop token mid-way (greedy), and a pool small enough to preempt
    stop = a[0].choices[0].output_ids[9]
    reqs.append(req(prompts[0], temperature=0.0, max_tokens=24, ignore_eos=True, stop_token_ids=[stop]))
    outs = {}
    for overlap in (False, True):
        eng = LLMEngine(tmp_path, cfg(overlap, max_seq_len=128, num_kv_blocks=16))
        outs[overlap] = run(eng, reqs)
        assert eng.stats.preemptions_total > 0
    identical(outs[False], outs[True])
    assert outs[True][-1].choices[0].finish_reason == "stop"


def test_moe_routed_experts(tmp_path: Path) -> None:
    """Routed expert ids are read from a finishing sequence's pages when its last token lands: with
    overlap the next step (its discarded token) is already queued, and the ids must not change."""
    from helpers.hf_random import randomize
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=256,
        eos_token_id=1,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    randomize(Qwen3MoeForCausalLM(config), seed=7).save_pretrained(tmp_path)
    probe = run(
        LLMEngine(tmp_path, cfg(False, max_seq_len=128)), [req([5, 6, 7, 8], temperature=0.0, max_tokens=16)]
    )
    stop = probe[0].choices[0].output_ids[6]

    def reqs() -> list[GenerateRequest]:
        params = [
            SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=[stop]),
            SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=10, ignore_eos=True),
        ]
        prompts = [[5, 6, 7, 8], list(range(20, 37))]
        return [
            GenerateRequest(input_ids=p, sampling=sp, return_routed_experts=True)
            for p, sp in zip(prompts, params, strict=True)
        ]

    a = run(LLMEngine(tmp_path, cfg(False, max_seq_len=128)), reqs())
    b = run(LLMEngine(tmp_path, cfg(True, max_seq_len=128)), reqs())
    # Here the discarded token shares one step's expert GEMMs (tokens grouped per expert) with the
    # others, and their log-probs do move by float rounding: identical() allows 1e-5.
    identical(a, b)
    assert a[0].choices[0].finish_reason == "stop" and a[0].choices[0].routed_experts is not None


def test_async_engine_pause_lands_the_step_in_flight(dirs: tuple[Path, Path]) -> None:
    async def scenario() -> None:
        eng = AsyncEngine(LLMEngine(dirs[0], cfg(True))).start()
        try:
            reqs = [req(p, temperature=0.0, max_tokens=8, ignore_eos=True) for p in PROMPTS]
            outs = await asyncio.gather(*(eng.submit(r) for r in reqs))
            ref = LLMEngine(dirs[0], cfg(False)).generate(reqs)
            identical(list(outs), ref)
            long = asyncio.ensure_future(eng.submit(req(PROMPTS[1], max_tokens=40, ignore_eos=True)))
            while (
                eng.engine.stats.generated_tokens_total < sum(len(o.choices[0].output_ids) for o in outs) + 3
            ):
                await asyncio.sleep(0.001)
            await asyncio.to_thread(eng.pause)
            assert not eng.engine.in_flight  # paused: nothing pending on the device
            n = len(next(iter(eng._waiters)).seqs[0].output)
            await asyncio.sleep(0.05)
            assert len(next(iter(eng._waiters)).seqs[0].output) == n
            eng.resume()
            assert len((await asyncio.wait_for(long, 10)).choices[0].output_ids) == 40
        finally:
            eng.stop()

    asyncio.run(scenario())


def test_stop_lands_the_step_in_flight(dirs: tuple[Path, Path]) -> None:
    """A request whose last token is still on the device when the engine stops ends as it did
    ("length", every token), not as aborted one token short."""
    engine = LLMEngine(dirs[0], cfg(True))
    eng = AsyncEngine(engine)  # not started: the test does the loop's work by hand
    fut: Future[GenerateResponse] = Future()
    state = engine.add_request(req(PROMPTS[0], temperature=0.0, max_tokens=5, ignore_eos=True))
    eng._waiters[state] = fut
    while len(state.seqs[0].output) < 4:
        assert not engine.step()  # nothing finishes before the 5th token lands
    assert engine.in_flight  # the 5th token is sampled, not yet on the host
    eng._shutdown()
    out = fut.result(timeout=1).choices[0]
    assert out.finish_reason == "length" and len(out.output_ids) == 5
    ref = LLMEngine(dirs[0], cfg(False)).generate(
        [req(PROMPTS[0], temperature=0.0, max_tokens=5, ignore_eos=True)]
    )
    assert out.output_ids == ref[0].choices[0].output_ids and not engine.in_flight


TRITON_CHILD = """
import sys
from pathlib import Path
from services.common.config import EngineConfig
from services.common.schemas import GenerateRequest, SamplingParams
from services.engine import LLMEngine

base = dict(device="cpu", max_batch_size=8, max_seq_len=96, block_size=4, max_num_batched_tokens=24,
            attention_backend="triton")
reqs = [
    GenerateRequest(input_ids=list(range(3, 3 + n)), sampling=SamplingParams(
        temperature=0.0 if i % 2 else 1.0, max_tokens=8, seed=i, ignore_eos=True,
        stop_token_ids=[40] if i == 2 else []))
    for i, n in enumerate((5, 30, 1, 17))
]
out = [LLMEngine(Path(sys.argv[1]), EngineConfig(**base, overlap_schedule=o)).generate(reqs) for o in (False, True)]
for a, b in zip(*out):
    assert a.choices[0].output_ids == b.choices[0].output_ids, (a, b)
    assert max(abs(x - y) for x, y in zip(a.choices[0].logprobs, b.choices[0].logprobs)) < 1e-5
print("same")
"""


def test_triton_paged_path_in_child_process(dirs: tuple[Path, Path]) -> None:
    """The paged-kernel path (Triton interpreter on CPU; its eager batch gets the pending tokens
    through feed_pending): chunked prefill, mixed and decode-only steps, the same tokens as without
    overlap. A child process, since the interpreter must be set before triton's first import."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", TRITON_CHILD, str(dirs[0])],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0 and "same" in proc.stdout, proc.stderr[-3000:]


def test_feed_pending_writes_only_the_pending_rows() -> None:
    """The device-side feed: graph input buffers and the eager paged batch (one shared buffer)."""
    spans = [Span([0, 1], 5, [0]), Span([2], 2, [11]), Span([3, 4], 6, [0])]
    hb = HostBatch.build(spans, 4)
    feed = Feed(dst=[0, 2], src=[1, 0], tokens=torch.tensor([70, 80, 90]))
    buf = InputBuffers(4, 8, 8, torch.device("cpu"))
    buf.fill(hb, 4, None, 8)
    buf.dev.copy_(buf.host)
    before = buf.dev.clone()
    feed_pending(buf.ids, feed)
    assert buf.ids[:3].tolist() == [80, 11, 70] and buf.ids[3].item() == 0
    changed = np.flatnonzero((buf.dev != before).numpy())
    assert changed.tolist() == [0, 2]  # positions, slots, tables untouched
    batch = hb.to_forward_batch(torch.device("cpu"), 2, 4)
    positions = batch.positions.clone()
    feed_pending(batch.input_ids, feed)
    assert batch.input_ids.tolist() == [80, 11, 70] and torch.equal(batch.positions, positions)
    feed_pending(batch.input_ids, None)  # nothing pending: a no-op
    assert batch.input_ids.tolist() == [80, 11, 70]


def test_overlap_schedule_is_on_with_cuda_only_by_default(dirs: tuple[Path, Path]) -> None:
    assert EngineConfig().overlap_schedule == "auto"
    assert LLMEngine(dirs[0], EngineConfig(device="cpu")).overlap is False
    assert LLMEngine(dirs[0], EngineConfig(device="cpu", overlap_schedule=True)).overlap is True


def test_prefill_steps_are_timed_when_they_land(
    dirs: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With overlap scheduling a step's call time is its launch plus the previous step's landing,
    so a prefill step is timed as the period between the landing before it and its own (what the
    KV-pull policy divides prefill tokens by): the same prefill tokens as without overlap, and a
    prefill time no shorter than the forward of those tokens takes on its own."""
    import time

    prompts = [list(range(3, 3 + n)) for n in (40, 9, 25)]
    reqs = [
        GenerateRequest(input_ids=p, sampling=SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        for p in prompts
    ]
    tokens = {}
    for overlap in (False, True):
        eng = LLMEngine(dirs[0], cfg(overlap, enable_prefix_caching=False))
        assert eng.overlap is overlap
        eng.generate(reqs)
        tokens[overlap] = eng.stats.prefill_step_tokens_total
        assert eng.stats.prefill_step_seconds_total > 0 and eng._prefill_lag is None
    assert tokens[True] == tokens[False] == sum(map(len, prompts))
    # Make the landing slow, as the wait for a GPU's tokens is: the prefill step's time must
    # include the wait for its own tokens (the old call-time measure gave it only its launch).
    from services.engine.layers.sampler import PendingSample

    resolve = PendingSample.resolve

    def slow(self):  # noqa: ANN001, ANN202 - the real resolve, 50 ms later
        time.sleep(0.05)
        return resolve(self)

    monkeypatch.setattr(PendingSample, "resolve", slow)
    eng = LLMEngine(dirs[0], cfg(True, enable_prefix_caching=False))
    eng.generate(reqs[:1])
    assert eng.stats.prefill_step_seconds_total >= 0.05
