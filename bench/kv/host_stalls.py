"""Host-side stalls of a step loop, measured on their own (CPU; what services/engine/host_tuning.py
fixes, bench/kv/README.md "Decode stalls"):

  gc   a full (gen-2) collection's pause in a process holding the decode service's imports and a
       built engine, before and after gc.freeze()
  gil  a loop thread's "steps" (each drops the GIL 4x, as a step's device syncs and copies do)
       while 0, 1 or 3 threads run the long-prompt work's pure-Python part (chain_hashes of a 16k
       prompt), at CPython's 5 ms switch interval and at host_tuning's

    .venv/bin/python -m bench.kv.host_stalls
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

import services.decode.server  # noqa: F401 - the decode service's imports: their objects are the heap
from bench.kv.common import engine_config, make_model_dir
from services.engine import LLMEngine
from services.engine.host_tuning import SWITCH_INTERVAL_S, tune_after_startup
from services.engine.kv_transfer import chain_hashes


def full_collect_ms(n: int = 5) -> float:
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        gc.collect()
        ts.append((time.perf_counter() - t) * 1000)
    return min(ts)


def gil(nbg: int, interval_s: float, seconds: float) -> dict[str, float]:
    sys.setswitchinterval(interval_s)
    prompt = [random.randrange(150_000) for _ in range(16384)]
    a = torch.randn(64, 64)
    stop = threading.Event()

    def bg() -> None:
        while not stop.is_set():
            chain_hashes(prompt, 0, "layout", 16)

    threads = [threading.Thread(target=bg, daemon=True) for _ in range(nbg)]
    for th in threads:
        th.start()
    ms = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t = time.perf_counter()
        for _ in range(4):
            time.sleep(0.0002)  # a wait that drops the GIL (a device sync), then host work
            a @ a
        ms.append((time.perf_counter() - t) * 1000)
    stop.set()
    for th in threads:
        th.join()
    x = np.array(ms)
    return {"p50": float(np.percentile(x, 50)), "p99": float(np.percentile(x, 99)), "max": float(x.max())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=2.0, help="per GIL case")
    args = p.parse_args()
    torch.set_num_threads(1)
    model = make_model_dir("tiny", Path(tempfile.mkdtemp()) / "model")
    cfg = engine_config("cpu", "float32", 4096, block_size=16, num_kv_blocks=512, max_batch_size=64)
    eng = LLMEngine(model, cfg, version=0)
    print(f"gc: {len(gc.get_objects())} tracked objects; full collection {full_collect_ms():.2f} ms")
    default_interval = sys.getswitchinterval()
    info = tune_after_startup()
    print(f"gc: after tune_after_startup {info}: full collection {full_collect_ms():.3f} ms")
    for nbg in (0, 1, 3):
        for iv in (default_interval, SWITCH_INTERVAL_S):
            r = gil(nbg, iv, args.seconds)
            print(
                f"gil: {nbg} busy threads, switch interval {iv * 1000:.1f} ms: step ms " + str(r), flush=True
            )
    del eng


if __name__ == "__main__":
    main()
