"""Where the batch-1 megakernel's time goes (services/engine/kernels/megakernel.py).

Builds Qwen3-0.6B's 28 layers with random bf16 weights and a random KV cache (context --ctx), and
times the persistent decode kernel under launch overrides, each as CUDA events around --launches
back-to-back launches (the residual row reset before each), rounds alternating between variants:

- `full`: the engine's launch; `warps16`; `late_gu`: gate/up's weights loaded in the o_proj
  phase, not already in the merge phase;
- `ta1`, `ta2`: only the arrival (1) or only the passing (2) stores of TRACE_ALL (the passing
  stores alone measured the kernel 3% faster, unexplained);
- measured slower or equal and not in the kernel (git history has those variants): L2 prefetch
  of weights or KV, the merge folded into the attention phase, the look-ahead not spread over the
  barriers, volatile timer reads around the barriers, fewer phases a layer (the merge inside
  o_proj; the MLP in one phase), relaxed barrier polling, weights loaded `.cg`, and one
  `cp.async.bulk.prefetch.L2` of each weight slice a phase ahead;
- `barriers_only`: the grid barriers alone (WORK off);
- `arrivals`: every program's time at each arrival and barrier passing (TRACE_ALL), summarised per
  phase (which programs arrive last, by how much, how long the barrier takes to pass after them);
- `trace`: program 0's %globaltimer after every barrier, and inside each GEMV and attention
  phase once its inputs are in registers and once its result is computed: the mean time of each
  phase (its barrier included) and its split into inputs / compute / store + barrier;
- `only_<phase>`: one phase per layer (its barrier included), the others skipped (such a
  phase loads its own weights after the barrier: no look-ahead).

Every variant records its compiled kernel's registers and spills. Every full-work variant's
output row is compared with `full`'s (the same arithmetic: it must be
equal up to the order of float32 sums). The baseline in the same process is the DRAM read of the
layers' weights at the measured copy bandwidth.

    python3 bench/engine/megakernel_probe.py --out $OUT/megakernel_probe.json     (H200, ~1 minute)
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for bench.results
from bench.results import write_result  # noqa: E402

PHASE_NAMES = ("qkv", "attn", "merge", "o", "gate_up", "down")
VARIANTS: dict[str, dict[str, Any]] = {
    "full": {},
    "warps16": {"num_warps": 16},
    "late_gu": {"EARLY_GU": False},
    "trace": {"TRACE": True},
    "arrivals": {"TRACE_ALL": 3},
    "ta1": {"TRACE_ALL": 1},
    "ta2": {"TRACE_ALL": 2},
    "barriers_only": {"WORK": False},
    **{f"only_{name}": {"PHASES": 1 << i} for i, name in enumerate(PHASE_NAMES)},
}
FULL_WORK = ("full", "warps16", "late_gu", "trace", "arrivals", "ta1", "ta2")


def build(
    device: torch.device, ctx: int, layers: int, sms: int | None = None
) -> tuple[Any, dict[str, torch.Tensor], int]:
    """(the megakernel, its inputs, weight bytes of the layers) at Qwen3-0.6B's shapes, for `sms`
    SMs (default: the device's; more than it has leaves programs that cannot start)."""
    from services.common.config import ModelConfig
    from services.engine.kernels.megakernel import DecodeMegakernel
    from services.engine.kv_cache import KVCache
    from services.engine.models.causal_lm import CausalLM

    m = ModelConfig(dim=1024, n_layers=layers, n_heads=16, n_kv_heads=8, head_dim=128, hidden_dim=3072,
                    vocab_size=1024, max_seq_len=4096)  # fmt: skip
    torch.manual_seed(0)
    model = CausalLM(m, 4096).to(device, torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if p.dim() == 1 else 0.02 * torch.randn_like(p))
    model.fuse_projections()
    page = 16
    kv = KVCache.for_model(m, 512, page, 4096, torch.bfloat16, device)
    kv.k.normal_()
    kv.v.normal_()
    if sms is None:
        sms = torch.cuda.get_device_properties(device).multi_processor_count
    mk = DecodeMegakernel(model, kv.k, kv.v, page, sms)
    pages = torch.randperm(512, device=device)[: -(-ctx // page)]
    pos = ctx - 1
    inputs = {
        "h0": torch.randn(1, m.dim, device=device),
        "positions": torch.tensor([pos], device=device),
        "slots": (pages[pos // page] * page + pos % page).view(1),
        "ctx_lens": torch.tensor([ctx], device=device),
        "block_table": pages.contiguous(),
    }
    weight_bytes = sum(
        t.numel() * t.element_size()
        for layer in model.model.layers
        for t in (
            layer.self_attn.qkv.weight,
            layer.self_attn.o_proj.weight,
            layer.mlp.gate_up.weight,
            layer.mlp.down_proj.weight,
        )  # fmt: skip
    )
    return mk, inputs, weight_bytes


def run_once(mk: Any, inputs: dict[str, torch.Tensor], h: torch.Tensor) -> torch.Tensor:
    h.copy_(inputs["h0"])
    return mk.run(h, inputs["positions"], inputs["slots"], inputs["ctx_lens"], inputs["block_table"])


def time_us(fn: Callable[[], object], launches: int) -> float:
    """Microseconds per call of `fn` over `launches` back-to-back calls (CUDA events): the probes'
    persistent kernels reset their barrier (and input) before each launch, so no graph replay."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(launches):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / launches


def read_trace(
    mk: Any, inputs: dict[str, torch.Tensor], h: torch.Tensor, layers: int, out: dict[str, Any], name: str
) -> None:
    """One traced launch of variant `name`: program 0's barrier marks and inner marks (megakernel
    TRACE) into `out`."""
    mk.tuning = VARIANTS[name]
    mk.trace.zero_()  # (the buffer is shared with TRACE_ALL's)
    run_once(mk, inputs, h)
    torch.cuda.synchronize()
    t = mk.trace.cpu().double()
    phases = len(PHASE_NAMES)
    n_marks = int((t[: layers * phases + 1] > 0).sum())
    d = (t[1:n_marks] - t[: n_marks - 1]) / 1e3  # us between program 0's barrier exits
    per = {name: round(float(d[i::phases].mean()), 3) for i, name in enumerate(PHASE_NAMES)}
    out["us_per_phase_incl_barrier"] = per
    out["marks"] = n_marks
    # Inner marks (program 0): inputs in registers, result computed; so each phase splits
    # into waiting for its inputs after the barrier, computing, and storing + the barrier.
    inner = t[layers * phases + 1 : 3 * layers * phases + 1].view(layers, phases, 2)
    split: dict[str, dict[str, float]] = {}
    for i, name in enumerate(PHASE_NAMES):
        rows = [
            (inner[j, i, 0] - t[j * phases + i], inner[j, i, 1] - inner[j, i, 0], t[j * phases + i + 1] - inner[j, i, 1])
            for j in range(layers - 1)  # (the last layer's down phase has no barrier)
            if inner[j, i, 0] > 0
        ]  # fmt: skip
        if rows:
            cols = list(zip(*rows, strict=True))
            split[name] = {key: round(float(sum(c) / len(c)) / 1e3, 3)
                           for key, c in zip(("inputs", "compute", "store_and_barrier"), cols, strict=True)}  # fmt: skip
    out["us_split"] = split


def read_arrivals(mk: Any, inputs: dict[str, torch.Tensor], h: torch.Tensor, layers: int,
                  out: dict[str, Any], name: str) -> None:  # fmt: skip
    """One launch with every program's (arrival, passing) time at every barrier (TRACE_ALL),
    summarised per phase: how far the last arrival trails the median one, how long after the
    last arrival the programs see the barrier pass, which programs arrive last most often, and
    each program's mean lateness (us behind the median arrival)."""
    mk.tuning = VARIANTS[name]
    mk.trace.zero_()
    run_once(mk, inputs, h)
    torch.cuda.synchronize()
    p, phases = mk.programs, len(PHASE_NAMES)
    nb = layers * phases - 1  # the last layer's down phase has no barrier
    t = mk.trace[: 2 * p * layers * phases].view(p, layers * phases, 2)[:, :nb].cpu().double() / 1e3
    arrive, passed = t[..., 0], t[..., 1]
    median = arrive.median(dim=0).values
    last, last_pid = arrive.max(dim=0)
    late = arrive - median[None, :]
    per: dict[str, Any] = {}
    for i, name in enumerate(PHASE_NAMES):
        cols = list(range(i, nb, phases))
        pids = last_pid[cols].tolist()
        per[name] = {
            "last_after_median_us": round(float((last - median)[cols].mean()), 3),
            "first_to_last_us": round(float((last - arrive.min(dim=0).values)[cols].mean()), 3),
            "pass_after_last_us": round(float((passed[:, cols] - last[None, cols]).median()), 3),
            "most_often_last": sorted(((pids.count(q), q) for q in set(pids)), reverse=True)[:5],
            "latest_programs_mean_us": sorted(
                ((round(float(late[q, cols].mean()), 3), q) for q in range(p)), reverse=True
            )[:8],
        }
    out["arrivals"] = per


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--ctx", type=int, default=600)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--launches", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args()
    from bench.engine.w1 import measure_bandwidth, profile_setup

    cuda, device, _, _, report = profile_setup(False, "the DRAM read of the layers' weights (same process)")
    if not cuda:
        print("megakernel_probe needs a CUDA GPU (Hopper)", file=sys.stderr)
        sys.exit(2)
    out = Path(args.out)
    mk, inputs, weight_bytes = build(device, args.ctx, args.layers)
    bw = measure_bandwidth(device)
    report.update({"ctx": args.ctx, "layers": args.layers, "programs": mk.programs, "weight_bytes": weight_bytes,
                   "bandwidth_bytes_s": bw, "dram_read_us": weight_bytes / bw * 1e6})  # fmt: skip
    names = [v for v in args.variants.split(",") if v]
    h = torch.empty_like(inputs["h0"])
    results: dict[str, Any] = {}
    outputs: dict[str, torch.Tensor] = {}
    for name in names:  # compile + first output
        mk.tuning = VARIANTS[name]
        try:
            outputs[name] = run_once(mk, inputs, h).clone()
            torch.cuda.synchronize()
            results[name] = {"tuning": dict(VARIANTS[name]), "us": []}
            results[name].update({k: getattr(mk.compiled, k, None) for k in ("n_regs", "n_spills")})
        except Exception as e:  # noqa: BLE001
            results[name] = {"error": f"{type(e).__name__}: {e}"[:500]}
        write_result(out, {**report, "variants": results})
    for _ in range(args.rounds):
        for name in names:
            if "error" in results[name]:
                continue
            mk.tuning = VARIANTS[name]
            results[name]["us"].append(round(time_us(lambda: run_once(mk, inputs, h), args.launches), 2))
    for name, r in results.items():  # the traced variants' breakdowns
        tuning = VARIANTS[name]
        if "error" in r or not (tuning.get("TRACE") or tuning.get("TRACE_ALL") == 3):
            continue
        try:
            (read_trace if tuning.get("TRACE") else read_arrivals)(mk, inputs, h, args.layers, r, name)
        except Exception as e:  # noqa: BLE001 - the timings above still get written
            r["trace_error"] = f"{type(e).__name__}: {e}"[:500]
    ref = outputs.get("full")
    for name, r in results.items():
        if "error" in r:
            continue
        r["median_us"] = statistics.median(r["us"])
        r["us_per_layer"] = round(r["median_us"] / args.layers, 2)
        r["over_dram_read"] = round(r["median_us"] / report["dram_read_us"], 3)
        if ref is not None and name in FULL_WORK:
            r["max_abs_diff_vs_full"] = float((outputs[name] - ref).abs().max())
            r["rel_diff_vs_full"] = float((outputs[name] - ref).abs().max() / ref.abs().max())
            r["finite"] = bool(torch.isfinite(outputs[name]).all())
    report["variants"] = results
    write_result(out, report)
    for name, r in results.items():
        print(name, {k: v for k, v in r.items() if k not in ("us", "tuning")})


if __name__ == "__main__":
    main()
