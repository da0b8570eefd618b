"""Probe and pack at ImageNet scale (millions of files), whole-process, against a floor measured in the same run.

usage: python scripts/bench_scale.py N [--tree DIR] [--out DIR] [--skip-pack] [--workers 2] [--images SRC]
                                       [--pack-seconds 30] [--pack-resize 256] [--json PATH] [--interval 0.05]

The tree: N hard links (class folders n%08d of 1300 files, names n%08d_%d.JPEG) to a few hundred real
JPEGs, copied once into the tree's hidden folder .sources/ (probe and pack skip hidden names). Links are
cheap to make and leave the page cache holding only the few sources, so what scales is the file count:
the walk, the per-file open, and whatever the CLI keeps per file. A stamp file (.bench_scale.json) lets
a later run with the same N reuse the tree.

Every measurement is a subprocess timed from spawn to exit (interpreter start and imports included),
with its peak RSS summed over the process tree (VmRSS of every descendant, polled; shared pages of
forked workers count once per process, so this errs high) and the direct child's own VmHWM.

  floor         a plain Python walk (os.scandir, hidden names skipped) + open/read 4096 B/close of every
                file on --workers threads: what any probe has to pay at least
  probe+json    shardkit probe TREE --json F --records F.csv
  probe         shardkit probe TREE
  pack          shardkit pack TREE OUT --format webdataset --workers W --overwrite [--resize R]; stopped
                with SIGTERM --pack-seconds after its first shard appears (exit 143, resumable: expected)

This machine evicts file pages left untouched for ~30 s, so the tree is walked and read once, untimed,
right before every measurement.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from benchkit import (
    REPO,
    SAMPLE,
    all_pids,
    command_output,
    compiled,
    cpu_seconds,
    descendants,
    environment,
    jpeg_files,
    read_heads,
    stat_fields,
)

PER_CLASS = 1300  # ImageNet-1k's usual class size
STAMP_NAME = ".bench_scale.json"
SOURCES_NAME = ".sources"
LAYOUT = 1  # bump when the tree's layout changes, so old trees are rebuilt rather than reused
FLOOR_FLAG = "--floor-child"  # hidden: run the floor walk in this process and print its count
CHUNK_FILES = 1000
MB = 1_000_000  # shardkit's own reports use decimal units; the targets are read the same way
RSS_LIMIT_MB = 300
FLOOR_RATIO_LIMIT = 1.5
FIRST_SHARD_LIMIT_S = 5.0
KILL_GRACE_S = 60.0  # after SIGTERM, how long a pack may take to stop before it is killed
LEFTOVER_GRACE_S = 5.0  # after the driver exits, how long its helpers may take to follow


# ---------------------------------------------------------------------------------------------------
# The floor: walk + read the head of every file. Used as the timed floor (in a subprocess) and as the
# untimed cache warm-up (in this process).


def walk(tree: str) -> list[str]:
    """Every non-hidden regular file under `tree`, the way a probe must find them (no stat beyond d_type)."""
    paths: list[str] = []
    stack = [tree]
    while stack:
        with os.scandir(stack.pop()) as entries:
            for entry in entries:
                if entry.name.startswith("."):
                    continue
                if entry.is_dir(follow_symlinks=False):
                    stack.append(entry.path)
                elif entry.is_file(follow_symlinks=False):
                    paths.append(entry.path)
    return paths


def walk_and_read(tree: str, workers: int) -> int:
    """The floor: walk, then read every file's head on `workers` threads (os.read drops the GIL)."""
    paths = walk(tree)
    chunks = [paths[start : start + CHUNK_FILES] for start in range(0, len(paths), CHUNK_FILES)]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for _ in pool.map(read_heads, chunks):
            pass
    return len(paths)


def floor_child(argv: list[str]) -> None:
    tree, workers = argv[0], int(argv[1])
    print(json.dumps({"files": walk_and_read(tree, workers)}), flush=True)


# ---------------------------------------------------------------------------------------------------
# The tree of hard links.


