"""The ranks of one node of an engine that spans nodes, other than rank 0's node (whose ranks the
service itself starts, services/engine/parallel/ranks.py):

    python -m services.engine.parallel.node --config RUN_DIR/config.json --redis-url URL \
        --role decode --index 3 --node 1

It waits for the rendezvous that the service decode.3 (rank 0) publishes in Redis, starts this
node's worker ranks (services/engine/parallel/worker.py) at it, and beats the group id they joined
while all of them run, for rank 0 to see a node that went away. When the group ends (a rank
died, rank 0 stopped it or went away: its rendezvous expired or names another group) it kills what
is left of its ranks and waits for the next group: a restarted rank 0 forms a new one and this
node joins it. It runs until SIGTERM, under its supervisor like every service.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import subprocess
import sys
import threading
from pathlib import Path

import redis

from services.common.bus import Bus
from services.common.config import load_resolved
from services.engine.parallel.ranks import BEAT_S, RENDEZVOUS_TTL_S, node_ranks
from services.engine.parallel.worker import worker_argv

log = logging.getLogger("relay.engine.node")
REPO = Path(__file__).resolve().parents[3]


class NodeHost:
    def __init__(self, config: str, bus: Bus, role: str, name: str, ranks: range, timeout_s: float) -> None:
        self.config, self.bus, self.role, self.name = config, bus, role, name
        self.ranks, self.timeout_s = ranks, timeout_s
        self.node = ranks[0] // len(ranks)
        self.stop = threading.Event()
        self.joined = ""  # the last group this node ran in

    def rendezvous(self) -> dict[str, str] | None:
        try:
            raw = self.bus.r.get(self.bus.k.engine_rendezvous(self.name))
        except redis.RedisError as e:
            log.warning("redis: %s", e)
            return None
        return json.loads(raw) if raw else None

    def run(self) -> None:
        while not self.stop.is_set():
            rdzv = self.rendezvous()
            if rdzv is None or rdzv["group"] == self.joined:
                self.stop.wait(BEAT_S / 2)
                continue
            self.joined = rdzv["group"]
            self.serve(rdzv["init"], rdzv["group"])

    def serve(self, init: str, group: str) -> None:
        """Run this node's ranks in `group` until it ends (or SIGTERM)."""
        log.info(
            "joining %s group %s at %s: ranks %d-%d", self.name, group, init, self.ranks[0], self.ranks[-1]
        )
        procs = [
            subprocess.Popen(worker_argv(self.config, self.role, r, init, self.timeout_s), cwd=REPO)
            for r in self.ranks
        ]
        beat = self.bus.k.engine_node(self.name, self.node)
        why = ""
        while not why:
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes):
                why = f"ranks exited with {codes}"
            elif any(c not in (None, 0) for c in codes):
                why = f"a rank failed: exit codes {codes}"
            elif self.stop.is_set():
                why = "stopping"
            else:
                try:
                    self.bus.r.set(beat, group, px=int(RENDEZVOUS_TTL_S * 1000))
                    rdzv = self.rendezvous()
                    if rdzv is None or rdzv["group"] != group:
                        why = "rank 0 went away" if rdzv is None else "rank 0 formed another group"
                except redis.RedisError as e:  # Redis restarting: the collectives still tell
                    log.warning("redis: %s", e)
            if not why:
                self.stop.wait(BEAT_S)
        log.info("%s group %s ended: %s", self.name, group, why)
        try:
            self.bus.r.delete(beat)
        except redis.RedisError:
            pass
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, help="the run's resolved config (RUN_DIR/config.json)")
    ap.add_argument("--redis-url", required=True)
    ap.add_argument("--role", choices=("decode",), default="decode")
    ap.add_argument("--index", type=int, required=True, help="the replica (its rank 0 is <role>.<index>)")
    ap.add_argument("--node", type=int, required=True, help="this node among the replica's (1..)")
    ap.add_argument("--timeout-s", type=float, default=300.0, help="collective timeout")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s node {args.node} %(levelname)s %(message)s")
    cfg = load_resolved(args.config)
    nodes = cfg.engine_nodes(args.role)
    if not 1 <= args.node < nodes:
        ap.error(
            f"--node {args.node}: {args.role}.{args.index}'s engine spans {nodes} node(s); 1..{nodes - 1}"
        )
    ranks = node_ranks(cfg.decode.parallel.ranks, nodes, args.node)
    bus = Bus(args.redis_url, cfg.redis.prefix)
    host = NodeHost(args.config, bus, args.role, f"{args.role}.{args.index}", ranks, args.timeout_s)
    signal.signal(signal.SIGTERM, lambda *_: host.stop.set())
    host.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
