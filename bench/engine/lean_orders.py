"""Step orders at GLM-5 decode scale, on the host: bytes each rank receives per step and rank 0's
seconds per step to build and pickle them, for the lean orders (services/engine/parallel/orders.py:
page-table changes only, each attention group only its part) against the whole-table orders
(every sequence's whole page table in every step, every group's part to every rank), measured in
the same process on the same simulated steps.

The simulation: `--seqs` sequences decoding one token a step over `--groups` attention groups
(GLM-5's decode at EP 32 over 4 nodes: 32 groups of 8; `--groups 1`: one tp group holding all),
contexts uniform in [`--min-ctx`, `--max-ctx`] tokens on `--block-size` pages (a new page every
`block_size` tokens), each sequence finishing with probability `--finish` a step and replaced by
a new one of a random context (its whole table sent once). Real `Sequence`s and SamplingParams,
pickled as the broadcast / scatter pickle them. Then (`--send-world`, 4) the same simulation over
that many local gloo ranks, one attention group each: rank 0's time to build and send each step's
orders, the whole-table broadcast against the lean scatter (RankGroup's). CPU only.

    python bench/engine/lean_orders.py --out bench/engine/results/lean_orders_cpu.json
"""

from __future__ import annotations

import argparse
import json
import pickle
import random
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.machine import machine  # noqa: E402
from services.common.schemas import GenerateRequest, SamplingParams  # noqa: E402
from services.engine.batch import Span  # noqa: E402
from services.engine.parallel.orders import Book, LeanStep, Ledger  # noqa: E402
from services.engine.parallel.runner import StepOrder  # noqa: E402
from services.engine.sequence import RequestState, Sequence, Status  # noqa: E402


class Pool:
    """A group's page ids (shuffled so tables are not runs)."""

    def __init__(self, pages: int, rng: random.Random) -> None:
        self.free = list(range(pages))
        rng.shuffle(self.free)

    def take(self, n: int) -> list[int]:
        out = self.free[-n:]
        del self.free[-n:]
        return out


