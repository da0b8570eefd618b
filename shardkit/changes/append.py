"""`shardkit pack SRC OUT --append`: a source's inputs packed into new shards after an output's
own, every shard there staying byte for byte.

The append packs with the output's settings (the manifest's: resize, encode, format, sharding,
labels, the table's columns); a flag that would change one is refused before any work, naming it.
The new source is walked whole first. An input the output holds already (the same key, and the
same bytes, or for a URL or an object the same address) is left out and counted, so that running
an append of a folder that grew packs only what is new; an input whose key the output holds for
other bytes is refused (`key_prefix` gives the new keys a prefix of their own). Class names are
merged: the output's keep their numbers, new ones follow.

The pack itself is pack's, into the working folder's `next/pack/` (for an output in a bucket, into
the bucket's `.shardkit/next/pack-ID/`, each shard uploaded by the worker that wrote it, as any pack
into a bucket: Ray without a shared folder appends), its shards numbered after the output's last:
an interrupted append resumes its pack there shard by shard. Then `next/` gets the
new shards (hard links), index.parquet (the old rows, then the new), errors.jsonl (the old rows
byte for byte, then the append's; the manifest's history says which rows are whose) and the
manifest of the next version, and the journal's commit moves them in (changes/journal.py): a kill
at any point leaves the earlier version or the new one.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from ..core.config import ClipConfig, EncodeConfig, PackConfig, ResizeConfig, TableConfig
from ..core.errors import ConfigError, ManifestError, OutputError, describe
from ..core.manifest import (
    ERRORS_NAME,
    IDX_SUFFIX,
    INDEX_NAME,
    MANIFEST_NAME,
    SHA256_HEX,
    Manifest,
    ShardInfo,
    idx_name,
    iter_errors,
    read_manifest,
    sha256_file,
    write_json_atomic,
)
from ..core.pack_options import PACK_OPTION_TABLE, pack_config
from ..core.phash import PHASH_HEX
from ..formats import get_format
from ..packing.dedup import Earlier
from ..packing.folder_output import refuse_overlap, refuse_sources_inside
from ..packing.index import schema
from ..packing.output import open_output
from ..packing.pack import Extension, HashProgress, pack_into
from ..packing.resume import CREATED_BY, settings_of
from ..packing.running import ProgressCallback, Tally, ray_session
from ..packing.sources import Item, SourceList, SourceWalk, pack_source
from ..packing.sources.item import display
from ..packing.working_folder import finishing, is_shard_name, shard_number, state_dir, writing
from ..readers.arrays import flags, strings
from ..storage.urls import is_remote
from .journal import Changing, Journal, kept_name, refuse_link
from .place import changing
from .remove import REMOVED
from .rewrite import refuse_foreign_shards, refuse_incomplete, summed_totals, write_errors, write_output_files

STAGED = "pack"  # the append's own pack, in the working folder's next/
SHOWN = 3  # colliding keys a refusal names
# the settings a codec's version decides, not a flag: an append with another codec is allowed (its
# shards' bytes are its own) and the history entry names it
CODECS = ("jpeg_backend", "video_backend")
_PREFIX = re.compile(r"[A-Za-z0-9_\-]+(/[A-Za-z0-9_\-]+)*/?")
# which part of a PackConfig each option's owner is (the flags an append compares with the output's)
_PARTS = {"ResizeConfig": "resize", "EncodeConfig": "encode", "WebConfig": "web", "ClipConfig": "clips"}


@dataclass(frozen=True)
class AppendResult:
    """What an append did: the version it made (the one there was, where nothing was new), the
    new inputs and what became of them, the inputs the output held already, and the shards added."""

    output: str
    source: str
    version: int
    inputs: int  # new inputs: records + errors
    records: int
    errors: int
    already: int  # inputs the output held already, left out
    taken_down: int  # inputs under keys `shardkit remove` took out, left out (a takedown stays one)
    shards: int  # shards added
    reused_shards: int  # of which an interrupted append had written
    classes_added: list[str]
    bytes_written: int
    output_bytes: int
    seconds: float
    resumed: bool = False
    clips: bool = False  # the output holds clips of videos: a record is a clip, an input a video

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def append(
    source: str | os.PathLike[str],
    output: str | os.PathLike[str],
    *,
    key_prefix: str = "",
    keep_versions: bool = False,
    table: TableConfig | None = None,
    sidecars: bool = False,
    storage_options: dict[str, Any] | None = None,
    progress: ProgressCallback | None = None,
    dedup_progress: HashProgress | None = None,
    tally: Tally | None = None,
    **options: Any,
) -> AppendResult:
    """Pack `source`'s new inputs into new shards after those of the local output `output`, with
    the output's settings (`shardkit pack SOURCE OUTPUT --append`). `options` are pack's flat
    options (as `pack_config` takes them: `workers=4`, `executor="ray"`); one that decides the
    output's bytes (`resize=128`) must be what the output was packed with, or the append is refused
    naming it. `key_prefix` starts each new key (where the source's keys are the output's already,
    for other images). The same append run again finishes an interrupted one; one whose inputs
    are all in the output already changes nothing. `keep_versions` keeps the version before whole
    in versions/vN (hard links: no bytes copied; in a bucket, server-side copies)."""
    config = pack_config(
        os.fspath(source), os.fspath(output), storage_options=storage_options, table=table, sidecars=sidecars, **options
    )
    return _append(config, options, key_prefix, keep_versions, progress, dedup_progress, tally)


def _append(
    config: PackConfig,
    given: Mapping[str, Any],
    key_prefix: str,
    keep_versions: bool,
    progress: ProgressCallback | None,
    dedup_progress: HashProgress | None,
    tally: Tally | None,
) -> AppendResult:
    import time

    started = time.perf_counter()
    output = config.output
    take_over = config.resume  # (a bucket's change begun in another run is taken over only when asked)
    if config.resume:  # (an interrupted append is finished by the same append: --resume is that too)
        config = replace(config, resume=False)
    if config.overwrite:
        raise ConfigError("--append adds to the output: --overwrite would replace it (give one of them)")
    prefix = _checked_prefix(key_prefix)
    if not is_remote(config.source) and not is_remote(output):
        refuse_overlap(config.source, output)
    with changing(output, config.storage_options, take_over) as changed:
        manifest, pending = changed.manifest, changed.pending
        if pending is not None and pending.action != "append":
            said = finishing(output, pending.action, pending.plan)
            raise OutputError(f"{output}: an interrupted {pending.action[:40]!r} is here; {said} first")
        _refuse_output(changed)
        if pending is None:  # (an interrupted one's output may be between two versions)
            refuse_incomplete(changed, "an append")
        packing = _config(changed, config, given)
        request = _request(packing, prefix, keep_versions)
        if pending is not None and pending.request != request:
            said = finishing(output, pending.action, pending.plan)
            raise OutputError(f"{output}: another append was interrupted here; {said} first")
        first = _first_shard(manifest)
        if pending is not None and pending.committing:
            result = changed.next_manifest() or manifest
            _check_committing(changed, pending, result)
            changed.commit(pending)
            return _result(output, pending, result, time.perf_counter() - started, 0, resumed=True)
        if pending is not None:
            packing = replace(packing, output=_pack_output(changed, pending))
            pending.plan.setdefault("keep_versions", False)  # (a journal from before versions were kept)
            # (the journal says whether the version before is kept, as a remove's does)
            _check_pending(changed, pending, _plan(packing, prefix, first, pending.plan.get("keep_versions") is True))
        with ray_session(packing):  # (a cluster that cannot be reached is refused before the journal)
            staged = _finished_pack(changed, pending) if pending is not None else None
            walked = _walk(packing, changed, prefix) if staged is None else None
            if pending is None:
                assert walked is not None
                if walked.new == 0:  # everything the source holds is in the output: no new version
                    return AppendResult(
                        output, _source(packing), manifest.version, 0, 0, 0, walked.already, walked.taken_down, 0,
                        0, [], 0, sum(s.bytes for s in manifest.shards), time.perf_counter() - started,
                    )  # fmt: skip
                if keep_versions:
                    changed.refuse_kept()
                plan = {**_plan(packing, prefix, first, keep_versions), "already": walked.already,
                        "taken_down": walked.taken_down}  # fmt: skip
                journal = Journal("append", request, manifest.checksum, manifest.version + 1, plan)
                packing = replace(packing, output=_pack_output(changed, journal))
                changed.begin(journal)
            else:
                journal = pending
            reused = 0
            if staged is None:
                assert walked is not None
                refuse_link(changed.next / STAGED, "shardkit's working folder")
                counts = {"already": walked.already, "taken_down": walked.taken_down}
                if {key: journal.plan[key] for key in counts} != counts:  # (the source changed meanwhile)
                    journal.plan.update(counts)
                    changed.record(journal)
                earlier = _earlier(changed) if packing.dedup != "none" else None
                target = open_output(packing)
                target.open(packing)  # (a bucket's prefix claimed: shards a killed run put up are kept)
                packed = pack_into(
                    target.local_config(packing), target, progress, dedup_progress, tally,
                    extension=Extension(first, lambda found: walked.walk, earlier),
                )  # fmt: skip
                staged, reused = packed.manifest, packed.reused_shards
                if changed.bucket is not None:
                    staged = _finished_pack(changed, journal)
                    if staged is None or staged.checksum != packed.manifest.checksum:
                        raise OutputError(f"{packing.output}: the append's pack changed as it finished")
        result = _write_next(changed, journal, staged)
        if journal.plan["keep_versions"]:
            changed.keep_version(journal)
        changed.ready(journal, result)
        changed.commit(journal)
        if changed.bucket is not None:  # (the pack's state, kept where rows failed for a passing cause)
            from ..packing.bucket_output import clear_staging, staging_folder

            clear_staging(staging_folder(packing.output, packing.staging), staged)
    seconds = time.perf_counter() - started
    return _result(output, journal, result, seconds, reused, resumed=pending is not None)


def _plan(packing: PackConfig, prefix: str, first: int, keep_versions: bool) -> dict[str, Any]:
    """What the journal keeps of an append (besides its counts): what it packs, where its shards
    start, and whether the version before is kept."""
    return {"source": _source(packing), "key_prefix": prefix, "table": _table(packing), "first_shard": first,
            "keep_versions": keep_versions}  # fmt: skip


def _finished_pack(changed: Changing, journal: Journal) -> Manifest | None:
    """The manifest of the append's own pack where an interrupted append finished it (then it is
    taken as it is: its source may have changed since, and a pack finished is not packed again);
    None where it did not."""
    folder = changed.next / STAGED
    refuse_link(folder, "shardkit's working folder")
    if changed.bucket is not None:  # (packed in the bucket: its small files come to the mirror)
        return changed.bucket.finished_pack(folder, journal)
    if not os.path.lexists(folder / MANIFEST_NAME):
        return None
    try:
        staged = read_manifest(folder)
    except ManifestError:
        return None  # (written again by the pack, which refuses what it cannot take)
    if staged.checksum != staged.computed_checksum():
        return None
    return staged


# --- what the append packs -----------------------------------------------------------------------


def _checked_prefix(prefix: str) -> str:
    """A key prefix: letters, digits, '_', '-' and '/' between them (a '.' would end a WebDataset
    key; '..' or a leading '/' would read as a path)."""
    if prefix and not _PREFIX.fullmatch(prefix):
        raise ConfigError(
            f"--key-prefix {prefix!r}: letters, digits, '_', '-' and '/' between them only (e.g. 2026-11/)"
        )
    return prefix


def _refuse_output(changed: Changing) -> None:
    """An output an append can continue: pack's shards under pack's names, images (not clips)."""
    refuse_foreign_shards(changed, "an append")
    settings = changed.manifest.settings
    if not isinstance(settings.get("resize"), dict) or not isinstance(settings.get("encode"), dict):
        raise OutputError(f"{changed.name}/{MANIFEST_NAME}: says nothing of its settings; an append cannot follow them")


def _config(changed: Changing, asked: PackConfig, given: Mapping[str, Any]) -> PackConfig:
    """The pack of the append: the output's settings, the caller's source, workers and storage,
    into the working folder's `next/pack`. A flag the caller set to other than the output's value
    is refused, naming it."""
    settings = changed.manifest.settings
    try:
        table = {**settings.get("table", {})}
        if table.get("columns") is not None:
            table["columns"] = tuple(table["columns"])
        dedup = settings.get("dedup") or {}
        web = settings.get("web") or {}
        encode = {**settings["encode"], "background": tuple(settings["encode"]["background"])}
        packing = replace(
            asked, output=str(changed.next / STAGED), resume=True, overwrite=False, format=settings["format"],
            resize=ResizeConfig(**settings["resize"]), encode=EncodeConfig(**encode),
            shard_size=settings["shard_size"], shard_bytes=settings["shard_bytes"], shuffle=settings["shuffle"],
            seed=settings["seed"], labels=settings["labels"],
            table=TableConfig(**{**table, "path": asked.table.path}), sidecars=bool(settings.get("sidecars")),
            dedup=dedup.get("mode", "none"), dedup_threshold=dedup.get("threshold", asked.dedup_threshold),
            web=replace(asked.web, **web),
            clips=ClipConfig(**settings["clips"]) if changed.manifest.holds_clips else ClipConfig(),
        )  # fmt: skip
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        said = f"{changed.name}/{MANIFEST_NAME}: its settings are not pack's ({describe(error)})"
        raise OutputError(f"{said}; an append cannot follow them") from None
    for option in PACK_OPTION_TABLE:
        if given.get(option.name) is None:
            continue
        part = _PARTS.get(option.owner.__name__)
        mine = getattr(asked, option.field) if part is None else getattr(getattr(asked, part), option.field)
        theirs = getattr(packing, option.field) if part is None else getattr(getattr(packing, part), option.field)
        if mine != theirs:
            flag = "--" + option.name.replace("_", "-")
            raise ConfigError(
                f"{flag} {_shown(mine)}: the output was packed with {option.name.replace('_', ' ')} {_shown(theirs)}; "
                "an append keeps the output's settings (leave the flag out)"
            )
    if asked.sidecars and not packing.sidecars:
        raise ConfigError("--sidecars: the output was packed without it; an append keeps the output's settings")
    columns = {name: value for name, value in asdict(asked.table).items() if name != "path"}
    defaults = {name: value for name, value in asdict(TableConfig()).items() if name != "path"}
    kept = {name: value for name, value in asdict(packing.table).items() if name != "path"}
    if columns != defaults and columns != kept:
        raise ConfigError(
            "the table's columns differ from those the output was packed with; an append keeps the output's "
            "(leave --path-column, --caption-column, --label-column and --columns out)"
        )
    mine = json.loads(json.dumps(settings_of(packing, urls="web" in settings)))  # (tuples as JSON has them)
    ours = {key: value for key, value in settings.items() if key not in ("plan", "source", "merged")}
    for both in (mine, ours):  # (a table's file is the source's own: its columns are the setting)
        if isinstance(both.get("table"), dict):
            both["table"] = {name: value for name, value in both["table"].items() if name != "path"}
    differ = sorted(key for key in set(mine) | set(ours) if key not in CODECS and mine.get(key) != ours.get(key))
    if differ:
        raise OutputError(f"{changed.name}: an append cannot follow its setting {differ[0]!r}")
    return packing


def _pack_output(changed: Changing, journal: Journal) -> str:
    """Where the append's pack writes: the working folder's next/pack, or for a bucket's output a
    prefix in the bucket (its workers upload each shard there, as a pack into a bucket does: a
    Ray task on a machine that shares no folder with this one can write it)."""
    return str(changed.next / STAGED) if changed.bucket is None else changed.bucket.pack_url(journal)


def _shown(value: Any) -> str:
    return "none" if value is None else str(value)


def _source(packing: PackConfig) -> str:
    """The source as the journal and the history keep it: a local one as an absolute path (the same
    append from another folder is the same append)."""
    return packing.source if is_remote(packing.source) else os.path.abspath(packing.source)


def _request(packing: PackConfig, prefix: str, keep_versions: bool) -> str:
    """What tells one append from another: its source, prefix and table, and whether it keeps the
    version before."""
    asked: dict[str, Any] = {"source": _source(packing), "key_prefix": prefix, "table": _table(packing)}
    if keep_versions:
        asked["keep_versions"] = True
    return hashlib.sha256(json.dumps(asked, sort_keys=True).encode()).hexdigest()


def _first_shard(manifest: Manifest) -> int:
    """The number after the highest any version of the output gave a shard (a rewritten shard keeps
    its number: -vK), so that no name a version listed names other bytes later."""
    names = [shard.name for shard in manifest.shards]
    names += [text for entry in manifest.history for text in _texts(entry) if is_shard_name(text)]
    return max((shard_number(name) for name in names if is_shard_name(name)), default=-1) + 1


def _texts(value: Any) -> Iterator[str]:
    """Every string inside a history entry (shard names are in lists of its own shape per action)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _texts(item)
    elif isinstance(value, list):
        for item in value:
            yield from _texts(item)


