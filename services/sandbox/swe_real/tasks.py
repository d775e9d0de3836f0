"""The real-repository task factory: mutate, verify against the project's own tests in the
sandbox, keep, index.

A mutation becomes a task only if, run in a sandbox workspace over the project's base, some tests
fail with it (`fail_to_pass`), not every test does (a module that no longer imports is not a bug
report), and the unmutated project passes all of them (checked once per project). Everything is
drawn from `random.Random(f"{seed}:{project}")`, so a seed gives the same task set; verification
results are cached per (project, mutation) in `<cache>/verified.jsonl`, so a rebuild re-runs
nothing it has run, and `build` can be stopped and resumed (`make tasks`).
"""

from __future__ import annotations

import hashlib
import json
import random
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from services.sandbox.isolation import Limits, Workspace, WorkspaceManager
from services.sandbox.swe_real.base import DEFAULT_CACHE, DEPS_INSIDE, ensure_base, test_command
from services.sandbox.swe_real.mutate import Mutation, candidates
from services.sandbox.swe_real.projects import PROJECTS, Project

RUN_LIMITS = Limits(timeout_s=240, cpu_s=240, memory_mb=2048, max_procs=64, output_bytes=1 << 20, tmp_mb=256)
MAX_FAIL_SHARE = 0.5  # more failing tests than this share: the mutation breaks the module, not a bug


@dataclass(frozen=True)
class TestRun:
    failed: list[str]
    passed: int
    code: int
    output: str


@dataclass(frozen=True)
class Task:
    id: str
    project: str
    version: str
    mutation: dict[str, Any]
    fail_to_pass: list[str]
    passed_before: int  # tests passing without the bug
    statement: str

    def mutation_obj(self) -> Mutation:
        return Mutation(**self.mutation)


def workspace(mgr: WorkspaceManager, project: Project, cache: Path = DEFAULT_CACHE) -> Workspace:
    base = ensure_base(project, cache)
    return mgr.create(base / "src", {base / "deps": DEPS_INSIDE})


def run_tests(ws: Workspace, project: Project, limits: Limits = RUN_LIMITS) -> TestRun:
    r = ws.run(test_command(project), limits=limits)
    line = next((ln for ln in reversed(r.stdout.splitlines()) if ln.startswith("RELAY-REPORT ")), None)
    if line is None:
        return TestRun(["run: no report"], 0, r.exit_code, (r.stdout + r.stderr)[-4000:])
    out = json.loads(line[len("RELAY-REPORT ") :])
    return TestRun(out["failed"], out["passed"], out["code"], r.stdout[-8000:])


def mutation_id(project: Project, m: Mutation) -> str:
    h = hashlib.sha256(f"{project.key}:{m.path}:{m.start}:{m.end}:{m.after}".encode()).hexdigest()
    return f"{project.name}.{h[:12]}"


def project_mutations(project: Project, seed: int, cache: Path = DEFAULT_CACHE) -> list[Mutation]:
    """Every candidate mutation of the project's source files, in the seed's order."""
    src = ensure_base(project, cache) / "src"
    out: list[Mutation] = []
    for rel in project.src:
        out += candidates(rel, (src / rel).read_text())
    random.Random(f"{seed}:{project.key}").shuffle(out)
    return out


def statement(project: Project, m: Mutation, failed: list[str], output: str) -> str:
    """An issue report written from the failing tests: what fails and how, not where the bug is."""
    names = [f.split("::")[-1] for f in failed]
    shown = "\n".join(f"- `{f}`" for f in failed[:12]) + (
        f"\n- ... and {len(failed) - 12} more" if len(failed) > 12 else ""
    )
    # pytest's -q summary lines ("FAILED test::name - AssertionError: ...") say how they fail
    reasons = [ln for ln in output.splitlines() if ln.startswith(("FAILED ", "ERROR "))][:5]
    how = ("\n\nThe test run reports:\n```\n" + "\n".join(reasons) + "\n```") if reasons else ""
    return (
        f"# {project.name} {project.version}: {names[0]} fails\n\n"
        f"After a recent change, {len(failed)} test(s) of {project.name}'s own suite fail:\n\n{shown}{how}\n\n"
        "Find the bug in the library and fix it. Do not change the tests: the fix is checked against "
        "the project's test suite, and every test that passes now must still pass."
    )


