"""The direct download path's CPU: this checkout's urllib3 client against the hand-written
http.client one it replaced (--base-rev, a git worktree), on the same loopback server, in one run.

usage: python scripts/bench_http.py [--base-rev ff0ef36] [--base /tmp/bench_http_base] [--mb 256]
           [--gets 8] [--rounds 5]

A --mb MB file served by `python -m http.server` on 127.0.0.1 (another process: its CPU is not
counted); each revision's `storage.http.get_direct(url, file, None)` in a child process that imports
that revision, --gets downloads a round (each hashed and written to a file in /dev/shm), alternating
which goes first; CPU = the child's user + system seconds for the downloads (time.process_time),
per GB. Prints medians and the median of per-round ratios new / base (the issue's bar: at most 1.10).
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

from benchkit import REPO, base_worktree, environment, pythonpath_env, ratios, remove_worktree, span

sys.path.insert(0, str(REPO))  # tests.servers, and the checkout's shardkit
from shardkit.core.version import __version__
from tests.servers import http_server

CHILD = """
import json, os, sys, time
from shardkit.storage import http
url, gets, target = sys.argv[1], int(sys.argv[2]), sys.argv[3]
http.get_direct(url, target, None)  # warm: imports, the connection
cpu, wall = time.process_time(), time.perf_counter()
for _ in range(gets):
    digest = http.get_direct(url, target, None)
print(json.dumps({"cpu": time.process_time() - cpu, "wall": time.perf_counter() - wall, "digest": digest,
                  "file": http.__file__}))
"""


def measure(args: argparse.Namespace, url: str, shm: Path) -> dict[str, list[dict]]:
    """Each revision's downloads of `url`, --rounds alternating rounds, each in a child process."""
    revisions = {"base": args.base.resolve(), "new": REPO}
    found: dict[str, list[dict]] = {name: [] for name in revisions}
    for round_number in range(args.rounds):
        for name in list(revisions) if round_number % 2 == 0 else list(reversed(revisions)):
            done = subprocess.run(
                [sys.executable, "-c", CHILD, url, str(args.gets), str(shm / name)],
                env=pythonpath_env(revisions[name]), cwd=revisions[name], capture_output=True, text=True,
            )  # fmt: skip
            if done.returncode != 0:
                raise SystemExit(f"{name}: {done.stderr[-2000:]}")
            result = json.loads(done.stdout.strip().splitlines()[-1])
            if Path(result["file"]).resolve().parents[2] != revisions[name]:
                raise SystemExit(f"{name} imported {result['file']}")
            found[name].append(result)
        print(f"round {round_number + 1}/{args.rounds} done", file=sys.stderr)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-rev", default="ff0ef36")
    parser.add_argument("--base", type=Path, default=Path("/tmp/bench_http_base"))
    parser.add_argument("--mb", type=int, default=256)
    parser.add_argument("--gets", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print(environment(__version__))
    made = base_worktree(args.base, args.base_rev)
    temp = Path(tempfile.mkdtemp(prefix="bench-http-"))
    shm = Path(tempfile.mkdtemp(prefix="bench-http-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    try:
        (temp / "files").mkdir()
        (temp / "files" / "blob").write_bytes(os.urandom(args.mb << 20))
        with http_server(temp / "files") as base_url:
            found = measure(args, f"{base_url}/blob", shm)
    finally:
        shutil.rmtree(temp, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
        if made:
            remove_worktree(args.base)
    if len({r["digest"] for rows in found.values() for r in rows}) != 1:
        raise SystemExit("the revisions downloaded different bytes")
    gigabytes = args.gets * args.mb / 1024
    print(f"{args.mb} MB x {args.gets} GETs a round over loopback, {args.rounds} alternating rounds; "
          f"base = {args.base_rev} (http.client), new = this checkout (urllib3)")  # fmt: skip
    for name, rows in found.items():
        cpu = statistics.median(r["cpu"] for r in rows) / gigabytes
        wall = gigabytes / statistics.median(r["wall"] for r in rows)
        print(f"{name:<5} CPU {cpu:6.3f} s/GB   {wall:6.2f} GB/s")
    per_round = ratios([r["cpu"] for r in found["new"]], [r["cpu"] for r in found["base"]])
    print(f"CPU new / base: {statistics.median(per_round):.3f}x {span(per_round)}")


if __name__ == "__main__":
    main()
