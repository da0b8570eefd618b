"""Decode throughput from object storage: the same shards read from a SeaweedFS S3 server on loopback,
first epoch (cold cache) and second epoch (warm cache), against local disk, in one run.

usage: python scripts/bench_remote.py [SRC] [--copies 10] [--format webdataset] [--shard-size 100]
                                      [--resize 256] [--workers 2] [--rounds 3] [--json PATH]

SRC is a folder of JPEGs (default: the 300-photo ImageNet sample); they are hard-linked --copies times
into class folders (the synset prefix of `n01440764_tench.JPEG`) and packed with --resize (short side)
into shards of --shard-size records, which are uploaded to a bucket of a fresh server (tests/servers.py).

An epoch decodes every sample to RGB (open_shards(..., decode="rgb")) on --workers processes, rank i of
W each, started once before anything is timed and warmed up (imports, the S3 client and its connection,
a few decodes); the time runs from handing out the epoch to the last rank's reply (opening, iterating,
closing). Each round measures, with the order of local and the remote pair alternating:

  local      the shards on local disk
  S3 cold    a fresh, empty cache_dir: the first epoch downloads (sha256-checked) and decodes, the next
             shards prefetched in the background
  S3 warm    the second epoch on the cache_dir of the cold one: every shard already cached
  download   no decode: the ranks fetch their shards with the filesystem's get_file, nothing checked
             (the transfer alone, for reading the cold number; not a target)

This machine evicts file pages left untouched for ~30 s, so what an epoch reads is read once, untimed,
right before it: the local shards, the cached shards (warm), the server's data files (cold, download).
The server shares the cores with the decoders: its CPU time per epoch is read from /proc, as is the
CPU time the rest of the machine took meanwhile. Prints images/s per method per round, the median of
the per-round ratios against local, and the targets of the issue (warm >= 0.95x, cold >= 0.8x local).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

DEFAULT_SOURCE = REPO.parent / "shared" / "data" / "imagenet-sample"
WORKER_FLAG = "--worker"  # hidden: run as one rank, taking jobs on stdin
BUCKET = "bench"
PREFIX = "shards"
METHODS = ("local", "S3 cold", "S3 warm")
TARGETS = {"S3 warm": 0.95, "S3 cold": 0.8}
GAP_S = 0.02  # a wait between two samples longer than this counts as a stall (a decode takes a few ms)
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------------------------------------------
# One rank: a persistent child process that runs the jobs it is sent (one JSON line each) and answers
# with one JSON line. Its stdout is kept for the answers; anything printed goes to stderr.


def worker() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the driver stops us (EOF or kill) and cleans up
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    for line in sys.stdin:
        job = json.loads(line)
        try:
            result = {"download": download_job, "epoch": epoch_job, "warmup": warmup_job}[job["kind"]](job)
        except Exception:
            import traceback

            result = {"error": traceback.format_exc()}
        answers.write(json.dumps(result) + "\n")
        answers.flush()


def epoch_job(job: dict[str, Any]) -> dict[str, Any]:
    """This rank's part of one epoch, decoded to RGB; with the waits between samples (stalls)."""
    from shardkit import open_shards

    cpu, started = time.process_time(), time.perf_counter()
    remote = {"storage_options": job["options"], "cache_dir": job["cache_dir"]} if job["cache_dir"] else {}
    dataset = open_shards(job["path"], decode="rgb", rank=job["rank"], world_size=job["world"], **remote)
    count, pixels, stalls, stalled, first = 0, 0, 0, 0.0, None
    try:
        last = time.perf_counter()
        for sample in dataset:
            now = time.perf_counter()
            if first is None:
                first = now - started
            elif now - last > GAP_S:
                stalls += 1
                stalled += now - last
            pixels += sample.image.shape[0] * sample.image.shape[1]
            count += 1
            last = time.perf_counter()
    finally:
        dataset.close()
    return {
        "count": count,
        "pixels": pixels,
        "seconds": time.perf_counter() - started,
        "cpu": time.process_time() - cpu,  # every thread of the process: prefetch and hashing included
        "first": first,
        "stalls": stalls,
        "stalled": stalled,
        "pid": os.getpid(),
    }


def download_job(job: dict[str, Any]) -> dict[str, Any]:
    """This rank's half of the shard files, fetched one after another with the S3 filesystem alone."""
    import fsspec

    cpu, started = time.process_time(), time.perf_counter()
    fs = fsspec.filesystem("s3", **job["options"])
    total = 0
    for name in job["names"]:
        target = os.path.join(job["into"], name.replace("/", "_"))
        fs.get_file(f"{job['bucket']}/{job['prefix']}/{name}", target)
        total += os.path.getsize(target)
    return {"bytes": total, "seconds": time.perf_counter() - started, "cpu": time.process_time() - cpu}


