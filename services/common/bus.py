"""Everything relay keeps in Redis: key names, the rollout stream, the service registry,
the latest-weights key, the rollout ledger, the rollout log (the browser's index) and the pause.
Services never share memory; this is the contract.

Synchronous redis-py throughout; asyncio callers wrap calls in `asyncio.to_thread`, so there is
one implementation of each operation.

Redis may restart under a run (its supervisor brings it back with its data: AOF, fsync every
second). Every client made here reconnects: a command that meets a dropped connection is retried
with exponential back-off for up to `RECONNECT_S`, and only then raises. A retried command may
have run once already, so every write here is idempotent: sets, HSETs to a value, the trained
ledger through `MARK_TRAINED` (which tells a retry of the same step from a second training). A
long-running loop that must outlive a longer outage wraps its calls in `until_done`.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from services.common.auth import redis_credentials
from services.common.schemas import (
    PauseState,
    RolloutFate,
    RolloutGroup,
    RolloutLogEntry,
    ServiceInfo,
    TrainerStepMetrics,
    WeightsInfo,
)

TRAINER_GROUP = "trainer"
# The rollout log keeps about this many newest entries (a few MB; transcripts expire on their own).
ROLLOUT_LOG_MAX = 100_000
# How long one command keeps reconnecting before it raises: a supervised Redis is back in ~1-2 s.
RECONNECT_S = 30.0
BACKOFF_BASE_S, BACKOFF_CAP_S = 0.05, 2.0
T = TypeVar("T")
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Keys:
    prefix: str

    @property
    def rollouts(self) -> str:
        return f"{self.prefix}:rollouts"

    @property
    def weights_latest(self) -> str:
        return f"{self.prefix}:weights:latest"

    @property
    def weights_announced(self) -> str:
        """Hash: version -> WeightsInfo of every version the trainer announced (the only
        versions services load and samples may carry)."""
        return f"{self.prefix}:weights:announced"

    @property
    def metrics(self) -> str:
        return f"{self.prefix}:metrics"

    @property
    def started(self) -> str:
        return f"{self.prefix}:ledger:started"

    @property
    def trained(self) -> str:
        return f"{self.prefix}:ledger:trained"

    @property
    def dropped(self) -> str:
        return f"{self.prefix}:ledger:dropped"

    @property
    def consumed_at(self) -> str:
        """group -> the trainer's version when it trained or dropped the group (its staleness is
        this minus the group's min_version)."""
        return f"{self.prefix}:ledger:consumed_at"

    @property
    def rollout_log(self) -> str:
        """Stream of RolloutLogEntry, one per group pushed or dropped by the orchestrator, newest
        last, trimmed to about ROLLOUT_LOG_MAX entries: what GET /v1/rollouts pages through."""
        return f"{self.prefix}:rollouts:log"

    @property
    def retrained(self) -> str:
        """group id -> how many more steps trained it after the first (0 in a correct run)."""
        return f"{self.prefix}:ledger:retrained"

    @property
    def orchestrator_state(self) -> str:
        """Hash: `cursor`, how many groups the orchestrator has started (its position in the
        task order, which continues from there after a restart)."""
        return f"{self.prefix}:orchestrator"

    @property
    def inflight(self) -> str:
        """group id -> {"env", "seed"} of every group started but not yet pushed or dropped."""
        return f"{self.prefix}:orchestrator:inflight"

    def rollout(self, group_id: str) -> str:
        """A finished group's transcript (the RolloutGroup as pushed), kept for inspection."""
        return f"{self.prefix}:rollout:{group_id}"

    @property
    def rollouts_pattern(self) -> str:
        return self.rollout("*")

    @property
    def trainer_state(self) -> str:
        """Hash: `version` (the committed step), `status`, `last_checkpoint`, `pid`, ..."""
        return f"{self.prefix}:trainer"

    @property
    def control_stop(self) -> str:
        """Set (any value) to ask the trainer to stop at the next batch boundary."""
        return f"{self.prefix}:control:stop"

    @property
    def control_shutdown(self) -> str:
        """Set (a reason) to stop every component of a Slurm job; the first reason wins."""
        return f"{self.prefix}:control:shutdown"

    @property
    def control_pause(self) -> str:
        """Hash: the orchestrator's pause (since, reason) and the seconds paused before it
        (total_s): a PauseState. Survives an orchestrator restart; the time budget skips it."""
        return f"{self.prefix}:control:pause"

    def service(self, kind: str, sid: str) -> str:
        return f"{self.prefix}:svc:{kind}:{sid}"

    def supervisor(self, name: str) -> str:
        """A supervisor's state (JSON), refreshed every beat with a TTL."""
        return f"{self.prefix}:sup:{name}"

    def supervisor_restart(self, name: str) -> str:
        """Set to ask the supervisor `name` to restart its child (`make restart`)."""
        return f"{self.prefix}:sup-restart:{name}"

    def slurm_rendezvous(self, job_id: str) -> str:
        """host:port of trainer node 0's c10d rendezvous for one Slurm job."""
        return f"{self.prefix}:slurm:{job_id}:rdzv"

    def engine_rendezvous(self, service: str) -> str:
        """JSON {"init": "tcp://host:port", "group": id} of the rank group that the service
        `service` (decode.3), rank 0 of an engine spanning nodes, is forming; it sets the key with
        a TTL and refreshes it while the group lives (services/engine/parallel/ranks.py)."""
        return f"{self.prefix}:engine:{service}:rendezvous"

    def engine_node(self, service: str, node: int) -> str:
        """The group id that node `node` of `service`'s engine joined, with a TTL its host
        (services/engine/parallel/node.py) refreshes while all of its ranks run."""
        return f"{self.prefix}:engine:{service}:node:{node}"


