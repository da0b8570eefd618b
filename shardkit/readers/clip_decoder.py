"""The batch loader's clip decoder (loader(frames=T)): a chunk of packed video clips decoded with PyAV
on a loader thread (readers/clips.py), each clip's window and flip drawn as an image's from its
meta's stored size, and its T consecutive frames from an offset seeded as the windows are (the
middle ones unless crop="random"), all of a clip's frames cropped the same."""

from __future__ import annotations

import numpy as np

from ..core.errors import ConfigError
from .batch import Batch
from .clips import clip_geometry, clip_offsets, crop_clips, is_clip
from .decoding import Parts, StreamKey, WholeOnThreads, kept_rows
from .epoch import EpochRecord
from .targets import window_corners

_OFFSETS = 0x636C6970  # keeps the offsets' generator apart from the windows'


class ClipDecoder(WholeOnThreads):
    """Clips as (N, T, H, W, 3) batches, one window and flip per clip (the module's docstring)."""

    def __init__(self, parts: Parts) -> None:
        self.parts = parts
        self.frames = int(parts.options.frames or 0)
        self.size = parts.options.out_size

    def refuse(self, item: EpochRecord) -> None:
        if not is_clip(item.record):
            raise ConfigError(
                f"{item.shard_name}: record {item.record.key} is not a video clip: frames= reads clips only"
            )

    def decode(self, key: StreamKey, number: int, chunk: list[EpochRecord]) -> Batch:
        """One batch of clips, on a loader thread."""
        parts, limit = self.parts, self.parts.dataset.max_pixels
        for item in chunk:
            self.refuse(item)
        records = [item.record for item in chunk]
        sizes, counts, failures = clip_geometry(records, limit)
        boxes, flips = parts.windows.draw(key, number, sizes)
        rng = np.random.default_rng([*key, number, _OFFSETS]) if parts.options.crop == "random" else None
        offsets = clip_offsets(counts, self.frames, rng)
        images = parts.assembly.buffer((len(chunk), self.frames, *self.size, 3))
        crop_clips(records, boxes, flips, offsets, images, failures, limit)
        windows, keep = window_corners(boxes), kept_rows(chunk, failures, parts.dataset.on_error)
        if keep is not None:
            images, windows, flips, offsets = images[keep], windows[keep], flips[keep], offsets[keep]
            records = [records[i] for i in keep]
        batch = parts.assembly.batch(images, records)
        batch.windows, batch.flips, batch.offsets, batch.kept = windows, flips, offsets, keep
        return batch
