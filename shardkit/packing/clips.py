"""One source video to its clips, each an MP4 record as core/clips.py says (H.264, yuv420p, constant
frame rate, a keyframe at its first frame), made with PyAV (the `video` extra) in memory.

Clips are cut on the video's own timeline: clip k starts at t0 + k * stride, t0 the first frame's
timestamp (not 0), and is kept only when it ends by the video's end (the last frame's timestamp
plus one frame); a partial last clip is dropped. A clip's frame j is the source frame shown at
start + j / fps: the last one whose timestamp is at or before it (a small tolerance for containers
that round timestamps to milliseconds), so a variable frame rate comes out constant. Frames are
turned and mirrored as displayed (the display matrix) before they are sized.

Memory is bounded: frames are decoded one at a time and fed straight to the encoder of each clip
they fall in (at most ceil(seconds / stride) at once); what is held is the clips' encoded bytes,
refused past MAX_RECORD_BYTES for one video, so a video is packed whole or listed, never half."""

from __future__ import annotations

import contextlib
import io
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from fractions import Fraction
from typing import TYPE_CHECKING, Any

from ..core.config import (
    MAX_CLIP_FPS,
    MAX_CLIP_FRAMES,
    MAX_RECORD_BYTES,
    RECORD_META_ALLOWANCE,
    ClipConfig,
    ResizeConfig,
)
from ..core.errors import ImageError, describe, require
from ..core.safeio import open_regular
from .av_support import NOT_A_VIDEO, SNIFF_BYTES, Orientation, native_path, orientation, said, sniff
from .sources.item import Span

if TYPE_CHECKING:
    import av.container
    import av.video.frame

_INTERPOLATION = {"bilinear": "BILINEAR", "bicubic": "BICUBIC", "lanczos": "LANCZOS"}
_TOLERANCE = 0.002  # seconds: webm and mkv round timestamps to milliseconds
CLIP_NUMBER_DIGITS = 6  # clip keys `<video key>_000003`: sort in order, never a dot
MAX_CLIPS = 10**CLIP_NUMBER_DIGITS - 1  # of one video (a clip a second: 11 days)
MAX_GAP = 60.0  # seconds between two frames' timestamps: more is a damaged file, not a still scene
# a video's clip geometry: orientation, width and height as displayed, stored width and height
MAX_SEEK = 2**62  # a seek's target in the stream's time base: FFmpeg's timestamps are 64-bit
_Shape = tuple[Orientation, int, int, int, int]


def clip_key(video_key: str, number: int) -> str:
    """A clip's key: its video's, then '_' and its number in fixed width, so keys sort in clip
    order and no two videos' clips collide (a key ends in exactly one such number after its last
    '_', and video keys are unique)."""
    return f"{video_key}_{number:0{CLIP_NUMBER_DIGITS}d}"


@dataclass
class Clip:
    number: int
    data: bytes
    meta: dict[str, Any]


# x264's settings, which decide every clip's bytes (and so a resume's settings, packing/resume.py).
# No macroblock tree (mbtree=0): with it, x264 reads memory it has not written on clips this short,
# so a clip's bytes depend on what the allocator hands it and a killed pack would not resume to the
# same bytes. CRF 25 rather than x264's default 23 keeps the clips near the default's quality and
# size without the tree (CRF 23 without it makes far larger clips).
ENCODER_OPTIONS = {"preset": "veryfast", "crf": "25", "x264-params": "mbtree=0"}


@dataclass
class _Encoder:
    """One clip being encoded: an MP4 in memory, H.264 with one keyframe (its first frame)."""

    start: float
    targets: list[float]  # the source times its frames show, in order
    width: int
    height: int
    fps: Fraction
    buffer: io.BytesIO = field(default_factory=io.BytesIO)
    fed: int = 0
    container: Any = None
    stream: Any = None

    def add(self, frame: av.video.frame.VideoFrame) -> None:
        import av

        if self.container is None:
            self.container = av.open(self.buffer, "w", format="mp4")
            stream = self.container.add_stream("libx264", rate=self.fps)
            stream.width, stream.height, stream.pix_fmt = self.width, self.height, "yuv420p"
            stream.codec_context.gop_size = len(self.targets)  # one keyframe: the first frame
            stream.codec_context.thread_count = 1  # one thread: the same bytes on every run (resume)
            stream.options = dict(ENCODER_OPTIONS)
            self.stream = stream
        # in the clip's time base, or PyAV rescales it from the source's (read when it is sent: the
        # same frame may go to the next clip too)
        frame.pts, frame.time_base = self.fed, 1 / self.fps
        self.fed += 1
        try:
            for packet in self.stream.encode(frame):
                self.container.mux(packet)
        except av.FFmpegError as error:
            raise ImageError("encode", said(error)) from None

    def close(self) -> bytes:
        import av

        try:
            for packet in self.stream.encode():
                self.container.mux(packet)
            self.container.close()
        except av.FFmpegError as error:
            raise ImageError("encode", said(error)) from None
        return self.buffer.getvalue()

    def abandon(self) -> None:
        if self.container is not None:
            with contextlib.suppress(Exception):  # a clip thrown away: nothing it says matters
                self.container.close()


