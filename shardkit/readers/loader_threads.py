"""The batch loader's threads: each chunk's decode step submitted to a pool of `workers` threads (or
run in the calling thread with workers=0), up to `prefetch` chunks ahead of the one handed on, and
taken back in order through the decoder's lane. Whatever ends an epoch (its end, an exception,
Ctrl-C, a consumer that stops early), every thread is ended before the caller goes on."""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Any

from .batch import Decoded
from .chunks import Chunk
from .decoding import Lane, StreamKey
from .stats import LoaderClock

# a chunk on its way: its decode's future (None: no records read), its positions, its items' places
Pending = tuple[Future[Any] | None, int, list[int]]

_POOLS = itertools.count()  # each epoch's pool names its threads apart from every other's


class InCallingThread(Executor):
    """workers=0: each batch is made when it is asked for, in the thread that iterates."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        done: Future[Any] = Future()
        try:
            result = fn(*args, **kwargs)
        except BaseException as error:  # (Ctrl-C too: raised where the result is taken, as with threads)
            done.set_exception(error)
        else:  # (a Ctrl-C in set_result raises here, not into a second set_ on a finished future)
            done.set_result(result)
        return done


def loader_pool(workers: int) -> tuple[Executor, str]:
    """An epoch's pool of decode threads, and the name its threads start with."""
    named = f"shardkit-loader-{next(_POOLS)}"
    return (ThreadPoolExecutor(workers, thread_name_prefix=named) if workers else InCallingThread()), named


def decoded_ahead(
    chunks: Iterable[Chunk],
    key: StreamKey,
    step: Callable[[StreamKey, int, list[Any]], Any],
    pool: Executor,
    lane: Lane,
    pending: deque[Pending],
    prefetch: int,
    clock: LoaderClock | None = None,
) -> Iterator[Decoded]:
    """The chunks decoded in order: `step` (the decoder's, on a loader thread) submitted for up to
    `prefetch` chunks past the one handed on, each result made a batch by `lane`. `pending` holds
    the chunks on their way, for the caller to cancel when it stops. `clock` times the reads and
    the waits for the threads (with workers=0, their work)."""
    clock = clock or LoaderClock(0, enabled=False)
    for number, positions, items, offsets in _read(chunks, clock):
        with clock.timed("wait:decode"):
            work = lane.submit(pool.submit(step, key, number, items)) if items else None
        pending.append((work, positions, offsets))
        while len(pending) > prefetch:
            yield _next(pending, lane, clock)
    while pending:
        yield _next(pending, lane, clock)


def _read(chunks: Iterable[Chunk], clock: LoaderClock) -> Iterator[Chunk]:
    """The chunks, each one's reading timed."""
    pulled = iter(chunks)
    while True:
        with clock.timed("wait:read"):
            chunk = next(pulled, None)
        if chunk is None:
            return
        yield chunk


def _next(pending: deque[Pending], lane: Lane, clock: LoaderClock) -> Decoded:
    """The oldest chunk, decoded, with the places of the records it kept (none when all failed)."""
    work, positions, offsets = pending.popleft()
    with clock.timed("wait:decode"):
        batch = None if work is None else lane.handed(work)
    if batch is None:
        return Decoded(None, positions, [])
    kept = offsets if batch.kept is None else [offsets[i] for i in batch.kept]
    return Decoded(batch if kept else None, positions, kept)


def stop(pool: Executor, lane: Lane, named: str, pending: deque[Pending]) -> None:
    """The loader's threads ended before the caller goes on, whatever a Ctrl-C interrupts. It can
    land in a join (at an epoch's end), leaving the join half done; or in a submit, between a
    thread's start and the pool's record of it (Thread.start waits for the thread, and that wait
    takes the KeyboardInterrupt), leaving a thread the pool's shutdown never joins. So the joins
    are made again after an interruption, and every thread named as this pool's is waited for."""
    for work, _, _ in pending:
        if work is not None:
            work.cancel()
    try:
        pool.shutdown(wait=True, cancel_futures=True)
        lane.close()
    except BaseException:
        pool.shutdown(wait=True, cancel_futures=True)  # (a no-op where the first one ended)
        lane.close()
        raise
    finally:
        _wait_for_threads(named)


def _wait_for_threads(named: str) -> None:
    prefix = f"{named}_"  # how ThreadPoolExecutor names the threads of `named`
    while True:
        alive = [t for t in threading.enumerate() if t.name.startswith(prefix) and t is not threading.current_thread()]
        if not alive:
            return
        for thread in alive:
            _join_started(thread)  # (an unrecorded worker ends on the shutdown's None, as the others)
        # Python 3.11's Thread.join, interrupted, marks a thread still running as stopped (the
        # tstate lock it released, bpo-45274's fix): later joins return at once, so the threads
        # are waited for until they leave threading's list of the living
        time.sleep(0.001)


def _join_started(thread: threading.Thread) -> None:
    """Join a thread that may not have started yet (a Ctrl-C in its Thread.start)."""
    while True:
        try:
            thread.join()
            return
        except RuntimeError:  # "cannot join thread before it is started": it is starting
            time.sleep(0.001)
