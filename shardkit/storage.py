"""Shards in object storage (s3://, gs://, https://, any fsspec URL): the one seam that every remote
read and write goes through. Nothing else in shardkit knows a URL from a path.

- `Store`: one remote folder (a URL prefix) with retries, listing, whole-object download and upload.
- `ShardCache`: whole shards on local disk, content-addressed by their manifest sha256, shared by
  every process on the machine (DataLoader workers, ranks): a shard is downloaded once, under a
  per-shard file lock, to a temporary name, checked against the manifest's size and sha256, then
  renamed; least recently used shards are evicted past the limit.
- `CachedShardReader`: any format's reader over a cached copy, opened on first use in each process,
  its errors naming the URL, not the cache path.

Formats, the manifest and verify read local files only: remote shards reach them through the cache
(random access and memory-mapped formats need a whole file; iteration prefetches the next shards
of the epoch plan while the current one is read).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import select
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote, unquote, urlsplit

from .config import parse_bytes
from .errors import ConfigError, ManifestError, MissingDependencyError, ShardFormatError, ShardkitError, StorageError
from .manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, Manifest, parse_manifest

T = TypeVar("T")

_URL = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://")
# which extra brings the filesystem of a protocol (fsspec names the package, not our extra)
_EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs", "http": "http", "https": "http"}
RETRY_SECONDS = 30.0  # how long a remote that keeps failing is retried before the error is final


def is_remote(path: str | os.PathLike[str]) -> bool:
    """Whether `path` is a URL fsspec opens (s3://, gs://, https://, ...) rather than a local path.
    file:// URLs count as local."""
    match = _URL.match(os.fspath(path)) if isinstance(path, str) else None
    return match is not None and match.group(1).lower() != "file"


def refuse_local_options(path: str | os.PathLike[str], storage_options: dict[str, Any] | None) -> None:
    """Storage options given with a local path are a mistake (a URL lost its scheme?): say so."""
    if storage_options:
        raise ConfigError(f"{os.fspath(path)}: storage_options are for URLs (s3://, https://, ...), not local folders")


def local_path(path: str | os.PathLike[str]) -> str:
    """A local path from a path or a file:// URL."""
    text = os.fspath(path)
    return text[len("file://") :] if text.lower().startswith("file://") else text


def parse_storage_options(pairs: list[str] | None) -> dict[str, Any]:
    """`--storage-option key=value` pairs as fsspec keywords: values are JSON when they parse
    (numbers, true, {...}), strings otherwise; dotted keys nest (client_kwargs.region_name=...)."""
    options: dict[str, Any] = {}
    for pair in pairs or []:
        key, sep, text = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"storage option {pair!r} is not key=value")
        try:
            value: Any = json.loads(text)
        except ValueError:
            value = text
        *parents, leaf = key.strip().split(".")
        node = options
        for name in parents:
            node = node.setdefault(name, {})
            if not isinstance(node, dict):
                raise ConfigError(f"storage option {key!r} nests under a value that is not a mapping")
        node[leaf] = value
    return options


def retry_seconds() -> float:
    """The retry window: SHARDKIT_RETRY_SECONDS, or 30 s."""
    text = os.environ.get("SHARDKIT_RETRY_SECONDS")
    try:
        return max(0.0, float(text)) if text else RETRY_SECONDS
    except ValueError:
        raise ConfigError(f"SHARDKIT_RETRY_SECONDS must be a number of seconds, not {text!r}") from None


_PERMANENT = (FileNotFoundError, IsADirectoryError, NotADirectoryError, ShardkitError, ImportError)


def _describe(error: BaseException) -> str:
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"{type(error).__name__}: {text}"[:300] if text else type(error).__name__


