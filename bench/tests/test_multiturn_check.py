"""bench/engine/multiturn_check.py runs end to end on CPU (--smoke, tiny MoE): multi-turn episodes
through the real engine as the orchestrator's Trajectory builds them, later turns hitting the
prefix cache, scored again by the engine from scratch and by the trainer's scoring path. On CPU
the three agree to float rounding at every turn; the JSON has the per-turn tables the GPU run
fills in."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "bench_multiturn_check", Path(__file__).resolve().parents[2] / "bench" / "engine" / "multiturn_check.py"
)
assert _spec is not None and _spec.loader is not None
mt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mt)

PAIRS = ("engine_vs_scratch", "engine_vs_trainer", "scratch_vs_trainer", "trainer_alone_vs_trainer")


def test_cpu_smoke_agrees_at_every_turn(tmp_path: Path) -> None:
    out = tmp_path / "multiturn.json"
    # peaked init: distributions far from flat, where a mismatch would show
    rc = mt.main(["--smoke", "--init", "peaked", "--device", "cpu", "--out", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    for key in ("command", "date", "machine", "baseline", "headline"):
        assert res[key]
    assert set(res["variants"]) == {"cache+bf16", "nocache+bf16"}
    turns = 4  # the smoke's --turns
    for name, v in res["variants"].items():
        assert "error" not in v, v.get("error")
        assert v["switches"]["cache"] is (name == "cache+bf16")
        # later turns extend earlier transcripts: with the cache on they reuse its pages
        assert (v["prefix_hit_tokens"] > 0) is v["switches"]["cache"]
        bt = v["by_turn"]
        assert set(bt) == {"all", "turn1", "turn2+", *map(str, range(1, turns + 1))}
        total = sum(bt[str(t)]["engine_vs_scratch"]["tokens"] for t in range(1, turns + 1))
        assert total == bt["all"]["engine_vs_scratch"]["tokens"] > 0
        assert (
            bt["turn1"]["engine_vs_trainer"]["tokens"] + bt["turn2+"]["engine_vs_trainer"]["tokens"] == total
        )
        # not flat: a uniform distribution over the vocabulary would hide any mismatch
        assert bt["all"]["engine_logp_mean"] > -math.log(res["model"]["vocab_size"]) + 1.0
        for part, row in bt.items():
            for pair in PAIRS:
                c = row[pair]
                assert c["tokens"] > 0
                assert 0.0 <= c["kl_k3"] < 1e-8, (name, part, pair, c)
                assert c["max_abs_dlogp"] < 1e-4, (name, part, pair, c)
        assert res["headline"]["kl_k3_and_max_abs_dlogp"][name]["turn2+"]["engine_vs_trainer"][0] < 1e-8
