"""The loader's device path (readers/device.py), run with device="cpu": CI has no GPU, and the
torch code is the same on either. Same crops and flips as the CPU loader, the same pixels within
the filters' rounding where no DCT scaling is involved; normalization, channels_last, resume and
bad records as the CPU loader has them; device="cuda" without CUDA is a one-line error."""

from __future__ import annotations

import importlib.util
import io
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from shardkit.core.config import EncodeConfig, PackConfig
from shardkit.core.errors import ConfigError, ShardReadError
from shardkit.formats.base import Record
from shardkit.packing.pack import pack
from shardkit.readers.dataset import open_shards
from shardkit.readers.device import dense_taps, filter_taps, line_taps
from shardkit.synthetic import picture, write_image

from .conftest import built_once
from .test_loader import foreign_output, jpeg, npy

torch = pytest.importorskip("torch")
if importlib.util.find_spec("torchvision") is None:  # (found, not imported: the device path imports it)
    pytest.skip("torchvision is not installed", allow_module_level=True)


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """60 labelled JPEGs between 1x and 1.9x the 96 px output: the CPU loader never DCT-scales.
    Built once a run (xdist workers share it): read only."""

    def build(folder: Path) -> None:
        source = folder / "photos"
        for i in range(60):
            size = (100 + 3 * i, 96 + 2 * (i % 20))
            write_image(source / f"c{i % 3}" / f"{i:03d}.jpg", *size, seed=i, gray=i % 11 == 0)
        pack(
            PackConfig(
                str(source), str(folder / "out"), shard_size=25, encode=EncodeConfig(encode="original"), workers=1
            )
        )

    return built_once(tmp_path_factory, "device-photos", build) / "out"


def run(folder: Path, batch: int = 16, **options) -> list:
    dataset = open_shards(folder, shuffle=True, seed=7)
    return list(dataset.loader(batch, 96, flip=True, **options))


def first(folder: Path, batch: int = 16, **options):
    """The first batch alone (what run(...)[0] is, without the rest of the epoch)."""
    return next(iter(open_shards(folder, shuffle=True, seed=7).loader(batch, 96, flip=True, **options)))


def test_the_device_path_gives_the_cpu_loaders_crops_and_pixels(small: Path) -> None:
    cpu, device = run(small), run(small, device="cpu")
    assert [b.keys for b in cpu] == [b.keys for b in device]
    for on_cpu, on_device in zip(cpu, device, strict=True):
        assert torch.equal(on_cpu.labels, on_device.labels)
        assert on_device.images.dtype == torch.uint8 and on_device.images.shape == on_cpu.images.shape
        assert on_device.images.is_contiguous(memory_format=torch.channels_last)
        # The same filter in float (the kernel's weights are fixed-point): a level. And the kernel
        # decodes only the window (libjpeg's cropped decode upsamples chroma a little differently at
        # its edges: a few pixels in ten thousand, up to 7 levels, as test_loader's TOLERANCE[1]).
        difference = (on_cpu.images.int() - on_device.images.int()).abs().float()
        assert difference.mean() < 0.1 and torch.quantile(difference.flatten(), 0.99) <= 1


def test_the_filter_is_pillows(tmp_path: Path) -> None:
    """filter_taps over a row against Pillow's own resize of that row, down and up, fractional."""
    row = picture(300, 1, 2, 3)[0, :, 0].astype(np.float64)
    image = Image.fromarray(row.astype(np.uint8)[None, :], "L")
    for left, right, out in ((0, 300, 37), (12.5, 200.25, 90), (40, 60, 100), (0, 300, 300)):
        weights, first = filter_taps(300, left, right, out)
        ours = np.rint(weights @ row[first : first + weights.shape[1]])
        pillows = np.asarray(image.resize((out, 1), Image.Resampling.BILINEAR, box=(left, 0, right, 1)))[0]
        assert np.abs(ours - pillows).max() <= 1, (left, right, out)


