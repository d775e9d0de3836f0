"""The agent loop's budgets (services/orchestrator/rollout.py): per-turn and per-rollout timeouts
over real HTTP (a real sandbox process serving the scripted environment below, a scripted decode
HTTP server, the orchestrator's own clients, its group runner and its Redis ledger), context
overflow (stop / truncate with a marker / max_tokens clamp), and per-turn CPU that stays flat
over a 300-turn rollout.

The scripted policy does what the context tells it: the text after the last "say:" is the next
answer ("a|b" gives the n samples of the first turn one each). Answers starting with "slow" take
SLOW_GEN_S to generate. The environment reacts to answers: "ok" is progress (3 end the episode),
"nap" sleeps NAP_S inside the step, "tick" sleeps TICK_S and is a little progress, "go" asks for
a slow answer next.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest
from aiohttp import web
from prometheus_client import REGISTRY

from services.common.auth import auth_headers
from services.common.bus import Bus
from services.common.config import RedisSection, RunConfig
from services.common.registry import Registry
from services.common.schemas import (
    GenerateChoice,
    GenerateRequest,
    GenerateResponse,
    ScoreResponse,
    ServiceInfo,
    StepResponse,
    WeightsInfo,
)
from services.common.tokenizer import build_char_tokenizer, eos_id
from services.orchestrator.clients import DecodeClient, Router, SandboxClient
from services.orchestrator.loop import Orchestrator
from services.orchestrator.rollout import (
    TRIM_MARKER,
    TRUNCATION_MARKER,
    GroupSpec,
    RolloutRunner,
    Trajectory,
)
from services.sandbox.envs import Environment, register_env

TOK = build_char_tokenizer()
EOS = eos_id(TOK)
ENV = "test-budgets"
SLOW_GEN_S = 3.0
NAP_S = 2.5
TICK_S = 0.25
# seed -> the first prompt: what each of the two samples answers first
PROMPTS = {0: "say:ok|nap", 1: "say:ok|go", 2: "say:tick|tick", 3: "say:slow|slow"}


@register_env(ENV)
class BudgetEnv(Environment):
    description = "scripted steps for the agent-loop budget tests"
    max_turns = 50

    def reset(self, seed: int) -> str:
        self.ok = 0
        self.ticks = 0
        return PROMPTS[seed]

    def step(self, action: str, eos: bool = True) -> tuple[str, bool]:
        if action == "ok":
            self.ok += 1
            return ("" if self.ok >= 3 else "\nsay:ok"), self.ok >= 3
        if action == "nap":
            time.sleep(NAP_S)
            return "\nsay:ok", False
        if action == "tick":
            time.sleep(TICK_S)
            self.ticks += 1
            return "\nsay:tick", False
        if action == "go":
            return "\nsay:slow", False
        return "\nsay:ok", False

    def score(self) -> float:
        return min(1.0, self.ok / 3 + self.ticks / 100)


# ------------------------------------------------------------------ real HTTP stack


Policy = Callable[[GenerateRequest], Awaitable[list[list[int]]]]


async def say_policy(req: GenerateRequest) -> list[list[int]]:
    """Answers what follows the last "say:" in the context (one "|"-separated item per sample)."""
    text = TOK.decode(req.input_ids)
    wants = text[text.rfind("say:") + 4 :].split("|")
    if any(w.startswith("slow") for w in wants[: req.sampling.n]):
        await asyncio.sleep(SLOW_GEN_S)
    return [[*TOK.encode(wants[i % len(wants)]).ids, EOS] for i in range(req.sampling.n)]


def scripted_decode_app(seen: list[GenerateRequest], policy: Policy, version: int = 0) -> web.Application:
    """A decode stand-in answering with `policy`'s tokens, tagged weight `version`."""

    async def generate(request: web.Request) -> web.Response:
        req = GenerateRequest.model_validate(await request.json())
        seen.append(req)
        choices = [
            GenerateChoice(
                output_ids=ids[: req.sampling.max_tokens],
                logprobs=[-0.1] * len(ids[: req.sampling.max_tokens]),
                versions=[version] * len(ids[: req.sampling.max_tokens]),
                finish_reason="stop",
            )
            for ids in await policy(req)
        ]
        resp = GenerateResponse(request_id="r", prompt_tokens=len(req.input_ids), choices=choices)
        return web.json_response(resp.model_dump(mode="json"))

    app = web.Application()
    app.router.add_post("/v1/generate", generate)
    return app


