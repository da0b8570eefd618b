"""What the video probe (video_probe.py) and the clip cutter (clips.py) share of PyAV, which both
import only where they read a video: the path FFmpeg opens a checked file by, FFmpeg's own words
for an error, what a file's first bytes say it is, and how a frame is displayed."""

from __future__ import annotations

import os
import struct
from typing import TYPE_CHECKING, Any, NamedTuple

from ..core.errors import describe

if TYPE_CHECKING:
    import numpy as np


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


NOT_A_VIDEO = "not a video: no MP4, Matroska or AVI header"
SNIFF_BYTES = 12
# QuickTime's top-level atoms that may come first in a .mov written before 'ftyp' was required
_QUICKTIME_FIRST = (b"moov", b"mdat", b"wide", b"free", b"skip", b"pnot")


def sniff(head: bytes) -> str | None:
    """The container a file's first SNIFF_BYTES say it is, or None: the probe and the pack both
    take a file as a video by this, so they give one verdict."""
    if len(head) >= 8 and (head[4:8] == b"ftyp" or head[4:8] in _QUICKTIME_FIRST):
        return "mp4"
    if head[:4] == b"\x1a\x45\xdf\xa3":
        return "matroska"
    if len(head) >= 12 and head[:4] == b"RIFF" and head[8:11] == b"AVI":
        return "avi"
    return None


class Orientation(NamedTuple):
    """How a player shows a decoded frame (its display matrix, snapped to the nearest of the eight
    right-angle orientations): the frame's rows and columns swapped, then its rows and its columns
    reversed. An array `pixels` (rows, columns, ...) is shown as `displayed(pixels)`."""

    swap: bool = False
    flip_rows: bool = False
    flip_columns: bool = False

    def displayed(self, pixels: np.ndarray) -> np.ndarray:
        import numpy as np

        shown = pixels.swapaxes(0, 1) if self.swap else pixels
        if self.flip_rows:
            shown = shown[::-1]
        if self.flip_columns:
            shown = shown[:, ::-1]
        turned: np.ndarray = np.ascontiguousarray(shown)
        return turned

    @property
    def rotation(self) -> int:
        """Degrees counter-clockwise of the turn, done before the mirror when `mirrored`."""
        return _TURNS[self][0]

    @property
    def mirrored(self) -> bool:
        """Whether the frame is shown mirrored left-right after its turn (`rotation`)."""
        return _TURNS[self][1]


# (swap, flip rows, flip columns) -> (degrees counter-clockwise, then mirrored left-right)
_TURNS = {
    Orientation(False, False, False): (0, False), Orientation(True, True, False): (90, False),
    Orientation(False, True, True): (180, False), Orientation(True, False, True): (270, False),
    Orientation(False, False, True): (0, True), Orientation(True, True, True): (90, True),
    Orientation(False, True, False): (180, True), Orientation(True, False, False): (270, True),
}  # fmt: skip


def orientation(frame: Any) -> Orientation:
    """A decoded frame's orientation from its display matrix (FFmpeg's layout: a point (x, y) of
    the frame, y down, is shown at (a x + c y, b x + d y), a, b, c, d its first, second, fourth and
    fifth entries). No matrix: shown as decoded."""
    from av.sidedata.sidedata import Type

    matrix = next((data for data in frame.side_data if data.type == Type.DISPLAYMATRIX), None)
    if matrix is None or len(bytes(matrix)) < 36:
        return Orientation()
    a, b, _, c, d = struct.unpack("<5i", bytes(matrix)[:20])
    if abs(a) + abs(d) >= abs(b) + abs(c):  # nearer a turn of 0 or 180 degrees: rows stay rows
        return Orientation(False, d < 0, a < 0)
    return Orientation(True, b < 0, c < 0)
