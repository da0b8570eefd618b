"""What a merge makes, wherever it goes (merge.py: local folders; bucket_merge.py: a bucket): the
sources checked as sources, the plan (what each source's records become, the merged classes), and
the merged output's files written in a folder, its shards put there by the caller's `Place` (a
hard link, a copy planned server-side) or written again with new keys or labels."""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..core.errors import ConfigError, ManifestError, OutputError, describe
from ..core.manifest import (
    ERRORS_NAME,
    INDEX_NAME,
    MANIFEST_NAME,
    Manifest,
    ShardInfo,
    error_lines,
    error_lines_as_written,
    idx_name,
    info_of,
    read_manifest,
    sha256_file,
    write_json_atomic,
    write_lines_atomic,
)
from ..core.safeio import open_regular, regular_size
from ..formats import get_format
from ..formats.base import Record
from ..packing.index import schema
from ..packing.resume import CREATED_BY
from ..packing.working_folder import STATE_NAME, is_shard_name, shard_name, state_dir, writing
from ..readers.arrays import booleans, int64s, integers, string, strings
from ..readers.subset import read_index
from ..storage.store import Store
from .journal import Journal, pending_change
from .rewrite import summed_totals, write_output_files

# what decides a record's bytes: outputs merged must agree on each
SAME = ("format", "resize", "encode", "clips")
# what outputs merged may differ in: the merged manifest's settings are the first's, each other's
# own are said beside it
OWN = ("shard_size", "shard_bytes", "shuffle", "seed", "jpeg_backend", "labels")
_UNSAFE = re.compile(r"[^A-Za-z0-9_\-]")


@dataclass(frozen=True)
class MergeResult:
    """What a merge did: the output, its sources, records and shards, how many shards were linked
    (or copied) as they are and how many written again, and the bytes written."""

    output: str
    sources: list[str]
    records: int
    shards: int
    linked: int  # shards put in place as they are (a hard link, or a copy across file systems)
    rewritten: int  # shards written again with prefixed keys or renumbered labels
    bytes_written: int  # copied or rewritten (a hard link writes none)
    output_bytes: int
    classes: int
    seconds: float
    resumed: bool = False
    already_complete: bool = False  # the output was this merge, finished: nothing was done

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def made_by(manifest: Manifest, plan: dict[str, Any], size_of: Callable[[str], int | None]) -> bool:
    """Whether `manifest` is the merge `plan` makes, finished and as it made it: its first version,
    of the same sources as they are now, every shard there with its size (`size_of`)."""
    merged = manifest.settings.get("merged")
    if manifest.checksum != manifest.computed_checksum() or not isinstance(merged, list):
        return False
    if manifest.version != 1 or manifest.history:
        return False
    said = [{key: entry.get(key) for key in ("path", "checksum")} for entry in merged if isinstance(entry, dict)]
    prefixes = [entry.get("key_prefix", "") for entry in merged if isinstance(entry, dict)]
    wanted = [{key: entry[key] for key in ("path", "checksum")} for entry in plan["merged"]]
    if said != wanted or prefixes != [entry["key_prefix"] for entry in plan["merged"]]:
        return False
    return all(size_of(shard.name) == shard.bytes for shard in manifest.shards)


# --- the sources ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Source:
    """An output to merge: the local folder holding its manifest, index and errors.jsonl (for an
    output in a bucket, a view of them in the cache: its shards stay in the bucket), its manifest,
    its index's rows, and the output as messages and the plan name it."""

    folder: Path
    manifest: Manifest
    rows: int  # index.parquet's, checked: a row per record
    where: str  # the folder as given, or the bucket's URL
    path: str  # the folder made absolute, or the URL: the plan's
    name: str  # its folder's own name (links followed), or the URL's last part: its key prefix's word


def located(named: str | os.PathLike[str], storage_options: dict[str, Any] | None) -> Store | Path:
    """A merge's source or output: a local folder, or an output in a bucket under one spelling of
    its URL (s3a://, a doubled slash: what the plan names and every request uses)."""
    from ..storage.location import locate
    from .bucket import spelled

    where = locate(named, storage_options)
    return where if isinstance(where, Path) else Store(spelled(where), where.options)


