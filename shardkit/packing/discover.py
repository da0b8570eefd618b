"""Walking a source: a folder of class sub-folders, a flat folder, or a list file.

Every image becomes an `Item` with a stable key derived from its relative path and an
optional integer label. Anything that is not taken is returned in `SourceWalk.skipped` with its
reason, so callers can account for every file they were pointed at.
"""

from __future__ import annotations

import itertools
import json
import os
import re
from array import array
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import quote

import numpy as np

from ..core.config import TableConfig
from ..core.errors import Failure, SourceError
from ..core.headers import EXTENSION_FORMATS
from .sidecars import sample_of, split_name
from .tables import MAX_EXTRA_BYTES, Table, clean_relpath, find_table, read_rows

IMAGE_EXTENSIONS = frozenset(EXTENSION_FORMATS)
# Characters kept as they are in keys; everything else (and '.') is percent-escaped so keys are
# ASCII, unique, and safe for tar member names where '.' separates the key from the extension.
_KEY_SAFE = "/ _-'()+,;=@!~&$[]"


class Item(NamedTuple):
    """One image to pack (a NamedTuple: a walk builds millions of them, 3x faster than a dataclass)."""

    path: str  # where to read the file
    relpath: str  # relative to the source root, '/'-separated: what the user sees and metadata keeps
    key: str
    label: int | None = None
    extra: str = ""  # a table row's caption and columns, as canonical JSON ("" when none)


def _skip(relpath: str, reason: str) -> Failure:
    """A file the walk does not take: a Failure at the discover stage."""
    return Failure(display(relpath), "discover", reason)


@dataclass(frozen=True)
class SourceList:
    root: str
    layout: str  # "folders", "flat" or "list"
    items: list[Item]
    classes: list[str] = field(default_factory=list)
    skipped: list[Failure] = field(default_factory=list)


def display(name: str) -> str:
    """A printable form of a file name that may hold undecodable bytes."""
    if name.isascii():
        return name
    return name.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def make_key(relpath: str, keep_extension: bool = False) -> str:
    stem = relpath if keep_extension else _strip_extension(relpath)
    return quote(os.fsencode(stem), safe=_KEY_SAFE).replace(".", "%2E")


def _strip_extension(relpath: str) -> str:
    head, _, name = relpath.rpartition("/")
    base, dot, _ext = name.rpartition(".")
    stem = base if dot and base else name
    return f"{head}/{stem}" if head else stem


def _check_folder(root: str) -> None:
    if not os.access(root, os.R_OK | os.X_OK):
        raise SourceError(f"{display(root)}: permission denied")


@dataclass
class SourceWalk:
    """A source being walked: layout and classes are known up front; `items` yields every image in
    byte order of the relative paths, as the walk finds them, and fills `skipped` as it goes.
    Only the folders on the current path are held in memory, never the whole list."""

    root: str
    layout: str  # "folders", "flat" or "list"
    items: Iterable[Item]
    classes: list[str] = field(default_factory=list)
    skipped: list[Failure] = field(default_factory=list)
    listed: SourceList | None = None  # a list file, read whole
    table: Table | None = None  # a metadata table the samples come from
    runs: Iterable[Run] | None = None  # a folder's walk, as runs of one folder's files (`items`, batched)