def stored_size(width: int, height: int, resize: ResizeConfig) -> tuple[int, int]:
    """A clip's frame size from the source's as displayed: scaled by the images' rule
    (`encode.resize_scale`), both sides even (yuv420p halves the colour planes)."""
    from .encode import resize_scale  # (its imaging loads with it: only for a pack of videos)

    scale = resize_scale(width, height, resize)
    return max(2, round(width * scale / 2) * 2), max(2, round(height * scale / 2) * 2)


def cut(path: str, source: str, clips: ClipConfig, resize: ResizeConfig, max_pixels: int) -> list[Clip]:
    """The clips of the video at `path` (`source`: its name under SRC, for the metadata), or
    ImageError naming the stage and cause: not a video, a header over `max_pixels`, a decode
    error, or no whole clip in it."""
    with _opened(path) as (av, container):
        return _cut(av, container, source, clips, resize, max_pixels)


def cut_span(path: str, source: str, span: Span, clips: ClipConfig, resize: ResizeConfig, max_pixels: int) -> Clip:
    """The one clip of a span table's row: [span.start, span.end) of the video at `path`, its
    frames picked as a fixed clip's are; ImageError as `cut` says, and for a span the video does
    not hold (before its first frame, past its end) or of too many frames."""
    with _opened(path) as (av, container):
        return _span(av, container, source, span, clips, resize, max_pixels)


@contextlib.contextmanager
def _opened(path: str) -> Iterator[tuple[Any, av.container.InputContainer]]:
    av = require("av", "video")
    fd = open_regular(path)  # a FIFO or a device is refused here, never waited on
    with os.fdopen(fd, "rb") as file:
        if sniff(file.read(SNIFF_BYTES)) is None:  # (the probe's test: one verdict for a file)
            raise ImageError("header", NOT_A_VIDEO)
        file.seek(0)
        try:
            container = av.open(native_path(fd, file), metadata_errors="ignore")
        except av.FFmpegError as error:
            raise ImageError("header", f"not a video FFmpeg reads ({said(error)})") from None
        except (ValueError, OSError) as error:
            raise ImageError("header", f"not a video FFmpeg reads ({describe(error)})") from None
        with container:
            yield av, container


def _header(container: av.container.InputContainer, max_pixels: int) -> tuple[Any, float]:
    """The video stream and its frame rate (capped at MAX_CLIP_FPS), or ImageError at "header"."""
    if not container.streams.video:
        raise ImageError("header", "no video stream")
    stream = container.streams.video[0]
    declared = stream.codec_context.width * stream.codec_context.height
    if declared > max_pixels:
        raise ImageError(
            "header",
            f"{stream.codec_context.width}x{stream.codec_context.height} = {declared:,} pixels a frame is over the "
            f"limit of {max_pixels:,}; raise --max-pixels to allow it",
        )
    rate = stream.average_rate or stream.guessed_rate or stream.base_rate
    if not rate or rate <= 0:
        raise ImageError("header", "no frame rate in its header")
    return stream, min(float(rate), MAX_CLIP_FPS)


def _clip_fps(clips: ClipConfig, source_fps: float) -> Fraction:
    """A clip's frame rate: --clip-fps, never more than the source's (a frame is never made up)."""
    return Fraction(min(clips.fps or source_fps, source_fps)).limit_denominator(1001)


def _frame_count(seconds: float, fps: Fraction) -> int:
    exact = seconds * float(fps)
    if not math.isfinite(exact):  # a span table's row may name any two numbers of seconds
        raise ImageError("clip", f"a clip of {seconds:g} s is longer than any video")
    count = round(exact)
    if not 1 <= count <= MAX_CLIP_FRAMES:
        raise ImageError(
            "clip", f"a clip of {seconds:g} s at {float(fps):g} fps holds {count} frames; not 1 to {MAX_CLIP_FRAMES:,}"
        )
    return count


