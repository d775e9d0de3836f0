"""The engine computes the same function as transformers' LlamaForCausalLM / Qwen3ForCausalLM.

Random-weight HF models (GQA, tied and untied embeddings, Qwen3's QK-norm, Llama-3.1 rope
scaling) are saved with `save_pretrained` and loaded by LLMEngine from that directory, exactly as
a Hub snapshot would be. float32 logits must agree, and greedy decoding must pick the same 64
tokens as HF's `generate(do_sample=False)`.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.hf_random import (
    TINY,
    VOCAB,
    HFPair,
    assert_logits_match_hf,
    engine,
    hf_greedy,
    hf_pair_fixture,
    randomize,
)
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel, Qwen3Config, Qwen3ForCausalLM

from services.common.config import EngineConfig, RopeScaling
from services.common.schemas import GenerateRequest, SamplingParams
from services.engine import LLMEngine

TOL = 1e-4  # float32; HF computes cos/sin by matmul and attention through its own path
LLAMA31 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # small, so that positions in the test run past it and all three frequency bands exist
    "original_max_position_embeddings": 32,
}

COMMON: dict[str, Any] = TINY | {
    "intermediate_size": 160,
    "num_key_value_heads": 2,  # GQA
    "head_dim": 16,
    "bos_token_id": 2,
}

VARIANTS: dict[str, tuple[type[PreTrainedModel], Any]] = {
    "llama3-untied": (
        LlamaForCausalLM,
        LlamaConfig(**COMMON, rope_theta=500000.0, tie_word_embeddings=False),
    ),
    "llama3-tied": (LlamaForCausalLM, LlamaConfig(**COMMON, rope_theta=500000.0, tie_word_embeddings=True)),
    "llama31-rope-scaled": (
        LlamaForCausalLM,
        LlamaConfig(**COMMON, rope_theta=10000.0, rope_scaling=dict(LLAMA31), tie_word_embeddings=False),
    ),
    "qwen3-tied": (Qwen3ForCausalLM, Qwen3Config(**COMMON, rope_theta=1000000.0, tie_word_embeddings=True)),
    "qwen3-untied": (
        Qwen3ForCausalLM,
        Qwen3Config(**COMMON, rope_theta=1000000.0, tie_word_embeddings=False),
    ),
}


def build(name: str) -> PreTrainedModel:
    cls, config = VARIANTS[name]
    return cls(config)


pair = hf_pair_fixture(VARIANTS, build, seed=5)


@pytest.fixture(scope="module")
def eng(pair: HFPair) -> LLMEngine:
    """One engine per variant, shared by its tests."""
    return engine(pair[2], max_batch_size=4, torch_threads=1)


def test_config_mapping(pair: HFPair, eng: LLMEngine) -> None:
    name, hf, _d = pair
    m = eng.model_config
    assert m.arch == ("llama3" if name.startswith("llama") else "qwen3")
    assert m.qk_norm == name.startswith("qwen3")
    assert m.tie_embeddings == name.endswith("-tied")
    assert (eng.model.lm_head is None) == m.tie_embeddings
    assert m.n_kv_heads == 2 and m.n_heads == 4
    assert m.rope_theta == hf.config.rope_parameters["rope_theta"]
    if name == "llama31-rope-scaled":
        assert m.rope_scaling == RopeScaling(
            factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=32
        )
    else:
        assert m.rope_scaling is None


def test_logits_match_transformers(pair: HFPair, eng: LLMEngine) -> None:
    tokens = torch.randint(0, VOCAB, (120,), generator=torch.Generator().manual_seed(3))
    assert_logits_match_hf(eng, pair[1], tokens.tolist(), TOL)


def test_greedy_64_tokens_match_hf_generate(pair: HFPair, eng: LLMEngine) -> None:
    hf = pair[1]
    prompts = [[5, 17, 33, 8, 61, 2], [40, 41, 42], [9] * 11]
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    resps = eng.generate([GenerateRequest(input_ids=p, sampling=params) for p in prompts])
    for prompt, resp in zip(prompts, resps, strict=True):
        expected = hf_greedy(hf, prompt, 64)
        assert len(expected) == 64
        assert resp.choices[0].output_ids == expected
        assert resp.choices[0].finish_reason == "length"


def test_rope_scaling_changes_the_function() -> None:
    """The scaled config really differs from plain RoPE at the tested positions, with all three
    frequency bands present, so the llama31 parity tests check the scaling itself."""
    from services.engine.layers.rope import rope_cache

    theta, head_dim = 10000.0, COMMON["head_dim"]
    scaling = RopeScaling(**{k: v for k, v in LLAMA31.items() if k != "rope_type"})
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    wavelen = 2 * math.pi / inv
    old = scaling.original_max_position_embeddings
    assert (wavelen < old / 4).any() and (wavelen > old).any()
    assert ((wavelen >= old / 4) & (wavelen <= old)).any()
    cos_scaled, _ = rope_cache(head_dim, 128, theta, scaling)
    cos_plain, _ = rope_cache(head_dim, 128, theta)
    assert not torch.allclose(cos_scaled, cos_plain, atol=1e-3)


def test_loads_hf_snapshot_with_rope_scaling_key(tmp_path: Path) -> None:
    """Hub snapshots written before transformers 5 carry `rope_scaling` and a top-level
    `rope_theta` rather than `rope_parameters`; both layouts load to the same config."""
    import json
    import shutil

    hf = randomize(build("llama31-rope-scaled"), seed=0)
    new = tmp_path / "new"
    hf.save_pretrained(new)
    old = tmp_path / "old"
    shutil.copytree(new, old)
    cfg = json.loads((old / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope.pop("rope_theta")
    cfg["rope_scaling"] = rope
    (old / "config.json").write_text(json.dumps(cfg))
    a = LLMEngine(new, EngineConfig(device="cpu", max_batch_size=1, max_seq_len=64))
    b = LLMEngine(old, EngineConfig(device="cpu", max_batch_size=1, max_seq_len=64))
    assert a.model_config == b.model_config
    assert a.model_config.rope_scaling is not None


def test_rejects_unsupported_rope_type(tmp_path: Path) -> None:
    import json

    from services.engine import WeightsError

    hf = randomize(build("llama3-untied"), seed=0)
    hf.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(WeightsError, match="yarn"):
        LLMEngine(tmp_path, EngineConfig(device="cpu", max_batch_size=1, max_seq_len=64))