def retrying(url: str, what: str, action: Callable[[], T]) -> T:
    """`action()`, retried with exponential backoff while it fails with a transient error (a
    refused connection, a timeout, a 5xx) for up to the retry window; then one StorageError naming
    the URL. A missing object or denied access is final at once (FileNotFoundError, PermissionError)."""
    window = retry_seconds()
    started, delay = time.monotonic(), 0.25
    while True:
        try:
            return action()
        except PermissionError as error:
            raise StorageError(f"{url}: access denied ({_describe(error)})") from None
        except _PERMANENT:
            raise
        except ValueError as error:  # a URL the client refuses (http.client.InvalidURL): never transient
            raise StorageError(f"{url}: {what} failed ({_describe(error)})") from None
        except Exception as error:
            if time.monotonic() - started + delay > window:
                waited = time.monotonic() - started
                raise StorageError(f"{url}: {what} failed ({_describe(error)}); gave up after {waited:.0f}s") from None
            time.sleep(delay)
            delay = min(delay * 2, 4.0)


def _filesystem(url: str, protocol: str, options: dict[str, Any]) -> tuple[Any, str]:
    try:
        import fsspec
    except ImportError:
        raise MissingDependencyError(f"{url}: URLs need fsspec: pip install fsspec") from None
    options = dict(options)
    if protocol in ("s3", "s3a"):
        options = _s3_defaults(options)
    try:
        return fsspec.core.url_to_fs(url, **options)
    except ImportError:
        extra = _EXTRAS.get(protocol)
        hint = f"pip install 'shardkit[{extra}]'" if extra else f"install the fsspec filesystem for {protocol}://"
        raise MissingDependencyError(f"{url}: {protocol}:// needs a package that is not installed: {hint}") from None
    except ValueError as error:  # an unknown protocol, or fsspec refusing the URL
        raise ConfigError(f"{url}: {error}") from None
    except TypeError as error:  # a storage option the filesystem does not take
        raise ConfigError(f"{url}: bad storage option ({error})") from None


def _s3_defaults(options: dict[str, Any]) -> dict[str, Any]:
    """S3 the standard way (AWS_* variables, profiles), plus AWS_ENDPOINT_URL for S3-compatible
    stores, with retries left to `retrying` (botocore's and s3fs's own would multiply its window)."""
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint and "endpoint_url" not in options and "endpoint_url" not in options.get("client_kwargs", {}):
        options["endpoint_url"] = endpoint
    config: dict[str, Any] = {
        "connect_timeout": 10,
        "read_timeout": 60,
        "retries": {"max_attempts": 2, "mode": "standard"},
    }
    # botocore's CRC of every response costs CPU the decoders need; each shard's sha256 is checked anyway
    with contextlib.suppress(ImportError):
        from botocore.config import Config

        for name in ("response_checksum_validation", "request_checksum_calculation"):
            if name in getattr(Config, "OPTION_DEFAULTS", {}):
                config[name] = "when_required"
    options["config_kwargs"] = {**config, **options.get("config_kwargs", {})}
    return options


_INHERITED: list[Any] = []  # filesystem objects a forked process inherited: kept, never used
_PARENT_LOOP: list[Any] = []


def _before_fork() -> None:
    asyn = sys.modules.get("fsspec.asyn")
    _PARENT_LOOP[:] = [asyn.loop[0]] if asyn is not None and asyn.loop[0] is not None else []


def _after_fork_in_child() -> None:
    """A forked child shares the kernel objects behind the parent's descriptors, the epoll set of
    fsspec's event loop included: a connection closed in the child (a finalizer, a garbage-collected
    client) would unregister the parent's socket from it, and the parent's request on it would wait
    out its timeout. So the child's copy of that loop gets an epoll set of its own, and every
    filesystem object fsspec had cached is kept alive, unused (closing one over TLS would also write
    to the parent's connection)."""
    _THREAD_LOCKS.clear()  # a lock a parent's thread held at the fork would never be released here
    global _THREAD_LOCKS_GUARD
    _THREAD_LOCKS_GUARD = threading.Lock()
    for loop in _PARENT_LOOP:
        selector = getattr(getattr(loop, "_selector", None), "_selector", None)
        if isinstance(selector, select.epoll):
            loop._selector._selector = select.epoll()
            selector.close()  # the child's descriptor only: the parent's set is untouched
    _PARENT_LOOP.clear()
    fsspec = sys.modules.get("fsspec")
    if fsspec is None:
        return
    pending = [fsspec.AbstractFileSystem]
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        cache = cls.__dict__.get("_cache")
        if isinstance(cache, dict):
            _INHERITED.extend(cache.values())


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)


