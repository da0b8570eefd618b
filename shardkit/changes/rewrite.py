"""What every change that writes shards again shares (`remove`, `compact`): a plan of new shards,
each made of old shards' records (less some), written in `next/` with everything beside them, and
its checks when an interrupted change is taken up again.

A plan is JSON in the journal: `writes`, a list of [new name, [[old name, [positions left out]], ...]]
in the output's order (a new shard takes the place of its first old one), and `gone`, every old
shard the new version no longer lists (those written again, and those left with no record). Every
other shard stays as it is, byte for byte. Records pass from each format's reader to its writer,
which gives the bytes pack writes: nothing is decoded or encoded again.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from ..core.errors import Failure, OutputError, describe
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
from ..packing.working_folder import finishing, is_shard_name, versioned_name, writing
from ..readers.arrays import booleans, int64s, strings
from ..readers.subset import IndexFile
from .journal import Changing, Journal, kept_name
from .place import changing

Progress = Callable[[int, int], None]
ACTIONS = ("remove", "compact", "append")  # the changes a journal may name


@dataclass(frozen=True)
class Change:
    """What an action (remove, compact) gives the shared machinery: its journal's plan when the
    output has nothing pending (`plan`: None where it changes nothing), and, once its shards are
    written, the new version's totals, its history entry and errors.jsonl's new rows."""

    action: str
    request: str
    plan: Callable[[Changing], Journal | None]
    totals: Callable[[Manifest, dict[str, Any], list[ShardInfo], int], dict[str, int]]
    history: Callable[[dict[str, Any]], dict[str, Any]]
    failures: Callable[[Changing, IndexFile, dict[str, Any]], list[Failure]] = lambda change, index, plan: []
    # the action's own checks of an interrupted plan: ValueError saying what does not fit
    check: Callable[[Journal, Manifest], None] = lambda journal, manifest: None
    keep_versions: bool = False  # the version it starts from kept whole in versions/vN (journal.py)


@dataclass(frozen=True)
class Done:
    """A change run: its journal (None where nothing was changed), the manifest the output holds
    now, and whether it finished an interrupted one."""

    journal: Journal | None
    manifest: Manifest
    resumed: bool
    seconds: float


def run(
    output: str | os.PathLike[str],
    change: Change,
    resume: bool,
    progress: Progress | None,
    storage_options: dict[str, Any] | None = None,
) -> Done:
    """Lock `output`, take up an interrupted change of the same request (or any with `resume`), or
    plan a new one; write the next version in `next/` and commit it."""
    started = time.perf_counter()
    with changing(output, storage_options, take_over=resume) as changed:
        pending = changed.pending
        if pending is not None and not (resume or pending.request == change.request):
            said = f"{output}: an interrupted {pending.action[:40]!r} to version {pending.version} is here"
            raise OutputError(f"{said}; {finishing(output, pending.action, pending.plan)}")
        if pending is None and resume:  # (what a kill in the commit's last step left is tidied away)
            return Done(None, changed.manifest, False, time.perf_counter() - started)
        if pending is None:
            refuse_incomplete(changed, f"a {change.action}")
            journal = change.plan(changed)
            if journal is None:
                return Done(None, changed.manifest, False, time.perf_counter() - started)
            if change.keep_versions:
                changed.refuse_kept()
                journal.plan["keep_versions"] = True
            refuse_damaged(changed, journal.plan)
            changed.begin(journal)
        else:
            journal = pending
            check_pending(changed, journal, change)
        if not journal.committing:
            if pending is not None:
                changed.restart()
            result = write_next(changed, journal, change, progress)
            journal.moves = moves(result, journal.plan["writes"])
            if journal.plan.get("keep_versions") is True:
                changed.keep_version(journal)
            changed.ready(journal, result)
        else:
            result = changed.next_manifest() or changed.manifest
        changed.commit(journal)
    return Done(journal, result, pending is not None, time.perf_counter() - started)


def new_journal(action: str, request: str, manifest: Manifest, plan: dict[str, Any]) -> Journal:
    """The journal of a plan (`writes` and `gone` in it) starting from `manifest`."""
    plan = {**plan, "bytes_written": 0, "output_bytes": 0}
    return Journal(action, request, manifest.checksum, manifest.version + 1, plan, [], deletes(manifest, plan["gone"]))


def refuse_incomplete(changed: Changing, action: str) -> None:
    """A change goes onto an output whose every shard and file beside it is there with the size its
    manifest says: one missing or truncated is refused, naming it, before anything is written. (Their
    bytes are not hashed again here: that reads the whole output, `shardkit verify`'s job; a change
    never reads or alters a shard it does not write again, and hashes those it does.)"""
    manifest = changed.manifest
    for entry in [*manifest.shards, *manifest.companions]:
        size = changed.size_of(entry.name)
        if size != entry.bytes:
            if size is not None:
                found = f"{size:,} bytes, the manifest says {entry.bytes:,}"
            else:
                found = "not a file shardkit wrote (a link?)" if changed.holds(entry.name) else "missing"
            raise OutputError(
                f"{changed.name}/{entry.name}: {found}; {action} goes only onto an output that verifies "
                "(`shardkit verify` says more)"
            )


def refuse_foreign_shards(changed: Changing, action: str) -> None:
    """A change rewrites only shards pack wrote, under the names pack gives."""
    manifest, output = changed.manifest, changed.name
    if isinstance(manifest.settings.get("adopted"), dict):
        raise OutputError(f"{output}: its tars were adopted (`shardkit index`): {action} rewrites only pack's shards")
    odd = next((s.name for s in manifest.shards if not is_shard_name(s.name)), None)
    if odd is not None:
        said = f"holds shard {odd!r}, a name pack does not give"
        raise OutputError(f"{output}: {said}: {action} rewrites only pack's shards")


def refuse_taken_names(changed: Changing, writes: list[list[Any]]) -> None:
    """A stranger's manifest may list a name the next version would take: refused, not overwritten."""
    listed = {s.name for s in changed.manifest.shards}
    taken = next((new for new, _ in writes if new in listed or changed.holds(new)), None)
    if taken is not None:
        raise OutputError(f"{changed.name}: {taken} is there already, where the next version's shard would go")


