"""How a worker turns a shard's planned items into records.

Each source convention says how with a `Reading`: a small frozen spec its `Source.reading` makes
once a pack, sent with every shard job. The contract is one method: `packed(packing)` yields each
item's `Outcome` in the shard's order, whatever order the work is done in: its record (a video's
clips: a list; None where it failed), its source bytes, and its failures. `Files` reads image files
(a folder's, a list's, a table's, a bucket's objects); a table of URLs and a folder of videos have
readings of their own, in their conventions' modules (sources/url_table.py, sources/video.py).

What the readings share is here: a file's bytes read with its header checked first (`read_source`),
an image's bytes encoded into its record (`image_record`), and an item that fails turned into its
`Failure` with the stage that failed (`attempt`).
"""

from __future__ import annotations

import hashlib
import os
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from ..core.config import MAX_RECORD_BYTES, RECORD_META_ALLOWANCE, EncodeConfig, ResizeConfig
from ..core.errors import Failure, HeaderError, ImageError, StorageError, StoreUnreachable, describe
from ..core.headers import HEAD_BYTES, ImageHeader, parse_header
from ..core.safeio import open_regular, read_regular
from ..formats.base import Record
from ..storage.http import ObjectChanged
from ..storage.urls import is_remote
from .objects import object_bytes, object_reads

if TYPE_CHECKING:  # (sources/ imports this module: its names are imported where they are used)
    from ..runtime.lanes import Admission
    from .sources.item import Item
    from .sources.sidecar_files import Sidecars

T = TypeVar("T")

# One item's outcome: its record (a video's clips: a list; None where it failed), its source bytes
# (those of the files it was made from), and its failures (a failed item's, and its copies').
Outcome = tuple[Record | list[Record] | None, int, list[Failure]]

OUTSIDE = "a link to a file outside the source folder (rows may name only files in it)"


@dataclass
class Packing:
    """One shard's items as a worker reads and encodes them: what the job says of them, and what
    the worker counts as it goes (seconds per stage, the pictures' PICTURE_COUNTS, and by a failed
    item's key the key of the copy packed in its slot, "" when none packed)."""

    items: tuple[Item, ...]
    resize: ResizeConfig
    encode: EncodeConfig
    format: str
    timings: dict[str, float]
    counts: dict[str, int]
    copies_packed: dict[str, str] = field(default_factory=dict)
    # --dedup: by an item's key, the copies left out for it, tried in its slot (in this order) when it fails
    copies: dict[str, tuple[Item, ...]] = field(default_factory=dict)
    storage_options: dict[str, Any] | None = None  # what reaches a bucket source's objects
    hash_kept: bool = False  # --dedup near: a picture kept as it was gets its DCT hash too (encode.py)


class Reading(ABC):
    """How a source's items become records in a worker (see the module's docstring)."""

    # Whether a shard's items may be encoded in parts by several workers at once (packing/parts.py).
    splits: ClassVar[bool] = True

    def may_split(self) -> bool:
        """Whether this shard may be split into parts (`splits`, unless its own state says not)."""
        return self.splits

    def admission(self) -> Admission | None:
        """How a worker takes shards when its shards mostly wait on something outside the process
        (a table of URLs' downloads): several at once, by this admission (runtime/lanes.py). None:
        one shard a worker at a time."""
        return None

    @abstractmethod
    def packed(self, packing: Packing) -> Generator[Outcome, None, None]:
        """Each item's outcome, in the shard's order; closing it drops any work still queued."""

    def shard_counts(self, counts: dict[str, int]) -> dict[str, int] | None:
        """The shard's PICTURE_COUNTS from its records' (None: not known)."""
        return dict(counts)

    def resumed(self, earlier: list[Failure], counts: dict[str, int] | None, shard: str) -> Reading:
        """This reading for a shard that --resume writes again because some of its items failed
        transiently: `earlier` its failures, `counts` its PICTURE_COUNTS, `shard` its file. Only
        downloads fail transiently; a reading of files is the same reading."""
        return self


@dataclass(frozen=True)
class Files(Reading):
    """Image files read in turn (a bucket's objects by ranges); a failed item's --dedup copies are
    tried in its slot. `confine`: the real folder the files must lie in (a table's rows)."""

    confine: str | None = None

    def packed(self, packing: Packing) -> Generator[Outcome, None, None]:
        for item in packing.items:
            record, size, failures = file_outcome(item, packing, self.confine)
            if record is None and item.key in packing.copies:
                record, size, packing.copies_packed[item.key] = _copy_packed(packing, item.key, self.confine, failures)
            yield record, size, failures


