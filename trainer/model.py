"""The trainer's model: torchtitan's Qwen3 definition, and conversion to/from the HF weights contract."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch
from torchtitan.models.qwen3.model.args import Qwen3ModelArgs
from torchtitan.models.qwen3.model.model import Qwen3Model
from torchtitan.models.qwen3.model.state_dict_adapter import Qwen3StateDictAdapter

from services.common.config import ModelConfig
from services.common.modeldir import hf_config, model_config_from_hf, read_model_dir, write_model_dir
from services.common.tokenizer import build_char_tokenizer, eos_id, save_tokenizer


def model_args(m: ModelConfig) -> Qwen3ModelArgs:
    return Qwen3ModelArgs(
        dim=m.dim,
        n_layers=m.n_layers,
        n_heads=m.n_heads,
        n_kv_heads=m.n_kv_heads,
        vocab_size=m.vocab_size,
        head_dim=m.head_dim,
        hidden_dim=m.hidden_dim,
        norm_eps=m.norm_eps,
        rope_theta=m.rope_theta,
        qk_norm=m.qk_norm,
        max_seq_len=m.max_seq_len,
        enable_weight_tying=m.tie_embeddings,
        # SDPA: FlexAttention has no CPU backward.
        attn_type="sdpa",
        attn_mask_type="causal",
    )


def build_model(
    m: ModelConfig,
    seed: int | None = None,
    device: str | torch.device = "cpu",
    init_std: float | None = None,
) -> Qwen3Model:
    """torchtitan's init; with `init_std`, tied embeddings are re-drawn with that std (see below).

    Why: torchtitan gives the tied embedding/output matrix std dim**-0.5. At init the residual
    stream is dominated by the input token's own embedding, so after the final RMSNorm the logit
    of "repeat the last token" is sqrt(dim) times larger than the others: for the debug model
    (dim 64) that is ~8 vs ~1 and the initial entropy is ~0.3 nats instead of ~log(vocab).
    A near-deterministic initial policy gives zero-advantage groups and RL barely starts. With
    std 0.02 the same ratio holds but all logits are small, so the policy starts near uniform.
    """
    args = model_args(m)
    with torch.device(device):
        model = Qwen3Model(args)
    if seed is not None:
        torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device(device))
        if init_std is not None and m.tie_embeddings:
            torch.nn.init.trunc_normal_(
                model.tok_embeddings.weight, mean=0.0, std=init_std, a=-3 * init_std, b=3 * init_std
            )
    return model


def adapter(m: ModelConfig) -> Qwen3StateDictAdapter:
    return Qwen3StateDictAdapter(model_args(m), None)


def to_hf_state(m: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return adapter(m).to_hf(state)


def from_hf_state(m: ModelConfig, hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    state = adapter(m).from_hf(hf_state)
    if m.tie_embeddings:
        state["output.weight"] = state["tok_embeddings.weight"]
    return state


def save_weights_dir(
    m: ModelConfig, state: dict[str, torch.Tensor], dest: Path, meta: dict[str, Any]
) -> Path:
    """Write a full (unsharded, CPU) torchtitan state dict as an HF model directory."""
    tok = build_char_tokenizer()
    if tok.get_vocab_size() > m.vocab_size:
        raise ValueError(f"tokenizer has {tok.get_vocab_size()} tokens > model vocab_size {m.vocab_size}")
    with tempfile.TemporaryDirectory() as tdir:
        save_tokenizer(tok, Path(tdir))
        return write_model_dir(dest, to_hf_state(m, state), hf_config(m, eos_id(tok)), Path(tdir), meta)


def load_weights_dir(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    cfg, hf_state = read_model_dir(path)
    m = model_config_from_hf(cfg)
    return m, from_hf_state(m, hf_state)
