"""`verify`: prove an output folder is whole, matches its manifest, and (with deep) decodes.

Every problem is data with the shard and key it concerns; nothing here prints. Shards are checked
in parallel, one job per shard. A shard whose size or sha256 is wrong is not opened: its bytes are
not what was written, and a damaged memory-mapped file must not take the checker down with it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from ..core.config import DEFAULT_MAX_PIXELS, TableConfig, check_workers
from ..core.errors import (
    ConfigError,
    ImageError,
    ManifestError,
    ShardFormatError,
    ShardkitError,
    StorageError,
    describe,
)
from ..core.manifest import (
    ERRORS_NAME,
    INDEX_NAME,
    MANIFEST_NAME,
    Manifest,
    ShardInfo,
    idx_name,
    iter_errors,
    read_manifest,
    sha256_file,
)
from ..core.pools import default_workers, map_local_surviving_crashes
from ..core.safeio import check_regular
from ..formats import get_format
from ..formats.base import Backend, Record
from ..packing.sources import SourceWalk, display, walk
from ..readers.decode import decode
from ..storage.http import TooLong
from ..storage.location import locate
from ..storage.store import Store, read_remote_manifest

MAX_ERRORS_BYTES = 1 << 30  # a remote errors.jsonl verify fetches (~7 M rows)


@dataclass(frozen=True)
class Problem:
    kind: str  # manifest, missing, stray, size, checksum, count, unreadable, duplicate-key, label, decode, ...
    detail: str
    shard: str | None = None
    key: str | None = None


@dataclass
class VerifyReport:
    folder: str
    format: str | None
    shards: int = 0
    records: int = 0
    decoded: int = 0
    seconds: float = 0.0
    problems: list[Problem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what was seen and is fine (e.g. a reader's lock files)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


@dataclass(frozen=True)
class _ShardJob:
    folder: str
    shard: ShardInfo
    format: str
    classes: int
    deep: bool
    max_pixels: int = DEFAULT_MAX_PIXELS
    store: Store | None = None  # a remote output: the shard is downloaded into `folder` (a temp folder)
    held: int | None = None  # the remote object's size from the listing, when it tells one
    companion: ShardInfo | None = None  # the shard's index for other readers, as the manifest lists it


@dataclass
class _ShardCheck:
    problems: list[Problem]
    keys: list[str]
    sources: list[str]
    decoded: int


def _check_shard(job: _ShardJob) -> _ShardCheck:
    """One shard's problems. Runs in a child process; an exception that is not a shardkit error is
    a bug in shardkit, reported as such (never a traceback, and never blamed on the shard)."""
    try:
        return _checked_shard(job)
    except Exception as error:
        detail = f"internal error while checking it (a shardkit bug, please report): {describe(error, with_type=True)}"
        return _ShardCheck([Problem("internal", detail[:500], job.shard.name)], [], [], 0)


def _checked_shard(job: _ShardJob) -> _ShardCheck:
    if job.store is None:
        return _checked_file(job)
    name, path = job.shard.name, _local(job, job.shard.name)
    if job.held is not None and job.held != job.shard.bytes:  # the listing's size, when it tells one
        return _ShardCheck([Problem("size", f"{job.held:,} bytes, manifest says {job.shard.bytes:,}", name)], [], [], 0)
    try:
        job.store.get(name, path, limit=job.shard.bytes)  # size and sha256 are checked below, as for a file
        if job.companion is not None:
            with contextlib.suppress(FileNotFoundError, TooLong):  # reported as missing or changed below
                job.store.get(job.companion.name, _local(job, job.companion.name), limit=job.companion.bytes)
        return _checked_file(job)
    except TooLong:
        detail = f"more than the {job.shard.bytes:,} bytes the manifest says"
        return _ShardCheck([Problem("size", detail, name)], [], [], 0)
    except FileNotFoundError:
        return _ShardCheck([Problem("missing", "listed in the manifest but not in the bucket", name)], [], [], 0)
    except StorageError as error:
        return _ShardCheck([Problem("unreadable", str(error), name)], [], [], 0)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        if job.companion is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(_local(job, job.companion.name))


def _local(job: _ShardJob, name: str) -> str:
    """Where `name` is read from: in the output folder itself, or for a remote output under a name
    of our own in the temporary folder (a bucket's object names need not be names a file can have:
    over 255 bytes, say)."""
    if job.store is None:
        return os.path.join(job.folder, name)
    return os.path.join(job.folder, hashlib.sha256(name.encode("utf-8", "surrogateescape")).hexdigest()[:32])


def _checked_file(job: _ShardJob) -> _ShardCheck:
    name, path = job.shard.name, _local(job, job.shard.name)
    check = _ShardCheck([], [], [], 0)
    problem = _file_problem(path, job.shard, missing="listed in the manifest but not on disk")
    if problem is not None:
        check.problems.append(problem)
        return check
    reader = get_format(job.format).reader(path)
    try:
        count = 0
        for record in reader:
            count += 1
            check.keys.append(record.key)
            check.sources.append(str(record.meta.get("source", "")))
            if record.label is not None and job.classes and not 0 <= record.label < job.classes:
                check.problems.append(
                    Problem("label", f"label {record.label} outside 0..{job.classes - 1}", name, record.key)
                )
            if job.deep:
                _check_pixels(record, name, check, job.max_pixels)
        if count != job.shard.count:
            check.problems.append(Problem("count", f"{count:,} records, manifest says {job.shard.count:,}", name))
        if job.companion is not None:
            _check_companion(job, path, check)
    except ShardFormatError as error:
        check.problems.append(Problem("unreadable", str(error), name))
    except OSError as error:
        check.problems.append(Problem("unreadable", f"cannot read: {describe(error)}", name))
    finally:
        reader.close()
    return check


def _check_companion(job: _ShardJob, shard: str, check: _ShardCheck) -> None:
    """The shard's index for other readers is what the format derives from the shard now, and the
    file beside it is that, byte for byte."""
    companion = job.companion
    idx_file = get_format(job.format).idx_file
    assert companion is not None
    expected = idx_file(shard) if idx_file is not None else None
    if expected is None or hashlib.sha256(expected).hexdigest() != companion.sha256:
        check.problems.append(Problem("companion", "does not match the shard's members", companion.name))
        return
    problem = _file_problem(_local(job, companion.name), companion)
    if problem is not None:
        check.problems.append(problem)


def _file_problem(path: str, info: ShardInfo, missing: str = "listed in the manifest but not there") -> Problem | None:
    """Whether the file at `path` (a shard or an index file) is what `info` says: there, a regular
    file, its size, then its sha256; the first thing wrong as a problem, or None."""
    try:
        size = check_regular(path).st_size
    except FileNotFoundError:
        return Problem("missing", missing, info.name)
    except OSError as error:
        return Problem("unreadable", describe(error), info.name)
    if size != info.bytes:
        return Problem("size", f"{size:,} bytes, manifest says {info.bytes:,}", info.name)
    try:
        digest = sha256_file(path)
    except OSError as error:
        return Problem("unreadable", f"cannot read: {describe(error)}", info.name)
    if digest != info.sha256:
        return Problem("checksum", "sha256 differs from the manifest (bytes changed)", info.name)
    return None


def _check_pixels(record: Record, shard: str, check: _ShardCheck, max_pixels: int) -> None:
    try:
        pixels = decode(record.data, record.ext, max_pixels=max_pixels)
    except (ImageError, ValueError) as error:
        check.problems.append(Problem("decode", str(error), shard, record.key))
        return
    check.decoded += 1
    expected = (record.meta.get("stored_height"), record.meta.get("stored_width"))
    if expected == (None, None):  # a tar someone else wrote (`shardkit index`): no stored sizes to hold to
        expected = tuple(pixels.shape[:2])
    if pixels.ndim != 3 or pixels.shape[2] != 3 or tuple(pixels.shape[:2]) != expected:
        check.problems.append(
            Problem("shape", f"decoded {pixels.shape}, metadata says {expected[0]}x{expected[1]}x3", shard, record.key)
        )


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
    open_shards): each object is downloaded to a temporary folder, checked, and deleted."""
    check_workers(workers)
    if max_pixels < 1:
        raise ConfigError(f"max pixels must be positive, not {max_pixels}")
    started = time.perf_counter()
    with _opened(folder, storage_options) as output:
        found = None
        if source is not None:  # a bad source is refused here, before any shard is read
            # walked as the pack walked it (a table's rows, sidecar samples): the manifest says how
            found = walk(source, labels="none", keys=False, **_walked_as(output.manifest))
        report = _verify(output, deep, found, workers, max_pixels, progress)
    report.seconds = time.perf_counter() - started
    return report


