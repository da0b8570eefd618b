"""Packed video clips (core/clips.py's contract) to pixels: `Sample.video` and the clip loader's
crops. A clip's MP4 is decoded with PyAV from memory, frame by frame, and only as far as asked.

Clips come from strangers like images do: the demuxer is MP4's alone and the decoder H.264's (no
probing of other formats). The meta is held to the contract (core/clips.py's `checked_meta`), the
stored size checked against `max_pixels` and against the stream's, and the clip's packets counted
against the meta's `frames` (demuxed, not decoded: cheap, and bounded by what the meta declares)
before a frame is decoded; then every frame is checked against the stream's size, the first to be
a keyframe, and a clip decoded to its end to hold its meta's `frames` exactly. A clip whose meta
and content disagree fails wherever it is read, whole or a few frames of it. Every failure is
ImageError("decode", ...), which readers turn into a ShardReadError naming shard and key."""

from __future__ import annotations

import contextlib
import io
import os
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

from ..core.clips import CLIP_EXT, checked_meta
from ..core.errors import ImageError, describe, require
from ..formats.base import Record
from .decode import refuse_over

MAX_VIDEO_BYTES = 4 << 30  # the most a whole clip's RGB frames (Sample.video) may take in memory
# FFmpeg threads per clip: the loader's threads already decode clips side by side, so more
# threads per clip add no parallelism
DECODE_THREADS = 1


_THREAD = threading.local()  # each thread's swscale context (see frame_rgb)


def frame_rgb(frame: Any) -> np.ndarray:
    """A decoded frame as HxWx3 uint8 RGB. One VideoReformatter per thread, reused: PyAV's
    frame.to_ndarray makes a new swscale context for every frame, which costs more than decoding
    the frame. Not shared across threads: swscale's context is not thread-safe. One swscale thread
    each: the loader's threads are the parallelism, and swscale's own worker threads do not survive
    a fork, so a torch DataLoader worker forked after a read would hang on them (the context is
    dropped in the child too)."""
    reformatter = getattr(_THREAD, "reformatter", None)
    if reformatter is None:
        from av.video.reformatter import VideoReformatter

        reformatter = _THREAD.reformatter = VideoReformatter()
    pixels: np.ndarray = reformatter.reformat(frame, format="rgb24", threads=1).to_ndarray()
    return pixels


def _forget_reformatter() -> None:
    _THREAD.__dict__.clear()  # (a forked child does not get the threads of an inherited context)


os.register_at_fork(after_in_child=_forget_reformatter)


def is_clip(record: Record) -> bool:
    return record.ext == CLIP_EXT


def clip_size(meta: dict[str, Any], max_pixels: int) -> tuple[int, int]:
    """(width, height) of a clip's frames as its meta states them (windows are drawn from it before
    anything is decoded), the meta checked (core/clips.py) and the size against `max_pixels`."""
    checked = checked_meta(meta)
    refuse_over((checked.stored_width, checked.stored_height), max_pixels)
    return checked.stored_width, checked.stored_height


def declared_frames(meta: dict[str, Any]) -> int:
    """How many frames a clip's meta says it holds, the meta checked (core/clips.py)."""
    return checked_meta(meta).frames


@contextlib.contextmanager
def _av_errors() -> Iterator[None]:
    """FFmpeg's errors (InvalidDataError, EOFError...) and PyAV's own (ValueError, IndexError) on a
    hostile file, each one ImageError("decode"); ours pass through."""
    try:
        yield
    except ImageError:
        raise
    except Exception as error:
        said = getattr(error, "strerror", None)  # FFmpeg's words, without its errno and '<none>' file name
        why = f"{type(error).__name__}: {said}" if isinstance(said, str) else describe(error, with_type=True)
        raise ImageError("decode", f"broken clip: {why}") from None


def clip_frames(
    data: bytes, meta: dict[str, Any], max_pixels: int, stop: int | None = None, threads: int = DECODE_THREADS
) -> Iterator[Any]:
    """The clip's decoded frames (av.VideoFrame), in order, at most `stop` of them (decoding ends
    there), checked as the module says."""
    av = require("av", "video")
    width, height = clip_size(meta, max_pixels)
    declared = declared_frames(meta)
    with _av_errors(), av.open(io.BytesIO(data), mode="r", format="mp4") as container:
        if not container.streams.video:
            raise ImageError("decode", "broken clip: no video stream")
        stream = container.streams.video[0]
        context = stream.codec_context
        if context.name != "h264":
            raise ImageError("decode", f"broken clip: {context.name} video, not H.264")
        if (context.width, context.height) != (width, height):
            raise ImageError(
                "decode", f"broken clip: {context.width}x{context.height} frames, the meta says {width}x{height}"
            )
        # FFmpeg's own limit, about the stored size: a stream whose parameter sets change the size
        # midway is refused by the decoder before it allocates for it, not after a frame shows it.
        # FFmpeg checks its buffers' size, padded to macroblocks and aligned: hence the margin.
        context.options = {**context.options, "max_pixels": str((width + 64) * (height + 32))}
        if threads > 1:
            stream.thread_type, stream.thread_count = "AUTO", threads
        else:
            stream.thread_count = 1
        packets = _packets(container, stream, declared)
        count = 0
        for packet in packets:
            for frame in stream.decode(packet):
                if (frame.width, frame.height) != (width, height):
                    raise ImageError(
                        "decode", f"broken clip: a {frame.width}x{frame.height} frame in a {width}x{height} clip"
                    )
                if count == 0 and not frame.key_frame:
                    raise ImageError("decode", "broken clip: its first frame is not a keyframe")
                count += 1
                if count > declared:
                    raise ImageError("decode", f"broken clip: more than the {declared:,} frames its meta says")
                yield frame
                if stop is not None and count >= stop:
                    return
        if count != declared:
            raise ImageError("decode", f"broken clip: {count:,} frames decode, its meta says {declared:,}")