def source_name(where: Store | Path) -> str:
    """A source as the plan names it (Source.path): its URL, or its folder made absolute."""
    return where.url if isinstance(where, Store) else os.path.abspath(where)


def refuse_named_twice(sources: Sequence[Store | Path]) -> None:
    """Each output merged once: one prefix, or one folder however it is reached (a link, `..`)."""
    seen = [where.url if isinstance(where, Store) else os.path.realpath(where) for where in sources]
    if len(set(seen)) != len(seen):
        twice = next(where for where, same in zip(sources, seen, strict=True) if seen.count(same) > 1)
        raise ConfigError(f"{source_name(twice)}: named twice; merge takes each output once")


def local_source(folder: Path) -> Source:
    """A finished, sealed output of pack's shards with nothing unfinished in it, each file it lists
    whole where a stat or a pass over its index and errors.jsonl can tell."""
    try:
        manifest = read_manifest(folder)
    except ManifestError as error:
        raise OutputError(str(error)) from None
    if pending_change(folder) is not None:
        raise OutputError(f"{folder}: a change of it is unfinished; finish it before merging")
    if os.path.lexists(state_dir(folder) / STATE_NAME) and not manifest.totals.get("transient"):
        raise OutputError(f"{folder}: an interrupted pack is here; finish it with pack --resume first")
    # every file it lists a regular file of its size, not a link, a FIFO or a device (a link would be
    # linked as a link, or followed anywhere when copied; a FIFO would hang the merge)
    return checked_source(
        folder, manifest, lambda name: regular_size(folder / name), str(folder), os.path.abspath(folder),
        folder.resolve().name,
    )  # fmt: skip


def checked_source(
    folder: Path, manifest: Manifest, size_of: Callable[[str], int | None], where: str, path: str, name: str
) -> Source:
    """An output whose manifest, index.parquet and errors.jsonl are in `folder` (`size_of` tells
    the size of each file of the output, None where it is not one), checked as a source: sealed,
    pack's shards, each file it lists there with its size, its index and errors.jsonl whole."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if manifest.checksum != manifest.computed_checksum():
        raise OutputError(f"{where}/{MANIFEST_NAME}: checksum does not match its content (edited by hand?)")
    if isinstance(manifest.settings.get("adopted"), dict) or not all(is_shard_name(s.name) for s in manifest.shards):
        raise OutputError(f"{where}: holds shards pack did not name (adopted tars?); merge takes pack's outputs")
    if manifest.index is None:
        raise OutputError(f"{where}: has no index.parquet (packed by an early shardkit); pack it again")
    for info in [*manifest.shards, *manifest.companions, manifest.index]:
        if size_of(info.name) != info.bytes:
            raise OutputError(f"{where}/{info.name}: not the file its manifest lists (a link, missing, or resized)")
    try:
        index = read_index(folder, manifest)  # (its bytes the manifest's, a row per record, each shard's)
    except ManifestError as error:
        raise OutputError(str(error)) from None
    types = {field.name: field.type for field in pq.read_schema(folder / INDEX_NAME)}
    if not (pa.types.is_string(types.get("key")) and pa.types.is_integer(types.get("label", pa.int64()))):
        raise OutputError(f"{folder / INDEX_NAME}: its key or label column is not pack's")
    errors, named = folder / ERRORS_NAME, f"{where}/{ERRORS_NAME}"  # (named as the output's, not a view's)
    most = manifest.totals.get("errors", 0)
    if os.path.lexists(errors) or most:
        if regular_size(errors) is None:
            raise OutputError(f"{named}: not a file shardkit wrote (a link, missing, or not a file)")
        try:
            with open(open_regular(errors), "rb") as log:
                rows = sum(1 for _ in error_lines(log, named, most))
        except (ManifestError, OSError) as error:
            raise OutputError(
                str(error) if isinstance(error, ManifestError) else f"{named}: {describe(error)}"
            ) from None
        if rows != most:
            raise OutputError(f"{named}: does not hold the {most:,} rows its manifest counts")
    return Source(folder, manifest, len(index.keys), where, path, name)


def check_rewrites(read: list[Source], plan: dict[str, Any]) -> None:
    """What a source whose records change (a key prefix, new label numbers) must be, checked before
    anything is written: its shards the manifest's byte for byte (a damaged record would come out
    in a new shard looking whole), its labels each a class it names, and for LMDB its keys with the
    prefix within LMDB's 511 bytes."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    for source, entry in zip(read, plan["merged"], strict=True):
        if not entry["key_prefix"] and entry["labels"] is None:
            continue
        for shard in source.manifest.shards:
            if sha256_file(source.folder / shard.name) != shard.sha256:
                raise OutputError(f"{source.folder / shard.name}: differs from its manifest (bytes changed)")
        table = pq.ParquetFile(source.folder / INDEX_NAME).read(columns=["key", "label"])
        labels = table.column("label")
        if entry["labels"] is not None and labels.null_count < len(labels):
            low, high = pc.min_max(labels).values()
            if low.as_py() < 0 or high.as_py() >= len(entry["labels"]):
                raise OutputError(f"{source.folder / INDEX_NAME}: a label names no class of its manifest")
        longest = pc.max(pc.binary_length(table.column("key"))).as_py() or 0
        if source.manifest.format == "lmdb" and longest + len(entry["key_prefix"].encode()) > 511:
            raise OutputError(
                f"{source.where}: a key with the prefix {entry['key_prefix']!r} would be over LMDB's 511 bytes"
            )


