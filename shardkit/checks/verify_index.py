"""index.parquet against the manifest and the shards: its bytes are the manifest's, and it lists
each shard's keys in their stored order, a row per record."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ..core.errors import describe
from ..core.manifest import INDEX_NAME, Manifest, sha256_file
from ..core.safeio import check_regular
from .verify_hashes import hashes
from .verify_report import Problem, VerifyReport


def check_index(root: Path, manifest: Manifest, by_shard: dict[int, np.ndarray], report: VerifyReport) -> None:
    """index.parquet is the manifest's (bytes, sha256) and says what the shards hold: a row per
    record, each shard's keys in their stored order at positions 0 to count - 1. Its own claims are
    checked before it is read (a stranger's parquet file could claim any size), and the types and
    nulls of the columns read before they are used (a re-sealed manifest vouches for any bytes)."""
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
        wrong = index_claims(handle, manifest, size) or _column_problem(handle.schema_arrow)
        if wrong is None:
            table = handle.read(columns=list(_COLUMNS))
            wrong = next((f"column {n!r} has nulls" for n in _COLUMNS if table.column(n).null_count), None)
    except Exception as error:  # pyarrow's own errors for a damaged file
        report.problems.append(Problem("index", f"{INDEX_NAME}: unreadable ({describe(error)})"))
        return
    if wrong is not None:
        report.problems.append(Problem("index", f"{INDEX_NAME}: {wrong}"))
        return
    keys, shards, positions = (table.column(name).to_pylist() for name in _COLUMNS)
    rows_of: dict[str, list[tuple[int, str]]] = {}
    for key, shard, position in zip(keys, shards, positions, strict=True):
        rows_of.setdefault(shard, []).append((position, key))
    named = {shard.name for shard in manifest.shards}
    strangers = sorted(name for name in rows_of if name not in named)
    if strangers:
        detail = f"{INDEX_NAME}: names a shard the manifest lacks: {strangers[0][:80]!r}"
        report.problems.append(Problem("index", detail))
    for number, shard in enumerate(manifest.shards):
        rows = sorted(rows_of.get(shard.name, []))
        if [position for position, _ in rows] != list(range(shard.count)):
            report.problems.append(
                Problem("index", f"{INDEX_NAME}: column 'position' is not 0 to {shard.count - 1:,} here", shard.name)
            )
        elif number in by_shard and not np.array_equal(hashes([key for _, key in rows]), by_shard[number]):
            report.problems.append(
                Problem("index", f"{INDEX_NAME} does not list this shard's keys in order", shard.name)
            )


def index_claims(handle: Any, manifest: Manifest, size: int) -> str | None:
    """What is wrong with what an opened index.parquet (a pyarrow ParquetFile) says of itself in
    its metadata, read before any row: its rows must be the manifest's records (a small file can
    hold millions of copies of one row), and what it unpacks to bounded by its size."""
    rows = handle.metadata.num_rows
    listed = manifest.index.count if manifest.index is not None else rows
    if rows != manifest.records or rows != listed:
        return f"{rows:,} rows, the manifest says {manifest.records:,} records"
    claimed = sum(handle.metadata.row_group(i).total_byte_size for i in range(handle.metadata.num_row_groups))
    if claimed > 64 * size + (1 << 20):
        return f"{claimed:,} bytes unpacked from {size:,}, more than an index of its rows"
    return None


_COLUMNS = ("key", "shard", "position")  # what verify reads of the index: each checked before use


def _column_problem(schema: Any) -> str | None:
    """What is wrong with the types of the columns verify reads (a stranger's index may hold any)."""
    import pyarrow as pa

    wanted = {"key": pa.types.is_string, "shard": pa.types.is_string, "position": pa.types.is_integer}
    for name, fits in wanted.items():
        found = schema.get_all_field_indices(name)
        if len(found) != 1:
            return f"{len(found)} columns named {name!r}, not one"
        at = found[0]
        if not fits(schema.field(at).type):
            return f"column {name!r} is {schema.field(at).type}, not {'int64' if name == 'position' else 'string'}"
    return None
