"""The warp-specialised Hopper FP8 GEMM (`fp8_wgmma.cu`): built with nvcc on first use, loaded
through ctypes, launched on torch's current stream. The engine's and trainer's "cuda" FP8 backend
(ops/fp8/dispatch.py), which "auto" picks where the dispatch table measured it fastest: at
M >= 4096 on the DeepSeek-V3 shapes its default variant measured 1.00-1.10x cuBLAS block-wise and
0.96-0.99x DeepGEMM (one H100, its K loops unrolled 4x; docs/fp8.md). Its grouped variants
(`fp8_grouped_gemm`) are the MoE experts' GEMM from 32 rows per expert. The other variants are
the measured alternatives the FP8 benchmarks time against it.

Built and cached by nvcc.py (one nvcc call of ~10 s, no torch headers; the library is keyed by the
source's hash, so a changed kernel rebuilds; nvcc's output is kept beside it, and `serialised` reads
ptxas's warnings there). The library links no libcuda (it looks the
tensor-map encoder up through the CUDA runtime), so it also builds where there is no driver.

Operands follow ops/fp8/recipe.py: a (M, K) e4m3 with a_scale (M, K/128) float32, w (N, K)
e4m3 with w_scale (ceil(N/128), K/128) float32; the output is bf16. What the kernel needs
(`unsupported_reason` says which one a call misses): Hopper (sm_90), K % 128 == 0, even N,
row-major contiguous a and w, 16-byte aligned pointers. The activation scales are read K-block
major (stride(0) == 1, what the Triton quantiser writes); other layouts are copied.
"""

from __future__ import annotations

import ctypes
import functools
import re
from pathlib import Path

import torch

from ops.fp8 import recipe as ref
from ops.fp8.cuda import nvcc
from ops.fp8.triton_gemm import device_index, num_sms

SOURCE = Path(__file__).with_name("fp8_wgmma.cu")
NVCC_FLAGS = nvcc.SM90A_FLAGS
BLOCK = 128
CAPABILITY = (9, 0)  # sm_90a: wgmma, setmaxnreg, TMA multicast
# The kernel variants the library exports, in its VARIANTS order: (BN, pipeline stages, mode,
# cluster size); fp8_wgmma.cu describes the modes. "unscaled" is a probe (no scales: not the
# recipe), for measuring what the promotion costs. Tiles are 128 rows (two math warpgroups), or
# 256 for a "tall" mode ("plain" with each warpgroup holding two 64-row blocks that share the
# B tile, and clusters sharing the A tile between CTAs with neighbouring columns: `tile_rows`).
# A "_tma" mode stores the output tile through shared memory (a ring slot lent by the producer)
# and TMA stores that overlap the next tile's wgmmas; at ldc % 8 != 0 it falls back to the direct
# epilogue of the same mode. A "_sbs" mode reads the weight scales from shared memory, loaded by
# TMA with each stage (as cuBLAS's kernel does), instead of a global load per K block; it takes
# them K-block-major like the activation scales (`uses_smem_scales`). An "_ovl" mode issues the next
# tile's first K block before storing the current tile, so the epilogue overlaps tensor-core work.
VARIANTS: tuple[tuple[int, int, str, int], ...] = (
    (128, 5, "plain", 1),
    (256, 4, "plain", 1),
    (128, 5, "pipelined", 1),
    (256, 4, "plain", 2),
    (128, 6, "pipelined", 2),
    (256, 4, "unscaled", 1),
    (128, 6, "plain", 2),
    (256, 4, "unscaled", 2),
    (256, 4, "plain_tma", 1),
    (256, 4, "plain_tma", 2),
    (128, 6, "pipelined_tma", 2),
    (256, 4, "unscaled_tma", 1),
    (256, 4, "plain_sbs", 1),
    (256, 4, "plain_tma_sbs", 1),
    (256, 4, "plain_sbs", 2),
    (128, 6, "plain_tma_sbs", 2),
    (128, 6, "plain_tma", 2),
    (256, 4, "plain_tma_sbs", 2),
    (256, 4, "plain_tma_sbs_ovl", 2),
    (256, 4, "plain_tma_sbs_ovl", 1),
    (128, 4, "tall_tma_sbs", 2),
    (128, 4, "tall_tma_sbs", 1),
    (128, 4, "tall_tma_sbs_ovl", 2),
    (256, 4, "plain_tma_sbs_ovl_grouped", 1),
    (256, 4, "plain_tma_sbs_grouped", 1),
)
# BN 256, plain + TMA store + scales in shared memory + OVERLAP, 2-CTA clusters: the fastest in
# interleaved timings on one H100, by 0-7% over variant 17.
DEFAULT_VARIANT = 18
# "_grouped" modes are the MoE grouped GEMM (`fp8_grouped_gemm`): variant 19's schedule over each
# expert's rows (no clusters: a cluster's two row tiles could belong to two experts).
DEFAULT_GROUPED_VARIANT = 23
MAX_GROUPS = 1024  # fp8_wgmma.cu's: the group tables live in shared memory


