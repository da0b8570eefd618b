"""The clip decoder alone (readers/clip_decoder.py), on packed clips: a chunk is the loader's batch
of it, T frames a clip from its offset (the middle ones with crop="center"), one window a clip,
and an image among clips refused."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from shardkit.core.errors import ConfigError
from shardkit.readers import open_shards
from shardkit.readers.clip_decoder import ClipDecoder
from shardkit.readers.epoch import EpochRecord
from shardkit.readers.loader import loader_parts
from shardkit.readers.options import LoaderOptions

from .stage_outputs import clips, first_chunk

pytest.importorskip("av")


@pytest.fixture(scope="module")
def output(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return clips(tmp_path_factory)


def test_a_chunk_is_the_loaders_batch_of_clips(output: Path) -> None:
    dataset = open_shards(output, seed=5)
    key, chunk = first_chunk(dataset, 4)
    options = LoaderOptions(4, 24, frames=4, flip=True, output="numpy")
    batch = ClipDecoder(loader_parts(dataset, options)).decode(key, 0, chunk)
    expected = next(iter(dataset.loader(4, 24, frames=4, flip=True, output="numpy")))
    assert batch.images.shape == (4, 4, 3, 24, 24) and batch.keys == expected.keys
    assert np.array_equal(batch.images, expected.images) and np.array_equal(batch.offsets, expected.offsets)


def test_center_takes_the_middle_frames(output: Path) -> None:
    dataset = open_shards(output)
    key, chunk = first_chunk(dataset, 6)
    batch = ClipDecoder(loader_parts(dataset, LoaderOptions(6, 16, frames=4, crop="center", output="numpy"))).decode(
        key, 0, chunk
    )
    counts = [item.record.meta["frames"] for item in chunk]
    assert batch.offsets.tolist() == [max(n - 4, 0) // 2 for n in counts]


def test_an_image_among_clips_is_refused(output: Path) -> None:
    dataset = open_shards(output)
    key, chunk = first_chunk(dataset, 2)
    image = EpochRecord(chunk[0].dataset, chunk[0].shard, chunk[0].record._replace(ext="jpg"))
    decoder = ClipDecoder(loader_parts(dataset, LoaderOptions(2, 16, frames=2, output="numpy")))
    with pytest.raises(ConfigError, match="is not a video clip: frames= reads clips only"):
        decoder.decode(key, 0, [chunk[1], image])
