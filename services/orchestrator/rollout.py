"""One rollout group: G samples of one task, driven turn by turn against decode and the sandbox.

Token bookkeeping is exact: the sample's tokens are the prompt ids, then for each turn the ids
the engine produced (trained, mask 1) followed by the tokenised observation (mask 0). Model
output is never re-tokenised, so what the trainer scores is exactly what the engine sampled.

Budgets (docs/environments.md, "Agent loop budgets"): `max_turns`; the context (`max_len`: an
observation that does not fit with a full next turn stops the sample, or is truncated with a
marker under `context_overflow = "truncate_observation"`, or, under "trim_history", closes the
sample's current part and the episode goes on from a trimmed context: see `_trim_history`);
`turn_timeout_s` (one generation + one env step of one sample) and `rollout_timeout_s` (the
whole group). A sample that hits a budget
ends with a finish reason naming it and is scored on what it did; a group in which no sample got
a model turn before its deadline has nothing to train on and is dropped (`GroupTimedOut`).

Cost per turn is O(new tokens) in the trajectory (list appends) plus one O(context) pass to
build and serialise the request, which must carry the whole context (token-in decode).
"""

from __future__ import annotations

import asyncio
import logging
import time
import zlib
from collections.abc import Collection, Coroutine
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, TypeVar

import numpy as np
from tokenizers import Tokenizer

from services.common import routing as routing_wire
from services.common.chat import ChatTemplate
from services.common.config import RunConfig
from services.common.schemas import (
    Credit,
    GenerateChoice,
    GenerateRequest,
    RolloutGroup,
    RoutedExperts,
    Sample,
    SampleSegment,
    SamplingParams,
)
from services.common.tokenizer import end_of_turn_id, load_tokenizer, model_eos_ids
from services.common.tools import ToolResult, dialect_of, kimi_to_hermes, render_tool_results
from services.orchestrator.chat_turns import (
    ChatConversation,
    TemplateMismatch,
    observation_messages,
    parse_tool_observation,
    parse_tools_prompt,
)
from services.orchestrator.clients import DecodeClient, SandboxClient, SandboxSession, ServiceUnavailable
from services.orchestrator.credit import ActionSpan, group_token_advantages

log = logging.getLogger("orchestrator")

# Appended to an observation cut by context_overflow = "truncate_observation".
TRUNCATION_MARKER = "[truncated {n} tokens]"
# Stands for an old tool output in a context rebuilt by context_overflow = "trim_history".
TRIM_MARKER = "[trimmed {n} tokens]"

TimeoutReason = Literal["turn_timeout", "rollout_timeout"]
T = TypeVar("T")


class GroupTimedOut(Exception):
    """A deadline passed before any sample of the group had a model turn (or while its episodes
    could not be scored): nothing to train on. The message starts with the finish reason
    ("turn_timeout: ..." / "rollout_timeout: ..."); the loop drops the group with it."""


@dataclass
class GroupSpec:
    group_id: str
    env: str
    seed: int


def sample_id(group_id: str, index: int) -> str:
    """A sample's rollout id: `<group_id>.<index>`."""
    return f"{group_id}.{index}"


def parse_rollout_id(rollout_id: str) -> tuple[str, int | None]:
    """(group id, sample index or None) of a group id or a sample's id; ValueError if it is
    neither (the index must be ASCII digits: str.isdigit() also accepts '²', which int() does not)."""
    group_id, dot, index = rollout_id.partition(".")
    if not group_id or "/" in group_id:
        raise ValueError(f"{rollout_id!r} is not a group id or <group_id>.<sample index>")
    if not dot:
        return group_id, None
    if not (index.isascii() and index.isdigit()) or len(index) > 9:
        raise ValueError(f"{rollout_id!r}: the sample index {index!r} is not a number")
    return group_id, int(index)