def _table(packing: PackConfig) -> str | None:
    path = packing.table.path
    return None if path is None else path if is_remote(path) else os.path.abspath(path)


@dataclass(frozen=True)
class Walked:
    """The append's walk, read whole: the inputs to pack (`walk`), how many are new (items and
    the walk's own failures), the inputs the output holds already (or lists as failed by an earlier
    run over the same source), and those it took out. (The class names it adds are its pack's
    manifest's, after the output's.)"""

    walk: SourceWalk
    new: int
    already: int
    taken_down: int  # inputs under a key `shardkit remove` took out: left out


def _walk(packing: PackConfig, changed: Changing, prefix: str) -> Walked:
    """The source walked whole, as the output would have it: keys with the prefix, labels by the
    output's class names (new names after its own), the inputs it holds already left out. An input
    whose key it holds for other bytes is refused, naming up to three."""
    source = pack_source(packing)
    source.refuse(packing)
    found = source.walk()
    items = list(found.items)  # (fills found.skipped)
    if found.listed is not None:
        refuse_sources_inside([item.path for item in found.listed.items], changed.output)
    classes, relabel = _classes(changed, found.classes)
    if prefix or relabel is not None:
        items = [
            item._replace(key=prefix + item.key if prefix else item.key,
                          label=relabel[item.label] if relabel is not None and item.label is not None else item.label)
            for item in items
        ]  # fmt: skip
    removed = _removed_keys(changed)
    spans = any(item.span is not None for item in items)  # (a span table's rows: a clip's key is the row's)
    # (a video whose every clip was taken out stays out: its clips' keys name it; one with clips left
    # is held, or another video under its key)
    if changed.manifest.holds_clips and removed and not spans:
        held = {_video_key(key) for key in changed.index().read(columns=["key"]).column("key").to_pylist()}
        removed |= {_video_key(key) for key in removed} - held
    taken_down = [item.key in removed for item in items]
    items = [item for item, gone in zip(items, taken_down, strict=True) if not gone]
    failed_keys, failed_paths = _failed_before(changed, _source(packing))
    # (a span table's rows share their video's path: only a row's key says which failed)
    failed = [
        item.key in failed_keys or (item.span is None and display(item.relpath) in failed_paths) for item in items
    ]
    present = _present(changed, [item for item, no in zip(items, failed, strict=True) if not no])
    there = iter(present)
    kept = [item for item, no in zip(items, failed, strict=True) if not no and not next(there)]
    already = len(items) - len(kept)
    skipped = [row for row in found.skipped if row.path not in failed_paths and row.key not in failed_keys]
    already += len(found.skipped) - len(skipped)
    listed = SourceList(found.root, found.layout, kept, classes, skipped)
    walk = replace(found, items=kept, classes=classes, listed=listed, runs=None, skipped=skipped)
    return Walked(walk, len(kept) + len(skipped), already, sum(taken_down))


