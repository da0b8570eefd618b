from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image, ImageOps

from shardkit.core import codecs as backends
from shardkit.core.config import EncodeConfig, ResizeConfig
from shardkit.core.errors import ImageError
from shardkit.core.phash import distances
from shardkit.packing.encode import dct_factor, plan_geometry, process_image, write_codec
from shardkit.packing.hashes import hash_bytes
from shardkit.readers.decode import decode
from shardkit.synthetic import encode, picture


@pytest.mark.parametrize(
    ("size", "resize", "expected"),
    [
        ((500, 375), ResizeConfig(256), (341, 256)),
        ((375, 500), ResizeConfig(256), (256, 341)),
        ((500, 375), ResizeConfig(256, mode="long"), (256, 192)),
        ((200, 150), ResizeConfig(256), (200, 150)),  # never upscale by default
        ((200, 150), ResizeConfig(256, upscale=True), (341, 256)),
        ((500, 375), ResizeConfig(224, mode="center-crop"), (224, 224)),
        ((100, 80), ResizeConfig(224, mode="center-crop"), (224, 224)),  # crop fills its square
        ((8000, 20), ResizeConfig(256, upscale=True), (1024, 3)),  # thin strip: long side capped at 4x
        ((20, 8000), ResizeConfig(256), (3, 1024)),
        ((640, 480), ResizeConfig(None), (640, 480)),
    ],
)
def test_geometry(size, resize, expected) -> None:
    assert plan_geometry(*size, resize).size == expected


def test_dct_factor_picks_the_strongest_reduction_that_covers_the_target() -> None:
    assert dct_factor((2000, 1500), (341, 256)) == (1, 4)
    assert dct_factor((1024, 768), (341, 256)) == (1, 2)
    assert dct_factor((500, 375), (341, 256)) == (1, 1)
    assert dct_factor((4000, 3000), (400, 300)) == (1, 8)


def jpeg(width: int, height: int, **options) -> bytes:
    return encode(picture(width, height, seed=3), "JPEG", quality=95, **options)


def reference(data: bytes, size: tuple[int, int]) -> np.ndarray:
    image = ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB")
    return np.asarray(image.resize(size, Image.Resampling.BICUBIC), dtype=np.float32)


@pytest.mark.parametrize("codec", ["pyturbojpeg", "pillow"])
@pytest.mark.parametrize("source", [(1600, 1200), (500, 375)])
def test_resized_pixels_match_a_plain_pil_resize(monkeypatch, codec: str, source) -> None:
    monkeypatch.setenv("SHARDKIT_WRITE_CODEC", codec)
    write_codec.cache_clear()
    try:
        assert write_codec() == codec or backends.turbojpeg() is None
        data = jpeg(*source)
        out = process_image(data, ResizeConfig(256), EncodeConfig(quality=95))
        pixels = decode(out.data, out.ext).astype(np.float32)
    finally:
        write_codec.cache_clear()
    assert pixels.shape == (256, round(source[0] * 256 / source[1]), 3)
    assert np.abs(pixels - reference(data, pixels.shape[1::-1])).mean() < 3.0
    meta = dict(out.meta)
    # the picture's DCT hash, from the pack's own decode: the file's (packing/hashes), or a few bits off
    picture = np.array([int(meta.pop("phash"), 16)], np.uint64)
    from_file = np.array([hash_bytes(data, True, 1 << 30)[1]], np.uint64)
    assert distances(picture, from_file)[0] <= 4
    assert meta == {
        "width": source[0], "height": source[1], "mode": "RGB", "format": "jpeg",
        "stored_width": pixels.shape[1], "stored_height": 256, "encoding": "jpeg",
    }  # fmt: skip


