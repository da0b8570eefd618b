"""pack --clip-seconds: a folder of videos cut into clip records (core/clips.py's contract), checked
by decoding the clips: counts, timeline, frame sizes, rotation, which source frames they show."""

from __future__ import annotations

import io
import json
import math
import os
import platform
import shutil
import subprocess
import sys
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shardkit.checks.verify import verify
from shardkit.core.clips import CLIP_EXT, CLIP_META
from shardkit.core.config import ClipConfig, ResizeConfig
from shardkit.core.errors import ConfigError, ImageError, SourceError
from shardkit.core.manifest import ERRORS_NAME, read_manifest
from shardkit.core.pack_options import pack_config
from shardkit.formats import get_format
from shardkit.formats.base import Record
from shardkit.packing.clips import clip_key, cut
from shardkit.packing.pack import pack
from shardkit.synthetic import video_frame, write_video

from .helpers import killed_then_resumed

av = pytest.importorskip("av")

SECONDS, FPS, RESIZE = 0.5, 10, 48  # clips of 5 frames, short side 48


def _vfr(path: Path, times_ms: list[int], width: int = 96, height: int = 64) -> None:
    """An H.264 MP4 whose frames are shown at `times_ms` (a variable frame rate)."""
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=25)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.codec_context.time_base = Fraction(1, 1000)
        for index, ms in enumerate(times_ms):
            frame = av.VideoFrame.from_ndarray(video_frame(width, height, index), format="rgb24")
            frame.pts, frame.time_base = ms, Fraction(1, 1000)
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


class _Pipe(io.RawIOBase):
    """A file that cannot seek: the muxer writes no duration in the header (as a live stream)."""

    def __init__(self, path: Path) -> None:
        self.file = path.open("wb")

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def write(self, data: Any) -> int:
        return self.file.write(data)

    def close(self) -> None:
        self.file.close()
        super().close()


