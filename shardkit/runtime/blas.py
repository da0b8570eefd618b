"""One BLAS thread for numpy in the CLI's processes, unless the user's environment says otherwise:
imported by `__main__` before anything imports numpy; the forkserver and the workers inherit it. A
library user's process is left as it is, and so are its children: the forkserver is the process's
one, shared with the user's own pools, and numpy's thread count is fixed once it is loaded there.

numpy's OpenBLAS starts a thread per core at import, and each spins for a while before it sleeps:
numpy's import took 0.20 s of CPU against 0.07 s with one thread, and a pack of 700 images on 2
workers 2.75 s of CPU against 2.52 s (this machine's 2 cores; the spinning ran in the forkserver
at start-up and in the driver, whose index.parquet writer imports numpy through pyarrow, while
both workers encoded). Workers are already one per core, and nothing shardkit runs multiplies
matrices larger than phash's 32 x 32, which OpenBLAS keeps on one thread anyway."""

from __future__ import annotations

import os

BLAS_THREADS_ENV = "OPENBLAS_NUM_THREADS"

os.environ.setdefault(BLAS_THREADS_ENV, "1")
