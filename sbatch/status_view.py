"""`make status` on one screen: a running run's progress, loop health and services (from the
orchestrator's /v1/status and the supervisors' states), or a finished run's summary table."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from services.common.versions import version_span


def _num(v: Any, fmt: str = ".3f", none: str = "-") -> str:
    return none if v is None else format(v, fmt)


def _rewards(by_env: dict[str, float | None]) -> str:
    return ", ".join(f"{e} {_num(v)}" for e, v in by_env.items()) or "-"


def print_running(
    console: Console,
    run: str,
    status: dict[str, Any],
    dashboard: str,
    health: list[dict[str, Any]],
) -> None:
    state = "running"
    if status.get("paused"):
        why = f": {status['paused_reason']}" if status.get("paused_reason") else ""
        state = f"[yellow]paused{why}[/]"
    console.print(
        f"run [cyan]{run}[/]: step {status['step']}/{status['max_steps']}, "
        f"policy v{status['policy_version']}, {state}"
    )
    console.print(f"dashboard  {dashboard}")
    by_env = status.get("last_reward_by_env") or {}
    console.print(
        f"reward     {_num(status.get('last_reward'))} at the last step ({_rewards(by_env)}); "
        f"recent rollouts: {_rewards(status.get('recent_rollout_reward') or {})}"
    )
    console.print(
        f"groups     started {status['groups_started']}, in flight {status['inflight_groups']}, "
        f"queued {status['queue_depth']}, dropped {status['groups_dropped']}"
    )
    console.print(
        f"loop       staleness {_num(status.get('staleness_mean'), '.2f')}, "
        f"trainer wait {_num(status.get('trainer_wait_s'), '.2f')} s, "
        f"decode idle {_num(status.get('decode_idle_s'), '.1f')} s, "
        f"paused {_num(status.get('paused_s'), '.0f', '0')} s"
    )
    served = [v for a, b in status.get("versions_served", []) for v in range(a, b + 1)]
    console.print(f"versions   served {version_span(served)}")
    print_services(console, health)


def print_services(console: Console, rows: list[dict[str, Any]]) -> None:
    """The health rows (services/common/health.py) as one table."""
    t = Table(box=None, pad_edge=False, show_edge=False)
    for col in ("service", "state", "restarts", "up", "url", "version", "pid"):
        t.add_column(col)
    for h in rows:
        last = "" if h["last_exit"] is None else f" (last exit {h['last_exit']})"
        t.add_row(
            h["name"],
            h["state"] if h["ok"] else f"[yellow]{h['state']}[/]",
            "-" if h["restarts"] is None else f"{h['restarts']}{last}",
            "-" if h["up_s"] is None else f"{h['up_s']:.0f}s",
            h["url"] or "-",
            "-" if h["version"] is None else f"v{h['version']}",
            str(h["pid"] or "-"),
        )
    console.print(t)
