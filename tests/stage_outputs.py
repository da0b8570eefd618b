"""Small packed outputs the tests of the loader's stages read (tests/test_chunks.py, test_decoding.py,
test_cpu_decoder.py, ...): built once a run with pack itself, read only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image, ImageDraw

from shardkit import EncodeConfig, PackConfig, ResizeConfig, pack
from shardkit.readers.epoch import EpochRecord
from shardkit.synthetic import write_image

from .conftest import built_once
from .video_clips import clip_record, write_output

PHOTOS = 24  # records of photos(): shards of 10, so the last is short
SIZES = ((180, 150), (223, 171), (300, 200), (160, 240), (257, 181), (96, 96))


def photos(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """24 labelled JPEGs of odd sizes (every fifth grey) in 3 classes, packed as they are, 10 a shard."""

    def build(folder: Path) -> None:
        for i in range(PHOTOS):
            write_image(folder / "src" / f"c{i % 3}" / f"{i:03d}.jpg", *SIZES[i % len(SIZES)], seed=i, gray=i % 5 == 0)
        config = PackConfig(str(folder / "src"), str(folder / "out"), shard_size=10, workers=1,
                            encode=EncodeConfig(encode="original"))  # fmt: skip
        pack(config)

    return built_once(tmp_path_factory, "stage-photos", build) / "out"


def targets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """8 sidecar samples (x.jpg, a label map x.seg.png, boxes and categories in x.json), packed with
    --resize 96 --resize-mode center-crop: the stored image is the original's centered square."""

    def build(folder: Path) -> None:
        source = folder / "src"
        source.mkdir()
        for i in range(8):
            width, height = SIZES[i % len(SIZES)]
            write_image(source / f"s{i}.jpg", width, height, seed=i)
            mask = Image.new("L", (width, height), 0)
            ImageDraw.Draw(mask).rectangle((width // 4, height // 4, width // 2, height // 2), fill=1 + i % 3)
            mask.save(source / f"s{i}.seg.png")
            boxes = [[width / 4, height / 4, width / 4, height / 4], [0.0, 0.0, width / 8, height / 8]]
            (source / f"s{i}.json").write_text(json.dumps({"objects": {"bbox": boxes, "category": ["a", "b"]}}))
        config = PackConfig(str(source), str(folder / "out"), sidecars=True, workers=1,
                            resize=ResizeConfig(size=96, mode="center-crop"))  # fmt: skip
        pack(config)

    return built_once(tmp_path_factory, "stage-targets", build) / "out"


def clips(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """6 video clips of 3 to 8 frames (64 x 48), in two webdataset shards."""

    def build(folder: Path) -> None:
        records = [clip_record(f"c{i}", i % 2, frames=3 + i, first=i, seed=i) for i in range(6)]
        write_output(folder / "out", "webdataset", [records[:4], records[4:]])

    return built_once(tmp_path_factory, "stage-clips", build) / "out"


def first_chunk(dataset, size: int) -> tuple[tuple[int, ...], list[EpochRecord]]:
    """The stream key and the records of the first `size` positions of `dataset`'s epoch: what the
    loader's read stage hands a decoder as its first chunk."""
    position, items = dataset.epoch_items()
    chunk = [item for item, _ in zip(items, range(size), strict=False) if item is not None]
    return position.stream.key, chunk
