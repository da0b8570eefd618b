"""`python -m shardkit ARGS` as a process of its own without paying the interpreter's start and the
CLI's imports each time: a starter process imports what the commands import, once, and forks a
child for each run, which runs the real entry point (shardkit.__main__.main) in a session of its
own, with the run's environment, working folder and output files, and exits as the command does.

For the kill tests, which run a command once for each of the tens of steps it takes and kill it
there (tests/step_kills.py): each run is a whole process group that SIGKILL takes whole, as a
started command is, and the hook of step_kills is installed in the child (and, through the
sitecustomize on PYTHONPATH, in every process it starts) before the command runs. The imports
are what a cold start would pay ~0.8 s for on every run; nothing else is shared: the starter
runs no command itself, and starts no thread, so a fork copies no lock held half way."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# What the commands the kill tests run import (pack's orchestration, the changes, the CLI), in the
# order `shardkit.__main__.run` imports them: runtime.blas before anything imports numpy.
_PRELOAD = [
    "shardkit.__main__", "shardkit.runtime.blas", "shardkit.cli", "shardkit.packing.pack",
    "shardkit.changes.append", "shardkit.changes.remove", "shardkit.changes.compact", "shardkit.changes.merge",
    "pyarrow.parquet",
]  # fmt: skip

_STARTER = """
import importlib, json, os, signal, sys, time
for module in json.loads(sys.argv[1]):
    importlib.import_module(module)
import threading
assert threading.active_count() == 1, threading.enumerate()  # a fork would copy a held lock
print("ready", flush=True)
for line in sys.stdin:
    run = json.loads(line)
    pid = os.fork()
    if pid == 0:
        code = 70
        try:
            os.setsid()
            os.environ.clear()
            os.environ.update(run["env"])
            import tempfile
            tempfile.tempdir = None  # (TMPDIR is the run's: a folder found before the fork is not)
            os.chdir(run["cwd"])
            for fd, name in ((1, "stdout"), (2, "stderr")):
                os.dup2(os.open(run[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
            os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
            if os.environ.get("STEP_KILLS_WATCH"):
                import tests.step_kills
                tests.step_kills.install()
            if run["code"] is None:
                sys.argv = ["shardkit", *run["args"]]
                import shardkit.__main__
                shardkit.__main__.main()
            else:
                sys.argv = ["-c", *run["args"]]
                exec(compile(run["code"], "<string>", "exec"), {"__name__": "__main__"})
            code = 0
        except SystemExit as stop:
            from tests.inprocess import exit_code
            code = exit_code(stop)
        except BaseException:
            import traceback
            traceback.print_exc()
            code = 1
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:
                    pass
            os._exit(code)
    deadline, timed_out = time.monotonic() + run["timeout"], False
    while True:
        ended, status = os.waitpid(pid, os.WNOHANG)
        if ended:
            break
        if not timed_out and time.monotonic() > deadline:  # as subprocess.run's timeout, for the whole group
            os.killpg(pid, signal.SIGKILL)
            timed_out = True
        time.sleep(0.005)
    print(json.dumps([os.waitstatus_to_exitcode(status), timed_out]), flush=True)

"""


class WarmStarter:
    """A starter process (a context manager): `run(args, env)` is `subprocess.run([python, -m,
    shardkit, *args], env=env, start_new_session=True, capture_output=True, text=True)`, and
    `run(args, env, code=CODE)` is the same of `[python, -c, CODE, *args]`. `preload`: more modules
    to import once (what CODE imports)."""

    def __init__(self, preload: tuple[str, ...] = ()) -> None:
        self._folder = Path(tempfile.mkdtemp(prefix="warm-starts"))
        self._process = subprocess.Popen(
            [sys.executable, "-c", _STARTER, json.dumps([*_PRELOAD, *preload])],
            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        assert self._answer() == "ready"

    def _answer(self) -> str:
        assert self._process.stdout is not None
        line = self._process.stdout.readline()
        assert line, f"the starter process ended ({self._process.wait()})"
        return line.strip()

    def run(
        self,
        args: list[str],
        env: dict[str, str],
        cwd: Path | None = None,
        timeout: float = 120,
        code: str | None = None,
    ) -> subprocess.CompletedProcess[str]:
        assert self._process.stdin is not None
        out, err = self._folder / "stdout", self._folder / "stderr"
        request = {
            "args": args, "env": env, "cwd": str(cwd or Path.cwd()), "stdout": str(out), "stderr": str(err),
            "timeout": timeout, "code": code,
        }  # fmt: skip
        self._process.stdin.write(json.dumps(request) + "\n")
        self._process.stdin.flush()
        exit_code, timed_out = json.loads(self._answer())
        if timed_out:
            raise subprocess.TimeoutExpired(["shardkit", *args], timeout, out.read_text(), err.read_text())
        command = ["shardkit", *args] if code is None else ["python", "-c", code, *args]
        return subprocess.CompletedProcess(command, exit_code, out.read_text(), err.read_text())

    def __enter__(self) -> WarmStarter:
        return self

    def __exit__(self, *raised: object) -> None:
        assert self._process.stdin is not None
        self._process.stdin.close()
        self._process.wait(timeout=30)
        for name in ("stdout", "stderr"):
            (self._folder / name).unlink(missing_ok=True)
        self._folder.rmdir()
