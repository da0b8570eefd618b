"""`shardkit remove`: records taken out of a finished output (a takedown, a privacy request) without
packing it again.

The shards that hold them are written again without them under the next version's names
(`shard-NNNNNN-vK`), record for record as pack writes them, and the shards they held are deleted:
the removed images' bytes are in no file of the output afterwards. Every other shard stays byte
for byte. Each removed record becomes a row of errors.jsonl (stage `removed`, the reason given),
so inputs = records + errors still holds and `verify --source` accounts for every input; the
manifest's `history` says what each version removed, and why. A kill at any point leaves the
earlier version or the new one (changes/journal.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from ..core.errors import ConfigError, Failure, OutputError
from ..core.manifest import (
    ERRORS_NAME,
    IDX_SUFFIX,
    INDEX_NAME,
    MANIFEST_NAME,
    Manifest,
    ShardInfo,
    idx_name,
    info_of,
    iter_errors,
    sha256_file,
    write_json_atomic,
    write_lines_atomic,
)
from ..formats import get_format
from ..packing.failed_rows import error_line
from ..packing.index import schema
from ..packing.resume import CREATED_BY
from ..packing.shard_writing import PICTURE_COUNTS
from ..packing.working_folder import is_shard_name, versioned_name, writing
from ..readers.subset import IndexFile, Selection, read_index, select
from ..storage.urls import is_remote
from .journal import Changing, Journal, changing

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
        return {
            "output": self.output, "version": self.version, "removed": self.removed, "missing": self.missing,
            "rewritten": self.rewritten, "dropped": self.dropped, "bytes_written": self.bytes_written,
            "output_bytes": self.output_bytes, "seconds": self.seconds, "resumed": self.resumed,
        }  # fmt: skip


def remove(
    output: str | os.PathLike[str],
    keys: Iterable[str] | None = None,
    *,
    where: Selection | None = None,
    reason: str = "",
    missing_ok: bool = False,
    resume: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> RemoveResult:
    """Take the records `keys` names (or those `where` selects: a pyarrow Expression over
    index.parquet's columns, or a callable, as `open_shards(select=...)` takes) out of the local
    output `output`, for `reason` (kept in the manifest's history and errors.jsonl). Keys the
    output lacks are refused, naming them, unless `missing_ok`. `resume` finishes a remove that was
    interrupted (so does the same remove run again). `progress(done, total)` counts shards written."""
    started = time.perf_counter()
    if is_remote(output):
        raise ConfigError(f"{output}: remove works on a local output folder (a bucket's is not supported yet)")
    if resume and (keys is not None or where is not None):
        raise ConfigError("--resume finishes the interrupted remove as it was asked: give no keys with it")
    if not resume and (keys is None) == (where is None):
        raise ConfigError("remove needs the records to take out: keys, or a condition over the index (not both)")
    reason = " ".join(reason.split())
    if not resume and not reason:
        raise ConfigError("remove needs a reason (--reason): the manifest's history and errors.jsonl keep it")
    wanted = None if keys is None else sorted(set(_checked_keys(keys)))
    request = _request(wanted, where, reason)
    with changing(output) as change:
        pending = change.pending
        if pending is not None and not (resume or pending.request == request):
            raise OutputError(
                f"{output}: an interrupted {pending.action} to version {pending.version} is here; finish it with "
                f"`shardkit remove {output} --resume` (or run the same remove again)"
            )
        if pending is None and resume:  # (what a kill in the commit's last step left is tidied away)
            return _unchanged(change, missing=0, seconds=time.perf_counter() - started)
        if pending is None:
            journal = _plan(change, wanted, where, reason, missing_ok, request)
            if journal is None:  # nothing the output holds was named: nothing changes
                return _unchanged(change, missing=len(wanted or ()), seconds=time.perf_counter() - started)
            change.begin(journal)
        else:
            journal = pending
            _check_pending(change, journal)
        if not journal.committing:
            if pending is not None:
                change.restart()
            result = _write_next(change, journal, progress)
            journal.moves = _moves(result, journal.plan["rewritten"])
            change.ready(journal, result)
        change.commit(journal)
    plan = journal.plan
    return RemoveResult(
        str(output), journal.version, plan["removed"], plan["missing"], len(plan["rewritten"]), len(plan["dropped"]),
        plan["bytes_written"], plan["output_bytes"], time.perf_counter() - started, resumed=pending is not None,
    )  # fmt: skip


def _checked_keys(keys: Iterable[str]) -> Iterable[str]:
    if isinstance(keys, (str, bytes)):
        raise ConfigError("remove: keys must be a list of keys, not one string")
    for key in keys:
        if not isinstance(key, str):
            raise ConfigError(f"remove: keys are text; {key!r} is a {type(key).__name__}")
        yield key


def _request(keys: list[str] | None, where: Selection | None, reason: str) -> str:
    """What was asked, as a digest: the same remove run again finishes an interrupted one."""
    asked = {"keys": keys, "where": None if where is None else repr(where), "reason": reason}
    return hashlib.sha256(json.dumps(asked, sort_keys=True).encode()).hexdigest()


def _plan(
    change: Changing, keys: list[str] | None, where: Selection | None, reason: str, missing_ok: bool, request: str
) -> Journal | None:
    """The journal of this remove: per shard the positions taken out, the next version's names, the
    files the commit moves and deletes; None where it takes nothing out."""
    import pyarrow as pa
    import pyarrow.compute as pc

    manifest, output = change.manifest, change.output
    if isinstance(manifest.settings.get("adopted"), dict):
        raise OutputError(f"{output}: its tars were adopted (`shardkit index`): remove rewrites only pack's shards")
    odd = next((s.name for s in manifest.shards if not is_shard_name(s.name)), None)
    if odd is not None:
        raise OutputError(
            f"{output}: holds shard {odd!r}, a name pack does not give: remove rewrites only pack's shards"
        )
    index = read_index(output, manifest)
    missing = 0
    selection: Selection
    if keys is not None:
        asked = pa.array(keys, pa.string())
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
            return None
    else:
        selection = where
    try:
        taken = select(index, selection, str(output))
    except ConfigError as error:
        if "keeps no record" in str(error):
            return None
        raise
    if len(taken) == manifest.records:
        raise ConfigError(f"{output}: this would remove every record; delete the output instead")
    version = manifest.version + 1
    rewritten, dropped, drops = [], [], {}
    for number, shard in enumerate(manifest.shards):
        gone = taken.kept(number)
        if not len(gone):
            continue
        drops[shard.name] = gone.tolist()
        if len(gone) == shard.count:
            dropped.append(shard.name)
        else:
            rewritten.append([shard.name, versioned_name(shard.name, version)])
    listed = {s.name for s in manifest.shards}
    taken_name = next((new for _, new in rewritten if new in listed or os.path.lexists(output / new)), None)
    if taken_name is not None:  # (a stranger's manifest may list a name this version would take)
        raise OutputError(f"{output}: {taken_name} is there already, where remove would write the next version")
    backend = get_format(manifest.format)
    removed_keys = sorted(taken.keys.to_pylist())
    plan = {
        "reason": reason, "removed": len(taken), "missing": missing, "drops": drops, "rewritten": rewritten,
        "dropped": dropped, "keys_sha256": hashlib.sha256("\n".join(removed_keys).encode()).hexdigest(),
        "suffix": backend.suffix, "bytes_written": 0, "output_bytes": 0,
    }  # fmt: skip
    return Journal("remove", request, manifest.checksum, version, plan, [], _deletes(manifest, rewritten, dropped))


def _deletes(manifest: Manifest, rewritten: list[list[str]], dropped: list[str]) -> list[str]:
    """What the commit deletes: the shards written again and those left empty, and their .idx files."""
    companions = {c.name for c in manifest.companions}
    gone = [old for old, _ in rewritten] + dropped
    return gone + [idx_name(old) for old in gone if idx_name(old) in companions]


def _moves(result: Manifest, rewritten: list[list[str]]) -> list[str]:
    """What the commit renames into the output, in order: the shards written again (each after its
    .idx file), the files for other readers, the index, errors.jsonl, the manifest last."""
    companions = [c.name for c in result.companions]
    new = [name for _, name in rewritten]
    moves = [name for shard in new for name in (idx_name(shard), shard) if name in companions or name == shard]
    moves += [name for name in companions if not name.endswith(IDX_SUFFIX)]  # (wids' shardindex.json)
    return [*moves, INDEX_NAME, ERRORS_NAME, MANIFEST_NAME]


def _check_pending(change: Changing, journal: Journal) -> None:
    """An interrupted remove's journal against the output as it is now: the output must still be
    the version it started from (or, once committing, that or the version it makes, which `next/`
    or the output holds), and what it plans to write, move and delete must follow from that version
    and its own plan. A tampered journal, or an output changed meanwhile, is refused in one line."""
    output, manifest = change.output, change.manifest
    away = f"move {output}/.shardkit away to abandon that remove"
    if journal.action != "remove":
        raise OutputError(f"{output}: an interrupted {journal.action[:40]!r}, which remove does not finish; {away}")
    _check_shape(journal, away)
    sealed = manifest.checksum == manifest.computed_checksum()
    if not journal.committing:
        if not sealed or manifest.checksum != journal.base:
            raise OutputError(f"{output}: the output changed since the interrupted remove began; {away}")
        _check_plan(journal, manifest, away)
        if journal.deletes != _deletes(manifest, journal.plan["rewritten"], journal.plan["dropped"]):
            raise OutputError(f"{output}: the interrupted remove's journal does not follow from its plan; {away}")
        return
    result = change.next_manifest() or manifest
    if not sealed or manifest.checksum not in (journal.base, journal.result) or result.checksum != journal.result:
        raise OutputError(f"{output}: the output changed since the interrupted remove began; {away}")
    if result.computed_checksum() != result.checksum or result.version != journal.version or not result.history:
        raise OutputError(f"{output}: the next version the interrupted remove wrote is damaged; {away}")
    entry = result.history[-1]
    plan = journal.plan
    if entry.get("rewritten") != plan.get("rewritten") or entry.get("dropped") != plan.get("dropped"):
        raise OutputError(f"{output}: the interrupted remove's journal does not follow from its plan; {away}")
    kept = {s.name for s in result.shards} | {c.name for c in result.companions}
    replaced = [old for old, _ in plan["rewritten"]] + plan["dropped"]
    allowed = set(replaced) | {idx_name(old) for old in replaced}
    if journal.moves != _moves(result, plan["rewritten"]) or not set(journal.deletes) <= allowed - kept:
        raise OutputError(f"{output}: the interrupted remove's journal does not follow from its plan; {away}")


def _check_plan(journal: Journal, manifest: Manifest, away: str) -> None:
    """A journal's plan, read back, against the manifest it starts from: every shard it names is the
    manifest's, each new name the next version's, the positions taken out each shard's own."""
    plan, where = journal.plan, "the interrupted remove's plan"
    counts = {s.name: s.count for s in manifest.shards}
    try:
        if journal.version != manifest.version + 1:
            raise ValueError(f"version {journal.version} after {manifest.version}")
        olds = [pair[0] for pair in plan["rewritten"]] + plan["dropped"]
        if len(set(olds)) != len(olds) or set(olds) != set(plan["drops"]) or not set(olds) <= set(counts):
            raise ValueError("shards that are not the output's")
        if any(new != versioned_name(old, journal.version) for old, new in plan["rewritten"]):
            raise ValueError("a name that is not the next version's")
        for name, positions in plan["drops"].items():
            full = name in plan["dropped"]
            if not (isinstance(positions, list) and all(type(p) is int for p in positions)
                    and positions == sorted(set(positions)) and (not positions or positions[0] >= 0)
                    and (not positions or positions[-1] < counts[name])
                    and (len(positions) == counts[name]) == full and positions):  # fmt: skip
                raise ValueError(f"positions that are not {name}'s")
        if plan["removed"] != sum(len(positions) for positions in plan["drops"].values()):
            raise ValueError("a count that is not its positions'")
    except (ValueError, TypeError) as error:
        raise OutputError(f"{where} does not fit the output ({error}); {away}") from None


_PLAN = {"reason": str, "removed": int, "missing": int, "drops": dict, "rewritten": list, "dropped": list,
         "keys_sha256": str, "bytes_written": int, "output_bytes": int}  # fmt: skip


def _check_shape(journal: Journal, away: str) -> None:
    """A plan read back has the fields and types a remove writes: shard names are plain names."""
    plan = journal.plan
    shaped = all(type(plan.get(name)) is kind for name, kind in _PLAN.items()) and all(
        isinstance(pair, list) and len(pair) == 2 and all(isinstance(n, str) and is_shard_name(n) for n in pair)
        for pair in plan["rewritten"]
    ) and all(isinstance(name, str) and is_shard_name(name) for name in plan["dropped"])  # fmt: skip
    if not shaped:
        raise OutputError(f"the interrupted remove's plan is damaged; {away}")


def _write_next(change: Changing, journal: Journal, progress: Callable[[int, int], None] | None) -> Manifest:
    """Everything the new version has that the old one lacks, in `next/`: the shards written again,
    their .idx files, the files for other readers, index.parquet, errors.jsonl, then the manifest."""
    manifest, output, folder, plan = change.manifest, change.output, change.next, journal.plan
    backend = get_format(manifest.format)
    written: dict[str, tuple[ShardInfo, ShardInfo | None]] = {}
    for done, (old, new) in enumerate(plan["rewritten"], 1):
        with writing(output, new):
            written[old] = _rewrite(backend, output / old, folder, new, set(plan["drops"][old]))
        if progress is not None:
            progress(done, len(plan["rewritten"]))
    companions = {c.name: c for c in manifest.companions}
    shards: list[ShardInfo] = []
    idx_companions: list[ShardInfo] = []
    for shard in manifest.shards:
        if shard.name in plan["dropped"]:
            continue
        info, idx = written.get(shard.name, (shard, companions.get(idx_name(shard.name))))
        shards.append(info)
        if idx is not None:
            idx_companions.append(idx)
    index = read_index(output, manifest)
    with writing(output, INDEX_NAME):
        index_info = _write_index(index, plan, folder / INDEX_NAME)
    output_companions = []
    if backend.output_files is not None:
        for name, data in backend.output_files(shards):
            with writing(output, name):
                (folder / name).write_bytes(data)
            output_companions.append(info_of(name, sum(s.count for s in shards), data))
    with writing(output, ERRORS_NAME):
        errors = _write_errors(output, manifest, index, plan, folder / ERRORS_NAME)
    plan["bytes_written"] = sum(written[old][0].bytes for old, _ in plan["rewritten"])
    plan["output_bytes"] = sum(s.bytes for s in shards)
    totals = {name: count for name, count in manifest.totals.items() if name not in PICTURE_COUNTS}
    totals["records"] = sum(s.count for s in shards)
    totals["errors"] = errors
    totals[REMOVED] = totals.get(REMOVED, 0) + plan["removed"]
    history = {
        "version": journal.version, "change": "remove", "reason": plan["reason"], "removed": plan["removed"],
        "keys_sha256": plan["keys_sha256"], "rewritten": plan["rewritten"], "dropped": plan["dropped"],
        "after": manifest.checksum, "by": CREATED_BY,
    }  # fmt: skip
    new = replace(
        manifest, shards=shards, totals=totals, index=index_info, companions=idx_companions + output_companions,
        version=journal.version, history=[*manifest.history, history],
    ).sealed()  # fmt: skip
    with writing(output, MANIFEST_NAME):
        write_json_atomic(folder / MANIFEST_NAME, new.to_json())
    return new


def _rewrite(backend: Any, shard: Path, folder: Path, name: str, drops: set[int]) -> tuple[ShardInfo, ShardInfo | None]:
    """`shard` without the records at `drops`, written as `folder/name` record for record as pack
    writes them (a reader's records into the format's writer give the same bytes); its entry and
    its .idx file's."""
    target = folder / name
    reader = backend.reader(str(shard))
    writer = backend.writer(str(target))
    try:
        for position, record in enumerate(reader.read_range(0, len(reader))):
            if position not in drops:
                writer.add(record)
        count = writer.close()
    except BaseException:
        writer.abort()
        raise
    finally:
        reader.close()
    info = ShardInfo(name, count, target.stat().st_size, writer.sha256() or sha256_file(target))
    idx = None
    if backend.idx_file is not None:
        data = backend.idx_file(str(target), writer.members)
        if data is not None:
            (folder / idx_name(name)).write_bytes(data)
            idx = info_of(idx_name(name), count, data)
    return info, idx


def _write_index(index: IndexFile, plan: dict[str, Any], path: Path) -> ShardInfo:
    """index.parquet without the removed rows, the rewritten shards' rows renamed and numbered
    again, a row group a shard, as pack writes it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = index.read()
    manifest = index.manifest
    order = np.lexsort((index.positions, index.shards))
    renamed = dict(map(tuple, plan["rewritten"]))
    starts = np.searchsorted(index.shards[order], np.arange(len(manifest.shards) + 1))
    rows = 0
    with pq.ParquetWriter(path, schema(), compression="zstd") as writer:
        for number, shard in enumerate(manifest.shards):
            if shard.name in plan["dropped"]:
                continue
            these = order[starts[number] : starts[number + 1]]
            part = table.take(pa.array(these))
            if shard.name in renamed:
                gone = np.isin(index.positions[these], plan["drops"][shard.name])
                part = part.filter(pa.array(~gone))
                names = pa.array([renamed[shard.name]] * part.num_rows, pa.string())
                part = part.set_column(part.schema.get_field_index("shard"), "shard", names)
                at = pa.array(np.arange(part.num_rows, dtype=np.int64))
                part = part.set_column(part.schema.get_field_index("position"), "position", at)
            writer.write_table(part.cast(schema()))
            rows += part.num_rows
    return ShardInfo(INDEX_NAME, rows, path.stat().st_size, sha256_file(path))


def _write_errors(output: Path, manifest: Manifest, index: IndexFile, plan: dict[str, Any], path: Path) -> int:
    """errors.jsonl as it was, byte for byte, then a row per removed record (its source, as pack
    lists inputs, its key and the reason) in the output's order; the number of rows."""
    table = index.read(columns=["key", "shard", "position", "source"])
    numbers = {s.name: n for n, s in enumerate(manifest.shards)}
    drops = {name: set(at) for name, at in plan["drops"].items()}
    removed = sorted(
        (numbers[shard], position, key, source if isinstance(source, str) else key)
        for key, shard, position, source in zip(*(table.column(n).to_pylist() for n in table.column_names), strict=True)
        if position in drops.get(shard, ())
    )
    earlier = manifest.totals.get("errors", 0)
    if sum(1 for _ in iter_errors(output, earlier)) != earlier:  # (verify says the same of such an output)
        raise OutputError(f"{output / ERRORS_NAME}: does not hold the {earlier:,} rows its manifest counts")

    def lines() -> Iterator[str]:
        last = "\n"
        with contextlib.suppress(FileNotFoundError), open(output / ERRORS_NAME, encoding="utf-8", newline="") as rows:
            for last in rows:  # (newline="": each row as it is, its line ending included)
                yield last
        if not last.endswith("\n"):  # a last row without its newline (verify takes it): the next starts a line
            yield "\n"
        for _, _, key, source in removed:
            yield error_line(Failure(source, REMOVED, plan["reason"], key=key))

    write_lines_atomic(path, lines(), temp_dir=path.parent)
    return earlier + len(removed)


def _unchanged(change: Changing, missing: int, seconds: float) -> RemoveResult:
    manifest = change.manifest
    size = sum(s.bytes for s in manifest.shards)
    return RemoveResult(str(change.output), manifest.version, 0, missing, 0, 0, 0, size, seconds)
