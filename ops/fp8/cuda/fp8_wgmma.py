"""The warp-specialised Hopper FP8 GEMM (`fp8_wgmma.cuh`, exported by `fp8_wgmma.cu`): built with
nvcc on first use, loaded through ctypes, launched on torch's current stream. The engine's and
trainer's "cuda" FP8 backend (ops/fp8/dispatch.py), which "auto" picks where the dispatch table
measured it fastest: at M >= 4096 on the DeepSeek-V3 shapes it measured 1.00-1.10x cuBLAS
block-wise and 0.96-0.99x DeepGEMM (one H100; docs/fp8.md). Its grouped GEMM (`fp8_grouped_gemm`)
is the MoE experts' GEMM from 32 rows per expert.

Built and cached by nvcc.py (one nvcc call of ~10 s, no torch headers; the library is keyed by the
source's and the headers' hash, so a changed kernel rebuilds; nvcc's output is kept beside it, and
`serialised` reads ptxas's warnings there). The library links no libcuda (it looks the
tensor-map encoder up through the CUDA runtime), so it also builds where there is no driver.

Operands follow ops/fp8/recipe.py: a (M, K) e4m3 with a_scale (M, K/128) float32, w (N, K)
e4m3 with w_scale (ceil(N/128), K/128) float32; the output is bf16. What the kernel needs
(`unsupported_reason` says which one a call misses): Hopper (sm_90), K % 128 == 0, even N,
row-major contiguous a and w, 16-byte aligned pointers. The scales are read K-block major
(stride(0) == 1, what the Triton quantiser writes); other layouts are copied.

A library exports a table of kernel configurations ("variants", fp8_wgmma.cuh's `Variant`); the
product's has two, `DENSE` and `GROUPED`. `fp8_gemm` and `fp8_grouped_gemm` take another library
and index (`lib`, `variant`: a measurement's build of the same header) and ask that library what
each index is (`describe`).
"""

from __future__ import annotations

import ctypes
import functools
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ops.fp8 import recipe as ref
from ops.fp8.cuda import nvcc
from ops.fp8.triton_gemm import device_index, num_sms

SOURCE = Path(__file__).with_name("fp8_wgmma.cu")
NVCC_FLAGS = nvcc.SM90A_FLAGS
BLOCK = 128
CAPABILITY = (9, 0)  # sm_90a: wgmma, setmaxnreg, TMA multicast
DENSE = 0  # fp8_wgmma.cu's table: the dense GEMM
GROUPED = 1  # and the MoE grouped GEMM
MAX_GROUPS = 1024  # fp8_wgmma.cuh's: the group tables live in shared memory
# fp8_wgmma.cuh's MODE flags.
MODE_FLAGS = {"tma": 4, "ovl": 16, "grouped": 64}


@dataclass(frozen=True)
class Variant:
    """One entry of a library's table: the kernel's template arguments."""

    bn: int
    stages: int
    mode: int
    cluster: int

    @property
    def flags(self) -> frozenset[str]:
        return frozenset(name for name, bit in MODE_FLAGS.items() if self.mode & bit)

    @property
    def grouped(self) -> bool:
        return bool(self.mode & MODE_FLAGS["grouped"])

    @property
    def name(self) -> str:
        """e.g. "n256s4_tma_ovl_c2"."""
        flags = "".join(f"_{f}" for f in MODE_FLAGS if f in self.flags)
        return f"n{self.bn}s{self.stages}{flags}_c{self.cluster}"


class WgmmaError(RuntimeError):
    """The kernel could not be built, loaded or launched."""


class WgmmaUnsupported(WgmmaError):
    """The kernel does not take this call (`unsupported_reason` says why); nothing failed."""


# ptxas's warnings that a kernel's wgmmas run one at a time: register shortage (C7511), an
# accumulator used while in flight (C7515), divergent code around them (C7518).
_SERIALISED = re.compile(r"\(C75(11|15|18)\)")


def library_path() -> Path:
    return nvcc.library_path(SOURCE, "fp8_wgmma", NVCC_FLAGS)


