"""Sidecar files (--sidecars): files that share a stem in one folder are one sample, the webdataset
convention. `x.jpg` (or .jpeg, .png, .webp...) is the image, `x.txt` its caption, `x.json` an
object whose keys become columns, `x.cls` its label, and any other `x.<suffix>` (`x.seg.png`,
`x.depth.png`, `x.npy`) a field named by its suffix. The stem is the name up to its first dot.

The walk only groups names (`from_sidecars`); the files are read in the worker, beside the image, so
a folder of millions of samples costs the driver no extra I/O. An image field (a mask) is cropped
and resized with the image, nearest-neighbour, so a mask never gets a value it did not have.
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ...core.config import LABEL_RULE, MAX_RECORD_BYTES, ResizeConfig
from ...core.errors import Failure, ImageError, describe
from ...core.headers import EXTENSION_FORMATS
from ...core.safeio import loads
from ...formats.base import RESERVED_FIELDS
from .folder import entries, not_a_file, sort_names
from .item import Item, SourceWalk, make_key, parse_label, skip
from .rows import BOM, MAX_EXTRA_BYTES, is_utf8

CAPTION, COLUMNS, LABEL = "txt", "json", "cls"
# Pillow's format for each image suffix a field may have: what an aligned field is saved back as
_SAVE_AS = {
    ".png": "PNG", ".webp": "WEBP", ".jpg": "JPEG", ".jpeg": "JPEG", ".bmp": "BMP", ".tif": "TIFF", ".tiff": "TIFF",
    ".gif": "GIF",
}  # fmt: skip


def split_name(name: str) -> tuple[str, str]:
    """(stem, suffix): the name up to its first dot, and the rest."""
    stem, _, suffix = name.partition(".")
    return stem, suffix


def is_image_suffix(suffix: str) -> bool:
    return "." + suffix.lower() in EXTENSION_FORMATS


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


def from_sidecars(root: str, keys: bool) -> SourceWalk:
    """A folder walked as sidecar samples: one item per image, in byte order of the paths, its
    caption, columns, label and fields named in `Item.sidecars` and read by the worker."""
    found = SourceWalk(root, "sidecars", [], [], [])
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
        # (the stem is escaped into the key; a suffix names a field as it is: one not UTF-8 took
        # the whole pack down, in every format)
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


@dataclass
class Sidecars:
    text: str | None = None
    columns: dict[str, Any] | None = None
    label: int | None = None
    files: dict[str, bytes] = field(default_factory=dict)


def read_sidecars(
    read: Callable[[str, int], bytes],
    parts: dict[str, str],
    meta: dict[str, Any],
    resize: ResizeConfig,
    max_pixels: int,
) -> Sidecars:
    """A sample's sidecar files, read and checked; ImageError("read") names the file and the cause.
    `read(name, limit)` reads a file of the image's folder (OSError when it cannot); `meta` is the
    image's record metadata (its original and stored sizes)."""
    found = Sidecars()
    budget = MAX_RECORD_BYTES // 2  # the image has the other half
    for part, name in parts.items():
        limit = MAX_EXTRA_BYTES if part in (CAPTION, COLUMNS, LABEL) else budget
        try:
            data = read(name, limit)
        except OSError as error:
            raise ImageError("read", f"{name}: {describe(error)}") from None
        if part in (CAPTION, COLUMNS, LABEL):
            data = data.removeprefix(BOM)  # Notepad's UTF-8 starts with one: not part of the text
        if part == CAPTION:
            try:
                found.text = data.decode("utf-8")
            except UnicodeDecodeError:
                raise ImageError("read", f"{name}: not UTF-8 text") from None
        elif part == COLUMNS:
            try:
                value = loads(data)
            except (ValueError, UnicodeDecodeError) as error:
                raise ImageError("read", f"{name}: not valid JSON ({describe(error)})") from None
            if type(value) is not dict:
                raise ImageError("read", f"{name}: not a JSON object (its keys become columns)")
            found.columns = value
        elif part == LABEL:
            label = parse_label(data.strip().decode("latin-1"))  # (any bytes decode; only digits parse)
            if label is None:
                raise ImageError("read", f"{name}: a label must be {LABEL_RULE}")
            found.label = label
        else:
            data = (
                _aligned(name, part, data, meta, resize, max_pixels)
                if is_image_suffix(part.rpartition(".")[2])
                else data
            )
            budget -= len(data)
            if budget < 0:
                raise ImageError("read", f"{name}: the sample's fields are over {MAX_RECORD_BYTES // 2 >> 20} MiB")
            found.files[part] = data
    return found


def _aligned(name: str, part: str, data: bytes, meta: dict[str, Any], resize: ResizeConfig, max_pixels: int) -> bytes:
    """An image field cropped and resized exactly as its image was (nearest-neighbour), saved
    back in its own format (losslessly where the format can). Unchanged when the image was."""
    size = (meta["width"], meta["height"])
    stored = (meta["stored_width"], meta["stored_height"])
    if stored == size:
        return data
    from PIL import Image  # (here: the walk, in the driver, needs no imaging)

    from ..encode import plan_geometry

    try:
        with Image.open(io.BytesIO(data)) as image:
            if image.width * image.height > max_pixels:
                raise ImageError("read", f"{name}: {image.width}x{image.height} is over the pixel limit")
            if image.size != size:
                raise ImageError(
                    "read",
                    f"{name}: {image.width}x{image.height}, its image {size[0]}x{size[1]}: cannot keep it aligned",
                )
            geometry = plan_geometry(size[0], size[1], resize)
            field_image = image.crop(geometry.box) if geometry.box is not None else image
            field_image = field_image.resize(geometry.size, Image.Resampling.NEAREST)
            if field_image.size != stored:
                raise ImageError("read", f"{name}: resized to {field_image.size}, the image to {stored}")
            buffer = io.BytesIO()
            save_as = _SAVE_AS.get("." + part.rpartition(".")[2].lower(), "PNG")
            options: dict[str, Any] = (
                {"lossless": True} if save_as == "WEBP" else {"quality": 95} if save_as == "JPEG" else {}
            )
            field_image.save(buffer, save_as, **options)
            return buffer.getvalue()
    except ImageError:
        raise
    except Exception as error:  # Pillow's many exception types for a damaged file
        raise ImageError("read", f"{name}: cannot decode ({describe(error, with_type=True)})") from None