def generate_sources(folder: Path, count: int = 8) -> list[Path]:
    """Fallback when the sample is missing: a few JPEGs of ImageNet-like sizes, textured so that they
    decode and re-encode at a realistic cost (flat colour would compress to nothing)."""
    from PIL import Image

    sizes = [(500, 375), (375, 500), (500, 333), (640, 480), (800, 600), (500, 500), (1024, 768), (333, 500)]
    made = []
    for index in range(count):
        width, height = sizes[index % len(sizes)]
        noise = Image.effect_noise((width, height), 40 + 10 * index).convert("RGB")
        gradient = Image.linear_gradient("L").resize((width, height)).convert("RGB")
        path = folder / f"gen-{index:04d}.JPEG"
        Image.blend(noise, gradient, 0.5).save(path, quality=90)
        made.append(path)
    return made


def read_stamp(tree: Path) -> dict | None:
    try:
        return json.loads((tree / STAMP_NAME).read_text())
    except (OSError, ValueError):
        return None


def wanted_stamp(n: int) -> dict:
    return {"n": n, "per_class": PER_CLASS, "layout": LAYOUT, "complete": True}


def prepare_tree_dir(tree: Path) -> None:
    """Start from an empty folder; delete an old one only when our stamp says we made it."""
    if tree.exists():
        if read_stamp(tree) is None and any(tree.iterdir()):
            sys.exit(f"{tree}: exists, is not empty and has no {STAMP_NAME}; not deleting it (pass another --tree)")
        print(f"removing the old tree {tree} ...", flush=True)
        shutil.rmtree(tree)
    tree.mkdir(parents=True)


def copy_sources(tree: Path, images: Path) -> list[Path]:
    """Copies of the sources inside the tree: the tree stands alone (no cross-device link, no link to
    files we do not own, which fs.protected_hardlinks refuses), and the sample's link counts stay 1."""
    folder = tree / SOURCES_NAME
    folder.mkdir()
    found = jpeg_files(images)
    if not found:
        print(f"no JPEGs in {images}; generating a few with Pillow", flush=True)
        return generate_sources(folder)
    copies = []
    for index, path in enumerate(found):
        copy = folder / f"src-{index:04d}{path.suffix}"
        shutil.copyfile(path, copy)
        copies.append(copy)
    return copies


def link_one(targets: list[Path], index: int, dest: str, folder: Path, copies: list[int]) -> None:
    """Link dest to source `index`; when that inode is full (EMLINK: ext4 allows 65000 links), copy
    the source once more and link to the fresh copy from then on."""
    try:
        os.link(targets[index], dest)
    except OSError as error:
        if error.errno != errno.EMLINK:
            raise
        copies[index] += 1
        fresh = folder / f"copy-{index:04d}-{copies[index]}{targets[index].suffix}"
        shutil.copyfile(targets[index], fresh)
        targets[index] = fresh
        os.link(fresh, dest)


def class_names(tree: Path, n: int) -> Iterator[tuple[int, str]]:
    """(i, TREE/n%08d/n%08d_RANK without its suffix) for i < n, ImageNet's layout of PER_CLASS files a
    class folder, each folder made as its first name comes."""
    for i in range(n):
        label, rank = divmod(i, PER_CLASS)
        if rank == 0:
            os.mkdir(tree / f"n{label:08d}")
        yield i, f"{tree}/n{label:08d}/n{label:08d}_{rank}"


