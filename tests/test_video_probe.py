"""probe of a folder of videos: the census from PyAV (duration, fps, variable frame rate, size as
displayed, codecs, audio), hostile files counted as not readable, and --json's `videos` object."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardkit.packing.video_probe import probe_video, probe_videos, sniff
from shardkit.synthetic import write_video
from tests.inprocess import run_cli
from tests.test_video_pack import ORIENTED, VFR_MS, _oriented, _rotated, _streamed_webm, _vfr, zeroed

av = pytest.importorskip("av")


@pytest.fixture(scope="module")
def videos(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("probe_videos")
    write_video(root / "a/one.mp4", 96, 64, seconds=1.0, fps=24)
    write_video(root / "a/long.mp4", 96, 64, seconds=3.0, fps=30)  # B-frames past the packets read
    write_video(root / "a/two.webm", 128, 96, seconds=0.5, fps=24)
    write_video(root / "b/three.avi", 96, 64, seconds=1.0, fps=20)
    write_video(root / "b/four.mkv", 96, 64, seconds=1.0, fps=25)
    _streamed_webm(root / "b/streamed.webm", seconds=1.0)
    _rotated(root / "b/turned.mp4", 90)
    _vfr(root / "b/vfr.mp4", VFR_MS)
    whole = (root / "a/one.mp4").read_bytes()
    (root / "b/text.mp4").write_text("not a video\n")
    (root / "b/truncated.mp4").write_bytes(whole[: len(whole) // 2])
    (root / "b/header_only.mp4").write_bytes(whole[:40])
    (root / "b/zeroed.mp4").write_bytes(zeroed(whole))
    return root


def test_each_video_as_displayed(videos: Path) -> None:
    one = probe_video(str(videos / "a/one.mp4"), "a/one.mp4")
    assert (one.error, one.container, one.codec, one.pix_fmt) == (None, "mp4", "h264", "yuv420p")
    assert (one.width, one.height, one.fps, one.frames, one.vfr, one.audio) == (96, 64, 24.0, 24, False, 0)
    assert one.duration == pytest.approx(1.0, abs=0.05)
    turned = probe_video(str(videos / "b/turned.mp4"), "b/turned.mp4")
    assert (turned.width, turned.height, turned.rotation) == (64, 96, 90)
    assert probe_video(str(videos / "b/vfr.mp4"), "b/vfr.mp4").vfr
    assert not probe_video(str(videos / "a/long.mp4"), "a/long.mp4").vfr
    streamed = probe_video(str(videos / "b/streamed.webm"), "b/streamed.webm")
    assert streamed.error is None and streamed.codec == "vp9"
    assert streamed.duration == pytest.approx(1.0, abs=0.1)  # from the packets: the header has none
    assert probe_video(str(videos / "b/three.avi"), "b/three.avi").codec == "mpeg4"
    assert probe_video(str(videos / "b/text.mp4"), "b/text.mp4").error.startswith("not a video")
    assert probe_video(str(videos / "a/one.mp4"), "a/one.mp4", max_pixels=100).error.startswith("96x64 is over")
    assert (
        probe_video(str(videos / "b/zeroed.mp4"), "zeroed.mp4").error
        == "cannot read: Invalid data found when processing input"
    )
    for name in ("truncated.mp4", "header_only.mp4"):
        assert probe_video(str(videos / "b" / name), name).error is not None
    assert sniff(b"\x00\x00\x00\x18ftypisom") == "mp4" and sniff(b"RIFF\x00\x00\x00\x00AVI ") == "avi"


def test_census_and_json(videos: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    report = probe_videos(videos, workers=1)
    assert (report.files, report.videos, report.vfr, report.rotated) == (12, 8, 1, 1)
    assert report.codecs == {"h264": 5, "vp9": 2, "mpeg4": 1}
    assert sum(report.problems.values()) == 4
    assert report.recommendation is not None and report.recommendation.fps == 24
    out = tmp_path / "probe.json"
    result = run_cli(capfd, "probe", videos, "--json", out, "--workers", "1")
    assert result.returncode == 0, result.stderr
    assert "8 readable videos" in result.stdout and "recommendation" in result.stdout
    data = json.loads(out.read_text())["videos"]
    assert data["count"] == 8 and data["codecs"]["h264"] == 5
    assert set(data["distributions"]) == {"duration", "fps", "width", "height"}


def test_the_census_tells_a_mirror_from_a_turn(tmp_path: Path) -> None:
    """The display matrix read whole: a mirror is counted as mirrored, not as a half turn; a
    transpose as a three-quarter turn and a mirror, its sides swapped."""
    expected = {"hflip": (0, True, 96, 64), "vflip": (180, True, 96, 64), "transpose": (270, True, 64, 96),
                "turn90": (90, False, 64, 96), "antitranspose": (90, True, 64, 96),
                "turn180": (180, False, 96, 64)}  # fmt: skip
    for name, (degrees, hflip, vflip) in ORIENTED.items():
        _oriented(tmp_path / f"{name}.mp4", degrees, hflip, vflip)
    found = {}
    for name in ORIENTED:
        row = probe_video(str(tmp_path / f"{name}.mp4"), f"{name}.mp4")
        assert row.error is None
        found[name] = (row.rotation, row.mirrored, row.width, row.height)
    assert found == expected
    report = probe_videos(tmp_path, workers=1)
    assert (report.videos, report.rotated, report.mirrored) == (6, 5, 4)
    assert report.to_json()["mirrored"] == 4
