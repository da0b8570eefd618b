"""A worker's scratch folder for a shard it uploads: the shard and its .idx file are written there,
uploaded, then deleted, so a machine holds a few shards per worker and never the output.

The folder is the driver's staging `tmp/` for local workers, and the node's own temporary folder
(`$TMPDIR/shardkit-scratch-<uid>`) for a Ray task, which must need nothing the driver's machine
holds. A task killed mid-shard (its worker or node gone) cannot clean up after itself, so each
task holds a lock on a file of its own while its files exist (an open file description lock:
the kernel lets go when the holder dies, in any process of any container on the machine), and
every task sweeps away the files of tasks whose lock nobody holds before it begins.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import secrets
import struct
import tempfile
from collections.abc import Iterator
from pathlib import Path

LOCK_SUFFIX = ".lock.tmp"  # a `.tmp` name: the staging folder's own clean-up takes it too
# struct flock for a whole-file write lock (l_type, l_whence, l_start, l_len, l_pid; pid 0 for OFD)
_WHOLE_FILE = struct.pack("@hhqqi", fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0).ljust(32, b"\0")


def node_scratch() -> Path:
    """The node's scratch folder for Ray tasks: under its temporary folder, one per user."""
    return Path(tempfile.gettempdir()) / f"shardkit-scratch-{os.getuid()}"


@contextlib.contextmanager
def locked_stem(folder: Path, name: str) -> Iterator[Path]:
    """A stem in `folder` (made if needed, swept of dead tasks' files) for the files of the shard
    `name` this task writes: they are named the stem and a suffix, and are its own, kept by its
    lock, until it leaves, when they are removed."""
    folder.mkdir(parents=True, exist_ok=True)
    sweep(folder)
    stem = folder / f"{name}.{os.getpid()}-{secrets.token_hex(4)}"  # (pids repeat across containers)
    lock, new = Path(f"{stem}{LOCK_SUFFIX}"), Path(f"{stem}.lock-new.tmp")
    fd = os.open(new, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        _lock(fd, blocking=True)
        os.rename(new, lock)  # locked before a sweep can see it: a lock file nobody holds is a dead task's
        try:
            yield stem
        finally:
            _remove(stem, lock)
    finally:
        new.unlink(missing_ok=True)  # (renamed unless the lock failed)
        os.close(fd)


def _remove(stem: Path, lock: Path) -> None:
    for path in stem.parent.glob(f"{stem.name}.*"):
        if path != lock:
            path.unlink(missing_ok=True)
    lock.unlink(missing_ok=True)  # last: while it is there, a sweep can tell whose the files are


def sweep(folder: Path) -> None:
    """Removes the files of tasks that are gone: those beside a lock file no process holds."""
    for lock in folder.glob(f"*{LOCK_SUFFIX}"):
        try:
            fd = os.open(lock, os.O_RDWR | os.O_NOFOLLOW)
        except OSError:
            continue  # removed by its owner or another sweep meanwhile
        try:
            if _lock(fd, blocking=False):  # nobody holds it: its task is gone (names are never reused)
                _remove(folder / lock.name.removesuffix(LOCK_SUFFIX), lock)
        finally:
            os.close(fd)


def _lock(fd: int, *, blocking: bool) -> bool:
    """An exclusive open-file-description lock on the whole file (F_OFD_SETLK(W)): held by this
    descriptor, so two tasks in one process exclude each other too; False when another holds it."""
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLKW if blocking else fcntl.F_OFD_SETLK, _WHOLE_FILE)
    except OSError as error:
        if error.errno in (errno.EAGAIN, errno.EACCES):  # another descriptor has it
            return False
        raise
    return True
