"""How shardkit's worker processes start and end: multiprocessing's context (forkserver, else
spawn), its helper processes started with the signals a stop to the whole group needs blocked, and
every worker's start (`start_worker`): Ctrl-C left to the driver, and a pidfd watchdog that ends it
within a second of its driver.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.resource_tracker
import multiprocessing.util
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, cast

from .timeline import mark

# "<driver pid>:<folder>": the driver's multiprocessing temp folder, for runtime/forkserver_exit.py.
FORKSERVER_TEMP_ENV = "SHARDKIT_FORKSERVER_TEMP"


def forkserver_folder(value: str) -> tuple[int, str] | None:
    """FORKSERVER_TEMP_ENV's value read: (the driver's pid, its folder), or None where it names no
    folder multiprocessing made (pymp-*): the one rule of what may be removed as the forkserver's."""
    driver, _, folder = value.partition(":")
    if driver.isdigit() and os.path.basename(folder).startswith("pymp-"):
        return int(driver), folder
    return None


def remove_forkserver_folder() -> None:
    """Remove the forkserver's folder this process made (named by FORKSERVER_TEMP_ENV), for an exit
    that skips the exit handlers (os._exit on a stop): the forkserver removes it once this process
    is gone, unless the same signal ended it too (a stop to the whole group). Nothing will start a
    worker after this."""
    named = forkserver_folder(os.environ.get(FORKSERVER_TEMP_ENV, ""))
    if named is not None and named[0] == os.getpid():
        import shutil

        shutil.rmtree(named[1], ignore_errors=True)


# Modules the forkserver imports once, so that every worker forks with them loaded (a name that
# does not import is skipped silently by multiprocessing: tests/test_executors.py imports each).
FORKSERVER_PRELOAD = (
    "shardkit.runtime.forkserver_exit", "shardkit.packing.pack", "shardkit.packing.encode", "shardkit.packing.probe",
)  # fmt: skip
# What a pack's workers run: the forkserver `__main__` starts for a pack imports only these. Its
# imports are what the first worker waits for (the driver's own, numpy-free, end sooner), so the
# driver's modules and probe's census stay out of it.
PACK_PRELOAD = ("shardkit.runtime.forkserver_exit", "shardkit.packing.worker", "shardkit.packing.encode")


def mp_context(
    preload: tuple[str, ...] = FORKSERVER_PRELOAD,
) -> multiprocessing.context.SpawnContext | multiprocessing.context.ForkServerContext:
    # Never fork a big parent: forkserver children start from a small clean process.
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    # The server imports the job modules (numpy, PIL, codecs) once; every worker forks ready to run.
    # (`preload` counts where this call starts the server: it starts once a process)
    context.set_forkserver_preload(list(preload))
    return context


# The exit code of a worker process that found itself still importing the user's script (see
# `exit_if_importing_main`): 78 is sysexits' EX_CONFIG, which nothing else here exits with.
RAN_THE_SCRIPT_AGAIN = 78


def exit_if_importing_main() -> None:
    """Under forkserver and spawn, multiprocessing imports the user's main script again in every
    worker process (as __mp_main__). A script that calls pack() at its top level, with no
    `if __name__ == "__main__":`, would then run pack again in each worker, meet the driver's
    output lock there, and leave the driver reporting a dead worker ("... run out of memory") or
    verify a whole shard as "crashed". Such a worker exits here with RAN_THE_SCRIPT_AGAIN, before
    it starts anything, and the driver says what to change (`script_ran_again`)."""
    if getattr(multiprocessing.process.current_process(), "_inheriting", False):
        os._exit(RAN_THE_SCRIPT_AGAIN)


def script_ran_again(exit_codes: Iterable[int | None]) -> str | None:
    """What the driver says when a worker ended by `exit_if_importing_main` (one of `exit_codes`)."""
    if RAN_THE_SCRIPT_AGAIN not in exit_codes:
        return None
    script = getattr(sys.modules.get("__main__"), "__file__", None) or "the main script"
    return (
        f"each worker process imports {script} again (Python's multiprocessing does), and its top-level code "
        'called shardkit again there: put that call under `if __name__ == "__main__":`'
    )


