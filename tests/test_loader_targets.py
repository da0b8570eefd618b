"""The batch loader's detection and segmentation targets: masks (a sidecar field) and boxes (a
column) through the same windows and flips as the images, checked against an independent
computation from the packed records, in every format; the windows and flips every batch carries."""

from __future__ import annotations

import importlib.util
import io
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image, ImageDraw, ImageOps

from shardkit import PackConfig, ResizeConfig, pack
from shardkit.core.errors import ConfigError, ImageError, ShardReadError
from shardkit.readers import open_shards
from shardkit.readers.targets import decode_mask
from shardkit.synthetic import write_image
from tests.conftest import IMAGENET_SAMPLE

FORMATS = ("webdataset", "lmdb", "hdf5")
IMAGES = 10
SYNTHETIC_SIZES = ((320, 240), (200, 300), (257, 181), (400, 150), (180, 180))


def _targets(width: int, height: int, seed: int) -> tuple[Image.Image, list[list[float]], list[int]]:
    """A label map (rectangles and an ellipse of classes 1..3 on 0) and COCO xywh boxes: the drawn
    rectangles, one box partly outside the image and one with no area."""
    rng = np.random.default_rng(seed)
    mask = Image.new("L", (width, height), 0)
    draw = ImageDraw.Draw(mask)
    boxes: list[list[float]] = []
    categories: list[int] = []
    for label in (1, 2, 3):
        w, h = int(rng.integers(width // 6, width // 2)), int(rng.integers(height // 6, height // 2))
        x, y = int(rng.integers(0, width - w)), int(rng.integers(0, height - h))
        if label == 3:
            draw.ellipse((x, y, x + w - 1, y + h - 1), fill=label)
        else:
            draw.rectangle((x, y, x + w - 1, y + h - 1), fill=label)
        boxes.append([x + 0.5 * (label == 2), y, w, h])
        categories.append(label)
    boxes += [[width - 10.0, height - 10.0, 40.0, 40.0], [5.0, 5.0, 0.0, 7.0]]
    categories += [4, 5]
    return mask, boxes, categories


def _source(root: Path, count: int = IMAGES, prefix: str = "img") -> Path:
    """Sidecar samples: x.jpg (ImageNet photos when ../shared is here, else generated), x.seg.png
    and x.json whose `objects` holds bbox and category, as Hugging Face's detection sets do."""
    root.mkdir(parents=True)
    photos = sorted(IMAGENET_SAMPLE.glob("*.JPEG"))[:count] if IMAGENET_SAMPLE.is_dir() else []
    for i in range(count):
        image = root / f"{prefix}{i:02d}.jpg"
        if len(photos) == count:
            shutil.copyfile(photos[i], image)
        else:
            write_image(image, *SYNTHETIC_SIZES[i % len(SYNTHETIC_SIZES)], seed=i)
        with Image.open(image) as opened:
            width, height = ImageOps.exif_transpose(opened).size
        mask, boxes, categories = _targets(width, height, i)
        mask.save(root / f"{prefix}{i:02d}.seg.png")
        (root / f"{prefix}{i:02d}.json").write_text(json.dumps({"objects": {"bbox": boxes, "category": categories}}))
    return root


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The source packed in every format with the short side resized to 96 (stored != original)."""
    root = tmp_path_factory.mktemp("targets")
    source = _source(root / "src")
    outputs = {}
    for format in FORMATS:
        outputs[format] = root / format
        pack(PackConfig(str(source), str(outputs[format]), format=format, sidecars=True, workers=1,
                        resize=ResizeConfig(size=96)))  # fmt: skip
    return outputs


def _stored(output: Path) -> dict[str, Any]:
    """Each record's sample as stored (its mask decoded, its meta), by key."""
    return {sample.key: sample for sample in open_shards(output)}


def _expected_mask(stored: np.ndarray, window: np.ndarray, flip: bool, size: tuple[int, int]) -> np.ndarray:
    out = np.asarray(
        Image.fromarray(stored).resize((size[1], size[0]), Image.Resampling.NEAREST, box=tuple(window.tolist()))
    )
    return out[:, ::-1] if flip else out


def _expected_boxes(
    boxes: list[list[float]], meta: dict[str, Any], window: np.ndarray, flip: bool, size: tuple[int, int],
    center_crop: bool = False,
) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    height, width = size
    original_w, original_h = meta["width"], meta["height"]
    left = top = 0
    if center_crop:
        short = min(original_w, original_h)
        left, top, original_w, original_h = (meta["width"] - short) // 2, (meta["height"] - short) // 2, short, short
    sx, sy = meta["stored_width"] / original_w, meta["stored_height"] / original_h
    x0, y0, x1, y1 = window.tolist()
    found, index = [], []
    for k, (x, y, w, h) in enumerate(boxes):
        a = ((x - left) * sx - x0) * width / (x1 - x0)
        b = ((x + w - left) * sx - x0) * width / (x1 - x0)
        c = ((y - top) * sy - y0) * height / (y1 - y0)
        d = ((y + h - top) * sy - y0) * height / (y1 - y0)
        if flip:
            a, b = width - b, width - a
        a, b = min(max(a, 0), width), min(max(b, 0), width)
        c, d = min(max(c, 0), height), min(max(d, 0), height)
        if b - a > 1e-3 and d - c > 1e-3:
            found.append([a, c, b, d])
            index.append(k)
    return np.array(found, np.float64).reshape(-1, 4), np.array(index, np.int64)


def _batches(folder: Path, **options: Any) -> list[Any]:
    on_error = options.pop("on_error", "raise")
    settings = {"crop": "random", "flip": True, "output": "numpy", "mask": "seg.png", "boxes": "objects.bbox"}
    return list(open_shards(folder, on_error=on_error, seed=3).loader(4, (48, 64), **{**settings, **options}))


def _check_batches(
    batches: list[Any], stored: dict[str, Any], size: tuple[int, int], center_crop: bool | set[str] = False
) -> None:
    """Every batch's masks and boxes against the independent computation; `center_crop`: whether the
    output was packed with a center crop (a set: the keys that were, for a mix)."""
    seen = 0
    for batch in batches:
        assert batch.windows.shape == (len(batch.keys), 4) and batch.flips.dtype == bool
        assert batch.masks.shape == (len(batch.keys), *size) and batch.masks.dtype == np.uint8
        for i, key in enumerate(batch.keys):
            sample, window, flip = stored[key], batch.windows[i], bool(batch.flips[i])
            mask = sample.fields["seg.png"]
            assert mask.shape == (sample.meta["stored_height"], sample.meta["stored_width"])
            assert (
                0 <= window[0] < window[2] <= mask.shape[1] + 1e-6
                and 0 <= window[1] < window[3] <= mask.shape[0] + 1e-6
            )
            expected = _expected_mask(mask, window, flip, size)
            assert np.mean(batch.masks[i] == expected) >= 0.99, key
            assert set(np.unique(batch.masks[i]).tolist()) <= set(np.unique(mask).tolist())
            crop = key in center_crop if isinstance(center_crop, set) else center_crop
            boxes, index = _expected_boxes(sample.fields["objects"]["bbox"], sample.meta, window, flip, size, crop)
            assert batch.boxes[i].dtype == np.float32 and batch.box_index[i].dtype == np.int64
            assert np.array_equal(batch.box_index[i], index), key
            assert np.allclose(batch.boxes[i], boxes, atol=1.0), key
            seen += 1
    assert seen == (IMAGES if isinstance(center_crop, bool) else sum(len(batch.keys) for batch in batches))


@pytest.mark.parametrize("format", FORMATS)
def test_masks_and_boxes_follow_the_windows_and_flips(packed: dict[str, Path], format: str) -> None:
    batches = _batches(packed[format])
    _check_batches(batches, _stored(packed[format]), (48, 64))
    assert any(batch.flips.any() for batch in batches) and any((~batch.flips).any() for batch in batches)


def test_a_center_crop_loader_and_whole_images(packed: dict[str, Path]) -> None:
    stored = _stored(packed["lmdb"])
    _check_batches(_batches(packed["lmdb"], crop="center", resize=80, flip=False), stored, (48, 64))
    _check_batches(_batches(packed["lmdb"], crop=None), stored, (48, 64))


def test_windows_and_flips_come_without_targets(packed: dict[str, Path]) -> None:
    plain = _batches(packed["webdataset"], mask=None, boxes=None)
    full = _batches(packed["webdataset"])
    for a, b in zip(plain, full, strict=True):
        assert np.array_equal(a.windows, b.windows) and np.array_equal(a.flips, b.flips)
        assert np.array_equal(a.images, b.images)
        assert a.masks is None and a.boxes is None and a.box_index is None


def _same(a: list[Any], b: list[Any]) -> None:
    assert [x.keys for x in a] == [y.keys for y in b]
    for x, y in zip(a, b, strict=True):
        assert np.array_equal(x.windows, y.windows) and np.array_equal(x.flips, y.flips)
        assert np.array_equal(x.masks, y.masks)
        assert all(np.array_equal(p, q) for p, q in zip(x.boxes, y.boxes, strict=True))
        assert all(np.array_equal(p, q) for p, q in zip(x.box_index, y.box_index, strict=True))


def test_targets_do_not_depend_on_threads_and_resume_exactly(packed: dict[str, Path]) -> None:
    output = packed["hdf5"]
    one, two = _batches(output, workers=1), _batches(output, workers=2)
    _same(one, two)
    settings = {"crop": "random", "flip": True, "output": "numpy", "mask": "seg.png", "boxes": "objects.bbox"}
    loader = open_shards(output, seed=3).loader(4, (48, 64), workers=2, **settings)
    first = next(iter(loader))
    state = loader.state_dict()
    resumed = open_shards(output, seed=3).loader(4, (48, 64), workers=1, **settings)
    resumed.load_state_dict(json.loads(json.dumps(state)))
    _same([first, *resumed], one)


def test_xyxy_boxes_and_a_flat_column(tmp_path: Path) -> None:
    source = _source(tmp_path / "src", count=2)
    for path in source.glob("*.json"):
        objects = json.loads(path.read_text())["objects"]
        xyxy = [[x, y, x + w, y + h] for x, y, w, h in objects["bbox"]]
        path.write_text(json.dumps({"objects": objects, "objects.bbox": xyxy}))  # a literal dotted name wins
    pack(PackConfig(str(source), str(tmp_path / "out"), sidecars=True, workers=1, resize=ResizeConfig(size=80)))
    a = _batches(tmp_path / "out", boxes="objects.bbox", box_format="xyxy", mask=None)
    stored = _stored(tmp_path / "out")
    for batch in a:
        for i, key in enumerate(batch.keys):
            boxes, index = _expected_boxes(
                stored[key].fields["objects"]["bbox"],
                stored[key].meta,
                batch.windows[i],
                bool(batch.flips[i]),
                (48, 64),
            )
            assert np.array_equal(batch.box_index[i], index) and np.allclose(batch.boxes[i], boxes, atol=1.0)


def test_a_center_crop_pack_maps_boxes_through_its_crop(tmp_path: Path) -> None:
    source = _source(tmp_path / "src", count=IMAGES)
    pack(PackConfig(str(source), str(tmp_path / "out"), sidecars=True, workers=1,
                    resize=ResizeConfig(size=64, mode="center-crop")))  # fmt: skip
    stored = _stored(tmp_path / "out")
    # (the crop matters for the oblong ones; a square one, which the generated set has, keeps all)
    assert sum(s.meta["width"] != s.meta["height"] for s in stored.values()) >= IMAGES // 2
    _check_batches(_batches(tmp_path / "out"), stored, (48, 64), center_crop=True)


def _bad_source(root: Path) -> Path:
    """Unresized samples (so pack keeps fields as they are): one with a mask of the wrong size, one
    without a mask, one without boxes, and a good one."""
    source = _source(root, count=4)
    Image.new("L", (7, 5), 1).save(source / "img01.seg.png")
    (source / "img02.seg.png").unlink()
    (source / "img03.json").write_text(json.dumps({"other": 1}))
    return source


def test_bad_targets_follow_on_error(tmp_path: Path) -> None:
    source = _bad_source(tmp_path / "src")
    pack(PackConfig(str(source), str(tmp_path / "out"), sidecars=True, workers=1))
    with pytest.raises(ShardReadError, match=r"record img01: .*seg\.png is 7x5, its image \d+x\d+"):
        _batches(tmp_path / "out", boxes=None)
    kept = [key for batch in _batches(tmp_path / "out", boxes=None, on_error="skip") for key in batch.keys]
    assert kept == ["img00", "img03"]
    kept = [key for batch in _batches(tmp_path / "out", mask=None, on_error="skip") for key in batch.keys]
    assert kept == ["img00", "img01", "img02"]
    if importlib.util.find_spec("torch") is not None:  # the device path drops the same records
        batches = _batches(tmp_path / "out", on_error="skip", output="torch", device="cpu")
        assert [key for batch in batches for key in batch.keys] == ["img00"]
        assert batches[0].masks.shape == (1, 48, 64) and len(batches[0].boxes) == 1
    with pytest.raises(ShardReadError, match=r"record img03: .*no column 'objects\.bbox'"):
        _batches(tmp_path / "out", mask=None)
    with pytest.raises(ShardReadError, match=r"record img00: .*column 'objects' is not a list"):
        _batches(tmp_path / "out", mask=None, boxes="objects")
    lacking = _source(tmp_path / "lacking", count=1)
    (lacking / "img00.seg.png").unlink()
    pack(PackConfig(str(lacking), str(tmp_path / "lacking-out"), sidecars=True, workers=1))
    with pytest.raises(ShardReadError, match=r"record img00: .*no field 'seg\.png'"):
        _batches(tmp_path / "lacking-out", boxes=None)


def test_options_are_checked(packed: dict[str, Path]) -> None:
    dataset = open_shards(packed["webdataset"])
    with pytest.raises(ConfigError, match="box_format"):
        dataset.loader(4, 32, output="numpy", boxes="objects.bbox", box_format="cxcywh")
    with pytest.raises(ConfigError, match="mask must be"):
        dataset.loader(4, 32, output="numpy", mask=3)


def test_a_transform_warns_that_the_loader_ignores_it(packed: dict[str, Path]) -> None:
    with pytest.warns(UserWarning, match="transform= applies to ds"):
        open_shards(packed["webdataset"], transform=lambda sample: sample).loader(4, 32, output="numpy")


def test_torch_output_is_torchvision_typed(packed: dict[str, Path]) -> None:
    torch = pytest.importorskip("torch")
    tv_tensors = pytest.importorskip("torchvision.tv_tensors")
    from torchvision.transforms import v2

    batch = next(iter(open_shards(packed["lmdb"]).loader(4, 32, mask="seg.png", boxes="objects.bbox")))
    assert isinstance(batch.masks, tv_tensors.Mask) and batch.masks.dtype == torch.uint8
    assert isinstance(batch.boxes[0], tv_tensors.BoundingBoxes) and batch.boxes[0].canvas_size == (32, 32)
    assert batch.box_index[0].dtype == torch.int64
    # (indexing a Mask gives a plain tensor, as any tv_tensor's does: typed again per image)
    _, boxes, mask = v2.RandomHorizontalFlip(p=1.0)(batch.images[0], batch.boxes[0], tv_tensors.Mask(batch.masks[0]))
    assert torch.equal(mask, batch.masks[0].flip(-1))
    assert torch.allclose(boxes[:, 0], 32 - batch.boxes[0][:, 2])


def test_the_device_path_gives_the_same_targets(packed: dict[str, Path]) -> None:
    torch = pytest.importorskip("torch")
    settings = {"crop": "random", "flip": True, "mask": "seg.png", "boxes": "objects.bbox", "workers": 2}
    host = list(open_shards(packed["webdataset"], seed=3).loader(4, (48, 64), **settings))
    device = list(open_shards(packed["webdataset"], seed=3).loader(4, (48, 64), device="cpu", **settings))
    assert [b.keys for b in host] == [b.keys for b in device]
    for a, b in zip(host, device, strict=True):
        assert np.array_equal(a.windows, b.windows) and np.array_equal(a.flips, b.flips)
        assert torch.equal(a.masks, b.masks) and b.masks.shape == (len(b.keys), 48, 64)
        assert all(torch.equal(p, q) for p, q in zip(a.boxes, b.boxes, strict=True))
        assert all(torch.equal(p, q) for p, q in zip(a.box_index, b.box_index, strict=True))


def test_a_mix_maps_each_sources_boxes_by_its_own_manifest(packed: dict[str, Path], tmp_path: Path) -> None:
    source = _source(tmp_path / "src", count=4, prefix="sq")
    pack(PackConfig(str(source), str(tmp_path / "out"), sidecars=True, workers=1,
                    resize=ResizeConfig(size=64, mode="center-crop")))  # fmt: skip
    stored = {**_stored(packed["lmdb"]), **_stored(tmp_path / "out")}
    mix = open_shards([packed["lmdb"], tmp_path / "out"], exhausted="stop", seed=3)
    settings = {"flip": True, "output": "numpy", "mask": "seg.png", "boxes": "objects.bbox"}
    batches = list(mix.loader(4, (48, 64), **settings))
    keys = {key for batch in batches for key in batch.keys}
    assert any(key.startswith("sq") for key in keys) and any(key.startswith("img") for key in keys)
    _check_batches(batches, stored, (48, 64), center_crop={key for key in keys if key.startswith("sq")})


def _png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


def test_a_mask_is_its_labels_never_converted_colours() -> None:
    labels = np.arange(12, dtype=np.uint8).reshape(3, 4)
    palette = Image.fromarray(labels, mode="L").convert("P")
    assert np.array_equal(decode_mask(_png(palette), 1000), labels)  # a palette image: its indices
    assert np.array_equal(decode_mask(_png(Image.fromarray(labels.astype(np.uint16))), 1000), labels)
    with pytest.raises(ImageError, match=r"labels outside 0\.\.255"):
        decode_mask(_png(Image.fromarray(labels.astype(np.uint16) * 100)), 1000)
    with pytest.raises(ImageError, match="RGB image, not one channel"):
        decode_mask(_png(Image.new("RGB", (4, 3))), 1000)
    with pytest.raises(ImageError, match="over"):
        decode_mask(_png(Image.new("L", (40, 30))), 1000)  # (max_pixels bounds the decode)


@pytest.mark.parametrize(
    "value",
    [[[10**400, 0, 4, 4]], [[float("nan"), 0, 4, 4]], [[1, 2, 3]], [["1", 2, 3, 4]], [[True, 2, 3, 4]], {"a": 1}],
)
def test_a_strangers_boxes_are_refused_in_one_line(value: object) -> None:
    """A shard's columns are a stranger's JSON: an integer no float holds, NaN, a short box, text
    or booleans are a malformed column (the loader's on_error), never another exception."""
    from shardkit.core.errors import ImageError
    from shardkit.readers.targets import parse_boxes

    with pytest.raises(ImageError, match="is not a list of"):
        parse_boxes(value, "objects.bbox", "xywh")