class RoutingTrace:
    """MoE: a sample's routed expert ids (Router Replay), one row per token, built over turns.

    Each turn's choice carries rows for its whole input + output. A turn contributes the rows of
    the tokens it appended, and the row of the previous turn's last sampled token, which that turn
    never forwarded (unrecorded) and this one did. Rows already recorded are kept: they are the
    routing under which the earlier turns' tokens were sampled."""

    def __init__(self) -> None:
        self.chunks: list[np.ndarray] = []
        self.n = 0  # rows held

    def add(self, choice: GenerateChoice) -> None:
        if choice.routed_experts is None:
            return
        # O(context) to decode, as the request carrying the context is; kept rows are not copied.
        arr = routing_wire.decode(choice.routed_experts)
        if self.n and len(arr) >= self.n:
            last = self.chunks[-1]
            if (last[-1] == routing_wire.unrecorded(last.dtype)).all():
                last[-1] = arr[self.n - 1]
        new = np.array(arr[self.n :])  # a writable copy of the new rows only
        if len(new):
            self.chunks.append(new)
            self.n += len(new)

    def finish(self, num_tokens: int) -> RoutedExperts | None:
        """Exactly `num_tokens` rows (tokens the engine never saw, e.g. a final observation, are
        unrecorded); None when no turn returned routing (a dense model)."""
        if not self.chunks:
            return None
        arr = np.concatenate(self.chunks)[:num_tokens]
        if len(arr) < num_tokens:
            pad = routing_wire.blank(num_tokens - len(arr), arr.shape[1], arr.shape[2], arr.dtype)
            arr = np.concatenate([arr, pad])
        return routing_wire.encode(arr)


@dataclass
class TurnRecord:
    """One model turn as a trimmed context is rebuilt from it: the engine's ids (verbatim) and
    what the environment answered. Plain path: the observation text and the ids appended for it;
    chat path: the turn's text as the template's message, and the env messages committed."""

    output_ids: list[int]
    observation: str = ""
    obs_ids: list[int] = field(default_factory=list)
    model_text: str = ""
    closed: bool = False
    messages: list[dict[str, Any]] = field(default_factory=list)
    stubbed: bool = False  # its observation already stands as a trim marker


@dataclass
class _Part:
    """A closed part of a trimmed episode (becomes a SampleSegment)."""

    tokens: list[int]
    mask: list[int]
    logprobs: list[float]
    versions: list[int]
    routing: RoutingTrace
    turns: int
    trimmed_after_turn: int


@dataclass
class Trajectory:
    tokens: list[int]
    mask: list[int]
    logprobs: list[float]
    versions: list[int]
    turns: int = 0
    finish_reason: str = "stop"
    # the decode replica that served the last model turn: the next turn prefers it (its prefix cache)
    decode_url: str | None = None
    routing: RoutingTrace = field(default_factory=RoutingTrace)
    # where each model turn's action lies in `tokens` (token credit, services/orchestrator/credit.py)
    actions: list[ActionSpan] = field(default_factory=list)
    # context_overflow = "trim_history": the prompt, the turns of the current context, the closed
    # parts, and the model turns generated in the current part
    prompt: list[int] = field(default_factory=list)
    turn_log: list[TurnRecord] = field(default_factory=list)
    parts: list[_Part] = field(default_factory=list)
    part_turns: int = 0

    @classmethod
    def start(cls, prompt_ids: list[int], decode_url: str | None = None) -> Trajectory:
        n = len(prompt_ids)
        return cls(
            list(prompt_ids), [0] * n, [0.0] * n, [-1] * n, decode_url=decode_url, prompt=list(prompt_ids)
        )

    def add_model(self, choice: GenerateChoice) -> None:
        self.tokens += choice.output_ids
        self.mask += [1] * len(choice.output_ids)
        self.logprobs += choice.logprobs
        self.versions += choice.versions
        self.routing.add(choice)
        self.turns += 1
        self.part_turns += 1

    def start_part(self, context: list[int]) -> None:
        """Close the current part (it ends on the model turn just taken) and go on from
        `context`, all of it context (mask 0): its model turns were trained in earlier parts."""
        self.parts.append(
            _Part(
                self.tokens,
                self.mask,
                self.logprobs,
                self.versions,
                self.routing,
                self.part_turns,
                self.turns,
            )
        )
        n = len(context)
        self.tokens, self.mask, self.logprobs, self.versions = list(context), [0] * n, [0.0] * n, [-1] * n
        self.routing, self.part_turns, self.actions = RoutingTrace(), 0, []

    def segments(self) -> list[SampleSegment]:
        """The closed parts as the sample's segments. A last part with no model token (its first
        generation timed out) trains nothing: the part before it becomes the sample's tokens."""
        if self.parts and not any(self.mask):
            p = self.parts.pop()
            self.tokens, self.mask, self.logprobs, self.versions = p.tokens, p.mask, p.logprobs, p.versions
            self.routing, self.part_turns = p.routing, p.turns
        return [
            SampleSegment(
                tokens=p.tokens,
                loss_mask=p.mask,
                logprobs=p.logprobs,
                versions=p.versions,
                turns=p.turns,
                trimmed_after_turn=p.trimmed_after_turn,
                routed_experts=p.routing.finish(len(p.tokens)),
            )
            for p in self.parts
        ]

    def add_env(self, ids: list[int]) -> None:
        self.tokens += ids
        self.mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [-1] * len(ids)

    def sample(
        self,
        rollout_id: str,
        reward: float,
        advantage: float,
        token_advantages: list[float] | None = None,
        segments: list[SampleSegment] | None = None,
    ) -> Sample:
        """The trajectory as the trainer's sample (routed experts: None when no turn returned them);
        `segments`: what `segments()` returned, taken before the trajectory's tokens were read."""
        return Sample(
            rollout_id=rollout_id,
            tokens=self.tokens,
            loss_mask=self.mask,
            logprobs=self.logprobs,
            versions=self.versions,
            reward=reward,
            advantage=advantage,
            token_advantages=token_advantages,
            turns=self.turns,
            finish_reason=self.finish_reason,
            segments=segments or [],
            routed_experts=self.routing.finish(len(self.tokens)),
        )

    def drop_env(self, n: int) -> None:
        """Remove the last `n` (environment) tokens: an observation whose answer never came is
        dead weight in the sample. O(n), like the append it undoes."""
        if n:
            del self.tokens[-n:], self.mask[-n:], self.logprobs[-n:], self.versions[-n:]


