"""What `shardkit index` costs per GB of tars, against reading the same tars once, in one run.

usage: python scripts/bench_index.py [--tars 30] [--photos ../shared/data/imagenet-sample]
           [--workers 2] [--rounds 3] [--keep /tmp/bench_index]

Builds --tars tars with GNU tar (--sort=name) from --photos (each tar every photo, renamed so that no
key repeats; ~32 MB each from the 300-photo ImageNet sample, ~1 GB in all; generated photos when the
folder is missing), then, alternating, --rounds times each, with every tar read in full right before
(warm page cache; this machine evicts pages untouched for ~30 s):
  read once: every tar read start to end in 8 MiB chunks, in --workers processes (the floor: the
             bytes index must at least read to hash them);
  index:     adopt_tars(folder, workers=--workers, overwrite=True): sha256, header walk, the records
             as open_shards reads them, DALI's index, wids' list, the manifest.
Prints GB/s of each and the median of per-round ratios index / read with their range.
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
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from benchkit import environment, ratios, span, warm

from shardkit.core.version import __version__
from shardkit.packing.adopt import adopt_tars
from shardkit.synthetic import write_image

CHUNK = 8 << 20


def make_tars(photos: Path, out: Path, count: int) -> int:
    if not photos.is_dir():
        photos = out.parent / "photos"
        for i in range(300):
            write_image(photos / f"p{i:03d}.jpg", 500, 375, seed=i)
    names = sorted(p.name for p in photos.iterdir() if p.is_file())
    out.mkdir(parents=True)
    for i in range(count):
        command = ["tar", "--sort=name", f"--transform=s,^,t{i:03d}_,", "-cf", str(out / f"part-{i:03d}.tar"), *names]
        subprocess.run(command, cwd=photos, check=True)
    return sum(path.stat().st_size for path in out.glob("*.tar"))


def read_file(path: str) -> int:
    total = 0
    fd = os.open(path, os.O_RDONLY)
    try:
        while chunk := os.read(fd, CHUNK):
            total += len(chunk)
    finally:
        os.close(fd)
    return total


def read_once(folder: Path, workers: int) -> None:
    with ProcessPoolExecutor(workers) as pool:
        list(pool.map(read_file, sorted(str(p) for p in folder.glob("*.tar"))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tars", type=int, default=30)
    parser.add_argument(
        "--photos", type=Path, default=Path(__file__).resolve().parents[2] / "shared/data/imagenet-sample"
    )
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--keep", type=Path, default=None, help="build the tars here and keep them")
    args = parser.parse_args()
    if shutil.which("tar") is None:
        raise SystemExit("GNU tar is needed to build the tars")
    print(environment(__version__))
    temp = Path(tempfile.mkdtemp(prefix="bench-index-")) if args.keep is None else args.keep
    folder = temp / "tars"
    try:
        size = (
            make_tars(args.photos, folder, args.tars)
            if not folder.exists()
            else sum(p.stat().st_size for p in folder.glob("*.tar"))
        )
        runs: dict[str, list[float]] = {"read": [], "index": []}
        records = 0
        for round_number in range(args.rounds):
            for name in ("read", "index") if round_number % 2 == 0 else ("index", "read"):
                warm(folder)
                started = time.perf_counter()
                if name == "read":
                    read_once(folder, args.workers)
                else:
                    records = adopt_tars(folder, workers=args.workers, overwrite=True).records
                runs[name].append(time.perf_counter() - started)
            print(f"round {round_number + 1}/{args.rounds} done", file=sys.stderr)
        gigabytes = size / 1e9
        print(f"{args.tars} tars, {gigabytes:.2f} GB, {records:,} records, {args.workers} workers, warm page cache; "
              f"median of {args.rounds} alternating rounds")  # fmt: skip
        for name, label in (("read", "read every tar once"), ("index", "shardkit index")):
            seconds = statistics.median(runs[name])
            print(f"{label:<22} {seconds:7.2f} s  {gigabytes / seconds:6.2f} GB/s  {seconds / gigabytes:6.2f} s/GB")
        per_round = ratios(runs["index"], runs["read"])
        print(f"index / read: {statistics.median(per_round):.2f}x {span(per_round)}")
    finally:
        if args.keep is None:
            shutil.rmtree(temp, ignore_errors=True)


if __name__ == "__main__":
    main()
