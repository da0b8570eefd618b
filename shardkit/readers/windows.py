"""Crop windows, drawn from image headers before anything is decoded: torchvision's
RandomResizedCrop and Resize+CenterCrop as windows of the original image, the DCT reduction a
window allows, and the Pillow path that crops any record with the same window, scale and filter
as the compiled kernel. Every decoder of the batch loader (CPU, device, clips) draws its windows
and flips with one `WindowDraw`, seeded by the stream and the chunk's number, so they are the same
whichever decoder and however many threads."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from ..core.errors import ImageError
from ..core.headers import jpeg_size
from ..formats.base import Record
from .decode import refuse_over, stored_size

JPEG_EXTENSIONS = ("jpg", "jpeg")
_WINDOWS = 0x6C6F6164  # keeps the windows' generator apart from every other seeded by the stream


class WindowDraw(NamedTuple):
    """How the loader draws a chunk's windows: its crop=, scale=, ratio= and flip=, the output size
    (height, width) and, for crop="center", the short side resized to."""

    crop: str | None
    scale: tuple[float, float]
    ratio: tuple[float, float]
    size: tuple[int, int]
    resize: int
    flip: bool

    def draw(self, key: tuple[int, ...], number: int, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Crop boxes (left, top, width, height) and flips of chunk `number` of the stream `key`,
        for images of `sizes` (width, height): the same for the same seed, epoch and rank, whatever
        the threads, and again after a resume."""
        rng = np.random.default_rng([*key, number, _WINDOWS])
        widths, heights = sizes[:, 0], sizes[:, 1]
        if self.crop == "random":
            boxes = random_resized_boxes(widths, heights, rng, self.scale, self.ratio)
        elif self.crop == "center":
            boxes = center_boxes(widths, heights, self.size, self.resize)
        else:
            boxes = np.stack([np.zeros_like(widths), np.zeros_like(widths), widths, heights], axis=1).astype(float)
        flips = rng.random(len(sizes)) < 0.5 if self.flip else np.zeros(len(sizes), bool)
        return boxes, flips


