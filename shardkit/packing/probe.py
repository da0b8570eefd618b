"""A census of an image folder from headers alone, and the pre-resize recommendation.

`probe()` reads every header in parallel chunks (no per-file IPC) into a `Census` (census.py), which
turns the records into distributions and the recommendation; the exact copies among the files are
confirmed by copies.py. Nothing here prints.
"""

from __future__ import annotations

import itertools
import math
import os
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from ..core.codecs import header_scanner
from ..core.config import DEFAULT_MAX_PIXELS, TableConfig, WebConfig, check_workers
from ..core.errors import HeaderError, describe
from ..core.headers import ImageHeader, read_head, read_header
from ..runtime.pools import default_workers, map_local, map_threads
from .census import (
    SHORT_SIDE_BINS,
    Census,
    Counts,
    ExactCopies,
    ProbeRecord,
    ProbeReport,
    Recommendation,
    counted_percentiles,
    counted_quantiles,
    recommend,
)
from .copies import candidate_names, confirm_copies
from .objects import Transfer
from .scan_rows import CANNOT_READ, FileProblem, ScanRow, header_warnings
from .sources import Item, SourceWalk, walk
from .sources.labelling import labelling
from .sources.table import NO_FILE

__all__ = [
    "CHUNK_FILES", "PARALLEL_MIN_FILES", "SHORT_SIDE_BINS", "Census", "Counts", "ExactCopies", "FileProblem",
    "ProbeChunk", "ProbeRecord", "ProbeReport", "Recommendation", "ScanRow", "confirm_copies", "counted_percentiles",
    "counted_quantiles", "parallelism", "probe", "probe_file", "recommend",
]  # fmt: skip

CHUNK_FILES = 2048
# A bucket's objects: chunks small enough to keep every thread busy, threads enough to hide latency.
REMOTE_CHUNK_OBJECTS = 64
REMOTE_THREADS = 32
# Below this many files a process pool costs more to start than it saves.
PARALLEL_MIN_FILES = 50_000


def probe_file(path: str, relpath: str, max_pixels: int = DEFAULT_MAX_PIXELS) -> ProbeRecord:
    try:
        header, size = read_header(path)
    except HeaderError as error:
        return ProbeRecord(relpath, _size_or_zero(path), None, FileProblem(str(error), error.kind))
    except OSError as error:
        return ProbeRecord(relpath, 0, None, FileProblem(f"cannot read: {describe(error)}", CANNOT_READ))
    head: int | None
    identity: int | None
    try:
        head, identity = read_head(path)
    except OSError:  # gone since its header was read: not counted among copies
        head = identity = None
    return ProbeRecord(relpath, size, header, None, header_warnings(header, relpath, max_pixels), head, identity)