@dataclass
class Store:
    """A remote folder: `url` (no trailing slash) and the fsspec options that reach it. Picklable;
    the filesystem object is made again in each process."""

    url: str
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.url = self.url.rstrip("/")
        self.protocol = _URL.match(self.url).group(1).lower()  # type: ignore[union-attr]
        self._http = self.protocol in ("http", "https")
        self._fs: Any = None
        self._root = ""
        self._pid = 0

    def __getstate__(self) -> dict[str, Any]:
        return {"url": self.url, "options": self.options}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.url, self.options = state["url"], state["options"]
        self.__post_init__()

    @property
    def fs(self) -> Any:
        if self._fs is None or self._pid != os.getpid():
            if self._fs is not None:
                # Inherited through a fork: its pooled connections are the parent's sockets. Left
                # alive, never used: closing it here would close them under the parent's requests.
                _INHERITED.append(self._fs)
            self._fs, self._root = _filesystem(self.url, self.protocol, self.options)
            self._root = self._root.rstrip("/")
            if self.protocol in ("s3", "s3a"):
                self._fs.retries = 2  # s3fs's own retry loop; `retrying` holds the window
            self._pid = os.getpid()
        return self._fs

    def child(self, name: str) -> str:
        return f"{self.url}/{name}"

    def _path(self, name: str) -> str:
        self.fs  # noqa: B018 - sets _root
        if self._http:
            name = quote(name)  # a space, '?' or '#' in a shard name is part of the name, not of the URL
        return f"{self._root}/{name}" if self._root else name

    def read(self, name: str, limit: int) -> bytes:
        """The whole object `name` of at most `limit` bytes (FileNotFoundError when there is none)."""
        path = self._path(name)

        def fetch() -> bytes:
            parts, total = [], 0
            with self._open_stream(path) as source:  # streamed: a body without a size, or a gzip
                while chunk := source.read(min(1 << 20, limit + 1 - total)):  # bomb, stops at the limit
                    parts.append(chunk)
                    total += len(chunk)
                    if total > limit:
                        raise StorageError(f"{self.child(name)}: over the limit of {limit:,} bytes")
            return b"".join(parts)

        return retrying(self.child(name), "reading", fetch)

    def _open_stream(self, path: str) -> Any:
        """A file object reading `path` from its start; HTTP as one streamed GET (servers need not
        support ranges)."""
        if self._http:
            return self.fs.open(path, "rb", block_size=0)
        return self.fs.open(path, "rb")

    def listing(self) -> dict[str, int | None]:
        """name -> size of the objects directly under this folder (none when it does not exist; an
        HTTP server lists what its index page links to, if it has one)."""
        fs = self.fs

        def ls() -> list[dict[str, Any]]:
            with contextlib.suppress(AttributeError, NotImplementedError):
                fs.invalidate_cache(self._root)
            try:
                return fs.ls(self._root, detail=True)
            except FileNotFoundError:
                return []

        entries = retrying(self.url, "listing", ls)
        held: dict[str, int | None] = {}
        for entry in entries:
            if entry.get("type") == "file":  # an HTTP index may not tell sizes: None
                size = entry.get("size")
                name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
                if self._http:
                    name = unquote(name)  # links are URLs: "a%20b.tar" is the shard "a b.tar"
                held[name] = None if size is None else int(size)
        return held

    def download(self, name: str, destination: str, size: int, sha256: str) -> None:
        """Object `name` into the local file `destination`, checked against `size` and `sha256`
        (ShardFormatError when the bytes differ: a damaged or replaced object, never retried)."""
        url = self.child(name)
        try:
            digest = self.get(name, destination, limit=size)
        except FileNotFoundError:
            raise ShardFormatError(f"{url}: listed in the manifest but missing") from None
        except TooLong:
            raise ShardFormatError(f"{url}: more than the {size:,} bytes the manifest says (replaced?)") from None
        held = os.path.getsize(destination)
        if held != size:
            raise ShardFormatError(f"{url}: {held:,} bytes, the manifest says {size:,} (truncated or replaced?)")
        if digest != sha256:
            raise ShardFormatError(f"{url}: sha256 differs from the manifest (damaged or replaced object)")

    def get(self, name: str, destination: str, limit: int | None = None) -> str:
        """Object `name` into the local file `destination`, as it is (FileNotFoundError if none);
        returns its sha256, computed on the way. With `limit`, a body longer than that raises
        TooLong as soon as it passes it (a stranger's server cannot fill the disk)."""
        path = self._path(name)

        def fetch() -> str:
            direct = self._direct_url(path)
            if direct is not None:
                try:
                    return _get_direct(direct, destination, limit)
                except _NotDirect:
                    pass
            with self._open_stream(path) as source:
                return _copy(source.read, destination, limit)

        return retrying(self.child(name), "downloading", fetch)

    def _direct_url(self, path: str) -> str | None:
        """A plain URL that a GET fetches this object from, where there is one: an S3 object's
        presigned URL, an http(s) URL itself. The transfer then costs about half the CPU of the
        async client (one readinto per MiB into a reused buffer, hashed on the way), which counts
        on a machine whose cores decode. Options that change the request (headers, requester pays,
        server-side keys) or a proxy in the environment keep the filesystem's own path."""
        if any(os.environ.get(name) for name in _PROXIES):
            return None
        if os.environ.get("AWS_CA_BUNDLE") or "verify" in self.options.get("client_kwargs", {}):
            return None  # a custom CA or no verification: the filesystem's own TLS settings apply
        if self._http and not self.options:
            return path
        if self.protocol in ("s3", "s3a") and not _REQUEST_OPTIONS & set(self.options):
            fs = self.fs
            return fs.url(path, expires=3600) if hasattr(fs, "url") else None
        return None

    def upload(self, source: str, name: str) -> None:
        path = self._path(name)
        retrying(self.child(name), "uploading", lambda: self.fs.put_file(source, path))

    def write(self, name: str, data: bytes) -> None:
        path = self._path(name)
        retrying(self.child(name), "writing", lambda: self.fs.pipe_file(path, data))

    def delete(self, name: str) -> None:
        path = self._path(name)

        def remove() -> None:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(path)

        retrying(self.child(name), "deleting", remove)


