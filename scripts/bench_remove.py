"""What a takedown costs: `shardkit remove` of 1% of an output's records against packing the output
whole, each as a whole `shardkit` process, in one run.

usage: python scripts/bench_remove.py [--images 1000] [--shard-size 100] [--format webdataset] [--repeat 3]

Generated photo-like images (ImageNet's size mix) are packed at 128 px into shards of --shard-size.
Then 1% of the records are removed twice, from fresh copies of the output: "clustered" (the 1% all
in the first shard: one shard holds them) and "spread" (every 100th record: every shard holds one).
Printed per case: seconds (median of --repeat), the bytes written beside the output's size, the
shards written again, and the ratio to the pack's seconds; the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchkit import compiled, shardkit_timed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--images", type=int, default=1000)
    parser.add_argument("--shard-size", type=int, default=100)
    parser.add_argument("--format", default="webdataset")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    from shardkit.synthetic import make_sample_dataset

    compiled()
    print(f"load average before: {os.getloadavg()}")
    with tempfile.TemporaryDirectory(prefix="bench-remove-") as temp:
        root = Path(temp)
        source = make_sample_dataset(root / "src", args.images, classes=10, seed=0)
        out = root / "out"
        pack = ["pack", str(source), str(out), "--resize", "128", "--shard-size", str(args.shard_size),
                "--format", args.format]  # fmt: skip
        pack_seconds = []
        for _ in range(args.repeat):
            shutil.rmtree(out, ignore_errors=True)
            pack_seconds.append(shardkit_timed(pack))
        packed = statistics.median(pack_seconds)
        index = pq.read_table(out / "index.parquet", columns=["key", "shard"]).to_pylist()
        size = sum(path.stat().st_size for path in out.iterdir() if path.is_file())
        first = index[0]["shard"]
        one_percent = max(1, len(index) // 100)
        cases = {
            "clustered": [row["key"] for row in index if row["shard"] == first][:one_percent],
            "spread": [row["key"] for row in index[:: max(1, len(index) // one_percent)]][:one_percent],
        }
        print(f"{args.format}: {len(index):,} records in {len({r['shard'] for r in index})} shards, "
              f"{size / 1e6:.1f} MB; pack {packed:.2f}s (median of {args.repeat})")  # fmt: skip
        for name, keys in cases.items():
            listing = root / f"{name}.txt"
            listing.write_text("\n".join(keys) + "\n")
            seconds, written, shards = [], 0, 0
            for _ in range(args.repeat):
                copy = root / f"copy-{name}"
                shutil.rmtree(copy, ignore_errors=True)
                shutil.copytree(out, copy)
                report = root / "remove.json"
                seconds.append(shardkit_timed(["remove", str(copy), "--keys", str(listing), "--reason", "bench",
                                      "--json", str(report)]))  # fmt: skip
                result = json.loads(report.read_text())
                written, shards = result["bytes_written"], result["rewritten"] + result["dropped"]
            median, spread = statistics.median(seconds), f"[{min(seconds):.2f}-{max(seconds):.2f}s]"
            print(f"  remove 1% {name:9s}: {len(keys):,} records, {shards} shards written again, "
                  f"{written / 1e6:.2f} MB written of {size / 1e6:.1f} MB ({written / size:.0%}), "
                  f"{median:.2f}s = {median / packed:.2f}x the pack {spread}")  # fmt: skip
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