@pytest.fixture(scope="module")
def budget_sandbox(redis_server: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    from test_sandbox_service import Sandbox

    sb = Sandbox(tmp_path_factory.mktemp("budgets"), redis_server, plugins=["test_agent_budgets"])
    sb.wait_ready()
    yield sb
    sb.stop()


def budget_cfg(redis_url: str, prefix: str, **orchestrator: object) -> RunConfig:
    cfg = RunConfig(redis=RedisSection(url=redis_url, prefix=prefix))
    cfg.orchestrator.group_size = 2
    cfg.orchestrator.max_turns = 50
    cfg.orchestrator.sampling.max_tokens = 8
    cfg.model.max_seq_len = cfg.decode.engine.max_seq_len = 4096
    for k, v in orchestrator.items():
        setattr(cfg.orchestrator, k, v)
    return cfg


async def run_groups(
    cfg: RunConfig,
    bus: Bus,
    tmp: Path,
    seeds: list[int],
    env: str = ENV,
    policy: Policy = say_policy,
    tok: Any = TOK,
    eos: int = EOS,
    chat: Any = None,
    credit: bool = False,
    version: int = 0,
) -> tuple[list[GroupSpec], list[GenerateRequest], float]:
    """Run one group per seed through the orchestrator's own _run_group (commit or drop into the
    Redis ledger), against the scripted decode (serving weight `version`) over HTTP and the real
    sandbox process. Version 0 is announced, as the trainer does before anything is served."""
    bus.publish_weights(WeightsInfo(version=0, path=str(tmp / "weights" / "step_0")))
    seen: list[GenerateRequest] = []
    runner = web.AppRunner(scripted_decode_app(seen, policy, version))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    decode_id = f"scripted-{uuid.uuid4().hex[:6]}"
    bus.register(ServiceInfo(kind="decode", id=decode_id, url=f"http://127.0.0.1:{port}"), ttl_s=600)
    orch = Orchestrator(cfg, bus, tmp)
    http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60, connect=5), headers=auth_headers())
    registry = Registry(bus.services)
    decode, sandbox = (
        DecodeClient(http, Router(registry, "decode")),
        SandboxClient(http, Router(registry, "sandbox"), credit=credit),
    )
    orch.runner = RolloutRunner(cfg, decode, sandbox, tok, eos, chat=chat)
    specs = [GroupSpec(group_id=uuid.uuid4().hex[:12], env=env, seed=s) for s in seeds]
    t0 = time.monotonic()
    try:
        for spec in specs:
            orch._record_start(spec, 0)
        await asyncio.gather(*(orch._run_group(spec) for spec in specs))
        took = time.monotonic() - t0
    finally:
        await http.close()
        await runner.cleanup()
        bus.deregister("decode", decode_id)
    return specs, seen, took


def committed(bus: Bus) -> dict[str, dict[str, object]]:
    out = {}
    for _eid, fields in bus.r.xrange(bus.k.rollouts):
        g = json.loads(fields["group"])
        out[g["group_id"]] = g
    return out


def assert_accounted(bus: Bus, specs: list[GroupSpec]) -> None:
    """Every started group is on the stream (for the trainer) or dropped with a reason; none in
    flight, none lost."""
    ledger = bus.ledger()
    on_stream = committed(bus)
    for spec in specs:
        assert spec.group_id in ledger["started"]  # type: ignore[operator]
        assert (spec.group_id in on_stream) != (spec.group_id in ledger["dropped"])  # type: ignore[operator]
    assert not bus.r.hlen(bus.k.inflight)


def sandbox_open(sb: object) -> int:
    return int(httpx.get(f"{sb.url}/health").json()["sessions_open"])  # type: ignore[attr-defined]


def test_turn_timeout_in_env_step_and_in_generation(
    budget_sandbox: object, redis_server: str, tmp_path: Path
) -> None:
    prefix = budget_sandbox.prefix  # type: ignore[attr-defined]
    bus = Bus(redis_server, prefix)
    cfg = budget_cfg(redis_server, prefix, turn_timeout_s=1.0)
    counted = {"env": ENV, "finish_reason": "turn_timeout"}
    before = REGISTRY.get_sample_value("relay_orchestrator_samples_total", counted) or 0.0
    specs, seen, took = asyncio.run(run_groups(cfg, bus, tmp_path, [0, 1]))
    assert REGISTRY.get_sample_value("relay_orchestrator_samples_total", counted) == before + 2
    assert took < NAP_S + SLOW_GEN_S  # both groups ran side by side and nobody waited out a nap
    assert_accounted(bus, specs)
    groups = committed(bus)
    nap, slow = groups[specs[0].group_id], groups[specs[1].group_id]

    # Seed 0: sample 0 finishes its 3 "ok" turns; sample 1's env step ("nap") outlasts the turn.
    done, timed = nap["samples"]
    assert done["finish_reason"] == "done" and done["reward"] == 1.0 and done["turns"] == 3
    assert timed["finish_reason"] == "turn_timeout" and timed["turns"] == 1
    assert timed["reward"] == 0.0  # scored on what it did (no progress), after the step finished
    prompt = TOK.encode(PROMPTS[0]).ids
    assert timed["tokens"] == [*prompt, *TOK.encode("nap").ids, EOS]
    assert timed["loss_mask"] == [0] * len(prompt) + [1] * 4
    assert done["advantage"] == 0.5 and timed["advantage"] == -0.5

    # Seed 1: sample 1 said "go", so its second generation is slow: the turn times out there and
    # the observation it was answering is left out (the sample ends on its own last token).
    done, timed = slow["samples"]
    assert done["finish_reason"] == "done" and done["reward"] == 1.0
    assert timed["finish_reason"] == "turn_timeout" and timed["turns"] == 1
    prompt = TOK.encode(PROMPTS[1]).ids
    assert timed["tokens"] == [*prompt, *TOK.encode("go").ids, EOS] and timed["loss_mask"][-1] == 1
    assert any(TOK.decode(r.input_ids).endswith("say:slow") for r in seen)  # it was asked, then given up
    assert sandbox_open(budget_sandbox) == 0  # every session scored or closed


