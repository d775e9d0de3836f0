"""The system benchmark's report, computed only from what a run wrote: RUN_DIR/metrics.jsonl (one
record per trainer step), summary.json (the rollout ledger), config.json, the services' JSON logs
(logs/*.log) and the Prometheus text of decode's and the orchestrator's /metrics, scraped by
bench/system/run.py at the start and the end of the measured window (bench_window.json).

The measured window starts when the orchestrator starts producing rollouts ("orchestrator
running" in its log) and lasts `window_s`; a trainer step belongs to it when its metrics record
was written inside it.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

HOUR_S = 3600.0


# ------------------------------------------------------------------ reading a run's files


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def log_events(path: Path, msg: str) -> list[dict[str, Any]]:
    """The JSON log records of one service with this message (other lines, e.g. the supervisor's
    or a traceback, are skipped)."""
    out = []
    if not path.exists():
        return out
    for line in path.read_text(errors="replace").splitlines():
        if not line.startswith("{"):
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if rec.get("msg") == msg:
            out.append(rec)
    return out


def prom_samples(text: str) -> dict[str, float]:
    """Prometheus exposition text -> {sample name with sorted labels: value}."""
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = float(s.value)
    return out


def prom_delta(before: str, after: str) -> dict[str, float]:
    """after - before for every sample of `after` (a sample new in `after` counts from 0)."""
    b, a = prom_samples(before), prom_samples(after)
    return {k: v - b.get(k, 0.0) for k, v in a.items()}


def _summary(values: Iterable[float]) -> dict[str, float] | None:
    vals = sorted(values)
    if not vals:
        return None
    return {
        "n": len(vals),
        "mean": statistics.fmean(vals),
        "median": statistics.median(vals),
        "max": vals[-1],
    }


# ------------------------------------------------------------------ one run


def window_steps(metrics: list[dict[str, Any]], t0: float, t1: float) -> list[dict[str, Any]]:
    return [m for m in metrics if t0 < m["time"] <= t1]


def throughput(steps: list[dict[str, Any]], window_s: float) -> dict[str, Any]:
    tokens = sum(m["tokens"] for m in steps)
    loss_tokens = sum(m.get("loss_tokens", 0) for m in steps)
    samples = sum(m["samples"] for m in steps)
    return {
        "steps": len(steps),
        "groups": sum(m["groups"] for m in steps),
        "samples": samples,
        "tokens": tokens,
        "loss_tokens": loss_tokens,
        "tokens_per_hour": tokens / window_s * HOUR_S,
        "loss_tokens_per_hour": loss_tokens / window_s * HOUR_S,
        "steps_per_hour": len(steps) / window_s * HOUR_S,
        "sample_tokens_mean": tokens / samples if samples else None,
        "sample_tokens_max": max((m.get("sample_tokens_max", 0) for m in steps), default=0),
        "groups_dropped_stale": sum(m["dropped_stale"] for m in steps),
    }


def trainer_time(steps: list[dict[str, Any]], window_s: float) -> dict[str, Any]:
    """Where the trainer's time went: computing (step_s), blocked on publishing (publish_s: the
    gather into host memory and waiting for the previous version's write) and waiting for data."""
    compute = sum(m["step_s"] for m in steps)
    publish = sum(m["publish_s"] for m in steps)
    wait = sum(m["wait_data_s"] for m in steps)
    tokens = sum(m["tokens"] for m in steps)
    return {
        "busy_share": min(1.0, (compute + publish) / window_s),
        "compute_share": compute / window_s,
        "publish_blocked_share": publish / window_s,
        "wait_data_share": wait / window_s,
        "compute_tokens_per_s": tokens / compute if compute > 0 else None,
        "step_period_s": _summary(m["wait_data_s"] + m["step_s"] + m["publish_s"] for m in steps),
        "step_s": _summary(m["step_s"] for m in steps),
        "wait_data_s": _summary(m["wait_data_s"] for m in steps),
    }


