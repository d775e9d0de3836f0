"""DeepGEMM's own SM90 block-scaled FP8 GEMM as a baseline, next to bf16 cuBLAS, torch's block-wise
scaled_mm (cuBLAS) and our CUDA kernel's default variant, in one process, at DeepSeek-V3's large-M
shapes.

Why: the goal (>= 1.7x bf16 at M >= 4096) is DeepGEMM's H800 figure, so DeepGEMM measured on the
same machine in the same process says what this card reaches; where it is faster, its kernel is
the one to read (bench/fp8/wgmma_ncu_source.sh profiles any kernel by name).

DeepGEMM is not a dependency and is not in this repository: `--src` is an extracted source tree
made by bench/fp8/deepgemm_bundle.sh (DeepGEMM plus the CUTLASS and {fmt} headers at its submodule
commits). Its C++ module is built here with torch's cpp_extension (ninja; no setup.py, no wheel),
and its kernels JIT-compile with nvcc at their first call, so the script warms every shape up
before any timing. The inputs are quantised by relay's own recipe (ops/fp8/recipe.py), whose
scales follow DeepGEMM's convention (float32 decoding scales, 1x128 for activations and 128x128
for weights), and every output is checked against the recipe's float32 reference first.

    python3 bench/fp8/deepgemm.py --src /tmp/deepgemm --out $OUT/deepgemm.json
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import gemm as bench  # noqa: E402
from wgmma import (  # noqa: E402
    MAX_REL_ERR,
    ROUNDS,
    TIME_MS,
    TIME_NK,
    add_tflops,
    bench_rounds,
    parse_nk,
    quantised,
)

from bench.kernels import fp8_wgmma_variants as variants  # noqa: E402
from bench.results import write_result
from ops.fp8 import recipe as ref  # noqa: E402
from ops.fp8.cuda import fp8_wgmma  # noqa: E402
from ops.fp8.cuda.nvcc import nvcc_path  # noqa: E402

CHECK_SHAPES = [(128, 4096, 7168), (1000, 2048, 7168), (4096, 7168, 2048)]
# Which of our variants (bench/kernels/fp8_wgmma_variants.cu) to time (--variants); each also from
# the library built with each of --unrolls (its K loops unrolled that many times).
OURS = [variants.DEFAULT]
UNROLLS: list[int] = []


def unrolled_key(variant: int, unroll: int | None) -> str:
    """The row's name for a variant from the library unrolled `unroll` times (None: the product's)."""
    return ours_key(variant) if unroll is None else f"{ours_key(variant)}_u{unroll}"


def ours_key(variant: int) -> str:
    """The row's name for one of our variants: "relay_wgmma" for the default (as before --variants)."""
    return "relay_wgmma" if variant == variants.DEFAULT else f"relay_wgmma_v{variant}"


def cuda_home() -> str:
    """$CUDA_HOME, else the toolkit holding nvcc's headers (nvcc may be a wrapper script)."""
    nvcc = nvcc_path()
    if nvcc is None:
        raise SystemExit("nvcc not found: DeepGEMM compiles its kernels with it at run time")
    candidates = [os.environ.get("CUDA_HOME"), str(Path(nvcc).resolve().parents[1]), "/usr/local/cuda"]
    candidates += sorted(str(p) for p in Path("/usr/local").glob("cuda-*"))
    for home in candidates:
        if home and (Path(home) / "include" / "cuda.h").exists():
            return home
    raise SystemExit(f"no CUDA toolkit with include/cuda.h among {candidates}: set CUDA_HOME")


def import_deepgemm(src: Path, build_dir: Path) -> Any:
    """Build DeepGEMM's C++ module from `src` into `build_dir` and import the package."""
    from torch.utils.cpp_extension import load

    home = cuda_home()
    os.environ.setdefault("CUDA_HOME", home)
    # The JIT includes cutlass/ and cute/ from the package's include directory (develop.sh links them).
    include = src / "deep_gemm" / "include"
    for name in ("cutlass", "cute"):
        link = include / name
        if not link.exists():
            link.symlink_to(src / "third-party" / "cutlass" / "include" / name)
    build_dir.mkdir(parents=True, exist_ok=True)
    module = load(
        name="_C",
        sources=[str(src / "csrc" / "python_api.cpp")],
        extra_include_paths=[
            f"{home}/include",
            f"{home}/include/cccl",
            str(include),
            str(src / "third-party" / "cutlass" / "include"),
            str(src / "third-party" / "fmt" / "include"),
        ],
        # DeepGEMM's setup.py flags (its C++ module is C++17; its JIT'd kernels pick their own).
        extra_cflags=["-std=c++17", "-O3", "-Wno-psabi", "-Wno-deprecated-declarations"],
        # -l:libstdc++.so.6: the module must share the process's libstdc++. On the GPU machine a
        # torch extension linked the default way lists no libstdc++ in its ldd and carries the
        # library's code itself (the crash frames, codecvt and ostream internals, were in _C.so):
        # a second copy whose locale facet ids disagree with the shared library's, so the first
        # std::regex or `ostream << unsigned long` calls through the wrong facet's vtable and
        # segfaults (a 10-line extension with a std::regex crashed the same way,
        # and ran once linked with this flag). Why that link takes the static archive there was
        # not found: the toolchain has libstdc++.so.
        extra_ldflags=[f"-L{home}/lib64", "-lcudart", "-lnvrtc", "-l:libstdc++.so.6"],
        build_directory=str(build_dir),
        verbose=False,
    )
    sys.modules["deep_gemm._C"] = module
    sys.path.insert(0, str(src))
    import deep_gemm

    return deep_gemm


