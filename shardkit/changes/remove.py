"""`shardkit remove`: records taken out of a finished output (a takedown, a privacy request) without
packing it again.

The shards that hold them are written again without them under the next version's names
(`shard-NNNNNN-vK`), record for record as pack writes them, and the shards they held are deleted:
the removed images' bytes are in no file of the output afterwards (unless `keep_versions` asks to
keep the version before, and them with it, in versions/vN). Every other shard stays byte
for byte. Each removed record becomes a row of errors.jsonl (stage `removed`, the reason given),
so inputs = records + errors still holds and `verify --source` accounts for every input; the
manifest's `history` says what each version removed, and why. A kill at any point leaves the
earlier version or the new one (changes/journal.py); the rewriting is changes/rewrite.py's.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..core.config import DEFAULT_DEDUP_THRESHOLD
from ..core.errors import ConfigError, Failure, OutputError
from ..core.manifest import VERSIONS_DIR, Manifest, ShardInfo
from ..packing.shard_writing import PICTURE_COUNTS
from ..packing.working_folder import versioned_name
from ..readers.arrays import strings
from ..readers.subset import IndexFile, Selection, select
from ..storage.urls import is_remote
from .journal import Changing, Journal
from .rewrite import Change, new_journal, refuse_foreign_shards, refuse_taken_names, run

REMOVED = "removed"  # errors.jsonl's stage of a record a remove took out
SHOWN = 3  # keys the output lacks that a refusal names


@dataclass(frozen=True)
class RemoveResult:
    """What a remove did: the version it made (the one there was, where nothing was removed), the
    records removed, the keys asked for that the output lacks, and what was written."""

    output: str
    version: int
    removed: int
    missing: int  # keys asked for that the output lacks (allowed with missing_ok)
    rewritten: int  # shards written again without the removed records
    dropped: int  # shards left with no record, deleted
    bytes_written: int
    output_bytes: int
    seconds: float
    resumed: bool = False  # an interrupted remove finished

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def remove(
    output: str | os.PathLike[str],
    keys: Iterable[str] | None = None,
    *,
    where: Selection | str | None = None,
    reason: str = "",
    missing_ok: bool = False,
    resume: bool = False,
    keep_versions: bool = False,
    progress: Callable[[int, int], None] | None = None,
    storage_options: dict[str, Any] | None = None,
    like: Sequence[str | os.PathLike[str]] | None = None,
    near: bool = False,
    threshold: int = DEFAULT_DEDUP_THRESHOLD,
) -> RemoveResult:
    """Take the records `keys` names (or those `where` selects: a pyarrow Expression over
    index.parquet's columns, a callable, as `open_shards(select=...)` takes, or a condition as
    `--where` takes it, "label == 3") out of the output `output` (a folder, or a bucket's URL
    reached with `storage_options`), for `reason` (kept in the manifest's history and
    errors.jsonl). Keys the
    output lacks are refused, naming them, unless `missing_ok`. `resume` finishes a remove that was
    interrupted (so does the same remove run again). `keep_versions` keeps the version before whole
    in versions/vN (hard links; a takedown should not: its bytes stay there). `progress(done,
    total)` counts shards written.

    `like` (a takedown by content, as a request with the picture in it comes): image files (or
    folders of them) whose records go, found by the sha256 of the file each was packed from
    (index.parquet's `source_sha256`), and with `near` by its DCT hash within `threshold` bits
    (`phash`: the same picture saved again, resized, re-encoded). A picture the output holds no
    record of is refused, as a missing key is, unless `missing_ok`."""
    if resume and (keys is not None or where is not None or like is not None):
        raise ConfigError("--resume finishes the interrupted remove as it was asked: give no keys with it")
    if not resume and sum(asked is not None for asked in (keys, where, like)) != 1:
        raise ConfigError(
            "remove needs the records to take out: keys, a condition over the index, or pictures (one of them)"
        )
    pictures = None if like is None else _pictures(like, near, threshold)
    asked_where = where
    if isinstance(where, str):  # (a condition written as text, as --where takes it)
        from ..readers.where import parse_where

        where = parse_where(where)
    reason = " ".join(reason.split())
    if not resume and not reason:
        raise ConfigError("remove needs a reason (--reason): the manifest's history and errors.jsonl keep it")
    # (a takedown must reach every file)
    if not (keep_versions or resume or is_remote(output)) and os.path.lexists(Path(output) / VERSIONS_DIR):
        raise _versions_kept(Path(output) / VERSIONS_DIR)
    wanted = None if keys is None else sorted(set(_checked_keys(keys)))
    request = _request(wanted, asked_where, reason, keep_versions, pictures)
    missing = [0]

    def plan(changed: Changing) -> Journal | None:
        if changed.bucket is not None and not keep_versions and changed.bucket.kept_versions():
            raise _versions_kept(f"{changed.bucket.url}/{VERSIONS_DIR}")
        if pictures is not None:
            found, missing[0] = pictures.keys(changed, missing_ok)
            if not found:
                return None
            journal, _ = _plan(changed, found, None, reason, False, request)
            if journal is not None:
                journal.plan["missing"] = missing[0]  # (pictures, not keys, the output lacks)
            return journal
        journal, missing[0] = _plan(changed, wanted, where, reason, missing_ok, request)
        return journal

    change = Change(REMOVED[:-1], request, plan, _totals, _history, _failures, _check, keep_versions)
    done = run(output, change, resume, progress, storage_options)
    if done.journal is None:  # nothing the output holds was named, or nothing was left to finish
        size = sum(s.bytes for s in done.manifest.shards)
        return RemoveResult(str(output), done.manifest.version, 0, missing[0], 0, 0, 0, size, done.seconds)
    spent = done.journal.plan
    writes = len(spent["writes"])
    return RemoveResult(
        str(output), done.journal.version, spent["removed"], spent["missing"], writes, len(spent["gone"]) - writes,
        spent["bytes_written"], spent["output_bytes"], done.seconds, resumed=done.resumed,
    )  # fmt: skip


def _versions_kept(where: str | Path) -> OutputError:
    return OutputError(
        f"{where}: earlier versions are kept there, and a remove would leave the records in them: delete "
        f"{where} first, or give --keep-versions to keep them knowingly"
    )


def _checked_keys(keys: Iterable[str]) -> Iterable[str]:
    if isinstance(keys, (str, bytes)):
        raise ConfigError("remove: keys must be a list of keys, not one string")
    for key in keys:
        if not isinstance(key, str):
            raise ConfigError(f"remove: keys are text; {key!r} is a {type(key).__name__}")
        yield key


def _request(
    keys: list[str] | None,
    where: Selection | str | None,
    reason: str,
    keep_versions: bool,
    pictures: Pictures | None = None,
) -> str:
    """What was asked, as a digest: the same remove run again finishes an interrupted one (and one
    that differs, if only in keeping versions, is refused while it is unfinished)."""
    asked: dict[str, Any] = {"keys": keys, "where": _said(where), "reason": reason}
    if keep_versions:  # (the digest of a remove that keeps none is what it always was)
        asked["keep_versions"] = True
    if pictures is not None:  # (by what the pictures are, not where they lie)
        asked["like"] = [pictures.digests, pictures.hashes if pictures.near else None, pictures.threshold]
    return hashlib.sha256(json.dumps(asked, sort_keys=True).encode()).hexdigest()


@dataclass(frozen=True)
class Pictures:
    """A takedown by content: the pictures asked for (each file's path as given, sha256 and DCT
    hash, None where it gives none), and whether near copies go too."""

    paths: list[str]
    digests: list[str]
    hashes: list[int | None]
    near: bool
    threshold: int

    def keys(self, changed: Changing, missing_ok: bool) -> tuple[list[str], int]:
        """The keys of the output's records of these pictures (the same source bytes; with `near`, a
        DCT hash within the threshold), and how many pictures it holds no record of: refused,
        naming up to three, unless `missing_ok`."""
        import numpy as np

        from ..core.phash import PHASH_HEX, distances

        try:
            table = changed.index().read(columns=["key", "source_sha256", "phash"])
        except ConfigError:  # (an index from before shardkit kept the hashes)
            raise ConfigError(
                f"{changed.name}: its index.parquet keeps no hashes of the files packed (an earlier shardkit's); "
                "take the records out by --keys"
            ) from None
        keys = table.column("key").to_pylist()
        digests = table.column("source_sha256").to_pylist()
        found = [False] * len(self.paths)
        taken = np.zeros(len(keys), bool)
        wanted: dict[str, list[int]] = {}
        for at, digest in enumerate(self.digests):  # (one picture may be given twice, by two names)
            wanted.setdefault(digest, []).append(at)
        for row, digest in enumerate(digests):
            if digest in wanted:
                taken[row] = True
                for at in wanted[digest]:
                    found[at] = True
        if self.near:
            texts = table.column("phash").to_pylist()
            hashed = np.array([isinstance(h, str) and PHASH_HEX.fullmatch(h) is not None for h in texts], bool)
            if not hashed.all():  # (kept as they were by --encode original, before such pictures were hashed)
                raise ConfigError(
                    f"{changed.name}: {int((~hashed).sum()):,} of its records have no DCT hash, so --near cannot "
                    "compare them; find them with `shardkit duplicates OUT --against PICTURES --near`, then "
                    "take them out by --keys"
                )
            values = np.array([int(h, 16) if ok else 0 for h, ok in zip(texts, hashed, strict=True)], np.uint64)
            for at, value in enumerate(self.hashes):
                if value is None:
                    continue
                close = hashed & (distances(values, np.full(len(values), value, np.uint64)) <= self.threshold)
                found[at] = found[at] or bool(close.any())
                taken |= close
        absent = [path for path, there in zip(self.paths, found, strict=True) if not there]
        if absent and not missing_ok:
            named = ", ".join(absent[:SHOWN])
            more = f" and {len(absent) - SHOWN:,} more" if len(absent) > SHOWN else ""
            said = f"{len(absent):,} of the pictures {'is' if len(absent) == 1 else 'are'} in no record of it"
            raise ConfigError(f"{changed.name}: {said}: {named}{more} (--missing-ok to go on)")
        return [key for key, gone in zip(keys, taken.tolist(), strict=True) if gone], len(absent)


def _pictures(like: Sequence[str | os.PathLike[str]], near: bool, threshold: int) -> Pictures:
    """The pictures of a takedown by content, each file (a folder: its image files, at any depth, in
    order) read and hashed before any work; one that cannot be is refused, naming it."""
    from ..core.config import DEFAULT_MAX_PIXELS
    from ..packing.hashes import hash_file
    from ..packing.sources.folder import IMAGE_EXTENSIONS

    if isinstance(like, (str, bytes, os.PathLike)):
        raise ConfigError("remove: like is a list of pictures (files or folders), not one path")
    if not 0 <= threshold <= 32:
        raise ConfigError(f"--dedup-threshold must be between 0 and 32 bits, not {threshold}")
    paths: list[str] = []
    for given in like:
        if os.path.isdir(given):
            found = sorted(
                str(path) for path in Path(given).rglob("*")
                if path.suffix.lower() in IMAGE_EXTENSIONS and path.is_file()
            )  # fmt: skip
            if not found:
                raise ConfigError(f"{given}: a folder with no image in it")
            paths += found
        else:
            paths.append(os.fspath(given))
    if not paths:
        raise ConfigError("remove: no pictures given")
    digests, hashes = [], []
    for path in paths:
        digest, value, why = hash_file(path, near, DEFAULT_MAX_PIXELS)
        if digest is None:
            raise ConfigError(f"{path}: {why}")
        if near and value is None:
            raise ConfigError(f"{path}: no picture to compare ({why}); take it out by its key")
        digests.append(digest)
        hashes.append(value)
    return Pictures(paths, digests, hashes, near, threshold)


def _said(where: Selection | str | None) -> str | None:
    """A condition as the digest takes it: its text, or an Expression's serialized bytes (its repr
    shortens a long `isin` list, so two lists differing in the middle would read the same), or a
    callable's repr."""
    if where is None or isinstance(where, str):
        return where
    reduced = getattr(where, "__reduce__", None)
    try:
        data = reduced()[1][0] if reduced is not None and not callable(where) else None
        return hashlib.sha256(bytes(data)).hexdigest() if data is not None else repr(where)
    except (TypeError, IndexError, ValueError):
        return repr(where)


