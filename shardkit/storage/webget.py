"""One GET of an image URL, the try that `storage/download` retries: through the process's HTTP
client (`client`), each try's deadline from connect to last byte, redirects followed by hand
(so a loop, a sixth hop and a scheme other than http(s) are refused), and what makes a 200 no image
(X-Robots-Tag, the size cap, the magic bytes, the sha256). Every failure is one DownloadError whose
reason never holds the URL's credentials."""

from __future__ import annotations

import base64
import hashlib
import http.client
import re
import socket
import time
import zlib
from email.utils import parsedate_to_datetime
from typing import NamedTuple
from urllib.parse import unquote, urljoin, urlsplit

import urllib3
from urllib3.connection import HTTPConnection

from ..core.config import WebConfig
from ..core.headers import format_from_magic
from ..core.version import __version__
from .client import INFLATE_BITS, Watch, http_client
from .urls import URL_SCHEME

USER_AGENT = f"shardkit/{__version__}"
AGENT_TOKEN = "shardkit"  # the name an `X-Robots-Tag: <bot>: ...` must give to speak to us
MAX_URL = 8192
MAX_REDIRECTS = 5
REDIRECTS = frozenset({301, 302, 303, 307, 308})
# img2dataset's default `disallowed_header_directives`: a site that says any of them is skipped
DISALLOWED = frozenset({"noai", "noimageai", "noindex", "noimageindex"})
_VALUED = frozenset({"unavailable_after", "max-snippet", "max-image-preview", "max-video-preview"})
_CHUNK = 1 << 16
MAGIC_BYTES = 16  # enough of the head to tell every format below


class DownloadError(Exception):
    """One URL that could not be fetched. `reason` is one line without credentials ("HTTP 404",
    "timed out after 30 s"); `cause` a short category to count by ("404", "5xx", "timeout", ...);
    `transient` when a later run may succeed; `status` the HTTP status when there was one.
    `retry_after` is the wait a 429 or 503 asked for, and `unreachable` says no answer came from
    the host at all (what the downloader's per-host breaker counts)."""

    def __init__(
        self,
        reason: str,
        cause: str = "error",
        transient: bool = False,
        status: int | None = None,
        retry_after: float | None = None,
        unreachable: bool = False,
    ) -> None:
        super().__init__(reason)
        self.reason, self.cause, self.transient, self.status = reason, cause, transient, status
        self.retry_after, self.unreachable = retry_after, unreachable

    def after(self, tries: int) -> DownloadError:
        """The same failure, saying how many tries it took when there was more than one."""
        if tries <= 1:
            return self
        again = DownloadError(f"{self.reason} (tried {tries} times)", self.cause, self.transient, self.status)
        again.unreachable = self.unreachable
        return again


def redact(url: str) -> str:
    """`url` with its userinfo (user:password@) replaced by ***@: how every report names a URL."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    end = min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))
    if "@" not in rest[:end]:
        return url
    return f"{scheme}://***@{rest[:end].rpartition('@')[2]}{rest[end:]}"


def url_problem(url: str) -> str:
    """Why `url` is no http(s) URL with a host, or "" when it is one."""
    if not isinstance(url, str) or not url:
        return "no URL"
    if len(url) > MAX_URL:
        return f"URL over 8 KiB ({len(url):,} characters)"
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in url):
        return "control characters in the URL"
    scheme = URL_SCHEME.match(url)
    if scheme is None:
        return "not a URL (a local path?)"
    if scheme.group(1).lower() not in ("http", "https"):
        return f"{scheme.group(1).lower()}:// is not http(s)"
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 (raises on a port that is no number)
    except ValueError:
        return "not a valid URL (its host or port)"
    return "" if parts.hostname else "no host in the URL"


def host_of(url: str) -> str:
    """The host (and port) a URL's connections go to: what per-host limits count."""
    try:
        parts = urlsplit(url)
        return f"{parts.hostname}:{parts.port or ''}"
    except ValueError:
        return ""


