"""FP8 (DeepSeek-V3 block-scaled) linear layers for the engine, and the kernel dispatch the trainer
shares (trainer/fp8.py calls `quantize_activation` and `fp8_gemm_dispatch` so both sides compute
the same bits for the same weights and inputs).

Weights are quantised 128x128 at load / weight-update time (services/common/fp8.quantize_weight);
activations 1x128 on every call. GEMM backends:

- "reference": services/common/fp8.fp8_gemm_reference (float32 block accumulation; CPU, tests);
- "torch": torch.nn.functional.scaled_mm block-wise (cuBLAS), best at large M;
- "triton": services/engine/kernels/fp8_gemm.py, small BLOCK_M + split-K, for decode-sized M;
- "cuda": services/engine/kernels/cuda/fp8_wgmma.py, the warp-specialised Hopper kernel (TMA,
  wgmma, DeepGEMM's design; bf16 output), best at large M on sm_90; built with nvcc at first use;
- "auto": CPU -> reference; CUDA -> the measured table kern.TUNED_CONFIGS (per M bucket and
  (N, K): a Triton config, torch or cuda), and for shapes it does not list: triton (pick_config)
  when M <= TRITON_MAX_M, else torch. A "cuda" entry runs only where the kernel can (sm_90, bf16
  output, K % 128 == 0, even N) and has not failed to build or launch here; elsewhere torch does.

The table and TRITON_MAX_M come from bench/fp8/gemm.py runs on the H200 (docs/fp8.md).
lm_head, routers and norms stay in high precision (services/common/fp8.default_skip).
"""

from __future__ import annotations

import logging
import os
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from services.common import fp8 as ref
from services.common import fp8_checkpoint
from services.engine.kernels import fp8_gemm as kern
from services.engine.kernels import fp8_quant
from services.engine.kernels.cuda import fp8_wgmma
from services.engine.moe import PER_EXPERT, ExpertWeights

Backend = Literal["auto", "reference", "torch", "triton", "cuda"]
BACKENDS: tuple[str, ...] = ("auto", "reference", "torch", "triton", "cuda")
# For (N, K) outside the measured table: M at or below which "auto" picks the Triton kernel on
# CUDA. H200 run 1: Triton (pick_config) beat cuBLAS block-wise at every measured M <= 256 and
# lost at 10 of 12 (M, N, K) with 512 <= M <= 2048.
TRITON_MAX_M = 256
# Triton configs that failed to compile/launch here (name -> error); "auto" then uses torch.
TRITON_FAILURES: dict[str, str] = {}
_FAILED_CONFIGS: set[kern.GemmConfig] = set()  # the same, by config: no name() per call
# Why the CUDA kernel cannot serve "auto" here (no nvcc, a failed build or launch), once known;
# "auto" then uses cuBLAS where the table says "cuda", and Triton for grouped GEMMs.
CUDA_FAILURE: list[str] = []
# Rows per expert (T / E) from which "auto" runs MoE grouped GEMMs on the CUDA kernel (Hopper).
# One H100, E = 32: from 32 rows per expert it beat the
# Triton grouped kernel at every measured point, 1.73-2.37x bf16 grouped_mm against 0.83-1.79x at
# DeepSeek-V3's expert shapes and 1.49-1.94x against 1.07-1.61x at Qwen3-30B-A3B's; below 32 it
# did not always (8 rows, 30B-A3B down: Triton 2.81x, CUDA 2.02x), so decode stays on Triton.
GROUPED_CUDA_MIN_ROWS = 32
log = logging.getLogger(__name__)


