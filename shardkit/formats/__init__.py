"""The one registry of shard formats. Each backend module encodes and decodes one container.

Naming, temp-and-rename, checksums and the manifest live in `pack`/`manifest`, not here.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from ..config import MAX_RECORD_BYTES
from ..errors import ConfigError, ShardFormatError
from ..safeio import loads

__all__ = ["MAX_RECORD_BYTES", "Backend", "Record", "available_formats", "get_format"]


class Record(NamedTuple):
    """One stored sample. A NamedTuple: readers build one per record, 4x cheaper than a frozen dataclass."""

    key: str
    data: bytes  # encoded image (ext "jpg") or .npy pixels (ext "npy")
    ext: str
    label: int | None
    meta: dict[str, Any]


def checked(record: Record, where: object) -> Record:
    """Shards come from strangers: a record's fields must have the types readers rely on."""
    if not isinstance(record.key, str) or not isinstance(record.ext, str) or not isinstance(record.meta, dict):
        raise ShardFormatError(f"{where}: record {str(record.key)[:200]!r} has fields of the wrong type")
    if record.label is not None and (not isinstance(record.label, int) or isinstance(record.label, bool)):
        raise ShardFormatError(f"{where}: record {record.key} has a label that is not an integer")
    if not record.key.isascii():  # our keys are ASCII; others must at least be valid UTF-8
        try:
            record.key.encode("utf-8")
        except UnicodeEncodeError:
            raise ShardFormatError(f"{where}: record key {record.key!r} is not UTF-8") from None
    return record


def parse_meta(blob: bytes | str, where: object) -> dict[str, Any]:
    """A record's JSON metadata object (untrusted: nesting depth, type and encoding are checked)."""
    try:
        value = loads(blob)
    except ValueError as error:
        raise ShardFormatError(f"{where} has unreadable metadata ({error})") from None
    if type(value) is not dict:
        raise ShardFormatError(f"{where} has metadata that is not a JSON object")
    return value


_scan_json = json.JSONDecoder().scan_once  # the C scanner behind json.loads, minus its Python wrappers


def json_objects(blobs: list[bytes]) -> list[dict[str, Any] | None]:
    """Each blob's JSON object, or None where the blob is not exactly one JSON object (callers then
    parse it with parse_meta, which names the problem). Per blob, the C scanner costs ~2x less than
    json.loads; each object must span its whole blob, so nothing can shift between records."""
    objects: list[dict[str, Any] | None] = []
    for blob in blobs:
        try:
            text = blob.decode("utf-8").strip()
            value, end = _scan_json(text, 0)
        except (StopIteration, ValueError, TypeError, AttributeError, RecursionError):
            value, end, text = None, -1, ""
        objects.append(value if end == len(text) and type(value) is dict else None)
    return objects


class ShardWriter(Protocol):
    def add(self, record: Record) -> None: ...
    def close(self) -> int: ...  # flushes; returns the number of records
    def abort(self) -> None: ...  # after a failure: release everything, write nothing more


class ShardReader(Protocol):
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[Record]: ...
    def read_range(self, start: int, stop: int) -> Iterator[Record]: ...  # records [start, stop), streamed
    def read(self, index: int) -> Record: ...
    def read_key(self, key: str) -> Record: ...
    def keys(self) -> list[str]: ...
    def close(self) -> None: ...


@dataclass(frozen=True)
class Backend:
    name: str
    suffix: str  # shard file suffix, with the dot
    random_access: bool  # by index and key without reading the shard from the start
    writer: Callable[..., ShardWriter]  # (path, **options): unknown options are a ConfigError
    reader: Callable[[str], ShardReader]


# Each format is a module that declares its own BACKEND (name, suffix, random access, writer,
# reader); the names are known here without importing one (h5py and numpy cost ~0.2 s).
FORMAT_NAMES = ("webdataset", "lmdb", "hdf5")
_formats: dict[str, Backend] | None = None


def _backends() -> dict[str, Backend]:
    global _formats
    if _formats is None:
        import importlib

        found = {name: importlib.import_module(f".{name}", __name__).BACKEND for name in FORMAT_NAMES}
        assert all(backend.name == name for name, backend in found.items()), "a format module names itself"
        _formats = found
    return _formats


def __getattr__(name: str) -> Any:
    if name == "FORMATS":  # built on first use (PEP 562)
        return _backends()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def available_formats() -> list[str]:
    return list(FORMAT_NAMES)


def get_format(name: str) -> Backend:
    try:
        return _backends()[name]
    except KeyError:
        raise ConfigError(f"unknown format {name!r}; choose one of {', '.join(FORMAT_NAMES)}") from None
