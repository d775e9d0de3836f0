"""HF config.json <-> ModelConfig: what a model directory's config.json says for each architecture
(dense Qwen3 / Llama-3, Qwen3-MoE, DeepSeek-V3 / Kimi-K2, GLM-5, Nemotron-H). The directory
itself (files, index, atomic writes, reading, retention) is services/common/weights_dir.py."""

from __future__ import annotations

import math
from typing import Any

from services.common.config import ModelConfig, RopeScaling, YarnScaling


def hf_config(m: ModelConfig, eos_token_id: int, pad_token_id: int = 0) -> dict[str, Any]:
    llama = m.arch == "llama3"
    extra: dict[str, Any] = {}
    if m.rope_scaling is not None:
        # The pre-5.0 HF key, which transformers 5 still reads (it folds it into rope_parameters).
        extra["rope_scaling"] = m.rope_scaling.model_dump()
    if not m.fp32_residual:  # relay's key (HF ignores it): the engine must round where the trainer does
        extra["relay_fp32_residual"] = False
    base = extra | {
        "architectures": ["LlamaForCausalLM" if llama else "Qwen3ForCausalLM"],
        "model_type": "llama" if llama else "qwen3",
        "vocab_size": m.vocab_size,
        "hidden_size": m.dim,
        "intermediate_size": m.hidden_dim,
        "num_hidden_layers": m.n_layers,
        "num_attention_heads": m.n_heads,
        "num_key_value_heads": m.n_kv_heads,
        "head_dim": m.head_dim,
        "max_position_embeddings": m.max_seq_len,
        "rope_theta": m.rope_theta,
        "rms_norm_eps": m.norm_eps,
        "tie_word_embeddings": m.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "eos_token_id": eos_token_id,
        "pad_token_id": pad_token_id,
        "torch_dtype": "float32",
    }
    return base | _moe_mla_hf(m)


def model_config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    """Inverse of hf_config, for loading any Qwen3-family HF directory."""
    m = _model_config_from_hf(cfg)
    # ModelConfig.fp32_residual: written by hf_config only when off; Hub configs lack it (default).
    return m if cfg.get("relay_fp32_residual", True) else m.model_copy(update={"fp32_residual": False})


