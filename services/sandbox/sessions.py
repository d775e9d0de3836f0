"""The sandbox's session store: open episodes by id, with a capacity limit and idle expiry.

Everything the HTTP layer does to an episode goes through `SessionStore`, so a later store that
runs each episode in an isolated process (bubblewrap, for tool calls) replaces this class and
leaves server.py alone. Errors are `SessionError`s carrying the HTTP status they map to.

Locking: one store lock guards the id -> session map and the counters and is held only for
dict operations; each session has its own lock around env calls, so a slow environment blocks
its own episode, never the whole sandbox (handlers run on a threadpool).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.sandbox.envs.base import (
    EnvError,
    Environment,
    Info,
    get_env_class,
    normalize_credit,
    normalize_score,
)
from services.sandbox.isolation import (
    ExecBusy,
    ExecResult,
    IsolationError,
    QuotaExceeded,
    Workspace,
    WorkspaceManager,
)

# How many ended session ids to remember so a late request can be told *why* its id is gone.
TOMBSTONES = 65536


class SessionError(Exception):
    status = 500

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class UnknownEnv(SessionError):
    status = 422
    field = "env"  # reported like a validation error on the body field


class UnknownSession(SessionError):
    status = 404


class EpisodeDone(SessionError):
    status = 409


class SandboxFull(SessionError):
    status = 429


class ExecsFull(SessionError):
    """Every concurrent-exec slot is taken."""

    status = 429


class NoIsolation(SessionError):
    """Commands cannot run: no workspace manager, or bubblewrap is missing."""

    status = 503


class BadFileRequest(SessionError):
    status = 400


class FileMissing(SessionError):
    status = 404


class DiskQuotaExceeded(SessionError):
    """A file write does not fit in the session's disk quota (sandbox.disk_quota_mb)."""

    status = 413
    field = "content"


class EnvFailed(SessionError):
    """The environment's own code raised or broke its contract: a plugin bug, not a client error."""

    status = 500

    def __init__(self, env: str, message: str):
        super().__init__(message)
        self.env = env


@dataclass
class Session:
    id: str
    env_name: str
    env: Environment
    max_turns: int
    created: float
    last_used: float
    turns: int = 0
    done: bool = False
    # characters of each action the env was given: what its credit() must line up with
    action_lens: list[int] = field(default_factory=list)
    workspace: Workspace | None = None
    execs: int = 0
    running: int = 0  # execs/file calls in flight: the idle sweep leaves the session alone
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    ws_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def describe(self, now: float) -> dict[str, Any]:
        usage = self.workspace.disk_usage() if self.workspace is not None else None
        return {
            "session_id": self.id,
            "env": self.env_name,
            "turns": self.turns,
            "max_turns": self.max_turns,
            "done": self.done,
            "age_s": round(now - self.created, 3),
            "idle_s": round(now - self.last_used, 3),
            "execs": self.execs,
            "workspace": self.workspace is not None,
            # None without a workspace or without a quota (sandbox.disk_quota_mb = 0, not root)
            "disk": None
            if usage is None
            else {
                "used_bytes": usage.used_bytes,
                "quota_bytes": usage.quota_bytes,
                "used_files": usage.used_inodes,
                "quota_files": usage.quota_inodes,
            },
        }


@dataclass
class Counts:
    created: int = 0
    steps: int = 0
    scored: int = 0
    deleted: int = 0
    expired: int = 0
    rejected_full: int = 0
    execs: int = 0
    execs_timed_out: int = 0
    rejected_busy: int = 0


