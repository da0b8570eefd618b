"""verify's `--source`: every source file is packed or in errors.jsonl, once, compared by hashes of
the paths, the source walked as the pack walked it."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

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
) -> None:
    """Every source file packed or in errors.jsonl, once; compared by hashes of the paths (a walk
    of the source streamed beside them), the names looked up again only for the files at fault."""
    if found.runs is not None:
        walked = [hashes([display(rel) for rel in run.relpaths]) for run in found.runs]
    else:
        walked = [hashes([display(item.relpath) for item in found.items])]
    walked.append(hashes([skip.path for skip in found.skipped]))
    expected = np.unique(joined(walked))
    if how.get("videos"):  # a video's clips all name it: packed once, however many clips it gave
        packed = np.unique(packed)
    logged = hashes([row["path"] for row in error_rows(log, None)])
    if found.layout == "spans":  # rows of one video: it may be packed by some and listed by others
        packed, logged = np.unique(packed), np.setdiff1d(logged, packed)
    accounted, times = np.unique(np.concatenate([packed, logged]), return_counts=True)
    lost = set(np.setdiff1d(expected, accounted, assume_unique=True).tolist())
    extra = set(np.setdiff1d(accounted, expected, assume_unique=True).tolist())
    twice = set(accounted[(times > 1) & np.isin(accounted, expected)].tolist())
    if lost:  # a second walk, streamed too: only the names at fault are kept
        again = walk(found.root, labels="none", keys=False, storage_options=found.options, **how)
        names = {name for name in (display(item.relpath) for item in again.items) if hash(name) in lost}
        names.update(skip.path for skip in again.skipped if hash(skip.path) in lost)
        for path in sorted(names):
            report.problems.append(Problem("lost", f"source file {path} is neither packed nor in {ERRORS_NAME}"))
    wanted = extra | twice
    if wanted:
        named = Counter(path for check in shallow_pass() for path in check.sources if hash(path) in wanted)
        named.update(row["path"] for row in error_rows(log, None) if hash(row["path"]) in wanted)
        for path in sorted(path for path in named if hash(path) in extra):
            report.problems.append(Problem("extra", f"{path} is packed or listed but not in the source"))
        for path in sorted(path for path, n in named.items() if n > 1 and hash(path) in twice):
            report.problems.append(Problem("duplicate-source", f"{path} is accounted for {named[path]} times"))
