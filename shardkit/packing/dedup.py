"""Copies among many files: their hashes, taken in parallel, the sets of copies (exact: the same
bytes; near: DCT hashes joined within a threshold, through multi-index hashing, not all pairs),
and what `pack --dedup` keeps: the first file of each set in walk order (the source's sorted
order, so the choice does not depend on --shuffle or on the workers).

`shardkit duplicates` (checks/duplicates.py) reports the same sets; this module decides nothing
about printing.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ..core.errors import Failure
from ..core.executors import default_workers, map_local
from ..core.phash import components, distances, near_components
from .discover import Item, display
from .hashes import hash_files

CHUNK_FILES = 256


@dataclass
class Hashed:
    """The hashes of a list of files, by position: `digests[i]` is None when file i could not be
    read; `hashed[i]` says whether `hashes[i]` holds its DCT hash; `problems` (position, stage, why)."""

    digests: list[str | None]
    hashes: np.ndarray  # uint64
    hashed: np.ndarray  # bool
    problems: list[tuple[int, str, str]]


def hash_paths(
    paths: Sequence[str], near: bool, max_pixels: int, workers: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> Hashed:  # fmt: skip
    """sha256 of every file and, with `near`, its DCT hash (a reduced decode), in worker processes."""
    chunks = [(list(paths[i : i + CHUNK_FILES]), near, max_pixels) for i in range(0, len(paths), CHUNK_FILES)]
    result = Hashed([None] * len(paths), np.zeros(len(paths), np.uint64), np.zeros(len(paths), bool), [])
    done = 0
    for index, rows in map_local(hash_files, chunks, workers or default_workers()):
        for offset, (digest, value, why) in enumerate(rows):
            at = index * CHUNK_FILES + offset
            result.digests[at] = digest
            if value is not None:
                result.hashes[at], result.hashed[at] = value, True
            if why is not None:
                result.problems.append((at, "decode" if digest else "read", why))
        done += len(rows)
        if progress is not None:
            progress(done)
    return result


def exact_sets(digests: Sequence[str | None]) -> list[list[int]]:
    """Positions sharing a digest (two or more), each set in order."""
    by_digest: dict[str, list[int]] = {}
    for at, digest in enumerate(digests):
        if digest is not None:
            by_digest.setdefault(digest, []).append(at)
    return [members for members in by_digest.values() if len(members) > 1]


def near_sets(digests: Sequence[str | None], hashes: np.ndarray, hashed: np.ndarray, threshold: int) -> list[list[int]]:
    """Positions joined through DCT hashes within `threshold` bits (transitively), two or more
    contents to a set; the search runs over distinct contents (one hash per digest), and a set then
    lists every copy of each of its contents, in order."""
    firsts: dict[str, int] = {}
    copies: dict[int, list[int]] = {}
    for at, digest in enumerate(digests):
        if digest is not None and hashed[at]:
            first = firsts.setdefault(digest, at)
            copies.setdefault(first, []).append(at)
    members = np.array(sorted(copies), np.int64)
    if len(members) < 2:
        return []
    group_of = near_components(hashes[members], threshold)
    joined: dict[int, list[int]] = {}
    for i, group in enumerate(group_of.tolist()):
        joined.setdefault(group, []).append(i)
    return [
        sorted(at for i in component for at in copies[int(members[i])])
        for component in joined.values()
        if len(component) > 1
    ]


def dedup_items(
    items: Sequence[Item], mode: str, threshold: int, max_pixels: int, workers: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> tuple[list[Item], list[Failure]]:  # fmt: skip
    """The items to pack (the first of each set of copies, in walk order) and a Failure at stage
    "duplicate" for each other one, naming the key and file it duplicates. A file that cannot be
    read or hashed is kept: the pack records why it fails, as it would without --dedup."""
    near = mode == "near"
    table = hash_paths([item.path for item in items], near, max_pixels, workers, progress)
    sets = exact_sets(table.digests)
    if near:
        sets += near_sets(table.digests, table.hashes, table.hashed, threshold)
    pairs = np.array([(members[0], other) for members in sets for other in members[1:]], np.int64).reshape(-1, 2)
    first = components(len(items), pairs)  # per item, the first item of its set (itself when none)
    kept: list[Item] = []
    dropped: list[Failure] = []
    for at, item in enumerate(items):
        keeper = int(first[at])
        if keeper == at:
            kept.append(item)
            continue
        original = items[keeper]
        if table.digests[at] == table.digests[keeper]:
            this = same_file(item.path)
            linked = this is not None and this == same_file(original.path)
            why = f"{'the same file (a link)' if linked else 'the same bytes'} as {display(original.relpath)}"
        else:
            bits = int(distances(table.hashes[at : at + 1], table.hashes[keeper : keeper + 1])[0])
            why = f"a near copy of {display(original.relpath)} (DCT hashes {bits} bits apart)"
        dropped.append(Failure(display(item.relpath), "duplicate", why, duplicate_of=original.key))
    return kept, dropped


def same_file(path: str) -> tuple[int, int] | None:
    """(device, inode) of a file, or None when it cannot be stat'ed: links to one file are one file."""
    try:
        status = os.stat(path)
    except OSError:
        return None
    return status.st_dev, status.st_ino
