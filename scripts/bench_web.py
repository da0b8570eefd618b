"""shardkit pack against img2dataset on a table of image URLs served by a faulty loopback server.

usage: python scripts/bench_web.py [--rows 700] [--latency 0.03] [--repeats 3] [--workers 2]
           [--threads 32] [--per-host N] [--shard-size N] [--table parquet|csv] [--seed 0]
           [--img2dataset PATH] [--only shardkit|img2dataset] [--keep DIR]

The server (this script again, `--serve`, in its own process: its CPU is the machine's, not a
tool's) holds the 300 ImageNet sample JPEGs beside the checkout (generated photos where they are
missing) in memory and serves --rows distinct URLs, /img/<i>.jpg being photo i % 300, each answer
after --latency seconds, HTTP/1.1 (keep-alive, as any CDN), a thread per connection. A fixed subset
of rows, drawn with --seed, fails (each share of --fault-share, "a few" 404s):

  503     503 on the first try, then 200
  cut     the first try's body stops half way (full Content-Length, connection closed), then 200
  429     429 with Retry-After: 1 for one second after the row's first request, then 200
  404     always 404 (the only rows that may be lost)

It counts the requests for each path, reset before every run, so the table says how many tries each
tool made. The table (url, caption, row, source) is written as parquet or CSV. Each tool is a whole
process, timed from spawn to exit, alternating which goes first, --repeats rounds; before each run
the table is read again and the tool's imports done once, untimed (this machine evicts file pages
left untouched for ~30 s). What each is asked to do (printed too):

  img2dataset --url_list TABLE --input_format parquet --url_col url --caption_col caption
      --output_format webdataset --resize_mode keep_ratio --image_size 256 --resize_only_if_bigger
      --encode_quality 90 --processes_count P --thread_count T --retries 2 --number_sample_per_shard S
  shardkit pack TABLE OUT --resize 256 --quality 90 --workers P --download-threads T --shard-size S

Both: short side to 256 when larger (shardkit never upscales; img2dataset is told not to), JPEG
quality 90, each tool's own filter, timeout and hashing defaults. --retries 2 is img2dataset's common
setting (three tries, back to back); shardkit keeps its defaults (5 retries, backoff 0.5 s doubled,
Retry-After obeyed). Counts come from each tool's output: img2dataset's *_stats.json and shard
parquet statuses; shardkit's manifest.json, index.parquet and errors.jsonl. A row "lost" is a row
whose faults were all transient (503, cut, 429) that the tool did not pack.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from benchkit import REPO, SAMPLE, compiled, environment, jpeg_files, pythonpath_env, ratios, span

TRANSIENT = ("503", "cut", "429")
KINDS = (*TRANSIENT, "404")
CONNECTIONS, RESETS = "(connections)", "(resets)"  # the server's counts that are not paths
ROW_IN_URL = re.compile(r"/img/(\d+)\.jpg")
PHOTOS = 300
I2D_DEFAULT = "/work/main/.venv-img2dataset/bin/img2dataset"
I2D_IMPORTS = "import img2dataset.main, img2dataset.downloader, img2dataset.resizer, img2dataset.writer"
SK_IMPORTS = "import shardkit.cli, shardkit.packing.pack, shardkit.packing.worker, shardkit.packing.sources"


# ---------------------------------------------------------------------------------------------------
# The faults: a pure function of rows, share and seed, so the server and the report agree.


def fault_plan(rows: int, share: float, seed: int) -> dict[int, str]:
    """Row -> fault kind: `share` of the rows for each transient kind, 1% (at least one) 404s."""
    each = round(rows * share)
    missing = max(1, rows // 100)
    chosen = random.Random(seed).sample(range(rows), min(rows, 3 * each + missing))
    kinds = [kind for kind in TRANSIENT for _ in range(each)] + ["404"] * missing
    return dict(zip(chosen, kinds, strict=False))


# ---------------------------------------------------------------------------------------------------
# The server (run as `bench_web.py --serve`).


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
        elif kind == "503" and tries == 1:
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


def serve(args: argparse.Namespace) -> None:
    photos = [path.read_bytes() for path in jpeg_files(args.photos)]
    server = Server(photos, fault_plan(args.rows, args.fault_share, args.seed), args.latency)
    print(server.server_address[1], flush=True)
    server.serve_forever()


class Serving:
    """The server in a process of its own; `url`, `counts()`, `reset()`, `close()`."""

    def __init__(self, args: argparse.Namespace, photos: Path) -> None:
        command = [sys.executable, __file__, "--serve", "--photos", str(photos), "--rows", str(args.rows),
                   "--latency", str(args.latency), "--fault-share", str(args.fault_share),
                   "--seed", str(args.seed)]  # fmt: skip
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, start_new_session=True)
        assert self.process.stdout is not None
        port = self.process.stdout.readline().strip()
        if not port.isdigit():
            self.close()
            raise SystemExit(f"the server did not start (exit {self.process.returncode})")
        self.url = f"http://127.0.0.1:{port}"

    def get(self, path: str) -> dict[str, int]:
        with urllib.request.urlopen(self.url + path, timeout=30) as answer:
            return json.loads(answer.read())

    def counts(self) -> dict[str, int]:
        return self.get("/_counts")

    def reset(self) -> None:
        self.get("/_reset")

    def close(self) -> None:
        self.process.kill()
        self.process.wait(10)


# ---------------------------------------------------------------------------------------------------
# The inputs.


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


def write_table(work: Path, base_url: str, rows: int, kind: str, photos: Path) -> Path:
    import pyarrow as pa
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    names = [path.stem.split("_", 1)[-1].replace("_", " ") for path in jpeg_files(photos)]
    table = pa.table({
        "url": [f"{base_url}/img/{i}.jpg" for i in range(rows)],
        "caption": [f"a photo of a {names[i % len(names)]}, number {i}" for i in range(rows)],
        "row": list(range(rows)),
        "source": ["bench_web"] * rows,
    })  # fmt: skip
    path = work / f"urls.{kind}"
    if kind == "parquet":
        pq.write_table(table, path)
    else:
        pacsv.write_csv(table, path)
    return path


# ---------------------------------------------------------------------------------------------------
# The tools: a command, and what a finished run's output says.


@dataclass
class Outcome:
    """What one run's own output says: the rows packed, and a note when its counts disagree."""

    packed: set[int]
    notes: list[str] = field(default_factory=list)