def walk(
    source: str | os.PathLike[str],
    labels: str = "auto",
    *,
    keys: bool = True,
    table: TableConfig | None = None,
    sidecars: bool = False,
) -> SourceWalk:
    """Start walking `source` (a folder or a list file); `labels` is auto, folders or none. A bad
    source is refused here, before any item is yielded. keys=False leaves the keys of a folder's
    items empty (probe has no use for them, and they cost more than the walk). A folder with a
    metadata table (`table.path`, or metadata.jsonl|csv|parquet at its root) has one sample per row."""
    if labels not in ("auto", "folders", "none"):
        raise SourceError(f"labels must be auto, folders or none, not {labels!r}")
    root = os.fspath(source)
    if not os.path.exists(root):
        raise SourceError(f"{display(root)}: no such file or folder")
    if os.path.isfile(root):
        if os.path.splitext(root)[1].lower() in IMAGE_EXTENSIONS:
            raise SourceError(f"{display(root)}: is an image; give the folder that holds it (or a list file)")
        if table is not None and table.path is not None:
            raise SourceError(f"{display(root)}: --metadata needs a source folder (the rows' paths are relative to it)")
        listed = _from_list(root)
        return SourceWalk(listed.root, listed.layout, listed.items, listed.classes, listed.skipped, listed)
    if not os.path.isdir(root):
        raise SourceError(f"{display(root)}: not a folder or a list file")
    _check_folder(root)
    metadata = find_table(root, table or TableConfig())
    if metadata is not None:
        if sidecars:
            raise SourceError(
                f"{display(root)}: samples come from {metadata.name}; --sidecars is for folders without a table"
            )
        return _from_table(root, metadata, labels, keys)
    if sidecars:
        if labels == "folders":
            raise SourceError(f"{display(root)}: with --sidecars, labels come from x.cls files, not folders")
        return _from_sidecars(root, keys)
    skipped: list[Failure] = []
    seen: set[tuple[int, int]] = set()  # folders the walk has entered
    top = _listing(root, "", skipped, seen, keys)  # the walk's first listing, made once
    top_level_images = any(not isinstance(part, str) for part in top)
    # a class is a top-level folder with an image somewhere below it (found without a full walk)
    folders = [part for part in top if isinstance(part, str)]
    # in walk order, sharing what was entered: a folder reached again (a link to an earlier class)
    # is skipped here as the walk will skip it
    entered = set(seen)
    holding = [] if top_level_images else [rel for rel in folders if _holds_image(root, rel, entered)]
    if not top_level_images and not holding:
        raise SourceError(f"{display(root)}: no images found (looked for {', '.join(sorted(IMAGE_EXTENSIONS))})")
    use_folders = labels == "folders" or (labels == "auto" and not top_level_images)
    if labels == "folders" and top_level_images:
        raise SourceError(f"{display(root)}: images at the top level, so sub-folders cannot be classes")
    classes = sorted(holding, key=os.fsencode) if use_folders else []
    found = SourceWalk(root, "folders" if use_folders else "flat", [], classes, skipped)
    class_index = {name: i for i, name in enumerate(classes)} if use_folders else None
    found.runs = walk_runs(root, top, class_index, skipped, seen, keys)
    found.items = itertools.chain.from_iterable(run.items() for run in found.runs)
    return found


class Run(NamedTuple):
    """Consecutive files of one folder in a walk: item i is Item(prefix + relpaths[i], relpaths[i],
    keys[i], label). Kept as lists, so a walk of millions of files takes no Python step per file."""

    prefix: str
    relpaths: list[str]
    keys: list[str]
    label: int | None

    def items(self) -> list[Item]:
        prefix, label = self.prefix, self.label
        return [Item(prefix + rel, rel, key, label) for rel, key in zip(self.relpaths, self.keys, strict=True)]


def walk_runs(
    root: str,
    top: list[str | tuple[list[str], list[str]]],
    classes: dict[str, int] | None,
    skipped: list[Failure],
    seen: set[tuple[int, int]],
    keys: bool,
) -> Iterator[Run]:
    """The images in byte order of their relative paths, depth first, as runs of one folder's
    files, from the root's listing `top` down. Each folder's entries are sorted by name, a folder's
    name with '/' after it: that is exactly the order of the full paths."""
    prefix = root if root.endswith("/") else root + "/"
    stack = [iter(top)]
    while stack:
        part = next(stack[-1], None)
        if part is None:
            stack.pop()
        elif isinstance(part, str):
            stack.append(iter(_listing(root, part, skipped, seen, keys)))
        else:
            relpaths, file_keys = part
            if classes is None:
                yield Run(prefix, relpaths, file_keys, None)
            elif (label := classes.get(relpaths[0].split("/", 1)[0])) is not None:  # one folder: one class
                yield Run(prefix, relpaths, file_keys, label)
            else:  # a folder that had no image when the classes were settled: never a silent new label
                skipped.extend(_skip(rel, "its class folder had no image when the walk began") for rel in relpaths)


