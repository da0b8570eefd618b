"""A shard being written: its records taken in order under a temporary name, then closed, hashed,
given its .idx file and handed to its `Destination`, which records it and puts it in place (a folder's
rename, a bucket's upload: output.py chooses); or closed as a part of a shard for the driver to
append (packing/parts.py). What comes back of it: `ShardResult`, and for a part `PartResult`.

The writing never asks where the shard goes: the job carries its destination, and a failure to
write raises OutputError and leaves no part of the shard behind (`discard`).
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from ..core.errors import Failure, OutputError, ShardFormatError
from ..core.manifest import ShardInfo, idx_name, info_of, sha256_file
from ..formats import get_format
from ..formats.base import Backend, Record, ShardWriter
from .index import row as index_row
from .working_folder import writing

if TYPE_CHECKING:
    from .plan import ShardSpec
    from .reading import Reading

# What a worker times, per shard: the worker time split of pack's summary.
TIMED_STEPS = ("read", "decode", "resize", "encode", "write")
# What a worker counts of the pictures it stores, per shard (the manifest's totals of the same
# names): transparency flattened onto the background, every stored pixel alike, and both at once.
PICTURE_COUNTS = ("alpha_flattened", "single_colour", "single_colour_flattened")


class Workspace(NamedTuple):
    """Where a shard is written before it is complete: `folder` (named in errors), the shard's
    temporary file and its .idx file's."""

    folder: str
    shard: Path
    idx: Path


class Destination(Protocol):
    """Where a written shard goes (folder_output.FolderShards, upload.BucketShards), carried by its
    job: the writing asks it for a workspace, then hands it the closed shard."""

    def workspace(self, name: str, files: contextlib.ExitStack) -> Workspace:
        """Where the shard (or the part) `name` is written; what must be undone when the writing
        ends is entered into `files`."""
        ...

    def put(self, result: ShardResult, rows: list[tuple[Any, ...]], space: Workspace) -> None:
        """The closed shard at `space` (its index rows `rows`) recorded and put in place."""
        ...


class ShardOrder(Protocol):
    """What the writing needs of its job (worker.ShardJob, which imports this module)."""

    @property
    def spec(self) -> ShardSpec: ...
    @property
    def format(self) -> str: ...
    @property
    def plan(self) -> str: ...
    @property
    def part(self) -> int | None: ...
    @property
    def reading(self) -> Reading: ...


@dataclass
class ShardResult:
    shard: ShardInfo
    errors: list[Failure]
    input_bytes: int
    timings: dict[str, float]
    plan: str = ""
    reused: bool = False
    worker: str = ""  # host:pid (local) or Ray node id that wrote the shard
    companion: ShardInfo | None = None  # the shard's .idx file for other readers (Backend.idx_file)
    # by the key of each item that failed and had copies: the key of the copy packed in its place ("" none)
    copies_used: dict[str, str] = field(default_factory=dict)
    already_uploaded: bool = False  # a bucket already had these very bytes: not sent again
    # an uploaded shard's part of index.parquet, for the driver to write (BucketOutput.mark_done); never on disk
    index_part: bytes | None = field(default=None, repr=False)
    # PICTURE_COUNTS of its records; None for a shard an earlier shardkit wrote, which did not count
    counts: dict[str, int] | None = field(default_factory=dict)

    def marker(self) -> dict[str, Any]:
        """The result as its done marker holds it (the index part is a file of its own)."""
        record = asdict(replace(self, index_part=None))
        del record["index_part"]
        return record


@dataclass
class Segment:
    """A part of a shard written by a worker (ShardWriter.close_part) for the driver to append:
    its file, in the output's tmp folder, and what the driver keeps of its records."""

    path: str
    count: int
    members: list[tuple[str, int, int]] | None  # placed from the part's own start
    rows: list[tuple[Any, ...]]  # its records' rows of index.parquet, numbered from the part's first
    errors: list[Failure]
    input_bytes: int


@dataclass
class PartResult:
    """A part of a shard (`ShardJob.part`), encoded by a worker for the driver to write
    (packing/parts.py): for a format whose shards append (a tar), the part written (`segment`);
    for any other, each item's record, source bytes and failures, in the shard's order."""

    name: str  # the shard's
    part: int
    packed: list[tuple[Record | list[Record] | None, int, list[Failure]]]
    timings: dict[str, float]
    copies_used: dict[str, str]
    segment: Segment | None = None
    counts: dict[str, int] = field(default_factory=dict)  # PICTURE_COUNTS of its records

    @property
    def errors(self) -> list[Failure]:
        """Its items' failures, whichever way the part came back."""
        if self.segment is not None:
            return self.segment.errors
        return [failure for _, _, failures in self.packed for failure in failures]


