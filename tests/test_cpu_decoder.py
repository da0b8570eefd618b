"""The CPU decoder alone (readers/cpu_decoder.py), on a real packed output: a chunk decoded on its
own is the loader's batch of that chunk, the kernel's pixels are Pillow's within the filters'
rounding, a record that fails is handed to on_error and left out, and a clip is refused."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from shardkit.core.errors import ConfigError, ShardReadError
from shardkit.formats.base import Record
from shardkit.readers import open_shards
from shardkit.readers.cpu_decoder import CpuDecoder
from shardkit.readers.epoch import EpochRecord
from shardkit.readers.loader import loader_parts
from shardkit.readers.options import LoaderOptions
from shardkit.readers.windows import crop_with_pillow
from shardkit.synthetic import picture

from .stage_outputs import first_chunk, photos
from .test_loader import foreign_output, jpeg

OPTIONS = {"output": "numpy", "flip": True, "workers": 1}


@pytest.fixture(scope="module")
def output(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return photos(tmp_path_factory)


def test_a_chunk_decodes_to_the_loaders_batch(output: Path) -> None:
    dataset = open_shards(output, shuffle=True, seed=4)
    key, chunk = first_chunk(dataset, 8)
    batch = CpuDecoder(loader_parts(dataset, LoaderOptions(8, 40, **OPTIONS))).decode(key, 0, chunk)
    expected = next(iter(dataset.loader(8, 40, **OPTIONS)))
    assert batch.keys == expected.keys == [item.record.key for item in chunk] and batch.kept is None
    assert np.array_equal(batch.images, expected.images) and np.array_equal(batch.windows, expected.windows)
    assert batch.images.shape == (8, 3, 40, 40) and batch.labels.dtype == np.int64


def test_the_kernel_and_pillow_give_the_same_crops(output: Path) -> None:
    dataset = open_shards(output)
    key, chunk = first_chunk(dataset, 6)
    parts = loader_parts(dataset, LoaderOptions(6, (32, 48), **OPTIONS))
    batch = CpuDecoder(parts).decode(key, 3, chunk)
    boxes = np.column_stack([batch.windows[:, :2], batch.windows[:, 2:] - batch.windows[:, :2]])
    for i, item in enumerate(chunk):
        by_pillow = crop_with_pillow(item.record.data, "jpg", boxes[i], bool(batch.flips[i]), (32, 48), 1 << 30)
        difference = np.abs(batch.images[i].transpose(1, 2, 0).astype(int) - by_pillow.astype(int))
        assert difference.mean() < 1 and difference.max() <= 8, item.record.key
    without_kernel = CpuDecoder(parts._replace(kernel=None)).decode(key, 3, chunk)  # (a machine without _crop.c)
    assert np.abs(without_kernel.images.astype(int) - batch.images.astype(int)).mean() < 1


def test_a_failed_record_is_handed_to_on_error(tmp_path: Path) -> None:
    good = jpeg(picture(90, 70, 1, 3))
    records = [
        Record(f"r{i}", good[:300] + bytes(200) + good[500:] if i == 2 else good, "jpg", i, {}) for i in range(4)
    ]
    folder = foreign_output(tmp_path / "out", records)
    skipping = open_shards(folder, on_error="skip")
    key, chunk = first_chunk(skipping, 4)
    batch = CpuDecoder(loader_parts(skipping, LoaderOptions(4, 16, output="numpy"))).decode(key, 0, chunk)
    assert batch.keys == ["r0", "r1", "r3"] and batch.kept == [0, 1, 3] and skipping.skipped == 1
    raising = open_shards(folder)
    key, chunk = first_chunk(raising, 4)
    with pytest.raises(ShardReadError, match=r"record r2: cannot decode \(corrupt JPEG"):
        CpuDecoder(loader_parts(raising, LoaderOptions(4, 16, output="numpy"))).decode(key, 0, chunk)


def test_a_clip_in_a_chunk_is_refused(output: Path) -> None:
    dataset = open_shards(output)
    key, chunk = first_chunk(dataset, 2)
    clip = EpochRecord(chunk[1].dataset, chunk[1].shard, chunk[1].record._replace(ext="mp4"))
    decoder = CpuDecoder(loader_parts(dataset, LoaderOptions(2, 16, output="numpy")))
    with pytest.raises(ConfigError, match="is a video clip: read clips with frames=T"):
        decoder.decode(key, 0, [chunk[0], clip])
