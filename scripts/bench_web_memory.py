"""The pack driver's peak memory on huge URL tables (issue #46): a whole pack, every row asked for.

usage: python scripts/bench_web_memory.py [--rows 1000000] [--failing-rows N] [--cases ok failing]
           [--base-rows 1000] [--workers 2] [--shard-size 1000] [--pack-args "--encode original"]
           [--row-group 100000] [--keep DIR]

Two cases, each a parquet table of URLs (url, a caption of ~100 characters, an int column) written
streamed by a process of its own, a row group at a time, and packed from a loopback server:

  ok       --rows rows (1 M by default; 10 M when asked), each an 8x8 JPEG at 200: every row packed
  failing  --failing-rows rows (default: --rows), each a 404 (final, never tried again): every row
           a failure in errors.jsonl

The server is this script again (`--serve`), a process of its own: asyncio on one thread, HTTP/1.1
keep-alive, no latency, one prepared answer a request, so that on 2 cores the pack and not the
server sets the pace. The pack is `shardkit pack TABLE OUT --workers P --shard-size S PACK_ARGS`;
--encode original by default (the 8x8 bytes stored as they come, no resize): the driver does the
same work a row as with any encoding, and the workers spend their CPU on the downloads. It runs in
a small wrapper: a process that calls shardkit's entry point (shardkit.__main__.main) in itself, so
the workers are processes of their own as in any pack, and the wrapper's memory is the driver's.
A thread of the wrapper reads the process's VmHWM (its RSS high-water mark) every quarter second,
to tell when the peak was reached; at exit, after every other exit handler, the wrapper writes the
final VmHWM. VmHWM starts again at exec, unlike getrusage's ru_maxrss, which Linux keeps across it.
Each case runs first on --base-rows rows, so that the bytes a row costs the driver are the slope
between the two runs, free of the imports and the pools. Printed for each run: rows, packed, in
errors.jsonl, requests answered, seconds, the driver's peak MB, when it was reached, and the MB
before the CLI's imports.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchkit import REPO, WARM_CHUNK, compiled, environment, pythonpath_env

CASES = {"ok": "/ok/", "failing": "/missing/"}  # each case's URL path: what the server answers
COUNT_PATH = b"GET /_count "

WRAPPER = """
import atexit, json, sys, threading, time

def hwm():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")) / 1024

started = time.perf_counter()
seen = {"imported_mb": hwm(), "peak_at": 0.0}
found = sys.argv[1]

def watch():
    while True:
        time.sleep(0.25)
        peak = hwm()
        if peak > seen.get("watched_mb", 0.0):
            seen["watched_mb"], seen["peak_at"] = peak, time.perf_counter() - started

def report():
    seen.update(peak_mb=hwm(), seconds=time.perf_counter() - started)
    if seen["peak_mb"] > seen.get("watched_mb", 0.0):  # reached after the watcher's last look: at the end
        seen["peak_at"] = seen["seconds"]
    with open(found, "w") as out:
        json.dump(seen, out)

