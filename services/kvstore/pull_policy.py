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

With a near tier (services/kvstore/near_cache.py: pages in this process's pinned host memory) the
leading `near` pages of the missing prefix cost only their host -> device import, estimated from
its own EWMA (near imports, PageExchange.near_import_*_total; prior `prior_near_bytes_per_s`):

    near_s = near bytes / near bandwidth          remote_s = the pull_s above, for the rest

A prefix is usable only from its head, so the candidates are: pull all (near_s + remote_s), pull
the near run and recompute the rest (near_s + the rest's recompute), recompute all; the cheapest
wins.
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
NEAR_BW = Gauge("relay_kv_near_bandwidth_bytes_per_second", "EWMA of near tier -> KV pool import bandwidth")
NEAR_DECISIONS = Counter("relay_kv_near_decisions", "decisions that pulled near-tier pages", ["remote"])
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
    pages: int  # leading pages to ask the store for, near tier included (0: none)
    pull_s: float  # expected seconds to pull all the missing pages
    recompute_s: float  # expected seconds to compute their tokens
    near: int = 0  # of `pages`, how many to take from the near tier (the rest: ask the gateway)
    near_s: float = 0.0  # expected seconds to import the near pages


class PullPolicy:
    """One per engine. `decide` before a pull; `observe_pull` after it; engine counters are read
    through `prefill_counters` / `import_counters` (cumulative (amount, seconds) pairs)."""

    def __init__(
        self,
        cfg: KVPullSection,
        prefill_counters: Callable[[], tuple[float, float]] | None = None,
        import_counters: Callable[[], tuple[float, float]] | None = None,
        clock: Callable[[], float] = time.monotonic,
        near_import_counters: Callable[[], tuple[float, float]] | None = None,
    ):
        self.cfg, self.clock = cfg, clock
        a = cfg.ewma_alpha
        self.pull_bw = Ewma(cfg.prior_pull_bytes_per_s, a)
        self.latency = Ewma(cfg.prior_pull_latency_s, a)
        self.import_bw = Ewma(cfg.prior_import_bytes_per_s, a)
        self.prefill = Ewma(cfg.prior_prefill_tokens_per_s, a)
        self.near_bw = Ewma(cfg.prior_near_bytes_per_s, a)
        self._prefill_counters, self._import_counters = prefill_counters, import_counters
        self._near_counters = near_import_counters
        self._prefill_seen = prefill_counters() if prefill_counters else (0.0, 0.0)
        self._import_seen = import_counters() if import_counters else (0.0, 0.0)
        self._near_seen = near_import_counters() if near_import_counters else (0.0, 0.0)
        self._last_pull_at = -1e18
        self._last_near_at = -1e18  # the last decision that took near-tier pages
        # Re-entrant: decide() holds it over refresh() (whose observe_* take it again) and the probe
        # check-and-set, which pulls on several worker threads would otherwise race (two probes in
        # one interval, one counter delta folded in twice).
        self._lock = threading.RLock()
        self.counts = {"pull": 0, "recompute": 0, "probe": 0}
        # Decisions that took near-tier pages: with gateway pages too ("all") or alone ("only").
        self.near_counts = {"all": 0, "only": 0}
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

    def observe_near_import(self, nbytes: float, seconds: float) -> None:
        with self._lock:
            if nbytes >= BANDWIDTH_MIN_BYTES and seconds > 0:
                self.near_bw.update(nbytes / seconds)
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
        if self._near_counters is not None:
            nb, sec = self._near_counters()
            db, ds = nb - self._near_seen[0], sec - self._near_seen[1]
            if db >= BANDWIDTH_MIN_BYTES:
                self.observe_near_import(db, ds)
                self._near_seen = (nb, sec)

    # ------------------------------------------------------------------ the decision

    def estimate_pull_s(self, nbytes: int) -> float:
        return self.latency.value + nbytes / self.pull_bw.value + nbytes / self.import_bw.value

    def estimate_recompute_s(self, tokens: int) -> float:
        return tokens / self.prefill.value

    def estimate_near_s(self, nbytes: int) -> float:
        return nbytes / self.near_bw.value

    def decide(self, pages: int, page_bytes: int, block_size: int, near: int = 0) -> Decision:
        """Whether to pull `pages` missing pages (page_bytes each, block_size tokens each), of
        which the leading `near` are in the near tier (the rest: the gateway, if it has them)."""
        with self._lock:
            self._refresh()
            k = min(max(near, 0), pages)
            r = pages - k
            near_s = self.estimate_near_s(k * page_bytes)
            remote_s = self.estimate_pull_s(r * page_bytes) if r else 0.0
            pull_s = near_s + remote_s
            recompute_s = self.estimate_recompute_s(pages * block_size)
            # Pull the near run, recompute the rest: what pays when only the gateway is slow.
            near_only_s = near_s + self.estimate_recompute_s(r * block_size)
            mode = self.cfg.mode
            took_near = 0
            if pages == 0:
                action, n = "recompute", 0
            elif mode == "always" or (mode == "auto" and pull_s < min(recompute_s, near_only_s)):
                action, n, took_near = "pull", pages, k
            else:
                # The remote part loses (or mode never): maybe the near run alone still pays.
                base = k if mode == "auto" and k and near_only_s < recompute_s else 0
                took_near = base
                probing = mode == "auto" and self.cfg.probe_pages > 0
                if (
                    probing
                    and k
                    and not base
                    and self.clock() - self._last_near_at >= self.cfg.probe_interval_s
                ):
                    # The near tier looks slower than recomputing: take a few of its pages now and
                    # then, so a prior (or an old measurement) cannot keep it unused for good.
                    action, n = "probe", min(k, self.cfg.probe_pages)
                    took_near = n
                # A remote probe measures the gateway: with the near run not taken, its pages are
                # asked of the gateway (Decision.near = 0), which has them too (write-through).
                elif probing and r and self.clock() - self._last_pull_at >= self.cfg.probe_interval_s:
                    action, n = "probe", base + min(r, self.cfg.probe_pages)
                    self._last_pull_at = self.clock()  # one probe per interval, even if it fails
                elif base:
                    action, n = "pull", base
                else:
                    action, n = "recompute", 0
            self.counts[action] += 1
            if took_near:
                self.near_counts["all" if n > k else "only"] += 1
                self._last_near_at = self.clock()
        DECISIONS.labels(action).inc()
        if took_near:
            NEAR_DECISIONS.labels("yes" if n > k else "no").inc()
        ESTIMATE.labels("pull").set(pull_s)
        ESTIMATE.labels("recompute").set(recompute_s)
        ESTIMATE.labels("near").set(near_s)
        return Decision(action, n, pull_s, recompute_s, near=took_near, near_s=near_s)

    def _export(self) -> None:
        PULL_BW.set(self.pull_bw.value)
        PULL_LATENCY.set(self.latency.value)
        IMPORT_BW.set(self.import_bw.value)
        PREFILL_RATE.set(self.prefill.value)
        NEAR_BW.set(self.near_bw.value)

    def stats(self) -> dict[str, float | int]:
        return {
            **{f"pull_decisions_{k}": v for k, v in self.counts.items()},
            "pull_bandwidth_bytes_per_s": self.pull_bw.value,
            "pull_latency_s": self.latency.value,
            "import_bandwidth_bytes_per_s": self.import_bw.value,
            "prefill_tokens_per_s": self.prefill.value,
            "near_bandwidth_bytes_per_s": self.near_bw.value,
            "pull_decisions_near_all": self.near_counts["all"],
            "pull_decisions_near_only": self.near_counts["only"],
        }
