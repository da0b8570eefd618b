"""A shard delivered to a bucket as soon as it is written: the worker uploads it between two markers
and deletes its local copy; the driver keeps only what the worker hands back.

The markers are the bucket's ledger (`<url>/.shardkit/uploaded/<shard>.json`: bytes, sha256,
whether the upload finished): one saying `uploaded: false` goes up before the shard's first byte,
so every object shardkit may have written is on record (what --overwrite may delete, what a
resume must not trust), and one saying `true` once the shard and its .idx file are whole. The
.idx file goes before its shard, as in a folder: a shard in the bucket always has its index.

The worker writes nothing of the driver's: its shard's part of index.parquet comes back as bytes
in the result (`ShardResult.index_part`), and the driver writes that part and the done marker
into its staging folder (`keep`). So a Ray task needs no folder the driver can see, and a local
worker's results take the same path, whoever runs it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from ..core.manifest import ShardInfo, write_json_atomic
from ..storage.store import Store
from .index import part_path, write_part_bytes
from .output import done_path, state_dir, writing

MARKERS = ".shardkit/uploaded"


class Held(NamedTuple):
    """What the bucket holds under a shard's name, on record as a finished upload, when the pack
    began: its bytes and sha256 (the marker's) and the size of its .idx file (None: none)."""

    bytes: int
    sha256: str
    idx_bytes: int | None


def mark(store: Store, name: str, size: int, sha256: str, uploaded: bool) -> None:
    record = {"bytes": size, "sha256": sha256, "uploaded": uploaded}
    store.write(f"{MARKERS}/{name}.json", json.dumps(record).encode())


def deliver(
    store: Store, shard: ShardInfo, path: Path, companion: ShardInfo | None, idx_path: Path, held: Held | None
) -> bool:
    """Uploads the shard just written at `path` (and its .idx file at `idx_path`) to `store`, between
    its two markers. False when the bucket already held these very bytes, on record (a resume from
    a lost staging folder, an overwrite with the same shards): nothing is uploaded then."""
    if held is not None and (held.bytes, held.sha256) == (shard.bytes, shard.sha256):
        if companion is not None and held.idx_bytes != companion.bytes:  # earlier shardkits sent them last
            store.upload(str(idx_path), companion.name)
        return False
    mark(store, shard.name, shard.bytes, shard.sha256, uploaded=False)  # on record before it exists
    if companion is not None:
        store.upload(str(idx_path), companion.name)
    store.upload(str(path), shard.name)
    mark(store, shard.name, shard.bytes, shard.sha256, uploaded=True)
    return True


class Handed(Protocol):
    """What `keep` needs of a worker's result (worker.ShardResult, which imports this module)."""

    shard: ShardInfo
    index_part: bytes | None

    def marker(self) -> dict[str, Any]: ...


def keep(staging: Path, result: Handed) -> None:
    """The driver's side: the part of index.parquet and the done marker of a shard a worker
    uploaded, written into the staging folder's state (the part first: the marker vouches for it);
    the part's bytes are then dropped from the result, so the driver holds no index in memory."""
    name = result.shard.name
    with writing(staging, name):
        write_part_bytes(part_path(state_dir(staging), name), result.index_part or b"")
        write_json_atomic(done_path(staging, name), result.marker())
    result.index_part = None