def random_resized_boxes(
    widths: np.ndarray,
    heights: np.ndarray,
    rng: np.random.Generator,
    scale: tuple[float, float] = (0.08, 1.0),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
    attempts: int = 10,
) -> np.ndarray:
    """torchvision's RandomResizedCrop.get_params for a batch: (left, top, width, height) per image.

    Up to ten tries of an area share uniform in `scale` and a log-uniform aspect ratio in `ratio`;
    the first that fits is placed uniformly; none fitting falls back to the largest centered crop
    with the aspect clamped to `ratio` (the whole image when its aspect is within it)."""
    widths, heights = np.asarray(widths, np.int64), np.asarray(heights, np.int64)
    n = len(widths)
    area = (widths * heights).astype(np.float64)
    target = area[:, None] * rng.uniform(scale[0], scale[1], (n, attempts))
    aspect = np.exp(rng.uniform(math.log(ratio[0]), math.log(ratio[1]), (n, attempts)))
    w = np.round(np.sqrt(target * aspect)).astype(np.int64)
    h = np.round(np.sqrt(target / aspect)).astype(np.int64)
    fits = (w > 0) & (w <= widths[:, None]) & (h > 0) & (h <= heights[:, None])
    first = np.argmax(fits, axis=1)
    found = fits[np.arange(n), first]
    w, h = w[np.arange(n), first], h[np.arange(n), first]
    top = (rng.random(n) * (heights - h + 1)).astype(np.int64)
    left = (rng.random(n) * (widths - w + 1)).astype(np.int64)
    # The fallback: a centered crop, the aspect ratio clamped into `ratio`.
    in_ratio = widths / heights
    fw, fh = widths.copy(), heights.copy()
    narrow, wide = in_ratio < min(ratio), in_ratio > max(ratio)
    fh[narrow] = np.round(widths[narrow] / min(ratio)).astype(np.int64)
    fw[wide] = np.round(heights[wide] * max(ratio)).astype(np.int64)
    w, h = np.where(found, w, fw), np.where(found, h, fh)
    top = np.where(found, top, (heights - h) // 2)
    left = np.where(found, left, (widths - w) // 2)
    return np.stack([left, top, w, h], axis=1).astype(np.float64)


def center_boxes(widths: np.ndarray, heights: np.ndarray, size: tuple[int, int], resize: int) -> np.ndarray:
    """torchvision's Resize(resize) then CenterCrop(size) as one window of the original image (the
    same sampling positions and filter width as the two steps)."""
    widths, heights = np.asarray(widths, np.float64), np.asarray(heights, np.float64)
    short, long = np.minimum(widths, heights), np.maximum(widths, heights)
    new_long = np.floor(resize * long / short)
    new_w = np.where(widths <= heights, resize, new_long)
    new_h = np.where(widths <= heights, new_long, resize)
    out_h, out_w = size
    top = np.round((new_h - out_h) / 2.0)
    left = np.round((new_w - out_w) / 2.0)
    sx, sy = widths / new_w, heights / new_h
    return np.stack([left * sx, top * sy, out_w * sx, out_h * sy], axis=1)


def dct_denominator(box_width: float, box_height: float, size: tuple[int, int]) -> int:
    """The strongest DCT reduction (8, 4, 2) that keeps the window at least the output size, or 1."""
    for denominator in (8, 4, 2):
        if box_width / denominator >= size[1] and box_height / denominator >= size[0]:
            return denominator
    return 1


def crop_with_pillow(data: bytes, ext: str, box: Sequence[float], flip: bool, size: tuple[int, int],
                     max_pixels: int) -> np.ndarray:  # fmt: skip
    """The Python path: the same window, DCT scale and filter as the kernel, through Pillow (any
    record type: JPEG of any colour space, PNG, raw pixels)."""
    from PIL import Image

    from .decode import decode, open_record, pillow_errors

    left, top, width, height = box
    if ext in JPEG_EXTENSIONS:
        image = open_record(data, max_pixels)
        with pillow_errors():
            denominator = dct_denominator(width, height, size)
            factor = denominator if denominator > 1 and image.format == "JPEG" else 1
            if factor > 1:  # draft() takes the largest reduction that keeps this size: exactly 1/factor
                image.draft("RGB", (image.width // factor, image.height // factor))
            image = image.convert("RGB")
    else:
        image, factor = Image.fromarray(decode(data, ext, max_pixels=max_pixels)), 1
    crop = (left / factor, top / factor, (left + width) / factor, (top + height) / factor)
    out = image.resize((size[1], size[0]), Image.Resampling.BILINEAR, box=crop)
    if flip:
        out = out.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return np.asarray(out)


def record_size(record: Record, max_pixels: int) -> tuple[int, int]:
    """(width, height) of a record's image from its header alone."""
    size = jpeg_size(record.data) if record.ext in JPEG_EXTENSIONS else None
    if size is None:
        size = stored_size(record.data, record.ext, max_pixels)  # (checks max_pixels itself)
    else:  # before any decoder allocates: the device path's has no limit of its own
        refuse_over(size, max_pixels)
    if not (size[0] > 0 and size[1] > 0):  # (a header saying 0: no window can be drawn in it)
        raise ImageError("decode", f"an empty {size[0]}x{size[1]} image")
    return size


def header_sizes(records: Sequence[Record], max_pixels: int, kernel: Any) -> tuple[np.ndarray, dict[int, str]]:
    """Each record's stored (width, height) from its header, and the records whose header fails
    (their size left 1 x 1, so a window can still be drawn). The kernel, where built, reads every
    JPEG's size in one call; the rest, and every refusal, go through `record_size`."""
    sizes = np.full((len(records), 2), -1, np.int64)
    if kernel is not None:
        kernel.jpeg_sizes([r.data if r.ext in JPEG_EXTENSIONS else b"" for r in records], sizes)
    widths, heights = sizes[:, 0], sizes[:, 1]
    plain = (widths > 0) & (heights > 0) & (widths * heights <= max_pixels)  # what record_size would take as is
    failures: dict[int, str] = {}
    for i in np.flatnonzero(~plain).tolist():
        try:
            sizes[i] = record_size(records[i], max_pixels)
        except ImageError as error:
            failures[i], sizes[i] = error.reason, (1, 1)
    return sizes, failures
