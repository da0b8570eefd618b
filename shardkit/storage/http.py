"""The direct read path of a remote output: one keep-alive GET per object (an S3 presigned URL or an
http(s) URL) through the process's HTTP client (`client`), read a MiB at a time and hashed on the
way, which costs less CPU than fsspec's async client on a machine whose cores decode; ranged reads,
a paced stream, and the bounded GET of a manifest or an index page. Each request is checked
against a `Pace`; what a failure means (absence, refusal, a passing fault) is said as an OSError
subclass for `retry` to judge."""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import re
import time
import zlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, BinaryIO
from urllib.parse import unquote, urljoin

from ..core.errors import ConfigError, ShardFormatError, StorageError

if TYPE_CHECKING:
    import urllib3  # imported where a GET is made: plain imports of this module stay light

_DIRECT_BUFFER = 1 << 20


class TooLong(ShardFormatError):
    """The body runs past the size the manifest gives (the caller names the URL)."""


class ObjectChanged(StorageError):
    """An object read in parts is another object than the one its first part came from (another
    ETag, another size): replaced between two reads. Never retried: a read of it from the start is
    the caller's to make."""


def _seconds(name: str, default: float) -> float:
    text = os.environ.get(name)
    try:
        value = float(text) if text else default
    except ValueError:
        raise ConfigError(f"{name} must be a number, not {text!r}") from None
    if value <= 0:
        raise ConfigError(f"{name} must be positive, not {text!r}")
    return value


class Pace:
    """Each request's total deadline (SHARDKIT_REQUEST_SECONDS, 1800 s) and, after its first
    SHARDKIT_RATE_GRACE_SECONDS (30 s), a minimum throughput (SHARDKIT_MIN_BYTES_PER_SECOND,
    64 KiB/s): a socket timeout alone is reset by every byte, so a server sending one byte a second
    would never be cut off. Either raises OSError (retried by `retry`, then said with the URL)."""

    def __init__(self) -> None:
        self.deadline = _seconds("SHARDKIT_REQUEST_SECONDS", 1800.0)
        self.grace = min(self.deadline, _seconds("SHARDKIT_RATE_GRACE_SECONDS", 30.0))
        self.rate = _seconds("SHARDKIT_MIN_BYTES_PER_SECOND", 65536.0)
        self.started = time.monotonic()

    @property
    def socket_timeout(self) -> float:
        """What one blocking read may wait: never past the deadline (nor a minute)."""
        return min(60.0, self.deadline)

    def check(self, total: int) -> None:
        elapsed = time.monotonic() - self.started
        if elapsed > self.deadline:
            raise OSError(f"took more than {self.deadline:g} s (SHARDKIT_REQUEST_SECONDS)")
        if elapsed > self.grace and total < self.rate * elapsed:
            raise OSError(
                f"{total:,} bytes in {elapsed:.0f} s, under the minimum of {self.rate:,.0f} bytes/s "
                "(SHARDKIT_MIN_BYTES_PER_SECOND)"
            )


def copy_body(read: Callable[[int], bytes], destination: str, limit: int | None, pace: Pace | None = None) -> str:
    """Copies a body into `destination` a MiB at a time, hashing on the way; stops with TooLong
    as soon as it passes `limit`, and with OSError when `pace` says it is too slow."""
    digest = hashlib.sha256()
    total = 0
    pending = bytearray()  # what `read` returned since the last write: written and hashed a MiB at a time
    with open(destination, "wb", buffering=0) as out:
        while chunk := read(_DIRECT_BUFFER):
            total += len(chunk)
            if limit is not None and total > limit:
                raise TooLong("")
            if pace is not None:
                pace.check(total)
            if pending or len(chunk) < _DIRECT_BUFFER // 4:  # small pieces (what arrived): gathered
                pending += chunk
                if len(pending) < _DIRECT_BUFFER:
                    continue
                out.write(pending)
                digest.update(pending)
                pending = bytearray()
                continue
            out.write(chunk)
            digest.update(chunk)
        if pending:
            out.write(pending)
            digest.update(pending)
    return digest.hexdigest()


class NotDirect(Exception):
    """The direct GET was redirected or refused in a way the filesystem's own path handles."""