def img2dataset_command(args: argparse.Namespace, table: Path, out: Path) -> list[str]:
    return [args.img2dataset, "--url_list", str(table), "--input_format", args.table, "--url_col", "url",
            "--caption_col", "caption", "--output_format", "webdataset", "--output_folder", str(out),
            "--resize_mode", "keep_ratio", "--image_size", "256", "--resize_only_if_bigger", "True",
            "--encode_quality", "90", "--processes_count", str(args.workers), "--thread_count", str(args.threads),
            "--retries", "2", "--number_sample_per_shard", str(args.shard_size),
            *shlex.split(args.img2dataset_args)]  # fmt: skip


def shardkit_command(args: argparse.Namespace, table: Path, out: Path) -> list[str]:
    extra = ([] if args.per_host is None else ["--per-host", str(args.per_host)]) + shlex.split(args.shardkit_args)
    return [sys.executable, "-m", "shardkit", "pack", str(table), str(out), "--resize", "256", "--quality", "90",
            "--workers", str(args.workers), "--download-threads", str(args.threads),
            "--shard-size", str(args.shard_size), *extra]  # fmt: skip


def rows_in(texts: Iterable[object]) -> set[int]:
    """The rows named by the URLs in `texts` (any strings: paths, sources, reasons)."""
    found = set()
    for text in texts:
        match = ROW_IN_URL.search(str(text))
        if match:
            found.add(int(match.group(1)))
    return found


def img2dataset_outcome(out: Path, rows: int) -> Outcome:
    import pyarrow.parquet as pq

    successes = sum(json.loads(path.read_text())["successes"] for path in out.glob("*_stats.json"))
    packed: set[int] = set()
    for path in sorted(out.glob("*.parquet")):
        shard = pq.read_table(path, columns=["url", "status"]).to_pylist()
        packed |= rows_in(row["url"] for row in shard if row["status"] == "success")
    notes = [] if successes == len(packed) else [f"stats say {successes} successes, parquet {len(packed)}"]
    return Outcome(packed, notes)


def shardkit_outcome(out: Path, rows: int) -> Outcome:
    import pyarrow.parquet as pq

    manifest = json.loads((out / "manifest.json").read_text())
    records = manifest.get("totals", {}).get("records")
    errors = [json.loads(line) for line in (out / "errors.jsonl").read_text().splitlines() if line.strip()]
    failed = rows_in(row.get("path", "") for row in errors)
    packed = rows_in(pq.read_table(out / "index.parquet", columns=["source"]).column("source").to_pylist())
    notes = []
    if records != len(packed):
        notes.append(f"manifest says {records} records, index.parquet names {len(packed)} rows")
    if failed & packed:
        notes.append(f"{len(failed & packed)} rows both packed and in errors.jsonl")
    if len(packed) + len(failed) != rows:
        notes.append(f"{rows - len(packed) - len(failed)} rows neither packed nor in errors.jsonl")
    flagged = rows_in(row.get("path", "") for row in errors if row.get("transient"))
    if flagged:
        notes.append(f"{len(flagged)} rows in errors.jsonl marked transient")
    return Outcome(packed, notes)


