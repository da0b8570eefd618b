"""The decode stage's contract (readers/decoding.py): a decoder picked by name when the loader is
made, the data checked against it then (frames= on images, or none on clips, refused before any
thread starts), failures handed to on_error, and the lane of a decoder that makes whole batches."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from pathlib import Path

import pytest

from shardkit.core.errors import ConfigError, ShardReadError
from shardkit.readers import open_shards
from shardkit.readers.decoding import InOrder, kept_rows
from shardkit.readers.loader import DECODERS
from shardkit.readers.options import LoaderOptions

from .stage_outputs import clips, photos

pytest.importorskip("av")


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return photos(tmp_path_factory)


@pytest.fixture(scope="module")
def videos(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return clips(tmp_path_factory)


def test_a_decoder_is_picked_by_name() -> None:
    assert set(DECODERS) == {"cpu", "device", "clips"}
    assert LoaderOptions(4, 16, output="numpy").decoder == "cpu"
    assert LoaderOptions(4, 16, output="numpy", frames=3).decoder == "clips"
    pytest.importorskip("torch")
    assert LoaderOptions(4, 16, device="cpu").decoder == "device"


def test_the_data_is_refused_when_the_loader_is_made(images: Path, videos: Path) -> None:
    before = threading.active_count()
    with pytest.raises(ConfigError, match=r"record c0/000 is not a video clip: frames= reads clips only$"):
        open_shards(images).loader(2, 16, frames=4, output="numpy")  # not iterated: no batch is asked for
    with pytest.raises(ConfigError, match=r"record c0 is a video clip: read clips with frames=T$"):
        open_shards(videos).loader(2, 16, output="numpy")
    with pytest.raises(ConfigError, match="is not a video clip"):  # each output of a mix is checked
        open_shards([videos, images]).loader(2, 16, frames=4, output="numpy")
    assert threading.active_count() == before
    assert len(open_shards(videos).loader(2, 16, frames=2, output="numpy")) == 3


def test_a_subset_is_checked_on_its_own_first_record(images: Path) -> None:
    """The record checked is the first the dataset reads: a subset's first kept one."""
    pytest.importorskip("pyarrow")
    dataset = open_shards(images, select=["c2/008", "c1/013"])
    with pytest.raises(ConfigError, match=r"shard-000001\.tar: record c1/013 is not a video clip"):
        dataset.loader(2, 16, frames=4, output="numpy")


def test_failures_go_to_on_error(images: Path) -> None:
    dataset = open_shards(images, on_error="skip")
    _, read = dataset.epoch_items()
    chunk = [item for item, _ in zip(read, range(4), strict=False) if item is not None]
    assert kept_rows(chunk, {}, dataset.on_error) is None
    assert kept_rows(chunk, {1: "worse", 3: "bad"}, dataset.on_error) == [0, 2]
    assert dataset.skipped == 2  # counted on the dataset each record came from
    key = chunk[1].record.key
    with pytest.raises(ShardReadError, match=rf"shard-000000\.tar: record {key}: cannot decode \(worse\)"):
        kept_rows(chunk, {3: "bad", 1: "worse"}, open_shards(images).on_error)  # the first failure raises


def test_the_in_order_lane_hands_each_result_as_it_is() -> None:
    lane, work = InOrder(), Future()
    work.set_result("batch")
    assert lane.submit(work) is work and lane.handed(work) == "batch"
    lane.close()