def _credentials(url: str) -> tuple[str, str | None]:
    """The URL without its userinfo, and the Authorization header the userinfo makes (or None)."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url, None
    user_info, _, host = parts.netloc.rpartition("@")
    user, _, password = user_info.partition(":")
    token = base64.b64encode(f"{unquote(user)}:{unquote(password)}".encode()).decode("ascii")
    return parts._replace(netloc=host).geturl(), f"Basic {token}"


def _origin(url: str) -> tuple[str, str]:
    parts = urlsplit(url)
    return parts.scheme.lower(), parts.netloc.lower()


# --- one try ------------------------------------------------------------------------------------


class Got(NamedTuple):
    body: bytes
    size: int | None  # the whole object's size, when the server said it


class _Want(NamedTuple):
    start: int  # the first byte wanted
    length: int | None  # how many (None: the whole object, which must be an image under the cap)
    sha256: str | None


def get_once(url: str, web: WebConfig, start: int = 0, length: int | None = None, sha256: str | None = None) -> Got:
    """One try at `url` (redirects followed): the whole object, or `length` bytes from `start` by
    a Range request. DownloadError on any failure, `transient` when trying again may help."""
    want = _Want(start, length, sha256.lower() if sha256 else None)
    deadline = time.monotonic() + web.timeout
    target, auth = _credentials(url)
    seen = {target}
    for _ in range(MAX_REDIRECTS + 1):
        got = _hop(target, auth, web, want, deadline)
        if isinstance(got, Got):
            return got
        location = urljoin(target, got)
        problem = url_problem(location)
        if problem:
            scheme = URL_SCHEME.match(location)
            raise DownloadError(
                f"redirect to {scheme.group(1).lower()}://…" if scheme else f"redirect to a bad URL ({problem})",
                "redirect",
            )
        new_target, new_auth = _credentials(location)
        if new_target in seen:
            raise DownloadError("redirect loop", "redirect")
        # the credentials go to where they were given (as requests does), never to another host
        auth = new_auth or (auth if _origin(new_target) == _origin(target) else None)
        target = new_target
        seen.add(target)
    raise DownloadError(f"more than {MAX_REDIRECTS} redirects", "redirect")


def _hop(target: str, auth: str | None, web: WebConfig, want: _Want, deadline: float) -> Got | str:
    """One request: what it got, or where a redirect points."""
    headers = {"User-Agent": USER_AGENT, "Accept-Encoding": "identity"}
    if auth:
        headers["Authorization"] = auth
    if want.length is not None:
        headers["Range"] = f"bytes={want.start}-{want.start + want.length - 1}"
    client = http_client()
    remaining = max(0.001, deadline - time.monotonic())
    watch = client.watchdog.start(deadline)
    client.local.watch = watch
    try:
        parsed = urllib3.util.parse_url(target)
        hosts = client.manager.connection_from_url(target, pool_kwargs={"maxsize": web.per_host})
        response = hosts.urlopen(
            "GET", parsed.request_uri, headers=headers, retries=False, redirect=False, assert_same_host=False,
            timeout=urllib3.Timeout(connect=remaining, read=remaining), preload_content=False,
            decode_content=False, release_conn=False,
        )  # fmt: skip
    except (urllib3.exceptions.HTTPError, OSError, ValueError) as error:
        client.watchdog.finish(watch)
        raise _no_answer(error, watch, web) from None
    finally:
        client.local.watch = None
    conn = _held(response)
    try:
        got = _answer(response, web, want, watch)
    except BaseException:
        client.watchdog.finish(watch)
        _close(response, conn)  # a failed answer's connection is never reused (it may be left mid-body)
        raise
    client.watchdog.finish(watch)  # before the connection goes back to the pool
    if isinstance(got, str) or not got.reusable or _more_to_read(conn):
        # a redirect's body or the rest of one (not worth reading to keep the connection), or bytes
        # past the body's end, which the next request on the connection would read as its answer
        _close(response, conn)
        return got if isinstance(got, str) else got.got
    if isinstance(response, urllib3.HTTPResponse):
        response._connection = conn
    response.release_conn()
    return got.got


def _held(response: urllib3.BaseHTTPResponse) -> HTTPConnection | None:
    """The response's connection, taken from it: urllib3 puts a connection back in the pool as the
    body's last byte is read, before anything after the body could be seen (or the try's watch
    ended), so `_hop` gives it back itself."""
    if not isinstance(response, urllib3.HTTPResponse):
        return None
    conn, response._connection = response._connection, None
    return conn


def _close(response: urllib3.BaseHTTPResponse, conn: HTTPConnection | None) -> None:
    response.close()
    if conn is not None:
        conn.close()


class _Read(NamedTuple):
    got: Got
    reusable: bool  # the body was read to its declared end and no further bytes came with it


class _Body(NamedTuple):
    data: bytes
    whole: bool  # read to its end (else the rest was left unread)
    surplus: bool  # bytes past the declared length came in with it


def _answer(response: urllib3.BaseHTTPResponse, web: WebConfig, want: _Want, watch: Watch) -> _Read | str:
    status = response.status
    if status in REDIRECTS:
        location = response.headers.get("Location", "").strip()
        if not location:
            raise DownloadError(f"HTTP {status} with no Location", "redirect", status=status)
        return location
    if status != 200 and not (status == 206 and want.length is not None):
        raise _status_error(response)
    if web.respect_noai and (directive := disallowed(response.headers.getlist("X-Robots-Tag"))):
        raise DownloadError(f"X-Robots-Tag: {directive}", "noai", status=status)
    declared, size = _sizes(response)
    # refused before reading (a range of it too: download would refuse the whole)
    if (declared or 0) > web.max_bytes:
        raise DownloadError(f"over the {_bytes(web.max_bytes)} cap", "too-big", status=status)
    skip = want.start if status == 200 else 0  # a server that ignores Range sends it all
    read = _body(response, web, watch, skip + want.length if want.length is not None else None)
    body = read.data[skip:]
    # (a range from 0 too short to tell, of an object longer still, is taken as it is)
    if want.start == 0 and (len(body) >= MAGIC_BYTES or read.whole) and not is_image(body[:MAGIC_BYTES]):
        kind = (response.headers.get("Content-Type") or "no Content-Type").split(";")[0].strip()[:60]
        empty = ", empty body" if not body else ""
        raise DownloadError(f"not an image ({_printable(kind)} at {status}{empty})", "not-image", status=status)
    if want.sha256 and hashlib.sha256(body).hexdigest() != want.sha256:
        raise DownloadError("sha256 mismatch", "sha256", status=status)
    # a body longer than it said is taken as the declared bytes (what its length promised)
    return _Read(Got(body, size), read.whole and not read.surplus)


def _status_error(response: urllib3.BaseHTTPResponse) -> DownloadError:
    status = response.status
    if status in (401, 403, 404, 410):
        return DownloadError(f"HTTP {status}", str(status), status=status)
    if status in (408, 429) or 500 <= status <= 599:
        wait = retry_after(response.headers.get("Retry-After")) if status in (429, 503) else None
        return DownloadError(f"HTTP {status}", "5xx" if status >= 500 else str(status), True, status, wait)
    return DownloadError(f"HTTP {status}", "4xx" if 400 <= status <= 499 else "status", status=status)


def _sizes(response: urllib3.BaseHTTPResponse) -> tuple[int | None, int | None]:
    """The size the server declares (a 206's Content-Range total, else Content-Length), and the
    whole object's size (the same, unless the body is compressed: then unknown)."""
    if response.status == 206:
        text = response.headers.get("Content-Range", "").rpartition("/")[2].strip()
    else:
        text = response.headers.get("Content-Length", "").strip()
    declared = int(text) if text.isdigit() else None
    encoded = response.headers.get("Content-Encoding", "identity").strip().lower() != "identity"
    return declared, None if encoded and response.status != 206 else declared


def _body(response: urllib3.BaseHTTPResponse, web: WebConfig, watch: Watch, take: int | None) -> _Body:
    """The body, inflated when the server gzipped it anyway, each step bounded: the first `take`
    bytes (and whether more were left unread), or all of it up to the cap."""
    encoding = (response.headers.get("Content-Encoding") or "identity").strip().lower()
    if encoding not in INFLATE_BITS and encoding != "identity":
        raise DownloadError(f"unsupported Content-Encoding {_printable(encoding[:20])}", "encoding")
    inflate = zlib.decompressobj(INFLATE_BITS[encoding]) if encoding in INFLATE_BITS else None
    cap = web.max_bytes if take is None else take
    parts: list[bytes] = []
    total = received = 0
    checked = ended = False
    try:
        surplus = _buffered_past_end(response)
    except OSError as error:
        raise _mid_body(error, watch, web, received, response) from None
    while total <= cap:
        try:
            chunk = response.read1(_CHUNK)
        except (urllib3.exceptions.HTTPError, OSError) as error:
            raise _mid_body(error, watch, web, received, response) from None
        if time.monotonic() > watch.deadline or watch.expired:
            raise _timed_out(web)
        if not chunk:
            ended = True
            break
        received += len(chunk)
        while chunk and total <= cap:  # at most the room left (+1 to tell "over") comes out of a step
            try:
                piece = inflate.decompress(chunk, cap + 1 - total) if inflate else chunk
            except zlib.error:
                raise DownloadError(f"a damaged {encoding} body", "encoding") from None
            chunk = inflate.unconsumed_tail if inflate else b""
            parts.append(piece)
            total += len(piece)
        if not checked and total >= MAGIC_BYTES and take is None:  # a web page: refused unread
            head = b"".join(parts)[:MAGIC_BYTES]
            checked = True
            if not is_image(head):
                return _Body(head, False, surplus)
    if ended and inflate is not None and not inflate.eof:  # the stream stops before its end marker
        raise DownloadError(
            f"body cut short ({received:,} bytes, its {encoding} stream unfinished)", "cut", True, response.status
        )
    body = b"".join(parts)
    if take is None and total > cap:
        raise DownloadError(f"over the {_bytes(web.max_bytes)} cap", "too-big", status=response.status)
    return _Body(body[:cap], ended, surplus)


def _buffered_past_end(response: urllib3.BaseHTTPResponse) -> bool:
    """Whether the bytes read in with the headers run past the declared length. http.client drops
    its read buffer at the body's end, so this surplus is seen only now, before the body is read
    (and more of it may still be on its way)."""
    remaining = response.length_remaining
    reader = getattr(getattr(response, "_fp", None), "fp", None)  # http.client's buffered reader
    if not remaining or reader is None or not hasattr(reader, "peek"):
        return False
    # (the buffered bytes; with none buffered, one read of what the body's start must bring anyway)
    return len(reader.peek()) > remaining


def _more_to_read(conn: HTTPConnection | None) -> bool:
    """Whether anything more waits on the connection after the body (bytes past its end, or the
    server's close): in the socket, or decrypted by TLS and held there, where urllib3's own check
    of a pooled connection never looks."""
    sock = getattr(conn, "sock", None)
    if sock is None:
        return True
    pending = getattr(sock, "pending", None)
    try:
        return bool(pending and pending()) or urllib3.util.wait.wait_for_read(sock, timeout=0.0)
    except (OSError, ValueError):
        return True


def _no_answer(error: BaseException, watch: Watch, web: WebConfig) -> DownloadError:
    """What a failure before any status line means. `unreachable`: the host gave no answer."""
    cause = error.__cause__ or error.__context__
    if watch.expired or isinstance(error, urllib3.exceptions.ReadTimeoutError):
        return _timed_out(web)
    if isinstance(error, urllib3.exceptions.NameResolutionError):
        if isinstance(cause, socket.gaierror) and cause.errno in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", -5)):
            return DownloadError("host not found", "dns")  # the name does not exist: no use trying again
        return DownloadError("host name lookup failed", "dns", True, unreachable=True)
    if isinstance(error, urllib3.exceptions.SSLError):
        if "CERTIFICATE_VERIFY_FAILED" in str(error):
            return DownloadError("TLS certificate not trusted", "tls")
        return DownloadError("TLS handshake failed", "tls", True, unreachable=True)
    if isinstance(error, urllib3.exceptions.NewConnectionError):
        if isinstance(cause, ConnectionRefusedError):
            return DownloadError("connection refused", "connection", True, unreachable=True)
        return DownloadError("could not connect", "connection", True, unreachable=True)
    if isinstance(error, urllib3.exceptions.ConnectTimeoutError):  # (after its subclass NewConnectionError)
        return DownloadError(f"timed out connecting after {web.timeout:g} s", "timeout", True, unreachable=True)
    if isinstance(error, urllib3.exceptions.ProtocolError | ConnectionError):
        return _refused_headers(error) or DownloadError(
            "connection closed before an answer", "connection", True, unreachable=True
        )
    if isinstance(error, urllib3.exceptions.LocationValueError | ValueError):
        return DownloadError("not a valid URL", "url")
    return DownloadError(f"request failed ({type(error).__name__})", "connection", True, unreachable=True)


def _refused_headers(error: BaseException) -> DownloadError | None:
    """The answer's head that http.client refuses to read (a line over 64 KiB, more than 100
    headers), or None for another failure. The host answered, so this is no outage of it (its
    breaker stays shut), and the same URL answers the same again: final."""
    inner = error.args[1] if len(error.args) > 1 else error.__context__
    if isinstance(inner, http.client.LineTooLong):
        status_line = str(inner).endswith("status line")  # ("got more than 65536 bytes when reading status line")
        return DownloadError("status line too long" if status_line else "headers too long", "headers")
    if isinstance(inner, http.client.HTTPException) and re.fullmatch(r"got more than \d+ headers", str(inner)):
        return DownloadError("too many headers", "headers")
    return None


def _mid_body(
    error: BaseException, watch: Watch, web: WebConfig, received: int, response: urllib3.BaseHTTPResponse
) -> DownloadError:
    if watch.expired or isinstance(error, urllib3.exceptions.ReadTimeoutError | TimeoutError):
        return _timed_out(web)
    length = response.headers.get("Content-Length", "").strip()
    of = f" of {int(length):,}" if length.isdigit() else ""
    return DownloadError(f"body cut short ({received:,}{of} bytes)", "cut", True, response.status)


def _timed_out(web: WebConfig) -> DownloadError:
    return DownloadError(f"timed out after {web.timeout:g} s", "timeout", True)


def retry_after(value: str | None) -> float | None:
    """A Retry-After header's wait in seconds (a number, or an HTTP date), or None when unreadable."""
    if not value:
        return None
    text = value.strip()
    if text.isdigit():
        return float(text)
    try:
        when = parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        return None
    return max(0.0, when.timestamp() - time.time())


def disallowed(values: list[str]) -> str:
    """The directive among X-Robots-Tag values that refuses our use ("" for none): img2dataset's
    default list, given to all (`noai`) or to us by name (`shardkit: noai`), never another bot's."""
    for value in values:
        bot, sep, rest = value.partition(":")
        token = bot.strip().lower()
        if sep and re.fullmatch(r"[a-z0-9_.-]+", token) and token not in _VALUED:
            if token != AGENT_TOKEN:
                continue
            value = rest
        for directive in value.split(","):
            if directive.strip().lower() in DISALLOWED:
                return directive.strip().lower()
    return ""


_TIFF = (b"II*\x00", b"MM\x00*")
_HEIF = frozenset({b"avif", b"avis", b"heic", b"heix", b"mif1", b"msf1"})


def is_image(head: bytes) -> bool:
    """Whether the first bytes are an image's: JPEG, PNG, GIF, WebP and BMP (core/headers reads
    them), TIFF, ICO, JPEG 2000, AVIF and HEIF (Pillow's)."""
    return bool(
        format_from_magic(head)
        or head[:4] in _TIFF
        or head[:4] == b"\x00\x00\x01\x00"
        or head.startswith((b"\x00\x00\x00\x0cjP  \r\n\x87\n", b"\xffO\xffQ"))
        or (head[4:8] == b"ftyp" and head[8:12] in _HEIF)
    )


def _bytes(size: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if size >= 1 << shift and size % (1 << shift) == 0:
            return f"{size >> shift}{unit}"
    return f"{size:,}-byte"


def _printable(text: str) -> str:
    return "".join(c if c.isprintable() else "?" for c in text)
