"""`shardkit pack --workers 2` against `--workers 1`, and against img2dataset, as whole processes, with
the breakdown of where each run's time went.

usage: python scripts/bench_pack_workers.py [--images 700,3500] [--repeat 3] [--workers 2]
           [--img2dataset PATH] [--img2dataset-images 700] [--source DIR] [--json PATH]

The sources: N hard links to the JPEGs of --source (the 300-photo ImageNet sample beside the checkout
by default), flat. Every run is a process timed from spawn to exit (`python -m shardkit pack SRC OUT
--resize 256 --quality 90 --workers W`, the default shard size), the runs of one size alternating
(w1, wW, img2dataset, w1, ...) so that drift hits all alike; figures are medians of --repeat with
min and max, ratios between medians of this run. img2dataset (its own venv) packs the same files by
file:// URL: --resize_mode keep_ratio --image_size 256 --encode_quality 90, webdataset, W processes.

"apart" is this machine's own ceiling for W processes: W `--workers 1` packs of N/W of the images
each (folders of their own), started together and timed until the last ends. Each pays the whole
start-up and none waits for another, so w1 / apart is what --workers W could reach with no cost of
working together; on this 2-core VM two CPU-bound processes each run 5-15% slower than one alone,
so that ceiling is below W.

The breakdown comes from SHARDKIT_TIMELINE (shardkit/core/timeline.py): each process of a run marks
its phases, and each run's wall time is cut into
  start      spawn to the CLI's imports done (interpreter, imports)
  setup      to the first shard handed out (claim, walk, plan of the first shard)
  to work    to the first image work in a worker (pool and forkserver start, preload, first fork)
  work       to the last shard job done
  finish     to the manifest written (index.parquet, errors.jsonl, the manifest)
  exit       to the process gone
and `idle` says how much of `work` the workers spent waiting, summed over workers (the tail: the last
jobs on fewer workers than there are).

This machine evicts file pages untouched for ~30 s: the sources are read again right before each run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchkit import SAMPLE, compiled, environment, jpeg_files, warm

PHASES = ("start", "setup", "to work", "work", "finish", "exit")


def link_images(files: list[Path], count: int, into: Path) -> list[Path]:
    into.mkdir(parents=True)
    paths = []
    for number in range(count):
        source = files[number % len(files)]
        path = into / f"{number:06d}_{source.name}"
        os.link(source, path)
        paths.append(path)
    return paths


def timed(command: list[str], env: dict[str, str]) -> float:
    started = time.time()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, timeout=3600)
    return time.time() - started


def pack_command(source: Path, out: Path, workers: int) -> list[str]:
    return [sys.executable, "-m", "shardkit", "pack", str(source), str(out), "--resize", "256", "--quality", "90",
            "--workers", str(workers)]  # fmt: skip


def pack_run(source: Path, out: Path, workers: int, timeline: Path) -> tuple[float, dict[str, float]]:
    shutil.rmtree(out, ignore_errors=True)
    timeline.unlink(missing_ok=True)
    warm(source)
    env = {**os.environ, "SHARDKIT_TIMELINE": str(timeline)}
    spawned = time.time()
    seconds = timed(pack_command(source, out, workers), env)
    return seconds, breakdown(timeline.read_text(), spawned, spawned + seconds)


def apart_run(sources: list[Path], work: Path) -> float:
    """W `--workers 1` packs, one a folder, started together: the time until the last has ended."""
    for source in sources:
        warm(source)
    outs = [work / f"apart{number}" for number in range(len(sources))]
    for out in outs:
        shutil.rmtree(out, ignore_errors=True)
    started = time.time()
    processes = [
        subprocess.Popen(pack_command(source, out, 1), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        for source, out in zip(sources, outs, strict=True)
    ]
    for process in processes:
        _, error = process.communicate(timeout=3600)
        if process.returncode != 0:
            raise SystemExit(f"a pack apart failed: {error.decode(errors='replace')[-2000:]}")
    return time.time() - started


def breakdown(text: str, spawned: float, ended: float) -> dict[str, float]:
    """The run's wall time cut at its marks (see the module's docstring), and the workers' idle time."""
    first: dict[str, float] = {}
    jobs: dict[int, list[tuple[float, float]]] = {}  # pid -> (start, end) of each shard job it ran
    opened: dict[tuple[int, str], float] = {}
    for line in text.splitlines():
        stamp, pid, event = line.split(" ", 2)
        at, process = float(stamp), int(pid)
        first.setdefault(event.split(" ")[0], at)
        if event.startswith(("job ", "part ")):
            opened[(process, event.split(" ", 1)[1])] = at
        elif event.startswith("done "):
            jobs.setdefault(process, []).append((opened.pop((process, event.split(" ", 1)[1])), at))
    starts = [start for spans in jobs.values() for start, _ in spans]
    ends = [end for spans in jobs.values() for _, end in spans]
    work_start, work_end = min(starts), max(ends)
    cuts = [spawned, first["imported"], first["planned"], work_start, work_end, first["manifest"], ended]
    phases = {name: cuts[at + 1] - cuts[at] for at, name in enumerate(PHASES)}
    lanes = max(len(jobs), 1)
    busy = sum(end - start for spans in jobs.values() for start, end in spans)
    phases["idle"] = lanes * (work_end - work_start) - busy
    return phases


