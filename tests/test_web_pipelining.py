"""A table of URLs at its users' scale, on a real loopback server of the test's own: a row waiting
out a server's Retry-After holds back no other shard, failed rows are told apart by row (two rows
naming one image with other credentials), and the failed rows go to errors.jsonl in order through
parts of their own, whatever the workers."""

from __future__ import annotations

import base64
import csv
import io
import json
import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest
from PIL import Image

from shardkit.readers import open_shards
from tests.helpers import read_errors
from tests.servers import serving


def _jpeg(index: int) -> bytes:
    rng = random.Random(index)
    image = Image.new("RGB", (40 + index % 9, 32 + index % 5), tuple(rng.randrange(256) for _ in range(3)))
    out = io.BytesIO()
    image.save(out, "JPEG", quality=90)
    return out.getvalue()


@dataclass
class Web:
    """What the server does and saw: rows that answer 429 with a Retry-After on their first try,
    a user whose requests fail with 503 (while `refusing`), and when each path was first asked."""

    retry_after: dict[int, int] = field(default_factory=dict)  # row -> seconds, its first try
    refusing: set[str] = field(default_factory=set)  # users answered 503
    missing: set[str] = field(default_factory=set)  # users answered 404
    first: dict[str, float] = field(default_factory=dict)
    tries: dict[str, list[float]] = field(default_factory=dict)
    shards_at_retry: list[str] = field(default_factory=list)  # the shard files there when a 429's row came back
    output: Path | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)


@pytest.fixture
def web() -> Iterator[tuple[Web, str]]:
    state = Web()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            row = int(self.path.rsplit("/", 1)[1].split(".")[0])
            user = base64.b64decode(self.headers.get("Authorization", "Basic ")[6:]).decode().partition(":")[0]
            with state.lock:
                tries = state.tries.setdefault(self.path, [])
                tries.append(time.monotonic())
                state.first.setdefault(self.path, tries[0])
                if len(tries) == 2 and row in state.retry_after and state.output is not None:
                    state.shards_at_retry = sorted(p.name for p in state.output.glob("*.tar"))
            if len(tries) == 1 and row in state.retry_after:
                self._answer(429, b"slow down", "text/plain", {"Retry-After": str(state.retry_after[row])})
            elif user in state.refusing:
                self._answer(503, b"busy", "text/plain")
            elif user in state.missing:
                self._answer(404, b"no", "text/plain")
            else:
                self._answer(200, _jpeg(row), "image/jpeg")

        def _answer(self, status: int, body: bytes, kind: str, headers: dict[str, str] | None = None) -> None:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(body)

    with serving(Handler) as base:
        yield state, base


def _table(path: Path, urls: list[str]) -> Path:
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=["url", "caption"])
    writer.writeheader()
    writer.writerows({"url": url, "caption": f"row {i}"} for i, url in enumerate(urls))
    path.write_text(text.getvalue())
    return path


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_row_waiting_on_retry_after_holds_back_no_other_shard(
    web: tuple[Web, str], tmp_path: Path, shardkit, workers: str
) -> None:
    """The first row of each of the first shards (one a worker) answers 429 with Retry-After: 2;
    the rows of the shards after them are all asked for, and those shards written, while they
    wait (one shard a worker at a time would ask for them only once those shards are done)."""
    state, base = web
    stuck = int(workers)
    state.retry_after = {5 * shard: 2 for shard in range(stuck)}
    rows = 40
    table = _table(tmp_path / "urls.csv", [f"{base}/img/{i}.jpg" for i in range(rows)])
    out = tmp_path / "out"
    state.output = out
    args = ["--shard-size", "5", "--workers", workers, "--download-threads", "4", "--timeout", "10"]
    assert shardkit("pack", table, out, *args).returncode == 0
    retried = min(state.tries[f"/img/{row}.jpg"][1] for row in state.retry_after)
    later = [state.first[f"/img/{i}.jpg"] for i in range(5 * stuck, rows)]
    assert max(later) < retried  # every other shard's rows, asked for within the wait
    assert len(state.shards_at_retry) >= 6  # and most of the shards after them written by then
    assert all(name.endswith(".tar") for name in state.shards_at_retry)
    dataset = open_shards(out)
    assert [dataset[i].key for i in range(len(dataset))] == [f"{i:09d}" for i in range(rows)]
    assert [dataset[i].text for i in range(len(dataset))] == [f"row {i}" for i in range(rows)]


