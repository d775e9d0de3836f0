"""verifiers environments, unmodified, inside the sandbox.

A run config names one as a task: `{ env = "<name>", verifiers = "<module>", args = {...} }`.
At start the sandbox builds it with verifiers' own `load_environment(module, **args)` and its
dataset (`get_dataset()`). `POST /v1/verifiers/{env}/group` then runs one group: example
`seed % len(dataset)`, `n` rollouts of it through the environment's own `rollout` (its turns,
tools, stop conditions), against one decode replica's OpenAI API, and scores them with the
environment's rubric (`score_group`, so group-level reward functions work too).

The model is reached through verifiers' token client (`OpenAIChatCompletionsTokenClient`, the
one prime-rl trains with): the first turn is a `/v1/chat/completions` call with
`return_token_ids`, later turns go to `/v1/chat/completions/tokens` with the previous turn's
prompt and completion ids plus the `/tokenize`d bridge (the new messages), so the model's tokens
are never re-tokenised. Each turn is read off decode's raw response (verifiers keeps only the fields
it knows, and drops a turn it rejects, e.g. an empty answer): prompt ids, completion ids, their
log-probs and the weight version of every completion token. The orchestrator stitches the turns into one training
sample (services/orchestrator/verifiers_rollout.py).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx

from services.common.auth import token_from_env
from services.common.config import TaskSpec
from services.common.schemas import (
    VerifiersGroupRequest,
    VerifiersGroupResponse,
    VerifiersRollout,
    VerifiersTurn,
)

log = logging.getLogger("sandbox.verifiers")

# The routes whose responses carry a turn's token ids (and relay's weight_versions).
_GENERATION_PATHS = ("/chat/completions", "/chat/completions/tokens", "/completions")


ROLLOUT_HEADER = "x-relay-rollout"


class VerifiersError(RuntimeError):
    """A verifiers task cannot be loaded or run (message names the task)."""


class DecodeUnavailable(VerifiersError):
    """A rollout could not reach decode: the group is to be run again (HTTP 503)."""


class VerifiersHost:
    """The run's verifiers environments by task name, with their datasets."""

    def __init__(self) -> None:
        self.envs: dict[str, Any] = {}
        self.datasets: dict[str, list[dict[str, Any]]] = {}

    @classmethod
    def from_tasks(cls, tasks: list[TaskSpec]) -> VerifiersHost:
        host = cls()
        for i, t in enumerate(tasks):
            if t.verifiers is not None:
                host.load(t.env, t.verifiers, t.args, f"orchestrator.tasks[{i}]")
        return host

    def load(self, name: str, module: str, args: dict[str, Any], where: str = "") -> None:
        try:
            import verifiers as vf
        except ImportError as e:
            raise VerifiersError(
                f"{where}.verifiers = {module!r}: the verifiers package is not installed "
                "(pip install 'relay[verifiers]')"
            ) from e
        try:
            env = vf.load_environment(module, **args)
            dataset = env.get_dataset()
        except Exception as e:
            raise VerifiersError(
                f"{where}.verifiers = {module!r}: load_environment failed: {type(e).__name__}: {e}"
            ) from e
        rows = [dict(r) for r in dataset] if dataset is not None else []
        if not rows:
            raise VerifiersError(f"{where}.verifiers = {module!r}: the environment has no dataset rows")
        self.envs[name], self.datasets[name] = env, rows
        log.info("verifiers environment %s loaded from %s (%d examples)", name, module, len(rows))

    def names(self) -> list[str]:
        return sorted(self.envs)

    def describe(self, name: str) -> dict[str, Any]:
        env = self.envs[name]
        return {
            "name": name,
            "max_turns": int(getattr(env, "max_turns", 1) or 1),
            "description": f"verifiers {type(env).__name__} ({len(self.datasets[name])} examples)",
        }

    async def run_group(self, name: str, req: VerifiersGroupRequest) -> VerifiersGroupResponse:
        from openai import AsyncOpenAI
        from verifiers.clients import OpenAIChatCompletionsTokenClient, OpenAICompletionsClient

        env = self.envs[name]
        rows = self.datasets[name]
        row = rows[req.seed % len(rows)]
        s = req.sampling
        chat = getattr(env, "message_type", "chat") == "chat"
        extra: dict[str, Any] = {"return_token_ids": True}
        if s.top_k:
            extra["top_k"] = s.top_k
        sampling: dict[str, Any] = {
            "temperature": s.temperature,
            "top_p": s.top_p,
            "max_tokens": s.max_tokens,
            "extra_body": extra,
        }
        if not chat:
            sampling["logprobs"] = 0  # the token client asks for them itself on chat

        # One connection pool for the group; each rollout's requests carry its index, so its
        # raw responses are its turns, in order, including one verifiers discards (an empty
        # answer aborts the rollout without a trajectory step, but its tokens were sampled and
        # are trained on, at the rubric's reward).
        turns: list[list[VerifiersTurn]] = [[] for _ in range(req.n)]

        async def record(resp: httpx.Response) -> None:
            if resp.status_code == 200 and resp.request.url.path.endswith(_GENERATION_PATHS):
                await resp.aread()
                turns[int(resp.request.headers[ROLLOUT_HEADER])].append(_turn(resp.json()))

        async with httpx.AsyncClient(
            timeout=httpx.Timeout(600.0, connect=60.0),
            limits=httpx.Limits(max_connections=max(req.n, 16)),
            event_hooks={"response": [record]},
        ) as http:

            async def one(i: int) -> Any:
                oai = AsyncOpenAI(
                    base_url=f"{req.decode_url}/v1",
                    api_key=token_from_env(),  # the run token: decode requires it
                    http_client=http,
                    max_retries=0,
                    default_headers={ROLLOUT_HEADER: str(i)},
                )
                client = OpenAIChatCompletionsTokenClient(oai) if chat else OpenAICompletionsClient(oai)
                return await env.rollout(dict(row), client, req.model, sampling)

            states = await asyncio.gather(*(one(i) for i in range(req.n)))
        for st in states:
            # decode unreachable or failing: not the model's doing, so not a sample to train on;
            # the orchestrator re-runs the group (a 503)
            if (cause := _transport_error(st.get("error"))) is not None:
                raise DecodeUnavailable(f"decode at {req.decode_url}: {cause}")
        await env.rubric.score_group(states)
        for st in states:
            await env.rubric.cleanup(st)
        return VerifiersGroupResponse(rollouts=[_rollout(st, t) for st, t in zip(states, turns, strict=True)])


