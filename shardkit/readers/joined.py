"""Columns added to an output without rewriting a shard: `open_shards(OUT, join=TABLE)`.

TABLE (a parquet, CSV or JSONL file, or a pyarrow Table) has a `key` column; its other columns join
each record of that key as extra fields (`Sample.fields`, the loader's `batch.fields`): they are
merged into the record's columns as it is read, so every path that shows the user's columns shows
them. Checked up front against the output's index.parquet, each refusal one line: a key the output
lacks, a key twice, a column named like a stored one. Held compactly: the table's arrow arrays and
one int32 per record of the output (the row joined to it, -1 for none), not a dict per key.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..core.errors import ConfigError, describe
from ..formats.base import Record
from ..storage.urls import is_remote, local_path, split_object_url
from .arrays import booleans, integers
from .subset import SHOWN, IndexFile

TABLE_SUFFIXES = (".parquet", ".csv", ".jsonl", ".json")


@dataclass(frozen=True)
class Joined:
    """The joined columns by record: `rows[g]` is the table's row for the output's g-th record
    (shards in stored order, records in stored order), -1 where the table has none."""

    names: list[str]
    arrays: list[Any]  # pyarrow arrays, one per name, indexed by the table's rows
    rows: np.ndarray  # int32 per record of the output

    def values(self, record: int) -> dict[str, Any]:
        row = int(self.rows[record])
        if row < 0:  # every sample has the same fields: a record the table lacks gets None
            return dict.fromkeys(self.names)
        return {name: array[row].as_py() for name, array in zip(self.names, self.arrays, strict=True)}

    def add(self, record: Record, number: int) -> Record:
        """The record (the output's `number`-th) with the joined columns among its columns."""
        return record._replace(columns={**(record.columns or {}), **self.values(number)})

    def added(self, records: Iterator[Record], first: int) -> Iterator[Record]:
        """Consecutive records, the first the output's `first`-th, each with its joined columns."""
        for number, record in enumerate(records, first):
            yield self.add(record, number)


def join(index: IndexFile, table: Any, what: str, storage_options: dict[str, Any] | None = None) -> Joined:
    """The columns `table` joins to the output whose index is `index` (`what` names it in errors);
    a table at a URL is fetched with `storage_options`."""
    import pyarrow as pa
    import pyarrow.compute as pc

    data = load_table(table, storage_options)
    if "key" not in data.column_names:
        raise ConfigError(f"join: the table has no 'key' column (its columns: {', '.join(data.column_names)[:200]})")
    keys = data.column("key").combine_chunks()
    if not pa.types.is_string(keys.type) and not pa.types.is_large_string(keys.type):
        raise ConfigError(f"join: the table's 'key' column is {keys.type}, not text")
    if keys.null_count:
        raise ConfigError(f"join: the table's 'key' column has {keys.null_count:,} empty keys")
    counted = pc.value_counts(keys)
    twice = counted.filter(booleans(integers(counted.field("counts")) > 1)).field("values")  # (no pandas)
    if len(twice):
        raise ConfigError(f"join: {len(twice):,} keys appear more than once in the table: {_some(twice)}")
    rows = pc.index_in(keys, value_set=index.keys)
    if rows.null_count:
        unknown = keys.filter(pc.is_null(rows))
        raise ConfigError(f"join: {len(unknown):,} keys of the table are not in {what}: {_some(unknown)}")
    names = [name for name in data.column_names if name != "key"]
    if not names:
        raise ConfigError("join: the table has no column besides 'key'")
    clash = sorted(set(names) & stored_columns(index))
    if clash:
        raise ConfigError(f"join: the table's column {clash[0]!r} is a stored column of {what}: rename it")
    at = integers(rows)  # (each found: unknown keys were refused above)
    counts = [shard.count for shard in index.manifest.shards]
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    record_rows = np.full(int(starts[-1]), -1, np.int32)
    record_rows[starts[index.shards[at]] + index.positions[at]] = np.arange(len(at), dtype=np.int32)
    return Joined(names, [data.column(name).combine_chunks() for name in names], record_rows)


def load_table(table: Any, storage_options: dict[str, Any] | None = None) -> Any:
    """A pyarrow Table from a Table or a parquet, CSV or JSONL file (keys always read as text). A
    URL (s3://, https://, ...) is fetched through storage with its retries and `storage_options`;
    a path or a file:// URL is read where it lies."""
    import pyarrow as pa

    if isinstance(table, pa.Table):
        return table
    if not isinstance(table, (str, os.PathLike)):
        raise ConfigError(f"join must be a table's path or a pyarrow Table, not {type(table).__name__}")
    path = os.fspath(table)
    suffix = os.path.splitext(path)[1].lower()
    remote = is_remote(path)
    if not remote and not os.path.lexists(local_path(path)):
        raise ConfigError(f"join: {path}: no such file or folder")
    if suffix not in TABLE_SUFFIXES:
        raise ConfigError(f"join: {path}: a table must be parquet, CSV or JSONL ({', '.join(TABLE_SUFFIXES)})")
    if not remote:
        return _read_table(local_path(path), suffix, path)
    with tempfile.TemporaryDirectory(prefix="shardkit-join-") as folder:
        fetched = os.path.join(folder, "table" + suffix)
        _fetch(path, fetched, storage_options)
        return _read_table(fetched, suffix, path)


def _fetch(url: str, destination: str, storage_options: dict[str, Any] | None) -> None:
    """The object at `url` into the local file `destination`, as every remote read: retried, with
    the storage options."""
    from ..storage.store import Store

    folder, name = split_object_url(url)
    try:
        Store(folder, dict(storage_options or {})).get(name, destination)
    except FileNotFoundError:
        raise ConfigError(f"join: {url}: no such file or folder") from None


def _read_table(path: str, suffix: str, shown: str) -> Any:
    """The table in the local file `path` (`shown` names it in errors), read by its suffix."""
    import pyarrow as pa

    try:
        if suffix == ".parquet":
            import pyarrow.parquet as pq

            return pq.read_table(path)
        text = pa.schema([("key", pa.string())])  # "0012" stays a key, not the number 12
        if suffix == ".csv":
            import pyarrow.csv as csv

            return csv.read_csv(path, convert_options=csv.ConvertOptions(column_types=text))
        import pyarrow.json as pj

        return pj.read_json(path, parse_options=pj.ParseOptions(explicit_schema=text))
    except OSError as error:
        raise ConfigError(f"join: {shown}: {describe(error)}") from None
    except Exception as error:  # pyarrow's own parse errors
        raise ConfigError(f"join: {shown}: unreadable ({str(error).splitlines()[0][:200]})") from None


def stored_columns(index: IndexFile) -> set[str]:
    """Every name a sample's fields or the index already use: the index's columns, the user's
    columns (the index's JSON `columns`, each distinct text parsed once) and sidecar fields."""
    import pyarrow.compute as pc

    names = set(index.columns) - {"key"}
    stored: list[str] = [n for n in ("columns", "fields") if n in index.columns]
    if not stored:
        return names
    table = index.read(stored)
    if "columns" in stored:
        for text in pc.unique(table.column("columns").drop_null()).to_pylist():
            try:
                parsed = json.loads(text)
            except ValueError:
                continue
            if isinstance(parsed, dict):
                names.update(parsed)
    if "fields" in stored:
        names.update(pc.unique(pc.list_flatten(table.column("fields"))).drop_null().to_pylist())
    return names


def _some(keys: Any) -> str:
    shown = ", ".join(repr(key) for key in keys[:SHOWN].to_pylist())
    return shown + (f" and {len(keys) - SHOWN:,} more" if len(keys) > SHOWN else "")
