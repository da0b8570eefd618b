"""The direct download path (storage/http: urllib3) against real sockets on loopback: what a
server says is mapped to absence, refusal or a transient failure, and a body cut short of its
Content-Length is never taken for a whole object."""

from __future__ import annotations

import hashlib
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from shardkit.storage.http import NotDirect, TooLong, get_direct


@contextmanager
def one_reply_server(replies: list[bytes]) -> Iterator[str]:
    """A server on loopback answering each connection's first request with the next raw reply,
    then closing the connection (its reply says `Connection: close`, or is cut on purpose)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    port = listener.getsockname()[1]

    def serve() -> None:
        for reply in replies:
            try:
                connection, _ = listener.accept()
            except OSError:
                return
            with connection:
                request = b""
                while b"\r\n\r\n" not in request:
                    chunk = connection.recv(4096)
                    if not chunk:
                        break
                    request += chunk
                connection.sendall(reply)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}/object"
    finally:
        listener.close()
        thread.join(5)


def reply(status: str, body: bytes, length: int | None = None, extra: str = "") -> bytes:
    size = len(body) if length is None else length
    head = f"HTTP/1.1 {status}\r\nContent-Length: {size}\r\nConnection: close\r\n{extra}\r\n"
    return head.encode() + body


def test_a_whole_body_is_written_and_hashed(tmp_path: Path) -> None:
    body = bytes(range(256)) * 5000
    with one_reply_server([reply("200 OK", body)]) as url:
        digest = get_direct(url, str(tmp_path / "out"), None)
    assert digest == hashlib.sha256(body).hexdigest() and (tmp_path / "out").read_bytes() == body


def test_a_body_cut_short_is_a_transient_failure_not_a_short_object(tmp_path: Path) -> None:
    with one_reply_server([reply("200 OK", b"x" * 1000, length=5000)]) as url, pytest.raises(OSError) as caught:
        get_direct(url, str(tmp_path / "out"), None)
    assert not isinstance(caught.value, FileNotFoundError | PermissionError)
    assert "IncompleteRead" in str(caught.value) or "ProtocolError" in str(caught.value)


@pytest.mark.parametrize(
    ("status", "raised"),
    [("404 Not Found", FileNotFoundError), ("403 Forbidden", PermissionError), ("503 Slow Down", OSError),
     ("429 Too Many Requests", OSError), ("302 Found", NotDirect)],
)  # fmt: skip
def test_statuses_say_absent_refused_transient_or_elsewhere(tmp_path: Path, status: str, raised: type) -> None:
    redirect = "Location: http://127.0.0.1:9/x\r\n"
    with one_reply_server([reply(status, b"no", extra=redirect)]) as url, pytest.raises(raised):
        get_direct(url, str(tmp_path / "out"), None)


def test_a_refused_connection_is_a_transient_failure(tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # nothing listens on it once this closes
    with pytest.raises(OSError) as caught:
        get_direct(f"http://127.0.0.1:{port}/x", str(tmp_path / "out"), None)
    assert not isinstance(caught.value, FileNotFoundError)


def test_a_body_past_the_limit_stops_at_the_limit(tmp_path: Path) -> None:
    with one_reply_server([reply("200 OK", b"y" * (3 << 20))]) as url, pytest.raises(TooLong):
        get_direct(url, str(tmp_path / "out"), 1 << 20)
    assert (tmp_path / "out").stat().st_size <= 1 << 20


# --- manifests and index pages over http(s): our own bounded GET (storage.http.fetch_bytes) -------


def gzipped(data: bytes) -> bytes:
    import gzip

    return gzip.compress(data, compresslevel=9)


def test_a_503_then_200_is_retried_a_404_is_absence(tmp_path: Path, monkeypatch) -> None:
    from shardkit.storage.store import Store

    monkeypatch.setenv("SHARDKIT_RETRY_SECONDS", "10")
    with one_reply_server([reply("503 Slow Down", b"busy"), reply("200 OK", b'{"x": 1}')]) as url:
        assert Store(url.rsplit("/", 1)[0]).read("object", 1 << 20) == b'{"x": 1}'
    with one_reply_server([reply("404 Not Found", b"no")]) as url, pytest.raises(FileNotFoundError):
        Store(url.rsplit("/", 1)[0]).read("object", 1 << 20)


def test_a_server_that_refuses_is_a_failure_not_a_missing_output(tmp_path: Path, monkeypatch) -> None:
    from shardkit.core.errors import StorageError
    from shardkit.readers import open_shards

    monkeypatch.setenv("SHARDKIT_RETRY_SECONDS", "1")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(StorageError) as caught:
        open_shards(f"http://127.0.0.1:{port}/out", cache_dir=tmp_path / "cache")
    assert "no manifest" not in str(caught.value) and "failed" in str(caught.value)


@pytest.fixture(scope="module")
def bomb() -> bytes:
    return gzipped(bytes(300 << 20))  # 300 MB of zeros in ~300 KB


def test_a_gzipped_manifest_is_read_and_a_gzip_bomb_stops_at_the_limit(bomb: bytes, tmp_path: Path) -> None:
    from shardkit.storage.store import Store

    data = b'{"a": "' + b"b" * 5000 + b'"}'
    encoded = "Content-Encoding: gzip\r\n"
    with one_reply_server([reply("200 OK", gzipped(data), extra=encoded)]) as url:
        assert Store(url.rsplit("/", 1)[0]).read("object", 1 << 20) == data
    script = (
        "import sys\nfrom shardkit.storage.store import Store\n"
        "try:\n    Store(sys.argv[1]).read('object', 16 << 20)\nexcept Exception as error:\n    print(error)\n"
        # VmHWM, this program's peak: ru_maxrss would count the forked copy of the caller before exec
        "print(next(int(line.split()[1]) // 1024 for line in open('/proc/self/status') if line.startswith('VmHWM')))"
    )
    with one_reply_server([reply("200 OK", bomb, extra=encoded)]) as url:
        done = subprocess.run([sys.executable, "-c", script, url.rsplit("/", 1)[0]], capture_output=True, text=True)
    message, peak_mb = done.stdout.strip().splitlines()
    assert "over the limit of 16,777,216 bytes" in message, done.stderr
    assert int(peak_mb) < 250  # inflated a bounded piece at a time, never the 300 MB


def test_a_gzip_bomb_on_the_direct_path_stops_at_the_shard_size(bomb: bytes, tmp_path: Path) -> None:
    """A shard's GET inflates what the server gzip-encodes (urllib3, at most what each read asks
    for since 2.6.3, the version the dependency asks for): a bomb stops at the manifest's size."""
    script = (
        "import sys\nfrom shardkit.storage.http import get_direct\n"
        "try:\n    get_direct(sys.argv[1], sys.argv[2], 16 << 20)\nexcept Exception as error:\n"
        "    print(type(error).__name__)\n"
        "print(next(int(line.split()[1]) // 1024 for line in open('/proc/self/status') if line.startswith('VmHWM')))"
    )
    with one_reply_server([reply("200 OK", bomb, extra="Content-Encoding: gzip\r\n")]) as url:
        command = [sys.executable, "-c", script, url, str(tmp_path / "out")]
        done = subprocess.run(command, capture_output=True, text=True)
    raised, peak_mb = done.stdout.strip().splitlines()
    assert raised == "TooLong", done.stderr
    assert int(peak_mb) < 250 and (tmp_path / "out").stat().st_size <= 16 << 20