def build(out: Path | None = None) -> Path:
    """Compile the library to `out` (default: the cache path); returns it."""
    try:
        return nvcc.build(SOURCE, out or library_path(), NVCC_FLAGS)
    except nvcc.BuildError as e:
        raise WgmmaError(str(e)) from e


def serialised(library_file: Path) -> bool:
    """Whether ptxas warned, building this library, that it serialised some kernel's wgmmas (which
    undoes the kernel's overlap of promotion and tensor-core work)."""
    log = nvcc.log_path(library_file)
    return log.exists() and _SERIALISED.search(log.read_text()) is not None


@functools.cache
def library() -> ctypes.CDLL:
    """The library, built first when the cache has none (WgmmaError when it cannot be)."""
    path = library_path()
    if not path.exists():
        build(path)
    return load(path)


def load(path: Path) -> ctypes.CDLL:
    """A built library (this one, or another build of fp8_wgmma.cuh), its entry points declared."""
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
    lib.relay_fp8_gemm_count.argtypes = []
    lib.relay_fp8_gemm_count.restype = i
    lib.relay_fp8_gemm_describe.argtypes = [i, ctypes.POINTER(ctypes.c_int)]
    lib.relay_fp8_gemm_describe.restype = i
    return lib


_TABLES: dict[int, tuple[Variant, ...]] = {}


def describe(lib: ctypes.CDLL | None = None) -> tuple[Variant, ...]:
    """The variant table of `lib` (default: the product's library), read from it once: fp8_gemm
    asks on every call, and a ctypes call per question would cost host time on the eager path."""
    lib = lib or library()
    key = lib._handle
    table = _TABLES.get(key)
    if table is None:
        out = (ctypes.c_int * 4)()
        rows = []
        for v in range(lib.relay_fp8_gemm_count()):
            if lib.relay_fp8_gemm_describe(v, out) != 0:
                raise WgmmaError(f"relay_fp8_gemm_describe({v}) failed")
            rows.append(Variant(*out))
        table = _TABLES[key] = tuple(rows)
    return table


def launch_grid(
    variant: int, m: int, n: int, device: torch.device | None = None, lib: ctypes.CDLL | None = None
) -> int:
    """The CTAs `fp8_gemm` launches for an (M, N) output with this variant."""
    return int((lib or library()).relay_fp8_gemm_grid(variant, m, n, num_sms(device or torch.device("cuda"))))


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
    variant: int = DENSE,
    lib: ctypes.CDLL | None = None,
) -> torch.Tensor:
    """(a, a_scale 1x128) @ (w, w_scale 128x128)^T in bf16 on the current stream; CUDA-graph safe
    (no synchronisation, no allocation when `out` is given and the scales are K-block-major).
    lib, variant: another build of the kernel (`load`) and an index into its table."""
    reason = unsupported_reason(a, w)
    if reason is not None:
        raise WgmmaUnsupported(reason)
    table = describe(lib)
    if not 0 <= variant < len(table) or table[variant].grouped:
        raise ValueError(f"variant must be a dense one in [0, {len(table)}), got {variant}")
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
    sb, sb_pitch = _k_block_major(w_scale)
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
    variant: int = GROUPED,
    lib: ctypes.CDLL | None = None,
) -> torch.Tensor:
    """MoE grouped GEMM in bf16 (ops/fp8/recipe.grouped_fp8_gemm's function): a (T, K) rows
    sorted by expert, expert e owning rows [offs[e-1], offs[e]) (offs: (E,) cumulative ends, on the
    GPU, empty experts allowed), times w[e]^T with w (E, N, K) e4m3 and w_scale (E, NB, KB). On
    the current stream, no host synchronisation (CUDA-graph safe)."""
    reason = grouped_unsupported_reason(a, w, offs)
    if reason is not None:
        raise WgmmaUnsupported(reason)
    table = describe(lib)
    if not 0 <= variant < len(table) or not table[variant].grouped:
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
        ends.data_ptr(), e, t, n, k, out.stride(0), lib=lib,
    )  # fmt: skip
    return out
