"""A pack whose output is a URL: the bucket claimed before any work, each shard uploaded by the
worker that wrote it (packing/upload.py), and at the end, from the driver's small staging state,
errors.jsonl, index.parquet and manifest.json last, so a reader never finds a manifest that names
an object not yet there. No local copy of the output is ever needed: the driver's staging folder
holds done markers and index parts, and the shards being written by its local workers.

The bucket is checked before any work, as a local output folder is: refused when it holds a
finished output (unless --resume or --overwrite), objects shardkit did not write, or when it cannot
be written. Each shard gets a marker (`.shardkit/uploaded/<shard>.json`: bytes, sha256, whether
the upload finished) before its upload begins and again when it ends, until the manifest is up:
every object shardkit may have written is on record, and a resumed pack keeps only the shards the
bucket holds with the same bytes and a finished upload. --overwrite removes the earlier manifest
before the first shard goes up (no reader trusts it while the new shards go up), then deletes only
the objects the earlier manifest named that the new one lacks.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..core.errors import OutputError, ShardkitError
from ..core.manifest import ERRORS_NAME, INDEX_NAME, MANIFEST_NAME, Manifest, idx_name
from ..core.safeio import loads
from ..formats import idx_files, output_file_names
from ..storage.cache import default_cache_dir
from ..storage.store import Store, read_remote_manifest
from .index import part_path
from .output import remove_state, state_dir
from .upload import MARKERS, Held
from .worker import ShardResult

EARLIER = ".shardkit/earlier.json"  # the earlier output's shards, written before its manifest goes
_PROBE = ".shardkit/probe"


@dataclass
class RemoteOutput:
    """What a bucket prefix held when the pack claimed it."""

    store: Store
    manifest: Manifest | None = None
    uploaded: dict[str, tuple[int, str]] = field(default_factory=dict)  # shard -> (bytes, sha256), finished uploads
    begun: set[str] = field(default_factory=set)  # every shard with a marker, finished or not
    held: dict[str, int | None] = field(default_factory=dict)  # object name -> size


def claim_remote(store: Store, *, resume: bool, overwrite: bool) -> RemoteOutput:
    """Checks the remote output before any work (nothing is deleted here): what it holds must be
    shardkit's, a finished output needs --resume or --overwrite, and it must take a write."""
    held = store.listing()
    state = RemoteOutput(store, held=held)
    if MANIFEST_NAME in held:
        try:
            state.manifest = read_remote_manifest(store)
        except ShardkitError as error:
            if not overwrite:
                raise OutputError(f"{error}; use --overwrite to replace it") from None
    state.uploaded, state.begun = _markers(store)
    ours = {MANIFEST_NAME, ERRORS_NAME, INDEX_NAME, *output_file_names()} | state.begun
    if state.manifest is not None:
        ours |= {shard.name for shard in state.manifest.shards} | {c.name for c in state.manifest.companions}
    ours |= idx_files(ours)  # and each shard's .idx file
    foreign = sorted(name for name in held if name not in ours)
    if foreign and MANIFEST_NAME in held and state.manifest is None:
        raise OutputError(
            f"{store.child(MANIFEST_NAME)}: damaged, so shardkit cannot tell its objects from others "
            f"(such as {foreign[0]}); remove them yourself, or pack into an empty prefix"
        )
    if foreign:
        raise OutputError(
            f"{store.child(foreign[0])}: not written by shardkit; pack into an empty prefix "
            "(nothing there is deleted or overwritten)"
        )
    if state.manifest is not None and not (resume or overwrite):
        raise OutputError(f"{store.url}: holds a finished shardkit output; use --resume or --overwrite")
    if state.begun and state.manifest is None and not (resume or overwrite):
        raise OutputError(f"{store.url}: holds an interrupted pack; use --resume to finish it or --overwrite")
    try:
        store.write(_PROBE, b"shardkit checks this output takes writes\n")
        store.delete(_PROBE)
    except ShardkitError as error:
        raise OutputError(f"{store.url}: cannot write here ({error})") from None
    except OSError as error:
        raise OutputError(f"{store.child(_PROBE)}: cannot write here ({error})") from None
    return state


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
    """Where the shards of a pack to `url` are written before they are uploaded."""
    if staging is not None:
        return Path(staging)
    return default_cache_dir() / "staging" / hashlib.sha256(url.encode()).hexdigest()[:16]