_PROXIES = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy")
_REQUEST_OPTIONS = {"s3_additional_kwargs", "requester_pays", "version_aware"}
_DIRECT_BUFFER = 1 << 20
_CONNECTIONS = threading.local()  # keep-alive connections of this thread: (pid, scheme, host, port) -> connection


class TooLong(ShardFormatError):
    """The body runs past the size the manifest gives (the caller names the URL)."""


def _copy(read: Callable[..., Any], destination: str, limit: int | None, into: bool = False) -> str:
    """Copies a body into `destination` a MiB at a time, hashing on the way; stops with TooLong
    as soon as it passes `limit`. `read` is readinto (into=True, into a reused buffer) or read."""
    digest = hashlib.sha256()
    buffer = memoryview(bytearray(_DIRECT_BUFFER))
    total = 0
    with open(destination, "wb", buffering=0) as out:
        while True:
            if into:
                count = read(buffer)
                chunk = buffer[:count]
            else:
                chunk = read(_DIRECT_BUFFER)
                count = len(chunk)
            if not count:
                break
            total += count
            if limit is not None and total > limit:
                raise TooLong("")
            out.write(chunk)
            digest.update(chunk)
    return digest.hexdigest()


class _NotDirect(Exception):
    """The direct GET was redirected or refused in a way the filesystem's own path handles."""