def build_tree(tree: Path, n: int, images: Path) -> float:
    """Build (or reuse) the N-file tree; returns the seconds spent building (0 when reused)."""
    if read_stamp(tree) == wanted_stamp(n):
        print(f"reusing {tree} ({n:,} files)", flush=True)
        return 0.0
    started = time.perf_counter()
    prepare_tree_dir(tree)
    (tree / STAMP_NAME).write_text(json.dumps({**wanted_stamp(n), "complete": False}))
    targets = copy_sources(tree, images)
    folder = tree / SOURCES_NAME
    copies = [0] * len(targets)
    for i, stem in class_names(tree, n):
        link_one(targets, i % len(targets), f"{stem}.JPEG", folder, copies)
        if (i + 1) % 100_000 == 0:
            rate = (i + 1) / (time.perf_counter() - started)
            print(f"  linked {i + 1:,} of {n:,} ({rate:,.0f}/s)", flush=True)
    (tree / STAMP_NAME).write_text(json.dumps(wanted_stamp(n)))
    seconds = time.perf_counter() - started
    extra = sum(copies)
    print(
        f"built {tree}: {n:,} links to {len(targets)} sources"
        f"{f' (+{extra} copies after EMLINK)' if extra else ''} in {seconds:.1f}s",
        flush=True,
    )
    return seconds


# ---------------------------------------------------------------------------------------------------
# Watching a process tree: /proc polling.


def group_members(pgid: int) -> list[int]:
    """Processes still in a process group (a measured command runs in its own session)."""
    return [pid for pid in all_pids() if (fields := stat_fields(pid)) is not None and int(fields[2]) == pgid]


