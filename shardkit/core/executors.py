"""Running independent jobs (probe chunks, shards) on local processes or on a Ray cluster.

Jobs are top-level functions over plain, picklable data. Results come back as they finish, each
with the index of its job, so callers can report progress and keep their own order.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import multiprocessing
import multiprocessing.resource_tracker
import multiprocessing.util
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence, Sized
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, ThreadPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from typing import Any, TypeVar, cast

from .errors import ShardkitError, WorkerDiedError, describe, require

Job = TypeVar("Job")
Result = TypeVar("Result")


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
# Modules the forkserver imports once, so that every worker forks with them loaded (a name that
# does not import is skipped silently by multiprocessing: tests/test_executors.py imports each).
# "<driver pid>:<folder>": the driver's multiprocessing temp folder, for core/forkserver_exit.py.
FORKSERVER_TEMP_ENV = "SHARDKIT_FORKSERVER_TEMP"
FORKSERVER_PRELOAD = ("shardkit.core.forkserver_exit", "shardkit.packing.pack", "shardkit.packing.probe")


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
    has a Python handler, and a signal landing then killed the process (exit -2 or -15, not the
    130 or 143 already decided; seen 2 runs in 5 under load)."""
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
    ("Exception ignored in ...") and carries on (seen once in 200 random stops under load: the pack
    ran to the end and exited 0). Called where the work waits, and when it ends."""
    global _pending
    if _stopped_by is not None and not _deferring:
        _pending = None
        raise Stopped(_stopped_by)


def stopped_by() -> int | None:
    """The stop signal that came, if one did: a failure that follows it (a worker or the forkserver
    it killed first, a pipe that broke) is the stop, not a crash."""
    return _stopped_by


@contextlib.contextmanager
def _stops_deferred() -> Iterator[None]:
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
            # BrokenProcessPool (which reached click as "Aborted." and exit code 1).
            raise Stopped(signum)


def _stop_if_stopping(grace: float = 0.2) -> None:
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
        with _stops_deferred():
            done, _ = wait(futures, timeout=timeout, return_when=FIRST_COMPLETED)
        if done:
            return done


def default_workers() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def mp_context() -> multiprocessing.context.SpawnContext | multiprocessing.context.ForkServerContext:
    # Never fork a big parent: forkserver children start from a small clean process.
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    # The server imports the job modules (numpy, PIL, codecs) once; every worker forks ready to run.
    context.set_forkserver_preload(list(FORKSERVER_PRELOAD))
    return context


def started_context() -> multiprocessing.context.SpawnContext | multiprocessing.context.ForkServerContext:
    """mp_context, with multiprocessing's helper processes started the way a stop signal to the
    whole group needs. Both are started with SIGINT and SIGHUP blocked, which they keep:
    - the resource tracker ignores SIGINT and SIGTERM but not SIGHUP: a SIGHUP killed it, the
      driver started a new one, and that one printed a KeyError traceback for every semaphore
      the old one had been told of;
    - the forkserver ignores SIGINT only once its preload imports are done: a Ctrl-C during them
      printed its KeyboardInterrupt traceback.
    Workers unblock both (start_worker). SIGTERM still ends either at once: it prints nothing."""
    context = mp_context()
    if context.get_start_method() != "forkserver":
        return context
    import multiprocessing.forkserver

    # The folder the forkserver's socket goes in (created now, the one multiprocessing will use):
    # the forkserver removes it when it exits after this process, even after a kill -9 of it.
    os.environ[FORKSERVER_TEMP_ENV] = f"{os.getpid()}:{_temp_dir()}"
    start_resource_tracker()
    _start_blocked(multiprocessing.forkserver.ensure_running)
    return context


# A Unix socket's path holds at most 107 bytes, and the forkserver's is TMP/pymp-XXXXXXXX/listener-XXXXXXXX:
# under a longer TMPDIR (SLURM's per-job scratch folders, pytest's) it could not be made at all
# ("OSError: AF_UNIX path too long", a traceback).
_LONGEST_TMP = 70


def _temp_dir() -> str:
    """multiprocessing's temp folder for this process (made now: the one the forkserver will use),
    under /tmp when TMPDIR is too long for the forkserver's socket."""
    import tempfile

    config = cast(Any, multiprocessing.process.current_process())._config  # where get_temp_dir keeps it
    if config.get("tempdir") is None and len(os.fsencode(tempfile.gettempdir())) > _LONGEST_TMP:
        import shutil

        folder = tempfile.mkdtemp(prefix="pymp-", dir="/tmp")
        multiprocessing.util.Finalize(None, shutil.rmtree, args=(folder, True), exitpriority=-100)
        config["tempdir"] = folder
    return multiprocessing.util.get_temp_dir()