def _plan(
    changed: Changing, keys: list[str] | None, where: Selection | None, reason: str, missing_ok: bool, request: str
) -> tuple[Journal | None, int]:
    """The journal of this remove: each shard holding a removed record written again without it
    (or gone, where none of its records stays); None where it takes nothing out. And how many of
    the keys the output lacks."""
    import pyarrow.compute as pc

    manifest, output = changed.manifest, changed.name
    refuse_foreign_shards(changed, "remove")
    index = changed.index()
    missing = 0
    selection: Selection
    if keys is not None:
        asked = strings(keys)  # (each a str: checked when asked)
        known = pc.is_in(asked, value_set=index.keys)
        unknown = asked.filter(pc.invert(known))
        missing = len(unknown)
        if missing and not missing_ok:
            names = ", ".join(repr(k) for k in unknown[:SHOWN].to_pylist())
            more = f" and {missing - SHOWN:,} more" if missing > SHOWN else ""
            said = f"{missing:,} {'key' if missing == 1 else 'keys'} not in the output"
            raise ConfigError(f"{output}: {said}: {names}{more} (--missing-ok to go on)")
        selection = asked.filter(known)
        if not len(selection):
            return None, missing
    else:
        selection = where
    try:
        taken = select(index, selection, str(output))
    except ConfigError as error:
        if "keeps no record" in str(error):
            return None, missing
        raise
    if len(taken) == manifest.records:
        raise ConfigError(f"{output}: this would remove every record; delete the output instead")
    version = manifest.version + 1
    writes, gone = [], []
    for number, shard in enumerate(manifest.shards):
        left_out = taken.kept(number).tolist()
        if left_out:
            gone.append(shard.name)
            if len(left_out) < shard.count:
                writes.append([versioned_name(shard.name, version), [[shard.name, left_out]]])
    refuse_taken_names(changed, writes)
    removed_keys = "\n".join(sorted(taken.keys.to_pylist()))
    plan = {
        "writes": writes, "gone": gone, "reason": reason, "removed": len(taken), "missing": missing,
        "keys_sha256": hashlib.sha256(removed_keys.encode()).hexdigest(),
    }  # fmt: skip
    return new_journal("remove", request, manifest, plan), missing


