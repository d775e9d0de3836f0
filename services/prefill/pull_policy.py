"""Pull or recompute: decode's cost model for a prompt's missing KV prefix.

A pull is only worth it when it is faster than computing the same tokens. On an H200 a Qwen3-0.6B
prefix recomputes at ~80k tokens/s (9 GB/s of KV), while the first pulls moved 190 MB/s: pulling
a 10.8k-token prefix took 6.5 s where recomputing it takes ~0.15 s. On CPU (or for a model whose
KV is small for its compute) a pull is much cheaper. So the choice is measured, not configured:

    pull_s      = latency + bytes / pull bandwidth + bytes / import bandwidth
    recompute_s = tokens / prefill throughput

Pull bandwidth and latency are EWMAs over this replica's pulls (timed by the caller), import
bandwidth over the engine's imports (PageExchange.import_*_total), prefill throughput over the
engine's own prefill steps (EngineStats.prefill_step_*_total); until measured, the priors of
`kvstore.pull` stand in (conservative: a slow pull, a fast prefill). While recompute wins, a small
probe pull (`probe_pages`) every `probe_interval_s` keeps the pull estimate fresh.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import Counter, Gauge

from services.common.config import KVPullSection

DECISIONS = Counter(
    "relay_kv_pull_decisions", "pull-or-recompute decisions on a missing prefix", ["decision"]
)
ESTIMATE = Gauge("relay_kv_pull_estimate_seconds", "the last decision's expected seconds", ["path"])
PULL_BW = Gauge("relay_kv_pull_bandwidth_bytes_per_second", "EWMA of measured pull bandwidth")
PULL_LATENCY = Gauge("relay_kv_pull_latency_seconds", "EWMA of a pull request's fixed cost")
IMPORT_BW = Gauge("relay_kv_import_bandwidth_bytes_per_second", "EWMA of host -> KV pool import bandwidth")
PREFILL_RATE = Gauge("relay_kv_prefill_tokens_per_second", "EWMA of the engine's prefill throughput")

# A pull smaller than this measures latency rather than bandwidth.
BANDWIDTH_MIN_BYTES = 1 << 20
# Prefill samples: at least this many tokens since the last sample (short steps are mostly overhead).
PREFILL_MIN_TOKENS = 64


class Ewma:
    def __init__(self, prior: float, alpha: float):
        self.value, self.alpha, self.samples = prior, alpha, 0

    def update(self, x: float) -> None:
        # The first measurement replaces the prior outright: priors are guesses, not data.
        self.value = x if self.samples == 0 else (1 - self.alpha) * self.value + self.alpha * x
        self.samples += 1


@dataclass(frozen=True)
class Decision:
    action: str  # "pull" | "recompute" | "probe" (a capped pull while recompute wins)
    pages: int  # pages to ask the store for (0: none)
    pull_s: float  # expected seconds to pull all the missing pages
    recompute_s: float  # expected seconds to compute their tokens


class PullPolicy:
    """One per engine. `decide` before a pull; `observe_pull` after it; engine counters are read
    through `prefill_counters` / `import_counters` (cumulative (amount, seconds) pairs)."""

    def __init__(
        self,
        cfg: KVPullSection,
        prefill_counters: Callable[[], tuple[float, float]] | None = None,
        import_counters: Callable[[], tuple[float, float]] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.cfg, self.clock = cfg, clock
        a = cfg.ewma_alpha
        self.pull_bw = Ewma(cfg.prior_pull_bytes_per_s, a)
        self.latency = Ewma(cfg.prior_pull_latency_s, a)
        self.import_bw = Ewma(cfg.prior_import_bytes_per_s, a)
        self.prefill = Ewma(cfg.prior_prefill_tokens_per_s, a)
        self._prefill_counters, self._import_counters = prefill_counters, import_counters
        self._prefill_seen = prefill_counters() if prefill_counters else (0.0, 0.0)
        self._import_seen = import_counters() if import_counters else (0.0, 0.0)
        self._last_pull_at = -1e18
        # Re-entrant: decide() holds it over refresh() (whose observe_* take it again) and the probe
        # check-and-set, which pulls on several worker threads would otherwise race (two probes in
        # one interval, one counter delta folded in twice).
        self._lock = threading.RLock()
        self.counts = {"pull": 0, "recompute": 0, "probe": 0}
        self._export()

    # ------------------------------------------------------------------ measurements

    def observe_pull(self, nbytes: int, seconds: float) -> None:
        """A pull of `nbytes` (0: nothing was found) took `seconds` end to end (request + reply)."""
        with self._lock:
            self._last_pull_at = self.clock()
            if nbytes < BANDWIDTH_MIN_BYTES:
                self.latency.update(seconds)
            else:
                # What the fixed cost does not explain is transfer time (at least 10% of it, so one
                # slow latency sample cannot make the bandwidth look infinite).
                transfer = max(seconds - self.latency.value, 0.1 * seconds, 1e-9)
                self.pull_bw.update(nbytes / transfer)
            self._export()

    def observe_prefill(self, tokens: float, seconds: float) -> None:
        with self._lock:
            if tokens >= PREFILL_MIN_TOKENS and seconds > 0:
                self.prefill.update(tokens / seconds)
                self._export()

    def observe_import(self, nbytes: float, seconds: float) -> None:
        with self._lock:
            if nbytes >= BANDWIDTH_MIN_BYTES and seconds > 0:
                self.import_bw.update(nbytes / seconds)
                self._export()

    def refresh(self) -> None:
        """Fold in what the engine measured since the last call (its cumulative counters)."""
        with self._lock:
            self._refresh()

    def _refresh(self) -> None:
        if self._prefill_counters is not None:
            tok, sec = self._prefill_counters()
            dt, ds = tok - self._prefill_seen[0], sec - self._prefill_seen[1]
            if dt >= PREFILL_MIN_TOKENS:
                self.observe_prefill(dt, ds)
                self._prefill_seen = (tok, sec)
        if self._import_counters is not None:
            nb, sec = self._import_counters()
            db, ds = nb - self._import_seen[0], sec - self._import_seen[1]
            if db >= BANDWIDTH_MIN_BYTES:
                self.observe_import(db, ds)
                self._import_seen = (nb, sec)

    # ------------------------------------------------------------------ the decision

    def estimate_pull_s(self, nbytes: int) -> float:
        return self.latency.value + nbytes / self.pull_bw.value + nbytes / self.import_bw.value

    def estimate_recompute_s(self, tokens: int) -> float:
        return tokens / self.prefill.value

    def decide(self, pages: int, page_bytes: int, block_size: int) -> Decision:
        """Whether to pull `pages` missing pages (page_bytes each, block_size tokens each)."""
        with self._lock:
            self._refresh()
            nbytes, tokens = pages * page_bytes, pages * block_size
            pull_s, recompute_s = self.estimate_pull_s(nbytes), self.estimate_recompute_s(tokens)
            mode = self.cfg.mode
            if pages == 0:
                action, n = "recompute", 0
            elif mode == "always" or (mode == "auto" and pull_s < recompute_s):
                action, n = "pull", pages
            elif (
                mode == "auto"
                and self.cfg.probe_pages > 0
                and self.clock() - self._last_pull_at >= self.cfg.probe_interval_s
            ):
                action, n = "probe", min(pages, self.cfg.probe_pages)
                self._last_pull_at = self.clock()  # one probe per interval, even if it fails
            else:
                action, n = "recompute", 0
            self.counts[action] += 1
        DECISIONS.labels(action).inc()
        ESTIMATE.labels("pull").set(pull_s)
        ESTIMATE.labels("recompute").set(recompute_s)
        return Decision(action, n, pull_s, recompute_s)

    def _export(self) -> None:
        PULL_BW.set(self.pull_bw.value)
        PULL_LATENCY.set(self.latency.value)
        IMPORT_BW.set(self.import_bw.value)
        PREFILL_RATE.set(self.prefill.value)

    def stats(self) -> dict[str, float | int]:
        return {
            **{f"pull_decisions_{k}": v for k, v in self.counts.items()},
            "pull_bandwidth_bytes_per_s": self.pull_bw.value,
            "pull_latency_s": self.latency.value,
            "import_bandwidth_bytes_per_s": self.import_bw.value,
            "prefill_tokens_per_s": self.prefill.value,
        }