def reap_group(pgid: int) -> int:
    """Helpers (resource tracker, forkserver) exit a moment after their driver; give them a grace,
    then kill what is left so that no run leaves processes behind. Returns how many were killed."""
    deadline = time.monotonic() + LEFTOVER_GRACE_S
    while (left := group_members(pgid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return len(left)


def memory_kb(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) in kB; zeros for a process gone or a zombie (no memory left to report)."""
    rss = hwm = 0
    try:
        with open(f"/proc/{pid}/status") as handle:
            for line in handle:
                if line.startswith("VmHWM:"):
                    hwm = int(line.split()[1])
                elif line.startswith("VmRSS:"):
                    rss = int(line.split()[1])
                    break  # VmHWM is listed before VmRSS; nothing further is needed
    except (OSError, ValueError, IndexError):
        pass
    return rss, hwm


@dataclass
class Run:
    """What one measured command did."""

    name: str
    command: list[str]
    rc: int | None = None
    seconds: float = 0.0
    tree_peak_mb: float = 0.0
    driver_peak_mb: float = 0.0
    max_processes: int = 0
    first_shard_s: float | None = None
    stopped_at_s: float | None = None  # when SIGTERM was sent, from spawn
    files: int | None = None  # files (probe, floor) or images packed (pack)
    leftover_processes: int = 0
    stdout_tail: str = ""
    stderr_tail: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def work_seconds(self) -> float:
        """The time the counted files took: up to the SIGTERM for a stopped pack."""
        return self.stopped_at_s if self.stopped_at_s is not None else self.seconds


def _tail(path: Path, chars: int = 2000) -> str:
    text = path.read_text(errors="replace")
    return text[-chars:]


def measure(
    name: str,
    command: list[str],
    interval: float,
    on_tick: Callable[[float, subprocess.Popen, Run], None] | None = None,
) -> Run:
    """Run `command` in its own session, poll its tree's memory every `interval` s until it exits.
    A waiter thread reaps it, so the wall time is exact rather than rounded up to a poll."""
    run = Run(name, command)
    logs = Path(tempfile.mkdtemp(prefix="bench-scale-log-"))
    ended: list[float] = []
    cpu: dict[int, float] = {}  # the last CPU time seen per process: where the time went
    exited = threading.Event()
    with open(logs / "out", "wb") as out, open(logs / "err", "wb") as err:
        started = time.perf_counter()
        proc = subprocess.Popen(command, stdout=out, stderr=err, start_new_session=True)

        def wait() -> None:
            proc.wait()
            ended.append(time.perf_counter())
            exited.set()

        threading.Thread(target=wait, daemon=True).start()
        try:
            while not exited.wait(interval):
                pids = descendants(proc.pid)
                total = 0
                for pid, fields in pids.items():
                    cpu[pid] = cpu_seconds(fields)
                    rss, hwm = memory_kb(pid)
                    total += rss
                    if pid == proc.pid:
                        # VmHWM is the driver's own peak so far; the last read before exit is its peak
                        # bar the final poll interval, and never below the VmRSS seen.
                        run.driver_peak_mb = max(run.driver_peak_mb, max(rss, hwm) * 1024 / MB)
                run.tree_peak_mb = max(run.tree_peak_mb, total * 1024 / MB)
                run.max_processes = max(run.max_processes, len(pids))
                if on_tick is not None:
                    on_tick(time.perf_counter() - started, proc, run)
        finally:
            if not exited.is_set():  # interrupted (Ctrl-C): take the whole group down with us
                os.killpg(proc.pid, signal.SIGKILL)
                exited.wait()
    run.seconds = ended[0] - started
    run.rc = proc.returncode
    run.extra["driver_cpu_s"] = round(cpu.get(proc.pid, 0.0), 2)
    run.extra["tree_cpu_s"] = round(sum(cpu.values()), 2)
    run.leftover_processes = reap_group(proc.pid)
    run.stdout_tail, run.stderr_tail = _tail(logs / "out"), _tail(logs / "err")
    shutil.rmtree(logs)
    return run


# ---------------------------------------------------------------------------------------------------
# The measurements.


def cli_command() -> list[str]:
    """The shardkit entry point of the interpreter running this script, else of the repo's venv."""
    for script in (Path(sys.executable).with_name("shardkit"), REPO / ".venv" / "bin" / "shardkit"):
        if script.exists():
            return [str(script)]
    return [sys.executable, "-m", "shardkit"]


def has_option(cli: list[str], command: str, option: str) -> bool:
    """Ask the CLI as it is now (its flags are being changed under us): is `option` in its --help?"""
    env = {**os.environ, "COLUMNS": "300", "NO_COLOR": "1", "TERM": "dumb"}
    shown = subprocess.run([*cli, command, "--help"], capture_output=True, text=True, env=env, check=False)
    return re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", shown.stdout + shown.stderr) is not None


def warm(tree: Path, workers: int) -> None:
    """Untimed walk + read, so every measurement starts from the same (warm) page and dentry cache."""
    started = time.perf_counter()
    count = walk_and_read(str(tree), workers)
    print(f"  warmed {count:,} files in {time.perf_counter() - started:.1f}s", flush=True)


def measure_floor(tree: Path, workers: int, interval: float) -> Run:
    command = [sys.executable, str(Path(__file__).resolve()), FLOOR_FLAG, str(tree), str(workers)]
    run = measure("floor", command, interval)
    with contextlib.suppress(ValueError, IndexError, KeyError):
        run.files = json.loads(run.stdout_tail.strip().splitlines()[-1])["files"]
    return run


def read_probe_report(report: Path, run: Run) -> None:
    """The file count and the probe's own timing (after start-up) from its JSON report, where this
    version of the report keeps them."""
    try:
        data = json.loads(report.read_text())
    except (OSError, ValueError):
        return
    if isinstance(data, dict):
        run.files = next((data[k] for k in ("files", "images", "total") if isinstance(data.get(k), int)), None)
        if isinstance(data.get("seconds"), (int, float)):
            run.extra["reported_seconds"] = round(data["seconds"], 2)


def measure_probe(cli: list[str], tree: Path, n: int, interval: float, with_reports: bool) -> Run:
    command = [*cli, "probe", str(tree)]
    work = Path(tempfile.mkdtemp(prefix=f"bench-scale-probe-{n}-"))
    report, records = work / "report.json", work / "records.csv"
    if with_reports:
        command += ["--json", str(report), "--records", str(records)]
    if has_option(cli, "probe", "--quiet"):
        command.append("--quiet")
    run = measure("probe+json" if with_reports else "probe", command, interval)
    if with_reports:
        read_probe_report(report, run)
        for path in (report, records):
            run.extra[f"{path.stem}_mb"] = round(path.stat().st_size / MB, 2) if path.exists() else None
    shutil.rmtree(work)
    return run


def is_pack_output(out: Path) -> bool:
    """Only ever rm -rf an output we would be allowed to overwrite: empty, or shardkit's own."""
    if not out.exists():
        return True
    names = {p.name for p in out.iterdir()}
    return not names or ".shardkit" in names or "manifest.json" in names


def remove_output(out: Path) -> None:
    if not is_pack_output(out):
        sys.exit(f"{out}: exists and is not a shardkit output; not deleting it (pass another --out)")
    shutil.rmtree(out, ignore_errors=True)


def first_shard(out: Path) -> bool:
    """A finished shard: renamed into OUT (temporaries live in OUT/.shardkit/)."""
    try:
        with os.scandir(out) as entries:
            return any(e.name.startswith("shard-") and e.name.endswith(".tar") for e in entries)
    except OSError:
        return False


def packed_images(out: Path) -> tuple[int | None, int]:
    """(images in finished shards, finished shards): from manifest.json when the pack completed, else
    from the done markers a stopped pack leaves for --resume. Best effort: the format may change."""
    shards = sum(1 for p in out.glob("shard-*.tar")) if out.is_dir() else 0
    try:
        manifest = json.loads((out / "manifest.json").read_text())
        return sum(int(s["count"]) for s in manifest["shards"]), shards
    except (OSError, ValueError, KeyError, TypeError):
        pass
    markers = list((out / ".shardkit" / "done").glob("*.json"))
    if not markers:
        return None, shards
    total = 0
    try:
        for marker in markers:
            data = json.loads(marker.read_text())
            shard = data.get("shard") or data.get("info")  # the marker is asdict(ShardResult)
            total += int(shard["count"]) + len(data.get("errors", []))
    except (OSError, ValueError, KeyError, TypeError):
        return None, shards
    return total, shards


def measure_pack(cli: list[str], tree: Path, out: Path, args: argparse.Namespace) -> Run:
    remove_output(out)
    command = [*cli, "pack", str(tree), str(out), "--format", "webdataset", "--workers", str(args.workers)]
    if has_option(cli, "pack", "--overwrite"):
        command.append("--overwrite")
    if args.pack_resize and has_option(cli, "pack", "--resize"):
        command += ["--resize", args.pack_resize]

    def tick(elapsed: float, proc: subprocess.Popen, run: Run) -> None:
        if run.first_shard_s is None and first_shard(out):
            run.first_shard_s = elapsed
        if run.stopped_at_s is None:
            due = run.first_shard_s is not None and elapsed >= run.first_shard_s + args.pack_seconds
            if due or elapsed >= args.pack_limit:
                run.stopped_at_s = elapsed
                proc.send_signal(signal.SIGTERM)  # the driver stops its workers and leaves a resumable state
        elif elapsed >= run.stopped_at_s + KILL_GRACE_S:
            run.extra["killed"] = True
            os.killpg(proc.pid, signal.SIGKILL)

    run = measure("pack", command, args.interval, tick)
    run.files, run.extra["shards"] = packed_images(out)
    if run.stopped_at_s is not None:
        run.extra["stop_to_exit_s"] = round(run.seconds - run.stopped_at_s, 2)
    remove_output(out)
    return run


# ---------------------------------------------------------------------------------------------------
# Report.


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_table(runs: list[Run], n: int) -> None:
    floor = next((r for r in runs if r.name == "floor"), None)
    header = ["measurement", "rc", "seconds", "files/s", "x floor", "tree peak MB", "driver peak MB", "1st shard s"]
    rows = [header]
    for run in runs:
        counted = run.files if run.name == "pack" else n
        rate = counted / run.work_seconds if counted and run.work_seconds > 0 else None
        ratio = run.seconds / floor.seconds if floor and run.name.startswith("probe") else None
        rows.append([
            run.name, str(run.rc), fmt(run.seconds, ".2f"), fmt(rate, ",.0f"), fmt(ratio, ".2f"),
            fmt(run.tree_peak_mb, ",.0f"), fmt(run.driver_peak_mb, ",.0f"), fmt(run.first_shard_s, ".2f"),
        ])  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for row in rows:
        cells = [c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))]
        print("  ".join(cells))
    for run in runs:
        notes = []
        if run.files is not None and run.name != "pack" and run.files != n:
            notes.append(f"counted {run.files:,} files, not {n:,}")
        if run.name == "pack":
            notes.append(f"{fmt(run.files, ',')} images in {run.extra.get('shards', 0)} finished shards")
            if run.stopped_at_s is not None:
                notes.append(f"SIGTERM at {run.stopped_at_s:.1f}s, exited {run.extra['stop_to_exit_s']}s later")
            if run.extra.get("killed"):
                notes.append("did not stop on SIGTERM: killed")
        if run.leftover_processes:
            notes.append(f"{run.leftover_processes} processes outlived it by {LEFTOVER_GRACE_S:g}s (killed)")
        notes.append(f"CPU s: driver {run.extra['driver_cpu_s']}, tree {run.extra['tree_cpu_s']}")
        notes += [f"{k} {v}" for k, v in run.extra.items() if k.endswith(("_mb", "reported_seconds"))]
        if notes:
            print(f"  {run.name}: {'; '.join(notes)}")


