"""The table convention (`TableSource`): a source folder whose samples are the rows of a metadata
table (rows.py reads CSV, TSV, JSONL and parquet): each row names its image by a path inside the
folder, with a caption, a label and columns. Read twice, streamed both times: the first pass keeps
8-byte hashes of every path and key (duplicates, key clashes, files without a row) and the class
names; the second yields the items, in row order. A path is compared as the file it names
(`RealPaths`: its folder's links followed), so two rows naming one file through a linked folder are
a duplicate."""

from __future__ import annotations

import math
import os
import re
from array import array
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ...core.config import TableConfig
from ...core.errors import Failure, SourceError
from ...core.safeio import file_stamp
from ...storage.urls import is_remote
from .base import Labelling, Source, SourceWalk, WalkOptions
from .folder import IMAGE_EXTENSIONS, check_folder, listing, walk_runs
from .item import Caption, Item, Run, Span, display, make_key, row_json, skip, whole_label
from .labelling import column_labels
from .rows import MAX_EXTRA_BYTES, Table, check_storable, clean_relpath, find_table, read_rows

if TYPE_CHECKING:  # (imported where a table is read: the pack driver of a folder never needs numpy)
    import numpy as np

SPAN_COLUMNS = ("start", "end")  # a video table with both: a row is one clip, this span (seconds) of its video
_DECIMAL = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")  # a cell's seconds
SPAN_ROW_DIGITS = 9  # a span clip's key: `<video key>_000000003`, the row's line: sorts in row order
NO_FILE = "no such file"  # how a row naming no file ends its reason (probe counts those rows apart)
# The caption column when --caption-column names none: the first of these the table has (a row's
# caption is text, or a list of texts: "captions" is Hugging Face's name for several)
CAPTION_COLUMNS = ("caption", "captions", "text")


class TableSource(Source):
    """A source folder with a metadata table: a sample a row, in row order (a bucket's prefix with
    one is walked alike, by bucket.py)."""

    KIND = "table"

    def __init__(self, options: WalkOptions, table: Table) -> None:
        super().__init__(options)
        self.table = table

    @classmethod
    def open(cls, options: WalkOptions) -> TableSource | None:
        if not os.path.isdir(options.source):
            return None
        check_folder(options.source)
        metadata = find_table(options.source, options.table or TableConfig())
        if metadata is None:
            return None
        refuse_sidecars(options.source, metadata, options.sidecars)
        return cls(options, metadata)

    def walk(self) -> SourceWalk:
        return from_table(self, self.root, self.table, self.options.labels, self.options.keys)

    def labelling(self, found: SourceWalk, labels: str) -> Labelling:
        return column_labels(found, labels)

    @property
    def confine(self) -> str | None:
        """A local table's rows may name only files in its folder (a bucket has no links: a row's
        path is checked to stay under the prefix)."""
        return None if is_remote(self.root) else os.path.realpath(self.root)


def refuse_sidecars(root: str, table: Table, sidecars: bool) -> None:
    """--sidecars asked of a source whose samples are a table's rows (a folder's or a bucket's)."""
    if sidecars:
        raise SourceError(f"{display(root)}: samples come from {table.name}; --sidecars is for folders without a table")


