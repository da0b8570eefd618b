"""The census of a probe: what the headers say, kept as exact counts of each size and file size (not
a record per file), the problems with their first examples, each readable image's 24 bytes toward
finding exact copies, and the report and pre-resize recommendation made from them. `recommend()`
is the one function that picks a pre-resize size; `pack --resize auto` calls it too."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

import numpy as np

from ..core.errors import Failure
from ..core.headers import ImageHeader
from .scan_rows import ScanRow
from .sources import display
from .sources.labelling import Labelling

SHORT_SIDE_BINS = (0, 64, 128, 192, 224, 256, 320, 384, 448, 512, 640, 768, 1024, 1536, 2048, 4096)


class ProbeRecord(NamedTuple):
    relpath: str
    bytes: int
    header: ImageHeader | None
    error: str | None = None  # why the header could not be read
    warnings: tuple[str, ...] = ()  # "truncated", "extension-mismatch", "too-many-pixels"
    head: int | None = None  # headers.head_hash of a readable image's first bytes
    identity: int | None = None  # headers.file_identity: the same for every name of one file


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


@dataclass(frozen=True)
class ExactCopies:
    """Files whose bytes copy another file's: found from (size, head hash) and confirmed by the
    sha256 of each file. Names of one file (symlinks, hard links, a table naming a file twice) are
    one file, counted apart as `links`."""

    files: int  # copies beyond the first of each group
    groups: int
    bytes: int  # what the copies hold
    links: int = 0
    examples: list[list[str]] = field(default_factory=list)  # the first groups, as paths in the source


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
    worker_kind: str = "process"  # "thread" with the compiled scanner
    # a metadata table's census: rows, rows without a file, images without a row, bad rows, the
    # columns found and caption lengths in characters (percentiles)
    table: dict[str, Any] | None = None
    duplicates: ExactCopies | None = None
    skipped: list[Failure] = field(default_factory=list, repr=False)
    # a bucket's probe: the bytes its range reads took for the headers (None: local files)
    header_bytes: int | None = None
    # every distinct displayed size with its count: the distribution itself, for plots
    size_counts: list[tuple[int, int, int]] = field(default_factory=list, repr=False)
    labels: Labelling | None = None  # how pack would label the samples (by default), and what to look at

    @property
    def warnings(self) -> list[str]:
        """The lines the report warns with: what in the source's layout may not be what was meant."""
        return list(self.labels.warnings) if self.labels is not None else []

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("size_counts")
        data["warnings"] = self.warnings
        data["skipped"] = [{"path": s.path, "reason": s.reason} for s in self.skipped]
        data["root"] = display(self.root)
        return data


class Counts:
    """A multiset of integers kept exactly and compactly: sorted distinct values, each with its
    count and the sum of a weight. Memory grows with the distinct values (image sizes: thousands),
    not with the number of files; additions are buffered and merged in large batches."""

    def __init__(self) -> None:
        self.values = np.empty(0, np.uint64)
        self.counts = np.empty(0, np.int64)
        self.weights = np.empty(0, np.int64)
        self._pending: list[tuple[np.ndarray, np.ndarray]] = []
        self._pending_size = 0

    def add(self, values: np.ndarray, weights: np.ndarray) -> None:
        self._pending.append((values.astype(np.uint64, copy=False), weights.astype(np.int64, copy=False)))
        self._pending_size += len(values)
        if self._pending_size >= 1 << 18:
            self.merge()

    def merge(self) -> Counts:
        if self._pending:
            values = np.concatenate([self.values, *(v for v, _ in self._pending)])
            counts = np.concatenate([self.counts, *(np.ones(len(v), np.int64) for v, _ in self._pending)])
            weights = np.concatenate([self.weights, *(w for _, w in self._pending)])
            self.values, inverse = np.unique(values, return_inverse=True)
            self.counts = _sum_by(inverse, counts, len(self.values))
            self.weights = _sum_by(inverse, weights, len(self.values))
            self._pending, self._pending_size = [], 0
        return self


def _sum_by(groups: np.ndarray, values: np.ndarray, size: int) -> np.ndarray:
    """Integer sums of `values` per group; exact while a sum is under 2**53 (8 PiB of files)."""
    return np.rint(np.bincount(groups, weights=values, minlength=size)).astype(np.int64)


