"""`shardkit index`: adopt WebDataset tars someone else wrote (img2dataset's output, anyone's `tar` of
a folder), so that verify, open_shards, the loader and bench work on them as on shardkit's own.

The tars are read, never modified or moved. Each is scanned once in a worker process (streamed: its
sha256, then its headers, then its records as open_shards reads them; memory bounded by one record),
and beside them go `manifest.json` (counts, bytes, sha256, the extensions samples hold, classes from
`.cls` members, or with `folder_labels` from the keys' folders), `errors.jsonl` (what readers leave
out, and why), each tar's DALI index and wids' `shardindex.json`. What is listed and not fatal: a
sample with no image member (the readers skip it), a member that is not a regular file (but a
folder: a tar of a tree stores them) or is in no sample (no extension, hidden), a key that another
tar holds too. A tar the readers cannot read whole (damaged, a key twice in it, a label that is not
a number) or whose file name is not UTF-8 (JSON cannot hold it) is left out of the manifest with its
reason. Keys are compared as 8-byte hashes, so memory is ~8 bytes a sample.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from ..core.config import check_workers
from ..core.errors import (
    ConfigError,
    Failure,
    ManifestError,
    OutputError,
    ShardFormatError,
    ShardkitError,
    StorageError,
    describe,
)
from ..core.manifest import (
    MANIFEST_NAME,
    STATE_DIR,
    WIDS_NAME,
    Manifest,
    ShardInfo,
    idx_name,
    info_of,
    sha256_file,
    wids_index,
)
from ..core.safeio import check_regular, open_regular
from ..core.version import __version__
from ..formats.folder_labels import FOLDER_LABELS, key_folder
from ..formats.tar_companions import dali_index_of, dali_samples
from ..formats.tar_headers import READ_AHEAD, FileBytes
from ..formats.webdataset import OTHER_PARTS, TarShardReader
from ..runtime.pools import default_workers, map_local_surviving_crashes
from ..storage.store import Store
from .adopt_place import TarPlace, tar_place
from .sources.item import display, label_problem
from .sources.rows import is_utf8

ADOPTED_BY = f"shardkit {__version__} index"
# Class names "0".."n-1" are written for labels below this; past it (another tool's `.cls` of
# 99999999999) the manifest names no classes and says why. ImageNet-21k's 21,841 fit with room.
MAX_CLASS_NAMES = 100_000
# The member extensions the manifest counts one by one (the most common; the rest as one count): a
# tar of a million distinct extensions must not make a manifest no reader takes (MAX_MANIFEST_BYTES).
MAX_EXTENSIONS = 100
_MAX_EXTENSION_CHARS = 32


@dataclass
class TarScan:
    """One tar as the readers see it."""

    name: str
    size: int = 0  # bytes
    sha256: str = ""
    count: int = 0  # records (samples with an image member)
    labels: int = 0  # the largest `.cls` label + 1 (0: none)
    extensions: dict[str, int] = field(default_factory=dict)  # members by extension
    key_hashes: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint64))
    problems: list[Failure] = field(default_factory=list)  # listed, not fatal
    dali_index: bytes | None = None  # its DALI index (the .idx companion)
    folders: set[str] = field(default_factory=set)  # its keys' first folders (MAX_CLASS_NAMES + 1 at most)
    unfoldered: int = 0  # records whose key is in no folder
    unreadable: str | None = None  # why the tar is left out


@dataclass
class IndexResult:
    folder: str
    manifest: Manifest
    tars: int  # found
    adopted: int  # in the manifest
    records: int
    errors: int
    bytes: int
    seconds: float
    extensions: dict[str, int]  # the MAX_EXTENSIONS most common
    other_extensions: dict[str, int] = field(default_factory=dict)  # {kinds, members} of the rest
    unnamed_labels: int | None = None  # the largest label, when there are too many to name classes


@dataclass(frozen=True)
class _Job:
    folder: str  # the tars' folder, or a temporary one a remote tar is downloaded into
    name: str
    store: Store | None = None


def key_hash(key: str) -> int:
    """A stable 8-byte hash of a key (the same in every process, unlike hash())."""
    return int.from_bytes(hashlib.blake2b(key.encode("utf-8", "surrogateescape"), digest_size=8).digest(), "little")


def scan_tar(job: _Job) -> TarScan:
    """One tar's scan (in a worker process): a problem with it is its result, never an exception."""
    path = os.path.join(job.folder, job.name)
    try:
        if job.store is not None:
            job.store.get(job.name, path)
        return _scanned(path, job.name)
    except (ShardkitError, OSError) as error:
        text = str(error) if isinstance(error, ShardkitError) else describe(error)
        return TarScan(job.name, unreadable=text)
    finally:
        if job.store is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


