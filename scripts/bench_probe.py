"""Probe throughput per core against PIL, imagesize and PyAV, all measured in this run.

usage: python scripts/bench_probe.py SRC [--repeat 5] [--copies 20] [--workers 2]

Warm cache: every method reads the same file list once before it is timed. Each figure is the
median of --repeat runs over the list (SRC's files repeated --copies times), with min and max.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings
from collections.abc import Callable

from shardkit.discover import discover
from shardkit.probe import probe_file, probe_records


def floor(paths: list[str]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        os.read(fd, 4096)
        os.close(fd)


def shardkit_probe(paths: list[str]) -> None:
    for path in paths:
        probe_file(path, path)


def pil_size(paths: list[str]) -> None:
    from PIL import Image

    for path in paths:
        with Image.open(path) as image:
            image.size  # noqa: B018


def imagesize_get(paths: list[str]) -> None:
    import imagesize

    for path in paths:
        imagesize.get(path)


def pyav_size(paths: list[str]) -> None:
    import av

    for path in paths:
        with av.open(path) as container:
            stream = container.streams.video[0]
            stream.codec_context.width  # noqa: B018


def measure(method: Callable[[list[str]], None], paths: list[str], repeat: int) -> list[float]:
    method(paths[: min(len(paths), 500)])  # warm-up: page cache, imports
    rates = []
    for _ in range(repeat):
        started = time.perf_counter()
        method(paths)
        rates.append(len(paths) / (time.perf_counter() - started))
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--copies", type=int, default=20)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    base = [item.path for item in discover(args.source, labels="none").items]
    paths = base * args.copies
    methods: dict[str, Callable[[list[str]], None]] = {
        "open+read(4 KiB)+close (floor)": floor,
        "shardkit probe_file": shardkit_probe,
        "imagesize.get": imagesize_get,
        "PIL Image.open().size": pil_size,
    }
    try:
        import av  # noqa: F401

        methods["PyAV open + codec size"] = pyav_size
    except ImportError:
        print("(PyAV not installed: pip install av to include it)")
    print(f"{len(base)} files x {args.copies} = {len(paths):,} header reads per run, one core, warm cache\n")
    medians = {}
    print(f"{'method':34} {'files/s (median)':>17} {'min':>9} {'max':>9}")
    for name, method in methods.items():
        sample = paths if "PyAV" not in name else base  # PyAV is ~100x slower: one copy is enough
        rates = measure(method, sample, args.repeat)
        medians[name] = statistics.median(rates)
        print(f"{name:34} {medians[name]:17,.0f} {min(rates):9,.0f} {max(rates):9,.0f}")
    ours = medians["shardkit probe_file"]
    print("\nratios (shardkit per core / other, same run):")
    for name, rate in medians.items():
        if name != "shardkit probe_file":
            print(f"  vs {name:32} {ours / rate:6.2f}x")
    relpaths = [os.path.relpath(p, args.source) for p in paths]
    started = time.perf_counter()
    probe_records(paths, relpaths, workers=args.workers, min_parallel=0)
    elapsed = time.perf_counter() - started
    print(f"\nwhole probe_records, {args.workers} processes, pool start included: {len(paths) / elapsed:,.0f} files/s")


if __name__ == "__main__":
    main()
