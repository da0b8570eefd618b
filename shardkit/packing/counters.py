"""The live counts a pack's workers share with its driver (local workers only: a Ray task's node
has none): items done, for the progress line, and a table of URLs' rows waiting out a retry now.
Each is a shared integer the driver makes and every worker is given at its start (`init_worker`)."""

from __future__ import annotations

from typing import Any

_done: Any = None  # items done (a multiprocessing Value), in this process's pool
_waiting: Any = None  # rows waiting out a retry's backoff or Retry-After now


def init_worker(done: Any, waiting: Any = None) -> None:
    global _done, _waiting
    _done, _waiting = done, waiting


def count_done() -> None:
    """One item done."""
    _add(_done, 1)


def count_waiting(change: int) -> None:
    """`change` more rows (or fewer, when negative) waiting out a retry."""
    _add(_waiting, change)


def _add(counter: Any, change: int) -> None:
    if counter is not None:
        with counter.get_lock():
            counter.value += change