def decode_time(scrapes: dict[str, Any]) -> dict[str, Any]:
    """Decode's share of the window with work (engine steps) and idle, from the deltas of its
    Prometheus counters over the scrape interval, summed over replicas."""
    dt = scrapes["t1"] - scrapes["t0"]
    tot: dict[str, float] = {}
    for pair in scrapes["decode"].values():
        for k, v in prom_delta(pair["t0"], pair["t1"]).items():
            tot[k] = tot.get(k, 0.0) + v
    replicas = max(1, len(scrapes["decode"]))
    steps = tot.get("relay_decode_steps_total", 0.0)
    step_s = tot.get("relay_decode_step_seconds_total", 0.0)
    generated = tot.get("relay_decode_generated_tokens_total", 0.0)
    return {
        "scrape_s": dt,
        "replicas": replicas,
        "busy_share": min(1.0, step_s / (dt * replicas)),
        "idle_share": tot.get("relay_decode_idle_seconds_total", 0.0) / (dt * replicas),
        "generated_tokens_per_s": generated / dt,
        "prompt_tokens_per_s": tot.get("relay_decode_prompt_tokens_total", 0.0) / dt,
        "engine_steps": steps,
        "step_ms": 1e3 * step_s / steps if steps else None,
        "batch_mean": tot.get("relay_decode_batch_size_sum", 0.0) / steps if steps else None,
        "weight_updates": tot.get("relay_decode_weight_updates_total", 0.0),
        # The loop held by weight applies (with decode.engine.stage_weights: the swaps only), and
        # the staging's share beside it, off the loop.
        "weights_held_share": tot.get("relay_decode_weight_apply_seconds_total", 0.0) / (dt * replicas),
        "weights_staging_share": tot.get("relay_decode_weight_stage_seconds_total", 0.0) / (dt * replicas),
        "preemptions": tot.get("relay_decode_preemptions_total", 0.0),
    }


def orchestrator_counts(scrapes: dict[str, Any]) -> dict[str, Any]:
    """Samples finished by finish_reason and groups dropped by reason inside the scrape interval."""
    pair = scrapes.get("orchestrator")
    if not pair:
        return {}
    d = prom_delta(pair["t0"], pair["t1"])
    finish: dict[str, float] = {}
    dropped: dict[str, float] = {}
    for k, v in d.items():
        if k.startswith("relay_orchestrator_samples_total{") and v:
            reason = k.split("finish_reason=")[1].split(",")[0].rstrip("}")
            finish[reason] = finish.get(reason, 0.0) + v
        elif k.startswith("relay_orchestrator_groups_dropped_total{") and v:
            dropped[k.split("reason=")[1].rstrip("}")] = v
    groups = sum(v for k, v in d.items() if k.startswith("relay_orchestrator_groups_total{"))
    return {"groups_pushed": groups, "samples_by_finish_reason": finish, "groups_dropped_by_reason": dropped}


def staleness(steps: list[dict[str, Any]], bound: int) -> dict[str, Any]:
    hist: list[int] = []
    for m in steps:
        for s, n in enumerate(m.get("staleness_groups", [])):
            hist += [0] * (s + 1 - len(hist))
            hist[s] += n
    groups = sum(hist)
    return {
        "bound": bound,
        "groups_by_staleness": hist,
        "mean": sum(s * n for s, n in enumerate(hist)) / groups if groups else None,
        "max": max((m["staleness_max"] for m in steps), default=0),
        "within_bound": all(m["staleness_max"] <= bound for m in steps),
    }


def mismatch(metrics: list[dict[str, Any]]) -> dict[str, Any]:
    """Mismatch KL per step (every step of the run: the replay-off segment is by step number),
    and its mean with Router Replay on and off (routing_replayed_frac > 0 vs 0)."""
    per_step = [
        {
            "step": m["step"],
            "kl_k3": m["mismatch_kl_k3"],
            "kl_k3_on_policy": m.get("mismatch_kl_k3_on_policy"),
            "replayed_frac": m.get("routing_replayed_frac"),
            "routing_agreement": m.get("routing_agreement_mean"),
        }
        for m in metrics
    ]

    def seg(on: bool) -> dict[str, Any]:
        rows = [r for r in per_step if r["replayed_frac"] is not None and (r["replayed_frac"] > 0) == on]
        on_pol = [r["kl_k3_on_policy"] for r in rows if r["kl_k3_on_policy"] is not None]
        agree = [r["routing_agreement"] for r in rows if r["routing_agreement"] is not None]
        return {
            "steps": len(rows),
            "kl_k3_mean": statistics.fmean(r["kl_k3"] for r in rows) if rows else None,
            "kl_k3_on_policy_mean": statistics.fmean(on_pol) if on_pol else None,
            "routing_agreement_mean": statistics.fmean(agree) if agree else None,
        }

    return {"replay_on": seg(True), "replay_off": seg(False), "per_step": per_step}


