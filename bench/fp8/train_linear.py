"""The FP8 trainer's linear on the H200: a GPU self-check of the backward's pieces, then forward +
backward time of one training linear (3 GEMMs) in bf16 and with trainer/fp8.py's recipe:

  fp8_fwd        FP8 forward, bf16 backward through the dequantised weight / activations
  fp8_fwd_dgrad  + the FP8 dgrad (grad_out 1x128 x the transposed 128x128 weight tiles)
  fp8_all        + the FP8 weight gradient over tokens (grad_out^T and x^T quantised 1x128 along
                 the tokens; torch block-wise scaled_mm with 1x128 scales on both operands)

Self-check (bits and bounds, against ops/fp8/recipe.py's references run on the GPU): the
Triton weight quantiser and its transposed copy, the transposed activation quantiser, the token
GEMM (cuBLAS) against the float32 reference, and each gradient of `fp8_all` against its formula.
Shapes: DeepSeek-V3's (M = 8192 tokens) and Qwen3-0.6B/4B's (M = 16384).

    python3 bench/fp8/train_linear.py --out $OUT/fp8_train_linear.json
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import gemm as bench  # noqa: E402

from bench.results import write_result
from ops.fp8 import recipe as ref  # noqa: E402
from ops.fp8.dispatch import fp8_gemm_dispatch, quantize_activation  # noqa: E402
from ops.fp8.triton_quant import (  # noqa: E402
    triton_quantize_act_both,
    triton_quantize_act_t,
    triton_quantize_weight,
)
from trainer.fp8 import fp8_linear  # noqa: E402

SHAPES = [
    (8192, 7168, 2048),
    (8192, 4096, 7168),
    (8192, 2048, 7168),
    (8192, 18432, 7168),
    (16384, 9728, 2560),
    (16384, 2560, 9728),
    (16384, 3072, 1024),
    (16384, 1024, 3072),
]
VARIANTS = {"fp8_fwd": (False, False), "fp8_fwd_dgrad": (True, False), "fp8_all": (True, True)}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.equal(a.view(torch.uint8), b.view(torch.uint8)))


def self_check(dev: torch.device) -> dict[str, Any]:
    g = torch.Generator(device=dev).manual_seed(0)
    out: dict[str, Any] = {}
    for pow2 in (False, True):
        w = torch.randn(1000, 1300, device=dev, generator=g) * torch.exp(
            torch.randn(1000, 1, device=dev, generator=g)
        )
        q, s, qt = triton_quantize_weight(w, pow2, transposed=True)
        rq, rs = ref.quantize_weight(w, pow2)
        assert qt is not None
        out[f"weight_pow2={pow2}"] = (
            same_bits(q, rq) and torch.equal(s, rs) and same_bits(qt, rq.t().contiguous())
        )
        x = torch.randn(1000, 700, device=dev, generator=g).to(torch.bfloat16)
        rq, rs = ref.quantize_act(x, pow2)
        rqt, rst = ref.quantize_act_t(x, pow2)
        q, s = triton_quantize_act_t(x, pow2)
        out[f"act_t_pow2={pow2}"] = same_bits(q, rqt) and torch.equal(s, rst)
        q, s = quantize_activation(x, pow2)
        out[f"act_pow2={pow2}"] = same_bits(q, rq) and torch.equal(s, rs)
        (q, s), (qt, st) = triton_quantize_act_both(x, pow2)
        out[f"act_both_pow2={pow2}"] = (
            same_bits(q, rq) and torch.equal(s, rs) and same_bits(qt, rqt) and torch.equal(st, rst)
        ) and st.stride(0) == 1
    gq, gs = triton_quantize_act_t(torch.randn(1000, 640, device=dev, generator=g))
    xq, xs = triton_quantize_act_t(torch.randn(1000, 896, device=dev, generator=g))
    fast = ref.fp8_gemm_tokens(gq, gs, xq, xs, torch.float32, backend="torch")
    slow = ref.fp8_gemm_tokens_reference(gq, gs, xq, xs)
    out["token_gemm_rel_err"] = ((fast - slow).norm() / slow.norm()).item()
    # Gradients of the whole recipe against their formulas (the reference GEMMs on the GPU).
    x = torch.randn(1000, 1024, device=dev, generator=g).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(768, 1024, device=dev, generator=g) * 0.02).to(torch.bfloat16).requires_grad_()
    grad = torch.randn(1000, 768, device=dev, generator=g).to(torch.bfloat16)
    fp8_linear(x, w, None, False, "auto", True, True).backward(grad)
    wq, ws = ref.quantize_weight(w.detach())
    gx = ref.fp8_gemm_reference(*ref.quantize_act(grad), wq.t().contiguous(), ws.t().contiguous())
    gw = ref.fp8_gemm_tokens_reference(*ref.quantize_act_t(grad), *ref.quantize_act_t(x.detach()))
    assert x.grad is not None and w.grad is not None
    out["dgrad_rel_err_vs_formula"] = ((x.grad.float() - gx).norm() / gx.norm()).item()
    out["wgrad_rel_err_vs_formula"] = ((w.grad.float() - gw).norm() / gw.norm()).item()
    exact_gw = grad.float().t() @ x.detach().float()
    out["wgrad_rel_err_vs_float32"] = ((w.grad.float() - exact_gw).norm() / exact_gw.norm()).item()
    # MoE: the stacked-expert quantiser, and the trainer's FP8 experts against the engine's.
    ew = torch.randn(8, 384, 256, device=dev, generator=g).to(torch.bfloat16)
    q, s, _ = triton_quantize_weight(ew)
    pairs = [ref.quantize_weight(e) for e in ew]
    out["stacked_experts"] = same_bits(q, torch.stack([p[0] for p in pairs])) and torch.equal(
        s, torch.stack([p[1] for p in pairs])
    )
    q, s, qt = triton_quantize_weight(ew, transposed=True)
    assert qt is not None
    out["stacked_experts_transposed"] = all(same_bits(qt[e], pairs[e][0].t().contiguous()) for e in range(8))
    out["moe_trainer_equals_engine"] = moe_trainer_equals_engine(dev, g)
    out.update(moe_fp8_backward(dev, g))
    # bf16 outputs: one bf16 rounding (2^-9) on top of wgmma's ~2^-13 block error. The MoE FP8
    # backward against the STE one: E4M3 rounding of two more tensors (0.043-0.048 on CPU).
    out["ok"] = (
        max(out["moe_fp8_backward_rel_err_vs_ste"].values()) < 0.1
        and out["moe_fp8_backward_grouped_wgrad_rel_err"] < 1e-2
        and all(v for k, v in out.items() if k.startswith(("weight", "act_", "stacked", "moe_trainer")))
        and out["token_gemm_rel_err"] < 1e-3
        and out["dgrad_rel_err_vs_formula"] < 5e-3
        and out["wgrad_rel_err_vs_formula"] < 5e-3
        and out["wgrad_rel_err_vs_float32"] < 0.06
    )
    return out


def moe_fp8_backward(dev: torch.device, g: torch.Generator) -> dict[str, Any]:
    """The FP8 experts' FP8 backward (trainer.fp8_backward) on the GPU, at uneven routing with an
    expert left empty: its gradients against the straight-through ones (same forward), and its
    grouped weight-gradient GEMM (torch._grouped_mm over unaligned token groups) against a loop."""
    from trainer.fp8 import _grouped_wgrad, convert
    from trainer.moe_routing import RoutedExperts

    e_n, dim, inter, t = 8, 512, 384, 1000
    weights = [torch.randn(s, device=dev, generator=g) * 0.05 for s in ((e_n, inter, dim), (e_n, dim, inter))]
    weights.append(torch.randn(e_n, inter, dim, device=dev, generator=g) * 0.05)
    x0 = torch.randn(t, dim, device=dev, generator=g).to(torch.bfloat16)
    ids = torch.randint(0, e_n - 1, (t,), device=dev, generator=g)  # the last expert gets no token
    order = ids.argsort(stable=True)
    counts = torch.bincount(ids, minlength=e_n)
    grad = torch.randn(t, dim, device=dev, generator=g).to(torch.bfloat16)
    grads = {}
    for fp8_backward in (False, True):
        experts = RoutedExperts(dim=dim, hidden_dim=inter, num_experts=e_n, use_grouped_mm=True).to(dev)
        with torch.no_grad():
            for w, v in zip((experts.w1, experts.w2, experts.w3), weights, strict=True):
                w.copy_(v)
        experts = experts.to(torch.bfloat16)
        convert(torch.nn.ModuleDict({"experts": experts}), fp8_dgrad=fp8_backward, fp8_wgrad=fp8_backward)
        x = x0.clone().requires_grad_()
        experts(x[order], counts).backward(grad[order])
        grads[fp8_backward] = [x.grad, experts.w1.grad, experts.w2.grad, experts.w3.grad]
    rel = {
        name: ((a.float() - b.float()).norm() / b.float().norm()).item()
        for name, a, b in zip(("x", "w1", "w2", "w3"), grads[True], grads[False], strict=True)
    }
    offs = counts.cumsum(0).to(torch.int32)
    a = torch.randn(t, inter, device=dev, generator=g).to(torch.bfloat16)
    got = _grouped_wgrad(grad, a, offs).float()
    bounds = [0, *offs.tolist()]
    want = torch.stack(
        [grad[s:e].float().t() @ a[s:e].float() for s, e in zip(bounds[:-1], bounds[1:], strict=True)]
    )
    return {
        "moe_fp8_backward_rel_err_vs_ste": rel,
        "moe_fp8_backward_grouped_wgrad_rel_err": ((got - want).norm() / want.norm()).item(),
    }


def moe_trainer_equals_engine(dev: torch.device, g: torch.Generator) -> bool:
    """trainer/fp8.Fp8RoutedExperts against services/engine/layers/fp8.Fp8Experts on the same
    weights, tokens and (top-1) routing: the same bits."""
    from services.engine.layers.fp8 import Fp8Experts
    from trainer.fp8 import convert
    from trainer.moe_routing import RoutedExperts

    e_n, dim, inter, t = 8, 512, 384, 1000
    experts = RoutedExperts(dim=dim, hidden_dim=inter, num_experts=e_n, use_grouped_mm=True).to(dev)
    with torch.no_grad():
        for w in (experts.w1, experts.w2, experts.w3):
            w.copy_(torch.randn(w.shape, device=dev, generator=g) * 0.05)
    experts = experts.to(torch.bfloat16)
    engine = Fp8Experts(e_n, inter, dim, device=dev)
    engine.load_fused("gate_up_proj", torch.cat([experts.w1, experts.w3], dim=1).detach())
    engine.load_fused("down_proj", experts.w2.detach())
    convert(torch.nn.ModuleDict({"experts": experts}))
    x = torch.randn(t, dim, device=dev, generator=g).to(torch.bfloat16)
    ids = torch.randint(0, e_n, (t,), device=dev, generator=g)
    order = ids.argsort(stable=True)
    with torch.no_grad():
        sorted_out = experts(x[order], torch.bincount(ids, minlength=e_n))
        want = engine(x, ids[:, None], torch.ones(t, 1, device=dev, dtype=torch.bfloat16))
    return bool(torch.equal(torch.empty_like(sorted_out).index_copy(0, order, sorted_out), want))


def fwd_bwd(fn: Any, grad: torch.Tensor) -> None:
    fn().backward(grad)


def train_row(m: int, n: int, k: int, dev: torch.device) -> dict[str, Any]:
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(m, k, device=dev, generator=g).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(n, k, device=dev, generator=g) * 0.02).to(torch.bfloat16).requires_grad_()
    grad = torch.randn(m, n, device=dev, generator=g).to(torch.bfloat16)
    flops = 3 * 2.0 * m * n * k
    row: dict[str, Any] = {"M": m, "N": n, "K": k, "ms": {}, "tflops": {}, "errors": {}}
    bench.timed(row, "bf16", flops, partial(fwd_bwd, partial(F.linear, x, w), grad), [x, w])
    for name, (dgrad, wgrad) in VARIANTS.items():
        fn = partial(fp8_linear, x, w, None, False, "auto", dgrad, wgrad)
        bench.timed(row, name, flops, partial(fwd_bwd, fn, grad), [x, w])
    # The pieces: the quantisers (what the recipe adds besides its GEMMs) and each FP8 GEMM
    # against one bf16 GEMM of the same size.
    xd, gd = x.detach(), grad
    bench.timed(row, "quant_weight_triton", 0, lambda: triton_quantize_weight(w.detach(), False, True))
    bench.timed(row, "quant_weight_torch", 0, lambda: ref.quantize_weight(w.detach()))
    bench.timed(row, "quant_act_t_triton", 0, lambda: triton_quantize_act_t(xd))
    bench.timed(row, "quant_act_triton", 0, lambda: quantize_activation(xd))
    bench.timed(row, "quant_act_both_triton", 0, lambda: triton_quantize_act_both(xd))
    wq, ws, wq_t = triton_quantize_weight(w.detach(), False, True)
    xq, xs = quantize_activation(xd)
    gq, gs = quantize_activation(gd)
    xq_t, xs_t = triton_quantize_act_t(xd)
    gq_t, gs_t = triton_quantize_act_t(gd)
    one = flops / 3
    bench.timed(row, "gemm_bf16", one, lambda: F.linear(xd, w.detach()))
    bench.timed(row, "gemm_fwd_fp8", one, lambda: fp8_gemm_dispatch(xq, xs, wq, ws, torch.bfloat16))
    bench.timed(row, "gemm_dgrad_fp8", one, lambda: fp8_gemm_dispatch(gq, gs, wq_t, ws.t(), torch.bfloat16))
    bench.timed(row, "gemm_wgrad_bf16", one, lambda: gd.t() @ xd)
    bench.timed(
        row,
        "gemm_wgrad_fp8",
        one,
        lambda: ref.fp8_gemm_tokens(gq_t, gs_t, xq_t, xs_t, torch.bfloat16, "torch"),
    )
    bf = row["ms"].get("bf16")
    row["speedup_vs_bf16"] = {v: bf / row["ms"][v] for v in VARIANTS if bf and v in row["ms"]}
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--skip-timing", action="store_true", help="the self-check only")
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    result = bench.new_result("bf16 F.linear forward + backward (cuBLAS), same process")
    out = Path(args.out)
    try:
        result["self_check"] = self_check(dev)
    except Exception:  # noqa: BLE001 - record it, still time the variants
        result["self_check"] = {"ok": False, "error": traceback.format_exc()[-2000:]}
    print(json.dumps(result["self_check"]), flush=True)
    write_result(out, result)
    if args.skip_timing:
        return
    for m, n, k in SHAPES:
        row = train_row(m, n, k, dev)
        result["rows"].append(row)
        print(
            f"train M={m} N={n:5d} K={k:5d} | "
            + " ".join(f"{v}={row['tflops'][v]:.0f}" for v in ("bf16", *VARIANTS) if v in row["tflops"])
            + " | x bf16 "
            + " ".join(f"{v}={sp:.2f}" for v, sp in row["speedup_vs_bf16"].items())
            + " | us: "
            + " ".join(
                f"{key}={ms * 1e3:.0f}" for key, ms in row["ms"].items() if key.startswith(("quant", "gemm"))
            )
            + (f" | errors {row['errors']}" if row["errors"] else ""),
            flush=True,
        )
        write_result(out, result)


if __name__ == "__main__":
    main()