def _failed_before(changed: Changing, source: str) -> tuple[set[str], set[str]]:
    """What errors.jsonl lists of an earlier run over `source` (the pack's or an append's), by key
    where a row has one (a table of URLs') and by path: an append of a folder that grew leaves
    those inputs out as it leaves out the ones packed, rather than list them again in every version.
    A row that failed for a passing cause (`transient`) is left out too: errors.jsonl keeps it, and
    a record of it later would count its input twice."""
    manifest = changed.manifest
    runs = [(range(e["error_rows"][0], e["error_rows"][1]), e.get("source"))
            for e in manifest.history if e.get("change") == "append" and _is_range(e.get("error_rows"))]  # fmt: skip
    packed_from = (
        manifest.settings.get("source", {}).get("path") if isinstance(manifest.settings.get("source"), dict) else None
    )
    first = isinstance(packed_from, str) and not is_remote(packed_from) and os.path.abspath(packed_from) == source
    first = first or packed_from == source
    keys: set[str] = set()
    paths: set[str] = set()
    for number, row in enumerate(iter_errors(changed.output, manifest.totals.get("errors", 0))):
        if row.get("stage") == REMOVED:
            continue
        run = next((run_source for rows, run_source in runs if number in rows), None)
        if run != source and not (run is None and first):
            continue
        if isinstance(row.get("key"), str):
            keys.add(row["key"])
        if isinstance(row.get("path"), str):  # (a URL's too: its key changes when its folder gains a part)
            paths.add(row["path"])
    return keys, paths