# fp8_wgmma.cu's MODE values (enum Mode and its flag constants) for the parts of a mode string.
BASE_MODES = {"plain": 0, "pipelined": 1, "unscaled": 2, "tall": 32}  # tall: PLAIN | TALL
MODE_FLAGS = {"tma": 4, "sbs": 8, "ovl": 16, "grouped": 64}


def mode_parts(mode: str) -> tuple[str, frozenset[str]]:
    """A mode string's base and its flags: "plain_tma_sbs" -> ("plain", {"tma", "sbs"})."""
    base, *flags = mode.split("_")
    return base, frozenset(flags)


def mode_value(mode: str) -> int:
    """fp8_wgmma.cu's MODE template argument for a mode string ("plain_tma_sbs_ovl" -> 28)."""
    base, flags = mode_parts(mode)
    value = BASE_MODES[base]
    for flag in flags:
        value |= MODE_FLAGS[flag]
    return value


# Each variant's mode parsed once: fp8_gemm asks two of these per call, and parsing the string
# each time cost ~0.5 us a question on the host-bound eager path.
_MODES = tuple(mode_parts(mode) for _, _, mode, _ in VARIANTS)


def tile_rows(variant: int) -> int:
    return 2 * BLOCK if _MODES[variant][0] == "tall" else BLOCK


def is_grouped(variant: int) -> bool:
    return "grouped" in _MODES[variant][1]


def uses_smem_scales(variant: int) -> bool:
    """Whether the variant reads the weight scales K-block-major (no copy for that layout)."""
    return "sbs" in _MODES[variant][1]


class WgmmaError(RuntimeError):
    """The kernel could not be built, loaded or launched."""


class WgmmaUnsupported(WgmmaError):
    """The kernel does not take this call (`unsupported_reason` says why); nothing failed."""


# fp8_wgmma.cu's K_UNROLL: how many times its K loops are unrolled. `unroll` below builds another
# (for timing them against each other).
K_UNROLL = 4
# ptxas's warnings that a kernel's wgmmas run one at a time: register shortage (C7511), an
# accumulator used while in flight (C7515), divergent code around them (C7518).
_SERIALISED = re.compile(r"\(C75(11|15|18)\)")


def _flags(unroll: int | None) -> tuple[str, ...]:
    return NVCC_FLAGS if unroll in (None, K_UNROLL) else (*NVCC_FLAGS, f"-DRELAY_K_UNROLL={unroll}")


def library_path(unroll: int | None = None) -> Path:
    stem = "fp8_wgmma" if unroll in (None, K_UNROLL) else f"fp8_wgmma_u{unroll}"
    return nvcc.library_path(SOURCE, stem, _flags(unroll))


def build(out: Path | None = None, unroll: int | None = None) -> Path:
    """Compile the library (its K loops unrolled `unroll` times, default K_UNROLL) to `out`
    (default: the cache path); returns it."""
    try:
        return nvcc.build(SOURCE, out or library_path(unroll), _flags(unroll))
    except nvcc.BuildError as e:
        raise WgmmaError(str(e)) from e


def serialised(library_file: Path) -> bool:
    """Whether ptxas warned, building this library, that it serialised some kernel's wgmmas (which
    undoes the kernel's overlap of promotion and tensor-core work)."""
    log = nvcc.log_path(library_file)
    return log.exists() and _SERIALISED.search(log.read_text()) is not None


@functools.cache
def library(unroll: int | None = None) -> ctypes.CDLL:
    """The library, built first when the cache has none (WgmmaError when it cannot be); `unroll`:
    the one built with its K loops unrolled that many times (a measurement's, not the product's)."""
    path = library_path(unroll)
    if not path.exists():
        build(path, unroll)
    return load(path)