def has_scaled_mm() -> bool:
    return hasattr(F, "scaled_mm") and hasattr(F, "ScalingType")


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def resolve_backend(
    backend: str, m: int, device: torch.device, n: int | None = None, k: int | None = None
) -> str:
    """The concrete backend ("reference", "torch", "triton" or "cuda") for an (M, K) x (N, K) GEMM
    on `device` (n, k: the measured table's key; without them only M decides)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown fp8 backend {backend!r}: one of {BACKENDS}")
    if backend == "reference":
        return "reference"
    if device.type != "cuda":
        if backend == "triton" and kern.HAS_TRITON and _interpreting():
            return "triton"  # CPU check of the kernel under the Triton interpreter
        if backend in ("torch", "triton", "cuda"):
            raise RuntimeError(f"fp8 backend {backend!r} needs CUDA tensors")
        return "reference"
    if backend != "auto":
        return backend
    choice = auto_choice(m, n, k, device)
    if choice == kern.CUDA:
        return "cuda"
    if choice != kern.TORCH:
        return "triton"
    return "torch" if has_scaled_mm() else "reference"


def auto_choice(m: int, n: int | None, k: int | None, device: torch.device) -> kern.GemmConfig | str:
    """What "auto" runs on CUDA: kern.TORCH (cuBLAS block-wise), kern.CUDA (our CUDA kernel) or
    the Triton config, from the measured table when it lists the shape, else TRITON_MAX_M /
    pick_config."""
    hit = None if n is None or k is None else kern.tuned_choice(m, n, k)
    if hit == kern.CUDA:
        if cuda_kernel_usable(device):
            return kern.CUDA
        hit = kern.TORCH
    if not kern.HAS_TRITON:
        return kern.TORCH
    if hit is None:
        if m > TRITON_MAX_M and has_scaled_mm():
            return kern.TORCH
        hit = kern.pick_config(m, n or 1, k or 1, kern.num_sms(device))
    if hit == kern.TORCH and not has_scaled_mm():
        return kern.pick_config(m, n or 1, k or 1, kern.num_sms(device))
    return hit


def cuda_kernel_usable(device: torch.device) -> bool:
    """Whether "auto" may pick the CUDA kernel on `device`: a Hopper GPU (the kernel is sm_90a
    wgmma) where it has not failed before."""
    return not CUDA_FAILURE and fp8_wgmma.is_hopper(device)


def _remember_cuda_failure(e: Exception) -> None:
    CUDA_FAILURE.append(str(e))
    log.warning("fp8 CUDA kernel failed, using torch scaled_mm / Triton where it was picked: %s", e)


def prepare_cuda_kernel(device: torch.device) -> bool:
    """At model load on a Hopper GPU: build (or load the cached) CUDA kernel now, so that the
    first large prefill does not wait ~10 s on nvcc. A failure (no nvcc here) is remembered and
    logged once, and "auto" never picks the kernel after. Whether it is ready."""
    if not cuda_kernel_usable(device):
        return False
    try:
        fp8_wgmma.library()
    except fp8_wgmma.WgmmaError as e:
        _remember_cuda_failure(e)
        return False
    return True


def _cuda_gemm(
    a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor | None:
    """ "auto"'s call of the CUDA kernel: its output, or None where it cannot serve this call (the
    caller then uses cuBLAS). A build or launch failure is remembered and logged once."""
    if out_dtype != torch.bfloat16:
        return None
    try:
        return fp8_wgmma.fp8_gemm(a, a_scale, w, w_scale)
    except fp8_wgmma.WgmmaUnsupported:  # this shape or layout: cuBLAS serves it, nothing failed
        return None
    except fp8_wgmma.WgmmaError as e:
        _remember_cuda_failure(e)
        return None


def _cuda_out_dtype(out_dtype: torch.dtype) -> None:
    if out_dtype != torch.bfloat16:
        raise ValueError(f"fp8 backend 'cuda' writes bf16, not {out_dtype}")


def grouped_cuda_choice(t: int, e: int, device: torch.device) -> bool:
    """Whether "auto" runs a grouped GEMM of T rows over E experts on the CUDA kernel."""
    return t >= GROUPED_CUDA_MIN_ROWS * e and cuda_kernel_usable(device)


def quantize_activation(x: torch.Tensor, pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """1x128 quantisation of x (M, K): one Triton launch on CUDA, the torch reference elsewhere.
    Both round the same way (IEEE divisions, round-to-nearest-even fp8), so the bits agree; the
    CPU interpreter's fp8 conversion is faulty, hence reference there even under TRITON_INTERPRET."""
    if _triton_ok(x, "quantize_act"):
        try:
            return kern.triton_quantize_act(x, pow2)
        except Exception as e:  # noqa: BLE001 - a kernel that does not compile here: torch ops
            _remember_failure("quantize_act", e)
    return ref.quantize_act(x, pow2)


