"""Lanes: worker processes that each run several jobs at once, for jobs that spend their time
waiting on something outside the process (a table of URLs' downloads waiting out a server's
Retry-After or a backoff). With one job a process, as `pools.map_local` runs them, a process sits
idle through each job's slowest wait; a lane takes its next job as soon as its admission says the
work its jobs hold leaves room (for downloads: few rows left that need a thread, not counting those
waiting out a retry), so the next job's work overlaps the last one's wait.

A lane is a long-lived task on a process of `pools.process_pool`: it takes (number, job) pairs from
a queue the driver fills, runs each on a thread of its own, and sends each result back as soon as
that job is done, in any order. What a job weighs and when there is room are the caller's
(`Admission`); a job tells its lane how far it has got with `job_done`. Worker deaths and
stop signals are handled as `map_local` handles them: the driver kills every lane and says which
job was running.
"""

from __future__ import annotations

import concurrent.futures.process
import contextlib
import heapq
import itertools
import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, ThreadPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from multiprocessing.queues import Queue, SimpleQueue
from typing import Any, Protocol, TypeVar

from .pools import _peek, process_pool, raise_broken, stop_pool, submit
from .processes import mp_context, start_resource_tracker
from .stops import raise_swallowed_stop, stops_deferred
from .timeline import mark

Result = TypeVar("Result")

LANE_JOBS = 32  # jobs at once in one lane at most (its admission bounds the work they hold)
POLL = 0.02  # seconds between a lane's looks at whether a job that waits has freed room


class Admission(Protocol):
    """When a lane may take another job while it runs some: `admits(left)`, asked in the lane's
    own process, with `left` the units its running jobs have not yet done (each job weighs
    `weight(job)` units and says what it has done with `job_done`). A lane with no job running
    always takes one. Picklable: it travels to each lane."""

    def weight(self, job: Any) -> int: ...

    def admits(self, left: int) -> bool: ...

    def abandon(self) -> None:
        """The jobs running on this process's threads are given up (a stop, another job's failure):
        end what they wait on, so that they end at once. (A lane in a process of its own is killed.)"""


@dataclass
class _Running:
    """A job a lane runs: its number, its weight, and how much of it is done (`job_done`)."""

    number: int
    weight: int
    done: int = 0

    def left(self) -> int:
        return max(0, self.weight - self.done)


_current = threading.local()  # .running: the _Running of the job on this thread


def job_done(units: int = 1) -> None:
    """`units` of the job running on this thread are done (nothing outside a lane)."""
    running = getattr(_current, "running", None)
    if running is not None:
        running.done += units


