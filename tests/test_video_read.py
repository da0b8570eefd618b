"""The read half of video (#36): Sample.video and the clip loader over outputs of packed clips
(core/clips.py's contract), in every format, built by hand until pack cuts clips."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from shardkit.core.errors import ConfigError, ShardReadError
from shardkit.formats.base import Record
from shardkit.readers.clips import decode_clip
from shardkit.readers.dataset import open_shards
from shardkit.synthetic import encode, picture, video_frame

from .video_clips import clip_mp4, clip_record, write_output

pytest.importorskip("av")

FORMATS = ("webdataset", "lmdb", "hdf5")
COUNTS = (6, 9, 4, 11, 7, 8)  # frames per clip: some fewer than the loader's T, some more
FIRSTS = (0, 3, 7, 12, 16, 20)  # the source frame each clip starts at


@pytest.fixture(scope="module")
def clips() -> list[Record]:
    shapes = enumerate(zip(COUNTS, FIRSTS, strict=True))
    return [clip_record(f"c{i}", i, frames=n, first=f, seed=i) for i, (n, f) in shapes]


@pytest.fixture(scope="module", params=FORMATS)
def output(request: pytest.FixtureRequest, clips: list[Record], tmp_path_factory: pytest.TempPathFactory) -> Path:
    name = request.param
    return write_output(tmp_path_factory.mktemp("clips") / name, name, [clips[:4], clips[4:]])


def frame_numbers(video: np.ndarray) -> list[int]:
    """Which source frame each frame is, from its top-left block's grey level (index * 8)."""
    return [round(float(frame[:8, :8].mean()) / 8) for frame in video]


def test_sample_video_is_the_clip_frame_by_frame(output: Path) -> None:
    dataset = open_shards(output)
    for i, sample in enumerate(dataset):
        assert sample.image is None and sample.label == i
        assert sample.video.shape == (COUNTS[i], 48, 64, 3) and sample.video.dtype == np.uint8
        assert frame_numbers(sample.video) == list(range(FIRSTS[i], FIRSTS[i] + COUNTS[i]))
    assert dataset.get("c3").video.shape[0] == COUNTS[3]


def test_decode_modes(output: Path, clips: list[Record]) -> None:
    torch = pytest.importorskip("torch")
    rgb = open_shards(output)[1].video
    assert open_shards(output, decode="bytes")[1].video == clips[1].data
    tensor = open_shards(output, decode="torch")[1].video
    assert isinstance(tensor, torch.Tensor) and tuple(tensor.shape) == (9, 3, 48, 64)
    assert np.array_equal(tensor.permute(0, 2, 3, 1).numpy(), rgb)
    pils = open_shards(output, decode="pil")[1].video
    assert len(pils) == 9 and all(isinstance(p, Image.Image) and p.size == (64, 48) for p in pils)
    assert np.array_equal(np.asarray(pils[4]), rgb[4])


def crops_by_hand(video: np.ndarray, window: np.ndarray, flip: bool, start: int, frames: int, size: int) -> np.ndarray:
    """What the loader should give for one clip: its frames from `start` (the last repeated), each
    cropped to the reported window with the loader's filter and flipped."""
    out = []
    for t in range(frames):
        image = Image.fromarray(video[min(start + t, len(video) - 1)])
        image = image.resize((size, size), Image.Resampling.BILINEAR, box=tuple(window))
        out.append(np.asarray(image.transpose(Image.Transpose.FLIP_LEFT_RIGHT) if flip else image))
    return np.stack(out)


