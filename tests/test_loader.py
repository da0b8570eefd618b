"""The batch loader: crop-decoded pixels equal full decode -> crop -> resize, crops are distributed
like torchvision's RandomResizedCrop, and batches are seeded, split across ranks and bounded."""

from __future__ import annotations

import io
import math
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from shardkit.core.codecs import crop_kernel
from shardkit.core.config import EncodeConfig, PackConfig, ResizeConfig
from shardkit.core.errors import ConfigError, ShardReadError
from shardkit.core.manifest import Manifest, ShardInfo, sha256_file, write_json_atomic
from shardkit.formats import get_format
from shardkit.formats.base import Record
from shardkit.packing.pack import pack
from shardkit.readers.dataset import open_shards
from shardkit.readers.loader import BatchLoader
from shardkit.readers.windows import center_boxes, crop_with_pillow, dct_denominator, random_resized_boxes
from shardkit.synthetic import picture, write_image

from .conftest import IMAGENET_SAMPLE, built_once
from .crop_checks import crop_raw, npy, raw_crops_match_pillow

torch = pytest.importorskip("torch")
kernel = crop_kernel()
needs_kernel = pytest.mark.skipif(kernel is None, reason="shardkit.core._crop was not compiled")


# --- pixels ------------------------------------------------------------------------------------


def jpeg(array: np.ndarray, quality: int = 90) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, "JPEG", quality=quality)
    return buffer.getvalue()


def reference(data: bytes, box, size: tuple[int, int], flip: bool) -> np.ndarray:
    """Full decode -> crop -> antialiased bilinear resize -> flip: what torchvision does on PIL."""
    image = Image.open(io.BytesIO(data)).convert("RGB")
    left, top, width, height = box
    out = image.resize((size[1], size[0]), Image.Resampling.BILINEAR, box=(left, top, left + width, top + height))
    return np.asarray(out.transpose(Image.Transpose.FLIP_LEFT_RIGHT) if flip else out)


def crop_decode(datas: list[bytes], boxes, flips, size: tuple[int, int]) -> np.ndarray:
    out = np.zeros((len(datas), *size, 3), np.uint8)
    results = kernel.decode_batch(
        datas, np.ascontiguousarray(boxes, np.float64), np.asarray(flips, np.uint8),
        np.arange(len(datas), dtype=np.int32), out, size[0], size[1], 1 << 40,
    )  # fmt: skip
    assert results == [None] * len(datas), results
    return out


def photos() -> list[bytes]:
    """Real photos when ../shared is here (at their own resolution), generated ones otherwise."""
    if IMAGENET_SAMPLE.is_dir():
        paths = sorted(p for p in IMAGENET_SAMPLE.iterdir() if p.suffix.lower() == ".jpeg")[::25]
        return [jpeg(np.asarray(Image.open(path).convert("RGB"))) for path in paths]
    return [jpeg(picture(500 - 37 * i, 375 + 29 * i, i, 3)) for i in range(12)]


# Without DCT scaling the kernel is Pillow's filter on the same decoded pixels: a level at most.
# With it, libjpeg's DCT-domain reduction replaces the first part of the bilinear downscale; over
# the 300 real ImageNet photos an image's mean difference is 0.9-1.3 levels (median; 1/2 to 1/8),
# 7.3 at worst, and its 99th percentile 6 (median), 26 at worst.
TOLERANCE = {1: (0.25, 1), 2: (8, 32), 4: (8, 32), 8: (8, 32)}  # denominator: (an image's mean, its 99th pct.)
SET_MEAN = {1: 0.05, 2: 1.8, 4: 1.8, 8: 2.0}  # the mean over the images


