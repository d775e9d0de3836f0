"""Sampler extensions (min-p, top-n log-probs, bf16 extremes) and stop strings, which the engine
detects on the incrementally detokenised output."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from services.common.config import EngineConfig, load_config
from services.common.schemas import GenerateRequest, SamplingParams
from services.engine import InvalidRequest, LLMEngine
from services.engine.detokenizer import IncrementalDetokenizer, OutputText
from services.engine.layers.sampler import Sampler
from trainer.model import build_model, save_weights_dir

# ------------------------------------------------------------------ sampler


def test_min_p_keeps_tokens_at_least_min_p_of_the_best() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.12, 0.08]])  # min_p 0.2 -> threshold 0.1: drops the last
    p = SamplingParams(min_p=0.2)
    seen = set()
    for seed in range(300):
        (t,), (lp,) = Sampler()(probs.log(), [p], [random.Random(seed)])
        seen.add(t)
        # renormalised over the surviving 0.92
        assert math.isclose(lp, math.log(probs[0, t].item() / 0.92), abs_tol=1e-6)
    assert seen == {0, 1, 2}


def test_min_p_applies_after_temperature() -> None:
    """At T=2 the distribution flattens, so a token min_p drops at T=1 survives."""
    logits = torch.tensor([[4.0, 0.0, -10.0]])
    p1 = SamplingParams(min_p=0.05, temperature=1.0)
    p2 = SamplingParams(min_p=0.05, temperature=2.0)
    seen1 = {Sampler()(logits, [p1], [random.Random(s)])[0][0] for s in range(400)}
    seen2 = {Sampler()(logits, [p2], [random.Random(s)])[0][0] for s in range(400)}
    assert seen1 == {0}  # exp(-4) = 0.018 < 0.05
    assert seen2 == {0, 1}  # exp(-2) = 0.135 >= 0.05; exp(-7) for the third is not


def test_top_n_logprobs_equal_log_softmax_top_n() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(5)) * 3
    params = [
        SamplingParams(logprobs=5),
        SamplingParams(temperature=0.5, top_k=3, logprobs=7),
        SamplingParams(),  # did not ask
        SamplingParams(temperature=0.0, logprobs=0),
    ]
    out = Sampler().sample(logits, params, [random.Random(i) for i in range(4)])
    ref = torch.log_softmax(logits, dim=-1)
    for row, n in ((0, 5), (1, 7)):
        top = out.top[row]
        assert top is not None and len(top) == n
        values, ids = ref[row].topk(n)
        assert [t for t, _ in top] == ids.tolist()
        assert [v for _, v in top] == pytest.approx(values.tolist(), abs=1e-6)
    assert out.top[2] is None
    assert out.top[3] == []


def test_bf16_extreme_logits_give_no_nan() -> None:
    big = torch.finfo(torch.bfloat16).max
    logits = torch.tensor(
        [
            [big, -big, 0.0, 1.0],
            [float("inf"), big, float("-inf"), 0.0],
            [float("nan"), float("nan"), 1.0, 0.0],
            [float("-inf")] * 4,
            [big, big, big, big],
        ],
        dtype=torch.bfloat16,
    )
    for params in (
        SamplingParams(temperature=0.0, logprobs=2),
        SamplingParams(temperature=1.0, logprobs=2),
        SamplingParams(temperature=0.01, top_p=0.9, top_k=3, min_p=0.1, logprobs=4),
        SamplingParams(temperature=5.0, min_p=0.5, logprobs=4),
    ):
        out = Sampler().sample(logits, [params] * 5, [random.Random(i) for i in range(5)])
        assert all(math.isfinite(lp) and lp <= 0 for lp in out.logprobs), (params, out.logprobs)
        assert all(0 <= t < 4 for t in out.tokens)
        for top in out.top:
            assert top is not None and all(math.isfinite(v) for _, v in top)
        assert out.tokens[2] in (2, 3)  # NaN logits are never drawn
        if params.temperature == 0:
            assert out.tokens[:3] == [0, 0, 2]


# ------------------------------------------------------------------ detokenizer


def byte_bpe() -> Tokenizer:
    """A small byte-level BPE (the Llama-3 / Qwen tokenizer family): CJK characters and emoji
    span several tokens, so single tokens decode to half characters."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<eos>"]
    )
    tok.train_from_iterator(["hello world, the stop here END", "bonjour le monde"] * 20, trainer)
    return tok


def test_incremental_detokenizer_reassembles_split_characters() -> None:
    tok = byte_bpe()
    text = "hello 世界 🎉 wörld END"
    ids = tok.encode(text).ids
    assert len(ids) > len(text.split())  # multi-byte characters really are split
    d = IncrementalDetokenizer(tok, [])
    pieces = [d.push(t) for t in ids]
    assert "".join(pieces) + d.flush() == text
    assert all("\ufffd" not in p for p in pieces)


