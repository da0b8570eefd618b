"""Typed errors, and the record of an input that was not packed. Library code raises these; only
the CLI turns them into messages and exit codes."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

FAILURE_STAGES = (
    "discover", "download", "header", "read", "decode", "resize", "encode", "duplicate", "internal", "removed",
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class Failure:
    """An input that was not taken, and why: what discover skips, what pack cannot pack, a row of
    errors.jsonl. `path` is relative to the source and printable; `stage` is one of FAILURE_STAGES
    ("internal": a shardkit bug, not a bad image; "removed": taken out by `shardkit remove`, with
    the reason given; "duplicate": left out by pack --dedup, a copy of
    the record keyed `duplicate_of`; "download": a URL that could not be fetched, `transient` when
    the cause may pass (a timeout, a 5xx, a 429), so `pack --resume` tries that row again)."""

    path: str
    stage: str
    reason: str
    duplicate_of: str | None = None
    transient: bool = False
    cause: str | None = None  # a download's failure in a word ("404", "timeout", "not-image"): counted per cause
    # the row's key, where rows are told apart by row and not by path: a table of URLs' rows, whose
    # paths are URLs with their credentials redacted (two rows may show as one URL)
    key: str | None = None

    def to_json(self) -> dict[str, Any]:
        row: dict[str, Any] = {"path": self.path, "stage": self.stage, "reason": self.reason}
        if self.key is not None:
            row["key"] = self.key
        if self.duplicate_of is not None:
            row["duplicate_of"] = self.duplicate_of
        if self.transient:
            row["transient"] = True
        if self.cause is not None:
            row["cause"] = self.cause
        return row


def describe(error: BaseException, *, with_type: bool = False) -> str:
    """Why `error` happened, in one line of at most 300 characters and without the path (callers
    name the file): an OSError's own words ("No such file or directory"), else the first line of
    its message (h5py's carry HDF5's whole error stack), else its type's name. `with_type` puts
    the type's name first, for messages that mean little alone (a struct.error from a plugin)."""
    if not with_type and isinstance(error, OSError) and error.strerror:
        return error.strerror[:300]
    line = next((text.strip() for text in str(error).splitlines() if text.strip()), "")
    name = type(error).__name__
    if not line:
        return name
    return (f"{name}: {line}" if with_type else line)[:300]


class ShardkitError(Exception):
    """Base class: a problem the user can act on, described in one line."""


class ConfigError(ShardkitError):
    """A bad flag, preset or combination of settings, refused before any work starts."""


class SourceError(ShardkitError):
    """The source folder or list cannot be read as a whole (missing, not a folder, empty...)."""


class OutputError(ShardkitError):
    """The output folder cannot be used (not writable, not empty, resumed with other settings...)."""


class ImageError(ShardkitError):
    """One image could not be processed; carries the stage that failed so it can be logged."""

    def __init__(self, stage: str, reason: str) -> None:
        super().__init__(f"{stage}: {reason}")
        self.stage = stage
        self.reason = reason


class ShardFormatError(ShardkitError):
    """A shard file is damaged, hostile or not what its manifest says."""


class ManifestError(ShardFormatError):
    """manifest.json or errors.jsonl is missing, damaged, hostile or inconsistent."""


class ShardReadError(ShardkitError):
    """A record could not be read or decoded; names the shard and the key."""


class StorageError(ShardkitError):
    """Object storage refused a request (denied access, an object over its limit) or, as
    StoreUnreachable, stayed unreachable through the retry window; names the URL."""


class StoreUnreachable(StorageError):
    """Object storage stayed unreachable through the whole retry window. The store's fault, not
    one input's: a pack stops on it (and finishes with --resume once the store answers), where a
    missing or denied object is one input not packed."""


class WorkerDiedError(ShardkitError):
    """A worker process ended abruptly (killed, out of memory, crashed in native code)."""


class HeaderError(ValueError):
    """The bytes are not a readable image header; the message is the reason and `kind` the class
    of problem probe reports it under. A ValueError, not a ShardkitError: it never reaches the user
    as such (probe and pack record it per file)."""

    def __init__(self, reason: str, kind: str = "corrupt header") -> None:
        super().__init__(reason)
        self.kind = kind


class MissingDependencyError(ShardkitError):
    """An optional dependency is needed; the message names the extra to install."""


def missing_extra(module: str, extra: str) -> MissingDependencyError:
    return MissingDependencyError(
        f"{module} is not installed: pip install 'shardkit[{extra}]' (or make install EXTRAS={extra})"
    )


def require(module: str, extra: str) -> Any:
    """An optional dependency, imported where it is used; MissingDependencyError naming the extra
    to install when it is missing."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise missing_extra(module.split(".")[0], extra) from None
