"""One shard's check, the unit of verify's work (run in a child process): the file is what the
manifest says (there, its size, its sha256) before it is opened, then every record is read (keys,
source paths, labels; with `deep`, decoded against its stored size), and the shard's index for
other readers (a tar's .idx file) is derived again and compared. A remote shard is downloaded
first, into a temporary folder, and deleted after."""

from __future__ import annotations

import contextlib
import hashlib
import os
from dataclasses import dataclass

from ..core.clips import CLIP_EXT
from ..core.config import DEFAULT_MAX_PIXELS
from ..core.errors import ImageError, ShardFormatError, StorageError, describe
from ..core.manifest import ShardInfo, sha256_file
from ..core.safeio import check_regular
from ..formats import get_format
from ..formats.base import Record
from ..readers.clips import clip_frames
from ..readers.decode import decode
from ..storage.http import TooLong
from ..storage.store import Store
from .verify_report import Problem


@dataclass(frozen=True)
class ShardToCheck:
    folder: str
    shard: ShardInfo
    format: str
    classes: int
    deep: bool
    max_pixels: int = DEFAULT_MAX_PIXELS
    store: Store | None = None  # a remote output: the shard is downloaded into `folder` (a temp folder)
    listed_size: int | None = None  # the remote object's size from the listing, when it tells one
    companion: ShardInfo | None = None  # the shard's index for other readers, as the manifest lists it


@dataclass
class ShardCheck:
    problems: list[Problem]
    keys: list[str]
    sources: list[str]
    decoded: int


def check_shard(job: ShardToCheck) -> ShardCheck:
    """One shard's problems. Runs in a child process; an exception that is not a shardkit error is
    a bug in shardkit, reported as such (never a traceback, and never blamed on the shard)."""
    try:
        return _checked_shard(job)
    except Exception as error:
        detail = f"internal error while checking it (a shardkit bug, please report): {describe(error, with_type=True)}"
        return ShardCheck([Problem("internal", detail[:500], job.shard.name)], [], [], 0)


def _checked_shard(job: ShardToCheck) -> ShardCheck:
    if job.store is None:
        return _checked_file(job)
    name, path = job.shard.name, _local(job, job.shard.name)
    if job.listed_size is not None and job.listed_size != job.shard.bytes:  # the listing's size, when it tells one
        return ShardCheck(
            [Problem("size", f"{job.listed_size:,} bytes, manifest says {job.shard.bytes:,}", name)], [], [], 0
        )
    try:
        job.store.get(name, path, limit=job.shard.bytes)  # size and sha256 are checked below, as for a file
        if job.companion is not None:
            with contextlib.suppress(FileNotFoundError, TooLong):  # reported as missing or changed below
                job.store.get(job.companion.name, _local(job, job.companion.name), limit=job.companion.bytes)
        return _checked_file(job)
    except TooLong:
        detail = f"more than the {job.shard.bytes:,} bytes the manifest says"
        return ShardCheck([Problem("size", detail, name)], [], [], 0)
    except FileNotFoundError:
        return ShardCheck([Problem("missing", "listed in the manifest but not in the bucket", name)], [], [], 0)
    except StorageError as error:
        return ShardCheck([Problem("unreadable", str(error), name)], [], [], 0)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        if job.companion is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(_local(job, job.companion.name))


def _local(job: ShardToCheck, name: str) -> str:
    """Where `name` is read from: in the output folder itself, or for a remote output under a name
    of our own in the temporary folder (a bucket's object names need not be names a file can have:
    over 255 bytes, say)."""
    if job.store is None:
        return os.path.join(job.folder, name)
    return os.path.join(job.folder, hashlib.sha256(name.encode("utf-8", "surrogateescape")).hexdigest()[:32])


