"""Running independent jobs (probe chunks, shards, checks) on local processes or threads.

Jobs are top-level functions over plain, picklable data. Results come back as they finish, each
with the index of its job, so callers can report progress and keep their own order. Every wait and
submit goes through `runtime.stops`, so a stop signal is never handled while concurrent.futures holds
its locks; worker processes start as `runtime.processes` says.
"""

from __future__ import annotations

import itertools
import os
import signal
from collections.abc import Callable, Iterable, Iterator, Sequence, Sized
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, NoReturn, TypeVar, cast

from ..core.config import usable_cores
from ..core.errors import ConfigError, WorkerDiedError
from .processes import script_ran_again, start_worker, started_context
from .stops import stop_if_stopping, stops_deferred, wait_any
from .timeline import mark

Result = TypeVar("Result")


def default_workers() -> int:
    return usable_cores()


def process_pool(
    workers: int, initializer: Callable[..., None] | None = None, initargs: tuple[Any, ...] = ()
) -> ProcessPoolExecutor:
    """A process pool whose workers follow the rules of `start_worker`."""
    return ProcessPoolExecutor(
        workers,
        mp_context=started_context(),
        initializer=start_worker,
        initargs=(os.getpid(), initializer, initargs, dict(os.environ)),
    )


def submit(pool: ProcessPoolExecutor, function: Callable[..., Result], *args: Any) -> Future[Result]:
    """pool.submit, never cut short by a stop signal: a submit can start a worker process, and a
    Stopped raised half way (forkserver asked, the process not yet recorded, its start data half
    sent) would leave a worker the pool does not know, which prints its own traceback (SemLock
    FileNotFoundError, EOFError) once the driver is gone, or a manager thread created and never
    started ("cannot join thread before it is started"). The stop is raised once it returns."""
    with stops_deferred():
        return pool.submit(function, *args)


def map_pool(pool: ProcessPoolExecutor, function: Callable[[Any], Result], jobs: Iterable[Any]) -> list[Result]:
    """pool.map's results in job order, with the submits and waits of `submit` and `wait_any`."""
    futures = [submit(pool, function, job) for job in jobs]
    waiting = set(futures)
    while waiting:
        waiting -= wait_any(waiting)
    return [future.result() for future in futures]


def stop_pool(pool: ProcessPoolExecutor, abandon: bool) -> None:
    """Shut a pool down; `abandon` (the caller is failing or was interrupted) kills the workers
    first instead of waiting for the jobs they are running."""
    if abandon:
        kill = getattr(pool, "kill_workers", None)  # Python 3.14+
        if kill is not None:
            kill()
        else:
            for process in list((getattr(pool, "_processes", None) or {}).values()):
                process.kill()
        # The pool's manager thread fails every queued future once it sees the workers dead; a
        # future cancelled meanwhile makes it die with InvalidStateError (a traceback on stderr,
        # Python 3.11), so the cancels wait for it to be done.
        manager = getattr(pool, "_executor_manager_thread", None)
        if manager is not None and manager.is_alive():
            manager.join(10)
    pool.shutdown(wait=True, cancel_futures=True)


def map_local(
    function: Callable[..., Result],
    jobs: Iterable[Any],
    workers: int,
    *,
    initializer: Callable[..., None] | None = None,
    initargs: tuple[Any, ...] = (),
    in_process: bool = True,
    started: Callable[[], None] | None = None,
) -> Iterator[tuple[int, Result]]:
    """Yield (job index, result) as jobs finish. workers=1 runs in this process, in order, unless
    in_process is False (jobs that may crash the process running them). `started` is called once,
    when the workers have their first jobs (in this process: before the first; with no jobs, at
    once), so that what the caller starts then (an import on a thread, which holds the GIL) keeps
    out of the pool's start.

    `jobs` may be a generator (a walk still going): it is drawn from only as workers free up, and at
    most 2 jobs per worker are in flight, so memory stays bounded however many jobs there are.
    An exception raised by a job propagates; a worker that dies raises WorkerDiedError.
    """
    upcoming, count = _peek(jobs)
    if count == 0:
        if started is not None:
            started()
        return
    if in_process and (workers <= 1 or count == 1):
        if initializer is not None:
            initializer(*initargs)
        if started is not None:
            started()
        for index, job in enumerate(upcoming):
            yield index, function(job)
        return
    workers = min(workers, len(jobs)) if isinstance(jobs, Sized) else workers
    mark("pool")
    pool = process_pool(workers, initializer, initargs)
    pending: dict[Future[Result], int] = {}
    numbered = enumerate(upcoming)
    exhausted = False
    finished = False
    try:
        while not exhausted or pending:
            while not exhausted and len(pending) < 2 * workers:
                index_job = next(numbered, None)
                if index_job is None:
                    exhausted = True
                    break
                pending[submit(pool, function, index_job[1])] = index_job[0]
            if started is not None:
                started()
                started = None
            if not pending:
                break
            done = wait_any(pending)
            for future in sorted(done, key=pending.__getitem__):
                index = pending.pop(future)
                try:
                    yield index, future.result()
                except BrokenProcessPool as error:
                    raise_broken(pool, error, f"job {index}")
        finished = True
    finally:
        with stops_deferred():  # (a stop in here would leave the workers running until exit)
            stop_pool(pool, abandon=not finished)


