"""The device decoder alone (readers/device_decoder.py), run with device="cpu" as CI has no GPU: its
three steps (the host's part on a loader thread, the decode, the make) give the loader's batch of
a chunk, with the CPU decoder's windows and flips; a record that fails is left out."""

from __future__ import annotations

import importlib.util
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import pytest

from shardkit.formats.base import Record
from shardkit.readers import open_shards
from shardkit.readers.cpu_decoder import CpuDecoder
from shardkit.readers.device_decoder import DEVICE_AHEAD, DeviceDecoder
from shardkit.readers.loader import loader_parts
from shardkit.readers.options import LoaderOptions
from shardkit.synthetic import picture

from .stage_outputs import first_chunk, photos
from .test_loader import foreign_output, jpeg

torch = pytest.importorskip("torch")
if importlib.util.find_spec("torchvision") is None:
    pytest.skip("torchvision is not installed", allow_module_level=True)


@pytest.fixture(scope="module")
def output(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return photos(tmp_path_factory)


def test_the_three_steps_make_the_loaders_batch(output: Path) -> None:
    dataset = open_shards(output, shuffle=True, seed=9)
    key, chunk = first_chunk(dataset, 6)
    decoder = DeviceDecoder(loader_parts(dataset, LoaderOptions(6, 48, flip=True, device="cpu")))
    gathered = decoder.decode(key, 0, chunk)
    assert gathered.failures == {} and len(gathered.encoded) == 6
    on_device = decoder.decode_on_device(gathered)
    assert on_device is not None and on_device.rows == list(range(6))
    batch = decoder.make(*on_device)
    expected = next(iter(dataset.loader(6, 48, flip=True, device="cpu")))
    assert batch.keys == expected.keys and torch.equal(batch.images, expected.images)
    assert batch.images.is_contiguous(memory_format=torch.channels_last) and batch.images.dtype == torch.uint8
    cpu = CpuDecoder(loader_parts(dataset, LoaderOptions(6, 48, flip=True))).decode(key, 0, chunk)
    assert np.array_equal(batch.windows, cpu.windows) and np.array_equal(batch.flips, cpu.flips)


def test_the_lane_hands_batches_in_order_and_ends_its_threads(output: Path) -> None:
    dataset = open_shards(output)
    key, chunk = first_chunk(dataset, 4)
    decoder = DeviceDecoder(loader_parts(dataset, LoaderOptions(2, 32, device="cpu")))
    lane = decoder.lane(decoder.make)
    submitted = []
    for number in range(DEVICE_AHEAD):
        gathered: Future = Future()
        gathered.set_result(decoder.decode(key, number, chunk[2 * number : 2 * number + 2]))
        submitted.append(lane.submit(gathered))
    batches = [lane.handed(work) for work in submitted]
    lane.close()
    assert [batch.keys for batch in batches] == [[item.record.key for item in chunk[:2]],
                                                 [item.record.key for item in chunk[2:]]]  # fmt: skip


def test_a_record_the_device_cannot_decode_is_left_out(tmp_path: Path) -> None:
    good = jpeg(picture(90, 70, 1, 3))
    records = [Record("r0", good, "jpg", 0, {}), Record("r1", b"\x89PNG\r\n\x1a\n" + bytes(40), "png", 1, {})]
    dataset = open_shards(foreign_output(tmp_path / "out", records), on_error="skip")
    key, chunk = first_chunk(dataset, 2)
    decoder = DeviceDecoder(loader_parts(dataset, LoaderOptions(2, 32, device="cpu")))
    on_device = decoder.decode_on_device(decoder.decode(key, 0, chunk))
    assert on_device is not None and on_device.rows == [0] and dataset.skipped == 1
    assert decoder.make(*on_device).keys == ["r0"]
