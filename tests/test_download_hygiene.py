"""What one URL's answer leaves on its connection (storage/webget) against a raw loopback server
that writes exact bytes, which http.server cannot be made to: a Content-Length that lies, a chunked
body that breaks off, a head too long to read, a compressed stream that stops short. A connection
that carried a bad answer is never pooled, so the next request to the host is answered cleanly on
its first try; a head too big to read is the URL's final failure and never the host's outage."""

from __future__ import annotations

import gzip
import io
import shutil
import socket
import socketserver
import ssl
import subprocess
import threading
import zlib
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest
from PIL import Image

from shardkit.core.config import WebConfig
from shardkit.storage.download import Downloader, DownloadError, download

WEB = WebConfig(retries=2, backoff=0.01, timeout=2.0, max_bytes=1 << 20, threads=4, per_host=2)


def _png(height: int, width: int) -> bytes:
    out = io.BytesIO()
    Image.fromarray(np.random.default_rng(5).integers(0, 256, (height, width, 3), dtype=np.uint8)).save(out, "PNG")
    return out.getvalue()


IMAGE = _png(32, 32)  # a few KiB: its answer fits in one read of the headers' buffer
LARGE = _png(64, 64)[:12000]  # (an image's head is all a download checks) past that buffer, within one TLS record


class Answer(NamedTuple):
    data: bytes  # written as it is
    close: bool = False  # the server hangs up after it


def ok(body: bytes, surplus: bytes = b"", extra: str = "", length: int | None = None) -> Answer:
    declared = len(body) if length is None else length
    head = f"HTTP/1.1 200 OK\r\nContent-Type: image/png\r\nContent-Length: {declared}\r\n{extra}\r\n"
    return Answer(head.encode() + body + surplus)


class RawServer(socketserver.ThreadingTCPServer):
    """A keep-alive loopback server (over TLS when given a context) answering each path with its
    `Answer`'s exact bytes (404 for others); `requests` holds (connection number, path) of each
    request in the order they came."""

    daemon_threads = True

    def __init__(self, answers: dict[str, Answer], tls: ssl.SSLContext | None = None) -> None:
        super().__init__(("127.0.0.1", 0), _RawHandler)
        self.answers, self.tls = answers, tls
        self.requests: list[tuple[int, str]] = []
        self.connections = 0
        self.lock = threading.Lock()

    def __enter__(self) -> RawServer:
        threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
        self.server_close()

    def url(self, path: str) -> str:
        scheme = "https" if self.tls else "http"
        return f"{scheme}://127.0.0.1:{self.server_address[1]}{path}"

    def get_request(self) -> tuple[socket.socket, Any]:
        sock, address = super().get_request()
        return (self.tls.wrap_socket(sock, server_side=True) if self.tls else sock), address