def img2dataset_run(binary: str, paths: list[Path], work: Path, workers: int) -> float:
    urls = work / "urls.txt"
    urls.write_text("".join(f"file://{path}\n" for path in paths))
    out = work / "i2d"
    shutil.rmtree(out, ignore_errors=True)
    warm(paths[0].parent)
    command = [binary, "--url_list", str(urls), "--input_format", "txt", "--output_folder", str(out),
               "--resize_mode", "keep_ratio", "--image_size", "256", "--encode_quality", "90",
               "--output_format", "webdataset", "--processes_count", str(workers), "--thread_count", "4"]  # fmt: skip
    return timed(command, {**os.environ, "NO_ALBUMENTATIONS_UPDATE": "1"})


def span(values: list[float]) -> str:
    return f"{statistics.median(values):6.2f} s  ({min(values):.2f}-{max(values):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", default="700,3500")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--source", type=Path, default=SAMPLE)
    beside = Path(__file__).resolve().parents[1] / ".venv-img2dataset" / "bin" / "img2dataset"  # (make img2dataset)
    parser.add_argument("--img2dataset", default=str(beside) if beside.exists() else shutil.which("img2dataset"))
    parser.add_argument("--img2dataset-images", default="700")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    files = jpeg_files(args.source)
    if not files:
        sys.exit(f"{args.source}: no JPEGs to pack (give --source DIR)")
    sizes = [int(size) for size in args.images.split(",")]
    i2d_sizes = {int(size) for size in args.img2dataset_images.split(",") if size} if args.img2dataset else set()
    import shardkit

    compiled()
    report: dict[str, object] = {"environment": environment(shardkit.__version__), "sizes": {}}
    print(f"{args.workers} workers against 1, whole processes, {args.repeat} alternating rounds; "
          f"{len(files)} photos of {args.source}, linked\n")  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="bench_pack_workers_") as temp:
        work = Path(temp)
        for size in sizes:
            paths = link_images(files, size, work / f"src{size}")
            apart = [work / f"src{size}-{number}" for number in range(args.workers)]
            for number, folder in enumerate(apart):
                folder.mkdir()
                for path in paths[number :: args.workers]:
                    os.link(path, folder / path.name)
            times: dict[str, list[float]] = {"w1": [], f"w{args.workers}": [], "apart": []}
            phases: dict[str, list[dict[str, float]]] = {name: [] for name in times}
            if size in i2d_sizes:
                times["img2dataset"] = []
            for _ in range(args.repeat):
                for name in times:
                    if name == "img2dataset":
                        times[name].append(img2dataset_run(args.img2dataset, paths, work, args.workers))
                        continue
                    if name == "apart":
                        times[name].append(apart_run(apart, work))
                        continue
                    workers = int(name[1:])
                    seconds, cut = pack_run(paths[0].parent, work / "out", workers, work / "timeline.txt")
                    times[name].append(seconds)
                    phases[name].append(cut)
            print(f"{size:,} images")
            for name, values in times.items():
                print(f"  {name:12} {span(values)}  {size / statistics.median(values):7,.0f} images/s")
            many = statistics.median(times[f"w{args.workers}"])
            one = statistics.median(times["w1"])
            ceiling = one / statistics.median(times["apart"])
            apart_words = f"{args.workers} packs of {size // args.workers:,} apart"
            print(f"  --workers {args.workers} / --workers 1: {one / many:.2f}x (the limit: {args.workers}.00x; "
                  f"this machine's, {apart_words}: {ceiling:.2f}x)")  # fmt: skip
            if "img2dataset" in times:
                print(f"  shardkit w{args.workers} / img2dataset w{args.workers}: "
                      f"{statistics.median(times['img2dataset']) / many:.2f}x")  # fmt: skip
            print(f"  breakdown, medians (s): {'':10}" + "".join(f"{phase:>9}" for phase in (*PHASES, "idle")))
            for name, cuts in phases.items():
                if not cuts:
                    continue
                row = "".join(f"{statistics.median(cut[phase] for cut in cuts):9.3f}" for phase in (*PHASES, "idle"))
                print(f"  {name:34}{row}")
            print()
            report["sizes"][str(size)] = {"seconds": times, "phases": phases}  # type: ignore[index]
            shutil.rmtree(work / f"src{size}")
            for folder in apart:
                shutil.rmtree(folder)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
