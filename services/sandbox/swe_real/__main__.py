"""Build and verify the real-repository task set (what `make tasks` runs):

    python -m services.sandbox.swe_real --seed 0 --tasks 500 [--projects inflection,six] [--out PATH]

Builds each project's base (pip), tries its mutations in the seed's order in sandbox workspaces
and keeps the verified ones, spread over the projects (tasks.build), then writes the index
(`.cache/swe-real/tasks.jsonl` by default: what the swe-real env reads). Verification results are
cached (`verified.jsonl`, one line per suite run, appended as it finishes), so a stopped build
(Ctrl-C, a killed job) resumes where it was when run again, and a rebuild from the same seed is
the same set. Prints a progress line every `--progress-s` seconds: tasks kept, mutations tried,
suite runs and their mean time, the time left at the current rate. Needs root and bubblewrap,
as the sandbox does."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from services.sandbox.isolation import WorkspaceManager
from services.sandbox.swe_real.base import DEFAULT_CACHE
from services.sandbox.swe_real.projects import BY_NAME, PROJECTS
from services.sandbox.swe_real.tasks import build, write_index


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tasks", type=int, default=500, help="how many tasks in all (spread over the projects)")
    ap.add_argument("--projects", default="", help="comma-separated names (default: all)")
    ap.add_argument("--out", type=Path, default=DEFAULT_CACHE / "tasks.jsonl")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--progress-s", type=float, default=30.0, help="seconds between progress lines")
    a = ap.parse_args()
    projects = tuple(BY_NAME[n] for n in a.projects.split(",")) if a.projects else PROJECTS
    t0 = time.monotonic()
    mgr = WorkspaceManager.temporary(max_concurrent=a.workers)
    try:
        tasks = build(
            a.seed, a.tasks, projects, mgr, workers=a.workers, log=lambda m: print(m, flush=True),
            progress_s=a.progress_s,
        )  # fmt: skip
    except KeyboardInterrupt:
        sys.exit("stopped: every finished suite run is cached; run it again (make tasks) to resume")
    finally:
        mgr.shutdown()
    write_index(tasks, a.out)
    names = {t.project for t in tasks}
    print(
        f"{len(tasks)} verified tasks from {len(names)} projects in {time.monotonic() - t0:.0f} s -> {a.out}"
    )
    if len(tasks) < a.tasks or len(names) < min(10, len(projects)):
        sys.exit(f"wanted {a.tasks} tasks from at least {min(10, len(projects))} projects")


if __name__ == "__main__":
    main()