def from_table(
    source: Source,
    root: str,
    table: Table,
    labels: str,
    keys: bool,
    real: Callable[[str], str] | None = None,
    images: Callable[[], Iterable[Run]] | None = None,
    spans: bool = False,
) -> SourceWalk:
    """A table's walk, for `source`. `real(rel)` names the file a row's path names (default: its folder's links
    resolved, `RealPaths`), and `images()` walks the images under the source (default: the local
    folder's walk), for those no row names; a bucket gives its own. With `spans` (a table of videos)
    and both SPAN_COLUMNS in the table, each row names a video and a span of it: one clip a row, and
    rows may share a video."""
    if labels == "folders":
        raise SourceError(f"{display(root)}: samples come from {table.name}; labels come from a column, not folders")
    config = table.config
    label_column = config.label_column if labels != "none" else None
    before = file_stamp(table.path)
    path_hashes, key_hashes = array("q"), array("q")
    labels_seen = LabelKinds(label_column)
    real = real or RealPaths(root)
    for row in read_rows(table):
        rel = None if row.values is None else clean_relpath(row.values.get(config.path_column))
        if rel is None or row.values is None:
            continue
        path_hashes.append(hash(real(rel)))
        key_hashes.append(hash(make_key(rel)))
        labels_seen.see(row.values)
    check_columns(table)
    spans = spans and has_spans(table)
    if spans and table.config.columns is None:  # (a clip's meta holds its span already, as numbers)
        table.columns = [name for name in table.columns or () if name not in SPAN_COLUMNS]
    classes = labels_seen.classes(table)
    import numpy as np

    # Sorted in place (the arrays' own buffers: no copy), duplicates are neighbours. A path two rows
    # name counts as a key clash too, so its one packed copy keeps its extension: rare, and harmless.
    paths = np.frombuffer(path_hashes, dtype=np.int64)
    stems = np.frombuffer(key_hashes, dtype=np.int64)
    if spans:  # rows naming one video share its key by right: only two videos' keys clash
        stems = np.unique(np.stack([paths, stems], axis=1), axis=0)[:, 1].copy()
    paths.sort()
    repeated = set(paths[1:][paths[1:] == paths[:-1]].tolist())  # paths (by hash) that two rows name
    stems.sort()
    clashing = set(stems[1:][stems[1:] == stems[:-1]].tolist())  # keys two files would share: keep extensions
    del stems, key_hashes
    found = SourceWalk(root, source, [], classes, [], table=table)
    class_index = {name: i for i, name in enumerate(classes)}
    rows = Rows(table, label_column, class_index, repeated, clashing, keys, before, real, spans)
    # A local row naming no file is said at its line, as every other bad row is (one lstat a row; a
    # bucket's rows are checked by the worker's read, which names the object)
    exists = (lambda rel: os.path.lexists(os.path.join(root, rel))) if images is None else None
    found.items = _table_items(root, rows, found.skipped, paths, images or (lambda: _local_images(root)), exists)
    return found


class RealPaths:
    """A row's path as the file it names: its folder resolved (links followed) relative to the
    source's real folder, its name as written. `a/self/in.jpg`, where `a/self` links to `../a`, is
    `a/in.jpg`: one file, however many rows spell it. One realpath per folder, cached (bounded: rows
    come folder by folder), so a row costs a dict lookup; a folder outside the source keeps its
    spelling (the worker refuses to read there)."""

    _CACHED = 65_536  # folders

    def __init__(self, root: str) -> None:
        self.root = root
        self.real_root = os.path.realpath(root)
        self.folders: dict[str, str] = {}  # a row's folder -> its real folder + "/" ("" at the root)

    def __call__(self, rel: str) -> str:
        folder, slash, name = rel.rpartition("/")
        if not slash:
            return rel  # (a file at the root: its folder is the root, resolved already)
        real = self.folders.get(folder)
        if real is None:
            if len(self.folders) >= self._CACHED:
                self.folders.clear()
            resolved = os.path.realpath(os.path.join(self.root, folder))
            if resolved == self.real_root:
                real = ""
            elif resolved.startswith(self.real_root + os.sep):
                real = resolved[len(self.real_root) + 1 :].replace(os.sep, "/") + "/"
            else:
                real = folder + "/"
            self.folders[folder] = real
        return real + name


@dataclass
class Rows:
    """What the first read of a table settled, for the second."""

    table: Table
    label_column: str | None
    class_index: dict[str, int]
    repeated: set[int]
    clashing: set[int]
    keys: bool
    stamp: tuple[int, int, int, int] | None
    real: Callable[[str], str]  # the path hashes above are of real paths
    spans: bool = False  # rows are spans of videos (a video named by many rows)


class LabelKinds:
    """What a table's label column holds, seen row by row in a first pass: class names (their
    sorted list is the classes) or whole numbers, never both."""

    def __init__(self, column: str | None) -> None:
        self.column = column
        self.names: set[str] = set()
        self.numbers = False

    def see(self, values: dict[str, Any]) -> None:
        if self.column is None:
            return
        value = values.get(self.column)
        if isinstance(value, str) and value and not re.fullmatch(r"[0-9]+", value):
            self.names.add(value)
        elif value is not None and value != "":
            self.numbers = True

    def classes(self, table: Table) -> list[str]:
        if self.names and self.numbers:
            raise SourceError(f"{table.shown}: column {self.column!r} mixes class names and numbers")
        return sorted(self.names, key=os.fsencode)