def file_outcome(item: Item, packing: Packing, confine: str | None = None) -> tuple[Record | None, int, list[Failure]]:
    """One image file (or a bucket's object) to its record, or the reason it failed."""

    def made() -> tuple[Record, int]:
        started = time.perf_counter()
        check_confined(item.path, confine)
        data, header = read_source(item.path, packing.encode.max_pixels, packing.storage_options)
        packing.timings["read"] += time.perf_counter() - started
        return image_record(item, data, header, packing)

    return attempt(item, made)


def _copy_packed(
    packing: Packing, key: str, confine: str | None, failures: list[Failure]
) -> tuple[Record | None, int, str]:
    """The first of an item's copies that packs, in its slot (the plan and its shards stay as
    they were), with its key; each one that fails before it has its row in `failures`."""
    for copy in packing.copies[key]:
        record, size, failed = file_outcome(copy, packing, confine)
        failures.extend(failed)
        if record is not None:
            return record, size, copy.key
    return None, 0, ""


def check_confined(path: str, confine: str | None) -> None:
    """A file a row names must lie in the source folder, links followed (ImageError "read")."""
    if confine is not None and not os.path.realpath(path).startswith(confine + os.sep):
        raise ImageError("read", OUTSIDE)


def image_record(item: Item, data: bytes, header: ImageHeader, packing: Packing) -> tuple[Record, int]:
    """An image's bytes (its header read and checked) encoded into the item's record, with its
    sidecar files where it has them, and the bytes it was made from; what its picture was is added
    to `packing.counts`."""
    from .encode import process_image, record_too_big  # (imaging: the workers', not the driver's)
    from .sources.item import display

    encoded = process_image(data, packing.resize, packing.encode, packing.timings, header)
    if len(encoded.data) > MAX_RECORD_BYTES - RECORD_META_ALLOWANCE:
        raise ImageError("encode", record_too_big(len(encoded.data)))
    # the source file's hash: `shardkit duplicates OUT --against OTHER` finds copies without reading them
    meta = {**encoded.meta, "source": display(item.relpath), "source_sha256": hashlib.sha256(data).hexdigest()}
    if packing.hash_kept and "phash" not in meta:
        meta.update(_kept_hash(data, packing.encode.max_pixels, packing.timings))
    if item.sidecars is None:
        record = Record(item.key, encoded.data, encoded.ext, item.label, meta, item.text, item.columns)
        size = len(data)
    else:
        found = _sidecars(item, item.sidecars, encoded.meta, packing)
        if encoded.ext in found.files:
            raise ImageError("read", f"a field named .{encoded.ext} would take the image's place")
        record = Record(
            item.key, encoded.data, encoded.ext, found.label, meta, found.text, found.columns, found.files or None
        )
        size = len(data) + sum(len(blob) for blob in found.files.values())
    counts = packing.counts
    counts["alpha_flattened"] += encoded.flattened
    counts["single_colour"] += encoded.single_colour
    counts["single_colour_flattened"] += encoded.flattened and encoded.single_colour
    return record, size


def _kept_hash(data: bytes, max_pixels: int, timings: dict[str, float]) -> dict[str, str]:
    """{"phash": ...} of a picture pack kept as it was (--encode original: nothing decoded it), as
    `pack --dedup` hashes files (hashes.py: a reduced DCT-scale decode, about 1 ms for an ImageNet
    photo); {} where it gives no thumbnail. (--dedup near asks for it: an append's near dedup
    compares new files with every record's hash.)"""
    from ..core.phash import dct_hash
    from .hashes import grey_thumbnail

    started = time.perf_counter()
    try:
        return {"phash": f"{dct_hash(grey_thumbnail(data, max_pixels)):016x}"}
    except ValueError:
        return {}
    finally:
        timings["decode"] += time.perf_counter() - started


def _sidecars(item: Item, parts: dict[str, str], meta: dict[str, Any], packing: Packing) -> Sidecars:
    """The sample's other files, read from the image's folder (or the object's prefix)."""
    from .sources.sidecar_files import read_sidecars

    started = time.perf_counter()
    folder = os.path.dirname(item.path)
    max_pixels = packing.encode.max_pixels
    try:
        if is_remote(item.path):
            options = packing.storage_options
            return read_sidecars(
                lambda name, limit: as_read_error(lambda: object_bytes(f"{folder}/{name}", options, limit)),
                parts, meta, packing.resize, max_pixels,
            )  # fmt: skip
        return read_sidecars(
            lambda name, limit: read_regular(os.path.join(folder, name), limit), parts, meta, packing.resize, max_pixels
        )
    finally:
        packing.timings["read"] += time.perf_counter() - started


