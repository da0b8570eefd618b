"""A census of an image folder from headers alone, and the pre-resize recommendation.

`probe()` reads every header in parallel chunks (no per-file IPC), then `summarize()` turns the
records into distributions. `recommend()` is the one function that picks a pre-resize size;
`pack --resize auto` calls it too. Nothing here prints.
"""

from __future__ import annotations

import math
import os
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import NamedTuple

import numpy as np

from .backends import header_scanner
from .config import DEFAULT_MAX_PIXELS
from .discover import Skipped, display, image_files
from .executors import default_workers, map_local, map_threads
from .headers import EXTENSION_FORMATS, HeaderError, ImageHeader, read_header

CHUNK_FILES = 2048
# Below this many files a process pool costs more to start than it saves.
PARALLEL_MIN_FILES = 50_000
SHORT_SIDE_BINS = (0, 64, 128, 192, 224, 256, 320, 384, 448, 512, 640, 768, 1024, 1536, 2048, 4096)


class ProbeRecord(NamedTuple):
    relpath: str
    bytes: int
    header: ImageHeader | None
    error: str | None = None  # why the header could not be read
    warnings: tuple[str, ...] = ()  # "truncated", "extension-mismatch", "too-many-pixels"


@dataclass(frozen=True)
class Recommendation:
    train_size: int
    resize: int | None  # short side to pre-resize to; None keeps the originals
    reason: str
    shrink_share: float  # share of readable images this would make smaller
    bytes_before: int
    bytes_after_estimate: int
    decode_work_saved: float  # share of decoded pixels saved per epoch (decode time ~ pixels)


@dataclass(frozen=True)
class ProblemSummary:
    count: int
    examples: list[str]


@dataclass
class ProbeReport:
    root: str
    files: int  # every file looked at, readable or not
    images: int  # readable headers
    bytes: int
    seconds: float
    workers: int
    percentiles: dict[str, dict[str, float]]
    short_side_histogram: list[tuple[int, int | None, int]]
    formats: dict[str, int]
    modes: dict[str, int]
    rotated: int
    progressive: int
    problems: dict[str, ProblemSummary]
    recommendation: Recommendation | None
    records: list[ProbeRecord] = field(default_factory=list, repr=False)
    worker_kind: str = "process"  # "thread" with the compiled scanner
    skipped: list[Skipped] = field(default_factory=list, repr=False)

    def to_json(self) -> dict:
        data = asdict(self)
        data.pop("records")
        data["skipped"] = [{"path": display(s.relpath), "reason": s.reason} for s in self.skipped]
        data["root"] = display(self.root)
        return data


def probe_file(path: str, relpath: str, max_pixels: int = DEFAULT_MAX_PIXELS) -> ProbeRecord:
    try:
        header, size = read_header(path)
    except HeaderError as error:
        return ProbeRecord(relpath, _size_or_zero(path), None, str(error))
    except OSError as error:
        return ProbeRecord(relpath, 0, None, f"cannot read: {error.strerror or error}")
    expected = EXTENSION_FORMATS.get("." + relpath.rpartition(".")[2].lower())
    if header.complete and expected == header.format and header.width * header.height <= max_pixels:
        return ProbeRecord(relpath, size, header)  # the common case, kept cheap
    warnings: list[str] = []
    if not header.complete:
        warnings.append("truncated")
    if expected is not None and expected != header.format:
        warnings.append("extension-mismatch")
    if header.width * header.height > max_pixels:
        warnings.append("too-many-pixels")
    return ProbeRecord(relpath, size, header, None, tuple(warnings))