def _checked_file(job: ShardToCheck) -> ShardCheck:
    name, path = job.shard.name, _local(job, job.shard.name)
    check = ShardCheck([], [], [], 0)
    problem = file_problem(path, job.shard, missing="listed in the manifest but not on disk")
    if problem is not None:
        check.problems.append(problem)
        return check
    reader = get_format(job.format).reader(path)
    try:
        count = 0
        for record in reader:
            count += 1
            check.keys.append(record.key)
            check.sources.append(str(record.meta.get("source", "")))
            if record.label is not None and job.classes and not 0 <= record.label < job.classes:
                check.problems.append(
                    Problem("label", f"label {record.label} outside 0..{job.classes - 1}", name, record.key)
                )
            if job.deep:
                _check_pixels(record, name, check, job.max_pixels)
        if count != job.shard.count:
            check.problems.append(Problem("count", f"{count:,} records, manifest says {job.shard.count:,}", name))
        if job.companion is not None:
            _check_companion(job, path, check)
    except ShardFormatError as error:
        check.problems.append(Problem("unreadable", str(error), name))
    except OSError as error:
        check.problems.append(Problem("unreadable", f"cannot read: {describe(error)}", name))
    finally:
        reader.close()
    return check


def _check_companion(job: ShardToCheck, shard: str, check: ShardCheck) -> None:
    """The shard's index for other readers is what the format derives from the shard now, and the
    file beside it is that, byte for byte."""
    companion = job.companion
    idx_file = get_format(job.format).idx_file
    assert companion is not None
    expected = idx_file(shard, None) if idx_file is not None else None
    if expected is None or hashlib.sha256(expected).hexdigest() != companion.sha256:
        check.problems.append(Problem("companion", "does not match the shard's members", companion.name))
        return
    problem = file_problem(_local(job, companion.name), companion)
    if problem is not None:
        check.problems.append(problem)


def file_problem(path: str, info: ShardInfo, missing: str = "listed in the manifest but not there") -> Problem | None:
    """Whether the file at `path` (a shard or an index file) is what `info` says: there, a regular
    file, its size, then its sha256; the first thing wrong as a problem, or None."""
    try:
        size = check_regular(path).st_size
    except FileNotFoundError:
        return Problem("missing", missing, info.name)
    except OSError as error:
        return Problem("unreadable", describe(error), info.name)
    if size != info.bytes:
        return Problem("size", f"{size:,} bytes, manifest says {info.bytes:,}", info.name)
    try:
        digest = sha256_file(path)
    except OSError as error:
        return Problem("unreadable", f"cannot read: {describe(error)}", info.name)
    if digest != info.sha256:
        return Problem("checksum", "sha256 differs from the manifest (bytes changed)", info.name)
    return None


def _check_clip(record: Record, shard: str, check: ShardCheck, max_pixels: int) -> None:
    """A clip (core/clips.py) decoded whole, as Sample.video reads it: its meta held to the
    contract, its frames to its meta (count, size, a keyframe first)."""
    try:
        for _ in clip_frames(record.data, record.meta, max_pixels):
            pass
    except ImageError as error:
        check.problems.append(Problem("decode", error.reason, shard, record.key))
        return
    check.decoded += 1


def _check_pixels(record: Record, shard: str, check: ShardCheck, max_pixels: int) -> None:
    if record.ext == CLIP_EXT:
        _check_clip(record, shard, check, max_pixels)
        return
    try:
        pixels = decode(record.data, record.ext, max_pixels=max_pixels)
    except (ImageError, ValueError) as error:
        check.problems.append(Problem("decode", str(error), shard, record.key))
        return
    check.decoded += 1
    expected = (record.meta.get("stored_height"), record.meta.get("stored_width"))
    if expected == (None, None):  # a tar someone else wrote (`shardkit index`): no stored sizes to hold to
        expected = tuple(pixels.shape[:2])
    if pixels.ndim != 3 or pixels.shape[2] != 3 or tuple(pixels.shape[:2]) != expected:
        check.problems.append(
            Problem("shape", f"decoded {pixels.shape}, metadata says {expected[0]}x{expected[1]}x3", shard, record.key)
        )
