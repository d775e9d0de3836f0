"""FP8 weight directories for tests: an HF directory's weights as an FP8 checkpoint (HF
quantization_config "fp8", 128x128 block scales), as DeepSeek-V3, Kimi-K2 and GLM-5 ship theirs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ops.fp8.recipe import default_skip, quantize_weight
from services.common.config import ModelConfig
from services.common.weights_dir import read_model_dir, write_model_dir

QCFG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def per_expert(state: dict[str, torch.Tensor], m: ModelConfig) -> dict[str, torch.Tensor]:
    """Fused expert tensors (the engine's parameter names) under HF's per-expert names, which is
    how FP8 MoE checkpoints ship them."""
    out: dict[str, torch.Tensor] = {}
    i = m.moe_hidden_dim
    for key, v in state.items():
        prefix, _, leaf = key.rpartition(".")
        if not (prefix.endswith(".mlp.experts") and leaf in ("gate_up_proj", "down_proj")):
            out[key] = v
            continue
        for e in range(v.shape[0]):
            if leaf == "gate_up_proj":
                out[f"{prefix}.{e}.gate_proj.weight"] = v[e, :i].clone()
                out[f"{prefix}.{e}.up_proj.weight"] = v[e, i:].clone()
            else:
                out[f"{prefix}.{e}.down_proj.weight"] = v[e].clone()
    return out


def quantise_state(hp: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An FP8 checkpoint's tensors: every attention/MLP/expert linear weight (incl. MLA's kv_b_proj,
    as DeepSeek-V3 ships it) as E4M3 + weight_scale_inv; embeddings, norms, lm_head, routers bf16.
    pow2 scales: a re-quantisation with the engine's exact scales gives other bits, so a test can
    tell a copy from a re-quantisation."""
    out: dict[str, torch.Tensor] = {}
    for key, v in hp.items():
        if key.endswith(".weight") and v.dim() == 2 and not default_skip(key.removesuffix(".weight")):
            out[key], out[key + "_scale_inv"] = quantize_weight(v, pow2=True)
        else:
            out[key] = v.to(torch.bfloat16)
    return out


def hf_config_of(d: Path) -> dict[str, Any]:
    return json.loads((d / "config.json").read_text())


def write_dir(dest: Path, state: dict[str, torch.Tensor], config: dict[str, Any], version: int = 0) -> Path:
    return write_model_dir(dest, state, config, None, {"version": version})


def fp8_model_dir(
    hp_dir: Path, m: ModelConfig, dest: Path, version: int = 0
) -> tuple[Path, dict[str, torch.Tensor]]:
    """`hp_dir`'s weights as an FP8 checkpoint at `dest`, and its tensors."""
    cfg, hp = read_model_dir(hp_dir)
    state = quantise_state(per_expert(hp, m))
    return write_dir(dest, state, cfg | {"quantization_config": QCFG}, version), state
