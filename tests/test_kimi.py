"""Kimi-K2: its run config sizes (configs/kimi-k2.toml), YaRN RoPE in the trainer against HF (and
refused by the engine), its tiktoken tokenizer converted to the ids tiktoken gives, and its
tool-call format through the orchestrator's chat path (services/common/tools.py "kimi_k2").

Kimi-K2's files are not downloaded here: the tokenizer tests learn a small BPE in tiktoken's file
format, and the chat template is written in Kimi-K2's format (its role markers, tool declaration
turn, call sections and "## Return of <id>" results)."""

from __future__ import annotations

import asyncio
import base64
import collections
import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch
from helpers.moe import small_ds, small_glm, tokens

from services.common.config import CONFIG_DIR, REPO_ROOT, ModelConfig, RunConfig, YarnScaling
from services.common.schemas import (
    GenerateChoice,
    GenerateRequest,
    GenerateResponse,
    ScoreResponse,
    StepResponse,
)
from services.common.tokenizer import KIMI_PATTERN, load_tokenizer
from services.common.tools import (
    KIMI_SECTION_BEGIN,
    ToolCall,
    ToolCallError,
    kimi_to_hermes,
    parse_tool_calls,
)
from services.orchestrator.rollout import GroupSpec, RolloutRunner
from trainer.model import build_model, load_weights_dir, save_weights_dir

# ------------------------------------------------------------------ the configs


