"""Rank groups: the collectives one engine's ranks run together.

`RankGroup` wraps a torch.distributed process group (gloo on CPU, NCCL on GPU). A group of one
rank has no process group and every collective is the identity, so a one-rank engine runs the same
code with no communication. Every group is created with a timeout: a collective whose peer died
raises (gloo: at once when the peer's socket closes, or after the timeout; NCCL: the watchdog tears
the process down after it) instead of waiting forever, and the service exits for its supervisor to
restart the whole rank group.

`init_engine_groups` lays out one engine's ranks as `decode.parallel` describes them
(docs/parallel.md): ranks = tp x dp_attention, rank r in attention group r // tp at position
r % tp; the expert-parallel group is the whole engine when ep > 1.
"""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist

from services.common.config import ParallelConfig

ReduceOp = Literal["sum", "max", "min"]
_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


class RankGroup:
    """`size` ranks (global ranks `ranks`), this process being `rank` among them."""

    def __init__(self, rank: int, ranks: list[int], pg: dist.ProcessGroup | None) -> None:
        self.rank, self.ranks, self.pg = rank, ranks, pg
        self.size = len(ranks)
        if self.size > 1 and pg is None:
            raise ValueError("a group of several ranks needs a process group")

    @staticmethod
    def single() -> RankGroup:
        return RankGroup(0, [0], None)

    def all_reduce(self, x: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        """x reduced over the group, in place (and returned)."""
        if self.size > 1:
            dist.all_reduce(x, op=_OPS[op], group=self.pg)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[*shape] on each rank -> [size, *shape] in rank order (equal shapes on every rank)."""
        if self.size == 1:
            return x[None]
        flat = torch.empty(self.size * x.numel(), dtype=x.dtype, device=x.device)
        _all_gather_flat(flat, x.reshape(-1).contiguous(), self.pg)
        return flat.view(self.size, *x.shape)

    def all_to_all(self, x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        """Rows of x, `send[j]` of them to rank j in order; returns the rows received, `recv[j]`
        from rank j, in rank order."""
        if self.size == 1:
            return x
        out = torch.empty((sum(recv), *x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=self.pg)
        return out

    def exchange_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """counts[j] = what this rank sends to rank j -> what it receives from each rank."""
        if self.size == 1:
            return counts.clone()
        out = torch.empty_like(counts)
        dist.all_to_all_single(out, counts.contiguous(), group=self.pg)
        return out

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """`obj` of the group's rank `src` on every rank (pickled: host-side plans, not tensors)."""
        if self.size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=self.ranks[src], group=self.pg)
        return box[0]

    def scatter_object(self, objs: list[Any] | None, src: int = 0) -> Any:
        """Rank `src` gives each rank its own object (`objs[rank]`; None elsewhere): a broadcast of
        the pickled sizes, then one scatter padded to the largest. An object repeated in `objs` is
        pickled once."""
        if self.size == 1:
            assert objs is not None
            return objs[0]
        nccl = dist.get_backend(self.pg) == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        chunks: list[torch.Tensor] | None = None
        if self.rank == src:
            assert objs is not None and len(objs) == self.size
            memo: dict[int, bytes] = {}
            bufs = [
                memo.get(id(o)) or memo.setdefault(id(o), pickle.dumps(o, pickle.HIGHEST_PROTOCOL))
                for o in objs
            ]
            sizes = torch.tensor([len(b) for b in bufs], dtype=torch.int64, device=device)
            n = int(sizes.max())
            chunks = [
                torch.frombuffer(bytearray(b.ljust(n, b"\0")), dtype=torch.uint8).to(device) for b in bufs
            ]
        else:
            sizes = torch.empty(self.size, dtype=torch.int64, device=device)
        dist.broadcast(sizes, src=self.ranks[src], group=self.pg)
        out = torch.empty(int(sizes.max()), dtype=torch.uint8, device=device)
        dist.scatter(out, chunks, src=self.ranks[src], group=self.pg)
        if objs is not None:
            return objs[self.rank]
        return pickle.loads(out[: int(sizes[self.rank])].cpu().numpy().tobytes())

    def gather_objects(self, obj: Any, dst: int = 0) -> list[Any] | None:
        """Every rank's `obj`, in rank order, on rank `dst`; None elsewhere."""
        if self.size == 1:
            return [obj]
        out: list[Any] | None = [None] * self.size if self.rank == dst else None
        dist.gather_object(obj, out, dst=self.ranks[dst], group=self.pg)
        return out

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier(group=self.pg)


def _all_gather_flat(out: torch.Tensor, x: torch.Tensor, pg: dist.ProcessGroup | None) -> None:
    # all_gather_single is the newer name of all_gather_into_tensor (deprecated in its favour).
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, x, group=pg)


@dataclass(frozen=True)
class EngineGroups:
    """One rank's view of its engine: the whole engine, its attention (tp) group, its expert group."""

    world: RankGroup
    tp: RankGroup
    ep: RankGroup
    dp_rank: int  # which attention group

    @staticmethod
    def single() -> EngineGroups:
        one = RankGroup.single()
        return EngineGroups(one, one, one, 0)


def init_engine_groups(
    par: ParallelConfig,
    rank: int,
    init_method: str,
    backend: Literal["gloo", "nccl"] = "gloo",
    timeout_s: float = 60.0,
) -> EngineGroups:
    """Join the engine's process group (`init_method`: tcp://host:port or env://) and build its
    subgroups. Every rank must call this with the same arguments but its own rank."""
    world = par.ranks
    if world == 1:
        return EngineGroups.single()
    if backend == "nccl":
        # On a collective timeout the NCCL watchdog tears the process down rather than leaving the
        # rank blocked on a peer that will never answer.
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    timeout = timedelta(seconds=timeout_s)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world, timeout=timeout)
    everyone = list(range(world))
    tp_groups = [list(range(g * par.tp, (g + 1) * par.tp)) for g in range(par.dp_attention)]
    # new_group is collective over the whole world: every rank creates every subgroup, in order.
    made = [dist.new_group(ranks, timeout=timeout) if len(ranks) > 1 else None for ranks in tp_groups]
    dp_rank = rank // par.tp
    tp = RankGroup(rank % par.tp, tp_groups[dp_rank], made[dp_rank])
    whole = RankGroup(rank, everyone, dist.group.WORLD)
    ep = whole if par.ep > 1 else RankGroup.single()
    return EngineGroups(whole, tp, ep, dp_rank)


def close_engine_groups(groups: EngineGroups) -> None:
    if groups.world.size > 1 and dist.is_initialized():
        dist.destroy_process_group()