def deletes(manifest: Manifest, gone: list[str]) -> list[str]:
    """What the commit deletes: the shards the new version no longer lists, and their .idx files."""
    companions = {c.name for c in manifest.companions}
    return [*gone, *(idx_name(old) for old in gone if idx_name(old) in companions)]


def moves(result: Manifest, writes: list[list[Any]]) -> list[str]:
    """What the commit renames into the output, in order: the shards written again (each after its
    .idx file), the files for other readers, the index, errors.jsonl, the manifest last."""
    companions = [c.name for c in result.companions]
    new = [name for name, _ in writes]
    found = [name for shard in new for name in (idx_name(shard), shard) if name in companions or name == shard]
    found += [name for name in companions if not name.endswith(IDX_SUFFIX)]  # (wids' shardindex.json)
    return [*found, INDEX_NAME, ERRORS_NAME, MANIFEST_NAME]


# --- writing the next version -------------------------------------------------------------------


def write_next(changed: Changing, journal: Journal, change: Change, progress: Progress | None) -> Manifest:
    """Everything the new version has that the old one lacks, in `next/`: the shards written again,
    their .idx files, the files for other readers, index.parquet, errors.jsonl, then the manifest."""
    manifest, output, folder, plan = changed.manifest, changed.output, changed.next, journal.plan
    backend = get_format(manifest.format)
    written: dict[str, tuple[ShardInfo, ShardInfo | None]] = {}
    for done, (new, parts) in enumerate(plan["writes"], 1):
        with writing(output, new):
            written[parts[0][0]] = _write_shard(backend, output, folder, new, parts)
        if progress is not None:
            progress(done, len(plan["writes"]))
    companions = {c.name: c for c in manifest.companions}
    gone = set(plan["gone"])
    shards: list[ShardInfo] = []
    idx_companions: list[ShardInfo] = []
    for shard in manifest.shards:  # a new shard in its first old one's place; the other old ones gone
        if shard.name in gone and shard.name not in written:
            continue
        info, idx = written.get(shard.name, (shard, companions.get(idx_name(shard.name))))
        shards.append(info)
        if idx is not None:
            idx_companions.append(idx)
    index = changed.index()
    with writing(output, INDEX_NAME):
        index_info = _write_index(index, plan, folder / INDEX_NAME)
    output_companions = write_output_files(backend, output, folder, shards)
    with writing(output, ERRORS_NAME):
        failures = change.failures(changed, index, plan)
        errors = write_errors(output, manifest, map(error_line, failures), folder / ERRORS_NAME)
    plan["bytes_written"] = sum(info.bytes for info, _ in written.values())
    plan["output_bytes"] = sum(s.bytes for s in shards)
    entry = {"version": journal.version, "change": journal.action, **change.history(plan)}
    entry.update({"after": manifest.checksum, "by": CREATED_BY})
    new = replace(
        manifest, shards=shards, totals=change.totals(manifest, plan, shards, errors), index=index_info,
        companions=idx_companions + output_companions, version=journal.version, history=[*manifest.history, entry],
    ).sealed()  # fmt: skip
    with writing(output, MANIFEST_NAME):
        write_json_atomic(folder / MANIFEST_NAME, new.to_json())
    return new


