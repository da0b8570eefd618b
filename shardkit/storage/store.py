"""`Store`: one remote folder (a URL prefix) reached through fsspec, with retries, listing, bounded
whole-object reads, checked downloads (through the direct path of `http.py` where there is one) and
uploads; and the manifest of a remote output. Formats, the manifest and verify read local files
only: remote shards reach them through `cache.py`."""

from __future__ import annotations

import contextlib
import errno
import io
import os
import re
import select
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, BinaryIO
from urllib.parse import quote, unquote

from ..core.errors import ConfigError, ManifestError, MissingDependencyError, ShardFormatError, StorageError
from ..core.manifest import (
    CHANGE_NAME,
    JOURNAL_LIMIT,
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    STATE_DIR,
    VERSIONS_DIR,
    Manifest,
    finishing,
    parse_manifest,
    unfinished,
)
from ..core.safeio import loads
from .http import (
    NotDirect,
    ObjectChanged,
    Pace,
    PacedReader,
    TooLong,
    copy_body,
    fetch_bytes,
    fetch_range,
    get_direct,
    list_links,
    stream_direct,
)  # fmt: skip
from .retry import retrying
from .urls import PROTOCOL_EXTRAS, URL_SCHEME

LISTING_LIMIT = 64 << 20  # an HTTP folder's index page, inflated (~100 bytes a link: 600,000 links)


