"""Header-only image parsing: size, mode, progressive, EXIF orientation, without decoding pixels.

This is the hot loop of `probe`, so it works on raw bytes with integer indexing and reads
more of the file only when a header does not fit in the first block. Formats we do not
parse ourselves go to PIL's lazy `Image.open`, which also reads only the header.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Callable
from typing import Literal, NamedTuple

from .errors import HeaderError as HeaderError  # re-exported: what the parsers here raise
from .safeio import not_regular

HEAD_BYTES = 4096
# A header that needs more than this is hostile or broken; never read further.
MAX_HEADER_SCAN = 16 * 1024 * 1024
_EXIF_READ = 65536

Fetch = Callable[[int, int], bytes]


class ImageHeader(NamedTuple):
    """What a header says. A NamedTuple: cheap to build in the hot loop and to send between processes."""

    format: str  # "jpeg", "png", "gif", "webp", "bmp", or PIL's format name in lower case
    width: int  # as stored, before EXIF orientation (what PIL's Image.size says)
    height: int
    mode: str  # PIL-style: "L", "RGB", "CMYK", "P", "LA", "RGBA", "I;16", "1"
    bits: int  # bits per sample
    progressive: bool = False
    orientation: int = 1  # EXIF orientation 1..8
    complete: bool = True  # False when the file lacks its end marker (likely truncated)

    @property
    def displayed_size(self) -> tuple[int, int]:
        """Size after applying EXIF orientation (what `ImageOps.exif_transpose` gives)."""
        if self.orientation >= 5:
            return self.height, self.width
        return self.width, self.height

    @property
    def has_alpha(self) -> bool:
        return self.mode in ("LA", "RGBA", "PA", "La", "RGBa")


EXTENSION_FORMATS = {
    ".jpg": "jpeg", ".jpeg": "jpeg", ".jpe": "jpeg", ".jfif": "jpeg",
    ".png": "png", ".apng": "png", ".gif": "gif", ".webp": "webp",
    ".bmp": "bmp", ".dib": "bmp", ".tif": "tiff", ".tiff": "tiff",
    ".ppm": "ppm", ".pgm": "ppm", ".pbm": "ppm", ".pnm": "ppm", ".tga": "tga",
}  # fmt: skip


def format_from_magic(head: bytes) -> str | None:
    if head[:3] == b"\xff\xd8\xff":
        return "jpeg"
    if head[:8] == b"\x89PNG\r\n\x1a\n":
        return "png"
    if head[:4] == b"GIF8":
        return "gif"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "webp"
    if head[:2] == b"BM":
        return "bmp"
    return None


def read_header(path: str | os.PathLike[str]) -> tuple[ImageHeader, int]:
    """Parse the header of the file at `path`; returns the header and the file size in bytes.

    O_NONBLOCK: a FIFO (named in a list file) is refused, not waited on; it is checked for only when
    a read looks odd, so the common case costs no fstat."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        try:
            head = os.read(fd, HEAD_BYTES)
        except BlockingIOError:
            head = b""
        if len(head) < HEAD_BYTES:  # the whole file is in hand: no more system calls
            if not head:
                _refuse_special(fd, path)  # an empty file, or a FIFO with no writer
            size = len(head)
            return parse_header(head, lambda offset, n: head[offset : offset + n], size, path), size
        # lseek is the cheapest way to learn the size (fstat builds a 20-field object).
        try:
            size = os.lseek(fd, 0, os.SEEK_END)
        except OSError:
            size = -1  # a FIFO or socket cannot seek
        if size < len(head):  # a device such as /dev/zero has content but no size
            _refuse_special(fd, path)
        return parse_header(head, lambda offset, n: os.pread(fd, n, offset), size, path), size
    finally:
        os.close(fd)


_HASH_STEP = 0x9E3779B97F4A7C15
_HASH_MIX = 0xBF58476D1CE4E5B9
_HASH_FINAL = 0x94D049BB133111EB
_MASK = (1 << 64) - 1