def _cut(
    av: Any,
    container: av.container.InputContainer,
    source: str,
    clips: ClipConfig,
    resize: ResizeConfig,
    max_pixels: int,
) -> list[Clip]:
    stream, source_fps = _header(container, max_pixels)
    fps = _clip_fps(clips, source_fps)
    seconds, step = clips.seconds, clips.step
    assert seconds is not None
    count = _frame_count(seconds, fps)
    tolerance = min(_TOLERANCE, 0.25 / source_fps)
    codec = stream.codec_context.name
    made: list[Clip] = []
    encoded_bytes = 0
    active: list[_Encoder] = []
    prev: tuple[float, av.video.frame.VideoFrame] | None = None
    t0 = last_t = 0.0
    shape: _Shape | None = None
    next_clip = 0

    def finish(clip: _Encoder) -> None:
        nonlocal encoded_bytes
        data = clip.close()
        encoded_bytes += len(data)
        if encoded_bytes > MAX_RECORD_BYTES - RECORD_META_ALLOWANCE:
            raise ImageError("encode", f"its clips pass {MAX_RECORD_BYTES >> 20} MiB; cut the video shorter")
        assert shape is not None
        made.append(Clip(len(made), data, _meta(source, clip.start, clip.start + seconds, fps, count, shape, codec)))

    try:
        for t, frame in _frames(av, container, stream, source_fps, max_pixels):
            if prev is None:
                t0 = t
                shape = _shape(frame, resize)
            assert shape is not None
            picture = _displayed(frame, shape, resize)
            # Clips open one at a time, each fed and finished before the next opens, so a gap in
            # the timestamps never holds more encoders than clips overlap (seconds / stride).
            while True:
                for clip in active:
                    while clip.fed < count and clip.targets[clip.fed] < t - tolerance:
                        assert prev is not None
                        clip.add(prev[1])
                for clip in [c for c in active if c.fed == count and t >= c.start + seconds - tolerance]:
                    active.remove(clip)
                    finish(clip)
                if (start := t0 + next_clip * step) > t + tolerance:
                    break
                if len(made) + len(active) >= MAX_CLIPS:
                    raise ImageError("clip", f"more than {MAX_CLIPS:,} clips; use a longer --clip-stride")
                active.append(_Encoder(start, [start + j / fps for j in range(count)], shape[3], shape[4], fps))
                next_clip += 1
            prev = (t, picture)
            last_t = t
    except av.FFmpegError as error:
        raise ImageError("decode", said(error)) from None
    finally:
        pending = list(active)
        active.clear()
    if prev is None:
        raise ImageError("decode", "no frame decodes")
    end = last_t + 1 / source_fps  # the video ends when its last frame's time is up
    for clip in pending:
        if clip.start + seconds <= end + tolerance:
            while clip.fed < count:
                clip.add(prev[1])
            finish(clip)
        else:
            clip.abandon()
    if not made:
        raise ImageError(
            "clip", f"shorter than one clip: {end - t0:.3f} s of video, clips of {seconds:g} s; nothing packed"
        )
    return made


