"""Weight directories of the debug model for engine and decode tests that need two versions."""

from __future__ import annotations

from pathlib import Path

from services.common.config import load_config
from trainer.model import build_model, save_weights_dir


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
