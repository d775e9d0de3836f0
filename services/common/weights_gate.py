"""Which weights a service may load on request, and which sample versions count.

Only the trainer writes weights and it announces every version in Redis (Bus.publish_weights):
POST /update_weights (decode, prefill) loads a directory only if it is an announced version's
directory (so never one from the future), under the run's weights root; samples
carrying a version the trainer never announced are dropped (orchestrator, trainer).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from services.common.bus import Bus
from services.common.weights_dir import weights_root


class UpdateRefused(ValueError):
    """A weights update the service must not load; `field` is the request field at fault."""

    def __init__(self, field: str, reason: str):
        super().__init__(f"{field}: {reason}")
        self.field, self.reason = field, reason


def check_update(bus: Bus, run_dir: Path, path: str, version: int) -> None:
    """Raise UpdateRefused unless `path` is the directory the trainer announced as `version`."""
    root = weights_root(run_dir).resolve()
    target = Path(path).resolve()
    if not target.is_relative_to(root):
        raise UpdateRefused("path", f"{path} is not under the run's weights directory {root}")
    info = bus.announced_weights(version)
    if info is None:  # from the future, or never the trainer's
        known = bus.announced_versions()
        newest = f"the newest is {max(known)}" if known else "none yet"
        raise UpdateRefused("version", f"{version} has not been announced by the trainer ({newest})")
    if Path(info.path).resolve() != target:
        raise UpdateRefused("path", f"version {version} is {info.path}, not {path}")


class AnnouncedVersions:
    """The versions the trainer announced, cached (a version, once announced, stays so); Redis is
    asked again only for a version the cache does not hold."""

    def __init__(self, bus: Bus):
        self.bus = bus
        self.known: set[int] = set()

    def unannounced(self, versions: Iterable[int]) -> list[int]:
        """The sampling versions (>= 0) among `versions` the trainer never announced."""
        wanted = {v for v in versions if v >= 0}
        if not wanted <= self.known:
            self.known |= self.bus.announced_versions()
        return sorted(wanted - self.known)