def planned(read: list[Source], prefix_keys: bool, relabel: bool) -> tuple[dict[str, Any], str]:
    """The merge's plan (refused where two sources share a key) and its request: the plan's
    digest, by which an interrupted merge tells the same merge run again."""
    plan = _plan(read, prefix_keys, relabel)
    _refuse_collisions(read, plan)
    return plan, hashlib.sha256(json.dumps(plan, sort_keys=True).encode()).hexdigest()


def _plan(read: list[Source], prefix_keys: bool, relabel: bool) -> dict[str, Any]:
    """The merge as the journal keeps it: each source (its folder, its manifest's checksum, its key
    prefix, its labels' new numbers), the merged classes and the flags. A function of the sources
    as they are: an interrupted merge goes on only over the same ones."""
    first = read[0]
    for other in read[1:]:
        for key in SAME:
            if other.manifest.settings.get(key) != first.manifest.settings.get(key):
                theirs, ours = other.manifest.settings.get(key), first.manifest.settings.get(key)
                raise OutputError(
                    f"{other.where}: packed with {key} {_shown(theirs)}, {first.where} with {_shown(ours)}; "
                    "merge takes outputs packed alike"
                )
    named = [bool(source.manifest.classes) for source in read if source.manifest.records]
    if any(named) and not all(named):
        odd = next(s.where for s in read if s.manifest.records and bool(s.manifest.classes) != named[0])
        raise OutputError(f"{odd}: labels by {'class names' if not named[0] else 'whole numbers'}, unlike "
                          f"{read[0].where}; merge keeps what a label means")  # fmt: skip
    classes: list[str] = []
    for source in read:
        classes += [name for name in source.manifest.classes if name not in set(classes)]
    number = {name: i for i, name in enumerate(classes)}
    entries = []
    prefixes = _prefixes(read) if prefix_keys else [""] * len(read)
    for source, prefix in zip(read, prefixes, strict=True):
        labels = [number[name] for name in source.manifest.classes]
        if labels != list(range(len(labels))) and not relabel:
            moved = next(i for i, label in enumerate(labels) if label != i)
            raise OutputError(
                f"{source.where}: its label {moved} is {source.manifest.classes[moved]!r}, which {read[0].where} and "
                f"the merged classes number {labels[moved]}; --relabel numbers its records by the merged classes"
            )
        entries.append({
            "path": source.path, "checksum": source.manifest.checksum, "key_prefix": prefix,
            "labels": None if labels == list(range(len(labels))) else labels,
        })  # fmt: skip
    return {
        "sources": [entry["path"] for entry in entries], "merged": entries, "classes": classes,
        "prefix_keys": prefix_keys, "relabel": relabel,
    }  # fmt: skip


