"""`make status` on one screen: a running run's progress, loop health and services (from the
orchestrator's /v1/status and the supervisors' states), or a finished run's summary table."""

from __future__ import annotations

import time
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
    services: list[dict[str, Any]],
    supervisors: list[dict[str, Any]],
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
    print_services(console, services, supervisors)


def print_services(
    console: Console, services: list[dict[str, Any]], supervisors: list[dict[str, Any]]
) -> None:
    """One row per supervised process (state, restarts, uptime) with its registry entry (URL,
    weight version) when it has one; registered services without a supervisor follow."""
    t = Table(box=None, pad_edge=False, show_edge=False)
    for col in ("service", "state", "restarts", "up", "url", "version", "pid"):
        t.add_column(col)
    by_pid = {(s.get("host"), s.get("pid")): s for s in services}
    now = time.time()
    for sup in supervisors:
        reg = by_pid.pop((sup.get("host"), sup.get("child_pid")), None)
        running = sup["state"] == "running" and sup.get("child_started")
        up = f"{now - sup['child_started']:.0f}s" if running else "-"
        last = "" if sup.get("last_exit") is None else f" (last exit {sup['last_exit']})"
        t.add_row(
            sup["name"],
            sup["state"] if sup["state"] == "running" else f"[yellow]{sup['state']}[/]",
            f"{sup['restarts']}{last}",
            up,
            reg["url"] if reg else "-",
            f"v{reg['version']}" if reg and reg["version"] >= 0 else "-",
            str(sup.get("child_pid") or "-"),
        )
    for reg in by_pid.values():
        version = f"v{reg['version']}" if reg["version"] >= 0 else "-"
        t.add_row(reg["kind"], "registered", "-", "-", reg["url"], version, str(reg["pid"]))
    console.print(t)
