"""The URL-table convention (`UrlSource`): a table file (CSV, TSV, JSONL, gzipped or not, or parquet:
rows.py reads them) whose rows name images by http(s) URL, with a caption, a label and columns, as
LAION, DataComp, COYO and CC12M ship; the table itself may be an object (s3://.../part-0.parquet) or
at a URL, or in parts: a local folder of table files or a glob of them (url_parts.py), read as one
table, part after part. The worker downloads the images (`Downloads`, packing/fetched.py).

Read twice, streamed both times, as a metadata table is (table.py): the first pass counts the rows
and keeps a 4-byte hash of each URL (duplicates, across all parts) and the class names (one
vocabulary for all parts); the second yields the items in row order. Memory grows by 4 bytes a row
(10 M rows: 40 MB), never by the rows themselves. A row's key is its place in the table
(`000000042`), or in parts its part's place and its own (`00003-000000042`), so keys sort as the
rows do and never depend on the URL; a row that cannot be taken (no URL, not http(s), a second row
naming the same URL, a bad caption) is a Failure naming its URL, or its line where it has none.
"""

from __future__ import annotations

import os
import re
import shutil
import weakref
from array import array
from collections.abc import Generator, Iterator
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING

from ...core.config import PackConfig, TableConfig, WebConfig
from ...core.errors import ConfigError, Failure, SourceError
from ...core.safeio import file_stamp
from ...storage.urls import is_remote
from ..reading import Outcome, Packing, Reading
from .base import HeaderReads, Labelling, Source, SourceWalk, WalkOptions
from .bucket import fetch_copy
from .item import Item, display
from .labelling import column_labels
from .rows import Table, read_rows, table_kind
from .table import LabelKinds, RealPaths, Rows, caption_and_columns, check_columns, table_label
from .url_parts import glob_parts, is_glob, is_remote_glob, part_key_format, part_name, table_folder_parts

if TYPE_CHECKING:
    from ...runtime.lanes import Admission
    from ..objects import Transfer

SHA256_COLUMN = "sha256"  # where a table has it, each download is checked against it
_SHA256 = re.compile(r"[0-9a-fA-F]{64}")


