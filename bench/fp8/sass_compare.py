"""Static instruction counts of the FP8 GEMM kernels' K loops, ours (`fp8_wgmma.cuh` in the
configurations of bench/kernels/fp8_wgmma_variants.cu) against
DeepGEMM's, read from their SASS on this machine: nvcc and cuobjdump, no GPU.

Why: device time is scarce, and the largest measured gain of the kernel came from reading the two
kernels' SASS side by side (DeepGEMM's compiles here from the bundle of deepgemm_bundle.sh): ours spent about
twice DeepGEMM's non-FMA instructions per K block. This makes that comparison one command, so a
kernel change can be judged by its SASS before it spends a device call.

What it reports per kernel: the innermost loop that issues wgmmas (QGMMA; the K loop), its
instructions per wgmma, those that are not FFMA per wgmma, and an opcode histogram of the loop.
DeepGEMM unrolls its K loop 8x and ours 4x (the header's K_UNROLL), so per-wgmma figures are the
comparable ones.

    python3 bench/fp8/sass_compare.py --variants 0,2 --deepgemm .deepgemm/src.tar.gz
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from ncu_summary import opcode  # noqa: E402

from bench.kernels import fp8_wgmma_variants as variants  # noqa: E402
from ops.fp8.cuda import nvcc  # noqa: E402

# DeepGEMM's SM90 1D2D kernel as its heuristic configures it for M, N, K = 4096, 4096, 7168 on 132
# SMs (its DG_PRINT_CONFIGS output): 256 x 128 tiles, 3 stages, 2-CTA clusters sharing A. The
# template arguments of sm90_fp8_gemm_1d2d_impl, in its order.
DEEPGEMM_ARGS = (
    "cute::UMMA::Major::K, 0, 4096, 7168, 1, 256, 128, 128, 128, 128, 128, 3, 128, 256, 2, true, 132, "
    "GemmType::Normal, cutlass::bfloat16_t, epilogue::transform::EpilogueIdentity"
)
DEEPGEMM_FLAGS = (
    "-std=c++20",
    "--expt-relaxed-constexpr",
    "--expt-extended-lambda",
    "-O3",
    "--diag-suppress=39,161,174,177,186,940",
    "--ptxas-options=--register-usage-level=10",
    "-gencode=arch=compute_90a,code=sm_90a",
)
OURS_FLAGS = ("-gencode=arch=compute_90a,code=sm_90a", "-O3", "-std=c++17")

_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_BRANCH = re.compile(r"\bBRA\s+(?:`?\(?)0x([0-9a-f]+)")


@dataclass(frozen=True)
class Instr:
    addr: int
    text: str

    @property
    def opcode(self) -> str:
        return opcode(self.text)


@dataclass(frozen=True)
class LoopStats:
    instructions: int
    wgmmas: int
    ffmas: int
    opcodes: dict[str, int]

    @property
    def per_wgmma(self) -> float:
        return self.instructions / self.wgmmas

    @property
    def non_ffma_per_wgmma(self) -> float:
        return (self.instructions - self.ffmas) / self.wgmmas


def kernel_symbol_part(variant: int) -> str:
    """The mangled template arguments that name a variant's kernel in the cubin."""
    v = variants.VARIANTS[variant]
    return f"fp8_gemm_kernelILi{v.bn}ELi{v.stages}ELi{v.mode}ELi{v.cluster}EE"


def cuobjdump_path() -> str:
    """cuobjdump from the CUDA toolkit (nvcc.cuda_tool), else the copy bundled with Triton."""
    found = nvcc.cuda_tool("cuobjdump")
    if found:
        return found
    try:
        import triton

        bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        if bundled.exists():
            return str(bundled)
    except ImportError:
        pass
    raise nvcc.BuildError("cuobjdump not found (PATH, $CUDA_HOME/bin, Triton's bundle)")


