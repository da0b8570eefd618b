"""Checks of the crop kernel that a child process runs too (SHARDKIT_CROP_PORTABLE takes effect when
the kernel loads): this module imports no torch, so that the child starts in a fraction of the time."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

from shardkit.core.codecs import crop_kernel
from shardkit.synthetic import picture


def npy(array: np.ndarray, fortran: bool = False) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, np.asfortranarray(array) if fortran else array)
    return buffer.getvalue()


def crop_raw(datas: list[bytes], boxes, flips, size: tuple[int, int]) -> np.ndarray:
    from shardkit.readers.decode import npy_layout

    out = np.zeros((len(datas), *size, 3), np.uint8)
    geometry = np.array([npy_layout(data)[:3] for data in datas], np.int64)
    results = crop_kernel().crop_raw_batch(
        datas, geometry, np.ascontiguousarray(boxes, np.float64), np.asarray(flips, np.uint8),
        np.arange(len(datas), dtype=np.int32), out, size[0], size[1], 1 << 40,
    )  # fmt: skip
    assert results == [None] * len(datas), results
    return out


def raw_crops_match_pillow() -> None:
    """Raw records cropped by the kernel: Pillow's antialiased bilinear on the same pixels, within a
    level, for any box and scale, flipped or not."""
    rng = np.random.default_rng(3)
    pixels = [picture(500 - 37 * i, 375 + 29 * i, i, 3) for i in range(10)]
    size = (96, 80)
    boxes, flips = [], []
    for array in pixels:
        height, width = array.shape[:2]
        w, h = int(rng.integers(8, width + 1)), int(rng.integers(8, height + 1))
        boxes.append((float(rng.integers(0, width - w + 1)), float(rng.integers(0, height - h + 1)), w, h))
        flips.append(bool(rng.integers(2)))
    boxes[0] = (0.0, 0.0, pixels[0].shape[1], pixels[0].shape[0])  # the whole image, 5x down
    boxes[1] = (10.25, 3.5, 40.0, 30.0)  # fractional, upscaled
    got = crop_raw([npy(array) for array in pixels], boxes, flips, size)
    for image, array, box, flip in zip(got, pixels, boxes, flips, strict=True):
        left, top, w, h = box
        want = Image.fromarray(array).resize(
            (size[1], size[0]), Image.Resampling.BILINEAR, box=(left, top, left + w, top + h)
        )
        want = np.asarray(want.transpose(Image.Transpose.FLIP_LEFT_RIGHT) if flip else want).astype(int)
        assert np.abs(image.astype(int) - want).max() <= 1