def start_resource_tracker() -> None:
    """multiprocessing's resource tracker, started as `started_context` says (before anything
    that makes a semaphore starts it the usual way)."""
    _start_blocked(multiprocessing.resource_tracker.ensure_running)


def _start_blocked(start: Callable[[], None]) -> None:
    # One helper a call: the tracker's own start unblocks SIGINT and SIGTERM in this thread after it.
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, _HELPER_BLOCKED)
    try:
        start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


_HELPER_BLOCKED = {signal.SIGINT, signal.SIGHUP}


def start_worker(driver: int, initializer: Callable[..., None] | None = None, initargs: tuple[Any, ...] = ()) -> None:
    """Runs first in every worker process. Ctrl-C, which a terminal sends to every process, is the
    driver's to handle (it stops the workers itself); a SIGTERM ends a worker as usual. When the
    driver dies (even by kill -9) the worker exits within a second instead of working for nobody."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _HELPER_BLOCKED)  # (blocked in the forkserver)
    threading.Thread(target=_exit_when_gone, args=(driver,), daemon=True, name="shardkit-watchdog").start()
    if initializer is not None:
        initializer(*initargs)


def _exit_when_gone(pid: int) -> None:
    try:
        handle = os.pidfd_open(pid)  # readable once the process has ended (Linux 5.3+)
    except (AttributeError, OSError):
        handle = None
    if handle is not None:
        select.select([handle], [], [])
    else:
        while _alive(pid) and os.getppid() != 1:
            time.sleep(0.5)
    os._exit(1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def process_pool(
    workers: int, initializer: Callable[..., None] | None = None, initargs: tuple[Any, ...] = ()
) -> ProcessPoolExecutor:
    """A process pool whose workers follow the rules of `start_worker`."""
    return ProcessPoolExecutor(
        workers, mp_context=started_context(), initializer=start_worker, initargs=(os.getpid(), initializer, initargs)
    )


def submit(pool: ProcessPoolExecutor, function: Callable[..., Result], *args: Any) -> Future[Result]:
    """pool.submit, never cut short by a stop signal: a submit can start a worker process, and a
    Stopped raised half way (forkserver asked, the process not yet recorded, its start data half
    sent) left a worker the pool did not know, which printed its own traceback (SemLock
    FileNotFoundError, EOFError) once the driver was gone, or a manager thread created and never
    started ("cannot join thread before it is started"). The stop is raised once it returns."""
    with _stops_deferred():
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
        # future cancelled meanwhile made it die with InvalidStateError (a traceback on stderr,
        # Python 3.11): the cancels wait for it to be done.
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
) -> Iterator[tuple[int, Result]]:
    """Yield (job index, result) as jobs finish. workers=1 runs in this process, in order, unless
    in_process is False (jobs that may crash the process running them).

    `jobs` may be a generator (a walk still going): it is drawn from only as workers free up, and at
    most 2 jobs per worker are in flight, so memory stays bounded however many jobs there are.
    An exception raised by a job propagates; a worker that dies raises WorkerDiedError.
    """
    upcoming, count = _peek(jobs)
    if count == 0:
        return
    if in_process and (workers <= 1 or count == 1):
        if initializer is not None:
            initializer(*initargs)
        for index, job in enumerate(upcoming):
            yield index, function(job)
        return
    workers = min(workers, len(jobs)) if isinstance(jobs, Sized) else workers
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
            if not pending:
                break
            done = wait_any(pending)
            for future in sorted(done, key=pending.__getitem__):
                index = pending.pop(future)
                try:
                    yield index, future.result()
                except BrokenProcessPool as error:
                    _stop_if_stopping()  # a stop signal to the whole group ends the workers first
                    raise WorkerDiedError(
                        f"a worker process died while running job {index} ({error}); "
                        "it may have been killed or run out of memory"
                    ) from None
        finished = True
    finally:
        with _stops_deferred():  # (a stop in here would leave the workers running until exit)
            stop_pool(pool, abandon=not finished)


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
    process = context.Process(target=_alone, args=(os.getpid(), function, job, sender), daemon=True)
    with _stops_deferred():  # (as in `submit`: a process half started is one nobody stops)
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


def _alone(driver: int, function: Callable[[Any], Any], job: Any, sender: Any) -> None:
    start_worker(driver)
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


def check_ray() -> None:
    """Fail fast, in one line, when the ray extra is missing."""
    require("ray", "ray")


def _on_ray_node(function: Callable[[Any], Result], job: Any) -> tuple[str, Result]:
    """Runs in a Ray worker: the job's result and the id of the node that ran it."""
    import ray

    return ray.get_runtime_context().get_node_id(), function(job)