@pytest.mark.parametrize("orientation", [3, 6, 8])
def test_exif_orientation_is_applied(orientation: int) -> None:
    exif = Image.Exif()
    exif[0x0112] = orientation
    data = jpeg(400, 300, exif=exif.tobytes())
    out = process_image(data, ResizeConfig(150), EncodeConfig(quality=95))
    pixels = decode(out.data, out.ext).astype(np.float32)
    expected = reference(data, pixels.shape[1::-1])
    assert np.abs(pixels - expected).mean() < 3.0
    if orientation in (6, 8):
        assert (out.meta["width"], out.meta["height"]) == (300, 400)


@pytest.mark.parametrize(
    ("mode", "fmt"),
    [("L", "JPEG"), ("L", "PNG"), ("P", "PNG"), ("RGBA", "PNG"), ("LA", "PNG"), ("CMYK", "JPEG"), ("I;16", "PNG")],
)
def test_every_mode_becomes_8bit_rgb(mode: str, fmt: str) -> None:
    base = Image.fromarray(picture(64, 48, seed=5))
    if mode == "I;16":
        image = Image.fromarray(np.asarray(base.convert("L")).astype(np.uint16) * 257)
    elif mode == "P":
        image = base.convert("P", palette=Image.Palette.ADAPTIVE)
    else:
        image = base.convert(mode)
    buffer = io.BytesIO()
    image.save(buffer, fmt)
    out = process_image(buffer.getvalue(), ResizeConfig(None), EncodeConfig(encode="raw"))
    pixels = decode(out.data, out.ext)
    assert pixels.shape == (48, 64, 3) and pixels.dtype == np.uint8
    assert out.meta["mode"] in (mode, "L", "RGB", "LA")
    if mode in ("L", "I;16"):  # gray stays gray: three equal channels, full 8-bit range used
        assert (pixels[..., 0] == pixels[..., 1]).all() and pixels.max() > 128


def test_transparent_pixels_are_composited_on_the_background() -> None:
    rgba = np.zeros((10, 10, 4), dtype=np.uint8)
    data = encode(rgba, "PNG")
    out = process_image(data, ResizeConfig(None), EncodeConfig(encode="raw", background=(10, 20, 30)))
    assert (decode(out.data, out.ext) == [10, 20, 30]).all()


def test_original_encoding_keeps_untouched_baseline_jpegs() -> None:
    data = jpeg(200, 150)
    kept = process_image(data, ResizeConfig(256), EncodeConfig(encode="original"))
    assert kept.data == data and kept.meta["encoding"] == "original"
    shrunk = process_image(jpeg(600, 400), ResizeConfig(256), EncodeConfig(encode="original"))
    assert shrunk.meta["encoding"] == "jpeg" and shrunk.meta["stored_height"] == 256
    progressive = jpeg(200, 150, progressive=True)
    assert process_image(progressive, ResizeConfig(256), EncodeConfig(encode="original")).data != progressive


def test_raw_encoding_stores_npy_without_pickle() -> None:
    out = process_image(jpeg(300, 200), ResizeConfig(100, mode="center-crop"), EncodeConfig(encode="raw"))
    assert out.ext == "npy" and out.data[:6] == b"\x93NUMPY"
    assert decode(out.data, "npy").shape == (100, 100, 3)


def test_bomb_is_refused_from_the_header_before_decoding() -> None:
    with pytest.raises(ImageError) as error:
        process_image(jpeg(300, 200), ResizeConfig(None), EncodeConfig(max_pixels=1000))
    assert error.value.stage == "header" and "decompression bomb" in error.value.reason


def test_truncated_jpeg_is_a_decode_error() -> None:
    data = jpeg(300, 200)
    with pytest.raises(ImageError) as error:
        process_image(data[: len(data) // 2], ResizeConfig(None), EncodeConfig())
    assert error.value.stage == "decode"


@pytest.mark.parametrize("scale", [0.5, 0.25, 0.125])
def test_read_side_dct_scaled_decode(scale: float) -> None:
    data = jpeg(400, 320)
    assert decode(data, "jpg", scale).shape == (int(320 * scale), int(400 * scale), 3)