def _shown(value: Any) -> str:
    return json.dumps(value, sort_keys=True)[:200]


def _prefixes(read: list[Source]) -> list[str]:
    """Each source's key prefix: its folder's name, made a plain word, with -2, -3... where two
    folders share a name."""
    prefixes: list[str] = []
    for source in read:
        base = _UNSAFE.sub("_", source.name) or "output"
        name, n = base, 1
        while f"{name}/" in prefixes:
            n += 1
            name = f"{base}-{n}"
        prefixes.append(f"{name}/")
    return prefixes


def _refuse_collisions(read: list[Source], plan: dict[str, Any]) -> None:
    """Keys two sources share (after their prefixes), named: a merged output keys each record once."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    columns = []
    for source, entry in zip(read, plan["merged"], strict=True):
        keys = pq.ParquetFile(source.folder / INDEX_NAME).read(columns=["key"]).column("key")
        prefix = entry["key_prefix"]
        columns.append(pc.binary_join_element_wise(string(prefix), keys, string("")) if prefix else keys)
    every = pa.chunked_array([chunk for column in columns for chunk in column.chunks], pa.string())
    counts = pc.value_counts(every)
    shared = counts.filter(booleans(integers(counts.field("counts")) > 1)).field("values")  # (no pandas)
    if len(shared):
        named = ", ".join(repr(key) for key in shared[:3].to_pylist())
        more = f" and {len(shared) - 3:,} more" if len(shared) > 3 else ""
        raise OutputError(
            f"{len(shared):,} keys are in two of the outputs ({named}{more}); --prefix-keys gives each output's "
            "keys its folder's name as a prefix"
        )


# --- the merged output ---------------------------------------------------------------------------


# puts a source's shard (and its .idx file) under its new name, as it is: its entries and the
# bytes that took writing (a hard link writes none)
Place = Callable[[Source, ShardInfo, str, ShardInfo | None], tuple[ShardInfo, ShardInfo | None, int]]


def write_merged(
    folder: Path,
    output: str | Path,
    journal: Journal,
    read: list[Source],
    place: Place,
    progress: Callable[[int, int], None] | None,
) -> Manifest:
    """The merged output in `folder` (`next/`): the shards, put there by `place` or written again
    with new keys or labels, and their .idx files, the files for other readers, index.parquet,
    errors.jsonl, the manifest; `journal.moves` every file it holds, the manifest last. `output`
    is the output as a failed write names it."""
    plan = journal.plan
    first = read[0].manifest
    backend = get_format(first.format)
    shards: list[ShardInfo] = []
    idx: list[ShardInfo] = []
    moves: list[str] = []
    names: list[dict[str, str]] = []  # each source's old shard name -> new
    linked = rewritten = written = 0
    total = sum(len(source.manifest.shards) for source in read)
    for source, entry in zip(read, plan["merged"], strict=True):
        renamed: dict[str, str] = {}
        companions = {c.name: c for c in source.manifest.companions}
        change = _record_change(entry)
        for old in source.manifest.shards:
            new = shard_name(len(shards), backend.suffix)
            renamed[old.name] = new
            with writing(output, new):
                if change is None:
                    info, companion, took = place(source, old, new, companions.get(idx_name(old.name)))
                    written += took
                    linked += 1
                else:
                    info, companion = _rewrite(backend, source.folder / old.name, old, folder / new, change)
                    written += info.bytes
                    rewritten += 1
            shards.append(info)
            if companion is not None:
                idx.append(companion)
                moves.append(companion.name)
            moves.append(new)
            if progress is not None:
                progress(len(shards), total)
        names.append(renamed)
    output_files = write_output_files(backend, output, folder, shards)
    moves += [info.name for info in output_files]
    with writing(output, INDEX_NAME):
        index = _write_index(read, plan, names, folder / INDEX_NAME)
    with writing(output, ERRORS_NAME):
        ranges = _write_errors(read, plan, folder / ERRORS_NAME)
    merged = []
    start = 0
    for source, entry, rows in zip(read, plan["merged"], ranges, strict=True):
        count = len(source.manifest.shards)
        said: dict[str, Any] = {
            "path": entry["path"], "checksum": entry["checksum"], "version": source.manifest.version,
            "records": source.manifest.records, "error_rows": rows,
            "shards": [shards[start].name, shards[start + count - 1].name] if count else [],
        }  # fmt: skip
        if entry["key_prefix"]:
            said["key_prefix"] = entry["key_prefix"]
        if entry["labels"] is not None:
            said["relabelled"] = True
        own = {key: source.manifest.settings.get(key) for key in OWN}
        if own != {key: first.settings.get(key) for key in OWN}:  # (the manifest's settings are the first's)
            said["settings"] = own
        merged.append(said)
        start += count
    settings = {key: value for key, value in first.settings.items() if key not in ("plan", "source")}
    settings["merged"] = merged
    totals: dict[str, int] = {}
    for source in read:
        totals = summed_totals(totals, source.manifest.totals) if totals else dict(source.manifest.totals)
    plan.update(linked=linked, rewritten=rewritten, bytes_written=written)
    manifest = Manifest(
        format=first.format, shards=shards, classes=list(plan["classes"]), settings=settings, totals=totals,
        created_by=CREATED_BY, index=index, companions=idx + output_files,
    ).sealed()  # fmt: skip
    journal.moves = [*moves, INDEX_NAME, ERRORS_NAME, MANIFEST_NAME]
    with writing(output, MANIFEST_NAME):
        write_json_atomic(folder / MANIFEST_NAME, manifest.to_json())
    return manifest


def _record_change(entry: dict[str, Any]) -> Callable[[Record], Record] | None:
    """What a source's records need (a key prefix, new label numbers), or None: nothing."""
    prefix, labels = entry["key_prefix"], entry["labels"]
    if not prefix and labels is None:
        return None

    def change(record: Record) -> Record:
        if labels is not None and record.label is not None and not 0 <= record.label < len(labels):
            raise OutputError(f"record {record.key[:200]!r}: its label {record.label} names no class of its output")
        label = record.label if labels is None or record.label is None else labels[record.label]
        return record._replace(key=prefix + record.key, label=label)

    return change


