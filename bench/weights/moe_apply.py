"""An MoE engine applying a published version: every layer's experts in one copy per fused buffer
(services/engine/weight_copy.copy_pieces) against one copy per expert tensor (copy_each), in the
same process, on the same directory read once.

    python bench/weights/moe_apply.py --out $OUT/moe_apply.json                          # GPU
    python bench/weights/moe_apply.py --device cpu --layers 2 --vocab 4096 --out /tmp/m.json

Qwen3-30B-A3B's layer shapes (bench/shapes.py "30b-a3b": 128 experts of 768 x 2048 per layer),
`--layers` of its 48 (expert costs are per layer: the full model's are 48 / layers times these),
published by trainer.publish.Publisher in bf16 and FP8 (E4M3, 128x128 block scales: the engine
copies the file's bits). For each precision: the copy operations each path issues into the expert
buffers per apply, `apply_s` (the engine loop held,
`relay_decode_weight_apply_last_seconds`) of each path, alternated `--repeats` times, their
medians and ratio, and whether both paths leave the engine's every buffer with the same bits.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.machine import machine  # noqa: E402
from bench.results import write_result
from bench.weights.publish_apply import engine, free, model_config, publish  # noqa: E402
from services.engine.layers import fp8 as engine_fp8  # noqa: E402
from services.engine.layers import moe as engine_moe  # noqa: E402
from services.engine.weight_copy import copy_each, copy_pieces  # noqa: E402

PATHS = {"stacked": copy_pieces, "per_expert": copy_each}
copies: dict[str, int] = {}  # copy operations into the engine's expert buffers, by path


def use(path: str) -> None:
    """Apply experts through `path`, counting its copy operations (stacked: one per buffer and
    layer; per_expert: one per expert tensor, each its own staged host-to-device copy on a GPU)."""
    copy = PATHS[path]

    def counted(dst: torch.Tensor, pieces: list[torch.Tensor]) -> None:
        copies[path] = copies.get(path, 0) + (1 if path == "stacked" else len(pieces))
        copy(dst, pieces)

    engine_moe.copy_pieces = engine_fp8.copy_pieces = counted  # type: ignore[attr-defined]


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every buffer's bytes (fp8 included), on the host."""
    return {k: v.detach().reshape(-1).view(torch.uint8).cpu() for k, v in model.state_dict().items()}


def run(
    quant: str, layers: int, vocab: int, device: torch.device, root: Path, repeats: int
) -> dict[str, Any]:
    m = model_config("30b-a3b").model_copy(update={"n_layers": layers, "vocab_size": vocab})
    pub = publish(m, quant, device, root, (1, 2))
    d1, d2 = root / "weights" / "step_1", root / "weights" / "step_2"
    eng = engine(d1, quant, device)
    ckpt = eng.read_weights(d2)  # read once: both paths apply the same mapped bytes
    before = eng.read_weights(d1)
    times: dict[str, list[float]] = {p: [] for p in PATHS}
    bits: dict[str, dict[str, torch.Tensor]] = {}
    try:
        for i in range(repeats):
            for path in PATHS:
                use(path)
                eng.apply_weights(before, 1)  # other bits in every buffer first (not timed)
                copies.pop(path, None)
                eng.apply_weights(ckpt, 2)
                times[path].append(round(eng.stats.weight_apply_seconds_last, 4))
                if i == 0:
                    bits[path] = snapshot(eng.model)
    finally:
        engine_moe.copy_pieces = engine_fp8.copy_pieces = copy_pieces  # type: ignore[attr-defined]
    a, b = bits["stacked"], bits["per_expert"]
    med = {p: statistics.median(t) for p, t in times.items()}
    out = {
        "layers": layers,
        "experts_per_layer": m.n_routed_experts,
        "publish_bytes": pub["runs"][-1]["bytes"],
        "apply_bytes": ckpt.nbytes,
        "expert_copies_per_apply": dict(copies),
        "apply_s": times,
        "median_s": med,
        "per_expert_over_stacked": round(med["per_expert"] / max(med["stacked"], 1e-9), 2),
        "bit_identical": list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a),
        "differing_buffers": [k for k in a if k in b and not torch.equal(a[k], b[k])][:5],
    }
    del eng, ckpt, before, bits
    free(device)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--precisions", default="bf16,fp8")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    device = torch.device(args.device)
    result: dict[str, Any] = {
        "command": " ".join(["python", *sys.argv]),
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "device": str(device),
        "shape": "30b-a3b",
        "precisions": {},
    }
    for prec in args.precisions.split(","):
        quant = "none" if prec == "bf16" else prec
        with tempfile.TemporaryDirectory(prefix="relay-moe-apply-", dir=args.dir) as root:
            result["precisions"][prec] = rec = run(
                quant, args.layers, args.vocab, device, Path(root), args.repeats
            )
        print(json.dumps({prec: rec}), flush=True)
        write_result(args.out, result)


if __name__ == "__main__":
    main()