def _is_range(value: object) -> bool:
    return isinstance(value, list) and len(value) == 2 and all(type(v) is int for v in value)


def _earlier(changed: Changing) -> Earlier:
    """The output's records as --dedup compares the new files with them: from index.parquet, each
    record's key, source, the sha256 of its source file and its picture's DCT hash."""
    import numpy as np

    table = changed.index().read(columns=["key", "source", "source_sha256", "phash"])
    # (an index may be a stranger's, or an adopted tar's columns another tool wrote: a hash that is
    # not one is no hash, as `shardkit duplicates` takes them)
    phashes = [h if isinstance(h, str) and PHASH_HEX.fullmatch(h) else None for h in table.column("phash").to_pylist()]
    hashed = np.array([h is not None for h in phashes], bool)
    hashes = np.array([int(h, 16) if h is not None else 0 for h in phashes], np.uint64)
    digests = [
        d if isinstance(d, str) and SHA256_HEX.fullmatch(d) else None for d in table.column("source_sha256").to_pylist()
    ]
    keys = table.column("key").to_pylist()
    sources = [s if isinstance(s, str) else k for s, k in zip(table.column("source").to_pylist(), keys, strict=True)]
    return Earlier(keys, sources, digests, hashes, hashed)


def _removed_keys(changed: Changing) -> set[str]:
    """The keys `shardkit remove` took out of the output (errors.jsonl's rows at stage "removed"):
    an append of a source that still holds one leaves it out, so that a takedown stays one."""
    most = changed.manifest.totals.get("errors", 0)
    if not changed.manifest.totals.get(REMOVED):
        return set()
    return {row["key"] for row in iter_errors(changed.output, most)
            if row.get("stage") == REMOVED and isinstance(row.get("key"), str)}  # fmt: skip