@needs_kernel
@pytest.mark.parametrize("denominator", [1, 2, 4, 8])
def test_crop_decode_equals_full_decode_crop_resize(denominator: int) -> None:
    rng = np.random.default_rng(denominator)
    datas, boxes, flips, size = [], [], [], None
    for data in photos():
        width, height = Image.open(io.BytesIO(data)).size
        side = min(width, height)
        out = max(8, side // (2 * denominator) if denominator > 1 else side // 2)
        size = size or (out, out)
        if denominator > 1 and min(width, height) < size[0] * denominator:
            continue
        smallest = (size[1] * denominator, size[0] * denominator) if denominator > 1 else (8, 8)
        w, h = int(rng.integers(smallest[0], width + 1)), int(rng.integers(smallest[1], height + 1))
        box = (int(rng.integers(0, width - w + 1)), int(rng.integers(0, height - h + 1)), w, h)
        assert dct_denominator(w, h, size) >= denominator
        datas.append(data)
        boxes.append(box)
        flips.append(bool(rng.integers(2)))
    assert len(datas) >= 3
    got = crop_decode(datas, boxes, flips, size)
    mean_limit, p99_limit = TOLERANCE[denominator]
    means = []
    for image, data, box, flip in zip(got, datas, boxes, flips, strict=True):
        difference = np.abs(image.astype(int) - reference(data, box, size, flip).astype(int))
        assert difference.mean() <= mean_limit and np.percentile(difference, 99) <= p99_limit, (box, flip)
        means.append(difference.mean())
    assert np.mean(means) <= SET_MEAN[denominator]


@needs_kernel
@pytest.mark.parametrize(
    ("width", "height", "box", "size"),
    [
        (333, 517, (16, 32, 160, 240), (224, 224)),  # box on iMCU boundaries
        (333, 517, (17, 33, 161, 239), (224, 224)),  # and off them
        (333, 517, (0, 0, 333, 517), (97, 131)),  # the whole odd-sized image, odd output
        (333, 517, (300, 480, 33, 37), (224, 224)),  # a corner, upscaled
        (8, 8, (0, 0, 8, 8), (224, 224)),  # tiny
        (1, 1, (0, 0, 1, 1), (16, 16)),
        (4000, 30, (100, 0, 3000, 30), (30, 224)),  # a strip
        (640, 480, (10.5, 20.25, 300.5, 200.75), (224, 224)),  # fractional (center crops are)
    ],
)
@pytest.mark.parametrize("gray", [False, True])
def test_crop_decode_edge_cases(width, height, box, size, gray) -> None:
    array = picture(width, height, 3, 1 if gray else 3)
    data = jpeg(array[..., 0] if gray else array)
    for flip in (False, True):
        got = crop_decode([data], [box], [flip], size)[0]
        difference = np.abs(got.astype(int) - reference(data, box, size, flip).astype(int))
        limit = TOLERANCE[dct_denominator(box[2], box[3], size)]
        assert difference.mean() <= limit[0] and np.percentile(difference, 99) <= limit[1]


@pytest.mark.parametrize("denominator", [1, 2])
def test_the_pillow_path_gives_the_kernels_pixels(denominator: int) -> None:
    """Without the kernel (no compiler, CMYK, PNG) the loader uses Pillow with the same window, DCT
    scale and filter."""
    data = jpeg(picture(900, 700, 5, 3))
    box, size = (40, 30, 224 * denominator + 100, 224 * denominator + 50), (224, 224)
    pillow = crop_with_pillow(data, "jpg", box, True, size, 1 << 40)
    expected = reference(data, box, size, True) if kernel is None else crop_decode([data], [box], [True], size)[0]
    difference = np.abs(pillow.astype(int) - expected.astype(int))
    assert difference.mean() <= (0.25 if denominator == 1 else TOLERANCE[2][0]) and difference.max() <= 16


# --- the windows ---------------------------------------------------------------------------------


def ks_statistic(a: np.ndarray, b: np.ndarray) -> float:
    values = np.sort(np.concatenate([a, b]))
    return float(np.abs(np.searchsorted(np.sort(a), values, "right") / len(a)
                        - np.searchsorted(np.sort(b), values, "right") / len(b)).max())  # fmt: skip


@pytest.mark.parametrize(
    ("width", "height"),
    [pytest.param(500, 375, marks=pytest.mark.slow), (256, 341), (224, 224), (1000, 60), (40, 900)],  # (2 s)
)
def test_random_crops_are_distributed_like_torchvisions(width: int, height: int) -> None:
    """Area share, aspect ratio and position of the windows, against torchvision's own get_params
    (two-sample Kolmogorov-Smirnov at a 0.1% level), on sizes where the fallback is rare and where
    it is the rule."""
    from torchvision.transforms import v2

    n = 4000
    ours = random_resized_boxes(np.full(n, width), np.full(n, height), np.random.default_rng(0))
    torch.manual_seed(0)
    image = torch.empty(3, height, width)
    params = [v2.RandomResizedCrop.get_params(image, [0.08, 1.0], [3 / 4, 4 / 3]) for _ in range(n)]
    theirs = np.array([(j, i, w, h) for i, j, h, w in params], dtype=np.float64)
    critical = 1.95 * math.sqrt(2 / n)
    for name, measure in {
        "area": lambda b: b[:, 2] * b[:, 3] / (width * height),
        "aspect": lambda b: np.log(b[:, 2] / b[:, 3]),
        "left": lambda b: b[:, 0] / np.maximum(1, width - b[:, 2]),
        "top": lambda b: b[:, 1] / np.maximum(1, height - b[:, 3]),
    }.items():
        assert ks_statistic(measure(ours), measure(theirs)) < critical, name
    assert (ours[:, 0] + ours[:, 2] <= width).all() and (ours[:, 1] + ours[:, 3] <= height).all()
    assert (ours[:, 2:] >= 1).all()


def test_center_crop_is_torchvisions_resize_then_center_crop() -> None:
    from torchvision.transforms import v2

    for width, height in ((500, 375), (333, 517), (256, 256), (1024, 256)):
        data = jpeg(picture(width, height, 1, 3))
        (box,) = center_boxes(np.array([width]), np.array([height]), (224, 224), 256)
        ours = crop_with_pillow(data, "jpg", box, False, (224, 224), 1 << 40)
        image = Image.open(io.BytesIO(data)).convert("RGB")
        theirs = np.asarray(v2.Compose([v2.Resize(256, antialias=True), v2.CenterCrop(224)])(image))
        assert np.abs(ours.astype(int) - theirs.astype(int)).mean() < 0.6, (width, height)


@needs_kernel
def test_the_kernels_jpeg_sizes_are_the_header_parsers(odd_images: Path) -> None:
    """`jpeg_sizes` is headers.jpeg_size in C (the loader takes its rows where they are plain and
    asks record_size for the rest): the same answer on real, odd and fuzzed JPEG headers."""
    import random

    from shardkit.core.headers import jpeg_size

    datas = [jpeg(np.full((7 + i, 300 - i, 3), i, np.uint8)) for i in range(0, 60, 7)]
    datas += [path.read_bytes() for path in sorted(odd_images.rglob("*")) if path.is_file()]
    datas += [b"", b"\xff\xd8", b"\xff\xd8\xff\xc0" + bytes(5), b"\xff\xd8\xff\xe0\xff\xff" + bytes(20)]
    rng = random.Random(5)
    for _ in range(400):
        data = bytearray(rng.choice(datas[:9]))
        for _ in range(rng.randint(1, 4)):
            at = rng.randrange(min(len(data), 120))
            data[at] = rng.choice((0x00, 0xFF, 0xC0, 0xC4, 0xD9, 0xDA, 0x01, rng.randrange(256)))
        datas.append(bytes(data[: rng.choice((len(data), rng.randrange(len(data) + 1)))]))
    sizes = np.empty((len(datas), 2), np.int64)
    kernel.jpeg_sizes(datas, sizes)
    expected = [jpeg_size(data) or (-1, -1) for data in datas]
    assert [tuple(row) for row in sizes.tolist()] == expected
    assert sum(size != (-1, -1) for size in expected) > 100  # most stayed plain: both parsers answered


# --- the loader -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """200 labelled JPEG records (odd sizes, some grey) in 4 shards, plus one PNG source. Built once
    a run (xdist workers share it): read only."""

    def build(folder: Path) -> None:
        source = folder / "photos"
        for i in range(200):
            size = (180 + 7 * (i % 13), 150 + 11 * (i % 7))
            write_image(source / f"c{i % 5}" / f"{i:03d}.jpg", *size, seed=i, gray=i % 9 == 0)
        pack(
            PackConfig(
                str(source), str(folder / "out"), shard_size=50, encode=EncodeConfig(encode="original"), workers=1
            )
        )

    return built_once(tmp_path_factory, "loader-photos", build) / "out"


def batches(out: Path, **options) -> list:
    dataset_options = {key: options.pop(key) for key in ("shuffle", "seed", "rank", "world_size") if key in options}
    return list(open_shards(out, **dataset_options).loader(options.pop("batch_size", 32), options.pop("size", 64),
                                                          **options))  # fmt: skip


def test_batches_are_uint8_channels_last_with_labels_and_keys(packed: Path) -> None:
    dataset = open_shards(packed)
    loader = dataset.loader(32, 64, flip=True, workers=2)
    got = list(loader)
    assert len(loader) == len(got) == math.ceil(200 / 32)
    images, labels = got[0]
    assert images.shape == (32, 3, 64, 64) and images.dtype == torch.uint8
    assert images.is_contiguous(memory_format=torch.channels_last)
    assert labels.dtype == torch.int64 and labels.tolist() == [dataset[i].label for i in range(32)]
    assert got[0].keys == [dataset[i].key for i in range(32)] and got[0].images is images
    assert sum(len(b.labels) for b in got) == 200 and len(got[-1].labels) == 200 % 32
    assert len(dataset.loader(32, 64, drop_last=True)) == 200 // 32 == len(list(dataset.loader(32, 64, drop_last=True)))
    as_numpy = dataset.loader(32, (48, 80), output="numpy").__iter__().__next__()
    assert isinstance(as_numpy.images, np.ndarray) and as_numpy.images.shape == (32, 3, 48, 80)


def test_crops_and_flips_repeat_whatever_the_thread_count(packed: Path) -> None:
    runs = [batches(packed, shuffle=True, seed=3, flip=True, workers=workers) for workers in (1, 2, 3)]
    for batch in range(len(runs[0])):
        assert runs[0][batch].keys == runs[1][batch].keys == runs[2][batch].keys
        assert torch.equal(runs[0][batch].images, runs[1][batch].images)
        assert torch.equal(runs[0][batch].images, runs[2][batch].images)
    other = batches(packed, shuffle=True, seed=4, flip=True)
    assert other[0].keys != runs[0][0].keys


def test_the_epoch_changes_crops_and_order(packed: Path) -> None:
    dataset = open_shards(packed, shuffle=True, seed=1)
    first = [b.keys for b in dataset.loader(50, 32)]
    dataset.set_epoch(1)
    assert [b.keys for b in dataset.loader(50, 32)] != first


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_split_the_epoch_like_iteration(packed: Path, world: int) -> None:
    seen = []
    for rank in range(world):
        dataset = open_shards(packed, shuffle=True, seed=2, rank=rank, world_size=world)
        keys = [key for batch in dataset.loader(16, 32) for key in batch.keys]
        assert keys == [sample.key for sample in dataset]  # the same samples, in the same order
        seen.append(keys)
    assert len({len(keys) for keys in seen}) == 1
    assert set().union(*map(set, seen)) == {open_shards(packed)[i].key for i in range(200)}


def test_no_crop_passes_fixed_size_records_through(tmp_path: Path) -> None:
    for i in range(6):
        write_image(tmp_path / "src" / f"{i}.jpg", 120 + 10 * i, 90, seed=i)
    out = tmp_path / "out"
    pack(PackConfig(str(tmp_path / "src"), str(out), resize=ResizeConfig(64, mode="center-crop"), workers=1))
    dataset = open_shards(out)
    (batch,) = dataset.loader(8, 64, crop=None)
    for image, sample in zip(batch.images, dataset, strict=True):
        assert np.array_equal(image.permute(1, 2, 0).numpy(), sample.image)


def foreign_output(folder: Path, records: list[Record]) -> Path:
    folder.mkdir()
    writer = get_format("webdataset").writer(str(folder / "shard-000000.tar"))
    for record in records:
        writer.add(record)
    writer.close()
    shard = folder / "shard-000000.tar"
    info = ShardInfo(shard.name, len(records), shard.stat().st_size, sha256_file(shard))
    total = {"inputs": len(records), "records": len(records), "errors": 0}
    write_json_atomic(folder / "manifest.json", Manifest("webdataset", [info], totals=total).sealed().to_json())
    (folder / "errors.jsonl").write_text("")
    return folder


def test_png_raw_and_cmyk_records_take_the_pillow_path(tmp_path: Path) -> None:
    rgb = picture(150, 120, 7, 3)
    png, npy = io.BytesIO(), io.BytesIO()
    Image.fromarray(rgb).save(png, "PNG")
    np.save(npy, rgb)
    cmyk = io.BytesIO()
    Image.fromarray(rgb).convert("CMYK").save(cmyk, "JPEG", quality=95)
    records = [
        Record("a", jpeg(rgb), "jpg", 0, {}),
        Record("b", png.getvalue(), "png", 1, {}),
        Record("c", npy.getvalue(), "npy", 2, {}),
        Record("d", cmyk.getvalue(), "jpg", 3, {}),
    ]
    folder = foreign_output(tmp_path / "out", records)
    (batch,) = open_shards(folder).loader(4, 64, crop="center", resize=80)
    images = batch.images.permute(0, 2, 3, 1).numpy().astype(int)
    assert batch.labels.tolist() == [0, 1, 2, 3]
    # The same scene four ways: JPEG's loss and CMYK's round trip aside, the same crop.
    for i in (1, 2, 3):
        assert np.abs(images[i] - images[0]).mean() < 6, records[i].key


def test_a_bad_record_raises_or_is_skipped(tmp_path: Path) -> None:
    good = jpeg(picture(90, 70, 1, 3))
    broken = good[:300] + bytes(200) + good[500:]
    records = [Record(f"r{i}", broken if i == 5 else good, "jpg", i, {}) for i in range(10)]
    folder = foreign_output(tmp_path / "out", records)
    with pytest.raises(ShardReadError, match=r"shard-000000\.tar: record r5: cannot decode"):
        list(open_shards(folder).loader(4, 32))
    dataset = open_shards(folder, on_error="skip")
    got = list(dataset.loader(4, 32))
    assert [len(b.labels) for b in got] == [4, 4, 1] and "r5" not in [k for b in got for k in b.keys]  # (refilled)
    assert dataset.skipped == 1
    # drop_last: a short last chunk can fill a batch only when records are skipped; otherwise it is
    # not read at all, so a bad record there neither raises nor costs a decode
    tail = [Record(f"r{i}", broken if i == 9 else good, "jpg", i, {}) for i in range(10)]
    folder = foreign_output(tmp_path / "tail", tail)
    assert [b.keys for b in open_shards(folder).loader(4, 32, drop_last=True)] == [
        ["r0", "r1", "r2", "r3"], ["r4", "r5", "r6", "r7"]]  # fmt: skip
    kept = list(open_shards(folder, on_error="skip").loader(3, 32, drop_last=True))
    assert [b.keys for b in kept] == [["r0", "r1", "r2"], ["r3", "r4", "r5"], ["r6", "r7", "r8"]]


def test_a_pixel_bomb_record_is_refused_before_decoding(tmp_path: Path) -> None:
    data = bytearray(jpeg(picture(16, 16, 1, 3)))
    at = data.index(b"\xff\xc0")
    data[at + 5 : at + 9] = (65000).to_bytes(2, "big") * 2
    folder = foreign_output(tmp_path / "out", [Record("r0", bytes(data), "jpg", 0, {})])
    with pytest.raises(ShardReadError, match="over the limit"):
        list(open_shards(folder).loader(1, 32))


def test_memory_is_bounded_by_the_prefetch(packed: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    decoded, highest = [0], [0]
    original = BatchLoader._decode

    def counting(self, key, number, chunk):
        decoded[0] += 1
        return original(self, key, number, chunk)

    monkeypatch.setattr(BatchLoader, "_decode", counting)
    loader = open_shards(packed).loader(8, 32, workers=2, prefetch=3)
    for consumed, _ in enumerate(loader, 1):
        threading.Event().wait(0.01)  # a slow training step
        highest[0] = max(highest[0], decoded[0] - consumed)
    assert highest[0] <= 3 + 1  # the prefetched batches and the one being handed over


def test_stopping_early_leaves_no_thread_behind(packed: Path) -> None:
    before = threading.active_count()
    loader = iter(open_shards(packed).loader(8, 32, workers=3))
    next(loader)
    loader.close()
    assert threading.active_count() == before


CTRL_C = """
import signal, sys, threading, time, os
# Python keeps SIGINT ignored when it starts so (a CI job run in the background by a shell without
# job control): then no Ctrl-C would come, and this test waited out its timeout.
signal.signal(signal.SIGINT, signal.default_int_handler)
from shardkit.readers import open_shards
loader = open_shards(sys.argv[1]).loader(8, 64, workers=2)
timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))
timer.start()
try:
    while True:
        for batch in loader:
            time.sleep(0.01)
