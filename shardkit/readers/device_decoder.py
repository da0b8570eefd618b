"""The batch loader's device decoder (loader(device=...)): the loader threads read the headers, draw
the same windows and flips as the CPU decoder, make masks and boxes, and turn the JPEGs' bytes and
the filter's taps into what the device takes (readers/device.py's plan); the decoder's own lane
then decodes a batch on the device on one thread and crops, resizes and flips it on another, on a
CUDA side stream, so batch k is resampled while batch k + 1 decodes and neither waits on the loop
that hands batches out. At most DEVICE_AHEAD batches past the one handed out are made."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple

import numpy as np

from ..core.errors import ConfigError
from .batch import Batch, add_texts, labels_of
from .batch_targets import Targets
from .clips import is_clip
from .decoding import Lane, Parts, StreamKey, kept_rows
from .epoch import EpochRecord
from .targets import window_corners
from .windows import header_sizes

DEVICE_AHEAD = 2  # batches the device lane makes past the one handed out


class Gathered(NamedTuple):
    """A chunk's host work, made on a loader thread: its windows and flips, the records whose header
    failed, the JPEGs' bytes as the tensors the device's decoder takes, the resample's taps, and the
    masks and boxes (made on the host: a mask's PNG is decoded there)."""

    chunk: list[EpochRecord]
    boxes: np.ndarray
    flips: np.ndarray
    failures: dict[int, str]
    encoded: list[Any] | None
    plan: Any
    targets: Targets | None


class OnDevice(NamedTuple):
    """A chunk's images decoded on the device and laid end to end, with the rows kept (on_error),
    their shapes and plan, and what the batch says of them."""

    chunk: list[EpochRecord]
    rows: list[int]
    flat: Any
    shapes: np.ndarray
    plan: Any
    boxes: np.ndarray
    flips: np.ndarray
    targets: Targets | None


class DeviceDecoder:
    """Batches decoded, cropped and resized on a torch device (the module's docstring)."""

    def __init__(self, parts: Parts) -> None:
        self.parts = parts
        self.size = parts.options.out_size
        self.device = parts.options.torch_device
        self.dtype, self.mean, self.std = parts.options.normalize
        self.torch = parts.assembly.torch
        self._stream: Any = None  # the CUDA side stream of the lane's make step (made on first use, kept)

    def refuse(self, item: EpochRecord) -> None:
        if is_clip(item.record):
            raise ConfigError(f"{item.shard_name}: record {item.record.key} is a video clip: read clips with frames=T")

    def decode(self, key: StreamKey, number: int, chunk: list[EpochRecord]) -> Gathered:
        """The host's part, on a loader thread (decoding is the device's)."""
        from .device import encoded_jpegs, plan_resample

        parts = self.parts
        for item in chunk:
            self.refuse(item)
        records = [item.record for item in chunk]
        sizes, failures = header_sizes(records, parts.dataset.max_pixels, parts.kernel)
        parts.clock.pixels(int(sizes.prod(axis=1).sum()), len(chunk) * self.size[0] * self.size[1])
        boxes, flips = parts.windows.draw(key, number, sizes)
        targets = parts.targets.measure(chunk, sizes, window_corners(boxes), flips, failures)
        encoded = encoded_jpegs(self.torch, records)
        plan = plan_resample(sizes[:, ::-1], boxes, flips, self.size)  # (sizes: width, height)
        return Gathered(chunk, boxes, flips, failures, encoded, plan, targets)

    def lane(self, make: Callable[..., Batch | None]) -> Lane:
        return DeviceLane(self, make, DEVICE_AHEAD)

    def decode_on_device(self, gathered: Gathered) -> OnDevice | None:
        """The lane's first step, on its decode thread: the chunk's images decoded on the device
        (readers/device.py) and laid end to end; None when every record failed and on_error skips
        them."""
        with self.parts.clock.timed("busy:device"):
            return self._decode_on_device(gathered)

    def _decode_on_device(self, gathered: Gathered) -> OnDevice | None:
        from .device import decode_batch, flatten_images, plan_resample

        chunk, boxes, flips, failures, encoded, plan, targets = gathered
        candidates = [i for i in range(len(chunk)) if i not in failures]
        images, failed = decode_batch(
            self.torch,
            [chunk[i].record for i in candidates],
            self.device,
            self.parts.dataset.max_pixels,
            None if encoded is None else [encoded[i] for i in candidates],
        )
        failures = {**failures, **{candidates[n]: reason for n, reason in failed.items()}}
        keep = kept_rows(chunk, failures, self.parts.dataset.on_error)
        rows = list(range(len(chunk))) if keep is None else keep
        if not rows:
            return None
        decoded = dict(zip(candidates, images, strict=True))
        kept = [decoded[i] for i in rows]
        shapes = np.array([(int(image.shape[1]), int(image.shape[2])) for image in kept], np.int64)
        plan = plan if keep is None else plan.take(rows)
        if not np.array_equal(plan.shapes, shapes):  # (a decoder that disagrees with the header)
            plan = plan_resample(shapes, boxes[rows], flips[rows], self.size)
        flat = flatten_images(self.torch, kept)
        return OnDevice(chunk, rows, flat, shapes, plan, boxes[rows], flips[rows], targets)

    def make(self, *made: Any) -> Batch:
        """The lane's last step, on its make thread: the crops resized and flipped, the output and
        the labels queued on the device without waiting for it."""
        from .device import finish, resample_planned, to_device

        chunk, rows, flat, shapes, plan, boxes, flips, targets = OnDevice(*made)
        torch = self.torch
        if flat.device.type == "cuda":  # (made on the decode's stream, read on this one)
            flat.record_stream(torch.cuda.current_stream(flat.device))
        pixels = resample_planned(torch, flat, shapes, plan, self.size)
        records = [chunk[i].record for i in rows]
        images = finish(torch, pixels, self.dtype, self.mean, self.std)
        batch = Batch(images, to_device(torch, labels_of(records), self.device), [r.key for r in records])
        batch.windows, batch.flips, batch.kept = window_corners(boxes), flips.copy(), rows
        self.parts.targets.attach(batch, targets, rows)
        add_texts(batch, records)
        return batch

    def side_stream(self) -> Any:
        if self._stream is None:
            self._stream = self.torch.cuda.Stream(self.device)
        return self._stream


class DeviceLane:
    """The device decoder's own two threads, in order, a batch at a time: one decodes (nvJPEG's
    batched decode blocks the thread that calls it until the batch is decoded, with the GIL
    released), the other runs `make` (the loader's hook to the decoder's make step) on a CUDA side
    stream. At most `ahead` batches past the last one handed out are decoded or made."""

    def __init__(self, decoder: DeviceDecoder, make: Callable[..., Batch | None], ahead: int) -> None:
        self._decoder, self._make_step = decoder, make
        self._slots, self._closed = threading.Semaphore(ahead), threading.Event()
        self._decoder_thread = ThreadPoolExecutor(1, thread_name_prefix="shardkit-device-decode")
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="shardkit-device")
        self._stream: Any = None  # the decode's own CUDA stream (made on first use)

    def submit(self, work: Future[Any]) -> Future[Any]:
        """The batch `work` (a Gathered future) will give, made on the device: a future of (Batch,
        the event its stream records after it) or None (every record skipped)."""
        decoded = self._decoder_thread.submit(self._decode, work)
        return self._thread.submit(self._make, decoded)

    def _decode(self, gathered: Future[Any]) -> OnDevice | None:
        """The decode thread's part: a batch's images on the device, laid end to end (or None)."""
        while not self._slots.acquire(timeout=0.1):  # (the loop hands batches out, or closes)
            if self._closed.is_set():
                return None
        if self._closed.is_set():
            return None
        decoder = self._decoder
        torch, device = decoder.torch, decoder.device
        if device.type != "cuda":
            return decoder.decode_on_device(gathered.result())
        # Its own stream, not the side stream: what the decode allocates comes from that stream's
        # memory, which nothing else frees, and nvJPEG writes it on its own stream without waiting
        # for the one current here. That stream is done before the next decode starts (below): its
        # one copy, the images laid end to end, is queued right after the decode ends.
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        with torch.cuda.device(device), torch.cuda.stream(self._stream):
            decoded = decoder.decode_on_device(gathered.result())
        self._stream.synchronize()
        return decoded

    def _make(self, decoded: Future[Any]) -> tuple[Batch | None, Any] | None:
        made = decoded.result()
        if made is None:
            return None
        decoder = self._decoder
        torch, device = decoder.torch, decoder.device
        if device.type != "cuda":
            return self._make_step(*made), None
        stream = decoder.side_stream()
        with torch.cuda.device(device), torch.cuda.stream(stream):
            batch = self._make_step(*made)
            done = torch.cuda.Event()
            done.record(stream)
        return batch, done

    def handed(self, work: Future[Any]) -> Batch | None:
        """A made batch as the consumer gets it: on CUDA, the consumer's stream waits for the side
        stream and owns the memory after. Frees its slot for the lane's next batch."""
        try:
            made: tuple[Batch | None, Any] | None = work.result()
        finally:
            self._slots.release()
        if made is None:
            return None
        batch, done = made
        if batch is not None and done is not None:
            torch = self._decoder.torch
            current = torch.cuda.current_stream(self._decoder.device)
            current.wait_event(done)
            for tensor in (batch.images, batch.labels, *batch.target_tensors()):
                tensor.record_stream(current)
        return batch

    def close(self) -> None:
        self._closed.set()
        self._slots.release()
        self._decoder_thread.shutdown(wait=True, cancel_futures=True)
        self._thread.shutdown(wait=True, cancel_futures=True)