def run_deepgemm(dg: Any, d: dict[str, torch.Tensor], out: torch.Tensor) -> None:
    # SM90 takes float32 scales as they are (no UE8M0 packing); the recipe is read from their shapes.
    dg.fp8_gemm_nt((d["aq"], d["as"]), (d["wq"], d["ws"]), out, disable_ue8m0_cast=True)


def run_ours(d: dict[str, torch.Tensor], out: torch.Tensor, variant: int, unroll: int | None = None) -> None:
    """Our variant from the variants library, or from the one unrolled `unroll` times."""
    fp8_wgmma.fp8_gemm(
        d["aq"], d["as_col"], d["wq"], d["ws_col"], out=out, variant=variant, lib=variants.library(unroll)
    )


def self_check(dg: Any, dev: torch.device) -> list[dict[str, Any]]:
    rows = []
    for i, (m, n, k) in enumerate(CHECK_SHAPES):
        d = quantised(m, n, k, dev, seed=200 + i)
        want = ref.fp8_gemm_reference(d["aq"], d["as"], d["wq"], d["ws"], torch.float32)
        out = torch.full((m, n), float("nan"), device=dev, dtype=torch.bfloat16)
        run_deepgemm(dg, d, out)
        torch.cuda.synchronize()
        err = bench.rel(out, want)
        finite = bool(torch.isfinite(out).all())
        rows.append({"M": m, "N": n, "K": k, "rel_err": err, "all_written": finite,
                     "ok": finite and err < MAX_REL_ERR})  # fmt: skip
        print(rows[-1], flush=True)
    return rows


def check_ours(dev: torch.device) -> list[dict[str, Any]]:
    """Our timed variants, from the product's library and each --unrolls one, at each timed
    (N, K), a ragged and a full M, against the recipe's reference with a NaN-poisoned output."""
    rows = []
    for v, u in ((v, u) for v in OURS for u in [None, *UNROLLS]):
        for n, k in TIME_NK:
            for m in (1000, 4096):
                d = quantised(m, n, k, dev, seed=300 + m + n + k)
                want = ref.fp8_gemm_reference(d["aq"], d["as"], d["wq"], d["ws"], torch.float32)
                out = torch.full((m, n), float("nan"), device=dev, dtype=torch.bfloat16)
                run_ours(d, out, v, u)
                torch.cuda.synchronize()
                err = bench.rel(out, want)
                finite = bool(torch.isfinite(out).all())
                rows.append({"M": m, "N": n, "K": k, "variant": unrolled_key(v, u),
                             "rel_err": err, "all_written": finite, "ok": finite and err < MAX_REL_ERR})  # fmt: skip
                print(rows[-1], flush=True)
    return rows