except KeyboardInterrupt:
    timer.join()  # the signal can reach this thread before the timer's own has ended: not the loader's
    print("stopped", threading.active_count(), flush=True)
"""


@pytest.mark.slow  # kills a process
def test_ctrl_c_stops_the_loader_cleanly(packed: Path) -> None:
    run = subprocess.run([sys.executable, "-c", CTRL_C, str(packed)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stdout.split() == ["stopped", "1"], run.stdout + run.stderr


def test_pin_memory_without_cuda_says_so(packed: Path) -> None:
    if torch.cuda.is_available():
        (batch, *_) = open_shards(packed).loader(8, 32, pin_memory=True)
        assert batch.images.is_pinned()
        return
    with pytest.warns(UserWarning, match="no CUDA device"):
        loader = open_shards(packed).loader(8, 32, pin_memory=True)
    assert not next(iter(loader)).images.is_pinned()


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"batch_size": 0}, "batch_size"),
        ({"size": (0, 4)}, "size"),
        ({"crop": "middle"}, "crop"),
        ({"output": "jax"}, "output"),
        ({"scale": (0.5, 0.1)}, "scale"),
        ({"ratio": (float("nan"), 1)}, "ratio"),
        ({"crop": "center", "resize": 100, "size": 224}, "smaller than the center crop"),
        ({"workers": -1}, "workers"),
    ],
)
def test_bad_options_are_refused(packed: Path, options: dict, words: str) -> None:
    arguments = {"batch_size": 8, "size": 32, **options}
    with pytest.raises(ConfigError, match=words):
        open_shards(packed).loader(arguments.pop("batch_size"), arguments.pop("size"), **arguments)


def test_workers_0_makes_each_batch_in_the_calling_thread(packed: Path) -> None:
    """torch's num_workers=0: no thread is started, and the batches are those of any thread count."""
    import threading

    dataset = open_shards(packed, shuffle=True, seed=3)
    before = threading.active_count()
    inline = [(b.keys, b.images.copy()) for b in dataset.loader(8, 32, workers=0, output="numpy", flip=True)]
    assert threading.active_count() == before
    threaded = [(b.keys, b.images) for b in dataset.loader(8, 32, workers=2, output="numpy", flip=True)]
    assert [k for k, _ in inline] == [k for k, _ in threaded]
    assert all(np.array_equal(a, b) for (_, a), (_, b) in zip(inline, threaded, strict=True))