_KEY_STEP = np.uint64(0x9E3779B97F4A7C15)  # spreads the size over the key's bits
_SIDE_BITS = 32  # a size is kept as width << 32 | height
_SIDE_LIMIT = (1 << _SIDE_BITS) - 1
_SIDE_BITS_U = np.uint64(_SIDE_BITS)


@dataclass
class Census:
    """What probe keeps while it streams: totals, exact counts of each displayed size (with the
    bytes of its files) and of each file size, and up to `examples` names per problem."""

    examples: int = 5
    files: int = 0
    bytes: int = 0
    sizes: Counts = field(default_factory=Counts)  # width << 32 | height, weighted by file bytes
    file_sizes: Counts = field(default_factory=Counts)
    formats: Counter[str] = field(default_factory=Counter)
    modes: Counter[str] = field(default_factory=Counter)
    rotated: int = 0
    progressive: int = 0
    problems: dict[str, list[Any]] = field(default_factory=dict)  # kind -> [count, examples]
    # each readable image's position in the walk, its key (head hash ^ size) and its file's
    # identity: 24 bytes an image, what finding exact copies without reading every file costs
    copy_places: list[np.ndarray] = field(default_factory=list)
    copy_keys: list[np.ndarray] = field(default_factory=list)
    copy_identities: list[np.ndarray] = field(default_factory=list)

    def add(self, records: Sequence[ProbeRecord]) -> None:
        self.add_rows(
            [r.relpath for r in records],
            [(r.bytes, r.header, r.error, r.warnings, r.head, r.identity) for r in records],
        )

    def add_rows(self, relpaths: Sequence[str], rows: Sequence[ScanRow]) -> None:
        """The hot path: rows as the scanner gives them, (bytes, header tuple or None, error,
        warnings, head hash, file identity), with no object built for a clean image. Taken by
        columns (one zip), so that a chunk of clean images costs no Python step per file."""
        base = self.files
        self.files += len(rows)
        if not rows:
            return
        sizes, headers, errors, warned, heads, identities = zip(*rows, strict=True)
        self.bytes += sum(sizes)
        places: Sequence[int] = range(base, base + len(rows))
        if errors.count(None) != len(errors) or any(warned):
            kept = [index for index, row in enumerate(rows) if self._readable(relpaths[index], row)]
            sizes, headers = tuple(sizes[i] for i in kept), tuple(headers[i] for i in kept)
            heads, identities = tuple(heads[i] for i in kept), tuple(identities[i] for i in kept)
            places = [base + i for i in kept]
            if not kept:
                return
        # header tuples: (format, width, height, mode, bits, progressive, orientation, complete)
        formats, widths, heights, modes, _, progressive, orientations, _ = zip(*headers, strict=True)
        turned = np.array(orientations, np.int64) >= 5  # EXIF quarter turns: displayed with the sides swapped
        across = np.minimum(np.array(widths, np.uint64), _SIDE_LIMIT)
        down = np.minimum(np.array(heights, np.uint64), _SIDE_LIMIT)
        packed = np.where(turned, down, across) << _SIDE_BITS_U | np.where(turned, across, down)
        self.formats.update(formats)
        self.modes.update(modes)
        self.rotated += len(orientations) - orientations.count(1)
        self.progressive += sum(progressive)
        weights = np.array(sizes, np.int64)
        self.sizes.add(packed, weights)
        self.file_sizes.add(weights, np.zeros(len(weights), np.int64))
        if None in heads or None in identities:  # a file gone between its header and its head
            hashed = [
                i for i, (h, f) in enumerate(zip(heads, identities, strict=True)) if h is not None and f is not None
            ]
            heads, identities = tuple(heads[i] for i in hashed), tuple(identities[i] for i in hashed)
            places, weights = [places[i] for i in hashed], weights[hashed]
        self.copy_keys.append(np.array(heads, np.uint64) ^ (weights.astype(np.uint64) * _KEY_STEP))
        self.copy_identities.append(np.array(identities, np.uint64))
        self.copy_places.append(np.array(places, np.int64))

    def _readable(self, relpath: str, row: ScanRow) -> bool:
        """Notes a row's problems; whether its image counts (a header, under the pixel limit)."""
        size, header, error, warnings = row[:4]
        if error is None and not warnings:
            return True
        self._note_problems(
            ProbeRecord(relpath, size, None if header is None else ImageHeader._make(header), error, warnings)
        )
        return header is not None and "too-many-pixels" not in warnings

    def copy_candidates(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        """The positions (ascending), keys and identities of the files whose key another file shares, each
        file at its first name, and how many names are more names of a file already counted. The
        census lets its columns go here (they are joined, not copied): call it once, at the end."""
        if not self.copy_keys:
            return np.empty(0, np.int64), np.empty(0, np.uint64), np.empty(0, np.uint64), 0
        # one array at a time, each list let go as it is joined: the peak stays near twice the columns
        keys = np.concatenate(self.copy_keys)
        self.copy_keys = []
        identities = np.concatenate(self.copy_identities)
        self.copy_identities = []
        places = np.concatenate(self.copy_places)
        self.copy_places = []
        order = np.lexsort((places, identities, keys))  # by key, then file, then walk order
        keys = keys[order]
        identities = identities[order]
        places = places[order]
        del order
        first = np.ones(len(keys), bool)  # a file's first name
        first[1:] = (keys[1:] != keys[:-1]) | (identities[1:] != identities[:-1])
        links = int(len(keys) - first.sum())
        keys, identities, places = keys[first], identities[first], places[first]
        same = keys[1:] == keys[:-1]
        shared = np.zeros(len(keys), bool)
        shared[1:] |= same
        shared[:-1] |= same
        chosen = np.argsort(places[shared], kind="stable")
        return places[shared][chosen], keys[shared][chosen], identities[shared][chosen], links

    def _note_problems(self, record: ProbeRecord) -> None:
        found = []
        if record.error is not None:
            kind = getattr(record.error, "kind", "corrupt header")  # a plain str: from outside probe_file
            found.append((kind, f"{display(record.relpath)}: {record.error}"))
        for warning in record.warnings:
            note = ""
            if warning == "extension-mismatch" and record.header is not None:
                note = f": content is {record.header.format}"
            elif warning == "too-many-pixels" and record.header is not None:
                note = f": {record.header.width}x{record.header.height}"
            found.append((_PROBLEM_KINDS[warning], display(record.relpath) + note))
        for kind, example in found:
            entry = self.problems.setdefault(kind, [0, []])
            entry[0] += 1
            if len(entry[1]) < self.examples:
                entry[1].append(example)

    def report(self, *, train_size: int = 224, root: str = "") -> ProbeReport:
        sizes, file_sizes = self.sizes.merge(), self.file_sizes.merge()
        widths = (sizes.values >> np.uint64(_SIDE_BITS)).astype(np.float64)
        heights = (sizes.values & np.uint64(_SIDE_LIMIT)).astype(np.float64)
        shorts, longs = np.minimum(widths, heights), np.maximum(widths, heights)
        counts = sizes.counts
        metrics = {
            "width": (widths, counts),
            "height": (heights, counts),
            "short_side": (shorts, counts),
            "megapixels": (widths * heights / 1e6, counts),
            "aspect": (longs / np.maximum(shorts, 1), counts),
            "kilobytes": (file_sizes.values.astype(np.float64) / 1024, file_sizes.counts),
        }
        images = int(counts.sum())
        return ProbeReport(
            root=root,
            files=self.files,
            images=images,
            bytes=self.bytes,
            seconds=0.0,
            workers=1,
            percentiles={name: counted_percentiles(values, n) for name, (values, n) in metrics.items()},
            short_side_histogram=_histogram(shorts, counts),
            formats=dict(self.formats.most_common()),
            modes=dict(self.modes.most_common()),
            rotated=self.rotated,
            progressive=self.progressive,
            problems={kind: ProblemSummary(count, examples) for kind, (count, examples) in self.problems.items()},
            recommendation=recommend(widths, heights, sizes.weights, train_size, counts=counts) if images else None,
            size_counts=[(int(w), int(h), int(n)) for w, h, n in zip(widths, heights, counts, strict=True)],
        )


PERCENTILES = (1, 5, 25, 50, 75, 95, 99)


def counted_percentiles(values: np.ndarray, counts: np.ndarray) -> dict[str, float]:
    """What np.percentile and np.mean say of the multiset where each value appears `counts` times,
    without expanding it (percentiles to the last bit; the mean from sums, to rounding)."""
    total = int(counts.sum())
    if total == 0:
        return {}
    found = counted_quantiles(values, counts, np.true_divide(np.asarray(PERCENTILES), 100))
    summary = {f"p{q}": round(float(v), 3) for q, v in zip(PERCENTILES, found, strict=True)}
    mean = float((values * counts).sum() / total)
    summary.update(min=float(values.min()), max=float(values.max()), mean=round(mean, 3))
    return summary


def counted_quantiles(values: np.ndarray, counts: np.ndarray, quantiles: np.ndarray) -> np.ndarray:
    """np.quantile's default method ('linear') over a multiset given as values and their counts."""
    order = np.argsort(values, kind="stable")
    values, counts = values[order], counts[order]
    ends = np.cumsum(counts)  # ranks ends[i-1] .. ends[i]-1 of the sorted multiset hold values[i]
    total = int(ends[-1])
    virtual = (total - 1) * quantiles
    previous = np.floor(virtual)
    gamma = virtual - previous
    rank = previous.astype(np.int64)
    lower = values[np.searchsorted(ends, rank, side="right")]
    upper = values[np.searchsorted(ends, np.minimum(rank + 1, total - 1), side="right")]
    difference = upper - lower
    # numpy's _lerp: from the nearer end, so that the result is exact at both ends
    quantile: np.ndarray = np.where(gamma >= 0.5, upper - difference * (1 - gamma), lower + difference * gamma)
    return quantile


def _histogram(shorts: np.ndarray, counts: np.ndarray) -> list[tuple[int, int | None, int]]:
    edges = [*list(SHORT_SIDE_BINS), math.inf]
    binned, _ = np.histogram(shorts, bins=edges, weights=counts)
    bins = zip(SHORT_SIDE_BINS, edges[1:], binned, strict=True)
    return [(lo, None if math.isinf(hi) else int(hi), int(n)) for lo, hi, n in bins if n]


_PROBLEM_KINDS = {
    "truncated": "truncated (no end marker)",
    "extension-mismatch": "extension does not match content",
    "too-many-pixels": "over the pixel limit (decompression bomb?)",
}


def recommend(
    widths: np.ndarray,
    heights: np.ndarray,
    file_bytes: np.ndarray,
    train_size: int = 224,
    crop_ratio: float = 0.875,
    *,
    counts: np.ndarray | None = None,
) -> Recommendation:
    """The short side to pre-resize to for training at `train_size`, from displayed sizes.

    One entry per image, or with `counts` one per distinct size: `counts[i]` images of that size,
    whose files hold `file_bytes[i]` bytes in all.

    The classic recipe resizes to train_size / 0.875 (224 -> 256) and crops. We never pick a size
    above what most images have: below the median short side, images would be stored upscaled.
    """
    widths = np.asarray(widths, dtype=np.float64)
    heights = np.asarray(heights, dtype=np.float64)
    file_bytes = np.asarray(file_bytes, dtype=np.float64)
    counts = np.ones(len(widths), np.int64) if counts is None else np.asarray(counts, np.int64)
    short_sides = np.minimum(widths, heights)
    target = int(math.ceil(train_size / crop_ratio / 8) * 8)
    median = float(counted_quantiles(short_sides, counts, np.array([0.5]))[0])
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
    pixels = widths * heights * counts
    return Recommendation(
        train_size=train_size,
        resize=resize,
        reason=reason,
        shrink_share=round(float(counts[scale < 1].sum() / counts.sum()), 4),
        bytes_before=int(file_bytes.sum()),
        # Assumes the stored bits per pixel stay the same: JPEG size is close to linear in pixels.
        bytes_after_estimate=int((file_bytes * area).sum()),
        # Decode time is close to linear in pixels, so this is also the decode time saved.
        decode_work_saved=round(float(1 - (pixels * area).sum() / pixels.sum()), 4),
    )