def _entries(root: str, rel_dir: str, skipped: list[Failure], seen: set[tuple[int, int]]) -> list[os.DirEntry[str]]:
    """A folder's entries, or none (the reason in `skipped`) when it cannot be listed or a link led
    back into a folder already visited. Folder links are followed."""
    path = os.path.join(root, rel_dir) if rel_dir else root
    try:
        info = os.stat(path)
        if (info.st_dev, info.st_ino) in seen:
            skipped.append(_skip(rel_dir, "folder link loop (already visited)"))
            return []
        seen.add((info.st_dev, info.st_ino))
        with os.scandir(path) as entries_iterator:
            return list(entries_iterator)
    except OSError as error:
        skipped.append(_skip(rel_dir or ".", f"cannot list folder: {error.strerror}"))
        return []


def _sort_names(names: list[str]) -> None:
    """In byte order of the names, the order of a walk (folders carry a '/' after their name)."""
    if all(name.isascii() for name in names):
        names.sort()  # code-point order is byte order here, and sorting str is 10x cheaper
    else:
        names.sort(key=os.fsencode)


def _listing(
    root: str, rel_dir: str, skipped: list[Failure], seen: set[tuple[int, int]], keys: bool
) -> list[str | tuple[list[str], list[str]]]:
    """One folder's sub-folders (relpaths) and runs of image files between them ((relpaths, keys)),
    in sorted order; what is not taken goes to `skipped`. Folder links are followed, but a folder
    already visited is not entered again."""
    entries = _entries(root, rel_dir, skipped, seen)
    names: list[str] = []  # image files, and folders with a '/' after the name (their sort key)
    for entry in entries:
        name = entry.name
        if name.startswith("."):
            continue
        try:
            if entry.is_dir():
                names.append(name + "/")
                continue
            is_file = entry.is_file()
        except OSError as error:
            skipped.append(_skip(f"{rel_dir}/{name}" if rel_dir else name, f"cannot stat: {error.strerror}"))
            continue
        if is_file and (dot := name.rfind(".")) > 0 and name[dot:].lower() in IMAGE_EXTENSIONS:
            names.append(name)  # (os.path.splitext, minus its cost: hidden names never get here)
        else:
            reason = (
                "not an image file extension"
                if is_file
                else "broken link"
                if entry.is_symlink()
                else "not a regular file"
            )
            skipped.append(_skip(f"{rel_dir}/{name}" if rel_dir else name, reason))
    _sort_names(names)
    base = rel_dir + "/" if rel_dir else ""
    parts: list[str | tuple[list[str], list[str]]] = []  # sub-folders, and runs of files between them
    run: list[str] = []
    for name in names:
        if name[-1] == "/":
            if run:
                parts.append((run, _unique_keys(run) if keys else [""] * len(run)))
                run = []
            parts.append(base + name[:-1])
        else:
            run.append(base + name)
    if run:
        parts.append((run, _unique_keys(run) if keys else [""] * len(run)))
    return parts


def _holds_image(root: str, rel_dir: str, seen: set[tuple[int, int]]) -> bool:
    """Whether a folder has an image file somewhere below it; stops at the first one found. Folders
    in `seen` (entered before) are not entered again, and those entered here are added to it."""
    stack = [rel_dir]
    while stack:
        rel = stack.pop()
        path = os.path.join(root, rel)
        try:
            info = os.stat(path)
            if (info.st_dev, info.st_ino) in seen:
                continue
            seen.add((info.st_dev, info.st_ino))
            with os.scandir(path) as entries:
                for entry in entries:
                    name = entry.name
                    if name.startswith("."):
                        continue
                    try:
                        if entry.is_dir():
                            stack.append(f"{rel}/{name}")
                        elif (
                            entry.is_file() and (dot := name.rfind(".")) > 0 and name[dot:].lower() in IMAGE_EXTENSIONS
                        ):
                            return True
                    except OSError:
                        continue
        except OSError:
            continue
    return False


def _unique_keys(relpaths: list[str]) -> list[str]:
    """Keys of distinct relpaths: the extension is dropped unless that makes two files' keys
    collide (a.jpg and a.png; or a.jpg kept whole against a.jpg.png), in which case both keep it.
    Keys of files in different folders never collide, so a walk settles each folder on its own."""
    keys = [make_key(rel) for rel in relpaths]
    whole: set[int] = set()  # files whose key keeps the extension
    while True:
        owners: dict[str, list[int]] = {}
        for index, key in enumerate(keys):
            owners.setdefault(key, []).append(index)
        clashing = {index for group in owners.values() if len(group) > 1 for index in group} - whole
        if not clashing:
            return keys
        whole |= clashing
        for index in clashing:
            keys[index] = make_key(relpaths[index], keep_extension=True)


