"""`shardkit ARGS` run in the test's own process: the real entry point (shardkit.__main__.run, what
the `shardkit` script's main() runs before it exits the process) with sys.argv set, its exit code and its output as a
subprocess would give them, without an interpreter start and the CLI's imports (torch for some
commands) each time.

For what a command says and how it exits. Whatever needs a real process (signals, kill -9, the exit
code the interpreter itself gives, start-up time and imports, stdin and terminals) stays a
subprocess in the tests that check it.

Everything the run changes in the process is put back: the signal handlers (run() installs its own
before the CLI does), the blocked signals, sys.unraisablehook (the CLI's, and pytest's before it),
sys.argv, the working folder and the variables asked for. Warnings are shown on stderr as Python
shows them in a fresh process (pytest would otherwise collect them), so that a test of "one line on
stderr" still sees one. (What is left: the CLI registers, once, an exit handler that ignores stop
signals while the interpreter shuts down, and the library's note that a command's work is over,
which only its own stop handlers read.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import warnings
from collections.abc import Mapping

import pytest

# Python's own filters in a fresh process (no -W, no PYTHONWARNINGS): these categories are hidden.
_HIDDEN_BY_DEFAULT = (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning)
_UNCATCHABLE = {signal.SIGKILL, signal.SIGSTOP}


def _show_on_stderr(message, category, filename, lineno, file=None, line=None) -> None:
    sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


def signal_state() -> tuple[dict[int, object], set[int]]:
    """The Python-level handler of every signal that can have one, and the blocked signals."""
    handlers = {int(s): signal.getsignal(s) for s in signal.valid_signals() if s not in _UNCATCHABLE}
    return handlers, set(signal.pthread_sigmask(signal.SIG_BLOCK, []))


def exit_code(exit_: SystemExit) -> int:
    """The exit status a process that raised `exit_` ends with: sys.exit("text") prints the text."""
    if exit_.code is None or isinstance(exit_.code, int):
        return exit_.code or 0
    print(exit_.code, file=sys.stderr)  # Python prints it and exits 1
    return 1


def run_cli(
    capfd: pytest.CaptureFixture[str],
    *args: str | os.PathLike[str],
    cwd: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """`shardkit *args` in-process; `env` adds or replaces variables for the run only."""
    from shardkit.__main__ import run

    argv = ["shardkit", *map(str, args)]
    capfd.readouterr()  # what the test printed before is not the command's output
    handlers, blocked = signal_state()
    saved_hook, saved_argv, saved_cwd = sys.unraisablehook, sys.argv, os.getcwd()
    saved_env = {name: os.environ.get(name) for name in env or {}}
    code: int
    try:
        os.environ.update(env or {})
        if cwd is not None:
            os.chdir(cwd)
        sys.argv = argv
        with warnings.catch_warnings():
            warnings.resetwarnings()
            for category in _HIDDEN_BY_DEFAULT:
                warnings.simplefilter("ignore", category, append=True)
            warnings.showwarning = _show_on_stderr
            try:
                run()
                code = 0
            except SystemExit as exit_:
                code = exit_code(exit_)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        sys.argv, sys.unraisablehook = saved_argv, saved_hook
        os.chdir(saved_cwd)
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        for signum, handler in handlers.items():
            if handler is not None and signal.getsignal(signum) is not handler:
                signal.signal(signum, handler)
    out, err = capfd.readouterr()
    return subprocess.CompletedProcess(argv, code, out, err)


class Cli:
    """The `shardkit` fixture: `shardkit("verify", folder)` runs the command in-process."""

    def __init__(self, capfd: pytest.CaptureFixture[str]) -> None:
        self._capfd = capfd

    def __call__(
        self, *args: str | os.PathLike[str], cwd: str | os.PathLike[str] | None = None,
        env: Mapping[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:  # fmt: skip
        return run_cli(self._capfd, *args, cwd=cwd, env=env)
