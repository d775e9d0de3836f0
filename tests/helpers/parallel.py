"""What the multi-rank engine tests share: tiny model shapes, running a function on N gloo ranks
(spawned processes meeting at a file rendezvous: no port to race other processes for), and finding
the worker ranks a process started."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

from services.common.config import ModelConfig

# vocab 48 and 4 heads: split over 2 ranks; 2 layers, the first dense where an MoE has one.
TINY: dict[str, Any] = dict(vocab_size=48, dim=32, n_layers=2, n_heads=4, head_dim=8, hidden_dim=64)


def tiny_moe(max_seq_len: int) -> ModelConfig:
    """Qwen3-MoE: 8 experts top-2 after one dense layer, untied head."""
    return ModelConfig(
        **TINY,
        max_seq_len=max_seq_len,
        arch="qwen3_moe",
        n_kv_heads=2,
        n_routed_experts=8,
        n_experts_per_tok=2,
        moe_hidden_dim=16,
        first_k_dense=1,
        tie_embeddings=False,
    )


def run_ranks(fn: Callable[..., None], nprocs: int, tmp: Path, *args: Any) -> None:
    """fn(rank, init_method, *args) on `nprocs` spawned processes; a rank's exception fails the
    call (torch.multiprocessing re-raises it here)."""
    mp.start_processes(
        _run_then_exit, args=(fn, f"file://{tmp / 'rdzv'}", *args), nprocs=nprocs, start_method="spawn"
    )


def _run_then_exit(rank: int, fn: Callable[..., None], init: str, *args: Any) -> None:
    fn(rank, init, *args)
    # Done and its results written: leave without the process groups' destructors, which abort
    # the process (SIGABRT) when a peer has already gone, as after a dead-peer check.
    os._exit(0)


def worker_pids(parent: int) -> list[int]:
    """The engine worker ranks (services.engine.parallel.worker) that process `parent` started."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
                cmd = (d / "cmdline").read_bytes()
            except OSError:
                continue
            if ppid == parent and b"services.engine.parallel.worker" in cmd:
                out.append(int(d.name))
    return out