def _triton_ok(x: torch.Tensor, name: str) -> bool:
    """The Triton quantiser `name` may run on x: CUDA, Triton installed, not failed before."""
    return x.is_cuda and kern.HAS_TRITON and name not in TRITON_FAILURES


def _remember_failure(name: str, e: Exception) -> None:
    """A quantiser that does not compile or launch here: logged once, the torch reference after."""
    TRITON_FAILURES[name] = f"{type(e).__name__}: {e}"
    log.warning("fp8 triton %s failed, using the torch reference: %s", name, e)


def quantize_weight_fast(
    w: torch.Tensor, pow2: bool = False, transposed: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """128x128 quantisation of a (N, K) weight: (fp8, scales, the fp8 transposed (K, N) contiguous
    if asked for); of a stacked (E, N, K) one (MoE experts) per expert (transposed: (E, K, N)).
    One Triton pass on CUDA (kernels/fp8_quant.py), the torch reference elsewhere; the same bits
    either way."""
    if _triton_ok(w, "quantize_weight"):
        try:
            return fp8_quant.triton_quantize_weight(w, pow2, transposed)
        except Exception as e:  # noqa: BLE001 - as in quantize_activation
            _remember_failure("quantize_weight", e)
    if w.dim() == 3:
        pairs = [ref.quantize_weight(we, pow2) for we in w]
        q, s = torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs])
    else:
        q, s = ref.quantize_weight(w, pow2)
    return q, s, q.transpose(-2, -1).contiguous() if transposed else None


