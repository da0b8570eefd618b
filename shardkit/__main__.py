"""`python -m shardkit` and the `shardkit` command."""

from __future__ import annotations

import os
import signal


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
    from .cli import app

    app(prog_name="shardkit")


if __name__ == "__main__":
    main()
