"""`bench`: decode speed of shards against the raw folder they came from, on the same images.

Every pass (`bench_passes`) is measured in the same run, after a warm-up, in `repeat` round-robin
rounds; the report (`bench_report`) keeps the median and the spread, and each ratio is the median
of the ratios within rounds. With `workers` > 1 each pass runs in that many processes (one pool,
started before timing) over disjoint parts.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

from ..core.clips import CLIP_EXT
from ..core.codecs import turbojpeg
from ..core.config import check_train_size, check_workers
from ..core.errors import ConfigError, ShardkitError, require
from ..packing.sources import display
from ..readers.split import record_ranges
from ..runtime.pools import map_pool, process_pool, stop_pool
from ..storage.cache import ShardCache
from ..storage.location import locate
from .bench_passes import (
    Where,
    folder_pil,
    folder_torchvision,
    folder_turbo,
    memory_blobs,
    paired_overhead,
    shard_ranges,
    train_loader,
    video_spans,
)
from .bench_report import BASELINE, IO_ONLY, MEMORY, VIDEO_BASELINE, BenchReport, BenchRow

MAX_WORKERS = 1024

# A pass: one worker's part in, (images, bytes) out
_PassFunction = Callable[[Any], tuple[int, int]]


# A pass as bench runs it: its name, its function, each worker's part, the files it reads (evicted
# before each run with `cold`)
_Pass = tuple[str, _PassFunction, list[Any], list[str]]


class _Output(NamedTuple):
    """The output as the passes read it: where it is, the dataset open on it, its shard files on
    this machine, and every record's bytes and source path, in stored order."""

    where: Where
    dataset: Any
    paths: list[str]
    blobs: list[tuple[bytes, str]]
    sources: list[str]
    spans: list[tuple[float, float, float]]  # an output of clips: each record's (start, end, fps)

    @property
    def clips(self) -> bool:
        return bool(self.blobs) and self.blobs[0][1] == CLIP_EXT


def bench(
    output: str | os.PathLike[str],
    *,
    against: str | os.PathLike[str] | None = None,
    workers: int = 1,
    repeat: int = 3,
    cold: bool = False,
    train: int | None = None,
    device: str | None = None,
    explain: bool = False,
    progress: Callable[[int, int], None] | None = None,
    storage_options: dict[str, Any] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    cache_limit: str | int | None = None,
) -> BenchReport:
    """Measure decode throughput of the shards in `output` (and of `against`, the raw folder).
    With `train` (a crop size), also the training input: the batch loader's random crops against
    torchvision's RandomResizedCrop on the raw folder (when torchvision is installed), and with
    `device` ("cuda", or "cpu" for its torch code on the CPU) the loader's device path too. `output` may
    be a URL (see open_shards): the passes then read through the local cache, which the warm-up
    fills (with `cold`, the cached copies are evicted from the page cache before each run).
    With `explain`, one more epoch of the loader says where its time goes and what would help
    (checks/explain.py). `progress(done, total)` is called as each timed pass (or warm-up) ends."""
    _check_options(workers, repeat, train, device)
    if explain and train is None:
        raise ConfigError("--explain explains the training input: give --train SIZE too")
    read = _read(output, storage_options, cache_dir, cache_limit)
    manifest, root = read.dataset.manifest, read.dataset.folder
    report = BenchReport(str(root), None if against is None else display(os.fspath(against)), manifest.format,
                         len(read.blobs), workers, cold, repeat)  # fmt: skip
    files: list[str] = []
    if against is not None:
        if not all(read.sources):
            raise ShardkitError(f"{root}: records carry no source paths; cannot bench against a folder")
        files = source_files(against, read.sources)
    if read.clips:
        if device is not None:
            raise ConfigError("--device measures the image loader's device path; an output of clips has none")
        report.baseline, report.unit = VIDEO_BASELINE, "clips"
    passes = _passes(read, files, workers, cold, train, device)
    _measure(read, passes, report, progress)
    if explain and train is not None:
        from .explain import explain_training

        report.explained = explain_training(read.where, train, workers, device)
    return report


def _check_options(workers: int, repeat: int, train: int | None, device: str | None) -> None:
    """Refuse what cannot be measured before any work: workers, rounds, the crop size, the device."""
    check_workers(workers, most=MAX_WORKERS)
    if repeat < 1:
        raise ConfigError(f"repeat must be at least 1, not {repeat}")
    if train is not None:
        check_train_size(train)
    if device is not None:
        if train is None:
            raise ConfigError("--device measures the training input's device path: give --train SIZE too")
        from ..readers.device import check_device

        check_device(require("torch", "torch"), device)  # refused before any work


