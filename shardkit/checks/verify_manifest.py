"""The manifest against itself, errors.jsonl and the folder: its checksum, its totals, the files it
lists and the ones it does not (strays, a reader's leftovers, an adopted folder's other files), and
the files for other readers beside the whole output, derived again from the shards."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from ..core.errors import ShardFormatError, StorageError, describe
from ..core.manifest import (
    ERRORS_NAME,
    IDX_SUFFIX,
    INDEX_NAME,
    MANIFEST_NAME,
    VERSIONS_DIR,
    Manifest,
    ShardInfo,
    error_lines,
    idx_name,
    iter_errors,
)
from ..formats import get_format
from ..formats.base import Backend
from ..packing.sources.item import display
from ..storage.http import TooLong
from ..storage.store import Store
from .verify_report import Problem, VerifyReport
from .verify_shard import file_problem


def check_manifest(
    log: ErrorLog, manifest: Manifest, backend: Backend, present: Iterable[str], report: VerifyReport
) -> bool:
    """The manifest against itself, errors.jsonl and the folder; whether its checksum holds."""
    sealed = manifest.checksum == manifest.computed_checksum()
    if not sealed:
        report.problems.append(Problem("manifest", "checksum does not match its content (edited by hand?)"))
    if len({s.name for s in manifest.shards}) != len(manifest.shards):
        report.problems.append(Problem("manifest", "a shard is listed twice"))
    totals = manifest.totals
    adopted = isinstance(manifest.settings.get("adopted"), dict)  # tars `shardkit index` adopted
    errors, duplicates, removed, left_out = 0, 0, 0, set()
    for row in error_rows(log, report):
        errors += 1
        duplicates += row.get("stage") == "duplicate"
        removed += row.get("stage") == "removed"
        if adopted and row.get("stage") == "read":
            left_out.add(row.get("path"))  # a tar the readers cannot read, listed with its reason
    if totals.get("records") != manifest.records:
        report.problems.append(
            Problem("manifest", f"totals say {totals.get('records')} records, shards hold {manifest.records}")
        )
    if totals.get("errors") != errors:
        report.problems.append(
            Problem("manifest", f"totals say {totals.get('errors')} errors, {ERRORS_NAME} has {errors}")
        )
    if "duplicates" in totals and totals["duplicates"] != duplicates:
        report.problems.append(
            Problem("manifest", f"totals say {totals['duplicates']} duplicates, {ERRORS_NAME} lists {duplicates}")
        )
    if totals.get("removed", 0) != removed:  # (records `shardkit remove` took out: errors of their own)
        report.problems.append(
            Problem("manifest", f"totals say {totals.get('removed', 0)} removed, {ERRORS_NAME} lists {removed}")
        )
    if "videos" in totals:  # clips of videos: a record is a clip, an input a video packed or listed
        # (a removed record is a clip of a video packed: listed, but not an input of its own)
        if totals.get("inputs") != totals["videos"] + totals.get("errors", 0) - totals.get("removed", 0):
            report.problems.append(Problem("manifest", "inputs are not videos + errors"))
        if totals["videos"] > totals.get("records", 0) + totals.get("removed", 0):
            report.problems.append(Problem("manifest", "more videos packed than clips"))
    elif totals.get("inputs") != totals.get("records", 0) + totals.get("errors", 0):
        report.problems.append(Problem("manifest", "inputs are not records + errors"))
    listed = {s.name for s in manifest.shards} | {c.name for c in manifest.companions}
    listed |= {MANIFEST_NAME, ERRORS_NAME, INDEX_NAME}
    # what a plain reader of the format may leave beside a shard: its trace, not a change to the output
    leftovers = {f"{s.name}{leftover.suffix}": leftover.what for s in manifest.shards for leftover in backend.leftovers}
    others = 0
    for name in sorted(present):
        own_kind = name.endswith(backend.suffix) or (backend.idx_file is not None and name.endswith(IDX_SUFFIX))
        if adopted and (display(name) in left_out or not own_kind):  # (listed as shown: a name in UTF-8)
            others += name not in listed and not name.startswith(".")
        elif name in leftovers:
            report.notes.append(f"{name}: {leftovers[name]}; ignored")
        elif name == VERSIONS_DIR and manifest.version > 1:
            report.notes.append(f"{name}/: earlier versions kept whole (`shardkit verify OUT/{name}/vN` checks one)")
        elif name not in listed and not name.startswith("."):
            report.problems.append(Problem("stray", "not listed in the manifest", name))
    if others:
        report.notes.append(
            f"{others:,} other files beside the adopted tars (theirs, or tars listed in {ERRORS_NAME}): not checked"
        )
    return sealed


@dataclass(frozen=True)
class ErrorLog:
    """errors.jsonl as verify reads it, a pass at a time: from the output's folder, or streamed from
    its store (never copied to disk), each pass ended at the first row past `most`, the manifest's
    totals.errors (a log that never ends costs no more than the rows its manifest gives)."""

    root: Path
    store: Store | None = None
    most: int | None = None

    def rows(self) -> Iterator[dict[str, str]]:
        if self.store is None:
            yield from iter_errors(self.root, self.most)
            return
        try:
            with self.store.stream(ERRORS_NAME) as body:
                yield from error_lines(body, self.store.child(ERRORS_NAME), self.most)
        except FileNotFoundError:  # no errors.jsonl: nothing was skipped
            return


def listed_duplicates(log: ErrorLog) -> set[str]:
    """Keys an adopted output's errors.jsonl lists as found in two tars (`shardkit index` keeps both)."""
    return {
        row["path"].split("/", 1)[1]
        for row in error_rows(log, None)
        if row.get("stage") == "duplicate" and "/" in str(row.get("path"))
    }


