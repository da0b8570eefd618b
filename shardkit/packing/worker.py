"""The unit of work of a pack: one shard, from its items to a file in the output, in one worker.

`write_shard` writes under a temporary name, then the shard's part of index.parquet, its done
marker, the format's index file and the shard itself are renamed into place, in that order, so
every shard in the output is on record. For an output URL (`ShardJob.remote`) the shard is written
in a scratch folder of the task's own (scratch.py), uploaded between its markers and deleted
(upload.py), and its index part and done marker go back to the driver in the result: nothing is
written where the driver's staging folder is. An input that cannot be packed becomes a Failure (and
where --dedup left out copies of it, the first of them that packs takes its slot); a
failure to write the output raises OutputError and leaves no part of the shard behind. The worker
knows nothing of who runs it (a local process pool or Ray: packing/running.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
import time
from collections.abc import Callable, Generator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from ..core.clips import CLIP_EXT
from ..core.config import MAX_RECORD_BYTES, RECORD_META_ALLOWANCE, ClipConfig, EncodeConfig, ResizeConfig, WebConfig
from ..core.errors import Failure, HeaderError, ImageError, OutputError, ShardFormatError, StorageError, describe
from ..core.headers import HEAD_BYTES, ImageHeader, parse_header
from ..core.manifest import ShardInfo, idx_name, info_of, sha256_file, write_json_atomic
from ..core.safeio import open_regular, read_regular
from ..core.timeline import mark
from ..formats import get_format
from ..formats.base import Backend, Record, ShardWriter
from ..storage.store import Store
from ..storage.urls import is_remote
from .index import part_bytes, part_path, write_part
from .index import row as index_row
from .objects import object_bytes, object_reads
from .output import done_path, state_dir, temp_dir, writing
from .plan import ShardSpec
from .scratch import held, node_scratch
from .sources import Item, display
from .sources.sidecars import Sidecars, read_sidecars
from .upload import Held, deliver

T = TypeVar("T")

# What a worker times, per shard: the worker time split of pack's summary.
STAGES = ("read", "decode", "resize", "encode", "write")
# What a worker counts of the pictures it stores, per shard (the manifest's totals of the same
# names): transparency flattened onto the background, every stored pixel alike, and both at once.
PICTURE_COUNTS = ("alpha_flattened", "single_colour", "single_colour_flattened")


if TYPE_CHECKING:
    from .fetched import Kept  # (imported where a URL table needs it: urllib3 and threads)


@dataclass(frozen=True)
class ShardJob:
    spec: ShardSpec
    output: str
    format: str
    resize: ResizeConfig
    encode: EncodeConfig
    plan: str  # fingerprint, stored with the result so a resume can trust it
    confine: str | None = None  # a table's rows may only name files under this (real) folder
    # --dedup: by an item's key, the copies left out for it, tried in its slot (in this order) when it fails
    copies: dict[str, tuple[Item, ...]] = field(default_factory=dict)
    storage_options: dict[str, Any] | None = None  # what reaches a bucket source's objects
    web: WebConfig | None = None  # a table of URLs: the items' paths are downloaded, so
    # --resume of a shard some of whose rows failed transiently: its earlier errors (the shard file
    # in the output keeps the other rows' records, so only those rows are downloaded again)
    earlier: list[Failure] | None = None
    earlier_counts: dict[str, int] | None = None  # and the PICTURE_COUNTS of the records it keeps (None: not counted)
    # An output URL: the shard is uploaded there as soon as it is written (packing/upload.py), from
    # `scratch` (None: the node's own temporary folder, for a task that cannot see the driver's);
    # `held` is what the bucket held under its name, on record, when the pack began.
    remote: Store | None = None
    scratch: str | None = None
    held: Held | None = None
    clips: ClipConfig | None = None  # the items are videos, each cut into clips: a record a clip
    # A part of a shard (packing/parts.py): `spec.items` are the part's; the worker encodes them
    # and hands the records back for the driver to write (encode_part), numbered from 0 of `parts`.
    part: int | None = None
    parts: int = 1


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
    stand_ins: dict[str, str] = field(default_factory=dict)
    already_held: bool = False  # uploaded to a bucket that held these very bytes: not sent again
    # an uploaded shard's part of index.parquet, for the driver to keep (upload.keep); never on disk
    index_part: bytes | None = field(default=None, repr=False)
    # PICTURE_COUNTS of its records; None for a shard an earlier shardkit wrote, which did not count
    counts: dict[str, int] | None = field(default_factory=dict)

    def marker(self) -> dict[str, Any]:
        """The result as its done marker holds it (the index part is a file of its own)."""
        record = asdict(replace(self, index_part=None))
        del record["index_part"]
        return record


# Set in each worker process by the executor; counts images as they are done, for live progress.
_progress_counter: Any = None


def init_worker(counter: Any) -> None:
    global _progress_counter
    _progress_counter = counter


def _count_one() -> None:
    """One item done, on the live progress counter (when the executor gave this process one)."""
    if _progress_counter is not None:
        with _progress_counter.get_lock():
            _progress_counter.value += 1


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
    with contextlib.ExitStack() as scratch:
        shard = ShardWriting(job, scratch)
        packed = _packed(job, shard.timings, shard.stand_ins, shard.counts)
        try:
            for record, size, failures in packed:
                shard.add(record, size, failures)
                _count_one()
            return close(shard), shard
        finally:
            packed.close()  # (downloads still queued are dropped)
            shard.discard()


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
    stand_ins: dict[str, str]
    segment: Segment | None = None
    counts: dict[str, int] = field(default_factory=dict)  # PICTURE_COUNTS of its records

    @property
    def errors(self) -> list[Failure]:
        """Its items' failures, whichever way the part came back."""
        if self.segment is not None:
            return self.segment.errors
        return [failure for _, _, failures in self.packed for failure in failures]


