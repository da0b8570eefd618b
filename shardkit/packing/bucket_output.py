"""A bucket prefix as a pack's output (s3://, gs://, any fsspec URL that writes): the bucket claimed
before any work, each shard uploaded by the worker that wrote it (upload.py), and at the end, from
the driver's small staging state, errors.jsonl, index.parquet and manifest.json last, so a reader
never finds a manifest that names an object not yet there. No local copy of the output is ever
needed: the driver's staging folder (the pack's local folder, claimed by the folder rules) holds
the done markers and index parts, and the shards its local workers are writing.

The bucket is checked before any work, as a local output folder is: refused when it holds a
finished output (unless --resume or --overwrite), objects shardkit did not write, or when it cannot
be written. Each shard gets a marker (`.shardkit/uploaded/<shard>.json`: bytes, sha256, whether
the upload finished) before its upload begins and again when it ends, until the manifest is up:
every object shardkit may have written is named by a marker, and a resumed pack keeps only the shards the
bucket holds with the same bytes and a finished upload. --overwrite removes the earlier manifest
before the first shard goes up (no reader trusts it while the new shards go up), then deletes only
the objects the earlier manifest named that the new one lacks.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from ..core.config import PackConfig
from ..core.errors import OutputError, ShardkitError, StorageError, StoreUnreachable, describe
from ..core.manifest import (
    ERRORS_NAME,
    INDEX_NAME,
    MANIFEST_NAME,
    STATE_DIR,
    VERSIONS_DIR,
    Manifest,
    idx_name,
    write_json_atomic,
)
from ..core.safeio import loads
from ..formats import get_format, idx_files, output_file_names
from ..storage.cache import default_cache_dir
from ..storage.store import Store, read_remote_manifest
from ..storage.urls import is_remote
from .index import part_path, write_part_bytes
from .upload import MARKERS, BucketShards, Uploaded
from .working_folder import CHANGE_NAME, done_path, remove_state, state_dir, writing

if TYPE_CHECKING:
    from .finish import PackResult
    from .shard_writing import ShardResult

CHANGE_JOURNAL = f"{STATE_DIR}/{CHANGE_NAME}"  # a change's journal in the bucket (changes/bucket.py)
EARLIER = ".shardkit/earlier.json"  # the earlier output's shards, written before its manifest goes
_PROBE = ".shardkit/probe"


@dataclass
class BucketContents:
    """What a bucket prefix contained when the pack claimed it."""

    store: Store
    manifest: Manifest | None = None
    uploaded: dict[str, tuple[int, str]] = field(default_factory=dict)  # shard -> (bytes, sha256), finished uploads
    begun: set[str] = field(default_factory=set)  # every shard with a marker, finished or not
    objects: dict[str, int | None] = field(default_factory=dict)  # object name -> size


class BucketOutput:
    """A bucket prefix as a pack's output (output.Output): the pack's local folder is a staging
    folder, the workers upload each shard as it is written (upload.BucketShards), and `publish`
    sends the files beside the whole output and the manifest last."""

    shards_here = False  # (they are in the bucket; staging holds only the state)

    def __init__(self, store: Store, staging: Path, scratch: str | None) -> None:
        self.store = store
        self.url = store.url
        self.folder = staging
        self.scratch = scratch  # where a local worker writes a shard to upload (None: its node's own)
        self.contents = BucketContents(store)

    def open(self, config: PackConfig) -> Manifest | None:
        """The bucket claimed (`claim_bucket`); with --resume, a finished output it holds (one with
        rows that failed transiently too: it is resumed only with the inputs it was made from)."""
        get_format(config.format)
        self.contents = claim_bucket(self.store, resume=config.resume, overwrite=config.overwrite)
        manifest = self.contents.manifest
        return manifest if config.resume else None

    def complete(self, manifest: Manifest) -> bool:
        """Whether every shard is listed with its size (its bytes are trusted here; `shardkit
        verify URL` checks them)."""
        return all(self.contents.objects.get(shard.name) == shard.bytes for shard in manifest.shards)

    def local_config(self, config: PackConfig) -> PackConfig:
        """The pack into the staging folder: resumed only where staging holds a run's state (what a
        run stopped before its end leaves); anything else there (the files of a run stopped as it
        cleared them) is staging's own, replaced. The storage options are the source's only."""
        staging = self.folder
        resume = config.resume and state_dir(staging).exists()
        occupied = staging.is_dir() and any(staging.iterdir())
        try:
            staging.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise OutputError(f"{staging}: cannot stage the shards here ({describe(error)})") from None
        return replace(
            config, output=str(staging), resume=resume, overwrite=occupied and not resume, staging=None,
            storage_options=config.storage_options if is_remote(config.source) else None,
        )  # fmt: skip

    def begin(self) -> None:
        retire_earlier(self.contents)  # before the first shard goes up

    def destination(self, name: str) -> BucketShards:
        return BucketShards(self.store, self.scratch, finished_upload(self.contents, name))

    def intact(self, result: ShardResult) -> bool:
        """Whether a shard an earlier run finished (its done marker in staging) may be kept: the
        bucket holds it (and its .idx file) with the bytes and sha256 of its done marker, recorded as a
        finished upload, and its index part is in the staging state."""
        uploaded = finished_upload(self.contents, result.shard.name)
        companion = None if result.companion is None else result.companion.bytes
        return (
            uploaded is not None
            and (uploaded.bytes, uploaded.sha256, uploaded.idx_bytes)
            == (result.shard.bytes, result.shard.sha256, companion)
            and part_path(state_dir(self.folder), result.shard.name).is_file()
        )

    def mark_done(self, result: ShardResult) -> None:
        """The part of index.parquet and the done marker of a shard a worker uploaded, written into
        the staging state (the part first: the marker vouches for it); the part's bytes are then
        dropped from the result, so the driver holds no index in memory."""
        name = result.shard.name
        with writing(self.folder, name):
            write_part_bytes(part_path(state_dir(self.folder), name), result.index_part or b"")
            write_json_atomic(done_path(self.folder, name), result.marker())
        result.index_part = None

    def publish(self, manifest: Manifest) -> None:
        publish(self.folder, self.contents, manifest)
        if not manifest.totals.get("transient"):  # else its state stays, for a --resume
            clear_staging(self.folder, manifest)

    def report(self, result: PackResult) -> PackResult:
        """The result names the bucket, not its staging folder."""
        return replace(result, output=self.url, already_complete=False)


def claim_bucket(store: Store, *, resume: bool, overwrite: bool) -> BucketContents:
    """Checks the remote output before any work (nothing is deleted here): what it holds must be
    shardkit's, a finished output needs --resume or --overwrite, and it must take a write."""
    refuse_unfinished_change(store)
    objects = store.listing()
    contents = BucketContents(store, objects=objects)
    if MANIFEST_NAME in objects:
        try:
            contents.manifest = read_remote_manifest(store)
        except StoreUnreachable:
            raise  # (the store is down, not the manifest damaged: --overwrite would be the wrong advice)
        except ShardkitError as error:
            if not overwrite:
                raise OutputError(f"{error}; use --overwrite to replace it") from None
    contents.uploaded, contents.begun = _markers(store)
    ours = {MANIFEST_NAME, ERRORS_NAME, INDEX_NAME, *output_file_names()} | contents.begun
    if contents.manifest is not None:
        ours |= {shard.name for shard in contents.manifest.shards} | {c.name for c in contents.manifest.companions}
    ours |= idx_files(ours)  # and each shard's .idx file
    foreign = sorted(name for name in objects if name not in ours)
    if foreign and MANIFEST_NAME in objects and contents.manifest is None:
        raise OutputError(
            f"{store.child(MANIFEST_NAME)}: damaged, so shardkit cannot tell its objects from others "
            f"(such as {foreign[0]}); remove them yourself, or pack into an empty prefix"
        )
    if foreign:
        raise OutputError(
            f"{store.child(foreign[0])}: not written by shardkit; pack into an empty prefix "
            "(nothing there is deleted or overwritten)"
        )
    if contents.manifest is not None and not (resume or overwrite):
        raise OutputError(f"{store.url}: holds a finished shardkit output; use --resume or --overwrite")
    if contents.manifest is not None and overwrite and store.holds(VERSIONS_DIR):
        raise OutputError(
            f"{store.url}: keeps earlier versions ({VERSIONS_DIR}/, --keep-versions); move them away to pack here again"
        )
    if contents.begun and contents.manifest is None and not (resume or overwrite):
        raise OutputError(f"{store.url}: holds an interrupted pack; use --resume to finish it or --overwrite")
    try:
        store.write(_PROBE, b"shardkit checks this output takes writes\n")
        store.delete(_PROBE)
    except StoreUnreachable:
        raise
    except ShardkitError as error:
        raise OutputError(f"{store.url}: cannot write here ({error})") from None
    except OSError as error:
        raise OutputError(f"{store.child(_PROBE)}: cannot write here ({error})") from None
    return contents