def _from_list(list_path: str) -> SourceList:
    """A text file with one `path[,label]` per line; relative paths are relative to the file."""
    base = os.path.dirname(os.path.abspath(list_path))
    try:
        lines = Path(list_path).read_text(encoding="utf-8", errors="surrogateescape").splitlines()
    except OSError as error:
        raise SourceError(f"{display(list_path)}: {error.strerror}") from None
    if any("\x00" in line for line in lines):
        raise SourceError(f"{display(list_path)}: not a text list file (expected one path[,label] per line)")
    raw: list[tuple[str, str | None]] = []
    for number, line in enumerate(lines, 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        path, sep, label = line.rpartition(",") if "," in line else (line, "", "")
        path, label = path.strip(), label.strip()
        if not path:
            raise SourceError(f"{display(list_path)}:{number}: no path before the comma")
        raw.append((path, label if sep else None))
    if not raw:
        raise SourceError(f"{display(list_path)}: the list is empty")
    labelled = [label for _, label in raw if label is not None]
    if labelled and len(labelled) != len(raw):
        raise SourceError(f"{display(list_path)}: some lines have a label and some do not")
    classes: list[str] = []
    if labelled and not all(re.fullmatch(r"[0-9]+", label) for label in labelled):
        if any(re.fullmatch(r"-[0-9]+", label) for label in labelled):
            raise SourceError(f"{display(list_path)}: labels must be 0 or more (or class names)")
        classes = sorted(set(labelled))
    index = {name: i for i, name in enumerate(classes)}

    def to_label(label: str | None) -> int | None:
        if label is None:
            return None
        return index[label] if classes else int(label)

    pairs = [(os.path.normpath(path).replace(os.sep, "/"), to_label(label)) for path, label in raw]
    skipped: list[Failure] = []
    items = _keyed(base, pairs, skipped)
    return SourceList(list_path, "list", items, classes, skipped)


def _keyed(root: str, pairs: list[tuple[str, int | None]], skipped: list[Failure]) -> list[Item]:
    """Items with unique keys (the rule of `_unique_keys`); a path listed twice is skipped."""
    shown_paths = sorted({rel.lstrip("/") for rel, _ in pairs})
    key_of = dict(zip(shown_paths, _unique_keys(shown_paths), strict=True))
    items: list[Item] = []
    seen: set[str] = set()
    for rel, label in pairs:
        shown = rel.lstrip("/")
        key = key_of[shown]
        if key in seen:
            skipped.append(_skip(shown, "listed more than once"))
            continue
        seen.add(key)
        path = rel if os.path.isabs(rel) else os.path.join(root, rel)
        items.append(Item(path, shown, key, label))
    return items


def _from_table(root: str, table: Table, labels: str, keys: bool) -> SourceWalk:
    """A source folder whose samples are the rows of a metadata table (tables.py): read twice,
    streamed, then the folder walked for images that no row names."""
    if labels == "folders":
        raise SourceError(f"{display(root)}: samples come from {table.name}; labels come from a column, not folders")
    config = table.config
    label_column = config.label_column if labels != "none" else None
    before = _stamp(table.path)
    path_hashes, key_hashes = array("q"), array("q")
    names: set[str] = set()
    numbers = False
    for row in read_rows(table):
        rel = None if row.values is None else clean_relpath(row.values.get(config.path_column))
        if rel is None or row.values is None:
            continue
        path_hashes.append(hash(rel))
        key_hashes.append(hash(make_key(rel)))
        if label_column is not None:
            value = row.values.get(label_column)
            if isinstance(value, str) and value and not re.fullmatch(r"[0-9]+", value):
                names.add(value)
            elif value is not None and value != "":
                numbers = True
    if not table.rows:
        raise SourceError(f"{table.path}: the table has no rows")
    _check_columns(table)
    if names and numbers:
        raise SourceError(f"{table.path}: column {label_column!r} mixes class names and numbers")
    classes = sorted(names, key=os.fsencode)
    # Sorted in place (the arrays' own buffers: no copy), duplicates are neighbours. A path two rows
    # name counts as a key clash too, so its one packed copy keeps its extension: rare, and harmless.
    paths = np.frombuffer(path_hashes, dtype=np.int64)
    paths.sort()
    repeated = set(paths[1:][paths[1:] == paths[:-1]].tolist())  # paths (by hash) that two rows name
    stems = np.frombuffer(key_hashes, dtype=np.int64)
    stems.sort()
    clashing = set(stems[1:][stems[1:] == stems[:-1]].tolist())  # keys two files would share: keep extensions
    del stems, key_hashes
    found = SourceWalk(root, "table", [], classes, [], table=table)
    rows = _Rows(table, label_column, {name: i for i, name in enumerate(classes)}, repeated, clashing, keys, before)
    found.items = _table_items(root, rows, found.skipped, paths)
    return found


@dataclass
class _Rows:
    """What the first read of a table settled, for the second."""

    table: Table
    label_column: str | None
    class_index: dict[str, int]
    repeated: set[int]
    clashing: set[int]
    keys: bool
    stamp: tuple[int, int]


def _stamp(path: str) -> tuple[int, int]:
    info = os.stat(path)
    return info.st_size, info.st_mtime_ns


def _check_columns(table: Table) -> None:
    """The columns the flags name exist; the caption column is resolved ("caption", else "text")."""
    config, found = table.config, table.found
    shown = ", ".join(found[:20]) + (", ..." if len(found) > 20 else "") if found else "no columns"
    if config.path_column not in found:
        raise SourceError(f"{table.path}: no {config.path_column!r} column ({shown}); name it with --path-column")
    for what, name in (("label", config.label_column), ("caption", config.caption_column)):
        if name is not None and name not in found:
            raise SourceError(f"{table.path}: no {what} column {name!r} ({shown})")
    table.caption = config.caption_column or next((name for name in ("caption", "text") if name in found), None)
    taken = {config.path_column, config.label_column, table.caption}
    if config.columns is not None:
        missing = [name for name in config.columns if name not in found]
        if missing:
            raise SourceError(f"{table.path}: no column {missing[0]!r} ({shown})")
        table.columns = [name for name in config.columns if name not in taken]
    else:
        table.columns = [name for name in found if name not in taken]


def _table_items(root: str, rows: _Rows, skipped: list[Failure], rowed: np.ndarray) -> Iterator[Item]:
    table = rows.table
    path_column = table.config.path_column
    taken: dict[int, list[str]] = {}  # path hash -> the paths taken, for the few hashes seen twice
    unit = "row" if table.kind == "parquet" else "line"
    for row in read_rows(table):
        where = f"{table.name} {unit} {row.line}"
        if row.values is None:
            skipped.append(Failure(where, "discover", f"{table.name} {row.problem}"))
            continue
        raw = row.values.get(path_column)
        rel = clean_relpath(raw)
        if rel is None:
            shown = display(raw) if isinstance(raw, str) and raw else where
            why = "no path" if raw is None or raw == "" else "not a path inside the source folder"
            skipped.append(Failure(shown, "discover", f"{where}: {why} in column {path_column!r}"))
            continue
        hashed = hash(rel)
        if hashed in rows.repeated:
            if rel in taken.setdefault(hashed, []):  # (the row is the input left out: the file is packed)
                skipped.append(Failure(where, "discover", f"{where}: {display(rel)} is named by an earlier row too"))
                continue
            taken[hashed].append(rel)
        label, problem = _table_label(row.values, rows)
        extra = ""
        if not problem:
            extra, problem = _extra(row.values, table)
        if problem:
            skipped.append(_skip(rel, f"{where}: {problem}"))
            continue
        key = make_key(rel, keep_extension=hash(make_key(rel)) in rows.clashing) if rows.keys else ""
        yield Item(os.path.join(root, rel), rel, key, label, extra)
    if _stamp(table.path) != rows.stamp:
        raise SourceError(f"{table.path}: changed while it was being read; pack again (--resume keeps what was done)")
    _unrowed(root, table.name, rowed, skipped)


def _table_label(values: dict[str, Any], rows: _Rows) -> tuple[int | None, str]:
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
    number = int(value)
    return (number, "") if number >= 0 else (None, f"label {number} is negative")


def _extra(values: dict[str, Any], table: Table) -> tuple[str, str]:
    """(a row's caption and columns as the canonical JSON stored with its item, "" when none;
    the problem that keeps the row out, "" when none)."""
    extra: dict[str, Any] = {}
    if table.caption is not None and (text := values.get(table.caption)) is not None:
        if not (isinstance(text, str) or (isinstance(text, list) and all(isinstance(t, str) for t in text))):
            return "", f"the caption in column {table.caption!r} is not text or a list of texts"
        extra["text"] = text
    columns = {name: values[name] for name in table.columns or () if name in values}
    if columns:
        extra["columns"] = columns
    if not extra:
        return "", ""
    try:
        encoded = json.dumps(extra, sort_keys=True, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except ValueError:
        return "", "a column holds NaN or infinity, which JSON cannot store"
    try:
        size = len(encoded.encode("utf-8"))
    except UnicodeEncodeError:  # JSON may escape a lone surrogate ("\ud800"): no UTF-8 text holds one
        return "", "a caption or column holds a lone surrogate, which is not text"
    if size > MAX_EXTRA_BYTES:
        return "", f"caption and columns take {size:,} bytes, over the {MAX_EXTRA_BYTES >> 20} MiB limit"
    return encoded, ""


def _unrowed(root: str, name: str, rowed: np.ndarray, skipped: list[Failure]) -> None:
    """Images under the source that no row names: each is an input not packed, with its reason.
    (Other files, the table itself among them, are not samples of a table source.)"""
    seen: set[tuple[int, int]] = set()
    ignored: list[Failure] = []
    top = _listing(root, "", ignored, seen, False)
    for run in walk_runs(root, top, None, ignored, seen, False):
        hashes = np.fromiter((hash(rel) for rel in run.relpaths), dtype=np.int64, count=len(run.relpaths))
        at = np.minimum(np.searchsorted(rowed, hashes), max(len(rowed) - 1, 0))
        missing = rowed[at] != hashes if len(rowed) else np.ones(len(hashes), dtype=bool)
        skipped.extend(
            _skip(rel, f"no row in {name}") for rel, gone in zip(run.relpaths, missing, strict=False) if gone
        )


def _from_sidecars(root: str, keys: bool) -> SourceWalk:
    """A folder walked as sidecar samples (sidecars.py): one item per image, its caption, columns,
    label and fields named in `extra` and read by the worker."""
    found = SourceWalk(root, "sidecars", [], [], [])
    found.items = _sidecar_items(root, "", found.skipped, set(), keys)
    return found


def _sidecar_items(
    root: str, rel_dir: str, skipped: list[Failure], seen: set[tuple[int, int]], keys: bool
) -> Iterator[Item]:
    base = rel_dir + "/" if rel_dir else ""
    names: list[str] = []
    groups: dict[str, dict[str, str]] = {}
    for entry in _entries(root, rel_dir, skipped, seen):
        name = entry.name
        if name.startswith("."):
            continue
        try:
            if entry.is_dir():
                names.append(name + "/")
                continue
            is_file = entry.is_file()
        except OSError as error:
            skipped.append(_skip(base + name, f"cannot stat: {error.strerror}"))
            continue
        if not is_file:
            skipped.append(_skip(base + name, "broken link" if entry.is_symlink() else "not a regular file"))
            continue
        stem, suffix = split_name(name)
        if not suffix:
            skipped.append(_skip(base + name, "no suffix: not part of a sample (x.jpg, x.txt, x.json, ...)"))
            continue
        names.append(name)
        groups.setdefault(stem, {})[suffix] = name
    _sort_names(names)
    done: set[str] = set()
    for name in names:
        if name[-1] == "/":
            yield from _sidecar_items(root, base + name[:-1], skipped, seen, keys)
            continue
        stem = split_name(name)[0]
        if stem in done:
            continue
        done.add(stem)
        image, parts, problem = sample_of(groups[stem])
        if image is None:
            skipped.extend(_skip(base + other, problem) for other in sorted(groups[stem].values(), key=os.fsencode))
            continue
        extra = json.dumps({"sidecars": parts}, sort_keys=True, ensure_ascii=False) if parts else ""
        relpath = base + image
        yield Item(os.path.join(root, relpath), relpath, make_key(relpath) if keys else "", None, extra)
