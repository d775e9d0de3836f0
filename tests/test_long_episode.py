"""One episode of 105 tool calls end to end, past the model's context, with
`orchestrator.context_overflow = "trim_history"`: the orchestrator's RolloutRunner over a real
decode process (a tiny HF chat model on CPU whose weights are a bigram table: after the generation
prompt it always writes one `bash` tool call, tests/helpers/bigram_chat.py) and a real sandbox
process running `long-tools` (tests/helpers/long_tool_env.py: every call runs in the session's
sandbox and logs a line; reward = the share of the 105 calls logged).

Checks: every call executed (reward 1.0, 105 turns, the episode ends "done"); the first trim
happens exactly at the turn where the template's rendering of the untrimmed conversation plus a
full turn first exceeds the context; each part of the sample is exactly the template's rendering
of what the model was given (model ids verbatim, each turn's trained tokens the engine's 4-token
call), every model turn trained in exactly one part and no part longer than the context; the
group committed by the orchestrator to Redis reads back with its segments and their reason, and
the trainer's sequences are those parts."""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from helpers.bigram_chat import IM_END, bigram_chat_dir, bigram_model_config
from helpers.decode_server import Server, decode_server
from helpers.long_tool_env import CALLS, CMD, TOOLS, tool_output
from helpers.sandbox import session_root
from test_sandbox_service import Sandbox

from services.common.auth import auth_headers
from services.common.bus import Bus
from services.common.chat import ChatTemplate
from services.common.registry import Registry
from services.common.schemas import RolloutGroup
from services.common.tokenizer import load_tokenizer
from services.orchestrator.clients import DecodeClient, Router, SandboxClient
from services.orchestrator.loop import Orchestrator
from services.orchestrator.rollout import TRIM_MARKER, GroupSpec, RolloutRunner
from trainer.batch import flatten

CALL = json.dumps({"name": "bash", "arguments": {"cmd": CMD}})
# After the generation prompt (which ends with "\n") the model writes exactly this turn.
CHAIN = ["\n", "<tool_call>\n", CALL, "\n</tool_call>", IM_END]
TURN = "".join(CHAIN[1:-1])
MAX_LEN = 2048
MAX_TOKENS = 8
KEEP = 3


