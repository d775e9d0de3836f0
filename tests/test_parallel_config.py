"""decode.parallel / prefill.parallel: checked against the model's shape and the GPUs a replica is
given, errors naming the dotted key; the engine layout and memory per GPU the dry run prints."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from sbatch import plan as P
from sbatch import slurm
from services.common.config import ConfigError, ParallelConfig, load_config

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    ("config", "overrides", "reason"),
    [
        # debug: 4 heads, 2 KV heads, vocab 64, hidden 256
        ("debug", ["--decode.parallel.tp=3"], r"decode\.parallel\.tp \(3\) must divide model\.n_heads \(4\)"),
        (
            "debug",
            ["--model.n_heads=12", "--model.n_kv_heads=6", "--decode.parallel.tp=4"],
            r"decode\.parallel\.tp \(4\) must divide model\.n_kv_heads \(6\), or be a multiple",
        ),
        (
            "debug",
            ["--model.vocab_size=66", "--decode.parallel.tp=4"],
            r"decode\.parallel\.tp \(4\) must divide model\.vocab_size",
        ),
        ("debug", ["--decode.parallel.ep=2"], r"ep \(2\) must be 1 or the engine's ranks"),
        (
            "debug",
            ["--decode.parallel.tp=2", "--decode.parallel.ep=2"],
            r"decode\.parallel\.ep \(2\) > 1 needs an MoE",
        ),
        (
            "debug-moe",
            ["--decode.parallel.dp_attention=2"],
            r"dp_attention \(2\) > 1 needs ep = tp x dp_attention = 2",
        ),
        (
            "debug-moe",
            ["--model.n_routed_experts=6", "--decode.parallel.dp_attention=4", "--decode.parallel.ep=4"],
            r"decode\.parallel\.ep \(4\) must divide model\.n_routed_experts \(6\)",
        ),
        (
            "debug-moe",
            [
                "--decode.engine.max_batch_size=1",
                "--decode.parallel.dp_attention=2",
                "--decode.parallel.ep=2",
            ],
            r"decode\.parallel\.dp_attention \(2\) exceeds decode\.engine\.max_batch_size \(1\)",
        ),
        (
            "debug-moe",
            ["--model.moe_hidden_dim=62", "--decode.parallel.tp=4"],
            r"decode\.parallel\.tp \(4\) must divide model\.moe_hidden_dim \(62\)",
        ),
        (
            "debug-nemotron",
            ["--decode.parallel.tp=4"],
            r"decode\.parallel\.tp \(4\) must divide model\.mamba_n_groups \(2\)",
        ),
        (
            "debug",
            ["--prefill.replicas=1", "--prefill.parallel.tp=3"],
            r"prefill\.parallel\.tp \(3\) must divide model\.n_heads",
        ),
        (
            "debug",
            ["--slurm.launcher=slurm", "--slurm.decode.gpus_per_node=4", "--decode.parallel.tp=2"],
            r"decode\.parallel: tp x dp_attention = 2 rank\(s\) per engine, but each decode replica gets 4 GPU",
        ),
        (
            "glm5",
            ["--prefill.parallel.tp=1", "--prefill.parallel.dp_attention=4", "--prefill.parallel.ep=4"],
            r"prefill\.parallel: tp x dp_attention = 4 rank\(s\) per engine, but each prefill replica gets 8",
        ),
    ],
)
def test_bad_layouts_name_the_key(config: str, overrides: list[str], reason: str) -> None:
    with pytest.raises(ConfigError, match=reason):
        load_config(config, overrides)


def test_good_layouts() -> None:
    # Fewer KV heads than ranks: each KV head replicated (2 KV heads over tp 4).
    cfg = load_config("debug", ["--decode.parallel.tp=4"])
    assert cfg.decode.parallel.ranks == 4 and cfg.prefill_parallel == cfg.decode.parallel
    # EP over the whole engine with data-parallel attention; tp x dp_attention ranks.
    cfg = load_config(
        "debug-moe", ["--decode.parallel.tp=2", "--decode.parallel.dp_attention=2", "--decode.parallel.ep=4"]
    )
    assert cfg.decode.parallel.ranks == 4
    # Experts tensor-parallel with everything else (ep = 1).
    assert load_config("debug-moe", ["--decode.parallel.tp=2"]).decode.parallel.ep == 1
    # Nemotron-H: Mamba-2 heads and B/C groups split, experts tensor- or expert-parallel.
    for extra in ([], ["--decode.parallel.ep=2"]):
        cfg = load_config("debug-nemotron", ["--decode.parallel.tp=2", *extra])
        assert cfg.decode.parallel.ranks == 2
    layout = ["--decode.parallel.dp_attention=2", "--decode.parallel.ep=2"]  # its own state slots a group
    assert load_config("debug-nemotron", layout).decode.parallel.ranks == 2
    with pytest.raises(ValueError, match="ep"):
        ParallelConfig(tp=2, ep=3)


def test_glm5_engine_layout_and_memory_per_gpu() -> None:
    cfg = load_config("glm5")
    par = cfg.decode.parallel
    assert (par.tp, par.dp_attention, par.ep) == (1, 8, 8)
    m = cfg.model
    dev = P.DEVICES["h200"]
    lay = P.engine_layout(cfg, "decode", dev)
    routed = 75 * 256 * 3 * 6144 * 2048
    assert P.routed_expert_params(m) == routed
    # FP8: one byte a parameter; everything but the experts on every GPU, 32 of 256 experts each.
    rest = m.param_counts()["total"] - routed
    assert lay.weights_gb == pytest.approx((rest + routed / 8) / 1e9)
    assert lay.experts_per_rank == 32 and lay.heads_per_rank == 64 and lay.vocab_per_rank == 154880
    # 48 sequences over 8 attention groups; MLA keeps the whole latent on each rank.
    assert lay.sequences_per_group == 6
    kv = 6 * (48000 / 2) * P.kv_bytes_per_token(m)
    assert lay.kv_gb == pytest.approx(kv / 1e9)
    assert lay.fits
    # 64 sequences at the mean context would not fit.
    assert not P.engine_layout(load_config("glm5", ["--decode.engine.max_batch_size=64"]), "decode", dev).fits


def test_dense_tp_layout_by_hand() -> None:
    # GQA with 2 KV heads over tp 4: each rank keeps one KV head, half of a token's KV.
    cfg = load_config("debug", ["--decode.parallel.tp=4", "--decode.engine.max_batch_size=8"])
    m = cfg.model
    lay = P.engine_layout(cfg, "decode", P.DEVICES["h100"])
    assert lay.kv_heads_per_rank == 1 and lay.heads_per_rank == 1 and lay.vocab_per_rank == 16
    assert P.kv_share_per_rank(m, 4) == 0.5 and P.kv_share_per_rank(m, 2) == 0.5
    assert P.kv_share_per_rank(m, 1) == 1.0
    assert lay.weights_gb == pytest.approx(m.param_counts()["total"] * 2 / 4 / 1e9)
    # One rank reads a quarter of the weights and half of every sequence's KV.
    full = P.decode_step_bytes(m, 8, 100, 2.0)
    kv = 8 * P.kv_bytes_read_per_token(m, 100)
    assert P.decode_step_bytes_per_rank(m, cfg.decode.parallel, 8, 100, 2.0) == pytest.approx(
        (full - kv) / 4 + kv / 2
    )
    one = load_config("debug").decode.parallel
    assert P.decode_step_bytes_per_rank(m, one, 8, 100, 2.0) == pytest.approx(full)


def test_glm5_dry_run_prints_the_engine_layout(tmp_path: Path) -> None:
    cfg = load_config("glm5")
    text = slurm.describe(cfg, slurm.build_plan(cfg, tmp_path / "run"))
    engines = text.split("engines (one rank per GPU")[1]
    assert "decode: 8 engine(s) x 8 rank(s) (tp 1, dp_attention 8, ep 8); 1 engine(s) per node" in engines
    assert "prefill: 4 engine(s) x 8 rank(s)" in engines
    assert "32 routed experts" in engines and "serves 6 sequences" in engines
    assert "DOES NOT FIT" not in engines


def test_launch_dry_run_command_shows_layout() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "sbatch.launch", "run", "glm5", "--dry-run"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "engines (one rank per GPU" in out.stdout and "per GPU: weights 109.7 GB" in out.stdout