def _read(
    output: str | os.PathLike[str],
    storage_options: dict[str, Any] | None,
    cache_dir: str | os.PathLike[str] | None,
    cache_limit: str | int | None,
) -> _Output:
    """Open the output and read every record once: the bytes the memory pass decodes, the source
    paths that name the raw files; a remote output's shard files are its cached copies."""
    location = locate(output, storage_options)
    where = Where(
        str(location) if isinstance(location, Path) else location.url, storage_options,
        None if cache_dir is None else os.fspath(cache_dir), cache_limit,
    )  # fmt: skip
    dataset = where.open(decode="bytes")
    manifest = dataset.manifest
    if not isinstance(location, Path):
        cache = ShardCache.at(cache_dir, cache_limit)
        paths = [str(cache.path_of(shard.sha256, shard.name)) for shard in manifest.shards]
    else:
        paths = [os.path.join(dataset.folder, shard.name) for shard in manifest.shards]
    records = [record for shard in range(len(manifest.shards)) for record in dataset.records(shard)]
    blobs = [(record.data, record.ext) for record in records]
    sources = [str(record.meta.get("source", "")) for record in records]
    spans = [_span(record.meta) for record in records] if blobs and blobs[0][1] == CLIP_EXT else []
    return _Output(where, dataset, paths, blobs, sources, spans)


def _span(meta: dict[str, Any]) -> tuple[float, float, float]:
    """A clip's (start, end, fps) from its meta, which a stranger wrote: numbers, or the pass fails."""
    try:
        start, end, fps = (float(meta[name]) for name in ("start", "end", "fps"))
    except (KeyError, TypeError, ValueError):
        raise ShardkitError("a clip's meta has no start, end and fps: cannot find it in its video") from None
    if not (0 <= start < end and 0 < fps <= 1000):
        raise ShardkitError(f"a clip's meta says start {start}, end {end}, fps {fps}: not a span of a video")
    return start, end, fps


def source_files(against: str | os.PathLike[str], sources: list[str]) -> list[str]:
    """The raw-folder file of each record, from the source path its metadata names. Records come
    from strangers: a path must stay inside `against` (no absolute paths, no '..')."""
    root = os.path.realpath(against)
    files = []
    for source in sources:
        path = os.path.realpath(os.path.join(root, source))
        if os.path.isabs(source) or not path.startswith(root.rstrip(os.sep) + os.sep):
            raise ShardkitError(f"a record's source {source[:200]!r} is not a path inside {os.fspath(against)}")
        if not os.path.exists(path):
            raise ShardkitError(f"{path}: packed from this file, but it is not under {os.fspath(against)}")
        files.append(path)
    return files


