"""The weights directory: RUN_DIR/weights/step_<N>/ is an HF model directory, and this module is
the only code that writes or reads its layout.

    config.json                        HF config (services/common/modeldir.hf_config)
    model.safetensors                  one file, or several:
    model-00001-of-0000W.safetensors   HF sharded safetensors (HF parameter names), and
    model.safetensors.index.json       {"metadata": {"total_size": B}, "weight_map": {name: file}}
    tokenizer.json, tokenizer_config.json
    relay.json                         {"version": N, "step": N, "created": ...}

Writing (`DirWrite`): every writer puts its file into `.step_<N>.tmp-<token>` under a partial
name, fsyncs it and renames it to its final name; one writer (rank 0 of the trainer, or the only
one) waits until every file is there, adds the index, config, tokenizer and relay.json, fsyncs,
and renames the directory into place. A reader never sees a half-written version, and any
HF-compatible tool loads one.

Reading (`WeightsReader`): the index (or the files' headers) says where each tensor's bytes are;
tensors come back as zero-copy views of a private memory map, whole or sliced
(services/common/weights_slice.py), so a reader touches only the bytes it copies.

Retention (`retain`): what `run.keep_weights` keeps and what it deletes.
"""

from __future__ import annotations

import json
import mmap
import os
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
META_FILE = "relay.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
STEP_RE = re.compile(r"^step_(\d+)$")
# `.step_<N>.tmp-<token>`: a version being written (or left by a writer that died).
TEMP_RE = re.compile(r"^\.step_(\d+)\.tmp-")
PARTIAL = ".partial"
# HF's FP8 checkpoints: X.weight (E4M3) comes with X.weight_scale_inv, one scale per weight tile.
SCALE_SUFFIX = "_scale_inv"
FAILED = ".failed-"

DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
DTYPES = {v: k for k, v in DTYPE_NAMES.items()}


# ---------------------------------------------------------------------------- layout


def weights_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "weights"


def step_dir(run_dir: str | Path, version: int) -> Path:
    return weights_root(run_dir) / f"step_{version}"


def shard_name(index: int, count: int) -> str:
    """HF's names: one file is model.safetensors, several are model-0000i-of-0000n.safetensors."""
    return WEIGHTS_FILE if count == 1 else f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def temp_dir(dest: Path, token: str) -> Path:
    return dest.parent / f".{dest.name}.tmp-{token}"


def versions(run_dir: str | Path) -> list[int]:
    """The complete versions under RUN_DIR/weights (renamed into place), ascending."""
    root = weights_root(run_dir)
    if not root.is_dir():
        return []
    return sorted(int(m[1]) for p in root.iterdir() if (m := STEP_RE.match(p.name)) and p.is_dir())


def newest_version(run_dir: str | Path) -> int:
    """The highest N of a complete `weights/step_N`, -1 if none."""
    return max(versions(run_dir), default=-1)


def read_meta(path: str | Path) -> dict[str, Any]:
    p = Path(path) / META_FILE
    return json.loads(p.read_text()) if p.exists() else {}


# ---------------------------------------------------------------------------- safetensors files


def tensor_nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def write_safetensors(path: Path, tensors: Mapping[str, torch.Tensor], metadata: dict[str, str]) -> int:
    """Stream CPU tensors into a safetensors file and fsync it; returns the bytes written.
    Tensors are laid out widest dtype first so every one starts aligned to its element size (the
    reader's views are then zero-copy); file.write releases the GIL for each tensor's copy into
    the kernel, with no bytes() copy of it (safetensors' save_file would hold the GIL meanwhile)."""
    order = sorted(tensors, key=lambda k: -tensors[k].element_size())  # stable: given order within a width
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name in order:
        t = tensors[name]
        if t.dtype not in DTYPE_NAMES:
            raise ValueError(f"{name}: dtype {t.dtype} has no safetensors name")
        n = tensor_nbytes(t)
        header[name] = {
            "dtype": DTYPE_NAMES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + n],
        }
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format wants the data 8-byte aligned
    with open(path, "wb") as fh:
        fh.write(len(raw).to_bytes(8, "little"))
        fh.write(raw)
        for name in order:
            t = tensors[name]
            if t.numel():
                fh.write(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data)
        fh.flush()
        os.fsync(fh.fileno())
    return 8 + len(raw) + offset


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