def _scanned(path: str, name: str) -> TarScan:
    scan = TarScan(name, size=check_regular(path).st_size)
    scan.sha256 = sha256_file(path)
    extensions: Counter[str] = Counter()
    imageless: dict[str, list[str]] = {}  # key -> its members' extensions
    try:
        fd = open_regular(path)
        try:  # the samples and their members, from the headers, as DALI and webdataset group them
            skipped: list[tuple[str, str]] = []
            unnamed: list[str] = []  # members no reader takes as part of a sample
            samples = list(dali_samples(FileBytes(fd, scan.size, READ_AHEAD), path, skipped, unnamed))
            for sample in samples:
                extensions.update(ext for ext, _, _, _ in sample)
                if {ext for ext, _, _, _ in sample} <= OTHER_PARTS:
                    key = sample[0][3][: -len(sample[0][0]) - 1]  # the member name less its extension
                    imageless.setdefault(key, []).extend(f".{ext}" for ext, _, _, _ in sample)
            for member, kind in skipped:
                if kind == "a folder":  # a tar of a tree stores its folders: nothing a reader takes or misses
                    continue
                scan.problems.append(Failure(f"{name}/{member}", "index", f"not a regular file ({kind}): left out"))
            for member in unnamed:  # readers (webdataset's, DALI's) skip these: inputs = records + errors
                why = "a hidden file" if member.rpartition("/")[2].startswith(".") else "no extension"
                scan.problems.append(Failure(f"{name}/{member}", "index", f"{why}, so no sample's member: left out"))
        finally:
            os.close(fd)
        reader = TarShardReader(path)  # the records, as open_shards reads them: all of it must read
        apart: set[str] = set()  # keys of imageless samples whose image is another sample of the tar
        try:
            hashes = []
            for record in reader:
                hashes.append(key_hash(record.key))
                folder = key_folder(record.key)
                if folder is None:
                    scan.unfoldered += 1
                elif len(scan.folders) <= MAX_CLASS_NAMES:  # (bounded: another tool's tar may have a million)
                    scan.folders.add(folder)
                if record.key in imageless:
                    apart.add(record.key)
                if record.label is not None:
                    if problem := label_problem(record.label):  # the label rule a pack keeps
                        raise ShardFormatError(f"{path}: record {record.key}: {problem}")
                    scan.labels = max(scan.labels, record.label + 1)
        finally:
            reader.close()
        scan.count, scan.key_hashes = len(hashes), np.array(hashes, np.uint64)
        scan.dali_index = dali_index_of(samples)  # from the same walk
        for key, exts in imageless.items():
            reason = f"no image member ({', '.join(exts)}): not a record"
            if key in apart:  # `tar cf` stores a folder's files in the order the disk lists them
                reason += "; the image is elsewhere in the tar: make tars with `tar --sort=name`"
            scan.problems.append(Failure(f"{name}/{key}", "index", reason))
    except ShardFormatError as error:
        scan.unreadable = str(error)
    scan.extensions = dict(extensions)
    return scan


