"""FP8 training linears with the engine's recipe, as a torchtitan model converter.

Forward: the master weight (float32, or bf16 under FSDP2 mixed precision) is quantised 128x128 and
the input 1x128, then the same block-scaled GEMM as the engine runs (services/engine/fp8_linear:
`quantize_activation` + `fp8_gemm_dispatch`), so for the same weights and inputs the trainer's
log-probs are the engine's bit for bit. That is the point: an FP8 engine sampling for a
high-precision trainer has a systematic train/inference mismatch; training through the same
quantised forward removes it (docs/fp8.md measures both).

Backward (straight-through: the quantisers count as identity):
  grad_x = grad_out @ dequant(W_q)   in grad_out's dtype, or with `fp8_dgrad` the block-scaled GEMM
           (grad_out quantised 1x128 along N; W_q^T, the 128x128 tiles transposed, written by the
           forward's weight quantiser in the same pass);
  grad_W = grad_out^T @ dequant(x_q) in grad_out's dtype, or with `fp8_wgrad` an FP8 GEMM that
           contracts over tokens: grad_out^T and x^T both quantised 1x128 along the tokens
           (DeepSeek-V3's 128x1 backward quantisation; the forward then saves x^T quantised that
           way instead of x_q, the same bytes), float32 output for float32 master weights;
  grad_b = sum of grad_out.
The module stays an nn.Linear subclass with the same `weight`/`bias` parameters, so state dicts,
checkpoints, FSDP2 and the HF weight export are unchanged and the optimizer updates the master
weights. Converted: every nn.Linear but those kept (attention wq/wk/wv/wo, dense MLP and shared
expert w1/w2/w3, Nemotron-H's Mamba-2 in_proj/out_proj) and the MoEs' routed experts
(`Fp8RoutedExperts`, `Fp8Relu2RoutedExperts`: the engine's Fp8Experts / Fp8Relu2Experts recipes;
straight-through backward, their dgrads in FP8 with `fp8_dgrad`); kept: `output` (lm_head), MoE
routers (`...router.gate`), embeddings, norms, and what is not a linear (Mamba-2's conv1d, dt/A/D).
Experts of a kind with no FP8 recipe are an error, not left in high precision.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torchtitan.models.moe.moe import GroupedExperts
from torchtitan.protocols.model_converter import _registry_model_converter_cls, register_model_converter

from ops.fp8.dispatch import (
    BACKENDS,
    fp8_gemm_dispatch,
    grouped_fp8_gemm_dispatch,
    quantize_activation,
    quantize_activation_both,
    quantize_activation_t,
    quantize_weight_fast,
)
from ops.fp8.recipe import (
    BLOCK,
    FP8_DTYPE,
    _cdiv,
    _outer_major,
    default_skip,
    dequantize_act,
    dequantize_weight,
    fp8_gemm_tokens,
)
from trainer.moe_routing import RoutedExperts
from trainer.nemotron import Relu2Experts, relu2
from trainer.swiglu_bwd import swiglu_backward

CONVERTER_NAME = "quantize.linear.fp8_blockwise"


def _out_dtype(x: torch.Tensor) -> torch.dtype:
    # Under autocast a plain nn.Linear would return the autocast dtype; do the same.
    dev = x.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return x.dtype


# The recipe's kernels are dispatched in Python (Triton or cuBLAS by shape, fallbacks on failure),
# which torch.compile cannot trace. As custom ops they are opaque nodes with shape functions
# (the fakes below), so trainer.compile compiles everything around them with fullgraph=True, and
# selective activation checkpointing (a dispatch mode) sees one op. In plain eager execution the
# autograd function calls the ops' bodies directly: torch.library's wrapper cost 70-340 us of
# host time per op on the H100 machines, and the host is what limits an eager FP8 linear at
# most widths (docs/fp8.md).
def _through_op() -> bool:
    """Whether the FP8 linear must go through its custom ops: compiling, or a dispatch mode
    (selective AC's, fake tensors) is active."""
    return torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0


def _fp8_linear_fwd(
    x: torch.Tensor,
    weight: torch.Tensor,
    pow2: bool,
    backend: str,
    dgrad: bool,
    wgrad: bool,
    out_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (M, K) @ weight (N, K)^T through the recipe -> (out (M, N), then what the backward reads:
    x^T quantised along the tokens (wgrad) or x_q, with its scales; W_q^T (dgrad) or W_q; the
    weight's 128x128 scales)."""
    wq, ws, wq_t = quantize_weight_fast(weight, pow2, transposed=dgrad)
    if wgrad:  # x both ways in one pass: the forward's operand and the weight gradient's
        (xq, xs), (xb, xbs) = quantize_activation_both(x, pow2)
    else:
        xq, xs = quantize_activation(x, pow2)
        xb, xbs = xq, xs
    out = fp8_gemm_dispatch(xq, xs, wq, ws, out_dtype, backend)
    wb = wq_t if dgrad else wq
    assert wb is not None
    # Outputs of a custom op must not alias each other or the inputs, and their strides should be
    # the fake's: contiguous copies of any views, and xb's scales outer-dimension-major (the Triton
    # quantisers write them so, and the backward's token GEMM reads them so; tiny either way).
    return out.contiguous(), xb.contiguous(), _outer_major(xbs), wb, ws


fp8_linear_fwd = torch.library.custom_op("relay::fp8_linear_fwd", _fp8_linear_fwd, mutates_args=())


@fp8_linear_fwd.register_fake
def _(
    x: torch.Tensor,
    weight: torch.Tensor,
    pow2: bool,
    backend: str,
    dgrad: bool,
    wgrad: bool,
    out_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    (m, k), n = x.shape, weight.shape[0]
    f8, f32 = FP8_DTYPE, torch.float32
    blocks = _cdiv(n, BLOCK), _cdiv(k, BLOCK)
    if wgrad:
        m_pad = _cdiv(m, BLOCK) * BLOCK
        xb, xbs = x.new_empty(k, m_pad, dtype=f8), x.new_empty(m_pad // BLOCK, k, dtype=f32).t()
    else:
        xb, xbs = x.new_empty(m, k, dtype=f8), x.new_empty(blocks[1], m, dtype=f32).t()
    wb = x.new_empty((k, n) if dgrad else (n, k), dtype=f8)
    return x.new_empty(m, n, dtype=out_dtype), xb, xbs, wb, x.new_empty(blocks, dtype=f32)


def _fp8_linear_bwd(
    g: torch.Tensor,
    xb: torch.Tensor,
    xbs: torch.Tensor,
    wb: torch.Tensor,
    ws: torch.Tensor,
    pow2: bool,
    backend: str,
    dgrad: bool,
    wgrad: bool,
    w_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """grad_out (M, N) -> (grad_x (M, K) in g's dtype, grad_W (N, K) in w_dtype): the straight-through
    gradients, each GEMM in FP8 or through the dequantised operand (module docstring)."""
    g = g.contiguous()
    if dgrad and wgrad:  # grad_out both ways in one pass
        (gq, gs), (gq_t, gs_t) = quantize_activation_both(g, pow2)
    elif dgrad:
        gq, gs = quantize_activation(g, pow2)
    elif wgrad:
        gq_t, gs_t = quantize_activation_t(g, pow2)
    if dgrad:
        gx = fp8_gemm_dispatch(gq, gs, wb, ws.t(), g.dtype, backend)
    else:
        gx = g @ dequantize_weight(wb, ws).to(g.dtype)
    if wgrad:
        gw = fp8_gemm_tokens(
            gq_t,
            gs_t,
            xb,
            xbs,
            torch.float32 if w_dtype == torch.float32 else g.dtype,
            _token_backend(backend),
        )
    else:
        gw = g.t() @ dequantize_act(xb, xbs).to(g.dtype)
    return gx.contiguous(), gw.to(w_dtype).contiguous()


fp8_linear_bwd = torch.library.custom_op("relay::fp8_linear_bwd", _fp8_linear_bwd, mutates_args=())


@fp8_linear_bwd.register_fake
def _(
    g: torch.Tensor,
    xb: torch.Tensor,
    xbs: torch.Tensor,
    wb: torch.Tensor,
    ws: torch.Tensor,
    pow2: bool,
    backend: str,
    dgrad: bool,
    wgrad: bool,
    w_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    m, n = g.shape
    k = wb.shape[0] if dgrad else wb.shape[1]
    return g.new_empty(m, k), g.new_empty(n, k, dtype=w_dtype)


class _Fp8LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        pow2: bool,
        backend: str,
        fp8_dgrad: bool,
        fp8_wgrad: bool,
    ) -> torch.Tensor:
        k = x.shape[-1]
        out_dtype = _out_dtype(x)
        fwd = fp8_linear_fwd if _through_op() else _fp8_linear_fwd
        out, *saved = fwd(
            x.detach().reshape(-1, k), weight.detach(), pow2, backend, fp8_dgrad, fp8_wgrad, out_dtype
        )
        if bias is not None:
            out = out + bias.to(out_dtype)
        ctx.save_for_backward(*saved)
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype = x.shape, x.dtype, weight.dtype
        ctx.b_dtype = bias.dtype if bias is not None else None
        ctx.has_bias, ctx.pow2, ctx.backend = bias is not None, pow2, backend
        ctx.fp8_dgrad, ctx.fp8_wgrad = fp8_dgrad, fp8_wgrad
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        xb, xbs, wb, ws = ctx.saved_tensors
        g = grad_out.reshape(-1, grad_out.shape[-1])
        bwd = fp8_linear_bwd if _through_op() else _fp8_linear_bwd
        gx, gw = bwd(g, xb, xbs, wb, ws, ctx.pow2, ctx.backend, ctx.fp8_dgrad, ctx.fp8_wgrad, ctx.w_dtype)
        gb = g.sum(0).to(ctx.b_dtype) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return (
            gx.reshape(ctx.x_shape).to(ctx.x_dtype) if ctx.needs_input_grad[0] else None,
            gw if ctx.needs_input_grad[1] else None,
            gb,
            None,
            None,
            None,
            None,
        )


def _token_backend(backend: str) -> str:
    """The token GEMM has cuBLAS and the reference only: "triton" means cuBLAS there."""
    return "torch" if backend == "triton" else backend


def _activate(gu: torch.Tensor, squared_relu: bool) -> torch.Tensor:
    """The experts' activation on the in-projection's output, as the engine's Fp8Experts.activate
    (SiLU-mul of the gate and up halves) or Fp8Relu2Experts.activate (relu(up)^2)."""
    if squared_relu:
        return relu2(gu).contiguous()
    gate, up = gu.chunk(2, dim=-1)
    return (F.silu(gate) * up).contiguous()


def _relu2_backward(h: torch.Tensor, da: torch.Tensor) -> torch.Tensor:
    """d relu(h)^2 / dh = 2 relu(h), times da, in float32 math, in h's dtype."""
    return (da.float() * 2 * F.relu(h.float())).to(h.dtype)


class _Fp8ExpertsFn(torch.autograd.Function):
    """The routed experts through the engine's FP8 MoE recipe (services/engine/layers/fp8.Fp8Experts):
    gate and up fused as one [E, 2I, D] weight and each expert quantised 128x128 (a 128-row tile may
    hold gate and up rows, as in the engine), the expert inputs and the SiLU-mul output quantised
    1x128, both GEMMs grouped. `w3` None: Nemotron-H's squared-ReLU experts (Fp8Relu2Experts), the
    up weight [E, I, D] alone as the in-projection and relu(h)^2 as the activation.

    Backward, `fp8_backward` (trainer.fp8_backward, the default): the straight-through gradients of
    the function the forward computed, from what it saved (no recompute). The two dgrads are
    grouped FP8 GEMMs as the dense linear's (grad_out, then the SiLU-mul's input gradient, quantised
    1x128; each expert's 128x128 tiles transposed, written by the weight quantiser in the same
    pass); the SiLU-mul backward is one pass in float32 math on the forward's gate and up
    (trainer/swiglu_bwd.py; the squared ReLU's, 2 relu(h) da, likewise); the weight gradients are
    bf16 grouped GEMMs over each expert's tokens (grad^T @ the GEMM's input before its
    quantisation, as the quantisers are the identity to the straight-through backward). Without
    it: the gradients of the experts' high-precision function at the dequantised weights,
    recomputed (the module's `run`, loop or grouped GEMMs as configured)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        w1: torch.Tensor,
        w2: torch.Tensor,
        w3: torch.Tensor | None,
        counts: torch.Tensor,
        experts: nn.Module,
        pow2: bool,
        backend: str,
        fp8_backward: bool,
    ) -> torch.Tensor:
        out_dtype = _out_dtype(x)
        ctx.squared_relu = w3 is None
        w_in = w1 if w3 is None else torch.cat([w1, w3], dim=1)
        gu_q, gu_s, gu_t = quantize_weight_fast(w_in.detach(), pow2, fp8_backward)
        dn_q, dn_s, dn_t = quantize_weight_fast(w2.detach(), pow2, fp8_backward)
        # Rows past the counted ones (an EP dispatch's padding) go to the last group: computed,
        # then dropped by whoever padded them, as torchtitan's grouped path leaves them.
        offs = counts.cumsum(0).to(torch.int32)
        offs[-1] = x.shape[0]
        xh = x.detach().to(out_dtype)
        xq, xs = quantize_activation(xh, pow2)
        gu = grouped_fp8_gemm_dispatch(xq, xs, gu_q, gu_s, offs, out_dtype, backend)
        a = _activate(gu, ctx.squared_relu)
        aq, a_s = quantize_activation(a, pow2)
        out = grouped_fp8_gemm_dispatch(aq, a_s, dn_q, dn_s, offs, out_dtype, backend)
        if fp8_backward:
            assert gu_t is not None and dn_t is not None
            ctx.save_for_backward(xh, gu, a, gu_t, gu_s, dn_t, dn_s, offs)
        else:
            ctx.save_for_backward(x, gu_q, gu_s, dn_q, dn_s, counts)
        ctx.experts, ctx.w_dtype, ctx.inter = experts, w1.dtype, w1.shape[1]
        ctx.fp8_backward, ctx.pow2, ctx.backend = fp8_backward, pow2, backend
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        if ctx.fp8_backward:
            return (*_fp8_experts_backward(ctx, grad_out), None, None, None, None, None, None)
        x, gu_q, gu_s, dn_q, dn_s, counts = ctx.saved_tensors
        w_in = dequantize_weight(gu_q, gu_s).to(ctx.w_dtype)
        w2 = dequantize_weight(dn_q, dn_s).to(ctx.w_dtype)
        if ctx.squared_relu:
            leaves = [t.detach().requires_grad_() for t in (x, w_in, w2)]
            with torch.enable_grad():
                out = ctx.experts.run(leaves[1], leaves[2], leaves[0], counts)
                gx, gw1, gw2 = torch.autograd.grad(out, leaves, grad_out)
            return gx, gw1, gw2, None, None, None, None, None, None
        w1, w3 = w_in.split(ctx.inter, dim=1)
        leaves = [t.detach().requires_grad_() for t in (x, w1, w2, w3)]
        with torch.enable_grad():
            out = ctx.experts.run(leaves[1], leaves[2], leaves[3], leaves[0], counts)
            gx, gw1, gw2, gw3 = torch.autograd.grad(out, leaves, grad_out)
        return gx, gw1, gw2, gw3, None, None, None, None, None


def _fp8_experts_backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    """_Fp8ExpertsFn's FP8 backward: (grad x, grad w1, grad w2, grad w3; None for squared-ReLU experts)."""
    xh, gu, a, gu_t, gu_s, dn_t, dn_s, offs = ctx.saved_tensors
    g = grad_out.contiguous().to(xh.dtype)
    dtype = g.dtype
    gq, gs = quantize_activation(g, ctx.pow2)
    # grad of the SiLU-mul output: grad_out @ w2 per expert, w2^T's tiles (E, I, D) on the kernel.
    da = grouped_fp8_gemm_dispatch(gq, gs, dn_t, dn_s.transpose(1, 2).contiguous(), offs, dtype, ctx.backend)
    dgu = _relu2_backward(gu, da) if ctx.squared_relu else swiglu_backward(gu, da)
    dq, ds = quantize_activation(dgu, ctx.pow2)
    gx = grouped_fp8_gemm_dispatch(dq, ds, gu_t, gu_s.transpose(1, 2).contiguous(), offs, dtype, ctx.backend)
    # Weight gradients against the GEMMs' high-precision inputs (the quantisers as identity).
    gw2 = _grouped_wgrad(g, a, offs)
    gw13 = _grouped_wgrad(dgu, xh, offs)
    if ctx.squared_relu:
        return gx, gw13.to(ctx.w_dtype), gw2.to(ctx.w_dtype), None
    gw1, gw3 = gw13.to(ctx.w_dtype).split(ctx.inter, dim=1)
    return gx, gw1, gw2.to(ctx.w_dtype), gw3


def _grouped_wgrad(g: torch.Tensor, a: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """(E, N, K): per expert e, g_e^T @ a_e over its rows [offs[e-1], offs[e]) of g (T, N) and a
    (T, K). One grouped GEMM over the token dimension (torch._grouped_mm, 2-D x 2-D: no host
    synchronisation); a per-expert loop where it is unavailable."""
    if hasattr(torch, "_grouped_mm") and (not g.is_cuda or g.dtype == torch.bfloat16):
        return torch._grouped_mm(g.t(), a, offs=offs)
    bounds = [0, *offs.tolist()]
    return torch.stack([g[s:e].t() @ a[s:e] for s, e in zip(bounds[:-1], bounds[1:], strict=True)])


class Fp8RoutedExperts(RoutedExperts):
    """RoutedExperts (same parameters w1/w2/w3, the master weights) whose forward runs the engine's
    FP8 MoE recipe (_Fp8ExpertsFn). Made by re-classing a RoutedExperts in place (`convert`)."""

    pow2_scales: bool = False
    backend: str = "auto"
    fp8_backward: bool = False

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        w1, w2, w3 = self.local_weights()
        return _Fp8ExpertsFn.apply(  # type: ignore[no-any-return]
            x, w1, w2, w3, num_tokens_per_expert, self, self.pow2_scales, self.backend, self.fp8_backward
        )


class Fp8Relu2RoutedExperts(Relu2Experts):
    """Nemotron-H's Relu2Experts (same parameters w1 = up, w2 = down) whose forward runs the
    engine's Fp8Relu2Experts recipe (_Fp8ExpertsFn without w3). Made by re-classing in place."""

    pow2_scales: bool = False
    backend: str = "auto"
    fp8_backward: bool = False

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        w1, w2 = self.local_weights()
        return _Fp8ExpertsFn.apply(  # type: ignore[no-any-return]
            x, w1, w2, None, num_tokens_per_expert, self, self.pow2_scales, self.backend, self.fp8_backward
        )


# Routed experts with an FP8 recipe, by their high-precision class.
FP8_EXPERTS: dict[type[nn.Module], type[nn.Module]] = {
    RoutedExperts: Fp8RoutedExperts,
    Relu2Experts: Fp8Relu2RoutedExperts,
}


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    pow2_scales: bool = False,
    backend: str = "auto",
    fp8_dgrad: bool = False,
    fp8_wgrad: bool = False,
) -> torch.Tensor:
    """F.linear through the FP8 block-scaled recipe, differentiable in x, weight and bias."""
    return _Fp8LinearFn.apply(x, weight, bias, pow2_scales, backend, fp8_dgrad, fp8_wgrad)  # type: ignore[no-any-return]


class Fp8TrainLinear(nn.Linear):
    """nn.Linear whose forward runs the FP8 recipe; parameters (master weights) are untouched.
    Made by re-classing an existing nn.Linear in place (see `convert`), so nothing is copied."""

    pow2_scales: bool = False
    backend: str = "auto"
    fp8_dgrad: bool = False
    fp8_wgrad: bool = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(
            x, self.weight, self.bias, self.pow2_scales, self.backend, self.fp8_dgrad, self.fp8_wgrad
        )

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fp8=1x128/128x128, pow2_scales={self.pow2_scales}, backend={self.backend!r}"


def trainer_skip(name: str) -> bool:
    """Kept in high precision: the engine's rule (lm_head, routers, embeddings, norms, and MLA's
    kv_b_proj, which the engine's absorbed decode reads as a plain weight) in torchtitan's names:
    `output` for the head, `wkv_b` for kv_b_proj."""
    return default_skip(name) or name.split(".")[-1] in ("output", "wkv_b")


def convert(
    model: nn.Module,
    pow2_scales: bool = False,
    backend: str = "auto",
    fp8_dgrad: bool = False,
    fp8_wgrad: bool = False,
    min_weights: int = 0,
) -> list[str]:
    """Re-class every nn.Linear not matched by `trainer_skip` and of at least `min_weights`
    weights as Fp8TrainLinear, and every MoE's routed experts as their FP8 class (FP8_EXPERTS: the
    engine's Fp8Experts / Fp8Relu2Experts recipes), in place. Returns the converted names. Routed
    experts of another class are a ValueError naming them: left in high precision they would
    silently differ from an FP8 engine's. Call before FSDP/compile wrapping (like torchtitan's
    converters)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown fp8 backend {backend!r}: one of {BACKENDS}")
    done = set(FP8_EXPERTS.values())
    unknown = [
        f"{name} ({type(mod).__name__})"
        for name, mod in model.named_modules()
        if isinstance(mod, (GroupedExperts, Relu2Experts))
        and type(mod) not in FP8_EXPERTS
        and type(mod) not in done
    ]
    if unknown:
        raise ValueError(
            f"trainer.fp8: no FP8 recipe for the routed experts {', '.join(unknown)}; "
            f"FP8 experts exist for {', '.join(c.__name__ for c in FP8_EXPERTS)}"
        )
    names = []
    for name, mod in model.named_modules():
        if type(mod) is nn.Linear and not trainer_skip(name) and mod.weight.numel() >= min_weights:
            mod.__class__ = Fp8TrainLinear
            mod.pow2_scales, mod.backend = pow2_scales, backend
            mod.fp8_dgrad, mod.fp8_wgrad = fp8_dgrad, fp8_wgrad
            names.append(name)
        elif type(mod) in FP8_EXPERTS:
            mod.__class__ = FP8_EXPERTS[type(mod)]
            mod.pow2_scales, mod.backend = pow2_scales, backend
            mod.fp8_backward = fp8_dgrad  # the dgrads in FP8; the weight gradients stay bf16
            names.append(name)
    return names


class Fp8BlockwiseConverter:
    """torchtitan ModelConverter (protocols/model_converter.py), registered as
    "quantize.linear.fp8_blockwise": `model.converters = ["quantize.linear.fp8_blockwise"]` in a
    torchtitan job applies it. relay's trainer calls it directly when `trainer.fp8` is set."""

    def __init__(
        self,
        job_config: Any = None,
        parallel_dims: Any = None,
        pow2_scales: bool = False,
        backend: str = "auto",
        fp8_dgrad: bool = False,
        fp8_wgrad: bool = False,
        min_weights: int = 0,
    ) -> None:
        self.pow2_scales, self.backend = pow2_scales, backend
        self.fp8_dgrad, self.fp8_wgrad = fp8_dgrad, fp8_wgrad
        self.min_weights = min_weights
        self.converted: list[str] = []

    def convert(self, model: nn.Module) -> None:
        self.converted = convert(
            model,
            pow2_scales=self.pow2_scales,
            backend=self.backend,
            fp8_dgrad=self.fp8_dgrad,
            fp8_wgrad=self.fp8_wgrad,
            min_weights=self.min_weights,
        )

    def post_optimizer_hook(self, model: nn.Module | list[nn.Module]) -> None:
        # Nothing to refresh: the weights are re-quantised from the master weights every forward.
        return None


if CONVERTER_NAME not in _registry_model_converter_cls:  # the registry asserts on a second import
    register_model_converter(Fp8BlockwiseConverter, CONVERTER_NAME)  # type: ignore[arg-type]
