"""Run one service command and keep it running: the unit of per-service restarts.

    python -m sbatch.supervisor --name decode.0 --redis-url redis://h:p/0 --prefix relay:run \\
        [--max-restarts 5 --backoff-s 1 --backoff-max-s 60 --reset-after-s 300] -- python -m services.decode ...

- A child that exits non-zero (or is killed, e.g. `kill -9`) is restarted after an exponential
  back-off (backoff_s * 2^(n-1), capped at backoff_max_s). After more than max_restarts consecutive
  failures the supervisor gives up and exits with the child's code, so the launcher sees a dead
  service. A child that ran for reset_after_s before failing starts a fresh count: a week-long run
  survives an occasional crash without exhausting its budget.
- A child that exits 0 has finished (the trainer at max_steps): the supervisor exits 0 too. One that
  exits FATAL_EXIT (services/common/disk.py: e.g. its disk is full) is not restarted either: the
  supervisor gives up at once (FAILED).
- SIGTERM/SIGINT: forwarded to the child's process group (it runs in its own session so torchrun's
  workers get it too); after stop_timeout_s the group is killed. The child also gets SIGTERM if the
  supervisor itself dies (PR_SET_PDEATHSIG), so no orphan keeps a port or a GPU.
- Restart on purpose: SIGHUP, or the Redis key `<prefix>:sup-restart:<name>` (what
  `make restart SERVICE=...` sets). The child is stopped gracefully and started again at once;
  this does not count as a failure.
- State (`<prefix>:sup:<name>`, JSON: host, pids, state, restarts, last exit) is written to Redis
  every beat with a TTL, so `make status` shows it and a vanished supervisor disappears. Redis being
  unreachable (not started yet, restarting) never stops the supervisor: it only skips reporting.
- Liveness (`--probe`): a child that stops answering is killed (SIGKILL: a stopped or hung process
  would not act on SIGTERM) and restarted like a crashed one. `http` (default): once the child has
  registered in the service registry (found by its pid), GET its /health every probe_interval_s
  with a probe_timeout_s deadline; `redis`: PING the Redis at --redis-url (the supervisor of Redis
  itself); `none`: exits only (the trainer). probe_failures misses in a row count as hung; a 503
  (a task the service needs has died) is a miss too.
- `--pid-file`: the child's pid, so a supervisor started after its predecessor was killed first
  waits for (then kills) the child that one left behind, instead of running two at once.
- Logs: the child writes into --log directly (its output outlives a killed supervisor). When the
  supervisor cannot write there (its disk is full), its events and every child it starts from
  then on go to the same name under `fallback_log_dir(prefix)` (services/common/disk.py), with a
  line saying why; a child that meets the full disk itself moves its own output there too.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

import redis

from services.common.bus import Keys, connect, supervisor_states
from services.common.disk import FATAL_EXIT, fallback_log_dir
from services.common.schemas import ServiceInfo

# States a supervisor reports.
STARTING, RUNNING, BACKOFF, STOPPING, STOPPED, EXITED, FAILED = (
    "starting",
    "running",
    "backoff",
    "stopping",
    "stopped",
    "exited",
    "failed",
)
FINAL_STATES = (STOPPED, EXITED, FAILED)
PROBES = ("http", "redis", "none")
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class RestartPolicy:
    max_restarts: int = 5
    backoff_s: float = 1.0
    backoff_max_s: float = 60.0
    reset_after_s: float = 300.0
    stop_timeout_s: float = 15.0
    probe_interval_s: float = 2.0  # 0: no liveness probe
    probe_timeout_s: float = 5.0
    probe_failures: int = 3

    @classmethod
    def of(cls, sec: Any) -> RestartPolicy:
        """From the config's [slurm.supervisor] (services.common.config.SupervisorSection)."""
        return cls(**{f: getattr(sec, f) for f in cls.__dataclass_fields__})

    def delay(self, consecutive_failures: int) -> float:
        return min(self.backoff_max_s, self.backoff_s * 2 ** max(0, consecutive_failures - 1))


@dataclass
class SupervisorState:
    name: str
    argv: list[str]
    host: str = field(default_factory=socket.gethostname)
    pid: int = field(default_factory=os.getpid)
    child_pid: int | None = None
    state: str = STARTING
    restarts: int = 0  # every start after the first, failures and requests alike
    failures: int = 0  # consecutive failures (what the give-up bound counts)
    last_exit: int | None = None
    last_exit_at: float | None = None
    last_reason: str = ""
    started: float = field(default_factory=time.time)
    child_started: float | None = None
    log: str = ""
    updated: float = 0.0


