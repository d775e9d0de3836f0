"""MoE in the engine (services/engine/layers/moe.py) and routed-expert capture, against HF Qwen3-MoE.

Random-weight `Qwen3MoeForCausalLM` models are saved with `save_pretrained` (per-expert tensor
names) and served by LLMEngine from that directory. float32 logits must agree with HF's, greedy
decoding must equal HF's `generate` and a one-sequence run, and the expert ids the engine returns
(`return_routed_experts`) must be HF's router top-k on the same tokens, including for prompt
tokens served from the prefix cache and for forked samples.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import hf_random as hr
from transformers import PreTrainedModel, Qwen3MoeConfig, Qwen3MoeForCausalLM

from services.common import routing
from services.common.auth import auth_headers
from services.common.config import CONFIG_DIR, ModelConfig
from services.common.modeldir import hf_config, model_config_from_hf
from services.common.schemas import GenerateRequest, SamplingParams
from services.engine.kv_cache import KVCache
from services.engine.layers.moe import ExpertWeights, route

TOL = 1e-4
VOCAB = hr.VOCAB

VARIANTS: dict[str, dict[str, Any]] = {
    # a leading dense layer (mlp_only_layers), renormalised top-2 of 8
    "dense0-norm": {"mlp_only_layers": [0], "norm_topk_prob": True, "num_experts_per_tok": 2},
    # every layer MoE, raw softmax weights (Qwen3MoeConfig's default), top-3
    "allmoe-raw": {"mlp_only_layers": [], "norm_topk_prob": False, "num_experts_per_tok": 3},
}


def qwen3_moe_config(**over: Any) -> Qwen3MoeConfig:
    base: dict[str, Any] = hr.TINY | {
        "intermediate_size": 96,
        "moe_intermediate_size": 32,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_experts": 8,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
    }
    return Qwen3MoeConfig(**(base | over))


def build(name: str) -> PreTrainedModel:
    return Qwen3MoeForCausalLM(qwen3_moe_config(**VARIANTS[name]))


pair = hr.hf_pair_fixture(VARIANTS, build, seed=7)


def test_save_pretrained_writes_per_expert_names(pair) -> None:
    """What transformers 5.24 writes (the layout the trainer publishes too)."""
    from safetensors import safe_open

    _, _, d = pair
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "model.layers.1.mlp.experts.7.gate_proj.weight" in keys
    assert "model.layers.1.mlp.gate.weight" in keys
    assert not any(k.endswith("experts.gate_up_proj") for k in keys)


def test_config_mapping(pair) -> None:
    name, hf, d = pair
    m = hr.engine(d).model_config
    assert m.arch == "qwen3_moe" and m.is_moe and not m.is_mla
    assert m.n_routed_experts == 8 and m.moe_hidden_dim == 32 and m.hidden_dim == 96
    assert m.n_experts_per_tok == hf.config.num_experts_per_tok
    assert m.first_k_dense == len(hf.config.mlp_only_layers)
    assert m.norm_topk_prob == hf.config.norm_topk_prob
    assert m.router_score == "softmax" and not m.expert_bias and m.n_shared_experts == 0


def test_logits_match_transformers(pair) -> None:
    _, hf, d = pair
    eng = hr.engine(d)
    tokens = torch.randint(0, VOCAB, (120,), generator=torch.Generator().manual_seed(3))
    hr.assert_logits_match_hf(eng, hf, tokens.tolist(), TOL)


def test_fused_expert_layout_loads_the_same(pair) -> None:
    """transformers' in-memory state dict holds experts fused (gate_up_proj [E, 2I, D]); the
    loader accepts that layout as well as the per-expert one on disk."""
    _, hf, d = pair
    eng = hr.engine(d)
    state = hf.state_dict()
    assert "model.layers.1.mlp.experts.gate_up_proj" in state
    tokens = list(range(3, 60))
    before = hr.engine_logprobs(eng, tokens)
    with torch.no_grad():
        for p in eng.model.parameters():
            p.zero_()
    eng.model.load_hf_state(state)
    torch.testing.assert_close(hr.engine_logprobs(eng, tokens), before, atol=0, rtol=0)


def test_incomplete_per_expert_state_is_rejected(pair) -> None:
    _, _, d = pair
    from services.common.weights_dir import read_model_dir

    eng = hr.engine(d)
    _, state = read_model_dir(d)
    del state["model.layers.2.mlp.experts.5.up_proj.weight"]
    with pytest.raises(ValueError, match=r"model\.layers\.2\.mlp\.experts: per-expert tensors incomplete"):
        eng.model.load_hf_state(state)


def test_greedy_matches_hf_generate_and_one_sequence_runs(pair) -> None:
    _, hf, d = pair
    hr.assert_greedy_matches_hf_and_alone(hf, d, hr.PROMPTS)


def test_routed_experts_match_hf_router(pair) -> None:
    """Batched, chunked prefill (a token budget smaller than the prompts) and sampled decoding:
    every forwarded token's ids are HF's router top-k on the same full sequence."""
    _, hf, d = pair
    eng = hr.engine(d, block_size=4, max_num_batched_tokens=16)
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=1)
    reqs = [GenerateRequest(input_ids=p, sampling=params, return_routed_experts=True) for p in hr.PROMPTS]
    m = eng.model_config
    for prompt, resp in zip(hr.PROMPTS, eng.generate(reqs), strict=True):
        choice = resp.choices[0]
        assert choice.routed_experts is not None
        ids = routing.decode(choice.routed_experts)
        n = len(prompt) + len(choice.output_ids)
        assert ids.dtype == np.uint8
        assert ids.shape == (n, m.n_layers - m.first_k_dense, m.n_experts_per_tok)
        # The last sampled token was never forwarded: its row is the sentinel.
        assert (ids[-1] == routing.unrecorded(ids.dtype)).all()
        hr.assert_same_experts(ids[:-1], hr.hf_router_ids(hf, (prompt + choice.output_ids)[:-1]))


def test_prefix_cache_hits_and_forks_keep_routing(pair) -> None:
    """A prompt served from the prefix cache skips the forward; its ids come from the pages. The
    n samples of one request fork from one prefill and share its prompt rows."""
    _, hf, d = pair
    eng = hr.engine(d, block_size=4)
    prompt = list(range(20, 58))  # 38 tokens: 9 full pages and a partial one
    params = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, n=3, seed=5)
    first = eng.generate([GenerateRequest(input_ids=prompt, sampling=params, return_routed_experts=True)])[0]
    hits = eng.stats.prefix_cache_hit_tokens
    second = eng.generate([GenerateRequest(input_ids=prompt, sampling=params, return_routed_experts=True)])[0]
    assert eng.stats.prefix_cache_hit_tokens - hits == 36  # the 9 full pages
    want_prompt = hr.hf_router_ids(hf, prompt)
    for resp in (first, second):
        assert len(resp.choices) == 3
        for choice in resp.choices:
            assert choice.routed_experts is not None
            ids = routing.decode(choice.routed_experts)
            hr.assert_same_experts(ids[: len(prompt)], want_prompt)
            hr.assert_same_experts(ids[:-1], hr.hf_router_ids(hf, (prompt + choice.output_ids)[:-1]))


def test_routing_only_when_asked(pair) -> None:
    _, _, d = pair
    resp = hr.engine(d).generate(
        [GenerateRequest(input_ids=[3, 4, 5], sampling=SamplingParams(max_tokens=2))]
    )
    assert resp[0].choices[0].routed_experts is None


def test_dense_model_returns_no_routing(tmp_path: Path) -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    hf = hr.randomize(
        Qwen3ForCausalLM(
            Qwen3Config(
                vocab_size=VOCAB,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=1,
                num_attention_heads=2,
                num_key_value_heads=2,
                head_dim=16,
            )
        ),
        seed=0,
    )
    hf.save_pretrained(tmp_path)
    eng = hr.engine(tmp_path)
    assert eng.kv.routing is None
    req = GenerateRequest(input_ids=[3, 4], sampling=SamplingParams(max_tokens=2), return_routed_experts=True)
    assert eng.generate([req])[0].choices[0].routed_experts is None


# ----------------------------------------------------------------------------- units


def test_expert_kernels_compute_the_same_function() -> None:
    """torch._grouped_mm (the CUDA bf16 kernel; torch >= 2.13 also runs it on CPU), the
    per-pair gathered bmm (CUDA, other dtypes) and the per-expert loop (CPU) agree, including
    experts that receive no token."""
    m = ModelConfig(arch="qwen3_moe", dim=32, n_routed_experts=6, n_experts_per_tok=2, moe_hidden_dim=16)
    ex = ExpertWeights(m)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        ex.gate_up_proj.copy_(torch.randn(ex.gate_up_proj.shape, generator=g))
        ex.down_proj.copy_(torch.randn(ex.down_proj.shape, generator=g))
    x = torch.randn(40, 32, generator=g)
    ids = torch.randint(0, 4, (40, 2), generator=g)  # experts 4 and 5 get nothing
    ids[:, 1] = (ids[:, 0] + 1) % 4
    w = torch.rand(40, 2, generator=g)
    loop = ex(x, ids, w, kernel="loop")
    assert ex.kernel_for(x) == "loop"  # on CPU
    torch.testing.assert_close(ex(x, ids, w, kernel="grouped"), loop, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(ex(x, ids, w, kernel="gather"), loop, atol=1e-4, rtol=1e-5)
    # and both are the plain definition
    ref = torch.zeros_like(x)
    for t in range(40):
        for j in range(2):
            e = int(ids[t, j])
            gate, up = (ex.gate_up_proj[e] @ x[t]).chunk(2)
            ref[t] += w[t, j] * (ex.down_proj[e] @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(loop, ref.detach(), atol=1e-4, rtol=1e-4)


def test_route_variants() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0, 3.0, -2.0, 1.5]])
    soft = ModelConfig(arch="qwen3_moe", n_routed_experts=8, n_experts_per_tok=2, moe_hidden_dim=8)
    w, ids = route(logits, soft, None)
    assert ids.tolist() == [[5, 0]]
    p = logits.softmax(-1)[0]
    torch.testing.assert_close(w, (p[[5, 0]] / p[[5, 0]].sum())[None])
    raw = soft.model_copy(update={"norm_topk_prob": False, "routed_scaling_factor": 2.0})
    torch.testing.assert_close(route(logits, raw, None)[0], 2.0 * p[[5, 0]][None])
    # sigmoid + bias: the bias moves the selection, the weights stay the unbiased scores
    sig = soft.model_copy(update={"router_score": "sigmoid", "norm_topk_prob": False})
    bias = torch.tensor([0.0, 0.0, 0.0, 5.0, 0.0, 0.0, 0.0, 0.0])
    w, ids = route(logits, sig, bias)
    assert ids.tolist() == [[3, 5]]
    torch.testing.assert_close(w, logits.sigmoid()[:, [3, 5]])
    # 4 groups of 2, one kept: group (0, 1) has the best pair sum although expert 6 scores highest
    grp = sig.model_copy(update={"n_group": 4, "topk_group": 1})
    _, ids = route(torch.tensor([[3.0, 3.0, 0.0, 0.0, 2.0, 2.0, 4.0, -9.0]]), grp, None)
    assert sorted(ids[0].tolist()) == [0, 1]


def test_routing_store_uint16_past_254_experts() -> None:
    kv = KVCache(1, 4, 4, 16, 1, 8, torch.float32, torch.device("cpu"), moe_layers=2, top_k=3, n_experts=300)
    ids = torch.tensor([[299, 0, 254], [255, 1, 2]])
    kv.store_routing(1, torch.tensor([9, 10]), ids)
    kv.store_routing(0, torch.tensor([9, 10]), ids.flip(0))
    out = kv.read_routing([3, 2], num_cached=7, num_tokens=8)  # positions 5, 6 -> slots 9, 10
    assert out.dtype == np.uint16 and out.shape == (8, 2, 3)
    assert out[5, 1].tolist() == [299, 0, 254] and out[6, 0].tolist() == [299, 0, 254]
    assert (out[:5] == 65535).all() and (out[7] == 65535).all()  # never written / not forwarded
    wire = routing.decode(routing.encode(out))
    np.testing.assert_array_equal(wire, out)
    # Padding rows of a CUDA-graph decode step carry slot -1: no page's slot may change.
    before = [t.clone() for t in kv.pools()]
    kv.store_routing(0, torch.tensor([-1]), torch.tensor([[7, 7, 7]]))
    for t, b in zip(kv.pools(), before, strict=True):
        assert torch.equal(t, b)


def test_debug_moe_config_round_trips(tmp_path: Path) -> None:
    """configs/models/debug-moe.toml -> HF config.json -> transformers builds it -> the engine
    reads the same ModelConfig back and computes HF's logits."""
    m = ModelConfig.model_validate(tomllib.loads((CONFIG_DIR / "models" / "debug-moe.toml").read_text()))
    assert m.arch == "qwen3_moe" and m.n_routed_experts == 8 and m.n_experts_per_tok == 2
    cfg = hf_config(m, eos_token_id=1)
    assert model_config_from_hf(cfg) == m
    hf = hr.randomize(Qwen3MoeForCausalLM(Qwen3MoeConfig(**cfg)), seed=3)
    hf.save_pretrained(tmp_path)
    eng = hr.engine(tmp_path)
    assert eng.model_config.model_dump(exclude={"max_seq_len"}) == m.model_dump(exclude={"max_seq_len"})
    hr.assert_logits_match_hf(eng, hf, list(range(1, 60)), TOL)