def _classes(changed: Changing, names: list[str]) -> tuple[list[str], list[int] | None]:
    """The output's class names with the walk's new ones after them, and each of the walk's
    labels' new number (None: the same numbers). Labels from names appended to an output with
    whole-number labels (or the other way round) would change what a number means: refused."""
    have = changed.manifest.classes
    if bool(names) != bool(have) and changed.manifest.records:
        ours = "class names" if have else "whole numbers (or none)"
        theirs = "class names" if names else "whole numbers (or none)"
        raise OutputError(
            f"{changed.name}: its labels are {ours}, the source's {theirs}; an append keeps what a label means"
        )
    if not names:
        return list(have), None
    merged = list(have) + [name for name in names if name not in set(have)]
    number = {name: i for i, name in enumerate(merged)}
    relabel = [number[name] for name in names]
    return merged, None if relabel == list(range(len(names))) else relabel


def _present(changed: Changing, items: list[Item]) -> list[bool]:
    """For each item, whether the output holds it already: for a URL or an object, a record from
    the same address (whatever its key: a table's keys change when its folder gains a part); for a
    local file, a record of the same key from the same bytes (its sha256 against the index's). An
    item whose key the output holds for something else is refused, as is a local file under such a
    key that cannot be read (nothing says whether it is the one packed). Videos: `_present_videos`."""
    import pyarrow.compute as pc

    if not items:
        return []
    if changed.manifest.holds_clips:
        return _present_videos(changed, items)
    table = changed.index().read(columns=["key", "source", "source_sha256"])
    remote = [is_remote(item.path) for item in items]
    # (a local file's address is no source's: a NUL is in no path)
    addresses = strings([display(item.relpath) if far else "\0" for item, far in zip(items, remote, strict=True)])
    present = flags(pc.is_in(addresses, value_set=table.column("source"))).tolist()
    colliding = flags(pc.is_in(strings([item.key for item in items]), value_set=table.column("key")))
    at = [i for i in range(len(items)) if colliding[i] and not present[i]]
    if not at:
        return [bool(there) for there in present]
    rows = table.filter(pc.is_in(table.column("key"), value_set=strings([items[i].key for i in at])))
    held = dict(zip(rows.column("key").to_pylist(), rows.column("source_sha256").to_pylist(), strict=True))
    local = [i for i in at if not remote[i]]
    digests = dict(zip(local, _digests([items[i].path for i in local]), strict=True))
    clashes: list[str] = []
    for i in at:
        digest = digests.get(i)
        if i in digests and digest is None:
            raise OutputError(
                f"{display(items[i].path)}: cannot read it, and the output holds its key {items[i].key!r}"
            )
        if digest is not None and digest == held[items[i].key]:
            present[i] = True
        else:
            clashes.append(items[i].key)
    _refuse_clashes(changed, clashes, "images")
    return [bool(there) for there in present]


