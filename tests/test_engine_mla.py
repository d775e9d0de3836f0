"""MLA + DeepSeek-V3 MoE (+ GLM-5's DSA) in the engine (services/engine/layers/mla.py, layers/moe.py), against HF.

Random-weight `DeepseekV3ForCausalLM` models (low-rank q or plain q_proj; sigmoid routing with a
random e_score_correction_bias, group-limited top-k, shared experts, leading dense layers,
routed_scaling_factor) and a `GlmMoeDsaForCausalLM` (GLM-5: the same plus the DSA indexer, with an
index_topk far below the sequence lengths so attention really is sparse) are saved with
`save_pretrained` and served by LLMEngine. float32 logits must agree with HF's through both MLA
routes (expanded and weight-absorbed), greedy decoding must equal HF's `generate` and a
one-sequence run, and the routed-expert ids must be HF's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import hf_random as hr
from transformers import (
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    GlmMoeDsaConfig,
    GlmMoeDsaForCausalLM,
    PreTrainedModel,
)

from services.common import routing
from services.common.config import ModelConfig
from services.common.modeldir import hf_config, model_config_from_hf
from services.common.schemas import GenerateRequest, SamplingParams
from services.engine import LLMEngine, WeightsError
from services.engine.kv_cache import KVCache
from services.engine.layers.mla import MLAttention

TOL = 1e-4
VOCAB = hr.VOCAB

VARIANTS: dict[str, dict[str, Any]] = {
    # DeepSeek-V3 shape: low-rank q, 4 groups of 4 experts (2 kept), 1 shared expert
    "v3-qlora-groups": {"q_lora_rank": 48, "n_group": 4, "topk_group": 2, "n_shared_experts": 1},
    # Kimi-K2 / V2-Lite style: plain q_proj, one group, 2 shared experts, no renormalisation
    "qproj-nogroup": {
        "q_lora_rank": None,
        "n_group": 1,
        "topk_group": 1,
        "n_shared_experts": 2,
        "norm_topk_prob": False,
    },
    # GLM-5: DSA with each query attending to its 8 best keys (16 indexer heads: a key scores
    # exactly 0 only if all heads' relu are 0, and ties at 0 would make the choice arbitrary)
    "glm5-dsa": {
        "q_lora_rank": 48,
        "n_group": 1,
        "topk_group": 1,
        "n_shared_experts": 1,
        "index_topk": 8,
        "index_n_heads": 16,
        "index_head_dim": 16,
        "rms_norm_eps": 1e-5,
    },
}


def build(name: str) -> PreTrainedModel:
    over = VARIANTS[name]
    if "index_topk" in over:
        return GlmMoeDsaForCausalLM(GlmMoeDsaConfig(**(BASE | over)))
    return DeepseekV3ForCausalLM(deepseek_config(**over))


BASE: dict[str, Any] = hr.TINY | {
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "n_routed_experts": 16,
    "num_experts_per_tok": 3,
    "first_k_dense_replace": 1,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 12,
    "bos_token_id": 2,
}


def deepseek_config(**over: Any) -> DeepseekV3Config:
    return DeepseekV3Config(**(BASE | over))


def set_absorb(eng: LLMEngine, absorb: bool | None) -> None:
    for mod in eng.model.modules():
        if isinstance(mod, MLAttention):
            mod.absorb = absorb


pair = hr.hf_pair_fixture(VARIANTS, build, seed=11)


def test_config_and_cache_layout(pair) -> None:
    name, hf, d = pair
    eng = hr.engine(d)
    m = eng.model_config
    assert m.arch == ("glm_moe_dsa" if name == "glm5-dsa" else "deepseek_v3") and m.is_mla and m.is_moe
    assert m.head_dim == 24 and m.n_kv_heads == 4
    assert m.q_lora_rank == (0 if name == "qproj-nogroup" else 48)
    assert (m.index_topk, m.index_n_heads, m.index_head_dim) == (
        (8, 16, 16) if name == "glm5-dsa" else (0, 0, 0)
    )
    assert (m.n_group, m.topk_group) == (hf.config.n_group, hf.config.topk_group)
    assert m.expert_bias and m.router_score == "sigmoid" and m.routed_scaling_factor == 2.5
    assert m.first_k_dense == 1 and m.n_shared_experts == hf.config.n_shared_experts
    # Only the compressed KV is cached: one latent "head" of kv_lora_rank + rope dims, no V.
    assert eng.kv.k.shape[1:] == (eng.kv.num_blocks * eng.kv.block_size, 1, 32 + 8)
    assert eng.kv.v.shape[-1] == 0
    assert eng.kv.routing is not None and eng.kv.routing.shape[0] == 2  # MoE layers 1 and 2
    if name == "glm5-dsa":
        assert eng.kv.index_k is not None and eng.kv.index_k.shape[-1] == 16
    # the hf_config mapping inverts model_config_from_hf, and transformers builds the same model
    cfg = hf_config(m, eos_token_id=1)
    assert model_config_from_hf(cfg) == m
    rebuilt = type(hf)(type(hf.config)(**cfg))
    assert {k: v.shape for k, v in rebuilt.state_dict().items()} == {
        k: v.shape for k, v in hf.state_dict().items()
    }


@pytest.mark.parametrize("absorb", [False, True], ids=["expanded", "absorbed"])
def test_logits_match_transformers(pair, absorb: bool) -> None:
    _, hf, d = pair
    eng = hr.engine(d)
    set_absorb(eng, absorb)
    tokens = torch.randint(0, VOCAB, (100,), generator=torch.Generator().manual_seed(3))
    hr.assert_logits_match_hf(eng, hf, tokens.tolist(), TOL)


def test_greedy_matches_hf_generate_and_one_sequence_runs(pair) -> None:
    """Decode steps take the absorbed route, prefill chunks the expanded one."""
    _, hf, d = pair
    hr.assert_greedy_matches_hf_and_alone(hf, d, hr.PROMPTS)


def test_routed_experts_match_hf_router(pair) -> None:
    _, hf, d = pair
    eng = hr.engine(d, block_size=4, max_num_batched_tokens=16)
    params = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, seed=2, n=2)
    reqs = [GenerateRequest(input_ids=p, sampling=params, return_routed_experts=True) for p in hr.PROMPTS]
    for prompt, resp in zip(hr.PROMPTS, eng.generate(reqs), strict=True):
        for choice in resp.choices:
            assert choice.routed_experts is not None
            ids = routing.decode(choice.routed_experts)
            assert ids.shape == (len(prompt) + len(choice.output_ids), 2, 3)
            assert (ids[-1] == routing.unrecorded(ids.dtype)).all()
            hr.assert_same_experts(ids[:-1], hr.hf_router_ids(hf, (prompt + choice.output_ids)[:-1]))


def test_prefix_cache_hit_reuses_latents_and_routing(pair) -> None:
    _, hf, d = pair
    eng = hr.engine(d, block_size=4)
    prompt = list(range(30, 70))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    req = GenerateRequest(input_ids=prompt, sampling=params, return_routed_experts=True)
    a = eng.generate([req])[0].choices[0]
    hits = eng.stats.prefix_cache_hit_tokens
    b = eng.generate([req])[0].choices[0]
    assert eng.stats.prefix_cache_hit_tokens - hits == 36
    assert a.output_ids == b.output_ids
    assert a.routed_experts is not None and b.routed_experts is not None
    np.testing.assert_array_equal(routing.decode(a.routed_experts), routing.decode(b.routed_experts))
    hr.assert_same_experts(routing.decode(b.routed_experts)[: len(prompt)], hr.hf_router_ids(hf, prompt))


def test_kv_bytes_per_block_counts_latent_and_routing() -> None:
    m = ModelConfig(
        arch="deepseek_v3",
        n_layers=3,
        n_heads=4,
        n_kv_heads=4,
        head_dim=24,
        n_routed_experts=300,
        n_experts_per_tok=3,
        moe_hidden_dim=8,
        first_k_dense=1,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=12,
    )
    per_block = KVCache.bytes_per_block_for(m, 16, torch.bfloat16)
    assert per_block == 3 * 16 * (32 + 8) * 2 + 2 * 16 * 3 * 2  # latents (bf16) + uint16 ids
    kv = KVCache.for_model(m, 2, 16, 32, torch.bfloat16, torch.device("cpu"))
    assert sum(t[:, :16].nbytes for t in kv.pools()) == per_block


def test_rejects_yarn_and_shared_indexers(tmp_path: Path) -> None:
    """What the engine does not implement fails at load, naming it, instead of computing
    something else: YaRN rope scaling (DeepSeek-V3/Kimi-K2 Hub checkpoints) and GLM-5 layers that
    reuse another layer's DSA selection (indexer_types "shared")."""
    hf = hr.randomize(DeepseekV3ForCausalLM(deepseek_config()), seed=0)
    hf.save_pretrained(tmp_path / "yarn")
    cfg = json.loads((tmp_path / "yarn" / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "yarn", "factor": 40.0, "rope_theta": 10000.0}
    (tmp_path / "yarn" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(WeightsError, match="yarn"):
        hr.engine(tmp_path / "yarn")
    glm = hr.randomize(build("glm5-dsa"), seed=0)
    glm.save_pretrained(tmp_path / "shared")
    cfg = json.loads((tmp_path / "shared" / "config.json").read_text())
    cfg["indexer_types"] = ["full", "shared", "full"]
    (tmp_path / "shared" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(WeightsError, match="indexer_types"):
        hr.engine(tmp_path / "shared")


def test_dsa_needs_the_low_rank_query() -> None:
    from services.engine.models.causal_lm import CausalLM

    m = ModelConfig(
        arch="glm_moe_dsa",
        n_heads=4,
        n_kv_heads=4,
        head_dim=24,
        n_routed_experts=8,
        n_experts_per_tok=2,
        moe_hidden_dim=8,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=12,
        index_topk=16,
        index_n_heads=2,
        index_head_dim=8,
    )
    with pytest.raises(ValueError, match="q_lora_rank"):
        CausalLM(m, 64)


def test_dsa_selection_changes_the_function(tmp_path: Path) -> None:
    """The glm5-dsa parity above checks sparse attention itself: with every key selected (an
    index_topk past the context) the engine no longer computes HF's GLM-5 logits."""
    hf = hr.randomize(build("glm5-dsa"), seed=11)
    hf.save_pretrained(tmp_path)
    eng = hr.engine(tmp_path)
    tokens = list(range(3, 90))
    ref = hr.hf_logprobs(hf, tokens)
    torch.testing.assert_close(hr.engine_logprobs(eng, tokens), ref, atol=TOL, rtol=0)
    for mod in eng.model.modules():
        if isinstance(mod, MLAttention) and mod.indexer is not None:
            mod.indexer.topk = 10**6
    assert (hr.engine_logprobs(eng, tokens) - ref).abs().max() > 0.1
