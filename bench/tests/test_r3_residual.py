"""bench/r3/replay.py `--residual fp32,bf16`: both residual streams (ModelConfig.fp32_residual) in one
process, each phase recording its setting and the setting the engine loaded from config.json, and
on CPU (no kernel differences) the engine and both trainer paths (autocast, FSDP2 on a 1-rank gloo
group: blocks take the float32 stream uncast) bitwise equal with replay, key on and off.

"No kernel differences" needs ATen's scalar CPU kernels: on a CPU with AVX-512 BF16 / AMX, torch's
vectorised bf16 kernels round a few decode-step tokens differently from the trainer's full-sequence
pass (8 of 72 sampled tokens, log-ratio up to 9e-4, seen on such a machine; equal on the scalar
kernels), so the bench runs in a child process with ATEN_CPU_CAPABILITY=default (read at start)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPLAY = Path(__file__).resolve().parents[2] / "bench" / "r3" / "replay.py"
_spec = importlib.util.spec_from_file_location("bench_r3_replay_residual", REPLAY)
assert _spec is not None and _spec.loader is not None
r3 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(r3)


def test_residual_both_settings_in_one_process(tmp_path: Path) -> None:
    out = tmp_path / "r3.json"
    argv = ["--device", "cpu", "--smoke", "--inits", "hf", "--residual", "fp32,bf16", "--no-sanity"]
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default"}
    proc = subprocess.run(
        [sys.executable, str(REPLAY), *argv, "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(out.read_text())
    assert set(res["headline"]) == {
        "hf/autocast",
        "hf/fsdp",
        "hf/autocast/bf16_residual",
        "hf/fsdp/bf16_residual",
    }
    for name, fp32 in (("bf16/hf", True), ("bf16/hf/bf16_residual", False)):
        phase = res[name]
        assert phase["fp32_residual"] is fp32 and phase["engine"]["engine_fp32_residual"] is fp32, name
        for path in ("autocast", "fsdp"):
            row = phase[path]
            assert "error" not in row, row.get("error")
            on = row["replay_on"]
            assert on["routing_agreement_mean"] == 1.0
            assert on["mismatch_kl_k3"] == 0.0 and on["log_ratio_abs_max"] == 0.0, (name, path, on)
    for key, row in res["headline"].items():
        assert row["fp32_residual"] is (not key.endswith("/bf16_residual")), key


def test_bad_residual_names_the_flag() -> None:
    with pytest.raises(SystemExit):
        r3.parse_args(["--out", "x.json", "--residual", "fp16"])
