"""The census of a folder's videos (`shardkit probe` of a folder that holds videos), read with PyAV
(the `video` extra) in worker processes, a chunk of files per job as the image probe does.

A file counts as a video by its content (av_support.sniff, the pack's test too: an MP4/MOV box at
offset 4, Matroska/WebM's EBML magic, AVI's RIFF header), and as readable only once its first frame
decodes. What the header does not say is measured with bounded work: a duration missing from it
comes from the packets' timestamps (at most MAX_PACKETS), a variable frame rate from the first
VFR_FRAMES packets' timestamps (demuxed: only the first frame is decoded). Nothing here prints."""

from __future__ import annotations

import itertools
import os
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

from ..core.config import DEFAULT_MAX_PIXELS, DEFAULT_TRAIN_SIZE, check_workers
from ..core.errors import describe, require
from ..core.safeio import open_regular
from ..runtime.pools import default_workers, map_local
from .av_support import NOT_A_VIDEO, SNIFF_BYTES, native_path, orientation, said, sniff
from .sources import Item, walk
from .sources.labelling import Labelling, labelling

CHUNK_VIDEOS = 16  # a job: enough to pay its trip to a worker, few enough to keep every worker busy
VFR_FRAMES = 32
REORDER = 16  # packets read past VFR_FRAMES: B-frames arrive out of order, so the last read leave holes
MAX_PACKETS = 200_000  # the most packets read to measure a duration the header lacks (hours of video)
QUANTILES = (0.0, 0.05, 0.5, 0.95, 1.0)


class VideoRow(NamedTuple):
    """One file as the probe found it (plain data: it travels back from a worker process)."""

    relpath: str
    bytes: int
    error: str | None = None  # why it is not a readable video
    container: str = ""
    duration: float = 0.0  # seconds
    fps: float = 0.0  # average frame rate
    vfr: bool = False
    frames: int = 0  # from the header, else duration x fps
    width: int = 0  # as displayed (rotation applied)
    height: int = 0
    rotation: int = 0  # degrees counter-clockwise, from the display matrix (before `mirrored`)
    codec: str = ""  # FFmpeg's name
    pix_fmt: str = ""
    audio: int = 0  # audio streams
    mirrored: bool = False  # shown mirrored left-right after its rotation (the display matrix)


def probe_video(path: str, relpath: str, max_pixels: int = DEFAULT_MAX_PIXELS) -> VideoRow:
    try:
        fd = open_regular(path)
    except OSError as error:
        return VideoRow(relpath, 0, f"cannot read: {describe(error)}")
    with os.fdopen(fd, "rb") as file:
        size = os.fstat(fd).st_size
        kind = sniff(file.read(SNIFF_BYTES))
        if kind is None:
            return VideoRow(relpath, size, NOT_A_VIDEO)
        file.seek(0)
        try:
            return _probe_open(native_path(fd, file), relpath, size, kind, max_pixels)
        except Exception as error:  # PyAV's own types for a file it cannot read
            return VideoRow(relpath, size, f"cannot read: {said(error)}")


