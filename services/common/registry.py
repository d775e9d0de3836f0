"""The one client of the service registry (`Keys.service` entries, written by every service's
heartbeat): which services of a kind are live, cached briefly, with failed URLs routed around.

A registry read that fails (Redis restarting) keeps the last view instead of raising: callers
route on a view at most a few seconds old rather than failing their request, and the next read
after Redis is back refreshes it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable

import redis

from services.common.schemas import ServiceInfo

log = logging.getLogger(__name__)

Lookup = Callable[[str], list[ServiceInfo]]


class Registry:
    """Live services by kind from `lookup` (normally `Bus.services`), re-read at most every
    `refresh_s`. `forget(url)` quarantines a URL for `quarantine_s` (a request to it failed: its
    entry may not have expired yet, or a restarted process re-registers at the same URL)."""

    def __init__(self, lookup: Lookup, refresh_s: float = 0.5, quarantine_s: float = 5.0):
        self.lookup = lookup
        self.refresh_s = refresh_s
        self.quarantine_s = quarantine_s
        self._cache: dict[str, list[ServiceInfo]] = {}
        self._at: dict[str, float] = {}
        self._down: dict[str, float] = {}
        self._lock = threading.Lock()
        self._alock: asyncio.Lock | None = None  # asyncio callers queue here, not in threads

    def _fresh(self, kind: str) -> bool:
        return time.monotonic() - self._at.get(kind, -1e18) <= self.refresh_s

    def _refresh(self, kind: str, force: bool) -> None:
        with self._lock:
            if not force and self._fresh(kind):
                return  # another caller refreshed it while this one waited
            try:
                self._cache[kind] = self.lookup(kind)
            except (redis.RedisError, OSError) as e:
                log.warning("registry lookup of %s failed (%s); using the last view", kind, e)
            self._at[kind] = time.monotonic()

    def _usable(self, kind: str) -> list[ServiceInfo]:
        now = time.monotonic()
        return [i for i in self._cache.get(kind, []) if self._down.get(i.url, 0.0) < now]

    def get(self, kind: str, force: bool = False) -> list[ServiceInfo]:
        """Blocking (a Redis read when the view is older than refresh_s): call it off an event loop."""
        if force or not self._fresh(kind):
            self._refresh(kind, force)
        return self._usable(kind)

    async def live(self, kind: str, force: bool = False) -> list[ServiceInfo]:
        """`get` for asyncio callers: a fresh view is answered without leaving the loop."""
        if force or not self._fresh(kind):
            if self._alock is None:
                self._alock = asyncio.Lock()
            async with self._alock:
                if force or not self._fresh(kind):
                    await asyncio.to_thread(self._refresh, kind, force)
        return self._usable(kind)

    def forget(self, url: str) -> None:
        self._down[url] = time.monotonic() + self.quarantine_s
