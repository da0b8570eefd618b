"""The near search on hashes that cluster (burst shots, video frames, near-identical product
photos: every hash within 8 bits of every other) and on scattered ones: time and peak memory
(tracemalloc) of `near_components` (what `shardkit duplicates --near` groups with) and of
`keep_first` (what `pack --dedup near` keeps), against the way both worked before, all pairs
listed (`near_pairs` then `components`), in the same run.

usage: python scripts/bench_duplicates_cluster.py [--counts 2000 3000 20000] [--threshold 10]
                                                   [--pairs-up-to 3000]

Listing all pairs is measured only up to --pairs-up-to hashes: 20,000 clustered hashes are 200
million pairs, more memory than most machines have.
"""

from __future__ import annotations

import argparse
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import numpy as np

from shardkit.core.phash import components, near_components, near_pairs
from shardkit.packing.dedup import Hashed, keep_first
from shardkit.packing.sources import Item


def clustered(count: int, seed: int = 0, bits: int = 4) -> np.ndarray:
    """Each hash at most `bits` bits from one centre: all within 2 * `bits` of one another."""
    rng = np.random.default_rng(seed)
    flips = np.zeros(count, np.uint64)
    for column in rng.integers(0, 64, (bits, count)):
        flips |= np.uint64(1) << column.astype(np.uint64)
    return rng.integers(0, 2**63, dtype=np.uint64) ^ flips


def scattered(count: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 2**63, count, dtype=np.uint64)


def measure(run: Callable[[], Any]) -> tuple[float, float, Any]:
    """Seconds, peak MiB traced, and the result."""
    tracemalloc.start()
    started = time.perf_counter()
    try:
        result = run()
        return time.perf_counter() - started, tracemalloc.get_traced_memory()[1] / 2**20, result
    finally:
        tracemalloc.stop()


def by_pairs(hashes: np.ndarray, threshold: int) -> np.ndarray:
    """near_components as it was: every pair listed, then union-find over them."""
    values, first_index, inverse = np.unique(hashes, return_index=True, return_inverse=True)
    return first_index[components(len(values), near_pairs(values, threshold))][inverse.ravel()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--counts", type=int, nargs="+", default=[2000, 3000, 20000])
    parser.add_argument("--threshold", type=int, default=10)
    parser.add_argument("--pairs-up-to", type=int, default=3000)
    args = parser.parse_args()
    print(f"{'hashes':>14} {'count':>7} {'what':<22} {'seconds':>8} {'peak MiB':>9}  result")
    for kind, make in (("clustered", clustered), ("scattered", scattered)):
        for count in args.counts:
            hashes = make(count)
            runs: list[tuple[str, Callable[[], Any]]] = [
                ("near_components", lambda h=hashes: near_components(h, args.threshold))
            ]
            if count <= args.pairs_up_to:
                runs.append(("all pairs (before)", lambda h=hashes: by_pairs(h, args.threshold)))
            items = [Item(f"/src/{n}.jpg", f"{n}.jpg", str(n)) for n in range(count)]
            table = Hashed([None] * count, hashes, np.ones(count, bool), [])
            runs.append(("keep_first", lambda t=table, i=items: keep_first(i, t, args.threshold)))
            groups = None
            for name, run in runs:
                seconds, peak, result = measure(run)
                if name == "keep_first":
                    said = f"{len(result.kept)} kept"
                else:
                    said = f"{len(set(result.tolist()))} groups"
                    if groups is not None:
                        said += ", the same" if np.array_equal(groups, result) else ", DIFFERENT"
                    groups = result
                print(f"{kind:>14} {count:>7} {name:<22} {seconds:>8.2f} {peak:>9.0f}  {said}", flush=True)


if __name__ == "__main__":
    main()
