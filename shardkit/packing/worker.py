"""The unit of work of a pack: one shard, from its items to its place in the output, in one worker.

`write_shard` reads and encodes the job's items in order and writes their records through a
`ShardWriting` (shard_writing.py), which hands the closed shard to the job's destination: renamed
into a folder, or uploaded to a bucket (output.py chooses; the worker never asks which). An input
that cannot be packed becomes a Failure (and where --dedup left out copies of it, the first of them
that packs takes its slot); a failure to write the output raises OutputError and leaves no part of
the shard behind. The worker knows nothing of who runs it (a local process pool or Ray:
packing/running.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ..core.config import EncodeConfig, ResizeConfig
from ..formats import get_format
from ..formats.base import Record
from ..runtime.timeline import mark
from .counters import count_done
from .folder_output import FolderShards
from .plan import ShardSpec
from .reading import Files, Outcome, Packing, Reading, file_outcome
from .shard_writing import PICTURE_COUNTS, TIMED_STEPS, Destination, PartResult, ShardResult, ShardWriting
from .sources.item import Item

T = TypeVar("T")


@dataclass(frozen=True)
class ShardJob:
    spec: ShardSpec
    output: str
    format: str
    resize: ResizeConfig
    encode: EncodeConfig
    plan: str  # fingerprint, stored with the result so a resume can trust it
    # --dedup: by an item's key, the copies left out for it, tried in its slot (in this order) when it fails
    copies: dict[str, tuple[Item, ...]] = field(default_factory=dict)
    storage_options: dict[str, Any] | None = None  # what reaches a bucket source's objects
    # How the items become records: the source's own reading (its `Source.reading`): image files,
    # a table of URLs' downloads, videos cut into clips
    reading: Reading = field(default_factory=Files)
    # Where the shard goes once written (the output's choice, output.py): None puts it into the
    # folder `output` (folder_output.FolderShards).
    destination: Destination | None = None
    # A part of a shard (packing/parts.py): `spec.items` are the part's; the worker encodes them
    # and hands the records back for the driver to write (encode_part), numbered from 0 of `parts`.
    part: int | None = None
    parts: int = 1
    hash_kept: bool = False  # --dedup near: a picture kept as it was gets its DCT hash too (encode.py)


def write_shard(job: ShardJob) -> ShardResult:
    """Write one shard from its items; a bad image is recorded, never fatal. A failure to write the
    output (disk full, read-only) raises OutputError and leaves no part of the shard behind."""
    mark(f"job {job.spec.name}")
    result, _ = _written(job, ShardWriting.close)
    mark(f"done {job.spec.name}")
    return result


def _written(job: ShardJob, close: Callable[[ShardWriting], T]) -> tuple[T, ShardWriting]:
    """The job's items encoded and written in order, then `close(shard)`: put in place, or
    handed on as a part; whatever of it is neither is removed, all of it on a failure."""
    with contextlib.ExitStack() as files:  # (what the destination must undo when the writing ends)
        shard = ShardWriting(job, destination_of(job), files)
        packed = _packed(job, shard.timings, shard.copies_used, shard.counts)
        try:
            for record, size, failures in packed:
                shard.add(record, size, failures)
                count_done()
            return close(shard), shard
        finally:
            packed.close()  # (downloads still queued are dropped)
            shard.discard()


def encode_part(job: ShardJob) -> PartResult:
    """A part of a shard (`job.spec` holds that part's items), as `write_shard` would write it:
    a shard's parts are encoded on several workers at once. A tar's part is written here, to a
    file the driver appends (its records never pass through the pipe to the driver); any other
    format's records go back to the driver."""
    mark(f"part {job.spec.name}:{job.part}")
    if get_format(job.format).appends:
        segment, shard = _written(job, ShardWriting.close_part)
        mark(f"done {job.spec.name}:{job.part}")
        return PartResult(job.spec.name, job.part or 0, [], shard.timings, shard.copies_used, segment, shard.counts)
    timings = dict.fromkeys(TIMED_STEPS, 0.0)
    copies_used: dict[str, str] = {}
    counts = dict.fromkeys(PICTURE_COUNTS, 0)
    done = []
    for outcome in _packed(job, timings, copies_used, counts):
        done.append(outcome)
        count_done()
    mark(f"done {job.spec.name}:{job.part}")
    return PartResult(job.spec.name, job.part or 0, done, timings, copies_used, counts=counts)


def run_job(job: ShardJob) -> ShardResult | PartResult:
    """What a worker runs: a whole shard, or a part of one."""
    return write_shard(job) if job.part is None else encode_part(job)


def destination_of(job: ShardJob) -> Destination:
    """Where the job's shard goes: its output's choice, or by default the folder `job.output`."""
    return job.destination if job.destination is not None else FolderShards(job.output)


def _packed(
    job: ShardJob, timings: dict[str, float], copies_used: dict[str, str], counts: dict[str, int]
) -> Generator[Outcome, None, None]:
    """Each item's outcome in the shard's order, as the source's reading makes it (reading.py):
    its record (None where it failed; a video's clips, a list), source bytes and failures; what
    its pictures were is added to `counts` (PICTURE_COUNTS)."""
    return job.reading.packed(_packing(job, timings, copies_used, counts))


def _packing(job: ShardJob, timings: dict[str, float], copies_used: dict[str, str], counts: dict[str, int]) -> Packing:
    return Packing(
        job.spec.items,
        job.resize,
        job.encode,
        job.format,
        timings,
        counts,
        copies_used,
        job.copies,
        job.storage_options,
        job.hash_kept,
    )


def pack_record(item: Item, job: ShardJob) -> Record | None:
    """One item's record as a shard of `job` would hold it, or None if it fails (what --shard-bytes
    calibrates its estimate of the output's bytes on: the very path a worker takes)."""
    packing = _packing(job, dict.fromkeys(TIMED_STEPS, 0.0), {}, dict.fromkeys(PICTURE_COUNTS, 0))
    return file_outcome(item, packing)[0]
