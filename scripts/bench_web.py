"""shardkit pack against img2dataset and its own floor on URL tables with the open web's faults (#46).

usage: python scripts/bench_web.py [--rows 700 10000] [--shard-size 100 1000] [--repeats 3] [--quick]
           [--latency 0.03] [--share-503 0.05] [--share-429 0.03] [--share-cut 0.02]
           [--share-404 0.02] [--share-html 0.01] [--workers 2] [--threads 32] [--per-host N]
           [--table parquet|csv] [--seed 0] [--img2dataset PATH] [--only TOOL ...] [--keep DIR]

One invocation measures a matrix: each --rows (a list; its own server) by each --shard-size (a
list). The server (scripts/web_fault_server.py, a process of its own: its CPU is the machine's, not
a tool's) serves the 300 ImageNet sample JPEGs beside the checkout (generated photos where they are
missing) as /img/<i>.jpg, photo i % 300, each answer after --latency seconds, and fails a fixed
subset of rows drawn with --seed, each kind a share of the rows: 503 on the first two tries, 429
with Retry-After: 1 for a second, a body cut half way on the first try (each then 200: "transient"),
404 always, a web page at 200 (text/html) always. It counts the requests for each path, reset
before every run, so the table says how many tries each tool made. The table (url, caption, row,
source) is written as parquet or CSV. In each cell three tools run:

  img2dataset --url_list TABLE --input_format parquet --url_col url --caption_col caption
      --output_format webdataset --resize_mode keep_ratio --image_size 256 --resize_only_if_bigger
      --encode_quality 90 --processes_count P --thread_count T --retries 2 --number_sample_per_shard S
  shardkit pack TABLE OUT --resize 256 --quality 90 --workers P --download-threads T --shard-size S
  floor: shardkit pack FOLDER OUT with the same flags, FOLDER holding the exact bytes the server
      serves for every row that can succeed (hard links to one copy of each photo) and a
      metadata.parquet with the table's other columns: the same records without the network

Both URL tools: short side to 256 when larger (shardkit never upscales; img2dataset is told not to),
JPEG quality 90, each tool's own filter, timeout and hashing defaults. --retries 2 is img2dataset's
common setting (three tries, back to back); shardkit keeps its defaults (5 retries, backoff 0.5 s
doubled, Retry-After obeyed). Each tool is a whole process, timed from spawn to exit, alternating
which goes first, --repeats rounds; before each run its input (the table, or the floor's folder) is
read again and its imports done once, untimed (this machine evicts file pages left untouched for
~30 s); each tool also runs once untimed before the first cell. Counts come from each tool's
output: img2dataset's *_stats.json and shard parquet statuses; shardkit's manifest.json,
index.parquet and errors.jsonl. A row "lost" is a row whose faults were all transient that the tool
did not pack. The load average is printed before and after each cell (a warning when the 1-minute
load is over 0.5 at its start): the machine is shared. --quick: one round, 700 rows, shards of 100.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchkit import REPO, compiled, environment, jpeg_files, pythonpath_env, ratios, span, warm
from web_fault_server import (
    CONNECTIONS,
    FINAL,
    KINDS,
    RESETS,
    ROW_IN_URL,
    SHARES,
    TRANSIENT,
    Serving,
    fault_plan,
    photo_folder,
)

ROW_IN_FILE = re.compile(r"(\d+)\.jpg$")  # the floor's files: <row>.jpg
BUSY_LOAD = 0.5  # a 1-minute load above this at a cell's start: others share the cores
I2D_DEFAULT = "/work/main/.venv-img2dataset/bin/img2dataset"
I2D_IMPORTS = "import img2dataset.main, img2dataset.downloader, img2dataset.resizer, img2dataset.writer"
SK_IMPORTS = "import shardkit.cli, shardkit.packing.pack, shardkit.packing.worker, shardkit.packing.sources"
TOOLS = ("img2dataset", "shardkit", "floor")


# ---------------------------------------------------------------------------------------------------
# The inputs of a cell.


def columns(rows: Iterable[int], photos: Path) -> dict[str, list[Any]]:
    """The table's columns but the URL, for `rows`: what both the table and the floor's metadata hold."""
    names = [path.stem.split("_", 1)[-1].replace("_", " ") for path in jpeg_files(photos)]
    chosen = list(rows)
    return {
        "caption": [f"a photo of a {names[i % len(names)]}, number {i}" for i in chosen],
        "row": chosen,
        "source": ["bench_web"] * len(chosen),
    }


def write_table(work: Path, base_url: str, rows: int, kind: str, photos: Path) -> Path:
    import pyarrow as pa
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    table = pa.table({"url": [f"{base_url}/img/{i}.jpg" for i in range(rows)], **columns(range(rows), photos)})
    path = work / f"urls-{rows}.{kind}"
    if kind == "parquet":
        pq.write_table(table, path)
    else:
        pacsv.write_csv(table, path)
    return path


def floor_folder(work: Path, rows: int, plan: dict[int, str], photos: Path) -> Path:
    """The rows that can succeed as files: <row>.jpg a hard link to a copy of the photo the server
    serves for it (our own copies: fs.protected_hardlinks refuses links to others' files), and
    metadata.parquet with the table's other columns in row order."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    copies = work / "photo-copies"
    if not copies.exists():
        copies.mkdir()
        for path in jpeg_files(photos):
            shutil.copyfile(path, copies / path.name)
    files = jpeg_files(copies)
    folder = work / f"floor-{rows}"
    folder.mkdir()
    kept = [row for row in range(rows) if plan.get(row) not in FINAL]
    for row in kept:
        os.link(files[row % len(files)], folder / f"{row:06d}.jpg")
    meta = {"file_name": [f"{row:06d}.jpg" for row in kept], **columns(kept, photos)}
    pq.write_table(pa.table(meta), folder / "metadata.parquet")
    return folder


@dataclass(frozen=True)
class Cell:
    rows: int
    shard_size: int
    table: Path
    floor: Path
    server: Serving
    plan: dict[int, str]


# ---------------------------------------------------------------------------------------------------
# The tools: a command, and what a finished run's output says.


@dataclass
class Outcome:
    """What one run's own output says: the rows packed, and a note when its counts disagree."""

    packed: set[int]
    notes: list[str] = field(default_factory=list)


def img2dataset_command(args: argparse.Namespace, cell: Cell, out: Path) -> list[str]:
    return [args.img2dataset, "--url_list", str(cell.table), "--input_format", args.table, "--url_col", "url",
            "--caption_col", "caption", "--output_format", "webdataset", "--output_folder", str(out),
            "--resize_mode", "keep_ratio", "--image_size", "256", "--resize_only_if_bigger", "True",
            "--encode_quality", "90", "--processes_count", str(args.workers), "--thread_count", str(args.threads),
            "--retries", "2", "--number_sample_per_shard", str(cell.shard_size),
            *shlex.split(args.img2dataset_args)]  # fmt: skip


def pack_command(args: argparse.Namespace, source: Path, shard_size: int, out: Path) -> list[str]:
    extra = ([] if args.per_host is None else ["--per-host", str(args.per_host)]) + shlex.split(args.shardkit_args)
    return [sys.executable, "-m", "shardkit", "pack", str(source), str(out), "--resize", "256", "--quality", "90",
            "--workers", str(args.workers), "--download-threads", str(args.threads),
            "--shard-size", str(shard_size), *extra]  # fmt: skip


def shardkit_command(args: argparse.Namespace, cell: Cell, out: Path) -> list[str]:
    return pack_command(args, cell.table, cell.shard_size, out)


def floor_command(args: argparse.Namespace, cell: Cell, out: Path) -> list[str]:
    return pack_command(args, cell.floor, cell.shard_size, out)


def rows_in(texts: Iterable[object], pattern: re.Pattern[str] = ROW_IN_URL) -> set[int]:
    """The rows named in `texts` (any strings: URLs, paths, sources, reasons)."""
    found = set()
    for text in texts:
        match = pattern.search(str(text))
        if match:
            found.add(int(match.group(1)))
    return found


def img2dataset_outcome(out: Path, cell: Cell) -> Outcome:
    import pyarrow.parquet as pq

    successes = sum(json.loads(path.read_text())["successes"] for path in out.glob("*_stats.json"))
    packed: set[int] = set()
    for path in sorted(out.glob("*.parquet")):
        shard = pq.read_table(path, columns=["url", "status"]).to_pylist()
        packed |= rows_in(row["url"] for row in shard if row["status"] == "success")
    notes = [] if successes == len(packed) else [f"stats say {successes} successes, parquet {len(packed)}"]
    return Outcome(packed, notes)


def pack_outcome(out: Path, expected: int, pattern: re.Pattern[str]) -> Outcome:
    """What a shardkit output says; `expected` is how many inputs it was given."""
    import pyarrow.parquet as pq

    manifest = json.loads((out / "manifest.json").read_text())
    records = manifest.get("totals", {}).get("records")
    errors = [json.loads(line) for line in (out / "errors.jsonl").read_text().splitlines() if line.strip()]
    failed = rows_in((row.get("path", "") for row in errors), pattern)
    packed = rows_in(pq.read_table(out / "index.parquet", columns=["source"]).column("source").to_pylist(), pattern)
    notes = []
    if records != len(packed):
        notes.append(f"manifest says {records} records, index.parquet names {len(packed)} rows")
    if failed & packed:
        notes.append(f"{len(failed & packed)} rows both packed and in errors.jsonl")
    if len(packed) + len(failed) != expected:
        notes.append(f"{expected - len(packed) - len(failed)} rows neither packed nor in errors.jsonl")
    flagged = rows_in((row.get("path", "") for row in errors if row.get("transient")), pattern)
    if flagged:
        notes.append(f"{len(flagged)} rows in errors.jsonl marked transient")
    return Outcome(packed, notes)


def shardkit_outcome(out: Path, cell: Cell) -> Outcome:
    return pack_outcome(out, cell.rows, ROW_IN_URL)


def floor_outcome(out: Path, cell: Cell) -> Outcome:
    return pack_outcome(out, sum(1 for row in range(cell.rows) if cell.plan.get(row) not in FINAL), ROW_IN_FILE)


@dataclass(frozen=True)
class Tool:
    name: str
    command: Callable[[argparse.Namespace, Cell, Path], list[str]]  # (args, cell, out) -> argv
    outcome: Callable[[Path, Cell], Outcome]  # (out, cell) -> what the output says
    reads: str  # the Cell's field the tool reads ("table", "floor"): read again right before it runs
    python: str  # the interpreter whose imports are warmed before a run
    imports: str
    env: dict[str, str]
    web: bool = True  # whether it asks the server (its tries are counted)


def tools(args: argparse.Namespace) -> list[Tool]:
    i2d_python = str(Path(args.img2dataset).parent / "python")
    i2d_env = {**os.environ, "NO_ALBUMENTATIONS_UPDATE": "1"}
    every = (
        Tool("img2dataset", img2dataset_command, img2dataset_outcome, "table", i2d_python, I2D_IMPORTS, i2d_env),
        Tool("shardkit", shardkit_command, shardkit_outcome, "table", sys.executable, SK_IMPORTS, pythonpath_env()),
        Tool("floor", floor_command, floor_outcome, "floor", sys.executable, SK_IMPORTS, pythonpath_env(), web=False),
    )
    return [tool for tool in every if tool.name in args.only]


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


class ToolFailed(Exception):
    pass


def warm_tool(tool: Tool, cell: Cell) -> None:
    source: Path = getattr(cell, tool.reads)
    if source.is_dir():
        warm(source)
    else:
        source.read_bytes()
    subprocess.run([tool.python, "-c", tool.imports], check=False, capture_output=True, env=tool.env)


def run_once(args: argparse.Namespace, tool: Tool, cell: Cell, out: Path) -> Run:
    shutil.rmtree(out, ignore_errors=True)
    scratch = out.parent / f"tmp-{tool.name}"  # img2dataset's wandb leaves two folders in TMPDIR a run
    scratch.mkdir(exist_ok=True)
    env = {**tool.env, "TMPDIR": str(scratch)}
    warm_tool(tool, cell)
    cell.server.reset()
    log = out.parent / f"{tool.name}.log"
    with open(log, "wb") as sink:
        started = time.perf_counter()
        done = subprocess.run(tool.command(args, cell, out), stdout=sink, stderr=subprocess.STDOUT, env=env)
        wall = time.perf_counter() - started
    if done.returncode != 0:
        raise ToolFailed(f"{tool.name} exited {done.returncode}:\n{log.read_text(errors='replace')[-3000:]}")
    outcome = tool.outcome(out, cell)
    transient = {row for row, kind in cell.plan.items() if kind in TRANSIENT}
    requests: Counter[str] = Counter()
    for path, count in (cell.server.counts() if tool.web else {}).items():
        match = ROW_IN_URL.fullmatch(path)
        requests[cell.plan.get(int(match.group(1)), "clean") if match else path] += count
    return Run(tool.name, wall, len(outcome.packed), len(transient - outcome.packed), dict(requests), outcome.notes)


def warm_up(args: argparse.Namespace, chosen: list[Tool], cell: Cell, work: Path) -> list[Tool]:
    """One untimed run of each tool; a tool that cannot run is left out with its reason."""
    able = []
    for tool in chosen:
        try:
            run_once(args, tool, cell, work / f"out-{tool.name}")
            able.append(tool)
        except ToolFailed as failure:
            print(f"left out: {failure}\n", file=sys.stderr)
    return able


def measure(args: argparse.Namespace, chosen: list[Tool], cell: Cell, work: Path) -> dict[str, list[Run]]:
    runs: dict[str, list[Run]] = {tool.name: [] for tool in chosen}
    for round_number in range(args.repeats):
        for tool in chosen if round_number % 2 == 0 else list(reversed(chosen)):
            run = run_once(args, tool, cell, work / f"out-{tool.name}")
            runs[tool.name].append(run)
            print(f"  round {round_number + 1}/{args.repeats} {tool.name}: {run.wall:.2f}s, {run.packed} packed, "
                  f"{run.lost} lost, requests {run.requests}{'; ' + '; '.join(run.notes) if run.notes else ''}",
                  file=sys.stderr)  # fmt: skip
    return runs


# ---------------------------------------------------------------------------------------------------
# The report.


COLUMNS = ("wall s", "[min-max]", "images/s", "packed", "lost", "tries/row: clean", *KINDS, "conns", "resets")
WIDTHS = (7, 13, 9, 7, 5, 16, 5, 5, 5, 5, 5, 6, 6)


def tool_row(cell: Cell, rows: list[Run]) -> list[str]:
    """One tool's cells: medians over its rounds (lost: the worst round's)."""
    kinds = Counter(cell.plan.values())
    walls = [run.wall for run in rows]

    def median(kind: str) -> float:
        return statistics.median(run.requests.get(kind, 0) for run in rows)

    if rows[0].requests:
        tries = [median("clean") / (cell.rows - len(cell.plan))] + [median(k) / max(1, kinds[k]) for k in KINDS]
        asked = [*(f"{t:.2f}" for t in tries), f"{median(CONNECTIONS):.0f}", f"{median(RESETS):.0f}"]
    else:
        asked = ["-"] * (len(KINDS) + 3)
    return [
        f"{statistics.median(walls):.2f}", span(walls), f"{statistics.median(run.rate() for run in rows):.1f}",
        f"{statistics.median(run.packed for run in rows):.0f}", str(max(run.lost for run in rows)), *asked,
    ]  # fmt: skip


def per_round(runs: dict[str, list[Run]], top: str, bottom: str, value: Callable[[Run], float]) -> list[float]:
    """Per-round ratios of `top` to `bottom`; [] when either did not run."""
    if top not in runs or bottom not in runs:
        return []
    return ratios([value(run) for run in runs[top]], [value(run) for run in runs[bottom]])


def cell_ratios(runs: dict[str, list[Run]]) -> tuple[list[float], list[float]]:
    """shardkit / img2dataset images/s and shardkit wall / floor wall, per round."""
    wall = per_round(runs, "shardkit", "floor", lambda run: run.wall)
    return per_round(runs, "shardkit", "img2dataset", Run.rate), wall


def report_cell(args: argparse.Namespace, cell: Cell, runs: dict[str, list[Run]], loads: str) -> None:
    kinds = Counter(cell.plan.values())
    print(
        f"\n{cell.rows} rows, shard size {cell.shard_size}: {sum(kinds[k] for k in TRANSIENT)} failing only "
        f"transiently ({', '.join(f'{kinds[k]} {k}' for k in TRANSIENT)}), "
        f"{', '.join(f'{kinds[k]} {k}' for k in FINAL)} final; at most {cell.rows - sum(kinds[k] for k in FINAL)} "
        f"packable; median of {args.repeats} alternating rounds\n{loads}"
    )
    print(f"{'tool':<12} " + " ".join(f"{name:>{width}}" for name, width in zip(COLUMNS, WIDTHS, strict=True)))
    for name, rows in runs.items():
        cells = tool_row(cell, rows)
        print(f"{name:<12} " + " ".join(f"{text:>{width}}" for text, width in zip(cells, WIDTHS, strict=True)))
        for note in sorted({note for run in rows for note in run.notes}):
            print(f"  {name}: {note}")
    versus_i2d, versus_floor = cell_ratios(runs)
    if versus_i2d:
        median = statistics.median(versus_i2d)
        lost = max(run.lost for run in runs["shardkit"])
        print(f"shardkit / img2dataset images/s: {median:.2f}x {span(versus_i2d)} (median of per-round ratios); "
              f"goal >= 2x, no transient row lost: {'met' if median >= 2 and lost == 0 else 'not met'}")  # fmt: skip
    if versus_floor:
        print(f"shardkit wall / floor wall: {statistics.median(versus_floor):.2f}x {span(versus_floor)} "
              f"(median of per-round ratios; 1.00x: the network costs nothing)")  # fmt: skip


def summary(results: list[tuple[Cell, dict[str, list[Run]]]]) -> None:
    """One line a cell: the numbers issue #46 asks for, side by side."""
    print(f"\n{'rows':>6} {'shard':>6} " + " ".join(f"{name + ' s':>14}" for name in TOOLS)
          + f" {'sk/i2d img/s':>13} {'sk/floor wall':>14}")  # fmt: skip
    for cell, runs in results:
        walls = [f"{statistics.median(r.wall for r in runs[name]):.2f}" if name in runs else "-" for name in TOOLS]
        versus_i2d, versus_floor = cell_ratios(runs)
        ratio = [f"{statistics.median(values):.2f}x" if values else "-" for values in (versus_i2d, versus_floor)]
        print(f"{cell.rows:>6} {cell.shard_size:>6} " + " ".join(f"{wall:>14}" for wall in walls)
              + f" {ratio[0]:>13} {ratio[1]:>14}")  # fmt: skip
    print(
        "lost: rows with only transient faults not packed (worst round); packed: rows packed; conns: TCP\n"
        "connections the server accepted; resets: connections the client reset; all else medians of the rounds"
    )


def load_line(start: tuple[float, ...], end: tuple[float, ...]) -> str:
    """The load averages (1, 5, 15 minutes) at a cell's start and end, and a warning when others were busy."""
    line = f"load average at start {' '.join(f'{x:.2f}' for x in start)}, at end {' '.join(f'{x:.2f}' for x in end)}"
    return line + (f"; warning: 1-minute load over {BUSY_LOAD} at the start" if start[0] > BUSY_LOAD else "")


# ---------------------------------------------------------------------------------------------------
# The matrix.


def run_matrix(args: argparse.Namespace, work: Path) -> list[tuple[Cell, dict[str, list[Run]]]]:
    photos, what = photo_folder(work)
    print(f"server: {what}, {args.latency * 1000:.0f} ms a request, shares {args.shares}")
    chosen = tools(args)
    results: list[tuple[Cell, dict[str, list[Run]]]] = []
    for rows in args.rows:
        server = Serving(photos, rows, args.latency, args.shares, args.seed)
        try:
            plan = fault_plan(rows, args.shares, args.seed)
            table = write_table(work, server.url, rows, args.table, photos)
            floor = floor_folder(work, rows, plan, photos)
            for shard_size in args.shard_size:
                cell = Cell(rows, shard_size, table, floor, server, plan)
                if not results:
                    for tool in chosen:
                        print(f"{tool.name}: {' '.join(tool.command(args, cell, Path('OUT')))}")
                    chosen = warm_up(args, chosen, cell, work)
                    if not chosen:
                        raise SystemExit("no tool could run (see above)")
                start = os.getloadavg()
                print(f"cell: {rows} rows, shard size {shard_size}, 1-minute load {start[0]:.2f}", file=sys.stderr)
                runs = measure(args, chosen, cell, work)
                report_cell(args, cell, runs, load_line(start, os.getloadavg()))
                results.append((cell, runs))
        finally:
            server.close()
    return results


def listed(text: str) -> list[int]:
    """A flag's list: `700 10000` or `700,10000`."""
    return [int(part) for part in text.split(",") if part.strip()]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=listed, nargs="+", default=[[700, 10_000]], help="rows of each table")
    parser.add_argument("--shard-size", type=listed, nargs="+", default=[[100, 1000]], help="rows per shard, all")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="a smoke run: one round, 700 rows, shard size 100")
    parser.add_argument("--latency", type=float, default=0.03, help="seconds before each answer")
    for kind, share in SHARES.items():
        parser.add_argument(f"--share-{kind}", type=float, default=share, help=f"share of rows: {kind}")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=32, help="download threads per process, both tools")
    parser.add_argument("--per-host", type=int, help="shardkit's --per-host (default: shardkit's own)")
    parser.add_argument("--table", choices=("parquet", "csv"), default="parquet")
    parser.add_argument("--img2dataset", default=I2D_DEFAULT)
    parser.add_argument("--shardkit-args", default="", help="more flags for shardkit pack, floor too (one string)")
    parser.add_argument("--img2dataset-args", default="", help="more flags for img2dataset (one string)")
    parser.add_argument("--only", nargs="+", choices=TOOLS, default=list(TOOLS), help="the tools to run")
    parser.add_argument("--keep", type=Path, help="leave the tables, folders, outputs and logs here")
    args = parser.parse_args()
    args.rows = [n for group in args.rows for n in group]
    args.shard_size = [n for group in args.shard_size for n in group]
    if args.quick:
        args.repeats, args.rows, args.shard_size = 1, [700], [100]
    args.shares = {kind: getattr(args, f"share_{kind}") for kind in SHARES}
    return args


def main() -> None:
    args = parse_args()
    compiled()
    sys.path.insert(0, str(REPO))
    from shardkit.core.version import __version__

    print(environment(__version__))
    work = Path(tempfile.mkdtemp(prefix="bench-web-", dir=args.keep))
    try:
        results = run_matrix(args, work)
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    summary(results)


if __name__ == "__main__":
    main()
