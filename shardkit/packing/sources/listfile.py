"""The list file convention (`ListSource`): a text file with one `path[,label]` per line (labels whole numbers, by
the label rule of `item`, or class names); relative paths are relative to the file. Read whole:
lists are small next to what they name, and their labels' kind is settled over every line."""

from __future__ import annotations

import os
import re
from pathlib import Path

from ...core.errors import Failure, SourceError
from .base import Labelling, Source, SourceList, SourceWalk, WalkOptions
from .folder import IMAGE_EXTENSIONS
from .item import Item, display, skip, unique_keys, whole_label
from .labelling import list_labels


class ListSource(Source):
    """A list file: read whole, its items in the list's order."""

    KIND = "list"

    @classmethod
    def open(cls, options: WalkOptions) -> ListSource | None:
        root = options.source
        if not os.path.isfile(root):
            return None
        if os.path.splitext(root)[1].lower() in IMAGE_EXTENSIONS:
            raise SourceError(f"{display(root)}: is an image; give the folder that holds it (or a list file)")
        if options.table is not None and options.table.path is not None:
            raise SourceError(f"{display(root)}: --metadata needs a source folder (the rows' paths are relative to it)")
        return cls(options)

    def walk(self) -> SourceWalk:
        listed = from_list(self.root)
        return SourceWalk(listed.root, self, listed.items, listed.classes, listed.skipped, listed)

    def labelling(self, found: SourceWalk, labels: str) -> Labelling:
        return list_labels(found)


def from_list(list_path: str) -> SourceList:
    base = os.path.dirname(os.path.abspath(list_path))
    try:
        text = Path(list_path).read_text(encoding="utf-8-sig", errors="surrogateescape")  # (a BOM is not text)
        lines = text.splitlines()
    except OSError as error:
        raise SourceError(f"{display(list_path)}: {error.strerror}") from None
    if any("\x00" in line for line in lines):
        raise SourceError(f"{display(list_path)}: not a text list file (expected one path[,label] per line)")
    raw: list[tuple[str, str | None]] = []
    numbers: list[int] = []  # each raw line's line number
    for number, line in enumerate(lines, 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        path, sep, label = line.rpartition(",") if "," in line else (line, "", "")
        path, label = path.strip(), label.strip()
        if not path:
            raise SourceError(f"{display(list_path)}:{number}: no path before the comma")
        raw.append((path, label if sep else None))
        numbers.append(number)
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

    def to_label(number: int, label: str | None) -> int | None:
        if label is None:
            return None
        if classes:
            return index[label]
        value, problem = whole_label(label)  # the label rule every source shares
        if value is None:
            raise SourceError(f"{display(list_path)}:{number}: {problem}")
        return value

    pairs = [
        (os.path.normpath(path).replace(os.sep, "/"), to_label(number, label))
        for number, (path, label) in zip(numbers, raw, strict=True)
    ]
    _refuse_if_none_exists(list_path, base, [path for path, _ in pairs])
    skipped: list[Failure] = []
    items = _keyed(base, pairs, skipped)
    return SourceList(list_path, "list", items, classes, skipped)


def _refuse_if_none_exists(list_path: str, base: str, paths: list[str]) -> None:
    """A list whose paths were written from another folder than its own names no file at all: it is
    refused before any work, saying where the paths were looked for, since packing none of its
    files would look like a pack that succeeded. (While the paths exist this is one stat: the
    search stops at the first; a list that names nothing costs a stat a line, once.)"""

    if any(os.path.lexists(_resolved(base, path)) for path in paths):
        return
    shown = (lambda path: path) if os.path.isabs(list_path) else os.path.relpath  # as the user wrote the list's
    said = f"{display(list_path)}: none of its {len(paths):,} paths exists; they are read from the list's folder"
    said += f" (the first: {display(shown(_resolved(base, paths[0])))})"
    if not os.path.isabs(paths[0]) and os.path.lexists(paths[0]):  # written from the current folder
        said += f", and {display(paths[0])} exists from the current folder: write them from {display(shown(base))}/"
        said += " or as absolute paths"
    raise SourceError(said)


def _keyed(root: str, pairs: list[tuple[str, int | None]], skipped: list[Failure]) -> list[Item]:
    """Items with unique keys (the rule of `unique_keys`); a path listed twice is skipped."""
    shown_paths = sorted({rel.lstrip("/") for rel, _ in pairs})
    key_of = dict(zip(shown_paths, unique_keys(shown_paths), strict=True))
    items: list[Item] = []
    seen: set[str] = set()
    for rel, label in pairs:
        shown = rel.lstrip("/")
        key = key_of[shown]
        if key in seen:
            skipped.append(skip(shown, "listed more than once"))
            continue
        seen.add(key)
        path = _resolved(root, rel)
        items.append(Item(path, shown, key, label))
    return items


def _resolved(base: str, path: str) -> str:
    """Where a listed path points: itself when whole, else from the list's folder `base`."""
    return path if os.path.isabs(path) else os.path.join(base, path)