def quantize_activation_t(x: torch.Tensor, pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, C) -> x^T quantised 1x128 along M: (C, M_pad) fp8 and (C, M_pad / 128) scales
    (services/common/fp8.quantize_act_t), for the FP8 weight-gradient GEMM. One Triton pass on CUDA."""
    if _triton_ok(x, "quantize_act_t"):
        try:
            return fp8_quant.triton_quantize_act_t(x, pow2)
        except Exception as e:  # noqa: BLE001 - as in quantize_activation
            _remember_failure("quantize_act_t", e)
    return ref.quantize_act_t(x, pow2)


def quantize_activation_both(
    x: torch.Tensor, pow2: bool = False
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """(quantize_activation(x), quantize_activation_t(x)): the FP8 trainer quantises its input and
    grad_out both ways. One Triton pass on CUDA (x read once, one launch), the references elsewhere."""
    if _triton_ok(x, "quantize_act_both"):
        try:
            return fp8_quant.triton_quantize_act_both(x, pow2)
        except Exception as e:  # noqa: BLE001 - as in quantize_activation
            _remember_failure("quantize_act_both", e)
    return quantize_activation(x, pow2), quantize_activation_t(x, pow2)


def fp8_gemm_dispatch(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype,
    backend: str = "auto",
) -> torch.Tensor:
    """(M, K) fp8 x (N, K) fp8 block-scaled GEMM -> (M, N) out_dtype, on the backend for this shape."""
    m, k = a.shape
    n = w.shape[0]
    if backend == "auto" and a.is_cuda:
        choice = auto_choice(m, n, k, a.device)
        if choice == kern.CUDA:
            out = _cuda_gemm(a, a_scale, w, w_scale, out_dtype)
            if out is not None:
                return out
        elif isinstance(choice, kern.GemmConfig):
            if not has_scaled_mm():
                return kern.triton_fp8_gemm(a, a_scale, w, w_scale, out_dtype, choice)
            # "auto" survives a Triton config that does not compile on this GPU/Triton version:
            # that config is remembered (TRITON_FAILURES, logged once) and cuBLAS serves it.
            if choice not in _FAILED_CONFIGS:
                try:
                    return kern.triton_fp8_gemm(a, a_scale, w, w_scale, out_dtype, choice)
                except Exception as e:  # noqa: BLE001 - compile errors come in many types
                    _FAILED_CONFIGS.add(choice)
                    TRITON_FAILURES[choice.name()] = f"{type(e).__name__}: {e}"
                    log.warning("fp8 triton config %s failed, using torch scaled_mm: %s", choice.name(), e)
        if not has_scaled_mm():  # neither Triton nor scaled_mm on this install
            return ref.fp8_gemm_reference(a, a_scale, w, w_scale, out_dtype)
        return ref.fp8_gemm(a, a_scale, w, w_scale, out_dtype, backend="torch")
    which = resolve_backend(backend, m, a.device, n, k)
    if which == "cuda":
        _cuda_out_dtype(out_dtype)
        return fp8_wgmma.fp8_gemm(a, a_scale, w, w_scale)
    if which == "triton":
        return kern.triton_fp8_gemm(a, a_scale, w, w_scale, out_dtype)
    if which == "torch":
        return ref.fp8_gemm(a, a_scale, w, w_scale, out_dtype, backend="torch")
    return ref.fp8_gemm_reference(a, a_scale, w, w_scale, out_dtype)


def grouped_fp8_gemm_dispatch(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    offs: torch.Tensor,
    out_dtype: torch.dtype,
    backend: str = "auto",
) -> torch.Tensor:
    """MoE grouped GEMM (rows sorted by expert, offs = cumulative ends): one launch on CUDA (no host
    sync): "auto" runs the CUDA kernel from GROUPED_CUDA_MIN_ROWS rows per expert on Hopper, else
    Triton; "cuda" / "triton" force one; "reference"/"torch" loop over experts
    (services/common/fp8.grouped_fp8_gemm)."""
    if backend == "cuda":
        resolve_backend(backend, 0, a.device)  # CPU tensors: the dense path's error
        _cuda_out_dtype(out_dtype)
        return fp8_wgmma.fp8_grouped_gemm(a, a_scale, w, w_scale, offs)
    if (
        backend == "auto"
        and a.is_cuda
        and out_dtype == torch.bfloat16
        and grouped_cuda_choice(a.shape[0], w.shape[0], a.device)
    ):
        try:
            return fp8_wgmma.fp8_grouped_gemm(a, a_scale, w, w_scale, offs)
        except fp8_wgmma.WgmmaUnsupported:
            pass  # this call's shape or layout: Triton, as below GROUPED_CUDA_MIN_ROWS
        except fp8_wgmma.WgmmaError as e:
            _remember_cuda_failure(e)  # then Triton, as below GROUPED_CUDA_MIN_ROWS
    which = resolve_backend(backend, 0, a.device)  # M = 0: "auto" picks triton when it exists
    if which == "triton" and backend == "auto" and has_scaled_mm():
        key = f"grouped m{kern.pick_grouped_block_m(a.shape[0], w.shape[0])}"
        if key not in TRITON_FAILURES:
            try:
                return kern.triton_grouped_fp8_gemm(a, a_scale, w, w_scale, offs, out_dtype)
            except Exception as e:  # noqa: BLE001 - as in fp8_gemm_dispatch
                TRITON_FAILURES[key] = f"{type(e).__name__}: {e}"
                log.warning("fp8 triton %s failed, looping torch scaled_mm per expert: %s", key, e)
        which = "torch"  # a host sync per call: no CUDA-graph capture on this path
    if which == "triton":
        return kern.triton_grouped_fp8_gemm(a, a_scale, w, w_scale, offs, out_dtype)
    return ref.grouped_fp8_gemm(a, a_scale, w, w_scale, offs, out_dtype, backend=which)


def fp8_matmul(
    x: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype,
    pow2: bool = False,
    backend: str = "auto",
) -> torch.Tensor:
    """x (..., K) high precision -> (..., N): quantise x 1x128, block-scaled GEMM with the weight.
    Where the tuned table measured the fused quantise+GEMM kernel faster for the whole linear
    (decode M), one launch does both; its bits equal the quantiser + the table's GEMM config, which
    is what the trainer's quantize_activation + fp8_gemm_dispatch compute (kern.tuned_linear_fused)."""
    k = x.shape[-1]
    if backend == "auto" and x.is_cuda and kern.HAS_TRITON and has_scaled_mm():
        fused = kern.tuned_linear_fused(x.numel() // max(k, 1), w_fp8.shape[0], k)
        if fused is not None and fused not in _FAILED_CONFIGS and x.dtype in (torch.bfloat16, torch.float32):
            try:
                out = kern.triton_fp8_linear_fused(x.reshape(-1, k), w_fp8, w_scale, out_dtype, fused, pow2)
                return out.reshape(*x.shape[:-1], w_fp8.shape[0])
            except Exception as e:  # noqa: BLE001 - as in fp8_gemm_dispatch: remember, then two kernels
                _FAILED_CONFIGS.add(fused)
                TRITON_FAILURES[f"fused {fused.name()}"] = f"{type(e).__name__}: {e}"
                log.warning("fp8 fused linear %s failed, quantiser + GEMM instead: %s", fused.name(), e)
    xq, xs = quantize_activation(x.reshape(-1, k), pow2)
    out = fp8_gemm_dispatch(xq, xs, w_fp8, w_scale, out_dtype, backend)
    return out.reshape(*x.shape[:-1], w_fp8.shape[0])  # torch path: N-sliced, not contiguous


class Fp8Linear(ref.Fp8Linear):
    """The engine's FP8 linear: services/common/fp8.Fp8Linear (fp8 weight + 128x128 scales as
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
    no host sync, so CUDA-graph capturable; a per-expert loop on the CPU reference path)."""

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
        for name, (n, k) in (("gate_up", (2 * inter, dim)), ("down", (dim, inter))):
            q = torch.zeros(n_experts, n, k, dtype=ref.FP8_DTYPE, device=device)
            self.register_buffer(f"{name}_fp8", q)
            shape = (n_experts, ref._cdiv(n, ref.BLOCK), ref._cdiv(k, ref.BLOCK))
            self.register_buffer(f"{name}_scale", torch.ones(shape, dtype=torch.float32, device=device))

    @classmethod
    def from_experts(
        cls, experts: ExpertWeights, pow2_scales: bool = False, backend: str = "auto"
    ) -> Fp8Experts:
        e, two_i, d = experts.gate_up_proj.shape
        mod = cls(e, two_i // 2, d, pow2_scales, backend, experts.gate_up_proj.device)
        mod.load_fused("gate_up_proj", experts.gate_up_proj)
        mod.load_fused("down_proj", experts.down_proj)
        return mod

    def expected_shape(self, proj: str) -> tuple[int, int, int]:
        n, k = (2 * self.inter, self.dim) if proj == "gate_up_proj" else (self.dim, self.inter)
        return (self.n_experts, n, k)

    @torch.no_grad()
    def load_expert(self, index: int, proj: str, w: torch.Tensor) -> None:
        """Quantise one expert's fused weight (gate_up_proj [2I, D] or down_proj [D, I]) in place."""
        q, s, _ = quantize_weight_fast(w.to(self.gate_up_fp8.device), self.pow2_scales)
        self.copy_expert(index, proj, q, s)

    @torch.no_grad()
    def copy_expert(self, index: int, proj: str, q: torch.Tensor, scale: torch.Tensor) -> None:
        """Copy one expert's already quantised weight (an fp8 checkpoint's bits and 128x128
        scales) into the buffers in place, without re-quantising."""
        dst = "gate_up" if proj == "gate_up_proj" else "down"
        getattr(self, f"{dst}_fp8")[index].copy_(q)
        getattr(self, f"{dst}_scale")[index].copy_(scale)

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
        h = grouped_fp8_gemm_dispatch(
            xq, xsc, self.gate_up_fp8, self.gate_up_scale, offs, x.dtype, self.backend
        )
        gate, up = h.chunk(2, dim=-1)
        aq, asc = quantize_activation((F.silu(gate) * up).contiguous(), self.pow2_scales)
        ys = grouped_fp8_gemm_dispatch(aq, asc, self.down_fp8, self.down_scale, offs, x.dtype, self.backend)
        ys = ys * weights.reshape(-1)[order, None].to(ys.dtype)
        return torch.zeros_like(x).index_add_(0, token, ys)


def engine_skip(name: str) -> bool:
    """Linears kept in high precision: services/common/fp8.default_skip (lm_head, routers,
    embeddings, norms) plus MLA's kv_b_proj, whose weight the absorbed decode path reads directly
    (services/engine/mla.py) rather than calling the module."""
    return ref.default_skip(name) or name.split(".")[-1] == "kv_b_proj"


def convert_model(
    model: nn.Module, pow2_scales: bool = False, backend: str = "auto", empty: bool = False
) -> list[str]:
    """Quantise every attention/MLP nn.Linear of an engine model in place (see engine_skip for
    what stays) and every MoE ExpertWeights into Fp8Experts. Returns the converted names. Call
    after the weights are loaded and after any `.to(dtype)`: a later dtype cast would turn the fp8
    buffers into that dtype. `empty`: only the layout (no quantisation; see model.build_fp8_model)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown fp8 backend {backend!r}: one of {BACKENDS}")
    names = ref.convert_to_fp8(
        model, skip=engine_skip, pow2_scales=pow2_scales, backend=backend, linear_cls=Fp8Linear, empty=empty
    )
    experts = [(n, mod) for n, mod in model.named_modules() if isinstance(mod, ExpertWeights)]
    for name, mod in experts:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if empty:
            e, two_i, d = mod.gate_up_proj.shape
            new = Fp8Experts(e, two_i // 2, d, pow2_scales, backend, mod.gate_up_proj.device)
        else:
            new = Fp8Experts.from_experts(mod, pow2_scales, backend)
        setattr(parent, child, new)
    return names + [n for n, _ in experts]


def fp8_modules(model: nn.Module) -> dict[str, ref.Fp8Linear]:
    return {name: mod for name, mod in model.named_modules() if isinstance(mod, ref.Fp8Linear)}


@torch.no_grad()
def load_hf_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Weight load/update for a model with Fp8Linear / Fp8Experts layers (HF names; experts fused
    or per expert). Each of their weights is either high precision (bf16/fp32), quantised 128x128
    into the fp8 buffers in place, or an fp8 checkpoint's pair `X.weight` (E4M3) +
    `X.weight_scale_inv` (services/common/fp8_checkpoint.py), whose bits and scales are copied into
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
        (mod, e, proj, w, scale)
        for prefix, mod in model.named_modules()
        if isinstance(mod, Fp8Experts)
        for e, proj, w, scale in _take_expert_weights(prefix, mod, rest, pairs)
    ]
    # Float32 here; the model's load_hf_state rounds to each parameter's dtype (one rounding).
    model.load_hf_state(fp8_checkpoint.dequantize_state(rest, torch.float32))  # type: ignore[operator]
    for name, w in weights.items():
        mods[name].load_weight(w)
    for name, (q, scale) in exact.items():
        mods[name].weight_fp8.copy_(q)
        mods[name].weight_scale.copy_(scale)
    for mod, e, proj, w, scale in expert_loads:
        if scale is None:
            mod.load_expert(e, proj, w)
        else:
            mod.copy_expert(e, proj, w, scale)


# (expert, fused proj, weight, scale): scale None = a high-precision weight to quantise; else the
# weight is fp8 and (weight, scale) are copied as they are.
ExpertLoad = tuple[int, str, torch.Tensor, torch.Tensor | None]


def _take_expert_weights(
    prefix: str, mod: Fp8Experts, rest: dict[str, torch.Tensor], pairs: dict[str, str]
) -> list[ExpertLoad]:
    """Pop one Fp8Experts' tensors out of `rest` (fused `<prefix>.gate_up_proj`/`.down_proj`, or
    per-expert `<prefix>.<e>.{gate,up,down}_proj.weight`, each high precision or an fp8 pair whose
    scale is popped too), checked, as ExpertLoads."""
    per: dict[tuple[int, str], torch.Tensor] = {}
    scales: dict[tuple[int, str], torch.Tensor] = {}
    for key in [k for k in rest if k.startswith(prefix + ".")]:
        hit = PER_EXPERT.match(key)
        if hit is not None and hit[1] == prefix:
            per[(int(hit[2]), hit[3])] = rest.pop(key)
            if key in pairs:
                scales[(int(hit[2]), hit[3])] = rest.pop(pairs[key])
    fused = {p: rest.pop(f"{prefix}.{p}") for p in ("gate_up_proj", "down_proj") if f"{prefix}.{p}" in rest}
    if per and fused:
        raise ValueError(f"{prefix}: both fused and per-expert tensors given")
    out: list[ExpertLoad] = []
    if per:
        want = {(e, p) for e in range(mod.n_experts) for p in ("gate_proj", "up_proj", "down_proj")}
        if set(per) != want:
            raise ValueError(
                f"{prefix}: per-expert tensors incomplete (missing {sorted(want - set(per))[:3]})"
            )
        for e in range(mod.n_experts):
            for p, (w, scale) in (
                ("gate_up_proj", _fuse_gate_up(mod, per, scales, e)),
                ("down_proj", (per[(e, "down_proj")], scales.get((e, "down_proj")))),
            ):
                if tuple(w.shape) != mod.expected_shape(p)[1:]:
                    raise ValueError(
                        f"{prefix}.{e}.{p}: shape {tuple(w.shape)} != {mod.expected_shape(p)[1:]}"
                    )
                if scale is not None and tuple(scale.shape) != mod.expected_scale_shape(p):
                    raise ValueError(
                        f"{prefix}.{e}.{p}: scale shape {tuple(scale.shape)} != {mod.expected_scale_shape(p)}"
                    )
                out.append((e, p, w, scale))
        return out
    for p in ("gate_up_proj", "down_proj"):
        if p not in fused:
            raise ValueError(f"state dict mismatch: missing ['{prefix}.{p}']")
        if tuple(fused[p].shape) != mod.expected_shape(p):
            raise ValueError(
                f"{prefix}.{p}: shape {tuple(fused[p].shape)} != expected {mod.expected_shape(p)}"
            )
        out.extend((e, p, fused[p][e], None) for e in range(mod.n_experts))
    return out


def _fuse_gate_up(
    mod: Fp8Experts,
    per: dict[tuple[int, str], torch.Tensor],
    scales: dict[tuple[int, str], torch.Tensor],
    e: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Expert e's fused gate_up rows (gate then up, as moe.ExpertWeights fuses them; a 128-row
    tile may span both) and, when they can be copied exactly, their scales."""
    gate, up = per[(e, "gate_proj")], per[(e, "up_proj")]
    gs, us = scales.get((e, "gate_proj")), scales.get((e, "up_proj"))
    if gs is not None and us is not None and mod.inter % ref.BLOCK == 0:
        # Both fp8 and the gate rows fill whole 128-row tiles: the fused weight's tiles are the
        # gate's then the up's, so the checkpoint's bits and scales concatenate exactly.
        return torch.cat([gate, up]), torch.cat([gs, us])
    # Otherwise the fused weight's tile that straddles gate and up rows has no scale of its own in
    # the checkpoint: dequantise (float32) and let load_expert re-quantise the expert 128x128.
    # Its fp8 bits then differ from the checkpoint's (docs/fp8.md).
    if gs is not None:
        gate = ref.dequantize_weight(gate, gs)
    if us is not None:
        up = ref.dequantize_weight(up, us)
    return torch.cat([gate, up]), None
