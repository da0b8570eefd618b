"""Decode throughput from a loopback S3 server, first epoch (cold cache) and second (warm), against local disk.

The same shards are read from a SeaweedFS S3 server on loopback and from local disk, in one run.

usage: python scripts/bench_remote.py [SRC] [--copies 40] [--format webdataset] [--shard-size 100]
                                      [--resize 256] [--workers 2] [--rounds 3] [--quiet-wait 5]
                                      [--no-download] [--json PATH]

SRC is a folder of JPEGs (default: the 300-photo ImageNet sample); they are hard-linked --copies times
into class folders (the synset prefix of `n01440764_tench.JPEG`) and packed with --resize (short side)
into shards of --shard-size records, which are uploaded to a bucket of a fresh server (tests/servers.py).
The default, 12,000 images in 121 shards, takes a few seconds per epoch on 2 cores.

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
What cold and download wrote is synced to disk after them, untimed, so that no later measurement pays
the write-back. Other work comes and goes on this machine: before each measurement the driver waits
(up to --quiet-wait s) for it to use less than 0.3 of a core, and then reads from /proc the CPU time of
the ranks, of the S3 server (it shares the cores with the decoders, which matters for cold) and of the
rest of the machine meanwhile.

Prints, per round and method, images/s and where the CPU went; then the medians, the median of the
per-round ratios against local, the "cpu-bound" ratio (local's CPU seconds over the method's, server
included: what the ratio would be with the cores kept busy and nothing else running) and the targets
of the issue (warm >= 0.95x local, cold >= 0.8x local). The exit status is 0 whether or not they are met.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchkit import CLOCK_TICKS, REPO, SAMPLE, cpu_of_tree, environment, jpeg_files, link_classes, ratios, span, warm

sys.path.insert(0, str(REPO))  # tests.servers, and the checkout's shardkit rather than an installed one

WORKER_FLAG = "--worker"  # hidden: run as one rank, taking jobs on stdin
BUCKET = "bench"
PREFIX = "shards"
METHODS = ("local", "S3 cold", "S3 warm")
TARGETS = {"S3 warm": 0.95, "S3 cold": 0.8}
QUIET_CORES = 0.3  # before a measurement, wait until the machine uses less than this many cores
GAP_S = 0.02  # a wait between two samples longer than this counts as a stall (a decode takes a few ms)


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
        paths = [str(REPO), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
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


def machine_cpu() -> tuple[float, float]:
    """(busy, steal): CPU seconds all cores have spent running something (user, system, interrupts; not
    idle, not waiting on I/O) and waiting for the hypervisor (steal), since boot."""
    with open("/proc/stat") as handle:
        user, nice, system, _, _, irq, softirq, steal = (int(value) for value in handle.readline().split()[1:9])
    return (user + nice + system + irq + softirq) / CLOCK_TICKS, steal / CLOCK_TICKS


def wait_quiet(limit: float, cores: float = QUIET_CORES, window: float = 0.5) -> float:
    """Waits (up to `limit` s) until the machine has been busy less than `cores` over `window` s: the
    other work on this machine comes and goes. Returns the seconds waited."""
    started = time.perf_counter()
    while time.perf_counter() - started < limit:
        busy = machine_cpu()[0]
        time.sleep(window)
        if (machine_cpu()[0] - busy) / window < cores:
            break
    return time.perf_counter() - started


def build(source: Path, root: Path, copies: int, args: argparse.Namespace) -> tuple[Path, int]:
    """`copies` hard links of every JPEG of `source` in class folders, packed; (shards folder, images)."""
    from shardkit.core.pack_options import pack_config
    from shardkit.packing.pack import pack

    photos = jpeg_files(source)
    if not photos:
        raise SystemExit(f"{source}: no JPEGs")
    base, tree = root / "base", root / "tree"
    base.mkdir()
    for path in photos:  # our own copies: linking to files of others may be refused (protected_hardlinks)
        shutil.copyfile(path, base / path.name)
    link_classes(base, tree, copies)
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


@contextlib.contextmanager
def s3_server(folder: Path) -> Iterator[Any]:
    """tests/servers.py's server (never left running, even by a Ctrl-C while it starts)."""
    from tests.servers import s3_server as serve

    with serve(folder) as server:
        yield server


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path, nargs="?", default=SAMPLE, help="a folder of JPEGs")
    parser.add_argument("--copies", type=int, default=40, help="links of every photo [default: 40]")
    parser.add_argument("--format", default="webdataset", choices=("webdataset", "lmdb", "hdf5"))
    parser.add_argument("--resize", default="256", help="pack's --resize (short side) [default: 256]")
    parser.add_argument("--shard-size", type=int, default=100, help="records per shard [default: 100]")
    parser.add_argument("--workers", type=int, default=2, help="rank processes [default: 2, the cores]")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-download", action="store_true", help="skip the plain download measurement")
    parser.add_argument("--quiet-wait", type=float, default=5.0,
                        help="before each measurement, wait up to this many s for the machine to quieten")  # fmt: skip
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

    def timed(jobs: list[dict[str, Any]]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """The jobs run by the ranks, after the machine quietens; with the CPU time of everything."""
        waited = wait_quiet(args.quiet_wait)
        weed_cpu, (busy, steal), own = cpu_of_tree(weed), machine_cpu(), time.process_time()
        seconds, answers = ranks.run(jobs)
        weed_cpu, own = cpu_of_tree(weed) - weed_cpu, time.process_time() - own
        busy, steal = (after - before for after, before in zip(machine_cpu(), (busy, steal), strict=True))
        ranks_cpu = sum(answer["cpu"] for answer in answers)
        return {
            "seconds": seconds,
            "ranks_cpu_s": ranks_cpu,
            "server_cpu_s": weed_cpu,
            "others_cpu_s": max(0.0, busy - ranks_cpu - weed_cpu - own),  # the rest of the machine (kernel threads too)
            "steal_s": steal,
            "waited_for_quiet_s": waited,
        }, answers

    def epoch(path: str, cache_dir: str | None) -> dict[str, Any]:
        jobs = [{"kind": "epoch", "path": path, "cache_dir": cache_dir, "rank": r, **common} for r in range(world)]
        run, answers = timed(jobs)
        count = sum(answer["count"] for answer in answers)
        if count != images:
            raise SystemExit(f"an epoch of {path} yielded {count:,} samples, not {images:,}")
        return {
            **run,
            "images_per_second": count / run["seconds"],
            "first_sample_s": max(answer["first"] or 0.0 for answer in answers),
            "stalls": sum(answer["stalls"] for answer in answers),
            "stalled_s": sum(answer["stalled"] for answer in answers),
        }

    def flushed(run: dict[str, Any]) -> dict[str, Any]:
        """Writes back what the run wrote (untimed), so that the kernel does not do it during the next one."""
        started = time.perf_counter()
        os.sync()
        return {**run, "sync_after_s": time.perf_counter() - started}

    def local() -> dict[str, Any]:
        warm(shards)
        return epoch(str(shards), None)

    def remote(round_number: int) -> tuple[dict[str, Any], dict[str, Any]]:
        cache = root / f"cache-{round_number}"
        warm(server_data)
        cold = flushed(epoch(url, str(cache)))
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
        run, answers = timed(jobs)
        run = flushed(run)
        shutil.rmtree(into)
        total = sum(answer["bytes"] for answer in answers)
        return {
            **run,
            "megabytes_per_second": total / 1e6 / run["seconds"],
            "images_per_second": images / run["seconds"],
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


def cpu_text(run: dict[str, Any]) -> str:
    return f"{run['ranks_cpu_s']:5.2f} / {run['server_cpu_s']:4.2f} / {run['others_cpu_s']:4.2f} ({run['steal_s']:.2f})"


def report(args: argparse.Namespace, results: dict[str, list[dict[str, Any]]], images: int, shards: int) -> int:
    what = f"{args.format}, {shards} shards of {args.shard_size}, short side {args.resize}"
    print(f"\n{images:,} images ({what}), decoded to RGB by {args.workers} rank processes on {os.cpu_count()} cores, "
          f"{args.rounds} rounds")  # fmt: skip
    print(
        "per round: images/s, seconds, CPU s of the ranks / the S3 server / the rest of the machine (steal),\n"
        "the last rank's first sample, waits > 20 ms between samples (summed over the ranks), waited for quiet"
    )
    for name in METHODS:
        for number, run in enumerate(results[name], 1):
            head = f"{name:<8} {number}: {run['images_per_second']:>6,.0f} {run['seconds']:6.2f}s  cpu {cpu_text(run)}"
            stalls = f"{run['stalls']:>2} ({run['stalled_s']:.2f}s)"
            quiet = f"{run['waited_for_quiet_s']:.1f}s"
            print(f"  {head}  first {run['first_sample_s']:.2f}s  stalls {stalls}  quiet {quiet}")
    for number, run in enumerate(results["download"], 1):
        rate = f"{run['megabytes_per_second']:>4,.0f} MB/s"
        head = f"download {number}: {rate} {run['seconds']:6.2f}s  cpu {cpu_text(run)}"
        print(f"  {head}  (= {run['images_per_second']:,.0f} images/s; get_file only: no decode, no check)")
    local = results["local"]
    summary: dict[str, Any] = {}
    print("\nmedians; ratios are medians of the per-round ratios to local. cpu-bound: local's CPU s over the method's\n"
          "(its ranks + the server): the ratio if both kept the cores busy with nothing else running")  # fmt: skip
    print(f"{'method':<9} {'images/s':>8} {'range':>13} {'vs local':>9} {'ratio range':>13} {'cpu-bound':>10} "
          f"{'server cpu s':>13}")  # fmt: skip
    for name in METHODS:
        rates = [run["images_per_second"] for run in results[name]]
        per_round = ratios(rates, [base["images_per_second"] for base in local])
        used = [run["ranks_cpu_s"] + run["server_cpu_s"] for run in results[name]]
        bound = ratios([base["ranks_cpu_s"] for base in local], used)
        server = statistics.median(run["server_cpu_s"] for run in results[name])
        summary[name] = {"median": statistics.median(rates), "ratio": statistics.median(per_round), "ratios": per_round,
                         "cpu_bound_ratio": statistics.median(bound), "server_cpu_s": server}  # fmt: skip
        print(f"{name:<9} {statistics.median(rates):>8,.0f} {min(rates):>6,.0f}-{max(rates):<6,.0f} "
              f"{statistics.median(per_round):>8.2f}x  {span(per_round)} "
              f"{statistics.median(bound):>9.2f}x {server:>13.2f}")  # fmt: skip
    print("\ntargets (from the issue, medians of the per-round ratios):")
    targets = []
    for name, limit in TARGETS.items():
        ratio = summary[name]["ratio"]
        met = ratio >= limit
        targets.append({"target": f"{name} >= {limit:g}x local", "met": met, "ratio": ratio})
        print(f"  {'PASS' if met else 'MISS'}  {name} >= {limit:g}x local: {ratio:.2f}x")
    if args.json:
        import shardkit  # imported by build() already: free here

        document = {
            "images": images,
            "shards": shards,
            "arguments": {key: str(value) for key, value in vars(args).items()},
            "environment": environment(shardkit.__version__),
            "rounds": results,
            "summary": summary,
            "targets": targets,
        }
        args.json.write_text(json.dumps(document, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
