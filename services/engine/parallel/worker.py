"""A worker rank of a multi-rank engine as its own process (ranks 1..; rank 0 is the service):

    python -m services.engine.parallel.worker --config RUN_DIR/config.json --role decode \
        --rank 1 --init tcp://127.0.0.1:29511

It joins the engine's process group, waits for rank 0's first weights, and runs its orders
(runner.run_worker). It exits 0 when rank 0 stops the engine and non-zero when the group breaks
(a peer died, a collective timed out), for its service's supervisor to restart the whole group.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from services.common.config import load_resolved
from services.engine.parallel.group import close_engine_groups, init_engine_groups
from services.engine.parallel.runner import rank_device, run_worker

log = logging.getLogger("relay.engine.worker")


def worker_argv(config: str | Path, role: str, rank: int, init: str, timeout_s: float) -> list[str]:
    """The command line of worker rank `rank` (run from the repository root)."""
    return [
        sys.executable, "-m", "services.engine.parallel.worker",
        "--config", str(config), "--role", role,
        "--rank", str(rank), "--init", init, "--timeout-s", str(timeout_s),
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, help="the run's resolved config (RUN_DIR/config.json)")
    ap.add_argument("--role", choices=("decode", "prefill"), default="decode")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--init", required=True, help="the group's rendezvous (tcp://host:port, file://path)")
    ap.add_argument("--timeout-s", type=float, default=300.0, help="collective timeout")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank {args.rank} %(levelname)s %(message)s")
    cfg = load_resolved(args.config)
    if args.role == "decode":
        engine, par = cfg.decode.engine, cfg.decode.parallel
    else:
        engine, par = cfg.prefill.engine or cfg.decode.engine, cfg.prefill_parallel
    backend = "nccl" if rank_device(engine, args.rank).type == "cuda" else "gloo"
    groups = init_engine_groups(par, args.rank, args.init, backend, args.timeout_s)
    try:
        run_worker(engine, par, groups)
    except Exception:
        log.exception("rank %d: the engine's group broke", args.rank)
        return 1
    close_engine_groups(groups)
    return 0


if __name__ == "__main__":
    sys.exit(main())
