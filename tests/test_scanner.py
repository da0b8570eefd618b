"""The compiled header scanner (shardkit.core._scan) must agree with the Python reference parser.

It answers only what it is sure of (a clean JPEG/PNG whose header is in the first 4 KiB) and
leaves the rest (None) to Python; wherever it answers, the row must be exactly Python's.
"""

from __future__ import annotations

import io
import os
import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from shardkit.core.codecs import header_scanner
from shardkit.core.config import DEFAULT_MAX_PIXELS
from shardkit.packing.probe import _probe_chunk, probe_file
from shardkit.synthetic import encode, picture, rotated_jpeg
from tests.helpers import probe_records

scanner = header_scanner()
needs_scanner = pytest.mark.skipif(scanner is None, reason="shardkit.core._scan was not compiled (no C compiler?)")


def python_row(path: str, max_pixels: int = DEFAULT_MAX_PIXELS) -> tuple:
    record = probe_file(path, path, max_pixels)
    header = None if record.header is None else tuple(record.header)
    return (record.bytes, header, record.error, record.warnings, record.head, record.identity)


def compare(paths: list[str], max_pixels: int = DEFAULT_MAX_PIXELS) -> int:
    """Assert agreement on every path; returns how many the compiled scanner answered itself."""
    answered = 0
    for path, row in zip(paths, scanner.scan_batch(paths, max_pixels), strict=True):
        if row is not None:
            answered += 1
            assert row == python_row(path, max_pixels), path
    return answered


def files(folder: Path) -> list[str]:
    return sorted(str(p) for p in folder.rglob("*") if p.is_file())


@needs_scanner
def test_agrees_on_generated_formats(odd_images: Path, sample_dataset: Path) -> None:
    paths = files(odd_images) + files(sample_dataset)
    answered = compare(paths)
    jpeg_png = [p for p in paths if p.endswith((".jpg", ".png")) and "big_app2" not in p and "corrupt" not in p]
    assert answered >= len(jpeg_png) - 1  # the fast path really runs on ordinary files


@needs_scanner
def test_agrees_on_imagenet_sample(imagenet_sample: Path) -> None:
    paths = files(imagenet_sample)
    assert compare(paths) >= 0.9 * len(paths)


@needs_scanner
def test_agrees_on_wild_files(wild: Path) -> None:
    compare(files(wild))


