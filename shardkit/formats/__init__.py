"""The one registry of shard formats: `get_format(name)` returns the `Backend` a format module
declares as its `BACKEND`, imported on first use. What every format shares is in `base.py`.

Naming, temp-and-rename, checksums and the manifest live on the write side and in `core.manifest`,
not here.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

from ..core.errors import ConfigError
from .base import Backend

__all__ = ["Backend", "available_formats", "get_format", "idx_files", "output_file_names"]


# Each format is a module that declares its own BACKEND (name, suffix, random access, writer,
# reader); the names are known here without importing one (h5py and numpy are slow to import).
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


def idx_files(shards: Iterable[str]) -> set[str]:
    """The .idx files other readers want beside these shards: one for each shard whose format
    writes one (`Backend.idx_file`: a tar's, for DALI)."""
    from ..core.manifest import idx_name  # here: `shardkit --help` loads no hashing (libcrypto)

    with_idx = tuple(backend.suffix for backend in _backends().values() if backend.idx_file is not None)
    return {idx_name(name) for name in shards if name.endswith(with_idx)}


@functools.cache  # (the registry is fixed for the process)
def output_file_names() -> frozenset[str]:
    """The names any format writes beside a whole output for other readers (wids'
    shardindex.json): what `Backend.output_files` makes, whose names do not depend on the shards."""
    names: set[str] = set()
    for backend in _backends().values():
        if backend.output_files is not None:
            names.update(name for name, _ in backend.output_files([]))
    return frozenset(names)