def raise_broken(pool: ProcessPoolExecutor, error: BrokenProcessPool, running: str) -> NoReturn:
    """What a pool broken while running `running` ("job 3") means: the stop signal that ended its
    workers, a script that runs shardkit at its top level, or a worker that died."""
    stop_if_stopping()  # a stop signal to the whole group ends the workers first
    processes = (getattr(pool, "_processes", None) or {}).values()
    if (said := script_ran_again(process.exitcode for process in list(processes))) is not None:
        raise ConfigError(said) from None
    raise WorkerDiedError(
        f"a worker process died while running {running} ({error}); it may have been killed or run out of memory"
    ) from None


def _peek(jobs: Iterable[Any]) -> tuple[Iterator[Any], int]:
    """The jobs as an iterator, and how many there are: the length of a sequence, or for a
    generator 0, 1 or 2 (meaning "more than one"), having drawn at most two."""
    if isinstance(jobs, Sized):
        return iter(jobs), len(jobs)
    source = iter(jobs)
    first = list(itertools.islice(source, 2))
    return itertools.chain(first, source), len(first)


def map_local_surviving_crashes(
    function: Callable[..., Result],
    jobs: Sequence[Any],
    workers: int,
    on_crash: Callable[[int, str], Result],
) -> Iterator[tuple[int, Result]]:
    """Like map_local, always in child processes, for jobs over untrusted input whose native code
    may crash (a hostile LMDB or HDF5 file). When a worker dies, every job not yet done runs again
    alone in a fresh process; one that kills that process too yields on_crash(index, how it died)."""
    done: set[int] = set()
    try:
        for index, result in map_local(function, jobs, workers, in_process=False):
            done.add(index)
            yield index, result
    except WorkerDiedError:
        for index, job in enumerate(jobs):
            if index not in done:
                outcome, died = run_alone(function, job)
                yield index, on_crash(index, died) if died else cast(Result, outcome)  # None only when it died


def run_alone(function: Callable[[Any], Result], job: Any) -> tuple[Result | None, str | None]:
    """(result, None), or (None, how the process died) when running `job` killed its process.
    An exception raised by the job is re-raised here."""
    context = started_context()
    receiver, sender = context.Pipe(duplex=False)
    process = context.Process(target=_alone, args=(os.getpid(), function, job, sender, dict(os.environ)), daemon=True)
    with stops_deferred():  # (as in `submit`: a process half started is one nobody stops)
        process.start()
    sender.close()
    try:
        ok, value = receiver.recv()
    except BaseException as error:
        if not isinstance(error, EOFError):  # interrupted: do not leave it running
            process.kill()
            process.join()
            raise
        # it died before sending anything
        process.join()
        code = process.exitcode
        if (said := script_ran_again([code])) is not None:  # (not the job's doing: no crash to report)
            raise ConfigError(said) from None
        if code is not None and code < 0:
            try:
                return None, f"killed by {signal.Signals(-code).name}"
            except ValueError:
                return None, f"killed by signal {-code}"
        return None, f"exited with status {code}"
    finally:
        receiver.close()
    process.join()
    if not ok:
        raise value
    return value, None


def _alone(driver: int, function: Callable[[Any], Any], job: Any, sender: Any, environment: dict[str, str]) -> None:
    start_worker(driver, environment=environment)
    try:
        result = (True, function(job))
    except Exception as error:
        result = (False, error)
    sender.send(result)
    sender.close()


def map_threads(function: Callable[..., Result], jobs: Iterable[Any], workers: int) -> Iterator[tuple[int, Result]]:
    """Like map_local, on threads: for jobs that release the GIL (compiled code, I/O)."""
    upcoming, count = _peek(jobs)
    if workers <= 1 or count <= 1:
        for index, job in enumerate(upcoming):
            yield index, function(job)
        return
    workers = min(workers, len(jobs)) if isinstance(jobs, Sized) else workers
    numbered = enumerate(upcoming)
    with ThreadPoolExecutor(workers) as pool:
        pending: dict[Future[Result], int] = {}
        try:
            while True:
                while len(pending) < 2 * workers and (index_job := next(numbered, None)) is not None:
                    pending[pool.submit(function, index_job[1])] = index_job[0]
                if not pending:
                    return
                for future in sorted(wait_any(pending), key=pending.__getitem__):
                    yield pending.pop(future), future.result()
        finally:
            for future in pending:
                future.cancel()