def _walked_as(manifest: Manifest | ManifestError | None) -> dict[str, Any]:
    """How the pack walked its source, from its manifest's settings (untrusted: a setting that is
    not what pack writes is left out, and the walk is the plain one)."""
    settings = manifest.settings if isinstance(manifest, Manifest) else {}
    how: dict[str, Any] = {"sidecars": settings.get("sidecars") is True}
    table = settings.get("table")
    if isinstance(table, dict):
        with contextlib.suppress(TypeError, ValueError, ConfigError):
            how["table"] = TableConfig(**table)
    return how


@dataclass
class _Output:
    """What verify reads: the output's name, a local folder holding its manifest and errors.jsonl,
    the names it holds, and for a remote output its store and a temporary folder for shards."""

    name: str
    meta: Path
    store: Store | None = None
    work: str = ""
    manifest: Manifest | ManifestError | None = None
    held: dict[str, int | None] = field(default_factory=dict)
    troubles: list[Problem] = field(default_factory=list)  # found while fetching what verify reads


@contextlib.contextmanager
def _opened(folder: str | os.PathLike[str], storage_options: dict[str, Any] | None) -> Iterator[_Output]:
    root = locate(folder, storage_options)
    if isinstance(root, Path):
        output = _Output(str(root), root, work=str(root))
        try:
            output.manifest = read_manifest(root)
        except ShardkitError as error:
            output.manifest = ManifestError(str(error))
        if root.is_dir():
            output.held = {entry.name: None for entry in os.scandir(root)}  # names only: shards are stat'ed
        yield output
        return
    store = root
    with tempfile.TemporaryDirectory(prefix="shardkit-verify-") as temp:
        shards = os.path.join(temp, "shards")  # apart from errors.jsonl: a shard may be named anything
        os.mkdir(shards)
        output = _Output(store.url, Path(temp), store, shards)
        try:
            output.manifest = read_remote_manifest(store)
            output.held = store.listing()
            with contextlib.suppress(FileNotFoundError):  # no errors.jsonl: nothing was skipped
                try:
                    store.get(ERRORS_NAME, os.path.join(temp, ERRORS_NAME), limit=MAX_ERRORS_BYTES)
                except TooLong:  # a log that never ends is not written to disk without end
                    os.unlink(os.path.join(temp, ERRORS_NAME))
                    detail = f"{ERRORS_NAME}: more than {MAX_ERRORS_BYTES:,} bytes, not read"
                    output.troubles.append(Problem("errors-log", detail))
            if isinstance(output.manifest, Manifest) and output.manifest.index is not None:
                with contextlib.suppress(FileNotFoundError, TooLong):  # reported by _check_index
                    store.get(INDEX_NAME, os.path.join(temp, INDEX_NAME), limit=output.manifest.index.bytes)
        except ShardkitError as error:
            output.manifest = ManifestError(str(error))
        yield output


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
    manifest = output.manifest
    if not isinstance(manifest, Manifest):
        report.problems.append(Problem("manifest", str(manifest)))
        return report
    root = output.meta
    try:
        get_format(manifest.format)
    except ConfigError:
        report.problems.append(Problem("manifest", f"unknown shard format {manifest.format[:40]!r}"))
        return report
    report.format = manifest.format
    report.shards = len(manifest.shards)
    sealed = _check_manifest(root, manifest, get_format(manifest.format), output.held, report)
    companions = {companion.name: companion for companion in manifest.companions}
    _check_output_files(output, manifest, companions, report)
    jobs = [
        _ShardJob(
            output.work,
            shard,
            manifest.format,
            len(manifest.classes),
            deep,
            max_pixels,
            output.store,
            output.held.get(shard.name),
            companions.get(idx_name(shard.name)),
        )
        for shard in manifest.shards
    ]
    # 8-byte hashes of every key and source path, not the strings: bounded memory at any size; the
    # strings are read again (a second, shallow pass) only to name what turns out to be wrong
    key_hashes: list[np.ndarray] = []
    source_hashes: list[np.ndarray] = []

    def crashed(index: int, how: str) -> _ShardCheck:
        reason = f"reading it crashed the checking process ({how}): the shard is damaged or hostile"
        return _ShardCheck([Problem("crashed", reason, jobs[index].shard.name)], [], [], 0)

    by_shard: dict[int, np.ndarray] = {}  # each shard's key hashes in stored order, for the index
    checks = map_local_surviving_crashes(_check_shard, jobs, workers or default_workers(), crashed)
    for done, (index, check) in enumerate(checks, 1):
        report.problems.extend(check.problems)
        report.records += len(check.keys)
        report.decoded += check.decoded
        key_hashes.append(_hashes(check.keys))
        if not check.problems:  # a damaged shard is reported as such, not as an index that disagrees
            by_shard[index] = key_hashes[-1]
        source_hashes.append(_hashes(check.sources))
        if progress is not None:
            progress(done, len(jobs))

    def shallow_pass() -> Iterator[_ShardCheck]:
        shallow = [replace(job, deep=False) for job in jobs]
        for _, check in map_local_surviving_crashes(_check_shard, shallow, workers or default_workers(), crashed):
            yield check

    if manifest.index is not None and sealed:
        _check_index(root, manifest, by_shard, report)  # (an edited manifest's claims are reported already)
    repeated = set(_repeated(_joined(key_hashes)).tolist())
    if repeated:
        times = Counter(key for check in shallow_pass() for key in check.keys if hash(key) in repeated)
        listed = _listed_duplicates(root) if isinstance(manifest.settings.get("adopted"), dict) else set()
        for key in sorted(key for key, n in times.items() if n > 1 and key not in listed):
            report.problems.append(Problem("duplicate-key", f"key stored {times[key]} times", key=key))
    if found is not None:
        _check_source(root, found, _joined(source_hashes), shallow_pass, report, _walked_as(manifest))
    return report