def warmup_job(job: dict[str, Any]) -> dict[str, Any]:
    """Imports, the S3 client and a connection, a few decodes: nothing an epoch should pay for."""
    import fsspec

    from shardkit import open_shards

    local = open_shards(job["local"], decode="rgb")
    for _, sample in zip(range(20), local, strict=False):
        assert sample.image.ndim == 3
    local.close()
    remote = open_shards(job["remote"], decode="rgb", storage_options=job["options"], cache_dir=job["cache_dir"])
    remote.close()
    fsspec.filesystem("s3", **job["options"]).ls(job["bucket"])
    return {"pid": os.getpid()}


# ---------------------------------------------------------------------------------------------------
# The driver.


class Ranks:
    """W rank processes, started once; `run(jobs)` hands each its job and waits for all the answers."""

    def __init__(self, workers: int) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        self.processes = [
            subprocess.Popen([sys.executable, str(Path(__file__).resolve()), WORKER_FLAG], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env=env, start_new_session=True)
            for _ in range(workers)
        ]  # fmt: skip

    def run(self, jobs: list[dict[str, Any]]) -> tuple[float, list[dict[str, Any]]]:
        started = time.perf_counter()
        for process, job in zip(self.processes, jobs, strict=True):
            process.stdin.write(json.dumps(job) + "\n")  # type: ignore[union-attr]
            process.stdin.flush()  # type: ignore[union-attr]
        answers = []
        for process in self.processes:
            line = process.stdout.readline()  # type: ignore[union-attr]
            if not line:
                raise SystemExit(f"rank process {process.pid} exited with {process.wait()}")
            answers.append(json.loads(line))
        seconds = time.perf_counter() - started
        for answer in answers:
            if "error" in answer:
                raise SystemExit(f"a rank failed:\n{answer['error']}")
        return seconds, answers

    def close(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
        for process in self.processes:
            process.wait(10)


def cpu_of_tree(root: int) -> float:
    """CPU seconds (user + system) of `root` and every process below it."""
    stats: dict[int, list[str]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as handle:
                    stats[int(name)] = handle.read().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
    children: dict[int, list[int]] = {}
    for pid, fields in stats.items():
        children.setdefault(int(fields[1]), []).append(pid)
    total, stack = 0.0, [root]
    while stack:
        pid = stack.pop()
        if pid in stats:
            total += (int(stats[pid][11]) + int(stats[pid][12])) / CLOCK_TICKS
        stack.extend(children.get(pid, ()))
    return total


def machine_busy() -> float:
    """CPU seconds all cores spent busy since boot (not idle, not waiting on I/O)."""
    with open("/proc/stat") as handle:
        fields = [int(value) for value in handle.readline().split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / CLOCK_TICKS


def warm(*folders: Path) -> None:
    """This machine drops file pages untouched for ~30 s: read everything right before timing."""
    for folder in folders:
        for path in folder.rglob("*"):
            if path.is_file():
                with open(path, "rb", buffering=0) as handle:
                    while handle.read(8 << 20):
                        pass


def build(source: Path, root: Path, copies: int, args: argparse.Namespace) -> tuple[Path, int]:
    """`copies` hard links of every JPEG of `source` in class folders, packed; (shards folder, images)."""
    from shardkit.config import pack_config
    from shardkit.pack import pack

    photos = sorted(p for p in source.iterdir() if p.suffix.lower() in (".jpg", ".jpeg") and p.is_file())
    if not photos:
        raise SystemExit(f"{source}: no JPEGs")
    base, tree = root / "base", root / "tree"
    base.mkdir()
    for path in photos:  # our own copies: linking to files of others may be refused (protected_hardlinks)
        shutil.copyfile(path, base / path.name)
    for copy in range(copies):
        for path in sorted(base.iterdir()):
            target = tree / path.name.split("_")[0] / f"{copy}_{path.name}"
            target.parent.mkdir(parents=True, exist_ok=True)
            os.link(path, target)
    shards = root / "shards"
    config = pack_config(tree, shards, format=args.format, resize=args.resize, shard_size=args.shard_size)
    pack(config)
    return shards, len(photos) * copies


def upload(server: Any, shards: Path) -> int:
    import s3fs

    server.make_bucket(BUCKET)
    fs = s3fs.S3FileSystem(**server.options)
    total = 0
    for path in sorted(shards.rglob("*")):
        if path.is_file():
            fs.put_file(str(path), f"{BUCKET}/{PREFIX}/{path.relative_to(shards).as_posix()}")
            total += path.stat().st_size
    return total


def environment() -> dict[str, Any]:
    """What the numbers depend on: the code (being edited while we run) and the machine."""

    def output(*command: str) -> str:
        return subprocess.run(command, capture_output=True, text=True, check=False).stdout.strip()

    import shardkit

    dirty = output("git", "-C", str(REPO), "status", "--porcelain", "--", "shardkit")
    return {
        "shardkit": shardkit.__version__,
        "commit": output("git", "-C", str(REPO), "rev-parse", "--short", "HEAD"),
        "shardkit_dirty_files": len(dirty.splitlines()),
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
    }


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path, nargs="?", default=DEFAULT_SOURCE, help="a folder of JPEGs")
    parser.add_argument("--copies", type=int, default=10, help="links of every photo [default: 10]")
    parser.add_argument("--format", default="webdataset", choices=("webdataset", "lmdb", "hdf5"))
    parser.add_argument("--resize", default="256", help="pack's --resize (short side) [default: 256]")
    parser.add_argument("--shard-size", type=int, default=100, help="records per shard [default: 100]")
    parser.add_argument("--workers", type=int, default=2, help="rank processes [default: 2, the cores]")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-download", action="store_true", help="skip the plain download measurement")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    if args.copies < 1 or args.workers < 1 or args.rounds < 1 or args.shard_size < 1:
        parser.error("--copies, --workers, --rounds and --shard-size must be at least 1")
    return args


def main(argv: list[str]) -> int:
    if argv[:1] == [WORKER_FLAG]:
        worker()
        return 0
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # clean up as on Ctrl-C
    from tests.servers import s3_server

    with tempfile.TemporaryDirectory(prefix="shardkit-remote-") as temp:
        root = Path(temp)
        started = time.perf_counter()
        shards, images = build(args.source, root, args.copies, args)
        names = sorted(p.relative_to(shards).as_posix() for p in shards.rglob("*") if p.is_file())
        shard_files = [name for name in names if name != "manifest.json"]
        print(f"packed {images:,} images into {len(shard_files)} {args.format} shards "
              f"({sum((shards / n).stat().st_size for n in shard_files) / 1e6:,.1f} MB) "
              f"in {time.perf_counter() - started:.1f}s", flush=True)  # fmt: skip
        with s3_server(root / "s3") as server:
            uploaded = upload(server, shards)
            print(f"uploaded {uploaded / 1e6:,.1f} MB to {server.endpoint}/{BUCKET}/{PREFIX}", flush=True)
            ranks = Ranks(args.workers)
            try:
                return measure(args, root, shards, shard_files, images, server, ranks)
            finally:
                ranks.close()


def measure(
    args: argparse.Namespace, root: Path, shards: Path, shard_files: list[str], images: int, server: Any, ranks: Ranks
) -> int:
    url = f"s3://{BUCKET}/{PREFIX}"
    world = args.workers
    server_data = root / "s3" / "data"
    weed = server.process.pid
    common = {"options": server.options, "world": world}
    warmup = {"kind": "warmup", "local": str(shards), "remote": url, "bucket": BUCKET, **common}
    _, answers = ranks.run([{**warmup, "cache_dir": str(root / "cache-warmup")} for _ in range(world)])
    if len({answer["pid"] for answer in answers}) != world:
        raise SystemExit("the ranks do not run in distinct processes")

    def epoch(path: str, cache_dir: str | None) -> dict[str, Any]:
        jobs = [{"kind": "epoch", "path": path, "cache_dir": cache_dir, "rank": r, **common} for r in range(world)]
        weed_cpu, busy = cpu_of_tree(weed), machine_busy()
        seconds, answers = ranks.run(jobs)
        weed_cpu, busy = cpu_of_tree(weed) - weed_cpu, machine_busy() - busy
        count = sum(answer["count"] for answer in answers)
        if count != images:
            raise SystemExit(f"an epoch of {path} yielded {count:,} samples, not {images:,}")
        ranks_cpu = sum(answer["cpu"] for answer in answers)
        return {
            "seconds": seconds,
            "images_per_second": count / seconds,
            "ranks_cpu_s": ranks_cpu,
            "server_cpu_s": weed_cpu,
            "others_cpu_s": max(0.0, busy - ranks_cpu - weed_cpu),  # this driver idles: the rest of the machine
            "first_sample_s": max(answer["first"] or 0.0 for answer in answers),
            "stalls": sum(answer["stalls"] for answer in answers),
            "stalled_s": sum(answer["stalled"] for answer in answers),
        }

    def local() -> dict[str, Any]:
        warm(shards)
        return epoch(str(shards), None)

    def remote(round_number: int) -> tuple[dict[str, Any], dict[str, Any]]:
        cache = root / f"cache-{round_number}"
        warm(server_data)
        cold = epoch(url, str(cache))
        held = sum(path.stat().st_size for path in (cache / "shards").iterdir())
        warm(cache / "shards")
        hot = epoch(url, str(cache))
        shutil.rmtree(cache)
        return {**cold, "cached_bytes": held}, hot

    def download(round_number: int) -> dict[str, Any]:
        into = root / f"download-{round_number}"
        into.mkdir()
        warm(server_data)
        jobs = [
            {"kind": "download", "names": shard_files[r::world], "into": str(into), "bucket": BUCKET,
             "prefix": PREFIX, **common}
            for r in range(world)
        ]  # fmt: skip
        weed_cpu = cpu_of_tree(weed)
        seconds, answers = ranks.run(jobs)
        weed_cpu = cpu_of_tree(weed) - weed_cpu
        shutil.rmtree(into)
        total = sum(answer["bytes"] for answer in answers)
        return {
            "seconds": seconds,
            "megabytes_per_second": total / 1e6 / seconds,
            "images_per_second": images / seconds,
            "ranks_cpu_s": sum(answer["cpu"] for answer in answers),
            "server_cpu_s": weed_cpu,
        }

    results: dict[str, list[dict[str, Any]]] = {name: [] for name in (*METHODS, "download")}
    for round_number in range(args.rounds):
        if round_number % 2 == 0:
            results["local"].append(local())
            cold, hot = remote(round_number)
        else:
            cold, hot = remote(round_number)
            results["local"].append(local())
        results["S3 cold"].append(cold)
        results["S3 warm"].append(hot)
        if not args.no_download:
            results["download"].append(download(round_number))
        shown = ", ".join(f"{name} {results[name][-1]['images_per_second']:,.0f}" for name in METHODS)
        print(f"round {round_number + 1}/{args.rounds}: {shown} images/s", flush=True)
    return report(args, results, images, len(shard_files))


def report(args: argparse.Namespace, results: dict[str, list[dict[str, Any]]], images: int, shards: int) -> int:
    what = f"{args.format}, {shards} shards of {args.shard_size}, short side {args.resize}"
    print(f"\n{images:,} images ({what}), decoded to RGB by {args.workers} rank processes on {os.cpu_count()} cores, "
          f"{args.rounds} rounds")  # fmt: skip
    print("images/s per round (cpu s of the ranks / the S3 server / the rest of the machine; stalls > 20 ms):")
    for name in METHODS:
        for number, run in enumerate(results[name], 1):
            cpu = f"{run['ranks_cpu_s']:5.2f} / {run['server_cpu_s']:4.2f} / {run['others_cpu_s']:4.2f}"
            stalls = f"{run['stalls']} ({run['stalled_s']:.2f}s)"
            print(f"  {name:<8} {number}: {run['images_per_second']:>7,.0f}  {run['seconds']:6.2f}s  cpu {cpu}  "
                  f"first sample {run['first_sample_s']:.2f}s  stalls {stalls}")  # fmt: skip
    for number, run in enumerate(results["download"], 1):
        cpu = f"{run['ranks_cpu_s']:.2f} / {run['server_cpu_s']:.2f}"
        print(f"  download {number}: {run['megabytes_per_second']:>7,.0f} MB/s "
              f"({run['images_per_second']:,.0f} images/s), {run['seconds']:.2f}s, cpu {cpu}")  # fmt: skip
    local = [run["images_per_second"] for run in results["local"]]
    summary: dict[str, Any] = {}
    print(f"\n{'method':<10} {'images/s':>9} {'range':>15} {'vs local':>9} {'ratio range':>13}  server cpu s")
    for name in METHODS:
        rates = [run["images_per_second"] for run in results[name]]
        ratios = [rate / base for rate, base in zip(rates, local, strict=True)]
        server = statistics.median(run["server_cpu_s"] for run in results[name])
        summary[name] = {"median": statistics.median(rates), "ratio": statistics.median(ratios), "ratios": ratios,
                         "server_cpu_s": server}  # fmt: skip
        print(f"{name:<10} {statistics.median(rates):>9,.0f} {min(rates):>7,.0f}-{max(rates):<7,.0f} "
              f"{statistics.median(ratios):>8.2f}x  [{min(ratios):.2f}-{max(ratios):.2f}]  {server:11.2f}")  # fmt: skip
    print("\ntargets (from the issue, medians of the per-round ratios):")
    targets = []
    for name, limit in TARGETS.items():
        ratio = summary[name]["ratio"]
        met = ratio >= limit
        targets.append({"target": f"{name} >= {limit:g}x local", "met": met, "ratio": ratio})
        print(f"  {'PASS' if met else 'MISS'}  {name} >= {limit:g}x local: {ratio:.2f}x")
    if args.json:
        document = {
            "images": images,
            "shards": shards,
            "arguments": {key: str(value) for key, value in vars(args).items()},
            "environment": environment(),
            "rounds": results,
            "summary": summary,
            "targets": targets,
        }
        args.json.write_text(json.dumps(document, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
