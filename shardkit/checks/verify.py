"""`verify`: prove an output folder is whole, matches its manifest, and (with deep) decodes.

Every problem is data with the shard and key it concerns; nothing here prints. Shards are checked
in parallel, one job per shard. A shard whose size or sha256 is wrong is not opened: its bytes are
not what was written, and a damaged memory-mapped file must not take the checker down with it.

This module is the orchestration: it opens the output (a remote one's manifest read, its index
fetched into a temporary folder, its errors.jsonl streamed by each pass that reads it) and runs the
checks, each a module of its own: the manifest and the folder (`verify_manifest`), each shard
(`verify_shard`), index.parquet (`verify_index`), the source (`verify_source`); the report's types
are in `verify_report`.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from ..changes.journal import pending_change
from ..core.config import DEFAULT_MAX_PIXELS, check_workers
from ..core.errors import ConfigError, ManifestError, ShardkitError
from ..core.manifest import INDEX_NAME, Manifest, ShardInfo, idx_name, read_manifest
from ..formats import get_format
from ..packing.sources import SourceWalk, walk
from ..packing.working_folder import finishing, is_idx_name, is_shard_name
from ..runtime.pools import default_workers, map_local_surviving_crashes
from ..storage.http import TooLong
from ..storage.location import locate
from ..storage.store import Store, read_remote_manifest
from ..storage.urls import is_remote
from .verify_hashes import hashes, joined, repeated
from .verify_index import check_index
from .verify_manifest import ErrorLog, check_manifest, check_output_files, listed_duplicates
from .verify_report import Problem, VerifyReport
from .verify_shard import ShardCheck, ShardToCheck, check_shard
from .verify_source import check_source, walked_as


def verify(
    folder: str | os.PathLike[str],
    *,
    deep: bool = False,
    source: str | os.PathLike[str] | None = None,
    workers: int | None = None,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    progress: Callable[[int, int], None] | None = None,
    storage_options: dict[str, Any] | None = None,
) -> VerifyReport:
    """Check `folder` against its manifest; with `deep`, decode every image (refusing any whose
    header claims more than `max_pixels`); with `source`, check that every source file is either
    packed or listed in errors.jsonl. `folder` may be a URL (s3://..., https://...; see
    open_shards): each shard is downloaded to a temporary folder, checked, and deleted; errors.jsonl
    is streamed, no further than the rows the manifest counts."""
    check_workers(workers)
    if max_pixels < 1:
        raise ConfigError(f"max pixels must be positive, not {max_pixels}")
    started = time.perf_counter()
    # one set of options serves the output and the source: a bucket source's, with a local output
    remote_source_only = source is not None and is_remote(source) and not is_remote(folder)
    with _opened(folder, None if remote_source_only else storage_options) as output:
        found = None
        if source is not None:  # a bad source is refused here, before any shard is read
            # walked as the pack walked it (a table's rows, sidecar samples): the manifest says how
            how = walked_as(output.manifest)
            found = walk(source, labels="none", keys=False, storage_options=storage_options, **how)
        report = _verify(output, deep, found, workers, max_pixels, progress)
    report.seconds = time.perf_counter() - started
    return report


@dataclass
class _Output:
    """What verify reads: the output's name, a local folder holding its manifest and errors.jsonl,
    the names it holds, and for a remote output its store and a temporary folder for shards."""

    name: str
    meta: Path
    store: Store | None = None
    work: str = ""
    manifest: Manifest | ManifestError | None = None
    listed: dict[str, int | None] = field(default_factory=dict)
    troubles: list[Problem] = field(default_factory=list)  # found while fetching what verify reads
    notes: list[str] = field(default_factory=list)


@contextlib.contextmanager
def _opened(folder: str | os.PathLike[str], storage_options: dict[str, Any] | None) -> Iterator[_Output]:
    root = locate(folder, storage_options)
    if isinstance(root, Path):
        output = _Output(str(root), root, work=str(root))
        if not os.path.lexists(root):  # nothing to report on: one line, as every command says it
            raise ConfigError(f"{root}: no such file or folder")
        try:
            output.manifest = read_manifest(root)
        except ShardkitError as error:
            output.manifest = ManifestError(str(error))
        if root.is_dir():
            output.listed = {entry.name: None for entry in os.scandir(root)}  # names only: shards are stat'ed
            output.troubles.extend(_interrupted_change(root))
        yield output
        return
    store = root
    with tempfile.TemporaryDirectory(prefix="shardkit-verify-") as temp:
        shards = os.path.join(temp, "shards")  # apart from errors.jsonl: a shard may be named anything
        os.mkdir(shards)
        output = _Output(store.url, Path(temp), store, shards)
        try:
            output.manifest = read_remote_manifest(store)  # (names a merge under way there)
            output.listed = store.listing()
            _bucket_change(store, output)
            if isinstance(output.manifest, Manifest) and output.manifest.index is not None:
                with contextlib.suppress(FileNotFoundError, TooLong):  # reported by check_index
                    store.get(INDEX_NAME, os.path.join(temp, INDEX_NAME), limit=output.manifest.index.bytes)
        except ShardkitError as error:
            output.manifest = ManifestError(str(error))
        yield output


def _interrupted_change(root: Path) -> list[Problem]:
    """A change (remove) killed in its commit leaves the output between two versions: said as that,
    with what finishes it, before what it left looks like (new shards beside the manifest's)."""
    try:
        journal = pending_change(root)
    except ShardkitError as error:
        return [Problem("interrupted", str(error))]
    if journal is None or not journal.committing:  # (before its commit the output is the version it was)
        return []
    said = f"a {journal.action} to version {journal.version} was interrupted while it committed"
    return [Problem("interrupted", f"{said}; {finishing(root, journal.action, journal.plan)}")]


def _bucket_change(store: Store, output: _Output) -> None:
    """A bucket's change killed once committed (its journal says every new file is up) leaves the
    output between two versions, as a local one's does. Before that (under way, or killed), the
    earlier version is whole, and the new shards it put up beside it are its own, not strays."""
    from ..changes.bucket import BucketChange

    try:
        found = BucketChange(store).journal()
    except ShardkitError as error:
        output.troubles.append(Problem("interrupted", str(error)))
        return
    if found is None:
        return
    journal = found.journal
    if found.uploaded:
        said = f"a change ({journal.action!r}) to version {journal.version} was interrupted while it committed"
        output.troubles.append(Problem("interrupted", f"{said}; {finishing(store.url, journal.action, journal.plan)}"))
        return
    for name in journal.moves:
        if is_shard_name(name) or is_idx_name(name):
            output.listed.pop(name, None)
    output.notes.append(
        f"a change ({journal.action!r}) of this output began and has not committed (it may still be running, or was "
        "killed): the output is the version before it, whole"
    )


def _verify(
    output: _Output,
    deep: bool,
    found: SourceWalk | None,
    workers: int | None,
    max_pixels: int,
    progress: Callable[[int, int], None] | None,
) -> VerifyReport:
    report = VerifyReport(output.name, None)
    report.problems.extend(output.troubles)
    report.notes.extend(output.notes)
    manifest = output.manifest
    if not isinstance(manifest, Manifest):
        report.problems.append(Problem("manifest", str(manifest)))
        return report
    if any(problem.kind == "interrupted" for problem in output.troubles):
        return report  # between two versions: what its files say of either is beside the point
    root = output.meta
    try:
        get_format(manifest.format)
    except ConfigError:
        report.problems.append(Problem("manifest", f"unknown shard format {manifest.format[:40]!r}"))
        return report
    report.format = manifest.format
    report.shards = len(manifest.shards)
    # errors.jsonl read a pass at a time (a remote one streamed), no further than the manifest's count
    log = ErrorLog(root, output.store, manifest.totals.get("errors", 0))
    sealed = check_manifest(log, manifest, get_format(manifest.format), output.listed, report)
    companions = {companion.name: companion for companion in manifest.companions}
    check_output_files(output.meta, output.store, manifest, companions, report)
    jobs = _jobs(output, manifest, companions, deep, max_pixels)
    # 8-byte hashes of every key and source path, not the strings: bounded memory at any size; the
    # strings are read again (a second, shallow pass) only to name what turns out to be wrong
    key_hashes: list[np.ndarray] = []
    source_hashes: list[np.ndarray] = []

    def crashed(index: int, how: str) -> ShardCheck:
        reason = f"reading it crashed the checking process ({how}): the shard is damaged or hostile"
        return ShardCheck([Problem("crashed", reason, jobs[index].shard.name)], [], [], 0)

    by_shard: dict[int, np.ndarray] = {}  # each shard's key hashes in stored order, for the index
    checks = map_local_surviving_crashes(check_shard, jobs, workers or default_workers(), crashed)
    for done, (index, check) in enumerate(checks, 1):
        report.problems.extend(check.problems)
        report.records += len(check.keys)
        report.decoded += check.decoded
        key_hashes.append(hashes(check.keys))
        if not check.problems:  # a damaged shard is reported as such, not as an index that disagrees
            by_shard[index] = key_hashes[-1]
        source_hashes.append(hashes(check.sources))
        if progress is not None:
            progress(done, len(jobs))

    def shallow_pass() -> Iterator[ShardCheck]:
        shallow = [replace(job, deep=False) for job in jobs]
        for _, check in map_local_surviving_crashes(check_shard, shallow, workers or default_workers(), crashed):
            yield check

    if manifest.index is not None and sealed:
        check_index(root, manifest, by_shard, report)  # (an edited manifest's claims are reported already)
    _check_keys(log, manifest, joined(key_hashes), shallow_pass, report)
    if found is not None:
        appended = [entry.get("version") for entry in manifest.history if entry.get("change") == "append"]
        check_source(log, found, joined(source_hashes), shallow_pass, report, walked_as(manifest), bool(appended))
        if appended:
            report.notes.append(
                f"the output holds appends (version {', '.join(map(str, appended))}): --source checked that every "
                "input of the source is packed or listed, not how many times (other sources' paths may be its own)"
            )
    return report


def _jobs(
    output: _Output, manifest: Manifest, companions: dict[str, ShardInfo], deep: bool, max_pixels: int
) -> list[ShardToCheck]:
    """One job per shard in the manifest, with its index for other readers when the manifest lists one."""
    return [
        ShardToCheck(
            output.work,
            shard,
            manifest.format,
            len(manifest.classes),
            deep,
            max_pixels,
            output.store,
            output.listed.get(shard.name),
            companions.get(idx_name(shard.name)),
        )
        for shard in manifest.shards
    ]


def _check_keys(
    log: ErrorLog,
    manifest: Manifest,
    key_hashes: np.ndarray,
    shallow_pass: Callable[[], Iterator[ShardCheck]],
    report: VerifyReport,
) -> None:
    """Every key stored once: a hash seen twice sends a shallow pass to name the keys (an adopted
    output's keys that errors.jsonl lists as found in two tars excepted)."""
    twice = set(repeated(key_hashes).tolist())
    if twice:
        times = Counter(key for check in shallow_pass() for key in check.keys if hash(key) in twice)
        listed = listed_duplicates(log) if isinstance(manifest.settings.get("adopted"), dict) else set()
        for key in sorted(key for key, n in times.items() if n > 1 and key not in listed):
            report.problems.append(Problem("duplicate-key", f"key stored {times[key]} times", key=key))
