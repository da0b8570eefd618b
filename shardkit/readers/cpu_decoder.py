"""The batch loader's CPU decoder: a chunk's images crop-decoded on a loader thread into one uint8
buffer. Each window is drawn from its record's header before anything is decoded; the compiled
kernel (`shardkit/_crop.c`) then decodes only what the window needs (libjpeg-turbo's DCT scaling,
crop and skip), resizes it with Pillow's antialiased bilinear filter and flips it, for the whole
chunk in one call with the GIL released. Raw (.npy) records go through the same kernel with nothing
decoded: the window's rows are read where they lie in the record. Records the kernel does not take
(PNG, CMYK JPEGs, Fortran-order raw records), and every record where the kernel was not built, go
through Pillow with the same window, DCT scale and filter: the same pixels within a level or two."""

from __future__ import annotations

from typing import Any, cast

import numpy as np

from ..core.errors import ConfigError, ImageError
from .batch import Batch
from .clips import is_clip
from .decode import npy_layout
from .decoding import Parts, StreamKey, WholeOnThreads, kept_rows
from .epoch import EpochRecord
from .targets import window_corners
from .windows import JPEG_EXTENSIONS, crop_with_pillow, header_sizes

_FAILED = 1  # the kernel's outcome for a record it refused (2: handed back for Pillow to convert)


class CpuDecoder(WholeOnThreads):
    """Images cropped, resized and flipped on the loader threads (the module's docstring)."""

    def __init__(self, parts: Parts) -> None:
        self.parts = parts
        self.size = parts.options.out_size

    def refuse(self, item: EpochRecord) -> None:
        if is_clip(item.record):
            raise ConfigError(f"{item.shard_name}: record {item.record.key} is a video clip: read clips with frames=T")

    def decode(self, key: StreamKey, number: int, chunk: list[EpochRecord]) -> Batch:
        """One batch, on a loader thread: windows from the headers, targets, then the kernel (or Pillow)."""
        parts, limit = self.parts, self.parts.dataset.max_pixels
        for item in chunk:
            self.refuse(item)
        images = parts.assembly.buffer((len(chunk), *self.size, 3))
        sizes, failures = header_sizes([item.record for item in chunk], limit, parts.kernel)
        parts.clock.pixels(int(sizes.prod(axis=1).sum()), len(chunk) * self.size[0] * self.size[1])
        boxes, flips = parts.windows.draw(key, number, sizes)
        windows = window_corners(boxes)
        targets = parts.targets.measure(chunk, sizes, windows, flips, failures)  # (first: a failure skips a decode)
        python_path = [i for i in range(len(chunk)) if i not in failures]
        if parts.kernel is not None:
            python_path = self._through_kernel(chunk, python_path, boxes, flips, images, failures)
        for i in python_path:
            record = chunk[i].record
            try:
                images[i] = crop_with_pillow(record.data, record.ext, boxes[i], bool(flips[i]), self.size, limit)
            except (ImageError, ValueError) as error:
                failures[i] = str(error)
        keep = kept_rows(chunk, failures, parts.dataset.on_error)
        if keep is not None:
            images, windows, flips = images[keep], windows[keep], flips[keep]
            chunk = [chunk[i] for i in keep]
        batch = parts.assembly.batch(images, [item.record for item in chunk])
        batch.windows, batch.flips, batch.kept = windows, flips, keep
        parts.targets.attach(batch, targets, keep)
        return batch

    def _through_kernel(
        self,
        chunk: list[EpochRecord],
        candidates: list[int],
        boxes: np.ndarray,
        flips: np.ndarray,
        images: np.ndarray,
        failures: dict[int, str],
    ) -> list[int]:
        """The crops the compiled kernel takes, into `images`: RGB and grey JPEGs (decoded at the
        DCT scale the box allows), and raw records in C order (their pixels read where they lie,
        nothing decoded). Returns the candidates left for Pillow (CMYK JPEGs, Fortran-order raw
        records, other formats)."""
        kernel, (height, width), limit = cast(Any, self.parts.kernel), self.size, self.parts.dataset.max_pixels
        jpegs = [i for i in candidates if chunk[i].record.ext in JPEG_EXTENSIONS]
        raws, layouts = [], []
        for i in candidates:
            if chunk[i].record.ext == "npy":
                try:
                    offset, columns, rows, fortran = npy_layout(chunk[i].record.data, limit)
                except ImageError as error:
                    failures[i] = error.reason
                    continue
                if not fortran:
                    raws.append(i)
                    layouts.append((offset, columns, rows))

        def windows(indices: list[int]) -> tuple[Any, ...]:
            return (np.ascontiguousarray(boxes[indices]), flips[indices].astype(np.uint8),
                    np.array(indices, np.int32), images, height, width, limit)  # fmt: skip

        outcomes: list[tuple[int, str, Any]] = []
        if jpegs:
            found = kernel.decode_batch([chunk[i].record.data for i in jpegs], *windows(jpegs))
            outcomes += [(i, "corrupt JPEG", result) for i, result in zip(jpegs, found, strict=True)]
        if raws:
            geometry = np.array(layouts, np.int64)
            found = kernel.crop_raw_batch([chunk[i].record.data for i in raws], geometry, *windows(raws))
            outcomes += [(i, "bad raw pixels", result) for i, result in zip(raws, found, strict=True)]
        done = set()
        for i, what, result in outcomes:
            if result is None:
                done.add(i)
            elif result[0] == _FAILED:
                failures[i] = f"{what}: {result[1]}"
            # else handed back (not an RGB or grey JPEG): Pillow converts it
        return [i for i in candidates if i not in done and i not in failures]