def compile_cubin(source: Path, out: Path, flags: tuple[str, ...], includes: tuple[Path, ...] = ()) -> Path:
    compiler = nvcc.nvcc_path()
    if compiler is None:
        raise nvcc.BuildError("nvcc not found (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin)")
    cmd = [compiler, *flags, *(f"-I{p}" for p in includes), "-cubin", "-o", str(out), str(source)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise nvcc.BuildError(f"nvcc failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return out


def sass_functions(dump: str) -> dict[str, list[Instr]]:
    """cuobjdump -sass text -> {function name: its instructions in address order}."""
    functions: dict[str, list[Instr]] = {}
    current: list[Instr] | None = None
    for line in dump.splitlines():
        if "Function :" in line:
            current = functions.setdefault(line.split("Function :", 1)[1].strip(), [])
            continue
        match = _INSTR.search(line)
        if match and current is not None:
            current.append(Instr(int(match.group(1), 16), match.group(2).strip()))
    return functions


def k_loop(instrs: list[Instr]) -> LoopStats:
    """The smallest loop (a conditional backward branch and the instructions from its target to it)
    that issues wgmmas: the K loop. Only conditional branches count: the out-of-line retry stubs
    of mbarrier waits, placed after the function's end, return into the loop unconditionally, and
    their spans from there would look like loops."""
    best: list[Instr] | None = None
    for i, ins in enumerate(instrs):
        branch = _BRANCH.search(ins.text)
        if not branch or not ins.text.startswith("@") or int(branch.group(1), 16) >= ins.addr:
            continue
        target = int(branch.group(1), 16)
        body = [x for x in instrs[: i + 1] if x.addr >= target]
        if any(x.opcode == "QGMMA" for x in body) and (best is None or len(body) < len(best)):
            best = body
    if best is None:
        raise ValueError("no loop issues a wgmma")
    ops = collections.Counter(x.opcode for x in best)
    return LoopStats(len(best), ops["QGMMA"], ops["FFMA"], dict(ops.most_common()))


def ours(indices: list[int], work: Path) -> dict[str, LoopStats]:
    # The kernel's headers sit beside nvcc.py (ops/fp8/cuda), as nvcc.build includes them.
    cubin = compile_cubin(variants.SOURCE, work / "ours.cubin", OURS_FLAGS, (Path(nvcc.__file__).parent,))
    functions = sass_functions(dump_sass(cubin))
    stats = {}
    for v in indices:
        part = kernel_symbol_part(v)
        names = [n for n in functions if part in n]
        if len(names) != 1:
            raise ValueError(f"variant {v}: {len(names)} functions match {part}")
        stats[f"ours v{v}"] = k_loop(functions[names[0]])
    return stats


def deepgemm(tarball: Path, work: Path) -> dict[str, LoopStats]:
    src = work / "deepgemm"
    with tarfile.open(tarball) as tar:
        tar.extractall(src, filter="data")
    inst = work / "deepgemm_inst.cu"
    inst.write_text(
        "#include <deep_gemm/impls/sm90_fp8_gemm_1d2d.cuh>\nusing namespace deep_gemm;\n"
        "static void instantiate() {\n"
        f"  auto ptr = reinterpret_cast<void*>(&sm90_fp8_gemm_1d2d_impl<{DEEPGEMM_ARGS}>);\n  (void)ptr;\n}}\n"
    )
    includes = (src / "deep_gemm" / "include", src / "third-party" / "cutlass" / "include")
    cubin = compile_cubin(inst, work / "deepgemm.cubin", DEEPGEMM_FLAGS, includes)
    functions = sass_functions(dump_sass(cubin))
    name = next(n for n in functions if "sm90_fp8_gemm_1d2d_impl" in n)
    return {"deepgemm": k_loop(functions[name])}


def dump_sass(cubin: Path) -> str:
    proc = subprocess.run([cuobjdump_path(), "-sass", str(cubin)], capture_output=True, text=True, check=True)
    return proc.stdout


def report(stats: dict[str, LoopStats], top: int) -> str:
    names = list(stats)
    lines = [
        f"{'K loop':28s}" + "".join(f"{n:>14s}" for n in names),
        f"{'instructions':28s}" + "".join(f"{s.instructions:14d}" for s in stats.values()),
        f"{'wgmmas (QGMMA)':28s}" + "".join(f"{s.wgmmas:14d}" for s in stats.values()),
        f"{'instructions per wgmma':28s}" + "".join(f"{s.per_wgmma:14.1f}" for s in stats.values()),
        f"{'non-FFMA per wgmma':28s}" + "".join(f"{s.non_ffma_per_wgmma:14.1f}" for s in stats.values()),
        "opcodes per wgmma:",
    ]
    ops = collections.Counter()
    for s in stats.values():
        ops.update({op: n / s.wgmmas for op, n in s.opcodes.items()})
    for op, _ in ops.most_common(top):
        lines.append(
            f"  {op:26s}" + "".join(f"{s.opcodes.get(op, 0) / s.wgmmas:14.2f}" for s in stats.values())
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--variants",
        default=str(variants.DEFAULT),
        help="indices into bench/kernels/fp8_wgmma_variants.cu's table",
    )
    ap.add_argument("--deepgemm", type=Path, help="the tarball of deepgemm_bundle.sh (.deepgemm/src.tar.gz)")
    ap.add_argument("--top", type=int, default=16, help="opcodes to list")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        stats = ours([int(v) for v in args.variants.split(",")], Path(tmp))
        if args.deepgemm:
            stats.update(deepgemm(args.deepgemm, Path(tmp)))
    print(report(stats, args.top))


if __name__ == "__main__":
    main()