def test_the_batched_taps_are_filter_taps() -> None:
    """line_taps (a batch's lines at once, compact, on the host) made dense where the matmuls run
    (dense_taps) against filter_taps line by line: the same source span, the same weights, reversed
    for a flip, zero in the padding."""
    rng = np.random.default_rng(5)
    sizes = rng.integers(40, 900, 64)
    in0 = rng.uniform(0, 0.6, 64) * sizes
    in1 = np.minimum(in0 + rng.uniform(0.05, 1.0, 64) * sizes + 0.5, sizes)
    in0[:3], in1[:3] = 0, sizes[:3]  # whole lines too
    flips = rng.random(64) < 0.5
    for out in (224, 37, 700):  # down, far down, up
        taps = line_taps(sizes, in0, in1, out, flips)
        assert taps.weights.dtype == np.float32 and taps.weights.shape[:2] == (64, out)
        span = int((taps.end - taps.first).max())
        got = dense_taps(torch, taps, span, torch.device("cpu")).numpy()
        for i in range(64):
            weights, first = filter_taps(int(sizes[i]), in0[i], in1[i], out)
            assert (taps.first[i], taps.end[i]) == (first, first + weights.shape[1])
            want = weights[::-1] if flips[i] else weights
            assert np.abs(got[i, :, : weights.shape[1]] - want).max() < 1e-6, (i, out)
            assert not got[i, :, weights.shape[1] :].any()


def test_raw_and_jpeg_records_on_the_device(tmp_path: Path) -> None:
    """Raw records (C and Fortran order) next to PNG and JPEG: each decoded its way, one batch."""
    arrays = [picture(140 + 9 * i, 100 + 5 * i, i, 3) for i in range(6)]
    records = []
    for i, array in enumerate(arrays):
        png = io.BytesIO()
        Image.fromarray(array).save(png, "PNG")
        data, ext = [(npy(array), "npy"), (npy(array, fortran=True), "npy"), (png.getvalue(), "png")][i % 3]
        records.append(Record(f"k{i}", data, ext, i, {}))
    folder = foreign_output(tmp_path / "out", records)
    (cpu,) = open_shards(folder, seed=1).loader(6, 64, flip=True)
    (device,) = open_shards(folder, seed=1).loader(6, 64, flip=True, device="cpu")
    assert cpu.keys == device.keys
    assert (cpu.images.int() - device.images.int()).abs().max() <= 2


def test_normalized_output_in_the_asked_dtype(small: Path) -> None:
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    plain = first(small, device="cpu")
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        normal = first(small, device="cpu", dtype=dtype, mean=mean, std=std)
        assert normal.images.dtype == dtype and normal.images.is_contiguous(memory_format=torch.channels_last)
        want = (plain.images.float() / 255 - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1)
        tolerance = {torch.float16: 4e-3, torch.bfloat16: 3e-2, torch.float32: 1e-5}[dtype]
        assert torch.allclose(normal.images.float(), want, atol=tolerance * 3, rtol=tolerance)


def test_a_state_saved_between_batches_resumes_at_the_next(small: Path) -> None:
    """The device path makes batch k+1 before handing out batch k: a state saved after batch k must
    still resume at k+1, not after it."""
    whole = run(small, batch=8, device="cpu")
    loader = open_shards(small, shuffle=True, seed=7).loader(8, 96, flip=True, device="cpu")
    seen = []
    for batch in loader:
        seen.append(batch)
        if len(seen) == 3:
            state = loader.state_dict()
            break
    again = open_shards(small, shuffle=True, seed=7).loader(8, 96, flip=True, device="cpu")
    again.load_state_dict(state)
    rest = list(again)
    assert [b.keys for b in seen + rest] == [b.keys for b in whole]
    assert all(torch.equal(a.images, b.images) for a, b in zip(seen + rest, whole, strict=True))


def test_a_bad_record_raises_or_is_skipped_on_the_device(tmp_path: Path) -> None:
    good = jpeg(picture(90, 70, 1, 3))
    # (Damaged entropy data is another matter: nvJPEG and torchvision decode it with grey blocks
    # where the CPU kernel refuses libjpeg's warning; see readers/device.py.)
    broken = good[:2] + b"\xff\xc0\x00\x11" + bytes(300)  # a frame header the decoders cannot use
    records = [Record(f"r{i}", broken if i == 2 else good, "jpg", i, {}) for i in range(6)]
    records.append(Record("r6", npy(picture(50, 40, 2, 3))[:-5], "npy", 6, {}))
    folder = foreign_output(tmp_path / "out", records)
    with pytest.raises(ShardReadError, match=r"record r2: cannot decode"):
        list(open_shards(folder).loader(4, 32, device="cpu"))
    dataset = open_shards(folder, on_error="skip")
    got = list(dataset.loader(4, 32, device="cpu"))
    assert [k for b in got for k in b.keys] == ["r0", "r1", "r3", "r4", "r5"] and dataset.skipped == 2


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"device": "cuda"}, "sees no CUDA device"),
        ({"device": "tpu"}, "device must be"),
        ({"dtype": "float16"}, "device path"),
        ({"device": "cpu", "dtype": torch.int8}, "dtype must be"),
        ({"device": "cpu", "mean": (0.5, 0.5, 0.5)}, "need a floating dtype"),
        ({"device": "cpu", "dtype": torch.float16, "std": (1, 0, 1)}, "std > 0"),
        ({"device": "cpu", "output": "numpy"}, "leave output='torch'"),
    ],
)
def test_bad_device_options_are_refused(small: Path, options: dict, words: str) -> None:
    if options.get("device") == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA: device='cuda' is valid here")
    with pytest.raises(ConfigError, match=words):
        open_shards(small).loader(8, 32, **options)