def publish_apply(run_dir: Path, t0: float, t1: float) -> dict[str, Any]:
    """Per published version inside the window: the trainer's gather and background write
    (trainer.log "weights written") and the roll-out to decode (orchestrator.log "weights rolled
    out": every decode read the directory and swapped it in)."""
    logs = run_dir / "logs"
    written = [e for e in log_events(logs / "trainer.log", "weights written") if t0 < e["ts"] <= t1]
    rolled = [e for e in log_events(logs / "orchestrator.log", "weights rolled out") if t0 < e["ts"] <= t1]
    pub = [e["gather_s"] + e["write_s"] for e in written]
    return {
        "versions_written": len(written),
        "versions_applied": len(rolled),
        "publish_s": _summary(pub),  # gather + write: from the step's end to weights:latest
        "gather_s": _summary(e["gather_s"] for e in written),
        "write_s": _summary(e["write_s"] for e in written),
        "apply_s": _summary(e["s"] for e in rolled),
        "bytes": written[-1]["bytes"] if written else None,
    }


def memory(run_dir: Path) -> dict[str, Any]:
    logs = run_dir / "logs"
    ready = log_events(logs / "decode.0.log", "engine ready")
    exits = log_events(logs / "trainer.log", "trainer exit")
    keys = ("cuda_memory_gib", "cuda_allocated_gib", "cuda_reserved_gib", "cuda_peak_gib", "kv_blocks")
    return {
        "decode_at_start": {k: ready[-1][k] for k in keys if ready and k in ready[-1]},
        "trainer_at_exit": {k: exits[-1][k] for k in keys if exits and k in exits[-1]},
    }


def reward_curve(steps: list[dict[str, Any]], t0: float) -> dict[str, Any]:
    rewards = [m["reward"] for m in steps]
    return {
        "first10": statistics.fmean(rewards[:10]) if rewards else None,
        "last10": statistics.fmean(rewards[-10:]) if rewards else None,
        "per_step": [[m["step"], round(m["time"] - t0, 3), m["reward"]] for m in steps],
    }


def run_report(run_dir: Path) -> dict[str, Any]:
    """Everything for one run, from its directory."""
    run_dir = Path(run_dir)
    win = json.loads((run_dir / "bench_window.json").read_text())
    cfg = json.loads((run_dir / "config.json").read_text())
    summary = (
        json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
    )
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    t0, t1 = win["t0"], win["t1"]
    window_s = t1 - t0
    steps = window_steps(metrics, t0, t1)
    bound = cfg["orchestrator"]["max_off_policy_steps"]
    ledger = summary.get("ledger", {})
    return {
        "mode": win["mode"],
        "run_dir": str(run_dir),
        "max_off_policy_steps": bound,
        "window_s": window_s,
        "startup_s": t0 - win["launched"],
        "throughput": throughput(steps, window_s),
        "trainer": trainer_time(steps, window_s),
        "decode": decode_time(win["scrapes"]),
        "orchestrator": orchestrator_counts(win["scrapes"]),
        "staleness": staleness(steps, bound),
        "mismatch": mismatch(metrics),
        "weights": publish_apply(run_dir, t0, t1),
        "memory": memory(run_dir),
        "rollouts": {
            k: ledger.get(k) for k in ("started", "trained", "dropped", "pending", "lost", "trained_twice")
        }
        | {"drop_reasons": ledger.get("drop_reasons", [])},
        "reward": reward_curve(steps, t0),
        "status": summary.get("status"),
        "steps_total": len(metrics),
    }


# ------------------------------------------------------------------ the comparison


