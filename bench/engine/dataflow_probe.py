"""Does a CUDA C++ kernel with per-program flags make the batch-1 chain's exchanges cheaper?

stream_probe.py and megakernel_probe.py measure the batch-1 persistent kernel's chain of GEMV phases in Triton and Gluon:
~2.8 us an exchange before any weight is read, and every arrangement at 17-20
us a layer for the four GEMV phases against 7.4 us of DRAM time. This probe measures
Hazy Research's design: CUDA C++, a producer warp streaming weights into shared memory, and consumers
that wait on the flags of the programs that wrote their inputs instead of on a grid barrier.
`dataflow_kernel.cu` is that kernel for the same chain (q/k/v, o_proj, gate/up, down; 28 layers;
no norms or attention), with the exchange selectable in the same code:

- `flags`: each program publishes a flag per phase; a lane polls only the flags of its inputs'
  producers (relaxed loads, several in flight), then one acquire fence;
- `barrier`: one counter a phase that every program increments, polled the same way;
- `*_no_weights`: the same chain with the weights never streamed (the exchanges alone);
- `flags_l2`: every layer streams layer 0's weights (from L2 after the first layer);
- `*_w8`: 8 consumer warps a program instead of 4;
- `*_1p`: one warp a program polls (the others wait at a named barrier) instead of every lane;
- `gluon`, `gluon_no_weights`: stream_probe.py's Gluon chain (TMA producer warps, grid
  barriers), the strongest of the earlier kernels, in the same process.

Every CUDA variant is checked against stream_probe's float32 torch chain (3 layers) first.
`--trace` also runs each CUDA variant once with clock marks (`TRACE_MARKS`, summarised by
`trace_summary`): per phase the wait, the input loads, the GEMV and the publication, and the
latency from a phase's last publication to the next phase's release.

    python3 bench/engine/dataflow_probe.py --out $OUT/dataflow_probe.json
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import sys
import traceback
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.engine.gemv_chain import (  # noqa: E402
    INTER,
    NQ,
    NQKV,
    D,
    first_layers,
    layer_stages,
    reference,
    setup,
    time_variants,
)
from bench.results import write_result
from ops.fp8.cuda import nvcc  # noqa: E402

SOURCE = Path(__file__).with_name("dataflow_kernel.cu")
P = 128
# Per phase, in the kernel's order: weight name, rows a program owns, K, columns a stage carries.
PHASES = (
    ("qkv", NQKV // P, D, 256),
    ("o", D // P, NQ, 1024),
    ("gu", 2 * INTER // P, D, 128),
    ("dn", D // P, INTER, 1024),
)
LAYER_ELEMS = sum(r * k for _, r, k, _ in PHASES)
MODES = {"flags": 0, "barrier": 1}
# The kernel's clock marks in each (layer, phase, program), by the thread that publishes: the
# intervals between them are the wait, the input loads, the GEMV and the publication.
TRACE_MARKS = ("entry", "released", "inputs", "reduced", "published")


def trace_summary(t: torch.Tensor) -> dict[str, Any]:
    """Where a layer's time goes, from a [layers, 4, P, marks] trace in ns (layer 0 left out: it
    carries the launch's skew). Per phase, medians over layers and programs of each interval, and
    the exchange's latency: from the last program's publication to each program's release into
    the next phase (in flags mode a program waits only for its producers, so it can be lower)."""
    t = t.double()
    layers = t.shape[0]
    phase_names = [name for name, *_ in PHASES]
    seq = t.reshape(layers * 4, P, len(TRACE_MARKS))  # phases in execution order
    last_pub = seq[:-1, :, 4].amax(dim=1, keepdim=True)
    # Each phase's release after the previous phase's last publication, for the phases of layer >= 1.
    lat = seq[4:, :, 1] - last_pub[3:]
    out: dict[str, Any] = {"layers": layers, "phases": {}}
    for i, name in enumerate(phase_names):
        rows = seq[4 + i :: 4]  # [layers - 1, P, marks]
        iv = rows[..., 1:] - rows[..., :-1]
        into = lat[i::4]
        out["phases"][name] = {
            "wait_us": float(iv[..., 0].median()) / 1e3,
            "inputs_us": float(iv[..., 1].median()) / 1e3,
            "gemv_us": float(iv[..., 2].median()) / 1e3,
            "publish_us": float(iv[..., 3].median()) / 1e3,
            "release_after_last_publish_us": float(into.median()) / 1e3,
            "publish_spread_us": float((rows[..., 4].amax(1) - rows[..., 4].amin(1)).median()) / 1e3,
        }
    qkv_release = seq[0::4, :, 1].median(dim=1).values
    out["layer_us"] = float((qkv_release[2:] - qkv_release[1:-1]).median()) / 1e3
    out["release_after_last_publish_us_all"] = float(lat.median()) / 1e3
    return out


def pack(weights: dict[str, torch.Tensor], layers: int) -> torch.Tensor:
    """[layers, P, LAYER_ELEMS] bf16: each program's weights of a layer contiguous, phase after
    phase, stage after stage, each stage's tile [R, CK] row-major (what the producer streams)."""
    parts = []
    for name, r, k, ck in PHASES:
        w = weights[name].view(layers, P, r, k // ck, ck).permute(0, 1, 3, 2, 4)
        parts.append(w.reshape(layers, P, r * k))
    return torch.cat(parts, dim=2).contiguous()


def emulate(packed: torch.Tensor, h0: torch.Tensor, layers: int) -> torch.Tensor:
    """The kernel's arithmetic on CPU from the packed tiles: each program's rows of each phase as
    the sum over stages of tile @ the stage's input columns (what reading `pack` wrongly breaks)."""
    h = h0.clone().float()
    for layer in range(layers):
        offset = 0
        outs: dict[str, torch.Tensor] = {}
        for name, r, k, ck in PHASES:
            if name in ("qkv", "gu"):
                x = h.bfloat16().float()
            elif name == "o":
                x = outs["qkv"][:NQ]
            else:
                g, u = outs["gu"][:INTER], outs["gu"][INTER:]
                x = (g / (1 + torch.exp(-g)) * u).bfloat16().float()
            tiles = packed[layer, :, offset : offset + r * k].float().view(P, k // ck, r, ck)
            offset += r * k
            y = torch.einsum("psrc,sc->pr", tiles, x.view(k // ck, ck)).reshape(-1)
            if name in ("qkv", "gu"):
                outs[name] = y.bfloat16().float()
            else:
                h = h + y.bfloat16().float()
    return h


def bind(path: Path) -> ctypes.CDLL:
    """Load a built dataflow library and declare its functions' signatures."""
    lib = ctypes.CDLL(str(path))
    vp, i, ll = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
    lib.relay_dataflow_launch.argtypes = [vp, ll, vp, vp, vp, vp, vp, vp, i, i, i, i, i, i, vp, vp]
    lib.relay_dataflow_launch.restype = i
    lib.relay_dataflow_layer_bytes.restype = i
    lib.relay_dataflow_programs.restype = i
    lib.relay_dataflow_trace_marks.restype = i
    return lib


@functools.cache
def library() -> ctypes.CDLL:
    path = nvcc.library_path(SOURCE, "dataflow")
    if not path.exists():
        nvcc.build(SOURCE, path)
    lib = bind(path)
    if (
        lib.relay_dataflow_layer_bytes() != 2 * LAYER_ELEMS
        or lib.relay_dataflow_programs() != P
        or lib.relay_dataflow_trace_marks() != len(TRACE_MARKS)
    ):
        raise RuntimeError("dataflow_kernel.cu and dataflow_probe.py disagree on the shapes")
    return lib


class Dataflow:
    """The CUDA chain over `pack`ed weights; `run` leaves the final residual in `ha`."""

    def __init__(self, weights: dict[str, torch.Tensor], layers: int):
        self.layers = layers
        self.packed = pack(weights, layers)
        dev = self.packed.device
        self.ha = torch.zeros(D, dtype=torch.float32, device=dev)
        self.hb = torch.zeros(D, dtype=torch.float32, device=dev)
        self.qkv = torch.zeros(NQKV, dtype=torch.bfloat16, device=dev)
        self.gu = torch.zeros(2 * INTER, dtype=torch.bfloat16, device=dev)
        # Never reset: each mode's epochs only grow (a launch's base is the epochs before it).
        self.sync = {m: torch.zeros(4 * P, dtype=torch.int32, device=dev) for m in MODES}
        self.launched = dict.fromkeys(MODES, 0)
        self.err = torch.zeros(4, dtype=torch.int32, device=dev)

    def run(
        self,
        h0: torch.Tensor,
        mode: str = "flags",
        weights: bool = True,
        same: bool = False,
        warps: int = 4,
        one_poller: bool = False,
        trace: torch.Tensor | None = None,
    ) -> None:
        """`trace`: None, or int64 [layers, 4, P, len(TRACE_MARKS)] for the phases' clocks."""
        self.ha.copy_(h0)
        base = self.launched[mode] * self.layers
        self.launched[mode] += 1
        rc = library().relay_dataflow_launch(
            self.packed.data_ptr(), 0 if same else P * 2 * LAYER_ELEMS, self.ha.data_ptr(), self.hb.data_ptr(),
            self.qkv.data_ptr(), self.gu.data_ptr(), self.sync[mode].data_ptr(), self.err.data_ptr(),
            self.layers, base, MODES[mode], int(weights), warps, int(one_poller),
            None if trace is None else trace.data_ptr(), ctypes.c_void_p(torch.cuda.current_stream().cuda_stream),
        )  # fmt: skip
        if rc != 0:
            raise RuntimeError(f"relay_dataflow_launch returned {rc}")

    def watchdog(self) -> list[int]:
        """[fired, phase, layer, lowest value seen]: a wait that timed out (a bug, not a result)."""
        return self.err.tolist()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--launches", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-gluon", action="store_true", help="skip stream_probe's Gluon baselines")
    ap.add_argument("--variants", default="", help="comma-separated CUDA variants to run (default: all)")
    ap.add_argument("--trace", action="store_true", help="also run each CUDA variant once with clock marks")
    args = ap.parse_args()
    from bench.engine.megakernel_probe import time_us

    L = args.layers
    weights, h0, report = setup(
        "dataflow_probe", "stream_probe's Gluon chain (TMA producers, grid barriers), same process", L, P
    )
    out = Path(args.out)
    print("building", flush=True)
    library()
    # Values grow through the MLPs of random weights: check 3 layers, time L.
    n_check = min(L, 3)
    small = first_layers(weights, L, n_check)
    want = reference(small, h0, n_check)
    try:  # one layer, each phase's output against torch (where a wrong result starts)
        one = first_layers(weights, L, 1)
        d1 = Dataflow(one, 1)
        d1.run(h0)
        torch.cuda.synchronize()
        stages = layer_stages(one, h0)
        report["one_layer_max_abs_err"] = {
            name: [float((got.float() - stages[name]).abs().max()), float(stages[name].abs().max())]
            for name, got in (("qkv", d1.qkv), ("hb", d1.hb), ("gu", d1.gu), ("h", d1.ha))
        }
        report["one_layer_watchdog"] = d1.watchdog()
        print("one layer", report["one_layer_max_abs_err"], d1.watchdog(), flush=True)
    except Exception:  # noqa: BLE001
        report["one_layer_error"] = traceback.format_exc()[-3000:]
        print(report["one_layer_error"], file=sys.stderr, flush=True)
    results: dict[str, Any] = {}
    runners: dict[str, Any] = {}
    check = Dataflow(small, n_check)
    full = Dataflow(weights, L)
    for name, kw in {
        "flags": {"mode": "flags"},
        "barrier": {"mode": "barrier"},
        "flags_no_weights": {"mode": "flags", "weights": False},
        "barrier_no_weights": {"mode": "barrier", "weights": False},
        "flags_l2": {"mode": "flags", "same": True},
        "flags_w8": {"mode": "flags", "warps": 8},
        "barrier_w8": {"mode": "barrier", "warps": 8},
        "flags_1p": {"mode": "flags", "one_poller": True},
        "barrier_1p": {"mode": "barrier", "one_poller": True},
        "flags_1p_no_weights": {"mode": "flags", "one_poller": True, "weights": False},
        "barrier_1p_no_weights": {"mode": "barrier", "one_poller": True, "weights": False},
    }.items():
        if args.variants and name not in args.variants.split(","):
            continue
        try:
            entry: dict[str, Any] = {"kwargs": kw}
            if kw.get("weights", True) and not kw.get("same"):
                check.run(h0, **kw)
                torch.cuda.synchronize()
                err = float((check.ha - want).abs().max() / want.abs().max())
                entry.update({"layers_checked": n_check, "max_err_over_max": err, "ok": err < 2e-2,
                              "watchdog": check.watchdog()})  # fmt: skip
                print(name, "check", err, "watchdog", entry["watchdog"], flush=True)
                if not entry["ok"] or entry["watchdog"][0]:
                    results[name] = entry
                    continue

            def run(kw: dict[str, Any] = kw) -> None:
                full.run(h0, **kw)

            run()
            torch.cuda.synchronize()
            entry["watchdog_after_warmup"] = full.watchdog()
            if args.trace:
                marks = torch.zeros(L, 4, P, len(TRACE_MARKS), dtype=torch.int64, device=h0.device)
                full.run(h0, **kw, trace=marks)
                torch.cuda.synchronize()
                entry["trace"] = trace_summary(marks.cpu())
                print(name, "trace", json.dumps(entry["trace"]), flush=True)
            runners[name] = run
            results[name] = entry
        except Exception as e:  # noqa: BLE001 - the other variants still run
            results[name] = {
                "error": f"{type(e).__name__}: {e}"[:3000],
                "traceback": traceback.format_exc()[-6000:],
            }
            print(results[name]["traceback"], file=sys.stderr, flush=True)
    if not args.no_gluon:
        try:
            from bench.engine.stream_probe import Stream

            st = Stream(weights, L)
            h = h0.clone()

            def run_gluon(weights_on: bool = True) -> None:
                h.copy_(h0)
                st.run(h, weights=weights_on)

            for name, on in (("gluon", True), ("gluon_no_weights", False)):
                fn = functools.partial(run_gluon, on)
                fn()
                torch.cuda.synchronize()
                runners[name] = fn
                results[name] = {"note": "stream_probe.py's Gluon chain" + ("" if on else ", no weights")}
        except Exception as e:  # noqa: BLE001
            results["gluon"] = {"error": f"{type(e).__name__}: {e}"[:3000]}
    time_variants(runners, results, time_us, args.rounds, args.launches, L, report["dram_read_us"])
    report["watchdog_end"] = full.watchdog()
    report["variants"] = results
    write_result(out, report)
    print(
        json.dumps(
            {k: {kk: vv for kk, vv in v.items() if kk != "traceback"} for k, v in results.items()}, indent=1
        )
    )


if __name__ == "__main__":
    main()
