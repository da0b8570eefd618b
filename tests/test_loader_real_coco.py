"""The batch loader on data shaped like real COCO (issue 44): images without masks (mask_missing=),
text categories (box_labels=, one vocabulary from index.parquet), images with no objects, mask ids
past 100, corrupt images among them; full batches under on_error="skip" that resume exactly at
every batch boundary, in every format, on the CPU and the device path, on one rank or two; and
DataLoader's message for images of different sizes. Real packed shards of real JPEGs throughout."""

from __future__ import annotations

import importlib.util
import json
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image, ImageDraw

from shardkit import PackConfig, ResizeConfig, pack
from shardkit.core.errors import ConfigError, ShardReadError
from shardkit.readers import open_shards
from shardkit.synthetic import write_image
from tests.test_loader_targets import _expected_mask

FORMATS = ("webdataset", "lmdb", "hdf5")
COUNT = 20
SIZES = ((320, 240), (200, 300), (257, 181), (400, 150), (224, 224))
# COCO's own ids (things up to 90, stuff up to 182): what a real mask holds
CATEGORIES = {"person": 1, "bicycle": 2, "car": 3, "dog": 18, "zebra": 24, "banana": 52, "sky-other": 157,
              "wall-other": 171, "wood": 182}  # fmt: skip
NAMES = sorted(CATEGORIES)
CORRUPT = ("img06", "img14")  # their JPEG header's size zeroed in the shards, after pack
SETTINGS = {"crop": "random", "flip": True, "output": "numpy", "mask": "seg.png", "boxes": "objects.bbox",
            "box_labels": "objects.category"}  # fmt: skip
torch_installed = importlib.util.find_spec("torch") is not None


def without_mask(i: int) -> bool:
    return i % 4 == 1  # 1 in 4, as COCO's images without segmentation


def without_objects(i: int) -> bool:
    return i % 7 == 3


@pytest.fixture(autouse=True)
def no_thread_outlives_a_test() -> Iterator[None]:
    yield
    left = [t.name for t in threading.enumerate() if t.name.startswith(("shardkit-loader", "shardkit-device"))]
    assert left == [], left


