"""Metadata tables at scale: the driver's memory on a huge table, and pack speed with captions
against the same images without them, measured in the same run.

usage: python scripts/bench_tables.py [SRC] [--rows 10000000] [--copies 8] [--rounds 3] [--kind jsonl]

memory: a table of --rows rows (captions of ~100 characters and two columns) naming --rows hard
links to a few photos is walked and planned the way pack's driver does it (both table passes, the
walk for images without a row, shards cut), in a child process whose peak RSS is reported.
speed: SRC (hard-linked --copies times) packed as a plain folder and as the same folder with a
metadata.jsonl giving every image a caption and columns, alternating, --rounds times; prints the
median ratio (with captions / without; 1.0 means the same speed) and its range.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchkit import SAMPLE, compiled, jpeg_files, pythonpath_env, ratios, span, warm

WALK = """
import resource, sys, time
from shardkit.packing.sources import walk
from shardkit.packing.plan import plan_shards
started = time.perf_counter()
found = walk(sys.argv[1])
items = shards = 0
for spec in plan_shards(found.items, suffix=".tar", shard_size=1000):
    shards += 1
    items += len(spec.items)
seconds = time.perf_counter() - started
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(items, len(found.skipped), shards, f"{seconds:.1f}", f"{peak:.0f}")
"""


def caption(i: int) -> str:
    return f"photo {i}: a tabby cat sitting on a sunny windowsill, looking at the birds outside — №{i % 997}"


def build_huge(root: Path, rows: int, kind: str) -> Path:
    """`rows` hard links in folders of 10,000, and a table naming each of them once."""
    photos = jpeg_files(SAMPLE)[:8] or [root.parent / "seed.jpg"]
    if not photos[0].exists():
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from shardkit.synthetic import write_image

        write_image(photos[0], 320, 240)
    source = root / "huge"
    # a file takes at most 65,000 links (ext4): a copy of a photo for every 50,000 rows
    seeds = []
    for i in range(-(-rows // 50_000)):
        seeds.append(root / "seeds" / f"{i}.jpg")
        seeds[-1].parent.mkdir(exist_ok=True)
        shutil.copyfile(photos[i % len(photos)], seeds[-1])
    names = []
    for i in range(rows):
        folder = source / f"{i // 10_000:05d}"
        if i % 10_000 == 0:
            folder.mkdir(parents=True)
        name = f"{i // 10_000:05d}/{i:08d}.jpg"
        os.link(seeds[i // 50_000], source / name)
        names.append(name) if kind == "parquet" else None
    if kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pa.table(
            {
                "file_name": names,
                "caption": [caption(i) for i in range(rows)],
                "aesthetic": [i % 10 / 10 for i in range(rows)],
                "tags": [["cat", "window"]] * rows,
            }
        )
        pq.write_table(table, source / "metadata.parquet", row_group_size=100_000)
    else:
        with open(source / "metadata.jsonl", "w", encoding="utf-8") as out:
            for i in range(rows):
                row = {"file_name": f"{i // 10_000:05d}/{i:08d}.jpg", "caption": caption(i), "aesthetic": i % 10 / 10}
                out.write(json.dumps({**row, "tags": ["cat", "window"]}, ensure_ascii=False) + "\n")
    return source


def memory(rows: int, kind: str, keep: Path | None) -> None:
    with tempfile.TemporaryDirectory(prefix="shardkit-tables-", dir=keep) as temp:
        started = time.perf_counter()
        source = build_huge(Path(temp), rows, kind)
        print(f"built {rows:,} links and a {kind} table in {time.perf_counter() - started:.0f}s", file=sys.stderr)
        done = subprocess.run(
            [sys.executable, "-c", WALK, str(source)], capture_output=True, text=True, env=pythonpath_env()
        )
        if done.returncode != 0:
            raise SystemExit(done.stderr[-3000:])
        items, skipped, shards, seconds, peak = done.stdout.split()
        print(f"{kind} table, {rows:,} rows: {int(items):,} items, {int(skipped):,} errors, {int(shards):,} shards "
              f"planned in {seconds}s; driver peak RSS {peak} MB")  # fmt: skip


def speed(source: Path, copies: int, rounds: int) -> None:
    with tempfile.TemporaryDirectory(prefix="shardkit-tables-") as temp:
        plain = Path(temp) / "plain"
        for copy in range(copies):
            shutil.copytree(source, plain / f"copy{copy}", copy_function=os.link)
        captioned = Path(temp) / "captioned"
        shutil.copytree(plain, captioned, copy_function=os.link)
        images = sorted(path.relative_to(captioned).as_posix() for path in captioned.rglob("*") if path.is_file())
        with open(captioned / "metadata.jsonl", "w", encoding="utf-8") as out:
            for i, name in enumerate(images):
                row = {"file_name": name, "caption": caption(i), "label": name.split("/")[1], "aesthetic": i % 10}
                out.write(json.dumps(row, ensure_ascii=False) + "\n")
        seconds: dict[str, list[float]] = {"plain": [], "captioned": []}
        for round_number in range(rounds):
            order = ["plain", "captioned"] if round_number % 2 == 0 else ["captioned", "plain"]
            for name in order:
                warm(plain)
                out = Path(temp) / f"out-{name}"
                extra = ["--label-column", "label"] if name == "captioned" else []
                started = time.perf_counter()
                subprocess.run(
                    [sys.executable, "-m", "shardkit", "pack", str(Path(temp) / name), str(out), "--overwrite",
                     "--resize", "256", "--workers", "2", *extra],
                    check=True, capture_output=True, env=pythonpath_env(),
                )  # fmt: skip
                seconds[name].append(time.perf_counter() - started)
        speeds = ratios(seconds["plain"], seconds["captioned"])  # captioned speed / plain speed
        median = sorted(speeds)[len(speeds) // 2]
        print(f"{len(images):,} images, {rounds} rounds, 2 workers: pack with captions and columns at "
              f"{median:.3f}x the speed of the same images without {span(speeds)}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path, nargs="?", default=SAMPLE)
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--kind", choices=["jsonl", "parquet"], default="jsonl")
    parser.add_argument("--copies", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", choices=["memory", "speed"])
    parser.add_argument("--tmp", type=Path, help="where to build the huge source (default: the system's temp)")
    args = parser.parse_args()
    compiled()
    if args.only != "speed":
        memory(args.rows, args.kind, args.tmp)
    if args.only != "memory":
        speed(args.source, args.copies, args.rounds)
    print(f"(this process: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB)", file=sys.stderr)


if __name__ == "__main__":
    main()
