"""bench/models/run.py (GLM-5 and Nemotron-3 on one GPU) runs end to end on CPU in smoke mode, in
its own process: real engines and trainers at tiny shapes; the JSON's structure and numbers."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench.results import errors

REPO = Path(__file__).resolve().parents[2]
PHASES = {
    "environment",
    "mismatch/glm5",
    "decode/glm5",
    "mismatch/nemotron3",
    "decode/nemotron3",
    "mfu/glm5",
    "fp32_sanity/glm5",
    "fp32_sanity/nemotron3",
}


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("models") / "models.json"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "models" / "run.py"), "--smoke", "--out", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_report_records_run_and_every_phase_without_error(result: dict[str, Any]) -> None:
    for key in ("command", "date", "machine", "device", "args", "goals", "baselines", "summary", "total_s"):
        assert key in result
    assert "--smoke" in result["command"]
    assert set(result["phases"]) == PHASES
    assert errors(result) == []
    assert result["goals"] == {
        "mismatch_kl_max": 1e-3,
        "replay_ratio_min": 5.0,
        "mfu_min": 0.35,
        "roofline_fraction_min": 0.5,
    }
    env = result["phases"]["environment"]
    assert env["peak_bf16_flops"] is None and env["bandwidth_bytes_s"] > 0  # CPU: no MFU


@pytest.mark.parametrize("shape", ["glm5", "nemotron3"])
def test_mismatch_replay_on_below_off(result: dict[str, Any], shape: str) -> None:
    row = result["phases"][f"mismatch/{shape}"]
    eng = row["engine"]
    assert eng["engine_dtype"] == "bfloat16" and row["publish_dtype"] == "torch.bfloat16"
    assert eng["sampled_tokens"] == eng["prompts"] * row["new_tokens_per_prompt"]
    assert row["model"]["arch"] == ("glm_moe_dsa" if shape == "glm5" else "nemotron_h")
    if shape == "glm5":  # every sampled token sees more keys than the indexer keeps: sparse
        assert row["prompt_tokens_range"][0] >= row["model"]["index_topk"]
    r = row["autocast"]
    off, on = r["replay_off"], r["replay_on"]
    for x in (off, on):
        assert x["tokens"] == eng["sampled_tokens"]
        assert math.isfinite(x["mismatch_kl_k3"]) and x["mismatch_kl_k3"] >= 0
        # not one-hot distributions: the KL would be trivially zero
        assert x["train_entropy_mean"] > 1.0
    assert off["routing_replayed_frac"] == 0.0 and on["routing_replayed_frac"] == 1.0
    assert 0 < on["mismatch_kl_k3"] < off["mismatch_kl_k3"]
    assert r["kl_ratio_off_on"] == pytest.approx(off["mismatch_kl_k3"] / on["mismatch_kl_k3"])
    assert off["routing_agreement_mean"] < 1.0  # bf16 flips some expert sets without replay
    s = result["summary"][shape]
    assert s["kl_replay_on"] == on["mismatch_kl_k3"] and s["kl_replay_off"] == off["mismatch_kl_k3"]
    assert s["kl_on_below_goal"] == (on["mismatch_kl_k3"] < 1e-3)
    assert s["replay_ratio_goal_met"] == (r["kl_ratio_off_on"] >= 5.0)


@pytest.mark.parametrize("shape", ["glm5", "nemotron3"])
def test_decode_counts_its_bytes(result: dict[str, Any], shape: str) -> None:
    d = result["phases"][f"decode/{shape}"]
    wl = d["workload"]
    assert d["complete"] and d["w1"]["output_tokens"] == wl["prompts"] * wl["new_tokens"]
    b, roof = d["bytes"], d["roofline"]
    # CPU: no memory plan limits the engine's batch, so one wave of every prompt
    assert wl["engine_batch"] == wl["prompts"] and roof["waves"] == 1
    assert b["weight_bytes"] > 0 and b["kv_bytes_per_token"] > 0
    assert 0 < b["experts_touched_fraction"] <= 1
    # Mamba-2 states for Nemotron only
    assert (b["state_bytes_per_seq"] > 0) == (shape == "nemotron3")
    assert roof["weight_bytes"] == b["weight_bytes"] and roof["bandwidth_bytes_s"] > 0
    # the roofline's time is the bytes of every decode step over the bandwidth
    n, t = wl["prompts"], wl["new_tokens"]
    assert (
        roof["decode_time_s"]
        >= t * (b["weight_bytes"] + n * b["state_bytes_per_seq"]) / roof["bandwidth_bytes_s"] - 1e-3
    )
    assert d["fraction_of_roofline"] == pytest.approx(
        d["w1"]["output_tok_s"] / roof["tok_s"], rel=1e-3, abs=1e-4
    )


def test_mfu_step_and_flop_count(result: dict[str, Any]) -> None:
    r = result["phases"]["mfu/glm5"]
    m = r["model"]
    assert m["arch"] == "glm_moe_dsa" and r["row_tokens"] <= m["index_topk"]
    assert r["tokens_per_step"] == r["rows"] * r["row_tokens"]
    assert len(r["step_times_s"]) == result["args"]["mfu_steps"] and r["step_s"] > 0
    assert all(math.isfinite(x) for x in r["losses"])
    f = r["flops"]
    # 6 N T plus causal attention; the head is part of N
    assert f["linear_flops"] == 6 * f["matmul_params_per_token"] * r["tokens_per_step"]
    assert f["total_flops"] == pytest.approx(f["linear_flops"] + f["attention_flops"])
    assert 0 < f["lm_head_share"] < 1
    assert f["matmul_params_per_token"] < r["params"]["active"]  # no input embedding, norms, indexer
    assert r["mfu"] is None  # CPU: no peak
    assert r["memory_plan"]["planned_gib"] > 0


@pytest.mark.parametrize("shape", ["glm5", "nemotron3"])
def test_fp32_sanity_row_is_exact(result: dict[str, Any], shape: str) -> None:
    r = result["phases"][f"fp32_sanity/{shape}"]
    assert r["engine"]["engine_dtype"] == "float32" and r["sanity_ok"]
    on = r["replay_on"]
    assert all(a == 1.0 for a in on["routing_agreement"])
    assert on["mismatch_kl_k3"] < 1e-6 and on["log_ratio_abs_max"] < 1e-4
    assert result["summary"][shape]["fp32_sanity_ok"] is True