def _size_or_zero(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _probe_chunk(job: tuple[list[str], list[str], int]) -> list[tuple]:
    """Probe one chunk of files; rows are plain tuples (size, header tuple, error, warnings).

    The compiled scanner answers the common case (a clean JPEG/PNG) for the whole chunk in one
    call; every file it leaves (None) goes through the Python reference, so results are the same
    either way. Plain tuples also travel cheaply between processes: pickling NamedTuples costs
    the parent ~1.5 us each, which on 2 cores ate the whole gain of a second process.
    """
    paths, relpaths, max_pixels = job
    scanner = header_scanner()
    # Clamped to what C takes: a smaller limit only sends more files to Python, never other answers.
    limit = min(max_pixels, 2**63 - 1)
    rows: list = scanner.scan_batch(paths, limit) if scanner is not None else [None] * len(paths)
    for index, row in enumerate(rows):
        if row is None:
            record = probe_file(paths[index], relpaths[index], max_pixels)
            header = tuple(record.header) if record.header is not None else None
            rows[index] = (record.bytes, header, record.error, record.warnings)
    return rows


def _records_from_rows(relpaths: Sequence[str], rows: list[tuple]) -> list[ProbeRecord]:
    make_header, make_record = ImageHeader._make, ProbeRecord._make
    return [
        make_record((rel, size, None if header is None else make_header(header), error, warnings))
        for rel, (size, header, error, warnings) in zip(relpaths, rows, strict=True)
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


def probe_records(
    paths: Sequence[str],
    relpaths: Sequence[str],
    *,
    workers: int | None = None,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    progress: Callable[[int], None] | None = None,
    min_parallel: int = PARALLEL_MIN_FILES,
) -> list[ProbeRecord]:
    """Probe files in chunks across threads or processes; records come back in input order."""
    workers, kind = parallelism(len(paths), workers, min_parallel)
    chunk = max(256, min(CHUNK_FILES, math.ceil(len(paths) / (4 * workers))))
    jobs = [
        (list(paths[i : i + chunk]), list(relpaths[i : i + chunk]), max_pixels) for i in range(0, len(paths), chunk)
    ]
    parts: list[list[ProbeRecord]] = [[] for _ in jobs]
    mapper = map_threads if kind == "thread" else map_local
    for index, rows in mapper(_probe_chunk, jobs, workers):
        parts[index] = _records_from_rows(jobs[index][1], rows)
        if progress is not None:
            progress(len(rows))
    return [record for part in parts for record in part]


def probe(
    source: str | os.PathLike[str],
    *,
    train_size: int = 224,
    workers: int | None = None,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    progress: Callable[[int, int], None] | None = None,
) -> ProbeReport:
    """Probe every image under `source`. `progress(done, total)` is called as chunks finish."""
    started = time.perf_counter()
    paths, relpaths, skipped = image_files(source)
    total = len(paths)
    done = 0

    def advance(n: int) -> None:
        nonlocal done
        done += n
        if progress is not None:
            progress(done, total)

    records = probe_records(
        paths,
        relpaths,
        workers=workers,
        max_pixels=max_pixels,
        progress=advance,
    )
    report = summarize(records, train_size=train_size, root=os.fspath(source))
    report.seconds = time.perf_counter() - started
    report.workers, report.worker_kind = parallelism(total, workers)
    report.skipped = skipped
    return report


def summarize(records: list[ProbeRecord], *, train_size: int = 224, root: str = "") -> ProbeReport:
    readable = [r for r in records if r.header is not None and "too-many-pixels" not in r.warnings]
    displayed = np.array([r.header.displayed_size for r in readable], dtype=np.float64).reshape(-1, 2)
    widths, heights = displayed[:, 0], displayed[:, 1]
    shorts, longs = np.minimum(widths, heights), np.maximum(widths, heights)
    sizes = np.array([r.bytes for r in readable], dtype=np.float64)
    metrics = {
        "width": widths,
        "height": heights,
        "short_side": shorts,
        "megapixels": widths * heights / 1e6,
        "aspect": longs / np.maximum(shorts, 1),
        "kilobytes": sizes / 1024,
    }
    return ProbeReport(
        root=root,
        files=len(records),
        images=len(readable),
        bytes=sum(r.bytes for r in records),
        seconds=0.0,
        workers=1,
        percentiles={name: _percentiles(values) for name, values in metrics.items()},
        short_side_histogram=_histogram(shorts),
        formats=dict(Counter(r.header.format for r in readable).most_common()),
        modes=dict(Counter(r.header.mode for r in readable).most_common()),
        rotated=sum(1 for r in readable if r.header.orientation != 1),
        progressive=sum(1 for r in readable if r.header.progressive),
        problems=_problems(records),
        recommendation=recommend(widths, heights, sizes, train_size) if len(readable) else None,
        records=records,
    )


def _percentiles(values: np.ndarray) -> dict[str, float]:
    if values.size == 0:
        return {}
    qs = np.percentile(values, [1, 5, 25, 50, 75, 95, 99])
    result = {f"p{q}": round(float(v), 3) for q, v in zip((1, 5, 25, 50, 75, 95, 99), qs, strict=False)}
    result.update(min=float(values.min()), max=float(values.max()), mean=round(float(values.mean()), 3))
    return result


def _histogram(shorts: np.ndarray) -> list[tuple[int, int | None, int]]:
    edges = [*list(SHORT_SIDE_BINS), math.inf]
    counts, _ = np.histogram(shorts, bins=edges)
    bins = zip(SHORT_SIDE_BINS, edges[1:], counts, strict=True)
    return [(lo, None if math.isinf(hi) else int(hi), int(n)) for lo, hi, n in bins if n]


_PROBLEM_KINDS = {
    "truncated": "truncated (no end marker)",
    "extension-mismatch": "extension does not match content",
    "too-many-pixels": "over the pixel limit (decompression bomb?)",
}


def problem_kind(error: str) -> str:
    if error == "empty file":
        return "empty file"
    if error.startswith("zero-size"):
        return "zero-size image"
    if error.startswith("not an image"):
        return "not an image"
    if error.startswith("cannot read"):
        return "cannot read (permissions, I/O)"
    return "corrupt header"


def _problems(records: list[ProbeRecord], examples: int = 5) -> dict[str, ProblemSummary]:
    found: dict[str, list[str]] = {}
    for record in records:
        if record.error is not None:
            kind = problem_kind(record.error)
            found.setdefault(kind, []).append(f"{display(record.relpath)}: {record.error}")
        for warning in record.warnings:
            note = ""
            if warning == "extension-mismatch" and record.header is not None:
                note = f": content is {record.header.format}"
            elif warning == "too-many-pixels" and record.header is not None:
                note = f": {record.header.width}x{record.header.height}"
            found.setdefault(_PROBLEM_KINDS[warning], []).append(display(record.relpath) + note)
    return {kind: ProblemSummary(len(names), names[:examples]) for kind, names in found.items()}


def recommend(
    widths: np.ndarray,
    heights: np.ndarray,
    file_bytes: np.ndarray,
    train_size: int = 224,
    crop_ratio: float = 0.875,
) -> Recommendation:
    """The short side to pre-resize to for training at `train_size`, from displayed sizes.

    The classic recipe resizes to train_size / 0.875 (224 -> 256) and crops. We never pick a size
    above what most images have: below the median short side, images would be stored upscaled.
    """
    widths = np.asarray(widths, dtype=np.float64)
    heights = np.asarray(heights, dtype=np.float64)
    file_bytes = np.asarray(file_bytes, dtype=np.float64)
    short_sides = np.minimum(widths, heights)
    target = int(math.ceil(train_size / crop_ratio / 8) * 8)
    median = float(np.median(short_sides))
    if median >= target:
        resize: int | None = target
        reason = f"{train_size}/{crop_ratio} rounded up to a multiple of 8; the median short side is {median:.0f}"
    elif median >= train_size:
        resize = max(train_size, int(median // 8 * 8))
        reason = f"the median short side ({median:.0f}) is below {target}, so stay at or under it"
    else:
        resize = None
        reason = f"the median short side ({median:.0f}) is below the training size {train_size}: keep originals"
    scale = np.ones_like(short_sides) if resize is None else np.minimum(1.0, resize / np.maximum(short_sides, 1))
    area = scale**2
    pixels = widths * heights
    return Recommendation(
        train_size=train_size,
        resize=resize,
        reason=reason,
        shrink_share=round(float(np.mean(scale < 1)), 4),
        bytes_before=int(file_bytes.sum()),
        # Assumes the stored bits per pixel stay the same: JPEG size is close to linear in pixels.
        bytes_after_estimate=int((file_bytes * area).sum()),
        # Decode time is close to linear in pixels, so this is also the decode time saved.
        decode_work_saved=round(float(1 - (pixels * area).sum() / pixels.sum()), 4),
    )
