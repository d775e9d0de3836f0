"""64 concurrent swe-real sessions on one sandbox service: each opens a session (a copy-on-write
view of the project's base), runs the project's whole test suite through the env's run_tests
tool, and is scored (the suite again, in a fresh view). Reports failures, session start latency
(POST /v1/sessions, which mounts the view and applies the bug; one at a time, and during the 64
concurrent starts) and the wall time, twice in one process: first the baseline, session starts
on the shared request threadpool (`sandbox.session_start_threads = 0`), then starts on their
own threads (the default); and a plain copy of the base (the fallback without root).

    python -m bench.sandbox.swe_sessions [--sessions 64] [--project inflection] [--out bench/sandbox/swe_sessions.json]

Needs root and bubblewrap. CPU heavy: bounded by --sessions (two to four minutes at 64 on 2 cores: the workload runs twice).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from bench.machine import machine
from bench.results import write_result
from services.common.auth import auth_headers, standalone_secrets
from services.common.bus import Bus
from services.common.config import REPO_ROOT, RunConfig
from services.common.redis_server import RedisServer
from services.sandbox.swe_real.base import ensure_base
from services.sandbox.swe_real.projects import BY_NAME
from services.sandbox.swe_real.tasks import build, write_index

CALL = '<tool_call>\n{"name": "run_tests", "arguments": {}}\n</tool_call>'


def run_sandbox(
    work: Path, redis_url: str, name: str, sessions: int, start_threads: int
) -> tuple[list[dict[str, object]], list[float], list[float], float]:
    """One sandbox process with `sandbox.session_start_threads = start_threads`: 8 session
    starts one at a time, then `sessions` concurrent sessions (start, run_tests, score) and,
    once they are all running their suites, 8 more starts one at a time (what a new rollout
    group meets in training). Returns the sessions' results, the lone start times, the starts
    under load and the concurrent wall time."""
    cfg = RunConfig()
    cfg.redis.url, cfg.redis.prefix = redis_url, f"bench-swe-{name}"
    cfg.sandbox.workdir_root = str(work / f"sessions-{name}")
    cfg.sandbox.max_concurrent_execs = sessions
    cfg.sandbox.exec_timeout_s = 300
    cfg.sandbox.session_start_threads = start_threads
    (work / f"{name}.json").write_text(cfg.dump())
    env = {**os.environ, "RELAY_SWE_TASKS": str(work / "tasks.jsonl")}
    with open(work / f"{name}.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.sandbox", "--config", str(work / f"{name}.json"),
             "--redis-url", redis_url],
            cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        bus = Bus(redis_url, f"bench-swe-{name}")
        deadline = time.monotonic() + 60
        while not bus.services("sandbox"):
            assert proc.poll() is None and time.monotonic() < deadline, (work / f"{name}.log").read_text()
            time.sleep(0.1)
        url = bus.services("sandbox")[0].url
        time.sleep(0.5)

        started = threading.Semaphore(0)

        def session(i: int) -> dict[str, object]:
            with httpx.Client(base_url=url, timeout=600, headers=auth_headers()) as c:
                t0 = time.perf_counter()
                r = c.post("/v1/sessions", json={"env": "swe-real", "seed": i})
                start = time.perf_counter() - t0
                started.release()
                if r.status_code != 200:
                    return {"ok": False, "error": r.text[:300], "start_s": start}
                sid = r.json()["session_id"]
                step = c.post(f"/v1/sessions/{sid}/step", json={"action": CALL})
                obs = step.json().get("observation", "") if step.status_code == 200 else step.text
                ran = "passed" in obs or "failed" in obs
                score = c.post(f"/v1/sessions/{sid}/score")
                ok = step.status_code == 200 and score.status_code == 200 and ran
                return {"ok": ok, "start_s": start, "reward": score.json().get("reward"), "ran": ran,
                        "error": None if ok else (obs[-300:] + score.text[:300])}  # fmt: skip

        alone = []  # one session at a time: the start itself, without 63 others' contention
        with httpx.Client(base_url=url, timeout=60, headers=auth_headers()) as c:
            for i in range(8):
                t0 = time.perf_counter()
                r = c.post("/v1/sessions", json={"env": "swe-real", "seed": i})
                alone.append(time.perf_counter() - t0)
                c.delete(f"/v1/sessions/{r.json()['session_id']}")

        def probe() -> list[float]:
            """Starts while every session is in its suite (the steps hold request threads)."""
            for _ in range(sessions):
                started.acquire()
            time.sleep(2.0)  # the last ones' steps are in flight
            out = []
            with httpx.Client(base_url=url, timeout=600, headers=auth_headers()) as c:
                for i in range(8):
                    t0 = time.perf_counter()
                    r = c.post("/v1/sessions", json={"env": "swe-real", "seed": 100 + i})
                    out.append(time.perf_counter() - t0)
                    c.delete(f"/v1/sessions/{r.json()['session_id']}")
            return out

        t0 = time.perf_counter()
        with ThreadPoolExecutor(sessions + 1) as pool:
            under_load = pool.submit(probe)
            results = list(pool.map(session, range(sessions)))
            loaded = under_load.result()
        return results, alone, loaded, time.perf_counter() - t0
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def summary(
    results: list[dict[str, object]], alone: list[float], loaded: list[float], wall: float
) -> dict[str, object]:
    starts = sorted(float(r["start_s"]) for r in results)  # type: ignore[arg-type]
    return {
        "session_start_while_suites_run_s": {
            "median": round(statistics.median(loaded), 4), "max": round(max(loaded), 4),
        },
        "failures": sum(1 for r in results if not r["ok"]),
        "errors": [r["error"] for r in results if not r["ok"]][:5],
        "wall_s": round(wall, 2),
        "session_start_alone_s": {"median": round(statistics.median(alone), 4), "max": round(max(alone), 4)},
        "session_start_concurrent_s": {"median": round(statistics.median(starts), 4), "max": round(starts[-1], 4)},
        "rewards": sorted({r["reward"] for r in results if r["ok"]}),  # the unfixed bug: 0
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sessions", type=int, default=64)
    ap.add_argument("--project", default="inflection")
    ap.add_argument("--start-threads", type=int, default=RunConfig().sandbox.session_start_threads)
    ap.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "sandbox" / "swe_sessions.json")
    a = ap.parse_args()
    project = BY_NAME[a.project]
    work = Path(tempfile.mkdtemp(prefix="relay-bench-swe-"))
    work.chmod(0o711)
    try:
        tasks = build(0, 4, (project,), log=lambda m: None)  # verification results are cached
        write_index(tasks, work / "tasks.jsonl")
        base = ensure_base(project) / "src"
        copies = []
        for i in range(8):  # what a session start costs without copy-on-write
            t0 = time.perf_counter()
            shutil.copytree(base, work / f"copy{i}", symlinks=True)
            copies.append(time.perf_counter() - t0)
        standalone_secrets()  # the sandboxes it starts and the clients below use them
        with RedisServer(work / "redis") as redis:
            # The baseline first: starts on the shared request threadpool (session_start_threads
            # = 0), then the same workload with starts on their own threads.
            shared = summary(*run_sandbox(work, redis.url, "shared", a.sessions, 0))
            own = summary(*run_sandbox(work, redis.url, "own", a.sessions, a.start_threads))

        def ratio(key: str, stat: str) -> float | None:
            mine, base = own[key][stat], shared[key][stat]  # type: ignore[index]
            return round(base / mine, 1) if mine else None

        out = {
            "command": "python -m bench.sandbox.swe_sessions " + " ".join(sys.argv[1:]),
            "machine": machine(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "project": project.key,
            "sessions": a.sessions,
            "session_start_threads": a.start_threads,
            **own,
            "baseline_shared_threadpool": shared,
            # baseline / this: the worst start is what a queued start costs (the median start
            # rarely queues: most of them find a free thread either way)
            "speedup": {
                "start_while_suites_run_max": ratio("session_start_while_suites_run_s", "max"),
                "start_concurrent_max": ratio("session_start_concurrent_s", "max"),
                "start_concurrent_median": ratio("session_start_concurrent_s", "median"),
            },
            "baseline_copy_s": {"median": round(statistics.median(copies), 4), "max": round(max(copies), 4)},
        }
        print(json.dumps(out, indent=2))
        write_result(a.out, out)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