def _refuse_clashes(changed: Changing, clashes: list[str], what: str) -> None:
    """New keys the output holds for other inputs: refused, naming up to three."""
    if clashes:
        named = ", ".join(repr(key) for key in clashes[:SHOWN])
        more = f" and {len(clashes) - SHOWN:,} more" if len(clashes) > SHOWN else ""
        raise OutputError(
            f"{changed.name}: holds other {what} under {len(clashes):,} of the new keys ({named}{more}); "
            "give the new keys a prefix with --key-prefix (e.g. --key-prefix 2026-11/)"
        )


def _video_key(clip_key: str) -> str:
    """The key of the video a clip was cut from (packing/clips.clip_key: the video's, '_', a number)."""
    return clip_key.rpartition("_")[0]


def _present_videos(changed: Changing, items: list[Item]) -> list[bool]:
    """`_present` for videos: a video the output holds is one whose clips it holds under its key
    (a span table's row: the clip's own key) from the same bytes (each clip keeps its video's
    sha256); a clip packed before shardkit kept that, from the same path. A video under a key the
    output holds for another is refused, naming up to three."""
    table = changed.index().read(columns=["key", "source", "source_sha256"])
    spans = any(item.span is not None for item in items)
    held: dict[str, set[str | None]] = {}
    for key, source, digest in zip(*(table.column(name).to_pylist() for name in table.column_names), strict=True):
        held.setdefault(key if spans else _video_key(key), set()).add(digest if digest is not None else f"\0{source}")
    at = [i for i, item in enumerate(items) if item.key in held]
    paths = sorted({items[i].path for i in at})  # (a span table's rows share their video: read once)
    by_path = dict(zip(paths, _digests(paths), strict=True))
    digests = {i: by_path[items[i].path] for i in at}
    present, clashes = [False] * len(items), []
    for i in at:
        item, digest = items[i], digests[i]
        if digest is None:
            raise OutputError(f"{display(item.path)}: cannot read it, and the output holds its key {item.key!r}")
        if digest in held[item.key] or f"\0{display(item.relpath)}" in held[item.key]:
            present[i] = True
        else:
            clashes.append(item.key)
    _refuse_clashes(changed, clashes, "videos")
    return present


