"""The batch loader's targets stage: a chunk's masks and boxes (loader(mask=, boxes=, box_labels=))
taken through each record's window and flip (readers/targets.py, one record at a time), and put on
the batch as the images are: numpy arrays, torch tensors, or tensors on the device, typed as
torchvision's Mask and BoundingBoxes where it is installed. Made once when the loader is made."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from ..core.errors import ImageError
from .batch import Batch
from .epoch import EpochRecord
from .stats import LoaderClock
from .targets import record_targets

if TYPE_CHECKING:
    from .box_classes import BoxClasses
    from .options import LoaderOptions

# a chunk's masks (or None) and per record (boxes, box index, box labels or None)
Targets = tuple[np.ndarray | None, list[Any]]


class TargetStage:
    """Masks and boxes of the records of a chunk. `tensor` turns a host array into what the batch
    holds (None: the array itself, for output="numpy"); `typed` is torchvision's tv_tensors (or None)."""

    def __init__(
        self,
        options: LoaderOptions,
        classes: BoxClasses | None,
        max_pixels: int,
        tensor: Callable[[np.ndarray], Any] | None,
        typed: Any,
        clock: LoaderClock | None = None,
    ) -> None:
        self.mask, self.boxes, self.box_format = options.mask, options.boxes, options.box_format
        self.mask_missing = None if options.mask_missing is None else int(options.mask_missing)
        self.box_labels, self.classes = options.box_labels, classes
        self.size, self.max_pixels = options.out_size, max_pixels
        self.tensor, self.typed = tensor, typed
        self.clock = clock or LoaderClock(0, enabled=False)

    @property
    def asked(self) -> bool:
        return self.mask is not None or self.boxes is not None

    def measure(
        self,
        chunk: list[EpochRecord],
        sizes: np.ndarray,
        windows: np.ndarray,
        flips: np.ndarray,
        failures: dict[int, str],
    ) -> Targets | None:
        """Masks (uint8 (n, H, W)) and per record (boxes, index, labels) through each record's
        window, before its pixels are decoded; a record whose targets fail joins `failures`. None
        when no target is asked for."""
        if not self.asked:
            return None
        with self.clock.timed("busy:targets"):
            masks = np.empty((len(chunk), *self.size), np.uint8) if self.mask is not None else None
            found: list[Any] = [None] * len(chunk)
            for i, item in enumerate(chunk):
                if i in failures:
                    continue
                try:
                    _, found[i] = record_targets(
                        item.record, (int(sizes[i][0]), int(sizes[i][1])), windows[i], bool(flips[i]), self.size,
                        mask=self.mask, boxes=self.boxes, box_format=self.box_format,
                        center_crop=item.dataset.manifest.packed_resize.center_crop, max_pixels=self.max_pixels,
                        out=None if masks is None else masks[i], mask_missing=self.mask_missing,
                        box_labels=self.classes,
                    )  # fmt: skip
                except ImageError as error:
                    failures[i] = str(error)
            return masks, found

    def attach(self, batch: Batch, targets: Targets | None, keep: list[int] | None) -> None:
        """The kept records' masks and boxes on their batch (`keep`: the chunk's rows it holds, None
        for all of them)."""
        if targets is None:
            return
        with self.clock.timed("busy:targets"):
            masks, found = targets
            if keep is not None:
                masks = masks[keep] if masks is not None else None
                found = [found[i] for i in keep]
            tensor, typed = self.tensor, self.typed
            if masks is not None:
                batch.masks = masks if tensor is None else tensor(masks)
                if typed is not None:
                    batch.masks = typed.Mask(batch.masks)
            if self.boxes is None:
                return
            boxes: list[Any] = [b for b, _, _ in found]
            index: list[Any] = [k for _, k, _ in found]
            labels: list[Any] = [c for _, _, c in found]
            if tensor is not None:
                boxes, index = [tensor(b) for b in boxes], [tensor(k) for k in index]
                labels = [c if c is None else tensor(c) for c in labels]
                if typed is not None:
                    boxes = [typed.BoundingBoxes(b, format="XYXY", canvas_size=self.size) for b in boxes]
            batch.boxes, batch.box_index = boxes, index
            if self.box_labels is not None:
                batch.box_labels = labels
