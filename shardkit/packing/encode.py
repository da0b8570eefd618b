"""One source image in, one encoded record out.

Write side: header check (bombs refused before any allocation) -> decode (libjpeg-turbo, through
Pillow or PyTurboJPEG, with a DCT-domain 1/2, 1/4 or 1/8 reduction when the target allows) -> EXIF
orientation -> 8-bit RGB -> (the picture's DCT hash, into the metadata) -> antialiased resize ->
encode. Each stage raises `ImageError(stage, reason)`.
"""

from __future__ import annotations

import io
import time
import warnings
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from ..core.codecs import DCT_FACTORS, turbojpeg, write_codec
from ..core.config import MAX_RECORD_BYTES, RECORD_META_ALLOWANCE, EncodeConfig, ResizeConfig
from ..core.errors import HeaderError, ImageError
from ..core.headers import ImageHeader, parse_bytes
from ..core.phash import THUMBNAIL, dct_hash

_TRANSPOSE = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}
_RESAMPLE = {
    "bilinear": Image.Resampling.BILINEAR,
    "bicubic": Image.Resampling.BICUBIC,
    "lanczos": Image.Resampling.LANCZOS,
}


@dataclass(frozen=True, slots=True)
class Encoded:
    data: bytes
    ext: str  # "jpg" or "npy" (raw pixels)
    meta: dict[str, Any]
    flattened: bool = False  # it had transparency (an alpha below 255 somewhere), flattened onto the background
    single_colour: bool = False  # stored with every pixel alike (of more than one pixel): see `single_coloured`


@dataclass(frozen=True, slots=True)
class Geometry:
    """Where an image goes: resize the (optionally cropped) displayed source to `size`."""

    size: tuple[int, int]  # output width, height
    needed: tuple[int, int]  # smallest full-image decode (displayed orientation) that keeps full detail
    box: tuple[int, int, int, int] | None = None  # crop of the displayed source, before resizing


