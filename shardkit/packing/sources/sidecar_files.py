"""A sidecar sample's files as the worker reads them, beside its image: `x.txt` its caption,
`x.json` an object whose keys become columns, `x.cls` its label, and any other `x.<suffix>` a field
named by its suffix, each read and checked. An image field (a mask) is cropped and resized with the
image, nearest-neighbour, so a mask never gets a value it did not have. The walk that groups the
names is sidecars.py.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ...core.config import LABEL_RULE, MAX_RECORD_BYTES, ResizeConfig
from ...core.errors import ImageError, describe
from ...core.headers import EXTENSION_FORMATS
from ...core.safeio import loads
from .item import parse_label
from .rows import BOM, MAX_EXTRA_BYTES

CAPTION, COLUMNS, LABEL = "txt", "json", "cls"
# Pillow's format for each image suffix a field may have: what an aligned field is saved back as
_SAVE_AS = {
    ".png": "PNG", ".webp": "WEBP", ".jpg": "JPEG", ".jpeg": "JPEG", ".bmp": "BMP", ".tif": "TIFF", ".tiff": "TIFF",
    ".gif": "GIF",
}  # fmt: skip


def is_image_suffix(suffix: str) -> bool:
    return "." + suffix.lower() in EXTENSION_FORMATS


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