def load(path: Path) -> ctypes.CDLL:
    """A built library, its entry points declared (a measurement's build, e.g. with other defines,
    goes through here too)."""
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        raise WgmmaError(f"cannot load {path}: {e}") from e
    vp, i = ctypes.c_void_p, ctypes.c_int
    lib.relay_fp8_gemm.argtypes = [vp, vp, i, vp, vp, i, vp, i, i, i, i, i, i, vp]
    lib.relay_fp8_gemm.restype = i
    lib.relay_fp8_grouped_gemm.argtypes = [vp, vp, i, vp, vp, i, vp, vp, i, i, i, i, i, i, i, vp]
    lib.relay_fp8_grouped_gemm.restype = i
    lib.relay_fp8_gemm_grid.argtypes = [i, i, i, i]
    lib.relay_fp8_gemm_grid.restype = i
    lib.relay_fp8_gemm_smem_bytes.argtypes = [i]
    lib.relay_fp8_gemm_smem_bytes.restype = i
    return lib


def launch_grid(variant: int, m: int, n: int, device: torch.device | None = None) -> int:
    """The CTAs `fp8_gemm` launches for an (M, N) output with this variant."""
    return int(library().relay_fp8_gemm_grid(variant, m, n, num_sms(device or torch.device("cuda"))))


def is_hopper(device: torch.device) -> bool:
    """Whether `device` is a GPU this kernel runs on (sm_90)."""
    return device.type == "cuda" and _capability(device_index(device)) == CAPABILITY


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    # Cached, as ops/fp8/triton_gemm.num_sms: "auto" asks on every GEMM it may send here.
    return torch.cuda.get_device_capability(index)


def unsupported_reason(a: torch.Tensor, w: torch.Tensor) -> str | None:
    """Why this kernel cannot run a @ w^T, or None when it can."""
    if not (a.is_cuda and w.is_cuda):
        return "needs CUDA tensors"
    if not is_hopper(a.device):
        return "needs a Hopper GPU (sm_90a wgmma)"
    k = a.shape[1]
    if k % BLOCK:
        return f"K={k} is not a multiple of {BLOCK}"
    if w.shape[0] % 2:
        return f"N={w.shape[0]} is odd (the epilogue stores column pairs)"
    for name, t in (("a", a), ("w", w)):
        if not t.is_contiguous():
            return f"{name} is not contiguous"
        if t.data_ptr() % 16:
            return f"{name} is not 16-byte aligned"
    return None


def _k_block_major(scale: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(rows, K blocks) scales as the kernel's TMA reads them: K-block-major rows (the layout
    cuBLAS's block-wise path wants too), the rows padded to a multiple of 4 for 16-byte pitches;
    returns them and their row pitch. No copy for the Triton quantiser's layout at rows % 4 == 0."""
    s = ref._outer_major(ref._pad_to(scale.float(), 0, 4))
    if s.shape[1] == 1:  # one K block: its stride says nothing, the row is the padded M
        return s, s.shape[0]
    if s.stride(1) % 4:  # a view whose rows are not 16-byte multiples apart
        s = s.t().contiguous().t()
    return s, s.stride(1)


def fp8_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    out: torch.Tensor | None = None,
    variant: int = DEFAULT_VARIANT,
    lib: ctypes.CDLL | None = None,
) -> torch.Tensor:
    """(a, a_scale 1x128) @ (w, w_scale 128x128)^T in bf16 on the current stream; CUDA-graph safe
    (no synchronisation, no allocation when `out` is given and the scales are K-block-major).
    lib: run another build of the kernel (`library(unroll)`, `load`: a measurement's) instead of
    the product's."""
    reason = unsupported_reason(a, w)
    if reason is not None:
        raise WgmmaUnsupported(reason)
    if not 0 <= variant < len(VARIANTS) or is_grouped(variant):
        raise ValueError(f"variant must be a dense one in [0, {len(VARIANTS)}), got {variant}")
    m, k = a.shape
    n = w.shape[0]
    kb = k // BLOCK
    if tuple(a_scale.shape) != (m, kb) or tuple(w_scale.shape) != (ref._cdiv(n, BLOCK), kb):
        raise ValueError(
            f"scale shapes {tuple(a_scale.shape)}, {tuple(w_scale.shape)} do not fit M={m} N={n} K={k}"
        )
    if out is None:
        out = torch.empty(m, n, dtype=torch.bfloat16, device=a.device)
    elif out.dtype != torch.bfloat16 or tuple(out.shape) != (m, n) or out.stride(1) != 1:
        raise ValueError("out must be a (M, N) bf16 tensor with unit column stride")
    if m == 0:
        return out
    sa, pitch = _k_block_major(a_scale)
    if uses_smem_scales(variant):
        sb, sb_pitch = _k_block_major(w_scale)
    else:
        sb, sb_pitch = w_scale.float().contiguous(), 0
    _launch(
        "relay_fp8_gemm", a.device, variant,
        a.data_ptr(), sa.data_ptr(), pitch, w.data_ptr(), sb.data_ptr(), sb_pitch, out.data_ptr(),
        m, n, k, out.stride(0), lib=lib,
    )  # fmt: skip
    return out