def connect_ray(address: str | None = None) -> bool:
    """Connect to the Ray cluster at `address` (auto, ray://host:port, host:port), or start a local
    instance; True when this call started the connection (disconnect_ray() ends it). Ray installs
    its own SIGTERM handler (an abrupt exit): the process's own stop handlers are put back."""
    import logging

    import ray

    if ray.is_initialized():
        return False
    _check_reachable(address)
    handlers = {stop_signal: signal.getsignal(stop_signal) for stop_signal in STOP_SIGNALS}
    try:
        ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
    except (ConnectionError, RuntimeError, ValueError) as error:
        where = address or "a new local instance"
        raise ShardkitError(f"cannot connect to the Ray cluster at {where}: {error}") from None
    finally:
        for stop_signal, handler in handlers.items():
            if handler is not None:
                signal.signal(stop_signal, handler)
    return True


def _check_reachable(address: str | None, timeout: float = 5.0) -> None:
    """A cluster address (host:port or ray://host:port) must answer: ray.init waits for minutes on
    one where nothing listens. 'auto' and None are Ray's to resolve (they fail fast)."""
    import socket

    if address is None or address == "auto" or address == "local":
        return
    target = address.removeprefix("ray://")
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit():
        raise ShardkitError(f"cannot connect to the Ray cluster at {address}: not host:port or ray://host:port")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as error:
        raise ShardkitError(f"cannot connect to the Ray cluster at {address}: {describe(error)}") from None


def disconnect_ray() -> None:
    import ray

    ray.shutdown()


def map_ray(
    function: Callable[..., Result],
    jobs: Iterable[Any],
    *,
    address: str | None = None,
    max_retries: int = 3,
    nodes: dict[int, str] | None = None,
    cancel: bool = True,
) -> Iterator[tuple[int, Result]]:
    """Yield (job index, result) as Ray tasks finish; each job is one task of `function`.

    Uses the Ray connection this process has (connect_ray), or makes one to `address` for the
    duration. Tasks are spread across nodes; a task whose worker or node dies is retried by Ray up
    to `max_retries` times. `nodes`, when given, receives the id of the node that ran each job.
    Stopped early, it cancels the tasks left, unless `cancel` is False: the caller is about to end
    the connection, which ends them (cancelling first races replies in flight: a Ray check-failure).
    """
    import ray
    from ray.exceptions import RayError, RayTaskError, WorkerCrashedError

    started_here = connect_ray(address)
    remote: Any = ray.remote(num_cpus=1, max_retries=max_retries, scheduling_strategy="SPREAD")(_on_ray_node)
    # Jobs are drawn as tasks finish (a plan still being walked feeds them): enough in flight to
    # keep every CPU of the cluster busy, and never the whole plan in the driver.
    in_flight = max(4, 2 * int(ray.cluster_resources().get("CPU", 1)))
    numbered = enumerate(jobs)
    pending: dict[Any, int] = {}
    try:
        while True:
            while len(pending) < in_flight and (index_job := next(numbered, None)) is not None:
                pending[remote.remote(function, index_job[1])] = index_job[0]
            if not pending:
                break
            done, _ = ray.wait(list(pending), num_returns=1, timeout=0.25)
            for ref in done:
                index = pending.pop(ref)
                try:
                    node, result = ray.get(ref)
                except RayTaskError as error:
                    cause = error.cause
                    if isinstance(cause, ShardkitError):
                        raise cause from None
                    raise ShardkitError(f"Ray task for job {index} failed: {cause!r}") from None
                except WorkerCrashedError:
                    raise WorkerDiedError(f"Ray worker for job {index} died {max_retries + 1} times") from None
                except RayError as error:
                    raise ShardkitError(f"Ray task for job {index} failed: {error}") from None
                if nodes is not None:
                    nodes[index] = node
                yield index, result
    finally:
        if started_here:
            disconnect_ray()  # ends this job's tasks with it
        elif cancel:
            for ref in pending:
                ray.cancel(ref, force=True)
