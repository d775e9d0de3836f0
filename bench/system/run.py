"""relay as one system: the whole pipeline, asynchronous and then synchronous, for the same window.

    bash bench/system/run_gpu.sh                        # one GPU (device tool): about 8-9 minutes
    python bench/system/run.py --smoke --out /tmp/s.json  # CPU, tiny model: checks the script

Each run is started by the launcher `make launch` uses (`python -m sbatch.launch run CONFIG`, the
local executor: Redis, sandbox, decode, trainer and orchestrator as supervised processes), with
configs/system-moe.toml (--smoke: configs/system-moe-smoke.toml):
  async  the config as it is (orchestrator.max_off_policy_steps >= 1): generation never waits for
         training, within the staleness bound;
  sync   orchestrator.max_off_policy_steps = 0: the orchestrator starts the groups of step v only
         once version v is live on every decode, and the trainer trains a batch only once it is
         whole, so generation and training alternate as in verl/slime-style loops.
The window opens when the orchestrator starts producing rollouts ("orchestrator running" in its
log); decode's and the orchestrator's /metrics are scraped then and when it closes, after which
the run is stopped through the launcher's own stop key (the trainer finishes its step and exits).
The report (bench/system/report.py) is computed from each run's files; bench_window.json in each
run directory holds the window and the scrapes. Both runs share every other setting (--set).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.results import write_result  # noqa: E402
from bench.system.report import compare, log_events, run_report, table  # noqa: E402
from sbatch.launch import run_redis_url  # noqa: E402
from services.common.bus import Bus  # noqa: E402
from services.common.config import ConfigError, RunConfig, load_config, load_resolved  # noqa: E402

MODES = ("async", "sync")


def mode_overrides(mode: str, config: str, sets: list[str]) -> list[str]:
    """The dotted overrides of one mode: the user's, then what makes the run synchronous."""
    cfg = load_config(config, sets)
    if mode == "async":
        if cfg.orchestrator.max_off_policy_steps < 1:
            raise ValueError(f"{config}: the asynchronous run needs orchestrator.max_off_policy_steps >= 1")
        return sets
    # max_inflight_groups = batch_size: what the staleness bound allows at 0 anyway, said outright.
    return [
        *sets,
        "--orchestrator.max_off_policy_steps=0",
        f"--orchestrator.max_inflight_groups={cfg.orchestrator.batch_size}",
    ]


def scrape(url: str) -> str:
    return httpx.get(f"{url}/metrics", timeout=20).text


def scrape_all(bus: Bus) -> dict[str, str]:
    """Prometheus text of every live decode replica (by id) and of the orchestrator."""
    out = {f"decode:{s.id}": scrape(s.url) for s in bus.services("decode")}
    orch = bus.services("orchestrator")
    if orch:
        out["orchestrator"] = scrape(orch[0].url)
    return out


def _resolved(path: Path) -> RunConfig | None:
    """The run's resolved config once the launcher has written it whole."""
    try:
        return load_resolved(path)
    except (FileNotFoundError, ConfigError):
        return None


def _wait_for(what: str, check: Any, launcher: subprocess.Popen[bytes], deadline: float) -> Any:
    while True:
        got = check()
        if got:
            return got
        if launcher.poll() is not None:
            raise RuntimeError(f"the launcher exited ({launcher.returncode}) before {what}")
        if time.time() > deadline:
            raise RuntimeError(f"no {what} within the start-up limit")
        time.sleep(0.25)