def _coco_source(root: Path, count: int = COUNT) -> Path:
    """Sidecar samples as Hugging Face's COCO sets hold them: x.jpg, x.seg.png (COCO ids, up to
    182) for 3 images in 4, x.json with objects.bbox (xywh) and objects.category (names)."""
    root.mkdir(parents=True)
    rng = np.random.default_rng(44)
    for i in range(count):
        width, height = SIZES[i % len(SIZES)]
        write_image(root / f"img{i:02d}.jpg", width, height, seed=i)
        mask = Image.new("L", (width, height), 0)
        boxes: list[list[float]] = []
        categories: list[str] = []
        for j in range(0 if without_objects(i) else 1 + i % 3):
            name = NAMES[(i + 3 * j) % len(NAMES)]
            w, h = int(rng.integers(width // 5, width // 2)), int(rng.integers(height // 5, height // 2))
            x, y = int(rng.integers(0, width - w)), int(rng.integers(0, height - h))
            ImageDraw.Draw(mask).rectangle((x, y, x + w - 1, y + h - 1), fill=CATEGORIES[name])
            boxes.append([float(x), float(y), float(w), float(h)])
            categories.append(name)
        if not without_mask(i):
            mask.save(root / f"img{i:02d}.seg.png")
        objects = {"objects": {"bbox": boxes, "category": categories}}
        (root / f"img{i:02d}.json").write_text(json.dumps(objects))
    return root


def _damage(output: Path, keys: tuple[str, ...]) -> None:
    """Zero the size in each record's JPEG header where it lies in its shard (the shard's size is
    unchanged, so only reading the record can tell): a corrupt image to every decoder."""
    dataset = open_shards(output, decode="bytes")
    for key in keys:
        image = dataset.get(key).image
        for shard in dataset.manifest.shards:
            data = bytearray((output / shard.name).read_bytes())
            at = data.find(image)
            if at >= 0:
                frame = at + image.index(b"\xff\xc0")
                data[frame + 5 : frame + 9] = bytes(4)
                (output / shard.name).write_bytes(bytes(data))
                break
        else:
            raise AssertionError(f"{key} not found whole in a shard")


@pytest.fixture(scope="module")
def coco(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The source packed in every format (short side 96, 7 records a shard), and a copy of each
    with CORRUPT's images damaged ("<format>-damaged")."""
    root = tmp_path_factory.mktemp("coco")
    source = _coco_source(root / "src")
    outputs = {}
    for format in FORMATS:
        outputs[format] = root / format
        pack(PackConfig(str(source), str(outputs[format]), format=format, sidecars=True, workers=1, shard_size=7,
                        resize=ResizeConfig(size=96)))  # fmt: skip
        damaged = root / f"{format}-damaged"
        shutil.copytree(outputs[format], damaged)
        _damage(damaged, CORRUPT)
        outputs[f"{format}-damaged"] = damaged
    return outputs


def _loader(folder: Path, batch_size: int = 4, dataset: dict[str, Any] | None = None, **options: Any) -> Any:
    opened = {"on_error": "skip", "shuffle": True, "seed": 5, "shuffle_buffer": 8, **(dataset or {})}
    return open_shards(folder, **opened).loader(batch_size, (40, 48), **{**SETTINGS, **options})


def _as_numpy(value: Any) -> Any:
    if value is None or isinstance(value, np.ndarray):
        return value
    return value.cpu().numpy()


def _same(a: list[Any], b: list[Any]) -> None:
    """The same batches: keys, pixels, labels, windows, flips, masks, boxes and their labels."""
    assert [x.keys for x in a] == [y.keys for y in b]
    for x, y in zip(a, b, strict=True):
        for name in ("images", "labels", "windows", "flips", "masks"):
            assert np.array_equal(_as_numpy(getattr(x, name)), _as_numpy(getattr(y, name))), (name, x.keys)
        for name in ("boxes", "box_index", "box_labels"):
            p, q = getattr(x, name), getattr(y, name)
            assert (p is None) == (q is None), name
            assert all(np.array_equal(_as_numpy(s), _as_numpy(t)) for s, t in zip(p or (), q or (), strict=True))


def _resumed(state: dict[str, Any], folder: Path, **options: Any) -> list[Any]:
    loader = _loader(folder, **options)
    loader.load_state_dict(json.loads(json.dumps(state)))
    return list(loader)


def _kept(missing_masks_fail: bool) -> set[str]:
    keys = {f"img{i:02d}" for i in range(COUNT) if not (missing_masks_fail and without_mask(i))}
    return keys - set(CORRUPT)


def _check_labels(batches: list[Any], output: Path) -> None:
    """Each batch's box labels are the ids of its surviving boxes' categories, from the sorted names."""
    stored = {s.key: s for s in open_shards(output, on_error="skip")}
    classes = open_shards(output).box_classes("objects.category")
    assert classes == sorted({name for i in range(COUNT) for name in _categories(i)})
    for batch in batches:
        for i, key in enumerate(batch.keys):
            names = stored[key].fields["objects"]["category"]
            ids = np.array([classes.index(name) for name in names], np.int64)
            labels, index = _as_numpy(batch.box_labels[i]), _as_numpy(batch.box_index[i])
            assert labels.dtype == np.int64 and np.array_equal(labels, ids[index]), key
            assert len(labels) == len(batch.boxes[i])


def _categories(i: int) -> list[str]:
    return [] if without_objects(i) else [NAMES[(i + 3 * j) % len(NAMES)] for j in range(1 + i % 3)]


# --- mask_missing= ------------------------------------------------------------------------------


@pytest.mark.parametrize("format", FORMATS)
def test_a_missing_mask_is_filled_and_the_others_are_unchanged(coco: dict[str, Path], format: str) -> None:
    filled = list(_loader(coco[format], mask_missing=255, box_labels=None))
    assert [len(b.keys) for b in filled] == [4] * 5
    assert sorted(k for b in filled for k in b.keys) == sorted(_kept(missing_masks_fail=False) | set(CORRUPT))
    plain = {key: (batch, i) for batch in _loader(coco[format], box_labels=None) for i, key in enumerate(batch.keys)}
    stored = {s.key: s for s in open_shards(coco[format])}
    for batch in filled:
        for i, key in enumerate(batch.keys):
            if without_mask(int(key[3:])):
                assert (batch.masks[i] == 255).all(), key
                assert key not in plain  # (without mask_missing=, a failure skipped)
                continue
            other, j = plain[key]  # the same window and flip, however the batches were made up
            assert np.array_equal(batch.windows[i], other.windows[j]) and batch.flips[i] == other.flips[j]
            assert np.array_equal(batch.masks[i], other.masks[j]), key
            expected = _expected_mask(stored[key].fields["seg.png"], batch.windows[i], bool(batch.flips[i]), (40, 48))
            assert np.mean(batch.masks[i] == expected) >= 0.97 and batch.masks[i].max() <= 182, key
    assert any(batch.masks.max() > 100 for batch in filled)  # (COCO's ids past 100 survive)


@pytest.mark.skipif(not torch_installed, reason="the device path needs torch")
def test_a_missing_mask_is_filled_on_the_device_path(coco: dict[str, Path]) -> None:
    cpu = list(_loader(coco["lmdb"], mask_missing=0, output="torch"))
    device = list(_loader(coco["lmdb"], mask_missing=0, output="torch", device="cpu"))
    assert [b.keys for b in cpu] == [b.keys for b in device]
    for a, b in zip(cpu, device, strict=True):
        assert np.array_equal(_as_numpy(a.masks), _as_numpy(b.masks))
        assert all(np.array_equal(_as_numpy(p), _as_numpy(q)) for p, q in zip(a.box_labels, b.box_labels, strict=True))
    missing = [(b, i) for b in device for i, k in enumerate(b.keys) if without_mask(int(k[3:]))]
    assert missing and all((b.masks[i] == 0).all() for b, i in missing)


def test_a_missing_mask_names_the_ways_out(coco: dict[str, Path]) -> None:
    with pytest.raises(ShardReadError, match=r"record img01: .*no field 'seg\.png'.*mask_missing=.*select=") as raised:
        list(_loader(coco["webdataset"], dataset={"on_error": "raise", "shuffle": False}))
    assert "\n" not in str(raised.value)

    def with_masks(index: Any) -> list[bool]:  # the way out the message names, as a user writes it
        return [fields is not None and "seg.png" in fields for fields in index.column("fields").to_pylist()]

    batches = list(_loader(coco["webdataset"], dataset={"on_error": "raise", "select": with_masks}))
    assert sorted(k for b in batches for k in b.keys) == sorted(_kept(missing_masks_fail=True) | set(CORRUPT))


@pytest.mark.parametrize("value", [256, -1, True, 1.5, "255", [255]])
def test_mask_missing_is_a_label_from_0_to_255(coco: dict[str, Path], value: Any) -> None:
    with pytest.raises(ConfigError, match="mask_missing must be a label from 0 to 255") as raised:
        open_shards(coco["webdataset"]).loader(4, 32, mask="seg.png", mask_missing=value)
    assert "\n" not in str(raised.value)


def test_mask_missing_needs_a_mask(coco: dict[str, Path]) -> None:
    with pytest.raises(ConfigError, match="give mask= too"):
        open_shards(coco["webdataset"]).loader(4, 32, mask_missing=255)
    loader = open_shards(coco["webdataset"]).loader(4, 32, mask="seg.png", mask_missing=np.uint8(7))
    assert loader.mask_missing == 7


# --- full batches under on_error="skip", resumed at every boundary ----------------------------


@pytest.mark.parametrize("format", FORMATS)
def test_skipped_records_are_replaced_and_every_boundary_resumes_exactly(coco: dict[str, Path], format: str) -> None:
    output = coco[f"{format}-damaged"]
    dataset = open_shards(output, on_error="skip", shuffle=True, seed=5, shuffle_buffer=8)
    loader = dataset.loader(4, (40, 48), workers=2, **SETTINGS)
    whole = list(loader)
    kept = _kept(missing_masks_fail=True)
    assert [len(b.keys) for b in whole] == [4, 4, 4, 1] and len(loader) == 5  # (len: an upper bound)
    assert sorted(k for b in whole for k in b.keys) == sorted(kept)
    assert dataset.skipped == COUNT - len(kept)
    _check_labels(whole, output)
    carried = 0
    for k in range(len(whole) + 1):
        first = _loader(output, workers=2)
        seen = [batch for _, batch in zip(range(k), first, strict=False)]
        state = first.state_dict()
        carried += bool(state["splits"]) and "carry" in state["splits"][-1]
        _same(seen + _resumed(state, output, workers=0), whole)
    assert carried  # (some boundary fell inside a chunk)


@pytest.mark.skipif(not torch_installed, reason="the device path needs torch")
def test_the_device_path_fills_and_resumes_the_same(coco: dict[str, Path]) -> None:
    output = coco["hdf5-damaged"]
    cpu = list(_loader(output, output="torch"))
    whole = list(_loader(output, output="torch", device="cpu", workers=2))
    assert [b.keys for b in whole] == [b.keys for b in cpu] and [len(b.keys) for b in whole] == [4, 4, 4, 1]
    for a, b in zip(cpu, whole, strict=True):
        assert np.array_equal(_as_numpy(a.windows), _as_numpy(b.windows))
        assert np.array_equal(_as_numpy(a.masks), _as_numpy(b.masks))
    for k in range(1, len(whole)):
        first = _loader(output, output="torch", device="cpu")
        seen = [batch for _, batch in zip(range(k), first, strict=False)]
        _same(seen + _resumed(first.state_dict(), output, output="torch", device="cpu"), whole)


def test_drop_last_keeps_only_full_batches(coco: dict[str, Path]) -> None:
    output = coco["webdataset-damaged"]
    batches = list(_loader(output, drop_last=True))
    assert [len(b.keys) for b in batches] == [4, 4, 4]
    assert [b.keys for b in batches] == [b.keys for b in _loader(output)][:3]


def test_torch_batches_are_joined_in_channels_last_memory(coco: dict[str, Path]) -> None:
    torch = pytest.importorskip("torch")
    batches = list(_loader(coco["lmdb-damaged"], output="torch"))
    numpy = list(_loader(coco["lmdb-damaged"]))
    for a, b in zip(batches, numpy, strict=True):
        assert a.images.is_contiguous(memory_format=torch.channels_last)
        assert np.array_equal(a.images.numpy(), b.images) and a.labels.dtype == torch.int64
        assert type(a.masks).__name__ == ("Mask" if importlib.util.find_spec("torchvision") else "Tensor")


def test_a_state_on_one_rank_resumes_on_two(coco: dict[str, Path]) -> None:
    output = coco["webdataset-damaged"]
    whole = list(_loader(output))
    for k in range(1, len(whole)):
        first = _loader(output)
        seen = [batch for _, batch in zip(range(k), first, strict=False)]
        state = json.loads(json.dumps(first.state_dict()))
        rest = [key for rank in (0, 1) for b in _resumed(state, output, dataset={"rank": rank, "world_size": 2})
                for key in b.keys]  # fmt: skip
        expected = [key for b in whole[k:] for key in b.keys]
        assert set(rest) == set(expected) and len(rest) - len(expected) <= 1  # (an uneven split: one repeat)
        assert not set(rest) & {key for b in seen for key in b.keys}
    two = _loader(output, dataset={"rank": 1, "world_size": 2})
    state = _carried_state(output)
    two.load_state_dict(state)
    next(iter(two))
    again = json.loads(json.dumps(two.state_dict()))  # (the carry counted as used by the new split)
    assert "carry" not in again["splits"][0] and again["splits"][1]["rank"] == 1
    _loader(output, dataset={"rank": 1, "world_size": 2}).load_state_dict(again)


def test_each_rank_that_skips_resumes_from_its_own_state(coco: dict[str, Path]) -> None:
    output = coco["lmdb-damaged"]
    ranks = [{"rank": rank, "world_size": 2} for rank in (0, 1)]
    wholes = [list(_loader(output, dataset=rank)) for rank in ranks]
    assert all(len(b.keys) == 4 for whole in wholes for b in whole[:-1])
    assert sorted(k for whole in wholes for b in whole for k in b.keys) == sorted(_kept(missing_masks_fail=True))
    states = []
    for rank, whole in zip(ranks, wholes, strict=True):
        _check_labels(whole, output)
        for k in range(len(whole) + 1):
            first = _loader(output, dataset=rank)
            seen = [batch for _, batch in zip(range(k), first, strict=False)]
            state = first.state_dict()
            _same(seen + _resumed(state, output, dataset=rank), whole)
        states.append(state)
    assert [state["splits"][-1]["rank"] for state in states] == [0, 1]
    with pytest.raises(ConfigError, match="this state is rank 0's, loaded on rank 1"):
        _loader(output, dataset=ranks[1]).load_state_dict(states[0])
    with pytest.raises(ConfigError, match="it resumes on 2 ranks, each from the state it saved"):
        _loader(output).load_state_dict(states[0])


def test_a_carry_is_format_2_and_iteration_takes_its_positions_as_used(coco: dict[str, Path]) -> None:
    loader = _loader(coco["webdataset"], mask_missing=255)
    next(iter(loader))
    state = loader.state_dict()
    assert state["format"] == "shardkit.progress/1" and "carry" not in state["splits"][-1]
    output = coco["webdataset-damaged"]
    damaged = _loader(output)
    batches = iter(damaged)
    seen = []
    while "carry" not in (damaged.state_dict()["splits"] or [{}])[-1]:
        seen += next(batches).keys
    batches.close()
    state = damaged.state_dict()
    assert state["format"] == "shardkit.progress/2"
    # iteration takes a carry's positions as used: it goes on after the records batches took
    iterable = open_shards(output, on_error="skip", shuffle=True, seed=5, shuffle_buffer=8).iterable()
    iterable.load_state_dict(state)
    rest = [sample.key for sample in iterable]
    resumed = [key for b in _resumed(state, output) for key in b.keys]
    assert not set(seen) & set(rest) and set(resumed) <= set(rest)
    assert len(seen + rest) == len(set(seen + rest))
    lost = _kept(missing_masks_fail=False) - set(seen + rest)  # only what the loader had skipped
    assert lost and all(without_mask(int(key[3:])) for key in lost)


def _carried_state(output: Path) -> dict[str, Any]:
    loader = _loader(output)
    batches = iter(loader)
    while "carry" not in (loader.state_dict()["splits"] or [{}])[-1]:
        next(batches)
    state: dict[str, Any] = json.loads(json.dumps(loader.state_dict()))
    return state


def test_a_hostile_carry_is_refused_in_one_line(coco: dict[str, Path]) -> None:
    output = coco["hdf5-damaged"]
    state = _carried_state(output)
    taken, through = state["splits"][-1]["carry"]["taken"], state["splits"][-1]["carry"]["through"]
    cases: list[tuple[Any, str]] = [
        ({"taken": through + 1, "through": through}, "carry taken must be a whole number from 1"),
        ({"taken": 0, "through": through}, "carry taken must be a whole number from 1"),
        ({"taken": -1, "through": through}, "carry taken"),
        ({"taken": taken, "through": 4}, "resume it with the batch size it was saved with"),
        ({"taken": taken, "through": 10**30}, "carry through must be"),
        ({"taken": taken}, "carry must be an object of taken and through"),
        ("3", "carry must be an object"),
        ({"taken": True, "through": through}, "carry taken"),
    ]
    for carry, words in cases:
        hostile = json.loads(json.dumps(state))
        hostile["splits"][-1]["carry"] = carry
        with pytest.raises(ConfigError, match=words) as raised:
            _loader(output).load_state_dict(hostile)
        assert "\n" not in str(raised.value)
    # a count in range that names other records than were handed out: refused as the chunk is decoded
    hostile = json.loads(json.dumps(state))
    hostile["splits"][-1]["carry"] = {"taken": taken, "through": through - 1} if through > taken else {
        "taken": taken - 1, "through": through}  # fmt: skip
    if hostile["splits"][-1]["carry"]["taken"] >= 1:
        loader = _loader(output)
        loader.load_state_dict(hostile)
        with pytest.raises(ConfigError, match="this state's carry says"):
            list(loader)
    for name, value, words in (("rank", 1, "rank must be a whole number from 0 to 0"), ("rank", "0", "rank must be"),
                               ("workers", 2, "a split of 2 workers has 1 done counts")):  # fmt: skip
        hostile = json.loads(json.dumps(state))
        hostile["splits"][-1][name] = value
        with pytest.raises(ConfigError, match=words):
            _loader(output).load_state_dict(hostile)
    two = json.loads(json.dumps(state))
    two["splits"][-1].update(workers=2, done=[0, 0])
    with pytest.raises(ConfigError, match="a carry belongs to the batch loader's split"):
        _loader(output).load_state_dict(two)
    past = json.loads(json.dumps(state))
    past["splits"][-1]["done"] = [COUNT]
    with pytest.raises(ConfigError, match="this state's done counts"):
        _loader(output).load_state_dict(past)


@pytest.mark.skipif(importlib.util.find_spec("av") is None, reason="clips need PyAV")
def test_clips_are_refilled_and_resume_the_same(tmp_path: Path) -> None:
    from shardkit.formats.base import Record

    from .video_clips import clip_meta, clip_record, write_output

    records = [clip_record(f"c{i}", i, frames=5, seed=i) for i in range(7)]
    records[1] = Record("c1", b"\x00" * 64, "mp4", 1, clip_meta(5, 64, 48))  # not an MP4
    folder = write_output(tmp_path / "clips", "webdataset", [records])
    dataset = open_shards(folder, on_error="skip")
    whole = list(dataset.loader(2, 16, frames=3, output="numpy", crop="random"))
    assert [b.keys for b in whole] == [["c0", "c2"], ["c3", "c4"], ["c5", "c6"]] and dataset.skipped == 1
    for k in range(len(whole) + 1):
        first = open_shards(folder, on_error="skip").loader(2, 16, frames=3, output="numpy", crop="random")
        seen = [batch for _, batch in zip(range(k), first, strict=False)]
        again = open_shards(folder, on_error="skip").loader(2, 16, frames=3, output="numpy", crop="random")
        again.load_state_dict(first.state_dict())
        rest = list(again)
        assert [b.keys for b in seen + rest] == [b.keys for b in whole]
        for a, b in zip(seen + rest, whole, strict=True):
            assert np.array_equal(a.images, b.images) and np.array_equal(a.offsets, b.offsets)


def test_a_loader_left_mid_epoch_leaves_no_thread(coco: dict[str, Path]) -> None:
    loader = _loader(coco["webdataset-damaged"], workers=3)
    batches = iter(loader)
    next(batches)
    next(batches)
    batches.close()  # (the autouse fixture checks that no loader thread is left)


# --- box_labels= --------------------------------------------------------------------------------


@pytest.mark.parametrize("format", FORMATS)
def test_text_categories_become_ids_of_the_boxes_kept(coco: dict[str, Path], format: str) -> None:
    loader = _loader(coco[format], mask_missing=255)
    batches = list(loader)
    assert loader.box_classes == sorted({name for i in range(COUNT) for name in _categories(i)})
    _check_labels(batches, coco[format])
    empty = [b.box_labels[i] for b in batches for i, key in enumerate(b.keys) if without_objects(int(key[3:]))]
    assert empty and all(labels.shape == (0,) and labels.dtype == np.int64 for labels in empty)


def test_box_classes_are_the_same_on_every_rank_and_subset(coco: dict[str, Path]) -> None:
    output = coco["hdf5"]
    loaders = [_loader(output, dataset={"rank": rank, "world_size": 2}, mask_missing=255) for rank in (0, 1)]
    assert loaders[0].box_classes == loaders[1].box_classes == open_shards(output).box_classes("objects.category")
    for loader in loaders:
        _check_labels(list(loader), output)
    few = open_shards(output, select=["img00", "img02"])
    assert few.box_classes("objects.category") == loaders[0].box_classes  # (from the whole index)
    mix = open_shards([coco["hdf5"], coco["lmdb"]])
    assert mix.box_classes("objects.category") == loaders[0].box_classes


@pytest.mark.skipif(not torch_installed, reason="torch output")
def test_box_labels_are_int64_tensors_aligned_with_the_boxes(coco: dict[str, Path]) -> None:
    torch = pytest.importorskip("torch")
    for device in (None, "cpu"):
        batch = next(iter(_loader(coco["lmdb"], output="torch", device=device, mask_missing=255)))
        assert all(isinstance(t, torch.Tensor) and t.dtype == torch.int64 for t in batch.box_labels)
        assert [len(t) for t in batch.box_labels] == [len(b) for b in batch.boxes]


def _small_source(root: Path, objects: list[dict[str, Any]]) -> Path:
    root.mkdir(parents=True)
    for i, found in enumerate(objects):
        write_image(root / f"img{i:02d}.jpg", 160, 120, seed=i)
        (root / f"img{i:02d}.json").write_text(json.dumps({"objects": found}))
    return root


BOX = [10.0, 10.0, 60.0, 50.0]


def test_a_records_bad_box_labels_follow_on_error(tmp_path: Path) -> None:
    source = _small_source(tmp_path / "src", [
        {"bbox": [BOX], "category": ["dog"]},
        {"bbox": [BOX, BOX]},  # no categories
        {"bbox": [BOX, BOX], "category": ["dog"]},  # fewer than its boxes
        {"bbox": [BOX], "category": [{"name": "dog"}]},  # not a category
        {"bbox": [BOX], "category": "dog"},  # not a list
        {"bbox": [BOX], "category": ["cat"]},
    ])  # fmt: skip
    pack(PackConfig(str(source), str(tmp_path / "out"), sidecars=True, workers=1))
    options = {"output": "numpy", "boxes": "objects.bbox", "box_labels": "objects.category", "crop": None}
    for key, words in (("img01", r"box_labels: no column 'objects\.category'"),
                       ("img02", "box_labels: column 'objects.category' holds 1 labels for 2 boxes"),
                       ("img03", r"holds \{'name': 'dog'\}: its categories are text"),
                       ("img04", "is 'dog', not a list of categories")):  # fmt: skip
        dataset = open_shards(tmp_path / "out", select=["img00", key])
        with pytest.raises(ShardReadError, match=rf"record {key}: cannot decode \(.*{words}") as raised:
            list(dataset.loader(2, 32, **options))
        assert "\n" not in str(raised.value)
    dataset = open_shards(tmp_path / "out", on_error="skip")
    loader = dataset.loader(2, 32, **options)
    batches = list(loader)
    assert [b.keys for b in batches] == [["img00", "img05"]] and dataset.skipped == 4
    assert loader.box_classes == ["cat", "dog"] and [b.tolist() for b in batches[0].box_labels] == [[1], [0]]


def test_whole_number_categories_pass_through(tmp_path: Path) -> None:
    source = _small_source(tmp_path / "src", [{"bbox": [BOX, BOX], "category": [18, 1]}, {"bbox": [], "category": []},
                                              {"bbox": [BOX], "category": [182]}])  # fmt: skip
    pack(PackConfig(str(source), str(tmp_path / "out"), sidecars=True, workers=1))
    loader = open_shards(tmp_path / "out").loader(3, 32, output="numpy", crop=None, boxes="objects.bbox",
                                                  box_labels="objects.category")  # fmt: skip
    (batch,) = loader
    assert loader.box_classes == [1, 18, 182]
    assert [b.tolist() for b in batch.box_labels] == [[18, 1], [], [182]]


def test_box_labels_are_checked_up_front(tmp_path: Path, coco: dict[str, Path]) -> None:
    dataset = open_shards(coco["webdataset"])
    cases: list[tuple[dict[str, Any], str]] = [
        ({"box_labels": "objects"}, r"box_labels: 'objects' is \{.*in every record: not a list of categories"),
        ({"box_labels": "objects.categroy"}, "box_labels: no record of .* has a column 'objects.categroy'"),
        ({"box_labels": 3}, "box_labels must be a field name"),
        ({"box_labels": ""}, "box_labels must be a field name"),
        ({"box_labels": "objects.category", "boxes": None}, "box_labels= labels the boxes of boxes="),
    ]
    for options, words in cases:
        with pytest.raises(ConfigError, match=words) as raised:
            dataset.loader(4, 32, **{"boxes": "objects.bbox", **options})
        assert "\n" not in str(raised.value)
    with pytest.raises(ConfigError, match="box_labels must be a column name"):
        dataset.box_classes(None)  # type: ignore[arg-type]
    source = _small_source(tmp_path / "src", [{"bbox": [BOX], "category": ["dog"]}, {"bbox": [BOX], "category": [3]}])
    pack(PackConfig(str(source), str(tmp_path / "out"), sidecars=True, workers=1))
    with pytest.raises(ConfigError, match=r"holds both text \('dog'\) and numbers \(3\)"):
        open_shards(tmp_path / "out").loader(2, 32, boxes="objects.bbox", box_labels="objects.category")


# --- DataLoader(ds, batch_size>1) on images of different sizes -------------------------------------


@pytest.mark.skipif(not torch_installed, reason="torch's DataLoader")
def test_dataloader_on_images_of_different_sizes_says_what_batches_them(coco: dict[str, Path]) -> None:
    from torch.utils.data import DataLoader

    dataset = open_shards(coco["webdataset"])
    with pytest.raises(ConfigError, match=r"DataLoader\(batch_size=4\) stacks .* ds\.loader\(.*transform=") as raised:
        next(iter(DataLoader(dataset, batch_size=4)))
    assert "\n" not in str(raised.value) and "x" in str(raised.value)
    same = open_shards(coco["webdataset"], select=["img04", "img09"])  # two 224x224 sources: 96x96 stored
    batch = next(iter(DataLoader(same, batch_size=2)))
    assert tuple(batch.image.shape) == (2, 96, 96, 3)