class _Deadline:
    """The earlier of a turn's and the group's deadline, and which budget it is (loop.time())."""

    at: float | None
    reason: TimeoutReason

    def __init__(self, turn_s: float | None, rollout_at: float | None):
        now = asyncio.get_running_loop().time()
        turn_at = None if turn_s is None else now + turn_s
        if rollout_at is not None and (turn_at is None or rollout_at <= turn_at):
            self.at, self.reason = rollout_at, "rollout_timeout"
        else:
            self.at, self.reason = turn_at, "turn_timeout"


class RolloutRunner:
    def __init__(
        self,
        cfg: RunConfig,
        decode: DecodeClient,
        sandbox: SandboxClient,
        tok: Tokenizer,
        eos: int,
        chat: ChatTemplate | None = None,
        eos_ids: Collection[int] = (),
    ):
        self.cfg = cfg
        self.decode = decode
        self.sandbox = sandbox
        self.tok = tok
        # `eos`: the end-of-turn id, the one the chat template closes an assistant turn with.
        # `eos_ids`: every other id the engine stops on (config.json + generation_config.json,
        # e.g. Qwen's <|endoftext|> besides <|im_end|>, Llama-3's <|end_of_text|> besides
        # <|eot_id|>). A turn that ends on any of them ended with EOS for the environment.
        self.eos = eos
        self.eos_ids = frozenset([eos, *eos_ids])
        # The model's chat template: tool environments' prompts and observations go through it
        # (chat_turns.py). None (the char debug tokenizer): text exactly as the env wrote it.
        self.chat = chat
        # How the model writes tool calls (services/common/tools.py): from its special tokens.
        specials = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
        self.dialect = dialect_of(specials)
        self.eos_text = tok.decode([eos], skip_special_tokens=False)
        o = cfg.orchestrator
        self.sampling = SamplingParams(
            temperature=o.sampling.temperature,
            top_p=o.sampling.top_p,
            top_k=o.sampling.top_k,
            max_tokens=o.sampling.max_tokens,
        )
        self.max_len = min(cfg.model.max_seq_len, cfg.decode.engine.max_seq_len)
        self.overflow = o.context_overflow
        # trim_history cuts an observation only when it alone does not fit the trimmed context
        self.truncate = o.context_overflow == "truncate_observation"
        self.trim = o.context_overflow == "trim_history"

    @classmethod
    def for_model_dir(
        cls, cfg: RunConfig, decode: DecodeClient, sandbox: SandboxClient, model_dir: str | Path
    ) -> RolloutRunner:
        """A runner for the model in `model_dir`: its tokenizer, its chat template (tool
        environments' turns go through it), its end-of-turn id (Qwen: <|im_end|>, not a literal
        <eos>) and every EOS id the engine serving that directory stops on."""
        tok = load_tokenizer(model_dir)
        chat = ChatTemplate.from_model_dir(model_dir)
        eot = end_of_turn_id(model_dir, tok, chat)
        return cls(cfg, decode, sandbox, tok, eot, chat=chat, eos_ids=model_eos_ids(model_dir))

    async def _generate(
        self, ids: list[int], n: int, seed: int | None, prefer: str | None = None
    ) -> tuple[str, list[GenerateChoice]]:
        """One turn's generation, re-issued on another replica if the serving one vanishes.
        Returns the replica that served it; `prefer`: the one that served this sample's last turn."""
        # max_tokens never asks for more than the context has left, so the engine never
        # rejects a turn (the budget checks below normally leave a full turn anyway).
        max_tokens = min(self.sampling.max_tokens, self.max_len - len(ids))
        sampling = self.sampling.model_copy(update={"n": n, "seed": seed, "max_tokens": max_tokens})
        # model_construct: ids are our own token lists (prompt, engine output, tokenizer ids), so
        # validating every int again per turn would be a second O(context) pass for nothing; decode
        # validates the request it receives. The list is not copied: it is serialised before this
        # sample's trajectory can change (the sample waits on this call).
        # MoE: ask for the expert ids of every token (Router Replay, routing agreement metric).
        req = GenerateRequest.model_construct(
            input_ids=ids, sampling=sampling, return_routed_experts=self.cfg.model.is_moe
        )
        deadline = time.monotonic() + self.cfg.orchestrator.request_timeout_s
        attempt = 0
        while True:
            try:
                url, resp = await self.decode.generate(req, prefer)
                return url, resp.choices
            except ServiceUnavailable:
                # The replica vanished (the client dropped it from the routing cache); a
                # restarted or other replica picks the turn up from the same tokens.
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(min(0.1 * 2**attempt, 2.0))
                attempt += 1

    def _action(self, text_ids: list[int]) -> tuple[str, list[str]]:
        """The model turn's text for the environment, and the ids of the calls it made. Tool
        environments read Hermes calls: a Kimi-K2 model's calls (special-token sections, decoded
        with their tokens) are rewritten as Hermes blocks and their ids kept for the chat template."""
        if self.dialect == "kimi_k2":
            return kimi_to_hermes(self.tok.decode(text_ids, skip_special_tokens=False))
        return self.tok.decode(text_ids), []

    def _budget_left(self, traj: Trajectory) -> int:
        return self.max_len - len(traj.tokens)

    def _fit_observation(self, traj: Trajectory, obs_ids: list[int]) -> list[int] | None:
        """The observation ids to append so that a full next turn still fits, or None when the
        sample must stop for context. Truncation keeps the head and appends the marker."""
        return self._fit_ids(obs_ids, self._budget_left(traj) - self.sampling.max_tokens, self.truncate)

    def _fit_ids(self, obs_ids: list[int], room: int, truncate: bool) -> list[int] | None:
        if len(obs_ids) <= room:
            return obs_ids
        if not truncate:
            return None
        # The marker's length depends on the count it reports: iterate to the fixed point
        # (it moves by at most a digit or two, so this ends in a few rounds).
        keep = room
        for _ in range(8):
            marker = self.tok.encode(TRUNCATION_MARKER.format(n=len(obs_ids) - max(keep, 0))).ids
            new_keep = room - len(marker)
            if new_keep == keep:
                break
            keep = new_keep
        if keep < 0:
            return None  # not even the marker fits with a full turn: the context is full
        return obs_ids[:keep] + marker

    def _fit_chat_observation(
        self,
        room: int,
        conv: ChatConversation,
        text_ids: list[int],
        ended_eos: bool,
        observation: str,
        call_ids: list[str] | None,
        truncate: bool,
    ) -> list[int] | None:
        """Like _fit_observation, through the chat template: the observation is the template's
        continuation after the model's turn; truncation cuts the last message's content (never
        the template's own turn markers) and re-renders. Commits the turn to `conv` when it fits.
        `room`: the tokens the observation may take (the budget left minus a full next turn)."""
        model_text = self.tok.decode(text_ids, skip_special_tokens=False)
        messages = observation_messages(observation, call_ids)
        original = messages[-1]
        content_ids: list[int] = []
        cut = -1  # tokens of the last message's content kept; -1: not cut yet
        for _ in range(8):  # a cut rarely needs a second round (re-encoding may shift a token)
            text = conv.continuation(model_text, ended_eos, messages)
            ids = self.tok.encode(text, add_special_tokens=False).ids
            if len(ids) <= room:
                conv.commit(model_text, ended_eos, messages, text)
                return ids
            if not truncate or cut == 0:
                return None  # stop mode, or only the marker is left and it still does not fit
            over = len(ids) - room
            if cut < 0:
                content_ids = self.tok.encode(original["content"], add_special_tokens=False).ids
                marker = TRUNCATION_MARKER.format(n=over)
                cut = len(content_ids) - len(self.tok.encode(marker, add_special_tokens=False).ids)
            cut = max(cut - over, 0)
            content = self.tok.decode(content_ids[:cut], skip_special_tokens=False)
            marked = content + TRUNCATION_MARKER.format(n=len(content_ids) - cut)
            messages = [*messages[:-1], {**original, "content": marked}]
        return None

    def _stub_ids(self, rec: TurnRecord) -> list[int]:
        """A plain observation as it stands in a trimmed context: each tool output (or the whole
        text) replaced by the trim marker; kept as it was when that is no shorter."""
        if rec.stubbed:
            return rec.obs_ids
        contents = parse_tool_observation(rec.observation)
        if contents is not None:
            marks = [ToolResult("", TRIM_MARKER.format(n=len(self.tok.encode(c).ids))) for c in contents]
            text = render_tool_results(marks, "plain")
        else:
            text = TRIM_MARKER.format(n=len(rec.obs_ids))
        ids = self.tok.encode(text).ids
        return ids if len(ids) < len(rec.obs_ids) else rec.obs_ids

    def _stub_messages(self, rec: TurnRecord) -> list[dict[str, Any]]:
        """The chat-path counterpart of _stub_ids: each env message's content as the marker."""
        if rec.stubbed:
            return rec.messages
        out = []
        for m in rec.messages:
            n = len(self.tok.encode(m["content"], add_special_tokens=False).ids)
            marker = TRIM_MARKER.format(n=n)
            short = len(self.tok.encode(marker, add_special_tokens=False).ids) < n
            out.append({**m, "content": marker} if short else m)
        return out

    def _rebuild(
        self, traj: Trajectory, conv: ChatConversation | None, start: int, verbatim_from: int
    ) -> tuple[list[int], list[int], list[TurnRecord], ChatConversation | None]:
        """A trimmed context: the prompt, then turns start.. of the turn log but the last (the
        current one, whose observation is pending) with their model ids verbatim and their
        observations stubbed before `verbatim_from`; then the current turn's ids. Returns the
        ids, each rebuilt turn's length, the rebuilt turns' records and (chat path) the
        conversation the template renders for it (TemplateMismatch if it renders otherwise)."""
        past, cur = traj.turn_log[:-1], traj.turn_log[-1]
        ids = list(traj.prompt)
        lens: list[int] = []
        recs: list[TurnRecord] = []
        new: ChatConversation | None = None
        if conv is not None:
            new = ChatConversation(conv.template, conv.tools, conv.messages[0]["content"], conv.eos_text)
        for i in range(start, len(past)):
            rec = past[i]
            stub = i < verbatim_from
            if new is None:
                obs = self._stub_ids(rec) if stub else rec.obs_ids
                rec = replace(rec, obs_ids=obs, stubbed=rec.stubbed or obs is not rec.obs_ids)
            else:
                msgs = self._stub_messages(rec) if stub else rec.messages
                text = new.continuation(rec.model_text, rec.closed, msgs)
                new.commit(rec.model_text, rec.closed, msgs, text)
                obs = self.tok.encode(text, add_special_tokens=False).ids
                rec = replace(rec, messages=msgs, obs_ids=obs, stubbed=rec.stubbed or stub)
            ids += rec.output_ids
            ids += obs
            lens.append(len(rec.output_ids) + len(obs))
            recs.append(rec)
        return [*ids, *cur.output_ids], lens, recs, new

    def _trim_history(
        self,
        traj: Trajectory,
        conv: ChatConversation | None,
        turn_ids: list[int],
        closed: bool,
        observation: str,
        call_ids: list[str],
    ) -> list[int] | None:
        """context_overflow = "trim_history": the current observation does not fit. Close the
        sample's current part and continue from a trimmed context (prompt, old observations as
        trim markers, the oldest turns dropped while it exceeds context_trim_target of the budget,
        the last context_keep_turns observations verbatim, the current turn), then the
        observation (truncated if needed). More turns are dropped if it still does not fit.
        Returns the observation ids to append to the new part, or None (nothing changed) when
        not even the prompt and the current turn leave it room. Model ids are never
        re-tokenised: the new part's context holds the engine's ids of every kept turn."""
        o = self.cfg.orchestrator
        past = len(traj.turn_log) - 1
        verbatim_from = max(0, past - o.context_keep_turns)
        ids, lens, _, _ = self._rebuild(traj, conv, 0, verbatim_from)
        plain_obs = self.tok.encode(observation).ids if conv is None else []
        estimate = len(plain_obs) if conv is None else len(self.tok.encode(observation).ids)
        total = len(ids) + estimate + self.sampling.max_tokens
        start = 0
        while total > self.max_len * o.context_trim_target and start < verbatim_from:
            total -= lens[start]
            start += 1
        for first in range(start, past + 1):
            ids, _, recs, new = self._rebuild(traj, conv, first, verbatim_from)
            room = self.max_len - len(ids) - self.sampling.max_tokens
            if new is None:
                obs = self._fit_ids(plain_obs, room, truncate=True)
            else:
                obs = self._fit_chat_observation(room, new, turn_ids, closed, observation, call_ids, True)
            if obs is None:
                continue
            traj.start_part(ids)
            traj.turn_log = [*recs, traj.turn_log[-1]]
            if conv is not None and new is not None:
                conv.messages, conv.text = new.messages, new.text
            log.info(
                "history trimmed after turn %d: %d turns dropped, %d stubbed, context %d tokens",
                traj.turns, first, max(0, verbatim_from - first), len(ids) + len(obs),
            )  # fmt: skip
            return obs
        return None

    async def _finish_sample(
        self,
        session: SandboxSession,
        traj: Trajectory,
        choice: GenerateChoice,
        turn: _Deadline,
        rollout_at: float | None,
        conv: ChatConversation | None = None,
    ) -> tuple[float, Credit | None]:
        """Play the rest of one sample's episode after its first model turn; returns the reward
        and the env's per-character credit (None if it gives none).
        `turn` is the deadline of the turn whose generation produced `choice`."""
        turn_timeout_s = self.cfg.orchestrator.turn_timeout_s
        while True:
            traj.add_model(choice)
            if self.trim:
                traj.turn_log.append(TurnRecord(choice.output_ids))
            last = choice.output_ids[-1] if choice.output_ids else None
            ended_eos = last in self.eos_ids
            # The action is the turn's text without its EOS token, whichever EOS id it was.
            text_ids = choice.output_ids[:-1] if ended_eos else choice.output_ids
            traj.actions.append(
                ActionSpan(len(traj.tokens) - len(choice.output_ids), len(text_ids), ended_eos)
            )
            action, call_ids = self._action(text_ids)
            try:
                async with asyncio.timeout_at(turn.at):
                    step = await session.step(action, eos=ended_eos)
            except TimeoutError:
                # The sandbox still finishes the step (env code is not interruptible); score()
                # below waits for it server-side, so the reward sees the action's effect.
                traj.finish_reason = turn.reason
                break
            if step.done:
                traj.finish_reason = "done"
                if step.reward is not None:
                    return step.reward, step.credit
                break
            if traj.turns >= self.cfg.orchestrator.max_turns:
                traj.finish_reason = "max_turns"
                break
            # Only the end-of-turn id is the template's own close of the turn. Another EOS id
            # (e.g. <|endoftext|>) stays in the turn's text as the model wrote it, and the
            # template's close (<|im_end|>) is environment text after it: the tokens stay
            # exactly the template's rendering of the conversation.
            closed = last == self.eos
            turn_ids = text_ids if closed else choice.output_ids
            try:
                if conv is None:
                    obs_ids = self._fit_observation(traj, self.tok.encode(step.observation).ids)
                else:
                    room = self._budget_left(traj) - self.sampling.max_tokens
                    obs_ids = self._fit_chat_observation(
                        room, conv, turn_ids, closed, step.observation, call_ids, self.truncate
                    )
                if obs_ids is None and self.trim:
                    obs_ids = self._trim_history(traj, conv, turn_ids, closed, step.observation, call_ids)
            except TemplateMismatch as e:
                # Continuing would feed the model a history its template never renders.
                log.warning("chat template mismatch, sample ends: %s", e)
                traj.finish_reason = "template_mismatch"
                break
            if obs_ids is None:
                traj.finish_reason = (
                    "context_truncated" if self.overflow == "truncate_observation" else "context"
                )
                break
            if self.trim:
                rec = traj.turn_log[-1]
                rec.observation, rec.obs_ids = step.observation, obs_ids
                if conv is not None:
                    # the turn just committed: the last assistant message, then the env's
                    at = max(i for i, m in enumerate(conv.messages) if m["role"] == "assistant")
                    rec.model_text, rec.closed = conv.messages[at]["content"], closed
                    rec.messages = conv.messages[at + 1 :]
            turn = _Deadline(turn_timeout_s, rollout_at)
            traj.add_env(obs_ids)
            try:
                async with asyncio.timeout_at(turn.at):
                    traj.decode_url, (choice,) = await self._generate(traj.tokens, 1, None, traj.decode_url)
            except TimeoutError:
                # asyncio.timeout_at raises TimeoutError only for its own deadline; transport
                # timeouts below it arrive as ServiceUnavailable (clients._post).
                traj.drop_env(len(obs_ids))  # the sample ends on its last model turn
                traj.finish_reason = turn.reason
                break
        return await self._score(session, traj)

    async def _score(self, session: SandboxSession, traj: Trajectory) -> tuple[float, Credit | None]:
        try:
            scored = await session.score()
            return scored.reward, scored.credit
        except ServiceUnavailable as e:
            if traj.finish_reason in ("turn_timeout", "rollout_timeout"):
                # The step that timed out is still running (or hung) in the sandbox: re-running
                # the group would most likely time out again, so it is dropped, and counted.
                raise GroupTimedOut(f"{traj.finish_reason}: scoring after the timeout failed: {e}") from e
            raise

    async def run(self, spec: GroupSpec) -> RolloutGroup:
        o = self.cfg.orchestrator
        g = o.group_size
        loop = asyncio.get_running_loop()
        rollout_at = None if o.rollout_timeout_s is None else loop.time() + o.rollout_timeout_s
        try:
            async with asyncio.timeout_at(rollout_at):
                sessions = await self.sandbox.open_group(spec.env, spec.seed, g)
        except TimeoutError:
            raise GroupTimedOut(
                f"rollout_timeout: opening {g} {spec.env} sessions took longer than "
                f"orchestrator.rollout_timeout_s={o.rollout_timeout_s:g} s"
            ) from None
        try:
            prompt = sessions[0].prompt
            parsed = parse_tools_prompt(prompt) if self.chat is not None else None
            convs: list[ChatConversation | None] = [None] * g
            if self.chat is not None and parsed is not None:
                convs = [ChatConversation(self.chat, *parsed, self.eos_text) for _ in range(g)]
                # The template's text carries its own special tokens (BOS included, if any).
                prompt_ids = self.tok.encode(convs[0].text, add_special_tokens=False).ids  # type: ignore[union-attr]
            else:
                prompt_ids = self.tok.encode(prompt).ids
            if len(prompt_ids) + self.sampling.max_tokens > self.max_len:
                raise ValueError(f"{spec.env} prompt of {len(prompt_ids)} tokens exceeds the context budget")
            # The first turn shares one prompt: one request with n samples lets decode prefill once.
            seed = zlib.crc32(f"{spec.group_id}:{spec.seed}".encode())
            turn = _Deadline(o.turn_timeout_s, rollout_at)
            try:
                async with asyncio.timeout_at(turn.at):
                    url, first = await self._generate(prompt_ids, g, seed)
            except TimeoutError:
                budget = "turn_timeout_s" if turn.reason == "turn_timeout" else "rollout_timeout_s"
                raise GroupTimedOut(
                    f"{turn.reason}: the group's first generation outlasted "
                    f"orchestrator.{budget}={getattr(o, budget):g} s; no sample has a model turn"
                ) from None
            trajs = [Trajectory.start(prompt_ids, url) for _ in range(g)]
            scored = await _gather_or_cancel(
                [
                    self._finish_sample(s, t, c, turn, rollout_at, conv)
                    for s, t, c, conv in zip(sessions, trajs, first, convs, strict=True)
                ]
            )
        finally:
            await asyncio.gather(*(s.close() for s in sessions))
        rewards = [r for r, _ in scored]
        segments = [t.segments() for t in trajs]  # before reading the trajectories' last parts
        o = self.cfg.orchestrator
        advantages = group_advantages(rewards, o.advantage_std_norm, o.baseline_prior)
        per_token = None
        if o.advantage == "token":
            per_token = group_token_advantages(
                self.tok,
                [t.tokens for t in trajs],
                [t.actions for t in trajs],
                [c for _, c in scored],
                advantages,
                [t.mask for t in trajs],
                o.baseline_prior,
            )
        samples = [
            t.sample(sample_id(spec.group_id, i), r, a, None if per_token is None else per_token[i], segs)
            for i, (t, r, a, segs) in enumerate(zip(trajs, rewards, advantages, segments, strict=True))
        ]
        return RolloutGroup(group_id=spec.group_id, env=spec.env, seed=spec.seed, samples=samples)


