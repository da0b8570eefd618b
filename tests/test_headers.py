from __future__ import annotations

import contextlib
import io
import os
import warnings
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image, ImageOps

from shardkit.core.headers import HeaderError, parse_bytes, read_header
from shardkit.synthetic import encode, picture


def pil_displayed_size(path: Path) -> tuple[int, int] | None:
    """PIL's size after EXIF orientation, or None when PIL cannot open or decode the file."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            with Image.open(path) as image:
                return ImageOps.exif_transpose(image).size
        except Exception:
            return None


def assert_matches_pil(folder: Path) -> tuple[int, int]:
    readable = unreadable = 0
    for path in sorted(folder.iterdir()):
        expected = pil_displayed_size(path)
        try:
            header, size = read_header(path)
        except HeaderError as error:
            assert str(error), path
            unreadable += 1
            continue
        assert size == path.stat().st_size
        if expected is not None:
            assert header.displayed_size == expected, path.name
            readable += 1
    return readable, unreadable


def test_generated_formats_match_pil(odd_images: Path) -> None:
    readable, unreadable = assert_matches_pil(odd_images)
    assert readable == len(list(odd_images.iterdir()))
    assert unreadable == 0


def test_imagenet_sample_matches_pil(imagenet_sample: Path) -> None:
    readable, unreadable = assert_matches_pil(imagenet_sample)
    assert readable == 300 and unreadable == 0


def test_wild_files_match_pil_or_are_refused_with_reason(wild: Path) -> None:
    readable, unreadable = assert_matches_pil(wild)
    assert readable >= 12
    assert unreadable == 4  # empty, not an image, broken PNG, zero-width GIF


@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation_swaps_displayed_size(odd_images: Path, orientation: int) -> None:
    header, _ = read_header(odd_images / f"80x50_orientation_{orientation}.jpg")
    assert header.orientation == orientation
    assert header.displayed_size == ((50, 80) if orientation >= 5 else (80, 50))


def test_modes_and_flags(odd_images: Path) -> None:
    def h(name: str):
        return read_header(odd_images / name)[0]

    assert h("64x48_gray.jpg").mode == "L"
    assert h("120x80.jpg").mode == "RGB" and not h("120x80.jpg").progressive
    assert h("200x150_progressive.jpg").progressive
    assert h("40x30.gif").format == "gif"
    assert h("57x31.webp").format == "webp"
    assert h("66x22.tiff").format == "tiff"  # through PIL's lazy open
    assert h("120x80.jpg").complete


def test_truncated_jpeg_is_flagged_incomplete() -> None:
    data = encode(picture(100, 80))
    header = parse_bytes(data[: len(data) // 2])
    assert (header.width, header.height) == (100, 80)
    assert not header.complete


def test_sixteen_bit_and_alpha_png() -> None:
    rgba = encode(picture(30, 20, channels=4), "PNG")
    assert parse_bytes(rgba).mode == "RGBA"
    gray16 = Image.fromarray(picture(30, 20, channels=1)[..., 0].astype("uint16") * 257)
    buffer = io.BytesIO()
    gray16.save(buffer, "PNG")
    header = parse_bytes(buffer.getvalue())
    assert (header.mode, header.bits) == ("I;16", 16)


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"", "empty file"),
        (b"hello, this is text", "not an image"),
        (b"\xff\xd8\xff\xe0\x00\x10JFIF\x00", "truncated"),
        (b"\x89PNG\r\n\x1a\n" + b"\x00" * 30, "no IHDR"),
    ],
)
def test_bad_bytes_give_a_reason(data: bytes, reason: str) -> None:
    with pytest.raises(HeaderError, match=reason):
        parse_bytes(data)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=2048), st.sampled_from([b"", b"\xff\xd8\xff", b"\x89PNG\r\n\x1a\n", b"GIF89a", b"BM"]))
def test_garbage_never_raises_anything_but_header_error(data: bytes, magic: bytes) -> None:
    try:
        header = parse_bytes(magic + data)
    except HeaderError:
        return
    assert header.width > 0 and header.height > 0


@settings(max_examples=60, deadline=None)
@given(st.integers(min_value=1, max_value=4000))
def test_every_prefix_of_a_real_jpeg_parses_or_fails_cleanly(cut: int) -> None:
    data = encode(picture(64, 48))
    with contextlib.suppress(HeaderError):
        parse_bytes(data[:cut])


def test_header_reads_stay_small(tmp_path: Path) -> None:
    """A file whose header claims a huge skip must not make us read the skipped bytes."""
    path = tmp_path / "huge_app.jpg"
    # APP1 segments chained up to 20 MB of sparse file, then nothing: give up at 16 MiB.
    with open(path, "wb") as out:
        out.write(b"\xff\xd8")
        for _ in range(400):
            out.write(b"\xff\xe2\xff\xff")
            out.seek(65533, os.SEEK_CUR)
    with pytest.raises(HeaderError):
        read_header(path)
