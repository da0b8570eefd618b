"""--shard-bytes: how close shards land to the target, and what cutting by estimated output costs.

usage: python scripts/bench_shard_bytes.py [--target 1MB] [--synthetic-target 300KB] [--repeat 3]

For imagenet-sample (../shared/data/imagenet-sample, when there) and a generated set (300 images,
shardkit.synthetic's ImageNet-like size mix), packed at --resize 256 (jpeg q90) in each format: each
shard's bytes over the target, all but the last shard (mean of |deviation| and the worst), cut by
the estimate of the output ("output", this checkout) and by source bytes (the old rule: the plan's
weigh swapped for the source file's size, in this same run). Then the cost: pack seconds with
--shard-bytes against --shard-size giving as many shards, alternating, --repeat times (medians),
and the calibration alone.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from shardkit.core.config import PackConfig, ResizeConfig
from shardkit.core.manifest import read_manifest
from shardkit.core.pack_options import parse_bytes
from shardkit.packing import estimate, pack
from shardkit.packing.sources import Item
from shardkit.synthetic import make_sample_dataset

REAL = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "imagenet-sample"


class _SourceBytes:
    """The old rule, for comparison: an item weighs its source file."""

    per_shard = 0

    @staticmethod
    def of(item: Item) -> int:
        return os.path.getsize(item.path)


def deviations(output: Path, target: int) -> list[float]:
    shards = read_manifest(output).shards
    return [shard.bytes / target - 1 for shard in shards[:-1]]


def run_pack(config: PackConfig, rule: str) -> float:
    calibrate = pack.calibrate
    if rule == "source":
        pack.calibrate = lambda items, config: _SourceBytes()  # type: ignore[assignment,return-value]
    try:
        started = time.perf_counter()
        pack.pack(config)
        return time.perf_counter() - started
    finally:
        pack.calibrate = calibrate


def closeness(source: Path, target: int, work: Path) -> None:
    for format in ("webdataset", "lmdb", "hdf5"):
        for rule in ("output", "source"):
            out = work / f"{format}-{rule}"
            config = PackConfig(
                str(source), str(out), format=format, resize=ResizeConfig(256), shard_bytes=target, overwrite=True
            )
            run_pack(config, rule)
            found = deviations(out, target)
            shards = len(found) + 1
            if not found:
                print(f"  {format:10} {rule:6}: {shards} shard")
                continue
            mean = statistics.mean(abs(d) for d in found)
            worst = max(found, key=abs)
            print(f"  {format:10} {rule:6}: {shards:3} shards, mean |dev| {mean:6.1%}, worst {worst:+7.1%}")


def cost(source: Path, target: int, work: Path, repeat: int) -> None:
    by_bytes = PackConfig(str(source), str(work / "bytes"), resize=ResizeConfig(256), shard_bytes=target)
    by_bytes = replace(by_bytes, overwrite=True)
    pack.pack(by_bytes)
    manifest = read_manifest(work / "bytes")
    per_shard = -(-manifest.totals["records"] // len(manifest.shards))
    by_count = replace(by_bytes, output=str(work / "count"), shard_bytes=None, shard_size=per_shard)
    times: dict[str, list[float]] = {"bytes": [], "count": []}
    for _ in range(repeat):
        times["count"].append(run_pack(by_count, "output"))
        times["bytes"].append(run_pack(by_bytes, "output"))
    items = list(pack._walk(by_bytes).items)
    started = time.perf_counter()
    sizes = estimate.calibrate(items, by_bytes)
    calibrating = time.perf_counter() - started
    started = time.perf_counter()
    for item in items:
        sizes.of(item)
    heads = time.perf_counter() - started
    count, size = statistics.median(times["count"]), statistics.median(times["bytes"])
    print(
        f"  pack --shard-size {per_shard}: {count:.2f} s; --shard-bytes: {size:.2f} s ({size / count - 1:+.0%}); "
        f"of which calibration {calibrating:.2f} s, {len(items)} header reads {heads * 1000:.0f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="1MB")
    parser.add_argument("--synthetic-target", default="300KB")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    print(f"cpus: {os.cpu_count()}")
    with tempfile.TemporaryDirectory(prefix="bench-shard-bytes-") as folder:
        work = Path(folder)
        sources: list[tuple[str, Path, Any]] = []
        if REAL.is_dir():
            sources.append(("imagenet-sample", REAL, parse_bytes(args.target)))
        synthetic = make_sample_dataset(work / "synthetic-source", 300, classes=8, seed=0)
        sources.append(("synthetic", synthetic, parse_bytes(args.synthetic_target)))
        for name, source, target in sources:
            print(f"{name}, target {target:,} bytes:")
            closeness(source, target, work / name)
            cost(source, target, work / name, args.repeat)


if __name__ == "__main__":
    main()