# ---------------------------------------------------------------------------- writing


@dataclass
class DirWrite:
    """One version's directory being written by `files` writers (trainer ranks) into one temporary
    directory. Each writer calls `write_file(i, tensors)` for its file i; the finishing writer then
    calls `finish(...)`, which waits for every file. Sharing `token` (rank 0's choice) puts every
    writer in the same temporary directory; a failed version is `abandon`ed (its directory removed)."""

    dest: Path
    token: str
    files: int

    @property
    def tmp(self) -> Path:
        return temp_dir(self.dest, self.token)

    def write_file(self, index: int, tensors: Mapping[str, torch.Tensor]) -> int:
        """Write file `index` (bytes returned). A writer that fails leaves a marker, so the finishing
        writer stops waiting at once and names it."""
        self.tmp.mkdir(parents=True, exist_ok=True)
        final = self.tmp / shard_name(index, self.files)
        partial = final.with_name(final.name + PARTIAL)
        try:
            n = write_safetensors(partial, tensors, {"format": "pt"})
            os.rename(partial, final)
        except BaseException as e:
            try:
                _write_file(self.tmp / f"{FAILED}{index}", f"{type(e).__name__}: {e}".encode())
            except OSError:
                pass  # the disk that failed the write may refuse the marker too: finish() times out
            raise
        return n

    def finish(
        self,
        config: dict[str, Any],
        files: Mapping[str, bytes],
        meta: dict[str, Any],
        timeout_s: float = 600.0,
        poll_s: float = 0.01,
    ) -> Path:
        """Wait for every writer's file, write the index (several files: built from their
        headers), config.json, the extra `files` (tokenizer) and relay.json, fsync, and rename the
        directory into place."""
        self.tmp.mkdir(parents=True, exist_ok=True)
        names = [shard_name(i, self.files) for i in range(self.files)]
        deadline = time.monotonic() + timeout_s
        while True:
            present = {p.name for p in self.tmp.iterdir()}
            failed = sorted(n for n in present if n.startswith(FAILED))
            if failed:
                why = (self.tmp / failed[0]).read_text()
                raise RuntimeError(
                    f"{self.dest.name}: writer of file {failed[0][len(FAILED) :]} failed: {why}"
                )
            missing = [n for n in names if n not in present]
            if not missing:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{self.dest.name}: files {missing[:3]} not written within {timeout_s:.0f} s"
                )
            time.sleep(poll_s)
        if self.files > 1:
            weight_map: dict[str, str] = {}
            total = 0
            for n in names:
                for k, e in read_header(self.tmp / n).items():
                    if k in weight_map:
                        raise ValueError(f"{self.dest.name}: {k} written to both {weight_map[k]} and {n}")
                    weight_map[k] = n
                    total += e.nbytes
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            _write_file(self.tmp / INDEX_FILE, json.dumps(index, indent=2).encode())
        _write_file(self.tmp / "config.json", json.dumps(config, indent=2).encode())
        for name, data in files.items():
            _write_file(self.tmp / name, data)
        # Last: a directory holding relay.json is complete (kept through the rename).
        _write_file(self.tmp / META_FILE, json.dumps({**meta, "created": time.time()}, indent=2).encode())
        _fsync_dir(self.tmp)
        if self.dest.exists():
            shutil.rmtree(self.dest)
        os.rename(self.tmp, self.dest)
        _fsync_dir(self.dest.parent)
        return self.dest

    def abandon(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


def tokenizer_files(src: Path | None) -> dict[str, bytes]:
    """The tokenizer files of a model directory (or of a directory save_tokenizer wrote)."""
    if src is None:
        return {}
    return {n: (src / n).read_bytes() for n in TOKENIZER_FILES if (src / n).exists()}


def write_model_dir(
    dest: Path,
    hf_state: Mapping[str, torch.Tensor],
    config: dict[str, Any],
    tokenizer_src: Path | None,
    meta: dict[str, Any],
) -> Path:
    """A complete model directory from one process: one file, the sharded writers' protocol."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    w = DirWrite(dest, str(os.getpid()), 1)
    w.abandon()  # a directory left by this pid's earlier attempt
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in hf_state.items()}
    w.write_file(0, tensors)
    return w.finish(config, tokenizer_files(tokenizer_src), meta)


def remove_temp_dirs(run_dir: str | Path, keep: Callable[[Path], bool] = lambda _p: False) -> list[Path]:
    """Remove `.step_<N>.tmp-*` directories (writes a dead process left) except those `keep`s."""
    root = weights_root(run_dir)
    gone = []
    if root.is_dir():
        for p in root.iterdir():
            if TEMP_RE.match(p.name) and p.is_dir() and not keep(p):
                shutil.rmtree(p, ignore_errors=True)
                gone.append(p)
    return gone


# ---------------------------------------------------------------------------- reading


@dataclass(frozen=True)
class TensorEntry:
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    nbytes: int


def read_header(path: Path) -> dict[str, TensorEntry]:
    """A safetensors file's tensors (names, dtypes, shapes, byte ranges), checked against its size."""
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) != 8:
            raise ValueError(f"{path.name}: not a safetensors file (shorter than 8 bytes)")
        n = int.from_bytes(head, "little")
        if n > size - 8:
            raise ValueError(f"{path.name}: header length {n} past the end of the file ({size} bytes)")
        header = json.loads(fh.read(n))
    base = 8 + n
    out: dict[str, TensorEntry] = {}
    for name, h in header.items():
        if name == "__metadata__":
            continue
        dtype = DTYPES.get(h["dtype"])
        if dtype is None:
            raise ValueError(f"{path.name}: {name}: unsupported dtype {h['dtype']}")
        shape = tuple(int(s) for s in h["shape"])
        begin, end = (int(x) for x in h["data_offsets"])
        numel = 1
        for s in shape:
            numel *= s
        if end - begin != numel * dtype.itemsize or base + end > size or begin < 0:
            raise ValueError(
                f"{path.name}: {name}: byte range {begin}..{end} does not fit {h['dtype']} {shape}"
            )
        out[name] = TensorEntry(path, dtype, shape, base + begin, end - begin)
    return out