def test_qwen3_moe_rejects_what_hf_cannot_express() -> None:
    m = ModelConfig(
        arch="qwen3_moe", n_routed_experts=8, n_experts_per_tok=2, moe_hidden_dim=8, expert_bias=True
    )
    with pytest.raises(ValueError, match="model.expert_bias"):
        hf_config(m, eos_token_id=1)


def test_loads_trainer_published_moe_weights(tmp_path: Path) -> None:
    """The trainer publishes torchtitan Qwen3-MoE weights under HF per-expert names; the engine
    loads that directory and computes the trainer model's log-probs."""
    from trainer.model import build_model, save_weights_dir  # imports torchtitan: only here

    m = ModelConfig.model_validate(tomllib.loads((CONFIG_DIR / "models" / "debug-moe.toml").read_text()))
    model = build_model(m, seed=0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.1)  # peaked routing and logits: every expert weight matters
    d = save_weights_dir(m, model.state_dict(), tmp_path / "step_0", {"version": 0})
    eng = hr.engine(d)
    assert eng.model_config.model_dump(exclude={"max_seq_len"}) == m.model_dump(exclude={"max_seq_len"})
    tokens = list(range(1, 60))
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([tokens]))[0].float(), dim=-1)
    torch.testing.assert_close(hr.engine_logprobs(eng, tokens), ref, atol=TOL, rtol=0)