class _Turns:
    """The order in which a lane's jobs take turns at their CPU work (`in_turn`): one at a time,
    the job with the lowest number first, so that the earliest job ends first and the later ones
    take the time the earlier ones spend waiting. The turn is handed to the next in line alone
    (a Condition's notify_all would wake every waiting job at each turn)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.waiting: list[tuple[int, int, threading.Event]] = []  # (job number, arrival, its wake-up)
        self.arrivals = itertools.count()
        self.busy = False

    @contextlib.contextmanager
    def turn(self, number: int) -> Iterator[None]:
        with self.lock:
            wake = None if not self.busy else threading.Event()
            if wake is None:
                self.busy = True
            else:
                heapq.heappush(self.waiting, (number, next(self.arrivals), wake))
        if wake is not None:
            wake.wait()  # (handed the turn: `busy` stays set for it)
        try:
            yield
        finally:
            with self.lock:
                if self.waiting:
                    heapq.heappop(self.waiting)[2].set()
                else:
                    self.busy = False


_turns = _Turns()  # this process's


@contextlib.contextmanager
def in_turn() -> Iterator[None]:
    """A step of CPU work of the job on this thread, taken in its lane's order (`_Turns`); outside
    a lane, at once."""
    running = getattr(_current, "running", None)
    if running is None:
        yield
        return
    with _turns.turn(running.number):
        yield


def _run(function: Callable[[Any], Result], job: Any, running: _Running) -> Result:
    _current.running = running
    try:
        return function(job)
    finally:
        _current.running = None


class _Jobs:
    """The jobs one lane runs at once on its threads, and whether it may take another."""

    def __init__(self, function: Callable[[Any], Any], admission: Admission) -> None:
        self.function, self.admission = function, admission
        self.threads = ThreadPoolExecutor(LANE_JOBS, thread_name_prefix="shardkit-lane")
        self.running: dict[Future[Any], tuple[int, _Running]] = {}

    def has_room(self) -> bool:
        if not self.running:
            return True
        if len(self.running) >= LANE_JOBS:
            return False
        return self.admission.admits(sum(running.left() for _, running in self.running.values()))

    def start(self, number: int, job: Any) -> None:
        running = _Running(number, self.admission.weight(job))
        self.running[self.threads.submit(_run, self.function, job, running)] = (number, running)

    def finished(self, timeout: float) -> list[tuple[int, Future[Any]]]:
        """The jobs done within `timeout` seconds (at once when one is), each once."""
        done, _ = wait(self.running, timeout=timeout, return_when=FIRST_COMPLETED) if self.running else (set(), None)
        return [(self.running.pop(future)[0], future) for future in done]

    def close(self) -> None:
        self.threads.shutdown(wait=True, cancel_futures=True)


# --- the lane, in its worker process ---------------------------------------------------------------

_lane: tuple[Queue[Any], SimpleQueue[Any], Admission] | None = None  # set in a lane's process at its start


def _start_lane(
    jobs: Queue[Any],
    results: SimpleQueue[Any],
    admission: Admission,
    initializer: Callable[..., None] | None,
    initargs: tuple[Any, ...],
) -> None:
    global _lane
    _lane = (jobs, results, admission)
    if initializer is not None:
        initializer(*initargs)


def _run_lane(function: Callable[[Any], Any]) -> None:
    """A lane's life: jobs taken while it has room, each result sent back as its job ends
    ((number, True, result) or (number, False, exception)), until the driver's None."""
    assert _lane is not None, "a lane runs on a process of map_lanes' pool"
    jobs, results, admission = _lane
    running = _Jobs(function, admission)
    taking = True
    try:
        while taking or running.running:
            if taking and running.has_room():
                with contextlib.suppress(queue.Empty):
                    got = jobs.get(timeout=POLL)
                    if got is None:
                        taking = False
                    else:
                        running.start(*got)
            for number, future in running.finished(0 if taking and running.has_room() else POLL):
                _send(results, number, future)
    finally:
        running.close()


def _send(results: SimpleQueue[Any], number: int, future: Future[Any]) -> None:
    """A job's result, or its exception with the lane's traceback (as concurrent.futures sends
    one); an exception that cannot be pickled goes as a RuntimeError that names it."""
    error = future.exception()
    if error is None:
        results.put((number, True, future.result()))
        return
    with_traceback = getattr(concurrent.futures.process, "_ExceptionWithTraceback", None)
    try:
        results.put((number, False, with_traceback(error, error.__traceback__) if with_traceback else error))
    except Exception:
        results.put((number, False, RuntimeError(f"job {number} failed: {type(error).__name__}: {error}")))


# --- the driver --------------------------------------------------------------------------------------


def map_lanes(
    function: Callable[[Any], Result],
    jobs: Iterable[Any],
    workers: int,
    admission: Admission,
    *,
    initializer: Callable[..., None] | None = None,
    initargs: tuple[Any, ...] = (),
    started: Callable[[], None] | None = None,
) -> Iterator[tuple[int, Result]]:
    """Yield (job index, result) as jobs finish, on `workers` lanes (with one worker, on threads of
    this process). `jobs` may be a generator: at most LANE_JOBS + 1 jobs a lane are drawn ahead of
    the results. An exception raised by a job propagates; a worker that dies raises WorkerDiedError."""
    upcoming, count = _peek(jobs)
    if count == 0:
        if started is not None:
            started()
        return
    if workers <= 1:
        yield from _in_process(function, upcoming, admission, initializer, initargs, started)
        return
    yield from _on_lanes(function, upcoming, workers, admission, initializer, initargs, started)


