"""A record made a Sample (readers/samples.py), on a real packed output: each decode mode, the
transform after it, and a record that does not decode named by shard and key."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from shardkit.core.errors import ShardReadError
from shardkit.readers import Sample, open_shards
from shardkit.readers.samples import sample_of

from .stage_outputs import photos


@pytest.fixture(scope="module")
def record(tmp_path_factory: pytest.TempPathFactory):
    dataset = open_shards(photos(tmp_path_factory))
    return next(iter(dataset.records(0)))


def test_each_decode_mode(record) -> None:
    rgb = sample_of(record, "shard-000000.tar", "rgb", None, 1 << 30, None)
    assert isinstance(rgb, Sample) and rgb.key == record.key and rgb.label == record.label
    assert rgb.image.dtype == np.uint8 and rgb.image.shape[2] == 3 and rgb.video is None
    assert sample_of(record, "s", "bytes", None, 1 << 30, None).image == record.data
    assert isinstance(sample_of(record, "s", "pil", None, 1 << 30, None).image, Image.Image)
    half = sample_of(record, "s", "rgb", 1 / 2, 1 << 30, None).image
    assert half.shape[:2] == tuple(-(-side // 2) for side in rgb.image.shape[:2])
    torch = pytest.importorskip("torch")
    tensor = sample_of(record, "s", "torch", None, 1 << 30, None).image
    assert isinstance(tensor, torch.Tensor) and tuple(tensor.shape) == (3, *rgb.image.shape[:2])


def test_the_transform_takes_the_sample(record) -> None:
    assert sample_of(record, "s", "bytes", None, 1 << 30, lambda sample: sample.key) == record.key


def test_a_record_that_does_not_decode_is_named(record) -> None:
    broken = record._replace(data=record.data[:200])
    with pytest.raises(ShardReadError, match=rf"shard-000007\.tar: record {record.key}: cannot decode"):
        sample_of(broken, "shard-000007.tar", "rgb", None, 1 << 30, None)
    with pytest.raises(ShardReadError, match="over the limit"):
        sample_of(record, "s", "rgb", None, 16, None)
