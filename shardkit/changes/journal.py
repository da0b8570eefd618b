"""A change of a finished local output (remove, compact, append; and merge, which makes a new
one): one writer at a time, and safe to kill at any moment.

The output's files are never edited in place. A change writes everything new under new names in
the working folder's `next/` (rewritten shards as `shard-NNNNNN-vK`, the index, errors.jsonl, the
files for other readers, the manifest), recorded by a journal, `.shardkit/change.json`, written
before anything else and again, as `committing`, once `next/` is whole. Committing moves in
the version it started from kept whole (`--keep-versions`: versions/vN, a folder of links), then
renames the new shards into the output, then the files beside them, the manifest last, then
deletes the shards the new version no longer lists. So a kill leaves the earlier version (before
the commit) or the new one with some superseded files left (after the manifest), and in between
only the renames of one commit; `--resume` (or the same command again) finishes from the journal, byte for byte as an
uninterrupted run, and every other writer (a pack, another change) is refused until it has.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ..core.errors import ManifestError, OutputError, describe
from ..core.manifest import (
    ERRORS_NAME,
    INDEX_NAME,
    MANIFEST_NAME,
    MAX_VERSION,
    VERSIONS_DIR,
    Manifest,
    read_manifest,
    write_json_atomic,
)
from ..core.safeio import load_json_file, regular_size
from ..packing.folder_output import lock_folder, precheck
from ..packing.working_folder import (
    CHANGE_NAME,
    NEXT_DIR,
    STATE_NAME,
    finishing,
    is_idx_name,
    is_shard_name,
    own_files,
    remove_state,
    state_dir,
    writing,
)
from ..readers.subset import IndexFile, read_index

if TYPE_CHECKING:
    from ..core.manifest import ShardInfo


class BucketSide(Protocol):
    """What a change of a bucket's output (bucket.BucketChange) does where a folder's does its own."""

    @property
    def url(self) -> str: ...  # the output's URL
    @property
    def journal_url(self) -> str: ...  # its journal's

    def fetch(self, folder: Path, shards: list[ShardInfo]) -> None: ...
    def holds(self, name: str) -> bool: ...
    def size_of(self, name: str) -> int | None: ...
    def begun(self, journal: Journal) -> None: ...
    def commit(self, next_folder: Path, journal: dict[str, Any]) -> None: ...
    def clear(self, folder: Path) -> None: ...
    def kept_versions(self) -> list[int]: ...
    def refuse_kept(self, version: int) -> None: ...
    def pack_url(self, journal: Journal) -> str: ...  # where an append packs (its workers upload there)
    def finished_pack(self, folder: Path, journal: Journal) -> Manifest | None: ...
    def clear_packs(self, keep: Journal | None) -> None: ...


@dataclass
class Journal:
    """A change in progress, as `.shardkit/change.json` holds it: what was asked (`request`, to tell
    the same command run again from another change), the version it starts from (by its manifest's
    checksum) and makes, the plan (the action's own, JSON), the files the commit moves into the
    output (in that order: manifest.json last) and deletes, and, once `next/` is whole, the
    checksum of the manifest it holds (`result`; empty before)."""

    action: str
    request: str
    base: str  # the checksum of the manifest the change starts from
    version: int  # the version it makes
    plan: dict[str, Any]
    moves: list[str] = field(default_factory=list)
    deletes: list[str] = field(default_factory=list)
    result: str = ""

    @property
    def committing(self) -> bool:
        return bool(self.result)

    def to_json(self) -> dict[str, Any]:
        return {
            "action": self.action, "request": self.request, "base": self.base, "version": self.version,
            "plan": self.plan, "moves": self.moves, "deletes": self.deletes, "result": self.result,
        }  # fmt: skip

    @classmethod
    def from_json(cls, data: Any, where: str | Path, away: str = "move it away") -> Journal:
        """A journal read back, every field type-checked and every name it would have the commit
        move or delete one that shardkit gives (it is ours, but a tampered one must not reach
        anything else); what it plans is checked against the output by its action."""
        damaged = f"{where}: a damaged journal of a change"
        if not isinstance(data, dict):
            raise OutputError(f"{damaged} (not an object); {away}")
        kinds = {"action": str, "request": str, "base": str, "version": int, "plan": dict, "moves": list,
                 "deletes": list, "result": str}  # fmt: skip
        for name, kind in kinds.items():
            if type(data.get(name)) is not kind:
                raise OutputError(f"{damaged} ({name} is not of type {kind.__name__}); {away}")
        journal = cls(**{name: data[name] for name in kinds})
        if not (1 if journal.action == "merge" else 2) <= journal.version <= MAX_VERSION:
            raise OutputError(f"{damaged} (version {journal.version}); {away}")
        own = set(own_files())
        kept = [name for name in journal.moves if isinstance(name, str) and KEPT.fullmatch(name)]
        if kept and (
            kept != [kept_name(journal.version - 1)] or journal.moves[0] != kept[0] or journal.action == "merge"
        ):
            raise OutputError(f"{where}: a journal keeping a version it does not make; {away}")
        if not all(isinstance(name, str) and (name in own or is_shard_name(name) or is_idx_name(name))
                   for name in [*journal.moves[len(kept):], *journal.deletes]):  # fmt: skip
            raise OutputError(f"{where}: a journal naming files shardkit does not write; {away}")
        if MANIFEST_NAME in journal.deletes or (journal.committing and journal.moves[-1:] != [MANIFEST_NAME]):
            raise OutputError(f"{where}: a journal whose commit does not end with the manifest; {away}")
        if set(journal.moves) & set(journal.deletes):
            raise OutputError(f"{where}: a journal that would delete what it puts in place; {away}")
        return journal


KEPT = re.compile(r"versions/v[1-9][0-9]{0,9}")  # what --keep-versions moves in: one version's folder


def kept_name(version: int) -> str:
    """Where `--keep-versions` keeps `version`, relative to the output."""
    return f"{VERSIONS_DIR}/v{version}"


@dataclass
class Changing:
    """An output locked for a change: its folder, the manifest it holds now, and the journal of a
    change an earlier run left unfinished (None where there is none)."""

    output: Path  # the folder the change runs in: the output, or a bucket output's mirror
    manifest: Manifest
    pending: Journal | None
    _index: IndexFile | None = None
    bucket: BucketSide | None = None  # where the output is a bucket's (bucket.py)

    def index(self) -> IndexFile:
        """The output's index.parquet, checked against its manifest: read once for a plan and the
        new version's index alike (hashing and reading it is a pass over every row)."""
        if self._index is None:
            self._index = read_index(self.output, self.manifest)
        return self._index

    @property
    def name(self) -> str:
        """The output as messages name it: its folder, or its bucket's URL (not the mirror's)."""
        return self.bucket.url if self.bucket is not None else str(self.output)

    def abandoning(self, action: str) -> str:
        """What abandons an unfinished `action` that has not begun its commit, as a refusal says it."""
        if self.bucket is None:
            return f"move {self.output}/.shardkit away to abandon that {action}"
        return f"delete {self.output} and {self.bucket.journal_url} to abandon that {action}"

    @property
    def next(self) -> Path:
        return state_dir(self.output) / NEXT_DIR

    @property
    def journal_path(self) -> Path:
        return state_dir(self.output) / CHANGE_NAME

    def begin(self, journal: Journal) -> None:
        """Record the change before anything is written. A pack that finished with rows that failed
        for a passing cause kept its state for `pack --resume` to try them again: the change makes
        another version, which no such resume can follow, so that state goes (the rows stay in
        errors.jsonl, marked transient)."""
        if os.path.lexists(state_dir(self.output) / STATE_NAME):
            with writing(self.output, "the working folder"):
                remove_state(self.output, keep_lock=True)
        self.restart()
        with writing(self.output, CHANGE_NAME):
            write_json_atomic(self.journal_path, journal.to_json())
        if self.bucket is not None:
            self.bucket.begun(journal)
            self.bucket.clear_packs(journal)  # (once it is this run's: what abandoned appends left)
        self.pending = journal

    def record(self, journal: Journal) -> None:
        """The journal written again as it is now (what an action learnt since it began: an append's
        counts, where its source changed meanwhile), before the change goes on."""
        with writing(self.output, CHANGE_NAME):
            write_json_atomic(self.journal_path, journal.to_json())
        if self.bucket is not None:
            self.bucket.begun(journal)
        self.pending = journal

    def restart(self) -> None:
        """An empty `next/`: what an interrupted run wrote there goes, since it is written again
        whole from the journal (a kill while writing it leaves nothing to trust)."""
        self._refuse_planted_next()
        with writing(self.output, "the working folder"):
            shutil.rmtree(self.next, ignore_errors=True)
            self.next.mkdir(parents=True)

    def next_manifest(self) -> Manifest | None:
        """The manifest `next/` holds, where it still holds one (None once the commit moved it)."""
        self._refuse_planted_next()
        if not os.path.lexists(self.next / MANIFEST_NAME):
            return None
        try:
            return read_manifest(self.next / MANIFEST_NAME)
        except ManifestError as error:
            raise OutputError(f"{error}; move {state_dir(self.output)} away") from None

    def ready(self, journal: Journal, result: Manifest) -> None:
        """`next/` is whole, holding `result`: from here the change is committed, whoever finishes it."""
        journal.result = result.checksum
        with writing(self.output, CHANGE_NAME):
            for name in journal.moves:  # what the commit will rename is on disk, not in a cache
                if self.bucket is None or os.path.lexists(self.next / name):  # (an append's shards: in the bucket)
                    _fsync(self.next / name)
            write_json_atomic(self.journal_path, journal.to_json())

    def fetch(self, shards: list[ShardInfo]) -> None:
        """The shards a change reads, in `output` (a bucket's downloaded into its mirror)."""
        if self.bucket is not None:
            self.bucket.fetch(self.output, shards)

    def size_of(self, name: str) -> int | None:
        """The size of the output's regular file (in a bucket: object) `name`; None where there is
        none (a link or a folder is none)."""
        if self.bucket is not None:
            return self.bucket.size_of(name)
        return regular_size(self.output / name)

    def holds(self, name: str) -> bool:
        """Whether the output holds a file named `name` (in a bucket: an object)."""
        return os.path.lexists(self.output / name) or (self.bucket is not None and self.bucket.holds(name))

    def commit(self, journal: Journal) -> None:
        """Rename what `next/` holds into the output (the new shards, then the files beside them, the
        manifest last), then delete what the new version no longer lists, then the journal. Every
        step may be done again: a name already moved or deleted is skipped. Only regular files are
        moved, from a `next/` that is a folder of its own. A bucket's change commits in the bucket
        (bucket.py), and its mirror is emptied."""
        self._refuse_planted_next()
        if self.bucket is not None:
            self.bucket.commit(self.next, journal.to_json())
            with writing(self.output, "the mirror of the bucket"):
                self.bucket.clear(self.output)
            self.pending = None
            return
        with writing(self.output, "the new version"):
            for name in journal.moves:
                source = self.next / name
                if not os.path.lexists(source):
                    if KEPT.fullmatch(name) and not os.path.lexists(self.output / name):
                        raise OutputError(f"{source}: the version to keep is missing; restore the output from a copy")
                    continue  # (moved by the run that was interrupted)
                if KEPT.fullmatch(name):  # the earlier version, kept whole: a folder of links
                    self._keep(source, name)
                    continue
                if not stat.S_ISREG(os.lstat(source).st_mode):
                    raise OutputError(f"{source}: not a file shardkit wrote; move {state_dir(self.output)} away")
                os.replace(source, self.output / name)
            for name in journal.deletes:
                (self.output / name).unlink(missing_ok=True)
            shutil.rmtree(self.next, ignore_errors=True)
            self.journal_path.unlink(missing_ok=True)
        self.pending = None

    def refuse_kept(self) -> None:
        """`--keep-versions` refused before anything is written where the version it would keep is
        in the way, or where a file it lists is not a regular file (a link would be kept as a link)."""
        if self.bucket is not None:  # (its files are the bucket's objects, copied at the commit)
            self.bucket.refuse_kept(self.manifest.version)
            return
        versions, version = self.output / VERSIONS_DIR, self.manifest.version
        refuse_link(versions, "shardkit's folder of versions")
        if os.path.lexists(self.output / kept_name(version)):
            raise OutputError(
                f"{self.output / kept_name(version)}: is there already; move it away to keep version {version}"
            )
        for file in self._version_files():
            if not stat.S_ISREG(os.lstat(self.output / file).st_mode):
                raise OutputError(
                    f"{self.output / file}: not a file shardkit wrote (a link?); --keep-versions keeps files"
                )

    def _version_files(self) -> list[str]:
        """The files of the version the output is at: shards, companions, index, errors, manifest."""
        manifest = self.manifest
        files = [s.name for s in manifest.shards] + [c.name for c in manifest.companions]
        files += [INDEX_NAME] * (manifest.index is not None) + [MANIFEST_NAME]
        return files + [ERRORS_NAME] * os.path.lexists(self.output / ERRORS_NAME)

    def keep_version(self, journal: Journal) -> None:
        """`--keep-versions`: the version the change starts from, kept whole as `versions/vN/`
        beside the next one (hard links to its shards and the files beside them: no bytes are
        copied), made in `next/` and moved in first by the commit. A takedown that keeps versions
        keeps the removed bytes there: that is what was asked."""
        name = kept_name(self.manifest.version)
        self.refuse_kept()
        if self.bucket is not None:  # (a bucket has no links: its commit copies the files, server-side)
            journal.moves.insert(0, name)
            return
        self._refuse_planted_next()
        folder = self.next / name
        with writing(self.output, name):
            if os.path.lexists(folder):
                shutil.rmtree(folder)
            folder.mkdir(parents=True)
            for file in self._version_files():
                os.link(self.output / file, folder / file)
        journal.moves.insert(0, name)

    def _keep(self, source: Path, name: str) -> None:
        """The kept version's folder moved in: a folder of `next/versions/`, into `versions/`."""
        refuse_link(self.output / VERSIONS_DIR, "shardkit's folder of versions")
        if not stat.S_ISDIR(os.lstat(source).st_mode):
            raise OutputError(f"{source}: not a folder shardkit wrote; move {state_dir(self.output)} away")
        (self.output / VERSIONS_DIR).mkdir(exist_ok=True)
        os.replace(source, self.output / name)

    def _refuse_planted_next(self) -> None:
        """A link or file planted as `next/` (or as its `versions/`) must not make a change read,
        write, move or delete elsewhere."""
        refuse_link(self.next, "shardkit's working folder")
        refuse_link(self.next / VERSIONS_DIR, "shardkit's working folder")


def refuse_link(folder: Path, what: str) -> None:
    """A link or file planted where shardkit keeps a folder of its own (`what`) is refused: writes,
    moves and deletions there must not reach elsewhere."""
    if os.path.lexists(folder) and not stat.S_ISDIR(os.lstat(folder).st_mode):
        raise OutputError(f"{folder}: is not {what} (not a folder); move it away")


@contextlib.contextmanager
def changing(output: str | os.PathLike[str]) -> Iterator[Changing]:
    """The local output folder `output` locked for a change (one writer at a time: a pack or another
    change is refused), with its manifest and any unfinished change's journal. Refused, before
    anything is written, where there is no finished output or an interrupted pack is there. (A
    bucket's output: place.changing.)"""
    path = Path(output)
    if not path.is_dir():
        raise OutputError(f"{path}: no such folder" if not os.path.lexists(path) else f"{path}: not a folder")
    precheck(path)
    if path.resolve().parent.name == VERSIONS_DIR and (path.resolve().parent.parent / MANIFEST_NAME).exists():
        raise OutputError(f"{path}: a version kept by --keep-versions: read it, or delete it; change the output itself")
    with changing_in(path) as changed:
        yield changed


@contextlib.contextmanager
def changing_in(path: Path, prepare: Callable[[Path], None] | None = None) -> Iterator[Changing]:
    """`path` locked for a change, with its manifest and journal; `prepare(path)` first, under the
    lock (a bucket's mirror made to follow the bucket)."""
    state, lock_fd = _locked(path)
    try:
        if prepare is not None:
            prepare(path)
        if (state / STATE_NAME).exists() and not _finished_with_retries(path):
            raise OutputError(f"{path}: an interrupted pack is here; finish it with pack --resume first")
        pending = _journal(state / CHANGE_NAME)
        if pending is not None and pending.action == "merge" and not os.path.lexists(path / MANIFEST_NAME):
            said = finishing(path, pending.action, pending.plan)
            raise OutputError(f"{path}: an interrupted merge is here; {said} first")
        try:
            manifest = read_manifest(path)
        except ManifestError as error:
            raise OutputError(str(error)) from None
        if pending is None and manifest.checksum != manifest.computed_checksum():
            raise OutputError(f"{path}/{MANIFEST_NAME}: checksum does not match its content (edited by hand?)")
        yield Changing(path, manifest, pending)
    finally:
        _release(path, lock_fd)


@contextlib.contextmanager
def creating(output: str | os.PathLike[str]) -> Iterator[Changing]:
    """A new output folder `output` locked for a change that makes its first version (a merge):
    refused where it holds anything but an unfinished merge's working folder or a finished output
    (whose manifest it gives, version 1 or more, for the change to tell whether it is its own; else
    an empty stand-in, version 0)."""
    path = Path(output)
    precheck(path)
    state, lock_fd = _locked(path)
    try:
        pending = _journal(state / CHANGE_NAME)
        if pending is not None and pending.action != "merge":
            raise OutputError(f"{path}: an interrupted {pending.action[:40]!r} is here, not a merge")
        if os.path.lexists(state / STATE_NAME):
            raise OutputError(f"{path}: an interrupted pack is here; merge into a new folder")
        others = sorted(entry.name for entry in os.scandir(path) if entry.name != state.name)
        if others and pending is None and MANIFEST_NAME not in others:
            raise OutputError(f"{path}: holds {others[0]!r}; merge into a new folder")
        manifest = Manifest(format="", shards=[], version=0)  # (a stand-in: there is none yet)
        if pending is None and others:  # a finished output: the change says whether it is its own
            try:
                manifest = read_manifest(path)
            except ManifestError:
                raise OutputError(f"{path}: holds an output already; merge into a new folder") from None
        yield Changing(path, manifest, pending)
    finally:
        _release(path, lock_fd)


@contextlib.contextmanager
def locked(path: Path) -> Iterator[Path]:
    """`path`'s working folder, locked as one writer holds it (a bucket merge's mirror)."""
    state, lock_fd = _locked(path)
    try:
        yield state
    finally:
        _release(path, lock_fd)


def _locked(path: Path) -> tuple[Path, int]:
    """The working folder of `path` made (a link planted there refused) and locked, as one writer
    holds it: the folder and the lock's descriptor."""
    state = state_dir(path)
    refuse_link(state, "shardkit's working folder")
    try:
        state.mkdir(parents=True, exist_ok=True)
        return state, lock_folder(state, path)
    except OSError as error:
        raise OutputError(f"{path}: cannot write here ({describe(error)})") from None


def _release(path: Path, lock_fd: int) -> None:
    """The lock let go. The working folder goes unless it holds an unfinished change's or pack's
    state (its --resume needs it): an earlier change killed in its last step, or a pack's cleanup,
    leaves only its lock and markers behind."""
    state = state_dir(path)
    if not os.path.lexists(state / CHANGE_NAME) and not os.path.lexists(state / STATE_NAME):
        remove_state(path)
    os.close(lock_fd)


def _finished_with_retries(output: Path) -> bool:
    """Whether the pack state in `output` is a finished pack's, kept for `pack --resume` to try
    again rows that failed for a passing cause: a sealed manifest that counts such rows."""
    try:
        manifest = read_manifest(output)
    except ManifestError:
        return False
    return manifest.checksum == manifest.computed_checksum() and bool(manifest.totals.get("transient"))


def pending_change(output: Path) -> Journal | None:
    """The journal of a change of `output` in progress or interrupted, read without the lock (what
    verify says of an output in the middle of a commit); None where there is none."""
    return _journal(state_dir(output) / CHANGE_NAME)


def _journal(path: Path) -> Journal | None:
    try:
        data = load_json_file(path)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as error:
        raise OutputError(f"{path}: an unreadable journal of a change ({describe(error)}); move it away") from None
    return Journal.from_json(data, path)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # (a FIFO put there must not hang the commit)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