def encode_part(job: ShardJob) -> PartResult:
    """A part of a shard (`job.spec` holds that part's items), as `write_shard` would write it:
    a shard's parts are encoded on several workers at once. A tar's part is written here, to a
    file the driver appends (its records through the result's pipe kept each worker from its next
    part ~15 ms, and the driver ~25 ms after the last one, of a 700-image pack); any other
    format's records go back to the driver."""
    mark(f"part {job.spec.name}:{job.part}")
    if get_format(job.format).appends:
        segment, shard = _written(job, ShardWriting.close_part)
        mark(f"done {job.spec.name}:{job.part}")
        return PartResult(job.spec.name, job.part or 0, [], shard.timings, shard.stand_ins, segment, shard.counts)
    timings = dict.fromkeys(STAGES, 0.0)
    stand_ins: dict[str, str] = {}
    counts = dict.fromkeys(PICTURE_COUNTS, 0)
    done = []
    for outcome in _packed(job, timings, stand_ins, counts):
        done.append(outcome)
        _count_one()
    mark(f"done {job.spec.name}:{job.part}")
    return PartResult(job.spec.name, job.part or 0, done, timings, stand_ins, counts=counts)


def run_job(job: ShardJob) -> ShardResult | PartResult:
    """What a worker runs: a whole shard, or a part of one."""
    return write_shard(job) if job.part is None else encode_part(job)


