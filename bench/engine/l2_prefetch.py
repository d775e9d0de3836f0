"""Does streaming the next weights into L2 on a side stream shorten the batch-1 decode chain?

The target is a batch-1 decode step within 2x of one weight read. The step's graph is a chain of
~10 dependent kernels per layer; its GEMVs read 4-12 MB each in ~4-5 us where the bytes alone take
1-3 us (bench/engine/profile_batch1.py): each waits for its DRAM latency and ramp-up in turn. Folding
kernels together did not help under PDL (bench/engine/README.md). This probe
tests the other way out, the one megakernels take: keep DRAM streaming the weights continuously,
ahead of the compute chain, so that the chain's GEMVs read from L2 (50 MB on the H200; one
Qwen3-0.6B layer's GEMM weights are 30 MB).

The chain: Qwen3-0.6B's 28 layers as their real decode kernels at batch 1 (services/engine
kernels, PDL on as in the engine): per layer the q/k/v GEMV, add + RMSNorm, the o_proj GEMV,
add + RMSNorm, the gate/up GEMV, SiLU-mul, the down GEMV (attention is left out: it reads the KV,
not weights). Captured as one CUDA graph; variants, each replayed and timed alternately:

- `chain`: the chain alone (the baseline: the engine's graph minus attention).
- `l2_resident`: every layer reuses layer 0's weights, so they stay in L2 (the lower bound a
  perfect prefetch could reach).
- `touch_d{D}`: a side stream reads the weights of the GEMV D ops ahead (a Triton kernel on a few
  programs, evict_last loads) when the chain starts each GEMV; forked and joined with events
  inside the graph.
- `bulk_d{D}`: the same with `cp.async.bulk.prefetch.L2` (one TMA bulk prefetch per 64 KB chunk,
  no registers, no SM time to speak of).

Every variant's GEMV outputs are checked against the chain's (a prefetch changes no numerics).
Reported per variant: graph replay ms, per layer us, and the ratio to the DRAM read of the chain's
weights at the copy bandwidth measured in the same process. A variant whose kernel fails to
compile is recorded with its error; the others still run.

    python3 bench/engine/l2_prefetch.py --out $OUT/l2_prefetch_h200.json    (H200; about a minute)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import traceback
from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl

from bench.engine.w1 import QWEN3_0_6B, measure_bandwidth, profile_setup
from bench.results import write_result
from ops import pdl
from ops.fused_norm import add_rms_norm, silu_mul
from services.engine.kernels.gemv import gemv, replay_us

# (name, N, K) of one layer's decode GEMMs, and the GEMV configuration the warm-up chose for each
# at M = 1 on the H200 (bench/engine/profile_batch1.py's decode_gemm_choices).
GEMMS = (
    ("qkv", 4096, 1024, (2, 1024, 4)),
    ("o_proj", 1024, 2048, (4, 2048, 8)),
    ("gate_up", 6144, 1024, (8, 512, 4)),
    ("down", 1024, 3072, (4, 2048, 8)),
)
CHUNK = 64 << 10  # bytes per bulk prefetch


@triton.jit
def _touch(w_ptr, sink_ptr, n, BLOCK: tl.constexpr):
    """Read n int32 words (evict_last: they should stay in L2 for the GEMV that follows)."""
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], tl.int32)
    for start in range(pid * BLOCK, n, tl.num_programs(0) * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        acc ^= tl.load(w_ptr + offs, mask=offs < n, other=0, eviction_policy="evict_last")
    tl.store(sink_ptr + pid, tl.reduce(acc, 0, _xor))


@triton.jit
def _xor(a, b):
    return a ^ b


@triton.jit
def _bulk_prefetch(base, nbytes, CHUNK_BYTES: tl.constexpr, BLOCK: tl.constexpr):
    """One cp.async.bulk.prefetch.L2 per CHUNK_BYTES of [base, base + nbytes) (16-byte aligned,
    nbytes a multiple of 16); lanes past the end repeat the last chunk."""
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    last = (nbytes - 1) // CHUNK_BYTES
    off = tl.minimum(idx, last).to(tl.int64) * CHUNK_BYTES
    size = tl.minimum(nbytes - off, CHUNK_BYTES).to(tl.int32)
    tl.inline_asm_elementwise(
        "cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0;",
        "=r,l,r",
        [base + off, size],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


def touch(w: torch.Tensor, sink: torch.Tensor, programs: int) -> None:
    words = w.view(torch.int32).view(-1)
    _touch[(programs,)](words, sink, words.numel(), BLOCK=1024, num_warps=8)


def bulk_prefetch(w: torch.Tensor) -> None:
    nbytes = w.numel() * w.element_size()
    chunks = triton.cdiv(nbytes, CHUNK)
    _bulk_prefetch[(triton.cdiv(chunks, 128),)](
        w.data_ptr(), nbytes, CHUNK_BYTES=CHUNK, BLOCK=128, num_warps=4
    )


def prefetch_plan(n_ops: int, distance: int) -> list[list[int]]:
    """plan[i]: the ops whose weights the side stream fetches when op i starts. Ops 0..distance-1
    are fetched at op 0 (nothing runs before them), then op i + distance at op i."""
    plan: list[list[int]] = [[] for _ in range(n_ops)]
    if n_ops:
        plan[0] = list(range(min(distance + 1, n_ops)))
    for i in range(1, n_ops - distance):
        plan[i].append(i + distance)
    return plan


class Chain:
    """The 28-layer batch-1 decode chain of GEMVs and elementwise kernels over fixed buffers."""

    def __init__(self, device: torch.device, layers: int, shared_weights: bool):
        g = torch.Generator(device=device).manual_seed(0)
        dim = QWEN3_0_6B["hidden_size"]

        def rand(*shape: int) -> torch.Tensor:
            return (torch.randn(*shape, generator=g, device=device) * 0.02).to(torch.bfloat16)

        first = [rand(n, k) for _, n, k, _ in GEMMS]
        self.weights = [
            first if shared_weights or i == 0 else [rand(n, k) for _, n, k, _ in GEMMS] for i in range(layers)
        ]
        self.norm_w = torch.ones(dim, dtype=torch.bfloat16, device=device)
        self.h0 = rand(1, dim) * 50
        self.outs: list[torch.Tensor] = []

    def ops(self) -> list[tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]]:
        """(weight, run) per GEMV in order; run takes the chain's running state and returns it."""
        ops = []
        for layer in self.weights:
            for (name, _n, _k, cfg), w in zip(GEMMS, layer, strict=True):
                ops.append((w, self._step(name, w, cfg)))
        return ops

    def _step(
        self, name: str, w: torch.Tensor, cfg: tuple[int, int, int]
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        attn_width = QWEN3_0_6B["num_attention_heads"] * QWEN3_0_6B["head_dim"]
        inner = QWEN3_0_6B["intermediate_size"]

        def run(state: torch.Tensor) -> torch.Tensor:
            x = state
            if name in ("qkv", "gate_up"):  # the residual add + RMSNorm before them
                self.h, x = add_rms_norm(self.h, state, self.norm_w, 1e-6)
            out = gemv(x, w, cfg)
            self.outs.append(out)
            if name == "qkv":  # the attention output's shape, for o_proj (attention reads KV, not weights)
                return out[:, :attn_width].contiguous()
            if name == "gate_up":
                return silu_mul(out[:, :inner], out[:, inner:])
            return out

        return run

    def capture(self, prefetch: Callable[[torch.Tensor], None] | None, distance: int) -> torch.cuda.CUDAGraph:
        """The chain as one graph; with `prefetch`, a side stream fetches op i + distance's weight
        when op i starts (fork: an event on the chain's stream; join at the end). Every kernel
        runs once eagerly first: Triton compiles and loads a kernel at its first launch, which
        must not happen inside a capture (the engine's graphs warm up the same way)."""
        ops = self.ops()
        with pdl.scope(True):
            self.h, state = self.h0.clone(), torch.zeros_like(self.h0)
            for w, run in ops[: len(GEMMS)]:
                state = run(state)
                if prefetch is not None:
                    prefetch(w)
        torch.cuda.synchronize()
        plan = prefetch_plan(len(ops), distance)
        main = torch.cuda.current_stream()
        side = torch.cuda.Stream()
        graph = torch.cuda.CUDAGraph()
        self.outs = []
        with torch.cuda.graph(graph), pdl.scope(True):
            self.h = self.h0.clone()
            state = torch.zeros_like(self.h0)
            for i, (_w, run) in enumerate(ops):
                if prefetch is not None and plan[i]:
                    fork = torch.cuda.Event()
                    fork.record(main)
                    side.wait_event(fork)
                    with torch.cuda.stream(side):
                        for j in plan[i]:
                            prefetch(ops[j][0])
                state = run(state)
            if prefetch is not None:
                join = torch.cuda.Event()
                join.record(side)
                main.wait_event(join)
        return graph


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=QWEN3_0_6B["num_hidden_layers"])
    ap.add_argument("--distances", default="1,2,4", help="how many GEMVs ahead the side stream fetches")
    ap.add_argument("--touch-programs", type=int, default=16, help="programs of the touch kernel")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("l2_prefetch.py measures the GPU's memory system: it needs CUDA (the H200)")
    cuda, device, _dtype, _model, report = profile_setup(
        False,
        "the same chain without prefetch (`chain`), in the same process; and the DRAM read of its weights",
    )
    assert cuda
    bw = measure_bandwidth(device)
    chain = Chain(device, args.layers, shared_weights=False)
    resident = Chain(device, args.layers, shared_weights=True)
    weight_bytes = sum(w.numel() * w.element_size() for layer in chain.weights for w in layer)
    report.update(bandwidth_bytes_s=bw, weight_bytes=weight_bytes, dram_read_ms=weight_bytes / bw * 1e3)
    sink = torch.empty(args.touch_programs, dtype=torch.int32, device=device)
    variants: dict[str, tuple[Chain, Callable[[torch.Tensor], None] | None, int]] = {
        "chain": (chain, None, 0),
        "l2_resident": (resident, None, 0),
    }
    for d in (int(x) for x in args.distances.split(",")):
        variants[f"touch_d{d}"] = (chain, lambda w: touch(w, sink, args.touch_programs), d)
        variants[f"bulk_d{d}"] = (chain, bulk_prefetch, d)
    graphs: dict[str, torch.cuda.CUDAGraph] = {}
    outs: dict[str, list[torch.Tensor]] = {}
    results: dict[str, dict[str, Any]] = {}
    for name, (ch, fetch, d) in variants.items():
        try:
            g = ch.capture(fetch, d)
            g.replay()
            torch.cuda.synchronize()
            graphs[name], outs[name] = g, [o.clone() for o in ch.outs]
            results[name] = {}
        except Exception as e:  # noqa: BLE001 - one variant that fails to build is a result too
            results[name] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]}
            torch.cuda.synchronize()
    for name in graphs:  # a prefetch changes no output (l2_resident runs other weights)
        if name not in ("chain", "l2_resident") and "chain" in outs:
            same = all(torch.equal(a, b) for a, b in zip(outs["chain"], outs[name], strict=True))
            results[name]["outputs_equal_chain"] = same
    times: dict[str, list[float]] = {name: [] for name in graphs}
    for _ in range(5):  # alternate, so clock drift hits every variant alike
        for name, g in graphs.items():
            times[name].append(replay_us(g, 20) / 1e3)
    base = statistics.median(times["chain"]) if "chain" in times else None
    for name, ts in times.items():
        ms = statistics.median(ts)
        results[name].update(
            graph_replay_ms=round(ms, 4),
            replay_ms_all=[round(t, 4) for t in ts],
            us_per_layer=round(ms * 1e3 / args.layers, 2),
            over_dram_read=round(ms / report["dram_read_ms"], 3),
            **({"over_chain": round(ms / base, 4)} if base else {}),
        )
    report["variants"] = results
    write_result(args.out, report)
    print(json.dumps({k: v for k, v in report.items() if k != "machine"}, indent=1)[:6000])
    if any(r.get("outputs_equal_chain") is False for r in results.values()):
        sys.exit("a prefetch variant changed the GEMV outputs (see outputs_equal_chain)")


if __name__ == "__main__":
    main()
