"""The training input: batches of random-resized (or center) crops, decoded straight from the shards
into one uint8 buffer per batch.

The crop window of every image is drawn from its header's size before anything is decoded
(torchvision's RandomResizedCrop, with its arguments and its fallback). A compiled kernel
(`shardkit/_crop.c`) then decodes only what each window needs (libjpeg-turbo's DCT scaling, crop and
skip), resizes it with Pillow's antialiased bilinear filter and flips it, for a whole batch per call
with the GIL released; batches are decoded on `workers` threads while earlier ones are consumed. Raw
(.npy) records go through the same kernel without decoding: the window's rows are read where they
lie in the record's bytes (no copy of the whole image). Records the kernel does not take (PNG, CMYK
JPEGs, Fortran-order raw records), and every record when the kernel was not built, go through Pillow
with the same window, DCT scale and filter: the same pixels within a level or two. Crops and flips
come from a generator seeded by (seed, epoch, rank, batch number), so they do not depend on the
number of threads. Reading never imports the pack side.
"""

from __future__ import annotations

import math
import os
import warnings
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from ..core.codecs import crop_kernel
from ..core.errors import ConfigError, ImageError, ShardReadError, require
from .decode import npy_layout, record_fields
from .epoch import Cursor, Epochs, Item, check_progress
from .order import Progress
from .windows import (
    JPEG_EXTENSIONS,
    center_boxes,
    crop_with_pillow,
    random_resized_boxes,
    record_size,
)

CROPS = ("random", "center", None)
OUTPUTS = ("torch", "numpy")
_FAILED, _UNSUPPORTED = 1, 2


class Batch(tuple[Any, Any]):
    """(images, labels), as `for images, labels in loader` wants, with `.keys`, `.texts` and
    `.fields` alongside (lists, one per image, in the order of the images).

    images: uint8 (N, 3, H, W), in channels_last memory (the buffer is N x H x W x 3); labels:
    int64 (N,), -1 for unlabelled records. Torch tensors, or numpy arrays with output="numpy".
    texts: each image's caption (a string, a list of them, or None); fields: its columns (a dict).
    """

    keys: list[str]
    texts: list[str | list[str] | None]
    fields: list[dict[str, Any]]

    def __new__(
        cls,
        images: Any,
        labels: Any,
        keys: list[str],
        texts: list[str | list[str] | None] | None = None,
        fields: list[dict[str, Any]] | None = None,
    ) -> Batch:
        batch = super().__new__(cls, (images, labels))
        batch.keys = keys
        batch.texts = texts if texts is not None else [None] * len(keys)
        batch.fields = fields if fields is not None else [{} for _ in keys]
        return batch

    @property
    def images(self) -> Any:
        return self[0]

    @property
    def labels(self) -> Any:
        return self[1]


@dataclass(frozen=True)
class LoaderOptions:
    """The batch loader's keywords (see `loader()` for each), made once from them and handed to
    BatchLoader, which checks them. No defaults: those are `loader()`'s own, written once there."""

    batch_size: int
    size: int | tuple[int, int]
    crop: str | None
    flip: bool
    workers: int | None
    scale: tuple[float, float]
    ratio: tuple[float, float]
    resize: int | None
    output: str
    pin_memory: bool
    prefetch: int | None
    drop_last: bool
    device: Any
    dtype: Any
    mean: Sequence[float] | None
    std: Sequence[float] | None


@dataclass
class _Ahead:
    """The device path's batch made ahead: handed out when the next is made (or the epoch ends)."""

    batch: Batch
    done: Any  # the CUDA event its side stream records when it is made (None on the CPU)
    positions: int  # the epoch's positions it stands for, skipped ones included


