"""The multi-rank engine's decode step on 2 GPUs against one GPU doing the same per-GPU work, and
its collectives next to the NCCL bandwidth measured in the same run.

    torchrun --standalone --nproc_per_node=2 bench/engine/multi.py --shape moe30b \
        --out bench/engine/results/multi_moe30b_ep2.json
    torchrun --standalone --nproc_per_node=2 bench/engine/multi.py --shape dense8b \
        --out bench/engine/results/multi_dense8b_tp2.json
    # the CPU check of the script itself (gloo, tiny shapes; bench/tests/test_multi.py runs it):
    torchrun --standalone --nproc_per_node=2 bench/engine/multi.py --shape tiny-moe --device cpu \
        --steps 3 --out /tmp/multi.json

Shapes: `moe30b` is Qwen3-30B-A3B (48 layers, 128 experts top-8, 2048 wide, 4 KV heads) at EP 2
(attention tensor-parallel over the same 2 ranks, 64 experts a GPU: ~32 GB of bf16 weights each);
`dense8b` is Qwen3-8B at TP 2. Weights are random (each parameter from a generator seeded by its
name, so the replicated ones agree across ranks); nothing is read from disk.

What runs: every rank builds its shard (services/engine/parallel/runner.RankRunner), prefills
`--batch` sequences of `--context` random tokens, then decodes `--steps` steps the way the
multi-rank engine does: rank 0 broadcasts each step's lean order (new tokens, sampling rows, draws), every
rank runs the forward on its shard and the sharded sampler (temperature 1). A step's time is from
the order's broadcast to the sampled tokens on the host, after `--warmup` steps.

The baseline, in the same process after the 2-rank model is freed: rank 0 alone, one GPU, the
same code path (RankRunner with one rank), on the same per-GPU work: for `moe30b` the same model
with half the experts (64, top-8) at half the batch: per GPU the same expert weights, expert
products and attention heads x tokens as one EP rank; for `dense8b` the whole model at the same
batch (tok/s per GPU = the 2-GPU tok/s / 2). The ratio is 2-GPU tok/s per GPU / 1-GPU tok/s.

Both sides take the multi-rank engine's fast path (RankRunner.prepare: the paged attention and
fused elementwise kernels, and decode CUDA graphs where the layout allows them: none with expert
parallelism, so for `moe30b` the one-GPU baseline runs without graphs too); `--eager` runs both on
the torch attention path without graphs. The ratio is the cost of splitting the model; the
multi-rank path with 1 rank against the single-rank engine is w1.py's `+ranks1` variant.

Collectives, timed alone with the step's shapes: per MoE layer the dispatch and combine
all-to-alls of `batch / tp x top_k` rows (plus the count exchange) and the all-gather of the tp
group's outputs; per layer the all-reduce(s) of `batch x dim` (o_proj, and down_proj on dense
layers); next to the all-to-all and all-reduce bus bandwidth of 256 MiB messages.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import time
import zlib
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.machine import machine  # noqa: E402
from bench.results import write_result  # noqa: E402
from services.common.config import EngineConfig, ModelConfig, ParallelConfig  # noqa: E402
from services.common.schemas import SamplingParams  # noqa: E402
from services.engine.batch import Span  # noqa: E402
from services.engine.parallel.group import EngineGroups, RankGroup, init_engine_groups  # noqa: E402
from services.engine.parallel.orders import Ledger  # noqa: E402
from services.engine.parallel.runner import RankRunner, StepOrder  # noqa: E402
from services.engine.parallel.vocab import ShardedSampler  # noqa: E402
from services.engine.sequence import Sequence, Status  # noqa: E402

QWEN3_30B_A3B = dict(
    arch="qwen3_moe", vocab_size=151936, dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128,
    hidden_dim=6144, moe_hidden_dim=768, n_routed_experts=128, n_experts_per_tok=8, tie_embeddings=False,
)  # fmt: skip
QWEN3_8B = dict(
    arch="qwen3", vocab_size=151936, dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, head_dim=128,
    hidden_dim=12288, tie_embeddings=False,
)  # fmt: skip
TINY_MOE = dict(
    arch="qwen3_moe", vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
    hidden_dim=64, moe_hidden_dim=16, n_routed_experts=8, n_experts_per_tok=2, tie_embeddings=False,
)  # fmt: skip
TINY_DENSE = dict(
    arch="qwen3", vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, hidden_dim=64,
)  # fmt: skip
SHAPES: dict[str, tuple[dict[str, Any], ParallelConfig]] = {
    "moe30b": (QWEN3_30B_A3B, ParallelConfig(tp=2, ep=2)),
    "dense8b": (QWEN3_8B, ParallelConfig(tp=2)),
    "tiny-moe": (TINY_MOE, ParallelConfig(tp=2, ep=2)),
    "tiny-dense": (TINY_DENSE, ParallelConfig(tp=2)),
}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def randomize(model: torch.nn.Module, device: torch.device) -> None:
    """Norms 1, everything else normal(0, 0.02), each parameter from a generator seeded by its name
    (replicated parameters equal on every rank)."""
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
            continue
        g = torch.Generator(device=device).manual_seed(zlib.crc32(name.encode()))
        p.copy_(torch.randn(p.shape, generator=g, device=device, dtype=torch.float32).to(p.dtype) * 0.02)


def build(
    m: ModelConfig,
    par: ParallelConfig,
    groups: EngineGroups,
    args: argparse.Namespace,
    batch: int,
    graphs: bool = True,
) -> RankRunner:
    device = (
        torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    )
    max_seq = args.context + args.warmup + args.steps + 1
    cfg = EngineConfig(
        device=args.device,
        dtype=args.dtype,
        max_batch_size=batch,
        max_seq_len=max_seq,
        block_size=16,
        num_kv_blocks=batch * -(-max_seq // 16),
        torch_threads=args.threads,
        attention_backend="torch" if args.eager else "auto",
        cuda_graphs=graphs and not args.eager,
    )
    runner = RankRunner(m, cfg, par, groups, device, cfg.num_kv_blocks or 0, max_seq)
    randomize(runner.model, device)
    runner.prepare()  # after the weights: graph capture runs the model (every rank in step)
    return runner


def tables(batch: int, max_seq: int) -> list[list[int]]:
    per = -(-max_seq // 16)
    return [list(range(i * per, (i + 1) * per)) for i in range(batch)]


def prefill(runner: RankRunner, batch: int, args: argparse.Namespace) -> list[Span]:
    """Every sequence's context in chunks of at most --prefill-tokens per step (the same random
    tokens on every rank); returns the decode spans of the first step."""
    rng = random.Random(0)
    vocab = runner.model_config.vocab_size
    seqs = [[rng.randrange(vocab) for _ in range(args.context)] for _ in range(batch)]
    tabs = tables(batch, runner.max_seq_len)
    per_step = max(1, args.prefill_tokens // args.context)
    for first in range(0, batch, per_step):
        ids = range(first, min(batch, first + per_step))
        runner.step(StepOrder([Span(tabs[i], 0, seqs[i][:-1]) for i in ids]))
    return [Span(tabs[i], args.context - 1, [seqs[i][-1]]) for i in range(batch)]


def decode(runner: RankRunner, spans: list[Span], args: argparse.Namespace) -> list[float]:
    """Decode steps as the multi-rank engine runs them: rank 0 sends the order (a lean one:
    parallel/orders.py; after the first, no page tables), every rank steps; returns the timed
    steps' seconds (after --warmup)."""
    world = runner.groups.world
    params = [SamplingParams(temperature=1.0)] * len(spans)
    rngs = [random.Random(100 + i) for i in range(len(spans))]
    # Rank 0's sequences as the ledger sees them: each one's page table, state and parameters.
    running = Status.RUNNING
    seqs = [SimpleNamespace(block_table=s.block_table, status=running, params=params[0]) for s in spans]
    ledger = Ledger()
    times = []
    for step in range(args.warmup + args.steps):
        sync(runner.device)
        t0 = time.perf_counter()
        rows = list(range(len(spans)))
        if world.rank == 0:
            draws = ShardedSampler.draws(params, rngs)
            lean = ledger.order(spans, cast(list[Sequence], seqs), rows, cast(list[Sequence], seqs), draws)
            lean.graph = runner.graph_size(spans)
            world.broadcast_object(lean)
            out = runner.step(StepOrder(spans, rows, params, draws, graph=lean.graph))
        else:
            out = runner.step(runner.unpack(world.broadcast_object(None)))
        assert out is not None
        sync(runner.device)
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
        spans = [Span(s.block_table, s.start + 1, [t]) for s, t in zip(spans, out.tokens, strict=True)]
    return times


