"""Walking a source: a folder of class sub-folders, a flat folder, or a list file.

Every image becomes an `Item` with a stable key derived from its relative path and an
optional integer label. Anything that is not taken is returned in `Source.skipped` with its
reason, so callers can account for every file they were pointed at.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

from .errors import SourceError
from .headers import EXTENSION_FORMATS

IMAGE_EXTENSIONS = frozenset(EXTENSION_FORMATS)
# Characters kept as they are in keys; everything else (and '.') is percent-escaped so keys are
# ASCII, unique, and safe for tar member names where '.' separates the key from the extension.
_KEY_SAFE = "/ _-'()+,;=@!~&$[]"


@dataclass(frozen=True, slots=True)
class Item:
    path: str  # where to read the file
    relpath: str  # relative to the source root, '/'-separated: what the user sees and metadata keeps
    key: str
    label: int | None = None


@dataclass(frozen=True, slots=True)
class Skipped:
    relpath: str
    reason: str


@dataclass(frozen=True)
class Source:
    root: str
    layout: str  # "folders", "flat" or "list"
    items: list[Item]
    classes: list[str] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)


def display(name: str) -> str:
    """A printable form of a file name that may hold undecodable bytes."""
    return name.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def make_key(relpath: str, keep_extension: bool = False) -> str:
    stem = relpath if keep_extension else _strip_extension(relpath)
    return quote(os.fsencode(stem), safe=_KEY_SAFE).replace(".", "%2E")


def _strip_extension(relpath: str) -> str:
    head, _, name = relpath.rpartition("/")
    base, dot, _ext = name.rpartition(".")
    stem = base if dot and base else name
    return f"{head}/{stem}" if head else stem


def image_files(source: str | os.PathLike[str]) -> tuple[list[str], list[str], list[Skipped]]:
    """(paths, relative paths, skipped) of the images under a folder or in a list file, without
    keys or labels: the cheap walk that `probe` needs."""
    root = os.fspath(source)
    if os.path.isdir(root):
        _check_folder(root)
        skipped: list[Skipped] = []
        relpaths = _sorted_paths(_walk(root, skipped))
        if not relpaths:
            raise SourceError(f"{display(root)}: no images found (looked for {', '.join(sorted(IMAGE_EXTENSIONS))})")
        prefix = root if root.endswith("/") else root + "/"
        return [prefix + rel for rel in relpaths], relpaths, skipped
    found = discover(root, labels="none")
    return [item.path for item in found.items], [item.relpath for item in found.items], found.skipped


def _check_folder(root: str) -> None:
    if not os.access(root, os.R_OK | os.X_OK):
        raise SourceError(f"{display(root)}: permission denied")


def discover(source: str | os.PathLike[str], labels: str = "auto") -> Source:
    """Find the images under `source` (a folder or a list file); `labels` is auto, folders or none."""
    if labels not in ("auto", "folders", "none"):
        raise SourceError(f"labels must be auto, folders or none, not {labels!r}")
    root = os.fspath(source)
    if not os.path.exists(root):
        raise SourceError(f"{display(root)}: no such file or folder")
    if os.path.isfile(root):
        if os.path.splitext(root)[1].lower() in IMAGE_EXTENSIONS:
            raise SourceError(f"{display(root)}: is an image; give the folder that holds it (or a list file)")
        return _from_list(root)
    if not os.path.isdir(root):
        raise SourceError(f"{display(root)}: not a folder or a list file")
    _check_folder(root)
    skipped: list[Skipped] = []
    relpaths = _sorted_paths(_walk(root, skipped))
    if not relpaths:
        raise SourceError(f"{display(root)}: no images found (looked for {', '.join(sorted(IMAGE_EXTENSIONS))})")
    top_level_images = any("/" not in rel for rel in relpaths)
    use_folders = labels == "folders" or (labels == "auto" and not top_level_images)
    if labels == "folders" and top_level_images:
        raise SourceError(f"{display(root)}: images at the top level, so sub-folders cannot be classes")
    classes = sorted({rel.split("/", 1)[0] for rel in relpaths}, key=os.fsencode) if use_folders else []
    index = {name: i for i, name in enumerate(classes)}
    pairs = [(rel, index[rel.split("/", 1)[0]] if use_folders else None) for rel in relpaths]
    items = _keyed(root, pairs, skipped)
    return Source(root, "folders" if use_folders else "flat", items, classes, skipped)


def _sorted_paths(relpaths: Iterable[str]) -> list[str]:
    """Sorted in byte order of the names on disk, the same on every machine."""
    names = list(relpaths)
    if all(name.isascii() for name in names):
        return sorted(names)  # code-point order is byte order here, and sorting str is 10x cheaper
    return sorted(names, key=os.fsencode)


def _walk(root: str, skipped: list[Skipped]) -> Iterator[str]:
    """Relative paths of image files below root; follows folder links but never loops."""
    seen: set[tuple[int, int]] = set()
    stack = [""]
    while stack:
        rel_dir = stack.pop()
        path = os.path.join(root, rel_dir) if rel_dir else root
        try:
            info = os.stat(path)
            if (info.st_dev, info.st_ino) in seen:
                skipped.append(Skipped(rel_dir, "folder link loop (already visited)"))
                continue
            seen.add((info.st_dev, info.st_ino))
            entries = list(os.scandir(path))
        except OSError as error:
            skipped.append(Skipped(rel_dir or ".", f"cannot list folder: {error.strerror}"))
            continue
        for entry in entries:
            if entry.name.startswith("."):
                continue
            rel = f"{rel_dir}/{entry.name}" if rel_dir else entry.name
            try:
                if entry.is_dir():
                    stack.append(rel)
                    continue
                is_file = entry.is_file()
            except OSError as error:
                skipped.append(Skipped(rel, f"cannot stat: {error.strerror}"))
                continue
            if not is_file:
                reason = "broken link" if entry.is_symlink() else "not a regular file"
                skipped.append(Skipped(rel, reason))
            elif (dot := entry.name.rfind(".")) > 0 and entry.name[dot:].lower() in IMAGE_EXTENSIONS:
                yield rel  # (os.path.splitext, minus its cost: hidden names never get here)
            else:
                skipped.append(Skipped(rel, "not an image file extension"))


def _from_list(list_path: str) -> Source:
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
    skipped: list[Skipped] = []
    items = _keyed(base, pairs, skipped)
    return Source(list_path, "list", items, classes, skipped)


def _keyed(root: str, pairs: list[tuple[str, int | None]], skipped: list[Skipped]) -> list[Item]:
    """Items with unique keys: the extension is dropped unless that makes two files' keys collide
    (a.jpg and a.png; or a.jpg kept whole against a.jpg.png), in which case both keep it."""
    shown_paths = {rel.lstrip("/") for rel, _ in pairs}
    whole: set[str] = set()  # relpaths whose key keeps the extension
    while True:
        owners: dict[str, set[str]] = {}
        for shown in shown_paths:
            owners.setdefault(make_key(shown, keep_extension=shown in whole), set()).add(shown)
        clashing = {shown for group in owners.values() if len(group) > 1 for shown in group} - whole
        if not clashing:
            break
        whole |= clashing
    items: list[Item] = []
    seen: set[str] = set()
    for rel, label in pairs:
        shown = rel.lstrip("/")
        key = make_key(shown, keep_extension=shown in whole)
        if key in seen:
            skipped.append(Skipped(shown, "listed more than once"))
            continue
        seen.add(key)
        path = rel if os.path.isabs(rel) else os.path.join(root, rel)
        items.append(Item(path, shown, key, label))
    return items