def _digests(paths: list[str]) -> list[str | None]:
    """Each local file's sha256 (None: unreadable). On threads: hashlib and file reads let go of
    the GIL."""

    def digest(path: str) -> str | None:
        try:
            return sha256_file(Path(path))
        except OSError:
            return None

    with ThreadPoolExecutor(max_workers=min(8, (os.cpu_count() or 2) * 2)) as pool:
        return list(pool.map(digest, paths, chunksize=64))


# --- the next version ----------------------------------------------------------------------------


def _write_next(changed: Changing, journal: Journal, staged: Manifest) -> Manifest:
    """The next version in `next/`: the append's shards and their .idx files (hard links to its
    pack's), the files for other readers, index.parquet, errors.jsonl and the manifest; the
    journal's moves, in the order the commit takes them."""
    manifest, output, folder = changed.manifest, changed.output, changed.next
    pack = folder / STAGED
    backend = get_format(manifest.format)
    first = journal.plan["first_shard"]
    if staged.format != manifest.format or not all(shard_number(s.name) >= first for s in staged.shards):
        raise OutputError(f"{pack}: holds a pack that is not this append's; move {state_dir(output)} away")
    new_idx = [c for c in staged.companions if c.name.endswith(IDX_SUFFIX)]
    idx_names = {c.name for c in new_idx}
    moves: list[str] = []
    for shard in staged.shards:
        for name in (idx_name(shard.name), shard.name):
            if name != shard.name and name not in idx_names:
                continue
            if changed.bucket is None:  # (a bucket's commit copies them from the pack there)
                with writing(output, name):
                    (folder / name).unlink(missing_ok=True)
                    os.link(pack / name, folder / name)
            moves.append(name)
    shards = [*manifest.shards, *staged.shards]
    idx = [c for c in manifest.companions if c.name.endswith(IDX_SUFFIX)] + new_idx
    output_files = write_output_files(backend, output, folder, shards)
    moves += [info.name for info in output_files]
    with writing(output, INDEX_NAME):
        index = _write_index(changed, pack / INDEX_NAME, folder / INDEX_NAME)
    earlier = manifest.totals.get("errors", 0)
    added = staged.totals.get("errors", 0)
    with writing(output, ERRORS_NAME):
        errors = write_errors(output, manifest, _lines(pack / ERRORS_NAME), folder / ERRORS_NAME)
    if errors != earlier + added:
        raise OutputError(f"{pack / ERRORS_NAME}: does not hold the {added:,} rows its manifest counts")
    plan = journal.plan
    entry: dict[str, Any] = {
        "version": journal.version, "change": "append", "source": plan["source"],
        "layout": staged.settings.get("source", {}).get("layout"), "inputs": staged.totals.get("inputs", 0),
        "records": staged.records, "errors": added, "error_rows": [earlier, earlier + added],
        "already": plan["already"], "taken_down": plan["taken_down"],
        "shards": [staged.shards[0].name, staged.shards[-1].name] if staged.shards else [],
    }  # fmt: skip
    if plan["key_prefix"]:
        entry["key_prefix"] = plan["key_prefix"]
    if staged.classes[len(manifest.classes) :]:
        entry["classes_added"] = staged.classes[len(manifest.classes) :]
    for codec in CODECS:
        if codec in staged.settings and staged.settings[codec] != manifest.settings.get(codec):
            entry[codec] = staged.settings[codec]
    entry.update({"after": manifest.checksum, "by": CREATED_BY})
    new = replace(
        manifest, shards=shards, classes=staged.classes or manifest.classes,
        totals=summed_totals(manifest.totals, staged.totals), index=index, companions=idx + output_files,
        version=journal.version, history=[*manifest.history, entry],
    ).sealed()  # fmt: skip
    journal.moves = [*moves, INDEX_NAME, ERRORS_NAME, MANIFEST_NAME]
    with writing(output, MANIFEST_NAME):
        write_json_atomic(folder / MANIFEST_NAME, new.to_json())
    return new