def _packets(container: Any, stream: Any, declared: int) -> list[Any]:
    """The clip's packets (one a frame), the flush packet last, refused unless there are exactly
    `declared` of them: a clip's length is known before a frame is decoded, however few are read."""
    packets: list[Any] = []
    count = 0
    for packet in container.demux(stream):
        packets.append(packet)
        if packet.size:
            count += 1
            if count > declared:
                raise ImageError("decode", f"broken clip: more than the {declared:,} frames its meta says")
    if count != declared:
        raise ImageError("decode", f"broken clip: {count:,} frames, its meta says {declared:,}")
    return packets


def decode_clip(data: bytes, meta: dict[str, Any], max_pixels: int) -> np.ndarray:
    """A clip's frames as a (T, H, W, 3) uint8 array, refused unread over MAX_VIDEO_BYTES."""
    width, height = clip_size(meta, max_pixels)
    need = declared_frames(meta) * width * height * 3
    if need > MAX_VIDEO_BYTES:
        raise ImageError("decode", f"clip of {need:,} bytes of frames, over the limit of {MAX_VIDEO_BYTES:,}")
    with _av_errors():
        frames = [frame_rgb(frame) for frame in clip_frames(data, meta, max_pixels)]
    video: np.ndarray = np.stack(frames)
    return video


def sample_video(record: Record, decode: str, max_pixels: int) -> Any:
    """Sample.video of a clip record as `decode` says: "rgb" (T, H, W, 3) uint8 numpy, "bytes" the
    MP4, "torch" a (T, 3, H, W) uint8 tensor, "pil" a list of PIL images."""
    if decode == "bytes":
        return record.data
    if decode == "pil":
        with _av_errors():
            from PIL import Image

            return [Image.fromarray(frame_rgb(frame)) for frame in clip_frames(record.data, record.meta, max_pixels)]
    frames = decode_clip(record.data, record.meta, max_pixels)
    if decode == "torch":
        return require("torch", "torch").from_numpy(frames).permute(0, 3, 1, 2)
    return frames


def clip_offsets(counts: np.ndarray, frames: int, rng: np.random.Generator | None) -> np.ndarray:
    """The first frame each clip's `frames` start at: uniform over the clips' own counts with `rng`,
    centered without it; 0 for a clip with `frames` or fewer (its last frame repeats)."""
    spare: np.ndarray = np.maximum(np.asarray(counts, np.int64) - frames, 0)
    if rng is None:
        centered: np.ndarray = spare // 2
        return centered
    drawn: np.ndarray = (rng.random(len(spare)) * (spare + 1)).astype(np.int64)
    return drawn


def crop_clip(
    record: Record,
    box: np.ndarray,
    flip: bool,
    start: int,
    out: np.ndarray,
    max_pixels: int,
    threads: int | None = None,
) -> None:
    """Frames start .. start + len(out) of a clip, each cropped to `box` (left, top, width, height
    in stored pixels), resized into `out` (T, H, W, 3) with Pillow's antialiased bilinear filter
    (the loader's for images) and flipped: one window and one flip for every frame. A clip that
    ends early repeats its last frame."""
    from PIL import Image

    height, width = out.shape[1], out.shape[2]
    left, top, w, h = (float(v) for v in box)
    done, threads = 0, DECODE_THREADS if threads is None else threads
    with _av_errors():
        for index, frame in enumerate(clip_frames(record.data, record.meta, max_pixels, start + len(out), threads)):
            if index < start:
                continue
            image = Image.fromarray(frame_rgb(frame)).resize(
                (width, height), Image.Resampling.BILINEAR, box=(left, top, left + w, top + h)
            )
            if flip:
                image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
            out[done] = np.asarray(image)
            done += 1
    if done == 0:
        raise ImageError("decode", f"broken clip: no frame at {start} (its meta says {declared_frames(record.meta)})")
    out[done:] = out[done - 1]


def clip_geometry(records: list[Record], max_pixels: int) -> tuple[np.ndarray, np.ndarray, dict[int, str]]:
    """The loader's view of a batch of clips before decoding: (width, height) and frame count of
    each from its meta, and the clips whose meta is unusable (their size and count left 1)."""
    sizes, counts = np.ones((len(records), 2), np.int64), np.ones(len(records), np.int64)
    failures: dict[int, str] = {}
    for i, record in enumerate(records):
        try:
            sizes[i], counts[i] = clip_size(record.meta, max_pixels), declared_frames(record.meta)
        except ImageError as error:
            failures[i] = error.reason
    return sizes, counts, failures


def crop_clips(
    records: list[Record],
    boxes: np.ndarray,
    flips: np.ndarray,
    offsets: np.ndarray,
    out: np.ndarray,
    failures: dict[int, str],
    max_pixels: int,
) -> None:
    """Each clip's frames into its row of `out` (N, T, H, W, 3) (crop_clip); a clip that fails
    joins `failures`, which already names those to leave out."""
    for i, record in enumerate(records):
        if i in failures:
            continue
        try:
            crop_clip(record, boxes[i], bool(flips[i]), int(offsets[i]), out[i], max_pixels)
        except ImageError as error:
            failures[i] = error.reason
