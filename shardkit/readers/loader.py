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
number of threads; every batch says them (windows, flips), and a record's mask and boxes, when
asked for, go through the same ones (readers/targets.py). Batches are decoded as chunks of
`batch_size` positions and handed out as batches of exactly `batch_size` records (readers/batch.py:
a chunk with skipped records is filled from the next). Reading never imports the pack side.
"""

from __future__ import annotations

import itertools
import math
import os
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from ..core.codecs import crop_kernel
from ..core.errors import ConfigError, ImageError, ShardReadError, require
from .batch import Assembly, Batch, Decoded, full_batches
from .clips import clip_geometry, clip_offsets, crop_clips, is_clip
from .decode import npy_layout, record_fields
from .epoch import Epochs, Item, check_progress
from .order import Progress
from .split import rank_and_world
from .targets import center_cropped, check_target_options, record_targets, tv_tensors, window_corners
from .windows import (
    JPEG_EXTENSIONS,
    center_boxes,
    crop_with_pillow,
    random_resized_boxes,
    record_size,
)

CROPS = ("random", "center", None)
DEVICE_AHEAD = 2  # batches the device path makes past the one handed out
OUTPUTS = ("torch", "numpy")
_FAILED, _UNSUPPORTED = 1, 2
# a batch's masks (or None) and per record (boxes, box index, box labels or None)
Targets = tuple[np.ndarray | None, list[Any]]
# a chunk on its way: its decode's future (None: no records read), its positions, its items' places
_Pending = tuple[Future[Any] | None, int, list[int]]


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
    mask: str | None
    boxes: str | None
    box_format: str
    frames: int | None
    mask_missing: int | None
    box_labels: str | None


class _DeviceLane:
    """The device path's own two threads, in order, a batch at a time: one decodes (nvJPEG's batched
    decode blocks the thread that calls it until the batch is decoded, with the GIL released), the
    other queues the crop, resize and output on a CUDA side stream; so batch k's resample is queued,
    and runs on the GPU, while batch k+1 decodes, and neither waits on the loop that hands batches
    out. At most `ahead` batches past the last one handed out are decoded or made."""

    def __init__(self, loader: BatchLoader, ahead: int) -> None:
        self._loader, self._slots, self._closed = loader, threading.Semaphore(ahead), threading.Event()
        self._decoder = ThreadPoolExecutor(1, thread_name_prefix="shardkit-device-decode")
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="shardkit-device")
        self._stream: Any = None  # the decode's own CUDA stream (made on first use)

    def submit(self, gathered: Future[Any]) -> Future[Any]:
        """The batch `gathered` (a `_gather` future) will give, made on the device: a future of
        (Batch, the event its stream records after it) or None (every record skipped)."""
        decoded = self._decoder.submit(self._decode, gathered)
        return self._thread.submit(self._make, decoded)

    def _decode(self, gathered: Future[Any]) -> Any:
        """The decode thread's part: a batch's images on the device, laid end to end (or None)."""
        while not self._slots.acquire(timeout=0.1):  # (the loop hands batches out, or closes)
            if self._closed.is_set():
                return None
        if self._closed.is_set():
            return None
        loader = self._loader
        torch, device = loader._torch, cast(Any, loader.device)
        if device.type != "cuda":
            return loader._decode_on_device(*gathered.result())
        # Its own stream, not the side stream: what the decode allocates comes from that stream's
        # memory, which nothing else frees, and nvJPEG writes it on its own stream without waiting
        # for the one current here. That stream is done before the next decode starts (below): its
        # one copy, the images laid end to end, was queued right after the decode ended.
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        with torch.cuda.device(device), torch.cuda.stream(self._stream):
            decoded = loader._decode_on_device(*gathered.result())
        self._stream.synchronize()
        return decoded

    def _make(self, decoded: Future[Any]) -> tuple[Batch | None, Any] | None:
        made = decoded.result()
        if made is None:
            return None
        loader = self._loader
        torch, device = loader._torch, cast(Any, loader.device)
        if device.type != "cuda":
            return loader._on_device(*made), None
        stream = loader._side_stream()
        with torch.cuda.device(device), torch.cuda.stream(stream):
            batch = loader._on_device(*made)
            done = torch.cuda.Event()
            done.record(stream)
        return batch, done

    def handed(self, made: tuple[Batch | None, Any] | None) -> Batch | None:
        """A made batch as the consumer gets it: on CUDA, the consumer's stream waits for the side
        stream and owns the memory after. Frees its slot for the lane's next batch."""
        self._slots.release()
        if made is None:
            return None
        batch, done = made
        if batch is not None and done is not None:
            torch = self._loader._torch
            current = torch.cuda.current_stream(self._loader.device)
            current.wait_event(done)
            for tensor in (batch.images, batch.labels, *batch.target_tensors()):
                tensor.record_stream(current)
        return batch

    def close(self) -> None:
        self._closed.set()
        self._slots.release()
        self._decoder.shutdown(wait=True, cancel_futures=True)
        self._thread.shutdown(wait=True, cancel_futures=True)


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
        if workers == 0:  # torch's DataLoader reads num_workers=0 so: in the calling thread
            self.workers, self.prefetch = 0, 0
        else:
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
        check_target_options(options.mask, options.boxes, options.box_format, options.mask_missing, options.box_labels)
        self.mask, self.boxes, self.box_format = options.mask, options.boxes, options.box_format
        self.mask_missing = None if options.mask_missing is None else int(options.mask_missing)
        self.frames = None if options.frames is None else _positive("frames", options.frames)
        if self.frames is not None and (self.device is not None or self.mask is not None or self.boxes is not None):
            raise ConfigError("frames= (clips) takes no device=, mask= or boxes=: clips are decoded on the CPU")
        # made once, from the index alone: the same ids on every rank, worker and resume
        self.box_labels = options.box_labels
        self._classes = None if options.box_labels is None else dataset.box_vocabulary(options.box_labels)
        # imported here, not on a loader thread (an import there would hold the import lock)
        wants_typed = self._torch is not None and (self.mask is not None or self.boxes is not None)
        self._tv_tensors = tv_tensors() if wants_typed else None
        self._stream: Any = None  # the device path's CUDA side stream (made on first use, kept)
        self._progress: Progress | None = None  # where the running (or last) epoch stands
        self._resume: Progress | None = None  # a loaded state, for the next iteration

    def _pinning_possible(self) -> bool:
        if self._torch.cuda.is_available():
            return True
        warnings.warn("pin_memory=True, but no CUDA device is available: batches are not pinned", stacklevel=3)
        return False

    @property
    def box_classes(self) -> list[Any] | None:
        """The classes `batch.box_labels` number boxes by (ds.box_classes(box_labels)), None without
        box_labels=: with text categories a box's id is its category's place in this list."""
        return None if self._classes is None else list(self._classes.classes)

    def __len__(self) -> int:
        """Batches per epoch on this rank: exact when no record is skipped; with on_error="skip" an
        upper bound (batches are filled from the stream, so skips end the epoch sooner)."""
        samples = self.dataset.samples_per_rank()
        return samples // self.batch_size if self.drop_last else -(-samples // self.batch_size)

    def state_dict(self) -> dict[str, Any]:
        """Where this loader stands in its epoch: a small JSON-able dict (readers/order). Saved after
        batch k, `load_state_dict` in a fresh process continues at batch k+1, with the same samples,
        crops and flips; with another world size, the rest of the epoch split anew. With
        on_error="skip" on several ranks, it is this rank's: each rank saves and loads its own."""
        progress = self._progress or self._resume or self.dataset.fresh_progress()
        return progress.to_state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The next iteration resumes where `state` stood (then epochs start whole again)."""
        progress = Progress.from_state(state)
        check_progress(self.dataset, progress)
        rank, world = rank_and_world(self.dataset.rank, self.dataset.world_size)
        progress.check_layout(world, 1, self.dataset.drop_last, rank)
        carry = progress.splits[-1].carry if progress.splits else None
        if carry is not None and carry[1] >= self.batch_size:
            raise ConfigError(
                f"this state's carry reaches {carry[1]:,} positions into a chunk of batch_size {self.batch_size:,}: "
                "resume it with the batch size it was saved with"
            )
        self._resume, self._progress = progress, None

    def __iter__(self) -> Iterator[Batch]:
        progress = self._resume if self._resume is not None else self.dataset.fresh_progress()
        self._resume, self._progress = None, progress
        # threads do not split the epoch; the loader resumes a carry itself (readers/batch.py)
        position, items = self.dataset.epoch_items(progress, workers=(0, 1), carry=True)
        rank, world = rank_and_world(self.dataset.rank, self.dataset.world_size)
        if world > 1 and self.dataset.on_error.name == "skip":  # each rank's counts are its own
            progress.splits[position.split].rank = rank
        first = position.done // self.batch_size
        named = f"shardkit-loader-{next(_POOLS)}"
        pool: Executor = (
            ThreadPoolExecutor(self.workers, thread_name_prefix=named) if self.workers else _InCallingThread()
        )
        lane = _DeviceLane(self, DEVICE_AHEAD) if self.device is not None else None
        pending: deque[_Pending] = deque()
        assembly = Assembly(self._torch, self._tv_tensors, self.pin_memory)
        try:
            chunks = self._decoded(items, position.stream.key, first, pool, lane, pending)
            yield from full_batches(chunks, position, self.batch_size, self.drop_last, assembly)
        finally:  # an exception, Ctrl-C or a consumer that stopped early: nothing keeps running
            for work, _, _ in pending:
                if work is not None:
                    work.cancel()
            _stop(pool, lane, named)

    def _decoded(
        self,
        items: Iterator[Item | None],
        key: tuple[int, ...],
        first: int,
        pool: Executor,
        lane: _DeviceLane | None,
        pending: deque[_Pending],
    ) -> Iterator[Decoded]:
        """The stream's chunks of batch_size positions decoded in order, numbered from `first` (their
        windows' seeds), up to `prefetch` of them submitted ahead of the one handed on."""
        step: Any = self._decode if lane is None else self._gather
        if self.frames is not None:
            step = self._decode_clips
        for number, (positions, chunk, offsets) in enumerate(self._chunks(items), start=first):
            work = pool.submit(step, key, number, chunk) if chunk else None
            if work is not None and lane is not None:
                work = lane.submit(work)
            pending.append((work, positions, offsets))
            while len(pending) > self.prefetch:
                yield self._next(pending, lane)
        while pending:
            yield self._next(pending, lane)

    def _side_stream(self) -> Any:
        if self._stream is None:
            self._stream = self._torch.cuda.Stream(self.device)
        return self._stream

    def _gather(
        self, key: tuple[int, ...], number: int, chunk: list[Item]
    ) -> tuple[list[Item], np.ndarray, np.ndarray, dict[int, str], list[Any] | None, Any, Targets | None]:
        """The device path's host work, on a loader thread (decoding is the device's): a batch's
        records with their windows and flips, drawn from their headers' sizes, the records whose
        header failed, the JPEGs' bytes as the tensors its decoder takes, the resample's taps
        (readers/device.py's plan), and masks and boxes when asked (made on the host, as a mask's
        PNG is decoded there)."""
        from .device import encoded_jpegs, plan_resample

        sizes, boxes, flips, failures = self._sized_windows(key, number, chunk)
        targets = self._targets(chunk, sizes, window_corners(boxes), flips, failures)
        encoded = encoded_jpegs(self._torch, [item.record for item in chunk])
        plan = plan_resample(sizes[:, ::-1], boxes, flips, self.size)  # (sizes: width, height)
        return chunk, boxes, flips, failures, encoded, plan, targets

    def _sized_windows(
        self, key: tuple[int, ...], number: int, chunk: list[Item]
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict[int, str]]:
        """A batch's stored sizes (width, height) from the headers, windows, flips, and the records
        whose header failed."""
        records = [item.record for item in chunk]
        for i, record in enumerate(records):
            if is_clip(record):
                raise ConfigError(
                    f"{chunk[i].shard_name}: record {record.key} is a video clip: read clips with frames=T"
                )
        limit = self.dataset.max_pixels
        sizes = np.full((len(chunk), 2), -1, np.int64)
        if self.kernel is not None:  # headers.jpeg_size of every JPEG in one call (~3 us a record in Python)
            self.kernel.jpeg_sizes([r.data if r.ext in JPEG_EXTENSIONS else b"" for r in records], sizes)
        widths, heights = sizes[:, 0], sizes[:, 1]
        plain = (widths > 0) & (heights > 0) & (widths * heights <= limit)  # what record_size would take as is
        failures: dict[int, str] = {}
        for i in np.flatnonzero(~plain).tolist():  # other formats, odd JPEGs, and every refusal: record_size's
            try:
                sizes[i] = record_size(records[i], limit)
            except ImageError as error:
                failures[i], sizes[i] = error.reason, (1, 1)
        boxes, flips = self._windows(key, number, sizes)
        return sizes, boxes, flips, failures

    def _decode_on_device(
        self,
        chunk: list[Item],
        boxes: np.ndarray,
        flips: np.ndarray,
        failures: dict[int, str],
        encoded: list[Any] | None,
        plan: Any,
        targets: Targets | None,
    ) -> tuple[list[Item], list[int], Any, np.ndarray, Any, np.ndarray, np.ndarray, Targets | None] | None:
        """The device path's first step, on its decode thread: the batch's images decoded on the
        device (readers/device.py) and laid end to end, with the rows kept (on_error), their shapes
        and their plan; None when every record failed and on_error skips them."""
        from .device import decode_batch, flatten_images, plan_resample

        candidates = [i for i in range(len(chunk)) if i not in failures]
        images, failed = decode_batch(
            self._torch,
            [chunk[i].record for i in candidates],
            self.device,
            self.dataset.max_pixels,
            None if encoded is None else [encoded[i] for i in candidates],
        )
        failures = {**failures, **{candidates[n]: reason for n, reason in failed.items()}}
        keep = self._failed(chunk, failures)
        rows = list(range(len(chunk))) if keep is None else keep
        if not rows:
            return None
        decoded = dict(zip(candidates, images, strict=True))
        kept = [decoded[i] for i in rows]
        shapes = np.array([(int(image.shape[1]), int(image.shape[2])) for image in kept], np.int64)
        plan = plan if keep is None else plan.take(rows)
        if not np.array_equal(plan.shapes, shapes):  # (a decoder that disagrees with the header)
            plan = plan_resample(shapes, boxes[rows], flips[rows], self.size)
        return chunk, rows, flatten_images(self._torch, kept), shapes, plan, boxes[rows], flips[rows], targets

    def _on_device(
        self,
        chunk: list[Item],
        rows: list[int],
        flat: Any,
        shapes: np.ndarray,
        plan: Any,
        boxes: np.ndarray,
        flips: np.ndarray,
        targets: Targets | None,
    ) -> Batch:
        """A Batch on the device from what `_decode_on_device` made: the crops resized and flipped,
        the output and the labels queued on the device without waiting for it."""
        from .device import finish, resample_planned, to_device

        torch = self._torch
        if flat.device.type == "cuda":  # (made on the decode's stream, read on this one)
            flat.record_stream(torch.cuda.current_stream(flat.device))
        pixels = resample_planned(torch, flat, shapes, plan, self.size)
        records = [chunk[i].record for i in rows]
        labels = np.array([-1 if r.label is None else r.label for r in records], dtype=np.int64)
        images = finish(torch, pixels, self.dtype, self.mean, self.std)
        batch = Batch(images, to_device(torch, labels, self.device), [r.key for r in records])
        batch.windows, batch.flips, batch.kept = window_corners(boxes), flips.copy(), rows
        if targets is not None:
            self._attach_targets(batch, targets, rows)
        if any(r.text is not None or r.columns is not None or r.files for r in records):
            batch.texts = [r.text for r in records]
            batch.fields = [record_fields(r, "bytes") for r in records]
        return batch

    @staticmethod
    def _next(pending: deque[_Pending], lane: _DeviceLane | None = None) -> Decoded:
        """The oldest chunk, decoded, with the places of the records it kept (none when all of them
        failed). On the device path the lane made it; the lane makes the next ones meanwhile."""
        work, positions, offsets = pending.popleft()
        if work is None:
            batch = None
        elif lane is None:
            batch = work.result()
        else:
            try:
                made = work.result()
            except BaseException:
                lane.handed(None)
                raise
            batch = lane.handed(made)
        if batch is None:
            return Decoded(None, positions, [])
        kept = offsets if batch.kept is None else [offsets[i] for i in batch.kept]
        return Decoded(batch if kept else None, positions, kept)

    def _chunks(self, items: Iterator[Item | None]) -> Iterator[tuple[int, list[Item], list[int]]]:
        """(positions, the items read at them, each item's place among them) per chunk of
        `batch_size` positions; the last may be shorter (drop_last drops what is left of the
        records after the last full batch: readers/batch.py). A short last chunk is not read with
        drop_last unless records are skipped: only then can its records fill a batch."""
        chunk: list[Item] = []
        offsets: list[int] = []
        positions = 0
        for item in items:
            if item is not None:
                chunk.append(item)
                offsets.append(positions)
            positions += 1
            if positions == self.batch_size:
                yield positions, chunk, offsets
                chunk, offsets, positions = [], [], 0
        if positions and (not self.drop_last or self.dataset.on_error.name == "skip"):
            yield positions, chunk, offsets

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
        sizes, boxes, flips, failures = self._sized_windows(key, number, chunk)
        windows = window_corners(boxes)
        targets = self._targets(chunk, sizes, windows, flips, failures)  # (before decoding: a failure skips it)
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
            images, windows, flips = images[keep], windows[keep], flips[keep]
            chunk = [chunk[i] for i in keep]
        records = [item.record for item in chunk]
        labels = np.array([-1 if r.label is None else r.label for r in records], dtype=np.int64)
        batch = self._batch(images, labels, [r.key for r in records])
        batch.windows, batch.flips, batch.kept = windows, flips, keep
        if targets is not None:
            self._attach_targets(batch, targets, keep)
        if any(r.text is not None or r.columns is not None or r.files for r in records):
            batch.texts = [r.text for r in records]
            batch.fields = [record_fields(r, "bytes") for r in records]  # sidecar fields as bytes
        return batch

    def _decode_clips(self, key: tuple[int, ...], number: int, chunk: list[Item]) -> Batch:
        """One batch of clips, on a loader thread (readers/clips.py): each clip's window and flip
        drawn as an image's, from its meta's stored size; its `frames` consecutive frames from an
        offset seeded as the windows are (centered unless crop="random"); all cropped the same."""
        frames, limit = cast(int, self.frames), self.dataset.max_pixels
        for item in chunk:
            if not is_clip(item.record):
                raise ConfigError(
                    f"{item.shard_name}: record {item.record.key} is not a video clip: frames= reads clips only"
                )
        records = [item.record for item in chunk]
        sizes, counts, failures = clip_geometry(records, limit)
        boxes, flips = self._windows(key, number, sizes)
        rng = np.random.default_rng([*key, number, 0x636C6970]) if self.crop == "random" else None
        offsets = clip_offsets(counts, frames, rng)
        images = self._buffer(len(chunk), frames)
        crop_clips(records, boxes, flips, offsets, images, failures, limit)
        windows, keep = window_corners(boxes), self._failed(chunk, failures)
        if keep is not None:
            images, windows, flips, offsets = images[keep], windows[keep], flips[keep], offsets[keep]
            records = [records[i] for i in keep]
        labels = np.array([-1 if r.label is None else r.label for r in records], dtype=np.int64)
        batch = self._batch(images, labels, [r.key for r in records])
        batch.windows, batch.flips, batch.offsets, batch.kept = windows, flips, offsets, keep
        if any(r.text is not None or r.columns is not None or r.files for r in records):
            batch.texts = [r.text for r in records]
            batch.fields = [record_fields(r, "bytes") for r in records]
        return batch

    def _targets(
        self,
        chunk: list[Item],
        sizes: np.ndarray,
        windows: np.ndarray,
        flips: np.ndarray,
        failures: dict[int, str],
    ) -> Targets | None:
        """Masks (uint8 (n, H, W)) and per-record (boxes, index) through each record's window
        (readers/targets.py); a record whose targets fail joins `failures`. None when not asked."""
        if self.mask is None and self.boxes is None:
            return None
        masks = np.empty((len(chunk), *self.size), np.uint8) if self.mask is not None else None
        found: list[Any] = [None] * len(chunk)
        for i, item in enumerate(chunk):
            if i in failures:
                continue
            try:
                _, found[i] = record_targets(
                    item.record, (int(sizes[i][0]), int(sizes[i][1])), windows[i], bool(flips[i]), self.size,
                    mask=self.mask, boxes=self.boxes, box_format=self.box_format,
                    center_crop=center_cropped(item.dataset.manifest.settings), max_pixels=self.dataset.max_pixels,
                    out=None if masks is None else masks[i], mask_missing=self.mask_missing,
                    box_labels=self._classes,
                )  # fmt: skip
            except ImageError as error:
                failures[i] = str(error)
        return masks, found

    def _attach_targets(self, batch: Batch, targets: Targets, keep: list[int] | None) -> None:
        """The kept records' masks and boxes on the batch: torch tensors with output="torch" (on the
        device on the device path), typed as torchvision's Mask and BoundingBoxes where it is installed."""
        masks, found = targets
        if keep is not None:
            masks = masks[keep] if masks is not None else None
            found = [found[i] for i in keep]
        torch, typed = self._torch, self._tv_tensors
        if torch is None:
            tensor: Any = None
        elif self.device is None:
            tensor = torch.from_numpy
        else:
            from .device import to_device

            def tensor(array: np.ndarray) -> Any:
                return to_device(torch, array, self.device)

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
                canvas = self.size
                boxes = [typed.BoundingBoxes(b, format="XYXY", canvas_size=canvas) for b in boxes]
        batch.boxes, batch.box_index = boxes, index
        if self.box_labels is not None:
            batch.box_labels = labels

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

    def _buffer(self, *lead: int) -> np.ndarray:
        shape = (*lead, *self.size, 3)  # (N, H, W, 3), or (N, T, H, W, 3) for clips
        if self.pin_memory:
            pinned: np.ndarray = self._torch.empty(shape, dtype=self._torch.uint8, pin_memory=True).numpy()
            return pinned
        return np.empty(shape, np.uint8)

    def _batch(self, images: np.ndarray, labels: np.ndarray, keys: list[str]) -> Batch:
        order = (0, 3, 1, 2) if images.ndim == 4 else (0, 1, 4, 2, 3)  # clips: (N, T, H, W, 3)
        chw = images.transpose(order)  # a view: the memory stays N x H x W x 3 (channels_last)
        if self._torch is None:
            return Batch(chw, labels, keys)
        return Batch(self._torch.from_numpy(images).permute(order), self._torch.from_numpy(labels), keys)


