"""Prometheus view of a decode replica's engine, built at scrape time from EngineStats."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from services.engine import AsyncEngine
from services.engine.stats import BATCH_BUCKETS


class EngineCollector(Collector):
    """Reads the current engine (None while weights load) on every scrape."""

    def __init__(self, engine: Callable[[], AsyncEngine | None]):
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        eng = self.engine()
        if eng is None:
            yield GaugeMetricFamily("relay_decode_weight_version", "Loaded weight version", value=-1)
            return
        s = eng.engine.stats
        counters = [
            ("relay_decode_requests", "Generate requests received", s.requests_total),
            ("relay_decode_requests_finished", "Generate requests completed", s.requests_finished),
            ("relay_decode_prompt_tokens", "Prompt tokens received", s.prompt_tokens_total),
            ("relay_decode_generated_tokens", "Tokens generated", s.generated_tokens_total),
            ("relay_decode_steps", "Engine steps (batched forwards)", s.steps_total),
            ("relay_decode_step_seconds", "Seconds spent in engine steps", s.step_seconds_total),
            ("relay_decode_idle_seconds", "Seconds with no work while not paused", s.idle_seconds_total),
            ("relay_decode_weight_updates", "Weight updates applied", s.weight_updates_total),
            (
                "relay_decode_weight_apply_seconds",
                "Seconds the engine loop spent applying weight updates",
                s.weight_apply_seconds_total,
            ),
            (
                "relay_decode_weight_stage_seconds",
                "Seconds spent writing weight updates into the staging copy, off the engine loop"
                " (decode.engine.stage_weights)",
                s.weight_stage_seconds_total,
            ),
            (
                "relay_decode_weight_bytes_read",
                "Bytes of weights read for updates",
                s.weight_bytes_read_total,
            ),
            (
                "relay_decode_prefix_cache_queried_tokens",
                "Tokens of admitted sequences looked up in the prefix cache",
                s.prefix_cache_queried_tokens,
            ),
            (
                "relay_decode_prefix_cache_hit_tokens",
                "Tokens found in the prefix cache (KV reused, not computed)",
                s.prefix_cache_hit_tokens,
            ),
            ("relay_decode_preemptions", "Sequences preempted for lack of KV pages", s.preemptions_total),
            (
                "relay_decode_requests_timed_out",
                "Requests aborted by request_timeout_s",
                s.requests_timed_out,
            ),
        ]
        for name, doc, value in counters:
            yield CounterMetricFamily(name, doc, value=value)
        yield GaugeMetricFamily("relay_decode_weight_version", "Loaded weight version", value=eng.version)
        yield GaugeMetricFamily(
            "relay_decode_weight_apply_last_seconds",
            "Seconds the last weight update held the engine loop (copies into the parameters;"
            " with decode.engine.stage_weights, the swap of the staged copy)",
            value=s.weight_apply_seconds_last,
        )
        yield GaugeMetricFamily(
            "relay_decode_weight_stage_last_seconds",
            "Seconds the last weight update spent being written into the staging copy, off the loop"
            " (decode.engine.stage_weights; 0 without it)",
            value=s.weight_stage_seconds_last,
        )
        yield GaugeMetricFamily(
            "relay_decode_weight_read_last_seconds",
            "Seconds the last weight update spent reading its files, before the loop applied it",
            value=s.weight_read_seconds_last,
        )
        yield GaugeMetricFamily(
            "relay_decode_queue_length", "Sequences waiting for a slot", value=eng.num_waiting
        )
        yield GaugeMetricFamily(
            "relay_decode_running", "Sequences in the running batch", value=eng.num_running
        )
        yield GaugeMetricFamily("relay_decode_paused", "1 while paused", value=int(eng.paused))
        yield GaugeMetricFamily(
            "relay_decode_prefix_cache_hit_rate",
            "Prefix-cache hit tokens / queried tokens since start",
            value=s.prefix_cache_hit_rate,
        )
        kv = eng.engine.kv
        pools = eng.engine.kv_pools  # one per attention group with data-parallel attention
        yield GaugeMetricFamily(
            "relay_decode_kv_blocks", "KV cache pages in the pool(s)", value=sum(p.num_blocks for p in pools)
        )
        yield GaugeMetricFamily(
            "relay_decode_kv_blocks_used",
            "KV cache pages held by sequences",
            value=sum(p.num_blocks - p.num_free for p in pools),
        )
        yield GaugeMetricFamily(
            "relay_decode_kv_cache_bytes", "Bytes of the KV page pools", value=kv.kv_bytes
        )
        yield GaugeMetricFamily(
            "relay_decode_state_cache_bytes",
            "Bytes of the Mamba-2 state slots (0 without Mamba-2 layers)",
            value=kv.state_bytes,
        )
        cumulative, buckets = 0, []
        for bound, count in zip([*map(str, BATCH_BUCKETS), "+Inf"], s.batch_size_buckets, strict=True):
            cumulative += count
            buckets.append((bound, cumulative))
        yield HistogramMetricFamily(
            "relay_decode_batch_size",
            "Sequences per engine step",
            buckets=buckets,
            sum_value=s.batch_size_sum,
        )