def _check_output_files(
    output: _Output, manifest: Manifest, companions: dict[str, ShardInfo], report: VerifyReport
) -> None:
    """The files for other readers beside the whole output (`Backend.output_files`: wids'
    shardindex.json) that the manifest lists are what the format derives from its shards now, and
    the files there are that, byte for byte. A listed file the format does not write, and that is
    no shard's index, is a problem."""
    produce = get_format(manifest.format).output_files
    expected = dict(produce(manifest.shards)) if produce is not None else {}
    indexes = {idx_name(shard.name) for shard in manifest.shards}  # checked with their shards
    for name, listed in companions.items():
        if name in expected:
            _check_output_file(output, name, expected[name], listed, report)
        elif name not in indexes:
            report.problems.append(Problem("companion", f"not a file the {manifest.format} format writes", name))


def _check_output_file(output: _Output, name: str, expected: bytes, listed: ShardInfo, report: VerifyReport) -> None:
    """One output-level file: the manifest's entry is `expected`'s hash, and the file is that."""
    if hashlib.sha256(expected).hexdigest() != listed.sha256:
        report.problems.append(Problem("companion", "does not list the manifest's shards", name))
        return
    path = output.meta / name
    if output.store is not None:
        try:
            output.store.get(name, str(path), limit=listed.bytes)
        except FileNotFoundError:
            report.problems.append(Problem("missing", "listed in the manifest but not in the bucket", name))
            return
        except TooLong:
            report.problems.append(Problem("size", f"more than the {listed.bytes:,} bytes the manifest says", name))
            return
        except StorageError as error:
            report.problems.append(Problem("unreadable", str(error), name))
            return
    problem = _file_problem(str(path), listed)
    if problem is not None:
        report.problems.append(problem)