def targets(runs: list[Run]) -> list[tuple[str, bool | None, str]]:
    """The issue's targets: (what, met or None when not measured, the numbers)."""
    by_name = {run.name: run for run in runs}
    floor, probe, pack = by_name.get("floor"), by_name.get("probe+json"), by_name.get("pack")
    found: list[tuple[str, bool | None, str]] = []
    if floor and probe:
        limit = FLOOR_RATIO_LIMIT * floor.seconds
        found.append((
            f"probe --json --records within {FLOOR_RATIO_LIMIT}x floor", probe.rc == 0 and probe.seconds <= limit,
            f"{probe.seconds:.2f}s vs {FLOOR_RATIO_LIMIT} x {floor.seconds:.2f}s = {limit:.2f}s",
        ))  # fmt: skip
    if probe:
        found.append((
            f"probe --json --records peak RSS under {RSS_LIMIT_MB} MB", probe.tree_peak_mb < RSS_LIMIT_MB,
            f"tree {probe.tree_peak_mb:,.0f} MB (driver {probe.driver_peak_mb:,.0f} MB)",
        ))  # fmt: skip
    if pack:
        shard = pack.first_shard_s
        found.append((
            f"pack first shard within {FIRST_SHARD_LIMIT_S:g}s", shard is not None and shard <= FIRST_SHARD_LIMIT_S,
            "no shard appeared" if shard is None else f"{shard:.2f}s",
        ))  # fmt: skip
        found.append((
            f"pack driver peak RSS under {RSS_LIMIT_MB} MB", pack.driver_peak_mb < RSS_LIMIT_MB,
            f"driver {pack.driver_peak_mb:,.0f} MB (tree {pack.tree_peak_mb:,.0f} MB)",
        ))  # fmt: skip
    return found


