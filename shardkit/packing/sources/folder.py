"""The folder convention (`FolderSource`): class sub-folders (a label per top-level folder) or a flat
folder, and the listing every convention that walks a folder shares (sorted as it lists, links
followed once).
"""

from __future__ import annotations

import errno
import itertools
import os
from collections.abc import Callable, Iterable, Iterator

from ...core.clips import VIDEO_EXTENSIONS
from ...core.errors import Failure, SourceError
from ...core.headers import EXTENSION_FORMATS
from ...core.safeio import not_regular
from .base import Labelling, Source, SourceWalk, WalkOptions
from .item import Run, display, skip, unique_keys
from .labelling import folder_labels

IMAGE_EXTENSIONS = frozenset(EXTENSION_FORMATS)
VIDEO_SUFFIXES = frozenset(f".{ext}" for ext in VIDEO_EXTENSIONS)  # as IMAGE_EXTENSIONS: with the dot
Listing = list[str | tuple[list[str], list[str]]]  # sub-folders (relpaths), and runs of (relpaths, keys)


class FolderSource(Source):
    """A local folder of class sub-folders or of images, or a bucket's prefix walked alike
    (bucket.py): "folders" when its top-level folders are classes, else "flat"."""

    by_folders = False  # settled by the walk: the top-level folders are classes

    @classmethod
    def open(cls, options: WalkOptions) -> FolderSource | None:
        if not os.path.isdir(options.source):
            return None
        check_folder(options.source)
        return cls(options)

    @property
    def kind(self) -> str:
        return "folders" if self.by_folders else "flat"

    def walk(self) -> SourceWalk:
        options = self.options
        try:
            return from_folder(self, options.source, options.labels, options.keys)
        except SourceError:
            if holds_file(options.source, "", set(), VIDEO_SUFFIXES):  # a folder of videos given as one of images
                raise SourceError(
                    f"{display(options.source)}: no images found, but it holds videos; "
                    "cut them into clips with --clip-seconds S"
                ) from None
            raise

    def labelling(self, found: SourceWalk, labels: str) -> Labelling:
        return folder_labels(found, labels)


def check_folder(root: str) -> None:
    if not os.access(root, os.R_OK | os.X_OK):
        raise SourceError(f"{display(root)}: permission denied")


def from_folder(
    source: FolderSource, root: str, labels: str, keys: bool, extensions: frozenset[str] = IMAGE_EXTENSIONS
) -> SourceWalk:
    """A folder of class sub-folders (labels from the top-level folders) or of images (or of the
    files with other `extensions`: videos, sources/video.py), walked for `source`."""
    skipped: list[Failure] = []
    seen: set[tuple[int, int]] = set()  # folders the walk has entered
    top = listing(root, "", skipped, seen, keys, extensions)  # the walk's first listing, made once
    # in walk order, sharing what was entered: a folder reached again (a link to an earlier class)
    # is skipped here as the walk will skip it
    entered = set(seen)
    return walk_tree(
        source, root, root if root.endswith("/") else root + "/", top, labels, skipped,
        lambda folders: [rel for rel in folders if holds_file(root, rel, entered, extensions)],
        lambda rel_dir: listing(root, rel_dir, skipped, seen, keys, extensions), extensions,
    )  # fmt: skip


