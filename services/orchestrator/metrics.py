"""Prometheus metrics of the orchestrator (served at /metrics)."""

from prometheus_client import Counter, Gauge, Histogram

GROUPS = Counter("relay_orchestrator_groups_total", "rollout groups pushed to the trainer", ["env"])
DROPPED = Counter("relay_orchestrator_groups_dropped_total", "rollout groups dropped", ["reason"])
INFLIGHT = Gauge("relay_orchestrator_inflight_groups", "rollout groups in flight")
SAMPLES = Counter(
    "relay_orchestrator_samples_total",
    "samples pushed to the trainer, by how they ended (done, max_turns, context, turn_timeout, ...)",
    ["env", "finish_reason"],
)
POLICY_VERSION = Gauge("relay_orchestrator_policy_version", "weight version served by decode")
REWARD = Histogram(
    "relay_orchestrator_group_reward", "mean reward per group", ["env"], buckets=[i / 10 for i in range(11)]
)
AFFINITY = Counter(
    "relay_orchestrator_affinity_total",
    "requests routed with a preferred replica (a sample's previous turn's): kept there or moved",
    ["kind", "outcome"],
)