def run_mode(
    mode: str, config: str, sets: list[str], runs_dir: Path, window_s: float, startup_s: float
) -> Path:
    run_dir = runs_dir / mode
    if run_dir.exists():
        shutil.rmtree(run_dir)
    budget = startup_s + window_s + 60
    overrides = [
        *mode_overrides(mode, config, sets),
        f"--run.dir={run_dir}",
        f"--run.name=system-{mode}",
        f"--run.time_budget_s={budget}",  # a safety net: this script stops the run at the window's end
        f"--run.timeout_s={budget + 120}",
    ]
    cmd = [sys.executable, "-m", "sbatch.launch", "run", config, *overrides]
    print(f"== {mode}: {' '.join(cmd[1:])}", flush=True)
    runs_dir.mkdir(parents=True, exist_ok=True)
    launched = time.time()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    with open(runs_dir / f"{mode}.launch.txt", "wb") as out:
        launcher = subprocess.Popen(
            cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    try:
        deadline = launched + startup_s
        cfg = _wait_for("config.json", lambda: _resolved(run_dir / "config.json"), launcher, deadline)
        bus = Bus(run_redis_url(run_dir, cfg), cfg.redis.prefix)  # with RUN_DIR/secrets.json's password
        started = _wait_for(
            "rollouts (orchestrator running)",
            lambda: log_events(run_dir / "logs" / "orchestrator.log", "orchestrator running"),
            launcher,
            deadline,
        )
        t0 = float(started[0]["ts"])
        print(
            f"   producing rollouts {t0 - launched:.0f} s after launch; window {window_s:.0f} s", flush=True
        )
        first = scrape_all(bus)
        s0 = time.time()
        while time.time() < t0 + window_s:
            if launcher.poll() is not None:
                raise RuntimeError(
                    f"the run ended ({launcher.returncode}) inside the window: see {run_dir}/logs"
                )
            time.sleep(min(1.0, max(0.0, t0 + window_s - time.time())))
        last = scrape_all(bus)
        s1 = time.time()
        bus.r.set(bus.k.control_stop, "bench/system window closed")
        t1 = time.time()
        missing = set(first) ^ set(last)
        if missing:
            raise RuntimeError(f"services came or went inside the window: {sorted(missing)}")
        window = {
            "mode": mode,
            "launched": launched,
            "t0": t0,
            "t1": t1,
            "scrapes": {
                "t0": s0,
                "t1": s1,
                "decode": {k: {"t0": first[k], "t1": last[k]} for k in first if k.startswith("decode:")},
                "orchestrator": {"t0": first["orchestrator"], "t1": last["orchestrator"]}
                if "orchestrator" in first
                else None,
            },
        }
        (run_dir / "bench_window.json").write_text(json.dumps(window))
        code = launcher.wait(timeout=240)
        print(f"   stopped, launcher exit {code}, {time.time() - t1:.0f} s after the window", flush=True)
    finally:
        if launcher.poll() is None:  # our own launcher (its own process group): stop it and its services
            os.killpg(launcher.pid, signal.SIGTERM)
            try:
                launcher.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(launcher.pid, signal.SIGKILL)
    return run_dir


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--config", default=None, help="run config (default system-moe; --smoke: system-moe-smoke)"
    )
    p.add_argument(
        "--smoke", action="store_true", help="CPU, tiny model, a minute per run: checks the script"
    )
    p.add_argument(
        "--window-s", type=float, default=None, help="measured seconds per run (default 100; smoke 60)"
    )
    p.add_argument(
        "--startup-s", type=float, default=None, help="start-up limit per run (default 240; smoke 120)"
    )
    p.add_argument(
        "--modes", default=",".join(MODES), help="async,sync (either alone, or both in this order)"
    )
    p.add_argument(
        "--runs-dir", default=None, help="where the run directories go (default runs/system-<time>)"
    )
    p.add_argument(
        "--keep-weights", action="store_true", help="keep each run's weights/ (removed by default)"
    )
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override for both runs")
    p.add_argument("--out", default=None, help="report JSON (default RUNS_DIR/report.json)")
    args = p.parse_args(argv)
    config = args.config or ("system-moe-smoke" if args.smoke else "system-moe")
    window_s = args.window_s or (60.0 if args.smoke else 100.0)
    startup_s = args.startup_s or (120.0 if args.smoke else 240.0)
    modes = [m for m in args.modes.split(",") if m]
    if not modes or any(m not in MODES for m in modes):
        p.error(f"--modes: pick from {MODES}")
    sets = [s if s.startswith("--") else f"--{s}" for s in args.set]
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    runs_dir = Path(args.runs_dir or REPO / "runs" / f"system-{stamp}").resolve()
    out = Path(args.out or runs_dir / "report.json")

    from bench.machine import machine

    result: dict[str, Any] = {
        "command": " ".join(["python", *sys.argv]) if argv is None else " ".join(["run.py", *argv]),
        "date": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": machine(),
        "config": config,
        "sets": sets,
        "window_s": window_s,
        "method": (
            "trained tokens per hour = tokens of the trainer steps committed inside the window / window; "
            "busy shares: trainer (step_s + publish_s) / window, decode engine-step seconds / scrape "
            "interval; the synchronous run (max_off_policy_steps = 0) is the baseline, measured on the "
            "same machine after the asynchronous one"
        ),
    }
    runs: dict[str, dict[str, Any]] = {}
    errors: dict[str, str] = {}
    # A mode measured by an earlier call into the same --runs-dir (a split across two calls on one
    # machine) joins the comparison; the modes asked for now are measured again.
    for mode in MODES:
        if mode not in modes and (runs_dir / mode / "bench_window.json").exists():
            runs[mode] = run_report(runs_dir / mode)
            result.setdefault("earlier_call", []).append(mode)
    for mode in modes:
        try:
            run_dir = run_mode(mode, config, sets, runs_dir, window_s, startup_s)
            runs[mode] = run_report(run_dir)
        except Exception as e:  # noqa: BLE001 - report what ran; the other mode still runs
            errors[mode] = f"{type(e).__name__}: {e}"
            print(f"   {mode} failed: {errors[mode]}", flush=True)
        finally:
            if not args.keep_weights:
                shutil.rmtree(runs_dir / mode / "weights", ignore_errors=True)
        # Written after every run: a call cut short keeps what it measured.
        comparison = compare(runs)
        write_result(out, {**result, "runs": runs, "comparison": comparison, "errors": errors})
    if runs:
        print(table({m: runs[m] for m in MODES if m in runs}, compare(runs)))
    print(f"report: {out}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