def _left_out(manifest: Manifest, plan: dict[str, Any]) -> dict[str, list[int]]:
    """Each gone shard's removed positions: those its new shard leaves out, or all of them."""
    counts = {s.name: s.count for s in manifest.shards}
    written = {parts[0][0]: parts[0][1] for _, parts in plan["writes"]}
    return {name: written.get(name, list(range(counts[name]))) for name in plan["gone"]}


def _failures(changed: Changing, index: IndexFile, plan: dict[str, Any]) -> list[Failure]:
    """A row of errors.jsonl per removed record: its source (as pack lists inputs), its key and the
    reason, in the output's order."""
    manifest = changed.manifest
    table = index.read(columns=["key", "shard", "position", "source"])
    numbers = {s.name: n for n, s in enumerate(manifest.shards)}
    left_out = {name: set(at) for name, at in _left_out(manifest, plan).items()}
    removed = sorted(
        (numbers[shard], position, key, source if isinstance(source, str) else key)
        for key, shard, position, source in zip(*(table.column(n).to_pylist() for n in table.column_names), strict=True)
        if position in left_out.get(shard, ())
    )
    return [Failure(source, REMOVED, plan["reason"], key=key) for _, _, key, source in removed]


def _totals(manifest: Manifest, plan: dict[str, Any], shards: list[ShardInfo], errors: int) -> dict[str, int]:
    """The totals after a remove. The counts of pictures pack flattened or found single-coloured
    described its inputs: left out rather than kept untrue."""
    totals = {name: count for name, count in manifest.totals.items() if name not in PICTURE_COUNTS}
    totals.update(records=sum(s.count for s in shards), errors=errors)
    totals[REMOVED] = totals.get(REMOVED, 0) + plan["removed"]
    return totals


def _history(plan: dict[str, Any]) -> dict[str, Any]:
    written = {parts[0][0]: new for new, parts in plan["writes"]}
    return {
        "reason": plan["reason"], "removed": plan["removed"], "keys_sha256": plan["keys_sha256"],
        "rewritten": [[old, written[old]] for old in plan["gone"] if old in written],
        "dropped": [old for old in plan["gone"] if old not in written],
    }  # fmt: skip


_PLAN = {"reason": str, "removed": int, "missing": int, "keys_sha256": str}


def _check(journal: Journal, manifest: Manifest) -> None:
    """A remove's own fields of its plan, read back: each new shard is one old shard less some of
    its records, and the count removed is what the plan leaves out."""
    plan = journal.plan
    single = all(len(parts) == 1 and parts[0][1] for _, parts in plan["writes"])
    typed = all(type(plan.get(name)) is kind for name, kind in _PLAN.items())
    if not (single and typed) or plan["removed"] != sum(len(at) for at in _left_out(manifest, plan).values()):
        raise ValueError("does not fit the output")