class UrlSource(Source):
    """A table of URLs: a local table file whose header names the URL column, a local folder or
    glob of table parts (url_parts.py), or a table that is itself an object or at a URL (fetched
    to a temporary copy when it is walked)."""

    KIND = "urls"
    downloads = True

    def __init__(self, options: WalkOptions, tables: list[Table] | None = None) -> None:
        super().__init__(options)
        self.tables = tables  # a local table's parts (one for a table file), found when opened

    @classmethod
    def open(cls, options: WalkOptions) -> UrlSource | None:
        root = options.source
        if is_remote(root):
            if is_remote_glob(root):
                raise SourceError(
                    f"{root}: a glob of remote tables is not read; give one table, or copy its parts to a local folder"
                )
            return cls(options) if table_kind(root) is not None else None
        web = options.web or WebConfig()
        if os.path.isfile(root):
            found = url_table(root, options.table or TableConfig(), web)
            if found is None:
                return None
            if options.table is not None and options.table.path is not None:
                raise SourceError(f"{display(root)}: is a table of URLs itself; --metadata is for a source folder")
            if options.sidecars:
                raise SourceError(f"{display(root)}: a table of URLs has no sidecar files; leave out --sidecars")
            return cls(options, [found])
        parts = _local_parts(options)
        if parts is None:
            return None
        if (options.table is not None and options.table.path is not None) or options.sidecars:
            raise SourceError(f"{display(root)}: a table of URLs takes neither --metadata nor --sidecars")
        config = replace(options.table or TableConfig(), path_column=web.url_column)
        return cls(options, [Table(path, table_kind(path) or "", config, part_name(path, root)) for path in parts])

    def walk(self) -> SourceWalk:
        if self.tables is None:
            return self._remote_walk()
        return from_urls(self, self.tables, self.options.labels, self.options.keys)

    def _remote_walk(self) -> SourceWalk:
        """A table of URLs that is itself an object (s3://.../laion.parquet, https://.../part-0.parquet):
        fetched to a temporary copy that lives as long as the walk, then read as a local one."""
        options, url = self.options, self.root
        path, local = fetch_copy(url, options.storage_options, "table")
        found = url_table(path, options.table or TableConfig(), options.web or WebConfig())
        if found is None:
            shutil.rmtree(local, ignore_errors=True)
            column = (options.web or WebConfig()).url_column
            raise SourceError(f"{url}: no {column!r} column; name it with --url-column")
        found.url = url
        if (options.table is not None and options.table.path is not None) or options.sidecars:
            shutil.rmtree(local, ignore_errors=True)
            raise SourceError(f"{url}: a table of URLs takes neither --metadata nor --sidecars")
        walked = from_urls(self, [found], options.labels, options.keys)
        weakref.finalize(found, shutil.rmtree, local, True)  # the copy lives as long as the walk reading it
        return walked

    def refuse(self, config: PackConfig) -> None:
        """Besides a remote source's refusals: what needs every image before the pack, which a
        table of URLs downloads only while packing."""
        super().refuse(config)
        if config.dedup != "none":
            raise ConfigError(
                f"{config.source}: --dedup compares the images before packing, and a table of URLs is downloaded "
                "while packing; pack it, then run `shardkit duplicates OUT`"
            )
        if config.shard_bytes is not None:
            raise ConfigError(
                f"{config.source}: --shard-bytes estimates each image's output from its local file, and a table "
                "of URLs is downloaded while packing; use --shard-size"
            )

    def labelling(self, found: SourceWalk, labels: str) -> Labelling:
        return column_labels(found, labels)

    def reading(self, config: PackConfig) -> Reading:
        return Downloads(config.web)

    def header_reads(self, found: SourceWalk, transfer: Transfer) -> HeaderReads:
        """Each header by range requests, waiting on the network: on threads."""
        from ..fetched import probe_urls, url_digest  # (urllib3: only for tables of URLs)

        web = self.options.web or WebConfig()
        return HeaderReads(partial(probe_urls, web, transfer), partial(url_digest, web))


@dataclass(frozen=True)
class Downloads(Reading):
    """How a worker reads a table of URLs' rows: a shard's images downloaded ahead on the process's
    threads, each encoded as it arrives and handed on in row order (packing/fetched.py). A shard
    that --resume writes again because some of its rows failed transiently keeps the records of
    its file `shard` and the rows that failed for good (`earlier`), and downloads only the others;
    `earlier_counts` are the PICTURE_COUNTS of the records it keeps (None: not counted)."""

    web: WebConfig
    shard: str = ""
    earlier: list[Failure] | None = None
    earlier_counts: dict[str, int] | None = None

    def may_split(self) -> bool:
        return self.earlier is None  # (a shard written again keeps its file's records, read in order)

    def admission(self) -> Admission:
        from ..fetched import DownloadAdmission

        return DownloadAdmission.of(self.web)

    def packed(self, packing: Packing) -> Generator[Outcome, None, None]:
        from ..fetched import downloaded, refetched  # (urllib3 and threads: only for URL tables)

        sha256s = [expected_sha256(item) for item in packing.items]
        if self.earlier is None:
            return downloaded(packing, self.web, sha256s)
        return refetched(packing, self.web, sha256s, self.shard, self.earlier)

    def shard_counts(self, counts: dict[str, int]) -> dict[str, int] | None:
        if self.earlier is None:
            return dict(counts)
        if self.earlier_counts is None:
            return None
        return {name: count + self.earlier_counts.get(name, 0) for name, count in counts.items()}

    def resumed(self, earlier: list[Failure], counts: dict[str, int] | None, shard: str) -> Reading:
        return replace(self, shard=shard, earlier=earlier, earlier_counts=counts)


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


def _local_parts(options: WalkOptions) -> list[str] | None:
    """The parts of a local folder of tables or of a glob, None when the source is neither (a
    folder given --metadata is the table convention's)."""
    root = options.source
    if os.path.isdir(root):
        return None if options.table is not None and options.table.path is not None else table_folder_parts(root)
    return glob_parts(root) if is_glob(root) else None