def error_rows(log: ErrorLog, report: VerifyReport | None) -> Iterator[dict[str, str]]:
    """errors.jsonl's rows, streamed; a damaged or unreadable log (or one longer than its manifest
    says) ends them with an errors-log problem."""
    try:
        yield from log.rows()
    except (ShardFormatError, StorageError) as error:
        if report is not None:
            report.problems.append(Problem("errors-log", str(error)))
    except OSError as error:  # a remote body broken off mid-way
        if report is not None:
            report.problems.append(Problem("errors-log", f"{ERRORS_NAME}: unreadable ({describe(error)})"))


def check_output_files(
    meta: Path, store: Store | None, manifest: Manifest, companions: dict[str, ShardInfo], report: VerifyReport
) -> None:
    """The files for other readers beside the whole output (`Backend.output_files`: wids'
    shardindex.json) that the manifest lists are what the format derives from its shards now, and
    the files there are that, byte for byte. A listed file the format does not write, and that is
    no shard's index, is a problem."""
    produce = get_format(manifest.format).output_files
    expected = dict(produce(manifest.shards)) if produce is not None else {}
    indexes = {idx_name(shard.name) for shard in manifest.shards}  # checked with their shards
    for name, listed in companions.items():
        if name in expected:
            _check_output_file(meta, store, name, expected[name], listed, report)
        elif name not in indexes:
            report.problems.append(Problem("companion", f"not a file the {manifest.format} format writes", name))


def _check_output_file(
    meta: Path, store: Store | None, name: str, expected: bytes, listed: ShardInfo, report: VerifyReport
) -> None:
    """One output-level file: the manifest's entry is `expected`'s hash, and the file is that (a
    remote output's is downloaded first into `meta`, the folder holding its manifest)."""
    if hashlib.sha256(expected).hexdigest() != listed.sha256:
        report.problems.append(Problem("companion", "does not list the manifest's shards", name))
        return
    path = meta / name
    if store is not None:
        try:
            store.get(name, str(path), limit=listed.bytes)
        except FileNotFoundError:
            report.problems.append(Problem("missing", "listed in the manifest but not in the bucket", name))
            return
        except TooLong:
            report.problems.append(Problem("size", f"more than the {listed.bytes:,} bytes the manifest says", name))
            return
        except StorageError as error:
            report.problems.append(Problem("unreadable", str(error), name))
            return
    problem = file_problem(str(path), listed)
    if problem is not None:
        report.problems.append(problem)