@dataclass(frozen=True)
class Tool:
    name: str
    command: Callable[[argparse.Namespace, Path, Path], list[str]]  # (args, table, out) -> argv
    outcome: Callable[[Path, int], Outcome]  # (out, rows) -> what the output says
    python: str  # the interpreter whose imports are warmed before a run
    imports: str
    env: dict[str, str]


def tools(args: argparse.Namespace) -> list[Tool]:
    found = []
    if args.only in (None, "img2dataset"):
        python = str(Path(args.img2dataset).parent / "python")
        env = {**os.environ, "NO_ALBUMENTATIONS_UPDATE": "1"}
        found.append(Tool("img2dataset", img2dataset_command, img2dataset_outcome, python, I2D_IMPORTS, env))
    if args.only in (None, "shardkit"):
        found.append(Tool("shardkit", shardkit_command, shardkit_outcome, sys.executable, SK_IMPORTS, pythonpath_env()))
    return found


# ---------------------------------------------------------------------------------------------------
# Runs.


@dataclass
class Run:
    tool: str
    wall: float
    packed: int
    lost: int  # rows with only transient faults not packed
    requests: dict[str, int]  # per fault kind ("clean" too): requests made
    notes: list[str]

    def rate(self) -> float:
        return self.packed / self.wall


def warm_tool(tool: Tool, table: Path) -> None:
    table.read_bytes()
    subprocess.run([tool.python, "-c", tool.imports], check=False, capture_output=True, env=tool.env)


def run_once(args: argparse.Namespace, tool: Tool, server: Serving, table: Path, out: Path) -> Run:
    shutil.rmtree(out, ignore_errors=True)
    scratch = out.parent / f"tmp-{tool.name}"  # img2dataset's wandb leaves two folders in TMPDIR a run
    scratch.mkdir(exist_ok=True)
    env = {**tool.env, "TMPDIR": str(scratch)}
    warm_tool(tool, table)
    server.reset()
    log = out.parent / f"{tool.name}.log"
    with open(log, "wb") as sink:
        started = time.perf_counter()
        done = subprocess.run(tool.command(args, table, out), stdout=sink, stderr=subprocess.STDOUT, env=env)
        wall = time.perf_counter() - started
    if done.returncode != 0:
        raise ToolFailed(f"{tool.name} exited {done.returncode}:\n{log.read_text(errors='replace')[-3000:]}")
    outcome = tool.outcome(out, args.rows)
    plan = fault_plan(args.rows, args.fault_share, args.seed)
    transient = {row for row, kind in plan.items() if kind in TRANSIENT}
    requests: Counter[str] = Counter()
    for path, count in server.counts().items():
        match = ROW_IN_URL.fullmatch(path)
        requests[plan.get(int(match.group(1)), "clean") if match else path] += count
    return Run(tool.name, wall, len(outcome.packed), len(transient - outcome.packed), dict(requests), outcome.notes)


class ToolFailed(Exception):
    pass


def measure(args: argparse.Namespace, server: Serving, table: Path, work: Path) -> dict[str, list[Run]]:
    chosen = tools(args)
    runs: dict[str, list[Run]] = {tool.name: [] for tool in chosen}
    for tool in list(chosen):  # warm-up: untimed, and a tool that cannot run is left out with its reason
        try:
            run_once(args, tool, server, table, work / f"out-{tool.name}")
        except ToolFailed as failure:
            print(f"left out: {failure}\n", file=sys.stderr)
            chosen.remove(tool)
            del runs[tool.name]
    for round_number in range(args.repeats):
        for tool in chosen if round_number % 2 == 0 else list(reversed(chosen)):
            run = run_once(args, tool, server, table, work / f"out-{tool.name}")
            runs[tool.name].append(run)
            print(f"round {round_number + 1}/{args.repeats} {tool.name}: {run.wall:.2f}s, {run.packed} packed, "
                  f"{run.lost} lost, requests {run.requests}{'; ' + '; '.join(run.notes) if run.notes else ''}",
                  file=sys.stderr)  # fmt: skip
    return runs


# ---------------------------------------------------------------------------------------------------
# The report.


COLUMNS = ("wall s", "[min-max]", "images/s", "success", "lost", "tries/row: clean", *KINDS, "conns", "resets")
WIDTHS = (7, 13, 9, 8, 5, 16, 5, 5, 5, 5, 6, 6)


