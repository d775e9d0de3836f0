"""The FP8 (DeepSeek-V3 block-scaled) quantisers and GEMM dispatch of the engine's layers and the
trainer's (services/engine/layers/fp8.py, trainer/fp8.py): both call `quantize_activation` and
`fp8_gemm_dispatch`, so they compute the same bits for the same weights and inputs.

Weights are quantised 128x128 at load / weight-update time (ops/fp8/recipe.quantize_weight);
activations 1x128 on every call. GEMM backends:

- "reference": ops/fp8/recipe.fp8_gemm_reference (float32 block accumulation; CPU, tests);
- "torch": torch.nn.functional.scaled_mm block-wise (cuBLAS), best at large M;
- "triton": ops/fp8/triton_gemm.py, small BLOCK_M + split-K, for decode-sized M;
- "cuda": ops/fp8/cuda/fp8_wgmma.py, the warp-specialised Hopper kernel (TMA, wgmma, DeepGEMM's
  design; bf16 output), best at large M on sm_90; built with nvcc at first use;
- "auto": CPU -> reference; CUDA -> the measured table kern.TUNED_CONFIGS (per M bucket and
  (N, K): a Triton config, torch or cuda), and for shapes it does not list: triton (pick_config)
  when M <= TRITON_MAX_M, else torch. A "cuda" entry runs only where the kernel can (sm_90, bf16
  output, K % 128 == 0, even N) and has not failed to build or launch here; elsewhere torch does.

The table and TRITON_MAX_M are measured on the H200 (docs/fp8.md).
"""

from __future__ import annotations

import logging
import os
from typing import Literal

import torch
import torch.nn.functional as F

from ops.fp8 import recipe as ref
from ops.fp8 import triton_gemm as kern
from ops.fp8 import triton_quant as fp8_quant
from ops.fp8.cuda import fp8_wgmma

Backend = Literal["auto", "reference", "torch", "triton", "cuda"]
BACKENDS: tuple[str, ...] = ("auto", "reference", "torch", "triton", "cuda")
# For (N, K) outside the measured table: M at or below which "auto" picks the Triton kernel on
# CUDA. On the H200 Triton (pick_config) beat cuBLAS block-wise at every measured M <= 256 and
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
    One Triton pass on CUDA (ops/fp8/triton_quant.py), the torch reference elsewhere; the same bits
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
    (ops/fp8/recipe.quantize_act_t), for the FP8 weight-gradient GEMM. One Triton pass on CUDA."""
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
    (ops/fp8/recipe.grouped_fp8_gemm)."""
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
