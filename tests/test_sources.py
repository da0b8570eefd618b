"""The `Source` contract: each convention is found by `open` in `SOURCES`' order and walked into a
`SourceWalk` whose `source` names its kind; what a pack cannot take from a source is refused before
the walk reads anything; a new convention is one class and its line in `SOURCES`; a `Reading`
hands each item's outcome back in the shard's order."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from shardkit.core.config import EncodeConfig, ResizeConfig
from shardkit.core.errors import ConfigError, SourceError
from shardkit.core.pack_options import pack_config
from shardkit.packing import sources
from shardkit.packing.pack import pack, prepare
from shardkit.packing.reading import Files, Packing
from shardkit.packing.sources import SOURCES, Item, SourceWalk, WalkOptions, open_source, walk
from shardkit.packing.sources.base import Labelling
from shardkit.packing.sources.folder import FolderSource, from_folder
from shardkit.packing.sources.labelling import labelling
from shardkit.synthetic import write_image


def _images(root: Path, names: list[str]) -> Path:
    for name in names:
        write_image(root / name, 24, 16)
    return root


def test_each_convention_is_found_and_names_its_kind(tmp_path: Path) -> None:
    classes = _images(tmp_path / "classes", ["cat/1.jpg", "dog/2.jpg"])
    flat = _images(tmp_path / "flat", ["1.jpg", "2.jpg"])
    listed = tmp_path / "list.txt"
    listed.write_text("flat/1.jpg\nflat/2.jpg\n")
    table = _images(tmp_path / "table", ["a.jpg"])
    (table / "metadata.csv").write_text("file_name,caption\na.jpg,a cat\n")
    sidecars = _images(tmp_path / "sidecars", ["x.jpg"])
    (sidecars / "x.txt").write_text("a caption")
    urls = tmp_path / "urls.csv"
    urls.write_text("url,caption\nhttp://127.0.0.1:9/a.jpg,a\n")
    videos = tmp_path / "videos"
    videos.mkdir()
    (videos / "clip.mp4").write_bytes(b"\x00" * 16)  # (a walk goes by the name; only a worker opens it)
    spans = tmp_path / "spans"
    spans.mkdir()
    (spans / "clip.mp4").write_bytes(b"\x00" * 16)
    (spans / "metadata.csv").write_text("file_name,start,end\nclip.mp4,0,1\n")
    found = {
        "folders": walk(classes), "flat": walk(flat), "list": walk(listed), "table": walk(table),
        "sidecars": walk(sidecars, sidecars=True), "urls": walk(urls), "videos": walk(videos, videos=True),
        "spans": walk(spans, videos=True),
    }  # fmt: skip
    for kind, walked in found.items():
        list(walked.items)
        assert (walked.source.kind, walked.layout) == (kind, kind)
    assert found["spans"].source.shares_files and not found["videos"].source.shares_files
    assert found["urls"].source.downloads and not found["table"].source.downloads


def test_open_finds_the_first_convention_that_takes_the_source(tmp_path: Path) -> None:
    folder = _images(tmp_path / "pics", ["1.jpg"])
    assert type(open_source(folder)).__name__ == "FolderSource"
    assert type(open_source(folder, sidecars=True)).__name__ == "SidecarSource"
    assert type(open_source(folder, videos=True)).__name__ == "VideoSource"
    assert type(open_source("s3://bucket/prefix")).__name__ == "BucketSource"  # (opened without a listing)
    assert type(open_source("s3://bucket/urls.parquet")).__name__ == "UrlSource"
    with pytest.raises(SourceError, match="no such file or folder"):
        open_source(tmp_path / "missing")
    with pytest.raises(SourceError, match="is an image"):
        open_source(folder / "1.jpg")


def test_a_flag_the_source_cannot_take_is_refused_before_the_walk_reads_it(tmp_path: Path) -> None:
    """A table of URLs with --dedup: refused from its header alone, before the rows are read (a
    table with no rows at all is refused for the flag, not for its rows)."""
    urls = tmp_path / "urls.csv"
    urls.write_text("url,caption\n")
    with pytest.raises(SourceError, match="no rows"):
        list(walk(urls).items)
    with pytest.raises(ConfigError, match="--dedup compares the images before packing"):
        prepare(pack_config(urls, tmp_path / "out", dedup="exact"), None)
    with pytest.raises(ConfigError, match="--shard-bytes estimates each image's output from its local file"):
        prepare(pack_config(urls, tmp_path / "out", shard_bytes="1MB"), None)
    with pytest.raises(ConfigError, match="--dedup hashes local files"):
        prepare(pack_config("s3://nowhere/prefix", tmp_path / "out", dedup="exact"), None)  # no listing first


class _Numbered(FolderSource):
    """A convention of this test's own, over the folder convention: a folder holding a file named
    NUMBERED is walked flat, each image labelled by the number its name starts with."""

    @classmethod
    def open(cls, options: WalkOptions) -> _Numbered | None:
        return cls(options) if os.path.isfile(os.path.join(options.source, "NUMBERED")) else None

    @property
    def kind(self) -> str:
        return "numbered"

    def walk(self) -> SourceWalk:
        found = from_folder(self, self.root, "none", self.options.keys)
        found.items = (item._replace(label=int(item.relpath.split("_")[0])) for item in found.items)
        found.runs = None
        return found

    def labelling(self, found: SourceWalk, labels: str) -> Labelling:
        return Labelling("numbered", 0, "labels from the numbers that open the names")


def test_a_new_convention_is_one_class_and_its_line_in_the_registry(tmp_path: Path, monkeypatch) -> None:
    source = _images(tmp_path / "numbered", ["3_a.jpg", "7_b.jpg"])
    (source / "NUMBERED").write_text("")
    monkeypatch.setattr(sources, "SOURCES", {"numbered": _Numbered, **SOURCES})
    found = walk(source)
    assert [(item.relpath, item.label) for item in found.items] == [("3_a.jpg", 3), ("7_b.jpg", 7)]
    assert labelling(found).origin == "numbered"
    result = pack(pack_config(source, tmp_path / "out", resize=32, workers=1))
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["settings"]["source"]["layout"] == "numbered"
    assert result.manifest.totals["records"] == 2 and result.labels is not None and result.labels.origin == "numbered"


TIMED_STEPS = ("read", "decode", "resize", "encode", "write")
PICTURES = ("alpha_flattened", "single_colour", "single_colour_flattened")


def test_a_reading_hands_outcomes_back_in_order_with_a_copy_in_a_failed_items_slot(tmp_path: Path) -> None:
    _images(tmp_path, ["a.jpg", "copy.jpg", "c.jpg"])
    (tmp_path / "b.jpg").write_bytes(b"not an image")
    items = tuple(Item(str(tmp_path / name), name, name[0]) for name in ("a.jpg", "b.jpg", "c.jpg"))
    copies = {
        "b": (
            Item(str(tmp_path / "gone.jpg"), "gone.jpg", "gone"),
            Item(str(tmp_path / "copy.jpg"), "copy.jpg", "copy"),
        )
    }
    packing = Packing(
        items, ResizeConfig(16), EncodeConfig(), "webdataset", dict.fromkeys(TIMED_STEPS, 0.0),
        dict.fromkeys(PICTURES, 0), copies=copies,
    )  # fmt: skip
    outcomes = list(Files().packed(packing))
    assert [None if record is None or isinstance(record, list) else record.key for record, _, _ in outcomes] == [
        "a", "copy", "c"
    ]  # fmt: skip
    assert [(failure.path, failure.stage) for failure in outcomes[1][2]] == [("b.jpg", "header"), ("gone.jpg", "read")]
    assert packing.copies_packed == {"b": "copy"}


def test_a_clip_is_sized_by_the_images_scale_rule() -> None:
    """Video frames follow the image rule, `max_aspect` included: a 20:1 strip's long side stops at
    64 x 4, as an image's does; both sides even (yuv420p)."""
    from shardkit.packing.clips import stored_size
    from shardkit.packing.encode import plan_geometry

    assert plan_geometry(2000, 100, ResizeConfig(64)).size == (256, 13)
    assert stored_size(2000, 100, ResizeConfig(64)) == (256, 12)
    assert plan_geometry(640, 360, ResizeConfig(128)).size == stored_size(640, 360, ResizeConfig(128)) == (228, 128)
    assert stored_size(360, 640, ResizeConfig(100, mode="long")) == (56, 100)
    assert stored_size(103, 61, ResizeConfig(256)) == (104, 60)  # never enlarged: only made even
