"""When each phase of a run began, for the start-up breakdown of scripts/bench_pack_workers.py:
with SHARDKIT_TIMELINE naming a file, every process of the run (driver, forkserver, workers)
appends a line per event, "<unix time> <pid> <event>"; without it, `mark` does nothing. One
O_APPEND write a line, so lines of several processes never interleave."""

from __future__ import annotations

import os
import time

TIMELINE_ENV = "SHARDKIT_TIMELINE"
_PATH = os.environ.get(TIMELINE_ENV)  # read once: a process's events go to one file


def mark(event: str) -> None:
    if _PATH is None:
        return
    line = f"{time.time():.6f} {os.getpid()} {event}\n".encode()
    fd = os.open(_PATH, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)