class BatchLoader:
    """Iterable of `Batch`es over one epoch of a ShardDataset for this rank (see ShardDataset.loader)."""

    def __init__(self, dataset: Epochs, options: LoaderOptions) -> None:
        self.dataset = dataset
        self.batch_size = _positive("batch_size", options.batch_size)
        self.size = _size(options.size)
        crop, scale, ratio, output = options.crop, options.scale, options.ratio, options.output
        if crop not in CROPS:
            raise ConfigError(f"crop must be 'random', 'center' or None, not {crop!r}")
        if output not in OUTPUTS:
            raise ConfigError(f"output must be 'torch' or 'numpy', not {output!r}")
        if not (0 < scale[0] <= scale[1] <= 1) or not all(math.isfinite(v) for v in scale):
            raise ConfigError(f"scale must be 0 < low <= high <= 1, not {scale}")
        if not (0 < ratio[0] <= ratio[1]) or not all(math.isfinite(v) for v in ratio):
            raise ConfigError(f"ratio must be 0 < low <= high, not {ratio}")
        default_resize = round(min(self.size) / 0.875)
        self.resize = default_resize if options.resize is None else _positive("resize", options.resize)
        if crop == "center" and self.resize < max(self.size):
            raise ConfigError(f"resize {self.resize} is smaller than the center crop {self.size}")
        self.crop, self.flip = crop, bool(options.flip)
        self.scale, self.ratio = (scale[0], scale[1]), (ratio[0], ratio[1])
        workers, prefetch = options.workers, options.prefetch
        self.workers = _positive("workers", workers if workers is not None else (os.cpu_count() or 1))
        self.prefetch = _positive("prefetch", prefetch if prefetch is not None else 2 * self.workers)
        self.output, self.drop_last = output, options.drop_last
        if output == "torch":
            self._torch = require("torch", "torch")
            self.pin_memory = options.pin_memory and self._pinning_possible()
        else:
            self._torch, self.pin_memory = None, False
        self.kernel = crop_kernel()
        self.device = None  # None: the CPU path; else a torch.device (readers/device.py)
        if options.device is not None:
            from .device import check_device, check_normalize

            if output != "torch":
                raise ConfigError("device= gives torch tensors on that device: leave output='torch'")
            self.device = check_device(self._torch, options.device)
            self.dtype, self.mean, self.std = check_normalize(self._torch, options.dtype, options.mean, options.std)
            self.pin_memory = False
        elif options.dtype is not None or options.mean is not None or options.std is not None:
            raise ConfigError("dtype, mean and std are the device path's (give device='cuda', or 'cpu')")
        self._stream: Any = None  # the device path's CUDA side stream
        self._ahead: _Ahead | None = None  # the device path's batch made and not yet handed out
        self._progress: Progress | None = None  # where the running (or last) epoch stands
        self._resume: Progress | None = None  # a loaded state, for the next iteration

    def _pinning_possible(self) -> bool:
        if self._torch.cuda.is_available():
            return True
        warnings.warn("pin_memory=True, but no CUDA device is available: batches are not pinned", stacklevel=3)
        return False

    def __len__(self) -> int:
        """Batches per epoch on this rank."""
        samples = self.dataset.samples_per_rank()
        return samples // self.batch_size if self.drop_last else -(-samples // self.batch_size)

    def state_dict(self) -> dict[str, Any]:
        """Where this loader stands in its epoch: a small JSON-able dict (readers/order). Saved after
        batch k, `load_state_dict` in a fresh process continues at batch k+1, with the same samples,
        crops and flips; with another world size, the rest of the epoch split anew."""
        progress = self._progress or self._resume or self.dataset.fresh_progress()
        return progress.to_state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The next iteration resumes where `state` stood (then epochs start whole again)."""
        progress = Progress.from_state(state)
        check_progress(self.dataset, progress)
        self._resume, self._progress = progress, None

    def __iter__(self) -> Iterator[Batch]:
        self._ahead = None
        progress = self._resume if self._resume is not None else self.dataset.fresh_progress()
        self._resume, self._progress = None, progress
        position, items = self.dataset.epoch_items(progress, workers=(0, 1))  # threads do not split the epoch
        first = position.done // self.batch_size
        pool = ThreadPoolExecutor(self.workers, thread_name_prefix="shardkit-loader")
        pending: deque[tuple[Future[Any] | None, int]] = deque()
        try:
            step: Any = self._decode if self.device is None else self._gather
            for number, (positions, chunk) in enumerate(self._chunks(items), start=first):
                work = pool.submit(step, position.stream.key, number, chunk) if chunk else None
                pending.append((work, positions))
                while len(pending) > self.prefetch:
                    yield from self._ready(pending, position)
            while pending:
                yield from self._ready(pending, position)
            if self._ahead is not None:
                yield self._handed_out(position)
        finally:  # an exception, Ctrl-C or a consumer that stopped early: nothing keeps running
            for work, _ in pending:
                if work is not None:
                    work.cancel()
            pool.shutdown(wait=True, cancel_futures=True)

    def _ready(self, pending: deque[tuple[Future[Any] | None, int]], position: Cursor) -> Iterator[Batch]:
        """The next batch to hand out, if there is one. On the device path a batch is made (on a
        CUDA side stream) when its records are ready, and handed out once the next one is made:
        the device works on batch k+1 while batch k trains. A batch's positions count as consumed
        when it is handed out (a state saved then resumes after it, not after the one made ahead)."""
        if self.device is None:
            batch = self._next(pending, position)
            if batch is not None:
                yield batch
            return
        work, positions = pending.popleft()
        gathered = work.result() if work is not None else None
        torch, stream, done = self._torch, self._stream, None
        if gathered is not None and stream is None and self.device.type == "cuda":
            stream = self._stream = torch.cuda.Stream(self.device)
        if gathered is None:
            batch = None
        elif stream is not None:
            with torch.cuda.stream(stream):
                batch = self._on_device(*gathered)
                done = torch.cuda.Event()
                done.record(stream)
        else:
            batch = self._on_device(*gathered)
        if batch is None:  # every record skipped: consumed along with the batch before it
            if self._ahead is None:
                position.advance(positions)
            else:
                self._ahead.positions += positions
            return
        if self._ahead is not None:
            yield self._handed_out(position)
        self._ahead = _Ahead(batch, done, positions)

    def _handed_out(self, position: Cursor) -> Batch:
        assert self._ahead is not None
        batch, done, positions = self._ahead.batch, self._ahead.done, self._ahead.positions
        self._ahead = None
        if done is not None:  # the consumer's stream waits for the side stream, and owns the memory after
            current = self._torch.cuda.current_stream(self.device)
            current.wait_event(done)
            for tensor in (batch.images, batch.labels):
                tensor.record_stream(current)
        position.advance(positions)
        return batch

    def _gather(
        self, key: tuple[int, ...], number: int, chunk: list[Item]
    ) -> tuple[list[Item], np.ndarray, np.ndarray, dict[int, str]]:
        """A batch's records with their windows and flips, drawn from their headers' sizes, and the
        records whose header failed: all of the device path's work on a loader thread (decoding is
        the device's), and the first step of `_decode`."""
        sizes = np.zeros((len(chunk), 2), np.int64)
        failures: dict[int, str] = {}
        for i, (_, _, record) in enumerate(chunk):
            try:
                sizes[i] = record_size(record, self.dataset.max_pixels)
            except ImageError as error:
                failures[i], sizes[i] = error.reason, (1, 1)
        boxes, flips = self._windows(key, number, sizes)
        return chunk, boxes, flips, failures

    def _on_device(
        self, chunk: list[Item], boxes: np.ndarray, flips: np.ndarray, failures: dict[int, str]
    ) -> Batch | None:
        """A Batch on the device from what `_gather` read (readers/device.py), or None when every
        record failed and on_error skips them."""
        from .device import decode_batch, finish, resample_batch

        torch = self._torch
        candidates = [i for i in range(len(chunk)) if i not in failures]
        images, failed = decode_batch(
            torch, [chunk[i].record for i in candidates], self.device, self.dataset.max_pixels
        )
        failures = {**failures, **{candidates[n]: reason for n, reason in failed.items()}}
        keep = self._failed(chunk, failures)
        rows = list(range(len(chunk))) if keep is None else keep
        if not rows:
            return None
        decoded = dict(zip(candidates, images, strict=True))
        pixels = resample_batch(torch, [decoded[i] for i in rows], boxes[rows], flips[rows], self.size)
        records = [chunk[i].record for i in rows]
        labels = torch.tensor([-1 if r.label is None else r.label for r in records], dtype=torch.int64)
        images = finish(torch, pixels, self.dtype, self.mean, self.std)
        batch = Batch(images, labels.to(self.device), [r.key for r in records])
        if any(r.text is not None or r.columns is not None or r.files for r in records):
            batch.texts = [r.text for r in records]
            batch.fields = [record_fields(r, "bytes") for r in records]
        return batch

    @staticmethod
    def _next(pending: deque[tuple[Future[Any] | None, int]], position: Cursor) -> Batch | None:
        """The oldest batch, its positions counted as consumed when it is handed out (a batch whose
        records were all skipped is counted and not handed out)."""
        work, positions = pending.popleft()
        batch = work.result() if work is not None else None
        position.advance(positions)
        return batch

    def _chunks(self, items: Iterator[Item | None]) -> Iterator[tuple[int, list[Item]]]:
        """(positions, the items read at them) per batch of `batch_size` positions."""
        chunk: list[Item] = []
        positions = 0
        for item in items:
            positions += 1
            if item is not None:
                chunk.append(item)
            if positions == self.batch_size:
                yield positions, chunk
                chunk, positions = [], 0
        if positions and not self.drop_last:
            yield positions, chunk

    def _windows(self, key: tuple[int, ...], number: int, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Crop boxes and flips of batch `number` of the stream `key`: the same for the same seed,
        epoch and rank, whatever `workers` is, and again after a resume."""
        rng = np.random.default_rng([*key, number, 0x6C6F6164])
        widths, heights = sizes[:, 0], sizes[:, 1]
        if self.crop == "random":
            boxes = random_resized_boxes(widths, heights, rng, self.scale, self.ratio)
        elif self.crop == "center":
            boxes = center_boxes(widths, heights, self.size, self.resize)
        else:
            boxes = np.stack([np.zeros_like(widths), np.zeros_like(widths), widths, heights], axis=1).astype(float)
        flips = rng.random(len(sizes)) < 0.5 if self.flip else np.zeros(len(sizes), bool)
        return boxes, flips

    def _decode(self, key: tuple[int, ...], number: int, chunk: list[Item]) -> Batch:
        """One batch, on a loader thread: windows from the headers, then the kernel (or Pillow)."""
        dataset = self.dataset
        images = self._buffer(len(chunk))
        chunk, boxes, flips, failures = self._gather(key, number, chunk)
        python_path = [i for i in range(len(chunk)) if i not in failures]
        if self.kernel is not None:
            python_path = self._through_kernel(chunk, python_path, boxes, flips, images, failures)
        for i in python_path:
            record = chunk[i].record
            try:
                images[i] = crop_with_pillow(
                    record.data, record.ext, boxes[i], bool(flips[i]), self.size, dataset.max_pixels
                )
            except (ImageError, ValueError) as error:
                failures[i] = str(error)
        keep = self._failed(chunk, failures)
        if keep is not None:
            images = images[keep]
            chunk = [chunk[i] for i in keep]
        records = [item.record for item in chunk]
        labels = np.array([-1 if r.label is None else r.label for r in records], dtype=np.int64)
        batch = self._batch(images, labels, [r.key for r in records])
        if any(r.text is not None or r.columns is not None or r.files for r in records):
            batch.texts = [r.text for r in records]
            batch.fields = [record_fields(r, "bytes") for r in records]  # sidecar fields as bytes
        return batch

    def _through_kernel(
        self,
        chunk: list[Item],
        candidates: list[int],
        boxes: np.ndarray,
        flips: np.ndarray,
        images: np.ndarray,
        failures: dict[int, str],
    ) -> list[int]:
        """The crops the compiled kernel takes, into `images`: RGB and grey JPEGs (decoded at the
        DCT scale the box allows), and raw records in C order (their pixels read where they lie,
        nothing decoded: 2.5x the JPEG crops on one thread, README). Returns the
        candidates left for Pillow (CMYK JPEGs, Fortran-order raw records, other formats)."""
        kernel, (height, width), limit = cast(Any, self.kernel), self.size, self.dataset.max_pixels
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

    def _failed(self, chunk: list[Item], failures: dict[int, str]) -> list[int] | None:
        """on_error: raise for the first failed record, or the rows to keep (None: all of them)."""
        if not failures:
            return None
        on_error = self.dataset.on_error
        for i in sorted(failures):  # (on_error="raise" raises for the first)
            item = chunk[i]
            on_error(
                ShardReadError(f"{item.shard_name}: record {item.record.key}: cannot decode ({failures[i]})"),
                item.dataset,
            )
        return [i for i in range(len(chunk)) if i not in failures]

    def _buffer(self, n: int) -> np.ndarray:
        shape = (n, *self.size, 3)
        if self.pin_memory:
            pinned: np.ndarray = self._torch.empty(shape, dtype=self._torch.uint8, pin_memory=True).numpy()
            return pinned
        return np.empty(shape, np.uint8)

    def _batch(self, images: np.ndarray, labels: np.ndarray, keys: list[str]) -> Batch:
        chw = images.transpose(0, 3, 1, 2)  # a view: the memory stays N x H x W x 3 (channels_last)
        if self._torch is None:
            return Batch(chw, labels, keys)
        return Batch(self._torch.from_numpy(images).permute(0, 3, 1, 2), self._torch.from_numpy(labels), keys)


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, not {value!r}")
    return int(value)


def _size(size: Any) -> tuple[int, int]:
    if isinstance(size, (int, np.integer)) and not isinstance(size, bool):
        size = (size, size)
    if not (isinstance(size, tuple | list) and len(size) == 2):
        raise ConfigError(f"size must be an int or (height, width), not {size!r}")
    height, width = (_positive("size", value) for value in size)
    if height > 16384 or width > 16384:
        raise ConfigError(f"size must be at most 16384 pixels a side, not {size!r}")
    return height, width