def head_hash(head: bytes) -> int:
    """A 64-bit hash of a file's first bytes (at most HEAD_BYTES), the compiled scanner's twin
    (`_scan.c`: head_hash). Files with the same size and head hash may be copies of each other;
    probe confirms each such match with a sha256 of the whole files, so this only has to be cheap
    and rarely equal for different heads. Each little-endian word is mixed on its own and summed."""
    import numpy as np  # only the Python path of probe needs it; the scanner hashes in C

    n = len(head)
    words = np.frombuffer(head + bytes(-n % 8), "<u8")
    mixed = words + np.arange(len(words), dtype=np.uint64) * np.uint64(_HASH_STEP)  # wraps, as C does
    mixed ^= mixed >> np.uint64(32)
    mixed *= np.uint64(_HASH_MIX)
    total = (n * _HASH_STEP + int(mixed.sum(dtype=np.uint64))) & _MASK
    total ^= total >> 29
    total = (total * _HASH_FINAL) & _MASK
    return total ^ (total >> 32)


def file_identity(info: os.stat_result) -> int:
    """Which file this is, as one 64-bit number (`_scan.c` computes the same): the names of one file
    (links, a table naming it twice) share it. Device and inode are folded together; two files
    would have to share their size and head hash too before an equal fold mattered."""
    return (info.st_ino ^ (info.st_dev * _HASH_STEP)) & _MASK


def read_head(path: str | os.PathLike[str]) -> tuple[int, int]:
    """head_hash and file_identity of the file at `path` (O_NONBLOCK: never waits on a FIFO)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        return head_hash(os.read(fd, HEAD_BYTES)), file_identity(os.fstat(fd))
    finally:
        os.close(fd)


def _refuse_special(fd: int, path: str | os.PathLike[str]) -> None:
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        raise not_regular(path, mode)


def jpeg_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) from the frame header of a clean JPEG in memory, or None when its segments
    are not laid out plainly (then parse_bytes has the last word). Much cheaper than parse_bytes
    (no EXIF, no end-marker check, no ImageHeader): the read side checks every record's size before
    decoding it."""
    pos, end = 2, len(data) - 9
    while pos < end:
        if data[pos] != 0xFF:
            return None
        marker = data[pos + 1]
        if marker in _SOF:
            return (data[pos + 7] << 8) | data[pos + 8], (data[pos + 5] << 8) | data[pos + 6]
        if marker == 0xFF:
            pos += 1
        elif marker == 0xDA or marker == 0xD9 or 0xD0 <= marker <= 0xD8 or marker == 0x01:
            return None
        else:
            pos += 2 + ((data[pos + 2] << 8) | data[pos + 3])
    return None


def parse_bytes(data: bytes) -> ImageHeader:
    """Parse the header of an image held in memory."""
    return parse_header(data[:HEAD_BYTES], lambda offset, n: data[offset : offset + n], len(data), None)


def parse_header(head: bytes, fetch: Fetch, size: int, path: str | os.PathLike[str] | None) -> ImageHeader:
    if size == 0:
        raise HeaderError("empty file", "empty file")
    parser = _PARSERS.get(format_from_magic(head))
    if parser is not None:
        return parser(head, fetch, size)
    return _pil_header(head, fetch, size, path)


# --- JPEG -------------------------------------------------------------------------------------

# Start-of-frame markers; C4 (DHT), C8 (JPG) and CC (DAC) share the range but are not frames.
_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
_PROGRESSIVE_SOF = frozenset({0xC2, 0xC6, 0xCA, 0xCE})
_XMP_PREFIX = b"http://ns.adobe.com/xap/1.0/\x00"
_XMP_ORIENTATION = re.compile(rb"tiff:Orientation(?:=\"|>)(\d)")