def held_shard(remote: RemoteOutput, name: str) -> Held | None:
    """What the bucket held under the shard `name` when the pack began, where it is on record as
    finished (a marker, an earlier manifest, earlier.json) and the object has the recorded size."""
    record = remote.uploaded.get(name)
    if remote.manifest is not None and record is None:
        record = next(((s.bytes, s.sha256) for s in remote.manifest.shards if s.name == name), None)
    if record is None or remote.held.get(name) != record[0]:
        return None
    return Held(record[0], record[1], remote.held.get(idx_name(name)))


def upload_fields(remote: RemoteOutput, name: str, scratch: str | None) -> dict[str, Any]:
    """A shard job's fields for a pack to a bucket (worker.ShardJob: remote, scratch, held)."""
    return {"remote": remote.store, "scratch": scratch, "held": held_shard(remote, name)}


def in_bucket(remote: RemoteOutput, staging: Path) -> Callable[[ShardResult], bool]:
    """Whether a shard an earlier run finished (its done marker in `staging`) may be kept: the bucket
    holds it (and its .idx file) with the bytes and sha256 of its marker, on record as a finished
    upload, and its index part is in the staging state."""

    def intact(result: ShardResult) -> bool:
        held = held_shard(remote, result.shard.name)
        companion = None if result.companion is None else result.companion.bytes
        return (
            held is not None
            and (held.bytes, held.sha256, held.idx_bytes) == (result.shard.bytes, result.shard.sha256, companion)
            and part_path(state_dir(staging), result.shard.name).is_file()
        )

    return intact


def retire_earlier(remote: RemoteOutput) -> None:
    """Before the first shard goes up over a finished output (--overwrite, or --resume of one whose
    objects are not all there): its shards are put on record in earlier.json (a run killed from
    here on can finish or replace them), then its manifest is removed, so no reader trusts it while
    its shards change."""
    if remote.manifest is None:
        return
    on_record = {shard.name: [shard.bytes, shard.sha256] for shard in remote.manifest.shards}
    on_record.update((name, list(entry)) for name, entry in remote.uploaded.items())
    remote.store.write(EARLIER, json.dumps({"shards": on_record}).encode())
    remote.store.delete(MANIFEST_NAME)


def publish(staging: Path, remote: RemoteOutput, manifest: Manifest) -> None:
    """The end of a pack to a bucket whose shards the workers uploaded (packing/upload.py): the
    files beside the whole output, errors.jsonl and index.parquet from `staging`, the manifest
    last; then the objects of an earlier output the new one does not name, and the markers."""
    store = remote.store
    names = {shard.name for shard in manifest.shards}
    for companion in manifest.companions:
        if companion.name not in names and companion.name not in idx_files(names):  # a shard's own went with it
            store.upload(str(staging / companion.name), companion.name)
    for name in (ERRORS_NAME, INDEX_NAME):
        if (staging / name).exists():
            store.upload(str(staging / name), name)
    store.upload(str(staging / MANIFEST_NAME), MANIFEST_NAME)
    current = names | {c.name for c in manifest.companions}
    earlier = {shard.name for shard in remote.manifest.shards} if remote.manifest is not None else set()
    earlier |= {c.name for c in remote.manifest.companions} if remote.manifest is not None else set()
    stale = (earlier | remote.begun) - current
    stale |= idx_files(stale) - current  # their .idx files
    stale |= output_file_names() - current
    for name in sorted(stale):
        store.delete(name)  # named by shardkit's own earlier records only
    for name in sorted(remote.begun | names):
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
