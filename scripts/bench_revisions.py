"""Is this checkout slower than another revision? Pack throughput and shard reading, both measured
in the same run, interleaved round by round (this machine is shared and drifts; compare ratios).

usage: python scripts/bench_revisions.py BASE_CHECKOUT SRC [--rounds 5] [--copies 4] [--workers 2]

BASE_CHECKOUT is another clone or worktree of shardkit (e.g. `git worktree add /tmp/base main`; build
its scanner with `python setup.py build_ext --inplace` there). Each round packs SRC (hard-linked
`--copies` times, so a pack lasts a few seconds) into every format with both revisions, then runs
full passes of iteration over the same shards with both (decoded, and bytes only: 20 passes, so
that a pass is long enough to time), and `shardkit bench`'s paired reader overhead. Times are taken
inside the process (no interpreter start-up). Prints the median of the per-round ratios (this / base;
above 1 means this checkout is faster) with their range.
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

from benchkit import REPO, compiled, pythonpath_env, ratios, span, warm

PACK = """
import json, sys, time
from shardkit import PackConfig, ResizeConfig, pack  # the public API: the same in every revision
started = time.perf_counter()
result = pack(PackConfig(sys.argv[1], sys.argv[2], format=sys.argv[3], resize=ResizeConfig(256),
                         workers=int(sys.argv[4]), overwrite=True))
print(json.dumps({"seconds": time.perf_counter() - started, "records": result.records}))
"""
READ = """
import json, statistics, sys, time
from shardkit.readers import open_shards
dataset = open_shards(sys.argv[1], decode=sys.argv[2])
for _ in dataset:  # warm: page cache, lazy opens
    pass
seconds = []
for _ in range(int(sys.argv[3])):
    started = time.perf_counter()
    count = sum(1 for _ in dataset)
    seconds.append((time.perf_counter() - started) / count)
print(json.dumps(statistics.median(seconds)))
"""


def run(checkout: Path, *args: str) -> str:
    compiled(checkout)
    environment = pythonpath_env(checkout)
    # cwd: `python -c` puts the working folder ahead of PYTHONPATH, so run from the repo root the
    # "base" children would import this checkout and compare it with itself
    done = subprocess.run(
        [sys.executable, *args], env=environment, cwd=checkout, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise SystemExit(f"{checkout}: {' '.join(args[:3])} failed:\n{done.stderr[-2000:]}")
    return done.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base", type=Path)
    parser.add_argument("source", type=Path)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--copies", type=int, default=4)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--formats", default="webdataset,lmdb,hdf5")
    args = parser.parse_args()
    revisions = {"this": REPO, "base": args.base.resolve()}
    for checkout in revisions.values():  # each child must import its own revision, or the ratios mean nothing
        where = Path(run(checkout, "-c", "import shardkit; print(shardkit.__file__)").strip()).resolve()
        if checkout not in where.parents:
            raise SystemExit(f"{checkout}: its children import shardkit from {where}")
    formats = args.formats.split(",")
    pack_seconds = {(rev, name): [] for rev in revisions for name in formats}
    reading = {(rev, name): [] for rev in revisions for name in formats}
    with tempfile.TemporaryDirectory(prefix="shardkit-revisions-") as temp:
        source = Path(temp) / "source"
        for copy in range(args.copies):
            shutil.copytree(args.source, source / f"copy{copy}", copy_function=os.link)
        for round_number in range(args.rounds):
            order = list(revisions) if round_number % 2 == 0 else list(reversed(revisions))
            for name in formats:
                for rev in order:
                    warm(source)
                    out = Path(temp) / f"{rev}-{name}"
                    result = json.loads(run(revisions[rev], "-c", PACK, str(source), str(out), name, str(args.workers)))
                    pack_seconds[(rev, name)].append(result["seconds"] / result["records"])
                out = Path(temp) / f"base-{name}"  # the same shards for both readers
                for rev in order:
                    warm(out)
                    decoded = json.loads(run(revisions[rev], "-c", READ, str(out), "rgb", "3"))
                    raw = json.loads(run(revisions[rev], "-c", READ, str(out), "bytes", "20"))
                    report = Path(temp) / f"{rev}.json"
                    run(revisions[rev], "-m", "shardkit", "bench", str(out), "--repeat", "3", "--json", str(report))
                    overhead = json.loads(report.read_text())["reader_overhead"]
                    reading[(rev, name)].append((1 / decoded, 1 / raw, overhead))
            print(f"round {round_number + 1}/{args.rounds} done", file=sys.stderr)
    print(f"{args.copies} x {args.source} ({args.rounds} rounds, {args.workers} pack workers); ratio = this / base")
    for name in formats:
        this, base = reading[("this", name)], reading[("base", name)]
        pack_ratio = ratios(pack_seconds[("base", name)], pack_seconds[("this", name)])  # seconds: base over this
        decode = ratios([t[0] for t in this], [b[0] for b in base])
        raw = ratios([t[1] for t in this], [b[1] for b in base])
        this_overhead = statistics.median(t[2] for t in this)
        base_overhead = statistics.median(b[2] for b in base)
        print(
            f"{name:>10}: pack {statistics.median(pack_ratio):.3f}x {span(pack_ratio)}  "
            f"read+decode {statistics.median(decode):.3f}x {span(decode)}  "
            f"bytes-only {statistics.median(raw):.3f}x {span(raw)}  "
            f"reader overhead {this_overhead:+.1%} (base {base_overhead:+.1%})"
        )


if __name__ == "__main__":
    main()