def attempt(item: Item, make: Callable[[], tuple[T, int]], where: str = "") -> tuple[T | None, int, list[Failure]]:
    """`make()` of one item: its record and source bytes, or (None, 0) and the failure, at the stage
    it failed (`where` opens the reason: a span row's line). A store out of reach is no item's
    failure: it stops the job."""
    try:
        record, size = make()
        return record, size, []
    except StoreUnreachable:
        raise
    except OSError as error:
        failure = _failure(item.relpath, "read", where + describe(error))
    except ImageError as error:
        failure = _failure(item.relpath, error.stage, where + error.reason)
    except Exception as error:  # a codec's own exception type for a file it cannot handle, or a bug
        failure = _failure(item.relpath, blame(error), f"{where}{describe(error, with_type=True)}")
    return None, 0, [failure]


def _failure(relpath: str, stage: str, reason: str) -> Failure:
    from .sources.item import display

    return Failure(display(relpath), stage, reason)


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # shardkit/, not packing/


def blame(error: BaseException) -> str:
    """ "decode" when the exception came out of a codec (Pillow, libjpeg-turbo, PyAV: their own
    types for a file they cannot read), "internal" when shardkit's own code raised it: a bug must
    not pass for a bad image in errors.jsonl."""
    trace = error.__traceback__
    while trace is not None and trace.tb_next is not None:
        trace = trace.tb_next
    where = os.path.abspath(trace.tb_frame.f_code.co_filename) if trace is not None else ""
    return "internal" if where.startswith(_PACKAGE) else "decode"


def max_source_bytes(max_pixels: int) -> int:
    """The largest source file worth reading for an image of at most `max_pixels` pixels: 8 bytes a
    pixel (16-bit RGBA, uncompressed) and 16 MiB of metadata. Anything bigger is not read whole."""
    return max_pixels * 8 + (16 << 20)


def read_source(path: str, max_pixels: int, storage_options: dict[str, Any] | None = None) -> tuple[bytes, ImageHeader]:
    """A source file's bytes and header: the header is read and checked first, so neither a bomb
    nor a multi-GB file is read into memory; FIFOs and devices are refused, never waited on. A
    bucket's object (a URL) is read so too, by ranges: its first 64 KiB, then the rest."""
    if is_remote(path):
        return as_read_error(lambda: read_object(path, max_pixels, storage_options))
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


def read_object(
    url: str, max_pixels: int, storage_options: dict[str, Any] | None, between: Callable[[], object] | None = None
) -> tuple[bytes, ImageHeader]:
    """A bucket's object read as `read_source` reads a file: its header by its first range, then
    the rest, each range of the version the first one read. One replaced in between is read once
    more, whole by one GET, so its record is one version whole, never two spliced. `between` is
    called after the header is read, before the rest (where a test replaces the object)."""
    try:
        reads = object_reads(url, storage_options)
        header = _checked(reads.header, reads.size, max_pixels)
        if between is not None:
            between()
        return reads.whole(), header
    except ObjectChanged:
        data = object_bytes(url, storage_options, max_source_bytes(max_pixels))
        return data, _checked(lambda: parse_header(data[:HEAD_BYTES], _slicer(data), len(data), None), len(data),
                              max_pixels)  # fmt: skip


def _slicer(data: bytes) -> Callable[[int, int], bytes]:
    return lambda offset, n: data[offset : offset + n]


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


def as_read_error(read: Callable[[], T]) -> T:
    """`read()` of a bucket's object, its denied access (or another refusal) an ImageError at the
    read stage: one input not packed, as an unreadable file is. A store the retry window gave up
    on (StoreUnreachable) is no one object's fault: it goes on, and stops the pack."""
    try:
        return read()
    except StoreUnreachable:
        raise
    except StorageError as error:
        raise ImageError("read", str(error)) from None


def _read_all(fd: int) -> bytes:
    os.lseek(fd, 0, os.SEEK_SET)
    with open(fd, "rb", buffering=0, closefd=False) as source:
        return source.readall()
