"""The last shards of a pack split into parts that several workers encode at once, and the driver
writing each such shard from its parts: with one worker per shard, the other workers would sit idle
while the last shards are written (a small folder's single shard on one core).

Only the last `workers` shards of the plan are split, each into up to two parts per worker, of at
least MIN_PART items, the very last into parts that shrink as it ends (`guided`): the earlier
shards keep a worker each, and their records never pass through the driver. A split shard's bytes
are a whole one's: the same records, in the same order, through the same writer
(shard_writing.ShardWriting), with the same done marker and index part. A tar's parts are written
by their workers and appended here (`Backend.appends`); other formats' records come back through
the result. Only an output whose shards are files in the pack's local folder is split
(`Output.shards_here`): the driver puts the joined shard in place there.
"""

from __future__ import annotations

import contextlib
import itertools
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

from .shard_writing import PartResult, ShardResult, ShardWriting
from .worker import ShardJob, destination_of

MIN_PART = 16  # items: below this, a part's round trip to a worker weighs more than what it evens out


def split_last(jobs: Iterator[ShardJob], workers: int) -> Iterator[ShardJob]:
    """`jobs` in order, the last `workers` of them as parts: the plan is read `workers` shards
    ahead, so the tail is known before it is handed out."""
    ahead: deque[ShardJob] = deque()
    for job in jobs:
        ahead.append(job)
        if len(ahead) > workers:
            yield ahead.popleft()
    while ahead:
        job = ahead.popleft()
        yield from split(job, workers, last=not ahead)


def split(job: ShardJob, workers: int, last: bool = False) -> Iterator[ShardJob]:
    """The job as part jobs (itself when too small to split): up to 2 x `workers` of near-equal
    item counts, or for the plan's last shard, parts that shrink as it ends (`guided`)."""
    if not job.reading.may_split():
        yield job
        return
    items = job.spec.items
    sizes = guided(len(items), workers) if last else even(len(items), min(2 * workers, len(items) // MIN_PART))
    parts = len(sizes)
    if parts < 2:
        yield job
        return
    bounds = [0, *itertools.accumulate(sizes)]
    for number in range(parts):
        own = items[bounds[number] : bounds[number + 1]]
        keys = {item.key for item in own}
        copies = {key: copies for key, copies in job.copies.items() if key in keys}
        yield replace(job, spec=replace(job.spec, items=own), copies=copies, part=number, parts=parts)


def even(count: int, parts: int) -> list[int]:
    """`count` items in `parts` near-equal parts (one part when `parts` < 1)."""
    parts = max(parts, 1)
    return [count * (number + 1) // parts - count * number // parts for number in range(parts)]


def guided(count: int, workers: int) -> list[int]:
    """Part sizes for the plan's last shard: rounds of `workers` equal parts, each round half of
    what is left, down to parts of MIN_PART (guided scheduling), so that the last parts are small
    and the workers end together (with equal parts, one worker would sit idle through most of a
    part at the end)."""
    sizes: list[int] = []
    left = count
    while left >= 2 * workers * MIN_PART:
        each = left // (2 * workers)
        sizes += [each] * workers
        left -= each * workers
    if left >= MIN_PART or not sizes:
        return sizes + even(left, min(workers, left // MIN_PART))
    sizes[-1] += left  # (fewer than MIN_PART left over: the last part takes them)
    return sizes


@dataclass
class _Joined:
    writing: ShardWriting
    parts: int
    waiting: dict[int, PartResult] = field(default_factory=dict)
    next: int = 0


class Joining:
    """The split shards the driver is writing: each opened at its first part back, its parts
    written in the shard's order as soon as those before them are, closed and put in place at
    the last. `abandon` discards every one still open (a pack stopped or failing)."""

    def __init__(self) -> None:
        self._open: dict[str, _Joined] = {}
        self._files = contextlib.ExitStack()  # (a folder's workspace enters nothing here)

    def add(self, job: ShardJob, result: PartResult) -> ShardResult | None:
        """A part back from a worker (`job` is its part job); the shard's result once it is whole."""
        joined = self._open.get(result.name)
        if joined is None:
            whole = replace(job, part=None)  # (the shard's own temporary name, not a part's)
            writing = ShardWriting(whole, destination_of(whole), self._files)
            joined = self._open[result.name] = _Joined(writing, job.parts)
        joined.waiting[result.part] = result
        writing = joined.writing
        while joined.next in joined.waiting:
            part = joined.waiting.pop(joined.next)
            for stage, seconds in part.timings.items():
                writing.timings[stage] = writing.timings.get(stage, 0.0) + seconds
            writing.copies_used.update(part.copies_used)
            for name, count in part.counts.items():
                writing.counts[name] = writing.counts.get(name, 0) + count
            if part.segment is not None:
                writing.append(part.segment)
            for record, size, failures in part.packed:
                writing.add(record, size, failures)
            joined.next += 1
        if joined.next < joined.parts:
            return None
        del self._open[result.name]
        try:
            return writing.close()
        finally:
            writing.discard()

    def abandon(self) -> None:
        for joined in self._open.values():
            joined.writing.discard()
            for part in joined.waiting.values():
                if part.segment is not None:
                    Path(part.segment.path).unlink(missing_ok=True)
        self._open.clear()
