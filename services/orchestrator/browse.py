"""The rollout browser's queries: recent groups from the rollout log (bus.rollout_log), each
with its fate from the ledger, filtered and paged newest first, and one group's transcript."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from services.common.bus import Bus
from services.common.schemas import RolloutFate, RolloutLogEntry

# Log entries read per round trip, and at most per request: a rare filter (one task's dropped
# groups, an old version range) returns a partial page and a cursor to go on from.
SCAN_CHUNK = 200
SCAN_MAX = 5000


class RolloutQuery(BaseModel):
    """GET /v1/rollouts query parameters (a 422 names the bad one)."""

    model_config = ConfigDict(extra="forbid")

    task: str | None = Field(None, description="only this task (env name)")
    status: Literal["trained", "dropped", "pending"] | None = Field(
        None, description="only groups with this fate"
    )
    version_min: int | None = Field(None, ge=0, description="min_version >= this")
    version_max: int | None = Field(None, ge=0, description="min_version <= this")
    limit: int = Field(50, ge=1, le=500, description="rows per page")
    cursor: str | None = Field(
        None, pattern=r"^\d+-\d+$", description="next_cursor of the previous page: older rows"
    )


def row(eid: str, e: RolloutLogEntry, fate: RolloutFate) -> dict[str, Any]:
    stale = (
        fate.trainer_version - e.min_version
        if fate.trainer_version is not None and e.min_version >= 0
        else None
    )
    return {
        "id": e.group_id,
        "task": e.env,
        "seed": e.seed,
        "reward": e.reward,
        "version": e.min_version if e.min_version >= 0 else None,
        "staleness": stale,
        "trained_at": fate.trainer_version,
        "samples": e.samples,
        "length": round(e.tokens, 2),
        "model_tokens": round(e.model_tokens, 2),
        "status": fate.status,
        "reason": fate.reason,
        "finished": e.finished,
        "log_id": eid,
    }


def _matches(q: RolloutQuery, e: RolloutLogEntry, fate: RolloutFate) -> bool:
    if q.task is not None and e.env != q.task:
        return False
    if q.status is not None and fate.status != q.status:
        return False
    if q.version_min is not None and e.min_version < q.version_min:
        return False
    return q.version_max is None or 0 <= e.min_version <= q.version_max


def list_rollouts(bus: Bus, q: RolloutQuery) -> dict[str, Any]:
    """{"rollouts": [...newest first], "next_cursor": id or None (None: nothing older)}."""
    rows: list[dict[str, Any]] = []
    cursor, scanned = q.cursor, 0
    while len(rows) < q.limit and scanned < SCAN_MAX:
        chunk = bus.rollout_log(cursor, SCAN_CHUNK)
        fates = bus.fates([e.group_id for _, e in chunk])
        for (eid, e), fate in zip(chunk, fates, strict=True):
            cursor, scanned = eid, scanned + 1
            if _matches(q, e, fate):
                rows.append(row(eid, e, fate))
                if len(rows) == q.limit:
                    break
        if len(chunk) < SCAN_CHUNK and len(rows) < q.limit:
            return {"rollouts": rows, "next_cursor": None}  # reached the oldest entry
    return {"rollouts": rows, "next_cursor": cursor}
