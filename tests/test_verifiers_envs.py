"""verifiers environments, unmodified, run by relay: the sandbox loads them with verifiers'
`load_environment`, runs the environment's own rollouts against decode's OpenAI API (verifiers'
token client: return_token_ids, /tokenize, /v1/chat/completions/tokens) and scores them with its
rubric; the orchestrator stitches each rollout's turns into one training sample.

Real processes over HTTP: a decode service on a bigram chat model (tests/helpers/bigram_chat.py)
that calls a tool, reads its result and answers, and a sandbox service loading the tool
environment `tests/vf_envs/relay_vf_lookup.py` (written with the verifiers API only). The sample
must be exactly the template's rendering of the whole conversation, with only the model's tokens
trained, and its reward the rubric's."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from helpers.bigram_chat import IM_END, IM_START, TEMPLATE, bigram_chat_dir, bigram_model_config
from helpers.decode_server import Server, decode_server
from helpers.service_process import start_with_config, wait_registered

from services.common.auth import auth_headers
from services.common.chat import ChatTemplate
from services.common.config import RunConfig, TaskSpec
from services.common.schemas import SamplingParams
from services.common.tokenizer import load_tokenizer
from services.orchestrator.clients import DecodeClient, Registry, Router, SandboxClient
from services.orchestrator.rollout import GroupSpec
from services.orchestrator.verifiers_rollout import run_verifiers_group, stitch

VF_ENVS = Path(__file__).resolve().parent / "vf_envs"
CALL = '<tool_call>\n{"name": "lookup", "arguments": {"key": "k"}}\n</tool_call>'
# After a tool result the generation prompt ends with ":" instead of "\n", so the bigram model
# knows it has the result: it calls the tool first, then answers.
TOOL_TEMPLATE = TEMPLATE.replace(
    "{{ '<|im_start|>assistant\\n' }}{% endif %}",
    "{{ '<|im_start|>assistant' + (':' if messages[-1].role == 'tool' else '\\n') }}{% endif %}",
)
assert TOOL_TEMPLATE != TEMPLATE


@pytest.fixture(scope="module")
def decode(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("vf-decode")
    d = bigram_chat_dir(
        tmp / "step_0", [["\n", CALL, IM_END], [":", "v42", IM_END]], [CALL, "v42"], TOOL_TEMPLATE
    )
    with decode_server(
        redis_url, d, bigram_model_config(), tmp, prefix="test-vf", max_seq_len=1024, run_name="vf-bigram"
    ) as s:
        yield s


@pytest.fixture(scope="module")
def sandbox_cfg(decode: Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunConfig]:
    """A sandbox process (same Redis prefix as decode) with the verifiers tool env loaded."""
    tmp = tmp_path_factory.mktemp("vf-sandbox")
    cfg = decode.cfg.model_copy(deep=True)
    cfg.run.name = "vf-bigram"
    cfg.orchestrator.group_size = 2
    cfg.orchestrator.tasks = [TaskSpec(env="vf-lookup", verifiers="relay_vf_lookup", args={"max_turns": 3})]
    old = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(VF_ENVS), old) if p)
    try:
        proc = start_with_config("services.sandbox", cfg, decode.bus.url, tmp, "sandbox")
    finally:
        os.environ["PYTHONPATH"] = old
    try:
        wait_registered(decode.bus, "sandbox", proc, tmp / "sandbox.log")
        yield cfg
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def run_group(cfg: RunConfig, bus_services: object, seed: int) -> object:
    async def go() -> object:
        async with aiohttp.ClientSession(headers=auth_headers()) as http:
            registry = Registry(bus_services)  # type: ignore[arg-type]
            dec = DecodeClient(http, Router(registry, "decode"))
            sb = SandboxClient(http, Router(registry, "sandbox"))
            sampling = SamplingParams(temperature=1.0, max_tokens=64)
            return await run_verifiers_group(cfg, dec, sb, sampling, GroupSpec("g-vf", "vf-lookup", seed))

    return asyncio.run(go())


def test_tool_env_rollout_is_one_exact_sample(decode: Server, sandbox_cfg: RunConfig) -> None:
    group = run_group(sandbox_cfg, decode.bus.services, seed=0)  # example 0: "value of k?" -> v42
    tok = load_tokenizer(decode.model_dir)
    tpl = ChatTemplate.from_model_dir(decode.model_dir)
    assert tpl is not None
    assert len(group.samples) == 2  # type: ignore[attr-defined]
    for s in group.samples:  # type: ignore[attr-defined]
        assert s.reward == 1.0 and s.turns == 2 and s.finish_reason == "done"
        text = tok.decode(s.tokens, skip_special_tokens=False)
        # The whole conversation as the template renders it: the model's tool call, the tool's
        # result (the environment ran lookup), the answer.
        assert text.endswith(
            f"{CALL}{IM_END}\n{IM_START}user\n<tool_response>\nv42\n</tool_response>{IM_END}\n"
            f"{IM_START}assistant:v42{IM_END}"
        ), text
        assert text.startswith(f"{IM_START}system\n# Tools\n<tools>\n") and "value of k?" in text
        trained = [t for t, m in zip(s.tokens, s.loss_mask, strict=True) if m]
        assert tok.decode(trained, skip_special_tokens=False) == f"{CALL}{IM_END}v42{IM_END}"
        assert len(trained) == 4 and all(lp <= 0 for lp, m in zip(s.logprobs, s.loss_mask, strict=True) if m)
        assert {v for v, m in zip(s.versions, s.loss_mask, strict=True) if m} == {0}
    # A group where the model's answer is wrong for the example: the rubric gives 0.
    wrong = run_group(sandbox_cfg, decode.bus.services, seed=1)  # "value of a?" -> ab; model says v42
    assert [s.reward for s in wrong.samples] == [0.0, 0.0]  # type: ignore[attr-defined]


def test_stitch_ends_a_sample_whose_next_prompt_does_not_extend_it() -> None:
    from services.common.schemas import VerifiersRollout, VerifiersTurn

    t1 = VerifiersTurn(
        prompt_ids=[1, 2], completion_ids=[3, 4], completion_logprobs=[-0.1, -0.2], versions=[5, 5]
    )
    ok = VerifiersTurn(
        prompt_ids=[1, 2, 3, 4, 9], completion_ids=[7], completion_logprobs=[-0.3], versions=[6]
    )
    bad = VerifiersTurn(
        prompt_ids=[1, 2, 3, 8, 9], completion_ids=[7], completion_logprobs=[-0.3], versions=[6]
    )
    good = stitch(VerifiersRollout(turns=[t1, ok], reward=1.0))
    assert good is not None
    assert good.tokens == [1, 2, 3, 4, 9, 7] and good.mask == [0, 0, 1, 1, 0, 1]
    assert good.versions == [-1, -1, 5, 5, -1, 6] and good.finish_reason == "done"
    cut = stitch(VerifiersRollout(turns=[t1, bad], reward=0.5))
    assert cut is not None and cut.tokens == [1, 2, 3, 4] and cut.finish_reason == "template_mismatch"
    assert stitch(VerifiersRollout(turns=[], reward=0.0, error="boom")) is None