def _connection(scheme: str, host: str, port: int | None) -> Any:
    import http.client

    key = (os.getpid(), scheme, host, port)
    pool = getattr(_CONNECTIONS, "pool", None)
    if pool is None:
        pool = _CONNECTIONS.pool = {}
    if key not in pool:
        kind = http.client.HTTPSConnection if scheme == "https" else http.client.HTTPConnection
        pool[key] = kind(host, port, timeout=60)
    return pool[key]


def _get_direct(url: str, destination: str, limit: int | None) -> str:
    """GET `url` into `destination`, hashing on the way; the sha256. FileNotFoundError on 404,
    PermissionError on 401/403, OSError (retried) on 5xx and 429, _NotDirect on redirects."""
    import http.client

    parts = urlsplit(url)
    connection = _connection(parts.scheme, parts.hostname or "", parts.port)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    for attempt in (1, 2):
        reused = connection.sock is not None
        try:
            connection.request("GET", target)
            response = connection.getresponse()
            break
        except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
            connection.close()  # a kept-alive connection the server had closed: once more, anew
            if attempt == 2 or not reused:
                raise
        except BaseException:
            connection.close()  # never reuse a connection left mid-request
            raise
    try:
        status = response.status
        if status != 200:
            response.read(1 << 16)
            if status == 404:
                raise FileNotFoundError(status, "not found")
            if status in (401, 403):
                raise PermissionError(status, f"HTTP {status} {response.reason}")
            if status >= 500 or status == 429:
                raise OSError(status, f"HTTP {status} {response.reason}")
            raise _NotDirect(status)
        try:
            return _copy(response.readinto, destination, limit, into=True)
        except TooLong:
            connection.close()  # the rest of the body is not read: the connection cannot be reused
            raise
    except BaseException:
        connection.close()
        raise


