"""Walking a source: a folder of class sub-folders, a flat folder, or a list file.

Every image becomes an `Item` with a stable key derived from its relative path and an
optional integer label. Anything that is not taken is returned in `SourceWalk.skipped` with its
reason, so callers can account for every file they were pointed at.
"""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple
from urllib.parse import quote

from ..core.errors import Failure, SourceError
from ..core.headers import EXTENSION_FORMATS

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
    runs: Iterable[Run] | None = None  # a folder's walk, as runs of one folder's files (`items`, batched)


def walk(source: str | os.PathLike[str], labels: str = "auto", *, keys: bool = True) -> SourceWalk:
    """Start walking `source` (a folder or a list file); `labels` is auto, folders or none. A bad
    source is refused here, before any item is yielded. keys=False leaves the keys of a folder's
    items empty (probe has no use for them, and they cost more than the walk)."""
    if labels not in ("auto", "folders", "none"):
        raise SourceError(f"labels must be auto, folders or none, not {labels!r}")
    root = os.fspath(source)
    if not os.path.exists(root):
        raise SourceError(f"{display(root)}: no such file or folder")
    if os.path.isfile(root):
        if os.path.splitext(root)[1].lower() in IMAGE_EXTENSIONS:
            raise SourceError(f"{display(root)}: is an image; give the folder that holds it (or a list file)")
        listed = _from_list(root)
        return SourceWalk(listed.root, listed.layout, listed.items, listed.classes, listed.skipped, listed)
    if not os.path.isdir(root):
        raise SourceError(f"{display(root)}: not a folder or a list file")
    _check_folder(root)
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


def _listing(
    root: str, rel_dir: str, skipped: list[Failure], seen: set[tuple[int, int]], keys: bool
) -> list[str | tuple[list[str], list[str]]]:
    """One folder's sub-folders (relpaths) and runs of image files between them ((relpaths, keys)),
    in sorted order; what is not taken goes to `skipped`. Folder links are followed, but a folder
    already visited is not entered again."""
    path = os.path.join(root, rel_dir) if rel_dir else root
    try:
        info = os.stat(path)
        if (info.st_dev, info.st_ino) in seen:
            skipped.append(_skip(rel_dir, "folder link loop (already visited)"))
            return []
        seen.add((info.st_dev, info.st_ino))
        with os.scandir(path) as entries_iterator:
            entries = list(entries_iterator)
    except OSError as error:
        skipped.append(_skip(rel_dir or ".", f"cannot list folder: {error.strerror}"))
        return []
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
    if all(name.isascii() for name in names):
        names.sort()  # code-point order is byte order here, and sorting str is 10x cheaper
    else:
        names.sort(key=os.fsencode)
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