def _transport_error(err: BaseException | None) -> str | None:
    """The transport or server failure behind a rollout's error, if that is what ended it."""
    from openai import APIConnectionError, InternalServerError

    seen = 0
    while err is not None and seen < 16:
        if isinstance(err, APIConnectionError | InternalServerError):
            return f"{type(err).__name__}: {err}"
        err, seen = err.__cause__ or err.__context__, seen + 1
    return None


def _turn(body: dict[str, Any]) -> VerifiersTurn:
    """A generation response (return_token_ids) as a turn: chat puts prompt_token_ids at the top
    level and log-probs in logprobs.content, completions on the choice and in token_logprobs."""
    ch = body["choices"][0]
    prompt = body.get("prompt_token_ids") or ch.get("prompt_token_ids")
    lp = ch.get("logprobs") or {}
    logprobs = [c["logprob"] for c in lp["content"]] if "content" in lp else lp.get("token_logprobs")
    if prompt is None or "token_ids" not in ch or logprobs is None or "weight_versions" not in ch:
        raise VerifiersError("decode's response lacks token ids, log-probs or weight versions")
    return VerifiersTurn(
        prompt_ids=prompt,
        completion_ids=ch["token_ids"],
        completion_logprobs=[float(x) for x in logprobs],
        versions=ch["weight_versions"],
        truncated=ch.get("finish_reason") == "length",
    )


def _rollout(state: Any, turns: list[VerifiersTurn]) -> VerifiersRollout:
    reward = float(state.get("reward") or 0.0)
    metrics = {k: float(v) for k, v in (state.get("metrics") or {}).items() if isinstance(v, int | float)}
    err = state.get("error")
    return VerifiersRollout(
        turns=turns,
        reward=reward,
        metrics=metrics,
        stop_condition=state.get("stop_condition"),
        error=None if err is None else f"{type(err).__name__}: {err}",
    )