def walk_tree(
    source: FolderSource,
    root: str,
    prefix: str,
    top: Listing,
    labels: str,
    skipped: list[Failure],
    holding: Callable[[list[str]], list[str]],
    list_folder: Callable[[str], Listing],
    extensions: frozenset[str] = IMAGE_EXTENSIONS,
) -> SourceWalk:
    """The class-folder or flat walk of a tree of any kind (a local folder, a bucket's prefix) from
    its top-level listing: `holding(folders)` keeps the top-level folders with an image somewhere
    below them (the classes, found without a full walk), `list_folder(rel_dir)` lists one folder,
    and item i of a run is at `prefix + relpath`; `source` learns whether its folders are classes."""
    top_level_images = any(not isinstance(part, str) for part in top)
    # a class is a top-level folder with an image somewhere below it
    folders = [part for part in top if isinstance(part, str)]
    class_folders = [] if top_level_images else holding(folders)
    if not top_level_images and not class_folders:
        what = "images" if extensions is IMAGE_EXTENSIONS else "videos"
        raise SourceError(f"{display(root)}: no {what} found (looked for {', '.join(sorted(extensions))})")
    use_folders = labels == "folders" or (labels == "auto" and not top_level_images)
    if labels == "folders" and top_level_images:
        raise SourceError(f"{display(root)}: images at the top level, so sub-folders cannot be classes")
    classes = sorted(class_folders, key=os.fsencode) if use_folders else []
    source.by_folders = use_folders
    found = SourceWalk(root, source, [], classes, skipped)
    class_index = {name: i for i, name in enumerate(classes)} if use_folders else None
    found.runs = noting_depths(walk_runs(prefix, top, class_index, skipped, list_folder), found.depths)
    found.items = itertools.chain.from_iterable(run.items() for run in found.runs)
    return found


def noting_depths(runs: Iterable[Run], depths: dict[int, str]) -> Iterator[Run]:
    """`runs` as they come, each depth of their files (a run is one folder's) noted in `depths`
    with the first file found at it: what says that files sit at two depths, or that class
    folders hold sub-folders (labelling.py). One step a folder, none a file."""
    for run in runs:
        depth = run.relpaths[0].count("/")
        if depth not in depths:
            depths[depth] = run.relpaths[0]
        yield run


def walk_runs(
    prefix: str,
    top: Listing,
    classes: dict[str, int] | None,
    skipped: list[Failure],
    list_folder: Callable[[str], Listing],
) -> Iterator[Run]:
    """The images in byte order of their relative paths, depth first, as runs of one folder's
    files, from the root's listing `top` down (`list_folder(rel_dir)` lists the others). Each
    folder's entries are sorted by name, a folder's name with '/' after it: that is exactly the
    order of the full paths."""
    stack = [iter(top)]
    while stack:
        part = next(stack[-1], None)
        if part is None:
            stack.pop()
        elif isinstance(part, str):
            stack.append(iter(list_folder(part)))
        else:
            relpaths, file_keys = part
            if classes is None:
                yield Run(prefix, relpaths, file_keys, None)
            elif (label := classes.get(relpaths[0].split("/", 1)[0])) is not None:  # one folder: one class
                yield Run(prefix, relpaths, file_keys, label)
            else:  # a folder that had no image when the classes were settled: never a silent new label
                skipped.extend(skip(rel, "its class folder had no image when the walk began") for rel in relpaths)


def entries(root: str, rel_dir: str, skipped: list[Failure], seen: set[tuple[int, int]]) -> list[os.DirEntry[str]]:
    """A folder's entries, or none (the reason in `skipped`) when it cannot be listed or a link led
    back into a folder already visited. Folder links are followed."""
    path = os.path.join(root, rel_dir) if rel_dir else root
    try:
        info = os.stat(path)
        if (info.st_dev, info.st_ino) in seen:
            skipped.append(skip(rel_dir, "folder link loop (already visited)"))
            return []
        seen.add((info.st_dev, info.st_ino))
        with os.scandir(path) as entries_iterator:
            return list(entries_iterator)
    except OSError as error:
        skipped.append(skip(rel_dir or ".", f"cannot list folder: {error.strerror}"))
        return []


def sort_names(names: list[str]) -> None:
    """In byte order of the names, the order of a walk (folders carry a '/' after their name)."""
    if all(name.isascii() for name in names):
        names.sort()  # code-point order is byte order here, and sorting str is far cheaper than by bytes
    else:
        names.sort(key=os.fsencode)


