"""`shardkit merge OUT_A OUT_B ... OUT`: one output from several packed alike, without decoding or
encoding a record.

The outputs' shards follow one another in OUT, in the order given, numbered again
(`shard-000000.tar`...); each is a hard link to its source's file (a copy where the two folders
are on different file systems), byte for byte. index.parquet is the sources' rows in the same
order, the shard names changed; errors.jsonl their rows, byte for byte; the manifest sums their
totals and says in `settings.merged` which rows and shards came from which source (by its
manifest's checksum).

What is refused, before anything is written: sources packed otherwise (format, resize, encode,
clips), keys two sources share (`prefix_keys` gives each source's keys its folder's name as a
prefix), and class lists in which one name has two numbers (`relabel` numbers every record by the
merged list, whose first names are the first source's). A prefix or a relabelling changes records,
so those shards are written again record for record (no pixel is decoded), with their key and
label fields changed and nothing else.

OUT is made whole in `.shardkit/next/` under a journal and renamed into place, the manifest last
(changes/journal.py): a kill leaves no output or the merged one, and the same merge with `--resume`
finishes it byte for byte. A merge into a bucket is bucket_merge.py's; an output in a bucket merged
into a local folder is downloaded first (into the cache), then merged as a local one. What both
make is merged.py's.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..core.errors import ConfigError, ManifestError, OutputError, describe
from ..core.manifest import (
    MANIFEST_NAME,
    Manifest,
    ShardInfo,
    idx_name,
    read_manifest,
)
from ..core.safeio import regular_size
from ..packing.dedup import same_file
from ..packing.working_folder import state_dir
from ..storage.store import Store
from ..storage.urls import is_remote
from .journal import Changing, Journal, creating, pending_change
from .merged import (
    MergeResult,
    Place,
    Source,
    asked_for,
    check_rewrites,
    local_source,
    located,
    made_by,
    planned,
    refuse_named_twice,
    result_of,
    source_name,
    write_merged,
)


def merge(
    sources: Sequence[str | os.PathLike[str]],
    output: str | os.PathLike[str],
    *,
    prefix_keys: bool = False,
    relabel: bool = False,
    resume: bool = False,
    progress: Callable[[int, int], None] | None = None,
    storage_options: dict[str, Any] | None = None,
) -> MergeResult:
    """Merge the local outputs `sources` (two or more, packed alike) into the new folder `output`.
    `prefix_keys` starts each source's keys with its folder's name and '/'; `relabel` numbers
    labels by the merged class list where a source's numbers would mean other classes. `resume`
    finishes an interrupted merge of the same sources (so does the same merge run again).
    `progress(done, total)` counts shards put in place. Outputs in buckets of one store merge into
    a new prefix there, their shards copied server-side, a local output's uploaded (bucket_merge.py;
    `storage_options` reach the store); an output in a bucket merged into a local folder is
    downloaded first (`_downloaded`), each file checked against its manifest."""
    if not isinstance(sources, (str, os.PathLike)) and is_remote(output):
        if len(sources) < 2:
            raise ConfigError("merge needs two or more outputs to merge, then the folder to make")
        from .bucket_merge import merge_in_bucket

        return merge_in_bucket(
            [os.fspath(source) for source in sources], os.fspath(output), storage_options=storage_options,
            prefix_keys=prefix_keys, relabel=relabel, progress=progress,
        )  # fmt: skip
    if storage_options and not any(is_remote(source) for source in sources):
        raise ConfigError("storage options reach outputs in a bucket; these are local folders")
    started = time.perf_counter()
    folders = _checked_sources(sources, output, storage_options)
    pending = pending_change(Path(output)) if os.path.isdir(output) else None
    if pending is not None and pending.action == "merge" and pending.committing:
        # its next/ holds the whole merged output, checked when it was written: finished whatever
        # became of the sources since
        with creating(output) as changed:
            if changed.pending is not None and changed.pending.committing:
                return _finish(changed, changed.pending, started, folders, prefix_keys, relabel)
    # every check of the sources, before OUT is made or touched
    with _downloaded(folders) as (read, fetch):
        plan, request = planned(read, prefix_keys, relabel)
        done = _done_already(output, plan, started)  # (before an output in a bucket is downloaded)
        if done is not None:
            return done
        fetch()
        check_rewrites(read, plan)
        return _merge(
            read, output, plan, request, started, progress,
            lambda changed, pending: _finish(changed, pending, started, folders, prefix_keys, relabel),
        )  # fmt: skip


def _merge(
    read: list[Source],
    output: str | os.PathLike[str],
    plan: dict[str, Any],
    request: str,
    started: float,
    progress: Callable[[int, int], None] | None,
    finish: Callable[[Changing, Journal], MergeResult],
) -> MergeResult:
    """The merge of the checked sources `read` as `plan` says, into `output` (`finish`: an
    interrupted merge's commit found there, finished)."""
    with creating(output) as changed:
        pending = changed.pending
        if pending is not None and pending.committing:
            return finish(changed, pending)
        if pending is not None and pending.request != request:
            raise OutputError(
                f"{output}: an interrupted merge of other sources (or of sources changed since) is here; "
                f"delete {output} to start again"
            )
        if pending is None and changed.manifest.version:  # a finished output: this merge's, or refused
            if made_by(changed.manifest, plan, lambda name: regular_size(Path(output) / name)):
                done = result_of(str(output), plan, changed.manifest, {}, time.perf_counter() - started, False)
                return replace(done, already_complete=True)
            raise OutputError(f"{output}: holds an output already; merge into a new folder")
        journal = Journal("merge", request, "", 1, plan)
        if pending is None:
            changed.begin(journal)
        else:
            changed.restart()  # (written again whole: links are cheap, and a rewrite is what it was)
        result = write_merged(changed.next, changed.output, journal, read, linked_into(changed.next), progress)
        changed.ready(journal, result)
        changed.commit(journal)
    return result_of(str(output), plan, result, journal.plan, time.perf_counter() - started, pending is not None)


def _finish(
    changed: Changing, pending: Journal, started: float, folders: list[Path | Store], prefix_keys: bool, relabel: bool
) -> MergeResult:
    """An interrupted merge's commit, finished whatever merge was asked for (it is committed); one
    of other sources or flags is then refused, saying so."""
    result = changed.next_manifest() or _committed(changed.output)
    if result.checksum != pending.result or result.computed_checksum() != result.checksum:
        raise OutputError(f"{changed.output}: the merged output an interrupted merge wrote is damaged; delete it")
    changed.commit(pending)
    plan = pending.plan
    if not asked_for(plan, [source_name(folder) for folder in folders], prefix_keys, relabel):
        raise OutputError(
            f"{changed.output}: held an interrupted merge of other outputs, finished now; merge into a new folder"
        )
    return result_of(str(changed.output), plan, result, plan, time.perf_counter() - started, True)


def _committed(output: Path) -> Manifest:
    """The manifest a committed merge put in place (gone only where someone deleted it)."""
    try:
        return read_manifest(output)
    except ManifestError:
        raise OutputError(
            f"{output}: its merge was committed, but its manifest is gone (deleted?); merge again into a new folder"
        ) from None


def _checked_sources(
    sources: Sequence[str | os.PathLike[str]], output: str | os.PathLike[str], storage_options: dict[str, Any] | None
) -> list[Path | Store]:
    """Two or more outputs, local folders or in buckets (not over HTTP: merged locally, it would be
    read whole anyway, but a bucket is what `storage_options` reach), each once, no folder holding
    or inside `output`."""
    if isinstance(sources, (str, os.PathLike)) or len(sources) < 2:
        raise ConfigError("merge needs two or more outputs to merge, then the folder to make")
    folders = [located(source, storage_options) for source in sources]
    refuse_named_twice(folders)
    target = os.path.realpath(output)
    for folder in folders:
        path = "" if isinstance(folder, Store) else os.path.realpath(folder)
        if path and (target == path or target.startswith(path + os.sep) or path.startswith(target + os.sep)):
            raise ConfigError(f"{output}: overlaps {folder}; merge into a folder of its own")
    return folders


def _done_already(output: str | os.PathLike[str], plan: dict[str, Any], started: float) -> MergeResult | None:
    """Where `output` holds a finished output and no unfinished change: this merge's (done already),
    or another (refused); None where the merge is to be made (the same checks are made again
    under the output's lock)."""
    path = Path(output)
    if not (path / MANIFEST_NAME).is_file() or pending_change(path) is not None:
        return None
    try:
        manifest = read_manifest(path)
    except ManifestError:
        return None  # (said under the lock)
    if not made_by(manifest, plan, lambda name: regular_size(path / name)):
        raise OutputError(f"{output}: holds an output already; merge into a new folder")
    if os.path.lexists(state_dir(path)):
        return None  # (what a kill as it ended left is tidied under the lock)
    done = result_of(str(output), plan, manifest, {}, time.perf_counter() - started, False)
    return replace(done, already_complete=True)


@contextlib.contextmanager
def _downloaded(folders: list[Path | Store]) -> Iterator[tuple[list[Source], Callable[[], None]]]:
    """The sources checked, and what downloads the shards of those in a bucket: each output in a
    bucket is read into a folder of the cache of this run's own (`_claimed_view`, deleted after):
    its manifest, index.parquet and errors.jsonl at once, checked against its manifest; its shards
    and .idx files when `fetch()` is called (once the merge knows it has work), checked too, so
    that the merge links them as a local output's. What killed runs left there goes first."""
    from ..storage.cache import default_cache_dir
    from .bucket_merge import fetch_shards, read_source

    under = default_cache_dir() / "merge-sources"
    held: list[tuple[Path, int]] = []
    try:
        read, far = [], []
        for folder in folders:
            if isinstance(folder, Path):
                read.append(local_source(folder))
                continue
            if not held:
                _sweep(under)
            held.append(_claimed_view(under, folder.url))
            source = read_source(folder, held[-1][0])
            read.append(source)
            far.append((folder, source))

        def fetch() -> None:
            for store, source in far:
                fetch_shards(store, source, with_idx=True)

        yield read, fetch
    finally:
        for view, fd in held:
            if not os.path.islink(view):
                shutil.rmtree(view, ignore_errors=True)
            with contextlib.suppress(OSError):
                os.unlink(f"{view}{_LOCK}")
            os.close(fd)


_LOCK = ".lock"  # beside each download folder: held (flock) by the run it is for


def _claimed_view(under: Path, url: str) -> tuple[Path, int]:
    """A download folder's name of this run's own for the output at `url`, and the open lock file
    beside it, held while the run lives (a kill -9 lets go of it: the next merge deletes both)."""
    import fcntl
    import tempfile

    under.mkdir(parents=True, exist_ok=True)
    fd, lock = tempfile.mkstemp(prefix=hashlib.sha256(url.encode()).hexdigest()[:16] + "-", suffix=_LOCK, dir=under)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return Path(lock.removesuffix(_LOCK)), fd


def _sweep(under: Path) -> None:
    """The download folders of merges no longer running (their lock files let go), deleted."""
    import fcntl

    for lock in under.glob(f"*{_LOCK}") if under.is_dir() else []:
        try:
            fd = os.open(lock, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # (a merge that is running holds it)
            os.close(fd)
            continue
        try:
            view = Path(str(lock).removesuffix(_LOCK))
            if not view.is_symlink():
                shutil.rmtree(view, ignore_errors=True)
            lock.unlink(missing_ok=True)
        finally:
            os.close(fd)


def linked_into(folder: Path) -> Place:
    """A local merge's placing: a hard link into `folder`, a copy where the link cannot be made."""

    def place(
        source: Source, old: ShardInfo, new: str, companion: ShardInfo | None
    ) -> tuple[ShardInfo, ShardInfo | None, int]:
        info, placed = _link(source.folder, folder, old, new, companion)
        here = same_file(str(folder / new))
        # (a bucket's shard was downloaded: its bytes were written here, if into the cache first)
        copied = here is None or here != same_file(str(source.folder / old.name)) or is_remote(source.path)
        return info, placed, info.bytes if copied else 0

    return place


def _link(
    source: Path, folder: Path, old: ShardInfo, new: str, companion: ShardInfo | None
) -> tuple[ShardInfo, ShardInfo | None]:
    """`old` (and its .idx file) under its new name in `folder`: a hard link, or a copy across file
    systems; its size must be the manifest's (a shard changed since would come in unnoticed)."""
    pairs = [(old.name, new, old)]
    if companion is not None:
        pairs.insert(0, (companion.name, idx_name(new), companion))
    for name, target, info in pairs:
        path = folder / target
        path.unlink(missing_ok=True)
        try:
            os.link(source / name, path)
        except OSError as error:
            if error.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
                raise OutputError(f"{source / name}: cannot link it ({describe(error)})") from None
            shutil.copyfile(source / name, path)
        if path.stat().st_size != info.bytes:
            raise OutputError(
                f"{source / name}: differs from its manifest (bytes changed); `shardkit verify` says more"
            )
    moved = replace(old, name=new)
    return moved, None if companion is None else replace(companion, name=idx_name(new))
