"""bench/r3/replay.py (Router Replay benchmark) runs end to end on CPU in smoke mode: real engine
(bf16 and float32), the trainer's scoring path with replay off and on, and the float32 sanity row."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Any

import pytest

from bench.results import errors

# bench/ is not an installed package: load the script by path.
_spec = importlib.util.spec_from_file_location(
    "bench_r3_replay", Path(__file__).resolve().parents[2] / "bench" / "r3" / "replay.py"
)
assert _spec is not None and _spec.loader is not None
r3 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(r3)


def check_row(row: dict[str, Any], layers: int, sampled: int) -> None:
    off, on = row["replay_off"], row["replay_on"]
    for r in (off, on):
        assert r["tokens"] == sampled
        assert len(r["routing_agreement"]) == layers
        assert all(0.0 <= a <= 1.0 for a in r["routing_agreement"])
        assert r["mismatch_kl_k3"] >= 0.0
        assert 0.0 <= r["mismatch_p_abs_mean"] <= r["mismatch_p_abs_max"] <= 1.0
        assert 0.0 <= r["mismatch_ratio_out_frac"] <= 1.0
        assert r["train_entropy_mean"] > 0.0
        # the split by "own expert set flipped at this position" covers every sampled token
        f = r["flipped_token_frac"]
        assert 0.0 <= f <= 1.0
        parts = (r["kl_k3_flipped_tokens"] or 0.0) * f + (r["kl_k3_unflipped_tokens"] or 0.0) * (1 - f)
        assert parts == pytest.approx(r["mismatch_kl_k3"], rel=1e-6, abs=1e-15)
    # replay on routes every recorded token by the engine's ids, replay off none
    assert off["routing_replayed_frac"] == 0.0
    assert on["routing_replayed_frac"] == 1.0
    if on["mismatch_kl_k3"] > 0:
        assert row["kl_ratio_off_on"] == pytest.approx(off["mismatch_kl_k3"] / on["mismatch_kl_k3"])
    else:
        assert row["kl_ratio_off_on"] == float("inf")


def test_smoke_one_init_and_fp32_sanity(tmp_path: Path) -> None:
    out = tmp_path / "r3.json"
    assert r3.main(["--device", "cpu", "--smoke", "--inits", "hf", "--no-fsdp", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert errors(res) == []
    assert "RANK" not in os.environ
    for key in ("command", "date", "machine", "torch", "total_s"):
        assert key in res
    phase = res["bf16/hf"]
    eng = phase["engine"]
    assert eng["engine_dtype"] == "bfloat16"
    assert eng["sampled_tokens"] == 6 * 12  # smoke: 6 prompts x 12 new tokens
    check_row(phase["autocast"], layers=2, sampled=eng["sampled_tokens"])
    assert set(res["headline"]) == {"hf/autocast"}

    # float32 engine and trainer: with replay the trainer takes exactly the engine's experts and
    # its own top-k agrees on every token; the log-probs agree to float32 rounding.
    fp32 = res["fp32_sanity"]
    assert fp32["engine"]["engine_dtype"] == "float32"
    check_row(fp32, layers=2, sampled=fp32["engine"]["sampled_tokens"])
    on = fp32["replay_on"]
    assert on["routing_agreement"] == [1.0, 1.0]
    assert on["flipped_token_frac"] == 0.0 and fp32["replay_off"]["flipped_token_frac"] == 0.0
    assert on["mismatch_kl_k3"] < 1e-6 and on["log_ratio_abs_max"] < 1e-4
    assert on["mismatch_ratio_out_frac"] == 0.0
    assert fp32["sanity_ok"] is True


@pytest.mark.slow
def test_smoke_full_default_phases(tmp_path: Path) -> None:
    """Both initialisations and both trainer paths (autocast, FSDP2 on a 1-rank gloo group)."""
    out = tmp_path / "r3.json"
    assert r3.main(["--device", "cpu", "--smoke", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert errors(res) == []
    assert "RANK" not in os.environ
    for init in ("trainer", "hf"):
        phase = res[f"bf16/{init}"]
        for path in ("autocast", "fsdp"):
            check_row(phase[path], layers=2, sampled=phase["engine"]["sampled_tokens"])
    assert set(res["headline"]) == {"trainer/autocast", "trainer/fsdp", "hf/autocast", "hf/fsdp"}
    assert res["fp32_sanity"]["sanity_ok"] is True


def test_bad_arguments_name_the_flag() -> None:
    with pytest.raises(SystemExit):
        r3.parse_args(["--out", "x.json", "--prompt-min", "10", "--prompt-max", "5"])
    with pytest.raises(ValueError, match="--inits"):
        r3.build_trainer_model(r3.tiny_moe(), "nope", 0, r3.torch.device("cpu"))