def listing(
    root: str,
    rel_dir: str,
    skipped: list[Failure],
    seen: set[tuple[int, int]],
    keys: bool,
    extensions: frozenset[str] = IMAGE_EXTENSIONS,
) -> Listing:
    """One folder's sub-folders (relpaths) and runs of image files between them ((relpaths, keys)),
    in sorted order; what is not taken goes to `skipped`. Folder links are followed, but a folder
    already visited is not entered again."""
    names: list[str] = []  # image files, and folders with a '/' after the name (their sort key)
    for entry in entries(root, rel_dir, skipped, seen):
        name = entry.name
        if name.startswith("."):
            continue
        try:
            if entry.is_dir():
                names.append(name + "/")
                continue
            is_file = entry.is_file()
        except OSError as error:
            skipped.append(skip(f"{rel_dir}/{name}" if rel_dir else name, f"cannot stat: {error.strerror}"))
            continue
        if is_file and (dot := name.rfind(".")) > 0 and name[dot:].lower() in extensions:
            names.append(name)  # (os.path.splitext, minus its cost: hidden names never get here)
        else:
            reason = not_taken(name, extensions) if is_file else not_a_file(entry)
            skipped.append(skip(f"{rel_dir}/{name}" if rel_dir else name, reason))
    return sorted_listing(names, rel_dir, keys)


def sorted_listing(names: list[str], rel_dir: str, keys: bool) -> Listing:
    """One folder's image files and sub-folders (a '/' after a folder's name; sorted here, in
    place) as its `Listing`: sub-folders' relpaths, and runs of (relpaths, keys) between them."""
    sort_names(names)
    base = rel_dir + "/" if rel_dir else ""
    parts: Listing = []
    run: list[str] = []
    for name in names:
        if name[-1] == "/":
            if run:
                parts.append((run, unique_keys(run) if keys else [""] * len(run)))
                run = []
            parts.append(base + name[:-1])
        else:
            run.append(base + name)
    if run:
        parts.append((run, unique_keys(run) if keys else [""] * len(run)))
    return parts


def not_a_file(entry: os.DirEntry[str]) -> str:
    """Why an entry that is neither a folder nor a regular file is not taken: what it is (a FIFO, a
    device), through a link or not; a link that leads nowhere is a broken link."""
    try:
        mode = os.stat(entry.path).st_mode
    except OSError as error:
        if isinstance(error, FileNotFoundError) or error.errno == errno.ELOOP:
            return "broken link"
        return f"cannot stat: {error.strerror}"
    reason = not_regular(entry.path, mode).strerror or "not a regular file"
    return f"{reason}, through a link" if entry.is_symlink() else reason


def not_taken(name: str, extensions: frozenset[str]) -> str:
    """Why a regular file is not taken: an image in a pack of videos, or the other way round, says so."""
    if extensions is IMAGE_EXTENSIONS:
        if name[name.rfind(".") :].lower() in VIDEO_SUFFIXES:
            return "a video; pack videos with --clip-seconds S"
        return "not an image file extension"
    if name[name.rfind(".") :].lower() in IMAGE_EXTENSIONS:
        return "an image; a pack with --clip-seconds takes the videos only"
    return "not a video file extension"


def holds_file(
    root: str, rel_dir: str, seen: set[tuple[int, int]], extensions: frozenset[str] = IMAGE_EXTENSIONS
) -> bool:
    """Whether a folder has an image file (or one of `extensions`) somewhere below it; stops at the
    first one found. Folders in `seen` (entered before) are not entered again, and those entered
    here are added to it."""
    stack = [rel_dir]
    while stack:
        rel = stack.pop()
        path = os.path.join(root, rel)
        try:
            info = os.stat(path)
            if (info.st_dev, info.st_ino) in seen:
                continue
            seen.add((info.st_dev, info.st_ino))
            with os.scandir(path) as found:
                for entry in found:
                    name = entry.name
                    if name.startswith("."):
                        continue
                    try:
                        if entry.is_dir():
                            stack.append(f"{rel}/{name}" if rel else name)
                        elif entry.is_file() and (dot := name.rfind(".")) > 0 and name[dot:].lower() in extensions:
                            return True
                    except OSError:
                        continue
        except OSError:
            continue
    return False
