"""Nemotron-H (nemotron_h) in the inference engine (services/engine/models/nemotron_h.py, the Mamba-2
state cache services/engine/state_cache.py) against the trainer's forward (trainer/nemotron.py) on
the same published weights, float32 on CPU: sequences of different lengths batched together with
chunked prefill, one joining mid-way, a request of several samples (forked states), preemption
(recomputed states) and overlap scheduling; greedy tokens and log-probs equal the trainer's
teacher-forced ones (and transformers' NemotronHForCausalLM's), and the trainer routing on its own
picks every expert set the engine recorded."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.moe import choice_sample, nemotron_model, small_nemotron

from services.common.config import EngineConfig, ModelConfig
from services.common.schemas import GenerateRequest, SamplingParams
from services.engine import LLMEngine
from services.engine.sequence import RequestState
from trainer.batch import micro_batches
from trainer.loss import token_logprobs
from trainer.model import save_weights_dir
from trainer.replay import micro_batch_routes, routing

TOL = 1e-5  # float32 log-probs, engine vs trainer

PROMPTS = [
    [5, 9, 14, 20, 3, 7, 11],
    [30, 31, 2, 8, 11, 12, 40, 41, 13, 50, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20],
    [3],
    [44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55],
]
LATE = [60, 61, 62, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]  # joins after 4 steps


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> tuple[ModelConfig, torch.nn.Module, Path]:
    m = small_nemotron()
    model = nemotron_model(m, seed=3)
    d = save_weights_dir(m, model.state_dict(), tmp_path_factory.mktemp("w") / "step_0", {"version": 0})
    return m, model, d


def run_engine(d: Path, m: ModelConfig, **cfg: object) -> tuple[list[tuple[list[int], RequestState]], int]:
    """The prompts greedy (one with 2 samples at temperature 1), LATE added after 4 steps; the
    steps feed at most 8 tokens, so prompts are prefilled in chunks beside running decodes.
    Returns each prompt with its request, and the preemptions."""
    base: dict[str, object] = dict(
        device="cpu", max_batch_size=8, max_seq_len=m.max_seq_len, block_size=4, max_num_batched_tokens=8
    )
    eng = LLMEngine(d, EngineConfig(**(base | cfg)))
    assert not eng.scheduler.prefix_caching and eng.kv.states is not None
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    twice = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, seed=7, n=2)

    def add(p: list[int], params: SamplingParams) -> tuple[list[int], RequestState]:
        return p, eng.add_request(GenerateRequest(input_ids=p, sampling=params, return_routed_experts=True))

    runs = [add(p, twice if i == 0 else greedy) for i, p in enumerate(PROMPTS)]
    for _ in range(4):
        eng.step()
    runs.append(add(LATE, greedy))
    while not all(s.finished for _, s in runs):
        eng.step()
    eng.flush()
    assert eng.kv.states.num_free == eng.kv.states.slots  # every slot given back
    return runs, eng.stats.preemptions_total


def check_against_trainer(
    model: torch.nn.Module, m: ModelConfig, runs: list[tuple[list[int], RequestState]]
) -> None:
    samples = []
    for i, (prompt, state) in enumerate(runs):
        for j, c in enumerate(state.response().choices):
            assert len(c.output_ids) == 10
            samples.append(choice_sample(f"s{i}.{j}", prompt, c))
            if state.seqs[0].params.temperature > 0:
                continue
            # Greedy: each token is the trainer's argmax given the tokens before it.
            with torch.no_grad():
                logits = model(torch.tensor([prompt + c.output_ids]))[0]
            best = logits[len(prompt) - 1 : -1].argmax(-1).tolist()
            assert best == c.output_ids, (i, best, c.output_ids)
    (mb,) = micro_batches(samples, 10_000)
    (routes,) = micro_batch_routes(samples, m, False, 10_000)
    with torch.no_grad(), routing(model, routes, replay=False) as rec:
        logp, _ = token_logprobs(model, mb.tokens)
    mask = mb.loss_mask > 0
    assert mask.sum().item() == 10 * len(samples)
    torch.testing.assert_close(logp[mask], mb.logp_infer[mask], rtol=0, atol=TOL)
    # Routing on its own, the trainer picks every top-k set the engine recorded.
    assert rec.total.sum().item() > 0 and torch.equal(rec.agree, rec.total)


def test_engine_equals_trainer_nemotron(published: tuple[ModelConfig, torch.nn.Module, Path]) -> None:
    m, model, d = published
    runs, _ = run_engine(d, m)
    assert [len(s.seqs) for _, s in runs] == [2, 1, 1, 1, 1]
    a, b = runs[0][1].response().choices
    assert a.output_ids != b.output_ids  # two samples from one forked state, drawing differently
    check_against_trainer(model, m, runs)
    # And transformers' NemotronHForCausalLM (its torch Mamba path) on the same directory.
    from transformers import NemotronHForCausalLM

    hf = NemotronHForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
    for prompt, state in runs:
        for c in state.response().choices:
            x = torch.tensor([prompt + c.output_ids])
            with torch.no_grad():
                logp = hf(input_ids=x[:, :-1]).logits.log_softmax(-1).gather(-1, x[:, 1:, None])[0, :, 0]
            torch.testing.assert_close(logp[len(prompt) - 1 :], torch.tensor(c.logprobs), rtol=0, atol=TOL)


def test_preempted_and_overlapped_nemotron(published: tuple[ModelConfig, torch.nn.Module, Path]) -> None:
    """A pool too small for every sequence at once: the newest are preempted (their slots freed,
    their states recomputed from zero on readmission); with overlap scheduling the states advance
    in step order too. Same tokens as without either, and the trainer's log-probs."""
    m, model, d = published
    plain, _ = run_engine(d, m)
    for cfg in ({"num_kv_blocks": 14}, {"overlap_schedule": True}):
        runs, preempted = run_engine(d, m, **cfg)
        assert (preempted > 0) == ("num_kv_blocks" in cfg)
        for (_, x), (_, y) in zip(plain, runs, strict=True):
            assert [c.output_ids for c in x.response().choices] == [
                c.output_ids for c in y.response().choices
            ]
        check_against_trainer(model, m, runs)


def test_aborted_sequences_give_their_state_slots_back(
    published: tuple[ModelConfig, torch.nn.Module, Path],
) -> None:
    """An abort mid-generation frees the request's slots at once (2 samples: 2 slots); the other
    request's state is untouched (its greedy tokens equal a run of its own)."""
    m, _, d = published
    cfg = EngineConfig(device="cpu", max_batch_size=4, max_seq_len=m.max_seq_len, block_size=4)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    (alone,) = LLMEngine(d, cfg).generate([GenerateRequest(input_ids=PROMPTS[1], sampling=greedy)])
    eng = LLMEngine(d, cfg)
    states = eng.kv.states
    assert states is not None
    many = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seed=1, n=2)
    dropped = eng.add_request(GenerateRequest(input_ids=PROMPTS[0], sampling=many))
    kept = eng.add_request(GenerateRequest(input_ids=PROMPTS[1], sampling=greedy))
    for _ in range(3):
        eng.step()
    assert states.num_free == 1  # 2 samples + 1
    eng.abort(dropped)
    assert states.num_free == 3
    while not kept.finished:
        eng.step()
    assert kept.response().choices[0].output_ids == alone.choices[0].output_ids
    assert states.num_free == 4