def test_every_path_gives_the_same_batches(packed: Path, tmp_path: Path) -> None:
    """The kernel's AVX2, SSE2 and portable passes (what ARM machines run) and Pillow (what a machine
    without a compiler gets): the same crops, the same pixels within the filters' rounding."""
    script = (
        "import sys, numpy as np\nfrom shardkit.readers import open_shards\n"
        "batch = next(iter(open_shards(sys.argv[1], shuffle=True, seed=5).loader(32, 64, flip=True, output='numpy')))\n"
        "np.save(sys.argv[2], np.ascontiguousarray(batch.images))\n"
    )
    outputs = {}
    paths = {"kernel": {}, "sse2": {"SHARDKIT_NO_AVX2": "1"}, "portable": {"SHARDKIT_CROP_PORTABLE": "1"},
             "pillow": {"SHARDKIT_NO_CROP_KERNEL": "1"}}  # fmt: skip
    for name, env in paths.items():
        target = tmp_path / f"{name}.npy"
        subprocess.run([sys.executable, "-c", script, str(packed), str(target)], check=True, env={**os.environ, **env})
        outputs[name] = np.load(target).astype(int)
    assert np.array_equal(outputs["kernel"], outputs["sse2"])  # the same integer arithmetic, wider registers
    for name in ("portable", "pillow"):
        difference = np.abs(outputs["kernel"] - outputs[name])
        assert difference.mean() < 0.5 and np.percentile(difference, 99) <= 2, name


