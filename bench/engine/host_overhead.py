"""Host-side (Python) cost of one decode step at batch 256, on CPU with a tiny model.

    .venv/bin/python bench/engine/host_overhead.py [--batch 256] [--steps 200] [--out host.json]
        [--mode both|off|overlap]

On the GPU a decode step's forward is one CUDA-graph replay; what the host does around it (schedule,
building the spans and the paged batch, the per-sequence bookkeeping before and after sampling)
is serial with the GPU unless it is overlapped, so it is measured here on its own: the engine's
own phase methods (`Scheduler.schedule`, `LLMEngine.spans`, `HostBatch.build`, `LLMEngine.advance`,
`LLMEngine.commit`) on a real engine, with real sequences, timed one by one. The forward itself
runs too (torch backend, tiny model: it gives the sampled tokens) but is not part of the figures.
The sampler is timed separately on [batch, 151936] float32 logits (CPU, so only indicative).

With overlap scheduling (decode.engine.overlap_schedule) the same host work runs in another order
(`LLMEngine._step_overlapped`: schedule, spans with pending tokens, choice of sampling rows, forward
and sampling launched, then landing the previous step's tokens, then page bookkeeping); on a GPU it
runs while the next step computes. `overlap_median_ms` times those phases the same way.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.results import dumps, write_result  # noqa: E402
from services.common.config import EngineConfig, load_config  # noqa: E402
from services.common.modeldir import hf_config  # noqa: E402
from services.common.schemas import GenerateRequest, SamplingParams  # noqa: E402
from services.common.weights_dir import write_model_dir  # noqa: E402
from services.engine.batch import HostBatch  # noqa: E402
from services.engine.layers.sampler import Sampler  # noqa: E402
from services.engine.llm_engine import LLMEngine  # noqa: E402
from services.engine.models.causal_lm import CausalLM  # noqa: E402
from services.engine.overlap import InFlight  # noqa: E402


def build_engine(
    root: Path, batch: int, prompt_len: int, max_tokens: int, overlap: bool = False
) -> LLMEngine:
    m = load_config("debug").model.model_copy(update={"max_seq_len": 1024})
    torch.manual_seed(0)
    state = CausalLM(m, m.max_seq_len).state_dict()  # random weights: only the host work matters
    state = {k: v for k, v in state.items() if "rope" not in k}
    path = write_model_dir(root / "step_0", state, hf_config(m, eos_token_id=0), None, {"version": 0})
    cfg = EngineConfig(
        device="cpu", max_batch_size=batch, max_seq_len=1024, block_size=16, overlap_schedule=overlap
    )
    engine = LLMEngine(path, cfg)
    for i in range(batch):
        prompt = [(i * 7 + j) % 60 + 1 for j in range(prompt_len)]
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=i)
        engine.add_request(GenerateRequest(input_ids=prompt, sampling=sp))
    return engine


def timed_steps(engine: LLMEngine, steps: int) -> dict[str, list[float]]:
    """Run decode steps phase by phase (the body of LLMEngine.step) and time each host phase."""
    t: dict[str, list[float]] = {k: [] for k in ("schedule", "spans", "host_batch", "advance", "commit")}
    for _ in range(steps):
        c0 = time.perf_counter()
        plan = engine.scheduler.schedule()
        c1 = time.perf_counter()
        spans = engine.spans(plan)
        c2 = time.perf_counter()
        HostBatch.build(spans, engine.kv.block_size, engine.block_tables)  # what the GPU path builds
        c3 = time.perf_counter()
        seqs, rows = engine._sampling_rows(plan)
        launched = engine.runner.launch(spans, seqs, rows)
        c4 = time.perf_counter()
        engine.advance(plan)
        c5 = time.perf_counter()
        out = launched.resolve()
        c6 = time.perf_counter()
        engine.commit(seqs, out)
        c7 = time.perf_counter()
        for k, dt in zip(t, (c1 - c0, c2 - c1, c3 - c2, c5 - c4, c7 - c6), strict=True):
            t[k].append(dt * 1e3)
    return t


def timed_steps_overlapped(engine: LLMEngine, steps: int) -> dict[str, list[float]]:
    """The body of LLMEngine._step_overlapped, phase by phase (forward and sampling not counted)."""
    keys = ("schedule", "spans", "host_batch", "sampling_rows", "land", "advance")
    t: dict[str, list[float]] = {k: [] for k in keys}
    for _ in range(steps):
        c0 = time.perf_counter()
        plan = engine.scheduler.schedule()
        c1 = time.perf_counter()
        spans, feed = engine._spans_overlapped(plan)
        c2 = time.perf_counter()
        HostBatch.build(spans, engine.kv.block_size, engine.block_tables)  # what the GPU path builds
        c3 = time.perf_counter()
        seqs, rows = engine._sampling_rows(plan)
        c4 = time.perf_counter()
        launched = engine.runner.launch(spans, seqs, rows, feed)
        for j, s in enumerate(seqs):
            s.pending += 1
            s.pending_row = j
        prev, engine._inflight = engine._inflight, InFlight(seqs, launched, engine.version)
        c5 = time.perf_counter()
        if prev is not None:
            engine._land(prev)
        c6 = time.perf_counter()
        engine._advance_overlapped(plan)
        c7 = time.perf_counter()
        for k, dt in zip(t, (c1 - c0, c2 - c1, c3 - c2, c4 - c3, c6 - c5, c7 - c6), strict=True):
            t[k].append(dt * 1e3)
    return t


def measure(args: argparse.Namespace, overlap: bool) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        engine = build_engine(Path(tmp), args.batch, args.prompt_len, args.steps + 50, overlap)
        while any(s.num_cached < len(s.prompt) for s in engine.scheduler.running) or engine.num_waiting:
            engine.step()  # prefill everything; what follows are decode-only steps
        for _ in range(20):
            engine.step()  # warm-up
        t = timed_steps_overlapped(engine, args.steps) if overlap else timed_steps(engine, args.steps)
    med = {k: round(statistics.median(v), 3) for k, v in t.items()}
    med["total"] = round(sum(med.values()), 3)
    return med


def sampler_ms(batch: int, vocab: int, reps: int) -> float:
    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams()] * batch
    import random

    rngs = [random.Random(i) for i in range(batch)]
    sampler = Sampler()
    sampler.sample(logits, params, rngs)
    times = []
    for _ in range(reps):
        c0 = time.perf_counter()
        sampler.sample(logits, params, rngs)
        times.append((time.perf_counter() - c0) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--prompt-len", type=int, default=100)
    ap.add_argument("--sampler-reps", type=int, default=3)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--mode", choices=("both", "off", "overlap"), default="both")
    args = ap.parse_args()
    torch.set_num_threads(1)
    result: dict[str, object] = {"device": "cpu", "batch": args.batch, "steps": args.steps}
    if args.mode in ("both", "off"):
        med = measure(args, overlap=False)
        result["host_total_ms"] = med.pop("total")
        result["median_ms"] = med
    if args.mode in ("both", "overlap"):
        med = measure(args, overlap=True)
        result["overlap_host_total_ms"] = med.pop("total")
        result["overlap_median_ms"] = med
    if args.sampler_reps > 0:
        result["sampler_cpu_ms[batch x 151936]"] = round(sampler_ms(args.batch, 151936, args.sampler_reps), 1)
    print(dumps(result), end="")
    if args.out:
        write_result(args.out, result)


if __name__ == "__main__":
    main()
