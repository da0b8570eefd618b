"""`python -m shardkit ARGS` as a process of its own without paying the interpreter's start and the
CLI's imports each time: a starter process imports what the commands import, once, and forks a
child for each run, which runs the real entry point (shardkit.__main__.main) in a session of its
own, with the run's environment (and what the imports set in it: runtime.blas's BLAS threads),
working folder and stdin, its output read to the end as subprocess.run's is (every process of the
run done with it), and exits as the command does.

For the kill tests, which run a command once for each of the tens of steps it takes and kill it
there (tests/step_kills.py): each run is a whole process group that SIGKILL takes whole, as a
started command is, and the hook of step_kills is installed in the child (and, through the
sitecustomize on PYTHONPATH, in every process it starts) before the command runs. The imports
are what a cold start would pay ~0.8 s for on every run; nothing else is shared: the starter
runs no command itself and starts no Python thread, so a fork copies no lock held half way
(pyarrow's allocator keeps a native thread; jemalloc's own fork handlers cover it)."""

from __future__ import annotations

import json
import os
import shutil
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
import importlib, json, os, select, signal, sys, time
started = dict(os.environ)
for module in json.loads(sys.argv[1]):
    importlib.import_module(module)
set_by_imports = {k: v for k, v in os.environ.items() if started.get(k) != v}  # (runtime.blas's)
import threading
assert threading.active_count() == 1, threading.enumerate()  # a fork would copy a held lock
print("ready", flush=True)


def child(run, out, err):
    code = 70
    try:
        os.dup2(out, 1)  # the run's output first: anything that fails below is said there
        os.dup2(err, 2)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.setsid()
        os.environ.clear()
        os.environ.update(run["env"])
        for name, value in set_by_imports.items():
            os.environ.setdefault(name, value)
        import tempfile
        tempfile.tempdir = None  # (TMPDIR is the run's: a folder found before the fork is not)
        timeline = sys.modules.get("shardkit.runtime.timeline")
        if timeline is not None:
            timeline._PATH = os.environ.get(timeline.TIMELINE_ENV)  # (read at its import)
        os.chdir(run["cwd"])
        if os.environ.get("STEP_KILLS_WATCH"):
            import tests.step_kills
            tests.step_kills.install()
        if run["code"] is None:
            sys.argv = ["shardkit", *run["args"]]
            import shardkit.__main__
            shardkit.__main__.main()  # (ends the process as the command does)
        else:
            sys.argv = ["-c", *run["args"]]
            exec(compile(run["code"], "<string>", "exec"), {"__name__": "__main__"})
            import atexit
            atexit._run_exitfuncs()  # as a `python -c` does at its end
        code = 0
    except SystemExit as stop:
        from tests.inprocess import exit_code
        code = exit_code(stop)
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
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


for line in sys.stdin:
    run = json.loads(line)
    (out_read, out_write), (err_read, err_write) = os.pipe(), os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(out_read)
        os.close(err_read)
        child(run, out_write, err_write)
    os.close(out_write)
    os.close(err_write)
    # As subprocess.run(capture_output=True): read both pipes to their end, which comes once every
    # process of the run (what it started too) has let go of them; at the timeout, the whole
    # group is killed.
    files = {out_read: open(run["stdout"], "wb"), err_read: open(run["stderr"], "wb")}
    deadline, timed_out = time.monotonic() + run["timeout"], False
    while files:
        ready, _, _ = select.select(list(files), [], [], 0.1)
        for fd in ready:
            data = os.read(fd, 1 << 16)
            if data:
                files[fd].write(data)
            else:
                files.pop(fd).close()
                os.close(fd)
        if not timed_out and time.monotonic() > deadline:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            timed_out = True
    _, status = os.waitpid(pid, 0)
    print(json.dumps([os.waitstatus_to_exitcode(status), timed_out]), flush=True)
"""


class WarmStarter:
    """A starter process (a context manager): `run(args, env)` is `subprocess.run([python, -m,
    shardkit, *args], env=env, start_new_session=True, capture_output=True, text=True)`, and
    `run(args, env, code=CODE)` is the same of `[python, -c, CODE, *args]`. `preload`: more modules
    to import once (what CODE imports)."""

    def __init__(self, preload: tuple[str, ...] = ()) -> None:
        self._folder = Path(tempfile.mkdtemp(prefix="warm-starts"))
        self._runs = 0
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
        self._runs += 1
        out, err = self._folder / f"{self._runs}.stdout", self._folder / f"{self._runs}.stderr"
        request = {
            "args": args, "env": env, "cwd": str(cwd or Path.cwd()), "stdout": str(out), "stderr": str(err),
            "timeout": timeout, "code": code,
        }  # fmt: skip
        self._process.stdin.write(json.dumps(request) + "\n")
        self._process.stdin.flush()
        exit_code, timed_out = json.loads(self._answer())
        if timed_out:
            raise subprocess.TimeoutExpired(["shardkit", *args], timeout, out.read_bytes(), err.read_bytes())
        command = ["shardkit", *args] if code is None else ["python", "-c", code, *args]
        said = subprocess.CompletedProcess(command, exit_code, out.read_text(), err.read_text())
        out.unlink()
        err.unlink()
        return said

    def __enter__(self) -> WarmStarter:
        return self

    def __exit__(self, *raised: object) -> None:
        assert self._process.stdin is not None
        self._process.stdin.close()  # (the starter ends at its input's end, once a run under way ends)
        try:
            self._process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        shutil.rmtree(self._folder, ignore_errors=True)