def new_seq(rid: int, pool: Pool, ctx: int, block: int) -> Sequence:
    req = GenerateRequest(input_ids=[1], sampling=SamplingParams(temperature=1.0, max_tokens=1024, seed=rid))
    seq = RequestState(f"r{rid}", req).seqs[0]
    seq.block_table = pool.take(-(-ctx // block))
    seq.num_cached = ctx
    seq.status = Status.RUNNING
    return seq


class Sim:
    """The scheduler's part of each decode step over `groups` attention groups: finished sequences
    replaced by new ones, a page appended when a sequence crosses a page boundary."""

    def __init__(self, args: argparse.Namespace, groups: int) -> None:
        self.args, self.rng = args, random.Random(0)
        self.per = args.seqs // groups
        room = self.per * (args.max_ctx // args.block_size + args.steps // args.block_size + 2) * 2
        self.pools = [Pool(room, self.rng) for _ in range(groups)]
        self.rid = 0
        self.groups = [[self.admit(g) for _ in range(self.per)] for g in range(groups)]

    def admit(self, g: int) -> Sequence:
        a = self.args
        self.rid += 1
        return new_seq(self.rid, self.pools[g], self.rng.randint(a.min_ctx, a.max_ctx), a.block_size)

    def step(self, first: bool) -> list[list[Span]]:
        for g, seqs in enumerate(self.groups):
            for i, s in enumerate(seqs):
                if not first and self.rng.random() < self.args.finish:
                    s.status = Status.FINISHED
                    self.pools[g].free.extend(s.block_table)
                    s.block_table = []
                    seqs[i] = self.admit(g)
                    continue
                if s.num_cached % self.args.block_size == 0:
                    s.block_table.append(self.pools[g].take(1)[0])
                s.num_cached += 1
        return [[Span(s.block_table, s.num_cached - 1, [7], -1) for s in seqs] for seqs in self.groups]

    def whole_orders(self, spans: list[list[Span]]) -> list[StepOrder]:
        """The whole-table orders: every group's StepOrder (all of them to every rank)."""
        per = self.per
        return [
            StepOrder(spans[g], list(range(per)), [s.params for s in seqs], [0.5] * per)
            for g, seqs in enumerate(self.groups)
        ]

    def lean_orders(self, ledgers: list[Ledger], spans: list[list[Span]]) -> list[LeanStep]:
        per = self.per
        return [
            ledgers[g].order(spans[g], seqs, list(range(per)), seqs, [0.5] * per)
            for g, seqs in enumerate(self.groups)
        ]


def run(args: argparse.Namespace) -> dict[str, object]:
    sim = Sim(args, args.groups)
    ledgers = [Ledger() for _ in range(args.groups)]
    book = Book()  # the last group's worker
    old_s: list[float] = []
    new_s: list[float] = []
    old_bytes: list[int] = []
    new_bytes: list[list[int]] = []
    worker_old_s: list[float] = []
    worker_new_s: list[float] = []
    pages_total = []
    for step in range(args.steps):
        spans = sim.step(step == 0)
        pages_total.append(sum(len(s.block_table) for seqs in sim.groups for s in seqs))
        t0 = time.perf_counter()
        blob = pickle.dumps(sim.whole_orders(spans), pickle.HIGHEST_PROTOCOL)
        old_s.append(time.perf_counter() - t0)
        old_bytes.append(len(blob))
        t0 = time.perf_counter()
        pickle.loads(blob)
        worker_old_s.append(time.perf_counter() - t0)
        # The lean orders: each group's changes, pickled once per group (the scatter's parts).
        t0 = time.perf_counter()
        blobs = [pickle.dumps(lean, pickle.HIGHEST_PROTOCOL) for lean in sim.lean_orders(ledgers, spans)]
        new_s.append(time.perf_counter() - t0)
        new_bytes.append([len(b) for b in blobs])
        t0 = time.perf_counter()
        got, _ = book.apply(pickle.loads(blobs[-1]))
        worker_new_s.append(time.perf_counter() - t0)
        assert [sp.block_table for sp in got] == [s.block_table for s in sim.groups[-1]]
    warm = slice(1, None)  # step 0 sends every table whole (the engine's first step after a start)

    def mean(xs: list) -> float:
        return statistics.fmean(xs[warm])

    return {
        "pages_per_step_mean": mean(pages_total),
        "whole_table_orders": {
            "bytes_per_rank_per_step": mean(old_bytes),
            "rank0_build_pickle_ms_per_step": 1e3 * mean(old_s),
            "worker_unpickle_ms_per_step": 1e3 * mean(worker_old_s),
        },
        "lean_orders": {
            "bytes_per_rank_per_step_mean": mean([statistics.fmean(b) for b in new_bytes]),
            "bytes_per_rank_per_step_max_group": mean([max(b) for b in new_bytes]),
            "bytes_first_step_max_group": max(new_bytes[0]),
            "rank0_build_pickle_ms_per_step": 1e3 * mean(new_s),
            "worker_unpickle_apply_ms_per_step": 1e3 * mean(worker_new_s),
        },
        "bytes_ratio_whole_over_lean_max": mean(old_bytes) / mean([max(b) for b in new_bytes]),
    }


def send_rank(rank: int, args: argparse.Namespace, world: int, init: str, out: str) -> None:
    """One rank of the gloo run: rank 0 simulates `world` groups of one rank each and sends each
    step's orders both ways (a barrier between, untimed); the others receive and apply them."""
    import torch.distributed as dist

    from services.engine.parallel.group import RankGroup

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    group = RankGroup(rank, list(range(world)), dist.group.WORLD)
    sim = Sim(args, world) if rank == 0 else None
    ledgers = [Ledger() for _ in range(world)]
    book = Book()
    times: dict[str, list[float]] = {"whole": [], "lean": []}
    for step in range(args.steps):
        spans = sim.step(step == 0) if sim is not None else []
        t0 = time.perf_counter()
        group.broadcast_object(sim.whole_orders(spans) if sim is not None else None)
        times["whole"].append(time.perf_counter() - t0)
        dist.barrier()
        t0 = time.perf_counter()
        if sim is not None:
            group.scatter_object(list(sim.lean_orders(ledgers, spans)))
        else:
            book.apply(group.scatter_object(None))
        times["lean"].append(time.perf_counter() - t0)
        dist.barrier()
    if rank == 0:
        Path(out).write_text(json.dumps({k: 1e3 * statistics.fmean(v[1:]) for k, v in times.items()}))
    dist.destroy_process_group()


def send_run(args: argparse.Namespace, world: int) -> dict[str, object]:
    import socket
    import tempfile

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp, "send.json"))
        mp.spawn(send_rank, (args, world, f"tcp://127.0.0.1:{port}", out), nprocs=world)
        ms = json.loads(Path(out).read_text())
    return {
        "world": world,
        "rank0_build_send_ms_per_step_whole_table_broadcast": ms["whole"],
        "rank0_build_send_ms_per_step_lean_scatter": ms["lean"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", type=int, default=256)
    ap.add_argument("--groups", type=int, nargs="+", default=[32, 1])
    ap.add_argument("--min-ctx", type=int, default=4096)
    ap.add_argument("--max-ctx", type=int, default=131072)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--finish", type=float, default=0.002)
    ap.add_argument("--send-world", type=int, default=4, help="gloo ranks for the send timing (0: none)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    results = {}
    for g in args.groups:
        results[f"groups_{g}"] = run(argparse.Namespace(**{**vars(args), "groups": g}))
        print(g, json.dumps(results[f"groups_{g}"], indent=1), flush=True)
    if args.send_world:
        results["gloo_send"] = send_run(args, args.send_world)
        print(json.dumps(results["gloo_send"], indent=1), flush=True)
    doc = {
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "baseline": "whole_table_orders: every sequence's whole table, every group's part to every rank",
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
