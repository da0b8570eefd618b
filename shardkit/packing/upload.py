"""A bucket as the place a written shard goes (the worker's side of bucket_output.BucketOutput):
the worker writes the shard in a scratch folder of its task's own (scratch.py), uploads it between
two markers and deletes its local copy.

The markers are the bucket's ledger (`<url>/.shardkit/uploaded/<shard>.json`: bytes, sha256,
whether the upload finished): one saying `uploaded: false` goes up before the shard's first byte,
so every object shardkit may have written is named by a marker (what --overwrite may delete, what a
resume must not trust), and one saying `true` once the shard and its .idx file are whole. The
.idx file goes before its shard, as in a folder: a shard in the bucket always has its index.

The worker writes nothing of the driver's: its shard's part of index.parquet comes back as bytes
in the result (`ShardResult.index_part`), and the driver writes that part and the done marker
into its staging folder (`BucketOutput.mark_done`). So a Ray task needs no folder the driver can
see, and a local worker's results take the same path, whoever runs it.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from ..core.manifest import ShardInfo
from ..storage.store import Store
from .index import part_bytes
from .scratch import locked_stem, node_scratch
from .shard_writing import ShardResult, Workspace
from .working_folder import writing

MARKERS = ".shardkit/uploaded"


class Uploaded(NamedTuple):
    """A shard the bucket contained under its name when the pack began, recorded as a finished upload:
    its bytes and sha256 (the marker's) and the size of its .idx file (None: none)."""

    bytes: int
    sha256: str
    idx_bytes: int | None


@dataclass(frozen=True)
class BucketShards:
    """Where a written shard goes for a pack to a bucket: up to `store`, from a scratch folder
    (`scratch`: the driver's staging `tmp/` for a local worker; None: the node's own temporary
    folder, for a Ray task that cannot see the driver's). `uploaded` is what the bucket contained under
    the shard's name when the pack began: the same bytes are not sent again."""

    store: Store
    scratch: str | None
    uploaded: Uploaded | None

    def workspace(self, name: str, files: contextlib.ExitStack) -> Workspace:
        """A stem of the task's own in the scratch folder, locked until the writing ends."""
        folder = Path(self.scratch) if self.scratch is not None else node_scratch()
        with writing(folder, name):
            stem = files.enter_context(locked_stem(folder, name))
        return Workspace(str(folder), Path(f"{stem}.tmp"), Path(f"{stem}.idx.tmp"))

    def put(self, result: ShardResult, rows: list[tuple[Any, ...]], space: Workspace) -> None:
        """The shard uploaded (unless the bucket holds it already), its index part in the result."""
        uploading = time.perf_counter()
        with writing(space.folder, result.shard.name):
            result.index_part = part_bytes(rows)
            sent = deliver(self.store, result.shard, space.shard, result.companion, space.idx, self.uploaded)
            result.already_uploaded = not sent
        result.timings["upload"] = time.perf_counter() - uploading


def mark(store: Store, name: str, size: int, sha256: str, uploaded: bool) -> None:
    record = {"bytes": size, "sha256": sha256, "uploaded": uploaded}
    store.write(f"{MARKERS}/{name}.json", json.dumps(record).encode())


def deliver(
    store: Store, shard: ShardInfo, path: Path, companion: ShardInfo | None, idx_path: Path, uploaded: Uploaded | None
) -> bool:
    """Uploads the shard just written at `path` (and its .idx file at `idx_path`) to `store`, between
    its two markers. False when the bucket already has these very bytes, recorded as uploaded (a resume from
    a lost staging folder, an overwrite with the same shards): nothing is uploaded then."""
    if uploaded is not None and (uploaded.bytes, uploaded.sha256) == (shard.bytes, shard.sha256):
        # older shardkits uploaded the .idx file after its shard: one missing or of another size is sent
        if companion is not None and uploaded.idx_bytes != companion.bytes:
            store.upload(str(idx_path), companion.name)
        return False
    mark(store, shard.name, shard.bytes, shard.sha256, uploaded=False)  # named by a marker before it exists
    if companion is not None:
        store.upload(str(idx_path), companion.name)
    store.upload(str(path), shard.name)
    mark(store, shard.name, shard.bytes, shard.sha256, uploaded=True)
    return True
