"""Record bytes to pixels, for everything that reads shards: JPEG through libjpeg-turbo (optionally
DCT-scaled 1/2, 1/4, 1/8), raw .npy pixels matched exactly (no pickle), other formats through
Pillow's plugins for the formats shardkit writes. Records come from strangers: every decoder checks
the header against `max_pixels` before anything is allocated, and raises only ImageError."""

import contextlib
import io
import re
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
from PIL import Image

from ..core.codecs import DCT_FACTORS, RECORD_FORMATS, turbojpeg
from ..core.config import DEFAULT_MAX_PIXELS
from ..core.errors import HeaderError, ImageError, describe
from ..core.headers import jpeg_size, parse_bytes
from ..formats.base import Record

_TJPF_RGB = 0  # turbojpeg.TJPF_RGB, without importing the binding on every read


def decode(data: bytes, ext: str, scale: float | None = None, max_pixels: int = DEFAULT_MAX_PIXELS) -> np.ndarray:
    """Stored bytes to an HxWx3 uint8 array; `scale` 1/2, 1/4 or 1/8 decodes JPEG in the DCT domain.
    Records come from strangers: an image over `max_pixels` is refused from its header, unallocated."""
    if ext == "npy":
        return decode_npy(data, max_pixels)
    factor = _scale_factor(scale)
    tj = turbojpeg()
    if tj is not None and ext == "jpg":
        size = jpeg_size(data)
        if size is None:
            try:
                header = parse_bytes(data)
            except HeaderError as error:
                raise ImageError("decode", f"corrupt JPEG: {error}") from None
            size = header.width, header.height
        refuse_over(size, max_pixels)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # libjpeg-turbo only warns on corrupt data: make it count
                pixels: np.ndarray = tj.decode(data, pixel_format=_TJPF_RGB, scaling_factor=factor)
                return pixels
        except (OSError, Warning) as error:
            if not _four_channel(tj, data):
                raise ImageError("decode", f"corrupt JPEG: {error}") from None
            # CMYK or YCCK: libjpeg-turbo will not make RGB of it, Pillow does (as the loader does)
    return np.asarray(decode_pil(data, scale, max_pixels))


def _four_channel(tj: Any, data: bytes) -> bool:
    """Whether a JPEG is CMYK or YCCK (TJCS_CMYK, TJCS_YCCK), which turbojpeg decodes to no RGB."""
    try:
        return tj.decode_header(data)[3] in (3, 4)
    except OSError:
        return False


def stored_size(data: bytes, ext: str, max_pixels: int = DEFAULT_MAX_PIXELS) -> tuple[int, int]:
    """(width, height) of a record's image as stored, from its header (nothing decoded), checked
    against `max_pixels`."""
    if ext == "npy":
        match = _NPY_HEADER.search(data[:512])
        if data[:6] != b"\x93NUMPY" or match is None:
            raise ImageError("decode", "bad raw pixels: not a uint8 HxWx3 .npy record")
        size = int(match.group(3)), int(match.group(2))
    else:
        try:
            header = parse_bytes(data)
        except HeaderError as error:
            raise ImageError("decode", str(error)) from None
        size = header.width, header.height
    refuse_over(size, max_pixels)
    return size


def refuse_over(size: tuple[int, int], max_pixels: int) -> None:
    if size[0] * size[1] > max_pixels:
        raise ImageError(
            "decode", f"{size[0]}x{size[1]} is over the limit of {max_pixels:,} pixels (raise max_pixels to allow it)"
        )


def open_record(data: bytes, max_pixels: int = DEFAULT_MAX_PIXELS) -> Image.Image:
    """A record's image, opened lazily (header read, nothing decoded) and checked against
    `max_pixels`; callers decode it inside `pillow_errors()`."""
    with pillow_errors():
        image = Image.open(io.BytesIO(data), formats=RECORD_FORMATS)
    refuse_over(image.size, max_pixels)
    return image


