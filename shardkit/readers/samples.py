"""A record made a `Sample`, what `ds[i]` and iteration hand out: its image (or a clip's frames)
decoded as the dataset's `decode=` says, its fields, then the user's transform. The same for one
output and each output of a mix."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from ..core.errors import ImageError, ShardReadError, require
from ..formats.base import Record
from .clips import is_clip, sample_video
from .decode import decode as decode_bytes
from .decode import decode_pil, record_fields

DECODE_MODES = ("rgb", "bytes", "pil", "torch")
SCALES = (1, 1 / 2, 1 / 4, 1 / 8)


class Sample(NamedTuple):
    key: str
    image: Any  # HWC uint8 array ("rgb"), bytes, PIL image, or CHW uint8 tensor ("torch")
    label: int | None
    meta: dict[str, Any]  # shardkit's own: source path, original and stored sizes
    text: str | list[str] | None = None  # the caption (or several), when the source had one
    fields: dict[str, Any] = {}  # noqa: RUF012 - the user's columns; readers give each sample its own dict
    # a clip's frames (readers/clips): (T, H, W, 3) uint8 ("rgb"), the MP4's bytes, a list of PIL
    # images, or a (T, 3, H, W) uint8 tensor ("torch"); its `image` is None. None for an image.
    video: Any = None


_collate_registered = False  # torch's default_collate knows Sample (torch_data.register_sample_collate)


def _register_collate() -> None:
    global _collate_registered
    from .torch_data import register_sample_collate

    register_sample_collate(Sample)
    _collate_registered = True


def sample_of(
    record: Record,
    shard_name: str,
    decode: str,
    scale: float | None,
    max_pixels: int,
    transform: Callable[[Sample], Any] | None,
) -> Any:
    """A record of shard `shard_name` as a dataset hands it out: decoded as `decode` says, its
    fields, then `transform`. A record that does not decode raises ShardReadError (naming the shard
    and key) whatever on_error says: the caller's OnError decides."""
    image = video = None
    try:
        if is_clip(record):
            video = sample_video(record, decode, max_pixels)
        else:
            image = _image(record, decode, scale, max_pixels)
    except (ImageError, ValueError) as error:
        raise ShardReadError(f"{shard_name}: record {record.key}: cannot decode ({error})") from None
    try:
        fields = record_fields(record, decode, max_pixels) if record.columns or record.files else {}
    except (ImageError, ValueError) as error:
        raise ShardReadError(f"{shard_name}: record {record.key}: cannot decode a field ({error})") from None
    sample = Sample(record.key, image, record.label, record.meta, record.text, fields, video)
    if not _collate_registered and "torch" in sys.modules:  # DataLoader(ds, batch_size=N) collates these
        _register_collate()
    return transform(sample) if transform is not None else sample


def _image(record: Record, decode: str, scale: float | None, max_pixels: int) -> Any:
    if decode == "bytes":
        return record.data
    if decode == "pil":
        if record.ext == "npy":
            from PIL import Image

            return Image.fromarray(decode_bytes(record.data, record.ext, max_pixels=max_pixels))
        return decode_pil(record.data, scale, max_pixels)
    pixels = decode_bytes(record.data, record.ext, scale, max_pixels)
    if decode == "torch":
        return require("torch", "torch").from_numpy(np.ascontiguousarray(pixels)).permute(2, 0, 1)
    return pixels