def time_rows(dg: Any, dev: torch.device) -> list[dict[str, Any]]:
    rows = []
    for m in TIME_MS:
        for n, k in TIME_NK:
            d = quantised(m, n, k, dev, seed=m + n + k)
            out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
            t0 = time.perf_counter()
            run_deepgemm(dg, d, out)  # the JIT compile of this shape's kernel, outside the timing
            torch.cuda.synchronize()
            row: dict[str, Any] = {"M": m, "N": n, "K": k, "deepgemm_first_call_s": time.perf_counter() - t0}
            fns = {
                "bf16": lambda d=d: torch.nn.functional.linear(d["x"], d["w"]),
                "torch_blockwise": lambda d=d: ref.fp8_gemm(
                    d["aq"], d["as_col"], d["wq"], d["ws"], torch.bfloat16, backend="torch"
                ),
                "deepgemm": lambda d=d, o=out: run_deepgemm(dg, d, o),
            }
            for v in OURS:
                fns[ours_key(v)] = lambda d=d, o=out, v=v: run_ours(d, o, v)
            for v, u in ((v, u) for v in OURS for u in UNROLLS):
                fns[unrolled_key(v, u)] = lambda d=d, o=out, v=v, u=u: run_ours(d, o, v, u)
            bench_rounds(fns, row)
            add_tflops(row, 2 * m * n * k)
            row["deepgemm_vs_bf16"] = row["bf16_us"] / row["deepgemm_us"]
            row["deepgemm_vs_torch_blockwise"] = row["torch_blockwise_us"] / row["deepgemm_us"]
            row["torch_blockwise_vs_bf16"] = row["bf16_us"] / row["torch_blockwise_us"]
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--src", required=True, help="DeepGEMM source tree from deepgemm_bundle.sh")
    ap.add_argument("--out", required=True)
    ap.add_argument("--build-dir", default="/tmp/deepgemm_build")
    ap.add_argument("--ms", default="", help="comma-separated M values to time (default 4096,8192)")
    ap.add_argument(
        "--nk", default="", help="(N, K) shapes to time, NxK comma list (default the DeepSeek-V3 four)"
    )
    ap.add_argument(
        "--unrolls",
        default="",
        help=f"also our variants from libraries whose K loops are unrolled these many times (the product's: "
        f"{variants.K_UNROLL}); e.g. 1,8",
    )
    ap.add_argument("--skip-timing", action="store_true")
    ap.add_argument("--rounds", type=int, default=ROUNDS[0], help="timing rounds (wgmma.bench_rounds)")
    ap.add_argument(
        "--variants",
        default="",
        help="comma-separated indices into fp8_wgmma_variants.cu's table (default: the product's, 0)",
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="check and time one shape only (one JIT compile: a first reading in little device time): "
        "M,N,K = 4096,4096,7168, or the first of --ms and --nk",
    )
    args = ap.parse_args()
    if args.ms:
        TIME_MS[:] = [int(m) for m in args.ms.split(",")]
    if args.nk:
        TIME_NK[:] = parse_nk(args.nk)
    if args.variants:
        OURS[:] = [int(v) for v in args.variants.split(",")]
    if args.unrolls:
        UNROLLS[:] = [int(u) for u in args.unrolls.split(",")]
    ROUNDS[0] = args.rounds
    if args.quick:
        m = TIME_MS[0] if args.ms else 4096
        n, k = TIME_NK[0] if args.nk else (4096, 7168)
        CHECK_SHAPES[:] = [(m, n, k)]
        TIME_MS[:] = [m]
        TIME_NK[:] = [(n, k)]
    dev = torch.device("cuda")
    src = Path(args.src).resolve()
    # A segfault before anything prints (the libstdc++ facet mismatch import_deepgemm's link
    # flags avoid) still says where it happened.
    faulthandler.enable()
    variants.build()
    for u in UNROLLS:
        variants.build(unroll=u)
    print("building DeepGEMM's C++ module", flush=True)
    t0 = time.perf_counter()
    dg = import_deepgemm(src, Path(args.build_dir))
    print(f"imported deep_gemm in {time.perf_counter() - t0:.0f} s; first calls JIT-compile", flush=True)
    result: dict[str, Any] = {
        "command": " ".join([sys.executable, *sys.argv]),
        "date": datetime.now(UTC).isoformat(),
        "machine": torch.cuda.get_device_name(),
        "baseline": "bf16 cuBLAS (F.linear), torch block-wise scaled_mm (cuBLAS) and relay's CUDA kernel "
        "(relay_wgmma: the product's configuration; relay_wgmma_v<i>: fp8_wgmma_variants.cu's i), same process, taking "
        "turns with DeepGEMM and ours (wgmma.bench_rounds: median of --rounds)",
        "default_variant": variants.DEFAULT,
        "variants": {v: variants.VARIANTS[v].name for v in OURS},
        "k_unroll": variants.K_UNROLL,
        "unrolls": UNROLLS,
        "serialised_by_ptxas": {
            u: fp8_wgmma.serialised(variants.library_path(u)) for u in [variants.K_UNROLL, *UNROLLS]
        },
        "deepgemm_version": getattr(dg, "__version__", "unknown"),
        "deepgemm_source": (src / "SOURCE").read_text().strip() if (src / "SOURCE").exists() else "unknown",
        "build_s": time.perf_counter() - t0,
    }
    result["check"] = self_check(dg, dev) + check_ours(dev)
    result["check_ok"] = all(r["ok"] for r in result["check"])
    write_result(args.out, result)
    if result["check_ok"] and not args.skip_timing:
        result["rows"] = time_rows(dg, dev)
        write_result(args.out, result)
    print("check_ok", result["check_ok"])
    for r in result.get("rows", []):
        ours = "".join(
            f"  relay v{v} {r[k]:5.0f} ({r[k] / r['bf16_tflops']:.2f}x)"
            for v in OURS
            for k in [f"{ours_key(v)}_tflops"]
        ) + "".join(
            f"  v{v} unrolled {u}x {r[k]:5.0f} ({r[k] / r['bf16_tflops']:.2f}x)"
            for v in OURS
            for u in UNROLLS
            for k in [f"{unrolled_key(v, u)}_tflops"]
        )
        print(
            f"M={r['M']:5d} N={r['N']:5d} K={r['K']:5d} bf16 {r['bf16_tflops']:5.0f}  cublas-bw "
            f"{r['torch_blockwise_tflops']:5.0f} ({r['torch_blockwise_vs_bf16']:.2f}x)  deepgemm "
            f"{r['deepgemm_tflops']:5.0f} ({r['deepgemm_vs_bf16']:.2f}x bf16){ours}"
        )


if __name__ == "__main__":
    main()
