"""index.parquet: one row per record of the whole output (key, shard, position, label, caption,
the user's columns, source path, original and stored sizes, the source file's sha256 and the
picture's DCT hash), for selecting and filtering with
pandas, polars or DuckDB without opening a shard.

Each worker writes its shard's part beside its done marker (`.shardkit/index/<shard>.jsonl`), so
a resumed pack keeps the parts of the shards it keeps; the driver joins the parts in shard order,
one row group a shard, streamed. The same records give the same bytes, whatever the workers.

Parts are JSON lines, not parquet: pyarrow converting Python objects (pa.array of a list) imports
pandas, a start-up cost every worker would pay; workers never load pyarrow, and the driver reads
the parts with pyarrow's own JSON reader, which needs no pandas.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..core.manifest import INDEX_NAME, ShardInfo, sha256_file
from ..formats.base import Record, encode_json

# The columns, in order. The user's columns are one JSON text: their names and types differ from
# row to row, a parquet schema cannot (read them with json.loads, or DuckDB's ->> operator).
COLUMNS = (
    ("key", "string"), ("shard", "string"), ("position", "int64"), ("label", "int64"),
    ("text", "string"), ("texts", "list<string>"), ("columns", "string"), ("fields", "list<string>"),
    ("source", "string"), ("width", "int64"), ("height", "int64"), ("stored_width", "int64"),
    ("stored_height", "int64"), ("source_sha256", "string"), ("phash", "string"),
)  # fmt: skip


def schema() -> Any:
    import pyarrow as pa

    kinds = {"string": pa.string(), "int64": pa.int64(), "list<string>": pa.list_(pa.string())}
    return pa.schema([(name, kinds[kind]) for name, kind in COLUMNS])


def row(record: Record, shard: str, position: int) -> tuple[Any, ...]:
    """A record's row, in COLUMNS order."""
    meta = record.meta
    several = record.text is not None and not isinstance(record.text, str)
    columns = None if record.columns is None else encode_json(record.columns).decode()
    return (
        record.key, shard, position, record.label, None if several else record.text,
        record.text if several else None, columns, sorted(record.files) if record.files else None,
        meta.get("source"), meta.get("width"), meta.get("height"), meta.get("stored_width"), meta.get("stored_height"),
        _text(meta.get("source_sha256")), _text(meta.get("phash")),
    )  # fmt: skip


def _text(value: Any) -> str | None:
    # an adopted tar's metadata comes from another tool: a column must keep its type whatever it holds
    return value if isinstance(value, str) else None


def part_path(state: Path, shard: str) -> Path:
    return state / "index" / f"{shard}.jsonl"


def part_bytes(rows: list[tuple[Any, ...]]) -> bytes:
    """One shard's rows as its part holds them: JSON lines, UTF-8."""
    names = [name for name, _ in COLUMNS]
    text = "".join(json.dumps(dict(zip(names, row, strict=True)), ensure_ascii=False) + "\n" for row in rows)
    return text.encode("utf-8")


def write_part(path: Path, rows: list[tuple[Any, ...]]) -> None:
    write_part_bytes(path, part_bytes(rows))


def write_part_bytes(path: Path, data: bytes) -> None:
    """One shard's part, written under a temporary name and renamed (a kill leaves no half part)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temp.write_bytes(data)
    os.replace(temp, path)


def load_soon() -> None:
    """Import what `join` needs (pyarrow's JSON reader and parquet writer) on a thread of its own,
    while the shards are written, so that the import is not on the pack's critical path after the
    last shard."""

    def load() -> None:
        with contextlib.suppress(ImportError):  # (join says what is missing)
            import pyarrow.json
            import pyarrow.parquet  # noqa: F401

    # Not a daemon: an import allocates, so the cyclic garbage collector may run on this thread and
    # finalize what the pack left behind (a failed run's traceback holds the workers' shared
    # counters, whose semaphores are unlinked, then unregistered from multiprocessing's resource
    # tracker). The process must not exit between the two (the tracker then warns on stderr of a
    # leaked semaphore), so it waits for this thread as for any other that is not a daemon.
    threading.Thread(target=load, name="shardkit-load-index").start()


def join(parts: Iterable[Path], output: Path, temp_dir: Path) -> ShardInfo:
    """The parts, in order, into OUT/index.parquet (atomically); its entry for the manifest."""
    import pyarrow.json as pyarrow_json
    import pyarrow.parquet as pq

    names = [name for name, _ in COLUMNS]
    # a row holds up to 1 MiB of caption and columns, escaped: blocks far larger than any row
    reading = pyarrow_json.ReadOptions(block_size=32 << 20, use_threads=False)
    parsing = pyarrow_json.ParseOptions(explicit_schema=schema(), unexpected_field_behavior="error")
    temp = temp_dir / f".{INDEX_NAME}.{os.getpid()}.tmp"
    rows = 0
    try:
        with pq.ParquetWriter(temp, schema(), compression="zstd") as writer:
            for path in parts:
                if path.stat().st_size == 0:  # a shard with no records
                    continue
                table = pyarrow_json.read_json(path, read_options=reading, parse_options=parsing)
                writer.write_table(table.select(names))
                rows += table.num_rows
        os.replace(temp, output / INDEX_NAME)
    finally:
        temp.unlink(missing_ok=True)
    target = output / INDEX_NAME
    return ShardInfo(INDEX_NAME, rows, target.stat().st_size, sha256_file(target))