@contextlib.contextmanager
def pillow_errors() -> Iterator[None]:
    """Pillow's plugins raise many exception types for a hostile file (ValueError, SyntaxError,
    struct.error, NotImplementedError...): each is ImageError("decode") here; our own pass through."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # our own limit applies
        try:
            yield
        except ImageError:
            raise
        except Exception as error:
            raise ImageError("decode", describe(error, with_type=True)) from None


def decode_pil(data: bytes, scale: float | None = None, max_pixels: int = DEFAULT_MAX_PIXELS) -> Image.Image:
    image = open_record(data, max_pixels)
    with pillow_errors():
        factor = _scale_factor(scale)
        if factor is not None and image.format == "JPEG":
            num, den = factor
            image.draft("RGB", (-(-image.width * num // den), -(-image.height * num // den)))
        image.load()
        return image if image.mode == "RGB" else image.convert("RGB")


_NPY_HEADER = re.compile(
    rb"\{\s*'descr'\s*:\s*'\|u1'\s*,\s*'fortran_order'\s*:\s*(False|True)\s*,"
    rb"\s*'shape'\s*:\s*\(\s*(\d{1,9})\s*,\s*(\d{1,9})\s*,\s*3\s*,?\s*\)\s*,?\s*\}\s*"
)


def npy_layout(data: bytes | memoryview, max_pixels: int = DEFAULT_MAX_PIXELS) -> tuple[int, int, int, bool]:
    """A raw record's (offset of its pixels, width, height, Fortran order), checked: exactly an
    HxWx3 uint8 .npy (what numpy writes for one; no pickle, no other dtype or shape), its size
    against `max_pixels` and against the bytes present. The header is matched here, not by numpy's
    parser, which raises a different exception for each way a hostile header can be wrong."""
    head = bytes(data[:10])
    if head[:6] != b"\x93NUMPY" or len(head) < 10 or head[6] not in (1, 2, 3):
        raise ImageError("decode", "bad raw pixels: not a .npy record")
    width = 2 if head[6] == 1 else 4
    end = 8 + width + int.from_bytes(bytes(data[8 : 8 + width]), "little")
    header = bytes(data[8 + width : min(end, 8 + width + 4096)])
    match = _NPY_HEADER.fullmatch(header)
    if end > len(data) or match is None:
        raise ImageError("decode", f"bad raw pixels: the header is not uint8 HxWx3 ({header[:80]!r})")
    fortran, height, columns = match.group(1) == b"True", int(match.group(2)), int(match.group(3))
    if not height or not columns:
        raise ImageError("decode", f"bad raw pixels: an empty {height}x{columns} image")
    refuse_over((columns, height), max_pixels)
    if len(data) - end != height * columns * 3:
        raise ImageError("decode", f"bad raw pixels: {len(data) - end:,} bytes for {height}x{columns}x3")
    return end, columns, height, fortran


def decode_npy(data: bytes, max_pixels: int = DEFAULT_MAX_PIXELS) -> np.ndarray:
    """A raw record's pixels (see npy_layout), nothing allocated before they are checked."""
    offset, columns, height, fortran = npy_layout(data, max_pixels)
    flat = np.frombuffer(data, np.uint8, offset=offset)
    pixels: np.ndarray  # (numpy's stubs type reshape's result as Any)
    if fortran:
        pixels = flat.reshape(3, columns, height).transpose(2, 1, 0).copy()
    else:
        pixels = flat.reshape(height, columns, 3).copy()
    return pixels


def _scale_factor(scale: float | None) -> tuple[int, int] | None:
    if scale is None or scale == 1:
        return None
    for num, den in DCT_FACTORS:
        if abs(scale - num / den) < 1e-9:
            return num, den
    raise ValueError(f"scale must be 1, 1/2, 1/4 or 1/8, not {scale}")


_IMAGE_FIELD = re.compile(r"(?:^|\.)(png|jpe?g|webp|gif|bmp|tiff?)$", re.IGNORECASE)


def record_fields(record: Record, decode: str, max_pixels: int = DEFAULT_MAX_PIXELS) -> dict[str, Any]:
    """A record's columns and sidecar fields as one dict. Fields stay bytes, unless `decode` asks
    for pixels: then an image field is an array in its own mode (a mask stays 2-D, its values
    untouched: never converted to RGB), or a PIL image for "pil"; an .npy field an array."""
    fields: dict[str, Any] = dict(record.columns) if record.columns else {}
    for name, data in (record.files or {}).items():
        if decode == "bytes":
            fields[name] = data
        elif _IMAGE_FIELD.search(name):
            image = open_record(data, max_pixels)
            with pillow_errors():
                image.load()
                fields[name] = image if decode == "pil" else np.asarray(image)
        elif name.lower().endswith("npy"):
            # numpy's parser, never pickle: from bytes in memory it allocates what is there, not what a header claims
            try:
                fields[name] = np.load(io.BytesIO(data), allow_pickle=False)
            except (ValueError, OSError, EOFError) as error:
                raise ImageError("decode", f"{name}: not a plain .npy array ({describe(error)})") from None
        else:
            fields[name] = data
    return fields
