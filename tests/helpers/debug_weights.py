"""Weight directories for engine and decode tests: the debug model in two versions, and random
weights of any small config."""

from __future__ import annotations

from pathlib import Path

import torch

from services.common.config import ModelConfig, load_config
from services.common.modeldir import hf_config
from services.common.weights_dir import write_model_dir
from services.engine.models.causal_lm import CausalLM
from trainer.model import build_model, save_weights_dir


def random_model_dir(m: ModelConfig, dest: Path, seed: int = 0, version: int = 0, std: float = 0.02) -> Path:
    """An HF directory of `m` with normal(0, std) matrices and unit norms (EOS: the last id)."""
    torch.manual_seed(seed)
    model = CausalLM(m, m.max_seq_len)
    state = {
        n: torch.ones_like(p) if p.dim() == 1 else torch.randn_like(p) * std
        for n, p in model.named_parameters()
    }
    return write_model_dir(
        dest, state, hf_config(m, eos_token_id=m.vocab_size - 1), None, {"version": version}
    )


def spread_debug_versions(root: Path) -> tuple[Path, Path]:
    """Versions 0 and 1 of the debug model (trainer init, seeds 0 and 1) as HF directories
    root/step_0 and root/step_1. The final norm is scaled by 0.3: the random init's next-token
    distributions are then spread out, so seeded sampling really draws different tokens."""
    m = load_config("debug").model
    out = []
    for seed in (0, 1):
        state = build_model(m, seed=seed).state_dict()
        state["norm.weight"] = state["norm.weight"] * 0.3
        out.append(save_weights_dir(m, state, root / f"step_{seed}", {"version": seed}))
    return out[0], out[1]