def _size_or_zero(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _probe_chunk(job: tuple[list[str], list[str], int]) -> list[ScanRow]:
    """Probe one chunk of files; rows are plain tuples (size, header tuple, error, warnings, head hash,
    file identity).

    The compiled scanner answers the common case (a clean JPEG/PNG) for the whole chunk in one
    call; every file it leaves (None) goes through the Python reference, so results are the same
    either way. Plain tuples also travel cheaply between processes: pickling NamedTuples costs the
    parent enough per row to cancel, on a machine with few cores, what a second process gains.
    """
    paths, relpaths, max_pixels = job
    scanner = header_scanner()
    # Clamped to what C takes: a smaller limit only sends more files to Python, never other answers.
    limit = min(max_pixels, 2**63 - 1)
    rows: list[Any] = scanner.scan_batch(paths, limit) if scanner is not None else [None] * len(paths)
    for index, row in enumerate(rows):
        if row is None:
            record = probe_file(paths[index], relpaths[index], max_pixels)
            header = tuple(record.header) if record.header is not None else None
            rows[index] = (record.bytes, header, record.error, record.warnings, record.head, record.identity)
    return rows


class ProbeChunk(NamedTuple):
    """A chunk of probe results as the scanner gives them: rows of (bytes, header tuple or None,
    error, warnings, head hash, file identity), one per relpath. records() builds the ProbeRecords."""

    relpaths: list[str]
    rows: list[ScanRow]

    def records(self) -> list[ProbeRecord]:
        return _records_from_rows(self.relpaths, self.rows)


def _records_from_rows(relpaths: Sequence[str], rows: list[ScanRow]) -> list[ProbeRecord]:
    make_header, make_record = ImageHeader._make, ProbeRecord._make
    return [
        make_record((rel, size, None if header is None else make_header(header), *rest))
        for rel, (size, header, *rest) in zip(relpaths, rows, strict=True)
    ]


def parallelism(files: int, workers: int | None = None, min_parallel: int = PARALLEL_MIN_FILES) -> tuple[int, str]:
    """How many workers probe `files` files, and whether they are threads or processes.

    The compiled scanner releases the GIL, so threads scale with no pool to start and nothing to
    pickle; the pure-Python parser needs processes, worth starting only for large folders.
    """
    workers = workers or default_workers()
    if header_scanner() is not None:
        return max(1, min(workers, math.ceil(files / CHUNK_FILES))), "thread"
    return (workers if files >= min_parallel else 1), "process"


def probe(
    source: str | os.PathLike[str],
    *,
    train_size: int = 224,
    workers: int | None = None,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    progress: Callable[[int, int | None], None] | None = None,
    on_chunk: Callable[[ProbeChunk], None] | None = None,
    copies_progress: Callable[[int, int], None] | None = None,
    chunk_files: int = CHUNK_FILES,
    table: TableConfig | None = None,
    sidecars: bool = False,
    storage_options: dict[str, Any] | None = None,
    web: WebConfig | None = None,
) -> ProbeReport:
    """Probe every image under `source`, streaming: the walk feeds the workers chunk by chunk as it
    goes, and only the statistics (exact counts of each size and file size) and the first examples
    of each problem are kept. `on_chunk` gets every chunk of results in walk order (byte order of
    the paths) as it is done; `progress(done, total)` has total None until the walk ends;
    `copies_progress(files, total)` follows the confirmation of copy candidates, read whole (none
    when no two files share a size and head hash). A bucket's prefix (s3://..., reached with
    `storage_options`) is probed by range reads of each object's header, on threads; so is a table
    of URLs (its URL column and download settings in `web`)."""
    check_workers(workers)
    started = time.perf_counter()
    # the samples pack would take, labelled as it would label them by default
    found = walk(
        source, labels="auto", keys=False, table=table, sidecars=sidecars, storage_options=storage_options, web=web
    )
    census = Census()
    transfer = Transfer()
    scan_chunk: Callable[[Job], list[ScanRow]] = _probe_chunk
    digest_of: Callable[[str, int], tuple[str, int] | None] | None = None
    remote = found.source.header_reads(found, transfer)
    if remote is not None:  # a bucket's objects, a table's URLs: headers by range reads, waiting on the network
        scan_chunk, digest_of = remote
        chunk_files = min(chunk_files, REMOTE_CHUNK_OBJECTS)
        workers, kind = workers or REMOTE_THREADS, "thread"
    else:
        workers, kind = parallelism(sys.maxsize, workers, min_parallel=0)  # the count is not known yet
    chunking = _Chunking(found, Counter(), chunk_files, max_pixels)
    jobs: Iterator[Job] = iter(chunking)
    if kind == "process":  # a pool is worth starting only for a large folder: look ahead first
        ahead = list(itertools.islice(jobs, math.ceil(PARALLEL_MIN_FILES / chunk_files)))
        if len(ahead) * chunk_files < PARALLEL_MIN_FILES:
            workers = 1
        jobs = itertools.chain(ahead, jobs)
    without_file = _scan(jobs, scan_chunk, kind, workers, census, chunking, on_chunk, progress)
    report = census.report(train_size=train_size, root=os.fspath(source))
    places, keys, identities, links = census.copy_candidates()
    report.duplicates = ExactCopies(0, 0, 0, links)
    if len(places):  # walked again: only the candidates' names are wanted, and they were not kept
        again = walk(
            source, labels="none", keys=False, table=table, sidecars=sidecars, storage_options=storage_options, web=web
        )
        names = candidate_names(_runs(again, Counter()), places, keys, identities)
        report.duplicates = confirm_copies(names, workers, links, progress=copies_progress, digest=digest_of)
    report.seconds = time.perf_counter() - started
    report.workers, report.worker_kind = (workers if chunking.chunks > 1 else 1), kind  # one chunk runs inline
    report.skipped = found.skipped
    report.labels = labelling(found)
    report.header_bytes = transfer.bytes if remote is not None else None
    if found.table is not None:
        report.table = _table_census(found, chunking.captions, without_file)
    return report


Job = tuple[list[str], list[str], int]  # a chunk's paths, relpaths, and the pixel limit


@dataclass
class _Chunking:
    """The walk cut into chunks of `chunk_files` files as it goes, counting what it has cut (the
    total is known once `done`) and the caption lengths of a table's rows."""

    found: SourceWalk
    captions: Counter[int]  # caption length in characters -> rows
    chunk_files: int
    max_pixels: int
    walked: int = 0
    chunks: int = 0
    done: bool = False

    def __iter__(self) -> Iterator[Job]:
        size = self.chunk_files
        paths: list[str] = []
        relpaths: list[str] = []
        for prefix, run_paths, run_relpaths in _runs(self.found, self.captions):
            paths += run_paths if run_paths is not None else [prefix + rel for rel in run_relpaths]
            relpaths += run_relpaths
            while len(paths) >= size:
                self.walked += size
                self.chunks += 1
                yield paths[:size], relpaths[:size], self.max_pixels
                del paths[:size], relpaths[:size]
        if paths:
            self.walked += len(paths)
            self.chunks += 1
            yield paths, relpaths, self.max_pixels
        self.done = True


def _scan(
    jobs: Iterator[Job], scan_chunk: Callable[[Job], list[ScanRow]], kind: str, workers: int, census: Census,
    chunking: _Chunking,
    on_chunk: Callable[[ProbeChunk], None] | None, progress: Callable[[int, int | None], None] | None,
) -> int:  # fmt: skip
    """Every chunk through the scanner on `workers` threads or processes, added to the census in
    walk order whatever order they finish in; returns how many of a table's rows name no file."""
    mapper = map_threads if kind == "thread" else map_local
    relpaths_of: dict[int, list[str]] = {}

    def numbered() -> Iterator[Job]:
        for index, job in enumerate(jobs):
            relpaths_of[index] = job[1]
            yield job

    without_file = 0
    finished: dict[int, list[ScanRow]] = {}
    next_index = 0
    for index, rows in mapper(scan_chunk, numbered(), workers):
        finished[index] = rows
        if chunking.found.table is not None:
            without_file += sum(1 for row in rows if row[2] is not None and row[2].startswith(_MISSING))
        while next_index in finished:
            chunk = ProbeChunk(relpaths_of.pop(next_index), finished.pop(next_index))
            census.add_rows(chunk.relpaths, chunk.rows)
            if on_chunk is not None:
                on_chunk(chunk)
            next_index += 1
            if progress is not None:
                progress(census.files, chunking.walked if chunking.done else None)
    return without_file


def _runs(found: SourceWalk, captions: Counter[int]) -> Iterable[tuple[str, list[str] | None, list[str]]]:
    """The walk as runs of (prefix, paths or None, relpaths): a folder's files at a time, so that
    a walk of millions of files takes no Python step per file (paths None: prefix + relpath)."""
    if found.table is not None:  # a table's rows, streamed
        return _table_runs(found.items, captions)
    if found.runs is None:  # a list file
        listed = list(found.items)
        return [("", [item.path for item in listed], [item.relpath for item in listed])]
    return ((run.prefix, None, run.relpaths) for run in found.runs)


# ENOENT, as probe_file words it, and a missing object, as a bucket's probe does
_MISSING = (f"cannot read: {os.strerror(2)}", "cannot read: no such object")


def _table_runs(
    items: Iterable[Item], captions: Counter[int], batch: int = 1024
) -> Iterator[tuple[str, list[str] | None, list[str]]]:
    """A table's items in batches (never the whole table), counting caption lengths on the way."""
    paths: list[str] = []
    relpaths: list[str] = []
    for item in items:
        paths.append(item.path)
        relpaths.append(item.relpath)
        if (text := item.text) is not None:
            for caption in [text] if isinstance(text, str) else text:
                captions[len(caption)] += 1
        if len(paths) >= batch:
            yield "", paths, relpaths
            paths, relpaths = [], []
    if paths:
        yield "", paths, relpaths


def _table_census(found: SourceWalk, captions: Counter[int], without_file: int) -> dict[str, Any]:
    assert found.table is not None
    unrowed = sum(1 for skip in found.skipped if skip.reason.startswith("no row in "))
    fileless = sum(1 for skip in found.skipped if skip.reason.endswith(f": {NO_FILE}"))  # (said by the walk)
    lengths = np.array(sorted(captions), dtype=np.float64)
    counts = np.array([captions[length] for length in sorted(captions)], dtype=np.int64)
    return {
        "name": found.table.name,
        "rows": found.table.rows,
        "rows_without_file": without_file + fileless,
        "images_without_row": unrowed,
        "bad_rows": len(found.skipped) - unrowed - fileless,
        "columns": list(found.table.found),
        "captions": int(counts.sum()),
        "caption_chars": counted_percentiles(lengths, counts) if len(counts) else {},
    }