def adopt_tars(
    folder: str | os.PathLike[str],
    *,
    workers: int | None = None,
    overwrite: bool = False,
    folder_labels: bool = False,
    storage_options: dict[str, Any] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> IndexResult:
    """Adopt the tars in `folder` (a local folder or a URL; the tars at its top level) as a shardkit
    output: see the module's docstring. With `folder_labels`, tars with no `.cls` members made of a
    class-folder tree get their classes from their keys' first folders (in sorted order, as a
    pack's class folders), said in the manifest. Refused before any work: no tars, a manifest already there
    (unless `overwrite`, which replaces only what index writes), a folder that cannot be written."""
    check_workers(workers)
    started = time.perf_counter()
    place = tar_place(folder, storage_options)
    names_here, names, exists = place.names()
    where = place.where
    if not names:
        raise ConfigError(f"{where}: no .tar files at the top of this folder")
    _refuse_a_pack_s_output(place, names_here, exists, overwrite)
    if exists and not overwrite:
        raise OutputError(f"{where}: already has a {MANIFEST_NAME}; use --overwrite to index the tars again")
    with place.work_folder() as work:
        place.refuse_unwritable()  # (before the scan)
        # a name that is not UTF-8 cannot be written in JSON (the manifest names each tar as it is)
        unnamed = [TarScan(name, unreadable=_NOT_UTF8) for name in names if not is_utf8(name)]
        jobs = [_Job(work, name, place.store) for name in names if is_utf8(name)]
        scans: list[TarScan | None] = [None] * len(jobs)

        def crashed(index: int, how: str) -> TarScan:
            return TarScan(jobs[index].name, unreadable=f"reading it crashed the scanning process ({how})")

        for done, (index, scan) in enumerate(
            map_local_surviving_crashes(scan_tar, jobs, workers or default_workers(), crashed), 1
        ):
            scans[index] = scan
            if progress is not None:
                progress(done, len(jobs))
    found = sorted([scan for scan in scans if scan is not None] + unnamed, key=lambda scan: scan.name)
    return _write(place, found, started, folder_labels)


_NOT_UTF8 = "its file name is not UTF-8, which JSON (the manifest, errors.jsonl) cannot hold: rename it to adopt it"


def _refuse_a_pack_s_output(place: TarPlace, names: set[str], exists: bool, overwrite: bool) -> None:
    """index writes only beside tars it adopts: never over what `shardkit pack` wrote (its manifest
    holds class names, totals and index.parquet that errors.jsonl and the index account for), nor
    beside a pack still running or stopped (its working folder, .shardkit/, is there)."""
    where = place.where
    if STATE_DIR in names:
        raise OutputError(
            f"{where}: holds {STATE_DIR}/, the working folder of `shardkit pack` (running, or stopped: "
            "finish it with `shardkit pack --resume`); index adopts tars no pack is writing"
        )
    if not (exists and overwrite):
        return
    try:
        manifest = place.manifest()
    except (ManifestError, StorageError) as error:
        raise OutputError(
            f"{where}: its {MANIFEST_NAME} cannot be read, so who wrote it cannot be told ({error}); "
            f"--overwrite replaces only what `shardkit index` wrote: remove it yourself to index again"
        ) from None
    if not isinstance(manifest.settings.get("adopted"), dict):  # as verify tells adopted tars
        made_by = manifest.created_by or "no created_by"
        raise OutputError(
            f"{where}: written by `shardkit pack` ({MANIFEST_NAME}: created_by {made_by!r}, no settings.adopted); "
            "--overwrite replaces only what `shardkit index` wrote, so this output is left as it is"
        )


def _write(place: TarPlace, scans: list[TarScan], started: float, folder_labels: bool) -> IndexResult:
    where = place.where
    adopted = [scan for scan in scans if scan.unreadable is None]
    folders = _class_folders(where, adopted) if folder_labels else None
    rows = [Failure(scan.name, "read", f"left out: {scan.unreadable}") for scan in scans if scan.unreadable]
    for scan in adopted:
        rows += scan.problems
    rows += _duplicates(place, adopted)
    # JSON must be UTF-8: a path or reason that holds undecodable bytes (a folder's name) is shown
    rows = [replace(row, path=display(row.path), reason=display(row.reason)) for row in rows]
    shards = [ShardInfo(scan.name, scan.count, scan.size, scan.sha256) for scan in adopted]
    described: list[tuple[str, int, bytes]] = [
        (idx_name(scan.name), scan.count, scan.dali_index) for scan in adopted if scan.dali_index is not None
    ]
    described.append((WIDS_NAME, sum(shard.count for shard in shards), wids_index(shards)))
    files = {name: data for name, _, data in described}
    companions = [info_of(name, count, data) for name, count, data in described]
    extensions: Counter[str] = Counter()
    for scan in scans:
        extensions.update(scan.extensions)
    records = sum(shard.count for shard in shards)
    labels = max((scan.labels for scan in adopted), default=0)  # the largest label + 1
    counted, others = _counted_extensions(extensions)
    adopted_settings: dict[str, Any] = {"by": "shardkit index", "tars": len(scans), "extensions": counted}
    if others:
        adopted_settings["other_extensions"] = others
    if labels > MAX_CLASS_NAMES:
        adopted_settings["labels"] = {"largest": labels - 1, "names": "too many to name"}
    classes = [str(label) for label in range(labels)] if labels <= MAX_CLASS_NAMES else []
    if folders is not None:  # readers label each record by its key's folder (formats/folder_labels)
        adopted_settings["labels"] = FOLDER_LABELS
        classes = folders
        unfoldered = sum(scan.unfoldered for scan in adopted)
        if unfoldered:
            adopted_settings["records_in_no_folder"] = unfoldered
    manifest = Manifest(
        format="webdataset",
        shards=shards,
        # a tar's labels are numbers: their names, while there are few enough to list
        classes=classes,
        settings={"adopted": adopted_settings, "source": {"path": display(where), "layout": "webdataset tars"}},
        # inputs: the records and what errors.jsonl lists (a duplicated key is a record and listed)
        totals={"inputs": records + len(rows), "records": records, "errors": len(rows)},
        created_by=ADOPTED_BY,
        companions=companions,
    ).sealed()
    errors = "".join(json.dumps(row.to_json(), sort_keys=True) + "\n" for row in rows)
    place.put(files, errors, manifest)
    return IndexResult(
        where, manifest, len(scans), len(adopted), records, len(rows), sum(s.bytes for s in shards),
        time.perf_counter() - started, counted, others, labels - 1 if labels > MAX_CLASS_NAMES else None,
    )  # fmt: skip


def _class_folders(where: str, adopted: list[TarScan]) -> list[str]:
    """--folder-labels' classes: the keys' first folders, sorted; refused where the tars label
    their records themselves, or where no key is in a folder."""
    for scan in adopted:
        if scan.labels:
            raise ConfigError(
                f"{where}: {scan.name} has .cls labels of its own; index it without --folder-labels to keep them"
            )
    folders = sorted(set().union(*(scan.folders for scan in adopted)))
    if not folders:
        raise ConfigError(f"{where}: --folder-labels, but no key is in a folder (a tar of a class-folder tree is)")
    if len(folders) > MAX_CLASS_NAMES:
        raise ConfigError(f"{where}: --folder-labels, but the keys are in over {MAX_CLASS_NAMES:,} folders")
    return folders


def _counted_extensions(extensions: Counter[str]) -> tuple[dict[str, int], dict[str, int]]:
    """(the most common extensions and their members, by name; {"kinds", "members"} of the rest, or
    {} when none are left over): bounded whatever a tar holds."""
    fit = [(ext, count) for ext, count in extensions.items() if len(ext) <= _MAX_EXTENSION_CHARS]
    kept = dict(sorted(sorted(fit, key=lambda pair: (-pair[1], pair[0]))[:MAX_EXTENSIONS]))
    rest = [count for ext, count in extensions.items() if ext not in kept]
    return kept, ({"kinds": len(rest), "members": sum(rest)} if rest else {})


def _duplicates(place: TarPlace, adopted: list[TarScan]) -> list[Failure]:
    """A row per record whose key an earlier tar holds too (found by hash, then named by a second
    read of only the tars involved)."""
    if not adopted:
        return []
    hashes = np.concatenate([scan.key_hashes for scan in adopted])
    owners = np.repeat(np.arange(len(adopted)), [len(scan.key_hashes) for scan in adopted])
    unique, first, counts = np.unique(hashes, return_index=True, return_counts=True)
    repeated = set(unique[counts > 1].tolist())
    if not repeated:
        return []
    first_owner = dict(zip(unique[counts > 1].tolist(), owners[first[counts > 1]].tolist(), strict=True))
    rows = []
    for tar in sorted(set(owners[np.isin(hashes, list(repeated))].tolist())):
        scan = adopted[tar]
        with place.local_copy(scan.name) as path:
            reader = TarShardReader(path)
            try:
                for record in reader:
                    value = key_hash(record.key)
                    if value in repeated and first_owner[value] != tar:
                        earlier = adopted[first_owner[value]].name
                        rows.append(Failure(f"{scan.name}/{record.key}", "duplicate", f"the key is in {earlier} too"))
            finally:
                reader.close()
    return rows
