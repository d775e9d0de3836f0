"""Build a CUDA C++ source into a shared library with nvcc, cached by content.

The CUDA kernels (the FP8 GEMM fp8_wgmma.cu, and benchmark kernels built on its headers) need no torch headers, so one nvcc call of a few seconds builds each (a torch extension build takes a
minute), and they are loaded through ctypes. Sources include this directory's headers by name (it is
on the include path). Libraries are cached under $RELAY_KERNEL_CACHE (default
~/.cache/relay/kernels), keyed by the hash of the source, these headers and the flags.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

HEADERS = sorted(Path(__file__).parent.glob("*.cuh"))
SM90A_FLAGS = (
    "-gencode=arch=compute_90a,code=sm_90a",
    "-O3",
    "-std=c++17",
    "-shared",
    "-Xcompiler",
    "-fPIC",
)


class BuildError(RuntimeError):
    """nvcc is missing or failed."""


def cuda_tool(name: str) -> str | None:
    """A CUDA toolkit program from PATH, else $CUDA_HOME/bin, else the usual install prefix."""
    found = shutil.which(name)
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if root and (Path(root) / "bin" / name).exists():
            return str(Path(root) / "bin" / name)
    return None


def nvcc_path() -> str | None:
    return cuda_tool("nvcc")


def cache_dir() -> Path:
    return Path(os.environ.get("RELAY_KERNEL_CACHE", Path.home() / ".cache" / "relay" / "kernels"))


def library_path(source: Path, stem: str, flags: tuple[str, ...] = SM90A_FLAGS) -> Path:
    h = hashlib.sha256(source.read_bytes())
    for header in HEADERS:
        h.update(header.read_bytes())
    h.update(" ".join(flags).encode())
    return cache_dir() / f"{stem}_{h.hexdigest()[:16]}.so"


def log_path(library: Path) -> Path:
    """Where `build` keeps what nvcc printed for `library` (ptxas's performance warnings)."""
    return library.with_suffix(".log")


def build(source: Path, out: Path, flags: tuple[str, ...] = SM90A_FLAGS) -> Path:
    """Compile `source` to `out`; returns it. What nvcc printed is kept in `log_path(out)`, written
    before the library appears. Atomic: the file is renamed into place, so concurrent builders
    never load a half-written library."""
    nvcc = nvcc_path()
    if nvcc is None:
        raise BuildError("nvcc not found (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin)")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        target = Path(tmp) / out.name
        proc = subprocess.run(
            [nvcc, *flags, "-I", str(Path(__file__).parent), "-o", str(target), str(source)],
            capture_output=True,
            text=True,
            check=False,
        )
        if proc.returncode != 0:
            raise BuildError(f"nvcc failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
        log = Path(tmp) / log_path(out).name
        log.write_text(proc.stdout + proc.stderr)
        os.replace(log, log_path(out))
        os.replace(target, out)
    return out
