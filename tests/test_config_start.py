"""Every shipped config passes the checks its decode and prefill services run at start on their
parallel layout, KV store and quantization settings (without building a model): a config that
cannot start fails here, not on the cluster."""

from __future__ import annotations

from pathlib import Path

import pytest

from sbatch import plan as P
from services.common.config import load_config
from services.decode.server import start_checks as decode_checks
from services.prefill.server import start_checks as prefill_checks
from trainer.model import MLA_ARCHS, moe_args
from trainer.moe_routing import deepseek_args

CONFIG_DIR = Path(__file__).parent.parent / "configs"
CONFIGS = sorted(p.name for p in CONFIG_DIR.glob("*.toml"))


def test_configs_found() -> None:
    assert {"debug.toml", "glm5.toml", "kimi-k2.toml", "nemotron3.toml"} <= set(CONFIGS)


@pytest.mark.parametrize("name", CONFIGS)
def test_prefill_starts(name: str) -> None:
    cfg = load_config(f"configs/{name}")
    prefill_checks(cfg)


@pytest.mark.parametrize("name", CONFIGS)
def test_decode_starts(name: str) -> None:
    cfg = load_config(f"configs/{name}")
    decode_checks(cfg)


def test_prefill_inheriting_dp_attention_refused_at_load(tmp_path: Path) -> None:
    """prefill.parallel unset takes decode.parallel: a data-parallel-attention decode layout is
    refused at load, naming the prefill's key."""
    text = (CONFIG_DIR / "glm5.toml").read_text()
    line = "parallel = { tp = 8, ep = 8 }\n"
    assert line in text
    path = tmp_path / "glm5.toml"
    path.write_text(text.replace(line, ""))
    with pytest.raises(ValueError, match=r"prefill\.parallel\.dp_attention \(8, from decode\.parallel"):
        load_config(str(path))


def test_glm5_prefill_layout_fits() -> None:
    """GLM-5's prefill: one attention group of tp 8 with the experts EP 8 over the node's GPUs."""
    cfg = load_config("glm5")
    par = cfg.prefill_parallel
    assert (par.tp, par.dp_attention, par.ep) == (8, 1, 8)
    lay = P.engine_layout(cfg, "prefill", P.DEVICES["h200"])
    assert lay.heads_per_rank == 8 and lay.experts_per_rank == 32 and lay.fits


@pytest.mark.parametrize("name", CONFIGS)
def test_trainer_model_args(name: str) -> None:
    """The trainer's model arguments (what it refuses before building anything) for every
    shipped model: MoE routing settings, MLA's and DSA's torchtitan arguments."""
    m = load_config(f"configs/{name}").model
    if m.arch in MLA_ARCHS:
        deepseek_args(m)
    if m.is_moe and m.arch != "nemotron_h":
        moe_args(m)