def tool_row(args: argparse.Namespace, rows: list[Run]) -> list[str]:
    """One tool's cells: medians over its rounds (lost: the worst round's)."""
    plan = fault_plan(args.rows, args.fault_share, args.seed)
    kinds = Counter(plan.values())
    walls = [run.wall for run in rows]

    def median(kind: str) -> float:
        return statistics.median(run.requests.get(kind, 0) for run in rows)

    tries = [median("clean") / (args.rows - len(plan))] + [median(k) / kinds[k] if kinds[k] else 0 for k in KINDS]
    return [
        f"{statistics.median(walls):.2f}", span(walls), f"{statistics.median(run.rate() for run in rows):.1f}",
        f"{statistics.median(run.packed for run in rows) / args.rows:.1%}", str(max(run.lost for run in rows)),
        *(f"{t:.2f}" for t in tries), f"{median(CONNECTIONS):.0f}", f"{median(RESETS):.0f}",
    ]  # fmt: skip


def report(args: argparse.Namespace, runs: dict[str, list[Run]]) -> None:
    kinds = Counter(fault_plan(args.rows, args.fault_share, args.seed).values())
    print(
        f"\n{args.rows} rows, {sum(kinds[k] for k in TRANSIENT)} failing only transiently "
        f"({', '.join(f'{kinds[k]} {k}' for k in TRANSIENT)}), {kinds['404']} permanent 404s; "
        f"best possible success {1 - kinds['404'] / args.rows:.1%}; median of {args.repeats} alternating rounds"
    )
    print(f"{'tool':<12} " + " ".join(f"{name:>{width}}" for name, width in zip(COLUMNS, WIDTHS, strict=True)))
    for name, rows in runs.items():
        cells = tool_row(args, rows)
        print(f"{name:<12} " + " ".join(f"{cell:>{width}}" for cell, width in zip(cells, WIDTHS, strict=True)))
        for note in sorted({note for run in rows for note in run.notes}):
            print(f"  {name}: {note}")
    if len(runs) == 2:
        per_round = ratios([r.rate() for r in runs["shardkit"]], [r.rate() for r in runs["img2dataset"]])
        median = statistics.median(per_round)
        lost = max(run.lost for run in runs["shardkit"])
        print(f"\nshardkit / img2dataset images/s: {median:.2f}x {span(per_round)} (median of per-round ratios)")
        print(
            f"goal (>= 2x, every transiently failing row recovered): "
            f"{'met' if median >= 2 and lost == 0 else 'not met'} ({median:.2f}x, {lost} lost)"
        )
    print(
        "lost: rows with only transient faults not packed (worst round); success: packed / rows; conns: TCP\n"
        "connections the server accepted; resets: connections the client reset; all else medians of the rounds"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=700)
    parser.add_argument("--latency", type=float, default=0.03, help="seconds before each answer")
    parser.add_argument("--fault-share", type=float, default=0.05, help="share of rows for each transient fault")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=32, help="download threads per process, both tools")
    parser.add_argument("--per-host", type=int, help="shardkit's --per-host (default: shardkit's own)")
    parser.add_argument("--shard-size", type=int, help="rows per shard, both tools (default: 2 shards a worker)")
    parser.add_argument("--table", choices=("parquet", "csv"), default="parquet")
    parser.add_argument("--img2dataset", default=I2D_DEFAULT)
    parser.add_argument("--shardkit-args", default="", help="more flags for shardkit pack (one string)")
    parser.add_argument("--img2dataset-args", default="", help="more flags for img2dataset (one string)")
    parser.add_argument("--only", choices=("shardkit", "img2dataset"))
    parser.add_argument("--keep", type=Path, help="leave the table, outputs and logs here")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--photos", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    compiled()
    if args.serve:
        serve(args)
        return
    args.shard_size = args.shard_size or math.ceil(args.rows / (2 * args.workers))
    sys.path.insert(0, str(REPO))
    from shardkit.core.version import __version__

    print(environment(__version__), f"load average {os.getloadavg()[0]:.2f}")
    work = Path(tempfile.mkdtemp(prefix="bench-web-", dir=args.keep))
    server = None
    try:
        photos, what = photo_folder(work)
        server = Serving(args, photos)
        table = write_table(work, server.url, args.rows, args.table, photos)
        print(f"server: {what}, {args.latency * 1000:.0f} ms a request; table {table.name}")
        for tool in tools(args):
            print(f"{tool.name}: {' '.join(tool.command(args, table, Path('OUT')))}")
        runs = measure(args, server, table, work)
    finally:
        if server is not None:
            server.close()
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    report(args, runs)
    print(f"load average after: {os.getloadavg()[0]:.2f} (2 shared cores: the server, both tools and others)")


if __name__ == "__main__":
    main()