def _jpeg(head: bytes, fetch: Fetch, size: int) -> ImageHeader:
    buf, base, limit = head, 0, len(head)  # buf holds file bytes [base, limit)
    pos = 2
    orientation = 0
    xmp_orientation = 0
    while True:
        if pos + 4 > limit:
            if pos >= MAX_HEADER_SCAN:
                raise HeaderError("no frame header in the first 16 MiB")
            buf, base = fetch(pos, HEAD_BYTES), pos
            limit = base + len(buf)
            if len(buf) < 4:
                raise HeaderError("truncated before the frame header")
        i = pos - base
        if buf[i] != 0xFF:
            # Like libjpeg and PIL, skip junk between segments up to the next marker.
            found = buf.find(b"\xff", i)
            pos = base + found if found >= 0 else limit
            continue
        marker = buf[i + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if marker == 0x01 or 0xD0 <= marker <= 0xD8:  # markers without a length
            pos += 2
            continue
        if marker == 0xDA or marker == 0xD9:
            raise HeaderError("corrupt JPEG: scan data before any frame header")
        length = (buf[i + 2] << 8) | buf[i + 3]
        if length < 2:
            raise HeaderError(f"corrupt JPEG: bad segment length at byte {pos}")
        if marker in _SOF:
            if i + 10 > len(buf):
                buf, base = fetch(pos, 16), pos
                limit, i = base + len(buf), 0
                if len(buf) < 10:
                    raise HeaderError("truncated inside the frame header")
            bits = buf[i + 4]
            height = (buf[i + 5] << 8) | buf[i + 6]
            width = (buf[i + 7] << 8) | buf[i + 8]
            components = buf[i + 9]
            if width == 0 or height == 0:
                raise HeaderError(f"zero-size image ({width}x{height})", "zero-size image")
            mode = _JPEG_MODES.get(components)
            if mode is None:
                raise HeaderError(f"unsupported JPEG with {components} components")
            return ImageHeader(
                "jpeg", width, height, mode, bits,
                progressive=marker in _PROGRESSIVE_SOF,
                orientation=orientation or xmp_orientation or 1,
                complete=_ends_with(fetch, size, b"\xff\xd9"),
            )  # fmt: skip
        if marker == 0xE1 and not orientation:
            segment = _segment(buf, i, base, pos, min(length - 2, _EXIF_READ), fetch)
            if segment[:6] == b"Exif\x00\x00":
                orientation = _exif_orientation(segment[6:]) or 0
            elif segment[: len(_XMP_PREFIX)] == _XMP_PREFIX and not xmp_orientation:
                segment = _segment(buf, i, base, pos, length - 2, fetch)
                match = _XMP_ORIENTATION.search(segment)
                xmp_orientation = int(match.group(1)) if match and "1" <= match.group(1).decode() <= "8" else 0
        pos += 2 + length


_JPEG_MODES = {1: "L", 3: "RGB", 4: "CMYK"}


def _segment(buf: bytes, i: int, base: int, pos: int, n: int, fetch: Fetch) -> bytes:
    """The first `n` bytes of the payload of the segment whose marker is at `pos`."""
    start = i + 4
    if start + n <= len(buf):
        return buf[start : start + n]
    return fetch(pos + 4, n)


def _exif_orientation(tiff: bytes) -> int | None:
    """The orientation tag (0x0112) of IFD0 in a TIFF-structured EXIF block, if valid."""
    if len(tiff) < 8:
        return None
    if tiff[:2] == b"II":
        little = True
    elif tiff[:2] == b"MM":
        little = False
    else:
        return None
    order: Literal["little", "big"] = "little" if little else "big"
    ifd = int.from_bytes(tiff[4:8], order)
    if ifd + 2 > len(tiff):
        return None
    count = int.from_bytes(tiff[ifd : ifd + 2], order)
    entry = ifd + 2
    end = min(entry + 12 * count, len(tiff) - 11)
    while entry < end:
        if int.from_bytes(tiff[entry : entry + 2], order) == 0x0112:
            value = int.from_bytes(tiff[entry + 8 : entry + 10], order)
            return value if 1 <= value <= 8 else None
        entry += 12
    return None


def _ends_with(fetch: Fetch, size: int, marker: bytes) -> bool:
    # Encoders may pad after the end marker, so look at the last few bytes, not just the last two.
    tail = fetch(max(0, size - 32), 32)
    return marker in tail


# --- PNG --------------------------------------------------------------------------------------

_PNG_MODES = {
    (0, 1): "1", (0, 2): "L", (0, 4): "L", (0, 8): "L", (0, 16): "I;16",
    (2, 8): "RGB", (2, 16): "RGB", (3, 1): "P", (3, 2): "P", (3, 4): "P", (3, 8): "P",
    (4, 8): "LA", (4, 16): "LA", (6, 8): "RGBA", (6, 16): "RGBA",
}  # fmt: skip


def _png(head: bytes, fetch: Fetch, size: int) -> ImageHeader:
    if len(head) < 33 or head[12:16] != b"IHDR":
        raise HeaderError("corrupt PNG: no IHDR chunk")
    width = int.from_bytes(head[16:20], "big")
    height = int.from_bytes(head[20:24], "big")
    bits, color_type = head[24], head[25]
    if width == 0 or height == 0:
        raise HeaderError(f"zero-size image ({width}x{height})", "zero-size image")
    mode = _PNG_MODES.get((color_type, bits))
    if mode is None:
        raise HeaderError(f"corrupt PNG: colour type {color_type} with bit depth {bits}")
    orientation, transparent = _png_chunks(head, fetch, size)
    if transparent and mode in ("L", "RGB"):
        mode += "A"
    return ImageHeader(
        "png", width, height, mode, bits, progressive=head[28] == 1,
        orientation=orientation, complete=_ends_with(fetch, size, b"IEND"),
    )  # fmt: skip


def _png_chunks(head: bytes, fetch: Fetch, size: int) -> tuple[int, bool]:
    """Walk the chunks before the image data for tRNS and eXIf (orientation)."""
    pos = 33
    orientation, transparent = 1, False
    while pos + 8 <= min(size, MAX_HEADER_SCAN):
        header = head[pos : pos + 8] if pos + 8 <= len(head) else fetch(pos, 8)
        if len(header) < 8:
            break
        length = int.from_bytes(header[:4], "big")
        kind = header[4:8]
        if kind == b"IDAT" or kind == b"IEND":
            break
        if kind == b"tRNS":
            transparent = True
        elif kind == b"eXIf":
            payload = fetch(pos + 8, min(length, _EXIF_READ))
            if payload[:6] == b"Exif\x00\x00":
                payload = payload[6:]
            orientation = _exif_orientation(payload) or 1
        pos += 12 + length
    return orientation, transparent


# --- GIF, WebP, BMP ---------------------------------------------------------------------------


def _gif(head: bytes, fetch: Fetch, size: int) -> ImageHeader:
    if len(head) < 13:
        raise HeaderError("truncated GIF header")
    width = head[6] | (head[7] << 8)
    height = head[8] | (head[9] << 8)
    if width == 0 or height == 0:
        raise HeaderError(f"zero-size image ({width}x{height})", "zero-size image")
    # Like PIL, grow the canvas to the first frame when the frame overhangs the screen.
    frame = _gif_first_frame(head, fetch, size)
    if frame is not None:
        width, height = max(width, frame[0]), max(height, frame[1])
    return ImageHeader("gif", width, height, "P", 8, complete=_ends_with(fetch, size, b"\x3b"))


def _gif_first_frame(head: bytes, fetch: Fetch, size: int) -> tuple[int, int] | None:
    """Right and bottom edge of the first image descriptor, or None if there is none."""
    pos = 13 + (3 << ((head[10] & 7) + 1) if head[10] & 0x80 else 0)
    while pos < min(size, MAX_HEADER_SCAN):
        block = fetch(pos, 10)
        if not block:
            return None
        if block[0] == 0x2C and len(block) >= 9:
            x, y = block[1] | (block[2] << 8), block[3] | (block[4] << 8)
            return x + (block[5] | (block[6] << 8)), y + (block[7] | (block[8] << 8))
        if block[0] != 0x21 or len(block) < 3:
            return None
        pos += 2  # extension introducer and label, then data sub-blocks until a zero length
        while True:
            length = fetch(pos, 1)
            if not length:
                return None
            pos += 1 + length[0]
            if length[0] == 0:
                break
    return None


def _webp(head: bytes, fetch: Fetch, size: int) -> ImageHeader:
    kind = head[12:16]
    if kind == b"VP8 " and len(head) >= 30 and head[23:26] == b"\x9d\x01\x2a":
        width = (head[26] | (head[27] << 8)) & 0x3FFF
        height = (head[28] | (head[29] << 8)) & 0x3FFF
        mode, orientation = "RGB", 1
    elif kind == b"VP8L" and len(head) >= 25 and head[20] == 0x2F:
        bits = int.from_bytes(head[21:25], "little")
        width = (bits & 0x3FFF) + 1
        height = ((bits >> 14) & 0x3FFF) + 1
        mode, orientation = ("RGBA" if bits >> 28 & 1 else "RGB"), 1
    elif kind == b"VP8X" and len(head) >= 30:
        flags = head[20]
        width = int.from_bytes(head[24:27], "little") + 1
        height = int.from_bytes(head[27:30], "little") + 1
        mode = "RGBA" if flags & 0x10 else "RGB"
        orientation = _webp_orientation(fetch, size) if flags & 0x08 else 1
    else:
        raise HeaderError("corrupt WebP: unknown or truncated first chunk")
    if width == 0 or height == 0:
        raise HeaderError(f"zero-size image ({width}x{height})", "zero-size image")
    return ImageHeader("webp", width, height, mode, 8, orientation=orientation)


def _webp_orientation(fetch: Fetch, size: int) -> int:
    pos = 12
    while pos + 8 <= min(size, MAX_HEADER_SCAN):
        header = fetch(pos, 8)
        if len(header) < 8:
            break
        length = int.from_bytes(header[4:8], "little")
        if header[:4] == b"EXIF":
            payload = fetch(pos + 8, min(length, _EXIF_READ))
            if payload[:6] == b"Exif\x00\x00":
                payload = payload[6:]
            return _exif_orientation(payload) or 1
        pos += 8 + length + (length & 1)
    return 1


def _bmp(head: bytes, fetch: Fetch, size: int) -> ImageHeader:
    if len(head) < 26:
        raise HeaderError("truncated BMP header")
    dib = int.from_bytes(head[14:18], "little")
    if dib == 12:
        width = int.from_bytes(head[18:20], "little")
        height = int.from_bytes(head[20:22], "little")
        bits = int.from_bytes(head[24:26], "little")
    elif dib >= 40 and len(head) >= 30:
        width = int.from_bytes(head[18:22], "little", signed=True)
        height = abs(int.from_bytes(head[22:26], "little", signed=True))
        bits = int.from_bytes(head[28:30], "little")
    else:
        raise HeaderError(f"unsupported BMP header of {dib} bytes")
    if width <= 0 or height == 0:
        raise HeaderError(f"zero-size image ({width}x{height})", "zero-size image")
    mode = "P" if bits <= 8 else "RGBA" if bits == 32 else "RGB"
    return ImageHeader("bmp", width, height, mode, 8 if bits >= 8 else bits)


# Keyed by str | None: parse_header looks up what format_from_magic says, None included.
_PARSERS: dict[str | None, Callable[[bytes, Fetch, int], ImageHeader]]
_PARSERS = {"jpeg": _jpeg, "png": _png, "gif": _gif, "webp": _webp, "bmp": _bmp}


# --- anything else: PIL's lazy open -----------------------------------------------------------


def _pil_header(head: bytes, fetch: Fetch, size: int, path: str | os.PathLike[str] | None) -> ImageHeader:
    import io
    import warnings

    from PIL import Image, UnidentifiedImageError

    source = path if path is not None else io.BytesIO(fetch(0, size))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with Image.open(source) as image:
                width, height = image.size
                orientation = image.getexif().get(0x0112, 1)
                fmt = (image.format or "unknown").lower()
                mode = image.mode
    except UnidentifiedImageError:
        raise HeaderError("not an image (unrecognised format)", "not an image") from None
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as error:
        raise HeaderError(f"unreadable header: {error}") from None
    if width <= 0 or height <= 0:
        raise HeaderError(f"zero-size image ({width}x{height})", "zero-size image")
    bits = 16 if mode.startswith("I;16") else 32 if mode in ("I", "F") else 8
    orientation = orientation if isinstance(orientation, int) and 1 <= orientation <= 8 else 1
    return ImageHeader(fmt, width, height, mode, bits, orientation=orientation)
