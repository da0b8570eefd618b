"""`shardkit duplicates --near` and `shardkit probe` over a tree of N files, whole-process: time and
peak memory, and what they find against what was planted.

usage: python scripts/bench_duplicates_tree.py N [--tree DIR] [--photos SRC] [--exact 100] [--workers 2]

The tree: N names in class folders of 1300 (n%08d/n%08d_%d.JPEG, .png for a PNG), hard links to D distinct files
kept in the tree's hidden .sources/ (the walk skips hidden names): the photos of SRC (default the
300-photo ImageNet sample), for each photo one planted copy of each kind bench_duplicates.py plants
(JPEG q20, half size, PNG bytes, a 3 % crop, grey, brighter), and --exact byte copies of the first
photos. Names are spread over the files round-robin, so every file has about N/D names.

What the issue asks of both commands at this scale, checked here:
  duplicates  one file however many names reach it (links within a source are not duplicates); every
              photo grouped with its planted copies (recall per kind); the byte copies as exact groups
  probe       the byte copies counted, every other name counted as a link, nothing else

Each command is a subprocess timed from spawn to exit (bench_scale.measure: peak RSS of the process
tree by /proc polling). The tree is walked and read once, untimed, before each (this machine evicts
pages left untouched ~30 s).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from bench_duplicates import KINDS, plant
from bench_scale import PER_CLASS, class_names, cli_command, measure, walk_and_read
from benchkit import REPO, environment, jpeg_files
from PIL import Image

from shardkit import __version__

STAMP = ".bench_duplicates_tree.json"


def build(tree: Path, n: int, photos: Path, exact: int) -> tuple[int, int]:
    """The tree (reused when its stamp matches); returns (photos, distinct files)."""
    originals = jpeg_files(photos)
    wanted = {"n": n, "photos": len(originals), "exact": exact, "kinds": list(KINDS), "png_names": True}
    stamp = tree / STAMP
    if stamp.exists() and json.loads(stamp.read_text()) == wanted:
        print(f"reusing {tree}", flush=True)
        return len(originals), len(originals) * (1 + len(KINDS)) + exact
    if tree.exists():
        shutil.rmtree(tree)
    sources = tree / ".sources"
    sources.mkdir(parents=True)
    files: list[Path] = []
    for i, path in enumerate(originals):
        files.append(Path(shutil.copyfile(path, sources / f"photo_{i:05d}.jpg")))
    for i, path in enumerate(originals):
        image = Image.open(path).convert("RGB")
        files += [plant(image, kind, sources / f"{kind}_{i:05d}") for kind in KINDS]
    for i in range(exact):
        files.append(Path(shutil.copyfile(files[i], sources / f"exact_{i:05d}.jpg")))
    started = time.perf_counter()
    for i, stem in class_names(tree, n):
        target = files[i % len(files)]
        os.link(target, stem + (".png" if target.suffix == ".png" else ".JPEG"))
    print(f"built {tree}: {n:,} names of {len(files):,} files in {time.perf_counter() - started:.0f}s", flush=True)
    stamp.write_text(json.dumps(wanted))
    return len(originals), len(files)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("n", type=int)
    parser.add_argument("--tree", type=Path)
    parser.add_argument("--photos", type=Path, default=REPO.parent / "shared/data/imagenet-sample")
    parser.add_argument("--exact", type=int, default=100)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    if args.n < 2 * 300 * (1 + len(KINDS)):
        sys.exit("N must give every file at least two names")
    tree = args.tree or Path(f"/tmp/duplicates-tree-{args.n}")
    print(environment(__version__))
    photos, distinct = build(tree, args.n, args.photos, args.exact)
    cli = cli_command()
    work = Path(tempfile.mkdtemp(prefix="bench-dup-tree-"))
    try:
        report = work / "duplicates.json"
        walk_and_read(str(tree), args.workers)
        dup = measure("duplicates --near", [*cli, "duplicates", str(tree), "--near", "--json", str(report),
                                            "--workers", str(args.workers)], 0.05)  # fmt: skip
        walk_and_read(str(tree), args.workers)
        probe_report = work / "probe.json"
        probed = measure("probe", [*cli, "probe", str(tree), "--json", str(probe_report),
                                   "--workers", str(args.workers)], 0.05)  # fmt: skip
        for run in (dup, probed):
            if run.rc != 0:
                sys.exit(f"{run.name} failed ({run.rc}): {run.stderr_tail}")
        found = json.loads(report.read_text())
        copies = json.loads(probe_report.read_text())["duplicates"]
    finally:
        shutil.rmtree(work)
    near = [g for g in found["groups"] if g["kind"] == "near"]
    exact = [g for g in found["groups"] if g["kind"] == "exact"]
    group_of: dict[int, int] = {}  # distinct file -> its near group; name i links to file i % distinct
    for number, group in enumerate(near):
        for name in group["files"]:
            label, rank = Path(name).stem[1:].split("_")  # n%08d_RANK.JPEG or .png
            group_of[(int(label) * PER_CLASS + int(rank)) % distinct] = number
    recall = {
        kind: sum(
            1
            for i in range(photos)
            if group_of.get(i) is not None and group_of.get(i) == group_of.get(photos + i * len(KINDS) + k)
        )
        / photos
        for k, kind in enumerate(KINDS)
    }
    print(f"\n{args.n:,} names of {distinct:,} files ({photos} photos, {photos * len(KINDS)} planted near copies, "
          f"{args.exact} byte copies), {args.workers} workers:")  # fmt: skip
    for run in (dup, probed):
        cpu = run.extra["tree_cpu_s"]
        print(f"  {run.name:18s} {run.seconds:7.1f} s  {args.n / run.seconds:9,.0f} names/s  "
              f"peak {run.tree_peak_mb:6.0f} MB (driver {run.driver_peak_mb:.0f} MB)  CPU {cpu} s")  # fmt: skip
    print(f"  duplicates: {found['files']:,} files seen (distinct: {distinct:,}), {len(near)} near groups, "
          f"{len(exact)} exact groups (planted {args.exact}); recall "
          + ", ".join(f"{kind} {share:.0%}" for kind, share in recall.items()))  # fmt: skip
    print(f"  probe: {copies['files']:,} byte copies (planted {args.exact}), {copies['links']:,} links "
          f"(expected {args.n - distinct:,})")  # fmt: skip


if __name__ == "__main__":
    main()
