"""Detection and segmentation targets for the batch loader: a record's mask (a sidecar field) and
boxes (a column) taken through the same window, resize and flip as its image.

Windows are in the stored image's pixels (x0, y0, x1, y1), as the loader draws them from headers.
A mask was aligned with its image at pack time (packing/sources/sidecars.py), so it is cropped to
the window and resized nearest-neighbour by indexing (never a value the stored mask lacks). Boxes
are in the original image's pixels, as the source's annotations were: they are mapped to stored
pixels (undoing pack's resize, and its center crop where the manifest's `packed_resize` says the
output was made with one), then through the window; their class ids (box_labels=,
readers/box_classes.py) follow the boxes kept.
A record without the mask field gets one of `mask_missing` where that is given (an ignore label,
as cross_entropy's ignore_index takes it). Pure numpy; the one Pillow call decodes the mask."""

from __future__ import annotations

import math
from typing import Any, Protocol

import numpy as np

from ..core.errors import ConfigError, ImageError
from ..formats.base import Record
from .decode import open_record, pillow_errors

BOX_FORMATS = ("xywh", "xyxy")
MIN_SIDE = 1e-3  # output pixels: a box thinner than this after clipping has no area left to learn


class Labels(Protocol):
    """A column's box class ids (readers/box_classes.BoxClasses)."""

    @property
    def path(self) -> str: ...

    def ids(self, value: Any, boxes: int) -> np.ndarray: ...


def check_target_options(
    mask: Any, boxes: Any, box_format: Any, mask_missing: Any = None, box_labels: Any = None
) -> None:
    """The loader's mask=, boxes=, box_format=, mask_missing= and box_labels= keywords, each refusal
    one line."""
    for name, value in (("mask", mask), ("boxes", boxes), ("box_labels", box_labels)):
        if value is not None and (not isinstance(value, str) or not value):
            raise ConfigError(f"{name} must be a field name (a string) or None, not {value!r}")
    if box_format not in BOX_FORMATS:
        raise ConfigError(f"box_format must be 'xywh' (COCO) or 'xyxy', not {box_format!r}")
    if mask_missing is not None:
        if isinstance(mask_missing, bool) or not isinstance(mask_missing, (int, np.integer)):
            raise ConfigError(f"mask_missing must be a label from 0 to 255 (an int) or None, not {mask_missing!r}")
        if not 0 <= mask_missing <= 255:
            raise ConfigError(f"mask_missing must be a label from 0 to 255 (a mask is uint8), not {mask_missing!r}")
        if mask is None:
            raise ConfigError("mask_missing= fills a missing mask= field: give mask= too")
    if box_labels is not None and boxes is None:
        raise ConfigError("box_labels= labels the boxes of boxes=: give boxes= too")


def window_corners(boxes: np.ndarray) -> np.ndarray:
    """The loader's (left, top, width, height) windows as (x0, y0, x1, y1): what Batch.windows says."""
    corners = np.array(boxes, np.float64, copy=True).reshape(-1, 4)
    corners[:, 2:] += corners[:, :2]
    return corners


def nearest_indices(start: float, stop: float, count: int, limit: int) -> np.ndarray:
    """Source index of each of `count` output pixels spanning [start, stop): each output pixel takes
    the source pixel under its centre (Pillow's NEAREST with a box), kept inside 0..limit-1."""
    step = (stop - start) / count
    centres = start + (np.arange(count, dtype=np.float64) + 0.5) * step
    return np.clip(np.floor(centres).astype(np.intp), 0, limit - 1)


def decode_mask(data: bytes, max_pixels: int) -> np.ndarray:
    """A mask field's bytes as a (height, width) uint8 label map. A palette image gives its indices
    (the labels), not colours; a multi-channel or wider-than-8-bit one is refused, since converting
    it would invent values."""
    image = open_record(data, max_pixels)
    with pillow_errors():
        if image.mode == "1":
            image = image.convert("L")
        pixels = np.asarray(image)
    if pixels.ndim != 2:
        raise ImageError("mask", f"a {image.mode} image, not one channel of labels")
    if pixels.dtype != np.uint8:
        if not np.issubdtype(pixels.dtype, np.integer):
            raise ImageError("mask", f"a {image.mode} image, not integer labels")
        if pixels.size and (int(pixels.min()) < 0 or int(pixels.max()) > 255):
            raise ImageError("mask", f"a {image.mode} image with labels outside 0..255")
        pixels = pixels.astype(np.uint8)
    return pixels


def crop_mask(
    mask: np.ndarray, window: np.ndarray, flip: bool, size: tuple[int, int], out: np.ndarray | None = None
) -> np.ndarray:
    """A stored mask through one window: cropped, resized nearest-neighbour to size (height, width),
    flipped, into `out` when given (the batch's buffer: no copy after). Taking the output's rows,
    then their columns, touches only the output's pixels (no full-size resize)."""
    x0, y0, x1, y1 = (float(v) for v in window)
    rows = nearest_indices(y0, y1, size[0], mask.shape[0])
    columns = nearest_indices(x0, x1, size[1], mask.shape[1])
    if flip:
        columns = columns[::-1]
    if out is None:
        out = np.empty(size, np.uint8)
    np.take(mask[rows], columns, axis=1, out=out)
    return out


def column_value(columns: dict[str, Any] | None, name: str) -> Any:
    """A column by name, or by a dotted path into nested objects (Hugging Face's `objects.bbox`).
    KeyError when absent: a literal key with a dot in it wins over the path."""
    if columns is None:
        raise KeyError(name)
    if name in columns:
        return columns[name]
    value: Any = columns
    for part in name.split("."):
        if not isinstance(value, dict) or part not in value:
            raise KeyError(name)
        value = value[part]
    return value