def test_an_index_page_lists_the_names_under_its_folder(tmp_path: Path) -> None:
    from shardkit.storage.store import Store

    page = (
        b'<html><a href="shard-000000.tar">a</a> <A HREF="a%20b.tar">b</A> <a href="../up.tar">x</a>'
        b'<a href="sub/">d</a><a href="http://elsewhere/x.tar">e</a><a href="manifest.json?v=1">m</a></html>'
    )
    with one_reply_server([reply("200 OK", page)]) as url:
        held = Store(url.rsplit("/", 1)[0] + "/out").listing()  # (the page of .../out/)
    assert held == {"shard-000000.tar": None, "a b.tar": None, "manifest.json": None}


@contextmanager
def slow_server(mode: str) -> Iterator[str]:
    """A server on loopback that takes each request and then never answers ("silent"), or sends
    headers promising 100 kB and then one byte every 20 ms ("trickle"), until the client leaves."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    stop = threading.Event()

    def serve(connection: socket.socket) -> None:
        with connection:
            connection.recv(65536)
            if mode == "trickle":
                connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n")
            while not stop.wait(0.02):
                if mode == "trickle":
                    try:
                        connection.sendall(b"x")
                    except OSError:
                        return

    def accept() -> None:
        while not stop.is_set():
            try:
                connection, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(connection,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        listener.close()


@pytest.mark.slow  # (2.8 s of waiting out deadlines: the fast suite stays near a minute)
@pytest.mark.parametrize("mode", ["silent", "trickle"])
def test_a_server_that_never_answers_or_trickles_ends_with_the_url(tmp_path: Path, monkeypatch, mode: str) -> None:
    """A socket timeout alone is reset by every byte: each request has a total deadline and, after
    a grace period, a minimum throughput; then the retry window, then one error naming the URL."""
    from shardkit.core.errors import StorageError
    from shardkit.storage.store import Store

    monkeypatch.setenv("SHARDKIT_REQUEST_SECONDS", "1.5")
    monkeypatch.setenv("SHARDKIT_RATE_GRACE_SECONDS", "0.5")
    monkeypatch.setenv("SHARDKIT_MIN_BYTES_PER_SECOND", "1000")
    monkeypatch.setenv("SHARDKIT_RETRY_SECONDS", "1")
    with slow_server(mode) as url:
        store = Store(url)
        started = time.monotonic()
        with pytest.raises(StorageError) as caught:
            store.get("shard.tar", str(tmp_path / "out"), limit=100000)
        assert time.monotonic() - started < 15
        assert f"{url}/shard.tar" in str(caught.value)
        reason = "under the minimum" if mode == "trickle" else "Timeout"
        assert reason in str(caught.value)