def _model_config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    if cfg.get("model_type") == "nemotron_h":
        return _nemotron_h_from_hf(cfg)
    if cfg.get("model_type") in MOE_MODEL_TYPES:
        return _moe_mla_from_hf(cfg)
    if cfg.get("model_type") not in ("qwen3", "llama", "qwen2"):
        raise ValueError(f"unsupported model_type {cfg.get('model_type')!r}")
    n_heads = cfg["num_attention_heads"]
    # transformers >= 5 writes rope_theta and the scaling into "rope_parameters"; older configs
    # (and most Hub snapshots) have top-level rope_theta and "rope_scaling".
    rope = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise ValueError(f"rope_scaling type {rope_type!r} is not supported (only llama3)")
    scaling = None
    if rope_type == "llama3":
        scaling = RopeScaling(
            factor=rope["factor"],
            low_freq_factor=rope["low_freq_factor"],
            high_freq_factor=rope["high_freq_factor"],
            original_max_position_embeddings=rope.get(
                "original_max_position_embeddings", cfg.get("max_position_embeddings", 8192)
            ),
        )
    return ModelConfig(
        arch="llama3" if cfg.get("model_type") == "llama" else "qwen3",
        vocab_size=cfg["vocab_size"],
        dim=cfg["hidden_size"],
        n_layers=cfg["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=cfg.get("num_key_value_heads", n_heads),
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // n_heads,
        hidden_dim=cfg["intermediate_size"],
        max_seq_len=cfg.get("max_position_embeddings", 4096),
        rope_theta=rope.get("rope_theta", cfg.get("rope_theta", 10000.0)),
        rope_scaling=scaling,
        norm_eps=cfg.get("rms_norm_eps", 1e-6),
        qk_norm=cfg.get("model_type") == "qwen3",
        tie_embeddings=cfg.get("tie_word_embeddings", False),
    )


# --------------------------------------------------------------------------- MoE / MLA (HF names)

# Kimi-K2 ships DeepSeek-V3's architecture under its own model_type.
MOE_MODEL_TYPES = ("qwen3_moe", "deepseek_v3", "kimi_k2", "glm_moe_dsa")


def _moe_mla_hf(m: ModelConfig) -> dict[str, Any]:
    """config.json keys of Qwen3MoeForCausalLM / DeepseekV3ForCausalLM / GlmMoeDsaForCausalLM /
    NemotronHForCausalLM, overriding the dense ones (empty for dense archs)."""
    if m.arch == "nemotron_h":
        return _nemotron_h_hf(m)
    if m.arch == "qwen3_moe":
        # HF Qwen3-MoE: softmax top-k, no shared experts, no bias, no groups, no output scaling.
        fixed = {
            "n_shared_experts": 0,
            "expert_bias": False,
            "router_score": "softmax",
            "n_group": 1,
            "routed_scaling_factor": 1.0,
        }
        for key, value in fixed.items():
            if getattr(m, key) != value:
                raise ValueError(
                    f"model.{key}: qwen3_moe (HF Qwen3-MoE) needs {value!r}, got {getattr(m, key)!r}"
                )
        return {
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "num_experts": m.n_routed_experts,
            "num_experts_per_tok": m.n_experts_per_tok,
            "moe_intermediate_size": m.moe_hidden_dim,
            "norm_topk_prob": m.norm_topk_prob,
            "decoder_sparse_step": 1,
            "mlp_only_layers": list(range(m.first_k_dense)),
        }
    if m.arch in ("deepseek_v3", "glm_moe_dsa"):
        out: dict[str, Any] = {
            "architectures": ["DeepseekV3ForCausalLM"],
            "model_type": "deepseek_v3",
            "num_key_value_heads": m.n_heads,
            # HF's DeepseekV3Config: head_dim is the RoPE width (what its rotary embedding spans).
            "head_dim": m.qk_rope_head_dim,
            "n_routed_experts": m.n_routed_experts,
            "n_shared_experts": m.n_shared_experts,
            "num_experts_per_tok": m.n_experts_per_tok,
            "moe_intermediate_size": m.moe_hidden_dim,
            "first_k_dense_replace": m.first_k_dense,
            "routed_scaling_factor": m.routed_scaling_factor,
            "scoring_func": m.router_score,
            "topk_method": "noaux_tc" if m.expert_bias else "greedy",
            "n_group": m.n_group,
            "topk_group": m.topk_group,
            "norm_topk_prob": m.norm_topk_prob,
            "q_lora_rank": m.q_lora_rank or None,
            "kv_lora_rank": m.kv_lora_rank,
            "qk_nope_head_dim": m.qk_nope_head_dim,
            "qk_rope_head_dim": m.qk_rope_head_dim,
            "v_head_dim": m.v_head_dim,
            "rope_interleave": True,
            "num_nextn_predict_layers": m.n_mtp_layers,
        }
        if m.arch == "glm_moe_dsa":
            # GLM-5: DeepSeek-V3's layout plus the DSA indexer; every layer runs its own indexer.
            out |= {
                "architectures": ["GlmMoeDsaForCausalLM"],
                "model_type": "glm_moe_dsa",
                "index_topk": m.index_topk,
                "index_n_heads": m.index_n_heads,
                "index_head_dim": m.index_head_dim,
                "indexer_types": ["full"] * m.n_layers,
                "mlp_layer_types": ["dense"] * m.first_k_dense + ["sparse"] * (m.n_layers - m.first_k_dense),
            }
        return out
    if m.is_moe or m.is_mla:
        raise ValueError(f"model.arch: no HF config.json mapping for {m.arch!r}")
    return {}


def _moe_mla_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    """Inverse of _moe_mla_hf (plus Hub DeepSeek-V3 / Kimi-K2 / GLM-5 configs)."""
    mt = cfg["model_type"]
    rope = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    yarn = None
    if rope_type == "yarn" and mt != "qwen3_moe":
        if not rope.get("mscale_all_dim"):
            # HF then leaves MLA's softmax scale unscaled, a variant no checkpoint we know uses.
            raise ValueError(f"{mt}: yarn rope_scaling without mscale_all_dim is not supported")
        yarn = YarnScaling(
            rope_type="yarn",
            factor=rope["factor"],
            original_max_position_embeddings=rope["original_max_position_embeddings"],
            beta_fast=rope.get("beta_fast") or 32.0,
            beta_slow=rope.get("beta_slow") or 1.0,
            mscale=rope.get("mscale") or 1.0,
            mscale_all_dim=rope["mscale_all_dim"],
        )
    elif rope_type != "default":
        raise ValueError(f"rope_scaling type {rope_type!r} is not supported for model_type {mt!r}")
    n_heads = cfg["num_attention_heads"]
    common: dict[str, Any] = {
        "vocab_size": cfg["vocab_size"],
        "dim": cfg["hidden_size"],
        "n_layers": cfg["num_hidden_layers"],
        "n_heads": n_heads,
        "hidden_dim": cfg["intermediate_size"],
        "max_seq_len": cfg.get("max_position_embeddings", 4096),
        "rope_theta": rope.get("rope_theta", cfg.get("rope_theta", 10000.0)),
        "rope_scaling": yarn,
        "norm_eps": cfg.get("rms_norm_eps", 1e-6),
        "tie_embeddings": cfg.get("tie_word_embeddings", False),
        "moe_hidden_dim": cfg["moe_intermediate_size"],
        "n_experts_per_tok": cfg["num_experts_per_tok"],
        "norm_topk_prob": cfg.get("norm_topk_prob", mt != "qwen3_moe"),
    }
    if mt == "qwen3_moe":
        n_layers = cfg["num_hidden_layers"]
        dense = sorted(cfg.get("mlp_only_layers") or [])
        if cfg.get("decoder_sparse_step", 1) != 1 or dense != list(range(len(dense))):
            raise ValueError(
                "qwen3_moe: only leading dense layers are supported (decoder_sparse_step 1, "
                f"mlp_only_layers 0..k-1; got {cfg.get('decoder_sparse_step')}, {dense})"
            )
        if len(dense) >= n_layers:
            raise ValueError("qwen3_moe: mlp_only_layers covers every layer (a dense model)")
        return ModelConfig(
            arch="qwen3_moe",
            n_kv_heads=cfg.get("num_key_value_heads", n_heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // n_heads,
            qk_norm=True,
            # transformers 5 writes num_local_experts, older configs num_experts.
            n_routed_experts=cfg.get("num_experts", cfg.get("num_local_experts")),
            first_k_dense=len(dense),
            router_score="softmax",
            **common,
        )
    nope, rope_dim = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"]
    if not cfg.get("rope_interleave", True):
        # The engine's MLA RoPE is DeepSeek's interleaved one (HF's default, torchtitan's).
        raise ValueError(f"{mt}: rope_interleave false is not supported")
    method = cfg.get("topk_method", "noaux_tc")
    first_k_dense = cfg.get("first_k_dense_replace", 0)
    dsa: dict[str, Any] = {}
    if mt == "glm_moe_dsa":
        n = cfg["num_hidden_layers"]
        first_k_dense = min(first_k_dense, n)
        types = cfg.get("mlp_layer_types") or ["dense"] * first_k_dense + ["sparse"] * (n - first_k_dense)
        first_k_dense = types.count("dense")
        if types != ["dense"] * first_k_dense + ["sparse"] * (n - first_k_dense):
            raise ValueError(
                f"glm_moe_dsa: only leading dense layers are supported (mlp_layer_types {types})"
            )
        if any(t != "full" for t in cfg.get("indexer_types") or []):
            # "shared" layers reuse another layer's top-k selection: not implemented in the engine.
            raise ValueError(
                f"glm_moe_dsa: indexer_types {cfg['indexer_types']} (only 'full') is not supported"
            )
        dsa = {
            "index_topk": cfg["index_topk"],
            "index_n_heads": cfg["index_n_heads"],
            "index_head_dim": cfg["index_head_dim"],
        }
    return ModelConfig(
        arch="glm_moe_dsa" if mt == "glm_moe_dsa" else "deepseek_v3",
        n_kv_heads=n_heads,  # MLA: every head has its own (decompressed) K and V
        head_dim=nope + rope_dim,
        qk_norm=False,
        n_routed_experts=cfg["n_routed_experts"],
        n_shared_experts=cfg.get("n_shared_experts") or 0,
        first_k_dense=first_k_dense,
        routed_scaling_factor=cfg.get("routed_scaling_factor", 1.0),
        router_score=cfg.get("scoring_func", "sigmoid"),
        n_group=cfg.get("n_group") or 1,
        topk_group=cfg.get("topk_group") or 1,
        expert_bias=method == "noaux_tc",
        q_lora_rank=cfg.get("q_lora_rank") or 0,
        kv_lora_rank=cfg["kv_lora_rank"],
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope_dim,
        v_head_dim=cfg["v_head_dim"],
        n_mtp_layers=cfg.get("num_nextn_predict_layers", 0),
        **dsa,
        **common,
    )


# --------------------------------------------------------------------------- Nemotron-H (HF names)

_NEMOTRON_KINDS = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
# transformers 5 spells each layer's kind out (layers_block_type / layer_types)
_NEMOTRON_TYPES = {
    "linear_attention": "M",
    "mamba": "M",
    "full_attention": "*",
    "attention": "*",
    "mlp": "-",
    "moe": "E",
}


def _nemotron_h_hf(m: ModelConfig) -> dict[str, Any]:
    """NemotronHForCausalLM's config.json (HF NemotronHConfig; the pattern as the Hub configs
    write it, hybrid_override_pattern, which transformers 5 turns into layers_block_type)."""
    if m.is_moe and m.router_score != "sigmoid":
        raise ValueError("model.router_score: nemotron_h routes by sigmoid scores")
    out: dict[str, Any] = {
        "architectures": ["NemotronHForCausalLM"],
        "model_type": "nemotron_h",
        "hybrid_override_pattern": m.hybrid_pattern,
        "num_hidden_layers": m.n_layers,
        "layer_norm_epsilon": m.norm_eps,
        "mlp_hidden_act": "relu2",
        "mlp_bias": False,
        "mamba_hidden_act": "silu",
        "mamba_num_heads": m.mamba_n_heads,
        "mamba_head_dim": m.mamba_head_dim,
        "ssm_state_size": m.ssm_state_size,
        "n_groups": m.mamba_n_groups,
        "conv_kernel": m.mamba_conv_kernel,
        "chunk_size": m.mamba_chunk_size,
        "use_conv_bias": True,
        "use_bias": False,
        "residual_in_fp32": False,
    }
    if m.mamba_dt_min or m.mamba_dt_max is not None:
        out["time_step_limit"] = [
            m.mamba_dt_min,
            m.mamba_dt_max if m.mamba_dt_max is not None else float("inf"),
        ]
    if m.is_moe:
        out |= {
            "n_routed_experts": m.n_routed_experts,
            "num_experts_per_tok": m.n_experts_per_tok,
            "moe_intermediate_size": m.moe_hidden_dim,
            "n_shared_experts": m.n_shared_experts,
            "moe_shared_expert_intermediate_size": m.shared_width,
            "routed_scaling_factor": m.routed_scaling_factor,
            "n_group": m.n_group,
            "topk_group": m.topk_group,
            "norm_topk_prob": m.norm_topk_prob,
        }
    return out


def _nemotron_pattern(cfg: dict[str, Any]) -> str:
    if isinstance(cfg.get("hybrid_override_pattern"), str):
        return str(cfg["hybrid_override_pattern"])
    types = cfg.get("layers_block_type") or cfg.get("layer_types")
    if not isinstance(types, list) or any(t not in _NEMOTRON_TYPES for t in types):
        raise ValueError(f"nemotron_h: unsupported layer types {types!r}")
    return "".join(_NEMOTRON_TYPES[t] for t in types)


def _json_float(v: Any) -> float:
    """A float of config.json: a number, or transformers' {"__float__": "Infinity"} for inf."""
    return float(v["__float__"]) if isinstance(v, dict) and "__float__" in v else float(v)


def _nemotron_h_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    """Inverse of _nemotron_h_hf, for Hub Nemotron-H / Nemotron-3 configs too."""
    pattern = _nemotron_pattern(cfg)
    fixed = {
        "mlp_hidden_act": "relu2",
        "mamba_hidden_act": "silu",
        "use_conv_bias": True,
        "use_bias": False,
        "mlp_bias": False,
        "moe_latent_size": None,
        "residual_in_fp32": False,
    }
    for key, want in fixed.items():
        if cfg.get(key, want) != want:
            raise ValueError(f"nemotron_h: {key} = {cfg[key]!r} is not supported (only {want!r})")
    n_heads = cfg["num_attention_heads"]
    moe = "E" in pattern
    lo, hi = (_json_float(v) for v in (cfg.get("time_step_limit") or [0.0, float("inf")])[:2])
    shared = 1 if moe else 0  # HF's NemotronHMoE always has its one shared expert
    return ModelConfig(
        arch="nemotron_h",
        vocab_size=cfg["vocab_size"],
        dim=cfg["hidden_size"],
        n_layers=len(pattern),
        n_heads=n_heads,
        n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // n_heads,
        hidden_dim=cfg.get("intermediate_size", 256),
        max_seq_len=cfg.get("max_position_embeddings", 4096),
        norm_eps=cfg.get("layer_norm_epsilon", 1e-5),
        qk_norm=False,
        tie_embeddings=cfg.get("tie_word_embeddings", False),
        hybrid_pattern=pattern,
        mamba_n_heads=cfg.get("mamba_num_heads", 0) if "M" in pattern else 0,
        mamba_head_dim=cfg.get("mamba_head_dim", 0) if "M" in pattern else 0,
        ssm_state_size=cfg.get("ssm_state_size", 0) if "M" in pattern else 0,
        mamba_n_groups=cfg.get("n_groups", cfg.get("mamba_n_groups", 1)),
        mamba_conv_kernel=cfg.get("conv_kernel", cfg.get("mamba_d_conv", 4)),
        mamba_chunk_size=cfg.get("chunk_size", cfg.get("mamba_chunk_size", 128)),
        mamba_dt_min=lo,
        mamba_dt_max=None if math.isinf(hi) else hi,
        n_routed_experts=cfg.get("n_routed_experts", 0) if moe else 0,
        n_experts_per_tok=cfg.get("num_experts_per_tok", 0) if moe else 0,
        moe_hidden_dim=cfg.get("moe_intermediate_size", 0) if moe else 0,
        n_shared_experts=shared,
        shared_expert_hidden_dim=cfg.get("moe_shared_expert_intermediate_size", 0) if shared else 0,
        routed_scaling_factor=cfg.get("routed_scaling_factor", 1.0),
        router_score="sigmoid",
        norm_topk_prob=cfg.get("norm_topk_prob", True),
        n_group=cfg.get("n_group") or 1,
        topk_group=cfg.get("topk_group") or 1,
        # HF's NemotronH router always has the correction bias (a float32 buffer, zeros by default)
        expert_bias=moe,
    )