def _rewrite(
    backend: Any, path: Path, old: ShardInfo, target: Path, change: Callable[[Record], Record]
) -> tuple[ShardInfo, ShardInfo | None]:
    """The shard written again record for record with `change` applied (its bytes were checked
    against the manifest before the merge began: `_check_rewrites`)."""
    if regular_size(path) != old.bytes:
        raise OutputError(f"{path}: differs from its manifest (bytes changed); `shardkit verify` says more")
    writer = backend.writer(str(target))
    reader = backend.reader(str(path))
    try:
        for record in reader.read_range(0, len(reader)):
            writer.add(change(record))
        count = writer.close()
    except BaseException:
        writer.abort()
        raise
    finally:
        reader.close()
    info = ShardInfo(target.name, count, target.stat().st_size, writer.sha256() or sha256_file(target))
    companion = None
    if backend.idx_file is not None:
        data = backend.idx_file(str(target), writer.members)
        if data is not None:
            (target.parent / idx_name(target.name)).write_bytes(data)
            companion = info_of(idx_name(target.name), count, data)
    return info, companion


def _write_index(read: list[Source], plan: dict[str, Any], names: list[dict[str, str]], path: Path) -> ShardInfo:
    """index.parquet: each source's row groups in order (a row group a shard, as pack writes them),
    the shard names the merged ones, keys prefixed and labels renumbered where the plan says."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    rows = 0
    with pq.ParquetWriter(path, schema(), compression="zstd") as writer:
        for source, entry, renamed in zip(read, plan["merged"], names, strict=True):
            parquet = pq.ParquetFile(source.folder / INDEX_NAME)
            olds, news = strings(list(renamed)), strings(list(renamed.values()))
            if parquet.metadata.num_rows != source.manifest.records:
                raise OutputError(f"{source.folder / INDEX_NAME}: does not hold a row per record")
            for group in range(parquet.num_row_groups):
                part = parquet.read_row_group(group).cast(schema())
                at = pc.index_in(part.column("shard"), value_set=olds)
                if at.null_count:
                    raise OutputError(f"{source.folder / INDEX_NAME}: names a shard its manifest lacks")
                part = part.set_column(part.schema.get_field_index("shard"), "shard", pc.take(news, at))
                if entry["key_prefix"]:
                    prefix, nothing = string(entry["key_prefix"]), string("")
                    keys = pc.binary_join_element_wise(prefix, part.column("key"), nothing)
                    part = part.set_column(part.schema.get_field_index("key"), "key", keys)
                if entry["labels"] is not None:
                    numbers = int64s(np.array(entry["labels"], np.int64))
                    labels = pc.take(numbers, part.column("label"))
                    part = part.set_column(part.schema.get_field_index("label"), "label", labels)
                writer.write_table(part.cast(schema()))
                rows += part.num_rows
    return ShardInfo(INDEX_NAME, rows, path.stat().st_size, sha256_file(path))


def _write_errors(read: list[Source], plan: dict[str, Any], path: Path) -> list[list[int]]:
    """errors.jsonl: each source's rows in order, each checked and copied as written (with a key
    prefix, a row naming a key is written again naming the prefixed one); the rows of each source,
    as [first, end)."""
    ranges: list[list[int]] = []
    count = [0]

    def lines() -> Iterator[str]:
        for source, entry in zip(read, plan["merged"], strict=True):
            start = count[0]
            most = source.manifest.totals.get("errors", 0)
            prefix = entry["key_prefix"]
            where = source.folder / ERRORS_NAME
            if most:
                with open(open_regular(where), "rb") as log:
                    for line, row in error_lines_as_written(log, str(where), most):
                        count[0] += 1
                        if prefix and any(isinstance(row.get(field), str) for field in ("key", "duplicate_of")):
                            for field in ("key", "duplicate_of"):
                                if isinstance(row.get(field), str):
                                    row[field] = prefix + row[field]
                            yield json.dumps(row, sort_keys=True) + "\n"
                        else:
                            text = line.decode("utf-8")
                            yield text if text.endswith("\n") else text + "\n"
            if count[0] - start != most:
                raise OutputError(f"{where}: does not hold the {most:,} rows its manifest counts")
            ranges.append([start, count[0]])

    try:
        write_lines_atomic(path, lines(), temp_dir=path.parent)
    except ManifestError as error:
        raise OutputError(str(error)) from None
    return ranges


def asked_for(plan: dict[str, Any], sources: list[str], prefix_keys: bool, relabel: bool) -> bool:
    """Whether `plan` is the merge of `sources` (as the plan names them) with these flags: a merge
    that finds another's committed finishes it, then refuses unless it was asked for."""
    flags = (bool(plan.get("prefix_keys")), bool(plan.get("relabel")))
    return plan.get("sources") == sources and flags == (prefix_keys, relabel)


def result_of(
    output: str, plan: dict[str, Any], result: Manifest, spent: dict[str, Any], seconds: float, resumed: bool
) -> MergeResult:
    return MergeResult(
        output, list(plan["sources"]), result.records, len(result.shards), spent.get("linked", 0),
        spent.get("rewritten", 0), spent.get("bytes_written", 0), sum(s.bytes for s in result.shards),
        len(result.classes), seconds, resumed,
    )  # fmt: skip