def test_one_window_and_flip_per_clip_over_all_its_frames(output: Path) -> None:
    dataset = open_shards(output)
    videos = {sample.key: sample.video for sample in dataset}
    batches = list(dataset.loader(4, 32, frames=5, flip=True, output="numpy", workers=2))
    assert [b.images.shape for b in batches] == [(4, 5, 3, 32, 32), (2, 5, 3, 32, 32)]
    assert [k for b in batches for k in b.keys] == [f"c{i}" for i in range(6)]
    flipped = set()
    for batch in batches:
        assert batch.images.dtype == np.uint8 and batch.labels.tolist() == [int(k[1:]) for k in batch.keys]
        for i, key in enumerate(batch.keys):
            start, count = int(batch.offsets[i]), len(videos[key])
            assert 0 <= start <= max(count - 5, 0)
            want = crops_by_hand(videos[key], batch.windows[i], bool(batch.flips[i]), start, 5, 32)
            assert np.array_equal(batch.images[i].transpose(0, 2, 3, 1), want), key
            flipped.add(bool(batch.flips[i]))
    assert flipped == {True, False}


def test_short_clips_repeat_their_last_frame_and_center_takes_the_middle(output: Path) -> None:
    (batch,) = open_shards(output).loader(6, 16, frames=8, crop="center", output="numpy")
    assert batch.offsets.tolist() == [max(n - 8, 0) // 2 for n in COUNTS]
    for i, count in enumerate(COUNTS):
        if count < 8:  # frames count .. 7 are the last one again
            assert all(np.array_equal(batch.images[i, t], batch.images[i, count - 1]) for t in range(count, 8))


def test_random_offsets_vary_and_repeat_for_the_seed(output: Path) -> None:
    def offsets(seed: int) -> list[int]:
        loader = open_shards(output, seed=seed).loader(6, 16, frames=3, output="numpy")
        return [o for b in loader for o in b.offsets.tolist()]

    assert offsets(1) == offsets(1)
    assert len({tuple(offsets(s)) for s in range(4)}) > 1


def test_the_same_batches_whatever_the_workers(output: Path) -> None:
    def run(workers: int) -> list:
        dataset = open_shards(output, shuffle=True, seed=5)
        return list(dataset.loader(4, 24, frames=4, flip=True, output="numpy", workers=workers))

    one, two = run(1), run(2)
    for a, b in zip(one, two, strict=True):
        assert a.keys == b.keys and np.array_equal(a.images, b.images) and np.array_equal(a.windows, b.windows)
        assert np.array_equal(a.flips, b.flips) and np.array_equal(a.offsets, b.offsets)


def test_resume_from_a_state_equals_the_run_uninterrupted(output: Path) -> None:
    def loader():  # type: ignore[no-untyped-def]
        return open_shards(output, shuffle=True, seed=2).loader(2, 24, frames=3, flip=True, output="numpy")

    whole = list(loader())
    first = loader()
    iterator = iter(first)
    next(iterator)
    state = first.state_dict()
    iterator.close()
    resumed = loader()
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert [b.keys for b in rest] == [b.keys for b in whole[1:]]
    assert all(np.array_equal(a.images, b.images) for a, b in zip(rest, whole[1:], strict=True))


def test_ranks_split_the_clips(output: Path) -> None:
    keys = [
        [k for b in open_shards(output, rank=r, world_size=2).loader(2, 16, frames=2, output="numpy") for k in b.keys]
        for r in (0, 1)
    ]
    assert len(keys[0]) == len(keys[1]) == 3 and sorted(keys[0] + keys[1]) == [f"c{i}" for i in range(6)]


def test_torch_output_is_btchw_uint8(output: Path) -> None:
    torch = pytest.importorskip("torch")
    images, labels = next(iter(open_shards(output).loader(3, 16, frames=2)))
    assert isinstance(images, torch.Tensor) and tuple(images.shape) == (3, 2, 3, 16, 16)
    assert images.dtype == torch.uint8 and labels.tolist() == [0, 1, 2]


def hostile(clips: list[Record]) -> dict[str, Record]:
    good = clips[1]
    return {
        "not-mp4": good._replace(key="not-mp4", data=b"this is not a video" * 20),
        "truncated": good._replace(key="truncated", data=good.data[: len(good.data) // 2]),
        "huge": good._replace(key="huge", meta={**good.meta, "stored_width": 100_000, "stored_height": 100_000}),
        "liar": good._replace(key="liar", meta={**good.meta, "stored_width": 640, "stored_height": 480}),
        "too-many": good._replace(key="too-many", meta={**good.meta, "frames": 1}),
        "no-count": good._replace(key="no-count", meta={**good.meta, "frames": "many"}),
    }


@pytest.mark.parametrize("bad", ["not-mp4", "truncated", "huge", "liar", "too-many", "no-count"])
def test_a_hostile_clip_raises_or_is_skipped(tmp_path: Path, clips: list[Record], bad: str) -> None:
    records = [clips[0], hostile(clips)[bad], clips[2]]
    folder = write_output(tmp_path / "out", "webdataset", [records])
    with pytest.raises(ShardReadError, match=rf"^shard-000000\.tar: record {bad}: cannot decode") as raised:
        list(open_shards(folder).loader(3, 16, frames=4, output="numpy"))
    assert "\n" not in str(raised.value)
    with pytest.raises(ShardReadError, match=rf"^shard-000000\.tar: record {bad}: cannot decode") as raised:
        open_shards(folder)[1]
    assert "\n" not in str(raised.value)
    (batch,) = open_shards(folder, on_error="skip").loader(3, 16, frames=4, output="numpy")
    assert batch.keys == ["c0", "c2"] and batch.images.shape[0] == 2 and len(batch.offsets) == 2
    assert [s.key for s in open_shards(folder, on_error="skip")] == ["c0", "c2"]


def test_the_huge_clip_is_refused_before_decoding(tmp_path: Path, clips: list[Record]) -> None:
    folder = write_output(tmp_path / "out", "webdataset", [[hostile(clips)["huge"]]])
    with pytest.raises(ShardReadError, match="over the limit of"):
        open_shards(folder)[0]


def test_frames_and_what_the_output_holds_must_agree(tmp_path: Path, output: Path) -> None:
    images = [Record(f"i{i}", encode(picture(40, 30, i), "JPEG"), "jpg", i, {}) for i in range(3)]
    folder = write_output(tmp_path / "images", "webdataset", [images])
    with pytest.raises(ConfigError, match=r"record i0 is not a video clip: frames= reads clips only$"):
        list(open_shards(folder).loader(2, 16, frames=4))
    with pytest.raises(ConfigError, match=r"record c0 is a video clip: read clips with frames=T$"):
        list(open_shards(output).loader(2, 16))
    with pytest.raises(ConfigError, match="frames= \\(clips\\) takes no device=, mask= or boxes="):
        open_shards(output).loader(2, 16, frames=4, mask="seg.png")
    with pytest.raises(ConfigError, match="frames must be a positive integer"):
        open_shards(output).loader(2, 16, frames=0)


def test_decode_clip_is_what_sample_video_gives(clips: list[Record]) -> None:
    video = decode_clip(clips[3].data, clips[3].meta, 10**8)
    assert frame_numbers(video) == list(range(12, 23))


def test_torch_collates_clip_samples(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader

    records = [clip_record(f"c{i}", i, frames=4, first=i) for i in range(4)]
    folder = write_output(tmp_path / "out", "webdataset", [records])
    batches = list(DataLoader(open_shards(folder), batch_size=2))
    assert [tuple(b.video.shape) for b in batches] == [(2, 4, 48, 64, 3)] * 2
    assert batches[0].image == [None, None] and batches[1].label.tolist() == [2, 3]
    assert isinstance(batches[0].video, torch.Tensor) and batches[0].key == ["c0", "c1"]


@pytest.mark.slow
def test_torch_workers_read_every_clip_once(output: Path) -> None:
    pytest.importorskip("torch")
    from torch.utils.data import DataLoader

    open_shards(output)[0]  # a clip decoded here first: forked workers must not inherit swscale's threads
    loader = DataLoader(open_shards(output).iterable(), batch_size=None, num_workers=2, timeout=60)
    keys = [sample.key for sample in loader]
    assert sorted(keys) == [f"c{i}" for i in range(6)]


def test_a_whole_clip_over_the_memory_limit_is_refused_unread(clips: list[Record]) -> None:
    from shardkit.core.errors import ImageError

    meta = {**clips[0].meta, "frames": 18_000, "end": 18_000 / 8, "stored_width": 4096, "stored_height": 2160}
    with pytest.raises(ImageError, match="bytes of frames, over the limit of"):
        decode_clip(clips[0].data, meta, 10**9)


def test_a_clip_not_of_whole_macroblocks_decodes() -> None:
    record = clip_record("odd", 0, frames=3, width=70, height=46)
    assert decode_clip(record.data, record.meta, 10**8).shape == (3, 46, 70, 3)


@pytest.fixture(scope="module")
def packed_clips(tmp_path_factory: pytest.TempPathFactory) -> list[Record]:
    """The records of a real pack: one video cut into clips of 5 frames, 72x48."""
    from shardkit.core.manifest import read_manifest
    from shardkit.core.pack_options import pack_config
    from shardkit.formats import get_format
    from shardkit.packing.pack import pack
    from shardkit.synthetic import write_video

    source = tmp_path_factory.mktemp("video")
    write_video(source / "v.mp4", 96, 64, seconds=1.5, fps=20)
    out = tmp_path_factory.mktemp("packed") / "out"
    pack(pack_config(source, out, clip_seconds=0.5, clip_fps=10, resize=48, workers=1))
    manifest = read_manifest(out)
    reader = get_format(manifest.format).reader
    records = [record for shard in manifest.shards for record in reader(str(out / shard.name))]
    assert len(records) == 3 and {r.meta["frames"] for r in records} == {5}
    return records


def _tampered(record: Record, how: str) -> Record:
    """A packed clip record whose meta or MP4 a stranger changed, as it would reach a reader."""
    meta = record.meta
    if how == "nan-fps":
        return record._replace(meta={**meta, "fps": float("nan")})
    if how == "far-start":
        return record._replace(meta={**meta, "start": 1e308})
    if how == "declared-longer":  # a meta consistent in itself, 18,000 frames, over a clip of 5
        return record._replace(meta={**meta, "frames": 18_000, "end": meta["start"] + 18_000 / meta["fps"]})
    assert how == "swapped-longer"  # the MP4 swapped for a longer one of the same size
    frames = [video_frame(meta["stored_width"], meta["stored_height"], i) for i in range(400)]
    return record._replace(data=clip_mp4(frames, fps=10, preset="ultrafast", crf=40))


@pytest.mark.parametrize("name", ["webdataset", "lmdb"])
@pytest.mark.parametrize("how", ["nan-fps", "far-start", "declared-longer", "swapped-longer"])
def test_a_clip_whose_meta_and_content_disagree_fails_everywhere(
    tmp_path: Path, packed_clips: list[Record], name: str, how: str
) -> None:
    """verify --deep, Sample.video and the clip loader (a few frames of each clip) all refuse the
    tampered record, naming it; the untouched records read."""
    from shardkit.checks.verify import verify

    records = [packed_clips[0], _tampered(packed_clips[1], how), packed_clips[2]]
    folder = write_output(tmp_path / "out", name, [records])
    key = records[1].key
    report = verify(folder, deep=True)
    assert [p.key for p in report.problems] == [key], report.problems
    dataset = open_shards(folder)
    assert dataset[0].video.shape == (5, 48, 72, 3)
    with pytest.raises(ShardReadError, match=rf": record {key}: cannot decode") as raised:
        dataset[1]
    assert "\n" not in str(raised.value)
    with pytest.raises(ShardReadError, match=rf": record {key}: cannot decode"):
        list(open_shards(folder).loader(3, 16, frames=2, output="numpy"))
    (batch,) = open_shards(folder, on_error="skip").loader(3, 16, frames=2, output="numpy")
    assert batch.keys == [packed_clips[0].key, packed_clips[2].key]
