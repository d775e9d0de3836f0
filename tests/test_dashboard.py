"""The live dashboard in a real headless Chromium against a running debug pipeline: the launch
prints its URL, every chart has data points after the page's scripts ran, the health table
lists every service, the rollout browser opens a trained rollout's turns with per-token
advantages, and the orchestrator's Prometheus /metrics carries every chart's series. Then
`make stop` (python -m sbatch.launch stop) ends the run and says what it stopped."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from html.parser import HTMLParser
from pathlib import Path

import httpx
import pytest

from services.common.auth import bearer, load_run_secrets
from services.common.config import REPO_ROOT
from services.common.redis_server import RedisServer

pytestmark = pytest.mark.slow


class Elements(HTMLParser):
    """Every element's attributes, by id and by tag, from the DOM Chromium dumped."""

    def __init__(self) -> None:
        super().__init__()
        self.all: list[tuple[str, dict[str, str]]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.all.append((tag, {k: v or "" for k, v in attrs}))

    def by_id(self, ident: str) -> dict[str, str]:
        return next(a for _, a in self.all if a.get("id") == ident)

    def having(self, attr: str) -> list[dict[str, str]]:
        return [a for _, a in self.all if attr in a]


def browser() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        pytest.skip("chromium is not installed (make test installs Debian's package)")
    return found


def dump_dom(chromium: str, url: str, tmp: Path) -> Elements:
    """Load `url` and dump the DOM once its scripts have run (virtual time: timers and fetches
    complete, the 2 s polls run a few times, then the page is read)."""
    out = subprocess.run(
        [
            chromium,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            f"--user-data-dir={tmp / 'chromium'}",
            "--virtual-time-budget=8000",
            "--dump-dom",
            url,
        ],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and "<html" in out.stdout, out.stderr[-2000:]
    page = Elements()
    page.feed(out.stdout)
    return page


def test_dashboard_in_chromium_against_a_running_pipeline(tmp_path: Path) -> None:
    chromium = browser()
    run_dir = tmp_path / "run"
    with RedisServer(tmp_path / "redis") as redis:
        cmd = [
            sys.executable, "-m", "sbatch.launch", "run", "debug", f"--run.dir={run_dir}",
            f"--redis.url={redis.url}", "--run.max_steps=10000", "--run.stop_on_targets=false",
            "--run.timeout_s=600", "--orchestrator.batch_size=8", "--orchestrator.group_size=4",
        ]  # fmt: skip
        out = tmp_path / "launch.out"
        with out.open("w") as f:
            launch = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=f, stderr=subprocess.STDOUT, text=True)
        try:
            deadline = time.monotonic() + 240
            metrics = run_dir / "metrics.jsonl"
            while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 4):
                assert launch.poll() is None, out.read_text()[-3000:]
                assert time.monotonic() < deadline, out.read_text()[-3000:]
                time.sleep(0.5)
            # The launch's first lines link the dashboard.
            m = re.search(r"dashboard (http://\S+/dashboard)", out.read_text())
            assert m, out.read_text()[:2000]
            dash = m.group(1)
            base = dash.removesuffix("/dashboard")

            spec = httpx.get(f"{base}/v1/dashboard").json()
            # The rollout browser's routes need the run's token; the page takes it from its address.
            token = load_run_secrets(run_dir).token
            auth = bearer(token)
            trained = httpx.get(
                f"{base}/v1/rollouts", params={"status": "trained", "limit": 1}, headers=auth
            ).json()
            (row,) = trained["rollouts"]
            page = dump_dom(chromium, f"{dash}#token={token}&rollout={row['id']}", tmp_path)

            assert page.having("data-ready"), "the page's start-up did not finish"
            assert not page.having("data-error"), page.having("data-error")
            charts = {a["id"]: int(a["data-points"]) for a in page.having("data-points")}
            assert set(charts) == {f"chart-{c['id']}" for c in spec["charts"]}
            assert all(n > 0 for n in charts.values()), charts
            # The health table lists every service the launcher started.
            services = set(json.loads((run_dir / "pids.json").read_text())) - {"launcher", "redis"}
            assert services == {"sandbox.0", "decode.0", "trainer", "orchestrator"}
            listed = {a["data-name"] for a in page.having("data-name")}
            assert services <= listed, listed
            assert int(page.by_id("health")["data-services"]) == len(listed)
            # The rollout browser: a page of rows, and the linked rollout's turns with advantages.
            assert int(page.by_id("rollouts")["data-rows"]) > 0
            assert page.by_id("rollout").get("data-id") == row["id"]
            # ... every model token of every sample, shaded by the advantage it was trained with.
            detail = httpx.get(f"{base}/v1/rollouts/{row['id']}", headers=auth).json()
            want = [
                a for smp in detail["samples"] for seg in smp["segments"] if seg["role"] == "model"
                for a in seg["advantages"]
            ]  # fmt: skip
            shown = [float(a["data-adv"]) for a in page.having("data-adv")]
            assert want and shown == pytest.approx(want)
            assert len(page.having("data-sample")) == len(detail["samples"])

            # Prometheus on the orchestrator carries every chart's series.
            prom = httpx.get(f"{base}/metrics").text
            for chart in spec["charts"]:
                for s in chart["series"]:
                    assert re.search(rf"^{s['metric']}(_total)?[{{ ]", prom, re.M), s["metric"]
            assert re.search(r'^relay_service_up\{service="decode.0"\} 1.0', prom, re.M)
            assert re.search(r'^relay_service_restarts_total\{service="trainer"\} 0.0', prom, re.M)

            stop = subprocess.run(
                [sys.executable, "-m", "sbatch.launch", "stop"],
                cwd=REPO_ROOT,
                env={**os.environ, "RELAY_RUN_DIR": str(run_dir)},
                capture_output=True,
                text=True,
                timeout=180,
            )
            assert stop.returncode == 0 and f"stopped run {run_dir.name}" in stop.stdout, stop.stdout
            assert launch.wait(30) == 130
            assert json.loads((run_dir / "summary.json").read_text())["status"] == "stopped"
        finally:
            if launch.poll() is None:
                launch.terminate()
                launch.wait(60)