def _filesystem(url: str, protocol: str, options: dict[str, Any]) -> tuple[Any, str]:
    try:
        import fsspec
    except ImportError:
        raise MissingDependencyError(f"{url}: URLs need fsspec: pip install fsspec") from None
    options = dict(options)
    if protocol in ("s3", "s3a"):
        options = _s3_defaults(options)
    try:
        found: tuple[Any, str] = fsspec.core.url_to_fs(url, **options)  # fsspec is untyped: (filesystem, path)
        return found
    except ImportError:
        extra = PROTOCOL_EXTRAS.get(protocol)
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
    # never in its repr: the options hold credentials (key, secret, token), and a Store formatted
    # into a message or a log line would show them
    options: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.url = self.url.rstrip("/")
        match = URL_SCHEME.match(self.url)
        assert match is not None, f"a Store is made from a URL (locate() asks is_remote), not {self.url!r}"
        self.protocol = match.group(1).lower()
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
                self._fs.retries = 2  # s3fs's own retry loop; `retrying` bounds the total time
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
        direct = self._direct_url(path) if self._http else None
        if direct is not None:  # our own GET: absence told from failure, bombs inflated within the limit

            def fetch_direct() -> bytes:
                try:
                    return fetch_bytes(direct, limit)
                except TooLong:
                    raise StorageError(f"{self.child(name)}: over the limit of {limit:,} bytes") from None

            return retrying(self.child(name), "reading", fetch_direct)

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
        with contextlib.suppress(AttributeError, NotImplementedError):
            # (what is there now: a listing this process made earlier may predate it, as a change's
            # journal another machine wrote since, and fsspec would answer "no such object")
            self.fs.invalidate_cache(path)
        return self.fs.open(path, "rb")

    def listing(self) -> dict[str, int | None]:
        """name -> size of the objects directly under this folder (none when it does not exist; an
        HTTP server lists what its index page links to, if it has one, sizes unknown)."""
        fs = self.fs
        direct = self._direct_url(self._root) if self._http else None
        if direct is not None:

            def links() -> list[str]:
                try:
                    return list_links(direct, LISTING_LIMIT)
                except FileNotFoundError:
                    return []
                except TooLong:
                    raise StorageError(f"{self.url}: an index page over the limit of {LISTING_LIMIT:,} bytes") from None

            return dict.fromkeys(retrying(self.url, "listing", links))

        def ls() -> list[dict[str, Any]]:
            with contextlib.suppress(AttributeError, NotImplementedError):
                fs.invalidate_cache(self._root)
            try:
                listed: list[dict[str, Any]] = fs.ls(self._root, detail=True)  # fsspec is untyped
                return listed
            except FileNotFoundError:
                return []

        entries = retrying(self.url, "listing", ls)
        listed: dict[str, int | None] = {}
        for entry in entries:
            if entry.get("type") == "file":  # an HTTP index may not tell sizes: None
                size = entry.get("size")
                name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
                if self._http:
                    name = unquote(name)  # links are URLs: "a%20b.tar" is the shard "a b.tar"
                listed[name] = None if size is None else int(size)
        return listed

    def folder(self, rel_dir: str = "") -> list[tuple[str, bool]]:
        """(name, whether it is a folder) of each entry directly under `rel_dir` ('/'-separated,
        "" for this folder itself), in no order, from one delimiter listing (pages of it, never the
        whole bucket): FileNotFoundError when nothing lies there. The listing is not kept in the
        filesystem's cache: a walk of millions of objects holds one folder at a time."""
        fs = self.fs
        path = f"{self._root}/{rel_dir}" if rel_dir else self._root
        where = self.child(rel_dir) if rel_dir else self.url

        def ls() -> list[dict[str, Any]]:
            try:
                with contextlib.suppress(AttributeError, NotImplementedError):  # (as it is now, not as
                    fs.invalidate_cache(path)  # a listing earlier in this process found it)
                listed: list[dict[str, Any]] = fs.ls(path, detail=True)  # fsspec is untyped
                return listed
            finally:
                with contextlib.suppress(AttributeError, NotImplementedError):
                    fs.invalidate_cache(path)

        entries = retrying(where, "listing", ls)
        found: list[tuple[str, bool]] = []
        for entry in entries:
            full = entry["name"].rstrip("/")
            if full == path or not full.startswith(path + "/"):  # the prefix's own marker object
                continue
            found.append((full[len(path) + 1 :], entry.get("type") == "directory"))
        if not found and entries and all(entry.get("type") == "file" for entry in entries):
            raise NotADirectoryError(f"{where}: an object, not a prefix")
        return found

    def entries(self, rel_dir: str) -> list[tuple[str, bool]]:
        """`folder(rel_dir)`, with nothing there (no such prefix, or an object) as no entries."""
        try:
            return self.folder(rel_dir)
        except (FileNotFoundError, NotADirectoryError):
            return []

    def holds(self, rel_dir: str, depth: int = 0) -> bool:
        """Whether an object lies under `rel_dir/`: a folder a store keeps once emptied (SeaweedFS
        does) holds none. Past 8 levels of folders, a folder is taken to hold one."""
        return any(
            not folder or depth >= 8 or self.holds(f"{rel_dir}/{name}", depth + 1)
            for name, folder in self.entries(rel_dir)
        )

    def read_range(
        self, name: str, start: int, length: int, version: str | None = None
    ) -> tuple[bytes, int, str | None]:
        """Bytes [start, start + length) of object `name` (fewer at its end), the object's whole
        size and its version (the ETag or generation it reports, None where it tells none), in one
        ranged GET where there is a direct path (its Content-Range says the size), else a ranged
        read and the object's info. With `version`, of that version only: ObjectChanged when the
        object is another now. FileNotFoundError ("no such object") when there is none; transient
        failures retried."""
        path = self._path(name)

        def fetch() -> tuple[bytes, int, str | None]:
            try:
                direct = self._direct_url(path)
                if direct is not None:
                    with contextlib.suppress(NotDirect):
                        data, total, tag = fetch_range(direct, start, length, if_match=version)
                        if total is not None:
                            _same(version, tag)  # (a server that ignores If-Match)
                            return data, total, tag
                info = self.fs.info(path)
                size, tag = int(info["size"]), _version_of(info)
                _same(version, tag)
                end = min(start + length, size)
                data = self.fs.cat_file(path, start=start, end=end) if end > start else b""
                if version is not None:  # the range is of the version asked for if that is there still
                    _same(version, _version_of(self.fs.info(path)))
                return data, size, tag
            except FileNotFoundError:
                raise FileNotFoundError(errno.ENOENT, "no such object") from None
            except ObjectChanged:
                raise ObjectChanged(f"{self.child(name)}: replaced while it was read") from None

        return retrying(self.child(name), "reading", fetch)

    def ranges(self, name: str) -> Callable[[int, int], tuple[bytes, int]]:
        """Object `name` read by ranges, (start, length) -> (bytes, whole size), every read after
        the first of the version the first one read: ObjectChanged when a later one finds another
        (its version, or where the store tells none, its size), so no two versions are ever
        spliced."""
        first: list[tuple[int, str | None]] = []

        def read_range(start: int, length: int) -> tuple[bytes, int]:
            version = first[0][1] if first else None
            data, size, tag = self.read_range(name, start, length, version)
            if not first:
                first.append((size, tag))
            elif size != first[0][0]:
                raise ObjectChanged(
                    f"{self.child(name)}: replaced while it was read ({first[0][0]:,} bytes, then {size:,})"
                )
            return data, size

        return read_range

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
        on_disk = os.path.getsize(destination)
        if on_disk != size:
            raise ShardFormatError(f"{url}: {on_disk:,} bytes, the manifest says {size:,} (truncated or replaced?)")
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
                    return get_direct(direct, destination, limit)
                except NotDirect:
                    pass
            with self._open_stream(path) as source:
                return copy_body(source.read, destination, limit, Pace())

        return retrying(self.child(name), "downloading", fetch)

    @contextlib.contextmanager
    def stream(self, name: str) -> Iterator[BinaryIO]:
        """Object `name` as a buffered binary stream read as it is consumed, never copied to disk
        (FileNotFoundError if none): for a log read once in a bounded pass. Reaching it is retried;
        a failure mid-body is an OSError to the reader."""
        path = self._path(name)

        def opened() -> tuple[contextlib.ExitStack, BinaryIO]:
            stack = contextlib.ExitStack()
            try:
                direct = self._direct_url(path)
                if direct is not None:
                    with contextlib.suppress(NotDirect):
                        return stack, stack.enter_context(stream_direct(direct))
                source = stack.enter_context(self._open_stream(path))
                return stack, io.BufferedReader(PacedReader(source.read, Pace()))
            except BaseException:
                stack.close()
                raise

        stack, body = retrying(self.child(name), "reading", opened)
        with stack:
            yield body

    def _direct_url(self, path: str) -> str | None:
        """A plain URL that a GET fetches this object from, where there is one: an S3 object's
        presigned URL, an http(s) URL itself. The transfer then costs less CPU than the async
        client (urllib3, a MiB a read, hashed on the way), which counts on a machine whose cores
        decode. Options that change the request (headers, requester pays, server-side keys) or a
        proxy in the environment keep the filesystem's own path."""
        if any(os.environ.get(name) for name in _PROXIES) or "verify" in self.options.get("client_kwargs", {}):
            return None
        url = None
        if self._http and not self.options:
            url = path
        elif self.protocol in ("s3", "s3a") and not _REQUEST_OPTIONS & set(self.options):
            fs = self.fs
            url = fs.url(path, expires=3600) if hasattr(fs, "url") else None
        if url is not None and url.startswith("https:") and any(os.environ.get(name) for name in _CA_BUNDLES):
            return None  # a custom CA: the filesystem's own TLS settings apply (plain http has none)
        return url

    def upload(self, source: str, name: str) -> None:
        path = self._path(name)
        retrying(self.child(name), "uploading", lambda: self.fs.put_file(source, path))

    def write(self, name: str, data: bytes) -> None:
        path = self._path(name)
        retrying(self.child(name), "writing", lambda: self.fs.pipe_file(path, data))

    def copy(self, name: str, to: str) -> None:
        """Object `name` copied to `to` in this store, server-side where the store can
        (FileNotFoundError where there is no `name`)."""
        source, target = self._path(name), self._path(to)
        retrying(self.child(to), "copying", lambda: self.fs.copy(source, target))

    def copy_from(self, source: Store, name: str, to: str) -> None:
        """Object `name` of the store `source` copied to `to` in this one, server-side (both on one
        filesystem: merge checks it; FileNotFoundError where there is no `name`)."""
        origin, target = source._path(name), self._path(to)
        retrying(self.child(to), "copying", lambda: self.fs.copy(origin, target))

    def delete(self, name: str) -> None:
        path = self._path(name)

        def remove() -> None:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(path)

        retrying(self.child(name), "deleting", remove)

    def delete_folder(self, name: str) -> None:
        """Every object under `name/` deleted (nothing there: nothing to do)."""
        path = self._path(name)

        def remove() -> None:
            with contextlib.suppress(AttributeError, NotImplementedError):
                self.fs.invalidate_cache(path)  # (every object there now, not those a listing saw)
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm(path, recursive=True)

        retrying(self.child(name), "deleting", remove)