def check_columns(table: Table, flag: str = "--path-column") -> None:
    """The table has rows, and the columns the flags name exist; the caption column is resolved
    (CAPTION_COLUMNS: "caption", else "captions", Hugging Face's list of several, else "text").
    The column that names each sample's image (a path, or a URL) is set with `flag`."""
    if not table.rows:
        raise SourceError(f"{table.shown}: the table has no rows")
    config, found = table.config, table.found
    shown = ", ".join(found[:20]) + (", ..." if len(found) > 20 else "") if found else "no columns"
    if config.path_column not in found:
        raise SourceError(f"{table.shown}: no {config.path_column!r} column ({shown}); name it with {flag}")
    for what, name in (("label", config.label_column), ("caption", config.caption_column)):
        if name is not None and name not in found:
            raise SourceError(f"{table.shown}: no {what} column {name!r} ({shown})")
    table.caption = config.caption_column or next((name for name in CAPTION_COLUMNS if name in found), None)
    taken = {config.path_column, config.label_column, table.caption}
    if config.columns is not None:
        missing = [name for name in config.columns if name not in found]
        if missing:
            raise SourceError(f"{table.shown}: no column {missing[0]!r} ({shown})")
        table.columns = [name for name in config.columns if name not in taken]
    else:
        table.columns = [name for name in found if name not in taken]
    kept = [config.path_column, table.caption, config.label_column, *table.columns]
    check_storable(table, [name for name in kept if name is not None])


def _table_items(
    root: str,
    rows: Rows,
    skipped: list[Failure],
    rowed: np.ndarray,
    images: Callable[[], Iterable[Run]],
    exists: Callable[[str], bool] | None,
) -> Iterator[Item]:
    table = rows.table
    path_column = table.config.path_column
    taken: dict[int, list[str]] = {}  # path hash -> the paths taken, for the few hashes seen twice
    unit = "row" if table.kind == "parquet" else "line"
    for row in read_rows(table):
        where = f"{table.name} {unit} {row.line}"
        if row.values is None:
            skipped.append(Failure(where, "discover", row.problem))
            continue
        raw = row.values.get(path_column)
        rel = clean_relpath(raw)
        if rel is None:
            shown = display(raw) if isinstance(raw, str) and raw else where
            why = "no path" if raw is None or raw == "" else "not a path inside the source folder"
            why = f"{why} in column {path_column!r}"
            skipped.append(Failure(shown, "discover", why if shown == where else f"{where}: {why}"))
            continue
        real = rows.real(rel)
        hashed = hash(real)
        if hashed in rows.repeated and not rows.spans:
            if real in taken.setdefault(hashed, []):  # (the row is the input left out: the file is packed)
                skipped.append(Failure(where, "discover", f"{display(rel)} is named by an earlier row too"))
                continue
            taken[hashed].append(real)
        if exists is not None and not exists(real):
            skipped.append(skip(rel, f"{where}: {display(rel)}: {NO_FILE}"))
            continue
        span, problem = row_span(row.values, where) if rows.spans else (None, "")
        label: int | None = None
        text: Caption | None = None
        columns: dict[str, Any] | None = None
        if not problem:
            label, problem = table_label(row.values, rows)
        if not problem:
            text, columns, problem = caption_and_columns(row.values, table)
        if problem:
            skipped.append(skip(rel, f"{where}: {problem}"))
            continue
        key = make_key(rel, keep_extension=hash(make_key(rel)) in rows.clashing) if rows.keys else ""
        if span is not None and key:  # one clip a row: the video's key and the row's number
            key = f"{key}_{row.line:0{SPAN_ROW_DIGITS}d}"
        yield Item(os.path.join(root, rel), rel, key, label, text, columns, span=span)
    if file_stamp(table.path) != rows.stamp:
        raise SourceError(f"{table.shown}: changed while it was being read; pack again (--resume keeps what was done)")
    _unrowed(images(), table.name, rowed, skipped, rows.real)


def has_spans(table: Table) -> bool:
    """Whether a video table's rows are spans: it has both SPAN_COLUMNS (its header, or a JSONL
    table's first row, says)."""
    return all(name in table.found for name in SPAN_COLUMNS)


def names_spans(table: Table) -> bool:
    """`has_spans`, read only as far as it takes to tell (a header; a JSONL table's rows until both
    columns are seen, or its end): what refuses --clip-stride before the walk reads the table."""
    rows = read_rows(table)
    try:
        for _ in rows:
            if has_spans(table):
                return True
    finally:
        rows.close()
    return has_spans(table)