def _check_index(root: Path, manifest: Manifest, by_shard: dict[int, np.ndarray], report: VerifyReport) -> None:
    """index.parquet is the manifest's (bytes, sha256) and says what the shards hold: a row per
    record, each shard's keys in their stored order. Its own claims are checked before it is read
    (a stranger's parquet file could claim any size)."""
    entry, path = manifest.index, root / INDEX_NAME
    assert entry is not None
    try:
        size = check_regular(path).st_size
        digest = sha256_file(path) if size == entry.bytes else ""
    except OSError as error:
        report.problems.append(Problem("index", f"{INDEX_NAME}: {describe(error)}"))
        return
    if size != entry.bytes or digest != entry.sha256:
        report.problems.append(Problem("index", f"{INDEX_NAME} differs from the manifest (bytes changed)"))
        return
    import pyarrow.parquet as pq

    try:
        handle = pq.ParquetFile(path)
        rows = handle.metadata.num_rows
        claimed = sum(handle.metadata.row_group(i).total_byte_size for i in range(handle.metadata.num_row_groups))
        if rows != manifest.records or rows != entry.count or claimed > 64 * size + (1 << 20):
            report.problems.append(
                Problem("index", f"{INDEX_NAME} has {rows:,} rows, the shards {manifest.records:,} records")
            )
            return
        table = handle.read(columns=["key", "shard", "position"])
    except Exception as error:  # pyarrow's own errors for a damaged file
        report.problems.append(Problem("index", f"{INDEX_NAME}: unreadable ({describe(error)})"))
        return
    keys, shards, positions = (table.column(name).to_pylist() for name in ("key", "shard", "position"))
    rows_of: dict[str, list[tuple[int, str]]] = {}
    for key, shard, position in zip(keys, shards, positions, strict=True):
        rows_of.setdefault(str(shard), []).append((position, str(key)))
    for number, shard in enumerate(manifest.shards):
        listed = [key for _, key in sorted(rows_of.get(shard.name, []))]
        if number in by_shard and not np.array_equal(_hashes(listed), by_shard[number]):
            report.problems.append(
                Problem("index", f"{INDEX_NAME} does not list this shard's keys in order", shard.name)
            )


