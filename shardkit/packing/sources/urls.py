"""The URL-table convention: a table file (CSV, TSV, JSONL, gzipped or not, or parquet: rows.py
reads them) whose rows name images by http(s) URL, with a caption, a label and columns, as
LAION, DataComp, COYO and CC12M ship. The worker downloads them (storage/download.py).

Read twice, streamed both times, as a metadata table is (table.py): the first pass counts the rows
and keeps an 8-byte hash of each URL (duplicates) and the class names; the second yields the items
in row order. Memory grows by 4 bytes a row (10 M rows: 40 MB), never by the rows themselves.
A row's key is its place in the table (`000000042`), so keys sort as the rows do and never depend
on the URL; a row that cannot be taken (no URL, not http(s), a second row naming the same URL,
a bad caption) is a Failure naming its URL, or its line where it has none.
"""

from __future__ import annotations

import os
import re
from array import array
from collections.abc import Iterator
from dataclasses import replace

from ...core.config import TableConfig, WebConfig
from ...core.errors import Failure, SourceError
from ...core.safeio import file_stamp
from .item import Item, SourceWalk, display
from .rows import Table, read_rows, table_kind
from .table import LabelKinds, RealPaths, Rows, caption_and_columns, check_columns, table_label

SHA256_COLUMN = "sha256"  # where a table has it, each download is checked against it
_SHA256 = re.compile(r"[0-9a-fA-F]{64}")


def url_table(path: str, table: TableConfig, web: WebConfig) -> Table | None:
    """The URL table `path` is, or None when it is not one (a list file: `path[,label]` lines).
    Parquet and JSONL files are always tables; a CSV or TSV file is one when its header names the
    URL column (a list file has no header)."""
    kind = table_kind(path)
    if kind is None:
        return None
    config = replace(table, path_column=web.url_column)
    found = Table(path, kind, config, os.path.basename(path))
    if kind in ("csv", "tsv"):
        rows = read_rows(found)  # (its first step reads the header: `found.found` lists it)
        try:
            next(rows, None)
        except SourceError:  # not a CSV table's header: a list file's line
            return None
        finally:
            rows.close()
        if web.url_column not in found.found:
            return None
    return found


def from_urls(table: Table, labels: str, keys: bool) -> SourceWalk:
    """The walk of a URL table: items whose `path` is the URL (credentials and all, for the
    download) and whose `relpath` is the URL as reports show it (credentials redacted)."""
    if labels == "folders":
        raise SourceError(f"{display(table.shown)}: a table of URLs has no folders; labels come from --label-column")
    config = table.config
    label_column = config.label_column if labels != "none" else None
    before = file_stamp(table.path)
    url_hashes = array("I")  # 4 bytes a row: a hash two URLs share only makes them suspects, compared whole later
    labels_seen = LabelKinds(label_column)
    for row in read_rows(table):
        if row.values is None:
            continue
        url = row.values.get(config.path_column)
        if isinstance(url, str) and url:
            url_hashes.append(_hash32(url))
        labels_seen.see(row.values)
    check_columns(table, flag="--url-column")
    classes = labels_seen.classes(table)
    import numpy as np  # (here: the pack driver of a folder never imports numpy)

    hashes = np.frombuffer(url_hashes, dtype=np.uint32)
    hashes.sort()  # in place: duplicates are neighbours
    repeated = set(hashes[1:][hashes[1:] == hashes[:-1]].tolist())
    del hashes, url_hashes
    width = max(9, len(str(table.rows - 1)))
    rows = Rows(table, label_column, {name: i for i, name in enumerate(classes)}, repeated, set(), keys, before,
                RealPaths(os.path.dirname(table.path)))  # fmt: skip
    found = SourceWalk(table.shown, "urls", [], classes, [], table=table)  # (its root: the table itself)
    found.items = _url_items(rows, found.skipped, width)
    return found


def _url_items(rows: Rows, skipped: list[Failure], width: int) -> Iterator[Item]:
    from ...storage.webget import redact, url_problem  # (urllib3: only for a table of URLs)

    table = rows.table
    column = table.config.path_column
    taken: dict[int, list[str]] = {}  # URL hash -> the URLs taken, for the few hashes seen twice
    unit = "row" if table.kind == "parquet" else "line"
    for ordinal, row in enumerate(read_rows(table)):
        where = f"{table.name} {unit} {row.line}"
        if row.values is None:
            skipped.append(Failure(where, "discover", f"{table.name} {row.problem}"))
            continue
        url = row.values.get(column)
        if not isinstance(url, str) or not url:
            why = "no URL" if url is None or url == "" else "not a URL"
            skipped.append(Failure(where, "discover", f"{where}: {why} in column {column!r}"))
            continue
        shown = display(redact(url))
        problem = url_problem(url)
        if problem:
            skipped.append(Failure(shown, "discover", f"{where}: {problem}"))
            continue
        hashed = _hash32(url)
        if hashed in rows.repeated:
            if url in taken.setdefault(hashed, []):  # (the row is the input left out: the URL is packed)
                skipped.append(Failure(shown, "discover", f"{where}: the URL is named by an earlier row too"))
                continue
            taken[hashed].append(url)
        label, problem = table_label(row.values, rows)
        text, columns = None, None
        if not problem:
            text, columns, problem = caption_and_columns(row.values, table)
        if not problem and columns is not None:
            problem = _sha256_problem(columns.get(SHA256_COLUMN))
        if problem:
            skipped.append(Failure(shown, "discover", f"{where}: {problem}"))
            continue
        yield Item(url, shown, f"{ordinal:0{width}d}" if rows.keys else "", label, text, columns)
    if file_stamp(table.path) != rows.stamp:
        raise SourceError(f"{table.shown}: changed while it was being read; pack again (--resume keeps what was done)")


def _hash32(url: str) -> int:
    return hash(url) & 0xFFFFFFFF


def _sha256_problem(value: object) -> str:
    if value is None or value == "" or (isinstance(value, str) and _SHA256.fullmatch(value)):
        return ""
    return f"column {SHA256_COLUMN!r} holds {str(value)[:80]!r}, not a sha256 in hex"


def expected_sha256(item: Item) -> str | None:
    """The sha256 a row's table gives for its image, lower case, or None."""
    value = item.columns.get(SHA256_COLUMN) if item.columns is not None else None
    return value.lower() if isinstance(value, str) and value else None