def _launch(
    entry: str, device: torch.device, variant: int, *args: int, lib: ctypes.CDLL | None = None
) -> None:
    """Call `entry` of `lib` (default: the product's library) with `args`, then the SM count, the
    variant and the current stream (the arguments both entry points end with)."""
    # The raw handle: torch.cuda.current_stream() builds a Stream object (~5 us of host time,
    # against ~0.2 us), and an eager FP8 training step is host-bound.
    stream = torch._C._cuda_getCurrentRawStream(device_index(device))
    rc = getattr(lib or library(), entry)(*args, num_sms(device), variant, stream)
    if rc != 0:
        raise WgmmaError(f"{entry} failed with code {rc}")


def grouped_unsupported_reason(a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> str | None:
    """Why the grouped kernel cannot run this MoE GEMM, or None when it can (w: (E, N, K))."""
    if w.dim() != 3:
        return f"grouped weights are (E, N, K), got {tuple(w.shape)}"
    reason = unsupported_reason(a, w[0])
    if reason is not None:
        return reason
    if not w.is_contiguous():
        return "w is not contiguous"
    if w.shape[1] % 8:
        return f"N={w.shape[1]} is not a multiple of 8 (the TMA-stored output rows)"
    if not 1 <= w.shape[0] <= MAX_GROUPS:
        return f"{w.shape[0]} groups: the kernel takes 1..{MAX_GROUPS}"
    if offs.dim() != 1 or offs.shape[0] != w.shape[0]:
        return f"offs must be ({w.shape[0]},) cumulative row ends, got {tuple(offs.shape)}"
    if offs.device != a.device:
        return "offs is not on a's device"
    return None


def grouped_weight_scales(w_scale: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(E, NB, KB) weight scales as the grouped kernel's TMA reads them: K-block-major rows holding
    each expert's NB blocks padded to a multiple of 4 (so an expert's 32-byte box starts in its own
    blocks); returns them and their row pitch in floats. One small copy (E * NB * KB floats)."""
    e, nb, kb = w_scale.shape
    nbp = ref._cdiv(nb, 4) * 4
    s = torch.zeros(kb, e, nbp, dtype=torch.float32, device=w_scale.device)
    s[:, :, :nb] = w_scale.permute(2, 0, 1)
    return s.reshape(kb, e * nbp), e * nbp


def fp8_grouped_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    offs: torch.Tensor,
    out: torch.Tensor | None = None,
    variant: int = DEFAULT_GROUPED_VARIANT,
) -> torch.Tensor:
    """MoE grouped GEMM in bf16 (ops/fp8/recipe.grouped_fp8_gemm's function): a (T, K) rows
    sorted by expert, expert e owning rows [offs[e-1], offs[e]) (offs: (E,) cumulative ends, on the
    GPU, empty experts allowed), times w[e]^T with w (E, N, K) e4m3 and w_scale (E, NB, KB). On
    the current stream, no host synchronisation (CUDA-graph safe)."""
    reason = grouped_unsupported_reason(a, w, offs)
    if reason is not None:
        raise WgmmaUnsupported(reason)
    if not 0 <= variant < len(VARIANTS) or not is_grouped(variant):
        raise ValueError(f"variant {variant} is not a grouped one")
    t, k = a.shape
    e, n, _ = w.shape
    kb = k // BLOCK
    if tuple(a_scale.shape) != (t, kb) or tuple(w_scale.shape) != (e, ref._cdiv(n, BLOCK), kb):
        raise ValueError(
            f"scale shapes {tuple(a_scale.shape)}, {tuple(w_scale.shape)} do not fit T={t} E={e} N={n} K={k}"
        )
    if out is None:
        out = torch.empty(t, n, dtype=torch.bfloat16, device=a.device)
    elif out.dtype != torch.bfloat16 or tuple(out.shape) != (t, n) or not out.is_contiguous():
        raise ValueError("out must be a contiguous (T, N) bf16 tensor")
    if t == 0:
        return out
    sa, pitch = _k_block_major(a_scale)
    sb, sb_pitch = grouped_weight_scales(w_scale)
    ends = offs.to(torch.int32).contiguous()
    _launch(
        "relay_fp8_grouped_gemm", a.device, variant,
        a.data_ptr(), sa.data_ptr(), pitch, w.data_ptr(), sb.data_ptr(), sb_pitch, out.data_ptr(),
        ends.data_ptr(), e, t, n, k, out.stride(0),
    )  # fmt: skip
    return out