def timed(fn: Any, device: torch.device, iters: int) -> float:
    """Median seconds of fn() over iters calls (after two untimed ones)."""
    for _ in range(2):
        fn()
    out = []
    for _ in range(iters):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def collectives(
    m: ModelConfig,
    par: ParallelConfig,
    groups: EngineGroups,
    batch: int,
    args: argparse.Namespace,
    device: torch.device,
) -> dict[str, float]:
    dtype = getattr(torch, args.dtype)
    world, tp = groups.world, groups.tp
    d = m.dim
    out: dict[str, float] = {}
    x = torch.randn(batch, d, device=device, dtype=dtype)
    out["all_reduce_batch_x_dim_s"] = timed(lambda: tp.all_reduce(x.clone()), device, args.comm_iters)
    if m.is_moe and par.ep > 1:
        ep = groups.ep
        rows = -(-batch // tp.size) * m.n_experts_per_tok
        send = [rows // ep.size + (r < rows % ep.size) for r in range(ep.size)]
        buf = torch.randn(rows, d, device=device, dtype=dtype)
        counts = torch.tensor(send, device=device)

        def dispatch_combine() -> None:
            recv = ep.exchange_counts(counts).tolist()
            back = ep.all_to_all(buf, send, recv)
            ep.all_to_all(back, recv, send)

        out["moe_all_to_all_per_layer_s"] = timed(dispatch_combine, device, args.comm_iters)
        part = torch.randn(-(-batch // tp.size), d, device=device, dtype=dtype)
        out["moe_tp_gather_per_layer_s"] = timed(lambda: tp.all_gather(part), device, args.comm_iters)
    big = args.bandwidth_mib << 20
    n = world.size
    flat = torch.zeros(big // 2, device=device, dtype=torch.bfloat16)
    t = timed(lambda: world.all_to_all(flat.view(n, -1), [1] * n, [1] * n), device, 5)
    out["all_to_all_busbw_gb_s"] = big * (n - 1) / n / t / 1e9
    t = timed(lambda: world.all_reduce(flat), device, 5)
    out["all_reduce_busbw_gb_s"] = 2 * big * (n - 1) / n / t / 1e9
    out["bandwidth_message_bytes"] = float(big)
    return out


def summary(times: list[float], tokens_per_step: int, gpus: int) -> dict[str, float]:
    med = statistics.median(times)
    return {
        "step_ms_median": med * 1e3,
        "step_ms_p90": sorted(times)[int(0.9 * (len(times) - 1))] * 1e3,
        "tok_s": tokens_per_step / med,
        "tok_s_per_gpu": tokens_per_step / med / gpus,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="moe30b")
    ap.add_argument("--batch", type=int, default=64, help="decoding sequences over the 2 GPUs")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--prefill-tokens", type=int, default=8192, help="tokens per prefill step")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--dtype", default=None, help="default bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--comm-iters", type=int, default=50)
    ap.add_argument("--bandwidth-mib", type=int, default=256)
    ap.add_argument("--eager", action="store_true", help="torch attention, no graphs, on both sides")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    if args.device == "cpu":
        args.comm_iters, args.bandwidth_mib = min(args.comm_iters, 5), min(args.bandwidth_mib, 4)
    torch.set_num_threads(args.threads)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    shape, par = SHAPES[args.shape]
    if world_size != par.ranks:
        sys.exit(f"--shape {args.shape} runs on {par.ranks} ranks (torchrun --nproc_per_node={par.ranks})")
    m = ModelConfig(**shape, max_seq_len=args.context + args.warmup + args.steps + 1)
    backend = "nccl" if args.device == "cuda" else "gloo"
    if args.device == "cuda":
        torch.cuda.set_device(rank)
    groups = init_engine_groups(par, rank, "env://", backend, timeout_s=3600)
    runner = build(m, par, groups, args, args.batch)
    t0 = time.perf_counter()
    spans = prefill(runner, args.batch, args)
    sync(runner.device)
    prefill_s = time.perf_counter() - t0
    times = decode(runner, spans, args)
    comms = collectives(m, par, groups, args.batch, args, runner.device)
    multi = summary(times, args.batch, par.ranks)
    path = {"attention_backend": runner.attention_backend, "cuda_graphs": runner.graphs is not None}
    path["fused_elementwise"] = runner.model.fused_elementwise
    del runner, spans
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    result: dict[str, Any] = {}
    if rank == 0:
        # One GPU, the same per-GPU work (module docstring): half the experts at half the batch
        # for the MoE, the whole dense model at the same batch.
        one = ParallelConfig()
        single = EngineGroups(RankGroup.single(), RankGroup.single(), RankGroup.single(), 0)
        if m.is_moe:
            m1 = m.model_copy(update={"n_routed_experts": m.n_routed_experts // par.ep})
            batch1 = args.batch // par.ranks
        else:
            m1, batch1 = m, args.batch
        base_runner = build(m1, one, single, args, batch1, graphs=path["cuda_graphs"])
        base_times = decode(base_runner, prefill(base_runner, batch1, args), args)
        base = summary(base_times, batch1, 1)
        per_layer = {
            k[:-2] + "_ms": v * 1e3 for k, v in comms.items() if k.endswith("_s") and not k.endswith("gb_s")
        }
        # A step's collectives: o_proj's all-reduce every layer; down_proj's on dense layers; on
        # MoE layers the dispatch/combine all-to-all and the tp group's all-gather.
        n_moe = len(m.moe_layers()) if par.ep > 1 else 0
        dense = m.n_layers - n_moe
        step_comm = comms["all_reduce_batch_x_dim_s"] * (m.n_layers + dense)
        if n_moe:
            step_comm += n_moe * (comms["moe_all_to_all_per_layer_s"] + comms["moe_tp_gather_per_layer_s"])
        result = {
            "bench": "engine/multi",
            "command": "torchrun --standalone --nproc_per_node=2 " + " ".join(sys.argv),
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "machine": machine(),
            "shape": args.shape,
            "model": m.model_dump(mode="json"),
            "parallel": par.model_dump(),
            "batch": args.batch,
            "context": args.context,
            "steps": args.steps,
            "dtype": args.dtype,
            "prefill_s": prefill_s,
            "fast_path": path,
            "baseline_cuda_graphs": base_runner.graphs is not None,
            "multi_rank": multi,
            "baseline_one_gpu": {
                **base,
                "model": "half the experts" if m.is_moe else "the same model",
                "batch": batch1,
            },
            "tok_s_per_gpu_ratio": multi["tok_s_per_gpu"] / base["tok_s_per_gpu"],
            "collectives_ms": per_layer,
            "collectives_per_step_ms": step_comm * 1e3,
            "collectives_share_of_step": step_comm / (multi["step_ms_median"] / 1e3),
            "bandwidth_gb_s": {k: v for k, v in comms.items() if k.endswith("gb_s")},
            "notes": (
                "both sides on the same path (fast_path; the baseline's graphs only where the"
                " multi-rank side has them); step time is from the order's broadcast to the sampled"
                " tokens on the host"
            ),
        }
        write_result(args.out, result)
        print(
            json.dumps(
                {k: result[k] for k in ("multi_rank", "baseline_one_gpu", "tok_s_per_gpu_ratio")}, indent=2
            )
        )
    groups.world.barrier()  # rank 1 waits here while rank 0 measures the baseline
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
