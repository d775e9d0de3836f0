"""Random-weight HF models served by LLMEngine, for the engine's parity tests against
transformers (tests/test_engine_hf_parity.py, test_engine_moe.py, test_engine_mla.py): the
module-scoped model-dir fixture, weight randomisation, the tiny configs' common part, HF's
log-probs, greedy tokens and router ids, and the checks the architectures run the same way."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import PreTrainedModel

from services.common.config import EngineConfig
from services.common.schemas import GenerateRequest, SamplingParams
from services.engine import LLMEngine
from services.engine.batch import ForwardBatch, Span

HFPair = tuple[str, PreTrainedModel, Path]
VOCAB = 97
# What every tiny test config shares: a small vocabulary, 3 layers of width 64, 4 heads, and
# EOS/pad ids the prompts avoid. Each module adds its architecture's keys.
TINY: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "eos_token_id": 1,
    "pad_token_id": 0,
}
# Prompts of the parity tests: short, repeated tokens, and one longer than several pages.
PROMPTS = [[5, 17, 33, 8, 61, 2], [40, 41, 42], [9] * 11, list(range(10, 50))]


def randomize(model: PreTrainedModel, seed: int) -> PreTrainedModel:
    """Peaked random weights (HF's init gives near-uniform logits, where greedy ties would depend
    on rounding) and perturbed norms, so every weight matters. DeepSeek-V3's router bias is a
    buffer in HF, not a parameter: a random one really moves the expert selection."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            else:
                p.normal_(0, 0.12)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn_like(b))
    return model.eval()


def hf_pair_fixture(variants: Iterable[str], build: Callable[[str], PreTrainedModel], seed: int) -> Any:
    """A module-scoped fixture `pair`, parametrised over `variants`: (variant name, the model
    `build(name)` randomised with `seed`, its `save_pretrained` directory). Assign it in the test
    module: `pair = hf_pair_fixture(VARIANTS, build, seed=7)`."""

    @pytest.fixture(scope="module", params=list(variants), name="pair")
    def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> HFPair:
        hf = randomize(build(request.param), seed=seed)
        d = tmp_path_factory.mktemp(request.param)
        hf.save_pretrained(d)
        return request.param, hf, d

    return pair


def engine(d: Path, **kw: Any) -> LLMEngine:
    return LLMEngine(d, EngineConfig(**({"device": "cpu", "max_batch_size": 8, "max_seq_len": 256} | kw)))


def engine_logprobs(eng: LLMEngine, tokens: list[int]) -> torch.Tensor:
    """The engine's float32 log-softmax over the vocabulary at every position of one sequence."""
    n = eng.kv.blocks_for(eng.kv.max_seq_len)
    with torch.inference_mode():
        batch = ForwardBatch.build(
            [Span(list(range(n)), 0, tokens)], eng.device, eng.kv.max_seq_len, eng.kv.block_size
        )
        return torch.log_softmax(eng.model.logits(eng.model(batch, eng.kv)).float(), dim=-1)


def hf_logprobs(hf: PreTrainedModel, tokens: list[int]) -> torch.Tensor:
    """HF's float32 log-softmax over the vocabulary at every position of one sequence."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([tokens])).logits[0].float(), dim=-1)


def assert_logits_match_hf(eng: LLMEngine, hf: PreTrainedModel, tokens: list[int], tol: float = 1e-4) -> None:
    """The engine's log-probs on `tokens` are HF's within `tol` (float32 on both sides)."""
    torch.testing.assert_close(engine_logprobs(eng, tokens), hf_logprobs(hf, tokens), atol=tol, rtol=0)


def hf_greedy(hf: PreTrainedModel, prompt: list[int], max_new_tokens: int) -> list[int]:
    """HF `generate(do_sample=False)`'s new tokens after `prompt`, EOS ignored (the engine's
    ignore_eos: HF then never stops early; min_new_tokens would instead mask EOS's logit)."""
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def hf_router_ids(hf: PreTrainedModel, tokens: list[int]) -> np.ndarray:
    """[tokens, moe_layers, top_k] ids HF's routers pick on `tokens` (one forward, no cache)."""
    got: list[torch.Tensor] = []
    hooks = [
        layer.mlp.gate.register_forward_hook(lambda _m, _i, out: got.append(out[2]))
        for layer in hf.model.layers
        if hasattr(layer.mlp, "gate")
    ]
    try:
        with torch.no_grad():
            hf(torch.tensor([tokens]))
    finally:
        for h in hooks:
            h.remove()
    return torch.stack(got, dim=1).numpy()


def assert_same_experts(got: np.ndarray, want: np.ndarray) -> None:
    """Same expert set per (token, layer); the order within a top-k is not part of the contract."""
    assert got.shape == want.shape
    np.testing.assert_array_equal(np.sort(got, axis=-1), np.sort(want, axis=-1))


def assert_greedy_matches_hf_and_alone(hf: PreTrainedModel, d: Path, prompts: list[list[int]]) -> None:
    """Greedy decoding of `prompts` batched in one engine equals each prompt run alone and HF's
    `generate` (24 tokens, EOS ignored on both sides)."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    batched = engine(d, block_size=4).generate(
        [GenerateRequest(input_ids=p, sampling=params) for p in prompts]
    )
    for prompt, resp in zip(prompts, batched, strict=True):
        alone = engine(d, block_size=4).generate([GenerateRequest(input_ids=prompt, sampling=params)])[0]
        assert resp.choices[0].output_ids == alone.choices[0].output_ids
        assert resp.choices[0].output_ids == hf_greedy(hf, prompt, 24)
