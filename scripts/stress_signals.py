"""Stop signals at random instants: `shardkit pack` and `shardkit verify --deep` (2 workers) sent
SIGTERM, SIGINT or SIGHUP, to the driver or to its whole process group, at a uniformly random
instant from launch to --within seconds (which spans the CLI's import, the pool's start, the work
and the exit), --runs times each. Counts exit codes, stderr line counts, tracebacks, and what was
left behind: running processes of the group, and multiprocessing folders (pymp-*) in a TMPDIR of
its own.

usage: python scripts/stress_signals.py [--runs 200] [--within 1.5] [--images 96]

Every run must end with 128 + the signal and exactly one stderr line, or 0 and no stderr when the
signal came after the command had finished. One thing no program can handle: a signal that lands
before the interpreter has run the first line of shardkit (its own start-up, about 25 ms here)
takes the default action; those runs are counted apart ("before Python ran shardkit"), by the
instant they were sent at, measured against this machine's start-up time in the same run, or (for
SIGINT) by Python's own KeyboardInterrupt traceback from an import, with no shardkit line in it.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from shardkit.synthetic import write_image  # noqa: E402
from tests.test_processes import wait_for_group  # noqa: E402

COMMAND = [sys.executable, "-m", "shardkit"]
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def make_source(root: Path, images: int) -> None:
    """`images` full-size JPEGs in classes of 16 (hard links of the first 16)."""
    for i in range(16):
        write_image(root / "c00" / f"{i:03d}.jpg", 1024, 768, seed=i)
    for c in range(1, max(1, images // 16)):
        (root / f"c{c:02d}").mkdir()
        for original in (root / "c00").iterdir():
            os.link(original, root / f"c{c:02d}" / original.name)


def startup_seconds() -> float:
    """How long the interpreter takes to reach shardkit's first line (`import shardkit`), median of 5."""
    times = []
    for _ in range(5):
        started = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import shardkit"], check=True)
        times.append(time.perf_counter() - started)
    return sorted(times)[2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200, help="runs per command")
    parser.add_argument("--within", type=float, default=1.5, help="latest instant, seconds from launch")
    parser.add_argument("--images", type=int, default=96)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="stress-signals-"))
    temp = work / "tmp"
    temp.mkdir()
    env = {**os.environ, "TMPDIR": str(temp)}
    try:
        make_source(work / "src", args.images)
        subprocess.run([*COMMAND, "pack", str(work / "src"), str(work / "good"), "--resize", "none",
                        "--workers", "2", "--shard-size", "20"], check=True, capture_output=True)  # fmt: skip
        startup = startup_seconds()
        print(f"interpreter start-up to `import shardkit`: {startup * 1000:.0f} ms")
        rng = random.Random(0)
        failures = 0
        for command in ("pack", "verify"):
            codes: collections.Counter[str] = collections.Counter()
            lines: collections.Counter[int] = collections.Counter()
            early = tracebacks = outlived = 0
            bad: list[str] = []
            for run in range(args.runs):
                out = work / "out"
                shutil.rmtree(out, ignore_errors=True)
                argv = (
                    [*COMMAND, "pack", str(work / "src"), str(out), "--resize", "none", "--workers", "2",
                     "--shard-size", "20"]
                    if command == "pack"
                    else [*COMMAND, "verify", str(work / "good"), "--deep", "--workers", "2"]
                )  # fmt: skip
                signum = rng.choice(SIGNALS)
                to_group = rng.random() < 0.5
                delay = rng.uniform(0, args.within)
                process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                           start_new_session=True, env=env)  # fmt: skip
                time.sleep(delay)
                with contextlib.suppress(ProcessLookupError):  # (it had finished)
                    os.killpg(process.pid, signum) if to_group else os.kill(process.pid, signum)
                _, stderr = process.communicate(timeout=120)
                left = wait_for_group(process.pid, 5)
                outlived += bool(left)
                stderr_lines = [line for line in stderr.splitlines() if line.strip()]
                code = process.returncode
                # Before shardkit's first handler: the default action (-signal), or for SIGINT Python's
                # own KeyboardInterrupt, raised in an import (under load start-up takes longer).
                python_own = stderr.rstrip().endswith("\nKeyboardInterrupt") and "shardkit/cli" not in stderr
                if (code == -signum and delay < startup) or python_own:
                    early += 1
                    codes["killed before Python ran shardkit"] += 1
                    continue
                codes[str(code)] += 1
                lines[len(stderr_lines)] += 1
                tracebacks += "Traceback" in stderr
                fine = (code == 128 + signum and len(stderr_lines) == 1) or (code == 0 and not stderr_lines)
                if not fine or left:
                    bad.append(f"  run {run}: {signum.name} to the {'group' if to_group else 'driver'} after "
                               f"{delay * 1000:.0f} ms: exit {code}, {len(left)} left running, stderr: "
                               f"{stderr.strip()[-400:]!r}")  # fmt: skip
            left_folders = sorted(path.name for path in temp.iterdir())
            failures += len(bad) + len(left_folders)
            print(f"\n{command}: {args.runs} runs, signal within {args.within} s of launch")
            print(f"  exit codes: {dict(sorted(codes.items()))}")
            print(f"  stderr lines (runs Python handled): {dict(sorted(lines.items()))}")
            print(f"  tracebacks: {tracebacks}; runs that left a process running: {outlived}")
            print(f"  folders left in TMPDIR: {len(left_folders)} {left_folders[:5]}")
            print(f"  wrong exits: {len(bad)}")
            for line in bad[:10]:
                print(line)
            for path in temp.iterdir():
                shutil.rmtree(path, ignore_errors=True)
        print(f"\n{failures} failures")
        sys.exit(1 if failures else 0)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
