"""Metadata tables: one sample per row, its image named by a path column, with a caption, a label
and any other columns (Hugging Face ImageFolder's `metadata.jsonl|csv|parquet` with `file_name`,
or any CSV, TSV, JSONL or parquet table given with --metadata).

A table is read twice, streamed both times: a first pass keeps 8-byte hashes of every path and key
(duplicates, key clashes, files without a row) and the class names; the second yields the items.
Memory grows by 16 bytes a row, never by the rows themselves (10 M rows: 160 MB). A row that
cannot be taken becomes a Failure naming its line and the cause; the pack goes on.
"""

from __future__ import annotations

import contextlib
import csv
import gzip
import io
import os
import posixpath
import re
import zlib
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field
from typing import Any, BinaryIO, NamedTuple, cast

from ...core.config import TableConfig
from ...core.errors import SourceError, describe
from ...core.safeio import loads, open_regular

# Hugging Face ImageFolder's names, picked up at the source root with no flag.
AUTO_TABLES = ("metadata.jsonl", "metadata.csv", "metadata.parquet")
TABLE_KINDS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".csv": "csv", ".tsv": "tsv", ".parquet": "parquet"}
# A row's caption and columns as stored (canonical JSON): past this a row is refused, not truncated.
MAX_EXTRA_BYTES = 1 << 20
_PARQUET_BATCH = 8192  # rows a pass holds as Python objects at once: larger batches only cost memory
_LINE_LIMIT = 4 * MAX_EXTRA_BYTES  # a JSONL line or CSV field longer than this is refused unread
# UTF-8's byte-order mark, which Excel ("CSV UTF-8") and Notepad write first: not part of the text,
# as pyarrow, pandas and Hugging Face read it.
BOM = b"\xef\xbb\xbf"


class Row(NamedTuple):
    line: int  # 1-based line of a JSONL or CSV file (the header is line 1), row number in parquet
    values: dict[str, Any] | None  # None: the row could not be read (`problem` says why)
    problem: str = ""  # (its line or row is the failure's path: not said again here)


@dataclass
class Table:
    """A table being read: its file, its kind, and the columns a sample takes from it."""

    path: str
    kind: str
    config: TableConfig
    name: str = ""  # how errors name it (its file name)
    caption: str | None = None  # the caption column, resolved
    columns: list[str] | None = None  # None: every column but the path, caption and label ones
    found: list[str] = field(default_factory=list)  # the columns seen (all of a CSV or parquet header)
    types: dict[str, Any] = field(default_factory=dict)  # a parquet column's arrow type, by name
    rows: int = 0  # rows read in the last pass, readable or not
    url: str = ""  # where a table fetched from a bucket came from (`path` is its local copy)
    _known: set[str] = field(default_factory=set, repr=False)

    @property
    def shown(self) -> str:
        """How messages name the table: its URL, else its path."""
        return self.url or self.path


def find_table(root: str, config: TableConfig) -> Table | None:
    """The table of a source folder: --metadata, else metadata.jsonl|csv|parquet at its root.
    None when there is neither."""
    if config.path is not None:
        path = os.fspath(config.path)
        if not os.path.isfile(path):
            raise SourceError(f"{path}: no such metadata table")
    else:
        present = [name for name in AUTO_TABLES if os.path.isfile(os.path.join(root, name))]
        if not present:
            return None
        if len(present) > 1:
            raise both_present(root, present)
        path = os.path.join(root, present[0])
    return Table(path, metadata_kind(path), config, os.path.basename(path))


def metadata_kind(name: str) -> str:
    """A metadata table's kind from its name (a path or a URL); SourceError for a name of no kind."""
    kind = table_kind(name)
    if kind is None:
        raise SourceError(f"{name}: a metadata table must be .jsonl, .csv, .tsv or .parquet")
    return kind


def both_present(root: str, present: list[str]) -> SourceError:
    """The refusal of a source holding two of the tables picked up with no flag."""
    return SourceError(f"{root}: {' and '.join(present)} both present; keep one (or pick one with --metadata)")


