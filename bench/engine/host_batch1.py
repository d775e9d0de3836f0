"""Where the host's time goes in a batch-1 decode step (the target: a step within 2x of one weight read).

With CUDA graphs and overlap scheduling a batch-1 step is bound by whichever is slower: the GPU
(graph + logits + sampler) or the host's own work per step (scheduling, input building, the
launches and copies, landing the previous step's token). This runs W1's Qwen3-0.6B-shaped model
with the engine's defaults, decodes one request, and reports:
- the unsynced mean step (what overlap delivers) and the mean of each step phase
  (`LLMEngine.stats.last_step_phases`);
- the host-side ops of a step (torch.profiler CPU activity: aten ops, CUDA runtime calls, with
  their self CPU time per step);
- the Python functions with the most own time per step (cProfile; it inflates Python time, so
  read the ranking, not the absolute figures).

    python3 bench/engine/host_batch1.py --out $OUT/host_batch1.json            (H200)
    .venv/bin/python bench/engine/host_batch1.py --smoke --out /tmp/h.json     (CPU)
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from bench.engine.profile_batch1 import engine_config
from bench.engine.w1 import build_model_dir, profile_setup
from bench.results import write_result


def run_steps(eng: Any, n: int) -> None:
    for _ in range(n):
        eng.step()


def request(eng: Any, prompt: list[int], tokens: int) -> Any:
    from services.common.schemas import GenerateRequest, SamplingParams

    sampling = SamplingParams(temperature=1.0, max_tokens=tokens, ignore_eos=True)
    return eng.add_request(GenerateRequest(input_ids=prompt, sampling=sampling))


def phase_means(eng: Any, n: int) -> dict[str, float]:
    sums: dict[str, float] = defaultdict(float)
    for _ in range(n):
        eng.step()
        for k, v in eng.stats.last_step_phases.items():
            sums[k] += v
    return {k: round(v * 1e3 / n, 4) for k, v in sums.items()}


def op_table(eng: Any, n: int, sync: Any) -> list[dict[str, Any]]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run_steps(eng, n)
        sync()
    rows = []
    for e in prof.key_averages():
        rows.append(
            {
                "op": e.key[:90],
                "calls_per_step": round(e.count / n, 2),
                "self_cpu_us_per_step": round(e.self_cpu_time_total / n, 2),
            }
        )
    rows.sort(key=lambda r: -r["self_cpu_us_per_step"])
    return rows[:40]


def python_table(eng: Any, n: int) -> list[dict[str, Any]]:
    pr = cProfile.Profile()
    pr.enable()
    run_steps(eng, n)
    pr.disable()
    st = pstats.Stats(pr)
    rows = []
    for (file, line, fn), (_cc, nc, tt, ct, _) in st.stats.items():  # type: ignore[attr-defined]
        rows.append(
            {
                "function": f"{Path(file).name}:{line}:{fn}",
                "calls_per_step": round(nc / n, 2),
                "own_us_per_step": round(tt * 1e6 / n, 2),
                "cumulative_us_per_step": round(ct * 1e6 / n, 2),
            }
        )
    rows.sort(key=lambda r: -r["own_us_per_step"])
    return rows[:40]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--set", action="append", default=[], help="EngineConfig field=value (a TOML value)")
    args = ap.parse_args()
    cuda, device, dtype, model_kw, report = profile_setup(
        args.smoke, "none: host time per step, broken down (the GPU's share is the graph replay)"
    )
    root = Path(tempfile.mkdtemp(prefix="host1-"))
    build_model_dir(model_kw, device, dtype, root)
    from services.common.config import EngineConfig, parse_overrides
    from services.engine import LLMEngine

    # Validated: a misspelt field is an error, not a run with the defaults.
    overrides = parse_overrides([f"--{s}" for s in args.set])
    cfg = EngineConfig.model_validate({**engine_config(cuda, device).model_dump(), **overrides})
    report["config_overrides"] = overrides
    eng = LLMEngine(root, cfg)
    report["overlap"] = eng.overlap
    prompt = list(range(2, 514)) if cuda else list(range(2, 40))

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    n = args.steps
    # Each measurement on a fresh request long enough for it, after its prefill and first decodes.
    for name, fn in (
        ("unsynced", None),
        ("phases", phase_means),
        ("ops", lambda e, k: op_table(e, k, sync)),
        ("python", python_table),
    ):
        state = request(eng, prompt, n + 16)
        run_steps(eng, 8)
        sync()
        if fn is None:
            t0 = time.perf_counter()
            run_steps(eng, n)
            sync()
            report["step_ms_unsynced_mean"] = round((time.perf_counter() - t0) * 1e3 / n, 4)
        else:
            report[name] = fn(eng, n)
        while not state.finished:
            eng.step()
        eng.flush()
    write_result(args.out, report)
    print(json.dumps({k: v for k, v in report.items() if k != "machine"}, indent=1)[:12000])


if __name__ == "__main__":
    main()
