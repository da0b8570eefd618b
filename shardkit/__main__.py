"""`python -m shardkit` and the `shardkit` command."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from typing import Any


def _stopped_before_start(signum: int, frame: object = None) -> None:
    # Nothing has started yet: nothing to stop, nothing to resume. (The words are the CLI's.)
    what = "interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"
    os.write(2, f"{what}\n".encode())
    _remove_forkserver_folder()
    os._exit(128 + signum)


def _remove_forkserver_folder() -> None:
    """processes.remove_forkserver_folder, where processes is imported (only os and signal are
    loaded this early): not imported, or still being imported, means no forkserver started."""
    remove = getattr(sys.modules.get("shardkit.runtime.processes"), "remove_forkserver_folder", None)
    if remove is not None:
        remove()


def main() -> None:
    """The `shardkit` command: `run`, then the process's exit (see `_exit`)."""
    try:
        run()
        code = 0
    except SystemExit as stop:
        if stop.code is not None and not isinstance(stop.code, int):
            raise  # sys.exit("text"): Python prints it
        code = stop.code or 0
    _exit(code)


def run() -> None:
    """The command line in sys.argv, run: returns, or raises SystemExit with its exit code."""
    # Importing the CLI (typer, rich) takes a while: a stop signal in that window would end the
    # process by the default action (exit -15, no line). Only os and signal are loaded here; the
    # command's own handlers replace these once it runs.
    for stop_signal in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(stop_signal, _stopped_before_start)
    from .runtime import blas  # noqa: F401 - before anything imports numpy
    from .runtime.timeline import mark

    mark("main")
    if _starts_workers(sys.argv[1:]):
        from .runtime.processes import PACK_PRELOAD, started_context

        # The forkserver imports what the workers run while this process imports the CLI's
        # modules: started only with the pool, it would keep the workers waiting for those
        # imports. It exits with this process.
        started_context(PACK_PRELOAD)
    import typer

    from .cli import app

    mark("imported")

    exceptions = _click_exceptions()
    try:
        code = app(prog_name="shardkit", standalone_mode=False)
    except exceptions.NoArgsIsHelpError as error:  # `shardkit` or `shardkit pack` alone: the help
        error.show()
        sys.exit(error.exit_code)
    except exceptions.UsageError as error:  # a bad flag or value: one line, as every other mistake gets
        sys.stderr.write(f"error: {usage_line(error)}\n")
        sys.exit(error.exit_code)
    except typer.Abort:  # Ctrl-C while click itself was parsing (typer's, or click's re-exported)
        sys.stderr.write("interrupted\n")
        sys.exit(128 + signal.SIGINT)
    mark("exit")
    sys.exit(code if isinstance(code, int) else 0)


def _starts_workers(args: list[str]) -> bool:
    """Whether the command line is a pack that may start local worker processes: a guess from
    the words alone (a preset may still say --workers 1, and then the forkserver idles)."""
    if not args or args[0] != "pack" or "--help" in args:
        return False
    for flag, refused in (("--workers", "1"), ("--executor", "ray")):
        for at, word in enumerate(args):
            if word == f"{flag}={refused}" or (word == flag and args[at + 1 : at + 2] == [refused]):
                return False
    return True


def _exit(code: int) -> None:
    """Exit once the atexit handlers have run (multiprocessing's, tempfile's finalizers), without
    the interpreter's teardown of every module and object, which frees what the process's end
    frees anyway and is a visible share of a short command. Everything the commands write is closed
    by then. Where a thread that the interpreter would wait for is still running, or a profiler or
    coverage is watching, the usual exit."""
    import atexit
    import threading

    others = (thread for thread in threading.enumerate() if thread is not threading.current_thread())
    if any(thread.is_alive() and not thread.daemon for thread in others):
        sys.exit(code)
    if sys.gettrace() is not None or sys.getprofile() is not None or "coverage" in sys.modules:
        sys.exit(code)  # a profiler's or coverage's report is written at the interpreter's exit
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe or stream: nothing more to say there
            stream.flush()
    os._exit(code)


def _click_exceptions() -> Any:
    """The exceptions of the click that typer runs on: its own copy from typer 0.2x on, click before."""
    import importlib

    try:
        return importlib.import_module("typer._click.exceptions")
    except ImportError:
        return importlib.import_module("click.exceptions")


def usage_line(error: Any) -> str:
    """click's message for a bad command line (a UsageError) on one line, less the usage block and
    box around it and the "Value error, " that typer's Enum parsing puts first."""
    message = " ".join(error.format_message().split()).replace("Value error, ", "")
    command = error.ctx.command_path if error.ctx is not None else "shardkit"
    return f"{message} (see {command} --help)"


if __name__ == "__main__":
    main()