def test_output_text_cuts_at_stop_string_spanning_tokens() -> None:
    tok = byte_bpe()
    prompt = tok.encode("hello").ids
    ids = tok.encode(" world, 世界 the stop here").ids
    out = OutputText(tok, prompt, ["界 th", "zzz"])
    stopped_at = next(i for i, t in enumerate(ids) if out.push(t))
    assert out.text == " world, 世"
    assert out.stop_str == "界 th"
    # it stopped at the token that completed the stop string, not earlier or later
    full = tok.decode(ids[: stopped_at + 1])
    assert "界 th" in full and "界 th" not in tok.decode(ids[:stopped_at])


# ------------------------------------------------------------------ engine


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> LLMEngine:
    m = load_config("debug").model  # char tokenizer: every character is one token
    state = build_model(m, seed=3).state_dict()
    state["norm.weight"] = state["norm.weight"] * 0.3  # spread-out distributions (see test_engine)
    d = save_weights_dir(m, state, tmp_path_factory.mktemp("stop") / "w", {"version": 0})
    return LLMEngine(d, EngineConfig(device="cpu", max_batch_size=8, max_seq_len=64))


def encode(engine: LLMEngine, text: str) -> list[int]:
    assert engine.tokenizer is not None
    return engine.tokenizer.encode(text, add_special_tokens=False).ids


def test_stop_string_spanning_two_tokens(engine: LLMEngine) -> None:
    prompt = encode(engine, "abc: ")
    base = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, detokenize=True)
    [full] = engine.generate([GenerateRequest(input_ids=prompt, sampling=base)])
    text = full.choices[0].text
    assert text is not None and len(text) == 40  # char tokenizer: one character per token
    # a two-character stop string, i.e. spanning two tokens, first seen at position k
    k = 10
    stop = text[k : k + 2]
    k = text.find(stop)
    params = base.model_copy(update={"stop": [stop], "detokenize": False})
    [resp] = engine.generate([GenerateRequest(input_ids=prompt, sampling=params)])
    ch = resp.choices[0]
    assert ch.finish_reason == "stop" and ch.stop_str == stop
    assert ch.text == text[:k]
    # generation ended at the token completing the stop string; ids/logprobs stay aligned
    assert ch.output_ids == full.choices[0].output_ids[: k + 2]
    assert len(ch.logprobs) == len(ch.versions) == k + 2


def test_earliest_of_several_stop_strings_wins(engine: LLMEngine) -> None:
    prompt = encode(engine, "q=")
    base = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, detokenize=True)
    [full] = engine.generate([GenerateRequest(input_ids=prompt, sampling=base)])
    text = full.choices[0].text
    assert text is not None
    late, early = text[20:23], text[5:7]
    params = base.model_copy(update={"stop": [late, early]})
    [resp] = engine.generate([GenerateRequest(input_ids=prompt, sampling=params)])
    assert resp.choices[0].text == text[: text.find(early)]
    assert resp.choices[0].stop_str == early


def test_no_stop_hit_finishes_by_length_with_full_text(engine: LLMEngine) -> None:
    prompt = encode(engine, "x")
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=["~never~"])
    [resp] = engine.generate([GenerateRequest(input_ids=prompt, sampling=params)])
    ch = resp.choices[0]
    assert ch.finish_reason == "length" and ch.stop_str is None
    assert ch.text == engine.tokenizer.decode(ch.output_ids, skip_special_tokens=True)  # type: ignore[union-attr]


def test_engine_top_logprobs_match_model_distribution(engine: LLMEngine) -> None:
    prompt = encode(engine, "hello")
    params = SamplingParams(temperature=0.8, max_tokens=6, ignore_eos=True, logprobs=3, seed=1)
    [resp] = engine.generate([GenerateRequest(input_ids=prompt, sampling=params)])
    ch = resp.choices[0]
    assert ch.top_logprobs is not None and len(ch.top_logprobs) == 6
    # recompute each position's log_softmax with a fresh full forward (temperature 1: raw)
    tokens = prompt + ch.output_ids
    with torch.inference_mode():
        from services.engine.batch import ForwardBatch, Span

        n = engine.kv.blocks_for(engine.kv.max_seq_len)
        batch = ForwardBatch.build([Span(list(range(n)), 0, tokens)], engine.device, 64, engine.kv.block_size)
        ref = torch.log_softmax(engine.model.logits(engine.model(batch, engine.kv)).float(), -1)
    for i, top in enumerate(ch.top_logprobs):
        values, ids = ref[len(prompt) - 1 + i].topk(3)
        assert [t for t, _ in top] == ids.tolist()
        assert [v for _, v in top] == pytest.approx(values.tolist(), abs=1e-5)


def test_stop_without_tokenizer_is_rejected(tmp_path: Path) -> None:
    m = load_config("debug").model
    d = save_weights_dir(m, build_model(m, seed=0).state_dict(), tmp_path / "w", {"version": 0})
    (d / "tokenizer.json").unlink()
    eng = LLMEngine(d, EngineConfig(device="cpu", max_batch_size=2, max_seq_len=32))
    with pytest.raises(InvalidRequest) as e:
        eng.validate(GenerateRequest(input_ids=[5], sampling=SamplingParams(stop=["x"])))
    assert e.value.field == "sampling.stop"


def test_empty_stop_string_is_a_validation_error() -> None:
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=[""])