def test_rollout_timeout_and_dropped_first_turn(
    budget_sandbox: object, redis_server: str, tmp_path: Path
) -> None:
    prefix = budget_sandbox.prefix  # type: ignore[attr-defined]
    bus = Bus(redis_server, prefix)
    cfg = budget_cfg(redis_server, prefix, rollout_timeout_s=1.5)
    specs, _, took = asyncio.run(run_groups(cfg, bus, tmp_path, [2, 3]))
    assert took < 1.5 + 2.0
    assert_accounted(bus, specs)
    ticking, never = specs

    # Seed 2: endless 0.25 s steps; at the group's deadline both samples end, scored on progress.
    group = committed(bus)[ticking.group_id]
    for s in group["samples"]:
        assert s["finish_reason"] == "rollout_timeout"
        assert 2 <= s["turns"] <= 1.5 / TICK_S + 1
        assert 0 < s["reward"] < 0.1  # ticks/100: progress the env saw, not a made-up number
        assert s["loss_mask"][-1] == 1

    # Seed 3: the shared first generation outlasts the rollout: no sample has a model turn, so
    # the group cannot be trained and is dropped with the reason, and counted.
    reason = bus.ledger()["dropped"][never.group_id]  # type: ignore[index]
    assert reason.startswith("rollout_timeout: ") and "rollout_timeout_s=1.5" in reason
    assert never.group_id not in committed(bus)
    assert sandbox_open(budget_sandbox) == 0


def test_turn_timeout_on_first_generation_drops_group(
    budget_sandbox: object, redis_server: str, tmp_path: Path
) -> None:
    prefix = budget_sandbox.prefix  # type: ignore[attr-defined]
    bus = Bus(redis_server, prefix)
    cfg = budget_cfg(redis_server, prefix, turn_timeout_s=0.5, rollout_timeout_s=30.0)
    specs, _, took = asyncio.run(run_groups(cfg, bus, tmp_path, [3]))
    assert took < SLOW_GEN_S
    assert_accounted(bus, specs)
    reason = bus.ledger()["dropped"][specs[0].group_id]  # type: ignore[index]
    assert reason.startswith("turn_timeout: ") and "turn_timeout_s=0.5" in reason
    assert sandbox_open(budget_sandbox) == 0


# ------------------------------------------------------------------ context budget (in process)


class EchoDecode:
    """Answers "a" then EOS (or less, if max_tokens is smaller); records each request's input
    length and max_tokens when it arrives (the runner hands decode its live token list, which a
    real client serialises at once)."""

    def __init__(self) -> None:
        self.requests: list[tuple[int, int]] = []
        self.inputs: set[tuple[int, ...]] = set()

    async def generate(self, req: GenerateRequest, prefer: str | None = None) -> tuple[str, GenerateResponse]:
        self.requests.append((len(req.input_ids), req.sampling.max_tokens))
        self.inputs.add(tuple(req.input_ids))
        ids = [*TOK.encode("a").ids, EOS][: req.sampling.max_tokens]
        choice = GenerateChoice(
            output_ids=ids, logprobs=[-0.5] * len(ids), versions=[1] * len(ids), finish_reason="stop"
        )
        return "inproc://decode", GenerateResponse(
            request_id="r", prompt_tokens=0, choices=[choice] * req.sampling.n
        )


class Created:
    def __init__(self, prompt: str):
        self.prompt = prompt


class LongObsSession:
    """Never done; every observation is `obs`."""

    def __init__(self, prompt: str, obs: str):
        self.created = Created(prompt)
        self.obs = obs
        self.steps = 0
        self.closed = False

    @property
    def prompt(self) -> str:
        return self.created.prompt

    async def step(self, action: str, eos: bool) -> StepResponse:
        self.steps += 1
        return StepResponse(observation=self.obs, done=False)

    async def score(self) -> ScoreResponse:
        self.closed = True
        return ScoreResponse(reward=0.25)

    async def close(self) -> None:
        self.closed = True


