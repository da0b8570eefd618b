"""What a merge in a bucket costs: `shardkit merge s3://data/a s3://data/b s3://data/ab` (each shard
copied server-side) against what a user does without it (both outputs downloaded, merged locally,
the result uploaded), each step a whole process, in one run on a real S3 server on loopback
(SeaweedFS, from tests/servers.py).

usage: python scripts/bench_merge_bucket.py [--images 1000] [--shard-size 100] [--repeat 3]

Two outputs of --images generated photo-like images each (ImageNet's size mix, packed at 128 px)
are uploaded (not timed). Printed: the seconds of each way (median of --repeat, with the range), the
bytes that pass through this machine, the ratio, and the load average before and after. On
loopback the download and upload cost little next to a real network's: the ratio here is the least
the server-side copy saves.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchkit import compiled, pythonpath_env, shardkit_timed

_COPY = """
import sys, s3fs, json
fs = s3fs.S3FileSystem(**json.loads(sys.argv[1]))
if sys.argv[2] == "get":
    fs.get(sys.argv[3], sys.argv[4], recursive=True)
else:
    fs.put(sys.argv[3], sys.argv[4], recursive=True)
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--images", type=int, default=1000)
    parser.add_argument("--shard-size", type=int, default=100)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests.servers import s3_server

    with tempfile.TemporaryDirectory(prefix="bench-merge-s3-") as temp, s3_server(Path(temp)) as server:
        server.make_bucket("data")
        os.environ.update(server.env)
        os.environ["SHARDKIT_CACHE"] = str(Path(temp) / "cache")
        run(args, server, Path(temp))


def run(args: argparse.Namespace, server: Any, root: Path) -> None:
    import json

    from shardkit.synthetic import make_sample_dataset

    compiled()
    print(f"load average before: {os.getloadavg()}")
    flags = ["--resize", "128", "--shard-size", str(args.shard_size)]
    urls = []
    for name, seed in (("a", 0), ("b", 1)):
        source = make_sample_dataset(root / f"src-{name}", args.images, classes=10, seed=seed)
        for image in list(source.rglob("*.*")):  # (keys of their own, the same classes)
            image.rename(image.with_name(f"{name}-{image.name}"))
        shardkit_timed(["pack", str(source), str(root / name), *flags])
        _put(server, root / name, f"data/{name}")
        urls.append(f"s3://data/{name}")
    size = sum(p.stat().st_size for name in ("a", "b") for p in (root / name).iterdir() if p.is_file())
    options = json.dumps(server.options)
    server_side, by_hand = [], []
    for number in range(args.repeat):
        server_side.append(shardkit_timed(["merge", *urls, f"s3://data/ab-{number}"]))
        local = root / f"by-hand-{number}"
        started = time.perf_counter()
        for name in ("a", "b"):
            _copy(options, "get", f"data/{name}/", str(local / name))
        shardkit_timed(["merge", str(local / "a"), str(local / "b"), str(local / "ab")])
        _copy(options, "put", str(local / "ab") + "/", f"data/by-hand-{number}/")
        by_hand.append(time.perf_counter() - started)
        shutil.rmtree(local)
    ours, theirs = statistics.median(server_side), statistics.median(by_hand)
    print(f"two outputs of {args.images:,} records, {size / 1e6:.1f} MB in all, shards of {args.shard_size}")
    print(f"  merge in the bucket (server-side copies): {ours:.2f}s [{min(server_side):.2f}-{max(server_side):.2f}s], "
          "0 MB through this machine")  # fmt: skip
    print(f"  download, merge locally, upload:          {theirs:.2f}s [{min(by_hand):.2f}-{max(by_hand):.2f}s], "
          f"{2 * size / 1e6:.1f} MB through this machine")  # fmt: skip
    print(f"  ratio: {theirs / ours:.2f}x faster in the bucket (median of {args.repeat})")
    print(f"load average after: {os.getloadavg()}")


def _put(server: Any, folder: Path, prefix: str) -> None:
    import s3fs

    fs = s3fs.S3FileSystem(**server.options)
    for path in folder.iterdir():
        if path.is_file():
            fs.put_file(str(path), f"{prefix}/{path.name}")


def _copy(options: str, how: str, source: str, target: str) -> None:
    """A download or upload in a whole process of its own (as a user's `aws s3 cp` would be)."""
    subprocess.run([sys.executable, "-c", _COPY, options, how, source, target], check=True, env=pythonpath_env())


if __name__ == "__main__":
    main()