def test_two_rows_of_one_image_with_other_credentials_are_told_apart(
    web: tuple[Web, str], tmp_path: Path, shardkit
) -> None:
    """One image named by two rows with other credentials: the one whose user is refused (503)
    fails transiently, the other packs; errors.jsonl names the failed row by its key, and a
    --resume downloads that row alone and finishes whole."""
    state, base = web
    host = base.removeprefix("http://")
    urls = [f"{base}/img/1.jpg", f"http://good:pw@{host}/img/7.jpg", f"http://bad:pw@{host}/img/7.jpg"]
    table = _table(tmp_path / "urls.csv", urls)
    out = tmp_path / "out"
    args = ["--shard-size", "10", "--workers", "1", "--retries", "0", "--timeout", "5"]
    state.refusing = {"bad"}
    assert shardkit("pack", table, out, *args).returncode == 0
    checked = shardkit("verify", out, "--source", table)
    assert checked.returncode == 0, checked.stdout + checked.stderr  # one URL shown twice: packed once, listed once
    (failed,) = read_errors(out)
    assert failed["key"] == "000000002" and failed["transient"] and failed["path"] == f"http://***@{host}/img/7.jpg"
    assert "bad" not in json.dumps(failed) and "pw" not in json.dumps(failed)
    state.refusing = set()
    state.tries.clear()
    again = shardkit("pack", table, out, *args, "--resume")
    assert again.returncode == 0, again.stderr
    assert list(state.tries) == ["/img/7.jpg"] and len(state.tries["/img/7.jpg"]) == 1  # that row alone
    dataset = open_shards(out)
    assert [dataset[i].key for i in range(len(dataset))] == ["000000000", "000000001", "000000002"]
    assert read_errors(out) == []
    assert shardkit("verify", out, "--source", table).returncode == 0


@pytest.mark.parametrize("workers", ["1", "2"])
def test_failed_rows_reach_errors_jsonl_in_row_order_through_their_parts(
    web: tuple[Web, str], tmp_path: Path, shardkit, workers: str
) -> None:
    """Rows failing for good in every shard (404s):
    errors.jsonl lists them in the table's order whatever order the shards end in, the manifest
    counts them per cause, and the working folder keeps no part once the pack is done."""
    state, base = web
    host = base.removeprefix("http://")
    state.missing = {"nobody"}
    state.retry_after = {3: 1}  # (shard 0 ends last)
    urls = [f"http://nobody:x@{host}/img/{i}.jpg" if i % 4 == 1 else f"{base}/img/{i}.jpg" for i in range(30)]
    table = _table(tmp_path / "urls.csv", urls)
    out = tmp_path / "out"
    args = ["--shard-size", "4", "--workers", workers, "--retries", "1", "--backoff", "0.05", "--timeout", "5"]
    assert shardkit("pack", table, out, *args).returncode == 0
    rows = read_errors(out)
    assert [row["key"] for row in rows] == [f"{i:09d}" for i in range(30) if i % 4 == 1]
    assert all(row["cause"] == "404" and not row.get("transient") for row in rows)
    totals = json.loads((out / "manifest.json").read_text())["totals"]
    assert totals["errors"] == totals["download:404"] == len(rows) and totals["transient"] == 0
    assert not (out / ".shardkit").exists()


@pytest.mark.parametrize("workers", [1, 2])
def test_the_live_tally_says_how_many_rows_wait_to_retry(web: tuple[Web, str], tmp_path: Path, workers: int) -> None:
    """While four rows of the first two shards wait out a Retry-After together, the progress
    line's tally counts them (across the workers); at the end none wait."""
    from shardkit.core.pack_options import pack_config
    from shardkit.packing.pack import Tally, pack

    state, base = web
    state.retry_after = {0: 2, 1: 2, 5: 2, 6: 2}  # (asked for at once: shards are taken as the pack starts)
    table = _table(tmp_path / "urls.csv", [f"{base}/img/{i}.jpg" for i in range(20)])
    tally = Tally()
    seen: list[int] = []
    config = pack_config(table, tmp_path / "out", workers=workers, shard_size=5, timeout=10)
    result = pack(config, progress=lambda done, total, errors: seen.append(tally.waiting), tally=tally)
    assert result.records == 20
    assert max(seen) == 4 and seen[-1] == 0 and tally.waiting == 0


@pytest.mark.slow  # (a signal, timed)
def test_a_stop_ends_a_one_worker_pack_whose_rows_wait_a_minute(
    web: tuple[Web, str], tmp_path: Path, python_command
) -> None:
    """With one worker the shards run on threads of the driver: a Ctrl-C while rows wait out a
    Retry-After of a minute ends the pack at once (its shards abandoned, not waited for), with the
    stop's exit code, and a --resume finishes it."""
    import signal
    import subprocess

    state, base = web
    state.retry_after = {0: 60, 6: 60}
    table = _table(tmp_path / "urls.csv", [f"{base}/img/{i}.jpg" for i in range(12)])
    out = tmp_path / "out"
    command = [*python_command, "pack", str(table), str(out), "--workers", "1", "--shard-size", "5"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while not all(f"/img/{row}.jpg" in state.tries for row in (0, 6)) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)  # (both rows now wait out their minute)
    stopped = time.monotonic()
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=30)
    assert process.returncode == 130, stderr
    assert time.monotonic() - stopped < 5
    state.retry_after = {}
    again = subprocess.run([*command, "--resume"], capture_output=True, text=True, timeout=60)
    assert again.returncode == 0, again.stderr
    assert len(open_shards(out)) == 12