class LongObsSandbox:
    def __init__(self, prompt: str, obs: str):
        self.prompt, self.obs = prompt, obs
        self.sessions: list[LongObsSession] = []

    async def open_group(self, env: str, seed: int, n: int) -> list[LongObsSession]:
        self.sessions = [LongObsSession(self.prompt, self.obs) for _ in range(n)]
        return self.sessions


def context_runner(
    overflow: str, max_len: int, obs: str, prompt: str = "p:", max_tokens: int = 4
) -> tuple[RolloutRunner, EchoDecode]:
    cfg = RunConfig()
    cfg.orchestrator.group_size = 2
    cfg.orchestrator.max_turns = 100
    cfg.orchestrator.context_overflow = overflow  # type: ignore[assignment]
    cfg.orchestrator.sampling.max_tokens = max_tokens
    cfg.model.max_seq_len = cfg.decode.engine.max_seq_len = max_len
    decode = EchoDecode()
    sandbox = LongObsSandbox(prompt, obs)
    return RolloutRunner(cfg, decode, sandbox, TOK, EOS), decode  # type: ignore[arg-type]


OBS = "\n" + "x" * 29  # 30 tokens
ANSWER = [*TOK.encode("a").ids, EOS]


def test_context_stop_leaves_the_observation_out() -> None:
    r, decode = context_runner("stop", max_len=100, obs=OBS)
    group = asyncio.run(r.run(GroupSpec("c0", ENV, 0)))
    prompt = TOK.encode("p:").ids
    obs = TOK.encode(OBS).ids
    # p: a<eos> obs a<eos> obs a<eos> = 2 + 2 + 32 + 32 = 68; the next obs (30) + 4 > 100 - 68
    expected = [*prompt, *ANSWER, *obs, *ANSWER, *obs, *ANSWER]
    for s in group.samples:
        assert s.finish_reason == "context" and s.tokens == expected and s.turns == 3
    assert all(n + max_tokens <= 100 for n, max_tokens in decode.requests)


def test_context_truncate_observation_with_marker_then_stop() -> None:
    r, decode = context_runner("truncate_observation", max_len=100, obs=OBS)
    group = asyncio.run(r.run(GroupSpec("c1", ENV, 0)))
    prompt = TOK.encode("p:").ids
    obs = TOK.encode(OBS).ids
    # After 68 tokens: room for the observation = 100 - 68 - 4 = 28 = kept + marker.
    marker_len = len(TOK.encode(TRUNCATION_MARKER.format(n=10)).ids)  # 20 chars
    kept = 28 - marker_len
    marker = TOK.encode(TRUNCATION_MARKER.format(n=len(obs) - kept)).ids
    assert len(marker) == marker_len
    cut = [*obs[:kept], *marker]
    assert TOK.decode(cut).endswith(f"[truncated {len(obs) - kept} tokens]")
    expected = [*prompt, *ANSWER, *obs, *ANSWER, *obs, *ANSWER, *cut, *ANSWER]
    for s in group.samples:
        # then 100 - 98 = 2 tokens are left: not even a marker fits with a turn of 4
        assert s.finish_reason == "context_truncated" and s.turns == 4
        assert s.tokens == expected  # exact bookkeeping: the ids the engine saw, in order
        assert s.loss_mask == [0] * 2 + [1] * 2 + [0] * 30 + [1] * 2 + [0] * 30 + [1] * 2 + [0] * 28 + [1] * 2
        assert len(s.tokens) <= 100
    assert all(n + max_tokens <= 100 for n, max_tokens in decode.requests)


def test_context_trim_history_parts_are_what_decode_saw() -> None:
    r, decode = context_runner("trim_history", max_len=200, obs=OBS)
    r.cfg.orchestrator.max_turns, r.cfg.orchestrator.context_keep_turns = 40, 1
    group = asyncio.run(r.run(GroupSpec("c3", ENV, 0)))
    prompt, obs = TOK.encode("p:").ids, TOK.encode(OBS).ids
    stub = TOK.encode(TRIM_MARKER.format(n=len(obs))).ids
    assert len(stub) < len(obs)
    for s in group.samples:
        assert s.finish_reason == "max_turns" and s.turns == 40 and s.reward == 0.25
        parts = s.parts()
        # before turn 7's observation the context is 32 * 7 - 28 = 196 tokens: 196 + 30 + 4 > 200
        assert s.segments[0].trimmed_after_turn == 7 and s.segments[0].turns == 7
        assert s.segments[0].tokens == [*prompt, *(ANSWER + obs) * 6, *ANSWER]
        # Trimmed: turns 1-5's observations become markers; the oldest four turns are dropped
        # to get under half the budget; turn 6's observation (the last kept) stays verbatim.
        second = parts[1]
        context = [*prompt, *ANSWER, *stub, *ANSWER, *obs, *ANSWER, *obs]
        assert second.tokens[: len(context) + len(ANSWER)] == context + ANSWER
        assert second.loss_mask[: len(context)] == [0] * len(context)
        assert sum(p.turns for p in parts) == 40 and [p.finish_reason for p in parts][-1] == "max_turns"
        for p in parts:
            assert len(p.tokens) <= 200 and sum(p.loss_mask) == len(ANSWER) * p.turns
            # every trained turn was generated by decode from exactly the part's tokens before it
            starts = [i for i in range(1, len(p.tokens)) if p.loss_mask[i] and not p.loss_mask[i - 1]]
            assert len(starts) == p.turns
            assert all(tuple(p.tokens[:i]) in decode.inputs for i in starts)
    assert all(n + max_tokens <= 200 for n, max_tokens in decode.requests)


