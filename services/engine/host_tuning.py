"""Host-side tuning for processes that run an engine step loop next to other Python threads
(decode, prefill, the KV benches): the cyclic GC and the GIL's switch interval.

GC: after start-up (model loaded, CUDA graphs captured) the heap holds ~230k long-lived objects
(torch, pydantic, FastAPI internals) that every full (gen-2) collection walks again: 60-80 ms on
this CPU, landing in a random step. `gc.freeze()` moves them to the permanent generation, which
collections skip (full collection after it: < 0.01 ms); vLLM and SGLang freeze after start-up too.
A larger gen-0 threshold makes young collections (and the gen-1/2 ones they trigger) rarer.

Exit: frozen objects are never collected, so without more the start-up's reference cycles are
still alive when the interpreter finalises, and libtriton's nanobind bindings report each of
their objects as leaked (a wall of "nanobind: leaked ..." lines on every decode stop or
restart). An atexit hook unfreezes and collects them first, so the bindings see their objects
freed and a leak they report is a real one.

GIL: a thread that wants the GIL waits up to the switch interval (CPython default 5 ms) for the
holder to drop it, every time; a step loop drops it at each device sync or copy, so one busy
Python thread beside it (HTTP, JSON, hashing, staging loops) adds ~10 ms per release: a 1.3 ms
step took 43 ms. At 0.5 ms the same step took 6 ms (measured on the H200).
"""

from __future__ import annotations

import atexit
import gc
import sys
import time

# Gen-0 threshold after start-up (CPython's default is 700). At 10k the decode loop still met
# exactly one young collection per KV-import window on the H200, 14.6-28.2 ms inside a step
# (the pulls' Python work crosses the threshold); at 100k none came in the window. Young garbage with cycles waits longer to be freed: a few MB.
GEN0_THRESHOLD = 100_000
# Seconds a thread holds the GIL before it must let a waiting one (the step loop) take it.
SWITCH_INTERVAL_S = 0.0005


def tune_after_startup(
    gen0: int = GEN0_THRESHOLD, switch_interval_s: float = SWITCH_INTERVAL_S
) -> dict[str, float]:
    """Collect once, freeze what is left, raise the gen-0 threshold, shorten the GIL switch
    interval. Call once the engine is built. Returns what it did (logged by the caller)."""
    t0 = time.perf_counter()
    gc.collect()
    collect_ms = (time.perf_counter() - t0) * 1000
    gc.freeze()
    atexit.unregister(collect_frozen)  # once, however often start-up tuning runs
    atexit.register(collect_frozen)
    _, g1, g2 = gc.get_threshold()
    gc.set_threshold(gen0, g1, g2)
    sys.setswitchinterval(switch_interval_s)
    return {
        "collect_ms": round(collect_ms, 2),
        "frozen_objects": gc.get_freeze_count(),
        "gen0_threshold": gen0,
        "switch_interval_ms": switch_interval_s * 1000,
    }


def collect_frozen() -> None:
    """Unfreeze and collect the start-up's objects (at exit: see the module docstring)."""
    gc.unfreeze()
    gc.collect()