class ShardWriting:
    """A shard being written under a temporary name, its records handed in order (by the items'
    encoding in this process, or by a driver joining the parts workers encoded); `close` puts it
    in place, on record (see `_place`); `discard` removes whatever is left of it unplaced."""

    def __init__(self, job: ShardJob, scratch: contextlib.ExitStack) -> None:
        self.job = job
        self.backend = get_format(job.format)
        self.where, self.temp, self.idx_temp = _temp_paths(job, scratch)
        self.timings = dict.fromkeys(STAGES, 0.0)
        self.errors: list[Failure] = []
        self.input_bytes = 0
        self.rows: list[tuple[Any, ...]] = []  # the shard's part of index.parquet
        self.stand_ins: dict[str, str] = {}
        self.counts = dict.fromkeys(PICTURE_COUNTS, 0)
        with writing(self.where, job.spec.name):
            self.temp.parent.mkdir(parents=True, exist_ok=True)
            self.writer: ShardWriter = self.backend.writer(str(self.temp))
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
            with writing(self.where, name):
                self.writer.add(one)
            self.rows.append(index_row(one, name, len(self.rows)))
            self.timings["write"] += time.perf_counter() - written

    def close_part(self) -> Segment:
        """Closed as a part of its shard (`job.part`), its file left for the driver to append."""
        written = time.perf_counter()
        with writing(self.where, self.job.spec.name):
            count = self.writer.close_part()
        self.closed = self.handed_on = True
        self.timings["write"] += time.perf_counter() - written
        return Segment(str(self.temp), count, self.writer.members, self.rows, self.errors, self.input_bytes)

    def append(self, segment: Segment) -> None:
        """A part a worker wrote (close_part), after the records already here; its file removed."""
        written = time.perf_counter()
        self.errors.extend(segment.errors)
        self.input_bytes += segment.input_bytes
        first = len(self.rows)
        self.rows += [(*row[:2], first + row[2], *row[3:]) for row in segment.rows]
        try:
            with writing(self.where, self.job.spec.name):
                self.writer.append(segment.path, segment.count, segment.members)
        finally:  # (appended or not, it is of no use: on a failure the whole shard is written again)
            Path(segment.path).unlink(missing_ok=True)
        self.timings["write"] += time.perf_counter() - written

    def close(self) -> ShardResult:
        job, temp, idx_temp = self.job, self.temp, self.idx_temp
        closing = time.perf_counter()
        try:
            with writing(self.where, job.spec.name):
                count = self.writer.close()
                self.closed = True
                info = ShardInfo(job.spec.name, count, temp.stat().st_size, self.writer.sha256() or sha256_file(temp))
                companion = _write_idx_file(self.backend, temp, idx_temp, info, self.writer.members)
                worker = f"{socket.gethostname()}:{os.getpid()}"
                result = ShardResult(
                    info, self.errors, self.input_bytes, self.timings, job.plan, worker=worker,
                    companion=companion, stand_ins=self.stand_ins, counts=self._counts(),
                )  # fmt: skip
                if job.remote is None:
                    _place(job, result, self.rows, temp, idx_temp)
            self.timings["write"] += time.perf_counter() - closing
            if job.remote is not None:
                uploading = time.perf_counter()
                with writing(self.where, job.spec.name):
                    result.index_part = part_bytes(self.rows)
                    result.already_held = not deliver(job.remote, info, temp, companion, idx_temp, job.held)
                self.timings["upload"] = time.perf_counter() - uploading
        except BaseException:
            self._abort()
            raise
        return result

    def _counts(self) -> dict[str, int] | None:
        """The shard's PICTURE_COUNTS: its records', with those of the records a --resume kept from
        the earlier shard (unknown where that shard's marker did not count them)."""
        earlier = self.job.earlier_counts
        if self.job.earlier is None:
            return dict(self.counts)
        if earlier is None:
            return None
        return {name: count + earlier.get(name, 0) for name, count in self.counts.items()}

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
            self.temp.unlink(missing_ok=True)
        self.idx_temp.unlink(missing_ok=True)


def _packed(
    job: ShardJob, timings: dict[str, float], stand_ins: dict[str, str], counts: dict[str, int]
) -> Generator[tuple[Record | list[Record] | None, int, list[Failure]], None, None]:
    """Each item's record (None where it failed; a video's clips, a list), source bytes and
    failures, in the shard's order; what its pictures were is added to `counts` (PICTURE_COUNTS).
    A table of URLs' rows are encoded as their downloads arrive and handed on in order, so the
    encoder never idles while one row waits out its retries (fetched.py); any other source's are
    read and encoded in turn, a failed item's --dedup copies tried in its slot."""
    items = job.spec.items
    if job.clips is not None:
        for item in items:
            failures: list[Failure] = []
            clips, size = _clips_of(item, job, job.clips, timings, failures)
            yield clips, size, failures
        return
    if job.web is not None:
        from .fetched import downloads_in_any_order, refetched  # (urllib3 and threads: only for URL tables)

        if job.earlier is not None:
            shard = str(Path(job.output) / job.spec.name)
            for item, kept in zip(items, refetched(items, shard, job.format, job.earlier, job.web), strict=True):
                failures = []
                record, size = _pack_one(item, job, timings, failures, kept, counts)
                yield record, size, failures
            return
        done: dict[int, tuple[Record | None, int, list[Failure]]] = {}
        turn = 0
        for at, fetched in downloads_in_any_order(items, job.web):
            failures = []
            record, size = _pack_one(items[at], job, timings, failures, fetched, counts)
            done[at] = (record, size, failures)
            while turn in done:
                yield done.pop(turn)
                turn += 1
        return
    for item in items:
        failures = []
        record, size = _pack_one(item, job, timings, failures, counts=counts)
        if record is None and item.key in job.copies:
            record, size, stand_ins[item.key] = _stand_in(job.copies[item.key], job, timings, failures, counts)
        yield record, size, failures