def _get(
    url: str, retries: urllib3.Retry | bool, decode_content: bool, headers: dict[str, str] | None = None
) -> tuple[urllib3.BaseHTTPResponse, Pace]:
    """A streamed GET of `url` and the pace it is checked against; any trouble reaching it as OSError."""
    import urllib3

    from .client import http_client

    pace = Pace()
    timeout = urllib3.Timeout(connect=pace.socket_timeout, read=pace.socket_timeout)
    try:  # the client's own pool size; no retries of its own (the caller's, or `retry`'s, decide)
        response = http_client().manager.request(
            "GET", url, preload_content=False, decode_content=decode_content, retries=retries, timeout=timeout,
            headers=headers,
        )  # fmt: skip
    except urllib3.exceptions.MaxRetryError as error:  # (redirects followed, then a failure)
        raise OSError(f"{type(error.reason).__name__}: {error.reason}") from None
    except urllib3.exceptions.HTTPError as error:
        raise OSError(f"{type(error).__name__}: {error}") from None
    return response, pace


def _refusal(response: urllib3.BaseHTTPResponse) -> OSError | None:
    """What a status other than 200 means: absence (404), refusal (401, 403), a passing failure
    (5xx, 429); None for the rest (the caller says)."""
    status = response.status
    if status == 404:
        return FileNotFoundError(status, "not found")
    if status in (401, 403):
        return PermissionError(status, f"HTTP {status} {response.reason}")
    if status >= 500 or status == 429:
        return OSError(status, f"HTTP {status} {response.reason}")
    return None


def get_direct(url: str, destination: str, limit: int | None) -> str:
    """GET `url` into `destination` through a pooled keep-alive connection (urllib3), hashing on the
    way; the sha256. FileNotFoundError on 404, PermissionError on 401/403, OSError (retried) on 5xx,
    429, a refused or broken connection and a body cut short of its Content-Length; NotDirect on
    redirects."""
    import urllib3

    response, pace = _get(url, retries=False, decode_content=True)  # (redirects: the filesystem's path)
    try:
        if response.status != 200:
            response.read(1 << 16)
            raise _refusal(response) or NotDirect(response.status)
        try:
            digest = copy_body(response.read1, destination, limit, pace)  # what arrived: pace checks between
        except urllib3.exceptions.HTTPError as error:  # cut short, or stalled: retried, never taken as whole
            raise OSError(f"{type(error).__name__}: {error}") from None
    except BaseException:
        response.close()  # never reuse a connection left mid-body
        raise
    finally:
        response.release_conn()
    return digest


_CONTENT_RANGE = re.compile(r"bytes\s+(?:\d+-\d+|\*)/(\d+)")


def fetch_range(url: str, start: int, length: int, if_match: str | None = None) -> tuple[bytes, int | None, str | None]:
    """Bytes [start, start + length) of `url` by one ranged GET (fewer at its end, none past it),
    the whole size where the answer says it (Content-Range; a server that ignores the range: its
    Content-Length, the body read no further than the range) and the ETag it reports. With
    `if_match` (a strong ETag) the read is of that version only: ObjectChanged (412) when the object
    is another now. FileNotFoundError on 404, PermissionError on 401/403, OSError (retried) on 5xx,
    429 and a body cut short; NotDirect on redirects and other statuses."""
    import urllib3

    headers = {"Range": f"bytes={start}-{start + max(length, 1) - 1}"}
    if if_match is not None and not if_match.startswith("W/"):  # a weak ETag never matches (RFC 9110)
        headers["If-Match"] = if_match
    response, pace = _get(url, retries=False, decode_content=False, headers=headers)
    drained = False  # a body read to its end leaves its connection for the next request
    try:
        status = response.status
        tag = response.headers.get("ETag")
        if status == 412:
            response.read(1 << 16)
            raise ObjectChanged("")
        if status == 416:  # the range starts at or past the end: nothing there, and the size said
            drained = not response.read(1 << 16)
            return b"", _range_total(response), tag
        if status not in (200, 206):
            response.read(1 << 16)
            raise _refusal(response) or NotDirect(status)
        skip = start if status == 200 else 0  # the whole object came: its first bytes are not wanted
        parts, total = [], 0
        try:
            while total < skip + length and (chunk := response.read1(min(_DIRECT_BUFFER, skip + length - total))):
                parts.append(chunk)
                total += len(chunk)
                pace.check(total)
        except urllib3.exceptions.HTTPError as error:  # cut short, or stalled: retried
            raise OSError(f"{type(error).__name__}: {error}") from None
        data = b"".join(parts)[skip : skip + length]
        if status == 206:
            drained = not response.read(1)
            return data, _range_total(response), tag
        size = response.headers.get("Content-Length")
        return data, int(size) if size is not None and size.isdigit() else None, tag
    except urllib3.exceptions.HTTPError as error:
        raise OSError(f"{type(error).__name__}: {error}") from None
    finally:
        if not drained:
            response.close()  # a body left mid-way (a server that ignored the range): never reused
        response.release_conn()


