"""Shared pieces of the KV benchmarks: random-weight model directories (no torchtitan or transformers
needed, so they run on the GPU machine as is), the real Redis + KV store gateway (+ prefill service)
processes, and result files with command, machine and date."""

from __future__ import annotations

import argparse
import gc
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from bench import results
from services.common.auth import standalone_secrets
from services.common.bus import Bus
from services.common.config import REPO_ROOT, EngineConfig, ModelConfig, RunConfig
from services.common.modeldir import hf_config
from services.common.redis_server import RedisServer
from services.common.schemas import WeightsInfo
from services.common.weights_dir import write_model_dir
from services.engine.models.causal_lm import CausalLM

# "tiny": a CPU-sized Qwen3-style model with a long context. "qwen3-0.6b-shape": Qwen3-0.6B's shapes
# (28 layers, 16 q / 8 kv heads of 128, KV 112 KiB per token in bf16), random weights.
SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(
        vocab_size=1024,
        dim=128,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        head_dim=32,
        hidden_dim=384,
        max_seq_len=40960,
    ),
    "qwen3-0.6b-shape": dict(
        vocab_size=151936,
        dim=1024,
        n_layers=28,
        n_heads=16,
        n_kv_heads=8,
        head_dim=128,
        hidden_dim=3072,
        max_seq_len=40960,
        rope_theta=1_000_000.0,
    ),
}


def model_config(shape: str) -> ModelConfig:
    return ModelConfig(arch="qwen3", tie_embeddings=True, qk_norm=True, **SHAPES[shape])


def make_model_dir(shape: str | ModelConfig, dest: Path, seed: int = 0) -> Path:
    """An HF model directory (version 0) of random weights: normal(0, 0.02) matrices, unit norms.
    `shape`: a name of SHAPES or a ModelConfig."""
    if (dest / "config.json").exists():
        return dest
    m = model_config(shape) if isinstance(shape, str) else shape
    torch.manual_seed(seed)
    with torch.device("cpu"):
        model = CausalLM(m, m.max_seq_len)
    state = {}
    for name, p in model.named_parameters():
        state[name] = torch.ones_like(p) if p.dim() == 1 else torch.randn_like(p) * 0.02
    return write_model_dir(dest, state, hf_config(m, eos_token_id=m.vocab_size - 1), None, {"version": 0})


def pythonpath() -> str:
    """The repo first, then whatever the caller had (e.g. wheels unpacked into /tmp/site)."""
    return os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))


def engine_config(device: str, dtype: str, max_seq_len: int, **kw: Any) -> EngineConfig:
    return EngineConfig(device=device, dtype=dtype, max_seq_len=max_seq_len, **kw)  # type: ignore[arg-type]