def print_targets(found: list[tuple[str, bool | None, str]]) -> None:
    print("\ntargets (from the issue):")
    width = max((len(what) for what, _, _ in found), default=0)
    for what, met, numbers in found:
        print(f"  {'PASS' if met else 'MISS'}  {what.ljust(width)}  {numbers}")


# ---------------------------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("n", type=int, help="files in the tree")
    parser.add_argument("--tree", type=Path, help="where the tree is built or reused [default: /tmp/scale-N]")
    parser.add_argument("--out", type=Path, help="pack output, deleted after [default: /tmp/bench-scale-pack-N]")
    parser.add_argument("--skip-pack", action="store_true")
    parser.add_argument("--rounds", type=int, default=1, help="floor and probes measured in turn this many times")
    parser.add_argument("--workers", type=int, default=2, help="pack workers and floor threads [default: 2]")
    parser.add_argument("--images", type=Path, default=SAMPLE, help="folder of JPEGs to link to")
    parser.add_argument("--pack-seconds", type=float, default=30.0, help="SIGTERM pack this long after shard 1")
    parser.add_argument("--pack-limit", type=float, default=600.0, help="SIGTERM pack by then even with no shard")
    parser.add_argument("--pack-resize", default="256", help="pack's --resize (256, auto, none; '' to omit)")
    parser.add_argument("--interval", type=float, default=0.05, help="seconds between /proc polls")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    if args.n < 1:
        parser.error("N must be at least 1")
    args.tree = args.tree or Path(f"/tmp/scale-{args.n}")
    args.out = args.out or Path(f"/tmp/bench-scale-pack-{args.n}")
    return args