def compare(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Asynchronous against synchronous: the throughput ratio, what sharing the GPU cost each side
    (its rate when the other had work too, against the synchronous run where they alternate), and
    the acceptance checks."""
    a, s = runs.get("async"), runs.get("sync")
    out: dict[str, Any] = {}
    if a is None or s is None:
        return out
    sync_rate = s["throughput"]["tokens_per_hour"]
    out["tokens_per_hour_ratio"] = a["throughput"]["tokens_per_hour"] / sync_rate if sync_rate else None
    ta, ts = a["trainer"]["compute_tokens_per_s"], s["trainer"]["compute_tokens_per_s"]
    out["trainer_compute_rate_async_vs_sync"] = ta / ts if ta and ts else None
    da, ds = a["decode"]["step_ms"], s["decode"]["step_ms"]
    out["decode_step_ms_async_vs_sync"] = da / ds if da and ds else None
    lost = [r["rollouts"]["lost"] for r in (a, s)]
    out["acceptance"] = {
        "ratio_at_least_2": bool(out["tokens_per_hour_ratio"] and out["tokens_per_hour_ratio"] >= 2.0),
        "nothing_lost": all(x == 0 for x in lost),
        "staleness_within_bound": a["staleness"]["within_bound"] and s["staleness"]["within_bound"],
    }
    return out


# ------------------------------------------------------------------ the table


def _fmt(v: Any, spec: str = ".3g") -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return format(v, spec)
    return str(v)


def table(runs: dict[str, dict[str, Any]], comparison: dict[str, Any]) -> str:
    modes = list(runs)
    rows: list[tuple[str, list[str]]] = []

    def row(name: str, get: Any, spec: str = ".3g") -> None:
        rows.append((name, [_fmt(get(runs[m]), spec) for m in modes]))

    row("max_off_policy_steps", lambda r: r["max_off_policy_steps"])
    row("window s (startup s)", lambda r: f"{r['window_s']:.0f} ({r['startup_s']:.0f})")
    row("trainer steps", lambda r: r["throughput"]["steps"])
    row("trained tokens / hour", lambda r: r["throughput"]["tokens_per_hour"], ".4g")
    row("  of them loss tokens / hour", lambda r: r["throughput"]["loss_tokens_per_hour"], ".4g")
    row(
        "sample tokens mean / max",
        lambda r: f"{_fmt(r['throughput']['sample_tokens_mean'])} / {r['throughput']['sample_tokens_max']}",
    )
    row("trainer busy share", lambda r: r["trainer"]["busy_share"], ".2f")
    row("  waiting for data", lambda r: r["trainer"]["wait_data_share"], ".2f")
    row("decode busy share", lambda r: r["decode"]["busy_share"], ".2f")
    row("  held by weight applies", lambda r: r["decode"]["weights_held_share"], ".2f")
    row("decode mean batch", lambda r: r["decode"]["batch_mean"])
    row("staleness groups [0,1,..]", lambda r: r["staleness"]["groups_by_staleness"])
    row("staleness mean / max", lambda r: f"{_fmt(r['staleness']['mean'], '.2f')} / {r['staleness']['max']}")
    row("mismatch KL replay on", lambda r: r["mismatch"]["replay_on"]["kl_k3_mean"])
    row("mismatch KL replay off", lambda r: r["mismatch"]["replay_off"]["kl_k3_mean"])
    row("  on-policy samples, on", lambda r: r["mismatch"]["replay_on"]["kl_k3_on_policy_mean"])
    row("  on-policy samples, off", lambda r: r["mismatch"]["replay_off"]["kl_k3_on_policy_mean"])
    row("publish s (median)", lambda r: (r["weights"]["publish_s"] or {}).get("median"))
    row("apply s (median)", lambda r: (r["weights"]["apply_s"] or {}).get("median"))
    row("groups dropped stale (window)", lambda r: r["throughput"]["groups_dropped_stale"])
    row(
        "rollouts start/train/drop/lost",
        lambda r: "/".join(_fmt(r["rollouts"][k]) for k in ("started", "trained", "dropped", "lost")),
    )
    row(
        "reward first10 -> last10",
        lambda r: f"{_fmt(r['reward']['first10'])} -> {_fmt(r['reward']['last10'])}",
    )
    w = max(len(n) for n, _ in rows)
    cw = max([12, *(len(v) for _, vals in rows for v in vals)])
    lines = [f"{'':<{w}}  " + "  ".join(f"{m:>{cw}}" for m in modes)]
    lines += [f"{n:<{w}}  " + "  ".join(f"{v:>{cw}}" for v in vals) for n, vals in rows]
    if comparison:
        ratio = comparison.get("tokens_per_hour_ratio")
        lines.append(
            f"async / sync trained tokens per hour: {_fmt(ratio)}  acceptance: {comparison['acceptance']}"
        )
    return "\n".join(lines)
