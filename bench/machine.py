"""The machine a benchmark ran on: GPUs (nvidia-smi), host, CPU count and library versions.
No side effects at import, so any bench script can record it."""

from __future__ import annotations

import os
import platform
import subprocess
from typing import Any

import torch


def machine() -> dict[str, Any]:
    def sh(cmd: list[str]) -> str:
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip()
        except Exception as e:  # noqa: BLE001 - e.g. no nvidia-smi on a CPU machine
            return repr(e)

    versions: dict[str, str] = {"python": platform.python_version(), "torch": torch.__version__}
    for mod in ("triton", "transformers", "torchtitan", "pydantic"):
        try:
            versions[mod] = __import__(mod).__version__
        except Exception as e:  # noqa: BLE001
            versions[mod] = repr(e)
    return {
        "nvidia_smi": sh(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv"]),
        "hostname": platform.node(),
        "cpus": os.cpu_count(),
        "versions": versions,
    }
