"""Helpers shared by the benchmark scripts (scripts/bench_*.py), which import it as `benchkit`: they run
as `python scripts/bench_x.py`, so scripts/ is first on sys.path.

Standard library only, and only modules the scripts import anyway: bench_scale times a child process
of itself from spawn to exit, imports included, so importing this must cost that floor nothing more
than reading this one file. Hence no shardkit (its version is passed in), no typing, no statistics.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO.parent / "shared" / "data" / "imagenet-sample"  # the 300-photo ImageNet sample, beside the checkout
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
READ_BYTES = 4096  # a header read: what any probe of a file has to pay at least
WARM_CHUNK = 8 << 20  # read in chunks so that warming a big shard does not hold it all in memory


# ---------------------------------------------------------------------------------------------------
# What the numbers depend on.


def command_output(command: list[str]) -> str:
    """A command's stripped stdout; empty when it fails (a missing git must not lose a run's results)."""
    return subprocess.run(command, capture_output=True, text=True, check=False).stdout.strip()


def environment(shardkit_version: str) -> dict[str, str | int | None]:
    """What the numbers depend on: the code (being edited while we run) and the machine. The version
    is the caller's to find: one script asks the CLI it measures, another the package it imported."""
    dirty = command_output(["git", "-C", str(REPO), "status", "--porcelain", "--", "shardkit"])
    return {
        "shardkit": shardkit_version,
        "commit": command_output(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"]),
        "shardkit_dirty_files": len(dirty.splitlines()),
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
    }


def compiled(checkout: Path = REPO) -> None:
    """`checkout`'s shardkit compiled to bytecode now, as an installed package comes: where
    PYTHONDONTWRITEBYTECODE is set (this machine sets it) no process writes it, and every process
    of a timed run compiled each module it imported again (more so for a base worktree, which
    has never been imported): ~0.1 s of a pack's driver."""
    import compileall

    compileall.compile_dir(str(checkout / "shardkit"), quiet=1)


def pythonpath_env(checkout: Path = REPO) -> dict[str, str]:
    """The environment for a child that must import `checkout`'s shardkit, not whatever is installed."""
    return {**os.environ, "PYTHONPATH": str(checkout)}


# ---------------------------------------------------------------------------------------------------
# Sample data.


def jpeg_files(folder: Path) -> list[Path]:
    """The JPEGs directly in `folder`, sorted so that every run builds the same tree; [] when it is missing."""
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if p.suffix.lower() in (".jpg", ".jpeg") and p.is_file())


def link_classes(base: Path, into: Path, copies: int) -> None:
    """`copies` hard links of every file of `base` in class folders of `into`: the synset prefix of
    ImageNet's names (`n01440764` of `n01440764_tench.JPEG`) is the class, as ImageFolder and pack
    read it. `base` must hold our own copies: fs.protected_hardlinks refuses links to others' files."""
    files = sorted(base.iterdir())
    for copy in range(copies):
        for path in files:
            target = into / path.name.split("_")[0] / f"{copy}_{path.name}"
            target.parent.mkdir(parents=True, exist_ok=True)
            os.link(path, target)


# ---------------------------------------------------------------------------------------------------
# The page cache: this machine evicts file pages left untouched for ~30 s, so what a measurement reads
# is read once, untimed, right before it.


def warm(*folders: Path) -> None:
    """Read every file under `folders` in full."""
    for folder in folders:
        for path in folder.rglob("*"):
            if path.is_file():
                with open(path, "rb", buffering=0) as handle:
                    while handle.read(WARM_CHUNK):
                        pass


def read_heads(paths: Sequence[str]) -> None:
    """Open, read the first READ_BYTES and close every file: the floor a probe is measured against, so
    it is kept to the bare system calls (no pathlib, no buffered file object)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.read(fd, READ_BYTES)
        finally:
            os.close(fd)


# ---------------------------------------------------------------------------------------------------
# CPU time from /proc.


def stat_fields(pid: int) -> list[str] | None:
    """Fields after the comm of /proc/PID/stat (comm may hold spaces and parentheses); None when gone."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def all_pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def descendants(root: int) -> dict[int, list[str]]:
    """root and every process below it, with their stat fields (one pass over /proc/*/stat: this
    kernel has no /proc/PID/task/TID/children)."""
    stats: dict[int, list[str]] = {}
    children: dict[int, list[int]] = {}
    for pid in all_pids():
        fields = stat_fields(pid)
        if fields is not None:
            stats[pid] = fields
            children.setdefault(int(fields[1]), []).append(pid)
    found: dict[int, list[str]] = {}
    stack = [root]
    while stack:
        pid = stack.pop()
        if pid in stats:
            found[pid] = stats[pid]
        stack.extend(children.get(pid, ()))
    return found


def cpu_seconds(fields: list[str]) -> float:
    """utime + stime of a process from its stat fields (14th and 15th, counted with pid and comm)."""
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def cpu_of_tree(root: int) -> float:
    """CPU seconds (user + system) of `root` and every process below it."""
    return sum(cpu_seconds(fields) for fields in descendants(root).values())


# ---------------------------------------------------------------------------------------------------
# Rates and ratios.


def rate(work: Callable[[], object], count: int) -> float:
    """`count` items over the seconds one call of `work` takes."""
    started = time.perf_counter()
    work()
    return count / (time.perf_counter() - started)


def rates(work: Callable[[], object], count: int, repeat: int) -> list[float]:
    return [rate(work, count) for _ in range(repeat)]


def ratios(values: Sequence[float], bases: Sequence[float]) -> list[float]:
    """Per-round ratios: this machine is shared and drifts, so only numbers of the same round are
    compared, and the median of the ratios is reported rather than the ratio of the medians."""
    return [value / base for value, base in zip(values, bases, strict=True)]


def span(values: Sequence[float]) -> str:
    """The range of a set of ratios, as the tables print it next to their median."""
    return f"[{min(values):.2f}-{max(values):.2f}]"


# ---------------------------------------------------------------------------------------------------
# A base revision to measure against, in the same run.


def base_worktree(path: Path, revision: str) -> bool:
    """A worktree of `revision` at `path` with this checkout's compiled extensions; whether it was
    made here (and is to be removed with remove_worktree at the end)."""
    made = False
    if not path.exists():
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(path), revision],
                       check=True, capture_output=True)  # fmt: skip
        made = True
    head = subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
    want = subprocess.run(["git", "-C", str(REPO), "rev-parse", revision], capture_output=True, text=True, check=True)
    if head.stdout != want.stdout:
        raise SystemExit(f"{path} is at {head.stdout.strip()[:10]}, not {revision}")
    for extension in (REPO / "shardkit" / "core").glob("*.so"):
        shutil.copy2(extension, path / "shardkit" / "core" / extension.name)
    compiled(path)
    return made


def remove_worktree(path: Path) -> None:
    subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(path)], check=False)


def shardkit_timed(arguments: list[str], *inputs: Path) -> float:
    """Seconds a whole `shardkit ARGUMENTS` process takes, its `inputs` read just before (this
    machine drops file pages untouched for ~30 s); a failure ends the benchmark, saying why."""
    warm(*inputs)
    command = [sys.executable, "-m", "shardkit", *arguments]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed: {done.stderr.strip()}")
    return time.perf_counter() - started