def from_urls(source: Source, tables: list[Table], labels: str, keys: bool) -> SourceWalk:
    """The walk of a URL table for `source`, in one part or several (`tables`, read in turn): items
    whose `path` is the URL (credentials and all, for the download) and whose `relpath` is the URL
    as reports show it (credentials redacted). Every part is read once before any item is yielded,
    so a part that cannot be read is refused before any work."""
    root = source.root
    if labels == "folders":
        raise SourceError(f"{display(root)}: a table of URLs has no folders; labels come from --label-column")
    config = tables[0].config
    label_column = config.label_column if labels != "none" else None
    url_hashes = array("I")  # 4 bytes a row: a hash two URLs share only makes them suspects, compared whole later
    labels_seen = LabelKinds(label_column)
    stamps = [_first_pass(table, url_hashes, labels_seen, len(tables) > 1) for table in tables]
    whole = tables[0] if len(tables) == 1 else _whole(root, tables)
    if not whole.rows:
        raise SourceError(f"{display(root)}: its {len(tables)} table parts have no rows")
    classes = labels_seen.classes(whole)
    import numpy as np  # (here: the pack driver of a folder never imports numpy)

    hashes = np.frombuffer(url_hashes, dtype=np.uint32)
    hashes.sort()  # in place: duplicates are neighbours
    repeated = set(hashes[1:][hashes[1:] == hashes[:-1]].tolist())
    del hashes, url_hashes
    class_index = {name: i for i, name in enumerate(classes)}
    parts = [
        Rows(table, label_column, class_index, repeated, set(), keys, stamp, RealPaths(os.path.dirname(table.path)))
        for table, stamp in zip(tables, stamps, strict=True)
    ]
    found = SourceWalk(root, source, [], classes, [], table=whole)  # (its root: the table, its folder or glob)
    found.items = _url_items(parts, found.skipped, part_key_format([table.rows for table in tables]))
    return found


def _first_pass(
    table: Table, url_hashes: array[int], labels_seen: LabelKinds, several: bool
) -> tuple[int, int, int, int] | None:
    """One part's first read: its URLs' hashes and labels noted, its columns checked (an empty part
    among several has nothing to check); returns its stamp from before the read."""
    before = file_stamp(table.path)
    column = table.config.path_column
    for row in read_rows(table):
        if row.values is None:
            continue
        url = row.values.get(column)
        if isinstance(url, str) and url:
            url_hashes.append(_hash32(url))
        labels_seen.see(row.values)
    if table.rows or not several:
        check_columns(table, flag="--url-column")
    return before


def _whole(root: str, tables: list[Table]) -> Table:
    """The table that the parts make, as probe's census and the labels' words name it: its rows and
    columns are all the parts' (it is never read itself)."""
    columns = list(dict.fromkeys(name for table in tables for name in table.found))
    name = f"{display(root)} ({len(tables)} parts)"
    return Table(root, tables[0].kind, tables[0].config, name, found=columns, rows=sum(t.rows for t in tables))


def _url_items(parts: list[Rows], skipped: list[Failure], key_formats: list[str]) -> Iterator[Item]:
    taken: dict[int, list[str]] = {}  # URL hash -> the URLs taken, for the few hashes seen twice (all parts)
    for rows, key_format in zip(parts, key_formats, strict=True):
        yield from _part_items(rows, skipped, key_format, taken)


def _part_items(rows: Rows, skipped: list[Failure], key_format: str, taken: dict[int, list[str]]) -> Iterator[Item]:
    from ...storage.webget import redact, url_problem  # (urllib3: only for a table of URLs)

    table = rows.table
    column = table.config.path_column
    unit = "row" if table.kind == "parquet" else "line"
    for ordinal, row in enumerate(read_rows(table)):
        where = f"{table.name} {unit} {row.line}"
        if row.values is None:
            skipped.append(Failure(where, "discover", row.problem))
            continue
        url = row.values.get(column)
        if not isinstance(url, str) or not url:
            why = "no URL" if url is None or url == "" else "not a URL"
            skipped.append(Failure(where, "discover", f"{why} in column {column!r}"))
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
        yield Item(url, shown, key_format.format(ordinal) if rows.keys else "", label, text, columns)
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
