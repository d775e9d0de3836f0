"""The weights contract: RUN_DIR/weights/step_<N>/ is an HF-style model directory.

    config.json            HF Qwen3 config (model_type "qwen3")
    model.safetensors      HF parameter names (model.layers.0.self_attn.q_proj.weight, ...)
    tokenizer.json         HF tokenizers file
    tokenizer_config.json
    relay.json             {"version": N, "step": N, "created": ...}

Directories are written under a temporary name and renamed when complete, so a reader never
sees a half-written version; any HF-compatible engine can load one.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from services.common.config import ModelConfig

WEIGHTS_FILE = "model.safetensors"


def step_dir(run_dir: str | Path, version: int) -> Path:
    return Path(run_dir) / "weights" / f"step_{version}"


def hf_config(m: ModelConfig, eos_token_id: int, pad_token_id: int = 0) -> dict[str, Any]:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
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


def model_config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    """Inverse of hf_config, for loading any Qwen3-family HF directory."""
    if cfg.get("model_type") not in ("qwen3", "llama", "qwen2"):
        raise ValueError(f"unsupported model_type {cfg.get('model_type')!r}")
    n_heads = cfg["num_attention_heads"]
    return ModelConfig(
        vocab_size=cfg["vocab_size"],
        dim=cfg["hidden_size"],
        n_layers=cfg["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=cfg.get("num_key_value_heads", n_heads),
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // n_heads,
        hidden_dim=cfg["intermediate_size"],
        max_seq_len=cfg.get("max_position_embeddings", 4096),
        rope_theta=cfg.get("rope_theta", 10000.0),
        norm_eps=cfg.get("rms_norm_eps", 1e-6),
        qk_norm=cfg.get("model_type") == "qwen3",
        tie_embeddings=cfg.get("tie_word_embeddings", False),
    )


def write_model_dir(
    dest: Path,
    hf_state: dict[str, torch.Tensor],
    config: dict[str, Any],
    tokenizer_src: Path | None,
    meta: dict[str, Any],
) -> Path:
    """Write a complete model directory atomically (tmp name + rename)."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".{dest.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in hf_state.items()}
    save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    if tokenizer_src is not None:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            if (tokenizer_src / name).exists():
                shutil.copy2(tokenizer_src / name, tmp / name)
    (tmp / "relay.json").write_text(json.dumps({**meta, "created": time.time()}, indent=2))
    for f in tmp.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    if dest.exists():
        shutil.rmtree(dest)
    os.rename(tmp, dest)
    return dest


def read_model_dir(path: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Return (config.json, HF state dict). Reads every *.safetensors shard in the directory."""
    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    state: dict[str, torch.Tensor] = {}
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"{path} holds no *.safetensors")
    for shard in shards:
        state.update(load_file(str(shard)))
    return config, state


def read_meta(path: str | Path) -> dict[str, Any]:
    p = Path(path) / "relay.json"
    return json.loads(p.read_text()) if p.exists() else {}
