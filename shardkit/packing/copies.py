"""Exact copies among a probe's files: the candidates the census found (same size and head hash),
named by a second walk and confirmed by sha256, read through a descriptor that must still be the
file the scan counted."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from ..core.headers import file_identity
from ..core.manifest import sha256_of
from ..core.safeio import open_regular
from ..runtime.pools import map_threads
from .census import ExactCopies
from .sources import display

Runs = Iterable[tuple[str, list[str] | None, list[str]]]  # (prefix, paths or None, relpaths): a walk in runs


def candidate_names(
    runs: Runs, places: np.ndarray, keys: np.ndarray, identities: np.ndarray
) -> list[tuple[int, int, str, str]]:
    """(key, file identity, path, relpath) of the files at `places` (sorted positions in walk
    order). A folder changed since the first walk may put other files there: confirm_copies reads
    only a file whose identity is the one counted."""
    names: list[tuple[int, int, str, str]] = []
    at = 0
    for prefix, run_paths, run_relpaths in runs:
        first, end = np.searchsorted(places, [at, at + len(run_relpaths)])
        for j in range(int(first), int(end)):
            i = int(places[j]) - at
            path = run_paths[i] if run_paths is not None else prefix + run_relpaths[i]
            names.append((int(keys[j]), int(identities[j]), path, run_relpaths[i]))
        at += len(run_relpaths)
        if end == len(places):
            break
    return names


Digest = Callable[[str, int], "tuple[str, int] | None"]  # (path, identity) -> (sha256, size), None: unreadable


def confirm_copies(
    names: Sequence[tuple[int, int, str, str]], workers: int, links: int = 0, examples: int = 5,
    progress: Callable[[int, int], None] | None = None, digest: Digest | None = None,
) -> ExactCopies:  # fmt: skip
    """Which of the candidate files (key, identity, path, relpath), distinct files in walk order,
    really copy each other: those with the same key and the same sha256. A file gone, unreadable,
    or no longer the file counted (its identity changed) since the scan is left out. `digest`
    reads one file (default: a local file's, through one descriptor)."""
    jobs = [[(path, identity) for _, identity, path, _ in names[i : i + 64]] for i in range(0, len(names), 64)]
    read: list[tuple[str, int] | None] = [None] * len(names)
    done = 0
    one = digest or _digest
    for index, found in map_threads(lambda files: [one(path, identity) for path, identity in files], jobs, workers):
        read[index * 64 : index * 64 + len(found)] = found
        done += len(found)
        if progress is not None:
            progress(done, len(names))
    groups: dict[tuple[int, str], list[tuple[int, int]]] = {}  # (key, sha256) -> (name, size) of each file
    for i, ((key, *_), taken) in enumerate(zip(names, read, strict=True)):
        if taken is not None:
            groups.setdefault((key, taken[0]), []).append((i, taken[1]))
    copies = [group for group in groups.values() if len(group) > 1]
    return ExactCopies(
        files=sum(len(group) - 1 for group in copies),
        groups=len(copies),
        bytes=sum(group[0][1] * (len(group) - 1) for group in copies),
        links=links,
        examples=[[display(names[i][3]) for i, _ in group] for group in copies[:examples]],
    )


def _digest(path: str, identity: int) -> tuple[str, int] | None:
    """The sha256 and size of a local file, read through one descriptor whose file must be the one
    the scan counted; None where it cannot be read or is another file."""
    try:
        fd = open_regular(path)  # a FIFO put in a candidate's place is refused, not waited on
    except OSError:
        return None
    try:
        status = os.fstat(fd)
        return (sha256_of(fd), status.st_size) if file_identity(status) == identity else None
    except OSError:
        return None
    finally:
        os.close(fd)
