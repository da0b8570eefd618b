"""The faulty loopback image server of scripts/bench_web.py, the fault plan both agree on, and
`Serving`, which starts it and asks it what it counted.

usage (bench_web.py starts it): python scripts/web_fault_server.py --photos DIR --rows N
           [--latency 0.03] [--shares JSON] [--seed 0]

It runs in a process of its own (its CPU is the machine's, not a tool's), prints its port, holds the
JPEGs of --photos in memory and serves --rows distinct URLs, /img/<i>.jpg being photo i % photos,
each answer after --latency seconds, HTTP/1.1 (keep-alive, as any CDN), a thread per connection. A
fixed subset of rows, drawn with --seed, fails the way the open web does, each kind a share of the
rows (--shares, a JSON object of kind to share; SHARES the defaults):

  503     503 on the first two tries, then 200
  429     429 with Retry-After: 1 for one second after the row's first request, then 200
  cut     the first try's body stops half way (full Content-Length, connection closed), then 200
  404     always 404
  html    always a web page at 200 (text/html): a URL that leads to a page, not an image

It counts the requests for each path (GET /_counts), cleared by GET /_reset, so a run can say how
many tries each tool made.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from benchkit import REPO, SAMPLE, jpeg_files

TRANSIENT = ("503", "429", "cut")  # rows a tool that retries well packs
FINAL = ("404", "html")  # rows no tool can pack
KINDS = (*TRANSIENT, *FINAL)
SHARES = {"503": 0.05, "429": 0.03, "cut": 0.02, "404": 0.02, "html": 0.01}
CONNECTIONS, RESETS = "(connections)", "(resets)"  # the server's counts that are not paths
ROW_IN_URL = re.compile(r"/img/(\d+)\.jpg")
PHOTOS = 300  # generated where the sample is missing
HTML_PAGE = b"<!doctype html><html><head><title>A photo</title></head><body><img src='x.jpg'></body></html>"


def fault_plan(rows: int, shares: dict[str, float], seed: int) -> dict[int, str]:
    """Row -> fault kind, `round(rows * share)` rows of each kind: a pure function of its arguments,
    so the server and the report agree."""
    counts = {kind: round(rows * shares.get(kind, 0.0)) for kind in KINDS}
    chosen = random.Random(seed).sample(range(rows), min(rows, sum(counts.values())))
    kinds = [kind for kind in KINDS for _ in range(counts[kind])]
    return dict(zip(chosen, kinds, strict=False))


class Server(ThreadingHTTPServer):
    """The photos, the faults, and what was asked: the state every handler thread shares."""

    daemon_threads = True
    request_queue_size = 1024  # no SYN dropped (a 1 s retransmit) when 64 clients connect at once

    def __init__(self, photos: list[bytes], faults: dict[int, str], latency: float) -> None:
        super().__init__(("127.0.0.1", 0), FaultyHandler)
        self.photos, self.faults, self.latency = photos, faults, latency
        self.lock = threading.Lock()
        self.counts: Counter[str] = Counter()  # per path, and CONNECTIONS and RESETS
        self.first_seen: dict[str, float] = {}

    def finish_request(self, request: Any, client_address: Any) -> None:
        with self.lock:
            self.counts[CONNECTIONS] += 1
        super().finish_request(request, client_address)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that resets a kept-alive connection is counted, not printed (a traceback each)."""
        if isinstance(sys.exc_info()[1], ConnectionError):
            with self.lock:
                self.counts[RESETS] += 1
        else:
            super().handle_error(request, client_address)


class FaultyHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive where the client wants it
    server: Server

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        state = self.server
        if self.path in ("/_counts", "/_reset"):
            with state.lock:
                body = json.dumps(state.counts).encode()
                if self.path == "/_reset":
                    state.counts.clear()
                    state.first_seen.clear()
            self.reply(200, body, "application/json")
            return
        arrived = time.monotonic()
        match = ROW_IN_URL.fullmatch(self.path)
        with state.lock:
            state.counts[self.path] += 1
            tries = state.counts[self.path]
            first = state.first_seen.setdefault(self.path, arrived)
        time.sleep(state.latency)
        if match is None:
            self.reply(404, b"not found", "text/plain")
            return
        self.serve_row(int(match.group(1)), tries, arrived - first)

    def serve_row(self, row: int, tries: int, since_first: float) -> None:
        kind = self.server.faults.get(row)
        body = self.server.photos[row % len(self.server.photos)]
        if kind == "404":
            self.reply(404, b"not found", "text/plain")
        elif kind == "html":
            self.reply(200, HTML_PAGE, "text/html; charset=utf-8")
        elif kind == "503" and tries <= 2:
            self.reply(503, b"busy", "text/plain")
        elif kind == "429" and since_first < 1.0:
            self.reply(429, b"slow down", "text/plain", {"Retry-After": "1"})
        elif kind == "cut" and tries == 1:
            self.send_response(200)
            self.send_header("Content-Type", "image/jpeg")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body[: len(body) // 2])
            self.wfile.flush()
            self.close_connection = True  # the rest never comes
        else:
            self.reply(200, body, "image/jpeg")

    def reply(self, status: int, body: bytes, kind: str, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)


# ---------------------------------------------------------------------------------------------------
# The side that starts it (bench_web.py's).


class Serving:
    """The server for `rows` rows in a process of its own; `url`, `counts()`, `reset()`, `close()`."""

    def __init__(self, photos: Path, rows: int, latency: float, shares: dict[str, float], seed: int) -> None:
        command = [sys.executable, __file__, "--photos", str(photos), "--rows", str(rows), "--latency", str(latency),
                   "--shares", json.dumps(shares), "--seed", str(seed)]  # fmt: skip
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, start_new_session=True)
        assert self.process.stdout is not None
        port = self.process.stdout.readline().strip()
        if not port.isdigit():
            self.close()
            raise SystemExit(f"the server did not start (exit {self.process.returncode})")
        self.url = f"http://127.0.0.1:{port}"

    def get(self, path: str) -> dict[str, int]:
        with urllib.request.urlopen(self.url + path, timeout=30) as answer:
            counts: dict[str, int] = json.loads(answer.read())
        return counts

    def counts(self) -> dict[str, int]:
        return self.get("/_counts")

    def reset(self) -> None:
        self.get("/_reset")

    def close(self) -> None:
        self.process.kill()
        self.process.wait(10)


def photo_folder(work: Path) -> tuple[Path, str]:
    """The folder the server reads its photos from, and what they are."""
    photos = jpeg_files(SAMPLE)
    if photos:
        return SAMPLE, f"{len(photos)} ImageNet sample JPEGs"
    sys.path.insert(0, str(REPO))
    from shardkit.synthetic import write_image

    folder = work / "photos"
    folder.mkdir()
    for i in range(PHOTOS):
        write_image(folder / f"{i:03d}.jpg", 400 + 7 * (i % 40), 300 + 5 * (i % 30), seed=i)
    return folder, f"{PHOTOS} generated photos (no {SAMPLE})"


# ---------------------------------------------------------------------------------------------------
# The server's process.


def shares_of(text: str) -> dict[str, float]:
    """--shares: a JSON object of fault kind to share of the rows."""
    shares = json.loads(text)
    unknown = set(shares) - set(KINDS)
    if unknown:
        raise SystemExit(f"--shares: unknown fault kinds {sorted(unknown)} (known: {', '.join(KINDS)})")
    return {kind: float(share) for kind, share in shares.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--photos", type=Path, required=True)
    parser.add_argument("--rows", type=int, required=True)
    parser.add_argument("--latency", type=float, default=0.03)
    parser.add_argument("--shares", default=json.dumps(SHARES))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    photos = [path.read_bytes() for path in jpeg_files(args.photos)]
    if not photos:
        raise SystemExit(f"{args.photos}: no JPEGs to serve")
    server = Server(photos, fault_plan(args.rows, shares_of(args.shares), args.seed), args.latency)
    print(server.server_address[1], flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