class ShardWriting:
    """A shard being written under a temporary name, its records handed in order (by the items'
    encoding in this process, or by a driver joining the parts workers encoded); `close` hands it
    to its destination, which records it and puts it in place; `discard` removes whatever is left of it
    unplaced."""

    def __init__(self, job: ShardOrder, destination: Destination, files: contextlib.ExitStack) -> None:
        self.job = job
        self.destination = destination
        self.backend = get_format(job.format)
        # (a part's own name: one worker may write two parts of a shard before either is appended)
        name = job.spec.name if job.part is None else f"{job.spec.name}.part{job.part}"
        self.space = destination.workspace(name, files)
        self.timings = dict.fromkeys(TIMED_STEPS, 0.0)
        self.errors: list[Failure] = []
        self.input_bytes = 0
        self.rows: list[tuple[Any, ...]] = []  # the shard's part of index.parquet
        self.copies_used: dict[str, str] = {}
        self.counts = dict.fromkeys(PICTURE_COUNTS, 0)
        with writing(self.space.folder, job.spec.name):
            self.space.shard.parent.mkdir(parents=True, exist_ok=True)
            self.writer: ShardWriter = self.backend.writer(str(self.space.shard))
        self.closed = False
        self.handed_on = False  # closed as a part: its file is the driver's to append and remove

    def add(self, record: Record | list[Record] | None, size: int, failures: list[Failure]) -> None:
        """One item's outcome: its record (a video's clips, a list; None where it failed), its
        source bytes, its failures."""
        self.errors.extend(failures)
        if record is not None:
            self.input_bytes += size
        name = self.job.spec.name
        for one in record if isinstance(record, list) else [] if record is None else [record]:
            written = time.perf_counter()
            with writing(self.space.folder, name):
                self.writer.add(one)
            self.rows.append(index_row(one, name, len(self.rows)))
            self.timings["write"] += time.perf_counter() - written

    def close_part(self) -> Segment:
        """Closed as a part of its shard (`job.part`), its file left for the driver to append."""
        written = time.perf_counter()
        with writing(self.space.folder, self.job.spec.name):
            count = self.writer.close_part()
        self.closed = self.handed_on = True
        self.timings["write"] += time.perf_counter() - written
        return Segment(str(self.space.shard), count, self.writer.members, self.rows, self.errors, self.input_bytes)

    def append(self, segment: Segment) -> None:
        """A part a worker wrote (close_part), after the records already here; its file removed."""
        written = time.perf_counter()
        self.errors.extend(segment.errors)
        self.input_bytes += segment.input_bytes
        first = len(self.rows)
        self.rows += [(*row[:2], first + row[2], *row[3:]) for row in segment.rows]
        try:
            with writing(self.space.folder, self.job.spec.name):
                self.writer.append(segment.path, segment.count, segment.members)
        finally:  # (appended or not, it is of no use: on a failure the whole shard is written again)
            Path(segment.path).unlink(missing_ok=True)
        self.timings["write"] += time.perf_counter() - written

    def close(self) -> ShardResult:
        """The shard closed, hashed, given its .idx file and put in place by its destination."""
        job, space = self.job, self.space
        closing = time.perf_counter()
        try:
            with writing(space.folder, job.spec.name):
                count = self.writer.close()
                self.closed = True
                temp = space.shard
                info = ShardInfo(job.spec.name, count, temp.stat().st_size, self.writer.sha256() or sha256_file(temp))
                companion = _write_idx_file(self.backend, temp, space.idx, info, self.writer.members)
                worker = f"{socket.gethostname()}:{os.getpid()}"
                result = ShardResult(
                    info, self.errors, self.input_bytes, self.timings, job.plan, worker=worker,
                    companion=companion, copies_used=self.copies_used, counts=self._counts(),
                )  # fmt: skip
            self.timings["write"] += time.perf_counter() - closing
            self.destination.put(result, self.rows, space)
        except BaseException:
            self._abort()
            raise
        return result

    def _counts(self) -> dict[str, int] | None:
        """The shard's PICTURE_COUNTS: its records', with those of the records a --resume kept from
        the earlier shard (unknown where that shard's marker did not count them)."""
        return self.job.reading.shard_counts(self.counts)

    def _abort(self) -> None:
        if not self.closed:  # the first failure is the one to report; the abort's own is not
            self.closed = True
            with contextlib.suppress(Exception):
                self.writer.abort()

    def discard(self) -> None:
        """Whatever of the shard was not put in place nor handed on as a part: the writer aborted,
        its temporary files gone."""
        self._abort()
        if not self.handed_on:
            self.space.shard.unlink(missing_ok=True)
        self.space.idx.unlink(missing_ok=True)


def _write_idx_file(
    backend: Backend, shard: Path, path: Path, info: ShardInfo, members: list[tuple[str, int, int]] | None
) -> ShardInfo | None:
    """The format's .idx file of the shard just written, for other readers (DALI's, for a tar),
    from the members its writer kept where it did."""
    if backend.idx_file is None:
        return None
    try:
        data = backend.idx_file(str(shard), members)
    except ShardFormatError as error:  # our own writer's tar: a bug, never the input's fault
        raise OutputError(f"{shard}: cannot index the shard just written ({error}); a shardkit bug") from None
    if data is None:  # a tar DALI's index cannot describe (an extension with a space, no sample)
        return None
    path.write_bytes(data)
    return info_of(idx_name(info.name), info.count, data)