def _temp_paths(job: ShardJob, scratch: contextlib.ExitStack) -> tuple[str, Path, Path]:
    """Where the shard is written before it is complete: the output's tmp folder, which must be
    visible here; or, for a shard to upload, a scratch folder of this task's own (scratch.py)."""
    if job.remote is not None:
        folder = Path(job.scratch) if job.scratch is not None else node_scratch()
        with writing(folder, job.spec.name):
            stem = scratch.enter_context(held(folder, job.spec.name))
        return str(folder), Path(f"{stem}.tmp"), Path(f"{stem}.idx.tmp")
    if not os.path.isdir(state_dir(job.output)) or not os.access(job.output, os.W_OK):
        raise OutputError(
            f"{job.output}: not visible or not writable from worker {socket.gethostname()}:{os.getpid()}; "
            "with --executor ray the output folder must be on storage that every node shares"
        )
    # (a part's: one worker may write two parts of a shard before either is appended)
    name = job.spec.name if job.part is None else f"{job.spec.name}.part{job.part}"
    temp = temp_dir(job.output) / f"{name}.{os.getpid()}.tmp"
    return job.output, temp, temp_dir(job.output) / f"{idx_name(name)}.{os.getpid()}.tmp"


def _place(job: ShardJob, result: ShardResult, rows: list[tuple[Any, ...]], temp: Path, idx_temp: Path) -> None:
    """The shard into the output folder, on record first."""
    write_part(part_path(state_dir(job.output), job.spec.name), rows)  # before the marker that vouches for it
    # The marker goes first: no shard is ever in the output without a record of it (what
    # --overwrite may delete); a marker whose shard is missing is simply written again.
    # The index goes before its shard: a shard in the output always has its index.
    write_json_atomic(done_path(job.output, job.spec.name), result.marker())
    if result.companion is not None:
        os.replace(idx_temp, Path(job.output) / result.companion.name)
    os.replace(temp, Path(job.output) / job.spec.name)


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