def parse_boxes(value: Any, name: str, box_format: str) -> np.ndarray:
    """A column's boxes ([[a, b, c, d], ...] of finite numbers) as float64 (k, 4) x0, y0, x1, y1."""
    if not isinstance(value, list) or not all(
        isinstance(box, list) and len(box) == 4 and all(_finite(v) for v in box) for box in value
    ):
        raise ImageError("boxes", f"column {name!r} is not a list of [{', '.join(box_format)}] numbers")
    boxes = np.array(value, np.float64).reshape(-1, 4)
    if box_format == "xywh":
        boxes[:, 2:] += boxes[:, :2]
    return boxes


def _finite(value: Any) -> bool:
    """A number a box may hold: JSON from a stranger's shard may hold an integer no float holds."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def stored_boxes(boxes: np.ndarray, meta: dict[str, Any], stored: tuple[int, int], center_crop: bool) -> np.ndarray:
    """Original-image boxes (x0, y0, x1, y1) in the stored image's pixels. Pack resized the displayed
    image (meta's width x height) to the stored size, after cutting its centered square when the
    output was packed with --resize-mode center-crop (packing/encode.py plan_geometry). A record
    whose meta lacks the original size (an adopted tar) is taken as stored at its original size."""
    width, height = meta.get("width"), meta.get("height")
    if not (isinstance(width, int) and isinstance(height, int) and width > 0 and height > 0):
        return np.array(boxes, np.float64)
    mapped: np.ndarray = np.array(boxes, np.float64)
    if center_crop and (stored[0], stored[1]) != (width, height):
        short = min(width, height)
        left, top = (width - short) // 2, (height - short) // 2
        mapped -= (left, top, left, top)
        width = height = short
    mapped *= (stored[0] / width, stored[1] / height, stored[0] / width, stored[1] / height)
    return mapped


def window_boxes(
    boxes: np.ndarray, window: np.ndarray, flip: bool, size: tuple[int, int]
) -> tuple[np.ndarray, np.ndarray]:
    """Stored-pixel boxes through one window: (float32 (k, 4) x0, y0, x1, y1 in output pixels,
    clipped to the output; int64 (k,) which input boxes they are). Boxes the window leaves without
    area are dropped, so per-box labels are gathered with the index."""
    height, width = size
    x0, y0, x1, y1 = (float(v) for v in window)
    sx, sy = width / (x1 - x0), height / (y1 - y0)
    out = (boxes - (x0, y0, x0, y0)) * (sx, sy, sx, sy)
    if flip:
        out = np.stack([width - out[:, 2], out[:, 1], width - out[:, 0], out[:, 3]], axis=1)
    out = np.clip(out, 0.0, (width, height, width, height))
    kept = np.flatnonzero((out[:, 2] - out[:, 0] >= MIN_SIDE) & (out[:, 3] - out[:, 1] >= MIN_SIDE))
    return out[kept].astype(np.float32), kept.astype(np.int64)


def record_targets(
    record: Record,
    stored: tuple[int, int],
    window: np.ndarray,
    flip: bool,
    size: tuple[int, int],
    *,
    mask: str | None,
    boxes: str | None,
    box_format: str,
    center_crop: bool,
    max_pixels: int,
    out: np.ndarray | None = None,
    mask_missing: int | None = None,
    box_labels: Labels | None = None,
) -> tuple[np.ndarray | None, tuple[np.ndarray, np.ndarray, np.ndarray | None] | None]:
    """One record's (mask, written into `out` when given; (boxes, box index, box labels or None))
    through its window; ImageError (the reason, naming the field) for a missing field (a mask's
    filled with `mask_missing` where that is given), a malformed column or a mask not the stored
    image's size."""
    cropped = None
    if mask is not None:
        data = (record.files or {}).get(mask)
        if data is None and mask_missing is None:
            raise ImageError(
                "mask",
                f"no field {mask!r}: mask_missing=255 gives such records a mask of that ignore label, "
                "or select= reads only the records whose index.parquet `fields` name it",
            )
        if data is None:
            cropped = np.empty(size, np.uint8) if out is None else out
            cropped.fill(mask_missing)
        else:
            pixels = decode_mask(data, max_pixels)
            if (pixels.shape[1], pixels.shape[0]) != stored:
                raise ImageError(
                    "mask",
                    f"{mask} is {pixels.shape[1]}x{pixels.shape[0]}, its image {stored[0]}x{stored[1]}: not aligned",
                )
            cropped = crop_mask(pixels, window, flip, size, out)
    mapped = None
    if boxes is not None:
        found = parse_boxes(_column(record, boxes, "boxes"), boxes, box_format)
        ids = None if box_labels is None else box_labels.ids(_column(record, box_labels.path, "box_labels"), len(found))
        shown, kept = window_boxes(stored_boxes(found, record.meta, stored, center_crop), window, flip, size)
        mapped = (shown, kept, None if ids is None else ids[kept])
    return cropped, mapped


def _column(record: Record, name: str, stage: str) -> Any:
    try:
        return column_value(record.columns, name)
    except KeyError:
        raise ImageError(stage, f"no column {name!r}") from None


def tv_tensors() -> Any:
    """torchvision's tv_tensors module, or None where torchvision is not installed: with it, boxes
    and masks are typed so torchvision.transforms.v2 composes after the loader."""
    try:
        from torchvision import tv_tensors as module
    except ImportError:
        return None
    return module