atexit.register(report)  # the first registered runs last: after the CLI's own exit handlers
threading.Thread(target=watch, daemon=True).start()
sys.argv = ["shardkit", *sys.argv[2:]]
from shardkit.__main__ import main
main()
"""


# ---------------------------------------------------------------------------------------------------
# The server (run as `bench_web_memory.py --serve`).


def tiny_jpeg() -> bytes:
    from PIL import Image

    out = io.BytesIO()
    image = Image.new("RGB", (8, 8))
    image.putdata([(32 * x, 32 * y, 128) for y in range(8) for x in range(8)])  # not one colour: no warning
    image.save(out, "JPEG", quality=90)
    return out.getvalue()


def answer(status: str, kind: str, body: bytes) -> bytes:
    head = f"HTTP/1.1 {status}\r\nContent-Type: {kind}\r\nContent-Length: {len(body)}\r\n\r\n"
    return head.encode() + body


class Answering(asyncio.Protocol):
    """One connection: each request (a GET, no body) answered in order with its prepared answer."""

    served = 0  # requests answered, all connections

    def __init__(self, image: bytes, missing: bytes) -> None:
        self.image, self.missing, self.pending = image, missing, b""

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.pending += data
        while (end := self.pending.find(b"\r\n\r\n")) >= 0:
            request, self.pending = self.pending[:end], self.pending[end + 4 :]
            if request.startswith(COUNT_PATH):
                self.transport.write(answer("200 OK", "application/json", str(Answering.served).encode()))
                continue
            Answering.served += 1
            self.transport.write(self.missing if b" /missing/" in request[:16] else self.image)


async def serve_forever() -> None:
    image = answer("200 OK", "image/jpeg", tiny_jpeg())
    missing = answer("404 Not Found", "text/plain", b"not found")
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: Answering(image, missing), "127.0.0.1", 0, backlog=1024)
    print(server.sockets[0].getsockname()[1], flush=True)
    await server.serve_forever()


class Serving:
    """The server in a process of its own; `url`, `served()`, `close()`."""

    def __init__(self) -> None:
        command = [sys.executable, __file__, "--serve"]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, start_new_session=True)
        assert self.process.stdout is not None
        port = self.process.stdout.readline().strip()
        if not port.isdigit():
            self.close()
            raise SystemExit(f"the server did not start (exit {self.process.returncode})")
        self.url = f"http://127.0.0.1:{port}"

    def served(self) -> int:
        with urllib.request.urlopen(self.url + "/_count", timeout=30) as reply:
            return int(reply.read())

    def close(self) -> None:
        self.process.kill()
        self.process.wait(10)


# ---------------------------------------------------------------------------------------------------
# The table (run as `bench_web_memory.py --write TABLE --base URL --rows N`).


def caption(n: int) -> str:
    return f"photo {n}: a tabby cat sitting on a sunny windowsill, looking at the birds outside, #{n % 997}"


def batches(base: str, rows: int, size: int) -> Iterator[dict[str, list[Any]]]:
    for start in range(0, rows, size):
        numbers = range(start, min(rows, start + size))
        yield {
            "url": [f"{base}{n}.jpg" for n in numbers],
            "caption": [caption(n) for n in numbers],
            "aesthetic": [n % 10 for n in numbers],
        }


def write_table(path: Path, base: str, rows: int, size: int) -> None:
    """The table, a row group at a time: the writer never holds more than one batch."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema([("url", pa.string()), ("caption", pa.string()), ("aesthetic", pa.int64())])
    with pq.ParquetWriter(path, schema) as writer:
        for batch in batches(base, rows, size):
            writer.write_table(pa.table(batch, schema=schema), row_group_size=size)


def written_table(work: Path, base: str, rows: int, size: int) -> Path:
    """A table of `rows` URLs under `base`, written by a child process (this one stays small) and
    read once more right before the pack (this machine evicts file pages untouched for ~30 s)."""
    path = work / f"urls-{rows}-{base.rstrip('/').rsplit('/', 1)[-1]}.parquet"
    started = time.perf_counter()
    command = [sys.executable, __file__, "--write", str(path), "--base", base, "--rows", str(rows),
               "--row-group", str(size)]  # fmt: skip
    subprocess.run(command, check=True)
    print(f"wrote {path.name} ({rows:,} rows, {path.stat().st_size / 1e6:,.0f} MB) in "
          f"{time.perf_counter() - started:.0f}s", file=sys.stderr)  # fmt: skip
    return path


def warm(path: Path) -> None:
    with open(path, "rb", buffering=0) as handle:
        while handle.read(WARM_CHUNK):
            pass


# ---------------------------------------------------------------------------------------------------
# A case: the pack, and what its driver held.


def count_output(out: Path) -> tuple[int | None, int]:
    """Records the manifest names (None without one) and the lines of errors.jsonl."""
    manifest = out / "manifest.json"
    records = json.loads(manifest.read_text()).get("totals", {}).get("records") if manifest.exists() else None
    errors = out / "errors.jsonl"
    lines = 0
    if errors.exists():
        with open(errors, "rb") as handle:
            lines = sum(1 for line in handle if line.strip())
    return records, lines