async def _gather_or_cancel(coros: list[Coroutine[Any, Any, T]]) -> list[T]:
    """asyncio.gather, except that the first failure cancels the other samples (their sessions
    are closed next, so they could only fail later, unobserved) and is re-raised as itself."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def group_advantages(rewards: list[float], std_norm: bool, prior: float = 0.0) -> list[float]:
    """Reward minus the group's baseline; `prior` (orchestrator.baseline_prior) counts that many
    more samples of full reward (1.0) in the baseline, so a group that got nothing is pushed
    away from what it sampled instead of getting advantage 0."""
    mean = (sum(rewards) + prior) / (len(rewards) + prior)
    adv = [r - mean for r in rewards]
    if not std_norm:
        return adv
    std = (sum(a * a for a in adv) / len(adv)) ** 0.5
    # Below 1e-6 the group is (numerically) constant: no signal, not a huge one.
    return [a / std if std > 1e-6 else 0.0 for a in adv]


def render_sample(sample: Sample, tok: Tokenizer) -> list[dict[str, object]]:
    """Split a sample into prompt / model / env segments with their text, for humans."""
    segments: list[dict[str, object]] = []
    advantages = sample.advantages_per_token()
    start = 0
    seen_model = False
    for i in range(1, len(sample.tokens) + 1):
        if i == len(sample.tokens) or sample.loss_mask[i] != sample.loss_mask[start]:
            ids = sample.tokens[start:i]
            trained = bool(sample.loss_mask[start])
            role = "model" if trained else ("env" if seen_model else "prompt")
            seen_model = seen_model or trained
            seg: dict[str, object] = {
                "role": role,
                "text": tok.decode(ids, skip_special_tokens=False),
                "tokens": ids,
                "trained": trained,
            }
            if trained:
                # Each token's text, log-prob, weight version and the advantage it was trained
                # with (token credit: its own; otherwise the sample's, on every token).
                seg["pieces"] = [tok.decode([t], skip_special_tokens=False) for t in ids]
                seg["logprobs"] = sample.logprobs[start:i]
                seg["versions"] = sample.versions[start:i]
                seg["advantages"] = advantages[start:i]
            segments.append(seg)
            start = i
    return segments
