"""One BLAS thread for numpy in the CLI's processes, unless the user's environment says otherwise:
imported by `__main__` before anything imports numpy; the forkserver and the workers inherit it. A
library user's process is left as it is, and so are its children: the forkserver is the process's
one, shared with the user's own pools, and numpy's thread count is fixed once it is loaded there.

numpy's OpenBLAS starts a thread per core at import, and each spins for a while before it sleeps,
taking CPU from the workers: the forkserver imports numpy at start-up, and the driver imports it
through pyarrow (its index.parquet writer) while the workers encode. Workers are already one per
core, and nothing shardkit runs multiplies matrices larger than phash's 32 x 32, which OpenBLAS
keeps on one thread anyway."""

from __future__ import annotations

import os

BLAS_THREADS_ENV = "OPENBLAS_NUM_THREADS"

os.environ.setdefault(BLAS_THREADS_ENV, "1")
