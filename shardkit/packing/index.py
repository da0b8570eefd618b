"""index.parquet: one row per record of the whole output (key, shard, position, label, caption,
the user's columns, source path, original and stored sizes), for selecting and filtering with
pandas, polars or DuckDB without opening a shard.

Each worker writes its shard's part beside its done marker (`.shardkit/index/<shard>.parquet`), so
a resumed pack keeps the parts of the shards it keeps; the driver joins the parts in shard order,
one row group a shard, streamed. The same records give the same bytes, whatever the workers.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..core.manifest import INDEX_NAME, ShardInfo, sha256_file
from ..formats.base import Record

# The columns, in order. The user's columns are one JSON text: their names and types differ from
# row to row, a parquet schema cannot (read them with json.loads, or DuckDB's ->> operator).
COLUMNS = (
    ("key", "string"), ("shard", "string"), ("position", "int64"), ("label", "int64"),
    ("text", "string"), ("texts", "list<string>"), ("columns", "string"), ("fields", "list<string>"),
    ("source", "string"), ("width", "int64"), ("height", "int64"), ("stored_width", "int64"),
    ("stored_height", "int64"),
)  # fmt: skip


def schema() -> Any:
    import pyarrow as pa

    kinds = {"string": pa.string(), "int64": pa.int64(), "list<string>": pa.list_(pa.string())}
    return pa.schema([(name, kinds[kind]) for name, kind in COLUMNS])


def row(record: Record, shard: str, position: int) -> tuple[Any, ...]:
    """A record's row, in COLUMNS order."""
    meta = record.meta
    several = record.text is not None and not isinstance(record.text, str)
    columns = None
    if record.columns is not None:
        columns = json.dumps(record.columns, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return (
        record.key, shard, position, record.label, None if several else record.text,
        record.text if several else None, columns, sorted(record.files) if record.files else None,
        meta.get("source"), meta.get("width"), meta.get("height"), meta.get("stored_width"), meta.get("stored_height"),
    )  # fmt: skip


def part_path(state: Path, shard: str) -> Path:
    return state / "index" / f"{shard}.parquet"


def write_part(path: Path, rows: list[tuple[Any, ...]]) -> None:
    """One shard's rows, written under a temporary name and renamed (a kill leaves no half part)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.Table.from_arrays([pa.array(list(column)) for column in zip(*rows, strict=True)] if rows else
                                 [pa.array([], kind) for kind in schema().types], schema=schema())  # fmt: skip
    temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    pq.write_table(table, temp, compression="zstd")
    os.replace(temp, path)


def join(parts: Iterable[Path], output: Path, temp_dir: Path) -> ShardInfo:
    """The parts, in order, into OUT/index.parquet (atomically); its entry for the manifest."""
    import pyarrow.parquet as pq

    temp = temp_dir / f".{INDEX_NAME}.{os.getpid()}.tmp"
    rows = 0
    try:
        with pq.ParquetWriter(temp, schema(), compression="zstd") as writer:
            for path in parts:
                table = pq.read_table(path, schema=schema())
                writer.write_table(table)
                rows += table.num_rows
        os.replace(temp, output / INDEX_NAME)
    finally:
        temp.unlink(missing_ok=True)
    target = output / INDEX_NAME
    return ShardInfo(INDEX_NAME, rows, target.stat().st_size, sha256_file(target))