def default_cache_dir() -> Path:
    """SHARDKIT_CACHE, else $XDG_CACHE_HOME/shardkit, else ~/.cache/shardkit."""
    if os.environ.get("SHARDKIT_CACHE"):
        return Path(os.environ["SHARDKIT_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "shardkit"


DEFAULT_CACHE_LIMIT = "50GB"


_THREAD_LOCKS: dict[tuple[Path, str], threading.Lock] = {}
_THREAD_LOCKS_GUARD = threading.Lock()


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
            raise ConfigError(f"{self.root}: cannot use as the shard cache ({error.strerror or error})") from None

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
        """Excludes the other threads of this process, then the other processes: a POSIX record
        lock, released by the kernel when a process dies and, unlike flock, never inherited by a
        forked child (a DataLoader worker forked while a prefetch held one would wait on itself)."""
        with _thread_lock(self.root, name):
            fd = os.open(self.root / "locks" / f"{name}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX)
                yield
            finally:
                os.close(fd)  # releases the record lock

    def open(self, store: Store, name: str, size: int, sha256: str) -> int:
        """A read-only descriptor of shard `name` of `store`, downloaded and checked unless already
        cached. Processes wanting the same shard wait for the one downloading it; a failed or killed
        download leaves only a temporary file, which the next download of that shard removes."""
        try:
            return self._open(store, name, size, sha256)
        except ShardkitError:
            raise
        except OSError as error:  # the cache folder itself: full, read-only, another user's
            raise StorageError(f"{self.root}: cannot use the shard cache ({error.strerror or error})") from None

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


@dataclass
class Remote:
    """A remote output as readers see it: where it is and the cache its shards go through."""

    store: Store
    cache: ShardCache
    ahead: int = 2  # shards of the epoch plan fetched in the background beyond the current one

    def __post_init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._pending: dict[str, Future[None]] = {}
        self._pid = 0
        self._guard = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {"store": self.store, "cache": self.cache, "ahead": self.ahead}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.__post_init__()

    def open(self, name: str, size: int, sha256: str) -> int:
        return self.cache.open(self.store, name, size, sha256)

    def fetch(self, name: str, size: int, sha256: str) -> None:
        self.cache.fetch(self.store, name, size, sha256)

    def prefetch(self, shards: list[tuple[str, int, str]]) -> None:
        """Starts fetching these (name, bytes, sha256) in the background (errors are left for the
        foreground fetch of the same shard to raise)."""
        with self._guard:
            if self._pool is None or self._pid != os.getpid():  # threads do not survive a fork
                self._pool, self._pending, self._pid = ThreadPoolExecutor(2, "shardkit-prefetch"), {}, os.getpid()
            for done in [sha for sha, future in self._pending.items() if future.done()]:
                del self._pending[done]
            for name, size, sha256 in shards:
                if sha256 not in self._pending and not self.cache.cached(sha256, name, size):
                    self._pending[sha256] = self._pool.submit(self.fetch, name, size, sha256)

    def close(self) -> None:
        """Cancels the prefetches not started and waits for the running ones (they end within the
        retry window): nothing keeps downloading for a dataset that is closed."""
        with self._guard:
            pool, self._pool = self._pool, None
        if pool is not None and self._pid == os.getpid():
            pool.shutdown(wait=True, cancel_futures=True)


class CachedShardReader:
    """A format's reader over the cached copy of a remote shard: fetched and opened on first use in
    each process, errors naming the URL. The reader opens the copy through this process's
    descriptor of it (/dev/fd/N), so an eviction meanwhile cannot take it away. Closing it lets the
    cache's eviction free the space."""

    def __init__(self, open_reader: Callable[[str], Any], remote: Remote, name: str, size: int, sha256: str) -> None:
        self.path = remote.store.child(name)
        self._open_reader, self._remote = open_reader, remote
        self._shard = (name, size, sha256)
        self._inner: Any = None
        self._fd = -1
        self._local = ""
        self._pid = 0

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_inner": None, "_fd": -1, "_pid": 0}

    def _reader(self) -> Any:
        if self._inner is None or self._pid != os.getpid():  # after a fork, open our own
            self._fd = self._remote.open(*self._shard)
            self._local = f"/dev/fd/{self._fd}"
            self._inner, self._pid = self._open_reader(self._local), os.getpid()
        return self._inner

    def _named(self, error: ShardFormatError) -> ShardFormatError:
        text = str(error)
        return type(error)(text.replace(self._local, self.path)) if self._local else error

    def _call(self, method: str, *args: Any) -> Any:
        try:
            return getattr(self._reader(), method)(*args)
        except ShardFormatError as error:
            raise self._named(error) from None

    def __len__(self) -> int:
        return self._call("__len__")

    def keys(self) -> list[str]:
        return self._call("keys")

    def read(self, index: int) -> Any:
        return self._call("read", index)

    def read_key(self, key: str) -> Any:
        return self._call("read_key", key)

    def positions(self) -> dict[str, int]:
        return self._call("positions")

    def read_range(self, start: int, stop: int) -> Iterator[Any]:
        try:
            yield from self._reader().read_range(start, stop)
        except ShardFormatError as error:
            raise self._named(error) from None

    def __iter__(self) -> Iterator[Any]:
        try:
            yield from iter(self._reader())
        except ShardFormatError as error:
            raise self._named(error) from None

    def close(self) -> None:
        if self._inner is not None and self._pid == os.getpid():
            self._inner.close()
            os.close(self._fd)
        self._inner, self._fd = None, -1


def read_remote_manifest(store: Store) -> Manifest:
    """The manifest of a remote output folder."""
    where = store.child(MANIFEST_NAME)
    try:
        text = store.read(MANIFEST_NAME, MAX_MANIFEST_BYTES)
    except FileNotFoundError:
        raise ManifestError(f"{where}: no manifest (is this a shardkit output folder?)") from None
    return parse_manifest(text, where)


def split_manifest_url(url: str) -> str:
    """The folder URL of a folder or manifest.json URL."""
    url = url.rstrip("/")
    return url[: -len(MANIFEST_NAME) - 1] if url.endswith("/" + MANIFEST_NAME) else url
