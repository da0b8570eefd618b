"""Opening files that strangers may have placed: regular files only, bounded reads, JSON that cannot
blow the stack.

A FIFO opened for reading blocks until a writer appears, and a link to /dev/zero never ends: every
path a shard, manifest, log or source image is read from goes through `open_regular`, which opens
without blocking and refuses anything that is not a regular file.
"""

from __future__ import annotations

import json
import os
import stat
from typing import Any


class NotRegularFileError(OSError):
    """The path is a FIFO, a device, a socket or a folder (or a link to one), not a regular file."""


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def not_regular(path: str | os.PathLike[str], mode: int) -> NotRegularFileError:
    kind = _kind(mode)
    reason = "not a regular file" if kind == "not a regular file" else f"not a regular file ({kind})"
    return NotRegularFileError(0, reason, os.fspath(path))


def open_regular(path: str | os.PathLike[str], flags: int = os.O_RDONLY, *, own: bool = False) -> int:
    """A descriptor for `path`, which must be a regular file (links to one are fine).

    O_NONBLOCK makes opening a FIFO return at once instead of waiting for a writer; it has no effect
    on regular files, so the descriptor is an ordinary one. With `own` (a file of an output's state
    folder, which shardkit writes), no link is followed (O_NOFOLLOW: ELOOP) and the file may have no
    other name (NotRegularFileError): a link planted there must not make a write land in someone's
    file. A file O_CREAT makes is 0o644.
    """
    fd = os.open(path, flags | os.O_NONBLOCK | os.O_CLOEXEC | (os.O_NOFOLLOW if own else 0), 0o644)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise not_regular(path, info.st_mode)
        if own and info.st_nlink != 1:
            raise NotRegularFileError(0, "a file with other names (a hard link)", os.fspath(path))
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_regular(path: str | os.PathLike[str]) -> os.stat_result:
    """stat() of `path`, which must be a regular file (for libraries that open paths themselves)."""
    info = os.stat(path)
    if not stat.S_ISREG(info.st_mode):
        raise not_regular(path, info.st_mode)
    return info


def regular_size(path: str | os.PathLike[str]) -> int | None:
    """A regular file's size, not following a link: None for a link, a FIFO, a device, a folder or
    nothing there."""
    try:
        found = os.lstat(path)
    except OSError:
        return None
    return found.st_size if stat.S_ISREG(found.st_mode) else None


def read_regular(path: str | os.PathLike[str], limit: int) -> bytes:
    """The whole of a regular file of at most `limit` bytes (a larger one raises, unread)."""
    fd = open_regular(path)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise OSError(0, f"{size:,} bytes, over the limit of {limit:,}", os.fspath(path))
        parts, total = [], 0
        while chunk := os.read(fd, min(1 << 20, limit + 1 - total)):  # the file may grow while read
            parts.append(chunk)
            total += len(chunk)
            if total > limit:
                raise OSError(0, f"over the limit of {limit:,} bytes", os.fspath(path))
        return b"".join(parts)
    finally:
        os.close(fd)


def load_json_file(path: str | os.PathLike[str], limit: int = 64 << 20) -> Any:
    """A small JSON file (a state file, a marker): a regular file of at most `limit` bytes, parsed
    without recursion errors. OSError or ValueError otherwise (a FIFO planted there is refused)."""
    return loads(read_regular(path, limit))


def loads(text: str | bytes) -> Any:
    """json.loads for untrusted text: a deeply nested document raises ValueError, not RecursionError."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def file_stamp(path: str | os.PathLike[str]) -> tuple[int, int, int, int] | None:
    """What says a file is unchanged since it was last seen: size, mtime, and ctime and inode (which
    no one sets by hand: a file rewritten with its mtime put back still differs). None: gone."""
    try:
        status = os.stat(path)
    except OSError:
        return None
    return status.st_size, status.st_mtime_ns, status.st_ctime_ns, status.st_ino
