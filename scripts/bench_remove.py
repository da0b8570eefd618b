"""What a takedown costs: `shardkit remove` of 1% of an output's records against packing the output
whole, each as a whole `shardkit` process, in one run.

usage: python scripts/bench_remove.py [--images 1000] [--shard-size 100] [--format webdataset] [--repeat 3]
                                     [--bucket]

Generated photo-like images (ImageNet's size mix) are packed at 128 px into shards of --shard-size.
Then 1% of the records are removed twice, from fresh copies of the output: "clustered" (the 1% all
in the first shard: one shard holds them) and "spread" (every 100th record: every shard holds one).
Printed per case: seconds (median of --repeat), the bytes written beside the output's size, the
shards written again, and the ratio to the pack's seconds; the load average before and after.

--bucket does the same on an output in a bucket of a real S3 server on loopback (SeaweedFS, from
tests/servers.py): the pack into the bucket is the baseline, and each remove changes a fresh copy
of the output uploaded to its own prefix; the bytes it downloads (the shards it writes again) are
printed beside the bytes it writes.
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
from typing import Any

import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchkit import compiled, shardkit_timed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--images", type=int, default=1000)
    parser.add_argument("--shard-size", type=int, default=100)
    parser.add_argument("--format", default="webdataset")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--bucket", action="store_true", help="an output in a bucket of a local S3 server")
    args = parser.parse_args()
    if args.bucket:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        from tests.servers import s3_server

        with tempfile.TemporaryDirectory(prefix="bench-remove-s3-") as temp, s3_server(Path(temp)) as server:
            server.make_bucket("data")
            os.environ.update(server.env)
            os.environ["SHARDKIT_CACHE"] = str(Path(temp) / "cache")
            run(args, server)
        return
    run(args, None)


def run(args: argparse.Namespace, server: Any) -> None:
    from shardkit.synthetic import make_sample_dataset

    compiled()
    print(f"load average before: {os.getloadavg()}")
    with tempfile.TemporaryDirectory(prefix="bench-remove-") as temp:
        root = Path(temp)
        source = make_sample_dataset(root / "src", args.images, classes=10, seed=0)
        out = root / "out"
        flags = ["--resize", "128", "--shard-size", str(args.shard_size), "--format", args.format]
        pack_seconds = []
        for number in range(args.repeat):
            shutil.rmtree(out, ignore_errors=True)
            target = str(out) if server is None else f"s3://data/packed-{number}"
            pack_seconds.append(shardkit_timed(["pack", str(source), target, *flags], source))
        if server is not None:  # (the shards the removes start from: the same pack, into a folder)
            shardkit_timed(["pack", str(source), str(out), *flags])
        packed = statistics.median(pack_seconds)
        shard_bytes = {s["name"]: s["bytes"] for s in json.loads((out / "manifest.json").read_text())["shards"]}
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
            for number in range(args.repeat):
                copy = root / f"copy-{name}"
                shutil.rmtree(copy, ignore_errors=True)
                target = str(copy) if server is None else _uploaded(server, out, f"{name}-{number}")
                if server is None:
                    shutil.copytree(out, copy)
                report = root / "remove.json"
                seconds.append(shardkit_timed(["remove", target, "--keys", str(listing), "--reason", "bench",
                                      "--json", str(report)]))  # fmt: skip
                result = json.loads(report.read_text())
                written, shards = result["bytes_written"], result["rewritten"] + result["dropped"]
            median, spread = statistics.median(seconds), f"[{min(seconds):.2f}-{max(seconds):.2f}s]"
            keyed = set(keys)
            read = sum(shard_bytes[shard] for shard in {row["shard"] for row in index if row["key"] in keyed})
            fetched = f", {read / 1e6:.2f} MB downloaded" if server is not None else ""
            print(f"  remove 1% {name:9s}: {len(keys):,} records, {shards} shards written again, "
                  f"{written / 1e6:.2f} MB written of {size / 1e6:.1f} MB ({written / size:.0%}){fetched}, "
                  f"{median:.2f}s = {median / packed:.2f}x the pack {spread}")  # fmt: skip
    print(f"load average after: {os.getloadavg()}")


def _uploaded(server: Any, folder: Path, prefix: str) -> str:
    """The output `folder` put in the bucket under `prefix` (not timed): its URL."""
    import s3fs

    fs = s3fs.S3FileSystem(**server.options)
    for path in folder.iterdir():
        fs.put_file(str(path), f"data/{prefix}/{path.name}")
    return f"s3://data/{prefix}"


if __name__ == "__main__":
    main()
