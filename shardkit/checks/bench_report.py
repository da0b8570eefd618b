"""What `bench` reports: a row per timed pass (its seconds in each round, their median and the
rates) and the report that compares the passes with a baseline, each ratio the median of the
ratios within rounds; the names of the passes that the report and the CLI compare.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .explain import Explanation

BASELINE = "folder: PIL (ImageFolder loader)"
MEMORY = "memory: same bytes, libjpeg-turbo"
VIDEO_BASELINE = "videos: PyAV, each clip's span"  # an output of clips: decoded from its source videos
IO_ONLY = "shards: bytes only (I/O)"  # reads, decodes nothing: the CLI plots it apart from the decoders


@dataclass
class BenchRow:
    name: str
    images: int
    bytes: int
    seconds: list[float]
    workers: int

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def images_per_second(self) -> float:
        return self.images / self.median if self.median else 0.0

    @property
    def megabytes_per_second(self) -> float:
        return self.bytes / self.median / 1e6 if self.median else 0.0

    @property
    def per_core(self) -> float:
        return self.images_per_second / self.workers

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name, "images": self.images, "bytes": self.bytes, "workers": self.workers,
            "seconds": self.seconds, "median_seconds": self.median, "images_per_second": self.images_per_second,
            "mb_per_second": self.megabytes_per_second, "images_per_second_per_core": self.per_core,
        }  # fmt: skip


@dataclass
class BenchReport:
    output: str
    source: str | None
    format: str
    images: int
    workers: int
    cold: bool
    repeat: int
    rows: list[BenchRow] = field(default_factory=list)
    paired_overhead: list[float] = field(default_factory=list)  # one per round: bench_passes.paired_overhead
    baseline: str = BASELINE  # the pass the others are compared with (an output of clips: VIDEO_BASELINE)
    unit: str = "images"  # what a pass counts: images, or clips
    explained: Explanation | None = None  # with --explain: the loader's stats and advice (checks/explain)

    def ratio(self, name: str, baseline: str | None = None) -> float | None:
        """Speed of pass `name` over `baseline` (the report's own by default): the median of the
        ratios within each round."""
        baseline = self.baseline if baseline is None else baseline
        rows = {row.name: row for row in self.rows}
        if name not in rows or baseline not in rows:
            return None
        row, base = rows[name], rows[baseline]
        if not row.images or not base.images or not all(row.seconds) or not all(base.seconds):
            return None
        per_image = [(b / base.images) / (r / row.images) for r, b in zip(row.seconds, base.seconds, strict=True)]
        return statistics.median(per_image)

    def reader_overhead(self) -> float | None:
        """How much slower the shard reader is than decoding the same bytes from memory: from the
        paired measurement when there is one, else from the two passes."""
        if self.paired_overhead:
            return statistics.median(self.paired_overhead)
        ratio = self.ratio("shards: libjpeg-turbo", MEMORY)
        return None if ratio is None else 1 / ratio - 1

    def to_json(self) -> dict[str, Any]:
        return {
            "output": self.output, "source": self.source, "format": self.format, "images": self.images,
            "workers": self.workers, "cold": self.cold, "repeat": self.repeat,
            "rows": [row.to_json() for row in self.rows],
            "baseline": self.baseline, "unit": self.unit,
            "speedup_vs_folder_pil": {row.name: self.ratio(row.name) for row in self.rows},
            "reader_overhead": self.reader_overhead(), "paired_overhead_per_round": self.paired_overhead,
            "explain": None if self.explained is None else self.explained.to_json(),
        }  # fmt: skip
