"""A bucket's objects read as the worker and probe read local files: the worker's image by ranges
(`object_reads`: 64 KiB with its header first, then the body), a sidecar whole (`object_bytes`),
probe's headers by ranges (`probe_objects`: 4 KiB first) and probe's candidate copies streamed
(`object_digest`), each through the `Store` of the object's bucket (made once a process)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from ..core.errors import StorageError, StoreUnreachable
from ..storage.store import Store
from ..storage.urls import URL_SCHEME
from .ranges import PACK_FIRST, RangeReads, probe_row
from .scan_rows import ScanRow

_STORES: dict[tuple[str, str], Store] = {}  # (bucket URL, options) -> its store, made once a process


def object_store(url: str, options: dict[str, Any] | None) -> tuple[Store, str]:
    """The store of an object's bucket and the object's name in it."""
    match = URL_SCHEME.match(url)
    assert match is not None, f"an object's URL, not {url!r}"
    bucket, _, name = url[match.end() :].partition("/")
    root = url[: match.end()] + bucket
    key = (root, json.dumps(options or {}, sort_keys=True, default=str))
    store = _STORES.get(key)
    if store is None:
        store = _STORES.setdefault(key, Store(root, dict(options or {})))
    return store, name


def object_reads(url: str, options: dict[str, Any] | None) -> RangeReads:
    """An object's first 64 KiB (its header; all of a small image) and size, by one ranged read:
    FileNotFoundError ("no such object") when it has gone since it was listed. Its later ranges are
    of the version the first one read (ObjectChanged when it was replaced in between)."""
    store, name = object_store(url, options)
    return RangeReads(store.ranges(name), PACK_FIRST)


def object_bytes(url: str, options: dict[str, Any] | None, limit: int) -> bytes:
    """A whole object of at most `limit` bytes (a sidecar): FileNotFoundError when there is none."""
    store, name = object_store(url, options)
    return store.read(name, limit)


@dataclass
class Transfer:
    """What probe's range reads took: bytes, for the report (threads add to it under the GIL,
    a chunk at a time)."""

    bytes: int = 0


def probe_objects(
    options: dict[str, Any] | None, transfer: Transfer, job: tuple[list[str], list[str], int]
) -> list[ScanRow]:
    """A chunk of objects' probe rows, as `probe._probe_chunk` gives a chunk of files': each
    header read by ranges (4 KiB first, more only where it runs on)."""
    urls, relpaths, max_pixels = job
    rows: list[ScanRow] = []
    read = 0
    for url, relpath in zip(urls, relpaths, strict=True):
        store, name = object_store(url, options)
        row, taken = probe_row(store.ranges(name), url, relpath, max_pixels)
        rows.append(row)
        read += taken
    transfer.bytes += read
    return rows


def object_digest(options: dict[str, Any] | None, url: str, identity: int) -> tuple[str, int] | None:
    """The sha256 and size of an object (probe's copies), streamed; None when it cannot be read
    (StoreUnreachable when the store is out of reach: no one object's doing)."""
    store, name = object_store(url, options)
    digest, size = hashlib.sha256(), 0
    try:
        with store.stream(name) as body:
            while chunk := body.read(1 << 20):
                digest.update(chunk)
                size += len(chunk)
    except StoreUnreachable:
        raise
    except (OSError, StorageError):
        return None
    return digest.hexdigest(), size