# --- raw records: the kernel reads the window from the record's pixels, nothing decoded ----------


@needs_kernel
@pytest.mark.parametrize("portable", [False, True])
def test_raw_crops_are_pillows_filter_on_the_same_pixels(portable: bool) -> None:
    """Any box, any scale (no DCT step: the filter alone does the whole downscale), flips: Pillow's
    antialiased bilinear on the same pixels, within the filter's rounding (a level). The portable
    passes (ARM) are checked in a child process, where SHARDKIT_CROP_PORTABLE takes effect."""
    if portable:  # (the child imports no torch: a second or two less)
        script = (
            "import sys; sys.path.insert(0, sys.argv[1])\n"
            "from tests.crop_checks import raw_crops_match_pillow\n"
            "raw_crops_match_pillow()\n"
        )
        env = {**os.environ, "SHARDKIT_CROP_PORTABLE": "1"}
        repo = str(Path(__file__).resolve().parent.parent)
        subprocess.run([sys.executable, "-c", script, repo], check=True, env=env)
        return
    raw_crops_match_pillow()


@needs_kernel
def test_raw_crops_equal_the_jpeg_crops_of_the_same_stored_pixels() -> None:
    """A JPEG and a raw record holding what that JPEG decodes to: where the JPEG path needs no DCT
    scaling (the box under twice the output), the same crops within the filter's rounding."""
    rng = np.random.default_rng(11)
    datas, raws, boxes, flips = [], [], [], []
    size = (112, 112)
    for data in photos():
        stored = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))  # libjpeg-turbo, as the kernel
        height, width = stored.shape[:2]
        w = int(rng.integers(size[1] // 2, min(width, 2 * size[1] - 1) + 1))
        h = int(rng.integers(size[0] // 2, min(height, 2 * size[0] - 1) + 1))
        box = (int(rng.integers(0, width - w + 1)), int(rng.integers(0, height - h + 1)), w, h)
        assert dct_denominator(w, h, size) == 1
        datas.append(data)
        raws.append(npy(stored))
        boxes.append(box)
        flips.append(bool(rng.integers(2)))
    from_jpeg = crop_decode(datas, boxes, flips, size).astype(int)
    from_raw = crop_raw(raws, boxes, flips, size).astype(int)
    # As the JPEG path against a full decode (TOLERANCE[1]): libjpeg's cropped decode upsamples
    # chroma a little differently at the window's edges, here and there by 2 levels.
    for jpeg_crop, raw_crop in zip(from_jpeg, from_raw, strict=True):
        difference = np.abs(jpeg_crop - raw_crop)
        assert difference.mean() < TOLERANCE[1][0] and np.percentile(difference, 99) <= TOLERANCE[1][1]


def test_a_raw_shard_loads_like_the_jpeg_shard_of_its_pixels(tmp_path: Path) -> None:
    """Through the loader: raw records (C and Fortran order) and the JPEGs they were decoded from,
    one batch each with the same seed: the same labels, keys, crops and flips, the same pixels
    within the DCT step's difference (random crops may take 1/2 scale on the JPEG path)."""
    arrays = [picture(320 - 20 * i, 240 + 10 * i, i, 3) for i in range(8)]
    jpegs = [jpeg(array, 95) for array in arrays]
    stored = [np.asarray(Image.open(io.BytesIO(data)).convert("RGB")) for data in jpegs]
    jpeg_out = foreign_output(tmp_path / "jpeg", [Record(f"k{i}", d, "jpg", i, {}) for i, d in enumerate(jpegs)])
    raw_records = [Record(f"k{i}", npy(a, fortran=i == 5), "npy", i, {}) for i, a in enumerate(stored)]
    raw_out = foreign_output(tmp_path / "raw", raw_records)
    batches = [next(iter(open_shards(folder, shuffle=True, seed=4).loader(8, 64, flip=True, output="numpy")))
               for folder in (jpeg_out, raw_out)]  # fmt: skip
    (from_jpeg, from_raw) = batches
    assert from_jpeg.keys == from_raw.keys and from_jpeg.labels.tolist() == from_raw.labels.tolist()
    difference = np.abs(from_jpeg.images.astype(int) - from_raw.images.astype(int))
    assert difference.mean() < 2 and np.percentile(difference, 99) <= 16


@needs_kernel
def test_a_raw_record_geometry_past_its_bytes_is_refused_by_the_kernel() -> None:
    data = npy(picture(40, 30, 1, 3))
    out = np.zeros((1, 8, 8, 3), np.uint8)
    for geometry in ([[128, 40, 31]], [[len(data), 1, 1]], [[-1, 40, 30]], [[128, 0, 30]]):
        with pytest.raises(ValueError, match="geometry outside its bytes"):
            kernel.crop_raw_batch([data], np.array(geometry, np.int64), np.array([[0, 0, 8, 8]], np.float64),
                                  np.zeros(1, np.uint8), np.zeros(1, np.int32), out, 8, 8, 1 << 40)  # fmt: skip


def test_a_bad_raw_record_is_named_and_skipped(tmp_path: Path) -> None:
    good = npy(picture(60, 40, 1, 3))
    records = [
        Record("r0", good, "npy", 0, {}),
        Record("r1", good[:-7], "npy", 1, {}),  # truncated pixels
        Record("r2", good.replace(b"'|u1'", b"'<f8'"), "npy", 2, {}),  # not uint8
        Record("r3", good, "npy", 3, {}),
    ]
    folder = foreign_output(tmp_path / "out", records)
    with pytest.raises(ShardReadError, match=r"record r1: cannot decode \(bad raw pixels"):
        list(open_shards(folder).loader(4, 16))
    dataset = open_shards(folder, on_error="skip")
    (batch,) = dataset.loader(4, 16)
    assert batch.keys == ["r0", "r3"] and dataset.skipped == 2