def write_output_files(backend: Any, output: str | Path, folder: Path, shards: list[ShardInfo]) -> list[ShardInfo]:
    """The files the format keeps beside the whole output for other readers (wids' shardindex.json),
    for `shards`, written in `folder` (`next/`); their entries."""
    written = []
    if backend.output_files is not None:
        for name, data in backend.output_files(shards):
            with writing(output, name):
                (folder / name).write_bytes(data)
            written.append(info_of(name, sum(s.count for s in shards), data))
    return written


def summed_totals(before: dict[str, int], added: dict[str, int]) -> dict[str, int]:
    """Two outputs' totals summed (an append's, a merge's); a count of pictures one of them does
    not know (an output from an earlier shardkit) is left out, as pack leaves it out."""
    totals = {}
    for key in [*before, *(key for key in added if key not in before)]:
        if key in PICTURE_COUNTS and (key not in before or key not in added):
            continue
        totals[key] = before.get(key, 0) + added.get(key, 0)
    return totals


def _write_shard(
    backend: Any, output: Path, folder: Path, name: str, parts: list[list[Any]]
) -> tuple[ShardInfo, ShardInfo | None]:
    """A new shard `folder/name` of the parts' records in order, less each part's left-out
    positions, record for record as pack writes them; its entry and its .idx file's."""
    target = folder / name
    writer = backend.writer(str(target))
    try:
        for old, left_out in parts:
            skip = set(left_out)
            reader = backend.reader(str(output / old))
            try:
                for position, record in enumerate(reader.read_range(0, len(reader))):
                    if position not in skip:
                        writer.add(record)
            finally:
                reader.close()
        count = writer.close()
    except BaseException:
        writer.abort()
        raise
    info = ShardInfo(name, count, target.stat().st_size, writer.sha256() or sha256_file(target))
    idx = None
    if backend.idx_file is not None:
        data = backend.idx_file(str(target), writer.members)
        if data is not None:
            (folder / idx_name(name)).write_bytes(data)
            idx = info_of(idx_name(name), count, data)
    return info, idx


def refuse_damaged(changed: Changing, plan: dict[str, Any]) -> None:
    """Every shard a plan writes again must be the manifest's, byte for byte: its records would
    otherwise go into a new shard with a new sha256, and a damaged record come out looking whole.
    Checked before the change begins (and again before an interrupted one goes on)."""
    listed = {s.name: s for s in changed.manifest.shards}
    changed.fetch([listed[old] for _, parts in plan["writes"] for old, _ in parts if old in listed])
    for _, parts in plan["writes"]:
        for old, _ in parts:
            path = changed.output / old
            try:
                same = path.stat().st_size == listed[old].bytes and sha256_file(path) == listed[old].sha256
            except OSError as error:
                raise OutputError(f"{path}: cannot read it ({describe(error)}); `shardkit verify` says more") from None
            if not same:
                raise OutputError(f"{path}: differs from the manifest (bytes changed); `shardkit verify` says more")