def _span(
    av: Any,
    container: av.container.InputContainer,
    source: str,
    span: Span,
    clips: ClipConfig,
    resize: ResizeConfig,
    max_pixels: int,
) -> Clip:
    stream, source_fps = _header(container, max_pixels)
    fps = _clip_fps(clips, source_fps)
    length = span.end - span.start
    if not math.isfinite(length):
        raise ImageError("clip", f"the span from {span.start:g} s to {span.end:g} s is longer than any video")
    count = _frame_count(length, fps)
    tolerance = min(_TOLERANCE, 0.25 / source_fps)
    # Back to the keyframe at or before the start (a seek is in the stream's time base): decoding
    # from there, not from 0, is what makes a row late in a long video cheap.
    target = span.start / stream.time_base if stream.time_base else 0.0
    if 0 < target < MAX_SEEK:  # (a start past any timestamp FFmpeg keeps is found past the video's end)
        with contextlib.suppress(av.FFmpegError):  # (a file that cannot seek is decoded from its start)
            container.seek(int(target), stream=stream, backward=True)
    clip: _Encoder | None = None
    prev: tuple[float, Any] | None = None
    shape: _Shape | None = None
    try:
        for t, frame in _frames(av, container, stream, source_fps, max_pixels):
            if prev is None:
                # An annotation's 0 names a video whose first frame some containers show a frame or two
                # late (B-frame delay, an edit list): within one frame, its first frame is used.
                if t > span.start + max(tolerance, 1 / source_fps):
                    raise ImageError("clip", f"starts at {span.start:g} s, before the video's first frame ({t:.3f} s)")
                shape = _shape(frame, resize)
                clip = _Encoder(span.start, [span.start + j / fps for j in range(count)], shape[3], shape[4], fps)
            assert clip is not None and shape is not None
            while prev is not None and clip.fed < count and clip.targets[clip.fed] < t - tolerance:
                clip.add(prev[1])
            if clip.fed == count:
                break  # (the rest of the video is not this row's)
            prev = (t, _displayed(frame, shape, resize))
    except av.FFmpegError as error:
        raise ImageError("decode", said(error)) from None
    except BaseException:
        if clip is not None:
            clip.abandon()
        raise
    if prev is None or clip is None or shape is None:
        raise ImageError("decode", "no frame decodes")
    if clip.fed < count:  # the video ended: its last frame lasts one frame's time
        end = prev[0] + 1 / source_fps
        if span.end > end + tolerance:
            clip.abandon()
            raise ImageError("clip", f"ends at {span.end:g} s, past the video's end ({end:.3f} s)")
        while clip.fed < count:
            clip.add(prev[1])
    data = clip.close()
    if len(data) > MAX_RECORD_BYTES - RECORD_META_ALLOWANCE:
        raise ImageError("encode", f"its clip passes {MAX_RECORD_BYTES >> 20} MiB; cut a shorter span")
    codec = stream.codec_context.name
    return Clip(0, data, _meta(source, span.start, span.end, fps, count, shape, codec))


def _meta(
    source: str, start: float, end: float, fps: Fraction, count: int, shape: _Shape, codec: str
) -> dict[str, Any]:
    """A clip's meta: core/clips.py's CLIP_META."""
    return {
        "source": source, "start": round(start, 6), "end": round(end, 6), "fps": float(fps), "frames": count,
        "width": shape[1], "height": shape[2], "stored_width": shape[3], "stored_height": shape[4], "codec": codec,
    }  # fmt: skip


def _frames(
    av: Any, container: Any, stream: Any, source_fps: float, max_pixels: int
) -> Iterator[tuple[float, av.video.frame.VideoFrame]]:
    """The video's frames with their times in seconds, in order; a frame with no timestamp is one
    frame after the one before it, and one that does not move time forward is dropped."""
    last: float | None = None
    for frame in container.decode(stream):
        if frame.width * frame.height > max_pixels:
            raise ImageError(
                "decode", f"a {frame.width}x{frame.height} frame is over the limit of {max_pixels:,} pixels"
            )
        t = frame.time
        if t is None:
            t = 0.0 if last is None else last + 1 / source_fps
        if last is not None and t <= last:
            continue
        if last is not None and t - last > MAX_GAP:  # a damaged timestamp would open clips by the million
            raise ImageError("decode", f"its timestamps jump {t - last:,.1f} s after {last:.3f} s; a damaged file?")
        last = t
        yield t, frame


def _shape(frame: Any, resize: ResizeConfig) -> _Shape:
    """A video's clip geometry from its first frame: its orientation (display matrix), width and
    height as displayed, and the stored width and height."""
    turn = orientation(frame)
    width, height = (frame.height, frame.width) if turn.swap else (frame.width, frame.height)
    return (turn, width, height, *stored_size(width, height, resize))


def _displayed(frame: Any, shape: _Shape, resize: ResizeConfig) -> Any:
    """The frame as displayed (turned and mirrored as its display matrix says), at the stored
    size, in yuv420p."""
    import av

    turn, _, _, stored_width, stored_height = shape
    interpolation = _INTERPOLATION[resize.resample]
    if turn == Orientation():
        return frame.reformat(stored_width, stored_height, "yuv420p", interpolation=interpolation)
    width, height = (stored_height, stored_width) if turn.swap else (stored_width, stored_height)
    pixels = frame.reformat(width, height, "rgb24", interpolation=interpolation).to_ndarray()
    return av.VideoFrame.from_ndarray(turn.displayed(pixels), format="rgb24").reformat(format="yuv420p")