def machine() -> dict[str, Any]:
    out: dict[str, Any] = {
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(0)
        out["gpus"] = torch.cuda.device_count()
    return out


def command() -> str:
    """How this benchmark was run, as one would type it (`python -m bench.kv.x ...`)."""
    script = Path(sys.argv[0]).resolve()
    if script.suffix == ".py" and script.is_relative_to(REPO_ROOT):
        module = ".".join(script.relative_to(REPO_ROOT).with_suffix("").parts)
        return " ".join(["python", "-m", module, *sys.argv[1:]])
    return " ".join(["python", *sys.argv])


def write_result(path: Path, result: dict[str, Any], quiet: bool = False) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    full = {
        "command": command(),
        "machine": machine(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        **result,
    }
    # Written under a temporary name, then renamed: a run killed mid-write leaves the last file.
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(results.dumps(full))
    tmp.replace(path)
    if not quiet:
        print(f"wrote {path}")


@dataclass
class Services:
    """Real Redis + KV store gateway (+ prefill services) processes for one benchmark."""

    workdir: Path
    cfg: RunConfig
    redis: RedisServer
    bus: Bus
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def start(self, name: str, module: str, env: dict[str, str] | None = None) -> None:
        path = self.workdir / "config.json"
        with open(self.workdir / f"{name}.log", "ab") as out:
            self.procs[name] = subprocess.Popen(
                [sys.executable, "-m", module, "--config", str(path), "--redis-url", self.redis.url],
                cwd=REPO_ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONPATH": pythonpath(), **(env or {})},
            )

    def url(self, kind: str, name: str, timeout_s: float = 600.0) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            proc = self.procs[name]
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited: {(self.workdir / f'{name}.log').read_text()[-3000:]}")
            for s in self.bus.services(kind):
                if s.pid == proc.pid and s.version >= 0:
                    return s.url
            time.sleep(0.2)
        raise TimeoutError(f"{name} not ready")

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        self.redis.stop()


@contextmanager
def services(workdir: Path, cfg: RunConfig, weights: Path | None = None) -> Any:
    """Redis, then the gateway; the caller starts prefill services with `start` if it needs them."""
    workdir.mkdir(parents=True, exist_ok=True)
    standalone_secrets()  # the services it starts and its clients (KVStoreClient, Bus) read them
    redis = RedisServer(workdir / "redis").start()
    cfg = cfg.model_copy(deep=True)
    cfg.redis.prefix = f"bench-kv-{uuid.uuid4().hex[:8]}"
    cfg.redis.url = redis.url
    cfg.kvstore.enabled = True
    (workdir / "config.json").write_text(cfg.dump())
    svc = Services(workdir, cfg, redis, Bus(redis.url, cfg.redis.prefix))
    if weights is not None:
        svc.bus.publish_weights(WeightsInfo(version=0, path=str(weights)))
    try:
        svc.start("kvstore", "services.kvstore")
        svc.url("kvstore", "kvstore")
        yield svc
    finally:
        svc.stop()


# ---------------------------------------------------------------------- shared by the scripts


def add_common_args(p: argparse.ArgumentParser, out: str) -> None:
    """The flags every KV benchmark takes (device, model shape, dtype, page size, seed, paths)."""
    p.add_argument("--device", default="cpu")
    p.add_argument("--model", default="tiny", help=" | ".join(SHAPES))
    p.add_argument("--dtype", default="float32")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", default="", help="default: a fresh temporary directory")
    p.add_argument("--out", default=out)


def prepare(args: argparse.Namespace) -> tuple[Path, Path]:
    """(work directory, model directory) for a run: random weights of --model, made once per workdir."""
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-kv-"))
    return work, make_model_dir(args.model, work / f"model-{args.model}")


def synchronize(device: str) -> None:
    """Wait for the device, so host timers measure the work and not its launch."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def synchronize_stream(device: str) -> None:
    """Wait for the current (the engine loop's) stream only. A serving loop never waits for its
    device's other streams (page imports and handoff copies run on side streams, joined by events
    only where a step needs their pages); a device-wide synchronize after every step would charge
    their transfer time to the decoding streams' inter-token latency."""
    if device.startswith("cuda"):
        torch.cuda.current_stream().synchronize()


class ResultWriter:
    """Writes the result file after every update (`partial: true` until `done`), so a run killed
    by its time limit still leaves what it measured."""

    def __init__(self, path: Path, benchmark: str, args: argparse.Namespace):
        self.path, self.benchmark, self.params = path, benchmark, vars(args)

    def write(self, body: dict[str, Any], done: bool = False) -> None:
        result = {"benchmark": self.benchmark, "params": self.params, "partial": not done, **body}
        write_result(self.path, result, quiet=not done)


class GcTrace:
    """Every cyclic-GC collection while installed (gc.callbacks): (start, end, generation), on
    the perf_counter clock. A collection in any thread stalls the step loop (it holds the GIL)."""

    def __init__(self) -> None:
        self.collections: list[tuple[float, float, int]] = []
        self._t0 = 0.0

    def _cb(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.collections.append((self._t0, time.perf_counter(), info["generation"]))

    def __enter__(self) -> GcTrace:
        gc.callbacks.append(self._cb)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._cb)

    def ms_within(self, t0: float, t1: float) -> float:
        return sum(max(0.0, min(b, t1) - max(a, t0)) for a, b, _ in self.collections) * 1000

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for g in (0, 1, 2):
            ms = [(b - a) * 1000 for a, b, gen in self.collections if gen == g]
            out[f"gen{g}"] = {
                "n": len(ms),
                "total_ms": round(sum(ms), 2),
                "max_ms": round(max(ms, default=0.0), 2),
            }
        return out


class Timeline:
    """Background threads' events (prefill HTTP, page pull, staging): name, start, end, detail;
    thread-safe (list.append is atomic under the GIL)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, float, float, dict[str, Any]]] = []

    @contextmanager
    def span(self, name: str, **detail: Any) -> Iterator[dict[str, Any]]:
        """Records the block as one event; the caller may add to the yielded detail (bytes, ...)."""
        t0 = time.perf_counter()
        try:
            yield detail
        finally:
            self.events.append((name, t0, time.perf_counter(), detail))

    def add(self, name: str, t0: float, t1: float, **detail: Any) -> None:
        self.events.append((name, t0, t1, detail))

    def overlapping(self, t0: float, t1: float) -> list[str]:
        return [
            name + "".join(f" {k}={v}" for k, v in d.items())
            for name, a, b, d in self.events
            if a < t1 and b > t0
        ]

    def compact(self, origin: float) -> list[list[Any]]:
        """[name, start ms, end ms, detail] relative to `origin` (the window's start)."""
        return [
            [name, round((a - origin) * 1000, 1), round((b - origin) * 1000, 1), d]
            for name, a, b, d in sorted(self.events, key=lambda e: e[1])
        ]


class StallSampler:
    """Why a step is slow when its phases do not say: while the loop thread has been inside one
    step for more than `after_ms`, a sampler thread records every thread's innermost frames every
    `period_ms` (at most `per_step` samples a step). If the loop thread's frames sit in a CUDA call
    the host was blocked in the driver; if the sampler itself woke late (`lag_ms`), some thread
    held the GIL inside one C call. `step_begin` / `step_end` bracket each step on the loop thread."""

    def __init__(self, after_ms: float = 3.0, period_ms: float = 0.5, per_step: int = 4, depth: int = 5):
        self.after_s, self.period_s, self.per_step, self.depth = (
            after_ms / 1000,
            period_ms / 1000,
            per_step,
            depth,
        )
        self._loop = threading.get_ident()
        self._t0: float | None = None
        self._key = 0.0
        self._cur: list[dict[str, Any]] = []
        self._lag = 0.0
        self.steps: dict[float, dict[str, Any]] = {}  # step key -> {"samples", "sampler_lag_ms"}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stall-sampler", daemon=True)
        self._thread.start()

    def step_begin(self, key: float) -> None:
        """`key`: how the caller will look the step up in `steps` (its own start time)."""
        self._cur, self._lag, self._key = [], 0.0, key
        self._t0 = time.perf_counter()

    def step_end(self) -> None:
        t0, self._t0 = self._t0, None
        if t0 is not None and (self._cur or self._lag > self.after_s):
            self.steps[self._key] = {"samples": self._cur, "sampler_lag_ms": round(self._lag * 1000, 2)}

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1)

    def _run(self) -> None:
        names = {t.ident: t.name for t in threading.enumerate()}
        while not self._stop.is_set():
            t = time.perf_counter()
            time.sleep(self.period_s)
            now = time.perf_counter()
            t0 = self._t0
            if t0 is None:
                continue
            self._lag = max(self._lag, now - t - self.period_s)
            if now - t0 < self.after_s or len(self._cur) >= self.per_step:
                continue
            frames = sys._current_frames()
            if any(i not in names for i in frames):
                names = {t.ident: t.name for t in threading.enumerate()}
            self._cur.append(
                {
                    "in_step_ms": round((now - t0) * 1000, 2),
                    "threads": {
                        ("LOOP" if i == self._loop else names.get(i, str(i))): _innermost(f, self.depth)
                        for i, f in frames.items()
                        if i != threading.get_ident()
                    },
                }
            )


def _innermost(frame: Any, depth: int) -> list[str]:
    out = []
    while frame is not None and len(out) < depth:
        c = frame.f_code
        out.append(f"{Path(c.co_filename).name}:{frame.f_lineno} {c.co_name}")
        frame = frame.f_back
    return out