def _probe_open(file: Any, relpath: str, size: int, kind: str, max_pixels: int) -> VideoRow:
    av = require("av", "video")
    with av.open(file, metadata_errors="ignore") as container:
        if not container.streams.video:
            return VideoRow(relpath, size, "no video stream", kind)
        stream = container.streams.video[0]
        context = stream.codec_context
        if context.width * context.height > max_pixels:
            return VideoRow(
                relpath, size, f"{context.width}x{context.height} is over the limit of {max_pixels:,} pixels"
            )
        audio = len(container.streams.audio)
        times: list[float] = []  # the first packets' timestamps: demuxed, not decoded
        first = None  # the first frame: the one decode
        for packet in container.demux(stream):
            if packet.pts is not None and packet.time_base is not None:
                times.append(float(packet.pts * packet.time_base))
            if first is None:
                first = next(iter(packet.decode()), None)  # (a flush packet at the end decodes what is held)
            if first is not None and len(times) >= VFR_FRAMES + REORDER:
                break
        if first is None:  # a short file whose decoder still holds its first frame
            first = next(iter(stream.codec_context.decode(None)), None)
        # in display order; the last REORDER dropped, whose neighbours may still be unread
        times = sorted(times)[: max(2, len(times) - REORDER)] if len(times) > VFR_FRAMES else sorted(times)
        if first is None:
            return VideoRow(relpath, size, "no frame decodes", kind)
        turn = orientation(first)
        width, height = (first.height, first.width) if turn.swap else (first.width, first.height)
        rate = stream.average_rate or stream.guessed_rate
        deltas = [b - a for a, b in itertools.pairwise(times) if b > a]
        fps = float(rate) if rate else (len(deltas) / sum(deltas) if deltas else 0.0)
        vfr = bool(deltas) and max(deltas) - min(deltas) > max(0.002, 0.1 * sorted(deltas)[len(deltas) // 2])
        duration = _duration(container, stream, times, fps)
        frames = stream.frames or round(duration * fps)
        return VideoRow(relpath, size, None, kind, duration, fps, vfr, frames, width, height, turn.rotation,
                        context.name, context.pix_fmt or "", audio, turn.mirrored)  # fmt: skip


def _duration(container: Any, stream: Any, times: list[float], fps: float) -> float:
    """From the stream's header, else the container's, else the last packet's timestamp (demuxed,
    never decoded; at most MAX_PACKETS)."""
    if stream.duration is not None and stream.time_base is not None and stream.duration > 0:
        return float(stream.duration * stream.time_base)
    if container.duration is not None and container.duration > 0:
        return float(container.duration) / 1_000_000
    start = times[0] if times else 0.0
    container.seek(0)
    last = start
    for count, packet in enumerate(container.demux(stream)):
        if packet.pts is not None and packet.time_base is not None:
            last = max(last, float(packet.pts * packet.time_base))
        if count >= MAX_PACKETS:
            break
    return last - start + (1 / fps if fps else 0.0)


def _probe_chunk(job: tuple[list[str], list[str], int]) -> list[tuple[Any, ...]]:
    paths, relpaths, max_pixels = job
    return [tuple(probe_video(path, rel, max_pixels)) for path, rel in zip(paths, relpaths, strict=True)]


@dataclass
class VideoRecommendation:
    resize: int | None  # short side to pack clips at; None keeps the sources' size
    fps: float | None  # --clip-fps; None keeps each source's
    reason: str


@dataclass
class VideoReport:
    root: str
    files: int  # every file looked at
    videos: int  # readable (their first frame decodes)
    bytes: int
    seconds: float
    workers: int
    distributions: dict[str, dict[str, float]]  # duration, fps, width, height: quantiles
    codecs: dict[str, int]
    pix_fmts: dict[str, int]
    containers: dict[str, int]
    vfr: int
    rotated: int  # turned by the display matrix (a vertical mirror is a half turn, mirrored)
    mirrored: int
    with_audio: int
    total_seconds: float
    problems: dict[str, int]  # reason -> files
    examples: dict[str, list[str]]  # reason -> the first files
    recommendation: VideoRecommendation | None
    skipped: int = 0  # files the walk did not take (not a video extension)
    rows: list[VideoRow] = field(default_factory=list, repr=False)
    labels: Labelling | None = None  # how pack --clip-seconds would label the clips (by default)

    def to_json(self) -> dict[str, Any]:
        """The `videos` object of probe's --json."""
        data = asdict(self)
        del data["rows"]
        data["count"] = self.videos
        return data


def probe_videos(
    source: str | os.PathLike[str],
    *,
    workers: int | None = None,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    train_size: int = DEFAULT_TRAIN_SIZE,
    progress: Callable[[int, int | None], None] | None = None,
) -> VideoReport:
    """The census of the videos in a folder (class sub-folders or flat), probed in parallel."""
    check_workers(workers)
    started = time.perf_counter()
    found = walk(source, videos=True)
    count = workers or default_workers()
    rows: list[VideoRow] = []
    for _, chunk in map_local(_probe_chunk, _chunks(found.items, max_pixels), count):
        rows.extend(VideoRow._make(row) for row in chunk)
        if progress is not None:
            progress(len(rows), None)
    rows.sort(key=lambda row: os.fsencode(row.relpath))  # (chunks finish in any order)
    report = summarize(str(source), rows, time.perf_counter() - started, count, train_size, len(found.skipped))
    report.labels = labelling(found)
    return report


def _chunks(items: Iterator[Item] | Any, max_pixels: int) -> Iterator[tuple[list[str], list[str], int]]:
    paths: list[str] = []
    relpaths: list[str] = []
    for item in items:
        paths.append(item.path)
        relpaths.append(item.relpath)
        if len(paths) == CHUNK_VIDEOS:
            yield paths, relpaths, max_pixels
            paths, relpaths = [], []
    if paths:
        yield paths, relpaths, max_pixels


def _quantiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)
    return {f"p{round(q * 100)}": round(ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))], 3)
            for q in QUANTILES}  # fmt: skip


def summarize(
    root: str, rows: list[VideoRow], seconds: float, workers: int, train_size: int, skipped: int = 0
) -> VideoReport:
    good = [row for row in rows if row.error is None]
    problems = Counter(row.error.split(" (")[0] for row in rows if row.error is not None)
    examples: dict[str, list[str]] = {}
    for row in rows:
        if row.error is not None:
            shown = examples.setdefault(row.error.split(" (")[0], [])
            if len(shown) < 5:
                shown.append(row.relpath)
    distributions = {
        name: _quantiles([float(getattr(row, name)) for row in good]) for name in ("duration", "fps", "width", "height")
    }
    return VideoReport(
        root=root, files=len(rows), videos=len(good), bytes=sum(row.bytes for row in rows), seconds=seconds,
        workers=workers, distributions=distributions, codecs=dict(Counter(row.codec for row in good).most_common()),
        pix_fmts=dict(Counter(row.pix_fmt for row in good).most_common()),
        containers=dict(Counter(row.container for row in good).most_common()),
        vfr=sum(row.vfr for row in good), rotated=sum(row.rotation != 0 for row in good),
        mirrored=sum(row.mirrored for row in good), with_audio=sum(row.audio > 0 for row in good),
        total_seconds=round(sum(row.duration for row in good), 3),
        problems=dict(problems.most_common()), examples=examples, recommendation=recommend(good, train_size),
        skipped=skipped, rows=rows,
    )  # fmt: skip


def recommend(good: list[VideoRow], train_size: int) -> VideoRecommendation | None:
    """Clips at a short side a little over the training size (random crops need room: 256 for 224),
    and at most 30 fps (the median source's if lower): training samples frames, it rarely needs more."""
    if not good:
        return None
    target = -(-train_size * 8 // 7 // 32) * 32  # 224 -> 256
    shorts = sorted(min(row.width, row.height) for row in good)
    median_short = shorts[len(shorts) // 2]
    rates = sorted(row.fps for row in good)
    median_fps = rates[len(rates) // 2]
    fps = min(30.0, round(median_fps, 3))
    if median_short > target:
        resize: int | None = target
        reason = f"half the videos have a short side over {median_short}px; {target}px leaves room to crop {train_size}"
    else:
        resize = None
        reason = f"the median short side ({median_short}px) is at most {target}px: keep the sources' size"
    return VideoRecommendation(resize, fps, reason + f"; {fps:g} fps (median source {median_fps:g})")