def worker_parts(counts: list[int], workers: int) -> list[list[tuple[int, int, int]]]:
    """(shard, start, stop) ranges per worker: equal runs of records, not whole shards, so one big
    shard cannot leave a worker idle and make the pass look slower than it is."""
    order, total = list(range(len(counts))), sum(counts)
    return [
        record_ranges(order, counts, total * part // workers, total * (part + 1) // workers) for part in range(workers)
    ]


def _passes(
    read: _Output, files: list[str], workers: int, cold: bool, train: int | None, device: str | None
) -> list[_Pass]:
    """The passes to time, in the report's order: the raw folder's (when there is one), the
    shards' decoders, the same bytes from memory (not with `cold`), and the training input."""
    shard_splits = worker_parts([shard.count for shard in read.dataset.manifest.shards], workers)

    def shard_pass(mode: str, scale: float | None = None) -> list[Any]:
        return [(read.where, part, mode, scale) for part in shard_splits]

    passes: list[_Pass] = []
    if read.clips:
        return _clip_passes(read, files, workers, train, shard_pass)
    if files:
        passes.append((BASELINE, folder_pil, _split(files, workers), files))
        if turbojpeg() is not None:
            passes.append(("folder: libjpeg-turbo", folder_turbo, _split(files, workers), files))
    if turbojpeg() is not None:
        passes.append(("shards: libjpeg-turbo", shard_ranges, shard_pass("rgb"), read.paths))
    passes.append(("shards: Pillow", shard_ranges, shard_pass("pil"), read.paths))
    passes.append((IO_ONLY, shard_ranges, shard_pass("bytes"), read.paths))
    passes.append(("shards: scale 1/2", shard_ranges, shard_pass("rgb", 0.5), read.paths))
    if not cold:
        passes.append(
            (MEMORY if turbojpeg() else "memory: same bytes, Pillow", memory_blobs, _split(read.blobs, workers), [])
        )
    if train is not None:
        if files and _torchvision_available():
            parts = [(part, train) for part in _split(files, workers)]
            passes.append((f"train {train}: folder + torchvision", folder_torchvision, parts, files))
        passes.append((f"train {train}: shards loader", train_loader, [(read.where, train, workers, None)], read.paths))
        if device is not None:
            loader = [(read.where, train, workers, device)]
            passes.append((f"train {train}: shards loader, {device}", train_loader, loader, read.paths))
    return passes


def _clip_passes(
    read: _Output, files: list[str], workers: int, train: int | None, shard_pass: Callable[[str], list[Any]]
) -> list[_Pass]:
    """An output of clips: each clip decoded from its source video (seek to its start, decode to its
    end, its frames picked at its fps, as pack picked them), against the shards' clips decoded, the
    bytes alone, and with `train` the clip loader."""
    passes: list[_Pass] = []
    if files:
        spans = [(path, *span) for path, span in zip(files, read.spans, strict=True)]
        passes.append((VIDEO_BASELINE, video_spans, _split(spans, workers), sorted(set(files))))
    passes.append(("shards: clips, PyAV", shard_ranges, shard_pass("rgb"), read.paths))
    passes.append((IO_ONLY, shard_ranges, shard_pass("bytes"), read.paths))
    if train is not None:
        passes.append(
            (f"train {train}: shards clip loader", train_loader, [(read.where, train, workers, None)], read.paths)
        )
    return passes


def _split(items: list[Any], parts: int) -> list[list[Any]]:
    return [items[i::parts] for i in range(parts)]


def _torchvision_available() -> bool:
    try:
        import torchvision  # noqa: F401
    except ImportError:
        return False
    return True


def _measure(
    read: _Output, passes: list[_Pass], report: BenchReport, progress: Callable[[int, int], None] | None
) -> None:
    """Time the passes into `report` on one pool of `report.workers` processes (started before
    timing), then the paired reader overhead where it applies; the pool and the dataset are
    closed whatever happens."""
    workers, cold = report.workers, report.cold
    paired = workers == 1 and not cold and turbojpeg() is not None and not read.clips
    runs = len(passes) * (report.repeat + (0 if cold else 1)) + paired
    ticks = itertools.count(1)

    def tick() -> None:
        if progress is not None:
            progress(next(ticks), runs)

    if progress is not None:
        progress(0, runs)
    pool = process_pool(workers) if workers > 1 else None
    finished = False
    try:
        if pool is not None:
            map_pool(pool, folder_turbo, [[] for _ in range(workers)])  # start the workers before timing
        report.rows = _rounds(pool, passes, report, tick)
        if paired:
            by_shard = [[(r.data, r.ext) for r in read.dataset.records(shard)] for shard in range(len(read.paths))]
            report.paired_overhead = paired_overhead(read.where, by_shard, report.repeat)
            tick()
        finished = True
    finally:
        if pool is not None:
            stop_pool(pool, abandon=not finished)
        read.dataset.close()


def _rounds(
    pool: ProcessPoolExecutor | None, passes: list[_Pass], report: BenchReport, tick: Callable[[], None]
) -> list[BenchRow]:
    """A warm-up (not with `cold`), then `repeat` rounds. Round-robin: every round runs each pass
    once, so a noisy neighbour slows the passes of a round alike, and ratios taken within rounds
    stay steady. `tick` after each pass run."""
    cold, repeat = report.cold, report.repeat
    rows = [BenchRow(name, 0, 0, [], report.workers) for name, *_ in passes]
    if not cold:
        for _, function, parts, _paths in passes:
            _run_split(pool, function, parts)  # warm-up: page cache, imports, lazy opens
            tick()
    for _ in range(repeat):
        for row, (_, function, parts, paths) in zip(rows, passes, strict=True):
            if cold:
                _evict(paths)
            row.images, row.bytes, seconds = _run_split(pool, function, parts)
            row.seconds.append(seconds)
            tick()
    return rows


def _run_split(pool: ProcessPoolExecutor | None, function: _PassFunction, parts: list[Any]) -> tuple[int, int, float]:
    started = time.perf_counter()
    if function is train_loader:  # threads of its own, in this process
        pool = None
    results = [function(part) for part in parts] if pool is None else map_pool(pool, function, parts)
    elapsed = time.perf_counter() - started
    return sum(r[0] for r in results), sum(r[1] for r in results), elapsed


def _evict(paths: list[str]) -> None:
    """Drop the files from the page cache (no root needed) so the pass reads from disk."""
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
