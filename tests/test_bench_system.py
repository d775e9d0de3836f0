"""bench/system/report.py's arithmetic on a run directory written in the runs' own formats:
metrics.jsonl records built with the trainer's TrainerStepMetrics, summary.json's ledger, the
services' JSON logs and decode's / the orchestrator's Prometheus text. Every expected number is
worked out by hand from the records below."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.system.report import compare, run_report, table
from services.common.config import RunConfig
from services.common.schemas import TrainerStepMetrics

T0 = 1_000_000.0


def step(n: int, at: float, tokens: int, wait: float, stale: list[int], replayed: float, kl: float) -> dict:
    return TrainerStepMetrics(
        step=n,
        version=n,
        groups=sum(stale),
        samples=16,
        tokens=tokens,
        loss_tokens=tokens * 3 // 10,
        sample_tokens_max=200 + n,
        loss=0.0,
        entropy=1.0,
        grad_norm=1.0,
        reward=0.1 * n,
        reward_by_env={"reverse-tools": 0.1 * n},
        staleness_mean=0.0,
        staleness_max=len(stale) - 1,
        staleness_groups=stale,
        masked_ratio_frac=0.0,
        dropped_stale=n % 2,
        wait_data_s=wait,
        step_s=2.0,
        publish_s=0.5,
        tokens_per_s=tokens / 2.0,
        mismatch_kl_k3=kl,
        mismatch_kl_k3_on_policy=kl / 10 if stale[0] else None,
        routing_replayed_frac=replayed,
        routing_agreement_mean=0.9,
        time=T0 + at,
    ).model_dump()


DECODE_T0 = """# TYPE relay_decode_steps counter
relay_decode_steps_total 100.0
# TYPE relay_decode_step_seconds counter
relay_decode_step_seconds_total 10.0
# TYPE relay_decode_idle_seconds counter
relay_decode_idle_seconds_total 1.0
# TYPE relay_decode_generated_tokens counter
relay_decode_generated_tokens_total 1000.0
# TYPE relay_decode_prompt_tokens counter
relay_decode_prompt_tokens_total 500.0
# TYPE relay_decode_weight_updates counter
relay_decode_weight_updates_total 3.0
# TYPE relay_decode_weight_apply_seconds counter
relay_decode_weight_apply_seconds_total 1.0
# TYPE relay_decode_weight_stage_seconds counter
relay_decode_weight_stage_seconds_total 0.0
# TYPE relay_decode_batch_size histogram
relay_decode_batch_size_bucket{le="+Inf"} 100.0
relay_decode_batch_size_count 100.0
relay_decode_batch_size_sum 1000.0
"""
DECODE_T1 = (
    DECODE_T0.replace("steps_total 100.0", "steps_total 300.0")
    .replace("step_seconds_total 10.0", "step_seconds_total 25.0")
    .replace("idle_seconds_total 1.0", "idle_seconds_total 4.0")
    .replace("generated_tokens_total 1000.0", "generated_tokens_total 9000.0")
    .replace("prompt_tokens_total 500.0", "prompt_tokens_total 2500.0")
    .replace("weight_updates_total 3.0", "weight_updates_total 7.0")
    .replace("weight_apply_seconds_total 1.0", "weight_apply_seconds_total 3.0")
    .replace("weight_stage_seconds_total 0.0", "weight_stage_seconds_total 4.0")
    .replace("batch_size_sum 1000.0", "batch_size_sum 9000.0")
)
ORCH_T0 = """# TYPE relay_orchestrator_samples_total counter
relay_orchestrator_samples_total{env="reverse-tools",finish_reason="done"} 10.0
relay_orchestrator_samples_total{env="reverse-tools",finish_reason="max_turns"} 0.0
# TYPE relay_orchestrator_groups_total counter
relay_orchestrator_groups_total{env="reverse-tools"} 2.0
"""
ORCH_T1 = (
    ORCH_T0.replace('finish_reason="done"} 10.0', 'finish_reason="done"} 58.0')
    + '# TYPE relay_orchestrator_groups_dropped_total counter\nrelay_orchestrator_groups_dropped_total{reason="error"} 1.0\n'
).replace(
    'relay_orchestrator_groups_total{env="reverse-tools"} 2.0',
    'relay_orchestrator_groups_total{env="reverse-tools"} 8.0',
)


def write_run(root: Path, mode: str, bound: int, tokens: list[int], lost: int = 0) -> Path:
    run_dir = root / mode
    (run_dir / "logs").mkdir(parents=True)
    cfg = RunConfig()
    cfg.orchestrator.max_off_policy_steps = bound
    (run_dir / "config.json").write_text(cfg.dump())
    # steps 1-3 inside the 20 s window, step 4 after it; step 3 trained with Router Replay off
    recs = [
        step(1, 5.0, tokens[0], 1.0, [4], 1.0, 0.01),
        step(2, 10.0, tokens[1], 2.0, [2, 2], 1.0, 0.03),
        step(3, 15.0, tokens[2], 3.0, [1, 2, 1], 0.0, 0.2),
        step(4, 25.0, 99_999, 1.0, [4], 1.0, 0.05),
    ]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    ledger = {"started": 40, "trained": 30, "dropped": 2, "pending": 8, "lost": lost, "trained_twice": 0}
    summary = {"status": "completed", "ledger": {**ledger, "drop_reasons": ["stale"]}}
    (run_dir / "summary.json").write_text(json.dumps(summary))
    trainer_log = [
        "supervisor: started trainer",  # not JSON: skipped
        {
            "ts": T0 + 4.0,
            "msg": "weights written",
            "version": 1,
            "gather_s": 0.2,
            "write_s": 1.0,
            "bytes": 10,
        },
        {
            "ts": T0 + 9.0,
            "msg": "weights written",
            "version": 2,
            "gather_s": 0.3,
            "write_s": 1.2,
            "bytes": 10,
        },
        {
            "ts": T0 + 24.0,
            "msg": "weights written",
            "version": 3,
            "gather_s": 9.0,
            "write_s": 9.0,
            "bytes": 10,
        },
        {"ts": T0 + 30.0, "msg": "trainer exit", "cuda_peak_gib": 30.5, "cuda_memory_gib": 48.0},
    ]
    orch_log = [
        {"ts": T0, "msg": "orchestrator running"},
        {"ts": T0 + 6.0, "msg": "weights rolled out", "version": 1, "s": 0.5},
        {"ts": T0 + 11.0, "msg": "weights rolled out", "version": 2, "s": 0.7},
    ]
    decode_log = [{"ts": T0 - 1, "msg": "engine ready", "kv_blocks": 4096, "cuda_allocated_gib": 5.25}]
    for name, lines in (("trainer", trainer_log), ("orchestrator", orch_log), ("decode.0", decode_log)):
        text = "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines)
        (run_dir / "logs" / f"{name}.log").write_text(text)
    window = {
        "mode": mode,
        "launched": T0 - 30.0,
        "t0": T0,
        "t1": T0 + 20.0,
        "scrapes": {
            "t0": T0 + 0.5,
            "t1": T0 + 20.5,
            "decode": {"decode:0": {"t0": DECODE_T0, "t1": DECODE_T1}},
            "orchestrator": {"t0": ORCH_T0, "t1": ORCH_T1},
        },
    }
    (run_dir / "bench_window.json").write_text(json.dumps(window))
    return run_dir


def test_one_run_report(tmp_path: Path) -> None:
    r = run_report(write_run(tmp_path, "async", 2, [1000, 1200, 1400]))
    assert r["mode"] == "async" and r["window_s"] == 20.0 and r["startup_s"] == 30.0
    t = r["throughput"]
    assert (t["steps"], t["tokens"], t["loss_tokens"], t["samples"], t["groups"]) == (3, 3600, 1080, 48, 12)
    assert t["tokens_per_hour"] == pytest.approx(3600 / 20 * 3600)  # 648,000
    assert t["loss_tokens_per_hour"] == pytest.approx(1080 / 20 * 3600)
    assert t["sample_tokens_mean"] == 75.0 and t["sample_tokens_max"] == 203
    assert t["groups_dropped_stale"] == 2  # steps 1 and 3
    tr = r["trainer"]
    assert tr["busy_share"] == pytest.approx((3 * 2.0 + 3 * 0.5) / 20)
    assert tr["wait_data_share"] == pytest.approx(6.0 / 20) and tr["compute_tokens_per_s"] == pytest.approx(
        600
    )
    assert tr["step_period_s"]["median"] == pytest.approx(2.0 + 2.5)
    d = r["decode"]
    assert (
        d["scrape_s"] == 20.0
        and d["busy_share"] == pytest.approx(15 / 20)
        and d["idle_share"] == pytest.approx(3 / 20)
    )
    assert d["generated_tokens_per_s"] == pytest.approx(400) and d["prompt_tokens_per_s"] == pytest.approx(
        100
    )
    assert (
        d["batch_mean"] == pytest.approx(40)
        and d["step_ms"] == pytest.approx(75)
        and d["weight_updates"] == 4
    )
    assert d["weights_held_share"] == pytest.approx(2 / 20) and d["weights_staging_share"] == pytest.approx(
        4 / 20
    )
    o = r["orchestrator"]
    assert o["samples_by_finish_reason"] == {"done": 48} and o["groups_dropped_by_reason"] == {"error": 1}
    assert o["groups_pushed"] == 6
    s = r["staleness"]
    assert s["groups_by_staleness"] == [7, 4, 1] and s["mean"] == pytest.approx(6 / 12)
    assert s["max"] == 2 and s["within_bound"] and s["bound"] == 2
    m = r["mismatch"]  # all four steps: the off segment is by step number, not by window
    assert m["replay_on"]["steps"] == 3 and m["replay_on"]["kl_k3_mean"] == pytest.approx(0.03)
    assert m["replay_off"]["steps"] == 1 and m["replay_off"]["kl_k3_mean"] == pytest.approx(0.2)
    assert m["replay_on"]["kl_k3_on_policy_mean"] == pytest.approx((0.001 + 0.003 + 0.005) / 3)
    assert m["replay_off"]["kl_k3_on_policy_mean"] == pytest.approx(0.02)
    w = r["weights"]
    assert w["versions_written"] == 2 and w["versions_applied"] == 2  # version 3 was after the window
    assert w["publish_s"]["median"] == pytest.approx((1.2 + 1.5) / 2) and w["publish_s"][
        "max"
    ] == pytest.approx(1.5)
    assert w["apply_s"]["median"] == pytest.approx(0.6) and w["bytes"] == 10
    assert r["memory"]["trainer_at_exit"] == {"cuda_memory_gib": 48.0, "cuda_peak_gib": 30.5}
    assert r["memory"]["decode_at_start"] == {"cuda_allocated_gib": 5.25, "kv_blocks": 4096}
    assert r["rollouts"] == {
        "started": 40, "trained": 30, "dropped": 2, "pending": 8, "lost": 0, "trained_twice": 0,
        "drop_reasons": ["stale"],
    }  # fmt: skip
    assert r["reward"]["first10"] == pytest.approx(0.2) and [p[:2] for p in r["reward"]["per_step"]] == [
        [1, 5.0],
        [2, 10.0],
        [3, 15.0],
    ]


def test_comparison_and_table(tmp_path: Path) -> None:
    runs = {
        "async": run_report(write_run(tmp_path, "async", 2, [1000, 1200, 1400])),
        "sync": run_report(write_run(tmp_path, "sync", 2, [300, 400, 500])),
    }
    c = compare(runs)
    assert c["tokens_per_hour_ratio"] == pytest.approx(3600 / 1200)
    assert c["trainer_compute_rate_async_vs_sync"] == pytest.approx(600 / 200)
    assert c["decode_step_ms_async_vs_sync"] == pytest.approx(1.0)
    assert c["acceptance"] == {"ratio_at_least_2": True, "nothing_lost": True, "staleness_within_bound": True}
    text = table(runs, c)
    assert (
        "trained tokens / hour" in text
        and "6.48e+05" in text
        and "async / sync trained tokens per hour: 3" in text
    )

    runs["sync"] = run_report(write_run(tmp_path / "b", "sync", 1, [1000, 1000, 1000], lost=1))
    c = compare(runs)  # step 3's staleness 2 is over the sync run's bound of 1; a group was lost
    assert c["tokens_per_hour_ratio"] == pytest.approx(1.2)
    assert c["acceptance"] == {
        "ratio_at_least_2": False,
        "nothing_lost": False,
        "staleness_within_bound": False,
    }
    assert compare({"async": runs["async"]}) == {}