def _check_manifest(
    root: Path, manifest: Manifest, backend: Backend, held: Iterable[str], report: VerifyReport
) -> bool:
    """The manifest against itself, errors.jsonl and the folder; whether its checksum holds."""
    sealed = manifest.checksum == manifest.computed_checksum()
    if not sealed:
        report.problems.append(Problem("manifest", "checksum does not match its content (edited by hand?)"))
    if len({s.name for s in manifest.shards}) != len(manifest.shards):
        report.problems.append(Problem("manifest", "a shard is listed twice"))
    totals = manifest.totals
    adopted = isinstance(manifest.settings.get("adopted"), dict)  # tars `shardkit index` adopted
    errors, duplicates, left_out = 0, 0, set()
    for row in _error_rows(root, report):
        errors += 1
        duplicates += row.get("stage") == "duplicate"
        if adopted and row.get("stage") == "read":
            left_out.add(row.get("path"))  # a tar the readers cannot read, listed with its reason
    if totals.get("records") != manifest.records:
        report.problems.append(
            Problem("manifest", f"totals say {totals.get('records')} records, shards hold {manifest.records}")
        )
    if totals.get("errors") != errors:
        report.problems.append(
            Problem("manifest", f"totals say {totals.get('errors')} errors, {ERRORS_NAME} has {errors}")
        )
    if "duplicates" in totals and totals["duplicates"] != duplicates:
        report.problems.append(
            Problem("manifest", f"totals say {totals['duplicates']} duplicates, {ERRORS_NAME} lists {duplicates}")
        )
    if totals.get("inputs") != totals.get("records", 0) + totals.get("errors", 0):
        report.problems.append(Problem("manifest", "inputs are not records + errors"))
    listed = {s.name for s in manifest.shards} | {c.name for c in manifest.companions}
    listed |= {MANIFEST_NAME, ERRORS_NAME, INDEX_NAME}
    # what a plain reader of the format may leave beside a shard: its trace, not a change to the output
    leftovers = {f"{s.name}{leftover.suffix}": leftover.what for s in manifest.shards for leftover in backend.leftovers}
    others = 0
    for name in sorted(held):
        if adopted and (name in left_out or not name.endswith((".tar", ".idx"))):
            others += name not in listed and not name.startswith(".")
        elif name in leftovers:
            report.notes.append(f"{name}: {leftovers[name]}; ignored")
        elif name not in listed and not name.startswith("."):
            report.problems.append(Problem("stray", "not listed in the manifest", name))
    if others:
        report.notes.append(
            f"{others:,} other files beside the adopted tars (theirs, or tars listed in {ERRORS_NAME}): not checked"
        )
    return sealed


