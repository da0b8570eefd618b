"""What a video clip is once packed: the contract between the write side (probe and pack cut
videos into clips) and the read side (Sample.video, the clip loader). Shared here, in core, because
neither side imports the other.

A clip is one record: `Record.ext` is CLIP_EXT and `Record.data` an MP4 file (H.264, yuv420p,
constant frame rate, a keyframe at its first frame), so it decodes from its start with PyAV and
plays in any tool. `Record.meta` holds, beyond what an image's meta holds, the keys of CLIP_META.
Meta and content agree or the record is refused wherever it is read: `checked_meta`, then the
clip's frames against it (readers/clips.py)."""

from __future__ import annotations

import math
from typing import Any, NamedTuple, TypeGuard

from .config import MAX_CLIP_FPS, MAX_CLIP_FRAMES
from .errors import ImageError

CLIP_EXT = "mp4"
VIDEO_EXTENSIONS = frozenset({"mp4", "m4v", "mov", "mkv", "webm", "avi"})  # what a walk offers as a video
# meta of a clip: `source` (the video's path under SRC), `start` and `end` (seconds on the source's
# timeline), `fps` (the clip's, constant), `frames` (how many it holds), `width`/`height` (the
# source as displayed), `stored_width`/`stored_height` (the clip's frames), `codec` (the source's)
CLIP_META = ("source", "start", "end", "fps", "frames", "width", "height", "stored_width", "stored_height", "codec")

# a span's seconds times its fps is its frame count, rounded; start and end are kept to 6 decimals
_COUNT_TOLERANCE = 0.5 + 1e-3


class ClipMeta(NamedTuple):
    """What a clip record's meta says of its frames, checked (`checked_meta`)."""

    start: float
    end: float
    fps: float
    frames: int
    stored_width: int
    stored_height: int


def checked_meta(meta: dict[str, Any]) -> ClipMeta:
    """A clip record's meta held to the contract, or ImageError("decode", what is wrong): `frames`
    a whole number from 1 to MAX_CLIP_FRAMES, `fps` a number over 0 and at most MAX_CLIP_FPS,
    `start` and `end` finite numbers whose span at `fps` is `frames` frames, the stored size two
    positive whole numbers. Every reader of a clip (Sample.video, the clip loader, verify --deep)
    checks this, then the clip's content against it."""
    width, height = meta.get("stored_width"), meta.get("stored_height")
    if not (_whole(width) and _whole(height) and width > 0 and height > 0):
        raise ImageError("decode", f"clip meta's stored size is not two positive integers ({width!r}, {height!r})")
    frames = meta.get("frames")
    if not (_whole(frames) and 0 < frames <= MAX_CLIP_FRAMES):
        raise ImageError("decode", f"clip meta's frames is not an integer from 1 to {MAX_CLIP_FRAMES:,} ({frames!r})")
    fps = meta.get("fps")
    if not (_real(fps) and 0 < fps <= MAX_CLIP_FPS):
        raise ImageError("decode", f"clip meta's fps is not a number over 0 and at most {MAX_CLIP_FPS:g} ({fps!r})")
    start, end = meta.get("start"), meta.get("end")
    if not (_real(start) and _real(end) and end > start):
        raise ImageError("decode", f"clip meta's start and end are not two finite numbers, end after start "
                         f"({str(start)[:40]}, {str(end)[:40]})")  # fmt: skip
    if not abs((end - start) * fps - frames) <= _COUNT_TOLERANCE:
        raise ImageError(
            "decode", f"clip meta's span, {start:g} to {end:g} s at {fps:g} fps, does not hold its {frames:,} frames"
        )
    return ClipMeta(float(start), float(end), float(fps), frames, width, height)


def _whole(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _real(value: Any) -> TypeGuard[float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
