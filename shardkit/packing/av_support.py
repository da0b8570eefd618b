"""What the video probe (video_probe.py) and the clip cutter (clips.py) share of PyAV, which both
import only where they read a video: the path FFmpeg opens a checked file by, and FFmpeg's own
words for an error."""

from __future__ import annotations

import os
from typing import Any

from ..core.errors import describe


def said(error: BaseException) -> str:
    """What FFmpeg said, without PyAV's errno and function name around it."""
    text = getattr(error, "strerror", None) or describe(error)
    return str(text).strip() or type(error).__name__


def native_path(fd: int, file: Any) -> Any:
    """What PyAV opens for a descriptor checked to be a regular file: its /dev/fd path, read by
    FFmpeg's own I/O (through a Python file object, every read would call back into Python), or the
    file object where /dev/fd is missing."""
    path = f"/dev/fd/{fd}"
    return path if os.path.exists(path) else file