def test_a_pixel_bomb_is_refused_before_the_device_decodes(tmp_path: Path) -> None:
    """torchvision's decoder has no pixel limit of its own: the header is checked first."""
    data = bytearray(jpeg(picture(16, 16, 1, 3)))
    at = data.index(b"\xff\xc0")
    data[at + 5 : at + 9] = (65000).to_bytes(2, "big") * 2
    folder = foreign_output(tmp_path / "out", [Record("r0", bytes(data), "jpg", 0, {})])
    with pytest.raises(ShardReadError, match="over the limit"):
        list(open_shards(folder).loader(1, 32, device="cpu"))


def test_a_batch_past_the_window_budget_is_resampled_in_parts(small: Path, monkeypatch) -> None:
    """Large photos' padded windows would not fit a GPU at once: parts under WINDOW_BYTES give the
    same pixels as one batched call."""
    import shardkit.readers.device as device

    whole = run(small, device="cpu")
    # about three windows and their images a part
    monkeypatch.setattr(device, "WINDOW_BYTES", 3 * (device.WINDOW_PIXEL_BYTES * 100 * 100 + 3 * 130 * 130))
    parts = run(small, device="cpu")
    assert all(torch.equal(a.images, b.images) for a, b in zip(whole, parts, strict=True))


def test_the_windows_are_gathered_in_one_read_as_sliced_one_by_one() -> None:
    """gather_windows (the images laid end to end, one indexed read) against each window sliced
    alone: the same levels inside each window, whatever the images' sizes and layouts."""
    from shardkit.readers.device import gather_windows

    rng = np.random.default_rng(3)
    shapes = ((40, 70), (90, 33), (1, 5))
    images = [torch.from_numpy(rng.integers(0, 256, (3, h, w), dtype=np.uint8)) for h, w in shapes]
    images.append(torch.from_numpy(rng.integers(0, 256, (20, 30, 3), dtype=np.uint8)).permute(2, 0, 1))  # HWC memory
    top, left = np.array([3, 0, 0, 19]), np.array([10, 7, 4, 0])
    rows, cols = np.array([30, 90, 1, 1]), np.array([60, 20, 1, 30])
    windows = gather_windows(torch, images, top, rows, left, cols)
    assert windows.dtype == torch.float32 and windows.shape == (4, 3, 90, 60)
    for i, image in enumerate(images):
        want = image[:, top[i] : top[i] + rows[i], left[i] : left[i] + cols[i]].float()
        assert torch.equal(windows[i, :, : rows[i], : cols[i]], want)


def test_the_device_work_runs_on_its_own_thread_and_a_stop_ends_it(small: Path, monkeypatch) -> None:
    """The decode and resample run on the loader's device threads (the loop that hands batches out
    never waits on a decode), at most DEVICE_AHEAD batches past the one handed out; a consumer that
    stops early leaves no thread running."""
    from shardkit.readers.device_decoder import DEVICE_AHEAD
    from shardkit.readers.loader import BatchLoader

    made: list[str] = []
    real = BatchLoader._on_device

    def on_device(self, *args):
        made.append(threading.current_thread().name)
        return real(self, *args)

    monkeypatch.setattr(BatchLoader, "_on_device", on_device)
    loader = open_shards(small, shuffle=True, seed=7).loader(4, 96, flip=True, device="cpu")
    batches = iter(loader)
    next(batches)
    deadline = time.monotonic() + 5
    while len(made) < 1 + DEVICE_AHEAD and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)
    assert len(made) == 1 + DEVICE_AHEAD  # the one handed out, and DEVICE_AHEAD more: no further
    assert all(name.startswith("shardkit-device") for name in made)
    batches.close()
    assert not [t for t in threading.enumerate() if t.name.startswith(("shardkit-device", "shardkit-loader"))]
