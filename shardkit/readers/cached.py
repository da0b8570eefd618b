"""A format's reader over the cached copy of a remote shard: the read side's adapter between a format
(which reads local files only) and object storage (which hands out cached shards as descriptors)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from ..core.errors import ShardFormatError
from ..formats.base import Record, ShardReader
from ..storage.remote import Remote
from .stats import storage_wait

T = TypeVar("T")


class CachedShardReader(ShardReader):
    """A format's reader over the cached copy of a remote shard: fetched and opened on first use in
    each process, errors naming the URL. The reader opens the copy through this process's
    descriptor of it (/dev/fd/N), so an eviction meanwhile cannot take it away. Closing it lets the
    cache's eviction free the space."""

    def __init__(
        self, open_reader: Callable[[str], ShardReader], remote: Remote, name: str, size: int, sha256: str
    ) -> None:
        super().__init__(remote.store.child(name))
        self._open_reader, self._remote = open_reader, remote
        self._shard = (name, size, sha256)
        self._inner: ShardReader | None = None
        self._fd = -1
        self._local = ""
        self._pid = 0

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_inner": None, "_fd": -1, "_pid": 0}

    def _reader(self) -> ShardReader:
        inner = self._inner
        if inner is None or self._pid != os.getpid():  # after a fork, open our own
            with storage_wait():
                self._fd = self._remote.open(*self._shard)
            self._local = f"/dev/fd/{self._fd}"
            inner = self._inner = self._open_reader(self._local)
            self._pid = os.getpid()
        return inner

    def _named(self, error: ShardFormatError) -> ShardFormatError:
        text = str(error)
        return type(error)(text.replace(self._local, self.path)) if self._local else error

    def _call(self, method: Callable[[ShardReader], T]) -> T:
        try:
            return method(self._reader())
        except ShardFormatError as error:
            raise self._named(error) from None

    def __len__(self) -> int:
        return self._call(len)

    def keys(self) -> list[str]:
        return self._call(lambda reader: reader.keys())

    def read(self, index: int) -> Record:
        return self._call(lambda reader: reader.read(index))

    def read_key(self, key: str) -> Record:
        return self._call(lambda reader: reader.read_key(key))

    def positions(self) -> dict[str, int]:
        return self._call(lambda reader: reader.positions())

    def read_range(self, start: int, stop: int) -> Iterator[Record]:
        try:
            yield from self._reader().read_range(start, stop)
        except ShardFormatError as error:
            raise self._named(error) from None

    def __iter__(self) -> Iterator[Record]:
        try:
            yield from iter(self._reader())
        except ShardFormatError as error:
            raise self._named(error) from None

    def close(self) -> None:
        if self._inner is not None and self._pid == os.getpid():
            self._inner.close()
            os.close(self._fd)
        self._inner, self._fd = None, -1
