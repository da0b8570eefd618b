"""--sidecars: files sharing a stem are one sample (x.jpg, x.txt, x.json, x.cls, x.seg.png, ...),
packed into every format, masks kept aligned with their image, every odd file accounted for."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from shardkit import PackConfig, ResizeConfig, pack
from shardkit.checks.verify import verify
from shardkit.core.manifest import read_manifest
from shardkit.packing.plan import fingerprint, plan_shards
from shardkit.packing.sources import walk
from shardkit.readers import open_shards
from shardkit.synthetic import write_image
from tests.helpers import read_errors

FORMATS = ("webdataset", "lmdb", "hdf5")


def _half_and_half(path: Path, width: int, height: int) -> None:
    """An image bright on its left part, dark on the right: where a mask must say 1 and 0."""
    pixels = np.zeros((height, width, 3), np.uint8)
    pixels[:, : width // 3] = 250
    Image.fromarray(pixels).save(path, quality=95)


def _mask(path: Path, width: int, height: int) -> None:
    mask = np.zeros((height, width), np.uint8)
    mask[:, : width // 3] = 1
    mask[:4, -4:] = 7  # a rare value in a corner: nearest-neighbour may drop it, never invent another
    Image.fromarray(mask, mode="L").save(path)


@pytest.fixture(scope="module")
def sidecar_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("sidecars") / "src"
    (root / "sub").mkdir(parents=True)
    _half_and_half(root / "cat.jpg", 600, 400)
    (root / "cat.txt").write_text("a cat, 猫, قطة 🐈\nsecond line", encoding="utf-8")
    (root / "cat.json").write_text(json.dumps({"boxes": [[0, 0, 200, 400]], "width": 11, "source": "mine"}))
    (root / "cat.cls").write_text("3\n")
    _mask(root / "cat.seg.png", 600, 400)
    np.save(root / "cat.depth.npy", np.linspace(0, 1, 12, dtype=np.float32).reshape(3, 4))
    (root / "cat.points.bin").write_bytes(bytes(range(256)))
    _half_and_half(root / "sub" / "dog.png", 300, 500)
    (root / "sub" / "dog.txt").write_text("", encoding="utf-8")
    _mask(root / "sub" / "dog.seg.png", 300, 500)
    _half_and_half(root / "plain.webp", 100, 100)
    return root


def _pack(source: Path, output: Path, **options) -> None:
    resize = options.pop("resize", ResizeConfig(size=200))
    pack(PackConfig(str(source), str(output), sidecars=True, resize=resize, **options))


@pytest.mark.parametrize("format", FORMATS)
def test_sidecars_round_trip_in_every_format(sidecar_source: Path, tmp_path: Path, format: str) -> None:
    _pack(sidecar_source, tmp_path / "out", format=format)
    assert read_errors(tmp_path / "out") == []
    samples = {s.key: s for s in open_shards(tmp_path / "out")}
    assert sorted(samples) == ["cat", "plain", "sub/dog"]
    cat, dog, plain = samples["cat"], samples["sub/dog"], samples["plain"]
    assert cat.text == "a cat, 猫, قطة 🐈\nsecond line" and dog.text == "" and plain.text is None
    assert cat.label == 3 and dog.label is None
    assert cat.fields["boxes"] == [[0, 0, 200, 400]] and cat.fields["width"] == 11 and cat.fields["source"] == "mine"
    assert cat.meta["source"] == "cat.jpg" and cat.meta["width"] == 600  # shardkit's own, apart
    assert np.array_equal(cat.fields["depth.npy"], np.linspace(0, 1, 12, dtype=np.float32).reshape(3, 4))
    assert cat.fields["points.bin"] == bytes(range(256))
    for sample in (cat, dog):
        mask = sample.fields["seg.png"]
        assert mask.ndim == 2 and mask.shape == sample.image.shape[:2]  # resized with its image, never RGB
        assert set(np.unique(mask).tolist()) <= {0, 1, 7}
        bright = sample.image.mean(axis=2) > 128
        assert np.mean(bright == (mask == 1)) > 0.98  # aligned: the mask marks the bright part
    assert plain.fields == {}


def test_a_center_crop_crops_the_mask_with_its_image(sidecar_source: Path, tmp_path: Path) -> None:
    _pack(sidecar_source, tmp_path / "out", resize=ResizeConfig(size=128, mode="center-crop"))
    for sample in open_shards(tmp_path / "out"):
        if "seg.png" in sample.fields:
            mask = sample.fields["seg.png"]
            assert mask.shape == sample.image.shape[:2] == (128, 128)
            assert np.mean((sample.image.mean(axis=2) > 128) == (mask == 1)) > 0.98


def test_fields_as_bytes_or_pil_as_decode_asks(sidecar_source: Path, tmp_path: Path) -> None:
    _pack(sidecar_source, tmp_path / "out")
    raw = open_shards(tmp_path / "out", decode="bytes").get("cat").fields
    assert raw["seg.png"][:8] == b"\x89PNG\r\n\x1a\n" and isinstance(raw["depth.npy"], bytes)
    pil = open_shards(tmp_path / "out", decode="pil").get("cat").fields["seg.png"]
    assert pil.mode == "L" and pil.size == (300, 200)


def test_stock_webdataset_reads_the_fields(sidecar_source: Path, tmp_path: Path) -> None:
    webdataset = pytest.importorskip("webdataset")
    _pack(sidecar_source, tmp_path / "out")
    shards = [str(tmp_path / "out" / s.name) for s in read_manifest(tmp_path / "out").shards]
    stock = {s["__key__"]: s for s in webdataset.WebDataset(shards, shardshuffle=False)}
    assert stock["cat"]["txt"].decode() == "a cat, 猫, قطة 🐈\nsecond line" and stock["cat"]["cls"] == b"3"
    assert np.asarray(Image.open(__import__("io").BytesIO(stock["cat"]["seg.png"]))).shape == (200, 300)


def test_every_odd_file_is_accounted_for_and_verify_agrees(tmp_path: Path) -> None:
    source = tmp_path / "src"
    source.mkdir()
    for stem in ("ok", "twoimg", "twotxt", "badtxt", "badjson", "listjson", "badcls", "bigmask", "reserved"):
        _half_and_half(source / f"{stem}.jpg", 60, 40)
    (source / "orphan.txt").write_text("no image")
    _half_and_half(source / "twoimg.png", 60, 40)
    (source / "twotxt.txt").write_text("one")
    (source / "twotxt.TXT").write_text("two")
    (source / "badtxt.txt").write_bytes(b"\xff\xfe")
    (source / "badjson.json").write_text("{nope")
    (source / "listjson.json").write_text("[1, 2]")
    (source / "badcls.cls").write_text("-1")
    _mask(source / "bigmask.seg.png", 61, 40)
    (source / "reserved.columns.json").write_text("{}")
    (source / "noext").write_text("x")
    _half_and_half(source / "oddfield.jpg", 60, 40)
    (source / os.fsdecode(b"oddfield.t\xffx")).write_bytes(b"a field whose name is not text")
    _pack(source, tmp_path / "out", resize=ResizeConfig(size=20))
    reasons = {row["path"]: row["reason"] for row in read_errors(tmp_path / "out")}
    records = [s.key for s in open_shards(tmp_path / "out", decode="bytes")]
    assert records == ["oddfield", "ok"]  # (packed without the field it cannot name)
    assert reasons["orphan.txt"].startswith("a sidecar with no image")
    assert reasons["twoimg.jpg"] == reasons["twoimg.png"] == "two images share the name: twoimg.jpg, twoimg.png"
    assert "two files for one part" in reasons["twotxt.txt"]
    assert reasons["badtxt.jpg"] == "badtxt.txt: not UTF-8 text"
    assert reasons["badjson.jpg"].startswith("badjson.json: not valid JSON")
    assert reasons["listjson.jpg"].startswith("listjson.json: not a JSON object")
    assert reasons["badcls.jpg"] == "badcls.cls: a label must be a whole number from 0 to 2**63-1"
    assert "61x40, its image 60x40: cannot keep it aligned" in reasons["bigmask.jpg"]
    assert "a name shardkit's own parts take" in reasons["reserved.jpg"]
    assert reasons["noext"].startswith("no suffix")
    assert reasons["oddfield.t\ufffdx"] == "its suffix is not UTF-8 text, so no shard can name the field"
    report = verify(tmp_path / "out", source=source)
    assert report.ok, report.problems


def test_a_changed_sidecar_changes_the_plan(sidecar_source: Path, tmp_path: Path) -> None:
    """What --resume trusts: a caption file edited after a stop makes its shard be written again."""
    import shutil

    source = tmp_path / "src"
    shutil.copytree(sidecar_source, source)

    def plan() -> str:
        return fingerprint(
            {}, plan_shards(walk(source, labels="none", sidecars=True).items, suffix=".tar", shard_size=2)
        )

    before = plan()
    (source / "cat.txt").write_text("a different caption", encoding="utf-8")
    assert plan() != before


def test_the_cli_packs_sidecars(shardkit, sidecar_source: Path, tmp_path: Path) -> None:
    done = shardkit("pack", sidecar_source, tmp_path / "out", "--sidecars")
    assert done.returncode == 0, done.stderr
    assert open_shards(tmp_path / "out", decode="bytes").get("cat").text.startswith("a cat")
    check = shardkit("verify", tmp_path / "out", "--deep", "--source", sidecar_source)
    assert check.returncode == 0, check.stdout + check.stderr


def test_probe_counts_sidecar_samples_not_their_masks(sidecar_source: Path) -> None:
    from shardkit.packing.probe import probe

    assert probe(sidecar_source, sidecars=True).images == 3  # cat.jpg, sub/dog.png, plain.webp
    assert probe(sidecar_source).images == 5  # without --sidecars the masks are images too


def test_sidecars_written_with_a_byte_order_mark_read_as_their_text(tmp_path: Path) -> None:
    """Notepad's UTF-8 starts with a byte-order mark: it is not part of a caption, a JSON object or
    a label (json refused it, the label was not a number)."""
    source = tmp_path / "src"
    write_image(source / "a.jpg", 40, 30)
    bom = b"\xef\xbb\xbf"
    (source / "a.txt").write_bytes(bom + "une légende".encode())
    (source / "a.json").write_bytes(bom + b'{"n": 1}')
    (source / "a.cls").write_bytes(bom + b"7\n")
    _pack(source, tmp_path / "out")
    assert not read_errors(tmp_path / "out")
    [sample] = open_shards(tmp_path / "out", decode="bytes")
    assert (sample.text, sample.fields, sample.label) == ("une légende", {"n": 1}, 7)
