"""What a weekly addition costs: `shardkit pack --append` of 10% new images against packing the
whole grown folder again, each as a whole `shardkit` process, in one run.

usage: python scripts/bench_append.py [--images 2000] [--shard-size 100] [--format webdataset] [--repeat 3]

Generated photo-like images (ImageNet's size mix, one corrupt file) are packed at 128 px into
shards of --shard-size. Then 10% more images arrive, two ways: "grown" (new files in the same class
folders: the append walks the whole folder and hashes every input whose key the output holds, to
skip it) and "apart" (a folder of their own, appended with --key-prefix: nothing to hash). Each
append runs on a fresh copy of the output; the baseline packs the grown folder whole. Printed per
case: seconds (median of --repeat, [min-max]), the bytes written beside the output's size, and the
ratio to the whole pack and to the new images packed alone into an empty folder (an append's
floor: the same work, less the skipping); the load average before and after. The inputs are read again before each
timing (this machine drops file pages untouched for ~30 s).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchkit import REPO, compiled, shardkit_timed

SHARDKIT = [sys.executable, "-m", "shardkit"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--images", type=int, default=2000)
    parser.add_argument("--shard-size", type=int, default=100)
    parser.add_argument("--format", default="webdataset")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    from shardkit.synthetic import make_sample_dataset

    compiled()
    print(f"load average before: {os.getloadavg()}")
    with tempfile.TemporaryDirectory(prefix="bench-append-") as temp:
        root = Path(temp)
        new = args.images // 10
        base = make_sample_dataset(root / "base", args.images, classes=10, seed=0)
        apart = make_sample_dataset(root / "apart", new, classes=10, seed=1)
        grown = root / "grown"
        shutil.copytree(base, grown)
        for path in sorted(apart.rglob("*.jpg")):  # the same new images, in the old class folders
            shutil.copy(path, grown / path.parent.name / f"new_{path.name}")
        flags = ["--resize", "128", "--shard-size", str(args.shard_size), "--format", args.format]
        out, whole = root / "out", root / "whole"
        subprocess.run([*SHARDKIT, "pack", str(base), str(out), *flags], check=True, capture_output=True, cwd=REPO)
        size = sum(path.stat().st_size for path in out.iterdir() if path.is_file())
        packs = []
        for _ in range(args.repeat):
            shutil.rmtree(whole, ignore_errors=True)
            packs.append(shardkit_timed(["pack", str(grown), str(whole), *flags], grown))
        packed = statistics.median(packs)
        alone = root / "alone"
        alones = []
        for _ in range(args.repeat):  # what the new images cost packed on their own: the floor of an append
            shutil.rmtree(alone, ignore_errors=True)
            alones.append(shardkit_timed(["pack", str(apart), str(alone), *flags], apart))
        floor = statistics.median(alones)
        print(f"{args.format}: {args.images:,} images packed, {new:,} new; the grown folder packed whole in "
              f"{packed:.2f}s [{min(packs):.2f}-{max(packs):.2f}s], the new ones alone in {floor:.2f}s "
              f"[{min(alones):.2f}-{max(alones):.2f}s] (medians of {args.repeat})")  # fmt: skip
        cases = {"grown": (grown, []), "apart": (apart, ["--key-prefix", "w2/"])}
        for name, (source, extra) in cases.items():
            seconds, written, records, already = [], 0, 0, 0
            for _ in range(args.repeat):
                copy = root / f"copy-{name}"
                shutil.rmtree(copy, ignore_errors=True)
                shutil.copytree(out, copy)
                report = root / "append.json"
                arguments = ["pack", str(source), str(copy), "--append", *extra, "--json", str(report)]
                seconds.append(shardkit_timed(arguments, source))
                result = json.loads(report.read_text())
                written, records, already = result["bytes_written"], result["records"], result["already"]
            median = statistics.median(seconds)
            print(f"  append {name:5s}: {records:,} records added, {already:,} skipped as there already, "
                  f"{written / 1e6:.2f} MB written beside {size / 1e6:.1f} MB, {median:.2f}s "
                  f"[{min(seconds):.2f}-{max(seconds):.2f}s] = {median / packed:.2f}x the whole pack, "
                  f"{median / floor:.2f}x the new ones packed alone")  # fmt: skip
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
