"""`python -m shardkit` and the `shardkit` command."""

from __future__ import annotations

import os
import signal
import sys
from typing import Any


def _stopped_before_start(signum: int, frame: object = None) -> None:
    # Nothing has started yet: nothing to stop, nothing to resume. (The words are the CLI's.)
    what = "interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"
    os.write(2, f"{what}\n".encode())
    os._exit(128 + signum)


def main() -> None:
    # Importing the CLI takes about 0.3 s (typer, rich): a stop signal in that window would end the
    # process by the default action (exit -15, no line). Only os and signal are loaded here; the
    # command's own handlers replace these once it runs.
    for stop_signal in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(stop_signal, _stopped_before_start)
    from .core.timeline import mark

    mark("main")
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