def _write_index(index: IndexFile, plan: dict[str, Any], path: Path) -> ShardInfo:
    """index.parquet of the new version: each shard kept as it was, each new shard's rows those of
    its parts less the left-out ones, renamed and numbered again; a row group a shard, as pack
    writes it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = index.read()
    manifest = index.manifest
    order = np.lexsort((index.positions, index.shards))
    starts = np.searchsorted(index.shards[order], np.arange(len(manifest.shards) + 1))
    numbers = {s.name: n for n, s in enumerate(manifest.shards)}
    firsts = {parts[0][0]: (new, parts) for new, parts in plan["writes"]}
    gone = set(plan["gone"])

    def rows_of(name: str, left_out: list[int]) -> Any:
        these = order[starts[numbers[name]] : starts[numbers[name] + 1]]
        part = table.take(int64s(these))
        return part.filter(booleans(~np.isin(index.positions[these], left_out))) if left_out else part

    rows = 0
    with pq.ParquetWriter(path, schema(), compression="zstd") as writer:
        for shard in manifest.shards:
            if shard.name in firsts:
                new, parts = firsts[shard.name]
                part = pa.concat_tables([rows_of(old, left_out) for old, left_out in parts])
                names = strings([new] * part.num_rows)
                part = part.set_column(part.schema.get_field_index("shard"), "shard", names)
                at = int64s(np.arange(part.num_rows))
                part = part.set_column(part.schema.get_field_index("position"), "position", at)
            elif shard.name in gone:
                continue
            else:
                part = rows_of(shard.name, [])
            writer.write_table(part.cast(schema()))
            rows += part.num_rows
    return ShardInfo(INDEX_NAME, rows, path.stat().st_size, sha256_file(path))


def write_errors(output: Path, manifest: Manifest, rows: Iterable[str], path: Path) -> int:
    """errors.jsonl as it was, byte for byte, then `rows` (each a line of errors.jsonl); the number
    of rows."""
    earlier = manifest.totals.get("errors", 0)
    if sum(1 for _ in iter_errors(output, earlier)) != earlier:  # (verify says the same of such an output)
        raise OutputError(f"{output / ERRORS_NAME}: does not hold the {earlier:,} rows its manifest counts")

    def lines() -> Iterator[str]:
        last = "\n"
        with contextlib.suppress(FileNotFoundError), open(output / ERRORS_NAME, encoding="utf-8", newline="") as old:
            for last in old:  # (newline="": each row as it is, its line ending included)
                yield last
        if not last.endswith("\n"):  # a last row without its newline (verify takes it): the next starts a line
            yield "\n"
        for row in rows:
            added[0] += 1
            yield row if row.endswith("\n") else row + "\n"

    added = [0]
    write_lines_atomic(path, lines(), temp_dir=path.parent)
    return earlier + added[0]


# --- an interrupted change taken up again --------------------------------------------------------


def check_pending(changed: Changing, journal: Journal, change: Change) -> None:
    """An interrupted change's journal against the output as it is now: the output must still be
    the version it started from (or, once committing, that or the version it makes, which `next/`
    or the output holds), and what it plans to write, move and delete must follow from that version
    and its own plan. A tampered journal, or an output changed meanwhile, is refused in one line."""
    output, manifest = changed.name, changed.manifest
    if journal.committing:  # (half its files may be in place: moving its journal away would strand them)
        away = "the output is between two versions: restore it from a copy"
    else:
        away = changed.abandoning(journal.action[:40])
    unfollowed = f"{output}: the interrupted {change.action}'s journal does not follow from its plan; {away}"
    if journal.action != change.action:  # (shardkit's actions; a stranger's word is shown, never run)
        finish = finishing(output, journal.action, journal.plan) if journal.action in ACTIONS else away
        raise OutputError(f"{output}: an interrupted {journal.action[:40]!r} is here, not a {change.action}; {finish}")
    _check_shape(journal, f"{output}: ", away)
    sealed = manifest.checksum == manifest.computed_checksum()
    if not journal.committing:
        if not sealed or manifest.checksum != journal.base:
            raise OutputError(f"{output}: the output changed since the interrupted {change.action} began; {away}")
        _check_plan(journal, manifest, f"{output}: ", away)
        try:
            change.check(journal, manifest)
        except ValueError as error:
            raise OutputError(f"{output}: the interrupted {change.action}'s plan {error}; {away}") from None
        if journal.deletes != deletes(manifest, journal.plan["gone"]):
            raise OutputError(unfollowed)
        refuse_damaged(changed, journal.plan)
        return
    result = changed.next_manifest() or manifest
    if not sealed or manifest.checksum not in (journal.base, journal.result) or result.checksum != journal.result:
        raise OutputError(f"{output}: the output changed since the interrupted {change.action} began; {away}")
    if result.computed_checksum() != result.checksum or result.version != journal.version:
        raise OutputError(f"{output}: the next version the interrupted {change.action} wrote is damaged; {away}")
    kept = {s.name for s in result.shards} | {c.name for c in result.companions}
    gone = journal.plan["gone"]
    allowed = set(gone) | {idx_name(old) for old in gone}
    expected = moves(result, journal.plan["writes"])
    if journal.plan.get("keep_versions") is True:
        expected.insert(0, kept_name(journal.version - 1))
    if journal.moves != expected or not set(journal.deletes) <= allowed - kept:
        raise OutputError(unfollowed)


def _check_shape(journal: Journal, prefix: str, away: str) -> None:
    """A plan read back has `writes` and `gone` as changes write them: shard names are plain names."""
    plan = journal.plan

    def named(name: Any) -> bool:
        return isinstance(name, str) and is_shard_name(name)

    def part(entry: Any) -> bool:
        return isinstance(entry, list) and len(entry) == 2 and named(entry[0]) and isinstance(entry[1], list)

    writes, gone = plan.get("writes"), plan.get("gone")
    shaped = (
        isinstance(writes, list) and isinstance(gone, list) and all(named(name) for name in gone)
        and all(isinstance(w, list) and len(w) == 2 and named(w[0]) and isinstance(w[1], list) and w[1]
                and all(part(p) for p in w[1]) for w in writes)
        and type(plan.get("bytes_written")) is int and type(plan.get("output_bytes")) is int
    )  # fmt: skip
    if not shaped:
        raise OutputError(f"{prefix}the interrupted {journal.action[:40]}'s plan is damaged; {away}")


def _check_plan(journal: Journal, manifest: Manifest, prefix: str, away: str) -> None:
    """A plan against the manifest it starts from: every old shard it names is the manifest's and
    named once, each new name the next version's for its first part, the positions left out each
    shard's own, and each new shard holds a record."""
    plan = journal.plan
    counts = {s.name: s.count for s in manifest.shards}
    try:
        if journal.version != manifest.version + 1:
            raise ValueError(f"version {journal.version} after {manifest.version}")
        olds = [old for _, parts in plan["writes"] for old, _ in parts]
        if len(set(olds)) != len(olds) or not set(olds) <= set(plan["gone"]) or not set(plan["gone"]) <= set(counts):
            raise ValueError("shards that are not the output's")
        if len(set(plan["gone"])) != len(plan["gone"]):
            raise ValueError("a shard gone twice")
        for new, parts in plan["writes"]:
            if new != versioned_name(parts[0][0], journal.version):
                raise ValueError("a name that is not the next version's")
            for old, left_out in parts:
                if not (all(type(p) is int for p in left_out) and left_out == sorted(set(left_out))
                        and all(0 <= p < counts[old] for p in left_out)):  # fmt: skip
                    raise ValueError(f"positions that are not {old}'s")
            if sum(counts[old] - len(left_out) for old, left_out in parts) < 1:
                raise ValueError(f"{new} with no record")
    except (ValueError, TypeError, KeyError) as error:
        said = f"{prefix}the interrupted {journal.action}'s plan does not fit the output"
        raise OutputError(f"{said} ({error}); {away}") from None