@dataclass
class WeightsReader:
    """The tensors of one model directory: where each lives (the index, or every *.safetensors
    file's header), handed out as zero-copy views of private (copy-on-write) memory maps, so a
    caller may modify what it gets without touching the file. `bytes_mapped` counts the bytes of
    every view handed out: what a caller that copies them reads."""

    path: Path
    entries: dict[str, TensorEntry] = field(default_factory=dict)
    bytes_mapped: int = 0
    _maps: dict[Path, mmap.mmap] = field(default_factory=dict)
    _spans: dict[Path, list[tuple[int, int]]] = field(default_factory=dict)  # byte ranges handed out

    @classmethod
    def open(cls, path: str | Path) -> WeightsReader:
        p = Path(path)
        index = p / INDEX_FILE
        if index.is_file():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            files = sorted({p / f for f in weight_map.values()})
        else:
            weight_map = {}
            files = sorted(p.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{p} holds no *.safetensors")
        entries: dict[str, TensorEntry] = {}
        for f in files:
            for name, e in read_header(f).items():
                if weight_map and weight_map.get(name) != f.name:
                    if name in weight_map:
                        raise ValueError(f"{name}: in {f.name}, the index says {weight_map[name]}")
                    raise ValueError(f"{name}: in {f.name} but not in {INDEX_FILE}")
                if name in entries:
                    raise ValueError(f"{name}: in both {entries[name].file.name} and {f.name}")
                entries[name] = e
        missing = sorted(set(weight_map) - set(entries))
        if missing:
            raise ValueError(f"{INDEX_FILE} names tensors no file holds: {missing[:3]}")
        return cls(p, entries)

    def keys(self) -> list[str]:
        return list(self.entries)

    def _map(self, f: Path) -> mmap.mmap:
        m = self._maps.get(f)
        if m is None:
            with open(f, "rb") as fh:
                m = self._maps[f] = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
        return m

    def tensor(self, name: str, rows: tuple[int, int] | None = None, dim: int = 0) -> torch.Tensor:
        """`name`, or its slice [start, stop) along `dim`, as a CPU view of the file's bytes (a
        copy only when the file does not align it)."""
        e = self.entries[name]
        if e.nbytes == 0:
            return torch.empty(e.shape, dtype=e.dtype)
        flat = torch.frombuffer(self._map(e.file), dtype=torch.uint8, count=e.nbytes, offset=e.start)
        if e.start % e.dtype.itemsize:
            flat = flat.clone()
        t = flat.view(e.dtype).view(e.shape)
        begin, end = e.start, e.start + e.nbytes
        if rows is not None:
            t = t.narrow(dim, rows[0], rows[1] - rows[0])
            if dim == 0 and t.numel():  # contiguous rows: only their bytes
                row = e.nbytes // max(1, e.shape[0])
                begin, end = e.start + rows[0] * row, e.start + rows[1] * row
        self.bytes_mapped += tensor_nbytes(t)
        self._spans.setdefault(e.file, []).append((begin, end))
        return t

    def prefetch(self, chunk: int = 16 << 20, threads: int = 8) -> int:
        """Read every byte range handed out so far once, into the page cache, from several threads
        (from a loading thread: the later copies out of the maps then run at memory speed, not
        the disk's or the shared filesystem's). Returns the bytes read."""
        jobs: list[tuple[Path, int, int]] = []
        for f, spans in self._spans.items():
            merged: list[list[int]] = []
            for b, e in sorted(spans):
                if merged and b <= merged[-1][1]:
                    merged[-1][1] = max(merged[-1][1], e)
                else:
                    merged.append([b, e])
            jobs += [(f, off, min(chunk, e - off)) for b, e in merged for off in range(b, e, chunk)]
        fds = {f: os.open(f, os.O_RDONLY) for f in self._spans}
        local = threading.local()

        def read(job: tuple[Path, int, int]) -> int:
            f, off, n = job
            buf = getattr(local, "buf", None)
            if buf is None:
                buf = local.buf = memoryview(bytearray(chunk))
            return os.preadv(fds[f], [buf[:n]], off)  # releases the GIL

        try:
            with ThreadPoolExecutor(threads) as pool:
                return sum(pool.map(read, jobs))
        finally:
            for fd in fds.values():
                os.close(fd)

    def state(self, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
        return {k: self.tensor(k) for k in (self.entries if names is None else names)}


def read_model_dir(path: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config.json, HF state dict): every tensor of the directory as a memory-mapped view."""
    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    return config, WeightsReader.open(path).state()


# ---------------------------------------------------------------------------- retention


def kept_versions(all_versions: Iterable[int], last: int, every: int, protected: Iterable[int]) -> set[int]:
    """What `run.keep_weights` keeps of `all_versions`: the newest `last`, every multiple of
    `every` (0: none; the initial weights, version 0, among them), and every `protected` one
    (served, or needed by a restart)."""
    vs = sorted(set(all_versions))
    keep = set(vs[-last:]) if last > 0 else set()
    if every > 0:
        keep |= {v for v in vs if v % every == 0}
    return keep | (set(protected) & set(vs))


def retain(run_dir: str | Path, last: int, every: int, protected: Iterable[int]) -> list[int]:
    """Delete the complete versions `kept_versions` does not keep; returns them. A directory is
    renamed out of the way first, so no reader finds a half-deleted version under its name."""
    have = versions(run_dir)
    keep = kept_versions(have, last, every, protected)
    gone = []
    for v in have:
        if v in keep:
            continue
        d = step_dir(run_dir, v)
        trash = temp_dir(d, f"deleted-{os.getpid()}")
        try:
            os.rename(d, trash)
        except OSError:
            continue  # gone already (another process), or not ours to delete
        shutil.rmtree(trash, ignore_errors=True)
        gone.append(v)
    return gone