def pack_once(args: argparse.Namespace, server: Serving, case: str, rows: int, work: Path) -> dict[str, Any]:
    """One pack of a new table of `rows` rows of `case`: its counts, its time and its driver's peaks."""
    table = written_table(work, server.url + CASES[case], rows, args.row_group)
    out, found = work / f"out-{case}-{rows}", work / f"driver-{case}-{rows}.json"
    command = [sys.executable, "-c", WRAPPER, str(found), "pack", str(table), str(out), "--workers",
               str(args.workers), "--shard-size", str(args.shard_size), *shlex.split(args.pack_args)]  # fmt: skip
    warm(table)
    served = server.served()
    log = work / f"pack-{case}-{rows}.log"
    with open(log, "wb") as sink:
        started = time.perf_counter()
        done = subprocess.run(command, stdout=sink, stderr=subprocess.STDOUT, env=pythonpath_env())
        wall = time.perf_counter() - started
    if not found.exists():
        raise SystemExit(f"{case}: the wrapper wrote no peak (exit {done.returncode}):\n{log.read_text()[-3000:]}")
    driver = json.loads(found.read_text())
    records, errors = count_output(out)
    tail = log.read_text(errors="replace").strip().splitlines()[-1:] if done.returncode else []
    return {"case": case, "rows": rows, "exit": done.returncode, "wall": wall, "records": records,
            "errors": errors, "requests": server.served() - served, "tail": tail, **driver}  # fmt: skip


def report(found: dict[str, Any], base: dict[str, Any] | None) -> None:
    """One line of the table; with `base` (the same case on fewer rows), the bytes each more row costs."""
    per_row = "-"
    if base is not None and found["rows"] > base["rows"]:
        per_row = f"{(found['peak_mb'] - base['peak_mb']) * 2**20 / (found['rows'] - base['rows']):.0f}"
    print(f"{found['case']:<8} {found['rows']:>11,} {found['records'] or 0:>11,} {found['errors']:>11,} "
          f"{found['requests']:>11,} {found['wall']:>8.1f} {found['peak_mb']:>9.1f} {found['peak_at']:>8.1f} "
          f"{found['imported_mb']:>9.0f} {per_row:>8}", flush=True)  # fmt: skip
    if found["exit"]:
        print(f"  exit {found['exit']}: {' '.join(found['tail'])}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows of the ok case (every row packed)")
    parser.add_argument("--failing-rows", type=int, help="rows of the failing case (default: as --rows)")
    parser.add_argument("--cases", nargs="+", choices=tuple(CASES), default=list(CASES))
    parser.add_argument("--base-rows", type=int, default=1000, help="each case on this many rows first: the base")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--shard-size", type=int, default=1000)
    parser.add_argument("--pack-args", default="--encode original", help="more flags for shardkit pack (one string)")
    parser.add_argument("--row-group", type=int, default=100_000, help="rows per written batch (parquet row group)")
    parser.add_argument("--keep", type=Path, help="leave the tables, outputs and logs here")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--write", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--base", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        asyncio.run(serve_forever())
        return
    if args.write:
        write_table(args.write, args.base, args.rows, args.row_group)
        return
    compiled()
    sys.path.insert(0, str(REPO))
    from shardkit.core.version import __version__

    print(environment(__version__))
    print(f"pack: shardkit pack TABLE OUT --workers {args.workers} --shard-size {args.shard_size} {args.pack_args}")
    print(f"{'case':<8} {'rows':>11} {'packed':>11} {'errors':>11} {'requests':>11} {'seconds':>8} "
          f"{'peak MB':>9} {'peak at':>8} {'import MB':>9} {'B/row':>8}", flush=True)  # fmt: skip
    work = Path(tempfile.mkdtemp(prefix="bench-web-memory-", dir=args.keep))
    server = Serving()
    try:
        for case in args.cases:
            rows = (args.failing_rows or args.rows) if case == "failing" else args.rows
            base = pack_once(args, server, case, args.base_rows, work)
            report(base, None)
            report(pack_once(args, server, case, rows, work), base)
    finally:
        server.close()
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    print("peak MB: the driver's VmHWM; peak at: seconds into the run when it was reached (to a quarter second);\n"
          "import MB: VmHWM before the CLI ran; B/row: (peak - the base's peak) / (rows - the base's rows), what\n"
          "each row costs the driver; requests: what the server answered")  # fmt: skip


if __name__ == "__main__":
    main()