def test_trim_history_refuses_token_credit() -> None:
    from services.common.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="trim_history"):
        load_config(
            "debug", ["--orchestrator.context_overflow=trim_history", "--orchestrator.advantage=token"]
        )


def test_context_truncate_when_not_even_the_marker_fits() -> None:
    # prompt 2 + answer 2 = 4 tokens; room for an observation = 30 - 4 - 8 = 18 < marker (20)
    r, _ = context_runner("truncate_observation", max_len=30, obs=OBS, max_tokens=8)
    group = asyncio.run(r.run(GroupSpec("c2", ENV, 0)))
    for s in group.samples:
        assert s.finish_reason == "context_truncated" and s.turns == 1 and s.loss_mask[-1] == 1
        assert s.tokens == [*TOK.encode("p:").ids, *ANSWER] and s.reward == 0.25


def test_max_tokens_clamped_to_what_the_context_has_left() -> None:
    r, decode = context_runner("stop", max_len=50, obs=OBS, max_tokens=16)
    _url, (choice,) = asyncio.run(r._generate(list(range(3, 48)), 1, None))
    assert decode.requests[-1] == (45, 50 - 45) and len(choice.output_ids) <= 5
    asyncio.run(r._generate([3, 4], 1, None))
    assert decode.requests[-1] == (2, 16)  # the configured value when it fits


# ------------------------------------------------------------------ no quadratic overhead


class ConstantDecode:
    """O(1) per call (never looks at the context), and logs this thread's CPU clock per call."""

    def __init__(self) -> None:
        self.cpu: list[float] = []
        self.input_lens: list[int] = []
        ids = [*TOK.encode("42").ids, EOS]
        self.choice = GenerateChoice(
            output_ids=ids, logprobs=[-0.5] * 3, versions=[2] * 3, finish_reason="stop"
        )

    async def generate(self, req: GenerateRequest, prefer: str | None = None) -> tuple[str, GenerateResponse]:
        self.cpu.append(time.thread_time())
        self.input_lens.append(len(req.input_ids))
        return "inproc://decode", GenerateResponse(
            request_id="r", prompt_tokens=0, choices=[self.choice] * req.sampling.n
        )


def test_per_turn_cpu_flat_over_300_turns() -> None:
    """Per-turn orchestrator CPU (everything between two consecutive generate calls: the env step,
    tokenising the observation, the budget checks, the trajectory appends, building the request)
    must not grow with the context. The context reaches ~90k tokens."""
    obs = "\n" + "y" * 299
    cfg = RunConfig()
    cfg.orchestrator.group_size = 2
    cfg.orchestrator.max_turns = 300
    cfg.orchestrator.sampling.max_tokens = 4
    cfg.model.max_seq_len = cfg.decode.engine.max_seq_len = 200_000
    decode = ConstantDecode()
    sandbox = LongObsSandbox("count:", obs)
    runner = RolloutRunner(cfg, decode, sandbox, TOK, EOS)  # type: ignore[arg-type]
    group = asyncio.run(runner.run(GroupSpec("q", ENV, 0)))
    for s in group.samples:
        assert s.turns == 300 and s.finish_reason == "max_turns"
        assert len(s.tokens) == 6 + 300 * 3 + 299 * 300
    per_call = [b - a for a, b in zip(decode.cpu, decode.cpu[1:], strict=False)]
    early = statistics.median(per_call[10:110])  # contexts of ~1.5k-17k tokens
    late = statistics.median(per_call[-100:])  # ~75k-90k tokens
    # A full copy of the context per turn (e.g. tokens = tokens + new, or validating input_ids)
    # costs more than this slack at 90k tokens: time it here, on this machine.
    ctx = group.samples[0].tokens
    t0 = time.thread_time()
    for _ in range(20):
        list(ctx)
    copy_s = (time.thread_time() - t0) / 20
    assert late < 1.5 * early + copy_s, (early, late, copy_s)
    print(
        f"per-turn CPU: early {early * 1e3:.3f} ms, late {late * 1e3:.3f} ms; one 90k copy {copy_s * 1e3:.3f} ms"
    )


