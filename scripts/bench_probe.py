"""Probe throughput per core against PIL, imagesize and PyAV, all measured in this run.

usage: python scripts/bench_probe.py SRC [--repeat 5] [--copies 20] [--workers 2]

Warm cache: every method reads the same file list once before it is timed. Methods run
round-robin, --repeat rounds over the list (SRC's files repeated --copies times); ratios are taken
within each round, so a noisy neighbour slows every method of that round alike.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from functools import partial

from benchkit import REPO, rate, ratios, read_heads, span

from shardkit.core.codecs import header_scanner
from shardkit.core.config import DEFAULT_MAX_PIXELS
from shardkit.packing.probe import CHUNK_FILES, _probe_chunk, parallelism, probe_file
from shardkit.packing.sources import walk

sys.path.insert(0, str(REPO))  # tests.helpers: the whole-list probe, a reference the library has no use for
from tests.helpers import probe_records


def shardkit_probe(paths: list[str]) -> None:
    """What one probe worker does: chunks through the compiled scanner, Python for what it leaves."""
    for start in range(0, len(paths), CHUNK_FILES):
        chunk = paths[start : start + CHUNK_FILES]
        _probe_chunk((chunk, chunk, DEFAULT_MAX_PIXELS))


def shardkit_python(paths: list[str]) -> None:
    """The pure-Python reference parser alone (what runs where the C scanner could not build)."""
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--copies", type=int, default=20)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    base = [item.path for item in walk(args.source, labels="none").items]
    paths = base * args.copies
    methods: dict[str, Callable[[list[str]], None]] = {
        "open+read(4 KiB)+close (floor)": read_heads,
        "shardkit probe": shardkit_probe,
        "shardkit pure-Python parser": shardkit_python,
        "imagesize.get": imagesize_get,
        "PIL Image.open().size": pil_size,
    }
    try:
        import av  # noqa: F401

        methods["PyAV open + codec size"] = pyav_size
    except ImportError:
        print("(PyAV not installed: pip install av to include it)")
    if header_scanner() is None:
        print("(the compiled scanner is not built: 'shardkit probe' is the pure-Python parser here)")
    print(f"{len(base)} files x {args.copies} = {len(paths):,} header reads per run, one core, warm cache\n")
    samples = {name: (base if "PyAV" in name else paths) for name in methods}  # PyAV is slow: one copy
    for name, method in methods.items():
        method(samples[name][:500])  # warm-up: page cache, imports
    # Round-robin: each round runs every method once, so drift on a shared machine hits all alike,
    # and each ratio is taken within one round.
    rates: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(args.repeat):
        for name, method in methods.items():
            rates[name].append(rate(partial(method, samples[name]), len(samples[name])))
    print(f"{'method':34} {'files/s (median)':>17} {'min':>9} {'max':>9}")
    for name, values in rates.items():
        print(f"{name:34} {statistics.median(values):17,.0f} {min(values):9,.0f} {max(values):9,.0f}")
    ours = rates["shardkit probe"]
    print("\nratios (shardkit per core / other, within each round: median [min-max]):")
    for name, values in rates.items():
        if name != "shardkit probe":
            per_round = ratios(ours, values)
            print(f"  vs {name:32} {statistics.median(per_round):6.2f}x  {span(per_round)}")
    relpaths = [os.path.relpath(p, args.source) for p in paths]
    started = time.perf_counter()
    probe_records(paths, relpaths, workers=args.workers, min_parallel=0)
    elapsed = time.perf_counter() - started
    workers, kind = parallelism(len(paths), args.workers, 0)
    print(f"\nwhole probe_records on {workers} {kind}s, start-up included: {len(paths) / elapsed:,.0f} files/s")


if __name__ == "__main__":
    main()