def _version_of(info: dict[str, Any]) -> str | None:
    """The version an fsspec filesystem's info tells of an object: its ETag (as a direct GET's
    answer says it), else its generation or version id; None where it tells none."""
    for key in ("ETag", "etag", "generation", "VersionId", "version_id"):
        if info.get(key):
            return str(info[key])
    return None


def _same(version: str | None, found: str | None) -> None:
    if version is not None and found is not None and found != version:
        raise ObjectChanged("")


_PROXIES = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy")
_REQUEST_OPTIONS = {"s3_additional_kwargs", "requester_pays", "version_aware"}
_CA_BUNDLES = ("AWS_CA_BUNDLE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "SSL_CERT_FILE")


def kept_versions(store: Store) -> list[int]:
    """The versions `--keep-versions` kept in the output at `store` (its prefixes versions/vN with
    anything in them: a store may keep a folder emptied), in order."""
    names = [name for name, folder in store.entries(VERSIONS_DIR) if folder and re.fullmatch(r"v[0-9]{1,10}", name)]
    return sorted(int(name[1:]) for name in names if store.entries(f"{VERSIONS_DIR}/{name}"))


def read_remote_manifest(store: Store) -> Manifest:
    """The manifest of a remote output folder."""
    where = store.child(MANIFEST_NAME)
    try:
        text = store.read(MANIFEST_NAME, MAX_MANIFEST_BYTES)
    except FileNotFoundError:
        raise ManifestError(f"{where}: {_no_manifest(store)}") from None
    return parse_manifest(text, where)


def _no_manifest(store: Store) -> str:
    """Why `store` has no manifest: where a change's journal there reads as one, a change (a merge
    into a new prefix) began and has not finished, and the command that finishes it; else no
    output. Only a journal read whole counts (a server that refuses dot-paths, or fails, says
    nothing of one); https:// outputs hold no changes and are not asked. (A pack into a bucket
    keeps its state on the machine that packs.)"""
    plain = "no manifest (is this a shardkit output folder?)"
    if store._http:
        return plain
    try:
        data = loads(store.read(f"{STATE_DIR}/{CHANGE_NAME}", JOURNAL_LIMIT))
    except (FileNotFoundError, StorageError, OSError, ValueError):
        return plain
    if not isinstance(data, dict) or not isinstance(data.get("action"), str):
        return plain
    action = data["action"][:40]
    return unfinished(action, finishing(store.url, action, data.get("plan")))