def test_kimi_k2_model_and_run_config_size() -> None:
    m = ModelConfig(**tomllib.loads((CONFIG_DIR / "models" / "kimi-k2.toml").read_text()))
    p = m.param_counts()
    # The count is the formula's; the formula is checked against a built model of Kimi-K2's kind
    # (every block the full model has, at small widths): parameter for parameter.
    small = m.model_copy(
        update={"n_layers": 2, "vocab_size": 256, "dim": 64, "n_heads": 2, "n_kv_heads": 2, "hidden_dim": 96,
                "n_routed_experts": 8, "n_experts_per_tok": 2, "moe_hidden_dim": 32, "q_lora_rank": 32,
                "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
                "head_dim": 24, "max_seq_len": 64, "rope_scaling": None}
    )  # fmt: skip
    assert sum(t.numel() for t in build_model(small, seed=0).parameters()) == small.param_counts()["total"]
    # Published: 1T total, 32B activated (the model card rounds both).
    assert p["total"] == pytest.approx(1.0e12, rel=0.03) and p["active"] == pytest.approx(32e9, rel=0.03)
    assert isinstance(m.rope_scaling, YarnScaling) and m.rope_scaling.factor * 4096 == m.max_seq_len
    out = subprocess.run(
        [sys.executable, "-m", "sbatch.launch", "run", "kimi-k2", "--dry-run"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "sizing: 1026.4B params (32.9B active)" in out.stdout
    assert "trainer state per GPU 86 GB" in out.stdout and "24 node(s) x 8 GPU" in out.stdout


# ------------------------------------------------------------------ YaRN


def yarn(factor: float = 4.0) -> YarnScaling:
    # Kimi-K2's shape of YaRN (beta_fast = beta_slow = 1), over a 16-token original context
    return YarnScaling(
        rope_type="yarn",
        factor=factor,
        original_max_position_embeddings=16,
        beta_fast=1.0,
        beta_slow=1.0,
        mscale=0.707,
        mscale_all_dim=0.707,
    )


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm_moe_dsa"])
def test_yarn_logits_match_hf(tmp_path: Path, arch: str) -> None:
    """YaRN's frequencies and softmax mscale (torchtitan's) equal HF's DeepSeek-V3 / GLM-5 yarn
    on 40 positions of a 16-position original context, and change the function."""
    from transformers import AutoModelForCausalLM

    make = small_ds if arch == "deepseek_v3" else small_glm
    m = make(rope_scaling=yarn(), max_seq_len=64)
    model = build_model(m, seed=0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.12, generator=torch.Generator().manual_seed(hash(name) % 1000))
    d = save_weights_dir(m, model.state_dict(), tmp_path / "w", {"version": 0})
    m2, _ = load_weights_dir(d)
    assert m2.rope_scaling == m.rope_scaling
    hf = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
    x = tokens(m, b=2, t=40)
    plain = build_model(make(max_seq_len=64))
    plain.load_state_dict(model.state_dict())
    with torch.no_grad():
        ours = model(x)
        torch.testing.assert_close(ours, hf(input_ids=x).logits, rtol=1e-5, atol=1e-5)
        assert (plain(x) - ours).abs().max().item() > 1e-3


def test_engine_refuses_yarn(tmp_path: Path) -> None:
    from services.common.config import EngineConfig
    from services.engine import LLMEngine, WeightsError

    m = small_ds(rope_scaling=yarn())
    d = save_weights_dir(m, build_model(m, seed=0).state_dict(), tmp_path / "w", {"version": 0})
    with pytest.raises(WeightsError, match="yarn"):
        LLMEngine(d, EngineConfig(device="cpu", max_batch_size=2, max_seq_len=64))


def test_yarn_only_for_mla_models_with_one_mscale() -> None:
    with pytest.raises(ValueError, match="MLA"):
        ModelConfig(arch="qwen3", rope_scaling=yarn())
    with pytest.raises(ValueError, match="mscale"):
        YarnScaling(
            rope_type="yarn", factor=4.0, original_max_position_embeddings=16, mscale=1.0, mscale_all_dim=0.5
        )


# ------------------------------------------------------------------ the tokenizer

SPECIALS = [
    "[BOS]",
    "[EOS]",
    "<|im_end|>",
    "<|im_user|>",
    "<|im_assistant|>",
    "<|im_system|>",
    "<|im_middle|>",
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
]
CORPUS = (
    "The quick brown fox jumps over the lazy dog. Don't panic: we'll read calc.py and run the tests.\n"
    "def add(a, b):\n    return a + b\n\nexit_code: 0\n3 passed in 0.01s\n中文字符和日本語の文字 1234567 ÉÈ café\n"
) * 3

# Kimi-K2's chat template format: tools declared in a system turn, role markers, call sections
# quoting each call's id, results as "## Return of <id>" in a system turn named "tool".
KIMI_TEMPLATE = (
    "{%- if tools -%}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson(separators=(',', ':')) }}<|im_end|>{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if loop.first and messages[0]['role'] != 'system' -%}"
    "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>"
    "{%- endif -%}"
    "{%- if message['role'] == 'user' -%}<|im_user|>user<|im_middle|>"
    "{%- elif message['role'] == 'assistant' -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- else -%}<|im_system|>{{ message['role'] }}<|im_middle|>{%- endif -%}"
    "{%- if message['role'] == 'assistant' and message.get('tool_calls') -%}"
    "{{ message['content'] or '' }}<|tool_calls_section_begin|>"
    "{%- for call in message['tool_calls'] -%}"
    "<|tool_call_begin|>{{ call['id'] }}<|tool_call_argument_begin|>{{ call['function']['arguments'] }}<|tool_call_end|>"
    "{%- endfor -%}<|tool_calls_section_end|>"
    "{%- elif message['role'] == 'tool' -%}## Return of {{ message.tool_call_id }}\n{{ message['content'] }}"
    "{%- else -%}{{ message['content'] }}{%- endif -%}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)


def learn_ranks(text: str, merges: int) -> dict[bytes, int]:
    """A byte-level BPE in tiktoken's form (bytes -> rank), learnt greedily on `text`."""
    import regex

    ranks = {bytes([b]): b for b in range(256)}
    seqs = [[bytes([c]) for c in w.encode()] for w in regex.findall(KIMI_PATTERN, text)]
    for _ in range(merges):
        pairs = collections.Counter((a, b) for s in seqs for a, b in zip(s, s[1:], strict=False))
        if not pairs:
            break
        (a, b), _ = pairs.most_common(1)[0]
        ranks[a + b] = len(ranks)
        new = []
        for s in seqs:
            out, i = [], 0
            while i < len(s):
                if i + 1 < len(s) and s[i] == a and s[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(s[i])
                    i += 1
            new.append(out)
        seqs = new
    return ranks


def kimi_dir(tmp: Path, ranks: dict[bytes, int]) -> Path:
    """A Kimi-K2-style model directory's tokenizer files: tiktoken.model, specials after the
    ranks in tokenizer_config.json with the chat template, <|im_end|> as the EOS."""
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "tiktoken.model").write_text(
        "".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items())
    )
    n = len(ranks)
    added = {str(n + i): {"content": c, "special": True} for i, c in enumerate(SPECIALS)}
    cfg = {"added_tokens_decoder": added, "eos_token": "<|im_end|>", "chat_template": KIMI_TEMPLATE}
    (tmp / "tokenizer_config.json").write_text(json.dumps(cfg))
    (tmp / "config.json").write_text(json.dumps({"eos_token_id": n + SPECIALS.index("<|im_end|>")}))
    return tmp


def test_tiktoken_file_converts_to_the_same_ids(tmp_path: Path) -> None:
    import tiktoken

    ranks = learn_ranks(CORPUS, 200)
    tok = load_tokenizer(kimi_dir(tmp_path, ranks))
    n = len(ranks)
    ref = tiktoken.Encoding(
        "kimi-test",
        pat_str=KIMI_PATTERN,
        mergeable_ranks=ranks,
        special_tokens={c: n + i for i, c in enumerate(SPECIALS)},
    )
    texts = [
        CORPUS,
        "Hello World's 12345 don't\n\n  x\t\ty",
        "<|im_user|>user<|im_middle|>hi<|im_end|>",
        "中文 and 日本語, émoji 🎉\r\nend",
    ]
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False).ids
        assert ids == ref.encode(text, allowed_special="all"), text[:40]
        assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.token_to_id("<|im_end|>") == n + 2
    bad = json.loads((tmp_path / "tokenizer_config.json").read_text())
    bad["added_tokens_decoder"] = {str(n + 5): {"content": "[BOS]", "special": True}}
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "tiktoken.model").write_text((tmp_path / "tiktoken.model").read_text())
    (tmp_path / "bad" / "tokenizer_config.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="special token"):
        load_tokenizer(tmp_path / "bad")


# ------------------------------------------------------------------ tool calls through the chat path


def test_kimi_calls_become_hermes_blocks_with_their_ids() -> None:
    text = (
        "Let me look."
        "<|tool_calls_section_begin|>"
        '<|tool_call_begin|>functions.read_file:0<|tool_call_argument_begin|>{"path": "calc.py"}<|tool_call_end|>'
        "<|tool_call_begin|>functions.run_tests:1<|tool_call_argument_begin|>{oops<|tool_call_end|>"
        "<|tool_calls_section_end|>"
    )
    hermes, ids = kimi_to_hermes(text)
    assert ids == ["functions.read_file:0", "functions.run_tests:1"]
    content, calls = parse_tool_calls(hermes)
    assert content == "Let me look."
    assert calls[0] == ToolCall("read_file", {"path": "calc.py"})
    assert isinstance(calls[1], ToolCallError) and "JSON" in calls[1].message
    # A turn cut mid-call (max_tokens): the block stays unterminated for the env to report.
    cut, ids = kimi_to_hermes(text[: text.index("{oops")] + '{"a"')
    assert ids[-1] == "functions.run_tests:1"
    assert "unterminated" in parse_tool_calls(cut)[1][-1].message  # type: ignore[union-attr]
    assert kimi_to_hermes("no calls here") == ("no calls here", [])


class Created:
    def __init__(self, prompt: str):
        self.prompt = prompt


class KimiToolSession:
    """swe-lite-shaped: the plain Hermes tools prompt; a turn with Hermes calls gets their
    results (plain), one without ends the episode with reward 1."""

    def __init__(self, prompt: str):
        self.created = Created(prompt)
        self.actions: list[str] = []

    @property
    def prompt(self) -> str:
        return self.created.prompt

    async def step(self, action: str, eos: bool) -> StepResponse:
        from services.common.tools import ToolResult, render_tool_results

        self.actions.append(action)
        _, calls = parse_tool_calls(action)
        if not calls:
            return StepResponse(observation="", done=True, reward=1.0)
        results = [ToolResult(c.name, f"{c.name} ok") for c in calls if isinstance(c, ToolCall)]
        return StepResponse(observation=render_tool_results(results), done=False)

    async def score(self) -> ScoreResponse:
        return ScoreResponse(reward=0.0)

    async def close(self) -> None:
        return None


class KimiSandbox:
    def __init__(self, prompt: str):
        self.prompt = prompt
        self.sessions: list[KimiToolSession] = []

    async def open_group(self, env: str, seed: int, n: int) -> list[KimiToolSession]:
        self.sessions = [KimiToolSession(self.prompt) for _ in range(n)]
        return self.sessions


CALLS = (
    "<|tool_calls_section_begin|>"
    '<|tool_call_begin|>functions.read_file:0<|tool_call_argument_begin|>{"path": "calc.py"}<|tool_call_end|>'
    "<|tool_call_begin|>functions.run_tests:1<|tool_call_argument_begin|>{}<|tool_call_end|>"
    "<|tool_calls_section_end|>"
)


class KimiPolicy:
    """Calls two tools in Kimi-K2's format on its first turn, then answers "done"."""

    def __init__(self, tok: object):
        self.tok = tok
        self.end = tok.token_to_id("<|im_end|>")  # type: ignore[attr-defined]
        self.inputs: list[str] = []

    async def generate(self, req: GenerateRequest, prefer: str | None = None) -> tuple[str, GenerateResponse]:
        text = self.tok.decode(req.input_ids, skip_special_tokens=False)  # type: ignore[attr-defined]
        self.inputs.append(text)
        say = "Checking." + CALLS if "## Return of" not in text else "done"
        ids = [*self.tok.encode(say, add_special_tokens=False).ids, self.end]  # type: ignore[attr-defined]
        choice = GenerateChoice(
            output_ids=ids, logprobs=[-0.1] * len(ids), versions=[0] * len(ids), finish_reason="stop"
        )
        return "inproc://decode", GenerateResponse(
            request_id="r", prompt_tokens=0, choices=[choice] * req.sampling.n
        )


def test_tool_episode_through_kimi_chat_template(tmp_path: Path) -> None:
    """The orchestrator's chat path with a Kimi-K2 model directory: the env gets the model's calls
    as Hermes blocks, each result goes back as the template's "## Return of <the call's id>", and
    the sample's tokens are exactly the template's rendering of the conversation."""
    from services.common.chat import ChatTemplate
    from services.common.tools import render_tools_prompt
    from services.sandbox.envs.swe_lite import TOOLS

    d = kimi_dir(tmp_path / "kimi", learn_ranks(CORPUS, 200))
    cfg = RunConfig()
    cfg.orchestrator.group_size = 2
    cfg.orchestrator.max_turns = 5
    cfg.orchestrator.sampling.max_tokens = 512
    cfg.model.max_seq_len = cfg.decode.engine.max_seq_len = 8192
    tok = load_tokenizer(d)
    policy = KimiPolicy(tok)
    sandbox = KimiSandbox(render_tools_prompt(TOOLS) + "\n\nFix the bug in calc.py.")
    runner = RolloutRunner.for_model_dir(cfg, policy, sandbox, d)  # type: ignore[arg-type]
    assert runner.dialect == "kimi_k2" and runner.eos == tok.token_to_id("<|im_end|>")
    group = asyncio.run(runner.run(GroupSpec("k0", "swe-lite", 0)))
    tpl = ChatTemplate.from_model_dir(d)
    assert tpl is not None
    tools = [t.as_json() for t in TOOLS]
    convo = [
        {"role": "user", "content": "Fix the bug in calc.py."},
        {"role": "assistant", "content": "Checking." + CALLS},
        {"role": "tool", "tool_call_id": "functions.read_file:0", "content": "read_file ok"},
        {"role": "tool", "tool_call_id": "functions.run_tests:1", "content": "run_tests ok"},
        {"role": "assistant", "content": "done"},
    ]
    full = tpl.render(convo, tools=tools, add_generation_prompt=False)
    assert "## Return of functions.run_tests:1\nrun_tests ok<|im_end|>" in full
    assert policy.inputs[0].startswith("<|im_system|>tool_declare<|im_middle|>[{")
    for s, session in zip(group.samples, sandbox.sessions, strict=True):
        assert s.finish_reason == "done" and s.turns == 2 and s.reward == 1.0
        assert tok.decode(s.tokens, skip_special_tokens=False) == full
        trained = [t for t, m in zip(s.tokens, s.loss_mask, strict=True) if m]
        assert (
            tok.decode(trained, skip_special_tokens=False) == "Checking." + CALLS + "<|im_end|>done<|im_end|>"
        )
        _, calls = parse_tool_calls(session.actions[0])
        assert calls == [ToolCall("read_file", {"path": "calc.py"}), ToolCall("run_tests", {})]
        assert KIMI_SECTION_BEGIN not in session.actions[0]