def test_trajectory_appends_are_o_new_tokens() -> None:
    long = Trajectory.start(list(range(1_000_000)))
    short = Trajectory.start([1, 2, 3])
    obs = list(range(5))

    def appends(t: Trajectory) -> float:
        t0 = time.thread_time()
        for _ in range(1000):
            t.add_env(obs)
            t.drop_env(5)
            t.add_env(obs)
        return time.thread_time() - t0

    appends(short)  # warm up; CPU time of this thread, so other processes do not count
    t_short, t_long = appends(short), appends(long)
    t0 = time.thread_time()
    list(long.tokens)
    one_copy = time.thread_time() - t0
    # 2000 appends and 1000 truncations on a 1M-token trajectory cost about what they cost on a
    # 3-token one, and far less than copying the trajectory even a few times.
    assert t_long < 5 * t_short + 0.01 and t_long < 5 * one_copy, (t_short, t_long, one_copy)
    assert len(long.tokens) == len(long.mask) == len(long.logprobs) == len(long.versions) == 1_000_000 + 5000


# ------------------------------------------------------------------ tool prompts through a chat template

# A ChatML template with tools in the style of Qwen2.5's (tools in the system turn, tool results
# as <tool_response> blocks in a user turn). CONTENT renders assistant content: verbatim, or trimmed
# (a template that re-renders history differently from what the model saw).
CHATML = """
{%- if tools %}<|im_start|>system
# Tools

<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'user' %}<|im_start|>user
{{ message.content }}<|im_end|>
{% elif message.role == 'assistant' %}<|im_start|>assistant
{{ CONTENT }}<|im_end|>
{% elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}
<tool_response>
{{ message.content }}
</tool_response>
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>
{% endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}
"""
CALL = '<tool_call>\n{"name": "run_tests", "arguments": {}}\n</tool_call>'


def chat_tokenizer() -> object:
    """Character-level over all printable ASCII, with ChatML's turn markers as special tokens."""
    import string

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    specials = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate(specials + sorted(set(string.printable)))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(specials)
    return tok


class ToolSession(LongObsSession):
    """A swe-lite-shaped episode: the plain Hermes tools prompt; a turn with a tool call gets
    the tool's (plain) result, a turn without one ends the episode."""

    def __init__(self, result: str):
        from services.common.tools import render_tools_prompt
        from services.sandbox.envs.swe_lite import TOOLS

        super().__init__(render_tools_prompt(TOOLS) + "\n\nFix the bug in calc.py.", "")
        self.result = result
        self.actions: list[str] = []

    async def step(self, action: str, eos: bool) -> StepResponse:
        from services.common.tools import ToolResult, render_tool_results

        self.actions.append(action)
        if "<tool_call>" not in action:
            return StepResponse(observation="", done=True, reward=1.0)
        return StepResponse(
            observation=render_tool_results([ToolResult("run_tests", self.result)]), done=False
        )


class ToolSandbox:
    def __init__(self, result: str):
        self.result = result
        self.sessions: list[ToolSession] = []

    async def open_group(self, env: str, seed: int, n: int) -> list[ToolSession]:
        self.sessions = [ToolSession(self.result) for _ in range(n)]
        return self.sessions


class ToolPolicy:
    """Calls run_tests `calls` times (two trailing spaces after each call), then answers "done"."""

    def __init__(self, tok: object, calls: int):
        self.tok, self.calls = tok, calls
        self.end = tok.token_to_id("<|im_end|>")  # type: ignore[attr-defined]
        self.inputs: list[str] = []

    async def generate(self, req: GenerateRequest, prefer: str | None = None) -> tuple[str, GenerateResponse]:
        text = self.tok.decode(req.input_ids, skip_special_tokens=False)  # type: ignore[attr-defined]
        self.inputs.append(text)
        turn = text.count("<tool_response>")
        say = CALL + "  " if turn < self.calls else "done"
        ids = [*self.tok.encode(say, add_special_tokens=False).ids, self.end][: req.sampling.max_tokens]  # type: ignore[attr-defined]
        choice = GenerateChoice(
            output_ids=ids, logprobs=[-0.2] * len(ids), versions=[0] * len(ids), finish_reason="stop"
        )
        return "inproc://decode", GenerateResponse(
            request_id="r", prompt_tokens=0, choices=[choice] * req.sampling.n
        )


