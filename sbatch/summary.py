"""Per-step console lines and the end-of-run summary (also written to RUN_DIR/summary.json)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from sbatch.files import write_atomic
from services.common.bus import Bus
from services.common.config import RunConfig
from services.common.schemas import RolloutGroup
from services.common.versions import version_span


class StepLine:
    def __init__(self, cfg: RunConfig):
        self.envs = [t.env for t in cfg.orchestrator.tasks]
        self.w = max([10, *(len(e) for e in self.envs)])

    def header(self) -> str:
        envs = " ".join(f"{e:>{self.w}}" for e in self.envs)
        return f"{'step':>5} {'reward':>6} {envs} {'stale':>5} {'tok/s':>7} {'wait_s':>6} {'idle_s':>6} {'entropy':>7}"

    def format(self, r: dict[str, Any]) -> str:
        by_env = r.get("reward_by_env", {})
        envs = " ".join(f"{by_env[e]:>{self.w}.3f}" if e in by_env else f"{'-':>{self.w}}" for e in self.envs)
        return (
            f"{r['step']:>5} {r['reward']:>6.3f} {envs} {r['staleness_mean']:>5.2f} {r['tokens_per_s']:>7.0f} "
            f"{r['wait_data_s']:>6.2f} {r.get('decode_idle_s', 0.0):>6.1f} {r['entropy']:>7.3f}"
        )


def print_summary(console: Console, s: dict[str, Any]) -> None:
    """The end-of-run table and totals (also what `make status` shows for a finished run)."""
    t = Table(title=f"relay run {s['run']} — {s['steps']} steps in {s['wall_s']:.0f}s ({s['status']})")
    for col in ("task", "first 10", "last 10", "best 10", "target", "steps to target", "met"):
        t.add_column(col)
    for env, e in s["tasks"].items():
        hit = e["steps_to_target"]
        t.add_row(
            env,
            f"{e['first10']:.3f}",
            f"{e['last10']:.3f}",
            f"{e['best10']:.3f}",
            f"{e['target']:.2f}",
            "not reached" if hit is None else str(hit),
            "[green]yes[/]" if e["met"] else "[red]no[/]",
        )
    console.print(t)
    led = s["ledger"]
    console.print(
        f"groups started {led['started']}, trained {led['trained']}, dropped {led['dropped']}, "
        f"pending {led['pending']}, lost {led['lost']}, trained twice {led['trained_twice']}; "
        f"staleness mean {s['staleness_mean']:.2f} max {s['staleness_max']}; "
        f"trainer waited {s['trainer_wait_s']:.1f}s, decode idle {s['decode_idle_s']:.1f}s; "
        f"weight versions served {version_span(s['versions_served'])}"
    )
    console.print(f"metrics: {s['run_dir']}/metrics.jsonl  summary: {s['run_dir']}/summary.json")


def write_summary(run_dir: Path, summary: dict[str, Any], console: Console | None = None) -> bool:
    """RUN_DIR/summary.json, atomically: a reader (or a full disk) never finds it empty or cut
    short. If it cannot be written, the summary goes to the console instead."""
    text = json.dumps(summary, indent=2)
    try:
        write_atomic(run_dir / "summary.json", text)
        return True
    except OSError as e:
        if console is not None:
            console.print(f"[red]could not write {run_dir}/summary.json ({e}); the summary:[/]")
            console.print(text, soft_wrap=True)
        return False


def _window_means(vals: list[float], w: int = 10) -> list[float]:
    return [
        sum(vals[max(0, i - w + 1) : i + 1]) / len(vals[max(0, i - w + 1) : i + 1]) for i in range(len(vals))
    ]


def ledger_report(bus: Bus) -> dict[str, Any]:
    """started = trained + dropped + pending, with lost = started groups in none of those."""
    led = bus.ledger()
    started: set[str] = led["started"]  # type: ignore[assignment]
    trained: dict[str, int] = led["trained"]  # type: ignore[assignment]
    dropped: dict[str, str] = led["dropped"]  # type: ignore[assignment]
    inflight = set(bus.r.hkeys(bus.k.inflight))
    queued: set[str] = set()
    if bus.r.exists(bus.k.rollouts):
        for _eid, fields in bus.r.xrange(bus.k.rollouts):
            queued.add(RolloutGroup.model_validate_json(fields["group"]).group_id)
    done = set(trained) | set(dropped)
    pending = (inflight | queued) - done
    return {
        "started": len(started),
        "trained": len(trained),
        "dropped": len(dropped),
        "pending": len(pending & started),
        "lost": len(started - done - pending),
        "trained_twice": sum(1 for c in trained.values() if c > 1),
        "trained_and_dropped": len(set(trained) & set(dropped)),
        "drop_reasons": sorted({r.split(":")[0] for r in dropped.values()}),
    }


def versions_served(bus: Bus) -> list[int]:
    versions: set[int] = set()
    for key in bus.r.scan_iter(match=bus.k.rollouts_pattern, count=1000):
        raw = bus.r.get(key)
        if raw:
            for s in RolloutGroup.model_validate_json(raw).samples:
                versions.update(v for v in s.versions if v >= 0)
    return sorted(versions)


def read_metrics_after(path: Path, seen: int) -> list[dict[str, Any]]:
    """Records of metrics.jsonl after its first `seen` lines. Re-read whole and counted in lines:
    a restarted orchestrator rewrites the file (lines may change length), so a byte offset kept
    across that would land mid-line. A line still being written ends the read."""
    try:
        lines = path.read_text().split("\n")[:-1]  # the last element is "" or a partial line
    except FileNotFoundError:
        return []
    out = []
    for raw in lines[seen:]:
        try:
            out.append(json.loads(raw))
        except json.JSONDecodeError:
            break
    return out


def summarize(cfg: RunConfig, run_dir: Path, bus: Bus, wall_s: float, code: int) -> dict[str, Any]:
    path = run_dir / "metrics.jsonl"
    hist = read_metrics_after(path, 0)
    tasks: dict[str, Any] = {}
    for t in cfg.orchestrator.tasks:
        series = [h["reward_by_env"][t.env] for h in hist if t.env in h.get("reward_by_env", {})]
        steps = [h["step"] for h in hist if t.env in h.get("reward_by_env", {})]
        means = _window_means(series)
        hit = next((steps[i] for i, m in enumerate(means) if i >= 9 and m >= t.target), None)
        tasks[t.env] = {
            "first10": sum(series[:10]) / max(1, len(series[:10])),
            "last10": sum(series[-10:]) / max(1, len(series[-10:])),
            "best10": max(means[9:] or means or [0.0]),
            "target": t.target,
            "steps_to_target": hit,
            "met": hit is not None,
        }
    status = {0: "completed", 124: "timed out", 130: "stopped"}.get(code, f"failed ({code})")
    return {
        "run": cfg.run.name,
        "run_dir": str(run_dir),
        "status": status,
        "steps": hist[-1]["step"] if hist else 0,
        "wall_s": wall_s,
        "tasks": tasks,
        "staleness_mean": sum(h["staleness_mean"] for h in hist) / max(1, len(hist)),
        "staleness_max": max((h["staleness_max"] for h in hist), default=0),
        "trainer_wait_s": sum(h["wait_data_s"] for h in hist),
        "decode_idle_s": hist[-1].get("decode_idle_s", 0.0) if hist else 0.0,
        "tokens_per_s_mean": sum(h["tokens_per_s"] for h in hist) / max(1, len(hist)),
        "max_off_policy_steps": cfg.orchestrator.max_off_policy_steps,
        "ledger": ledger_report(bus),
        "versions_served": versions_served(bus),
    }
