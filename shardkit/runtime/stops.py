"""Stop signals (Ctrl-C, SIGTERM, SIGHUP): the one policy for every command.

The first signal raises `Stopped` in the main thread, deferred while it waits inside
concurrent.futures (which holds its futures' locks there); a second one, or one after the work,
writes one line to stderr and ends the process at once with 128 + the signal. docs/ARCHITECTURE.md
("Stop signals") says why each part is there.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import time
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any


class Stopped(KeyboardInterrupt):
    """A stop signal (Ctrl-C, SIGTERM, SIGHUP), raised where the main thread is: it unwinds like
    Ctrl-C, and the driver stops its workers on the way out."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


# SIGTERM is what SLURM, Kubernetes and systemd send; SIGHUP comes when the terminal goes away.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_deferring = 0  # > 0 while the main thread waits inside concurrent.futures (which holds locks)
_pending: int | None = None
_stopped_by: int | None = None  # the first stop signal that came: the next one exits at once
_over = False  # the command's work is over: a stop signal ends the process at once
_ignoring_at_exit = False  # the exit handler that ignores stop signals is registered


def arm_stops() -> None:
    """Install `stop` for the stop signals (the CLI does, for the rest of the process)."""
    global _pending, _stopped_by, _over
    _pending, _stopped_by, _over = None, None, False
    sys.unraisablehook = _quiet_swallowed_stop
    for stop_signal in STOP_SIGNALS:
        signal.signal(stop_signal, stop)


def _quiet_swallowed_stop(unraisable: Any) -> None:
    # A Stopped raised inside a weakref callback or __del__ cannot get out: Python would print it
    # as "Exception ignored"; it is raised again where the work waits or ends (raise_swallowed_stop).
    if not isinstance(unraisable.exc_value, Stopped):
        sys.__unraisablehook__(unraisable)


def stop(signum: int, frame: object = None) -> None:
    """The handler the CLI installs for the stop signals. The first raises Stopped, or inside a
    wait that must not be cut short (concurrent.futures holds its futures' locks there), as soon
    as that wait returns; a second one exits at once (workers follow within a second; --resume
    clears what the stop left half done)."""
    global _pending, _stopped_by
    if _stopped_by is not None or _over:
        with contextlib.suppress(Exception):  # a report half printed: what was printed reaches its reader
            sys.stdout.flush()
        name = signal.Signals(signum).name
        again = _stopped_by is not None
        os.write(2, (f"\nstopped again ({name}): exiting now\n" if again else f"stopped by {name}\n").encode())
        # os._exit skips multiprocessing's handler that removes the forkserver's folder, and a
        # SIGTERM to the whole group ends the forkserver before its own does: removed here, or a
        # /tmp/pymp-* folder is left behind each time
        remove = getattr(sys.modules.get("shardkit.runtime.processes"), "remove_forkserver_folder", None)
        if remove is not None:
            with contextlib.suppress(Exception):
                remove()
        os._exit(128 + signum)
    _stopped_by = signum
    if _deferring:
        _pending = signum
        return
    raise Stopped(signum)


def exit_on_stop() -> None:
    """The command's work is over (done, failed or stopped): from now on a stop signal ends the
    process at once with its exit code. Raising Stopped there instead would reach click, which
    turns a KeyboardInterrupt into "Aborted!" and exit code 1. From the exit handlers on, stop
    signals are ignored: Python's finalization puts back the default action of every signal that
    has a Python handler, and a signal landing then would kill the process (exit -2 or -15, not
    the 130 or 143 already decided)."""
    global _over, _ignoring_at_exit
    _over = True
    if not _ignoring_at_exit:
        _ignoring_at_exit = True
        atexit.register(_ignore_stops)  # runs before multiprocessing's exit handler (registered earlier)


def _ignore_stops() -> None:
    with contextlib.suppress(ValueError):  # (not the main thread: nothing to do)
        for stop_signal in STOP_SIGNALS:
            signal.signal(stop_signal, signal.SIG_IGN)


def raise_swallowed_stop() -> None:
    """Raise Stopped again for a stop signal whose Stopped never got out: the handler runs wherever
    the main thread is, and inside a weakref callback or a __del__ Python prints the exception
    ("Exception ignored in ...") and carries on, so the work would run to its end and exit 0.
    Called where the work waits, and when it ends."""
    global _pending
    if _stopped_by is not None and not _deferring:
        _pending = None
        raise Stopped(_stopped_by)


def stopped_by() -> int | None:
    """The stop signal that came, if one did: a failure that follows it (a worker or the forkserver
    it killed first, a pipe that broke) is the stop, not a crash."""
    return _stopped_by


@contextlib.contextmanager
def stops_deferred() -> Iterator[None]:
    """A stop signal that comes inside is raised once the block is left (a wait or a submit of
    concurrent.futures, which must not be cut half way)."""
    global _deferring, _pending
    _deferring += 1
    try:
        yield
    finally:
        _deferring -= 1
        if not _deferring and _pending is not None:
            signum, _pending = _pending, None
            # Raised in place of an exception too: a stop to the whole group kills the forkserver
            # and the workers as well, and the wait or submit then fails with EOFError or
            # BrokenProcessPool (which click would turn into "Aborted." and exit code 1).
            raise Stopped(signum)


def stop_if_stopping(grace: float = 0.2) -> None:
    """Raise Stopped when a stop signal came, or comes within `grace` seconds: a pool broken by
    one is a stop, not a crash."""
    global _pending
    deadline = time.monotonic() + grace
    while _stopped_by is None and time.monotonic() < deadline:
        time.sleep(0.01)  # the handler raises Stopped right here when the signal arrives
    if _stopped_by is not None:
        signum, _pending = _pending or _stopped_by, None
        raise Stopped(signum)


def wait_any(futures: Any, timeout: float = 0.25) -> set[Future[Any]]:
    """The futures done, as soon as one is (concurrent.futures.wait, in short waits, so that a stop
    signal is handled between them and never while its locks are held)."""
    while True:
        raise_swallowed_stop()
        with stops_deferred():
            done, _ = wait(futures, timeout=timeout, return_when=FIRST_COMPLETED)
        if done:
            return done
