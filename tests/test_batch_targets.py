"""The loader's targets stage (readers/batch_targets.py) on a real output packed with a center crop:
the manifest says so through its typed accessor, masks and boxes go through each record's window as
the loader's batch has them, a record without the mask field fails or is filled, and the targets
are put on the batch as numpy arrays or typed tensors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from shardkit.core.manifest import Manifest, PackedResize, read_manifest
from shardkit.readers import open_shards
from shardkit.readers.batch import Batch
from shardkit.readers.batch_targets import TargetStage
from shardkit.readers.options import LoaderOptions
from shardkit.readers.targets import record_targets, window_corners
from shardkit.readers.windows import WindowDraw, header_sizes

from .stage_outputs import targets

SIZE = (32, 40)


@pytest.fixture(scope="module")
def output(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return targets(tmp_path_factory)


def test_the_manifest_says_how_pack_resized(output: Path) -> None:
    assert read_manifest(output).packed_resize == PackedResize("center-crop", 96)
    assert read_manifest(output).packed_resize.center_crop
    assert not Manifest("webdataset", []).packed_resize.center_crop  # (an output from elsewhere says nothing)
    odd = Manifest("webdataset", [], settings={"resize": {"mode": "center-crop", "size": None}})
    assert odd.packed_resize == PackedResize("center-crop", None) and not odd.packed_resize.center_crop


def measured(output: Path, **options):
    dataset = open_shards(output, seed=1)
    position, items = dataset.epoch_items()
    chunk = [item for item in items if item is not None]
    sizes, failures = header_sizes([item.record for item in chunk], dataset.max_pixels, None)
    windows = WindowDraw("random", (0.3, 1.0), (3 / 4, 4 / 3), SIZE, 36, True)
    boxes, flips = windows.draw(position.stream.key, 0, sizes)
    loader_options = LoaderOptions(8, SIZE, output="numpy", **options)
    stage = TargetStage(loader_options, None, dataset.max_pixels, None, None)
    return chunk, sizes, window_corners(boxes), flips, failures, stage


def test_masks_and_boxes_go_through_each_window(output: Path) -> None:
    chunk, sizes, corners, flips, failures, stage = measured(output, mask="seg.png", boxes="objects.bbox")
    found = stage.measure(chunk, sizes, corners, flips, failures)
    assert found is not None and failures == {}
    masks, per_record = found
    for i, item in enumerate(chunk):
        mask, (boxes, index, _) = record_targets(
            item.record, (int(sizes[i][0]), int(sizes[i][1])), corners[i], bool(flips[i]), SIZE,
            mask="seg.png", boxes="objects.bbox", box_format="xywh", center_crop=True, max_pixels=1 << 30,
        )  # fmt: skip
        assert np.array_equal(masks[i], mask) and np.array_equal(per_record[i][0], boxes)
        assert np.array_equal(per_record[i][1], index)
    batch = Batch(np.zeros((len(chunk) - 1, 3, *SIZE), np.uint8), np.zeros(len(chunk) - 1), ["k"] * (len(chunk) - 1))
    stage.attach(batch, found, [i for i in range(len(chunk)) if i != 2])  # (record 2 failed to decode)
    assert np.array_equal(batch.masks, np.delete(masks, 2, axis=0)) and len(batch.boxes) == len(chunk) - 1
    assert batch.box_labels is None  # (none asked for)


def test_the_stage_is_the_loaders(output: Path) -> None:
    options = {"mask": "seg.png", "boxes": "objects.bbox", "output": "numpy", "flip": True}
    (batch,) = open_shards(output, seed=1).loader(8, SIZE, scale=(0.3, 1.0), resize=36, **options)
    chunk, sizes, corners, flips, failures, stage = measured(output, mask="seg.png", boxes="objects.bbox")
    masks, per_record = stage.measure(chunk, sizes, corners, flips, failures)
    assert np.array_equal(batch.masks, masks)
    assert all(np.array_equal(a, b) for a, (b, _, _) in zip(batch.boxes, per_record, strict=True))


def test_a_missing_mask_fails_or_is_filled(output: Path) -> None:
    chunk, sizes, corners, flips, failures, stage = measured(output, mask="missing.png")
    stage.measure(chunk, sizes, corners, flips, failures)
    assert sorted(failures) == list(range(len(chunk))) and "no field 'missing.png'" in failures[0]
    chunk, sizes, corners, flips, failures, stage = measured(output, mask="missing.png", mask_missing=255)
    masks, _ = stage.measure(chunk, sizes, corners, flips, failures)
    assert failures == {} and (masks == 255).all()


def test_targets_become_typed_tensors(output: Path) -> None:
    torch = pytest.importorskip("torch")
    tv_tensors = pytest.importorskip("torchvision.tv_tensors")
    chunk, sizes, corners, flips, failures, _ = measured(output, mask="seg.png", boxes="objects.bbox")
    options = LoaderOptions(8, SIZE, mask="seg.png", boxes="objects.bbox")
    stage = TargetStage(options, None, 1 << 30, torch.from_numpy, tv_tensors)
    batch = Batch(torch.zeros((len(chunk), 3, *SIZE)), torch.zeros(len(chunk)), ["k"] * len(chunk))
    stage.attach(batch, stage.measure(chunk, sizes, corners, flips, failures), None)
    assert isinstance(batch.masks, tv_tensors.Mask) and isinstance(batch.boxes[0], tv_tensors.BoundingBoxes)
    assert tuple(batch.boxes[0].canvas_size) == SIZE and batch.box_index[0].dtype == torch.int64