class SessionStore:
    def __init__(
        self,
        max_sessions: int,
        ttl_s: float,
        clock: Callable[[], float] = time.monotonic,
        workspaces: WorkspaceManager | None = None,
        file_max_bytes: int = 1 << 20,
    ):
        self.workspaces = workspaces
        self.file_max_bytes = file_max_bytes
        self.max_sessions = max_sessions
        self.ttl_s = ttl_s
        self.clock = clock
        self.counts = Counts()
        self._sessions: dict[str, Session] = {}
        self._reserved = 0  # sessions being built by create_many: room held for them
        self._ended: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ lookup

    def __len__(self) -> int:
        return len(self._sessions)

    def _full_message(self, n: int = 1) -> str:
        wanted = f"no room for {n} more: " if n > 1 else ""
        return (
            f"sandbox is full: {wanted}{len(self._sessions)} of sandbox.max_sessions={self.max_sessions} sessions are "
            f"open; score or DELETE finished sessions (idle ones expire after {self.ttl_s:g} s), "
            "or raise sandbox.max_sessions"
        )

    def _get(self, sid: str) -> Session:
        """The session, touched (its idle clock restarts). Caller holds no lock."""
        with self._lock:
            s = self._sessions.get(sid)
            if s is None:
                why = self._ended.get(sid)
                if why is None:
                    raise UnknownSession(f"unknown session {sid!r}")
                raise UnknownSession(f"session {sid!r} {why}")
            s.last_used = self.clock()
            return s

    def get(self, sid: str) -> dict[str, Any]:
        return self._get(sid).describe(self.clock())

    def _release(self, sessions: list[Session]) -> None:
        """Delete ended sessions' workspaces (kills their commands); caller holds no lock."""
        for s in sessions:
            if s.workspace is not None and self.workspaces is not None:
                self.workspaces.release(s.workspace)

    def close_all(self) -> None:
        with self._lock:
            gone = [s for sid in list(self._sessions) if (s := self._end(sid, "was closed at shutdown"))]
        self._release(gone)

    def _end(self, sid: str, why: str) -> Session | None:
        """Remove a session; caller holds the store lock."""
        s = self._sessions.pop(sid, None)
        if s is not None:
            self._ended[sid] = why
            if len(self._ended) > TOMBSTONES:
                self._ended.popitem(last=False)
        return s

    # ------------------------------------------------------------------ episode

    def create(self, env_name: str, seed: int) -> tuple[Session, str]:
        ((s, prompt),) = self.create_many(env_name, seed, 1)
        return s, prompt

    def create_many(self, env_name: str, seed: int, n: int) -> list[tuple[Session, str]]:
        """n sessions of one task (a rollout group), all or none: when the sandbox has no room
        for all n (SandboxFull) or one fails to start, none is kept and their workspaces go."""
        try:
            cls = get_env_class(env_name)
        except KeyError as e:
            raise UnknownEnv(f"env: {e.args[0]}") from None
        with self._lock:  # room for all n is held while they are built
            if len(self._sessions) + self._reserved + n > self.max_sessions:
                self.counts.rejected_full += 1
                raise SandboxFull(self._full_message(n))
            self._reserved += n
        built: list[tuple[Session, str]] = []
        try:
            for _ in range(n):
                built.append(self._build(cls, env_name, seed))
        except BaseException:
            for s, _prompt in built:
                self._drop_workspace(s.workspace)
            raise
        finally:
            with self._lock:
                self._reserved -= n
                if len(built) == n:
                    for s, _prompt in built:
                        self._sessions[s.id] = s
                    self.counts.created += n
        return built

    def _build(self, cls: type[Environment], env_name: str, seed: int) -> tuple[Session, str]:
        """One started episode, not yet in the store."""
        ws = None
        if cls.needs_workspace:
            ws = self._new_workspace(env_name, *cls.workspace_base(seed))
        try:
            env = cls()
            env.workspace = ws
            prompt = env.reset(seed)
            max_turns = int(env.max_turns)
            if not isinstance(prompt, str):
                raise EnvFailed(
                    env_name, f"env {env_name!r}: reset() returned {type(prompt).__name__}, expected str"
                )
        except EnvFailed:
            self._drop_workspace(ws)
            raise
        except Exception as e:
            self._drop_workspace(ws)
            raise EnvFailed(
                env_name, f"env {env_name!r}: reset({seed}) raised {type(e).__name__}: {e}"
            ) from e
        now = self.clock()
        return Session(uuid.uuid4().hex, env_name, env, max(1, max_turns), now, now, workspace=ws), prompt

    def _new_workspace(
        self, what: str, base: Path | None = None, binds: dict[Path, str] | None = None
    ) -> Workspace:
        if self.workspaces is None:
            raise NoIsolation(f"{what}: this sandbox has no workspace manager (isolated execution is off)")
        try:
            return self.workspaces.create(base, binds)
        except (IsolationError, OSError) as e:
            raise NoIsolation(f"{what}: cannot create a workspace: {e}") from e

    def _drop_workspace(self, ws: Workspace | None) -> None:
        if ws is not None and self.workspaces is not None:
            self.workspaces.release(ws)

    # ------------------------------------------------------------------ isolated execution

    def workspace(self, sid: str) -> tuple[Session, Workspace]:
        """The session's workspace, created on first use (any env can run commands)."""
        s = self._get(sid)
        with s.ws_lock:
            if s.workspace is None:
                s.workspace = self._new_workspace(f"session {sid!r}")
        with self._lock:
            ended = sid not in self._sessions
        if ended:  # closed while we created it: do not leak the directory
            self._drop_workspace(s.workspace)
            raise UnknownSession(f"session {sid!r} {self._ended.get(sid, 'was closed')}")
        return s, s.workspace

    def _isolated(self, sid: str, fn: Callable[[Workspace], Any]) -> Any:
        s, ws = self.workspace(sid)
        with self._lock:
            s.running += 1
        try:
            return fn(ws)
        except ExecBusy as e:
            with self._lock:
                self.counts.rejected_busy += 1
            raise ExecsFull(str(e)) from None
        except IsolationError as e:
            with self._lock:
                gone = sid not in self._sessions
            if gone:
                raise UnknownSession(f"session {sid!r} {self._ended.get(sid, 'was closed')}") from None
            raise NoIsolation(str(e)) from e
        finally:
            with self._lock:
                s.running -= 1
            s.last_used = self.clock()

    def exec(self, sid: str, cmd: str, timeout_s: float | None) -> ExecResult:
        r: ExecResult = self._isolated(sid, lambda ws: ws.run(cmd, timeout_s=timeout_s, wait=False))
        with self._lock:
            self.counts.execs += 1
            self.counts.execs_timed_out += int(r.timed_out)
            if (s := self._sessions.get(sid)) is not None:
                s.execs += 1
        return r

    def read_file(self, sid: str, path: str) -> tuple[str, bool]:
        if not path:
            raise BadFileRequest("path must be non-empty")
        try:
            text, truncated, exists = self._isolated(
                sid, lambda ws: ws.read_file(path, self.file_max_bytes, wait=False)
            )
        except OSError as e:
            raise BadFileRequest(str(e)) from e
        if not exists:
            raise FileMissing(f"session {sid!r}: no file {path!r}")
        return text, truncated

    def write_file(self, sid: str, path: str, content: str) -> int:
        if not path:
            raise BadFileRequest("path must be non-empty")
        if len(content.encode()) > self.file_max_bytes:
            raise BadFileRequest(f"content is over sandbox.file_max_bytes={self.file_max_bytes}")
        try:
            return int(self._isolated(sid, lambda ws: ws.write_file(path, content, wait=False)))
        except QuotaExceeded as e:
            raise DiskQuotaExceeded(f"content: {e}") from e
        except OSError as e:
            raise BadFileRequest(str(e)) from e

    def step(self, sid: str, action: str, eos: bool) -> tuple[Session, str, bool]:
        s = self._get(sid)
        with s.lock:
            if s.done:
                raise EpisodeDone(
                    f"session {sid!r} ({s.env_name}) is done after {s.turns} turn(s); score it instead of stepping"
                )
            try:
                observation, done = s.env.step(action, eos)
            except Exception as e:
                raise EnvFailed(
                    s.env_name, f"env {s.env_name!r}: step() raised {type(e).__name__}: {e}"
                ) from e
            if not isinstance(observation, str):
                raise EnvFailed(
                    s.env_name,
                    f"env {s.env_name!r}: step() returned observation {observation!r}, expected str",
                )
            s.turns += 1
            s.action_lens.append(len(action))
            # The sandbox, not each env, guarantees an episode ends by max_turns.
            s.done = bool(done) or s.turns >= s.max_turns
            with self._lock:
                self.counts.steps += 1
            return s, observation, s.done

    def score(
        self, sid: str, keep: bool = False, credit: bool = False
    ) -> tuple[Session, float, Info, list[list[float]] | None]:
        """(session, reward, info, per-turn character credit: Environment.credit, computed only
        when asked for, so a run without token credit never depends on an env's credit())."""
        s = self._get(sid)
        with s.lock:
            try:
                reward, info = normalize_score(s.env_name, s.env.score())
                chars = normalize_credit(s.env_name, s.env.credit(), s.action_lens) if credit else None
            except EnvError as e:
                raise EnvFailed(s.env_name, str(e)) from e
            except Exception as e:
                raise EnvFailed(
                    s.env_name, f"env {s.env_name!r}: score() raised {type(e).__name__}: {e}"
                ) from e
        with self._lock:
            self.counts.scored += 1
            ended = self._end(sid, "was closed when it was scored") if not keep else None
        if ended is not None:
            self._release([ended])
        return s, reward, info, chars

    def delete(self, sid: str) -> Session:
        with self._lock:
            s = self._end(sid, "was deleted")
            if s is None:
                why = self._ended.get(sid)
                raise UnknownSession(f"session {sid!r} {why}" if why else f"unknown session {sid!r}")
            self.counts.deleted += 1
        self._release([s])
        return s

    def sweep(self) -> list[Session]:
        """End sessions idle for longer than ttl_s; returns them (for metrics and logs)."""
        cutoff = self.clock() - self.ttl_s
        with self._lock:
            stale = [
                sid
                for sid, s in self._sessions.items()
                if s.last_used < cutoff and not s.running and not s.lock.locked()
            ]
            gone = [
                s
                for sid in stale
                if (s := self._end(sid, f"expired after {self.ttl_s:g} s idle")) is not None
            ]
            self.counts.expired += len(gone)
        self._release(gone)
        return gone

    def stats(self) -> dict[str, Any]:
        with self._lock:
            by_env: dict[str, int] = {}
            for s in self._sessions.values():
                by_env[s.env_name] = by_env.get(s.env_name, 0) + 1
            return {
                "sessions_open": len(self._sessions),
                "sessions_open_by_env": by_env,
                "max_sessions": self.max_sessions,
                "session_ttl_s": self.ttl_s,
                **{k: getattr(self.counts, k) for k in Counts.__dataclass_fields__},
            }
