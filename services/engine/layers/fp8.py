"""FP8 (DeepSeek-V3 block-scaled) layers of the engine: Fp8Linear, fused q/k/v and gate/up rows,
MoE Fp8Experts, the in-place conversion of a model and the weight load/update of a converted one.

The quantisers and the GEMM backends they call are ops/fp8/dispatch.py's, shared with the trainer
(trainer/fp8.py), so both sides compute the same bits for the same weights and inputs.
lm_head, routers and norms stay in high precision (ops/fp8/recipe.default_skip).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ops.fp8 import checkpoint as fp8_checkpoint
from ops.fp8 import recipe as ref
from ops.fp8.dispatch import (
    BACKENDS,
    fp8_matmul,
    grouped_fp8_gemm_dispatch,
    quantize_activation,
    quantize_weight_fast,
)
from services.engine.layers.moe import PER_EXPERT, ExpertWeights, Relu2ExpertWeights
from services.engine.weight_copy import copy_pieces, copy_weight


class Fp8Linear(ref.Fp8Linear):
    """The engine's FP8 linear: ops/fp8/recipe.Fp8Linear (fp8 weight + 128x128 scales as
    buffers, `load_weight` re-quantises in place) with the CPU/Triton/cuBLAS dispatch above."""

    def quantize(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # One Triton pass on CUDA at every weight update; the reference's bits.
        q, s, _ = quantize_weight_fast(weight, self.pow2_scales)
        return q, s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = fp8_matmul(
            x, self.weight_fp8, self.weight_scale, self.out_dtype, self.pow2_scales, self.backend
        )
        if self.bias is not None:
            out = out + self.bias
        return out


def fuse_fp8_rows(linears: list[nn.Module]) -> Fp8Linear | None:
    """One Fp8Linear over the concatenated rows of FP8 linears that read the same input (q/k/v,
    gate/up): one activation quantisation and one GEMM instead of one each per linear. Each part's
    fp8 weight, scales and bias become views of the fused buffers' row blocks, so in-place loads
    (load_weight, load_hf_state) reach the fused GEMM. Exact: every part's rows but the last fill
    whole 128-row scale blocks, so the fused scales are the parts' scales stacked and the GEMM
    computes each output column from the same bits. None when that does not hold or the parts
    differ in input, output dtype, scale rule, backend or bias."""
    if not linears or not all(type(lin) is Fp8Linear for lin in linears):
        return None
    parts: list[Fp8Linear] = linears  # type: ignore[assignment]
    first = parts[0]
    same = all(
        (p.in_features, p.out_dtype, p.pow2_scales, p.backend, p.bias is None)
        == (first.in_features, first.out_dtype, first.pow2_scales, first.backend, first.bias is None)
        for p in parts
    )
    if not same or any(p.out_features % ref.BLOCK for p in parts[:-1]):
        return None
    fused = Fp8Linear(
        first.in_features,
        sum(p.out_features for p in parts),
        bias=first.bias is not None,
        out_dtype=first.out_dtype,
        pow2_scales=first.pow2_scales,
        backend=first.backend,
        device=first.weight_fp8.device,
    )
    with torch.no_grad():
        fused.weight_fp8.copy_(torch.cat([p.weight_fp8 for p in parts]))
        fused.weight_scale.copy_(torch.cat([p.weight_scale for p in parts]))
        if fused.bias is not None:
            fused.bias.copy_(torch.cat([p.bias for p in parts]))  # type: ignore[misc]
        row = 0
        for p in parts:
            n, nb = p.out_features, ref._cdiv(p.out_features, ref.BLOCK)
            p.weight_fp8 = fused.weight_fp8[row : row + n]
            p.weight_scale = fused.weight_scale[row // ref.BLOCK : row // ref.BLOCK + nb]
            if fused.bias is not None:
                p.bias = nn.Parameter(fused.bias[row : row + n], requires_grad=False)
            row += n
    return fused


class Fp8Experts(nn.Module):
    """MoE experts (services/engine/moe.ExpertWeights' interface and function) with fp8 weights:
    gate_up [E, 2I, D] and down [E, D, I], each expert quantised 128x128 on its own; per call the
    expert inputs are quantised 1x128 and both GEMMs run grouped (one Triton launch each on CUDA,
    no host sync, so CUDA-graph capturable; a per-expert loop on the CPU reference path).
    Fp8Relu2Experts below: Nemotron-H's squared-ReLU experts (an `up` in-projection alone)."""

    IN = "gate_up"  # the in-projection's buffers (<IN>_fp8, <IN>_scale)
    FUSED = ("gate_up_proj", "down_proj")  # HF fused names: the in-projection's, the down's
    PER_EXPERT = ("gate_proj", "up_proj", "down_proj")  # per-expert HF names
    IN_ROWS = 2  # in-projection rows per intermediate unit

    def __init__(
        self,
        n_experts: int,
        inter: int,
        dim: int,
        pow2_scales: bool = False,
        backend: str = "auto",
        device: torch.device | str | None = None,
    ):
        super().__init__()
        self.n_experts, self.inter, self.dim = n_experts, inter, dim
        self.pow2_scales, self.backend = pow2_scales, backend
        for name, (n, k) in ((self.IN, (self.IN_ROWS * inter, dim)), ("down", (dim, inter))):
            q = torch.zeros(n_experts, n, k, dtype=ref.FP8_DTYPE, device=device)
            self.register_buffer(f"{name}_fp8", q)
            shape = (n_experts, ref._cdiv(n, ref.BLOCK), ref._cdiv(k, ref.BLOCK))
            self.register_buffer(f"{name}_scale", torch.ones(shape, dtype=torch.float32, device=device))

    @classmethod
    def from_experts(
        cls, experts: ExpertWeights, pow2_scales: bool = False, backend: str = "auto"
    ) -> Fp8Experts:
        mod = cls.empty_like(experts, pow2_scales, backend)
        mod.load_fused(cls.FUSED[0], experts.w_in)
        mod.load_fused("down_proj", experts.down_proj)
        return mod

    @classmethod
    def empty_like(
        cls, experts: ExpertWeights, pow2_scales: bool = False, backend: str = "auto"
    ) -> Fp8Experts:
        """The layout of `experts` in fp8, nothing quantised yet."""
        e, rows, d = experts.w_in.shape
        return cls(e, rows // cls.IN_ROWS, d, pow2_scales, backend, experts.w_in.device)

    def buffers_of(self, proj: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(fp8 weights, scales) of a fused projection name."""
        dst = self.IN if proj == self.FUSED[0] else "down"
        return getattr(self, f"{dst}_fp8"), getattr(self, f"{dst}_scale")

    def expected_shape(self, proj: str) -> tuple[int, int, int]:
        if proj == self.FUSED[0]:
            return (self.n_experts, self.IN_ROWS * self.inter, self.dim)
        return (self.n_experts, self.dim, self.inter)

    @torch.no_grad()
    def load_expert(self, index: int, proj: str, w: torch.Tensor) -> None:
        """Quantise one expert's fused weight (gate_up_proj [2I, D] or down_proj [D, I]) in place."""
        q, s, _ = quantize_weight_fast(w.to(self.down_fp8.device), self.pow2_scales)
        self.copy_expert(index, proj, q, s)

    @torch.no_grad()
    def copy_expert(self, index: int, proj: str, q: torch.Tensor, scale: torch.Tensor) -> None:
        """Copy one expert's already quantised weight (an fp8 checkpoint's bits and 128x128
        scales) into the buffers in place, without re-quantising."""
        fp8, scales = self.buffers_of(proj)
        copy_weight(fp8[index], q)
        copy_weight(scales[index], scale)

    @torch.no_grad()
    def copy_stacked(self, proj: str, weights: list[torch.Tensor], scales: list[torch.Tensor]) -> None:
        """Every expert's already quantised `proj` at once: `weights` / `scales` are the pieces of
        experts 0, 1, ... end to end (for gate_up_proj each expert's gate then up rows), their
        bytes exactly the buffers' (checked by the caller): one copy per buffer, not per expert."""
        fp8, scale = self.buffers_of(proj)
        copy_pieces(fp8, weights)
        copy_pieces(scale, scales)

    def expected_scale_shape(self, proj: str) -> tuple[int, int]:
        _, n, k = self.expected_shape(proj)
        return (ref._cdiv(n, ref.BLOCK), ref._cdiv(k, ref.BLOCK))

    @torch.no_grad()
    def load_fused(self, proj: str, w: torch.Tensor) -> None:
        if tuple(w.shape) != self.expected_shape(proj):
            raise ValueError(f"{proj}: shape {tuple(w.shape)} != expected {self.expected_shape(proj)}")
        for e in range(self.n_experts):
            self.load_expert(e, proj, w[e])

    def forward(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, kernel: object = None
    ) -> torch.Tensor:
        """x [T, D], ids/weights [T, k] -> sum_k weights * expert_ids(x), as ExpertWeights.forward.
        `kernel` is accepted for that interface and ignored: the fp8 path is always grouped."""
        t, k = ids.shape
        flat = ids.reshape(-1)
        order = flat.argsort(stable=True)  # each expert's rows contiguous
        token = order // k
        xs = x[token]
        # scatter_add, not bincount: no host sync (CUDA-graph capture), as in moe.py.
        counts = torch.zeros(self.n_experts, dtype=torch.long, device=x.device).scatter_add_(
            0, flat, torch.ones_like(flat)
        )
        offs = counts.cumsum(0).to(torch.int32)
        xq, xsc = quantize_activation(xs, self.pow2_scales)
        w_in, s_in = self.buffers_of(self.FUSED[0])
        h = grouped_fp8_gemm_dispatch(xq, xsc, w_in, s_in, offs, x.dtype, self.backend)
        aq, asc = quantize_activation(self.activate(h).contiguous(), self.pow2_scales)
        ys = grouped_fp8_gemm_dispatch(aq, asc, self.down_fp8, self.down_scale, offs, x.dtype, self.backend)
        ys = ys * weights.reshape(-1)[order, None].to(ys.dtype)
        return torch.zeros_like(x).index_add_(0, token, ys)

    @staticmethod
    def activate(h: torch.Tensor) -> torch.Tensor:
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up


class Fp8Relu2Experts(Fp8Experts):
    """Nemotron-H's squared-ReLU experts (moe.Relu2ExpertWeights) in fp8: up [E, I, D] and down
    [E, D, I], down(relu(up(x))^2), each expert quantised 128x128 on its own."""

    IN = "up"
    FUSED = ("up_proj", "down_proj")
    PER_EXPERT = ("up_proj", "down_proj")
    IN_ROWS = 1

    @staticmethod
    def activate(h: torch.Tensor) -> torch.Tensor:
        return torch.square(F.relu(h))


def engine_skip(name: str) -> bool:
    """Linears kept in high precision (fp8_checkpoint.kept_high_precision: the rule a published
    FP8 weights directory follows too)."""
    return fp8_checkpoint.kept_high_precision(name)


def convert_model(
    model: nn.Module, pow2_scales: bool = False, backend: str = "auto", empty: bool = False
) -> list[str]:
    """Quantise every attention/MLP nn.Linear of an engine model in place (see engine_skip for
    what stays) and every MoE ExpertWeights into Fp8Experts. Returns the converted names. Call
    after the weights are loaded and after any `.to(dtype)`: a later dtype cast would turn the fp8
    buffers into that dtype. `empty`: only the layout (no quantisation; see models/registry.build_fp8_model)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown fp8 backend {backend!r}: one of {BACKENDS}")
    names = ref.convert_to_fp8(
        model, skip=engine_skip, pow2_scales=pow2_scales, backend=backend, linear_cls=Fp8Linear, empty=empty
    )
    experts = [(n, mod) for n, mod in model.named_modules() if isinstance(mod, ExpertWeights)]
    for name, mod in experts:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        cls = Fp8Relu2Experts if isinstance(mod, Relu2ExpertWeights) else Fp8Experts
        if empty:
            new = cls.empty_like(mod, pow2_scales, backend)
        else:
            new = cls.from_experts(mod, pow2_scales, backend)
        setattr(parent, child, new)
    return names + [n for n, _ in experts]


def fp8_modules(model: nn.Module) -> dict[str, ref.Fp8Linear]:
    return {name: mod for name, mod in model.named_modules() if isinstance(mod, ref.Fp8Linear)}


@torch.no_grad()
def load_hf_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Weight load/update for a model with Fp8Linear / Fp8Experts layers (HF names; experts fused
    or per expert). Each of their weights is either high precision (bf16/fp32), quantised 128x128
    into the fp8 buffers in place, or an fp8 checkpoint's pair `X.weight` (E4M3) +
    `X.weight_scale_inv` (ops/fp8/checkpoint.py), whose bits and scales are copied into
    the buffers as they are. Pairs of tensors the model keeps in high precision (e.g. MLA's
    kv_b_proj, engine_skip) are dequantised. Everything else (embeddings, norms, lm_head, router,
    biases) goes through the model's own `load_hf_state` (which checks names and shapes). All
    names and shapes are checked before anything is written; the buffers are only ever written
    with copy_ (fused q/k/v and gate/up GEMMs hold views of them)."""
    pairs = fp8_checkpoint.fp8_pairs(state)
    mods = fp8_modules(model)
    rest = dict(state)
    weights: dict[str, torch.Tensor] = {}
    exact: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for name, mod in mods.items():
        key = f"{name}.weight"
        if key not in rest:
            raise ValueError(f"state dict mismatch: missing ['{key}']")
        w = rest.pop(key)
        if tuple(w.shape) != (mod.out_features, mod.in_features):
            raise ValueError(
                f"{key}: shape {tuple(w.shape)} != expected {(mod.out_features, mod.in_features)}"
            )
        if key in pairs:
            exact[name] = (w, rest.pop(pairs[key]))  # scale shape: checked by fp8_pairs
        else:
            weights[name] = w
    expert_loads = [
        (mod, *_take_expert_weights(prefix, mod, rest, pairs))
        for prefix, mod in model.named_modules()
        if isinstance(mod, Fp8Experts)
    ]
    # Float32 here; the model's load_hf_state rounds to each parameter's dtype (one rounding).
    model.load_hf_state(fp8_checkpoint.dequantize_state(rest, torch.float32))  # type: ignore[operator]
    for name, w in weights.items():
        mods[name].load_weight(w)
    for name, (q, scale) in exact.items():
        copy_weight(mods[name].weight_fp8, q)
        copy_weight(mods[name].weight_scale, scale)
    for mod, stacked, singles in expert_loads:
        for proj, (pieces, scales) in stacked.items():
            mod.copy_stacked(proj, pieces, scales)
        for e, proj, w, scale in singles:
            if scale is None:
                mod.load_expert(e, proj, w)
            else:
                mod.copy_expert(e, proj, w, scale)


# One Fp8Experts' load: fused proj -> (the fp8 pieces of every expert end to end, their scales'),
# copied as they are; and ExpertLoads one expert at a time.
Stacked = dict[str, tuple[list[torch.Tensor], list[torch.Tensor]]]
# (expert, fused proj, weight, scale): scale None = a high-precision weight to quantise; else the
# weight is fp8 and (weight, scale) are copied as they are.
ExpertLoad = tuple[int, str, torch.Tensor, torch.Tensor | None]
ExpertLoads = tuple[Stacked, list[ExpertLoad]]


def _take_expert_weights(
    prefix: str, mod: Fp8Experts, rest: dict[str, torch.Tensor], pairs: dict[str, str]
) -> ExpertLoads:
    """Pop one Fp8Experts' tensors out of `rest` (fused `<prefix>.gate_up_proj`/`.down_proj`, or
    per-expert `<prefix>.<e>.{gate,up,down}_proj.weight`, each high precision or an fp8 pair whose
    scale is popped too), checked. A projection whose every expert is an exact fp8 pair is
    stacked (one copy per buffer); the rest is loaded expert by expert."""
    per: dict[tuple[int, str], torch.Tensor] = {}
    scales: dict[tuple[int, str], torch.Tensor] = {}
    for key in [k for k in rest if k.startswith(prefix + ".")]:
        hit = PER_EXPERT.match(key)
        if hit is not None and hit[1] == prefix:
            per[(int(hit[2]), hit[3])] = rest.pop(key)
            if key in pairs:
                scales[(int(hit[2]), hit[3])] = rest.pop(pairs[key])
    fused = {p: rest.pop(f"{prefix}.{p}") for p in mod.FUSED if f"{prefix}.{p}" in rest}
    if per and fused:
        raise ValueError(f"{prefix}: both fused and per-expert tensors given")
    stacked: Stacked = {}
    singles: list[ExpertLoad] = []
    if per:
        want = {(e, p) for e in range(mod.n_experts) for p in mod.PER_EXPERT}
        if set(per) != want:
            raise ValueError(
                f"{prefix}: per-expert tensors incomplete (missing {sorted(want - set(per))[:3]})"
            )
        for p in mod.FUSED:
            loads: list[tuple[list[torch.Tensor], list[torch.Tensor] | None]] = []
            for e in range(mod.n_experts):
                if p == "gate_up_proj":
                    ws, ss = _fuse_gate_up(mod, per, scales, e)
                else:  # one per-expert tensor of the same name (down_proj; Nemotron-H's up_proj)
                    ws, ss = _single(per, scales, e, p)
                if _stacked_shape(ws) != mod.expected_shape(p)[1:]:
                    raise ValueError(
                        f"{prefix}.{e}.{p}: shape {_stacked_shape(ws)} != {mod.expected_shape(p)[1:]}"
                    )
                if ss is not None and _stacked_shape(ss) != mod.expected_scale_shape(p):
                    raise ValueError(
                        f"{prefix}.{e}.{p}: scale shape {_stacked_shape(ss)} != {mod.expected_scale_shape(p)}"
                    )
                loads.append((ws, ss))
            if all(ss is not None for _, ss in loads):
                stacked[p] = ([w for ws, _ in loads for w in ws], [s for _, ss in loads for s in ss or ()])
            else:
                # Some expert not an exact pair: each on its own (pairs copied, the rest quantised).
                singles.extend(
                    (e, p, torch.cat(ws), None if ss is None else torch.cat(ss))
                    for e, (ws, ss) in enumerate(loads)
                )
        return stacked, singles
    for p in mod.FUSED:
        if p not in fused:
            raise ValueError(f"state dict mismatch: missing ['{prefix}.{p}']")
        if tuple(fused[p].shape) != mod.expected_shape(p):
            raise ValueError(
                f"{prefix}.{p}: shape {tuple(fused[p].shape)} != expected {mod.expected_shape(p)}"
            )
        singles.extend((e, p, fused[p][e], None) for e in range(mod.n_experts))
    return stacked, singles


def _stacked_shape(pieces: list[torch.Tensor]) -> tuple[int, ...]:
    """The shape of torch.cat(pieces) (rows end to end), without making it."""
    rows = sum(p.shape[0] for p in pieces)
    tails = {tuple(p.shape[1:]) for p in pieces}
    return (rows, *tails.pop()) if len(tails) == 1 else (rows, *[-1] * (pieces[0].dim() - 1))


def _single(
    per: dict[tuple[int, str], torch.Tensor], scales: dict[tuple[int, str], torch.Tensor], e: int, proj: str
) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    s = scales.get((e, proj))
    return [per[(e, proj)]], None if s is None else [s]


def _fuse_gate_up(
    mod: Fp8Experts,
    per: dict[tuple[int, str], torch.Tensor],
    scales: dict[tuple[int, str], torch.Tensor],
    e: int,
) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """Expert e's fused gate_up rows as pieces (gate then up, as moe.ExpertWeights fuses them; a
    128-row tile may span both) and, when they can be copied exactly, their scales' pieces."""
    gate, up = per[(e, "gate_proj")], per[(e, "up_proj")]
    gs, us = scales.get((e, "gate_proj")), scales.get((e, "up_proj"))
    if gs is not None and us is not None and mod.inter % ref.BLOCK == 0:
        # Both fp8 and the gate rows fill whole 128-row tiles: the fused weight's tiles are the
        # gate's then the up's, so the checkpoint's bits and scales concatenate exactly.
        return [gate, up], [gs, us]
    # Otherwise the fused weight's tile that straddles gate and up rows has no scale of its own in
    # the checkpoint: dequantise (float32) and let load_expert re-quantise the expert 128x128.
    # Its fp8 bits then differ from the checkpoint's (docs/fp8.md).
    if gs is not None:
        gate = ref.dequantize_weight(gate, gs)
    if us is not None:
        up = ref.dequantize_weight(up, us)
    return [gate, up], None