def _streamed_webm(path: Path, seconds: float = 1.0, fps: int = 24) -> None:
    pipe = _Pipe(path)
    with av.open(pipe, "w", format="webm") as container:
        stream = container.add_stream("libvpx-vp9", rate=fps)
        stream.width, stream.height, stream.pix_fmt = 96, 64, "yuv420p"
        for index in range(round(seconds * fps)):
            frame = av.VideoFrame.from_ndarray(video_frame(96, 64, index), format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    pipe.close()


def zeroed(mp4: bytes) -> bytes:
    """An MP4 whose frames are zeros (its header and index intact)."""
    data = bytearray(mp4)
    start = data.find(b"mdat") + 4
    data[start : start + (len(data) - start) // 2] = bytes((len(data) - start) // 2)
    return bytes(data)


def _rotated(path: Path, degrees: int, seconds: float = 1.0) -> None:
    write_video(path, 96, 64, seconds, 24, gop=None, rotation=(degrees, False, False))


VFR_MS = [0, 40, 60, 140, 160, 240, 300, 320, 420, 460, 500, 580, 640, 700, 720, 800, 900, 960, 1000, 1100]

# name -> expected clip count by the rule floor((duration - S) / stride) + 1, duration = last frame + one frame
EXPECTED = {"cat/a.mp4": 4, "cat/b.webm": 2, "cat/streamed.webm": 2, "dog/c.avi": 2, "dog/d.mkv": 2,
            "dog/rot.mp4": 2, "dog/vfr.mp4": 2}  # fmt: skip
HOSTILE = {"bad/empty_text.mp4", "bad/header_only.mp4", "bad/truncated.mp4", "bad/short.mp4", "bad/zeroed.mp4"}


@pytest.fixture(scope="module")
def videos(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("videos")
    write_video(root / "cat/a.mp4", 96, 64, seconds=2.0, fps=24)
    write_video(root / "cat/b.webm", 96, 64, seconds=1.0, fps=24, seed=1)
    _streamed_webm(root / "cat/streamed.webm")
    write_video(root / "dog/c.avi", 96, 64, seconds=1.0, fps=20, seed=2)
    write_video(root / "dog/d.mkv", 96, 64, seconds=1.0, fps=25, seed=3)
    _rotated(root / "dog/rot.mp4", 90)
    _vfr(root / "dog/vfr.mp4", VFR_MS)
    (root / "dog/notes.jpg").write_bytes(b"an image beside videos")  # listed: a pack of videos takes videos
    bad = root / "bad"
    write_video(bad / "short.mp4", 96, 64, seconds=0.25, fps=24)
    whole = (root / "cat/a.mp4").read_bytes()
    (bad / "truncated.mp4").write_bytes(whole[: len(whole) // 2])  # its moov box, at the end, is gone
    (bad / "header_only.mp4").write_bytes(whole[:40])
    (bad / "empty_text.mp4").write_text("not a video at all\n")
    (bad / "zeroed.mp4").write_bytes(zeroed(whole))
    (root / "dog/clip.png").write_bytes(b"")  # an image where videos are packed: listed
    return root


@pytest.fixture(scope="module")
def packed(videos: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("packed") / "out"
    config = pack_config(videos, out, clip_seconds=SECONDS, clip_fps=FPS, resize=RESIZE, workers=1, shard_size=3)
    pack(config)
    return out


def _records(out: Path) -> list[Record]:
    manifest = read_manifest(out)
    backend = get_format(manifest.format)
    return [record for shard in manifest.shards for record in backend.reader(str(out / shard.name))]


def _frames(data: bytes) -> tuple[list[np.ndarray], list[tuple[int, bool]], Any]:
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        decoded = list(container.decode(stream))
        info = (stream.codec_context.name, stream.codec_context.pix_fmt, stream.average_rate)
    return [f.to_ndarray(format="gray") for f in decoded], [(f.pts, f.key_frame) for f in decoded], info


def _source_frames(path: Path) -> list[tuple[float, float]]:
    """The source's (time, marker) per frame: its top-left block's luma (the frame number x 8)."""
    with av.open(str(path)) as container:
        return [(f.time, float(f.to_ndarray(format="gray")[2:6, 2:6].mean())) for f in container.decode(video=0)]


def test_every_video_is_cut_into_clips_or_listed(packed: Path) -> None:
    records = _records(packed)
    by_source: dict[str, list[Record]] = {}
    for record in records:
        by_source.setdefault(record.meta["source"], []).append(record)
    assert {name: len(clips) for name, clips in by_source.items()} == EXPECTED
    errors = {row["path"]: row for row in map(json.loads, (packed / "errors.jsonl").read_text().splitlines())}
    assert set(errors) == HOSTILE | {"dog/notes.jpg", "dog/clip.png"}
    assert errors["bad/zeroed.mp4"]["stage"] == "decode"
    assert errors["bad/short.mp4"]["stage"] == "clip" and "shorter than one clip" in errors["bad/short.mp4"]["reason"]
    assert errors["bad/empty_text.mp4"]["stage"] == "header"
    assert errors["bad/header_only.mp4"]["stage"] == "header"
    assert errors["bad/truncated.mp4"]["stage"] in ("header", "decode")
    assert "takes the videos only" in errors["dog/notes.jpg"]["reason"]
    totals = read_manifest(packed).totals
    assert totals == {"inputs": 14, "records": sum(EXPECTED.values()), "errors": 7, "videos": 7}
    assert verify(packed).ok and verify(packed, deep=True).ok


def test_verify_source_accounts_for_every_video_once(packed: Path, videos: Path, tmp_path: Path) -> None:
    """--source walks the videos as the pack did: each video is packed (by however many clips) or
    listed, once; a video added since is lost."""
    report = verify(packed, source=videos)
    assert report.ok, report.problems
    grown = tmp_path / "grown"
    shutil.copytree(videos, grown)
    write_video(grown / "cat/new.mp4", 96, 64, seconds=1.0, fps=24)
    problems = verify(packed, source=grown).problems
    assert [(p.kind, p.detail) for p in problems] == [
        ("lost", f"source file cat/new.mp4 is neither packed nor in {ERRORS_NAME}")
    ]


def test_clips_follow_the_contract(packed: Path) -> None:
    classes = read_manifest(packed).classes
    for record in _records(packed):
        meta = record.meta
        assert record.ext == CLIP_EXT and set(CLIP_META) <= set(meta)
        number = int(record.key.rsplit("_", 1)[1])
        assert "." not in record.key and record.key == clip_key(record.key.rsplit("_", 1)[0], number)
        assert classes[record.label] == meta["source"].split("/")[0]
        assert meta["frames"] == SECONDS * FPS and meta["fps"] == FPS
        assert meta["end"] == pytest.approx(meta["start"] + SECONDS)
        assert meta["start"] == pytest.approx(number * SECONDS, abs=1e-3)  # the first frame is at 0 here
        frames, stamps, (codec, pix_fmt, rate) = _frames(record.data)
        assert (codec, pix_fmt, rate) == ("h264", "yuv420p", FPS)
        assert len(frames) == meta["frames"] and stamps[0][1] and stamps == sorted(stamps)
        height, width = frames[0].shape[:2]
        assert (width, height) == (meta["stored_width"], meta["stored_height"])
        assert min(width, height) == RESIZE
        turned = meta["source"] == "dog/rot.mp4"
        assert (meta["width"], meta["height"]) == ((64, 96) if turned else (96, 64))


def test_clip_frames_are_the_source_frames_at_their_times(packed: Path, videos: Path) -> None:
    errors: list[float] = []
    for record in _records(packed):
        meta = record.meta
        source = _source_frames(videos / meta["source"])
        frames, _, _ = _frames(record.data)
        turned = meta["source"] == "dog/rot.mp4"
        for j, frame in enumerate(frames):
            target = meta["start"] + j / meta["fps"]
            shown = [i for i, (t, _) in enumerate(source) if t <= target + 0.002][-1]
            corner = frame[-4:-1, 1:4] if turned else frame[1:4, 1:4]  # rotated 90 ccw: top-left goes bottom-left
            # H.264 at crf 23 moves a flat block by a few levels (8 at worst seen, on a P frame of a tiny
            # clip); a frame before or after would be 8-10 away every time
            error = abs(float(corner.mean()) - source[shown][1])
            assert error <= 10, (meta["source"], meta["start"], j)
            errors.append(error)
    assert np.mean(errors) < 2.5  # one frame off would be ~8 on average


@pytest.mark.slow  # two more packs
def test_all_formats_hold_the_same_clips(packed: Path, videos: Path, tmp_path: Path) -> None:
    expected = {r.key: (r.data, r.label, r.meta) for r in _records(packed)}
    for name in ("lmdb", "hdf5"):
        out = tmp_path / name
        config = pack_config(
            videos, out, clip_seconds=SECONDS, clip_fps=FPS, resize=RESIZE, workers=1, shard_size=3, format=name
        )
        pack(config)
        assert {r.key: (r.data, r.label, r.meta) for r in _records(out)} == expected
        assert verify(out).ok


def test_clip_stride_and_a_first_frame_after_zero(tmp_path: Path) -> None:
    _vfr(tmp_path / "late.mp4", [500 + 40 * i for i in range(50)])  # 2 s of video from t = 0.5 s
    made = cut(str(tmp_path / "late.mp4"), "late.mp4", ClipConfig(1.0, 0.25, 10), ResizeConfig(), 10**8)
    assert len(made) == math.floor((2.0 - 1.0) / 0.25) + 1
    assert [c.meta["start"] for c in made] == pytest.approx([0.5, 0.75, 1.0, 1.25, 1.5])
    assert made[0].meta["stored_width"] == 96  # no --resize: the source's size


def test_a_span_from_0_takes_a_first_frame_shown_a_frame_late(tmp_path: Path) -> None:
    """Annotations start at 0; some files show their first frame a frame later: within one frame
    it stands in; more than that is a span before the video, refused."""
    from shardkit.packing.clips import cut_span
    from shardkit.packing.sources.item import Span

    _vfr(tmp_path / "late.mp4", [40 + 40 * i for i in range(25)])  # 25 fps, the first frame at 40 ms
    clip = cut_span(str(tmp_path / "late.mp4"), "late.mp4", Span(0.0, 0.4, "t line 2"), ClipConfig(1.0, None, 10),
                    ResizeConfig(), 10**8)  # fmt: skip
    assert clip.meta["start"] == 0.0 and clip.meta["frames"] == 4
    _vfr(tmp_path / "later.mp4", [200 + 40 * i for i in range(25)])
    with pytest.raises(ImageError, match="before the video's first frame"):
        cut_span(str(tmp_path / "later.mp4"), "later.mp4", Span(0.0, 0.4, "t line 2"), ClipConfig(1.0, None, 10),
                 ResizeConfig(), 10**8)  # fmt: skip


def test_a_header_over_max_pixels_is_refused_before_decoding(videos: Path) -> None:
    with pytest.raises(ImageError) as refused:
        cut(str(videos / "cat/a.mp4"), "cat/a.mp4", ClipConfig(0.5), ResizeConfig(), 96 * 64 - 1)
    assert refused.value.stage == "header" and "over the limit" in refused.value.reason


def test_clip_options_are_validated(videos: Path, tmp_path: Path) -> None:
    for bad in ({"clip_seconds": 0}, {"clip_seconds": -1}, {"clip_seconds": 1, "clip_stride": 0},
                {"clip_seconds": 1, "clip_fps": 0}, {"clip_fps": 10}, {"clip_seconds": float("nan")}):  # fmt: skip
        with pytest.raises(ConfigError):
            pack_config(videos, tmp_path / "out", **bad)
    with pytest.raises(ConfigError, match="--dedup"):
        pack(pack_config(videos, tmp_path / "out", clip_seconds=1, dedup="exact"))
    with pytest.raises(SourceError, match="--clip-seconds"):  # a folder of videos packed as images
        pack(pack_config(videos / "cat", tmp_path / "out2"))


def _pack_cli(source: Path, out: Path, *extra: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "shardkit", "pack", str(source), str(out), "--clip-seconds", "0.5",
               "--clip-fps", "10", "--resize", "48", "--shard-size", "1", "--workers", "1", *extra]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent), **(env or {})}
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


@pytest.mark.slow  # packs three times in processes of their own
@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="MALLOC_PERTURB_ is glibc's")
def test_clip_bytes_do_not_depend_on_what_malloc_hands_the_encoder(videos: Path, tmp_path: Path) -> None:
    """x264's macroblock tree read memory it had not written: a rotated video's clips changed with
    MALLOC_PERTURB_ (85 against 255), and about one run in 100 under load gave another clip of the
    variable-frame-rate one, so a killed pack did not resume to the same bytes."""
    outputs = []
    for perturb in ("85", "255", "1"):
        out = tmp_path / f"perturb-{perturb}"
        process = _pack_cli(videos, out, env={"MALLOC_PERTURB_": perturb})
        _, stderr = process.communicate(timeout=120)
        assert process.returncode == 0, stderr
        outputs.append({shard.name: shard.sha256 for shard in read_manifest(out).shards})
    assert outputs[0] == outputs[1] == outputs[2]


@pytest.mark.slow  # kills a process
def test_sigkill_then_resume_gives_the_same_clips(videos: Path, packed: Path, tmp_path: Path) -> None:
    out, clean = tmp_path / "killed", tmp_path / "clean"
    shards, clean_shards = killed_then_resumed(_pack_cli, videos, out, clean)
    assert shards == clean_shards
    assert (out / "errors.jsonl").read_bytes() == (clean / "errors.jsonl").read_bytes()
    assert verify(out).ok


def test_a_metadata_table_gives_each_clip_its_video_caption_and_columns(videos: Path, tmp_path: Path) -> None:
    source = tmp_path / "src"
    (source / "v").mkdir(parents=True)
    os.link(videos / "cat/b.webm", source / "v/b.webm")
    os.link(videos / "dog/d.mkv", source / "unnamed.mkv")
    rows = [{"file_name": "v/b.webm", "caption": "a moving picture", "place": "here"},
            {"file_name": "v/gone.mp4", "caption": "no such file"}]  # fmt: skip
    (source / "metadata.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "out"
    pack(pack_config(source, out, clip_seconds=SECONDS, workers=1))
    records = _records(out)
    assert [r.key for r in records] == ["v/b_000000", "v/b_000001"]
    assert {(r.text, json.dumps(r.columns)) for r in records} == {("a moving picture", '{"place": "here"}')}
    errors = {row["path"]: row["reason"] for row in map(json.loads, (out / "errors.jsonl").read_text().splitlines())}
    assert set(errors) == {"unnamed.mkv", "v/gone.mp4"} and "no row" in errors["unnamed.mkv"]
    assert verify(out).ok


def test_a_timestamp_jump_is_refused_not_cut_into_a_million_clips(tmp_path: Path) -> None:
    _vfr(tmp_path / "jump.mp4", [0, 40, 80, 120, 100_000, 100_040])  # 100 s between two frames
    with pytest.raises(ImageError) as refused:
        cut(str(tmp_path / "jump.mp4"), "jump.mp4", ClipConfig(0.04), ResizeConfig(), 10**8)
    assert refused.value.stage == "decode" and "timestamps jump" in refused.value.reason


@pytest.mark.slow  # (a bench of four passes)
def test_bench_compares_the_clips_with_their_source_videos(packed: Path, videos: Path) -> None:
    from shardkit.checks.bench import bench
    from shardkit.checks.bench_report import VIDEO_BASELINE

    report = bench(packed, against=videos, repeat=1, train=32)
    rows = {row.name: row for row in report.rows}
    clips = sum(EXPECTED.values())
    assert (report.baseline, report.unit, report.images) == (VIDEO_BASELINE, "clips", clips)
    assert list(rows) == [
        VIDEO_BASELINE,
        "shards: clips, PyAV",
        "shards: bytes only (I/O)",
        "train 32: shards clip loader",
    ]
    assert all(row.images == clips for row in report.rows) and report.ratio("shards: clips, PyAV") is not None


def _corner_picture(width: int = 96, height: int = 64) -> np.ndarray:
    """A picture no turn or mirror maps onto itself: a bright block at the top-left corner, a
    mid-gray one at the top-right, dark elsewhere."""
    pixels = np.full((height, width, 3), 16, np.uint8)
    pixels[:16, :16] = 240
    pixels[:16, -24:] = 128
    return pixels


def _oriented(path: Path, degrees: int, hflip: bool, vflip: bool, seconds: float = 0.5) -> None:
    """An H.264 MP4 of _corner_picture whose display matrix turns it `degrees` counter-clockwise,
    then mirrors it (PyAV's set_display_rotation)."""
    write_video(
        path, 96, 64, seconds, 24, gop=None, rotation=(degrees, hflip, vflip), picture=lambda _: _corner_picture()
    )


# name -> (degrees counter-clockwise, hflip, vflip) of the display matrix
ORIENTED = {"hflip": (0, True, False), "vflip": (0, False, True), "transpose": (270, True, False),
            "turn90": (90, False, False), "antitranspose": (90, True, False),
            "turn180": (180, False, False)}  # fmt: skip


def _as_displayed(degrees: int, hflip: bool, vflip: bool) -> np.ndarray:
    """_corner_picture as a player shows it: turned counter-clockwise, then mirrored."""
    shown = np.rot90(_corner_picture(), degrees // 90)
    if hflip:
        shown = shown[:, ::-1]
    if vflip:
        shown = shown[::-1]
    return np.ascontiguousarray(shown)


@pytest.fixture(scope="module")
def oriented_firsts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, np.ndarray]:
    """The first frame of each ORIENTED video's first clip, packed in one pack."""
    source = tmp_path_factory.mktemp("oriented")
    for name, (degrees, hflip, vflip) in ORIENTED.items():
        _oriented(source / f"{name}.mp4", degrees, hflip, vflip)
    out = tmp_path_factory.mktemp("oriented_out") / "out"
    pack(pack_config(source, out, clip_seconds=0.25, clip_fps=8, workers=1))
    firsts = {}
    for record in _records(out):
        if record.key.endswith("_000000"):
            with av.open(io.BytesIO(record.data)) as container:
                firsts[record.meta["source"]] = next(container.decode(video=0)).to_ndarray(format="rgb24")
    assert set(firsts) == {f"{name}.mp4" for name in ORIENTED}
    return firsts


@pytest.mark.parametrize("name", list(ORIENTED))
def test_a_mirrored_or_transposed_video_is_packed_as_displayed(
    oriented_firsts: dict[str, np.ndarray], name: str
) -> None:
    """Each display matrix of a turn and a mirror: the clip's first frame is the picture as a
    player shows it, nearer to it than to any other of the eight orientations."""
    frame = oriented_firsts[f"{name}.mp4"].astype(np.float64)
    expected = _as_displayed(*ORIENTED[name])
    assert frame.shape == expected.shape
    candidates = {(d, h): _as_displayed(d, h, False) for d in (0, 90, 180, 270) for h in (False, True)}
    distances = {turn: float(np.abs(shown - frame).mean()) for turn, shown in candidates.items()
                 if shown.shape == frame.shape}  # fmt: skip
    nearest = min(distances, key=distances.__getitem__)
    assert np.array_equal(candidates[nearest], expected), nearest
    assert float(np.abs(expected - frame).mean()) < 8


def test_a_jpeg_named_mp4_gets_the_probes_verdict_from_pack(tmp_path: Path) -> None:
    from shardkit.packing.video_probe import probe_video
    from shardkit.synthetic import encode, picture

    source = tmp_path / "src"
    write_video(source / "good.mp4", 96, 64, seconds=1.0, fps=24)
    (source / "photo.mp4").write_bytes(encode(picture(96, 64), "JPEG"))
    out = tmp_path / "out"
    pack(pack_config(source, out, clip_seconds=SECONDS, workers=1))
    errors = {row["path"]: row for row in map(json.loads, (out / "errors.jsonl").read_text().splitlines())}
    verdict = probe_video(str(source / "photo.mp4"), "photo.mp4").error
    assert verdict == "not a video: no MP4, Matroska or AVI header"
    assert set(errors) == {"photo.mp4"}
    assert (errors["photo.mp4"]["stage"], errors["photo.mp4"]["reason"]) == ("header", verdict)