def table_kind(path: str) -> str | None:
    """A table's kind by its name (jsonl, csv, tsv, parquet; a text table may be gzipped, x.csv.gz),
    or None when the name is not a table's."""
    lower = path.lower()
    text = lower.removesuffix(".gz")
    kind = next((kind for suffix, kind in TABLE_KINDS.items() if text.endswith(suffix)), None)
    return None if kind == "parquet" and text != lower else kind  # (parquet compresses inside)


def _open_bytes(table: Table) -> BinaryIO:
    """The table's bytes, gunzipped when its name ends in .gz (streamed: no size is known up front,
    and the line limit bounds what one row may hold); a FIFO is refused, never waited on."""
    zipped = table.shown.lower().endswith(".gz")
    try:
        fd = open_regular(table.path)
    except OSError as error:
        raise SourceError(f"{table.shown}: cannot read ({describe(error)})") from None
    if not zipped:
        return open(fd, "rb")
    raw = open(fd, "rb", buffering=0)  # noqa: SIM115 - closed with the GzipFile (GzipFile buffers)
    unzipped = gzip.GzipFile(fileobj=raw, mode="rb")
    unzipped.myfileobj = raw  # closed with it, as when GzipFile opens the file itself
    return cast(BinaryIO, unzipped)


def read_rows(table: Table) -> Generator[Row, None, None]:
    """Every row of the table, streamed; a row that cannot be read comes with its problem."""
    table.rows = 0
    if table.kind == "jsonl":
        rows = _jsonl_rows(table)
    elif table.kind == "parquet":
        rows = _parquet_rows(table)
    else:
        rows = _csv_rows(table, "\t" if table.kind == "tsv" else ",")
    for row in rows:
        table.rows += 1
        yield row


def _jsonl_rows(table: Table) -> Iterator[Row]:
    handle = _open_bytes(table)
    with handle, _unzipping(table):
        for number, line in enumerate(iter(lambda: handle.readline(_LINE_LIMIT + 1), b""), 1):
            if len(line) > _LINE_LIMIT:
                raise SourceError(f"{table.shown}:{number}: a line over {_LINE_LIMIT >> 20} MiB; not a JSONL table?")
            if number == 1:
                line = line.removeprefix(BOM)
            if not line.strip():
                continue
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError:
                yield Row(number, None, "not UTF-8")
                continue
            try:
                value = loads(text)
            except ValueError as error:
                yield Row(number, None, f"not valid JSON ({describe(error)})")
                continue
            if type(value) is not dict:
                yield Row(number, None, "not a JSON object")
                continue
            if not table._known.issuperset(value):
                table.found.extend(name for name in value if name not in table._known)
                table._known.update(value)
            yield Row(number, value)


def _csv_rows(table: Table, delimiter: str) -> Iterator[Row]:
    csv.field_size_limit(_LINE_LIMIT)
    handle = io.TextIOWrapper(_open_bytes(table), encoding="utf-8-sig", errors="surrogateescape", newline="")
    with handle, _unzipping(table):
        reader = csv.reader(handle, delimiter=delimiter, strict=True)
        try:
            header = next(reader)
        except StopIteration:
            raise SourceError(f"{table.shown}: empty table (no header line)") from None
        except csv.Error as error:
            raise SourceError(f"{table.shown}:1: malformed header ({error})") from None
        if len(set(header)) != len(header):
            raise SourceError(f"{table.shown}: a column name appears twice in the header")
        table.found = list(header)
        while True:
            number = reader.line_num + 1
            try:
                fields = next(reader)
            except StopIteration:
                return
            except csv.Error as error:
                yield Row(number, None, f"malformed CSV ({error})")
                continue
            if not fields or fields == [""]:
                continue
            if len(fields) != len(header):
                yield Row(number, None, f"{len(fields)} fields, the header has {len(header)}")
                continue
            if not all(is_utf8(text) for text in fields):
                yield Row(number, None, "not UTF-8")
                continue
            yield Row(number, dict(zip(header, fields, strict=True)))