def refuse_unfinished_change(store: Store) -> None:
    """A prefix where a change (remove, compact, append) is unfinished takes no pack: its journal's
    presence is enough (what it says is changes/bucket.py's to read)."""
    try:
        store.read(CHANGE_JOURNAL, 64 << 20)
    except FileNotFoundError:
        return
    except StoreUnreachable:
        raise
    except StorageError:
        pass  # (one over the limit is there all the same)
    raise OutputError(
        f"{store.url}: a change of it is unfinished ({store.child(CHANGE_JOURNAL)}); finish it first (`shardkit "
        "verify` says how)"
    )


def _markers(store: Store) -> tuple[dict[str, tuple[int, str]], set[str]]:
    """(shards whose upload finished -> (bytes, sha256), every shard with a marker). The shards of
    an earlier output whose manifest an interrupted overwrite or resume removed count as finished."""
    marks = Store(store.child(MARKERS), store.options)
    finished: dict[str, tuple[int, str]] = {}
    begun: set[str] = set()
    with contextlib.suppress(FileNotFoundError, ValueError, TypeError, KeyError):
        earlier = loads(store.read(EARLIER, 64 << 20))
        for name, (size, sha256) in earlier["shards"].items():
            if isinstance(name, str) and "/" not in name:
                finished[name] = (int(size), str(sha256))
                begun.add(name)
    for name in marks.listing():
        if not name.endswith(".json"):
            continue
        shard = name.removesuffix(".json")
        begun.add(shard)
        finished.pop(shard, None)  # a marker is newer than the earlier output: it decides
        try:
            data = loads(marks.read(name, 1 << 16))
            if data["uploaded"] is True:
                finished[shard] = (int(data["bytes"]), str(data["sha256"]))
        except (ValueError, KeyError, TypeError, FileNotFoundError):
            continue  # a damaged marker: that shard is uploaded again
    return finished, begun