class _RawHandler(socketserver.StreamRequestHandler):
    server: RawServer

    def handle(self) -> None:
        with self.server.lock:
            self.server.connections += 1
            number = self.server.connections
        while True:
            try:
                line = self.rfile.readline()
                while self.rfile.readline() not in (b"\r\n", b""):
                    pass
            except OSError:  # a client that hung up
                return
            if not line:
                return
            path = line.split()[1].decode()
            with self.server.lock:
                self.server.requests.append((number, path))
            answer = self.server.answers.get(path, Answer(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n"))
            try:
                self.request.sendall(answer.data)
            except OSError:
                return
            if answer.close:
                return


def failure(url: str, web: WebConfig = WEB) -> DownloadError:
    with pytest.raises(DownloadError) as caught:
        download(url, web)
    return caught.value


# --- a length that does not match --------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "surplus"),
    [(IMAGE, b"GARBAGE" * 8), (IMAGE, b"G" * 200_000)],
    ids=["read-in-with-the-headers", "left-in-the-socket"],
)
def test_a_body_longer_than_its_length_is_its_declared_bytes_on_a_connection_not_kept(
    body: bytes, surplus: bytes
) -> None:
    with RawServer({"/long": ok(body, surplus), "/next": ok(IMAGE)}) as server:
        assert download(server.url("/long"), WEB) == body
        assert download(server.url("/next"), WEB) == IMAGE
    assert server.requests == [(1, "/long"), (2, "/next")]  # each asked once; the next on a new connection


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> tuple[ssl.SSLContext, Path]:
    """A server context with a self-signed certificate for 127.0.0.1, and the certificate's file."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl command to make a certificate with")
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    return context, cert


def test_over_tls_bytes_past_the_end_never_reach_the_next_answer(
    tls: tuple[ssl.SSLContext, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    # the surplus shares the body's TLS record: decrypted and held by TLS, out of the socket's sight
    context, cert = tls
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))  # the client trusts what the system's store holds
    with RawServer({"/long": ok(LARGE, b"GARBAGE" * 10), "/next": ok(IMAGE)}, context) as server:
        assert download(server.url("/long"), WEB) == LARGE
        assert download(server.url("/next"), WEB) == IMAGE
    assert server.requests == [(1, "/long"), (2, "/next")]


@pytest.mark.parametrize(
    ("answer", "reason"),
    [(Answer(ok(IMAGE, length=len(IMAGE) + 100).data, close=True), f"body cut short ({len(IMAGE):,} of "
      f"{len(IMAGE) + 100:,} bytes)"),
     (Answer(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + f"{len(IMAGE):x}\r\n".encode() + IMAGE
             + b"\r\nzz\r\n"), "body cut short"),
     (Answer(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + f"{len(IMAGE):x}\r\n".encode() + IMAGE
             + b"\r\n", close=True), "body cut short")],
    ids=["shorter-than-its-length", "chunk-size-unreadable", "no-last-chunk"],
)  # fmt: skip
def test_a_body_short_of_its_length_or_last_chunk_is_cut_and_its_connection_dropped(
    answer: Answer, reason: str
) -> None:
    with RawServer({"/short": answer, "/next": ok(IMAGE)}) as server:
        error = failure(server.url("/short"), replace(WEB, retries=0))
        assert error.reason.startswith(reason)
        assert (error.cause, error.transient, error.unreachable) == ("cut", True, False)
        assert download(server.url("/next"), WEB) == IMAGE
    assert server.requests == [(1, "/short"), (2, "/next")]


# --- a head too big to read --------------------------------------------------------------------

TOO_MANY = ok(IMAGE, extra="".join(f"X-Filler-{i}: {i}\r\n" for i in range(101)))
TOO_LONG = ok(IMAGE, extra=f"X-Filler: {'a' * 70_000}\r\n")
LONG_STATUS = Answer(b"HTTP/1.1 200 " + b"O" * 70_000 + b"\r\nContent-Length: 0\r\n\r\n")


@pytest.mark.parametrize(
    ("answer", "reason"),
    [(TOO_MANY, "too many headers"), (TOO_LONG, "headers too long"), (LONG_STATUS, "status line too long")],
)
def test_a_head_too_big_to_read_is_final_and_no_outage(answer: Answer, reason: str) -> None:
    with RawServer({"/bad": answer}) as server:
        error = failure(server.url("/bad"))
    said = (error.reason, error.cause, error.transient, error.unreachable)
    assert said == (reason, "headers", False, False)
    assert server.requests == [(1, "/bad")]  # asked once


def test_bad_heads_never_open_the_breaker_on_their_hosts_good_rows() -> None:
    # a breaker once open would fail the good rows for 20 s (the probe's wait): the test's whole run
    web = replace(WEB, retries=2, backoff=5.0, threads=2, per_host=2)
    bad = {f"/bad/{i}": (TOO_MANY, TOO_LONG)[i % 2] for i in range(6)}
    with RawServer({**bad, **{f"/good/{i}": ok(IMAGE) for i in range(4)}}) as server, Downloader(web) as downloader:
        results = list(downloader.fetch((server.url(path), None) for path in [*bad, *(f"/good/{i}" for i in range(4))]))
    assert [result.reason for result in results[:6] if isinstance(result, DownloadError)] == [
        "too many headers",
        "headers too long",
    ] * 3
    assert results[6:] == [IMAGE] * 4
    assert sorted(path for _, path in server.requests) == sorted([*bad, *(f"/good/{i}" for i in range(4))])


# --- a compressed body ---------------------------------------------------------------------------

COMPRESSED = {"gzip": gzip.compress(IMAGE), "deflate": zlib.compress(IMAGE)}


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_a_compressed_stream_that_stops_short_is_cut_and_tried_again(encoding: str) -> None:
    stream = COMPRESSED[encoding][: len(COMPRESSED[encoding]) // 2]
    with RawServer({"/cut": ok(stream, extra=f"Content-Encoding: {encoding}\r\n")}) as server:
        error = failure(server.url("/cut"))
    assert error.reason == f"body cut short ({len(stream):,} bytes, its {encoding} stream unfinished) (tried 3 times)"
    assert (error.cause, error.transient) == ("cut", True)
    assert len(server.requests) == 1 + WEB.retries


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_a_damaged_compressed_stream_is_final(encoding: str) -> None:
    # the check at its end (gzip's CRC-32, zlib's Adler-32) no longer matches: the head still reads as an image
    stream = bytearray(COMPRESSED[encoding])
    stream[-8 if encoding == "gzip" else -1] ^= 0xFF
    with RawServer({"/damaged": ok(bytes(stream), extra=f"Content-Encoding: {encoding}\r\n")}) as server:
        error = failure(server.url("/damaged"))
    assert (error.reason, error.cause, error.transient) == (f"a damaged {encoding} body", "encoding", False)
    assert len(server.requests) == 1


def test_a_whole_compressed_body_is_inflated_on_a_connection_kept() -> None:
    with RawServer(
        {"/whole": ok(COMPRESSED["gzip"], extra="Content-Encoding: gzip\r\n"), "/next": ok(IMAGE)}
    ) as server:
        assert download(server.url("/whole"), WEB) == IMAGE
        assert download(server.url("/next"), WEB) == IMAGE
    assert server.requests == [(1, "/whole"), (1, "/next")]
