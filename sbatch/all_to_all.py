"""Expert-parallel all-to-all time, for the capacity plan (sbatch/plan.py).

Under expert parallelism every MoE layer sends each (token, top-k slot) row to the rank that holds
its expert (dispatch) and the expert's output row back (combine). Both sides send one row per slot,
with no per-rank deduplication: the engine's `ExpertParallelMoE` (services/engine/parallel/
experts.py) and torchtitan's EP in the trainer. So one exchange moves, per rank,

    tokens x top-k x dim x bytes/elem   of which (ep - 1) / ep leave the GPU

with the experts spread evenly over the ep ranks and routing balanced. Of the rows that leave,
(g - 1) / ep go to the g - 1 other ranks of the group on the rank's own node (NVLink) and
(ep - g) / ep to other nodes (the network); a rank sends both at once, so an exchange lasts the
longer of the two. A rate here is bytes leaving one GPU per second, as nccl-tests' all-to-all bus
bandwidth (algorithm bandwidth x (n - 1) / n) and bench/engine/multi.py's `all_to_all_busbw_gb_s`
count it. Per-collective latency is not counted.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.common.config import ModelConfig

# Bytes an activation element takes on the wire, by the dtype the rows are sent in.
ELEM_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(frozen=True)
class Fabric:
    intra_bytes_per_s: float  # to the GPUs of its node, per GPU
    inter_bytes_per_s: float  # to GPUs of other nodes, per GPU


def exchange_bytes(
    m: ModelConfig, tokens: float, ep: int, gpus_per_node: int, elem_bytes: float
) -> tuple[float, float]:
    """(bytes to the other ranks of its node, bytes to other nodes) one rank sends in one
    exchange (a dispatch or a combine) of `tokens` tokens; (0, 0) without expert parallelism."""
    if not m.is_moe or ep <= 1:
        return 0.0, 0.0
    rows = tokens * m.n_experts_per_tok * m.dim * elem_bytes
    local = min(ep, max(1, gpus_per_node))  # the EP group's ranks on one node
    return rows * (local - 1) / ep, rows * (ep - local) / ep


def exchange_s(
    m: ModelConfig, tokens: float, ep: int, gpus_per_node: int, elem_bytes: float, fabric: Fabric
) -> float:
    """Seconds one exchange of `tokens` tokens a rank takes."""
    intra, inter = exchange_bytes(m, tokens, ep, gpus_per_node, elem_bytes)
    return max(intra / fabric.intra_bytes_per_s, inter / fabric.inter_bytes_per_s)


def moe_all_to_all_s(
    m: ModelConfig,
    tokens: float,
    ep: int,
    gpus_per_node: int,
    elem_bytes: float,
    fabric: Fabric,
    exchanges: int = 2,
) -> float:
    """Seconds every MoE layer's exchanges take for `tokens` tokens a rank: `exchanges` a layer
    (2 in a forward: dispatch and combine)."""
    return len(m.moe_layers()) * exchanges * exchange_s(m, tokens, ep, gpus_per_node, elem_bytes, fabric)


def trainer_exchanges(activation_checkpoint: str) -> int:
    """Exchanges a trainer MoE layer runs per step: dispatch and combine forward, their transposes
    backward; full activation checkpointing runs the forward's again in the recompute (selective
    saves the all-to-all's outputs: trainer/parallel.MOE_SAC_SAVE_OPS)."""
    return 6 if activation_checkpoint == "full" else 4


def spans_nodes(ep: int, gpus_per_node: int) -> bool:
    return ep > max(1, gpus_per_node)
