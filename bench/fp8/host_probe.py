"""Host time per eager call of the FP8 linear's pieces at decode M, next to bf16's, and where the
FP8 linear's host time goes (cProfile): the eager small-M numbers of gemm.py are host-bound and
move with the host's speed between machines.

Per function and shape (gemm.host_and_wall_ms): `host_us` is the host's time to enqueue one call
(200 calls back to back, no synchronisation; the GPU queue does not fill at these sizes), `wall_us`
the time per call including the final synchronisation. The same process times bf16 (`F.linear`)
as the baseline. The profile is gemm.host_top's: (function, calls per linear, host ms per linear).

    python3 bench/fp8/host_probe.py --out $OUT/fp8_host_probe.json
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import gemm as bench  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.results import write_result
from ops.fp8 import dispatch as fl  # noqa: E402
from ops.fp8 import recipe as ref  # noqa: E402

SHAPES = [(64, 7168, 2048), (128, 7168, 2048), (128, 4096, 7168), (128, 2048, 7168)]
CALLS = 200


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args()
    dev = torch.device("cuda")
    result = bench.new_result("bf16 F.linear, eager, same process")
    result["rows"] = []
    for m, n, k in SHAPES:
        d = bench.quantised(m, n, k, dev)
        ops = (*bench.engine_act(d), d["wq"], d["ws"], torch.bfloat16)
        fns = {
            "linear_bf16": partial(F.linear, d["x"], d["w"]),
            "quant_act": partial(fl.quantize_activation, d["x"]),
            "torch_blockwise": partial(ref.fp8_gemm, *ops, "torch"),
            "auto": partial(fl.fp8_gemm_dispatch, *ops),
            "linear_fp8_auto": partial(fl.fp8_matmul, d["x"], d["wq"], d["ws"], torch.bfloat16),
        }
        row: dict[str, Any] = {"M": m, "N": n, "K": k}
        for name, fn in fns.items():
            host_ms, wall_ms = bench.host_and_wall_ms(fn, CALLS)
            row[name] = {"host_us": host_ms * 1e3, "wall_us": wall_ms * 1e3}
        print(json.dumps(row), flush=True)
        result["rows"].append(row)
    m, n, k = SHAPES[1]
    d = bench.quantised(m, n, k, dev)
    # (function, calls per linear, host ms per linear under the profiler), most own time first
    top = bench.host_top(partial(fl.fp8_matmul, d["x"], d["wq"], d["ws"], torch.bfloat16), CALLS, args.top)
    result["profile_linear_fp8_auto"] = {"shape": [m, n, k], "host_top": top}
    for name, calls, ms in top:
        print(f"{ms * 1e3:8.2f} us  {calls:3d}x  {name}")
    write_result(args.out, result)


if __name__ == "__main__":
    main()
