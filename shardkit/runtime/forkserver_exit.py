"""Imported by the forkserver process only, never elsewhere (a preload of `processes.mp_context`):
it removes the driver's multiprocessing temp folder (/tmp/pymp-*, which holds the forkserver's
socket) when the forkserver exits. The driver removes it on a normal exit; after a kill -9 of the
driver nothing else would, and each killed run would leave a folder behind. The forkserver outlives
the driver by design: it exits once the driver and every worker are gone, so the socket is no
longer needed by then."""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import sys
import time

from .processes import FORKSERVER_TEMP_ENV, forkserver_folder


def _register() -> None:
    # Taken out of the environment: the workers forked from here, and whatever they start, must not
    # see it (they are not the forkserver).
    named = forkserver_folder(os.environ.pop(FORKSERVER_TEMP_ENV, ""))
    if named is None:
        return
    driver, folder = named
    # Only in the forkserver itself (the driver's child), or where the driver is gone.
    if driver == os.getppid():
        atexit.register(_remove_if_orphaned, driver, folder)
    elif not _alive(driver):  # gone before these imports ran (a stop early in its start-up): orphaned
        shutil.rmtree(folder, ignore_errors=True)
    # (else the driver lives and the folder is in use: the driver imported this module itself, as a
    # test of the preloads does, or the variable reached another process's forkserver)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # (another user's: alive)
        pass
    return True


def _remove_if_orphaned(driver: int, folder: str) -> None:
    # While the driver lives, the folder is its to remove (its exit handler would fail on a folder
    # gone, with a traceback); once it is gone, this process has a new parent. That can take a
    # moment after the driver's descriptors closed (which is what ended this process): wait up to a
    # second, looking every millisecond (a coarser poll keeps the output's pipe open that much longer).
    for _ in range(1000):
        if os.getppid() != driver:
            shutil.rmtree(folder, ignore_errors=True)
            break
        time.sleep(0.001)
    # The last exit handler (registered first, by the preload): what is left after it is the
    # interpreter's teardown of every preloaded module (numpy and the codecs among them), which
    # os._exit skips, since whoever reads the driver's output waits for this process to let go of it.
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(0)


_register()