def run_prefix(base: str, run_name: str) -> str:
    """The key prefix of one run (`redis.prefix` + the run directory's name): several runs, or a
    resumed one, share a Redis without mixing their keys."""
    return f"{base}:{run_name}"


def supervisor_states(r: redis.Redis, k: Keys) -> list[dict[str, Any]]:
    """Every supervisor of a run that reported recently (or ended within a day), sorted by name:
    the JSON each writes under `k.supervisor(name)` (sbatch/supervisor.py SupervisorState)."""
    keys = sorted(r.scan_iter(match=k.supervisor("*"), count=500))
    vals = r.mget(keys) if keys else []
    return sorted((json.loads(v) for v in vals if v), key=lambda s: s["name"])


def _retries(total_s: float) -> int:
    """How many back-off steps (base doubling up to the cap) add up to `total_s`."""
    n, waited = 0, 0.0
    while waited < total_s:
        n += 1
        waited += min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2**n)
    return n


def connect(url: str, reconnect_s: float = RECONNECT_S, **kw: Any) -> redis.Redis:
    """A client of the run's Redis, authenticated with the URL's credentials or the run's
    (services/common/auth.py), that rides out a Redis restart of up to `reconnect_s` (see the
    module's docstring; 0: no retries). `kw` overrides redis-py options (timeouts)."""
    username, password = redis_credentials(url)
    opts: dict[str, Any] = {
        "decode_responses": True,
        "socket_timeout": 30,
        "socket_connect_timeout": 5,
        "health_check_interval": 10,
        "retry": Retry(ExponentialBackoff(cap=BACKOFF_CAP_S, base=BACKOFF_BASE_S), _retries(reconnect_s)),
        "retry_on_error": [redis.ConnectionError, redis.TimeoutError, ConnectionError, TimeoutError],
    }
    if password:
        opts.update(username=username, password=password)
    return redis.Redis.from_url(url, **{**opts, **kw})


def until_done(
    fn: Callable[[], T],
    what: str,
    stop: Callable[[], bool] = lambda: False,
    max_delay_s: float = 5.0,
) -> T:
    """fn() until it does not raise a Redis error, however long Redis is away (each attempt already
    reconnects for RECONNECT_S), logging each failure; for loops that cannot go on without Redis
    and must not die of its outage (the trainer's commit). Raises the last error when `stop()`."""
    delay = 0.5
    while True:
        try:
            return fn()
        except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError) as e:
            if stop():
                raise
            log.warning("redis unavailable during %s (%s): retrying in %.1fs", what, e, delay)
            time.sleep(delay)
            delay = min(max_delay_s, delay * 2)


# Mark groups trained at one step: a group's first training records its step; a later call for
# the same step is a retry of that commit (no effect); another step training it counts in
# `retrained`. KEYS: trained, retrained. ARGV: step, group ids.
MARK_TRAINED = """
for i = 2, #ARGV do
  local cur = redis.call('HGET', KEYS[1], ARGV[i])
  if not cur then
    redis.call('HSET', KEYS[1], ARGV[i], ARGV[1])
  elseif cur ~= ARGV[1] then
    redis.call('HINCRBY', KEYS[2], ARGV[i], 1)
  end
end
return #ARGV - 1
"""


