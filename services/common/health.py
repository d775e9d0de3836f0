"""The run's services at a glance: each supervised process (state, restarts, uptime, last exit)
joined with its registry entry (URL, weight version), then registered services that have no
supervisor. What `make status`, GET /v1/status (`health`) and the dashboard's table show."""

from __future__ import annotations

import time
from typing import Any

from services.common.schemas import ServiceInfo


def health_rows(
    services: list[ServiceInfo], supervisors: list[dict[str, Any]], now: float | None = None
) -> list[dict[str, Any]]:
    now = time.time() if now is None else now
    by_pid = {(s.host, s.pid): s for s in services}
    rows = []
    for sup in supervisors:
        reg = by_pid.pop((sup.get("host"), sup.get("child_pid")), None)
        running = sup["state"] == "running"
        started = sup.get("child_started")
        rows.append(
            {
                "name": sup["name"],
                "state": sup["state"],
                "ok": running,
                "restarts": sup.get("restarts", 0),
                "last_exit": sup.get("last_exit"),
                "last_reason": sup.get("last_reason", ""),
                "up_s": round(now - started, 1) if running and started else None,
                "url": reg.url if reg else None,
                "version": reg.version if reg and reg.version >= 0 else None,
                "host": sup.get("host", ""),
                "pid": sup.get("child_pid"),
            }
        )
    for reg in by_pid.values():  # registered without a supervisor (started by hand, tests)
        rows.append(
            {
                "name": reg.kind,
                "state": "registered",
                "ok": True,
                "restarts": None,
                "last_exit": None,
                "last_reason": "",
                "up_s": round(now - reg.started, 1),
                "url": reg.url,
                "version": reg.version if reg.version >= 0 else None,
                "host": reg.host,
                "pid": reg.pid,
            }
        )
    return rows
