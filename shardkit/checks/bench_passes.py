"""The passes `bench` times: top-level functions over plain data, so worker processes can run
them. Each takes one worker's part (file paths, record ranges, record bytes, clip spans) and returns
what it read as (images or clips, bytes).
"""

from __future__ import annotations

import itertools
import os
import time
from typing import Any, BinaryIO, NamedTuple

from ..core.errors import ImageError, ShardkitError, describe, require
from ..core.safeio import open_regular
from ..readers.dataset import open_shards
from ..readers.decode import decode

CLIP_FRAMES = 16  # the frames of a clip the clip loader's pass takes


class Where(NamedTuple):
    """The shards a pass reads: a folder or URL and how to reach it (plain data, for workers)."""

    path: str
    storage_options: dict[str, Any] | None = None
    cache_dir: str | None = None
    cache_limit: str | int | None = None

    def open(self, **options: Any) -> Any:
        """The dataset on these shards, with `open_shards`'s read keywords."""
        return open_shards(
            self.path, storage_options=self.storage_options, cache_dir=self.cache_dir, cache_limit=self.cache_limit,
            **options,
        )  # fmt: skip


def _source(path: str) -> BinaryIO:
    """A raw-folder file, opened for reading: a regular file (a FIFO would hang the pass)."""
    try:
        return open(open_regular(path), "rb")
    except OSError as error:
        raise ShardkitError(f"{path}: cannot read ({describe(error)})") from None


def folder_pil(paths: list[str]) -> tuple[int, int]:
    from PIL import Image

    count = size = 0
    for path in paths:
        with _source(path) as file:
            try:
                image = Image.open(file)
                image.convert("RGB")  # torchvision's pil_loader: decode and convert
            except Exception as error:  # Pillow's plugins raise their own types for a bad file
                raise ShardkitError(f"{path}: cannot decode ({describe(error, with_type=True)})") from None
            size += file.tell()
        count += 1
    return count, size


def folder_turbo(paths: list[str]) -> tuple[int, int]:
    count = size = 0
    for path in paths:
        with _source(path) as file:
            data = file.read()
        try:
            decode(data, "jpg" if data[:3] == b"\xff\xd8\xff" else "png")
        except ImageError as error:
            raise ShardkitError(f"{path}: cannot decode ({error.reason})") from None
        size += len(data)
        count += 1
    return count, size


def folder_torchvision(job: tuple[list[str], int]) -> tuple[int, int]:
    """What a training loop on the raw folder does per image: ImageFolder's PIL loader, then
    torchvision v2's RandomResizedCrop and horizontal flip on the PIL image, to a uint8 tensor."""
    from torchvision.transforms import v2

    paths, size = job
    transform = v2.Compose([v2.RandomResizedCrop(size, antialias=True), v2.RandomHorizontalFlip(), v2.PILToTensor()])
    count = size_bytes = 0
    for path in paths:
        with _source(path) as file:
            try:
                from PIL import Image

                transform(Image.open(file).convert("RGB"))
            except Exception as error:  # Pillow's plugins raise their own types for a bad file
                raise ShardkitError(f"{path}: cannot decode ({describe(error, with_type=True)})") from None
            size_bytes += file.tell()
        count += 1
    return count, size_bytes


def shard_ranges(job: tuple[Where, list[tuple[int, int, int]], str, float | None]) -> tuple[int, int]:
    """Read and decode the (shard, start, stop) record ranges of one worker's part."""
    where, ranges, mode, scale = job
    dataset = where.open(decode=mode, scale=scale)
    count = 0
    size = 0.0
    for shard, start, stop in ranges:
        for _ in dataset.shard_samples(shard, start, stop):
            count += 1
        info = dataset.manifest.shards[shard]
        size += info.bytes * (stop - start) / max(1, info.count)  # the shard's bytes, pro rata
    dataset.close()
    return count, int(size)


def memory_blobs(blobs: list[tuple[bytes, str]]) -> tuple[int, int]:
    for data, ext in blobs:
        decode(data, ext)
    return len(blobs), sum(len(data) for data, _ in blobs)


def paired_overhead(where: Where, blobs: list[list[tuple[bytes, str]]], rounds: int, chunk: int = 25) -> list[float]:
    """The reader's overhead over decoding the same bytes from memory, per round.

    On a shared machine two whole passes run at different times differ by more than the overhead
    itself, so this alternates the two every `chunk` records, in alternating order, over every
    shard: drift and cache effects fall on both sides alike. Both loops keep one image alive
    while the next decodes, as a training loop does.
    """
    dataset = where.open()
    overheads = []
    try:
        for round_number in range(rounds):
            reader_seconds = memory_seconds = 0.0
            for shard, shard_blobs in enumerate(blobs):
                stream = dataset.shard_samples(shard)
                for turn, start in enumerate(range(0, len(shard_blobs), chunk)):
                    part = shard_blobs[start : start + chunk]
                    for side in (0, 1) if (turn + round_number) % 2 else (1, 0):
                        started = time.perf_counter()
                        if side == 0:
                            for _sample in itertools.islice(stream, len(part)):
                                pass
                        else:
                            for data, ext in part:
                                _image = decode(data, ext)
                        elapsed = time.perf_counter() - started
                        if side == 0:
                            reader_seconds += elapsed
                        else:
                            memory_seconds += elapsed
            overheads.append(reader_seconds / memory_seconds - 1 if memory_seconds else 0.0)
    finally:
        dataset.close()
    return overheads


def train_loader(job: tuple[Where, int, int, str | None]) -> tuple[int, int]:
    """The batch loader's epoch (random crops and flips, batches of 64) on `workers` threads; with
    a device, the device path's (readers/device.py), its last batch waited for."""
    where, size, workers, device = job
    dataset = where.open()
    count = sum(len(batch.labels) for batch in training_loader(dataset, size, workers, device))
    if device is not None and device.startswith("cuda"):
        import torch

        torch.cuda.synchronize(device)
    dataset.close()
    return count, sum(shard.bytes for shard in dataset.manifest.shards)


def training_loader(dataset: Any, size: int, workers: int, device: str | None) -> Any:
    """The loader as bench's training pass reads it: batches of 64, random crops and flips at
    `size`, `workers` threads, numpy out (or `device`'s path); an output of clips CLIP_FRAMES
    frames of each."""
    how: dict[str, Any] = {"output": "numpy"} if device is None else {"device": device}
    if dataset.manifest.totals.get("videos") is not None:
        how["frames"] = CLIP_FRAMES
    return dataset.loader(64, size, flip=True, workers=workers, **how)


def video_spans(spans: list[tuple[str, float, float, float]]) -> tuple[int, int]:
    """Each clip from its source video, as one would without shards: the frames of [start, end)
    decoded (from the keyframe before start), those at the clip's fps turned to RGB arrays."""
    av = require("av", "video")
    count = size = 0
    for path, start, end, fps in spans:
        try:
            with av.open(path) as container:
                stream = container.streams.video[0]
                stream.thread_type = "AUTO"
                container.seek(int(start / stream.time_base), stream=stream, backward=True)
                wanted, frames = start, 0
                for frame in container.decode(stream):
                    if frame.time is None or frame.time < wanted - 0.002:
                        continue
                    if frame.time >= end:
                        break
                    frame.to_ndarray(format="rgb24")
                    wanted, frames = wanted + 1 / fps, frames + 1
        except av.error.FFmpegError as error:
            raise ShardkitError(f"{path}: cannot decode ({error})") from None
        size += os.path.getsize(path) * frames // max(1, round((end - start) * fps))  # (its share, roughly)
        count += 1
    return count, size