def chat_runner(
    content: str, calls: int, result: str, max_len: int = 8192, overflow: str = "stop"
) -> tuple[RolloutRunner, ToolPolicy, object, object]:
    from services.common.chat import ChatTemplate

    tok = chat_tokenizer()
    tpl = ChatTemplate({"default": CHATML.replace("CONTENT", content)})
    cfg = RunConfig()
    cfg.orchestrator.group_size = 2
    cfg.orchestrator.max_turns = 10
    cfg.orchestrator.context_overflow = overflow  # type: ignore[assignment]
    cfg.orchestrator.sampling.max_tokens = 128
    cfg.model.max_seq_len = cfg.decode.engine.max_seq_len = max_len
    policy = ToolPolicy(tok, calls)
    end = tok.token_to_id("<|im_end|>")  # type: ignore[attr-defined]
    runner = RolloutRunner(cfg, policy, ToolSandbox(result), tok, end, chat=tpl)  # type: ignore[arg-type]
    return runner, policy, tok, tpl


def test_tool_env_prompt_and_observations_through_chat_template() -> None:
    from services.sandbox.envs.swe_lite import TOOLS

    runner, policy, tok, tpl = chat_runner("message.content", calls=2, result="exit_code: 0\n3 passed")
    group = asyncio.run(runner.run(GroupSpec("t0", "swe-lite", 0)))
    tools = [t.as_json() for t in TOOLS]
    user = {"role": "user", "content": "Fix the bug in calc.py."}
    # The first prompt is the template's, with the env's tool schemas in its system turn.
    first = tpl.render([user], tools=tools)  # type: ignore[attr-defined]
    assert policy.inputs[0] == first and first.startswith("<|im_start|>system\n# Tools\n\n<tools>{")
    assert (
        '"name": "run_tests"' in first
        and "Fix the bug in calc.py.<|im_end|>\n<|im_start|>assistant\n" in first
    )
    call = CALL + "  "
    convo = [
        user,
        {"role": "assistant", "content": call},
        {"role": "tool", "content": "exit_code: 0\n3 passed"},
        {"role": "assistant", "content": call},
        {"role": "tool", "content": "exit_code: 0\n3 passed"},
        {"role": "assistant", "content": "done"},
    ]
    full = tpl.render(convo, tools=tools, add_generation_prompt=False)  # type: ignore[attr-defined]
    prompt_ids = tok.encode(first, add_special_tokens=False).ids  # type: ignore[attr-defined]
    for s in group.samples:
        assert s.finish_reason == "done" and s.turns == 3 and s.reward == 1.0
        # Exact bookkeeping: the token stream decodes to the template's rendering of the whole
        # conversation (up to the newline it puts after the final end-of-turn) ...
        assert tok.decode(s.tokens, skip_special_tokens=False) + "\n" == full  # type: ignore[attr-defined]
        # ... the prompt is the template's prompt, and exactly the policy's tokens are trained.
        assert s.tokens[: len(prompt_ids)] == prompt_ids
        trained = [t for t, m in zip(s.tokens, s.loss_mask, strict=True) if m]
        said = [CALL + "  ", CALL + "  ", "done"]
        assert tok.decode(trained, skip_special_tokens=False) == "<|im_end|>".join(said) + "<|im_end|>"  # type: ignore[attr-defined]
    # Each later request was exactly the template's rendering of the conversation so far.
    assert policy.inputs[1] == tpl.render(convo[:3], tools=tools)  # type: ignore[attr-defined]
    assert policy.inputs[-1] == tpl.render(convo[:5], tools=tools)  # type: ignore[attr-defined]


def test_chat_template_truncates_tool_content_not_turn_markers() -> None:
    long = "x" * 400
    runner, policy, tok, _ = chat_runner(
        "message.content", calls=5, result=long, max_len=1411, overflow="truncate_observation"
    )
    group = asyncio.run(runner.run(GroupSpec("t1", "swe-lite", 0)))
    for s in group.samples:
        text = tok.decode(s.tokens, skip_special_tokens=False)  # type: ignore[attr-defined]
        assert s.finish_reason == "context_truncated" and len(s.tokens) <= 1411
        # The cut is inside the tool result; the template's closing and the next turn follow it.
        assert "tokens]\n</tool_response><|im_end|>\n<|im_start|>assistant\n" in text
        assert "[truncated " in text and s.loss_mask[-1] == 1
    assert all(len(tok.encode(t, add_special_tokens=False).ids) + 128 <= 1411 for t in policy.inputs)  # type: ignore[attr-defined]


def test_chat_template_that_rewrites_history_ends_the_sample() -> None:
    runner, _, _, _ = chat_runner("message.content | trim", calls=3, result="ok")
    group = asyncio.run(runner.run(GroupSpec("t2", "swe-lite", 0)))
    for s in group.samples:
        # turn 1 is rendered trimmed once turn 2 follows: not what the model saw, so stop there
        assert s.finish_reason == "template_mismatch" and s.turns == 2 and s.reward == 0.25