def _in_process(
    function: Callable[[Any], Result],
    upcoming: Iterator[Any],
    admission: Admission,
    initializer: Callable[..., None] | None,
    initargs: tuple[Any, ...],
    started: Callable[[], None] | None,
) -> Iterator[tuple[int, Result]]:
    if initializer is not None:
        initializer(*initargs)
    if started is not None:
        started()
    running = _Jobs(function, admission)
    numbered = enumerate(upcoming)
    more, finished = True, False
    try:
        while more or running.running:
            while more and running.has_room():
                got = next(numbered, None)
                if got is None:
                    more = False
                else:
                    running.start(*got)
            raise_swallowed_stop()
            with stops_deferred():
                done = running.finished(POLL)
            for number, future in done:
                yield number, future.result()
        finished = True
    finally:
        if not finished and running.running:
            admission.abandon()
        running.close()


def _on_lanes(
    function: Callable[[Any], Result],
    upcoming: Iterator[Any],
    workers: int,
    admission: Admission,
    initializer: Callable[..., None] | None,
    initargs: tuple[Any, ...],
    started: Callable[[], None] | None,
) -> Iterator[tuple[int, Result]]:
    mark("pool")
    start_resource_tracker()  # (the queues' locks are semaphores: the tracker starts as processes.py says)
    context = mp_context()
    # jobs through a Queue (put returns at once, its thread writes), results through a SimpleQueue
    # (written by the lane's thread itself): the driver never blocks on a put while a lane blocks
    # on a result the driver has not read
    jobs: Queue[Any] = context.Queue()
    jobs.cancel_join_thread()  # (at an abandoned run's exit, jobs no lane will take are dropped)
    results: SimpleQueue[Any] = context.SimpleQueue()
    pool = process_pool(workers, _start_lane, (jobs, results, admission, initializer, initargs))
    finished = False
    try:
        lanes = [submit(pool, _run_lane, function) for _ in range(workers)]
        numbered = enumerate(upcoming)
        outstanding, more = 0, True
        while True:
            while more and outstanding < workers * (LANE_JOBS + 1):
                numbered_job = next(numbered, None)
                if numbered_job is None:
                    more = False
                    for _ in lanes:
                        jobs.put(None)
                else:
                    jobs.put(numbered_job)
                    outstanding += 1
            if started is not None:
                started()
                started = None
            if not outstanding:
                break
            got = _result(results, lanes, more, pool)
            if got is not None:
                number, ok, value = got
                outstanding -= 1
                if not ok:
                    raise value
                yield number, value
        for lane in lanes:
            while not lane.done():
                _result(results, lanes, False, pool)
            lane.result()
        finished = True
    finally:
        with stops_deferred():  # (a stop in here would leave the workers running until exit)
            stop_pool(pool, abandon=not finished)
            jobs.close()


def _result(
    results: SimpleQueue[Any], lanes: list[Future[None]], more: bool, pool: ProcessPoolExecutor
) -> tuple[int, bool, Any] | None:
    """The next result, or None after a short wait; a lane that died or failed is raised."""
    raise_swallowed_stop()
    with stops_deferred():
        ready = results._reader.poll(0.25)  # type: ignore[attr-defined]
        if ready:
            got: tuple[int, bool, Any] = results.get()
            return got
    for lane in lanes:
        if lane.done() and (more or lane.exception() is not None):
            _raise_lane(lane, pool)
    return None


def _raise_lane(lane: Future[None], pool: ProcessPoolExecutor) -> None:
    error = lane.exception()
    if isinstance(error, BrokenProcessPool):
        raise_broken(pool, error, "its jobs")
    if error is not None:
        raise error
    raise RuntimeError("a lane ended while jobs were still to come")