def row_span(values: dict[str, Any], where: str) -> tuple[Span | None, str]:
    """(a span table row's span, "") or (None, why not): start and end numbers, end after start.
    (Whether the video holds the span is the worker's to say: it alone reads the video.)"""
    bounds: list[float] = []
    for name in SPAN_COLUMNS:
        value = values.get(name)
        if value is None or value == "":
            return None, f"no {name} in column {name!r}"
        number = seconds(value)
        if number is None:
            return None, f"{name} {str(value)[:40]!r} is not a number of seconds"
        bounds.append(number)
    start, end = bounds
    if end <= start:
        return None, f"end {end:g} s is not after start {start:g} s"
    return Span(start, end, where), ""


def seconds(value: Any) -> float | None:
    """A cell as a finite number of seconds, or None: a number, or text in decimal or scientific
    notation with ASCII digits (Python's float() takes '1_0', 'inf' and other digits too, which
    no table means as seconds)."""
    if isinstance(value, str):
        value = value.strip(" \t")
        if _DECIMAL.fullmatch(value) is None:
            return None
    elif isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:  # (an integer past float's range)
        return None
    return number if math.isfinite(number) else None


def table_label(values: dict[str, Any], rows: Rows) -> tuple[int | None, str]:
    column = rows.label_column
    if column is None:
        return None, ""
    value = values.get(column)
    if value is None or value == "":
        return None, f"no label in column {column!r}"
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        return None, f"label {str(value)[:40]!r} is neither a class name nor a whole number"
    if rows.class_index:
        index = rows.class_index.get(value) if isinstance(value, str) else None
        return (index, "") if index is not None else (None, f"label {str(value)[:40]!r} is not a class name")
    return whole_label(value)  # (a text label here is digits: the first pass took the others as names)


def caption_and_columns(values: dict[str, Any], table: Table) -> tuple[Caption | None, dict[str, Any] | None, str]:
    """(a row's caption, its columns, the problem that keeps the row out: "" when none). What is
    kept must store as canonical JSON within MAX_EXTRA_BYTES."""
    text = values.get(table.caption) if table.caption is not None else None
    if text is not None and not (
        isinstance(text, str) or (isinstance(text, list) and all(isinstance(t, str) for t in text))
    ):
        return None, None, f"the caption in column {table.caption!r} is not text or a list of texts"
    columns = {name: values[name] for name in table.columns or () if name in values} or None
    if text is None and columns is None:
        return None, None, ""
    try:
        encoded = row_json(text, columns)
    except ValueError:
        return None, None, "a column holds NaN or infinity, which JSON cannot store"
    try:
        size = len(encoded.encode("utf-8"))
    except UnicodeEncodeError:  # JSON may escape a lone surrogate ("\\ud800"): no UTF-8 text holds one
        return None, None, "a caption or column holds a lone surrogate, which is not text"
    if size > MAX_EXTRA_BYTES:
        return None, None, f"caption and columns take {size:,} bytes, over the {MAX_EXTRA_BYTES >> 20} MiB limit"
    return text, columns, ""


def _local_images(root: str) -> Iterator[Run]:
    return local_runs(root, IMAGE_EXTENSIONS)


def local_runs(root: str, extensions: frozenset[str]) -> Iterator[Run]:
    """The local folder's images (or videos: `extensions`), as runs (what is not taken is not a
    table's business)."""
    seen: set[tuple[int, int]] = set()
    ignored: list[Failure] = []
    top = listing(root, "", ignored, seen, False, extensions)
    prefix = root if root.endswith("/") else root + "/"
    return walk_runs(
        prefix, top, None, ignored, lambda rel_dir: listing(root, rel_dir, ignored, seen, False, extensions)
    )


def _unrowed(
    runs: Iterable[Run], name: str, rowed: np.ndarray, skipped: list[Failure], real: Callable[[str], str]
) -> None:
    """Images under the source that no row names (by real path: a row may name one through a linked
    folder): each is an input not packed, with its reason. (Other files, the table itself among
    them, are not samples of a table source.)"""
    import numpy as np

    for run in runs:
        hashes = np.fromiter((hash(real(rel)) for rel in run.relpaths), dtype=np.int64, count=len(run.relpaths))
        at = np.minimum(np.searchsorted(rowed, hashes), max(len(rowed) - 1, 0))
        missing = rowed[at] != hashes if len(rowed) else np.ones(len(hashes), dtype=bool)
        skipped.extend(skip(rel, f"no row in {name}") for rel, gone in zip(run.relpaths, missing, strict=False) if gone)
