"""The loader's read stage (readers/chunks.py): an epoch's items cut into numbered chunks of
batch_size positions, on a real packed output, a damaged shard's positions counted all the same."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardkit.readers import open_shards
from shardkit.readers.chunks import chunks

from .stage_outputs import PHOTOS, photos


@pytest.fixture(scope="module")
def output(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return photos(tmp_path_factory)


def test_chunks_cover_the_epoch_in_order(output: Path) -> None:
    dataset = open_shards(output, shuffle=True, seed=2, shuffle_buffer=8)
    _, items = dataset.epoch_items()
    got = list(chunks(items, 7, first=5, short_tail=True))
    assert [chunk.number for chunk in got] == [5, 6, 7, 8]
    assert [chunk.positions for chunk in got] == [7, 7, 7, PHOTOS - 21]
    assert all(chunk.offsets == list(range(chunk.positions)) for chunk in got)
    keys = [item.record.key for chunk in got for item in chunk.items]
    assert keys == [sample.key for sample in dataset]  # iteration's order, the loader's too


def test_a_short_tail_is_read_only_when_asked(output: Path) -> None:
    _, items = open_shards(output).epoch_items()
    assert [chunk.positions for chunk in chunks(items, 10, first=0, short_tail=False)] == [10, 10]
    _, items = open_shards(output).epoch_items()
    assert [chunk.positions for chunk in chunks(items, 8, first=0, short_tail=False)] == [8, 8, 8]  # (none short)


def test_a_skipped_position_stays_in_its_chunk(output: Path) -> None:
    """Items that are None (a damaged shard, skipped) take their positions but not their offsets."""
    _, read = open_shards(output).epoch_items()
    items = [None if 3 <= place < 6 else item for place, item in enumerate(read)]
    first, second, *_ = chunks(iter(items), 8, first=0, short_tail=True)
    assert first.positions == 8 and first.offsets == [0, 1, 2, 6, 7] and len(first.items) == 5
    assert second.offsets == list(range(8))
