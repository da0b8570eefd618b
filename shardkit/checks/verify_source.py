"""verify's `--source`: every source file is packed or in errors.jsonl, once for each time the
source names it, compared by hashes of the paths, the source walked as the pack walked it."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import numpy as np

from ..core.config import TableConfig, WebConfig
from ..core.errors import ConfigError, ManifestError
from ..core.manifest import ERRORS_NAME, Manifest
from ..packing.sources import SourceWalk, display, walk
from .verify_hashes import hashes, joined
from .verify_manifest import ErrorLog, error_rows
from .verify_report import Problem, VerifyReport
from .verify_shard import ShardCheck


def walked_as(manifest: Manifest | ManifestError | None) -> dict[str, Any]:
    """How the pack walked its source, from its manifest's settings (untrusted: a setting that is
    not what pack writes is left out, and the walk is the plain one)."""
    settings = manifest.settings if isinstance(manifest, Manifest) else {}
    how: dict[str, Any] = {"sidecars": settings.get("sidecars") is True}
    table = settings.get("table")
    if isinstance(table, dict):
        with contextlib.suppress(TypeError, ValueError, ConfigError):
            how["table"] = TableConfig(**table)
    clips = settings.get("clips")
    if isinstance(clips, dict) and clips.get("seconds") is not None:  # videos cut into clips: a video an input
        how["videos"] = True
    web = settings.get("web")
    if isinstance(web, dict) and isinstance(web.get("url_column"), str):
        with contextlib.suppress(ConfigError):
            how["web"] = WebConfig(url_column=web["url_column"])
    return how


def check_source(
    log: ErrorLog,
    found: SourceWalk,
    packed: np.ndarray,
    shallow_pass: Callable[[], Iterator[ShardCheck]],
    report: VerifyReport,
    how: dict[str, Any],
    appended: bool = False,
) -> None:
    """Every source input packed or in errors.jsonl, once for each time the source names it (a URL
    table's repeated URL: packed once, each later row listed); compared by hashes of the paths (a
    walk of the source streamed beside them), the names looked up again only for those at fault.
    An output with appends (`appended`) holds other sources' inputs, whose paths may be the
    source's own: only what is lost is said, not what is counted otherwise."""
    if found.runs is not None:
        walked = [hashes([display(rel) for rel in run.relpaths]) for run in found.runs]
    else:
        walked = [hashes([display(item.relpath) for item in found.items])]
    takeable = joined(walked)  # what pack may pack
    refused = hashes([skip.path for skip in found.skipped])  # what the walk itself lists, never packed
    if how.get("videos"):  # a video's clips all name it: packed once, however many clips it gave
        # (a clip `shardkit remove` took out is a clip of a video packed, not an input listed)
        removed = hashes([row["path"] for row in error_rows(log, None) if row.get("stage") == "removed"])
        packed = np.unique(np.concatenate([packed, removed]))
        logged = hashes([row["path"] for row in error_rows(log, None) if row.get("stage") != "removed"])
    else:
        logged = hashes([row["path"] for row in error_rows(log, None)])
    if found.source.shares_files:  # rows of one video: it may be packed by some and listed by others
        takeable, refused = np.unique(np.concatenate([takeable, refused])), refused[:0]
        packed, logged = np.unique(packed), np.setdiff1d(logged, packed)
    tally = Tally.of(takeable, refused, packed, logged)
    lost = tally.lost()
    if lost:  # a second walk, streamed too: only the names at fault are kept
        again = walk(found.root, labels="none", keys=False, storage_options=found.options, **how)
        names = {name for name in (display(item.relpath) for item in again.items) if hash(name) in lost}
        names.update(skip.path for skip in again.skipped if hash(skip.path) in lost)
        for path in sorted(names):
            report.problems.append(Problem("lost", f"source file {path} is neither packed nor in {ERRORS_NAME}"))
    wrong = {} if appended else tally.miscounted()
    if wrong:
        named = {path for check in shallow_pass() for path in check.sources if hash(path) in wrong}
        named.update(row["path"] for row in error_rows(log, None) if hash(row["path"]) in wrong)
        for path in sorted(named):
            report.problems.append(_miscounted(path, *wrong[hash(path)]))


class Tally(NamedTuple):
    """Each path's counts, by hash: named by the source (`takeable` of them packable), packed, and
    listed in errors.jsonl."""

    values: np.ndarray  # the path hashes, sorted, each once
    named: np.ndarray
    takeable: np.ndarray
    packed: np.ndarray
    logged: np.ndarray

    @classmethod
    def of(cls, takeable: np.ndarray, refused: np.ndarray, packed: np.ndarray, logged: np.ndarray) -> Tally:
        values = np.unique(np.concatenate([takeable, refused, packed, logged]))

        def count(hashed: np.ndarray) -> np.ndarray:
            return np.bincount(np.searchsorted(values, hashed), minlength=len(values))

        can = count(takeable)
        return cls(values, can + count(refused), can, count(packed), count(logged))

    def lost(self) -> set[int]:
        """The paths the source names that are neither packed nor listed."""
        return set(self.values[(self.named > 0) & (self.packed + self.logged == 0)].tolist())

    def miscounted(self) -> dict[int, tuple[int, int, int, int]]:
        """(named, takeable, packed, logged) of each path accounted for, but not once for each time
        the source names it (or packed more often than it may be, or not in the source at all)."""
        accounted = self.packed + self.logged
        bad = (accounted > 0) & ((accounted != self.named) | (self.packed > self.takeable))
        rows = zip(*(part[bad].tolist() for part in self), strict=True)
        return {value: (named, takeable, packed, logged) for value, named, takeable, packed, logged in rows}


def _miscounted(path: str, named: int, takeable: int, packed: int, logged: int) -> Problem:
    if named == 0:
        return Problem("extra", f"{path} is packed or listed but not in the source")
    accounted = packed + logged
    if named == 1 and packed <= takeable:
        return Problem("duplicate-source", f"{path} is accounted for {accounted} times")
    detail = (
        f"{path} is named {_times(named)} in the source but packed {_times(packed)} and listed {_times(logged)}"
        f" in {ERRORS_NAME}: each time it is named, it is packed or listed once, packed at most {_times(takeable)}"
    )
    return Problem("lost" if accounted < named else "duplicate-source", detail)


def _times(count: int) -> str:
    return "once" if count == 1 else f"{count} times"