def _pack_one(
    item: Item,
    job: ShardJob,
    timings: dict[str, float],
    errors: list[Failure],
    fetched: Kept | None = None,
    counts: dict[str, int] | None = None,
) -> tuple[Record | None, int]:
    """One source file (or `fetched`, its download) to a record, or (None, 0) with the reason
    appended to `errors`; what its picture was is added to `counts` (PICTURE_COUNTS) once it
    packed."""
    started = time.perf_counter()
    try:
        if fetched is not None:
            from .fetched import download_failure, read_downloaded

            if isinstance(fetched, Record):  # kept from the shard a resume writes again
                return fetched, 0
            if isinstance(fetched, Failure):  # failed for good in the earlier run
                errors.append(fetched)
                return None, 0
            if not isinstance(fetched, bytes):  # a DownloadError
                errors.append(download_failure(item, fetched))
                return None, 0
            data, header = read_downloaded(fetched, job.encode.max_pixels)
        else:
            if job.confine is not None and not os.path.realpath(item.path).startswith(job.confine + os.sep):
                raise ImageError("read", "a link to a file outside the source folder (rows may name only files in it)")
            data, header = read_source(item.path, job.encode.max_pixels, job.storage_options)
        timings["read"] += time.perf_counter() - started
        from .encode import process_image, record_too_big  # (imaging: the workers', not the driver's)

        encoded = process_image(data, job.resize, job.encode, timings, header)
        if len(encoded.data) > MAX_RECORD_BYTES - RECORD_META_ALLOWANCE:
            raise ImageError("encode", record_too_big(len(encoded.data)))
        # the source file's hash: `shardkit duplicates OUT --against OTHER` finds copies without reading them
        meta = {**encoded.meta, "source": display(item.relpath), "source_sha256": hashlib.sha256(data).hexdigest()}
        if item.sidecars is None:
            record = Record(item.key, encoded.data, encoded.ext, item.label, meta, item.text, item.columns)
            size = len(data)
        else:
            found = _sidecars(item, item.sidecars, encoded.meta, job, timings)
            if encoded.ext in found.files:
                raise ImageError("read", f"a field named .{encoded.ext} would take the image's place")
            record = Record(
                item.key, encoded.data, encoded.ext, found.label, meta, found.text, found.columns, found.files or None
            )
            size = len(data) + sum(len(blob) for blob in found.files.values())
        if counts is not None:
            _count_picture(counts, encoded.flattened, encoded.single_colour)
        return record, size
    except OSError as error:
        errors.append(_error(item.relpath, "read", describe(error)))
    except ImageError as error:
        errors.append(_error(item.relpath, error.stage, error.reason))
    except Exception as error:  # a codec's own exception type for a file it cannot handle, or a bug
        errors.append(_error(item.relpath, _blame(error), f"{describe(error, with_type=True)}"))
    return None, 0


def _clips_of(
    item: Item, job: ShardJob, clips: ClipConfig, timings: dict[str, float], errors: list[Failure]
) -> tuple[list[Record] | None, int]:
    """A video's clips as records (keys: the video's, then the clip's number), or (None, 0) with
    the reason appended to `errors`: a video is packed whole or listed, one row, never both."""
    from .clips import clip_key, cut, cut_span  # (PyAV: only for a pack of videos)

    started = time.perf_counter()
    where = f"{item.span.where}: " if item.span is not None else ""  # a span row's error names its line
    try:
        if job.confine is not None and not os.path.realpath(item.path).startswith(job.confine + os.sep):
            raise ImageError("read", "a link to a file outside the source folder (rows may name only files in it)")
        source = display(item.relpath)
        if item.span is not None:  # a span table's row: its one clip, keyed by the row already
            clip = cut_span(item.path, source, item.span, clips, job.resize, job.encode.max_pixels)
            made, keys = [clip], [item.key]
        else:
            made = cut(item.path, source, clips, job.resize, job.encode.max_pixels)
            keys = [clip_key(item.key, clip.number) for clip in made]
        timings["encode"] += time.perf_counter() - started
        size = os.stat(item.path).st_size
        records = [
            Record(key, clip.data, CLIP_EXT, item.label, clip.meta, item.text, item.columns)
            for key, clip in zip(keys, made, strict=True)
        ]
        return records, size
    except OSError as error:
        errors.append(_error(item.relpath, "read", where + describe(error)))
    except ImageError as error:
        errors.append(_error(item.relpath, error.stage, where + error.reason))
    except Exception as error:  # PyAV's own exception types for a file it cannot handle, or a bug
        errors.append(_error(item.relpath, _blame(error), f"{where}{describe(error, with_type=True)}"))
    return None, 0


def pack_record(item: Item, job: ShardJob) -> Record | None:
    """One item's record as a shard of `job` would hold it, or None if it fails (what --shard-bytes
    calibrates its estimate of the output's bytes on: the very path a worker takes)."""
    return _pack_one(item, job, dict.fromkeys(STAGES, 0.0), [])[0]


def _count_picture(counts: dict[str, int], flattened: bool, single_colour: bool) -> None:
    counts["alpha_flattened"] += flattened
    counts["single_colour"] += single_colour
    counts["single_colour_flattened"] += flattened and single_colour


def _stand_in(
    copies: tuple[Item, ...], job: ShardJob, timings: dict[str, float], errors: list[Failure], counts: dict[str, int]
) -> tuple[Record | None, int, str]:
    """The first of an item's copies that packs, in its slot (the plan and its shards stay as
    they were), with its key; each one that fails before it has its row in `errors`."""
    for copy in copies:
        record, size = _pack_one(copy, job, timings, errors, counts=counts)
        if record is not None:
            return record, size, copy.key
    return None, 0, ""