class Verifier:
    """Runs mutations against a project's suite in sandbox workspaces, with a result cache."""

    def __init__(self, mgr: WorkspaceManager, cache: Path = DEFAULT_CACHE, results: Path | None = None):
        self.mgr, self.cache = mgr, cache
        self.cache_file = results or cache / "verified.jsonl"
        self._lock = threading.Lock()
        self.done: dict[str, dict[str, Any]] = {}
        # suite runs made by this Verifier (not from the cache) and their seconds: progress, ETA
        self.runs, self.run_s = 0, 0.0
        if self.cache_file.exists():
            text = self.cache_file.read_text()
            if text and not text.endswith("\n"):  # cut mid-append: later records start a line
                with open(self.cache_file, "a") as f:
                    f.write("\n")
            for line in text.splitlines():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut by a stop mid-append: that mutation is run again
                if isinstance(rec, dict) and "id" in rec:
                    self.done[rec["id"]] = rec

    def _record(self, rec: dict[str, Any]) -> None:
        with self._lock:
            self.done[rec["id"]] = rec
            with open(self.cache_file, "a") as f:
                f.write(json.dumps(rec) + "\n")

    def _run(self, ws: Workspace, project: Project) -> TestRun:
        t0 = time.monotonic()
        run = run_tests(ws, project)
        with self._lock:
            self.runs += 1
            self.run_s += time.monotonic() - t0
        return run

    def baseline(self, project: Project) -> TestRun:
        """The unmutated project's run (cached like the mutations': a resumed build skips it)."""
        key = f"{project.key}:baseline"
        rec = self.done.get(key)
        if rec is None:
            ws = workspace(self.mgr, project, self.cache)
            try:
                run = self._run(ws, project)
            finally:
                self.mgr.release(ws)
            rec = {"id": key, "failed": run.failed, "passed": run.passed, "code": run.code}
            if not run.failed:  # a failing baseline may be the machine's fault: try it again next time
                self._record(rec)
            return run
        return TestRun(rec["failed"], rec["passed"], rec["code"], "")

    def verify(self, project: Project, m: Mutation, passed_before: int) -> Task | None:
        mid = mutation_id(project, m)
        rec = self.done.get(mid)
        if rec is None:
            src = ensure_base(project, self.cache) / "src" / m.path
            ws = workspace(self.mgr, project, self.cache)
            try:
                ws.seed_files({m.path: m.apply(src.read_text())})
                run = self._run(ws, project)
            finally:
                self.mgr.release(ws)
            rec = {"id": mid, "failed": run.failed, "output": run.output[-3000:]}
            self._record(rec)
        failed = rec["failed"]
        if not failed or any(f.startswith(("collect:", "run:")) for f in failed):
            return None
        if len(failed) > MAX_FAIL_SHARE * (passed_before + 0):
            return None
        return Task(
            mid,
            project.name,
            project.version,
            asdict(m),
            failed,
            passed_before,
            statement(project, m, failed, rec["output"]),
        )


def build(
    seed: int,
    total: int,
    projects: tuple[Project, ...] = PROJECTS,
    mgr: WorkspaceManager | None = None,
    cache: Path = DEFAULT_CACHE,
    workers: int = 2,
    max_tries: int | None = None,
    log: Any = print,
    results: Path | None = None,
    progress_s: float = 30.0,
) -> list[Task]:
    """At least `total` verified tasks if the projects have them, spread over the projects: in
    rounds, each project's next mutations (in the seed's order) are verified until it holds
    `ceil(total / projects)` tasks, then projects with mutations left make up for those that ran
    out, up to twice that share each. `max_tries` bounds the mutations tried per project;
    `results`: the verification cache (default `<cache>/verified.jsonl`). Logs a progress line
    at most every `progress_s` seconds (tasks kept, suite runs and their mean time, an ETA)."""
    mgr = mgr or WorkspaceManager.temporary(max_concurrent=workers)
    ver = Verifier(mgr, cache, results)
    t0 = last = time.monotonic()

    def progress(final: bool = False) -> None:
        nonlocal last
        now = time.monotonic()
        if not final and now - last < progress_s:
            return
        last = now
        n, tried = sum(len(v) for v in kept.values()), sum(pos.values())
        line = f"progress: {n}/{total} tasks kept, {tried} mutations tried, {ver.runs} suite runs"
        if ver.runs:
            line += f" ({ver.run_s / ver.runs:.1f} s each)"
            fresh = max(1, tried - cached_at_start)
            per_task = max(tried, 1) / max(n, 1)  # mutations tried per task kept so far
            eta = (total - n) * per_task * (now - t0) / fresh if n < total else 0.0
            line += f", {now - t0:.0f} s elapsed, ~{eta / 60:.0f} min left"
        log(line)

    share = -(-total // len(projects))
    live: dict[str, tuple[Project, list[Mutation], int]] = {}
    kept: dict[str, list[Task]] = {}
    for p in projects:
        base = ver.baseline(p)
        if base.failed:
            log(f"{p.key}: its own suite fails without a bug ({base.failed[:3]}); skipped")
            continue
        live[p.name] = (p, project_mutations(p, seed, cache)[: max_tries or None], base.passed)
        kept[p.name] = []
    pos = dict.fromkeys(live, 0)
    cached_at_start = 0  # mutations whose result came from the cache (cost no run)
    with ThreadPoolExecutor(workers) as pool:
        for cap in (share, 2 * share):
            while True:
                n = sum(len(v) for v in kept.values())
                todo = [k for k, (_, muts, _) in live.items() if len(kept[k]) < cap and pos[k] < len(muts)]
                if not todo or (cap > share and n >= total):
                    break
                for k in todo:
                    p, muts, passed = live[k]
                    chunk = muts[pos[k] : pos[k] + 4 * workers]
                    pos[k] += len(chunk)
                    cached_at_start += sum(mutation_id(p, m) in ver.done for m in chunk)
                    for t in pool.map(lambda m, p=p, n=passed: ver.verify(p, m, n), chunk):
                        if t is not None and len(kept[k]) < cap:
                            kept[k].append(t)
                    progress()
            for k, ts in kept.items():
                log(f"{live[k][0].key}: {len(ts)} tasks after {pos[k]} of {len(live[k][1])} mutations")
            if sum(len(v) for v in kept.values()) >= total:
                break
    progress(final=True)
    return [t for k in live for t in kept[k]]


def _chunks(xs: list[Mutation], n: int) -> Iterator[list[Mutation]]:
    for i in range(0, len(xs), n):
        yield xs[i : i + n]


def write_index(tasks: list[Task], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(asdict(t)) + "\n" for t in tasks))
    tmp.rename(path)


def read_index(path: Path) -> list[Task]:
    return [Task(**json.loads(line)) for line in path.read_text().splitlines() if line.strip()]
