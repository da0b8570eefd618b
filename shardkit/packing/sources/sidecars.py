"""Sidecar files (--sidecars): files that share a stem in one folder are one sample, the webdataset
convention. `x.jpg` (or .jpeg, .png, .webp...) is the image, `x.txt` its caption, `x.json` an
object whose keys become columns, `x.cls` its label, and any other `x.<suffix>` (`x.seg.png`,
`x.depth.png`, `x.npy`) a field named by its suffix. The stem is the name up to its first dot.

The walk only groups names (`SidecarSource`, `sidecar_items`); the files are read in the worker,
beside the image (sidecar_files.py), so a folder of millions of samples costs the driver no extra I/O.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator

from ...core.errors import Failure, SourceError
from ...formats.base import RESERVED_FIELDS
from .base import Labelling, Source, SourceWalk, WalkOptions
from .folder import check_folder, entries, not_a_file, sort_names
from .item import Item, display, make_key, skip
from .labelling import sidecar_labels
from .rows import is_utf8
from .sidecar_files import CAPTION, COLUMNS, LABEL, is_image_suffix


def split_name(name: str) -> tuple[str, str]:
    """(stem, suffix): the name up to its first dot, and the rest."""
    stem, _, suffix = name.partition(".")
    return stem, suffix


def sample_of(names: dict[str, str]) -> tuple[str | None, dict[str, str], str]:
    """For one stem's files ({suffix: name}): (the image's name, {part: name} of the rest, the
    problem that keeps the sample out ("" when none)). A part is txt, json, cls or a field's suffix."""
    images = sorted(name for suffix, name in names.items() if is_image_suffix(suffix))
    if not images:
        return None, {}, "a sidecar with no image of its name (.jpg, .png, .webp, ...)"
    if len(images) > 1:
        return None, {}, f"two images share the name: {', '.join(images)}"
    parts: dict[str, str] = {}
    seen: dict[str, str] = {}
    for suffix, name in sorted(names.items()):
        if name == images[0]:
            continue
        part = suffix.lower() if suffix.lower() in (CAPTION, COLUMNS, LABEL) else suffix
        if part.lower() in seen:
            return None, {}, f"two files for one part: {seen[part.lower()]}, {name}"
        if part in RESERVED_FIELDS - {CAPTION, COLUMNS, LABEL}:
            return None, {}, f"{name}: .{part} is a name shardkit's own parts take; rename the file"
        seen[part.lower()] = name
        parts[part] = name
    return images[0], parts, ""


class SidecarSource(Source):
    """A local folder walked with --sidecars (a bucket's prefix alike: bucket.py)."""

    KIND = "sidecars"

    @classmethod
    def open(cls, options: WalkOptions) -> SidecarSource | None:
        if not options.sidecars or not os.path.isdir(options.source):
            return None
        check_folder(options.source)
        refuse_folder_labels(options.source, options)
        return cls(options)

    def walk(self) -> SourceWalk:
        return from_sidecars(self, self.options.source, self.options.keys)

    def labelling(self, found: SourceWalk, labels: str) -> Labelling:
        return sidecar_labels(found)


def refuse_folder_labels(root: str, options: WalkOptions) -> None:
    """Labels from folders, asked of sidecar samples: refused, for a folder and a bucket alike."""
    if options.sidecars and options.labels == "folders":
        raise SourceError(f"{display(root)}: with --sidecars, labels come from x.cls files, not folders")


def from_sidecars(source: Source, root: str, keys: bool) -> SourceWalk:
    """A folder walked as sidecar samples for `source`: one item per image, in byte order of the
    paths, its caption, columns, label and fields named in `Item.sidecars` and read by the worker."""
    found = SourceWalk(root, source, [], [], [])
    seen: set[tuple[int, int]] = set()
    prefix = root if root.endswith("/") else root + "/"
    names = lambda rel_dir: _local_names(root, rel_dir, found.skipped, seen)  # noqa: E731
    found.items = counted(found, sidecar_items(prefix, "", found.skipped, names, keys))
    return found


def counted(found: SourceWalk, items: Iterable[Item]) -> Iterator[Item]:
    """`items` as they come, counted in `found`: the samples, and those with a label (x.cls)."""
    for item in items:
        found.samples += 1
        found.labelled += item.sidecars is not None and LABEL in item.sidecars
        yield item


def _local_names(root: str, rel_dir: str, skipped: list[Failure], seen: set[tuple[int, int]]) -> Iterator[Name]:
    """A local folder's visible files and sub-folders; what is neither goes to `skipped` as it is met."""
    base = rel_dir + "/" if rel_dir else ""
    for entry in entries(root, rel_dir, skipped, seen):
        name = entry.name
        if name.startswith("."):
            continue
        try:
            if entry.is_dir():
                yield name, True
                continue
            is_file = entry.is_file()
        except OSError as error:
            skipped.append(skip(base + name, f"cannot stat: {error.strerror}"))
            continue
        if not is_file:
            skipped.append(skip(base + name, not_a_file(entry)))
            continue
        yield name, False


Name = tuple[str, bool]  # an entry of a folder: its name, and whether it is a folder


def sidecar_items(
    prefix: str, rel_dir: str, skipped: list[Failure], list_names: Callable[[str], Iterable[Name]], keys: bool
) -> Iterator[Item]:
    """The sidecar samples under `rel_dir` of any tree (a folder, a bucket's prefix), depth first in
    byte order: `list_names(rel_dir)` gives a folder's visible entries; an item's path is
    `prefix + relpath`."""
    base = rel_dir + "/" if rel_dir else ""
    names: list[str] = []
    groups: dict[str, dict[str, str]] = {}
    for name, is_dir in list_names(rel_dir):
        if is_dir:
            names.append(name + "/")
            continue
        stem, suffix = split_name(name)
        if not suffix:
            skipped.append(skip(base + name, "no suffix: not part of a sample (x.jpg, x.txt, x.json, ...)"))
            continue
        # (the stem is escaped into the key; a suffix names a field as it is, and no format can
        # write a field name that is not UTF-8)
        if not is_utf8(suffix):
            skipped.append(skip(base + name, "its suffix is not UTF-8 text, so no shard can name the field"))
            continue
        names.append(name)
        groups.setdefault(stem, {})[suffix] = name
    sort_names(names)
    done: set[str] = set()
    for name in names:
        if name[-1] == "/":
            yield from sidecar_items(prefix, base + name[:-1], skipped, list_names, keys)
            continue
        stem = split_name(name)[0]
        if stem in done:
            continue
        done.add(stem)
        image, parts, problem = sample_of(groups[stem])
        if image is None:
            skipped.extend(skip(base + other, problem) for other in sorted(groups[stem].values(), key=os.fsencode))
            continue
        relpath = base + image
        key = make_key(relpath) if keys else ""
        yield Item(prefix + relpath, relpath, key, None, sidecars=parts or None)