_POOLS = itertools.count()  # each epoch's pool names its threads apart from every other's


class _InCallingThread(Executor):
    """workers=0: each batch is made when it is asked for, in the thread that iterates."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        done: Future[Any] = Future()
        try:
            done.set_result(fn(*args, **kwargs))
        except BaseException as error:  # (Ctrl-C too: raised where the result is taken, as with threads)
            done.set_exception(error)
        return done


def _stop(pool: Executor, lane: _DeviceLane | None, named: str) -> None:
    """The loader's threads ended before the caller goes on, whatever a Ctrl-C interrupted. It
    can land in a join (at an epoch's end), leaving the join half done; or in a submit, between
    a thread's start and the pool's record of it (Thread.start waits for the thread, and that
    wait takes the KeyboardInterrupt), leaving a thread the pool's shutdown never joins (seen
    in 3 of 30 runs of test_ctrl_c_stops_the_loader_cleanly on a loaded machine). So the joins
    are done again after an interruption, and every thread named as this pool's is waited for."""
    try:
        pool.shutdown(wait=True, cancel_futures=True)
        if lane is not None:
            lane.close()
    except BaseException:
        pool.shutdown(wait=True, cancel_futures=True)  # (a no-op where the first one ended)
        if lane is not None:
            lane.close()
        raise
    finally:
        _wait_for_threads(named)


def _wait_for_threads(named: str) -> None:
    prefix = f"{named}_"  # how ThreadPoolExecutor names the threads of `named`
    while True:
        alive = [t for t in threading.enumerate() if t.name.startswith(prefix) and t is not threading.current_thread()]
        if not alive:
            return
        for thread in alive:
            _join_started(thread)  # (an unrecorded worker ends on the shutdown's None, as the others)
        # Python 3.11's Thread.join, interrupted, marks a thread still running as stopped (the
        # tstate lock it released, bpo-45274's fix): later joins return at once, so the threads
        # are waited for until they leave threading's list of the living
        time.sleep(0.001)


def _join_started(thread: threading.Thread) -> None:
    """Join a thread that may not have started yet (a Ctrl-C in its Thread.start)."""
    while True:
        try:
            thread.join()
            return
        except RuntimeError:  # "cannot join thread before it is started": it is starting
            time.sleep(0.001)


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