def plan_geometry(width: int, height: int, resize: ResizeConfig) -> Geometry:
    """Output size (and crop) for a displayed width x height under `resize`."""
    size = resize.pixels
    if size is None:
        return Geometry((width, height), (width, height))
    short = min(width, height)
    if resize.mode == "center-crop":
        left, top = (width - short) // 2, (height - short) // 2
        needed = (min(width, -(-width * size // short)), min(height, -(-height * size // short)))
        return Geometry((size, size), needed, (left, top, left + short, top + short))
    scale = resize_scale(width, height, resize)
    if scale == 1.0:
        return Geometry((width, height), (width, height))
    output = (max(1, round(width * scale)), max(1, round(height * scale)))
    return Geometry(output, (min(width, output[0]), min(height, output[1])))


def resize_scale(width: int, height: int, resize: ResizeConfig) -> float:
    """The one scale rule of the short and long modes (images and video frames alike): the short
    (or long) side at the target, never enlarged unless --upscale, and the long side never past
    target x max_aspect, even if the short side then ends smaller (thin strips stay sane). 1.0
    without a target."""
    size = resize.pixels
    if size is None:
        return 1.0
    short, long = min(width, height), max(width, height)
    scale = size / (long if resize.mode == "long" else short)
    if not resize.upscale:
        scale = min(scale, 1.0)
    return min(scale, size * resize.max_aspect / long)


def dct_factor(stored: tuple[int, int], needed: tuple[int, int]) -> tuple[int, int]:
    """The strongest libjpeg-turbo reduction whose output still covers `needed` (both as stored)."""
    width, height = stored
    for num, den in DCT_FACTORS:
        if -(-width * num // den) >= needed[0] and -(-height * num // den) >= needed[1]:
            return num, den
    return 1, 1


def process_image(
    data: bytes,
    resize: ResizeConfig,
    encode: EncodeConfig,
    timings: MutableMapping[str, float] | None = None,
    header: ImageHeader | None = None,
) -> Encoded:
    """Decode, orient, convert, resize and encode one image held in memory (`header`: its header,
    already parsed and checked against the pixel limit)."""
    timings = timings if timings is not None else {}
    started = time.perf_counter()
    if header is None:
        header = read_checked_header(data, encode.max_pixels)
    width, height = header.displayed_size
    geometry = plan_geometry(width, height, resize)
    if geometry.size[0] * geometry.size[1] > encode.max_pixels:  # --upscale can grow past the limit
        raise ImageError(
            "resize",
            f"the output {geometry.size[0]}x{geometry.size[1]} would be over the limit of {encode.max_pixels:,} "
            "pixels that readers accept",
        )
    raw_bytes = geometry.size[0] * geometry.size[1] * 3
    if encode.encode == "raw" and raw_bytes > MAX_RECORD_BYTES - RECORD_META_ALLOWANCE:
        raise ImageError("encode", record_too_big(raw_bytes))
    meta: dict[str, Any] = {"width": width, "height": height, "mode": header.mode, "format": header.format}
    if can_keep_original(header, geometry, encode):
        meta.update(stored_width=width, stored_height=height, encoding="original")
        timings["encode"] = timings.get("encode", 0.0) + time.perf_counter() - started
        return Encoded(data, "jpg", meta)

    image = decode_for_geometry(data, header, geometry)
    decoded = time.perf_counter()
    image, flattened = rgb_of(image, header.bits, encode.background)
    # The picture's DCT hash, from pixels decoded anyway: records carry it, so packed outputs are
    # compared for near copies without decoding again. Taken from the resized image (fewer pixels to
    # average), unless a crop would leave part of the picture out of it.
    if geometry.box is not None:
        meta["phash"] = picture_hash(image)
    if image.size != geometry.size or geometry.box is not None:
        image = _resize(image, geometry, (width, height), resize)
    if geometry.box is None:
        meta["phash"] = picture_hash(image)
    resized = time.perf_counter()
    if encode.encode == "raw":
        buffer = io.BytesIO()
        np.save(buffer, np.asarray(image), allow_pickle=False)
        payload, ext = buffer.getvalue(), "npy"
    else:
        payload, ext = encode_jpeg(image, encode.quality), "jpg"
    done = time.perf_counter()
    meta.update(stored_width=image.width, stored_height=image.height, encoding="raw" if ext == "npy" else "jpeg")
    for stage, seconds in (("decode", decoded - started), ("resize", resized - decoded), ("encode", done - resized)):
        timings[stage] = timings.get(stage, 0.0) + seconds
    return Encoded(payload, ext, meta, flattened, single_coloured(image))


def record_too_big(size: int) -> str:
    return (
        f"the record would be {size:,} bytes, over the {MAX_RECORD_BYTES >> 20} MiB readers accept "
        "(resize it, or encode jpeg instead of raw)"
    )


def read_checked_header(data: bytes, max_pixels: int) -> ImageHeader:
    try:
        header = parse_bytes(data)
    except HeaderError as error:
        raise ImageError("header", str(error)) from None
    return check_pixels(header, max_pixels)


def check_pixels(header: ImageHeader, max_pixels: int) -> ImageHeader:
    if header.width * header.height > max_pixels:
        raise ImageError(
            "header",
            f"{header.width}x{header.height} = {header.width * header.height:,} pixels is over the limit "
            f"of {max_pixels:,} (decompression bomb?); raise --max-pixels to allow it",
        )
    return header


def can_keep_original(header: ImageHeader, geometry: Geometry, encode: EncodeConfig) -> bool:
    return (
        encode.encode == "original"
        and header.format == "jpeg"
        and not header.progressive
        and header.complete
        and header.bits == 8
        and header.mode in ("RGB", "L")
        and header.orientation == 1
        and geometry.box is None
        and geometry.size == (header.width, header.height)
    )


def decode_for_geometry(data: bytes, header: ImageHeader, geometry: Geometry) -> Image.Image:
    """Decode at the smallest DCT scale that still covers the output; orientation is applied."""
    needed = geometry.needed if header.orientation < 5 else geometry.needed[::-1]
    image: Image.Image | None = None
    tj = turbojpeg() if write_codec() == "pyturbojpeg" else None
    if tj is not None and header.format == "jpeg" and header.mode in ("RGB", "L") and header.bits == 8:
        image = _turbo_decode(tj, data, dct_factor((header.width, header.height), needed))
    if image is None:
        image = _pil_decode(data, header, needed)
    return oriented(image, header.orientation)


def oriented(image: Image.Image, orientation: int) -> Image.Image:
    """The image as displayed under its EXIF orientation (1 to 8; anything else: as stored)."""
    turn = _TRANSPOSE.get(orientation)
    return image.transpose(turn) if turn is not None else image


def _turbo_decode(tj: Any, data: bytes, factor: tuple[int, int]) -> Image.Image | None:
    """libjpeg-turbo decode; None when it only warns (corrupt data): Pillow then has the last word."""
    from turbojpeg import TJPF_RGB

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        try:
            pixels = tj.decode(data, pixel_format=TJPF_RGB, scaling_factor=factor)
        except Warning:
            return None
        except OSError as error:
            raise ImageError("decode", f"corrupt JPEG: {error}") from None
    return Image.fromarray(pixels, "RGB")


def _pil_decode(data: bytes, header: ImageHeader, needed: tuple[int, int]) -> Image.Image:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            image = Image.open(io.BytesIO(data))
            if header.format == "jpeg" and header.mode in ("RGB", "L"):
                image.draft(image.mode, needed)  # PIL's own DCT-domain reduction
            image.load()
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as error:
        raise ImageError("decode", str(error) or type(error).__name__) from None
    return image


def to_rgb(image: Image.Image, bits: int, background: tuple[int, int, int]) -> Image.Image:
    """8-bit RGB: gray, palette, CMYK, 16-bit and alpha (composited on `background`) all converted
    (`bits`: the header's bit depth)."""
    return rgb_of(image, bits, background)[0]


def rgb_of(image: Image.Image, bits: int, background: tuple[int, int, int]) -> tuple[Image.Image, bool]:
    """`to_rgb`, and whether transparency was flattened: an alpha channel (or a palette's or a
    colour key's transparency) below 255 somewhere. An alpha channel that is opaque everywhere is
    dropped, not flattened: the pixels are the same either way, and the count means real
    transparency."""
    mode = image.mode
    if mode == "RGB":
        return image, False
    if mode in ("I;16", "I;16B", "I;16L", "I", "F"):
        pixels = np.asarray(image)
        if mode == "F":
            pixels = np.clip(pixels, 0, 255)
        elif bits == 16 or pixels.max(initial=0) > 255:
            pixels = pixels.astype(np.uint32) >> 8
        return Image.fromarray(pixels.astype(np.uint8), "L").convert("RGB"), False
    has_alpha = mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in image.info
    if has_alpha:
        rgba = image.convert("RGBA")
        alpha = rgba.getchannel("A")
        if alpha.getextrema()[0] == 255:  # (ints for an "L" band)
            return rgba.convert("RGB"), False
        canvas = Image.new("RGB", rgba.size, background)
        canvas.paste(rgba, mask=alpha)
        return canvas, True
    return image.convert("RGB"), False


def single_coloured(image: Image.Image) -> bool:
    """Whether an 8-bit RGB image of more than one pixel has every pixel alike (each band's
    minimum is its maximum), looked at in the stored, resized image: its middle row first, which
    settles almost every picture cheaply, then the whole image only where that row is one
    colour. A 1x1 image is one colour by nature and never counts."""
    width, height = image.size
    if width * height < 2:
        return False
    middle = image.crop((0, height // 2, width, height // 2 + 1))
    return _one_colour(middle) and _one_colour(image)


def _one_colour(image: Image.Image) -> bool:
    bands: Any = image.getextrema()  # ((low, high) a band) for an RGB image
    return all(low == high for low, high in bands)


def picture_hash(image: Image.Image) -> str:
    """The DCT hash (16 hex digits) of a decoded 8-bit image, already oriented: what records carry."""
    return f"{dct_hash(grey_average(image)):016x}"


def grey_average(image: Image.Image) -> np.ndarray:
    """The THUMBNAIL x THUMBNAIL grey box average of an 8-bit image, as float64."""
    # Averaged first, grey after: luma is linear, so the order barely matters, and converting
    # THUMBNAIL x THUMBNAIL pixels instead of the whole picture is far cheaper.
    small = image.resize((THUMBNAIL, THUMBNAIL), Image.Resampling.BOX)
    return np.asarray(small.convert("L"), np.float64)


def _resize(image: Image.Image, geometry: Geometry, displayed: tuple[int, int], resize: ResizeConfig) -> Image.Image:
    box = None
    if geometry.box is not None:  # the crop was planned on the full-size image: map it onto the decoded one
        sx, sy = image.width / displayed[0], image.height / displayed[1]
        left, top, right, bottom = geometry.box
        box = (left * sx, top * sy, right * sx, bottom * sy)
    return image.resize(geometry.size, _RESAMPLE[resize.resample], box=box)


def encode_jpeg(image: Image.Image, quality: int) -> bytes:
    """Baseline 4:2:0 JPEG."""
    tj = turbojpeg() if write_codec() == "pyturbojpeg" else None
    if tj is not None:
        from turbojpeg import TJPF_RGB, TJSAMP_420

        return bytes(tj.encode(np.asarray(image), quality, TJPF_RGB, TJSAMP_420))
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", quality=quality, subsampling=2)
    return buffer.getvalue()
