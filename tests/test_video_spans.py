"""pack --clip-seconds with a span table: a metadata table of videos with `start` and `end` columns
is one clip a row, that span of its video, with the row's caption; bad rows listed at their line."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from shardkit.checks.verify import verify
from shardkit.core.clips import CLIP_META
from shardkit.core.errors import ConfigError
from shardkit.core.manifest import read_manifest
from shardkit.core.pack_options import pack_config
from shardkit.formats import get_format
from shardkit.formats.base import Record
from shardkit.packing.pack import pack
from shardkit.synthetic import write_video

from .helpers import killed_then_resumed

av = pytest.importorskip("av")

FPS, RESIZE = 10, 48
ROWS = """file_name,start,end,caption
a.mp4,0,0.5,the start
a.mp4,0.25,0.75,overlapping it
a.mp4,1.2,1.7,late: decoded from a keyframe after 0
b.webm,0.5,1.0,the other video
a.mp4,1,0.5,ends before it starts
a.mp4,soon,1,not a number
a.mp4,,1,no start
a.mp4,1.8,2.5,past the end
gone.mp4,0,1,no such file
a.mp4,-1,0.5,before the first frame
a.mp4,0,2000,too many frames
"""
Packed = tuple[Path, list[Record]]  # the output folder, its records
GOOD = {2: (0.0, 0.5), 3: (0.25, 0.75), 4: (1.2, 1.7), 5: (0.5, 1.0)}  # line: span


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("spans")
    write_video(root / "a.mp4", 96, 64, seconds=2.0, fps=24, gop=12)
    write_video(root / "b.webm", 96, 64, seconds=1.5, fps=20, seed=1)
    write_video(root / "unnamed.mp4", 96, 64, seconds=0.5, fps=24)  # no row: listed
    (root / "metadata.csv").write_text(ROWS)
    return root


def _pack(source: Path, out: Path, **options: object) -> list[Record]:
    pack(pack_config(source, out, clip_seconds=1, clip_fps=FPS, resize=RESIZE, workers=1, shard_size=3, **options))
    manifest = read_manifest(out)
    backend = get_format(manifest.format)
    return [record for shard in manifest.shards for record in backend.reader(str(out / shard.name))]


@pytest.fixture(scope="module")
def packed(source: Path, tmp_path_factory: pytest.TempPathFactory) -> Packed:
    out = tmp_path_factory.mktemp("packed") / "out"
    return out, _pack(source, out)


def _marker(path: Path) -> list[tuple[float, float]]:
    """The source's (time, marker) per frame: its top-left block's luma (the frame number x 8)."""
    with av.open(str(path)) as container:
        return [(f.time, float(f.to_ndarray(format="gray")[2:6, 2:6].mean())) for f in container.decode(video=0)]


def test_each_row_is_one_clip_of_its_span_with_its_caption(packed: Packed, source: Path) -> None:
    _, records = packed
    assert [r.key for r in records] == ["a_000000002", "a_000000003", "a_000000004", "b_000000005"]
    lines = ROWS.splitlines()
    for record in records:
        line = int(record.key.rsplit("_", 1)[1])
        meta = record.meta
        assert set(CLIP_META) <= set(meta) and (meta["start"], meta["end"]) == GOOD[line]
        assert record.text == lines[line - 1].split(",", 3)[3] and record.columns is None  # start, end: in meta
        assert meta["source"] == lines[line - 1].split(",")[0] and meta["fps"] == FPS
        with av.open(io.BytesIO(record.data)) as clip:
            frames = [f.to_ndarray(format="gray") for f in clip.decode(video=0)]
        assert len(frames) == meta["frames"] == round((meta["end"] - meta["start"]) * FPS)
        assert min(frames[0].shape) == RESIZE
        shown = _marker(source / meta["source"])
        for j, frame in enumerate(frames):  # frame j: the source frame shown at start + j / F
            target = meta["start"] + j / FPS
            expected = [marker for t, marker in shown if t <= target + 0.002][-1]
            assert abs(float(frame[1:4, 1:4].mean()) - expected) <= 10, (record.key, j)


def test_bad_rows_are_listed_at_their_line(packed: Packed) -> None:
    out, _ = packed
    rows = [json.loads(line) for line in (out / "errors.jsonl").read_text().splitlines()]
    by_line = {row["reason"].split(":")[0]: row for row in rows if row["reason"].startswith("metadata.csv")}
    reasons = {where.rsplit(" ", 1)[1]: row["reason"] for where, row in by_line.items()}
    assert sorted(reasons, key=int) == ["6", "7", "8", "9", "10", "11", "12"]
    assert "not after start" in reasons["6"] and "not a number" in reasons["7"] and "no start" in reasons["8"]
    assert "past the video's end" in reasons["9"] and "no such file" in reasons["10"].lower()
    assert "before the video's first frame" in reasons["11"] and "20000 frames" in reasons["12"]
    assert {row["path"] for row in rows} == {"a.mp4", "gone.mp4", "unnamed.mp4"}
    totals = read_manifest(out).totals
    assert totals == {"inputs": 12, "records": 4, "errors": 8, "videos": 4}  # an input a row (and the unrowed video)


def test_verify_accounts_for_every_row(packed: Packed, source: Path) -> None:
    out, _ = packed
    for report in (verify(out), verify(out, deep=True), verify(out, source=source)):
        assert report.ok, report.problems


def test_clip_stride_is_refused_for_a_span_table(source: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="leave out --clip-stride"):
        pack(pack_config(source, tmp_path / "out", clip_seconds=1, clip_stride=0.5))


@pytest.mark.slow  # two more packs
def test_a_repack_and_another_format_hold_the_same_clips(packed: Packed, source: Path, tmp_path: Path) -> None:
    _, records = packed
    again = _pack(source, tmp_path / "again")
    assert [(r.key, r.data) for r in again] == [(r.key, r.data) for r in records]  # deterministic
    lmdb = _pack(source, tmp_path / "lmdb", format="lmdb")
    assert [(r.key, r.text, r.meta) for r in lmdb] == [(r.key, r.text, r.meta) for r in records]
    assert np.all([a.data == b.data for a, b in zip(lmdb, records, strict=True)])
    assert verify(tmp_path / "lmdb", deep=True, source=source).ok


def _pack_cli(source: Path, out: Path, *extra: str) -> subprocess.Popen[str]:
    options = ["--clip-seconds", "1", "--clip-fps", str(FPS), "--resize", str(RESIZE), "--workers", "1"]
    command = [sys.executable, "-m", "shardkit", "pack", str(source), str(out), *options, "--shard-size", "2", *extra]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


@pytest.mark.slow  # kills a process
def test_sigkill_then_resume_gives_the_same_clips(source: Path, tmp_path: Path) -> None:
    many = tmp_path / "many"
    many.mkdir()
    os.link(source / "a.mp4", many / "a.mp4")
    spans = "".join(f"a.mp4,{i * 0.05:.2f},{i * 0.05 + 0.8:.2f},row {i}\n" for i in range(24))
    (many / "metadata.csv").write_text("file_name,start,end,caption\n" + spans)
    out = tmp_path / "killed"
    shards, clean_shards = killed_then_resumed(_pack_cli, many, out, tmp_path / "clean")
    assert len(shards) == 12 and shards == clean_shards
    assert verify(out, deep=True, source=many).ok


HOSTILE_ROWS = """file_name,start,end
a.mp4,0.25,7.5E-1
a.mp4,-1e308,1e308
a.mp4,0,0_5
a.mp4,\u0660,0.5
a.mp4,1e15,1000000000000001
"""


def test_a_span_cell_is_a_plain_number_and_any_span_is_listed_plainly(source: Path, tmp_path: Path) -> None:
    """A cell in Python-only syntax (an underscore, other digits) is not a number of seconds; a span
    no video holds (of infinite length, past any timestamp) is listed with its reason at the clip
    stage, as a span past a video's end is, never as shardkit's own error."""
    folder = tmp_path / "src"
    folder.mkdir()
    os.link(source / "a.mp4", folder / "a.mp4")
    (folder / "metadata.csv").write_text(HOSTILE_ROWS, encoding="utf-8")
    out = tmp_path / "out"
    records = _pack(folder, out)
    assert [(r.key, r.meta["start"], r.meta["end"]) for r in records] == [("a_000000002", 0.25, 0.75)]
    rows = [json.loads(line) for line in (out / "errors.jsonl").read_text().splitlines()]
    listed = {row["reason"].split(":")[0].rsplit(" ", 1)[1]: (row["stage"], row["reason"]) for row in rows}
    assert sorted(listed, key=int) == ["3", "4", "5", "6"]
    assert listed["3"] == ("clip", "metadata.csv line 3: the span from -1e+308 s to 1e+308 s is longer than any video")
    assert listed["4"] == ("discover", "metadata.csv line 4: end '0_5' is not a number of seconds")
    assert listed["5"] == ("discover", "metadata.csv line 5: start '\u0660' is not a number of seconds")
    assert listed["6"][0] == "clip" and "past the video's end" in listed["6"][1]


def test_rows_added_to_the_table_append_though_a_row_of_their_video_failed(source: Path, tmp_path: Path) -> None:
    """An append of the grown table packs each new row: a row of a video that failed before (past
    its end, no such number) fails as that row, and leaves the video's other rows alone."""
    from shardkit.changes.append import append

    grown = tmp_path / "src"
    shutil.copytree(source, grown)
    out = tmp_path / "out"
    before = _pack(grown, out)
    with open(grown / "metadata.csv", "a") as rows:
        rows.write("a.mp4,0.5,1.0,new a\nb.webm,0,0.5,new b\n")
    result = append(grown, out)
    assert (result.records, result.inputs) == (2, 2)
    manifest = read_manifest(out)
    backend = get_format(manifest.format)
    after = [record for shard in manifest.shards for record in backend.reader(str(out / shard.name))]
    assert [record.text for record in after[len(before) :]] == ["new a", "new b"]
    assert append(grown, out).inputs == 0
