"""index.parquet against the manifest and the shards: its bytes are the manifest's, and it lists
each shard's keys in their stored order, a row per record."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..core.errors import describe
from ..core.manifest import INDEX_NAME, Manifest, sha256_file
from ..core.safeio import check_regular
from .verify_hashes import hashes
from .verify_report import Problem, VerifyReport


def check_index(root: Path, manifest: Manifest, by_shard: dict[int, np.ndarray], report: VerifyReport) -> None:
    """index.parquet is the manifest's (bytes, sha256) and says what the shards hold: a row per
    record, each shard's keys in their stored order. Its own claims are checked before it is read
    (a stranger's parquet file could claim any size)."""
    entry, path = manifest.index, root / INDEX_NAME
    assert entry is not None
    try:
        size = check_regular(path).st_size
        digest = sha256_file(path) if size == entry.bytes else ""
    except OSError as error:
        report.problems.append(Problem("index", f"{INDEX_NAME}: {describe(error)}"))
        return
    if size != entry.bytes or digest != entry.sha256:
        report.problems.append(Problem("index", f"{INDEX_NAME} differs from the manifest (bytes changed)"))
        return
    import pyarrow.parquet as pq

    try:
        handle = pq.ParquetFile(path)
        rows = handle.metadata.num_rows
        claimed = sum(handle.metadata.row_group(i).total_byte_size for i in range(handle.metadata.num_row_groups))
        if rows != manifest.records or rows != entry.count or claimed > 64 * size + (1 << 20):
            report.problems.append(
                Problem("index", f"{INDEX_NAME} has {rows:,} rows, the shards {manifest.records:,} records")
            )
            return
        table = handle.read(columns=["key", "shard", "position"])
    except Exception as error:  # pyarrow's own errors for a damaged file
        report.problems.append(Problem("index", f"{INDEX_NAME}: unreadable ({describe(error)})"))
        return
    keys, shards, positions = (table.column(name).to_pylist() for name in ("key", "shard", "position"))
    rows_of: dict[str, list[tuple[int, str]]] = {}
    for key, shard, position in zip(keys, shards, positions, strict=True):
        rows_of.setdefault(str(shard), []).append((position, str(key)))
    for number, shard in enumerate(manifest.shards):
        listed = [key for _, key in sorted(rows_of.get(shard.name, []))]
        if number in by_shard and not np.array_equal(hashes(listed), by_shard[number]):
            report.problems.append(
                Problem("index", f"{INDEX_NAME} does not list this shard's keys in order", shard.name)
            )