def _lines(path: Path) -> Iterator[str]:
    """The append's errors.jsonl, row by row as its pack wrote it."""
    try:
        with open(path, encoding="utf-8", newline="") as rows:
            yield from rows
    except FileNotFoundError:
        return


def _write_index(changed: Changing, added: Path, path: Path) -> ShardInfo:
    """index.parquet of the next version: the output's row groups as they are, then the append's
    (a row group a shard, as pack writes them)."""
    import pyarrow.parquet as pq

    sources = [added]
    if changed.manifest.index is not None:
        changed.index()  # (the output's, checked against its manifest first)
        sources.insert(0, changed.output / INDEX_NAME)
    rows = 0
    with pq.ParquetWriter(path, schema(), compression="zstd") as writer:
        for source in sources:
            parquet = pq.ParquetFile(source)
            for group in range(parquet.num_row_groups):
                part = parquet.read_row_group(group).cast(schema())
                writer.write_table(part)
                rows += part.num_rows
    return ShardInfo(INDEX_NAME, rows, path.stat().st_size, sha256_file(path))


# --- an interrupted append -----------------------------------------------------------------------


def _check_pending(changed: Changing, journal: Journal, asked: dict[str, Any]) -> None:
    """An interrupted append, not committing yet: the output is still the version it began from,
    and its plan is this append's (its source, prefix, table and first shard) with its counts."""
    output, manifest = changed.name, changed.manifest
    away = changed.abandoning("append")
    if manifest.checksum != journal.base or manifest.checksum != manifest.computed_checksum():
        raise OutputError(f"{output}: the output changed since the interrupted append began; {away}")
    plan = journal.plan
    fits = (
        journal.version == manifest.version + 1 and not journal.deletes and not journal.moves
        and all(plan.get(key) == value for key, value in asked.items())
        and all(type(plan.get(key)) is int and plan[key] >= 0 for key in ("already", "taken_down"))
        and set(plan) == {*asked, "already", "taken_down"}
    )  # fmt: skip
    if not fits:
        raise OutputError(f"{output}: the interrupted append's journal does not fit the output; {away}")


def _check_committing(changed: Changing, journal: Journal, result: Manifest) -> None:
    """An interrupted append's commit: the next version it wrote is whole and follows the version
    it began from, and the commit moves exactly its files (the new shards, each after its .idx
    file, the files for other readers, index.parquet, errors.jsonl, the manifest last)."""
    output, manifest = changed.name, changed.manifest
    away = "the output is between two versions: restore it from a copy"
    sealed = manifest.checksum == manifest.computed_checksum()
    if not sealed or manifest.checksum not in (journal.base, journal.result) or result.checksum != journal.result:
        raise OutputError(f"{output}: the output changed since the interrupted append began; {away}")
    if result.computed_checksum() != result.checksum or result.version != journal.version:
        raise OutputError(f"{output}: the next version the interrupted append wrote is damaged; {away}")
    first = journal.plan.get("first_shard")
    new = [
        s.name for s in result.shards if type(first) is int and is_shard_name(s.name) and shard_number(s.name) >= first
    ]
    companions = {c.name for c in result.companions}
    expected = [name for shard in new for name in (idx_name(shard), shard) if name == shard or name in companions]
    expected += [c.name for c in result.companions if not c.name.endswith(IDX_SUFFIX)]
    kept = [kept_name(journal.version - 1)] if journal.plan.get("keep_versions") is True else []
    if journal.deletes or journal.moves != [*kept, *expected, INDEX_NAME, ERRORS_NAME, MANIFEST_NAME]:
        raise OutputError(f"{output}: the interrupted append's journal does not follow from its plan; {away}")


def _result(
    output: str, journal: Journal, result: Manifest, seconds: float, reused: int, resumed: bool
) -> AppendResult:
    """What the append did, from the history entry of the version it made."""
    entry = next((e for e in result.history if e.get("version") == journal.version), {})
    names = entry.get("shards") or []
    numbers = {s.name: i for i, s in enumerate(result.shards)}
    added = result.shards[numbers[names[0]] : numbers[names[1]] + 1] if names and names[0] in numbers else []
    return AppendResult(
        output, str(entry.get("source", "")), result.version, entry.get("inputs", 0), entry.get("records", 0),
        entry.get("errors", 0), entry.get("already", 0), entry.get("taken_down", 0), len(added), reused,
        list(entry.get("classes_added", [])), sum(s.bytes for s in added), sum(s.bytes for s in result.shards),
        seconds, resumed=resumed, clips=result.holds_clips,
    )  # fmt: skip