def main(argv: list[str]) -> int:
    if argv[:1] == [FLOOR_FLAG]:
        floor_child(argv[1:])
        return 0
    args = parse_args(argv)
    compiled()
    cli = cli_command()
    build_s = build_tree(args.tree, args.n, args.images)
    steps: list[tuple[str, Callable[[], Run]]] = [
        ("floor", lambda: measure_floor(args.tree, args.workers, args.interval)),
        ("probe+json", lambda: measure_probe(cli, args.tree, args.n, args.interval, with_reports=True)),
        ("probe", lambda: measure_probe(cli, args.tree, args.n, args.interval, with_reports=False)),
    ]
    if not args.skip_pack:
        steps.append(("pack", lambda: measure_pack(cli, args.tree, args.out, args)))
    # The floor drifts 2x between minutes on a shared machine: with --rounds, floor and probes are
    # measured in turn, each round's ratios taken, and the round with the median probe+json ratio shown.
    rounds: list[list[Run]] = []
    for round_number in range(args.rounds):
        done: list[Run] = []
        for name, step in steps:
            if name == "pack" and round_number < args.rounds - 1:
                continue  # pack once, in the last round
            print(f"{name}{f' (round {round_number + 1})' if args.rounds > 1 else ''}:", flush=True)
            warm(args.tree, args.workers)
            run = step()
            print(f"  {run.seconds:.2f}s, rc {run.rc}, tree peak {run.tree_peak_mb:,.0f} MB", flush=True)
            if run.rc not in (0, -signal.SIGTERM, 128 + signal.SIGTERM) and run.stderr_tail:
                print("  stderr tail: " + run.stderr_tail[-800:].replace("\n", "\n    "), flush=True)
            done.append(run)
        rounds.append(done)
    if args.rounds > 1:
        print("\nper round, seconds (x floor):")
        for number, done in enumerate(rounds, 1):
            floor = next(run.seconds for run in done if run.name == "floor")
            shown = ", ".join(
                f"{run.name} {run.seconds:.2f}"
                + (f" ({run.seconds / floor:.2f}x)" if run.name.startswith("probe") else "")
                for run in done
            )
            print(f"  {number}: {shown}")

    def ratio(done: list[Run]) -> float:
        times = {run.name: run.seconds for run in done}
        return times["probe+json"] / times["floor"]

    runs = sorted(rounds, key=ratio)[len(rounds) // 2]
    runs += [run for run in rounds[-1] if run.name == "pack" and run not in runs]
    print(f"\n{args.n:,} files in {args.tree}, {args.workers} workers:")
    print_table(runs, args.n)
    found = targets(runs)
    print_targets(found)
    if args.json:
        result = {
            "n": args.n,
            "tree": str(args.tree),
            "build_seconds": round(build_s, 1),
            "environment": environment(command_output([*cli, "--version"])),
            "runs": [asdict(run) for run in runs],
            "targets": [{"target": what, "met": met, "numbers": numbers} for what, met, numbers in found],
        }
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    expected = {"pack": (0, 128 + signal.SIGTERM, -signal.SIGTERM)}
    return 0 if all(run.rc in expected.get(run.name, (0,)) for run in runs) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