def _sidecars(
    item: Item, parts: dict[str, str], meta: dict[str, Any], job: ShardJob, timings: dict[str, float]
) -> Sidecars:
    started = time.perf_counter()
    try:
        folder = os.path.dirname(item.path)
        if is_remote(item.path):
            return read_sidecars(
                lambda name, limit: _remote(lambda: object_bytes(f"{folder}/{name}", job.storage_options, limit)),
                parts, meta, job.resize, job.encode.max_pixels,
            )  # fmt: skip
        return read_sidecars(
            lambda name, limit: read_regular(os.path.join(folder, name), limit), parts, meta, job.resize,
            job.encode.max_pixels,
        )  # fmt: skip
    finally:
        timings["read"] += time.perf_counter() - started


def max_source_bytes(max_pixels: int) -> int:
    """The largest source file worth reading for an image of at most `max_pixels` pixels: 8 bytes a
    pixel (16-bit RGBA, uncompressed) and 16 MiB of metadata. Anything bigger is not read whole."""
    return max_pixels * 8 + (16 << 20)


def read_source(path: str, max_pixels: int, storage_options: dict[str, Any] | None = None) -> tuple[bytes, ImageHeader]:
    """A source file's bytes and header: the header is read and checked first, so neither a bomb
    nor a multi-GB file is read into memory; FIFOs and devices are refused, never waited on. A
    bucket's object (a URL) is read so too, by ranges: its first 64 KiB, then the rest."""
    if is_remote(path):
        return _remote(lambda: _read_object(path, max_pixels, storage_options))
    fd = open_regular(path)
    try:
        size = os.fstat(fd).st_size
        head = os.pread(fd, HEAD_BYTES, 0)
        header = _checked(lambda: parse_header(head, lambda offset, n: os.pread(fd, n, offset), size, path), size,
                          max_pixels)  # fmt: skip
        data = head if len(head) == size else _read_all(fd)
    finally:
        os.close(fd)
    return data, header


def _read_object(url: str, max_pixels: int, storage_options: dict[str, Any] | None) -> tuple[bytes, ImageHeader]:
    reads = object_reads(url, storage_options)
    header = _checked(reads.header, reads.size, max_pixels)
    return reads.whole(), header


def _checked(parse: Callable[[], ImageHeader], size: int, max_pixels: int) -> ImageHeader:
    """The header, checked before the body is read: its pixels, and the file's size against them."""
    try:
        header = parse()
    except HeaderError as error:
        raise ImageError("header", str(error)) from None
    from .encode import check_pixels

    check_pixels(header, max_pixels)
    if size > max_source_bytes(max_pixels):
        raise ImageError("read", f"{size:,} bytes is more than an image of {max_pixels:,} pixels needs; not read")
    return header


def _remote(read: Callable[[], T]) -> T:
    """`read()` of a bucket's object, a failure the retry window gave up on (or denied access) an
    ImageError at the read stage: one input not packed, as an unreadable file is."""
    try:
        return read()
    except StorageError as error:
        raise ImageError("read", str(error)) from None


def _read_all(fd: int) -> bytes:
    os.lseek(fd, 0, os.SEEK_SET)
    with open(fd, "rb", buffering=0, closefd=False) as source:
        return source.readall()


def _error(relpath: str, stage: str, reason: str) -> Failure:
    return Failure(display(relpath), stage, reason)


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # shardkit/, not packing/


def _blame(error: BaseException) -> str:
    """ "decode" when the exception came out of a codec (Pillow, libjpeg-turbo: their own types for
    a file they cannot read), "internal" when shardkit's own code raised it: a bug must not pass
    for a bad image in errors.jsonl."""
    trace = error.__traceback__
    while trace is not None and trace.tb_next is not None:
        trace = trace.tb_next
    where = os.path.abspath(trace.tb_frame.f_code.co_filename) if trace is not None else ""
    return "internal" if where.startswith(_PACKAGE) else "decode"
