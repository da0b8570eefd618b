"""`shardkit merge s3://b/a s3://b/b s3://b/ab`: outputs in buckets merged into a new prefix of the
same store, each shard copied server-side (none passes through this machine but those a key prefix
or new labels write again, downloaded and checked against their manifest's sha256), and a local
output's (`shardkit merge local/ s3://b/b s3://b/ab`) uploaded.

The merge is made as a local one is (merged.write_merged), in a folder of the cache: each
source's manifest, index.parquet and errors.jsonl downloaded into a view of it, the merged output's
small files written in `next/`, its shards planned as copies. Then the bucket (the prefix must be
empty, or hold this merge unfinished):

0. the prefix is claimed before any work: the journal (`.shardkit/change.json`) goes up with a
   token of the run, and from here each step first checks the journal is still the run's (a bucket
   has no lock: another merge begun meanwhile is refused, not mixed in);
1. the journal goes up again naming every file the merge puts there;
2. the shards are copied from their sources (or uploaded, where written again), then the files
   with fixed names but the manifest; the manifest goes to `.shardkit/next/`;
3. once every object is there with its size, the journal goes up with `uploaded: true`;
4. the staged manifest is copied into place, then it and the journal are deleted.

Until the manifest is in place the prefix is no output (a reader, verify and pack say so; a pack
into it is refused while the journal is there). A kill before step 3 is undone by the same merge
run again (from any machine: every copy and upload is made again, to the same bytes); after it,
any merge into the prefix finishes step 4 from the bucket alone, whatever became of the sources
(one of other outputs then says so and is refused).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Sequence
from contextlib import suppress
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..core.errors import ConfigError, ManifestError, OutputError, ShardkitError, describe
from ..core.manifest import ERRORS_NAME, IDX_SUFFIX, INDEX_NAME, MANIFEST_NAME, Manifest, ShardInfo, idx_name
from ..packing.bucket_output import CHANGE_JOURNAL as JOURNAL
from ..packing.working_folder import NEXT_DIR, is_shard_name, state_dir
from ..storage.store import Store, read_remote_manifest
from .bucket import (
    BUCKET_NEXT,
    MAX_ERRORS_BYTES,
    MAX_JOURNAL_BYTES,
    BucketChange,
    clear_mirror,
    journal_bytes,
    mirror_folder,
    refuse_links,
)
from .journal import Journal, locked
from .merged import (
    MergeResult,
    Source,
    asked_for,
    check_rewrites,
    checked_source,
    local_source,
    located,
    made_by,
    planned,
    refuse_named_twice,
    result_of,
    source_name,
    write_merged,
)


@dataclass(frozen=True)
class Copy:
    """A shard (or .idx file) of a source, to be copied server-side to its name in the output (or
    uploaded, from a local output folder)."""

    origin: Store | Path
    name: str
    to: str
    size: int


def merge_in_bucket(
    sources: Sequence[str],
    output: str,
    *,
    storage_options: dict[str, Any] | None,
    prefix_keys: bool,
    relabel: bool,
    progress: Callable[[int, int], None] | None,
) -> MergeResult:
    """Merge the outputs at the URLs `sources` into the new prefix `output` of the same store (see
    the module); the same merge run again finishes one that was interrupted."""
    started = time.perf_counter()
    stores, out = _checked_stores(sources, output, storage_options)
    mirror = mirror_folder(out)
    work = mirror.with_name(mirror.name + "-merge")  # (beside the prefix's mirror: a killed remove's stays)
    refuse_links(work)
    try:
        work.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise OutputError(f"{work}: cannot make the merge's folder for {out.url} here ({describe(error)})") from None
    try:
        with locked(work):
            clear_mirror(work)  # (what a killed run left: every run makes its merge afresh)
            try:
                return _merge(stores, out, work, prefix_keys, relabel, progress, started)
            finally:
                clear_mirror(work)
    finally:
        with suppress(OSError):
            work.rmdir()


def _merge(
    stores: list[Store | Path],
    out: Store,
    mirror: Path,
    prefix_keys: bool,
    relabel: bool,
    progress: Callable[[int, int], None] | None,
    started: float,
) -> MergeResult:
    found = BucketChange(out).journal()
    if found is not None and found.journal.action != "merge":
        raise OutputError(f"{out.url}: an unfinished {found.journal.action} of it is here; merge into a new prefix")
    if found is not None and found.uploaded:  # every file up: finished from the bucket alone
        return _finish(out, found.journal, stores, prefix_keys, relabel, started)
    read = [
        local_source(store) if isinstance(store, Path) else read_source(store, mirror / "sources" / str(n))
        for n, store in enumerate(stores)
    ]
    plan, request = planned(read, prefix_keys, relabel)
    if found is not None and found.journal.request != request:
        raise OutputError(
            f"{out.url}: an interrupted merge of other sources (or of sources changed since) is here; "
            f"delete everything under {out.url} to start again"
        )
    if found is None:
        done = _finished(out, plan)
        if done is not None:
            finished = result_of(out.url, plan, done, {}, time.perf_counter() - started, False)
            return replace(finished, already_complete=True)
    journal = Journal("merge", request, "", 1, plan)
    owner = _claim(out, journal)
    for source, store, entry in zip(read, stores, plan["merged"], strict=True):
        if isinstance(store, Store) and (entry["key_prefix"] or entry["labels"] is not None):
            fetch_shards(store, source)  # (written again: its shards are read here)
    check_rewrites(read, plan)
    next_folder = state_dir(mirror) / NEXT_DIR
    next_folder.mkdir(parents=True)
    copies: list[Copy] = []
    by_path = {source.path: store for source, store in zip(read, stores, strict=True)}

    def planned_copy(
        source: Source, old: ShardInfo, new: str, companion: ShardInfo | None
    ) -> tuple[ShardInfo, ShardInfo | None, int]:
        store = by_path[source.path]
        placed = None if companion is None else replace(companion, name=idx_name(new))
        if companion is not None:
            copies.append(Copy(store, companion.name, idx_name(new), companion.bytes))
        copies.append(Copy(store, old.name, new, old.bytes))
        return replace(old, name=new), placed, old.bytes  # (as a local copy counts it: the shard's bytes)

    manifest = write_merged(next_folder, out.url, journal, read, planned_copy, None)
    journal.result = manifest.checksum
    _publish(out, next_folder, journal, copies, owner, progress)
    return result_of(out.url, plan, manifest, journal.plan, time.perf_counter() - started, found is not None)


def _checked_stores(
    sources: Sequence[str], output: str, storage_options: dict[str, Any] | None
) -> tuple[list[Store | Path], Store]:
    """The output a URL; every source a URL of its filesystem (copied server-side) or a local
    output folder (uploaded); none named twice, the output's prefix none of the sources' and
    inside none of them."""
    stores = [located(named, storage_options) for named in [*sources, output]]
    for where in stores:
        if isinstance(where, Store) and where.protocol in ("http", "https"):
            raise ConfigError(f"{where.url}: read over HTTP, where nothing can be copied server-side; merge it locally")
    *inputs, out = stores
    assert isinstance(out, Store)  # (merge sends an output in a bucket here)
    kinds = {store.protocol for store in stores if isinstance(store, Store)}
    if len(kinds) > 1:
        raise ConfigError(f"{out.url}: merge copies server-side, within one store: not from {', '.join(sorted(kinds))}")
    refuse_named_twice(inputs)
    for url in [store.url for store in inputs if isinstance(store, Store)]:
        if out.url == url or out.url.startswith(url + "/") or url.startswith(out.url + "/"):
            raise ConfigError(f"{out.url}: overlaps {url}; merge into a prefix of its own")
    return inputs, out


def read_source(store: Store, view: Path) -> Source:
    """An output in a bucket as a merge reads it: its manifest (read once: nothing reads it from the
    view), index.parquet and errors.jsonl in `view` (checked against its manifest), its shards
    listed in the bucket with their sizes, no change of it unfinished."""
    if BucketChange(store).journal() is not None:
        raise OutputError(f"{store.url}: a change of it is unfinished; finish it before merging")
    try:
        manifest = read_remote_manifest(store)
    except ManifestError as error:
        raise OutputError(str(error)) from None
    view.mkdir(parents=True)
    objects = store.listing()
    try:
        if manifest.index is not None and objects.get(INDEX_NAME) == manifest.index.bytes:
            store.download(INDEX_NAME, str(view / INDEX_NAME), manifest.index.bytes, manifest.index.sha256)
        if ERRORS_NAME in objects:
            store.get(ERRORS_NAME, str(view / ERRORS_NAME), MAX_ERRORS_BYTES)
    except ShardkitError as error:
        raise OutputError(f"{error}; `shardkit verify` says more") from None
    name = store.url.rstrip("/").rsplit("/", 1)[-1]
    return checked_source(view, manifest, objects.get, store.url, store.url, name)


def fetch_shards(store: Store, source: Source, *, with_idx: bool = False) -> None:
    """A source's shards downloaded into its view, each checked against its manifest's sha256 (a
    shard written again is read here; `with_idx`, their .idx files too: a local merge links them)."""
    idx = [c for c in source.manifest.companions if with_idx and c.name.endswith(IDX_SUFFIX)]
    for shard in [*source.manifest.shards, *idx]:
        try:
            store.download(shard.name, str(source.folder / shard.name), shard.bytes, shard.sha256)
        except ShardkitError as error:
            raise OutputError(f"{error}; `shardkit verify` says more") from None


def _finished(out: Store, plan: dict[str, Any]) -> Manifest | None:
    """The output this merge made, finished (None where the prefix is empty); anything else in the
    prefix is refused."""
    names = _held(out)
    if not names:
        return None
    if MANIFEST_NAME not in names:
        raise OutputError(f"{out.url}: holds {names[0]!r}; merge into a new prefix")
    try:
        manifest = read_remote_manifest(out)
    except ManifestError:
        raise OutputError(f"{out.url}: holds an output already; merge into a new prefix") from None
    if not made_by(manifest, plan, out.listing().get):
        raise OutputError(f"{out.url}: holds an output already; merge into a new prefix")
    return manifest


def _held(out: Store, under: str = "", depth: int = 0) -> list[str]:
    """The names of what the prefix holds, sorted, a folder named where an object lies in it (an
    empty folder, which a store that keeps folders leaves after its objects are deleted, is none)."""
    try:
        entries = sorted(out.folder(under))
    except (FileNotFoundError, NotADirectoryError):  # (an emptied folder's own marker, listed as a folder)
        return []
    held = []
    for name, is_folder in entries:
        inner = f"{under}/{name}" if under else name
        if not is_folder or depth >= 8 or _held(out, inner, depth + 1):
            held.append(name)
    return held


# requests in flight at once: each copy is a round trip the server does the work of (on loopback
# SeaweedFS, scripts/bench_merge_bucket.py's merge of 40 copies took 2.68 s one after another,
# 2.38 s with 8 in flight; the rest is the process's start and its first request)
IN_FLIGHT = 8


def _claim(out: Store, journal: Journal) -> str:
    """The prefix claimed for this run before any work: its journal put up with a token of the run
    (an interrupted run's of the same merge is taken over), then read back. A bucket has no lock:
    another merge that claimed it meanwhile is refused here or at the next `_ours`."""
    owner = secrets.token_hex(16)
    out.write(JOURNAL, journal_bytes(journal.to_json(), uploaded=False, owner=owner))
    _ours(out, owner)
    return owner


def _ours(out: Store, owner: str) -> None:
    found = BucketChange(out).journal()
    if found is None or found.owner != owner:
        raise OutputError(f"{out.url}: another merge into it began meanwhile (its journal is not this run's); leave it")


def _publish(
    out: Store,
    folder: Path,
    journal: Journal,
    copies: list[Copy],
    owner: str,
    progress: Callable[[int, int], None] | None,
) -> None:
    """Steps 1 to 4 of the module's docstring (step 2's copies and uploads IN_FLIGHT at once: in any
    order, as the journal names them all). Before each step the journal must still be this run's,
    and before the manifest is staged every object put up must still be of its size: a run of
    another merge that began at the same moment is refused, not mixed in."""
    from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

    copied = {copy.to: copy for copy in copies}
    _ours(out, owner)
    out.write(JOURNAL, journal_bytes(journal.to_json(), uploaded=False, owner=owner))

    def put(name: str) -> None:
        copy = copied.get(name)
        if copy is None:  # written again here
            out.upload(str(folder / name), name)
            return
        if isinstance(copy.origin, Path):  # a local output's
            out.upload(str(copy.origin / copy.name), name)
            return
        try:
            out.copy_from(copy.origin, copy.name, name)
        except FileNotFoundError:
            raise OutputError(
                f"{copy.origin.child(copy.name)}: gone while the merge copied it (a change of it meanwhile?); "
                "the same merge again goes on if its output is whole"
            ) from None

    shards = sum(1 for name in journal.moves if is_shard_name(name))
    with ThreadPoolExecutor(IN_FLIGHT, thread_name_prefix="shardkit-merge") as pool:
        pending = {pool.submit(put, name): name for name in journal.moves[:-1]}  # (the manifest last, staged)
        done = 0
        try:
            while pending:
                finished, _ = wait(pending, return_when=FIRST_COMPLETED)  # (progress as each ends)
                for future in finished:
                    future.result()  # (the first failure ends the merge: the same merge again goes on)
                    done += is_shard_name(pending.pop(future))
                if progress is not None:
                    progress(done, shards)
        except BaseException:
            for future in pending:
                future.cancel()
            raise
    _ours(out, owner)
    sizes = out.listing()
    for name in journal.moves[:-1]:  # (each as the merge made it here: a copy is its source's size)
        wanted = copied[name].size if name in copied else (folder / name).stat().st_size
        if sizes.get(name) != wanted:
            raise OutputError(
                f"{out.child(name)}: not the object this merge put there (another writer meanwhile?); "
                f"leave {out.url} to that writer, or delete everything under it to start again"
            )
    out.upload(str(folder / MANIFEST_NAME), f"{BUCKET_NEXT}/{MANIFEST_NAME}")
    _ours(out, owner)
    out.write(JOURNAL, journal_bytes(journal.to_json(), uploaded=True, owner=owner))
    _commit(out)


def _commit(out: Store) -> None:
    """Step 4: the staged manifest put in place, then it and the journal deleted (each may be done
    again: a staged manifest already gone was put in place by the run that was interrupted)."""
    with suppress(FileNotFoundError):
        out.copy(f"{BUCKET_NEXT}/{MANIFEST_NAME}", MANIFEST_NAME)
    out.delete(f"{BUCKET_NEXT}/{MANIFEST_NAME}")
    out.delete(JOURNAL)


def _finish(
    out: Store, journal: Journal, stores: list[Store | Path], prefix_keys: bool, relabel: bool, started: float
) -> MergeResult:
    """An interrupted merge's step 4, finished: the manifest it staged (or put in place) must be the
    one its journal names. It is finished whatever merge was asked for (it is committed); one of
    other sources or flags is then refused, saying so."""
    plan = journal.plan
    sources, counts = plan.get("sources"), [plan.get(key, 0) for key in ("linked", "rewritten", "bytes_written")]
    if not (isinstance(sources, list) and all(isinstance(source, str) for source in sources)) or not all(
        type(count) is int for count in counts
    ):
        raise OutputError(f"{out.child(JOURNAL)}: a damaged journal of a merge; delete everything under {out.url}")
    for name in (f"{BUCKET_NEXT}/{MANIFEST_NAME}", MANIFEST_NAME):
        try:
            text = out.read(name, MAX_JOURNAL_BYTES)
        except FileNotFoundError:
            continue
        manifest = _parsed(text, out.child(name))
        if manifest.checksum != journal.result or manifest.computed_checksum() != manifest.checksum:
            raise OutputError(f"{out.child(name)}: not the manifest its interrupted merge wrote; delete {out.url}")
        _commit(out)
        if not asked_for(plan, [source_name(store) for store in stores], prefix_keys, relabel):
            raise OutputError(
                f"{out.url}: held an interrupted merge of other outputs ({', '.join(sources[:3])[:300]}), "
                "finished now; merge into a new prefix"
            )
        return result_of(out.url, plan, manifest, plan, time.perf_counter() - started, True)
    raise OutputError(f"{out.url}: an interrupted merge left no manifest behind; delete {out.url} to start again")


def _parsed(text: bytes, where: str) -> Manifest:
    from ..core.manifest import parse_manifest

    try:
        return parse_manifest(text, where)
    except ManifestError as error:
        raise OutputError(str(error)) from None
