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
import time
import urllib.request
from pathlib import Path

from benchkit import REPO, environment, pythonpath_env, ratios, span

from shardkit.core.version import __version__

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


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def base_worktree(path: Path, revision: str) -> bool:
    if path.exists():
        return False
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(path), revision], check=True,
                   capture_output=True)  # fmt: skip
    return True


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
    (temp / "blob").write_bytes(os.urandom(args.mb << 20))
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory", str(temp)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}/blob"
    try:
        for _ in range(100):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=1).read()
                break
            except OSError:
                time.sleep(0.1)
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
        if len({r["digest"] for rows in found.values() for r in rows}) != 1:
            raise SystemExit("the revisions downloaded different bytes")
        gigabytes = args.gets * args.mb / 1024
        print(f"{args.mb} MB x {args.gets} GETs a round over loopback, {args.rounds} alternating rounds; "
              f"base = {args.base_rev} (http.client), new = this checkout (urllib3)")  # fmt: skip
        for name in revisions:
            cpu = statistics.median(r["cpu"] for r in found[name]) / gigabytes
            wall = gigabytes / statistics.median(r["wall"] for r in found[name])
            print(f"{name:<5} CPU {cpu:6.3f} s/GB   {wall:6.2f} GB/s")
        per_round = ratios([r["cpu"] for r in found["new"]], [r["cpu"] for r in found["base"]])
        print(f"CPU new / base: {statistics.median(per_round):.3f}x {span(per_round)}")
    finally:
        server.kill()
        shutil.rmtree(temp, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
        if made:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(args.base)], check=False)


if __name__ == "__main__":
    main()
