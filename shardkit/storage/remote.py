"""A remote output as readers see it: its store, the cache its shards go through, and the shards of
the epoch plan prefetched in the background."""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from .cache import ShardCache
from .store import Store


@dataclass
class Remote:
    """A remote output as readers see it: where it is and the cache its shards go through."""

    store: Store
    cache: ShardCache
    ahead: int = 2  # shards of the epoch plan fetched in the background beyond the current one

    def __post_init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._pending: dict[str, Future[None]] = {}
        self._pid = 0
        self._guard = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {"store": self.store, "cache": self.cache, "ahead": self.ahead}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.__post_init__()

    def open(self, name: str, size: int, sha256: str) -> int:
        return self.cache.open(self.store, name, size, sha256)

    def fetch(self, name: str, size: int, sha256: str) -> None:
        self.cache.fetch(self.store, name, size, sha256)

    def prefetch(self, shards: list[tuple[str, int, str]]) -> None:
        """Starts fetching these (name, bytes, sha256) in the background (errors are left for the
        foreground fetch of the same shard to raise)."""
        with self._guard:
            if self._pool is None or self._pid != os.getpid():  # threads do not survive a fork
                self._pool, self._pending, self._pid = ThreadPoolExecutor(2, "shardkit-prefetch"), {}, os.getpid()
            for done in [sha for sha, future in self._pending.items() if future.done()]:
                del self._pending[done]
            for name, size, sha256 in shards:
                if sha256 not in self._pending and not self.cache.cached(sha256, name, size):
                    self._pending[sha256] = self._pool.submit(self.fetch, name, size, sha256)

    def close(self) -> None:
        """Cancels the prefetches not started and waits for the running ones (they end within the
        retry window): nothing keeps downloading for a dataset that is closed."""
        with self._guard:
            pool, self._pool = self._pool, None
        if pool is not None and self._pid == os.getpid():
            pool.shutdown(wait=True, cancel_futures=True)