def started_context(
    preload: tuple[str, ...] = FORKSERVER_PRELOAD,
) -> multiprocessing.context.SpawnContext | multiprocessing.context.ForkServerContext:
    """mp_context, with multiprocessing's helper processes started the way a stop signal to the
    whole group needs. Both are started with SIGINT and SIGHUP blocked, which they keep:
    - the resource tracker ignores SIGINT and SIGTERM but not SIGHUP: a SIGHUP would kill it, the
      driver would start a new one, and that one would print a KeyError traceback for every
      semaphore the old one was told of;
    - the forkserver ignores SIGINT only once its preload imports are done: a Ctrl-C during them
      would print its KeyboardInterrupt traceback.
    Workers unblock both (start_worker). SIGTERM still ends either at once: it prints nothing."""
    exit_if_importing_main()
    context = mp_context(preload)
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
# under a longer TMPDIR (SLURM's per-job scratch folders, pytest's) it cannot be made at all
# ("OSError: AF_UNIX path too long", a traceback).
_LONGEST_TMP = 70


def _temp_dir() -> str:
    """multiprocessing's temp folder for this process (made now: the one the forkserver will use,
    and the one forkserver_exit removes once this process is gone), under /tmp when TMPDIR is too
    long for the forkserver's socket. Always this process's own: a multiprocessing child inherits
    its parent's folder (a Process carries its parent's config), and a shardkit pool in such a child
    (a user's own worker running pack) would remove the parent's folder, with its forkserver's
    socket, when the child ends: the parent could then start no process, and its exit would print a
    traceback."""
    import tempfile

    config = cast(Any, multiprocessing.process.current_process())._config  # where get_temp_dir keeps it
    inherited = config.get("tempdir")
    if inherited is not None and not _removed_at_exit_here(inherited):
        config["tempdir"] = None  # the parent's, left alone: get_temp_dir makes this process its own
    if config.get("tempdir") is None and len(os.fsencode(tempfile.gettempdir())) > _LONGEST_TMP:
        import shutil

        folder = tempfile.mkdtemp(prefix="pymp-", dir="/tmp")
        multiprocessing.util.Finalize(None, shutil.rmtree, args=(folder, True), exitpriority=-100)
        config["tempdir"] = folder
    return multiprocessing.util.get_temp_dir()


def _removed_at_exit_here(folder: str) -> bool:
    """Whether this process removes `folder` at its exit (a finalizer of multiprocessing's own, or
    _temp_dir's, made in this process): what makes a temp folder this process's. A child's registry
    starts empty, and a finalizer copied by a plain fork runs only in the process that made it."""
    finalizers = list(cast(Any, multiprocessing.util)._finalizer_registry.values())
    return any(
        getattr(finalizer, "_pid", None) == os.getpid() and folder in (getattr(finalizer, "_args", None) or ())
        for finalizer in finalizers
    )


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


def quiet_unretrieved_task_errors() -> None:
    """asyncio reports a task whose exception nobody retrieved through its logger, and with no
    logging set up Python prints that to stderr with a traceback. fsspec's S3 client leaves such
    tasks behind when a store goes away mid-request; the failure itself reaches shardkit as an
    error, said in one line. A NullHandler on asyncio's logger keeps the traceback off the terminal,
    while a program that sets up logging still gets the record (it propagates to the root)."""
    logger = logging.getLogger("asyncio")
    if not any(isinstance(handler, logging.NullHandler) for handler in logger.handlers):
        logger.addHandler(logging.NullHandler())


def start_worker(
    driver: int,
    initializer: Callable[..., None] | None = None,
    initargs: tuple[Any, ...] = (),
    environment: dict[str, str] | None = None,
) -> None:
    """Runs first in every worker process. Ctrl-C, which a terminal sends to every process, is the
    driver's to handle (it stops the workers itself); a SIGTERM ends a worker as usual. When the
    driver dies (even by kill -9) the worker exits within a second instead of working for nobody.

    `environment` is the driver's at the pool's start: a forkserver's children inherit the
    forkserver's environment, which is the driver's when the forkserver started, so a variable the
    driver set since (credentials, an endpoint) would be missing in its workers."""
    if environment is not None:
        os.environ.clear()
        os.environ.update(environment)
    mark("worker")
    quiet_unretrieved_task_errors()  # (a worker's stderr is the user's terminal)
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
