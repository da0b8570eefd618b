"""One worker's stream (readers/stream.py) on a real output's shard starts: its blocks emit every
position of its run once, lanes start at shards' first records, and where it stands is one count
that `locate`, `blocks_from` and `consumed` agree on."""

from __future__ import annotations

import numpy as np
import pytest

from shardkit.readers import open_shards
from shardkit.readers.intervals import interval_positions
from shardkit.readers.stream import LANES, MAX_LANES, Stream, lanes_for

from .stage_outputs import PHOTOS, photos


@pytest.fixture(scope="module")
def cuts(tmp_path_factory: pytest.TempPathFactory) -> np.ndarray:
    dataset = open_shards(photos(tmp_path_factory))
    found = dataset.space(dataset.fresh_progress()).cuts
    assert found is not None
    return found


@pytest.mark.parametrize("shuffle", [False, True])
def test_blocks_emit_the_run_once(cuts: np.ndarray, shuffle: bool) -> None:
    stream = Stream([(0, PHOTOS)], shuffle, 6, (1, 0, 0, 0, 0), 3, cuts)
    emitted = np.concatenate(list(stream.blocks_from(0)))
    assert sorted(emitted.tolist()) == list(range(PHOTOS))
    assert (emitted.tolist() == list(range(PHOTOS))) == (not shuffle)
    assert set(stream.lane_starts[:-1]) <= set(cuts.tolist())  # lanes start at a shard's first record


def test_where_a_stream_stands_is_one_count(cuts: np.ndarray) -> None:
    stream = Stream([(0, PHOTOS)], True, 6, (4, 1, 0, 0, 0), 3, cuts)
    emitted = np.concatenate(list(stream.blocks_from(0)))
    for done in range(PHOTOS + 1):
        rest = np.concatenate([np.zeros(0, np.int64), *stream.blocks_from(done)])
        assert rest.tolist() == emitted[done:].tolist()
        assert sorted(interval_positions(stream.consumed(done)).tolist()) == sorted(emitted[:done].tolist())


def test_lanes_for_a_buffer() -> None:
    assert lanes_for(16, 10_000) == LANES and lanes_for(10**9, 1) == MAX_LANES
    assert lanes_for(1000, 100) == 40  # pieces of about a quarter shard
