"""Reading a remote output through the shard cache, cold and warm, over the direct download path
(http) and over S3 (a SeaweedFS server): this checkout against another revision (--base-rev, a git
worktree), in one run, alternating.

usage: python scripts/bench_cache.py [--base-rev ff0ef36] [--base /tmp/bench_cache_base]
           [--images 4000] [--shard-size 100] [--rounds 5]

--images synthetic photos (200 distinct, hard-linked into classes; 320x256) are packed once into
webdataset shards, served from a folder by `python -m http.server` and uploaded to a bucket of a
fresh SeaweedFS server, both on loopback. A round runs, for each revision (order alternating by
round), in a child process importing that revision: `open_shards(URL, decode="bytes",
cache_dir=fresh)` and one epoch (cold: every shard downloaded, checked and cached, the next ones
prefetched), then a second epoch on the same cache (warm). decode="bytes" leaves the storage path as
most of the work. The child's wall and CPU seconds (time.process_time: its own threads, not the
server's) are per epoch. This machine evicts file pages left alone for ~30 s: the served files are
read right before a cold epoch and the cached files right before a warm one. Prints medians and the
median of per-round ratios new / base (wall: above 1 means slower; the issue's bar: nothing slower).
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

from benchkit import REPO, base_worktree, environment, pythonpath_env, ratios, remove_worktree, span, warm

sys.path.insert(0, str(REPO))
from shardkit import __version__
from tests.servers import http_server, s3_server

CHILD = """
import json, sys, time
from pathlib import Path
import shardkit
from shardkit.readers import open_shards
url, cache, options = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])

def epoch():
    dataset = open_shards(url, decode="bytes", cache_dir=cache, storage_options=options or None)
    wall, cpu = time.perf_counter(), time.process_time()
    count = sum(1 for _ in dataset.iterable())
    return {"wall": time.perf_counter() - wall, "cpu": time.process_time() - cpu, "records": count}

cold = epoch()
for path in Path(cache).rglob("*"):  # (pages of the cache: read untimed, as the docstring says)
    if path.is_file():
        path.read_bytes()
warm = epoch()
print(json.dumps({"cold": cold, "warm": warm, "file": shardkit.__file__}))
"""


def measure(args: argparse.Namespace, where: dict[str, tuple[str, dict[str, str]]], served: Path, temp: Path):
    revisions = {"base": args.base.resolve(), "new": REPO}
    found: dict[tuple[str, str], list[dict]] = {}
    for round_number in range(args.rounds):
        for name in list(revisions) if round_number % 2 == 0 else list(reversed(revisions)):
            for store, (url, options) in where.items():
                cache = temp / f"cache-{name}-{store}-{round_number}"
                warm(served)
                done = subprocess.run(
                    [sys.executable, "-c", CHILD, url, str(cache), json.dumps(options)],
                    env=pythonpath_env(revisions[name]), cwd=revisions[name], capture_output=True, text=True,
                )  # fmt: skip
                shutil.rmtree(cache, ignore_errors=True)
                if done.returncode != 0:
                    raise SystemExit(f"{name} {store}: {done.stderr[-2000:]}")
                result = json.loads(done.stdout.strip().splitlines()[-1])
                if Path(result["file"]).resolve().parents[1] != revisions[name]:
                    raise SystemExit(f"{name} imported {result['file']}")
                found.setdefault((name, store), []).append(result)
        print(f"round {round_number + 1}/{args.rounds} done", file=sys.stderr)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-rev", default="ff0ef36")
    parser.add_argument("--base", type=Path, default=Path("/tmp/bench_cache_base"))
    parser.add_argument("--images", type=int, default=4000)
    parser.add_argument("--shard-size", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print(environment(__version__))
    made = base_worktree(args.base, args.base_rev)
    temp = Path(tempfile.mkdtemp(prefix="bench-cache-"))
    try:
        from shardkit import PackConfig, ResizeConfig, pack
        from shardkit.synthetic import write_image

        for i in range(200):  # 200 photos, hard-linked into classes up to --images
            write_image(temp / "src" / "c000" / f"{i:03d}.jpg", 320, 256, seed=i)
        for c in range(1, args.images // 200):
            (temp / "src" / f"c{c:03d}").mkdir()
            for original in (temp / "src" / "c000").iterdir():
                os.link(original, temp / "src" / f"c{c:03d}" / original.name)
        out = temp / "served" / "out"
        pack(PackConfig(str(temp / "src"), str(out), format="webdataset", resize=ResizeConfig(256),
                        shard_size=args.shard_size, workers=2))  # fmt: skip
        with http_server(temp / "served") as base_url, s3_server(temp / "s3") as s3:
            import s3fs

            s3.make_bucket("bench")
            s3fs.S3FileSystem(**s3.options).put(str(out), "bench/out", recursive=True)
            where = {"http": (f"{base_url}/out", {}), "s3": ("s3://bench/out", s3.options)}
            found = measure(args, where, temp / "served", temp)
    finally:
        shutil.rmtree(temp, ignore_errors=True)
        if made:
            remove_worktree(args.base)
    print(f"{args.images} images in shards of {args.shard_size}, {args.rounds} alternating rounds; "
          f"base = {args.base_rev}, new = this checkout")  # fmt: skip
    for store in ("http", "s3"):
        for phase in ("cold", "warm"):
            rows = {name: [r[phase] for r in found[(name, store)]] for name in ("base", "new")}
            if len({r["records"] for values in rows.values() for r in values}) != 1:
                raise SystemExit(f"{store} {phase}: the revisions read different record counts")
            walls = ratios([r["wall"] for r in rows["new"]], [r["wall"] for r in rows["base"]])
            cpus = ratios([r["cpu"] for r in rows["new"]], [r["cpu"] for r in rows["base"]])
            base_wall = statistics.median(r["wall"] for r in rows["base"])
            new_wall = statistics.median(r["wall"] for r in rows["new"])
            print(f"{store:<4} {phase}: base {base_wall:6.3f} s, new {new_wall:6.3f} s; wall new/base "
                  f"{statistics.median(walls):.3f}x {span(walls)}, CPU new/base {statistics.median(cpus):.3f}x "
                  f"{span(cpus)}")  # fmt: skip


if __name__ == "__main__":
    os.environ.setdefault("SHARDKIT_RETRY_SECONDS", "30")
    main()
