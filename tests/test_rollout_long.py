"""Long multi-turn rollouts through the orchestrator's RolloutRunner (services/orchestrator/rollout.py)
against a scripted policy and an in-process episode: 300 turns with exact token accounting
(sample tokens = prompt + each turn's engine ids + each observation's ids, masks to match), the
turn and context budgets stopping with their reasons, and bounded time and memory."""

from __future__ import annotations

import asyncio
import time
import tracemalloc
from dataclasses import dataclass

from services.common.config import RunConfig
from services.common.schemas import (
    GenerateChoice,
    GenerateRequest,
    GenerateResponse,
    ScoreResponse,
    StepResponse,
)
from services.common.tokenizer import build_char_tokenizer, eos_id
from services.orchestrator.rollout import GroupSpec, RolloutRunner

TOK = build_char_tokenizer()
EOS = eos_id(TOK)
PROMPT = "count:"
OBS = "\nok:"


class ScriptedDecode:
    """Each turn answers the turn number's digits then EOS; records what it was sent."""

    def __init__(self) -> None:
        self.calls = 0
        self.max_input = 0

    async def generate(self, req: GenerateRequest, prefer: str | None = None) -> tuple[str, GenerateResponse]:
        self.calls += 1
        self.max_input = max(self.max_input, len(req.input_ids))
        text = TOK.decode(req.input_ids)
        turn = text.count(OBS)
        ids = [*TOK.encode(str(turn % 97)).ids, EOS]
        choice = GenerateChoice(
            output_ids=ids, logprobs=[-0.5] * len(ids), versions=[3] * len(ids), finish_reason="stop"
        )
        return "fake://decode", GenerateResponse(
            request_id="r", prompt_tokens=len(req.input_ids), choices=[choice] * req.sampling.n
        )


@dataclass
class Created:
    prompt: str


class Session:
    def __init__(self, turns: int):
        self.turns = turns
        self.steps: list[tuple[str, bool]] = []
        self.closed = False
        self.created = Created(PROMPT)

    @property
    def prompt(self) -> str:
        return PROMPT

    async def step(self, action: str, eos: bool) -> StepResponse:
        self.steps.append((action, eos))
        done = len(self.steps) >= self.turns
        right = all(a == str(i % 97) for i, (a, _) in enumerate(self.steps))
        return StepResponse(observation="" if done else OBS, done=done, reward=float(right) if done else None)

    async def score(self) -> ScoreResponse:
        self.closed = True
        return ScoreResponse(reward=0.5, info={})

    async def close(self) -> None:
        self.closed = True


class Sandbox:
    def __init__(self, turns: int):
        self.turns = turns
        self.sessions: list[Session] = []

    async def open_group(self, env: str, seed: int, n: int) -> list[Session]:
        self.sessions = [Session(self.turns) for _ in range(n)]
        return self.sessions


def runner(turns: int, max_turns: int, max_len: int) -> tuple[RolloutRunner, ScriptedDecode, Sandbox]:
    cfg = RunConfig()
    cfg.orchestrator.max_turns = max_turns
    cfg.orchestrator.group_size = 2
    cfg.orchestrator.sampling.max_tokens = 4
    cfg.model.max_seq_len = max_len
    cfg.decode.engine.max_seq_len = max_len
    decode, sandbox = ScriptedDecode(), Sandbox(turns)
    return RolloutRunner(cfg, decode, sandbox, TOK, EOS), decode, sandbox  # type: ignore[arg-type]


def expected_tokens(turns: int) -> tuple[list[int], list[int]]:
    tokens = list(TOK.encode(PROMPT).ids)
    mask = [0] * len(tokens)
    for t in range(turns):
        out = [*TOK.encode(str(t % 97)).ids, EOS]
        tokens += out
        mask += [1] * len(out)
        if t < turns - 1:
            obs = TOK.encode(OBS).ids
            tokens += obs
            mask += [0] * len(obs)
    return tokens, mask


def test_300_turn_rollout_exact_accounting_bounded() -> None:
    r, decode, sandbox = runner(turns=300, max_turns=300, max_len=8192)
    tracemalloc.start()
    t0 = time.perf_counter()
    group = asyncio.run(r.run(GroupSpec("g0", "count", 0)))
    took = time.perf_counter() - t0
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    tokens, mask = expected_tokens(300)
    for s, sess in zip(group.samples, sandbox.sessions, strict=True):
        assert s.turns == 300 and s.finish_reason == "done" and s.reward == 1.0
        assert s.tokens == tokens and s.loss_mask == mask  # exactly what the engine saw and sampled
        assert len(s.logprobs) == len(s.versions) == len(tokens)
        assert all(lp == -0.5 for lp, m in zip(s.logprobs, s.loss_mask, strict=True) if m)
        assert all(v == -1 for v, m in zip(s.versions, s.loss_mask, strict=True) if not m)
        assert [eos for _, eos in sess.steps] == [True] * 300
    # one shared first turn for the group, then one request per sample per turn
    assert decode.calls == 1 + 2 * 299 and decode.max_input == len(tokens) - 2
    assert took < 30, took
    assert peak < 64 << 20, peak  # bytes; the trajectories themselves are a few hundred KB


def test_turn_budget_stops_with_reason() -> None:
    r, _, sandbox = runner(turns=300, max_turns=50, max_len=8192)
    group = asyncio.run(r.run(GroupSpec("g1", "count", 0)))
    for s, sess in zip(group.samples, sandbox.sessions, strict=True):
        assert s.turns == 50 and s.finish_reason == "max_turns" and s.reward == 0.5
        assert len(sess.steps) == 50 and sess.closed


def test_context_budget_stops_with_reason() -> None:
    r, decode, _ = runner(turns=300, max_turns=300, max_len=200)
    group = asyncio.run(r.run(GroupSpec("g2", "count", 0)))
    for s in group.samples:
        assert s.finish_reason == "context" and s.turns < 300
        assert len(s.tokens) + 4 <= 200  # room for one more turn was never promised past the budget
        assert s.loss_mask[-1] == 1  # ends on a model turn: the observation that did not fit is left out
    assert decode.max_input <= 200 - 4