def _listed_duplicates(root: Path) -> set[str]:
    """Keys an adopted output's errors.jsonl lists as held by two tars (`shardkit index` keeps both)."""
    return {
        row["path"].split("/", 1)[1]
        for row in _error_rows(root, None)
        if row.get("stage") == "duplicate" and "/" in str(row.get("path"))
    }


def _error_rows(root: Path, report: VerifyReport | None) -> Iterator[dict[str, str]]:
    """errors.jsonl's rows, streamed; a damaged log ends them with an errors-log problem."""
    try:
        yield from iter_errors(root)
    except ShardFormatError as error:
        if report is not None:
            report.problems.append(Problem("errors-log", str(error)))


def _hashes(strings: list[str]) -> np.ndarray:
    return np.fromiter(map(hash, strings), np.int64, len(strings))


def _joined(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts) if parts else np.empty(0, np.int64)


def _repeated(hashes: np.ndarray) -> np.ndarray:
    values, counts = np.unique(hashes, return_counts=True)
    return values[counts > 1]


def _check_source(
    root: Path,
    found: SourceWalk,
    packed: np.ndarray,
    shallow_pass: Callable[[], Iterator[_ShardCheck]],
    report: VerifyReport,
    how: dict[str, Any],
) -> None:
    """Every source file packed or in errors.jsonl, once; compared by hashes of the paths (a walk
    of the source streamed beside them), the names looked up again only for the files at fault."""
    if found.runs is not None:
        walked = [_hashes([display(rel) for rel in run.relpaths]) for run in found.runs]
    else:
        walked = [_hashes([display(item.relpath) for item in found.items])]
    walked.append(_hashes([skip.path for skip in found.skipped]))
    expected = np.unique(_joined(walked))
    logged = _hashes([row["path"] for row in _error_rows(root, None)])
    accounted, times = np.unique(np.concatenate([packed, logged]), return_counts=True)
    lost = set(np.setdiff1d(expected, accounted, assume_unique=True).tolist())
    extra = set(np.setdiff1d(accounted, expected, assume_unique=True).tolist())
    twice = set(accounted[(times > 1) & np.isin(accounted, expected)].tolist())
    if lost:  # a second walk, streamed too: only the names at fault are kept
        again = walk(found.root, labels="none", keys=False, **how)
        names = {name for name in (display(item.relpath) for item in again.items) if hash(name) in lost}
        names.update(skip.path for skip in again.skipped if hash(skip.path) in lost)
        for path in sorted(names):
            report.problems.append(Problem("lost", f"source file {path} is neither packed nor in {ERRORS_NAME}"))
    wanted = extra | twice
    if wanted:
        named = Counter(path for check in shallow_pass() for path in check.sources if hash(path) in wanted)
        named.update(row["path"] for row in _error_rows(root, None) if hash(row["path"]) in wanted)
        for path in sorted(path for path in named if hash(path) in extra):
            report.problems.append(Problem("extra", f"{path} is packed or listed but not in the source"))
        for path in sorted(path for path, n in named.items() if n > 1 and hash(path) in twice):
            report.problems.append(Problem("duplicate-source", f"{path} is accounted for {named[path]} times"))