@needs_scanner
def test_leaves_warnings_and_odd_names_to_python(tmp_path: Path) -> None:
    jpeg = encode(picture(40, 30))
    cases = {
        "truncated.jpg": jpeg[: len(jpeg) // 2],
        "mismatch.png": jpeg,
        "no_extension": jpeg,
        "empty.jpg": b"",
        "caf\udce9.jpg": jpeg,  # a name that is not UTF-8 on disk
    }
    paths = []
    for name, data in cases.items():
        path = os.fsencode(tmp_path) + b"/" + os.fsencode(name)
        with open(path, "wb") as out:
            out.write(data)
        paths.append(os.fsdecode(path))
    paths.append(str(tmp_path / "missing.jpg"))
    paths.append(str(tmp_path))  # a folder
    assert scanner.scan_batch(paths, DEFAULT_MAX_PIXELS) == [None] * len(paths)
    # and over the pixel limit
    assert scanner.scan_batch([paths[0].replace("truncated", "x")], 1) == [None]
    ok = tmp_path / "ok.JPG"
    ok.write_bytes(jpeg)
    assert scanner.scan_batch([str(ok)], 40 * 30) == [python_row(str(ok))]
    assert scanner.scan_batch([str(ok)], 40 * 30 - 1) == [None]


@needs_scanner
def test_orientation_transparency_and_interlace(tmp_path: Path) -> None:
    paths = [str(rotated_jpeg(tmp_path / f"r{o}.jpg", 30, 20, o)) for o in range(1, 9)]
    for name, image, options in [
        ("la.png", Image.new("LA", (9, 7)), {}),
        ("trns.png", Image.new("RGB", (9, 7)), {"transparency": (1, 2, 3)}),
        ("p.png", Image.new("P", (9, 7)), {}),
        ("one.png", Image.new("1", (9, 7)), {}),
        ("i16.png", Image.new("I;16", (9, 7)), {}),
        ("interlaced.png", Image.new("RGB", (9, 7)), {"interlace": 1}),
        ("cmyk.jpg", Image.new("CMYK", (9, 7)), {}),
        ("progressive.jpg", Image.new("RGB", (64, 48)), {"progressive": True}),
    ]:
        path = tmp_path / name
        image.save(path, **options)
        paths.append(str(path))
    png_exif = tmp_path / "exif.png"
    exif = Image.Exif()
    exif[0x0112] = 6
    Image.new("RGB", (9, 7)).save(png_exif, exif=exif)
    paths.append(str(png_exif))
    assert compare(paths) >= len(paths) - 2
    assert scanner.scan_batch([paths[5]], DEFAULT_MAX_PIXELS)[0][1][6] == 6  # r6.jpg: orientation 6


def mutate(data: bytes, rng: random.Random) -> bytes:
    data = bytearray(data)
    for _ in range(rng.randint(1, 6)):
        choice = rng.random()
        if choice < 0.5 and data:
            data[rng.randrange(len(data))] = rng.randrange(256)
        elif choice < 0.7:
            data = data[: rng.randrange(len(data) + 1)]
        elif choice < 0.85:
            at = rng.randrange(len(data) + 1)
            data[at:at] = rng.randbytes(rng.randint(1, 40))
        else:  # a segment or chunk length that points far away
            at = rng.randrange(max(1, len(data) - 2))
            data[at : at + 2] = b"\xff\xff"
    return bytes(data)


def seeds() -> list[bytes]:
    exif = Image.Exif()
    exif[0x0112] = 3
    buffer = io.BytesIO()
    Image.fromarray(picture(24, 16)).save(buffer, "JPEG", exif=exif)
    png = io.BytesIO()
    Image.new("RGBA", (5, 3)).save(png, "PNG", exif=exif)
    return [buffer.getvalue(), png.getvalue(), encode(picture(20, 10), "PNG"), encode(picture(31, 9))]


SEEDS = seeds()


@needs_scanner
@settings(max_examples=400, deadline=None)
@given(st.integers(min_value=0, max_value=len(SEEDS) - 1), st.integers(min_value=0, max_value=2**32))
def test_fuzzed_headers_agree_or_fall_back(tmp_path_factory: pytest.TempPathFactory, which: int, seed: int) -> None:
    data = mutate(SEEDS[which], random.Random(seed))
    folder = tmp_path_factory.getbasetemp()
    paths = []
    for suffix in (".jpg", ".png"):
        path = folder / f"fuzz{suffix}"
        path.write_bytes(data)
        paths.append(str(path))
    compare(paths)


@needs_scanner
def test_fuzzed_large_files_agree(tmp_path: Path) -> None:
    """Files over 4 KiB: the size comes from lseek and the end marker from a tail read."""
    rng = random.Random(7)
    big = encode(picture(300, 200, seed=3), quality=95)
    assert len(big) > 4096
    paths = []
    for index in range(60):
        path = tmp_path / f"big{index}.jpg"
        path.write_bytes(mutate(big, rng) if index else big)
        paths.append(str(path))
    assert compare(paths) >= 1


def test_chunk_rows_are_the_same_with_or_without_the_scanner(sample_dataset: Path, odd_images: Path) -> None:
    paths = files(sample_dataset) + files(odd_images)
    job = (paths, paths, DEFAULT_MAX_PIXELS)
    with_scanner = _probe_chunk(job)
    assert with_scanner == [python_row(p) for p in paths]


def test_threaded_probe_keeps_input_order(sample_dataset: Path) -> None:
    paths = files(sample_dataset) * 80  # several chunks of 2048: really threaded
    serial = probe_records(paths, paths, workers=1)
    threaded = probe_records(paths, paths, workers=2)
    assert threaded == serial


@pytest.mark.parametrize("folder", ["imagenet_sample", "wild", "odd_images"])
def test_probe_sizes_equal_pil_displayed_sizes(folder: str, request: pytest.FixtureRequest) -> None:
    """End to end, whichever parser answered: every readable header gives PIL's displayed size."""
    from tests.test_headers import pil_displayed_size

    paths = files(request.getfixturevalue(folder))
    records = probe_records(paths, paths, workers=2)
    compared = 0
    for path, record in zip(paths, records, strict=True):
        expected = pil_displayed_size(Path(path))
        if record.header is not None and expected is not None:
            assert record.header.displayed_size == expected, path
            compared += 1
        elif expected is not None:
            assert record.error, path  # PIL opens it but we refuse it: there must be a reason
    assert compared >= len(paths) * (0.6 if folder == "wild" else 1)


@needs_scanner
@pytest.mark.parametrize("limit", [-1, 0, -(2**62)])
def test_a_limit_below_one_pixel_is_left_to_python(tmp_path: Path, limit: int) -> None:
    path = tmp_path / "a.jpg"
    path.write_bytes(encode(picture(40, 30)))
    assert scanner.scan_batch([str(path)], limit) == [None]
    assert _probe_chunk(([str(path)], [str(path)], limit))[0] == python_row(str(path), limit)


def test_huge_limits_agree(tmp_path: Path) -> None:
    path = tmp_path / "a.jpg"
    path.write_bytes(encode(picture(40, 30)))
    assert _probe_chunk(([str(path)], [str(path)], 2**70))[0] == python_row(str(path), 2**70)


@needs_scanner
def test_structured_edge_cases_agree(tmp_path: Path) -> None:
    from tests.scanner_cases import EXTS, jpeg, mutate, png

    rng = random.Random(11)
    paths = []
    for index in range(600):
        data = jpeg(rng) if rng.random() < 0.5 else png(rng)
        if rng.random() < 0.4:
            data = mutate(data, rng)
        path = tmp_path / f"f{index}{rng.choice(EXTS)}"
        path.write_bytes(data)
        paths.append(str(path))
    assert compare(paths) >= 50  # the scanner answers a good share itself