def test_plain_tool_prompts_without_a_template_are_unchanged() -> None:
    from services.common.tools import render_tools_prompt
    from services.orchestrator.chat_turns import parse_tool_observation, parse_tools_prompt
    from services.sandbox.envs.swe_lite import TOOLS

    prompt = render_tools_prompt(TOOLS) + "\n\nFix it."
    tools, user = parse_tools_prompt(prompt)  # type: ignore[misc]
    assert tools == [t.as_json() for t in TOOLS] and user == "Fix it."
    assert (
        parse_tools_prompt("rev abc:") is None
        and parse_tools_prompt(prompt.replace('"bash"', '"sh"', 1)) is not None
    )
    assert parse_tool_observation(
        "\n<tool_response>\na\n</tool_response>\n<tool_response>\nb\n</tool_response>\n"
    ) == ["a", "b"]
    assert parse_tool_observation("\nok:") is None
    # No template: the prompt goes to decode exactly as the env wrote it.
    runner, policy, tok, _ = chat_runner("message.content", calls=1, result="r")
    runner.chat = None
    asyncio.run(runner.run(GroupSpec("t3", "swe-lite", 0)))
    assert policy.inputs[0] == render_tools_prompt(TOOLS) + "\n\nFix the bug in calc.py."


def test_swe_lite_speaks_the_parsed_formats(bwrap: str) -> None:
    """The real swe-lite env's prompt and tool observations are what chat_turns parses."""
    import random

    from services.orchestrator.chat_turns import parse_tool_observation, parse_tools_prompt
    from services.sandbox.envs.swe_lite import TOOLS, SweLite
    from services.sandbox.isolation import WorkspaceManager

    m = WorkspaceManager.temporary(uid_base=random.randrange(1_000_000, 50_000_000, 1000))
    env = SweLite()
    env.workspace = m.create()
    try:
        parsed = parse_tools_prompt(env.reset(7))
        assert parsed is not None and parsed[0] == [t.as_json() for t in TOOLS]
        assert parsed[1].startswith("You are working in the repository")
        obs, done = env.step(CALL + "\n" + CALL.replace("run_tests", "read_file"))
        contents = parse_tool_observation(obs)
        assert not done and contents is not None and len(contents) == 2
        assert contents[0].startswith("exit_code: ") and contents[1].startswith("error: ")
    finally:
        m.release(env.workspace)
        m.shutdown()


def test_swe_lite_over_http_through_chat_template(
    budget_sandbox: object, bwrap: str, redis_server: str, tmp_path: Path
) -> None:
    """The real swe-lite env in the real sandbox (its workspace a quota tmpfs), the orchestrator's
    clients and group runner, a ChatML model over HTTP: the prompt is the template's with the
    env's tools, the tool result comes back as a tool turn, and the token stream is exactly the
    template's rendering of the conversation."""
    from services.common.chat import ChatTemplate
    from services.sandbox.envs.swe_lite import TOOLS

    tok: Any = chat_tokenizer()
    end = tok.token_to_id("<|im_end|>")

    async def tool_then_done(req: GenerateRequest) -> list[list[int]]:
        text = tok.decode(req.input_ids, skip_special_tokens=False)
        say = "done" if "<tool_response>" in text else CALL
        return [[*tok.encode(say, add_special_tokens=False).ids, end]] * req.sampling.n

    tpl = ChatTemplate({"default": CHATML.replace("CONTENT", "message.content")})
    prefix = budget_sandbox.prefix  # type: ignore[attr-defined]
    bus = Bus(redis_server, prefix)
    cfg = budget_cfg(redis_server, prefix, turn_timeout_s=60.0)
    cfg.orchestrator.sampling.max_tokens = 128
    cfg.model.max_seq_len = cfg.decode.engine.max_seq_len = 16384
    specs, seen, _ = asyncio.run(
        run_groups(cfg, bus, tmp_path, [5], env="swe-lite", policy=tool_then_done, tok=tok, eos=end, chat=tpl)
    )
    assert_accounted(bus, specs)
    first = tok.decode(seen[0].input_ids, skip_special_tokens=False)
    user = first.split("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]
    tools = [t.as_json() for t in TOOLS]
    assert user.startswith("You are working in the repository")
    assert first == tpl.render([{"role": "user", "content": user}], tools=tools)
    for s in committed(bus)[specs[0].group_id]["samples"]:  # type: ignore[union-attr]
        text = tok.decode(s["tokens"], skip_special_tokens=False)
        assert s["finish_reason"] == "done" and s["turns"] == 2 and s["reward"] == 0.0  # unfixed repo
        result = text.split("<tool_response>\n", 1)[1].split("\n</tool_response>", 1)[0]
        assert result.startswith("exit_code: 1") and "FAIL" in result  # the visible tests ran, and fail
        convo = [
            {"role": "user", "content": user},
            {"role": "assistant", "content": CALL},
            {"role": "tool", "content": result},
            {"role": "assistant", "content": "done"},
        ]
        assert text + "\n" == tpl.render(convo, tools=tools, add_generation_prompt=False)
    assert sandbox_open(budget_sandbox) == 0