@contextlib.contextmanager
def _unzipping(table: Table) -> Iterator[None]:
    """A damaged gzip stream said as the table's problem, in one line."""
    try:
        yield
    except (gzip.BadGzipFile, EOFError, zlib.error) as error:
        raise SourceError(f"{table.shown}: not a readable gzip file ({describe(error, with_type=True)})") from None


def is_utf8(text: str) -> bool:
    """Whether a name or field read from bytes (the undecodable ones kept as lone surrogates, as
    os.listdir and surrogateescape keep them) is UTF-8 text, the only text JSON (the manifest,
    errors.jsonl) and a shard's member names can hold."""
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _parquet_rows(table: Table) -> Iterator[Row]:
    import pyarrow.parquet as pq  # here: a source without a parquet table never loads pyarrow

    try:
        # (pre_buffer reads ahead whole column chunks: more memory held, for a local file that
        # streams as fast without it)
        handle = pq.ParquetFile(table.path, pre_buffer=False)
    except Exception as error:  # pyarrow's ArrowInvalid, OSError...: the file is not parquet
        raise SourceError(f"{table.shown}: not a readable parquet file ({describe(error)})") from None
    schema = handle.schema_arrow
    table.found = list(schema.names)
    table.types = {column.name: column.type for column in schema}
    number = 0
    try:
        for batch in handle.iter_batches(batch_size=_PARQUET_BATCH, columns=_parquet_wanted(table)):
            for values in batch.to_pylist():
                number += 1
                yield Row(number, values)
    except Exception as error:
        raise SourceError(f"{table.shown}: unreadable after row {number} ({describe(error)})") from None


def _parquet_wanted(table: Table) -> list[str]:
    """The parquet columns a pass reads: only those a sample takes (a column left out is neither
    read nor checked: its type may be one no datetime or JSON holds). The first pass, before the
    columns are resolved, needs only the path and the label."""
    config = table.config
    if table.columns is None:
        wanted = [config.path_column, config.label_column]
    else:
        wanted = [config.path_column, table.caption, config.label_column, *table.columns]
    names = list(dict.fromkeys(name for name in wanted if name is not None and name in table.types))
    return names or table.found[:1]  # (no path column: every row says so, then the table is refused)


def check_storable(table: Table, names: list[str]) -> None:
    """Each of these parquet columns holds values shardkit can store, else a SourceError naming it."""
    for name in names:
        kind = table.types.get(name)
        if kind is not None and not _storable(kind):
            raise SourceError(
                f"{table.shown}: column {name!r} has type {kind}, which shardkit cannot store "
                "(strings, numbers, booleans, and lists and structs of them); leave it out with --columns"
            )


def _storable(kind: Any) -> bool:
    import pyarrow.types as pa_types

    if pa_types.is_dictionary(kind):  # pandas' categorical: its values are what a row reads
        return _storable(kind.value_type)
    if pa_types.is_list(kind) or pa_types.is_large_list(kind) or pa_types.is_fixed_size_list(kind):
        return _storable(kind.value_type)
    if pa_types.is_struct(kind):
        return all(_storable(kind.field(i).type) for i in range(kind.num_fields))
    return bool(
        pa_types.is_null(kind)
        or pa_types.is_boolean(kind)
        or pa_types.is_integer(kind)
        or pa_types.is_floating(kind)
        or pa_types.is_string(kind)
        or pa_types.is_large_string(kind)
        or (hasattr(pa_types, "is_string_view") and pa_types.is_string_view(kind))
    )


def clean_relpath(value: Any) -> str | None:
    """A row's path relative to the source, normalized, or None when it is not one: not a
    non-empty string, absolute, or climbing out with '..' (nothing outside SRC is ever read)."""
    if not isinstance(value, str) or not value or "\0" in value:
        return None
    text = value.replace("\\", "/") if os.sep == "\\" else value
    if text.startswith("/") or re.match(r"[A-Za-z]:", text):
        return None
    normal = posixpath.normpath(text)
    if normal == ".." or normal.startswith("../") or normal == ".":
        return None
    return normal