def test_decode_service_returns_routed_experts(redis_url: str, tmp_path: Path) -> None:
    """POST /v1/generate with return_routed_experts on a real decode process serving debug-moe."""
    import httpx
    from helpers.decode_server import decode_server

    from services.common.schemas import GenerateResponse
    from trainer.model import build_model, save_weights_dir

    m = ModelConfig.model_validate(tomllib.loads((CONFIG_DIR / "models" / "debug-moe.toml").read_text()))
    weights = save_weights_dir(m, build_model(m, seed=0).state_dict(), tmp_path / "step_0", {"version": 0})
    with decode_server(
        redis_url, weights, m, tmp_path, prefix="test-moe", max_seq_len=64, max_batch_size=4
    ) as s:
        body = {"input_ids": [5, 6, 7, 8], "sampling": {"max_tokens": 4, "ignore_eos": True, "n": 2}}
        r = httpx.post(
            f"{s.url}/v1/generate",
            json={**body, "return_routed_experts": True},
            timeout=30,
            headers=auth_headers(),
        )
        assert r.status_code == 200, r.text
        for choice in GenerateResponse.model_validate(r.json()).choices:
            assert choice.routed_experts is not None
            ids = routing.decode(choice.routed_experts)
            assert ids.shape == (8, 2, 2) and ids.dtype == np.uint8
            assert (ids[:-1] < 8).all() and (ids[-1] == 255).all()
            assert (np.sort(ids[:-1], -1)[..., 0] < np.sort(ids[:-1], -1)[..., 1]).all()  # 2 distinct
        plain = httpx.post(f"{s.url}/v1/generate", json=body, timeout=30, headers=auth_headers()).json()
        assert all(c["routed_experts"] is None for c in plain["choices"])