def _state(pid: int) -> str:
    """The process state letter from /proc (Z: a zombie), "" if unknown."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def _set_pdeathsig() -> None:
    """Runs in the child between fork and exec: die with the supervisor (Linux only)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


class Supervisor:
    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        policy: RestartPolicy | None = None,
        redis_url: str = "",
        prefix: str = "",
        log: IO[bytes] | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        beat_s: float = 1.0,
        probe: str = "http",
        pid_file: str = "",
    ):
        if not argv:
            raise ValueError("supervisor: empty command")
        self.name = name
        self.argv = list(argv)
        self.policy = policy or RestartPolicy()
        self.prefix = prefix
        self.k = Keys(prefix)
        # Credentials come from the environment the launcher gives it (services/common/auth.py).
        # No retries: a beat that cannot reach Redis is skipped, the child is watched meanwhile.
        self.r = (
            connect(
                redis_url, reconnect_s=0, socket_timeout=2, socket_connect_timeout=2, health_check_interval=0
            )
            if redis_url
            else None
        )
        if probe not in PROBES:
            raise ValueError(f"supervisor: probe must be one of {PROBES}, not {probe!r}")
        self.probe = probe if self.policy.probe_interval_s > 0 else "none"
        self.redis_url = redis_url
        self.pid_file = Path(pid_file) if pid_file else None
        self._hung = ""  # set by the prober: why the running child counts as hung
        self.out: IO[bytes] = log or sys.stderr.buffer
        self._out_lock = threading.Lock()
        self._moved = False  # writing to the fallback log
        self.env = env
        self.cwd = cwd
        self.beat_s = beat_s
        self.ttl_s = max(10.0, 10 * beat_s)
        self.st = SupervisorState(name=name, argv=self.argv, log=getattr(log, "name", "") if log else "")
        self.child: subprocess.Popen[bytes] | None = None
        self._wake = threading.Event()
        self._stop_requested = False
        self._restart_requested = ""
        self._last_beat = 0.0
        self._prober = threading.Thread(target=self._probe_loop, name="probe", daemon=True)

    # ------------------------------------------------------------------ liveness

    def _child_url(self, pid: int) -> str:
        """The registry entry of our child (by pid, on this host): its URL, or "" until it registers."""
        if self.r is None:
            return ""
        keys = list(self.r.scan_iter(match=self.k.service("*", "*"), count=500))
        host = socket.gethostname()
        for raw in self.r.mget(keys) if keys else []:
            if raw:
                info = ServiceInfo.model_validate_json(raw)
                if info.pid == pid and info.host == host:
                    return info.url
        return ""

    def _probe_once(self, url: str) -> str:
        """Empty if the child answered in time, else what went wrong."""
        timeout = self.policy.probe_timeout_s
        if self.probe == "redis":
            try:
                r = connect(
                    self.redis_url,
                    reconnect_s=0,
                    socket_timeout=timeout,
                    socket_connect_timeout=timeout,
                    health_check_interval=0,
                )
                with contextlib.closing(r):
                    r.ping()
                return ""
            except (redis.RedisError, OSError) as e:
                return f"PING: {type(e).__name__}: {e}"
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=timeout) as resp:
                resp.read()
            return ""
        except urllib.error.HTTPError as e:
            return f"/health: HTTP {e.code}: {e.read()[:200]!r}"
        except (OSError, ValueError) as e:  # refused, reset, timed out
            return f"/health: {type(e).__name__}: {e}"

    def _probe_loop(self) -> None:
        """Runs beside the wait loop (a probe may take its whole deadline); sets _hung."""
        url, pid, misses = "", None, 0
        while not self._stop_requested:
            time.sleep(self.policy.probe_interval_s)
            child = self.child
            if child is None or child.poll() is not None or self.st.state != RUNNING or self._hung:
                continue
            if child.pid != pid:  # a new child: find it again, count afresh
                url, pid, misses = "", child.pid, 0
            if self.probe == "http" and not url:
                try:
                    url = self._child_url(child.pid)
                except (redis.RedisError, OSError, ValueError):
                    pass
                if not url:
                    continue  # not registered yet (starting): nothing to probe
            err = self._probe_once(url)
            if not err:
                misses = 0
                continue
            misses += 1
            self._log("probe failed", pid=child.pid, misses=misses, error=err)
            if misses >= self.policy.probe_failures and child.pid == pid and child.poll() is None:
                self._hung = f"unresponsive: {misses} probes failed ({err})"
                self._wake.set()

    # ------------------------------------------------------------------ reporting

    def _log(self, msg: str, **fields: Any) -> None:
        rec = {"ts": round(time.time(), 3), "level": "info", "logger": "supervisor", "msg": msg}
        rec.update(service=self.name, **fields)
        self._write((json.dumps(rec, default=str) + "\n").encode())

    def _write(self, data: bytes) -> None:
        """Into the log; if it cannot be written (a full disk), into the fallback log from then on."""
        with self._out_lock:
            try:
                self.out.write(data)
                self.out.flush()
                return
            except (OSError, ValueError) as e:
                if self._moved or not self._move_log(e):
                    return
            with contextlib.suppress(OSError, ValueError):
                self.out.write(data)
                self.out.flush()

    def _move_log(self, err: BaseException) -> bool:
        name = Path(self.st.log).name if self.st.log else f"{self.name}.log"
        path = fallback_log_dir(self.prefix) / name
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            out = open(path, "ab", buffering=0)  # noqa: SIM115 - lives as long as we do
        except OSError:
            return False
        note = {"ts": round(time.time(), 3), "logger": "supervisor", "msg": "log moved", "service": self.name}
        out.write((json.dumps({**note, "from": self.st.log, "error": str(err)}) + "\n").encode())
        self.out, self._moved, self.st.log = out, True, str(path)
        return True

    def _publish(self, final: bool = False) -> None:
        self._last_beat = time.monotonic()
        if self.r is None:
            return
        self.st.updated = time.time()
        try:
            # A final state stays a day so `make status` can still show how a service ended.
            self.r.set(
                self.k.supervisor(self.name),
                json.dumps(asdict(self.st)),
                ex=86400 if final else int(self.ttl_s),
            )
        except (redis.RedisError, OSError):
            pass  # Redis away (not started yet, or restarting): report on a later beat

    def _poll_restart_key(self) -> None:
        if self.r is None:
            return
        try:
            req = self.r.getdel(self.k.supervisor_restart(self.name))
        except (redis.RedisError, OSError):
            return
        if req:
            self._restart_requested = f"requested ({req})"

    # ------------------------------------------------------------------ signals

    def _on_stop(self, signum: int, _frame: object) -> None:
        self._stop_requested = True
        self._wake.set()

    def _on_hup(self, _signum: int, _frame: object) -> None:
        self._restart_requested = "requested (SIGHUP)"
        self._wake.set()

    def install_signal_handlers(self) -> None:
        signal.signal(signal.SIGTERM, self._on_stop)
        signal.signal(signal.SIGINT, self._on_stop)
        signal.signal(signal.SIGHUP, self._on_hup)

    def request_stop(self) -> None:
        """For in-process owners (tests, a component task): same as SIGTERM."""
        self._stop_requested = True
        self._wake.set()

    # ------------------------------------------------------------------ child

    def _reap_previous(self) -> None:
        """A child left by a supervisor that was killed (our pid file names it, and it still leads
        its own session): give it stop_timeout_s to finish its SIGTERM shutdown, then kill its group."""
        if self.pid_file is None:
            return
        try:
            pid = int(self.pid_file.read_text().strip())
        except (OSError, ValueError):
            return
        deadline = time.monotonic() + self.policy.stop_timeout_s

        def leading() -> bool:
            try:
                return os.getsid(pid) == pid and _state(pid) != "Z"
            except (ProcessLookupError, PermissionError):
                return False

        if not leading():
            return
        self._log("waiting for the previous supervisor's child", pid=pid)
        while leading() and time.monotonic() < deadline:
            time.sleep(0.1)
        if leading():
            self._log("previous child still running: killing", pid=pid)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
            while leading() and time.monotonic() < deadline + 10:
                time.sleep(0.1)

    def _write_pid_file(self, pid: int | None) -> None:
        if self.pid_file is None:
            return
        try:
            if pid is None:
                self.pid_file.unlink(missing_ok=True)
            else:
                tmp = self.pid_file.with_name(f".{self.pid_file.name}.tmp")
                tmp.write_text(str(pid))
                tmp.replace(self.pid_file)
        except OSError:
            pass  # a full disk: the pid file is a best effort

    def _spawn(self) -> None:
        self._hung = ""
        self.child = subprocess.Popen(
            self.argv,
            stdout=self.out,
            stderr=subprocess.STDOUT,
            env=self.env,
            cwd=self.cwd,
            # Own session: signals reach the child's whole tree (torchrun + workers) and only it.
            start_new_session=True,
            preexec_fn=_set_pdeathsig,
        )
        self._write_pid_file(self.child.pid)
        self.st.child_pid = self.child.pid
        self.st.child_started = time.time()
        self.st.state = RUNNING
        self._log("started", pid=self.child.pid, restarts=self.st.restarts, argv=self.argv)
        self._publish()

    def _terminate_child(self) -> int:
        """SIGTERM the child's group, SIGKILL it after stop_timeout_s; returns the exit code."""
        child = self.child
        assert child is not None
        if child.poll() is None:
            try:
                os.killpg(child.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                child.wait(self.policy.stop_timeout_s)
            except subprocess.TimeoutExpired:
                self._log(
                    "child ignored SIGTERM: killing", pid=child.pid, timeout_s=self.policy.stop_timeout_s
                )
                try:
                    os.killpg(child.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                child.wait()
        # The group may outlive its leader (a worker that ignored SIGTERM): never leave it behind.
        try:
            os.killpg(child.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        return child.returncode

    def _wait_child(self) -> int | None:
        """Waits until the child exits (returns its code) or a stop/restart is requested (None).
        A child the prober found hung is killed here: its exit is a failure like any other."""
        child = self.child
        assert child is not None
        while True:
            if self._hung:
                self._log("child hung: killing", pid=child.pid, reason=self._hung)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child.pid, signal.SIGKILL)
                child.wait()
            code = child.poll()
            if code is not None:
                return code
            if self._stop_requested or self._restart_requested:
                return None
            if time.monotonic() - self._last_beat >= self.beat_s:
                self._poll_restart_key()
                self._publish()
            # Short waits: a child's exit is noticed within 50 ms; signals set _wake to cut it short.
            self._wake.wait(0.05)
            self._wake.clear()

    def _sleep(self, seconds: float) -> None:
        """Back-off sleep, cut short by a stop or restart request."""
        end = time.monotonic() + seconds
        while not self._stop_requested and not self._restart_requested:
            left = end - time.monotonic()
            if left <= 0:
                return
            if time.monotonic() - self._last_beat >= self.beat_s:
                self._poll_restart_key()
                self._publish()
            self._wake.wait(min(left, 0.2))
            self._wake.clear()

    def _finish(self, state: str, code: int, reason: str) -> int:
        self.st.state = state
        self.st.last_reason = reason
        self._log(state, exit=code, reason=reason, restarts=self.st.restarts)
        self._publish(final=True)
        return code

    def run(self) -> int:
        """Supervise until the child finishes, the supervisor is stopped, or it gives up.
        Returns 0 on a clean finish or stop, else the child's last exit (128+N for signal N)."""
        self._reap_previous()
        if self.probe != "none":
            self._prober.start()
        while True:
            if self._stop_requested:
                return self._finish(STOPPED, 0, "stop requested")
            self._restart_requested = ""
            self._spawn()
            code = self._wait_child()
            assert self.child is not None and self.st.child_started is not None
            ran_s = time.time() - self.st.child_started
            if code is None:  # stop or restart requested while the child ran
                self.st.state = STOPPING
                self._publish()
                reason = "stop requested" if self._stop_requested else self._restart_requested
                self._log("stopping child", pid=self.child.pid, reason=reason)
                code = self._terminate_child()
                self._record_exit(code, reason)
                if self._stop_requested:
                    return self._finish(STOPPED, 0, "stop requested")
                self.st.restarts += 1
                self.st.failures = 0
                continue
            # The child exited on its own (or was killed as hung). Its group may still hold
            # workers: clean them up.
            self._terminate_child()
            self._record_exit(code, self._hung or "exited")
            if code == 0:
                return self._finish(EXITED, 0, "exited 0")
            if code == FATAL_EXIT:
                return self._finish(FAILED, code, f"exited {code}: cannot succeed if restarted (see its log)")
            self.st.failures = 1 if ran_s >= self.policy.reset_after_s else self.st.failures + 1
            exit_code = 128 - code if code < 0 else code
            if self.st.failures > self.policy.max_restarts:
                return self._finish(
                    FAILED,
                    exit_code,
                    f"gave up after {self.st.failures} consecutive failures (last exit {code})",
                )
            delay = self.policy.delay(self.st.failures)
            self.st.state = BACKOFF
            self._log("child failed: restarting", exit=code, ran_s=round(ran_s, 2), backoff_s=delay)
            self._publish()
            self._sleep(delay)
            self.st.restarts += 1

    def _record_exit(self, code: int, reason: str) -> None:
        self._write_pid_file(None)
        self.st.last_exit = code
        self.st.last_exit_at = time.time()
        self.st.last_reason = reason
        self.st.child_pid = None
        self._log("child exited", exit=code, reason=reason)


# ---------------------------------------------------------------------- control side


def read_states(r: redis.Redis, prefix: str) -> list[dict[str, Any]]:
    """Every supervisor of a run that reported recently (or ended within a day), sorted by name."""
    return supervisor_states(r, Keys(prefix))


def matches(name: str, service: str) -> bool:
    """`decode` names every decode replica, `decode.1` exactly one."""
    return name == service or name.startswith(service + ".")


def request_restart(r: redis.Redis, prefix: str, service: str) -> list[str]:
    """Ask the supervisors of `service` to restart their child; returns the names asked.
    Raises LookupError (listing the known names) when no live supervisor matches."""
    states = [s for s in read_states(r, prefix) if s["state"] not in FINAL_STATES]
    names = [s["name"] for s in states if matches(s["name"], service)]
    if not names:
        known = ", ".join(s["name"] for s in states) or "none"
        raise LookupError(f"no running service matches {service!r} (running: {known})")
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
    for n in names:
        # Expires so a request for a supervisor that died meanwhile cannot fire much later.
        r.set(Keys(prefix).supervisor_restart(n), stamp, ex=120)
    return names


def supervisor_argv(
    name: str,
    argv: Sequence[str],
    policy: RestartPolicy,
    redis_url: str = "",
    prefix: str = "",
    probe: str = "http",
    pid_file: str | Path = "",
    log: str | Path = "",
) -> list[str]:
    """The command line that runs `argv` under a supervisor (what the executors start)."""
    out = [sys.executable, "-m", "sbatch.supervisor", "--name", name]
    if redis_url:
        out += ["--redis-url", redis_url, "--prefix", prefix]
    if pid_file:
        out += ["--pid-file", str(pid_file)]
    if log:
        out += ["--log", str(log)]
    out += [
        f"--max-restarts={policy.max_restarts}",
        f"--backoff-s={policy.backoff_s}",
        f"--backoff-max-s={policy.backoff_max_s}",
        f"--reset-after-s={policy.reset_after_s}",
        f"--stop-timeout-s={policy.stop_timeout_s}",
        f"--probe={probe}",
        f"--probe-interval-s={policy.probe_interval_s}",
        f"--probe-timeout-s={policy.probe_timeout_s}",
        f"--probe-failures={policy.probe_failures}",
        "--",
        *argv,
    ]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sbatch.supervisor", description=__doc__.split("\n\n")[0])
    p.add_argument("--name", required=True, help="service name, e.g. decode.0")
    p.add_argument("--redis-url", default="")
    p.add_argument("--prefix", default="", help="the run's Redis key prefix")
    p.add_argument(
        "--log", default="", help="append the child's output and our events here (default: stdout)"
    )
    d = RestartPolicy()
    p.add_argument("--max-restarts", type=int, default=d.max_restarts)
    p.add_argument("--backoff-s", type=float, default=d.backoff_s)
    p.add_argument("--backoff-max-s", type=float, default=d.backoff_max_s)
    p.add_argument("--reset-after-s", type=float, default=d.reset_after_s)
    p.add_argument("--stop-timeout-s", type=float, default=d.stop_timeout_s)
    p.add_argument("--probe", choices=PROBES, default="http", help="liveness probe of the child")
    p.add_argument("--probe-interval-s", type=float, default=d.probe_interval_s, help="0: no probe")
    p.add_argument("--probe-timeout-s", type=float, default=d.probe_timeout_s)
    p.add_argument("--probe-failures", type=int, default=d.probe_failures)
    p.add_argument("--pid-file", default="", help="where the child's pid is kept (see above)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run")
    args = p.parse_args(argv)
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        p.error("no command given (put it after --)")
    if args.redis_url and not args.prefix:
        p.error("--redis-url needs --prefix")
    policy = RestartPolicy(
        max_restarts=args.max_restarts,
        backoff_s=args.backoff_s,
        backoff_max_s=args.backoff_max_s,
        reset_after_s=args.reset_after_s,
        stop_timeout_s=args.stop_timeout_s,
        probe_interval_s=args.probe_interval_s,
        probe_timeout_s=args.probe_timeout_s,
        probe_failures=args.probe_failures,
    )
    log = open(args.log, "ab", buffering=0) if args.log else sys.stdout.buffer  # noqa: SIM115 - lives as long as we do
    sup = Supervisor(
        args.name, cmd, policy, args.redis_url, args.prefix, log=log, probe=args.probe, pid_file=args.pid_file
    )
    sup.install_signal_handlers()
    return sup.run()


if __name__ == "__main__":
    sys.exit(main())
