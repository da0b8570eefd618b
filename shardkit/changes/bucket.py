"""A change (remove, compact, append) of an output in a bucket: run on a local mirror of its small
files, committed in the bucket by a journal of its own, so that a kill at any point leaves the
bucket at the earlier version or the new one, and any machine can finish it.

The mirror (a folder in the cache, one per output) holds what the change reads: the manifest,
index.parquet, errors.jsonl and the shards it writes again (each downloaded and checked against the
manifest's sha256). The change runs there as on a local folder (journal.py: the lock, the journal,
`next/`). The bucket hears of it at once: its journal, `.shardkit/change.json`, goes up when the
change begins, with the token of the run (the mirror) that owns it, and a pack into the prefix or
a change from another run is refused while it is there. The commit is the bucket's:

1. the bucket must still hold this run's journal and the version the change began from;
2. the new shards and their .idx files go up under their own names (no version lists them yet;
   an append's are copied there server-side from its pack, `pack_name`, which its workers
   uploaded them to), the files with fixed names (the files for other readers, index.parquet,
   errors.jsonl, the manifest) under `.shardkit/next/`;
3. the journal goes up again with `uploaded: true`: from here the change is committed;
4. each staged file is copied into place (server-side), the manifest last; then the objects the new
   version no longer lists are deleted, then the staged files and any append's pack, then the
   journal.

A kill before step 3 leaves the earlier version whole (the manifest and every file it names are as
they were): the same command again goes on from the mirror. Without the mirror (another machine)
it is refused, as the run that began it may still be going (a bucket has no lock); `--resume`
(`take_over`) then deletes what that run put up and does its plan again from the bucket's journal.
A kill after step 3 leaves a journal that says the change is committed: the same command (or
`--resume`) finishes step 4 from the bucket alone, from any machine. Every journal read from the
bucket is checked as a local one is before anything is done with it. A kept version
(`--keep-versions`) is copied whole into versions/vN/ server-side at the commit, before the journal
says the change is committed.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..core.errors import ConfigError, ManifestError, OutputError, ShardkitError
from ..core.manifest import (
    ERRORS_NAME,
    INDEX_NAME,
    JOURNAL_LIMIT,
    MANIFEST_NAME,
    STATE_DIR,
    VERSIONS_DIR,
    Manifest,
    ShardInfo,
    read_manifest,
    write_json_atomic,
    write_text_atomic,
)
from ..core.safeio import loads, regular_size
from ..packing.bucket_output import CHANGE_JOURNAL as JOURNAL
from ..packing.working_folder import (
    CHANGE_NAME,
    NEXT_DIR,
    is_idx_name,
    is_shard_name,
    remove_state,
    state_dir,
)
from ..storage.cache import default_cache_dir
from ..storage.store import Store, kept_versions, read_remote_manifest
from .journal import KEPT, Changing, Journal, changing_in, kept_name

BUCKET_NEXT = f"{STATE_DIR}/{NEXT_DIR}"  # where the files with fixed names wait for the commit
# where an append packs, an output of its own in the bucket (`pack_name`): each shard goes up as its
# worker writes it (a Ray task on a machine that never sees the mirror), and the commit copies the
# shards to their own names server-side
PACK_PREFIX = "pack-"
UPLOADED = "uploaded"  # the bucket journal's own field: every file of the new version is up
OWNER = "owner"  # and the token of the run whose change it is
OWNER_NAME = "bucket-owner"  # that token, in the mirror's working folder
MAX_JOURNAL_BYTES = JOURNAL_LIMIT  # a journal's, or a manifest's, most bytes
MAX_ERRORS_BYTES = 64 << 30  # errors.jsonl's (a row a failed input)
COPIES_AT_ONCE = 8  # a kept version's server-side copies in flight (as a merge's)


def spelled(store: Store) -> str:
    """The output's URL as the store reaches it: two spellings of one prefix (s3a://, a doubled
    slash, a trailing one) give one."""
    protocol = "s3" if store.protocol in ("s3", "s3a") else store.protocol
    return f"{protocol}://{re.sub('/+', '/', store.url.split('://', 1)[-1]).strip('/')}"


def mirror_folder(store: Store) -> Path:
    """The local folder a change of `store`'s output runs in (one per output, in the cache): named by
    the output as the store reaches it, so two spellings of one prefix share one mirror and its lock."""
    import hashlib

    return default_cache_dir() / "changes" / hashlib.sha256(spelled(store).encode()).hexdigest()[:16]


def goes_to(name: str) -> str:
    """Where the commit puts a file of the new version before it is committed: a new shard (or its
    .idx file) at its own name, as a kept version (versions/vN/, copies of the version before),
    anything else (whose name the current version uses) staged."""
    return name if is_shard_name(name) or is_idx_name(name) or KEPT.fullmatch(name) else f"{BUCKET_NEXT}/{name}"


@dataclass(frozen=True)
class Found:
    """The bucket's journal of a change, read and checked: the change, whether every file of its
    new version is up (committed), and the run that owns it."""

    journal: Journal
    uploaded: bool
    owner: str


@dataclass
class BucketChange:
    """The bucket side of a change of `store`'s output: its objects as the change found them, the
    run's own token (`owner`: which run a journal in the bucket is), and what prepares the mirror,
    fetches shards into it and commits into the bucket. `take_over` (--resume): a change another
    run began and did not commit is taken over (that run must be gone: a bucket has no lock)."""

    store: Store
    take_over: bool = False
    objects: dict[str, int | None] = field(default_factory=dict)
    owner: str = ""

    @property
    def url(self) -> str:
        return self.store.url

    @property
    def journal_url(self) -> str:
        return self.store.child(JOURNAL)

    def size_of(self, name: str) -> int | None:
        return self.objects.get(name)

    def clear(self, folder: Path) -> None:
        clear_mirror(folder)

    def kept_versions(self) -> list[int]:
        return kept_versions(self.store)

    def refuse_kept(self, version: int) -> None:
        """`--keep-versions` refused before anything is written where versions/vN holds objects."""
        if self.store.entries(kept_name(version)):
            where = self.store.child(kept_name(version))
            raise OutputError(f"{where}: is there already; move it away to keep version {version}")

    def pack_url(self, journal: Journal) -> str:
        """Where the append `journal` packs its new shards (`pack_name`)."""
        return self.store.child(pack_name(journal.request, journal.base))

    def finished_pack(self, folder: Path, journal: Journal) -> Manifest | None:
        """The manifest of the append's pack, finished in the bucket with every shard it lists there
        at its size, its index.parquet and errors.jsonl fetched into `folder` (the mirror's
        next/pack, where the append reads them); None where it has not finished so (the pack is
        resumed: a damaged manifest there, the pack's own, is deleted first)."""
        store = Store(self.pack_url(journal), self.store.options)
        objects = store.listing()
        try:
            staged = read_remote_manifest(store)
        except ManifestError:
            staged = None
        if staged is None or staged.checksum != staged.computed_checksum():
            if MANIFEST_NAME in objects:
                store.delete(MANIFEST_NAME)
            return None
        if any(objects.get(info.name) != info.bytes for info in [*staged.shards, *staged.companions]):
            return None
        folder.mkdir(parents=True, exist_ok=True)
        for name in (INDEX_NAME, ERRORS_NAME):
            (folder / name).unlink(missing_ok=True)
        try:
            if staged.index is not None:
                store.download(INDEX_NAME, str(folder / INDEX_NAME), staged.index.bytes, staged.index.sha256)
            if staged.totals.get("errors"):
                store.get(ERRORS_NAME, str(folder / ERRORS_NAME), MAX_ERRORS_BYTES)
        except FileNotFoundError:
            raise OutputError(f"{store.url}: the append's pack there lacks a file its manifest names") from None
        except ShardkitError as error:
            raise OutputError(f"{error}; `shardkit verify {store.url}` says more") from None
        return staged

    def prepare(self, folder: Path) -> None:
        """The mirror made to follow the bucket, under the mirror's lock, before the change reads
        it: a committed change in the bucket is taken up (its journal put in the mirror, so the
        change finishes it); this mirror's own uncommitted change goes on; another run's is
        refused, or with `take_over` undone and begun again from its plan (only its uploads undone,
        where the bucket is no longer at the version it began from: its plan is void); a mirror
        that no longer follows the bucket's version, or whose change the bucket holds the result
        of, is fetched again."""
        refuse_links(folder)
        try:
            remote = read_remote_manifest(self.store)
        except ManifestError as error:
            raise OutputError(str(error)) from None  # (names a merge under way there)
        found = self.journal()
        local = _local_journal(folder)
        mirrored = _checksum(folder / MANIFEST_NAME)
        mine = _read_owner(folder)
        if found is not None and found.uploaded:
            clear_mirror(folder)
            self._fetch_small(folder, remote, index=False)
            (state_dir(folder) / NEXT_DIR).mkdir(parents=True)
            with contextlib.suppress(FileNotFoundError):
                staged = str(state_dir(folder) / NEXT_DIR / MANIFEST_NAME)
                self.store.get(f"{BUCKET_NEXT}/{MANIFEST_NAME}", staged, MAX_JOURNAL_BYTES)
            write_json_atomic(state_dir(folder) / CHANGE_NAME, found.journal.to_json())
            self.owner = found.owner
        elif found is not None and found.owner == mine and local is not None and mirrored == remote.checksum:
            self.owner = mine  # this mirror's own change, killed: it goes on from here
        elif found is not None and not (self.take_over or found.owner == mine):
            action = found.journal.action
            raise OutputError(
                f"{self.store.url}: {'an' if action[:1] in 'aeiou' else 'a'} {action} of it began in another run "
                "(another machine, or another cache) "
                "and has not committed; if that run is gone, the same command with --resume takes it over"
            )
        elif found is not None:  # taken over: what it put up goes, and its plan is done again here
            self.undo(found.journal, remote)
            clear_mirror(folder)
            self._fetch_small(folder, remote, index=True)
            if found.journal.base == remote.checksum:  # (else its plan no longer applies: it is void)
                begun = replace(found.journal, moves=[], result="")
                write_json_atomic(state_dir(folder) / CHANGE_NAME, begun.to_json())
                self.owner = _new_owner(folder)
                self.begun(begun)
        elif local is None or mirrored != remote.checksum or local.get("result") == remote.checksum:
            # (a change the bucket holds the result of is done: only its mirror was left)
            clear_mirror(folder)
            self._fetch_small(folder, remote, index=True)
        if not self.owner:
            self.owner = mine if local is not None and mine else _new_owner(folder)
        kept = _local_journal(folder)
        if found is None and kept is not None:  # (killed before the bucket heard of it: it does now)
            self.begun(Journal.from_json(kept, state_dir(folder) / CHANGE_NAME))
        self.objects = self.store.listing()

    def begun(self, journal: Journal) -> None:
        """The change recorded in the bucket as soon as it is in the mirror's journal: a pack into
        the prefix, or a change from another run, is refused from here on."""
        self._refuse_another_owner(self.journal())
        self.store.write(JOURNAL, journal_bytes(journal.to_json(), uploaded=False, owner=self.owner))

    def journal(self) -> Found | None:
        """The bucket's journal of a change, checked as a local one is (None where there is none)."""
        where = self.store.child(JOURNAL)
        away = "delete it to abandon the change"
        try:
            text = self.store.read(JOURNAL, MAX_JOURNAL_BYTES)
        except FileNotFoundError:
            return None
        except ShardkitError:  # (access denied, the store unreachable: as they are, not the journal's fault)
            raise
        try:
            data = loads(text)
        except ValueError as error:
            raise OutputError(f"{where}: an unreadable journal of a change ({error}); {away}") from None
        if not isinstance(data, dict):
            raise OutputError(f"{where}: a damaged journal of a change (not an object); {away}")
        uploaded, owner = data.pop(UPLOADED, None), data.pop(OWNER, "")
        if type(uploaded) is not bool or type(owner) is not str:
            raise OutputError(f"{where}: a damaged journal of a change; {away}")
        journal = Journal.from_json(data, where, away)
        if uploaded and not journal.committing:
            raise OutputError(f"{where}: a damaged journal of a change; {away}")
        return Found(journal, uploaded, owner)

    def undo(self, journal: Journal, remote: Manifest) -> None:
        """What a change that did not commit put up, deleted: the new shards it names that the
        current version does not list, its staged files, then its journal. The earlier version
        was never touched. An append's pack stays while its plan holds (the bucket is at the
        version it began from): the append taken over resumes it, shard by shard."""
        listed = {s.name for s in remote.shards} | {c.name for c in remote.companions}
        for name in journal.moves:
            if KEPT.fullmatch(name):  # (its copies of the version it began from, and only those)
                ours = journal.version == remote.version + 1 and name == kept_name(remote.version)
                if ours and journal.base == remote.checksum:
                    self.store.delete_folder(name)
            elif goes_to(name) != name:
                self.store.delete(goes_to(name))
            elif name not in listed:
                self.store.delete(name)
        self.clear_packs(journal if journal.base == remote.checksum else None)
        self.store.delete(JOURNAL)

    def clear_packs(self, keep: Journal | None) -> None:
        """Every append's pack in the bucket deleted but `keep`'s (an append's own, while its plan
        holds): those of appends abandoned, or of this one once its shards are in place. Only a
        run whose journal the bucket holds (or one taking it over) calls this."""
        mine = None if keep is None or keep.action != "append" else pack_name(keep.request, keep.base)
        for name, folder in self.store.entries(BUCKET_NEXT):
            if folder and name.startswith(PACK_PREFIX) and f"{BUCKET_NEXT}/{name}" != mine:
                self.store.delete_folder(f"{BUCKET_NEXT}/{name}")

    def _refuse_another_owner(self, found: Found | None) -> None:
        """Another run's journal in the bucket (begun, or taken over, meanwhile) is left alone."""
        if found is not None and found.owner != self.owner:
            raise OutputError(f"{self.store.url}: another run began or took over a change of it meanwhile; leave it")

    def fetch(self, folder: Path, shards: list[ShardInfo]) -> None:
        """The shards a change reads, downloaded into the mirror and checked against the manifest
        (a damaged object is refused, naming it); those the mirror holds whole already stay."""
        for shard in shards:
            path = folder / shard.name
            if regular_size(path) == shard.bytes:
                continue
            if os.path.lexists(path):  # (written again as a file of its own: never through a link)
                os.unlink(path)
            try:
                self.store.download(shard.name, str(path), shard.bytes, shard.sha256)
            except ShardkitError as error:
                path.unlink(missing_ok=True)
                raise OutputError(f"{error}; `shardkit verify` says more") from None

    def holds(self, name: str) -> bool:
        return name in self.objects

    def commit(self, next_folder: Path, journal: dict[str, Any]) -> None:
        """Steps 1 to 4 of the module's commit: the new version's files up from `next_folder`
        (skipped where the bucket's journal says they are up), then put in place. Before the
        files go up, the bucket must still hold this run's journal (or none) and the version the
        change began from: another writer meanwhile is refused, not overwritten."""
        found = self.journal()
        if not (found is not None and found.uploaded and found.journal.result == journal["result"]):
            self._refuse_another_owner(found)
            remote = read_remote_manifest(self.store)
            if remote.checksum != journal["base"]:
                raise OutputError(f"{self.store.url}: its manifest changed while the change ran (another writer?)")
            self.store.write(JOURNAL, journal_bytes(journal, uploaded=False, owner=self.owner))
            for name in journal["moves"]:
                source = next_folder / name
                if KEPT.fullmatch(name):
                    self._keep_version(name, remote)
                    continue
                if _packed_in_bucket(journal, name, source):
                    self._copy_packed(name, pack_name(journal["request"], journal["base"]))
                    continue
                try:
                    regular = stat.S_ISREG(os.lstat(source).st_mode)
                except OSError:
                    regular = False
                if not regular:
                    raise OutputError(
                        f"{source}: not a file shardkit wrote; delete {next_folder.parent.parent} and run the same "
                        "command with --resume (it is done again from its plan)"
                    )
                self.store.upload(str(source), goes_to(name))
            found = self.journal()
            if found is None:
                raise OutputError(f"{self.store.url}: its journal was deleted while the change ran (another writer?)")
            self._refuse_another_owner(found)
            self.store.write(JOURNAL, journal_bytes(journal, uploaded=True, owner=self.owner))
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
        self.clear_packs(None)  # (an append's shards are in place: its pack goes, and any left behind)
        self.store.delete(JOURNAL)

    def _keep_version(self, name: str, remote: Manifest) -> None:
        """`--keep-versions`: the version the change starts from copied whole into `name`
        (versions/vN/), server-side, several requests at once, its manifest last (a prefix with a
        manifest is a whole output). A bucket has no hard links: the copies are its bytes again,
        in the store, not through this machine."""
        from concurrent.futures import ThreadPoolExecutor

        files = [s.name for s in remote.shards] + [c.name for c in remote.companions]
        files += [INDEX_NAME] * (remote.index is not None) + [ERRORS_NAME] * (ERRORS_NAME in self.objects)
        with ThreadPoolExecutor(max_workers=COPIES_AT_ONCE) as pool:
            list(pool.map(lambda file: self.store.copy(file, f"{name}/{file}"), files))
        self.store.copy(MANIFEST_NAME, f"{name}/{MANIFEST_NAME}")

    def _copy_packed(self, name: str, pack: str) -> None:
        """A new shard (or its .idx file) of an append copied from its pack to its own name."""
        try:
            self.store.copy(f"{pack}/{name}", name)
        except FileNotFoundError:
            raise OutputError(
                f"{self.store.child(f'{pack}/{name}')}: missing, and the append's commit copies it; "
                f"delete {self.store.child(JOURNAL)} and {self.store.child(pack)}/, then run the append again"
            ) from None

    def _fetch_small(self, folder: Path, remote: Manifest, *, index: bool) -> None:
        """The manifest (as read: its bytes are the bucket's), and with `index`, index.parquet and
        errors.jsonl, into the mirror."""
        self.store.get(MANIFEST_NAME, str(folder / MANIFEST_NAME), MAX_JOURNAL_BYTES)
        if _checksum(folder / MANIFEST_NAME) != remote.checksum:  # (another writer, between two reads)
            raise OutputError(f"{self.store.child(MANIFEST_NAME)}: changed while the change read it; try again")
        if not index:
            return
        if remote.index is not None:
            try:
                self.store.download(INDEX_NAME, str(folder / INDEX_NAME), remote.index.bytes, remote.index.sha256)
            except ShardkitError as error:
                raise OutputError(f"{error}; `shardkit verify` says more") from None
        try:
            self.store.get(ERRORS_NAME, str(folder / ERRORS_NAME), MAX_ERRORS_BYTES)
        except FileNotFoundError:
            if remote.totals.get("errors"):
                raise OutputError(
                    f"{self.store.child(ERRORS_NAME)}: missing, and its manifest counts {remote.totals['errors']:,} "
                    "rows (`shardkit verify` says more)"
                ) from None


def pack_name(request: str, base: str) -> str:
    """Where an append packs in the bucket: a prefix of its own under .shardkit/next/, named by what
    was asked and the version it began from, so that no append takes up the pack of another (one
    abandoned, or one still running elsewhere)."""
    import hashlib

    return f"{BUCKET_NEXT}/{PACK_PREFIX}{hashlib.sha256(f'{request}:{base}'.encode()).hexdigest()[:16]}"


def _packed_in_bucket(journal: dict[str, Any], name: str, source: Path) -> bool:
    """Whether the commit takes `name` from the append's pack in the bucket: a new shard or .idx
    file of an append that next/ does not hold (one begun before appends packed into the bucket
    has it there, and uploads it)."""
    return journal.get("action") == "append" and goes_to(name) == name and not os.path.lexists(source)


def refuse_links(folder: Path) -> None:
    """A link planted in the mirror (or as its working folder) is refused: the change writes there."""
    for path in (folder, state_dir(folder), state_dir(folder) / NEXT_DIR):
        if os.path.islink(path):
            raise OutputError(f"{path}: a link where shardkit keeps the mirror of a bucket; delete it")


def journal_bytes(journal: dict[str, Any], *, uploaded: bool, owner: str) -> bytes:
    return json.dumps({**journal, UPLOADED: uploaded, OWNER: owner}).encode()


def _read_owner(folder: Path) -> str:
    """The token kept in the mirror ("" where there is none, or a link or folder is there)."""
    path = state_dir(folder) / OWNER_NAME
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return ""
        return path.read_text(errors="replace").strip()[:64]
    except OSError:
        return ""


def _new_owner(folder: Path) -> str:
    """A token for this run's change, kept in the mirror (a run that goes on from it is the same);
    whatever was there goes first (written as a file of its own: never through a link)."""
    owner = secrets.token_hex(16)
    path = state_dir(folder) / OWNER_NAME
    state_dir(folder).mkdir(parents=True, exist_ok=True)
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.unlink(path)
    write_text_atomic(path, owner)
    return owner


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
    if os.path.islink(state / NEXT_DIR):
        os.unlink(state / NEXT_DIR)
    shutil.rmtree(state / NEXT_DIR, ignore_errors=True)
    (state / CHANGE_NAME).unlink(missing_ok=True)
    (state / OWNER_NAME).unlink(missing_ok=True)
    remove_state(folder, keep_lock=True)


@contextlib.contextmanager
def changing_bucket(
    output: str | os.PathLike[str], storage_options: dict[str, Any] | None, take_over: bool
) -> Iterator[Changing]:
    """The output at the URL `output` locked for a change in its mirror (this module's), the mirror
    made to follow the bucket first; with `take_over` (--resume), a change another run began and
    did not commit is taken over. An output read over HTTP takes no writes: refused."""
    from ..core.errors import describe
    from ..storage.location import locate

    store = locate(output, storage_options)
    assert not isinstance(store, Path)
    if store.protocol in ("http", "https"):
        raise ConfigError(f"{store.url}: an output read over HTTP takes no writes; change it where it is stored")
    above, _, name = spelled(store).rpartition("/")
    if above.endswith(f"/{VERSIONS_DIR}") and KEPT.fullmatch(f"{VERSIONS_DIR}/{name}"):
        outer = Store(above.removesuffix(f"/{VERSIONS_DIR}"), store.options)
        if MANIFEST_NAME in outer.listing():
            raise OutputError(
                f"{store.url}: a version kept by --keep-versions: read it, or delete it; change the output itself"
            )
    mirror = mirror_folder(store)
    try:
        mirror.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise OutputError(f"{mirror}: cannot make the mirror of {store.url} here ({describe(error)})") from None
    bucket = BucketChange(store, take_over)
    with changing_in(mirror, bucket.prepare) as changed:
        changed.bucket = bucket
        yield changed
    with contextlib.suppress(OSError):
        mirror.rmdir()  # (emptied by its commit; else kept for the change's --resume)