class Bus:
    """A thin, typed view of one run's Redis state."""

    def __init__(self, url: str, prefix: str):
        self.url = url
        self.r = connect(url)
        self.k = Keys(prefix)
        self._mark_trained = self.r.register_script(MARK_TRAINED)

    # ---------------------------------------------------------- rollouts stream

    def push_group(self, group: RolloutGroup) -> str:
        return self.r.xadd(self.k.rollouts, {"group": group.model_dump_json()})

    def ensure_trainer_group(self) -> None:
        try:
            self.r.xgroup_create(self.k.rollouts, TRAINER_GROUP, id="0", mkstream=True)
        except redis.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise

    def read_groups(
        self, consumer: str, count: int, block_ms: int, pending: bool = False
    ) -> list[tuple[str, RolloutGroup]]:
        """Read up to `count` groups. pending=True re-reads this consumer's unacked entries
        (what a restarted trainer must finish first: at-least-once delivery)."""
        start = "0" if pending else ">"
        try:
            resp = self.r.xreadgroup(
                TRAINER_GROUP,
                consumer,
                {self.k.rollouts: start},
                count=count,
                block=None if pending else block_ms,
            )
        except redis.ResponseError as e:
            if "NOGROUP" not in str(e):
                raise
            # Redis came back without the stream (it had none on disk): start reading anew.
            self.ensure_trainer_group()
            return []
        out: list[tuple[str, RolloutGroup]] = []
        for _stream, entries in resp or []:
            for entry_id, fields in entries:
                if fields is None:  # deleted while pending
                    continue
                out.append((entry_id, RolloutGroup.model_validate_json(fields["group"])))
        return out

    def ack(self, entry_ids: list[str]) -> None:
        if entry_ids:
            self.r.xack(self.k.rollouts, TRAINER_GROUP, *entry_ids)

    def drop_entry(self, entry_id: str, group_id: str, reason: str, version: int) -> None:
        """The trainer at `version` drops a delivered group: recorded in the ledger and acked,
        atomically."""
        pipe = self.r.pipeline(transaction=True)
        pipe.hset(self.k.dropped, group_id, reason)
        pipe.hset(self.k.consumed_at, group_id, version)
        pipe.xack(self.k.rollouts, TRAINER_GROUP, entry_id)
        pipe.execute()

    def pending_count(self, consumer: str) -> int:
        """Entries delivered to `consumer` and not yet acked."""
        try:
            for c in self.r.xinfo_consumers(self.k.rollouts, TRAINER_GROUP):
                if c["name"] == consumer:
                    return int(c["pending"])
        except redis.ResponseError:  # no stream or group yet
            pass
        return 0

    def queue_depth(self) -> int:
        """Groups on the stream not yet delivered to the trainer."""
        return self._trainer_group_counts()[0]

    def unconsumed(self) -> int:
        """Groups on the stream the trainer has not finished with: undelivered, or delivered
        but not yet acked (the batch it is collecting or training on)."""
        lag, pending = self._trainer_group_counts()
        return lag + pending

    def _trainer_group_counts(self) -> tuple[int, int]:
        try:
            for g in self.r.xinfo_groups(self.k.rollouts):
                if g["name"] == TRAINER_GROUP:
                    lag = g.get("lag")
                    return (int(lag) if lag is not None else 0), int(g.get("pending") or 0)
        except redis.ResponseError:
            pass
        # No consumer group yet: the trainer has not started reading; everything is undelivered.
        return (int(self.r.xlen(self.k.rollouts)) if self.r.exists(self.k.rollouts) else 0), 0

    # ---------------------------------------------------------- weights

    def publish_weights(self, info: WeightsInfo) -> None:
        """Announce a version: it joins the announced ones and becomes the latest, atomically."""
        raw = info.model_dump_json()
        pipe = self.r.pipeline()
        pipe.hset(self.k.weights_announced, str(info.version), raw)
        pipe.set(self.k.weights_latest, raw)
        pipe.execute()

    def latest_weights(self) -> WeightsInfo | None:
        raw = self.r.get(self.k.weights_latest)
        return WeightsInfo.model_validate_json(raw) if raw else None

    def announced_weights(self, version: int) -> WeightsInfo | None:
        raw = self.r.hget(self.k.weights_announced, str(version))
        return WeightsInfo.model_validate_json(raw) if raw else None

    def announced_versions(self) -> set[int]:
        return {int(v) for v in self.r.hkeys(self.k.weights_announced)}

    # ---------------------------------------------------------- ledger

    def mark_trained(self, group_ids: list[str], step: int, version: int | None = None) -> None:
        """Groups trained by step `step`; `version`: the trainer's version that trained them (the
        step's starting version, recorded for their staleness)."""
        if group_ids:
            pipe = self.r.pipeline(transaction=True)
            self._marks(pipe, group_ids, step, version)
            pipe.execute()

    def _marks(self, pipe: Any, group_ids: list[str], step: int, version: int | None) -> None:
        self._mark_trained(keys=[self.k.trained, self.k.retrained], args=[step, *group_ids], client=pipe)
        if version is not None:
            pipe.hset(self.k.consumed_at, mapping=dict.fromkeys(group_ids, version))

    def commit_step(
        self,
        group_ids: list[str],
        step: int,
        entry_ids: list[str],
        state: dict[str, Any],
        version: int | None = None,
    ) -> None:
        """The trainer's commit of one step, atomically (so a reader never sees the ledger and
        the trainer's version disagree): mark the groups trained at `step` (by `version`), record
        the trainer state, then ack their stream entries. Idempotent, so a retry after a lost
        reply is safe."""
        pipe = self.r.pipeline(transaction=True)
        if group_ids:
            self._marks(pipe, group_ids, step, version)
        pipe.hset(self.k.trainer_state, mapping=state)
        if entry_ids:
            pipe.xack(self.k.rollouts, TRAINER_GROUP, *entry_ids)
        pipe.execute()

    def progress(self) -> tuple[int, int, int, int | None]:
        """(groups started, trained, dropped, the trainer's committed version or None), read
        atomically: what admission is derived from."""
        pipe = self.r.pipeline(transaction=True)
        pipe.scard(self.k.started)
        pipe.hlen(self.k.trained)
        pipe.hlen(self.k.dropped)
        pipe.hget(self.k.trainer_state, "version")
        started, trained, dropped, version = pipe.execute()
        return int(started), int(trained), int(dropped), None if version is None else int(version)

    def mark_dropped(self, group_id: str, reason: str, version: int | None = None) -> None:
        """`version`: the trainer's version when the trainer dropped it (None: the orchestrator)."""
        pipe = self.r.pipeline()
        pipe.hset(self.k.dropped, group_id, reason)
        if version is not None:
            pipe.hset(self.k.consumed_at, group_id, version)
        pipe.execute()

    def is_trained(self, group_id: str) -> bool:
        return bool(self.r.hexists(self.k.trained, group_id))

    def ledger(self) -> dict[str, object]:
        """started (set of ids), trained (id -> times trained), dropped (id -> reason)."""
        started = self.r.smembers(self.k.started)
        again = {k: int(v) for k, v in self.r.hgetall(self.k.retrained).items()}
        trained = {k: 1 + again.get(k, 0) for k in self.r.hkeys(self.k.trained)}
        dropped = self.r.hgetall(self.k.dropped)
        return {"started": started, "trained": trained, "dropped": dropped}

    # ---------------------------------------------------------- rollout log (the browser's index)

    def log_rollout(self, entry: RolloutLogEntry, done: str | None = None) -> None:
        """Append to the rollout log; `done`: also take that group off the in-flight hash, in the
        same transaction (so a group the orchestrator re-issues after a crash is listed once)."""
        pipe = self.r.pipeline()
        pipe.xadd(
            self.k.rollout_log, {"e": entry.model_dump_json()}, maxlen=ROLLOUT_LOG_MAX, approximate=True
        )
        if done is not None:
            pipe.hdel(self.k.inflight, done)
        pipe.execute()

    def rollout_log(self, before: str | None, count: int) -> list[tuple[str, RolloutLogEntry]]:
        """Up to `count` entries, newest first, strictly older than the entry id `before`."""
        top = f"({before}" if before else "+"
        return [
            (eid, RolloutLogEntry.model_validate_json(f["e"]))
            for eid, f in self.r.xrevrange(self.k.rollout_log, max=top, min="-", count=count)
        ]

    def fates(self, group_ids: list[str]) -> list[RolloutFate]:
        """What the ledger says of each group (one round trip for the lot)."""
        if not group_ids:
            return []
        pipe = self.r.pipeline(transaction=False)
        pipe.hmget(self.k.trained, group_ids)
        pipe.hmget(self.k.dropped, group_ids)
        pipe.hmget(self.k.consumed_at, group_ids)
        trained, dropped, at = pipe.execute()
        out = []
        for t, d, v in zip(trained, dropped, at, strict=True):
            version = int(v) if v is not None else None
            if d is not None:
                out.append(RolloutFate(status="dropped", trainer_version=version, reason=d))
            elif t is not None:
                out.append(RolloutFate(status="trained", trainer_version=version))
            else:
                out.append(RolloutFate(status="pending"))
        return out

    # ---------------------------------------------------------- metrics

    def push_metrics(self, m: TrainerStepMetrics) -> None:
        """One entry per step, its id the step number: a retried push (a reply lost while Redis
        restarted) is refused as a duplicate instead of appearing twice."""
        entry = f"{m.step}-1"
        try:
            self.r.xadd(self.k.metrics, {"m": m.model_dump_json()}, id=entry)
        except redis.ResponseError as e:
            if "equal or smaller" not in str(e):
                raise
            last = self.r.xrevrange(self.k.metrics, count=1)
            if not last or last[0][0] != entry:  # not a retry: a step number went back
                raise ValueError(f"metrics of step {m.step} after step {last[0][0] if last else '?'}") from e

    def read_metrics(
        self, after: str = "0", block_ms: int | None = None
    ) -> list[tuple[str, TrainerStepMetrics]]:
        resp = self.r.xread({self.k.metrics: after}, block=block_ms)
        return [
            (eid, TrainerStepMetrics.model_validate_json(f["m"]))
            for _s, entries in resp or []
            for eid, f in entries
        ]

    # ---------------------------------------------------------- pause

    def pause_state(self) -> PauseState:
        h = self.r.hgetall(self.k.control_pause)
        since = h.get("since")
        return PauseState(
            paused=since is not None,
            since=float(since) if since is not None else None,
            reason=h.get("reason", ""),
            total_s=float(h.get("total_s") or 0.0),
        )

    def set_paused(self, paused: bool, reason: str = "") -> PauseState:
        """Pause or resume; a pause while paused keeps its start (only the reason changes), a
        resume adds the pause's length to total_s. Atomic (WATCH), so two resumes racing each
        other count the pause once."""
        key = self.k.control_pause
        with self.r.pipeline() as pipe:
            while True:
                try:
                    pipe.watch(key)
                    since = pipe.hget(key, "since")
                    pipe.multi()
                    if paused:
                        if since is None:
                            pipe.hset(key, "since", repr(time.time()))
                        pipe.hset(key, "reason", reason)
                    elif since is not None:
                        pipe.hincrbyfloat(key, "total_s", max(0.0, time.time() - float(since)))
                        pipe.hdel(key, "since")
                        pipe.hset(key, "reason", reason)
                    pipe.execute()
                    break
                except redis.WatchError:
                    continue
        return self.pause_state()

    # ---------------------------------------------------------- registry

    def register(self, info: ServiceInfo, ttl_s: float) -> None:
        self.r.set(self.k.service(info.kind, info.id), info.model_dump_json(), px=int(ttl_s * 1000))

    def deregister(self, kind: str, sid: str) -> None:
        self.r.delete(self.k.service(kind, sid))

    def supervisors(self) -> list[dict[str, Any]]:
        return supervisor_states(self.r, self.k)

    def services(self, kind: str | None = None) -> list[ServiceInfo]:
        pattern = self.k.service(kind or "*", "*")
        keys = sorted(self.r.scan_iter(match=pattern, count=500))
        vals = self.r.mget(keys) if keys else []
        return [ServiceInfo.model_validate_json(v) for v in vals if v]


class Heartbeat:
    """Keeps a service's registry entry alive from a daemon thread; `info()` is re-read every
    beat so a changing weight version shows up in the registry."""

    def __init__(self, bus: Bus, info: Callable[[], ServiceInfo], interval_s: float, ttl_s: float):
        self.bus, self.info, self.interval_s, self.ttl_s = bus, info, interval_s, ttl_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        self.bus.register(self.info(), self.ttl_s)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.bus.register(self.info(), self.ttl_s)
            except redis.RedisError:
                pass  # Redis briefly away: the entry expires and comes back on the next beat

    def stop(self) -> None:
        self._stop.set()
        info = self.info()
        try:
            self.bus.deregister(info.kind, info.id)
        except redis.RedisError:
            pass


def service_id(kind: str, port: int) -> str:
    return f"{kind}-{socket.gethostname()}-{port}-{os.getpid()}"


def wait_for_redis(url: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    r = connect(url)
    while True:
        try:
            r.ping()
            return
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
