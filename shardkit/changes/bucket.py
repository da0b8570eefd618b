"""A change (remove, compact, append) of an output in a bucket: run on a local mirror of its small
files, committed in the bucket by a journal of its own, so that a kill at any point leaves the
bucket at the earlier version or the new one, and any machine can finish it.

The mirror (a folder in the cache, one per output URL) holds what the change reads: the manifest,
index.parquet, errors.jsonl and the shards it writes again (each downloaded and checked against the
manifest's sha256). The change runs there as on a local folder (journal.py: the lock, the journal,
`next/`). Its commit is the bucket's:

1. `.shardkit/change.json` goes up (the local journal, `uploaded: false`);
2. the new shards and their .idx files go up under their own names (no version lists them yet),
   the files with fixed names (the files for other readers, index.parquet, errors.jsonl, the
   manifest) under `.shardkit/next/`;
3. the journal goes up again with `uploaded: true`: from here the change is committed;
4. each staged file is copied into place (server-side), the manifest last; then the objects the new
   version no longer lists are deleted, then the staged files, then the journal.

A kill before step 3 leaves the earlier version whole (the manifest and every file it names are as
they were): the same command again (or `--resume`) commits what the mirror holds, or, where the
mirror is gone (another machine), deletes what the killed one put up and does the change again
from the plan in the bucket's journal. A kill after it leaves a journal that says the change is
committed: the same command (or `--resume`) finishes steps 4 from the bucket alone, from any
machine. A pack into the prefix is refused while the journal is there, and `verify` names it.
Kept versions (`--keep-versions`) are not supported in a bucket yet: refused before any work.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..core.errors import ConfigError, ManifestError, OutputError, ShardkitError
from ..core.manifest import (
    ERRORS_NAME,
    INDEX_NAME,
    MANIFEST_NAME,
    STATE_DIR,
    Manifest,
    ShardInfo,
    read_manifest,
    write_json_atomic,
)
from ..core.safeio import loads
from ..packing.bucket_output import CHANGE_JOURNAL as JOURNAL
from ..packing.working_folder import CHANGE_NAME, NEXT_DIR, is_idx_name, is_shard_name, remove_state, state_dir
from ..storage.cache import default_cache_dir
from ..storage.store import Store, read_remote_manifest

STAGED = f"{STATE_DIR}/{NEXT_DIR}"  # where the files with fixed names wait for the commit
UPLOADED = "uploaded"  # the bucket journal's own field: every file of the new version is up
MAX_JOURNAL_BYTES = 64 << 20


def mirror_folder(url: str) -> Path:
    """The local folder a change of the output `url` runs in (one per URL, in the cache)."""
    import hashlib

    return default_cache_dir() / "changes" / hashlib.sha256(url.encode()).hexdigest()[:16]


def goes_to(name: str) -> str:
    """Where the commit puts a file of the new version before it is committed: a new shard (or its
    .idx file) at its own name, anything else (whose name the current version uses) staged."""
    return name if is_shard_name(name) or is_idx_name(name) else f"{STAGED}/{name}"


@dataclass
class BucketChange:
    """The bucket side of a change of `store`'s output: its objects as the change found them, and
    what prepares the mirror, fetches shards into it and commits into the bucket."""

    store: Store
    objects: dict[str, int | None] = field(default_factory=dict)

    def prepare(self, folder: Path) -> None:
        """The mirror made to follow the bucket, under the mirror's lock, before the change reads
        it: a committed change in the bucket is taken up (its journal put in the mirror, so the
        change finishes it); one killed before it committed is undone unless the mirror can still
        commit it; a mirror that no longer follows the bucket's version is fetched again."""
        try:
            remote = read_remote_manifest(self.store)
        except ManifestError as error:
            raise OutputError(str(error)) from None
        found = self.journal()
        local = _local_journal(folder)
        mirrored = _checksum(folder / MANIFEST_NAME)
        can_commit = (
            local is not None and bool(local.get("result")) and local.get("result") == found.get("result")
            and mirrored == remote.checksum
        ) if found is not None else False  # fmt: skip
        if found is not None and found.get(UPLOADED) is not True and not can_commit:
            # what it put up goes; its plan is taken up from the start, as a local one killed
            # before its commit is (the mirror that wrote it may be another machine's)
            self.undo(found, remote)
            clear_mirror(folder)
            self._fetch_small(folder, remote, index=True)
            begun = {name: value for name, value in found.items() if name != UPLOADED}
            write_json_atomic(state_dir(folder) / CHANGE_NAME, {**begun, "moves": [], "result": ""})
        elif found is not None and found.get(UPLOADED) is True:
            clear_mirror(folder)
            self._fetch_small(folder, remote, index=False)
            committed = {name: value for name, value in found.items() if name != UPLOADED}
            (state_dir(folder) / NEXT_DIR).mkdir(parents=True)
            with contextlib.suppress(FileNotFoundError):
                self.store.get(f"{STAGED}/{MANIFEST_NAME}", str(state_dir(folder) / NEXT_DIR / MANIFEST_NAME), 64 << 20)
            write_json_atomic(state_dir(folder) / CHANGE_NAME, committed)
        elif local is None or mirrored != remote.checksum:
            clear_mirror(folder)
            self._fetch_small(folder, remote, index=True)
        self.objects = self.store.listing()

    def journal(self) -> dict[str, Any] | None:
        """The bucket's journal of a change (None where there is none)."""
        try:
            data = loads(self.store.read(JOURNAL, MAX_JOURNAL_BYTES))
        except FileNotFoundError:
            return None
        except (ValueError, ShardkitError) as error:
            raise OutputError(f"{self.store.child(JOURNAL)}: an unreadable journal of a change ({error})") from None
        if not isinstance(data, dict):
            raise OutputError(f"{self.store.child(JOURNAL)}: a damaged journal of a change (not an object)")
        return data

    def undo(self, found: dict[str, Any], remote: Manifest) -> None:
        """What a change killed before its commit put up, deleted: the new shards it names that the
        current version does not list, its staged files, then its journal. The earlier version
        was never touched."""
        listed = {s.name for s in remote.shards} | {c.name for c in remote.companions}
        moves = found.get("moves")
        for name in moves if isinstance(moves, list) else []:
            if isinstance(name, str) and (is_shard_name(name) or is_idx_name(name)) and name not in listed:
                self.store.delete(name)
            elif isinstance(name, str) and "/" not in name:
                self.store.delete(f"{STAGED}/{name}")
        self.store.delete(JOURNAL)

    def fetch(self, folder: Path, shards: list[ShardInfo]) -> None:
        """The shards a change reads, downloaded into the mirror and checked against the manifest
        (a damaged object is refused, naming it); those the mirror holds whole already stay."""
        for shard in shards:
            path = folder / shard.name
            if os.path.lexists(path) and stat.S_ISREG(os.lstat(path).st_mode) and path.stat().st_size == shard.bytes:
                continue
            try:
                self.store.download(shard.name, str(path), shard.bytes, shard.sha256)
            except ShardkitError as error:
                path.unlink(missing_ok=True)
                raise OutputError(f"{error}; `shardkit verify` says more") from None

    def holds(self, name: str) -> bool:
        return name in self.objects

    def commit(self, next_folder: Path, journal: dict[str, Any]) -> None:
        """Steps 1 to 4 of the module's commit: the new version's files up from `next_folder`
        (skipped where the bucket's journal says they are up), then put in place."""
        found = self.journal()
        if not (found is not None and found.get(UPLOADED) is True and found.get("result") == journal["result"]):
            self.store.write(JOURNAL, json.dumps({**journal, UPLOADED: False}).encode())
            for name in journal["moves"]:
                source = next_folder / name
                if not stat.S_ISREG(os.lstat(source).st_mode):
                    raise OutputError(f"{source}: not a file shardkit wrote; move {next_folder.parent} away")
                self.store.upload(str(source), goes_to(name))
            self.store.write(JOURNAL, json.dumps({**journal, UPLOADED: True}).encode())
        self.finish(journal)

    def finish(self, journal: dict[str, Any]) -> None:
        """Step 4: each staged file copied into place (the manifest last), then what the new
        version no longer lists deleted, then the staged files and the journal. Every step may be
        done again: a staged file already gone was copied by the run that was interrupted (the
        staged files go only once every copy is made)."""
        staged = [name for name in journal["moves"] if goes_to(name) != name]
        for name in staged:
            try:
                self.store.copy(goes_to(name), name)
            except FileNotFoundError:
                continue
        for name in journal["deletes"]:
            self.store.delete(name)
        for name in staged:
            self.store.delete(goes_to(name))
        self.store.delete(JOURNAL)

    def _fetch_small(self, folder: Path, remote: Manifest, *, index: bool) -> None:
        """The manifest (as read: its bytes are the bucket's), and with `index`, index.parquet and
        errors.jsonl, into the mirror."""
        self.store.get(MANIFEST_NAME, str(folder / MANIFEST_NAME), 64 << 20)
        if _checksum(folder / MANIFEST_NAME) != remote.checksum:  # (another writer, between two reads)
            raise OutputError(f"{self.store.child(MANIFEST_NAME)}: changed while the change read it; try again")
        if not index:
            return
        if remote.index is not None:
            try:
                self.store.download(INDEX_NAME, str(folder / INDEX_NAME), remote.index.bytes, remote.index.sha256)
            except ShardkitError as error:
                raise OutputError(f"{error}; `shardkit verify` says more") from None
        with contextlib.suppress(FileNotFoundError):
            self.store.get(ERRORS_NAME, str(folder / ERRORS_NAME))


def refuse_keep_versions(url: str) -> None:
    raise ConfigError(f"{url}: --keep-versions keeps versions in a local output folder only (not a bucket's yet)")


def _local_journal(folder: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((state_dir(folder) / CHANGE_NAME).read_bytes())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _checksum(path: Path) -> str | None:
    """The checksum of the mirror's manifest (None where it has none it can read)."""
    try:
        return read_manifest(path).checksum
    except (ManifestError, OSError):
        return None


def clear_mirror(folder: Path) -> None:
    """The mirror emptied but for its lock (it is held): what an earlier change left goes."""
    for entry in list(os.scandir(folder)):
        if entry.name == STATE_DIR:
            continue
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path)
        else:
            os.unlink(entry.path)
    state = state_dir(folder)
    shutil.rmtree(state / NEXT_DIR, ignore_errors=True)
    (state / CHANGE_NAME).unlink(missing_ok=True)
    remove_state(folder, keep_lock=True)
