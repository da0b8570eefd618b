"""A pack whose output is a URL: shards are written to a local staging folder by the ordinary pack,
then uploaded, errors.jsonl next and manifest.json last, so a reader never finds a manifest that
names an object not yet there.

The bucket is checked before any work, as a local output folder is: refused when it holds a
finished output (unless --resume or --overwrite), objects shardkit did not write, or when it cannot
be written. Each shard gets a marker (`.shardkit/uploaded/<shard>.json`: bytes, sha256, whether
the upload finished) before its upload begins and again when it ends, until the manifest is up:
every object shardkit may have written is on record, and a resumed pack uploads only the shards
the bucket holds with the same bytes and a finished upload. --overwrite removes the earlier
manifest first (no reader trusts it while the new shards go up), then deletes only the objects the
earlier manifest named that the new one lacks.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..core.errors import OutputError, ShardkitError
from ..core.manifest import ERRORS_NAME, INDEX_NAME, MANIFEST_NAME, Manifest, read_manifest
from ..core.safeio import loads
from ..formats import idx_files, output_file_names
from ..storage.cache import default_cache_dir
from ..storage.store import Store, read_remote_manifest

MARKERS = ".shardkit/uploaded"
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


def _mark(store: Store, name: str, size: int, sha256: str, uploaded: bool) -> None:
    record = {"bytes": size, "sha256": sha256, "uploaded": uploaded}
    store.write(f"{MARKERS}/{name}.json", json.dumps(record).encode())


def staging_folder(url: str, staging: str | os.PathLike[str] | None) -> Path:
    """Where the shards of a pack to `url` are written before they are uploaded."""
    if staging is not None:
        return Path(staging)
    return default_cache_dir() / "staging" / hashlib.sha256(url.encode()).hexdigest()[:16]


def publish(
    staging: Path, remote: RemoteOutput, progress: Callable[[int, int], None] | None = None
) -> tuple[Manifest, int]:
    """Uploads a finished local output in `staging` to `remote`: shards the bucket does not hold
    with the same bytes, then errors.jsonl, then the manifest. Returns the manifest and the number of
    shards the bucket already held."""
    store = remote.store
    manifest = read_manifest(staging)
    have = dict(remote.uploaded)
    if remote.manifest is not None:
        have.update({shard.name: (shard.bytes, shard.sha256) for shard in remote.manifest.shards})
    if remote.manifest is not None:
        # the earlier shards stay on record (a run killed from here on can finish or replace them),
        # then readers stop trusting the earlier output before any shard changes
        on_record = {shard.name: [shard.bytes, shard.sha256] for shard in remote.manifest.shards}
        on_record.update((name, list(entry)) for name, entry in remote.uploaded.items())
        store.write(EARLIER, json.dumps({"shards": on_record}).encode())
        store.delete(MANIFEST_NAME)
    kept = 0
    for done, shard in enumerate(manifest.shards, 1):
        if have.get(shard.name) == (shard.bytes, shard.sha256) and remote.held.get(shard.name) == shard.bytes:
            kept += 1
        else:
            _mark(store, shard.name, shard.bytes, shard.sha256, uploaded=False)  # on record before it exists
            store.upload(str(staging / shard.name), shard.name)
            _mark(store, shard.name, shard.bytes, shard.sha256, uploaded=True)
        if progress is not None:
            progress(done, len(manifest.shards))
    earlier_companions = {c.name: c for c in remote.manifest.companions} if remote.manifest is not None else {}
    for companion in manifest.companions:  # small: uploaded unless the bucket holds the same bytes
        if earlier_companions.get(companion.name) != companion or remote.held.get(companion.name) != companion.bytes:
            store.upload(str(staging / companion.name), companion.name)
    for name in (ERRORS_NAME, INDEX_NAME):
        if (staging / name).exists():
            store.upload(str(staging / name), name)
    store.upload(str(staging / MANIFEST_NAME), MANIFEST_NAME)
    current = {shard.name for shard in manifest.shards} | {c.name for c in manifest.companions}
    earlier = {shard.name for shard in remote.manifest.shards} if remote.manifest is not None else set()
    earlier |= set(earlier_companions)
    stale = (earlier | remote.begun) - current
    stale |= idx_files(stale) - current  # their .idx files
    stale |= output_file_names() - current
    for name in sorted(stale):
        store.delete(name)  # named by shardkit's own earlier records only
    for name in sorted(remote.begun | current):
        store.delete(f"{MARKERS}/{name}.json")
    store.delete(EARLIER)
    return manifest, kept


def clear_staging(staging: Path, manifest: Manifest) -> None:
    """Removes the uploaded local copy: only what the manifest names, then the folder if empty."""
    for name in (
        [s.name for s in manifest.shards]
        + [c.name for c in manifest.companions]
        + [ERRORS_NAME, INDEX_NAME, MANIFEST_NAME]
    ):
        with contextlib.suppress(FileNotFoundError):
            (staging / name).unlink()
    with contextlib.suppress(OSError):
        staging.rmdir()
