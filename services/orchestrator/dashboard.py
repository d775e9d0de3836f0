"""The live dashboard's charts, defined once: the page (static/dashboard.js) draws them from
GET /v1/metrics records, and the orchestrator's Prometheus /metrics exports the same series
(latest step's value, labelled alike), so a Grafana board over /metrics shows what the page does.

The page itself is static (static/dashboard.html, .js, .css, and uPlot vendored under
static/vendor/ with its licence: no CDN, machines may have no internet).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from services.common.bus import Bus
from services.common.config import RunConfig
from services.common.health import health_rows

STATIC = Path(__file__).parent / "static"


@dataclass(frozen=True)
class Series:
    label: str
    # Field of a /v1/metrics record; "a.b" reads record["a"]["b"] (reward_by_env.reverse).
    key: str
    # Prometheus name; series of one chart that share a name differ by `labels`.
    metric: str
    help: str
    labels: dict[str, str] = field(default_factory=dict)
    # The record holds a running total: the page plots the increase per step, Prometheus a counter.
    total: bool = False
    # False: another exporter of this process already serves `metric` (services/orchestrator/metrics.py).
    own: bool = True


@dataclass(frozen=True)
class Chart:
    id: str
    title: str
    unit: str
    series: list[Series]
    # Horizontal reference lines (label, value): task targets, the entropy target.
    marks: list[tuple[str, float]] = field(default_factory=list)
    # Fixed y range (None: fit the data).
    y_range: tuple[float, float] | None = None


def charts(cfg: RunConfig) -> list[Chart]:
    tasks = cfg.orchestrator.tasks
    ent_target = cfg.trainer.entropy_target
    return [
        Chart(
            "reward",
            "Reward per task",
            "mean reward of the step's batch",
            [
                Series(
                    t.env,
                    f"reward_by_env.{t.env}",
                    "relay_trainer_reward",
                    "mean reward per task, last step",
                    {"task": t.env},
                )
                for t in tasks
            ],
            [(f"{t.env} target", t.target) for t in tasks if t.target > 0],
            y_range=(0.0, 1.0),
        ),
        Chart(
            "entropy",
            "Entropy",
            "nats per trained token",
            [Series("entropy", "entropy", "relay_trainer_entropy", "mean token entropy, last step")],
            [("target", ent_target)] if ent_target > 0 else [],
        ),
        Chart(
            "staleness",
            "Staleness",
            "trainer version - sample version",
            [
                Series(
                    "mean",
                    "staleness_mean",
                    "relay_trainer_staleness",
                    "staleness, last step",
                    {"stat": "mean"},
                ),
                Series(
                    "max", "staleness_max", "relay_trainer_staleness", "staleness, last step", {"stat": "max"}
                ),
            ],
            [("bound", float(cfg.orchestrator.max_off_policy_steps))],
        ),
        Chart(
            "throughput",
            "Trainer throughput",
            "tokens/s",
            [
                Series(
                    "tokens/s",
                    "tokens_per_s",
                    "relay_trainer_tokens_per_second",
                    "trained tokens per second of compute, last step",
                )
            ],
        ),
        Chart(
            "waiting",
            "Waiting",
            "seconds per step",
            [
                Series(
                    "trainer wait",
                    "wait_data_s",
                    "relay_trainer_wait_data_seconds",
                    "seconds the trainer waited for data, last step",
                ),
                Series(
                    "decode idle",
                    "decode_idle_s",
                    "relay_run_decode_idle_seconds",
                    "seconds the decode replicas sat idle, summed",
                    total=True,
                ),
            ],
        ),
        Chart(
            "mismatch",
            "Mismatch KL",
            "k3 KL(infer || train) per token",
            [
                Series(
                    "all samples",
                    "mismatch_kl_k3",
                    "relay_trainer_mismatch_kl",
                    "k3 KL(pi_infer || pi_train), last step",
                    {"samples": "all"},
                ),
                Series(
                    "on-policy",
                    "mismatch_kl_k3_on_policy",
                    "relay_trainer_mismatch_kl",
                    "k3 KL(pi_infer || pi_train), last step",
                    {"samples": "on_policy"},
                ),
            ],
        ),
        Chart(
            "versions",
            "Weight versions",
            "version",
            [
                Series(
                    "trainer", "version", "relay_trainer_weight_version", "version the trainer published last"
                ),
                Series(
                    "served",
                    "policy_version",
                    "relay_orchestrator_policy_version",
                    "weight version served by decode",
                    own=False,
                ),
            ],
        ),
    ]


def spec(cfg: RunConfig) -> dict[str, Any]:
    """What the page needs besides the records: the run, its tasks and the charts."""
    return {
        "run": cfg.run.name,
        "max_steps": cfg.run.max_steps,
        "tasks": [{"env": t.env, "target": t.target} for t in cfg.orchestrator.tasks],
        "charts": [asdict(c) for c in charts(cfg)],
    }


def _value(rec: dict[str, Any], key: str) -> float | None:
    v: Any = rec
    for part in key.split("."):
        if not isinstance(v, dict) or part not in v:
            return None
        v = v[part]
    return float(v) if isinstance(v, int | float) else None


class DashboardCollector(Collector):
    """Every chart's series at the latest step, plus the run's step, pause and each supervised
    service's health and restarts, read at scrape time."""

    def __init__(self, cfg: RunConfig, bus: Bus, history: Callable[[], list[dict[str, Any]]]):
        self.charts = charts(cfg)
        self.bus, self.history = bus, history

    def collect(self) -> Iterator[Metric]:
        hist = self.history()
        last = hist[-1] if hist else {}
        families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}
        for chart in self.charts:
            for s in chart.series:
                if not s.own:
                    continue
                names = sorted(s.labels)
                fam = families.get(s.metric)
                if fam is None:
                    kind = CounterMetricFamily if s.total else GaugeMetricFamily
                    fam = families[s.metric] = kind(s.metric, s.help, labels=names)
                v = _value(last, s.key)
                if v is not None:
                    fam.add_metric([s.labels[n] for n in names], v)
        yield from families.values()
        yield GaugeMetricFamily(
            "relay_run_step", "last step the trainer committed", value=last.get("step", 0)
        )
        # /metrics is served from a worker thread, so Redis is read synchronously here.
        pause = self.bus.pause_state()
        yield GaugeMetricFamily(
            "relay_orchestrator_paused", "1 while paused (POST /v1/pause)", value=int(pause.paused)
        )
        yield CounterMetricFamily(
            "relay_orchestrator_paused_seconds", "seconds spent paused", value=pause.paused_s()
        )
        up = GaugeMetricFamily("relay_service_up", "1 while the supervised service runs", labels=["service"])
        restarts = CounterMetricFamily(
            "relay_service_restarts", "restarts by its supervisor", labels=["service"]
        )
        for h in health_rows(self.bus.services(), self.bus.supervisors()):
            up.add_metric([h["name"]], int(h["ok"]))
            if h["restarts"] is not None:
                restarts.add_metric([h["name"]], h["restarts"])
        yield up
        yield restarts


def mount(app: FastAPI, cfg: RunConfig) -> None:
    """GET /dashboard (the page), /dashboard/static/* (its scripts, styles, vendored uPlot) and
    GET /v1/dashboard (the chart spec)."""

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard() -> FileResponse:
        return FileResponse(STATIC / "dashboard.html", media_type="text/html")

    @app.get("/v1/dashboard")
    async def dashboard_spec() -> dict[str, Any]:
        """The dashboard's charts: for each, the /v1/metrics fields it plots and the Prometheus
        series of the orchestrator's /metrics that carry the same values."""
        return spec(cfg)

    app.mount("/dashboard/static", StaticFiles(directory=STATIC), name="dashboard-static")
