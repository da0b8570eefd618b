"""Kill a pack at one step of its own: a test-only hook, loaded into every process of a pack run
as a subprocess (the driver, the forkserver, the workers) through a `sitecustomize` on PYTHONPATH
(`hooked_env`), that watches the calls which change the file system (mkdir, a file created, replace,
unlink, rmdir) and the source folder's listings (the walk). Each call under a watched folder is a
step, named by what it did and where ("replace out/shard-000001.lmdb"; a process id or mkstemp's
random part in a name is written PID or RANDOM, so names repeat from run to run; a second time in
one process adds " #2"). A call that changes nothing (a missing file unlinked, a folder made that
exists) is no step. Nothing in the library knows of it.

STEP_KILLS_WATCH: the folders watched (os.pathsep between them), names relative to the first's parent;
STEP_KILLS_LOG: a file each step is appended to, as "<pid> <step>";
STEP_KILLS_AT: the step just after which the whole process group gets SIGKILL (start the pack in a
session of its own): nothing of the pack runs past it, in any of its processes."""

from __future__ import annotations

import builtins
import io
import os
import re
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

SITECUSTOMIZE = "import tests.step_kills\ntests.step_kills.install()\n"
REPO = Path(__file__).resolve().parent.parent


def hooked_env(hook: Path, watched: list[Path], **variables: str) -> dict[str, str]:
    """The environment of a pack run with the hook: `hook`, a folder, gets the sitecustomize."""
    hook.mkdir(parents=True, exist_ok=True)
    (hook / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return {
        **os.environ, "PYTHONPATH": os.pathsep.join([str(hook), str(REPO)]),
        "STEP_KILLS_WATCH": os.pathsep.join(map(str, watched)),
        **{f"STEP_KILLS_{name.upper()}": value for name, value in variables.items()},
    }  # fmt: skip


def install() -> None:
    watched = os.environ.get("STEP_KILLS_WATCH")
    if not watched:
        return
    roots = watched.split(os.pathsep)
    base = os.path.dirname(roots[0])
    log, at = os.environ.get("STEP_KILLS_LOG"), os.environ.get("STEP_KILLS_AT")
    seen: dict[str, int] = {}

    def step(op: str, path: Any) -> None:
        where = os.path.abspath(os.fsdecode(path))
        if not any(where == root or where.startswith(root + os.sep) for root in roots):
            return
        name = f"{op} {os.path.relpath(where, base)}"
        name = re.sub(r"\.[a-z0-9_]{8}\.tmp$", ".RANDOM.tmp", re.sub(r"\.\d+\.tmp$", ".PID.tmp", name))
        seen[name] = seen.get(name, 0) + 1
        if seen[name] > 1:
            name += f" #{seen[name]}"
        if log:
            fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            os.write(fd, f"{os.getpid()} {name}\n".encode())
            os.close(fd)
        if name == at:
            os.killpg(os.getpgrp(), signal.SIGKILL)

    def watch(op: str, call: Callable[..., Any], which: int = 0, when: Callable[..., bool] | None = None) -> Any:
        def watched_call(*args: Any, **kwargs: Any) -> Any:
            path = args[which] if len(args) > which else None
            if isinstance(path, int) or path is None or (when is not None and not when(*args, **kwargs)):
                return call(*args, **kwargs)
            new = op != "create" or not os.path.lexists(path)
            result = call(*args, **kwargs)  # (one that raises is no step)
            if new:
                step(op, path)
            return result

        return watched_call

    def writes(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> bool:
        return any(c in mode for c in "wxa+")

    def creates(path: Any, flags: int, *args: Any, **kwargs: Any) -> bool:
        return bool(flags & os.O_CREAT)

    os.replace = watch("replace", os.replace, 1)
    os.rename = watch("replace", os.rename, 1)
    os.unlink = os.remove = watch("unlink", os.unlink)
    os.rmdir = watch("rmdir", os.rmdir)
    os.mkdir = watch("mkdir", os.mkdir)
    os.scandir = watch("scandir", os.scandir)
    os.open = watch("create", os.open, 0, creates)
    io.open = builtins.open = watch("create", io.open, 0, writes)
    # shutil, imported after these (a process hooked at its start), finds os.open and os.unlink not
    # among the functions that take dir_fd and removes trees by path, a step each: the same where it
    # was imported before (a run forked from tests/warm_starts.py), or its fd-relative removals
    # would be no steps.
    import shutil

    shutil._use_fd_functions = False  # type: ignore[attr-defined]


def every_step_finishes(
    out: Path,
    source: Path | None,
    command: list[str],
    finish: Callable[[], Any],
    expected: dict[str, bytes | None],
    hook: Path,
    *,
    checked: Callable[[Path], str | None] | None = None,
) -> list[str]:
    """Run `command` (a change of `out`, made afresh from `source` each time, or from nothing) once
    with the hook logging its steps, then once killed after each step: `checked(out)` says what is
    wrong with the killed output (None: nothing), and `finish()` (a CompletedProcess) must leave
    `out` exactly `expected`. What went wrong, a line per step (empty: nothing). `command` is
    `python -m shardkit ...`, each run a process group of its own, started warm
    (tests/warm_starts.py)."""
    import shutil
    import subprocess

    from tests.test_pack_kills import differences, snapshot
    from tests.warm_starts import WarmStarter

    def fresh() -> None:
        shutil.rmtree(out, ignore_errors=True)
        if source is not None:
            shutil.copytree(source, out)

    assert command[:3] == [sys.executable, "-m", "shardkit"], command  # (run by a warm starter)
    with WarmStarter() as starter:

        def run(**variables: str) -> subprocess.CompletedProcess[str]:
            return starter.run(command[3:], hooked_env(hook, [out], **variables))

        log = hook.parent / f"{hook.name}-steps.log"
        fresh()
        logged = run(log=str(log))
        assert logged.returncode == 0, logged.stderr
        assert snapshot(out) == expected  # (the hook itself changes nothing)
        # every step but a temporary file's creation (the rename that follows it leaves what it leaves)
        steps = [line.split(" ", 1)[1] for line in log.read_text().splitlines() if not line.endswith(".RANDOM.tmp")]
        assert any(step.startswith(f"replace {out.name}/manifest.json") for step in steps), steps
        failed = []
        for step in steps:
            fresh()
            killed = run(at=step)
            assert killed.returncode == -signal.SIGKILL, (
                f"{step}: not killed there ({killed.returncode}) {killed.stderr}"
            )
            wrong = checked(out) if checked is not None else None
            if wrong:
                failed.append(f"{step}: the killed output: {wrong}")
            done = finish()
            if done.returncode != 0:
                failed.append(f"{step}: finishing failed: {done.stderr.strip()}")
            elif snapshot(out) != expected:
                failed.append(f"{step}: differs from the clean run in {differences(snapshot(out), expected)}")
    return failed


def unfinished_said(out: Path) -> str | None:
    """What is wrong with what a reader says of a killed output that has no manifest yet: it names
    the unfinished pack or merge its working folder holds, and the command that finishes it (None:
    nothing wrong). (A change of an output that has a manifest is read at its old version.)"""
    state = out / ".shardkit"
    if (out / "manifest.json").exists() or not any((state / name).exists() for name in ("change.json", "state.json")):
        return None
    from shardkit.core.errors import ManifestError
    from shardkit.readers import open_shards

    if (state / "change.json").exists():  # (only a merge makes a new folder)
        wanted = ["no manifest yet: a merge into it began and has not", "`shardkit merge ", "--resume` finishes"]
    else:
        wanted = ["no manifest yet: a pack into it began and has not finished", "`shardkit pack` with --resume"]
    try:
        open_shards(out)
    except ManifestError as error:
        return None if all(words in str(error) for words in wanted) else str(error)
    return "open_shards read a folder with no manifest"