def staging_folder(url: str, staging: str | os.PathLike[str] | None) -> Path:
    """Where the driver of a pack to `url` keeps its state (and its local workers write shards
    before they are uploaded)."""
    if staging is not None:
        return Path(staging)
    return default_cache_dir() / "staging" / hashlib.sha256(url.encode()).hexdigest()[:16]


def finished_upload(contents: BucketContents, name: str) -> Uploaded | None:
    """What the bucket contained under the shard `name` when the pack began, where its records say the
    upload finished (a marker, an earlier manifest, earlier.json) and the object has the recorded size."""
    record = contents.uploaded.get(name)
    if contents.manifest is not None and record is None:
        record = next(((s.bytes, s.sha256) for s in contents.manifest.shards if s.name == name), None)
    if record is None or contents.objects.get(name) != record[0]:
        return None
    return Uploaded(record[0], record[1], contents.objects.get(idx_name(name)))


def retire_earlier(contents: BucketContents) -> None:
    """Before the first shard goes up over a finished output (--overwrite, or --resume of one whose
    objects are not all there): its shards are listed in earlier.json (a run killed from
    here on can finish or replace them), then its manifest is removed, so no reader trusts it while
    its shards change."""
    if contents.manifest is None:
        return
    earlier_shards = {shard.name: [shard.bytes, shard.sha256] for shard in contents.manifest.shards}
    earlier_shards.update((name, list(entry)) for name, entry in contents.uploaded.items())
    contents.store.write(EARLIER, json.dumps({"shards": earlier_shards}).encode())
    contents.store.delete(MANIFEST_NAME)


def publish(staging: Path, contents: BucketContents, manifest: Manifest) -> None:
    """The end of a pack to a bucket whose shards the workers uploaded (upload.py): the files
    beside the whole output, errors.jsonl and index.parquet from `staging`, the manifest last; then
    the objects of an earlier output the new one does not name, and the markers."""
    store = contents.store
    names = {shard.name for shard in manifest.shards}
    for companion in manifest.companions:
        if companion.name not in names and companion.name not in idx_files(names):  # a shard's own went with it
            store.upload(str(staging / companion.name), companion.name)
    for name in (ERRORS_NAME, INDEX_NAME):
        if (staging / name).exists():
            store.upload(str(staging / name), name)
    store.upload(str(staging / MANIFEST_NAME), MANIFEST_NAME)
    current = names | {c.name for c in manifest.companions}
    earlier = {shard.name for shard in contents.manifest.shards} if contents.manifest is not None else set()
    earlier |= {c.name for c in contents.manifest.companions} if contents.manifest is not None else set()
    stale = (earlier | contents.begun) - current
    stale |= idx_files(stale) - current  # their .idx files
    stale |= output_file_names() - current
    for name in sorted(stale):
        store.delete(name)  # named by shardkit's own earlier records only
    for name in sorted(contents.begun | names):
        store.delete(f"{MARKERS}/{name}.json")
    store.delete(EARLIER)


def clear_staging(staging: Path, manifest: Manifest) -> None:
    """Removes what a pack to a bucket left in its staging folder once the manifest is up: the
    files it uploaded, its state (done markers, index parts, the lock), then the folder if empty."""
    for name in [c.name for c in manifest.companions] + [ERRORS_NAME, INDEX_NAME, MANIFEST_NAME]:
        with contextlib.suppress(FileNotFoundError):
            (staging / name).unlink()
    remove_state(staging)
    with contextlib.suppress(OSError):
        staging.rmdir()
