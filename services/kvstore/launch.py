"""What a launcher needs to run the KV store side of a run: which processes (Mooncake master, the
gateway, prefill services), the master's ports, and the on-demand install of the Mooncake extra.
sbatch/local.py uses these; nothing here starts a process itself."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

from services.common.config import ConfigError, RunConfig

INSTALL_SCRIPT = Path(__file__).resolve().parent / "install_mooncake.sh"


def kv_plan(cfg: RunConfig) -> list[tuple[str, str, int]]:
    """(process name, module, replica index) in start order; empty unless kvstore.enabled."""
    if cfg.prefill.replicas and not cfg.kvstore.enabled:
        raise ConfigError(
            "prefill.replicas > 0 needs kvstore.enabled = true (pages travel through the store)"
        )
    if cfg.kvstore.mooncake.enabled and not cfg.kvstore.enabled:
        raise ConfigError("kvstore.mooncake.enabled needs kvstore.enabled = true")
    if not cfg.kvstore.enabled:
        return []
    plan = []
    if cfg.kvstore.mooncake.enabled:
        plan.append(("mooncake_master", "services.kvstore.master", 0))
    plan.append(("kvstore", "services.kvstore", 0))
    plan += [(f"prefill.{i}", "services.prefill", i) for i in range(cfg.prefill.replicas)]
    return plan


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def resolve_ports(cfg: RunConfig) -> RunConfig:
    """The config with free ports for the Mooncake master's 0 ports (written to config.json, so the
    master and every gateway agree)."""
    mc = cfg.kvstore.mooncake
    if not (cfg.kvstore.enabled and mc.enabled) or (mc.rpc_port and mc.metadata_port):
        return cfg
    ports = {
        "rpc_port": mc.rpc_port or _free_port(mc.master_host),
        "metadata_port": mc.metadata_port or _free_port(mc.master_host),
    }
    kv = cfg.kvstore.model_copy(update={"mooncake": mc.model_copy(update=ports)})
    return cfg.model_copy(update={"kvstore": kv})


def ensure_installed(cfg: RunConfig) -> None:
    """Install the Mooncake extra (and its apt libraries) when the run uses the Mooncake tier."""
    if not (cfg.kvstore.enabled and cfg.kvstore.mooncake.enabled):
        return
    proc = subprocess.run(["bash", str(INSTALL_SCRIPT), sys.executable], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"cannot install the Mooncake tier ({INSTALL_SCRIPT}): {proc.stderr.strip()}")
