"""Engine counters, read by the decode service's /metrics and /health. Plain numbers (no
Prometheus objects) so several engines can live in one process, as they do in tests."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

BATCH_BUCKETS: tuple[float, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
# Phases of one engine step, in order: imported pages registered (drain), scheduling, the fed
# tokens gathered (prep), forward launched (or graph replayed), the wait for sampled tokens
# (sample: the step's host <-> device sync), then appending them / stop checks / page bookkeeping.
PHASES: tuple[str, ...] = ("drain", "schedule", "prep", "forward", "sample", "post")


@dataclass
class EngineStats:
    requests_total: int = 0
    requests_finished: int = 0
    prompt_tokens_total: int = 0
    generated_tokens_total: int = 0
    steps_total: int = 0
    step_seconds_total: float = 0.0
    weight_updates_total: int = 0
    # Weight updates: seconds the step loop was held applying them (copies into the parameters;
    # with EngineConfig.stage_weights only the swap of the staged copy), seconds reading them
    # beforehand and, staged, writing the staging copy (both off the loop), and the bytes read
    # (this engine's slices).
    weight_apply_seconds_total: float = 0.0
    weight_apply_seconds_last: float = 0.0
    weight_read_seconds_last: float = 0.0
    weight_stage_seconds_total: float = 0.0
    weight_stage_seconds_last: float = 0.0
    weight_bytes_read_total: int = 0
    # Seconds the step loop had nothing to do while not paused: rollout starvation shows here.
    idle_seconds_total: float = 0.0
    # Sequences per step: counts per bucket of BATCH_BUCKETS (upper bounds), then +Inf.
    batch_size_buckets: list[int] = field(default_factory=lambda: [0] * (len(BATCH_BUCKETS) + 1))
    batch_size_sum: float = 0.0
    # Tokens fed through the model (prompt chunks + decodes): what the prefix cache saves shows here.
    computed_tokens_total: int = 0
    # Prefix cache: tokens of admitted sequences looked up, and those found cached (not computed).
    prefix_cache_queried_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    # Running sequences evicted for lack of KV pages (recomputed later).
    preemptions_total: int = 0
    requests_timed_out: int = 0
    # Steps that fed more tokens than they had sequences (prompt chunks in the batch): their tokens
    # and seconds give the engine's measured prefill throughput, which decode's KV-pull decision
    # weighs a pull against (services/kvstore/pull_policy.py).
    prefill_step_tokens_total: int = 0
    prefill_step_seconds_total: float = 0.0
    _computed_at_last_step: int = field(default=0, repr=False)
    # Seconds in each phase of the last step (PHASES; overwritten every step, a few perf_counter
    # calls): what a slow step spent its time on.
    last_step_phases: dict[str, float] = field(default_factory=dict)

    def observe_weights(self, apply_s: float, read_s: float, nbytes: int, stage_s: float = 0.0) -> None:
        self.weight_updates_total += 1
        self.weight_stage_seconds_total += stage_s
        self.weight_stage_seconds_last = stage_s
        self.weight_apply_seconds_total += apply_s
        self.weight_apply_seconds_last = apply_s
        self.weight_read_seconds_last = read_s
        self.weight_bytes_read_total += nbytes

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hit_tokens / max(self.prefix_cache_queried_tokens, 1)

    def observe_step(self, batch_size: int, generated: int, seconds: float, prefill: bool = True) -> int:
        """Count a step; returns the tokens it fed. `prefill` False: a prefill step's time is
        not `seconds` (overlap scheduling: the step's launch plus the landing of the one before)
        and the caller reports it with observe_prefill once known."""
        self.steps_total += 1
        fed = self.computed_tokens_total - self._computed_at_last_step
        self._computed_at_last_step = self.computed_tokens_total
        if prefill and fed > batch_size:
            self.observe_prefill(fed, seconds)
        self.generated_tokens_total += generated
        self.step_seconds_total += seconds
        self.batch_size_buckets[bisect.bisect_left(BATCH_BUCKETS, batch_size)] += 1
        self.batch_size_sum += batch_size
        return fed

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """A step that fed prompt tokens: what the KV-pull decision weighs a pull against."""
        self.prefill_step_tokens_total += tokens
        self.prefill_step_seconds_total += seconds
