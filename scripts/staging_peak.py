"""The staging folder's peak size during a pack to a bucket, against the size of the output.

A pack to a URL keeps its state in a local staging folder (done markers, index parts, errors) and
the shards its local workers are writing; each shard is uploaded and deleted as soon as it is
written, so the peak should be about workers x a shard, whatever the output's size.

usage: python scripts/staging_peak.py [SRC] [--copies 4] [--shard-size 20] [--workers 2]
                                      [--resize none] [--json PATH]

SRC is a folder of JPEGs (default: the 300-photo ImageNet sample); they are hard-linked --copies
times into class folders and packed with `shardkit pack SRC s3://staging-peak/out` (a subprocess,
the real CLI) into a fresh SeaweedFS S3 server on loopback (tests/servers.py), with --staging in a
temporary folder. Meanwhile the staging folder is walked every few milliseconds: the peak of its
files' total size (and, apart, of the shards being written and of the rest, the pack's state:
done markers, index parts, errors.jsonl and index.parquet before they go up) is printed beside the output's total (every
object the pack left in the bucket) and the largest shard.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchkit import REPO, SAMPLE, environment, jpeg_files, link_classes

sys.path.insert(0, str(REPO))  # tests.servers, and the checkout's shardkit rather than an installed one

BUCKET = "staging-peak"


def folder_size(folder: Path) -> tuple[int, int]:
    """(bytes of every file under `folder`, bytes of the shards being written there) right now;
    files that vanish while they are counted count as gone."""
    total = shards = 0
    for root, _, names in os.walk(folder):
        for name in names:
            try:
                size = os.stat(os.path.join(root, name)).st_size
            except FileNotFoundError:
                continue
            total += size
            if name.startswith("shard-") and name.endswith(".tmp") and ".lock" not in name:
                shards += size
    return total, shards


def measure(source: Path, staging: Path, env: dict[str, str], args: argparse.Namespace) -> dict[str, object]:
    command = [sys.executable, "-m", "shardkit", "pack", str(source), f"s3://{BUCKET}/out", "--staging",
               str(staging), "--shard-size", str(args.shard_size), "--workers", str(args.workers),
               "--resize", args.resize]  # fmt: skip
    started = time.perf_counter()
    run = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    peak = peak_shards = peak_state = samples = 0
    while run.poll() is None:
        total, shards = folder_size(staging)
        peak, peak_shards, peak_state = max(peak, total), max(peak_shards, shards), max(peak_state, total - shards)
        samples += 1
        time.sleep(0.002)
    stdout, stderr = run.communicate()
    if run.returncode != 0:
        raise SystemExit(f"pack failed:\n{stderr}")
    return {"peak_bytes": peak, "peak_shard_bytes": peak_shards, "peak_state_bytes": peak_state, "samples": samples,
            "seconds": time.perf_counter() - started, "summary": stdout}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", nargs="?", type=Path, default=SAMPLE)
    parser.add_argument("--copies", type=int, default=4)
    parser.add_argument("--shard-size", type=int, default=20)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--resize", default="none")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    photos = jpeg_files(args.source)
    if not photos:
        raise SystemExit(f"{args.source}: no JPEGs")

    import s3fs

    from shardkit import __version__
    from tests.servers import start_s3

    with tempfile.TemporaryDirectory(prefix="staging-peak-") as temp:
        root = Path(temp)
        base, tree = root / "base", root / "src"
        base.mkdir()
        for path in photos:  # our own copies: linking to files of others may be refused (protected_hardlinks)
            shutil.copyfile(path, base / path.name)
        link_classes(base, tree, args.copies)
        server = start_s3(root / "seaweed")
        try:
            server.make_bucket(BUCKET)
            paths = [str(REPO), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
            env = {**os.environ, **server.env, "PYTHONPATH": os.pathsep.join(paths), "SHARDKIT_CACHE": str(root)}
            result = measure(tree, root / "staging", env, args)
            fs = s3fs.S3FileSystem(**server.options)
            objects = {path: fs.info(path)["size"] for path in fs.find(f"{BUCKET}/out")}
        finally:
            server.kill()
    names = {path.rsplit("/", 1)[-1]: size for path, size in objects.items()}
    shards = [size for name, size in names.items() if name.startswith("shard-") and not name.endswith(".idx")]
    report = {
        "environment": environment(__version__),
        "images": len(photos) * args.copies,
        "shard_size": args.shard_size,
        "workers": args.workers,
        "output_bytes": sum(objects.values()),
        "objects": len(objects),
        "largest_shard_bytes": max(shards),
        "staging_peak_bytes": result["peak_bytes"],
        "staging_peak_shard_bytes": result["peak_shard_bytes"],
        "staging_peak_state_bytes": result["peak_state_bytes"],
        "samples": result["samples"],
        "seconds": round(float(str(result["seconds"])), 2),
    }
    mib = 1 << 20
    print(
        f"{report['images']} images, {len(shards)} shards of {args.shard_size} in {report['seconds']}s, "
        f"{args.workers} workers\n"
        f"output in the bucket:  {report['output_bytes'] / mib:8.2f} MiB ({len(objects)} objects, "
        f"largest shard {report['largest_shard_bytes'] / mib:.2f} MiB)\n"
        f"staging folder peak:   {report['staging_peak_bytes'] / mib:8.2f} MiB "
        f"(shards being written: {report['staging_peak_shard_bytes'] / mib:.2f} MiB, state: "
        f"{report['staging_peak_state_bytes'] / mib:.2f} MiB; {result['samples']} samples)\n"
        f"peak / output:         {report['staging_peak_bytes'] / report['output_bytes']:8.1%}"
    )
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
