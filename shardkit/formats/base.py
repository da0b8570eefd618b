"""What every format shares, so that a format module writes only its encoding and decoding.

A reader subclasses `ShardReaderBase`: it is opened lazily in the process that reads (handles never
cross a fork or a pickle: `TRANSIENT` names them), gets `__iter__` from `read_range`, `read_key`
from its index of keys unless it has a native one, and refuses a record over the size limit with
one message. A writer subclasses `ShardWriterBase`, which validates its options (unknown keys and
wrong types refused before anything is written) and encodes metadata the one way all formats do.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any, ClassVar

from ..config import MAX_RECORD_BYTES
from ..errors import ConfigError, ShardFormatError
from . import Record


def encode_meta(meta: dict[str, Any]) -> str:
    """A record's metadata as stored by every format: JSON with sorted keys (reproducible bytes)."""
    return json.dumps(meta, sort_keys=True)


class ShardWriterBase:
    """A writer opened on a temporary path with keyword options: `add(record)`, `close()` returning
    the count, `abort()` after a failure."""

    OPTIONS: ClassVar[dict[str, Any]] = {}  # option name -> default (its type is the default's type)

    def __init__(self, path: str, **options: Any) -> None:
        self.path = path
        unknown = set(options) - set(self.OPTIONS)
        if unknown:
            known = ", ".join(sorted(self.OPTIONS)) or "none"
            raise ConfigError(f"unknown writer option {sorted(unknown)[0]!r} (known: {known})")
        self.options = {**self.OPTIONS, **options}
        for name, value in options.items():
            wanted = type(self.OPTIONS[name])
            if not isinstance(value, wanted) or isinstance(value, bool) is not (wanted is bool):
                raise ConfigError(f"writer option {name} must be {wanted.__name__}, not {value!r}")

    def add(self, record: Record) -> None:
        raise NotImplementedError

    def close(self) -> int:
        raise NotImplementedError

    def abort(self) -> None:
        raise NotImplementedError


class ShardReaderBase:
    """A reader of one shard file, untrusted."""

    # attributes holding per-process handles: reset to None when the reader is pickled
    TRANSIENT: ClassVar[tuple[str, ...]] = ()

    def __init__(self, path: str) -> None:
        self.path = path
        self._pid = 0  # the process the handles were opened in
        self._by_key: dict[str, int] | None = None

    def in_this_process(self, handle: Any) -> bool:
        """Whether `handle` may be used here: opened, and not inherited through a fork."""
        return handle is not None and self._pid == os.getpid()

    def opened(self) -> None:
        self._pid = os.getpid()

    def __getstate__(self) -> dict[str, Any]:
        # handles do not travel to other processes; an index (plain data) does
        return {**self.__dict__, **dict.fromkeys(self.TRANSIENT), "_pid": 0}

    def __len__(self) -> int:
        raise NotImplementedError

    def keys(self) -> list[str]:
        raise NotImplementedError

    def read(self, index: int) -> Record:
        raise NotImplementedError

    def read_range(self, start: int, stop: int) -> Iterator[Record]:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __iter__(self) -> Iterator[Record]:
        return self.read_range(0, len(self))

    def positions(self) -> dict[str, int]:
        """Key -> index, from keys(), built once; a key stored twice is a damaged shard."""
        if self._by_key is None:
            keys = self.keys()
            by_key = {key: index for index, key in enumerate(keys)}
            if len(by_key) != len(keys):
                raise ShardFormatError(f"{self.path}: a key appears in two places")
            self._by_key = by_key
        return self._by_key

    def read_key(self, key: str) -> Record:
        try:
            index = self.positions()[key]
        except KeyError:
            raise KeyError(key) from None
        return self.read(index)

    def refuse_oversize(self, size: int, record: object) -> None:
        """Shards come from strangers: never allocate a record over the readers' limit."""
        if size > MAX_RECORD_BYTES:
            raise ShardFormatError(f"{self.path}: record {record} is over the size limit")