def _range_total(response: urllib3.BaseHTTPResponse) -> int | None:
    match = _CONTENT_RANGE.fullmatch(response.headers.get("Content-Range", "").strip())
    return int(match.group(1)) if match else None


class PacedReader(io.RawIOBase):
    """A body as a raw file for `io.BufferedReader` (and so `readline`): each read through `read`,
    checked against `pace`, any client's error mid-body an OSError naming it. For a body read as a
    stream, never kept."""

    def __init__(self, read: Callable[[int], bytes], pace: Pace) -> None:
        self._read, self._pace, self._total = read, pace, 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        try:
            chunk = self._read(min(len(buffer), _DIRECT_BUFFER))
        except OSError:
            raise
        except Exception as error:  # the client's own (urllib3's, aiohttp's through fsspec, zlib's): said
            raise OSError(f"{type(error).__name__}: {error}") from None
        self._total += len(chunk)
        self._pace.check(self._total)
        buffer[: len(chunk)] = chunk
        return len(chunk)


@contextlib.contextmanager
def stream_direct(url: str) -> Iterator[BinaryIO]:
    """The body of `url` as a buffered binary stream, read as it is consumed and checked against a
    `Pace` (nothing of it kept but the buffer). FileNotFoundError on 404, PermissionError on
    401/403, OSError on 5xx and 429, NotDirect on redirects and other statuses: as `get_direct`."""
    response, pace = _get(url, retries=False, decode_content=True)
    try:
        if response.status != 200:
            response.read(1 << 16)
            raise _refusal(response) or NotDirect(response.status)
        yield io.BufferedReader(PacedReader(response.read1, pace), _DIRECT_BUFFER)
    finally:
        response.close()  # a body left mid-way: its connection is never reused
        response.release_conn()


# Our own small GET for manifests and index pages over http(s), in place of fsspec's: fsspec takes
# a refused connection, a timeout or a 503 for FileNotFoundError (final: "no manifest"), and reads
# an index page whole before inflating it, so a small gzip bomb fills memory. Here absence (404) is
# told from failure, and a compressed body is inflated a bounded piece at a time up to the limit.


def fetch_bytes(url: str, limit: int) -> bytes:
    """The body of `url` (redirects followed), inflated when gzip or deflate encoded, of at most
    `limit` bytes (TooLong past it). FileNotFoundError on 404, PermissionError on 401/403, OSError
    (retried) on 5xx, 429 and any connection trouble."""
    import urllib3

    from .client import INFLATE_BITS

    redirects = urllib3.Retry(total=None, connect=0, read=0, status=0, other=0, redirect=5)
    response, pace = _get(url, retries=redirects, decode_content=False)  # (inflated below, bounded)
    try:
        if response.status != 200:
            raise _refusal(response) or OSError(response.status, f"HTTP {response.status} {response.reason}")
        encoding = response.headers.get("Content-Encoding", "").strip().lower()
        inflate = zlib.decompressobj(INFLATE_BITS[encoding]) if encoding in INFLATE_BITS else None
        parts, total = [], 0
        try:
            while chunk := response.read1(1 << 16):
                while chunk:  # at most the room left (+1 to tell "over") comes out of each step
                    piece = inflate.decompress(chunk, limit + 1 - total) if inflate else chunk
                    chunk = inflate.unconsumed_tail if inflate else b""
                    parts.append(piece)
                    total += len(piece)
                    if total > limit:
                        raise TooLong("")
                pace.check(total)
        except (urllib3.exceptions.HTTPError, zlib.error) as error:
            raise OSError(f"{type(error).__name__}: {error}") from None
        return b"".join(parts)
    except BaseException:
        response.close()
        raise
    finally:
        response.release_conn()


_LINK = re.compile(r"""<a\s+(?:[^>]*?\s+)?href=["']([^"']+)""", re.IGNORECASE)


def list_links(url: str, limit: int) -> list[str]:
    """The names an HTTP folder's index page links to directly under it (folders and links
    elsewhere left out), as fsspec's HTTP listing reads them; the page is read up to `limit`."""
    base = url.rstrip("/") + "/"
    page = fetch_bytes(base, limit).decode("utf-8", "replace")
    names = []
    for link in _LINK.findall(page):
        target = urljoin(base, link)
        if target.startswith(base) and target != base:
            name = target[len(base) :].split("?", 1)[0].split("#", 1)[0]
            if name and "/" not in name:
                names.append(unquote(name))
    return list(dict.fromkeys(names))
