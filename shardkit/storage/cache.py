"""`ShardCache`: whole shards on local disk, content-addressed by their manifest sha256, shared by
every process on the machine (DataLoader workers, ranks): a shard is downloaded once, under a
per-shard file lock, to a temporary name, checked against the manifest's size and sha256, then
renamed; least recently used shards are evicted past the limit."""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import struct
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ..core.errors import ConfigError, ShardkitError, StorageError, describe
from ..core.pack_options import parse_bytes
from .store import Store


def default_cache_dir() -> Path:
    """SHARDKIT_CACHE, else $XDG_CACHE_HOME/shardkit, else ~/.cache/shardkit."""
    if os.environ.get("SHARDKIT_CACHE"):
        return Path(os.environ["SHARDKIT_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "shardkit"


DEFAULT_CACHE_LIMIT = "50GB"


_THREAD_LOCKS: dict[tuple[Path, str], threading.Lock] = {}
_THREAD_LOCKS_GUARD = threading.Lock()


def _after_fork_in_child() -> None:
    """A lock a parent's thread held at the fork would never be released in the child; and the
    child's copies of the parent's held lock descriptors must not keep those locks alive (an OFD
    lock lasts while any descriptor of it is open)."""
    _THREAD_LOCKS.clear()
    global _THREAD_LOCKS_GUARD
    _THREAD_LOCKS_GUARD = threading.Lock()
    for fd in list(_LOCKED):
        with contextlib.suppress(OSError):
            os.close(fd)
    _LOCKED.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)

_LOCKED: set[int] = set()  # descriptors of the cache locks this process holds now
# struct flock for a whole-file write lock (l_type, l_whence, l_start, l_len, l_pid; pid 0 for OFD)
_WHOLE_FILE = struct.pack("@hhqqi", fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0).ljust(32, b"\0")


def _lock_exclusive(fd: int) -> None:
    if hasattr(fcntl, "F_OFD_SETLKW"):  # Linux
        fcntl.fcntl(fd, fcntl.F_OFD_SETLKW, _WHOLE_FILE)
    else:  # a system without OFD locks: the process-wide record lock (threads are excluded above)
        fcntl.lockf(fd, fcntl.LOCK_EX)


def _thread_lock(root: Path, name: str) -> threading.Lock:
    with _THREAD_LOCKS_GUARD:
        return _THREAD_LOCKS.setdefault((root, name), threading.Lock())


@dataclass(frozen=True)
class ShardCache:
    """Whole shards on local disk, named by their sha256 (the same bytes are cached once, whatever
    URL they came from) and shared by all processes of this machine. Shards are handed out as open
    descriptors: eviction may unlink a shard at any time, and a reader keeps what it opened."""

    root: Path
    limit: int

    @classmethod
    def at(cls, cache_dir: str | os.PathLike[str] | None, cache_limit: str | int | None) -> ShardCache:
        root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
        limit = parse_bytes(cache_limit if cache_limit is not None else DEFAULT_CACHE_LIMIT)
        if limit <= 0:
            raise ConfigError(f"cache_limit must be positive, not {cache_limit!r}")
        return cls(root, limit)

    def ready(self) -> None:
        """Creates the cache folders, or says why it cannot (before any download)."""
        try:
            for part in ("shards", "tmp", "locks"):
                (self.root / part).mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise ConfigError(f"{self.root}: cannot use as the shard cache ({describe(error)})") from None

    def path_of(self, sha256: str, name: str) -> Path:
        """Where the shard `name` with this sha256 is cached: the hash, and the name's suffix when it
        is short and plain (names come from strangers)."""
        suffix = Path(name).suffix
        return self.root / "shards" / (sha256 + (suffix if re.fullmatch(r"\.[A-Za-z0-9]{1,16}", suffix) else ""))

    def _open_cached(self, sha256: str, name: str, size: int) -> int | None:
        """A descriptor of the cached shard, or None. Opened before anything else: once open, an
        eviction in another process cannot take it away."""
        path = self.path_of(sha256, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        if os.fstat(fd).st_size != size:  # not ours: the name is the content's hash
            os.close(fd)
            return None
        with contextlib.suppress(OSError):
            os.utime(fd)  # last use: eviction takes the least recently used first
        return fd

    def cached(self, sha256: str, name: str, size: int) -> bool:
        fd = self._open_cached(sha256, name, size)
        if fd is None:
            return False
        os.close(fd)
        return True

    @contextlib.contextmanager
    def _lock(self, name: str) -> Iterator[None]:
        """Excludes the other threads of this process, then the other processes: an open file
        description lock (F_OFD_SETLKW), released by the kernel when its holder dies. Not a POSIX
        record lock: those belong to the process, so a thread downloading one shard while another
        waits for a second, in two processes, looks like a deadlock to the kernel (EDEADLK,
        "Resource deadlock avoided"). A child forked while one is held closes its copy
        (_after_fork_in_child), so it cannot keep the lock alive."""
        with _thread_lock(self.root, name):
            fd = os.open(self.root / "locks" / f"{name}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
            _LOCKED.add(fd)
            try:
                _lock_exclusive(fd)
                yield
            finally:
                _LOCKED.discard(fd)
                os.close(fd)  # releases the lock

    def open(self, store: Store, name: str, size: int, sha256: str) -> int:
        """A read-only descriptor of shard `name` of `store`, downloaded and checked unless already
        cached. Processes wanting the same shard wait for the one downloading it; a failed or killed
        download leaves only a temporary file, which the next download of that shard removes."""
        try:
            return self._open(store, name, size, sha256)
        except ShardkitError:
            raise
        except OSError as error:  # the cache folder itself: full, read-only, another user's
            raise StorageError(f"{self.root}: cannot use the shard cache ({describe(error)})") from None

    def _open(self, store: Store, name: str, size: int, sha256: str) -> int:
        fd = self._open_cached(sha256, name, size)
        if fd is not None:
            return fd
        if size > self.limit:
            raise ConfigError(f"{store.child(name)}: {size:,} bytes, more than the cache limit of {self.limit:,}")
        self.ready()
        with self._lock(sha256[:2]):
            fd = self._open_cached(sha256, name, size)
            if fd is not None:
                return fd
            for leftover in (self.root / "tmp").glob(f"{sha256}.*"):
                leftover.unlink(missing_ok=True)
            temp_fd, temp = tempfile.mkstemp(prefix=f"{sha256}.", suffix=".part", dir=self.root / "tmp")
            os.fchmod(temp_fd, 0o644)  # readable by the other users of a shared cache, as the locks are
            os.close(temp_fd)
            try:
                store.download(name, temp, size, sha256)
                fd = os.open(temp, os.O_RDONLY | os.O_CLOEXEC)
                final = self.path_of(sha256, name)
                os.replace(temp, final)
            except BaseException:
                Path(temp).unlink(missing_ok=True)
                raise
        try:
            self.evict(keep=final)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def fetch(self, store: Store, name: str, size: int, sha256: str) -> None:
        """Makes sure shard `name` is cached (a prefetch)."""
        os.close(self.open(store, name, size, sha256))

    def usage(self) -> int:
        return sum(entry.stat().st_size for entry in os.scandir(self.root / "shards") if entry.is_file())

    def evict(self, keep: Path | None = None) -> None:
        """Least recently used shards out until the cache holds at most `limit` bytes. A shard open
        anywhere stays readable there (POSIX keeps unlinked files for their readers)."""
        with self._lock("evict"):
            entries = []
            total = 0
            for entry in os.scandir(self.root / "shards"):
                with contextlib.suppress(FileNotFoundError):
                    info = entry.stat()
                    entries.append((info.st_mtime, info.st_size, entry.path))
                    total += info.st_size
            for _, size, path in sorted(entries):
                if total <= self.limit:
                    break
                if keep is not None and path == str(keep):
                    continue
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                    total -= size
