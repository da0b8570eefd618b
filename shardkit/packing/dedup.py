"""Copies among many files: their hashes, taken in worker processes (`shardkit duplicates` takes
them here too), and what `pack --dedup` keeps: in walk order (sorted paths for a folder, rows or
lines for a table or list: never --shuffle's order or the workers'), each file that is not a copy
of one kept before (the same bytes, or a DCT hash within the threshold, found by multi-index
hashing, not all pairs). A kept file that then fails in the worker has its copies as fallbacks,
tried in its place in walk order (`Fallbacks`, `settle`): one of each set that packs is packed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, NamedTuple

from ..core.errors import Failure
from ..core.manifest import SHA256_HEX
from ..core.safeio import file_stamp, open_regular
from ..runtime.pools import default_workers, map_local
from .sources import Item, display, payload

if TYPE_CHECKING:  # (numpy is imported where it is used: a pack without --dedup never needs it)
    import numpy as np

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
    progress: Callable[[int], None] | None = None, cache: Path | None = None, reuse: bool = True,
) -> Hashed:  # fmt: skip
    """sha256 of every file and, with `near`, its DCT hash (a reduced decode), in worker processes.

    With `cache` (a pack's `.shardkit/hashes.jsonl`), each file's hashes are appended there as they
    come, and with `reuse` (a --resume) a file whose size, times and inode are those cached is not
    read again: a stopped `pack --dedup` resumes without hashing what it had hashed. The cache is
    best effort: one that cannot be read or written is not used, and nothing fails for it."""
    import numpy as np

    result = Hashed([None] * len(paths), np.zeros(len(paths), np.uint64), np.zeros(len(paths), bool), [])
    stamps = [file_stamp(path) for path in paths] if cache is not None else []
    taken = np.zeros(len(paths), bool)
    usable = False
    if cache is not None and reuse:
        # the cache streamed against the files, never loaded whole: memory holds `where`, an entry a file
        where: dict[str, int] = {}
        again: dict[str, list[int]] = {}  # a path listed more than once: its other places
        for at, path in enumerate(paths):
            if where.setdefault(path, at) != at:
                again.setdefault(path, []).append(at)
        cached = _read_cache(cache, near, max_pixels)
        usable = cached is not None
        if cached is not None:
            with contextlib.closing(cached):
                for path, was, hashes in cached:
                    first = where.get(path)
                    if first is None:
                        continue
                    for place in (first, *again.get(path, ())):
                        if not taken[place] and was == stamps[place]:
                            _take(result, place, hashes)
                            taken[place] = True
        del where
    todo = np.flatnonzero(~taken).tolist()
    done = len(paths) - len(todo)
    if progress is not None and done:
        progress(done)
    chunks = [
        ([paths[at] for at in todo[i : i + CHUNK_FILES]], near, max_pixels) for i in range(0, len(todo), CHUNK_FILES)
    ]
    with _cache_writer(cache, near, max_pixels, fresh=not usable) as out:
        for index, rows in map_local(_hash_files, chunks, workers or default_workers()):
            lines = []
            for offset, row in enumerate(rows):
                at = todo[index * CHUNK_FILES + offset]
                _take(result, at, row)
                stamp = stamps[at] if stamps else None
                if stamp is not None and row[0] is not None:
                    lines.append(json.dumps([paths[at], *stamp, *row]) + "\n")
            out.write(lines)
            done += len(rows)
            if progress is not None:
                progress(done)
    result.problems.sort()
    return result


def _take(result: Hashed, at: int, row: Sequence[Any]) -> None:
    digest, value, why = row
    result.digests[at] = digest
    if value is not None:
        result.hashes[at], result.hashed[at] = value, True
    if why is not None:
        result.problems.append((at, "decode" if digest else "read", why))


_STAMP_FIELDS = 4  # file_stamp's
# a cached row: (path, file_stamp, (sha256, DCT hash or None, why not hashed or None))
CachedRow = tuple[str, tuple[int, ...], tuple[str, Any, Any]]


_CACHE_VERSION = 2


def _read_cache(cache: Path, near: bool, max_pixels: int) -> Generator[CachedRow] | None:
    """The rows cached with the same options, as (path, stamp, (sha256, DCT hash or None, why or
    None)), streamed; None when the cache cannot be read or was made with other options. A row
    that does not parse (the last, cut by a stop; a damaged file) is left out."""
    try:
        lines = _open_state(cache, os.O_RDONLY, "r")
    except OSError:
        return None
    try:
        head = json.loads(next(lines, "null"))
    except (ValueError, OSError, RecursionError):  # RecursionError: a hostile nesting of brackets
        head = None
    if head != {"version": _CACHE_VERSION, "near": near, "max_pixels": max_pixels}:
        lines.close()
        return None
    return _cache_rows(lines)


def _cache_rows(lines: IO[str]) -> Generator[CachedRow]:
    with lines:
        try:
            for line in lines:
                try:
                    path, *stamp, digest, value, why = json.loads(line)
                except (ValueError, TypeError, RecursionError):
                    continue
                if (
                    isinstance(path, str) and len(stamp) == _STAMP_FIELDS and all(type(v) is int for v in stamp)
                    and isinstance(digest, str) and SHA256_HEX.fullmatch(digest) is not None
                    and (value is None or (type(value) is int and 0 <= value < 1 << 64))
                    and (why is None or isinstance(why, str))
                ):  # fmt: skip
                    yield path, tuple(stamp), (digest, value, why)
        except OSError:
            return  # a read error part way: what was read stands


def _open_state(path: Path, flags: int, mode: str) -> IO[str]:
    """A file of the output's state folder, as the lock is opened (open_regular's `own`: no link
    followed, no other name, never a FIFO). Bytes that are not UTF-8 read as replacement
    characters (a row that then fails)."""
    return os.fdopen(open_regular(path, flags, own=True), mode, encoding="utf-8", errors="replace")


class _CacheOut:
    """Appends rows to the cache; the first write that fails ends the caching, not the pack."""

    def __init__(self, out: IO[str] | None) -> None:
        self.out = out

    def write(self, lines: list[str]) -> None:
        if self.out is None or not lines:
            return
        try:
            self.out.writelines(lines)
            self.out.flush()  # a stop loses at most the chunks in flight
        except OSError:  # a full disk, a file size limit: the hashes are only not kept
            with contextlib.suppress(OSError):
                self.out.close()
            self.out = None


@contextlib.contextmanager
def _cache_writer(cache: Path | None, near: bool, max_pixels: int, fresh: bool) -> Iterator[_CacheOut]:
    """The cache opened for appending, or started again (its options first) when nothing of it
    was usable: then the old name is removed and a new file made (O_EXCL), never truncated."""
    out: IO[str] | None = None
    if cache is not None:
        try:
            if fresh:
                cache.unlink(missing_ok=True)
                out = _open_state(cache, os.O_WRONLY | os.O_CREAT | os.O_EXCL, "w")
                out.write(json.dumps({"version": _CACHE_VERSION, "near": near, "max_pixels": max_pixels}) + "\n")
            else:
                out = _open_state(cache, os.O_RDWR | os.O_APPEND, "a")
                size = os.fstat(out.fileno()).st_size
                if size and os.pread(out.fileno(), 1, size - 1) != b"\n":
                    out.write("\n")  # a row cut by a stop ends here: the next one starts on a line of its own
        except OSError:
            out = None  # no cache: the hashes are only not kept for a resume
    writer = _CacheOut(out)
    try:
        yield writer
    finally:
        if writer.out is not None:
            with contextlib.suppress(OSError):
                writer.out.close()


class Fallbacks(NamedTuple):
    """The copies left out for one kept item: what the worker tries, in this order, in its place
    when it cannot be packed (a sidecar that fails, a decode the hash did not need, a file changed
    since it was hashed)."""

    name: str  # the kept file, as errors.jsonl shows it
    copies: list[tuple[Item, int]]  # each copy, in walk order, and the place of its row in the pack's skipped rows


class Deduplicated(NamedTuple):
    kept: list[Item]
    dropped: list[Failure]  # a row at stage "duplicate" for each copy left out, in walk order
    fallbacks: dict[str, Fallbacks]  # by the key of each kept item that has copies; places index `dropped`


class Earlier(NamedTuple):
    """The records an output holds already (what an append adds to), as --dedup compares new files
    with them: each record's key, source path, source sha256 and DCT hash (`hashed`: it has one),
    all from index.parquet."""

    keys: list[str]
    sources: list[str]
    digests: list[str | None]
    hashes: np.ndarray
    hashed: np.ndarray


def dedup_items(
    items: Sequence[Item], mode: str, threshold: int, max_pixels: int, workers: int | None = None,
    progress: Callable[[int], None] | None = None, confine: str | None = None, cache: Path | None = None,
    reuse: bool = True, earlier: Earlier | None = None,
) -> Deduplicated:  # fmt: skip
    """The items to pack and a Failure at stage "duplicate" for each other one, naming the key and
    file it copies. Decided in walk order: an item is left out when it is a copy of one already
    kept (the same bytes, or with `near` a DCT hash within `threshold` bits of it), never through
    a chain of copies (A near B near C does not drop C when C is far from A). A file that cannot
    be read or hashed, or (`confine`: a table's source) lies outside that folder, is kept: the pack
    records why it fails, as it would without --dedup. `earlier`: records kept before every item
    (an output's, for an append), never left out themselves."""
    import numpy as np

    near = mode == "near"
    inside = [confine is None or os.path.realpath(item.path).startswith(confine + os.sep) for item in items]
    table = hash_paths([item.path for item, ok in zip(items, inside, strict=True) if ok], near, max_pixels, workers,
                       progress, cache, reuse)  # fmt: skip
    digests: list[str | None] = [None] * len(items)
    hashes = np.zeros(len(items), np.uint64)
    hashed = np.zeros(len(items), bool)
    where = np.flatnonzero(inside)
    for i, at in enumerate(where.tolist()):
        digests[at], hashes[at], hashed[at] = table.digests[i], table.hashes[i], table.hashed[i]
    return keep_first(items, Hashed(digests, hashes, hashed, []), threshold if near else None, earlier)


def _hash_files(chunk: tuple[list[str], bool, int]) -> list[tuple[str | None, int | None, str | None]]:
    """hashes.hash_files, imported in the worker that runs it (it imports numpy and the codecs)."""
    from .hashes import hash_files

    return hash_files(chunk)


def keep_first(
    items: Sequence[Item], table: Hashed, threshold: int | None, earlier: Earlier | None = None
) -> Deduplicated:
    """`dedup_items`' decision over hashes already taken (`threshold` None: exact copies only), with
    the `earlier` records kept first (positions before the items': an item is a copy of one of them
    as of one of its own, with no fallback, since the record is packed already)."""
    import numpy as np

    from ..core.phash import near_components

    near = threshold is not None
    before = 0 if earlier is None else len(earlier.keys)
    digests = table.digests if earlier is None else [*earlier.digests, *table.digests]
    hashes = table.hashes if earlier is None else np.concatenate([earlier.hashes, table.hashes])
    hashed = table.hashed if earlier is None else np.concatenate([earlier.hashed, table.hashed])
    # Distinct hash values and their groups (joined through pairs within the threshold): a kept
    # item within the threshold of a value is in its group, and the pairs are never listed (a
    # burst of k near-identical shots has k^2 / 2 of them).
    grouped = hashed if threshold is None or earlier is None else _near_new(hashed, hashes, before, threshold)
    values, value_of = np.unique(hashes[grouped], return_inverse=True)
    group_of = near_components(values, threshold).tolist() if threshold is not None else []
    value_at = np.full(len(hashes), -1, np.int64)
    value_at[np.flatnonzero(grouped)] = value_of.ravel()
    first_of_digest: dict[str, tuple[int, bool]] = {}  # a digest -> the item kept for it, and whether its bytes
    kept_in_group: dict[int, list[tuple[int, int]]] = {}  # a group -> (hash, item) of each item kept in it
    kept: list[Item] = []
    dropped: list[Failure] = []
    fallbacks: dict[str, Fallbacks] = {}

    def item_at(at: int) -> Item:
        if at >= before:
            return items[at - before]
        assert earlier is not None
        return Item(earlier.sources[at], earlier.sources[at], earlier.keys[at])

    def drop(item: Item, at: int, why: str) -> None:
        original = item_at(at)
        if at >= before:  # (a record of the output is packed already: no copy stands in for it)
            fallbacks.setdefault(original.key, Fallbacks(display(original.relpath), [])).copies.append(
                (item, len(dropped))
            )
        dropped.append(_duplicate(item, original, why))

    def keep(at: int) -> None:
        digest = digests[at]
        if digest is not None and digest not in first_of_digest:
            first_of_digest[digest] = (at, True)
        if near and value_at[at] >= 0:
            kept_in_group.setdefault(group_of[value_at[at]], []).append((int(hashes[at]), at))

    for at in range(before):
        keep(at)
    for at in range(before, len(hashes)):
        item, digest = items[at - before], digests[at]
        if digest is not None and digest in first_of_digest:
            original, exact = first_of_digest[digest]
            why = (
                _same_bytes(item, item_at(original)) if exact else _near(item, item_at(original), hashes, at, original)
            )
            drop(item, original, why)
            continue
        keeper = None
        if threshold is not None and value_at[at] >= 0:
            keeper = _first_within(kept_in_group.get(group_of[value_at[at]], ()), int(hashes[at]), threshold)
        if keeper is not None:
            drop(item, keeper, _near(item, item_at(keeper), hashes, at, keeper))
            if digest is not None:  # its own exact copies are near copies of the same kept item
                first_of_digest[digest] = (keeper, False)
            continue
        kept.append(item)
        keep(at)
    return Deduplicated(kept, dropped, fallbacks)


# An append looks its new files up in the output's records when that compares fewer candidate pairs
# than this many per record; else (a dense cluster) the whole output is grouped as before.
_LOOKUP_BUDGET_PER_RECORD = 64


def _near_new(hashed: np.ndarray, hashes: np.ndarray, before: int, threshold: int) -> np.ndarray:
    """The hashes worth grouping when the first `before` are an output's records and the rest an
    append's new files: every new one, and the records within `threshold` of a new one. The others
    are never within the threshold of a new file, so no decision needs them, and grouping a million
    records for ten thousand new files took most of an append's time. (Groups only narrow the
    search: `_first_within` still measures each candidate, in walk order.)"""
    import numpy as np

    from ..core.phash import near_any

    new: np.ndarray = np.array(hashed, bool)
    new[:before] = False
    records = np.flatnonzero(hashed[:before])
    close = near_any(hashes[records], hashes[new], threshold, _LOOKUP_BUDGET_PER_RECORD * max(1, len(records)))
    if close is None:
        return hashed
    new[records[close]] = True
    return new


def _first_within(kept: Sequence[tuple[int, int]], value: int, threshold: int) -> int | None:
    """The first kept item (of `kept`: (hash, item), in walk order) within `threshold` bits of
    `value`, or None. Kept items are more than the threshold apart: a dense cluster keeps one."""
    for other, at in kept:
        if (other ^ value).bit_count() <= threshold:
            return at
    return None


def settle(
    rows: Sequence[Failure], fallbacks: Mapping[str, Fallbacks], copies_used: Mapping[str, str]
) -> list[Failure]:
    """The pack's skipped rows as it turned out, from what the workers did: for each kept item that
    failed (`copies_used`: its key -> the key of the copy packed in its place, "" when none was), the
    rows of the copies tried are gone (one was packed; the others failed and have rows of their
    own), and those not tried name the copy packed (`Fallbacks`' places index `rows`). Nothing
    failed: `rows` as they were."""
    if not copies_used:
        return list(rows)
    rows = list(rows)
    gone: set[int] = set()
    for key, packed in copies_used.items():
        fallback = fallbacks.get(key)
        if fallback is None:
            continue
        keys = [item.key for item, _ in fallback.copies]
        tried = keys.index(packed) + 1 if packed in keys else len(keys)
        gone.update(place for _, place in fallback.copies[:tried])
        if tried < len(keys):
            name = display(fallback.copies[tried - 1][0].relpath)
            for _, place in fallback.copies[tried:]:
                row = rows[place]
                why = f"{row.reason}; {fallback.name} could not be packed, {name} is packed in its place"
                rows[place] = replace(row, reason=why, duplicate_of=packed)
    return [row for at, row in enumerate(rows) if at not in gone]


def fallback_stamps(shard_hash: str, copies: Mapping[str, Sequence[Item]]) -> str:
    """A shard's own hash (its done marker's) with its fallbacks' files folded in: a copy changed
    since a shard packed it in a failed file's place writes the shard again. A shard without
    fallbacks keeps its hash."""
    if not copies:
        return shard_hash
    digest = hashlib.sha256(shard_hash.encode())
    for key in sorted(copies):
        for item in copies[key]:
            folder = os.path.dirname(item.path)
            files = [item.path, *(os.path.join(folder, name) for _, name in sorted((item.sidecars or {}).items()))]
            stamps = "\0".join(str(file_stamp(path)) for path in files)
            digest.update(f"\0{key}\0{item.key}\0{payload(item)}\0{stamps}".encode("utf-8", "surrogateescape"))
    return digest.hexdigest()


def _same_bytes(item: Item, original: Item) -> str:
    this = same_file(item.path)
    linked = this is not None and this == same_file(original.path)
    return f"{'the same file (a link)' if linked else 'the same bytes'} as {display(original.relpath)}"


def _near(item: Item, original: Item, hashes: np.ndarray, at: int, kept: int) -> str:
    from ..core.phash import distances

    bits = int(distances(hashes[at : at + 1], hashes[kept : kept + 1])[0])
    return f"a near copy of {display(original.relpath)} (DCT hashes {bits} bits apart)"


def _duplicate(item: Item, original: Item, why: str) -> Failure:
    return Failure(display(item.relpath), "duplicate", why, duplicate_of=original.key)


def same_file(path: str) -> tuple[int, int] | None:
    """(device, inode) of a file, or None when it cannot be stat'ed: links to one file are one file."""
    try:
        status = os.stat(path)
    except OSError:
        return None
    return status.st_dev, status.st_ino
