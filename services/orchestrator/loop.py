"""The rollout loop: keeps groups in flight, bounds staleness, streams finished groups to the
trainer and rolls new weights out to every live decode service.

State that must survive an orchestrator restart lives in Redis: its cursor in the task order
(group n's task and seed are drawn from (run.seed, n), so a restart continues the order instead
of replaying it), the groups in flight (re-issued on restart with the same id and seed), the
ledger (what admission is derived from).

Redis restarting under the run stalls the loop but never ends it: every loop retries its Redis
calls with back-off, a finished group's commit waits for Redis, and a loop that dies of anything
else fails the service's /health, so its supervisor restarts the process.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import redis

from services.common.auth import auth_headers
from services.common.bus import Bus
from services.common.config import RunConfig
from services.common.health import health_rows
from services.common.registry import Registry
from services.common.schemas import RolloutGroup, RolloutLogEntry, TrainerStepMetrics, WeightsInfo
from services.common.service import log_event
from services.common.versions import version_ranges
from services.common.weights_gate import AnnouncedVersions
from services.orchestrator import metrics as prom
from services.orchestrator.clients import DecodeClient, Router, SandboxClient, ServiceUnavailable
from services.orchestrator.rollout import GroupSpec, GroupTimedOut, RolloutRunner
from services.orchestrator.verifiers_rollout import run_verifiers_group

ROLLOUT_TTL_S = 7 * 24 * 3600
T = TypeVar("T")

log = logging.getLogger("orchestrator")


@dataclass(frozen=True)
class Progress:
    """What admission reads from Redis in one go."""

    started: int  # groups ever started (the ledger's started set)
    trained: int
    dropped: int
    trainer_version: int | None  # the trainer's committed version (None: not started yet)
    unconsumed: int  # groups on the stream the trainer has not finished with

    @property
    def pending(self) -> int:
        """Started, neither trained nor dropped yet: in flight, on the stream, or being trained."""
        return max(0, self.started - self.trained - self.dropped)


class Orchestrator:
    decode: DecodeClient  # set in run(): they need the aiohttp session of the running loop
    sandbox: SandboxClient

    def __init__(self, cfg: RunConfig, bus: Bus, run_dir: Path):
        self.cfg = cfg
        self.o = cfg.orchestrator
        self.bus = bus
        self.run_dir = run_dir
        self.k = bus.k
        self._http: aiohttp.ClientSession | None = None
        self.registry = Registry(bus.services, quarantine_s=cfg.redis.ttl_s)
        self.version = -1  # the version every live decode has been asked to serve
        self.rolled_out: WeightsInfo | None = None
        self._refused = -1  # the last lower version weights:latest showed (logged once)
        # decode id -> the version it answered /update_weights for: the registry shows a new
        # version only at the decode's next heartbeat, and must not trigger a second update.
        self.loaded: dict[str, int] = {}
        self.announced = AnnouncedVersions(bus)
        # Called with each version rolled out (the service shows it in its registry entry).
        self.on_version: Callable[[int], None] = lambda _v: None
        # The pause lives in Redis (a restarted orchestrator stays paused); this is its mirror.
        self.paused = bus.pause_state().paused
        self.stopping = False
        self.inflight: dict[str, asyncio.Task[None]] = {}
        self.cursor = 0  # groups started so far: the position in the task order (from Redis at run())
        self.history: list[dict[str, Any]] = []
        self.recent_rewards: dict[str, deque[float]] = {t.env: deque(maxlen=64) for t in self.o.tasks}
        self.decode_idle_prev: dict[str, float] = {}
        self.decode_idle_s = 0.0
        self.versions_served: set[int] = set()
        self.runner: RolloutRunner | None = None
        # tasks the sandbox runs as verifiers environments (services/orchestrator/verifiers_rollout.py)
        self.verifiers_envs = {t.env for t in cfg.orchestrator.tasks if t.verifiers is not None}
        self._wake = asyncio.Event()

    # ------------------------------------------------------------ redis-backed counters

    def _counts(self) -> tuple[int, int]:
        """(groups started, dropped) from the ledger."""
        started, _trained, dropped, _version = self.bus.progress()
        return started, dropped

    def _progress(self) -> Progress:
        started, trained, dropped, version = self.bus.progress()
        return Progress(started, trained, dropped, version, self.bus.unconsumed())

    async def _durably(self, what: str, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) off the loop, retried with back-off for as long as Redis is away (each try
        already reconnects for a while): a finished group waits for Redis rather than being lost.
        Gives up only when the orchestrator stops."""
        delay = 0.5
        while True:
            try:
                return await asyncio.to_thread(fn, *args)
            except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError) as e:
                if self.stopping:
                    raise
                log_event(log, "redis unavailable", during=what, error=str(e), retry_s=delay)
                await asyncio.sleep(delay)
                delay = min(5.0, delay * 2)

    # ------------------------------------------------------------ weights

    async def _wait_initial_weights(self) -> WeightsInfo:
        while True:
            info = await self._durably("weights", self.bus.latest_weights)
            if info is not None:
                return info
            await asyncio.sleep(0.2)

    async def _roll_out(self, info: WeightsInfo) -> None:
        """Ask every live decode to load `info`; the producer only starts groups of the new
        version once they all have (so staleness is bounded by what the trainer has published).
        A decode that cannot answer (5xx, unreachable: e.g. a 503 because its check of the
        announced versions could not reach Redis) is asked again with back-off (0.5 s doubling
        up to service_retry_max_delay_s) while it stays live, for up to service_retry_s; only
        then does the roll-out go on without it (the catch-up in weights_watcher keeps trying)."""
        decodes = await self.registry.live("decode", force=True)
        give_up = time.monotonic() + self.o.service_retry_s
        delay = 0.5
        while decodes:
            results = await asyncio.gather(
                *(self.decode.update_weights(d.url, info.path, info.version) for d in decodes),
                return_exceptions=True,
            )
            retry = []
            for d, r in zip(decodes, results, strict=True):
                if (
                    isinstance(r, ServiceUnavailable)
                    and not self.stopping
                    and time.monotonic() + delay <= give_up
                ):
                    log_event(
                        log,
                        "weight update retry",
                        url=d.url,
                        version=info.version,
                        error=str(r),
                        retry_s=delay,
                    )
                    retry.append(d.id)
                elif isinstance(r, Exception):
                    log_event(log, "weight update failed", url=d.url, version=info.version, error=str(r))
                else:
                    self.loaded[d.id] = info.version
            if not retry:
                break
            await asyncio.sleep(delay)
            delay = min(self.o.service_retry_max_delay_s, delay * 2)
            decodes = [d for d in await self.registry.live("decode", force=True) if d.id in retry]
        self.version = info.version
        self.rolled_out = info
        self.on_version(info.version)
        prom.POLICY_VERSION.set(info.version)
        self._wake.set()

    async def weights_watcher(self) -> None:
        while not self.stopping:
            try:
                info = await asyncio.to_thread(self.bus.latest_weights)
                # Only a higher number is new weights: a version names one set of weights for the
                # whole run (a resumed trainer republishes the version it holds, or numbers on
                # after the newest it reached: trainer/train.py, setup). A lower one means the key
                # was rewritten from outside the run (or Redis lost it): never roll back to it.
                if info is not None and info.version < self.version:
                    if info.version != self._refused:
                        self._refused = info.version
                        log_event(
                            log,
                            "weights version went back: ignored",
                            version=info.version,
                            serving=self.version,
                        )
                elif info is not None and info.version > self.version:
                    t0 = time.monotonic()
                    await self._roll_out(info)
                    log_event(
                        log, "weights rolled out", version=info.version, s=round(time.monotonic() - t0, 3)
                    )
                elif info is not None:
                    # A decode that restarted (a new id) may come back on another version:
                    # bring it in line, once.
                    for d in await self.registry.live("decode"):
                        if d.version < 0 or d.version == info.version:
                            continue
                        if self.loaded.get(d.id) == info.version:
                            continue  # done; its registry entry is a heartbeat behind
                        await self.decode.update_weights(d.url, info.path, info.version)
                        self.loaded[d.id] = info.version
            except (redis.RedisError, ServiceUnavailable, ValueError) as e:
                log_event(log, "weights watcher error", error=str(e))
            await asyncio.sleep(0.1)

    # ------------------------------------------------------------ producing groups

    def _allowance(self, p: Progress) -> int:
        """How many more groups may start now, derived from what the ledger says (never from the
        version number alone: a resumed trainer numbers on past steps whose groups it trained,
        and a resumed run starts with groups pending from before).

        Staleness (AReaL-style admission): the trainer at version t trains the pending groups
        (started, neither trained nor dropped) roughly in order, B per step, so a group started
        now, behind `pending` others, is trained by weights t + pending // B while decode serves
        v <= t. Its staleness t + pending // B - v stays within max_off_policy_steps while
        pending < (max_off_policy_steps + 1 - (t - v)) * B. Budget: no more groups than the
        trainer still needs for its remaining steps, counting those on the stream and in flight."""
        b = self.o.batch_size
        t = self.version if p.trainer_version is None else max(p.trainer_version, self.version)
        by_staleness = (self.o.max_off_policy_steps + 1 - (t - self.version)) * b - p.pending
        by_budget = (self.cfg.run.max_steps - t) * b - p.unconsumed - len(self.inflight)
        return min(by_staleness, by_budget)

    async def load_cursor(self) -> None:
        """Where the task order stands: groups started by every orchestrator of this run so far."""
        raw = await self._durably("cursor", self.bus.r.hget, self.k.orchestrator_state, "cursor")
        self.cursor = int(raw or 0)

    def spec(self, n: int, group_id: str | None = None) -> GroupSpec:
        """The n-th group of the run's task order: its task and seed depend on (run.seed, n) only."""
        rng = random.Random(f"{self.cfg.run.seed}:{n}")
        env = rng.choices([t.env for t in self.o.tasks], weights=[t.weight for t in self.o.tasks])[0]
        return GroupSpec(group_id=group_id or uuid.uuid4().hex[:16], env=env, seed=rng.randrange(1 << 31))

    async def producer(self) -> None:
        while not self.stopping:
            self._wake.clear()
            if self.paused or len(self.inflight) >= self.o.max_inflight_groups:
                await self._sleep_until_woken(0.5)
                continue
            progress = await self._durably("admission", self._progress)
            room = min(self._allowance(progress), self.o.max_inflight_groups - len(self.inflight))
            if room <= 0:
                await self._sleep_until_woken(0.2)
                continue
            for _ in range(room):
                spec = self.spec(self.cursor)
                await self._durably("start", self._record_start, spec, self.cursor + 1)
                self.cursor += 1
                if self.stopping:
                    # Shutdown began meanwhile and closed the HTTP session: a group launched now
                    # would fail and be dropped; left in flight, a restart re-issues it.
                    break
                self._launch(spec)

    async def _sleep_until_woken(self, timeout: float) -> None:
        try:
            await asyncio.wait_for(self._wake.wait(), timeout)
        except TimeoutError:
            pass

    def _record_start(self, spec: GroupSpec, cursor: int) -> None:
        pipe = self.bus.r.pipeline(transaction=True)
        pipe.hset(self.k.orchestrator_state, "cursor", cursor)
        pipe.sadd(self.k.started, spec.group_id)
        pipe.hset(self.k.inflight, spec.group_id, json.dumps({"env": spec.env, "seed": spec.seed}))
        pipe.execute()

    def _launch(self, spec: GroupSpec) -> None:
        task = asyncio.create_task(self._run_group(spec), name=f"group-{spec.group_id}")
        self.inflight[spec.group_id] = task
        prom.INFLIGHT.set(len(self.inflight))

    async def _run_group(self, spec: GroupSpec) -> None:
        assert self.runner is not None
        give_up = time.monotonic() + self.o.service_retry_s
        delay, attempt = 0.5, 0
        try:
            while True:
                try:
                    if spec.env in self.verifiers_envs:
                        group = await run_verifiers_group(
                            self.cfg, self.decode, self.sandbox, self.runner.sampling, spec
                        )
                    else:
                        group = await self.runner.run(spec)
                except ServiceUnavailable as e:
                    # decode or sandbox restarting (or none live): the whole group again, later.
                    attempt += 1
                    if time.monotonic() + delay > give_up:
                        reason = f"failed after {attempt} attempts in {self.o.service_retry_s:.0f}s: {e}"
                        await self._durably("drop", self._drop, spec, reason)
                        return
                    log_event(log, "group retry", group=spec.group_id, attempt=attempt, error=str(e))
                    await asyncio.sleep(delay)
                    delay = min(self.o.service_retry_max_delay_s, delay * 2)
                    continue
                except ValueError as e:
                    await self._durably("drop", self._drop, spec, f"error: {e}")
                    return
                except GroupTimedOut as e:  # no sample got a turn in time: nothing to train on
                    await self._durably("drop", self._drop, spec, str(e))
                    return
                versions = {v for s in group.samples for v in s.all_versions()}
                bad = await self._durably("versions", self.announced.unannounced, versions)
                if bad:  # weights the trainer never published: not a rollout of this run's policy
                    await self._durably("drop", self._drop, spec, f"unannounced: weight versions {bad}")
                    return
                await self._durably("commit", self._commit_group, group)
                return
        except asyncio.CancelledError:
            raise  # shutting down: the group stays in the in-flight hash and is re-issued on restart
        except Exception as e:  # noqa: BLE001 - any bug in one group must not kill the loop
            log.exception("group crashed")
            await self._durably("drop", self._drop, spec, f"crash: {type(e).__name__}: {e}")
        finally:
            self.inflight.pop(spec.group_id, None)
            prom.INFLIGHT.set(len(self.inflight))
            self._wake.set()

    def _commit_group(self, group: RolloutGroup) -> None:
        # Transcript first, then the stream record, then clear in-flight: a crash in between
        # re-issues the group and the trainer's dedup by group id drops the duplicate.
        self.bus.r.set(self.k.rollout(group.group_id), group.model_dump_json(), ex=ROLLOUT_TTL_S)
        self.bus.push_group(group)
        # Listed in the browser and off the in-flight hash together: a re-issue lists it once.
        self.bus.log_rollout(RolloutLogEntry.of_group(group), done=group.group_id)
        self.recent_rewards.setdefault(group.env, deque(maxlen=64)).extend(s.reward for s in group.samples)
        for s in group.samples:
            self.versions_served.update(v for v in s.all_versions() if v >= 0)
            prom.SAMPLES.labels(env=group.env, finish_reason=s.finish_reason).inc()
        prom.GROUPS.labels(env=group.env).inc()
        prom.REWARD.labels(env=group.env).observe(group.mean_reward)

    def _drop(self, spec: GroupSpec, reason: str) -> None:
        self.bus.mark_dropped(spec.group_id, reason)
        self.bus.log_rollout(
            RolloutLogEntry(group_id=spec.group_id, env=spec.env, seed=spec.seed), done=spec.group_id
        )
        prom.DROPPED.labels(reason=reason.split(":")[0]).inc()
        log_event(log, "group dropped", group=spec.group_id, reason=reason)

    async def resume_inflight(self) -> int:
        """Re-issue groups a previous orchestrator process started but never pushed."""
        pending = await self._durably("resume", self.bus.r.hgetall, self.k.inflight)
        for gid, raw in pending.items():
            d = json.loads(raw)
            self._launch(GroupSpec(group_id=gid, env=d["env"], seed=int(d["seed"])))
        return len(pending)

    # ------------------------------------------------------------ metrics

    async def metrics_tailer(self) -> None:
        """Merge the trainer's per-step metrics with the orchestrator's view into metrics.jsonl."""
        path = self.run_dir / "metrics.jsonl"
        last = "0"
        # On restart, rebuild history from the stream and rewrite the file so nothing is doubled.
        seen = await self._durably("metrics", self.bus.read_metrics, "0", None)
        for eid, m in seen:
            self.history.append(m.model_dump())
            last = eid
        rewrite = bool(seen)
        while not self.stopping:
            if rewrite:
                rewrite = not self._write_history(path)
            try:
                new = await asyncio.to_thread(self.bus.read_metrics, last, 1000)
            except redis.RedisError:
                await asyncio.sleep(1.0)
                continue
            for eid, m in new:
                last = eid
                rec = await self._durably("metrics", self._merge, m)  # Redis reads: off the event loop
                self.history.append(rec)
                if not rewrite:
                    size = path.stat().st_size if path.exists() else 0
                    try:
                        with path.open("a") as f:
                            f.write(json.dumps(rec) + "\n")
                    except OSError as e:  # a full disk: the history stays here, written when it can be
                        log_event(log, "metrics.jsonl not writable", error=str(e))
                        with contextlib.suppress(OSError):
                            os.truncate(path, size)  # no line cut short left behind
                        rewrite = True

    def _write_history(self, path: Path) -> bool:
        """metrics.jsonl from the history, replaced atomically; False if it cannot be written now."""
        tmp = path.with_name(f".{path.name}.tmp")
        try:
            tmp.write_text("".join(json.dumps(h) + "\n" for h in self.history))
            tmp.replace(path)
            return True
        except OSError as e:
            log_event(log, "metrics.jsonl not writable", error=str(e))
            tmp.unlink(missing_ok=True)
            return False

    def _merge(self, m: TrainerStepMetrics) -> dict[str, Any]:
        rec = m.model_dump()
        started, dropped = self._counts()
        rec.update(
            decode_idle_s=round(self.decode_idle_s, 3),
            inflight_groups=len(self.inflight),
            queue_depth=self.bus.queue_depth(),
            groups_started=started,
            groups_dropped=dropped,
            policy_version=self.version,
        )
        return rec

    async def decode_poller(self) -> None:
        """Accumulate how long decode sat idle (reported by each replica's /health)."""
        while not self.stopping:
            for d in await self.registry.live("decode"):
                h = await self.decode.health(d.url)
                idle = h.get("idle_s")
                if isinstance(idle, int | float):
                    prev = self.decode_idle_prev.get(d.id)
                    if prev is not None and idle >= prev:
                        self.decode_idle_s += idle - prev
                    self.decode_idle_prev[d.id] = float(idle)
            await asyncio.sleep(1.0)

    async def set_paused(self, paused: bool, reason: str) -> dict[str, Any]:
        state = await asyncio.to_thread(self.bus.set_paused, paused, reason)
        self.paused = state.paused
        self._wake.set()
        log_event(log, "paused" if paused else "resumed", reason=reason, paused_s=round(state.paused_s(), 1))
        return {"paused": state.paused, "reason": state.reason, "paused_s": round(state.paused_s(), 3)}

    async def status(self) -> dict[str, Any]:
        started, dropped = await asyncio.to_thread(self._counts)
        trainer = await asyncio.to_thread(self.bus.r.hgetall, self.k.trainer_state)
        queue = await asyncio.to_thread(self.bus.queue_depth)
        services = await asyncio.to_thread(self.bus.services)
        pause = await asyncio.to_thread(self.bus.pause_state)
        supervisors = await asyncio.to_thread(self.bus.supervisors)
        last = self.history[-1] if self.history else {}
        return {
            "run": self.cfg.run.name,
            "step": int(trainer.get("step", 0) or 0),
            "max_steps": self.cfg.run.max_steps,
            "policy_version": self.version,
            "paused": self.paused,
            "paused_reason": pause.reason,
            "paused_s": round(pause.paused_s(), 3),
            "inflight_groups": len(self.inflight),
            "queue_depth": queue,
            "groups_started": started,
            "groups_dropped": dropped,
            "last_reward": last.get("reward"),
            "last_reward_by_env": last.get("reward_by_env", {}),
            "recent_rollout_reward": {
                e: (sum(d) / len(d) if d else None) for e, d in self.recent_rewards.items()
            },
            "trainer_wait_s": last.get("wait_data_s"),
            "decode_idle_s": round(self.decode_idle_s, 3),
            "staleness_mean": last.get("staleness_mean"),
            # Ranges of consecutive versions, [[first, last], ...]: hundreds of versions stay a line.
            "versions_served": [list(r) for r in version_ranges(self.versions_served)],
            "services": [s.model_dump() for s in services],
            # Every supervised process with its registry entry: state, restarts, uptime, version.
            "health": health_rows(services, supervisors),
        }

    # ------------------------------------------------------------ lifecycle

    async def run(self) -> None:
        # The session must be created inside the running loop.
        self._http = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self.o.request_timeout_s, connect=5.0),
            connector=aiohttp.TCPConnector(limit=256),
            headers=auth_headers(),  # the run token: decode and sandbox require it
        )
        self.decode = DecodeClient(
            self._http, Router(self.registry, "decode", affinity_slack=self.o.decode_affinity_slack)
        )
        self.sandbox = SandboxClient(
            self._http, Router(self.registry, "sandbox"), credit=self.o.advantage == "token"
        )
        info = await self._wait_initial_weights()
        # Tokenizer, chat template, end-of-turn id and every EOS id, from the model directory.
        self.runner = RolloutRunner.for_model_dir(self.cfg, self.decode, self.sandbox, info.path)
        await self._roll_out(info)
        resumed = await self.resume_inflight()
        await self.load_cursor()
        log_event(
            log, "orchestrator running", version=self.version, resumed_groups=resumed, cursor=self.cursor
        )
        # A TaskGroup, not gather: one loop dying cancels the others and ends run() with its error
        # (the service's /health then fails and its supervisor restarts it); none may die silently.
        async with asyncio.TaskGroup() as tg:
            for loop in (self.producer, self.weights_watcher, self.metrics_tailer, self.decode_poller):
                tg.create_task(loop(), name=loop.__name__)

    async def shutdown(self) -> None:
        self.stopping = True
        self._wake.set()
        for t in list(self.inflight.values()):
            t.cancel()
        await asyncio.gather(*self.inflight.values(), return_exceptions=True)
        if self._http is not None:
            await self._http.close()
