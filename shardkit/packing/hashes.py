"""The two hashes an image file gets: the sha256 of its bytes (exact copies) and the DCT hash of its
picture (near copies: core/phash.py), from a grey thumbnail of the displayed image.

`duplicates` and `pack --dedup` hash files here (a reduced DCT-scale decode: libjpeg's 1/2 to 1/8
through Pillow's draft); `encode.picture_hash` hashes the picture pack has decoded anyway, so every
record carries both in its metadata and the index, and two packed outputs are compared without
decoding again. Both paths hash the image as displayed (EXIF orientation applied) and as pack
converts it (16-bit to 8, transparency on the background: `encode.to_rgb`).
"""

from __future__ import annotations

import hashlib
import io
import warnings

import numpy as np

from ..core.codecs import RECORD_FORMATS
from ..core.config import EncodeConfig
from ..core.errors import describe
from ..core.phash import THUMBNAIL, dct_hash
from ..core.safeio import read_regular

_BACKGROUND = EncodeConfig().background  # transparent pixels: on what pack composites them by default

# Below this short side a thumbnail says too little: such images are reported, not hashed.
MIN_SIDE = 16
MAX_FILE_BYTES = 1 << 30


def hash_file(path: str, near: bool, max_pixels: int) -> tuple[str | None, int | None, str | None]:
    """(sha256, DCT hash or None, why not or None) of one file: no sha256 when it cannot be read,
    no DCT hash (and the reason) when `near` and the image cannot give a thumbnail."""
    try:
        data = read_regular(path, MAX_FILE_BYTES)
    except OSError as error:
        return None, None, f"cannot read ({describe(error)})"
    return hash_bytes(data, near, max_pixels)


def hash_bytes(data: bytes, near: bool, max_pixels: int) -> tuple[str, int | None, str | None]:
    digest = hashlib.sha256(data).hexdigest()
    if not near:
        return digest, None, None
    try:
        thumbnail = grey_thumbnail(data, max_pixels)
    except ValueError as error:
        return digest, None, str(error)
    return digest, dct_hash(thumbnail), None


def hash_files(job: tuple[list[str], bool, int]) -> list[tuple[str | None, int | None, str | None]]:
    """`hash_file` over a chunk of paths: the unit of work of a pool. A table of URLs' images (an
    http(s) path) are downloaded on the process's threads, with the default download settings."""
    paths, near, max_pixels = job
    urls = [path for path in paths if path.startswith(("http://", "https://"))]
    if not urls:
        return [hash_file(path, near, max_pixels) for path in paths]
    from ..core.config import WebConfig
    from ..storage.download import Downloader, DownloadError

    with Downloader(WebConfig()) as downloader:
        fetched = iter(downloader.fetch((url, None) for url in urls))
        rows: list[tuple[str | None, int | None, str | None]] = []
        for path in paths:
            if not path.startswith(("http://", "https://")):
                rows.append(hash_file(path, near, max_pixels))
                continue
            got = next(fetched)
            if isinstance(got, DownloadError):
                rows.append((None, None, f"cannot download ({got.reason})"))
            else:
                rows.append(hash_bytes(got, near, max_pixels))
    return rows


def grey_thumbnail(data: bytes, max_pixels: int) -> np.ndarray:
    """A THUMBNAIL x THUMBNAIL grey thumbnail of the displayed image, decoded at the smallest DCT
    scale that keeps at least twice its size (JPEG); ValueError with the reason when the image
    cannot give one."""
    from PIL import Image, UnidentifiedImageError

    from .encode import grey_average, oriented, to_rgb

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            image = Image.open(io.BytesIO(data), formats=RECORD_FORMATS)
            width, height = image.size
            if width * height > max_pixels:
                raise ValueError(f"{width}x{height} is over the limit of {max_pixels:,} pixels")
            if min(width, height) < MIN_SIDE:
                raise ValueError(f"too small to hash ({width}x{height}, under {MIN_SIDE} px a side)")
            orientation = image.getexif().get(0x0112, 1) if image.format in ("JPEG", "PNG", "WEBP", "TIFF") else 1
            if image.format == "JPEG":
                image.draft("L", (2 * THUMBNAIL, 2 * THUMBNAIL))
            # 16-bit, palette, alpha: made 8-bit RGB as pack makes them, so both hash the same picture;
            # turned as displayed after the draft's reduction, where it costs next to nothing
            rgb = to_rgb(image, 16 if image.mode.startswith("I;16") else 8, _BACKGROUND)
            return grey_average(oriented(rgb, orientation if isinstance(orientation, int) else 1))
    except ValueError:
        raise
    except UnidentifiedImageError:  # (its text names an in-memory object, <_io.BytesIO object at 0x...>)
        raise ValueError("cannot decode (not a format Pillow recognises)") from None
    except Exception as error:  # Pillow raises many types for a bad file: each is "cannot decode"
        raise ValueError(f"cannot decode ({describe(error, with_type=True)})") from None