@pytest.fixture(scope="module")
def decode(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("long-episode")
    d = bigram_chat_dir(tmp / "step_0", [CHAIN], words=CHAIN[1:4])
    with decode_server(
        redis_url, d, bigram_model_config(), tmp, prefix="long-episode", max_seq_len=MAX_LEN
    ) as server:
        yield server


@pytest.fixture(scope="module")
def sandbox(redis_url: str, tmp_path_factory: pytest.TempPathFactory, bwrap: str) -> Iterator[Sandbox]:
    with session_root("relay-long-episode-") as root:
        sb = Sandbox(
            tmp_path_factory.mktemp("sb"),
            redis_url,
            workdir_root=str(root),
            uid_base=random.randrange(1_000_000, 50_000_000, 1000),
            plugins=["helpers.long_tool_env"],
        ).wait_ready()
        yield sb
        sb.stop()


def conversation(turns: int) -> list[dict[str, Any]]:
    """The untrimmed conversation after `turns` tool calls and their results."""
    msgs: list[dict[str, Any]] = []
    for n in range(1, turns + 1):
        msgs += [{"role": "assistant", "content": TURN}, {"role": "tool", "content": tool_output(n)}]
    return msgs


def expected(
    user: dict[str, Any],
    first_kept: int,
    stub_until: int,
    last: int,
    tpl: ChatTemplate,
    schemas: Any,
    ids: Any,
) -> str:
    """The template's rendering of turns first_kept..last (results before stub_until as trim
    markers, each counting its result's tokens), ending on the model's turn `last`."""
    msgs: list[dict[str, Any]] = [user]
    for m in range(first_kept, last + 1):
        msgs.append({"role": "assistant", "content": TURN})
        if m < last:
            out = tool_output(m)
            content = TRIM_MARKER.format(n=len(ids(out))) if m < stub_until else out
            msgs.append({"role": "tool", "content": content})
    text = tpl.render(msgs, tools=schemas, add_generation_prompt=False)
    return text.removesuffix("\n")


def test_long_tool_episode_past_the_context(
    decode: Server, sandbox: Sandbox, redis_url: str, tmp_path: Path
) -> None:
    d = decode.model_dir
    tok = load_tokenizer(d)
    tpl = ChatTemplate.from_model_dir(d)
    cfg = decode.cfg.model_copy(deep=True)
    o = cfg.orchestrator
    o.group_size, o.max_turns = 2, CALLS + 10
    o.sampling.max_tokens, o.sampling.temperature = MAX_TOKENS, 1.0
    o.context_overflow, o.context_keep_turns = "trim_history", KEEP
    cfg.model.max_seq_len = MAX_LEN

    async def run() -> RolloutGroup:
        async with aiohttp.ClientSession(headers=auth_headers()) as http:
            dec = DecodeClient(http, Router(Registry(decode.bus.services), "decode"))
            sb = SandboxClient(http, Router(Registry(sandbox.bus.services), "sandbox"))
            runner = RolloutRunner.for_model_dir(cfg, dec, sb, d)
            return await runner.run(GroupSpec("long-0", "long-tools", 0))

    t0 = time.monotonic()
    group = asyncio.run(run())
    took = time.monotonic() - t0

    schemas = [t.as_json() for t in TOOLS]
    user_text = f"Run `{CMD}` {CALLS} times, one call per turn."
    user = {"role": "user", "content": user_text}

    def ids(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False).ids

    prompt = ids(tpl.render([user], tools=schemas))
    turn_ids = ids(TURN + IM_END)
    assert len(turn_ids) == 4
    # The first overflow: the first turn t whose result, rendered after the untrimmed history,
    # leaves no room for a full next turn.
    first_trim = next(
        t
        for t in range(1, CALLS)
        if len(ids(tpl.render([user, *conversation(t)], tools=schemas))) + MAX_TOKENS > MAX_LEN
    )
    for s in group.samples:
        # every call the model made ran in the sandbox: 120 lines in calls.log
        assert s.finish_reason == "done" and s.turns == CALLS and s.reward == 1.0
        parts = s.parts()
        assert len(parts) == len(s.segments) + 1 >= 3
        assert s.segments[0].trimmed_after_turn == first_trim
        assert all(seg.reason == "context_trim" for seg in s.segments)
        after = [seg.trimmed_after_turn for seg in s.segments]
        assert after == sorted(set(after)) and after[-1] < CALLS
        trained_turns = 0
        for k, p in enumerate(parts):
            assert len(p.tokens) <= MAX_LEN and p.tokens[: len(prompt)] == prompt
            # each turn trained in this part is the engine's 4 tokens, with their log-probs
            trained = [t for t, m in zip(p.tokens, p.loss_mask, strict=True) if m]
            assert trained == turn_ids * p.turns and p.turns > 0
            assert all(v == 0 for v, m in zip(p.versions, p.loss_mask, strict=True) if m)
            assert all(-0.1 < lp <= 0.0 for lp, m in zip(p.logprobs, p.loss_mask, strict=True) if m)
            context = p.tokens[: p.loss_mask.index(1)]
            if k == 0:  # the untrimmed conversation up to the turn that overflowed
                first_kept = stub_until = 1
                last = after[0]
                assert p.turns == after[0]
            else:
                # The trimmed context: the prompt, the oldest turns dropped, older results as
                # markers, the last KEEP results verbatim, then the turn that overflowed and its
                # (untruncated) result; its size at most the trim target.
                n = after[k - 1]
                last = n + p.turns
                kept = tok.decode(context, skip_special_tokens=False).count(TURN)
                stub_until, first_kept = n - KEEP, n - kept + 1
                assert first_kept <= stub_until and len(context) + MAX_TOKENS <= MAX_LEN // 2 + 64
            # the part is exactly the template's rendering of that conversation, ending on its
            # last model turn (model ids verbatim: the tokenizer's ids of the call)
            text = expected(user, first_kept, stub_until, last, tpl, schemas, ids)
            assert tok.decode(p.tokens, skip_special_tokens=False) == text
            assert p.tokens == ids(text)
            assert p.loss_mask == [0] * len(context) + p.loss_mask[len(context) :]
            trained_turns += p.turns
        assert trained_turns == CALLS  # every model turn trained once, in the context it came from
    # The orchestrator records the group: the transcript reads back with its segments and reasons,
    # and the trainer's sequences are exactly its parts.
    bus = Bus(redis_url, f"long-episode-{uuid.uuid4().hex[:8]}")
    orch = Orchestrator(cfg, bus, tmp_path)
    orch._commit_group(group)
    stored = RolloutGroup.model_validate_json(bus.r.get(bus.k.rollout(group.group_id)))
    assert stored.samples[0].segments == group.samples[0].segments
    assert [q.finish_reason for q in stored.samples[0].parts()] == ["context_trim"] * len(after) + ["done"]
    sequences = flatten([stored])
    assert [q.tokens for q in sequences] == [p.tokens for s in group.samples for p in s.parts()]
    assert sum(sum(q.loss_mask) for q in sequences) == 2 * CALLS * 4
    # catches a per-turn cost that grows with the episode (20-60 s on 2 cores, with the load)
    assert took < 90, took