def test_weight_update_in_place_matches_fresh_engine(tmp_path: Path) -> None:
    """load_weights copies a new per-expert checkpoint into the fused expert tensors in place."""
    dirs = []
    for seed in (1, 2):
        hf = hr.randomize(Qwen3MoeForCausalLM(qwen3_moe_config(**VARIANTS["dense0-norm"])), seed=seed)
        hf.save_pretrained(tmp_path / f"v{seed}")
        dirs.append(tmp_path / f"v{seed}")
    eng = hr.engine(dirs[0])
    tokens = list(range(2, 50))
    old = hr.engine_logprobs(eng, tokens)
    experts = eng.model.model.layers[1].mlp.experts.gate_up_proj
    ptr = experts.data_ptr()
    eng.load_weights(dirs[1], version=1)
    assert experts.data_ptr() == ptr  # same storage: no reallocation
    new = hr.engine_logprobs(eng, tokens)
    assert (new - old).abs().max() > 0.1
    torch.testing.assert_close(new, hr.engine_logprobs(hr.engine(dirs[1]), tokens), atol=0, rtol=0)


def test_routing_survives_preemption(pair) -> None:
    """A pool too small for all sequences preempts (pages freed, recomputed later); the ids of
    the recomputed tokens come from the recompute and still equal HF's router top-k."""
    _, hf, d = pair
    eng = hr.engine(d, block_size=4, num_kv_blocks=16)
    params = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, seed=4)
    prompts = [list(range(10 + i, 30 + i)) for i in range(4)]  # 4 x 36 tokens > 64 slots
    reqs = [GenerateRequest(input_ids=p, sampling=params, return_routed_experts=True) for p in prompts]
    resps = eng.generate(reqs)
    assert eng.stats.preemptions_total > 0
    for prompt, resp in zip(prompts, resps, strict=True):
        choice = resp.choices[0]
        assert choice.routed_experts is not None and len(choice.output_ids) == 16
        ids = routing.decode(choice.routed_experts)
        hr.assert_same_experts(ids[:-1], hr.hf_router_ids(hf, (prompt + choice.output_ids)[:-1]))
