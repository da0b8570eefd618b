"""Duplicates and leakage (packing/duplicates.py, core/phash.py): planted copies of every kind are
found, distinct photos never group, the near search finds exactly the pairs all-pairs would, and
bad input is reported, never fatal."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image, ImageEnhance

from shardkit.checks.duplicates import find_duplicates
from shardkit.checks.verify import verify
from shardkit.core.config import DEFAULT_DEDUP_THRESHOLD
from shardkit.core.errors import ConfigError, OutputError
from shardkit.core.manifest import read_manifest, write_json_atomic
from shardkit.core.pack_options import pack_config
from shardkit.core.phash import components, distances, near_any, near_components, near_pairs
from shardkit.packing.dedup import Fallbacks, Hashed, keep_first
from shardkit.packing.hashes import hash_file
from shardkit.packing.pack import PackResult, pack
from shardkit.packing.sources import Item
from shardkit.readers import open_shards
from shardkit.synthetic import picture, write_image

from .conftest import IMAGENET_SAMPLE

KINDS = ("exact", "q20", "half", "png", "crop3", "grey", "bright")


def photos(count: int) -> list[Image.Image]:
    """Real photos when ../shared is here, generated ones otherwise (those are 16+ bits apart too)."""
    if IMAGENET_SAMPLE.is_dir():
        paths = sorted(p for p in IMAGENET_SAMPLE.iterdir() if p.suffix.lower() == ".jpeg")[:count]
        return [Image.open(path).convert("RGB") for path in paths]
    return [Image.fromarray(picture(320 + 7 * i, 240 + 5 * i, i, 3)) for i in range(count)]


def plant(image: Image.Image, kind: str, path: Path) -> Path:
    """A copy of `image` changed the way `kind` says, written to `path` (suffix set here)."""
    width, height = image.size
    if kind == "png":
        path = path.with_suffix(".png")
        image.save(path)
        return path
    path = path.with_suffix(".jpg")
    changed = {
        "q20": image,
        "half": image.resize((width // 2, height // 2)),
        "crop3": image.crop(
            (int(width * 0.03), int(height * 0.03), width - int(width * 0.03), height - int(height * 0.03))
        ),
        "grey": image.convert("L"),
        "bright": ImageEnhance.Brightness(image).enhance(1.3),
    }[kind]
    changed.save(path, quality=20 if kind == "q20" else 90)
    return path


@pytest.fixture(scope="module")
def planted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, list[tuple[str, str]]]]:
    """train: 24 photos; val: 6 distinct photos and, for each kind, a copy of 3 train photos."""
    root = tmp_path_factory.mktemp("dups")
    train, val = root / "train", root / "val"
    train.mkdir()
    val.mkdir()
    images = photos(30)
    for i, image in enumerate(images[:24]):
        image.save(train / f"t{i:02d}.jpg", quality=90)
    for i, image in enumerate(images[24:]):
        image.save(val / f"v{i:02d}.jpg", quality=90)
    expected: dict[str, list[tuple[str, str]]] = {kind: [] for kind in KINDS}
    for k, kind in enumerate(KINDS):
        for n in range(3):
            i = 3 * k + n
            original = train / f"t{i:02d}.jpg"
            if kind == "exact":
                copy = val / f"copy_{kind}_{i:02d}.jpg"
                copy.write_bytes(original.read_bytes())
            else:
                copy = plant(images[i], kind, val / f"copy_{kind}_{i:02d}")
            expected[kind].append((str(original), str(copy)))
    return train, val, expected


def test_planted_copies_are_found_and_distinct_photos_never_group(planted) -> None:
    train, val, expected = planted
    report = find_duplicates([train, val], near=True)
    together = {}
    for number, group in enumerate(report.groups):
        for path in group.files:
            together[path] = number
    recall = {}
    for kind, pairs in expected.items():
        recall[kind] = sum(together.get(a) is not None and together.get(a) == together.get(b) for a, b in pairs) / 3
    # thresholds from the 300 ImageNet photos (README): every copy of these kinds is within 8 bits
    assert all(recall[kind] == 1 for kind in ("exact", "q20", "half", "png", "grey")), recall
    assert recall["bright"] >= 2 / 3 and recall["crop3"] >= 2 / 3, recall
    originals = [str(p) for p in sorted(train.iterdir())] + [str(p) for p in sorted(val.glob("v*.jpg"))]
    false_groups = [g for g in report.groups if sum(path in originals for path in g.files) > 1]
    assert false_groups == []
    exact = [g for g in report.groups if g.kind == "exact"]
    assert [sorted(g.files) for g in exact] == [sorted(pair) for pair in expected["exact"]]
    assert all(g.leakage for g in report.groups)  # every planted copy is in val, every original in train
    exact_only = find_duplicates([train, val])
    assert [g.kind for g in exact_only.groups] == ["exact"] * 3 and exact_only.threshold is None


@pytest.mark.parametrize("threshold", [0, 3, 6, 10, 16])
def test_the_near_search_finds_what_all_pairs_finds(threshold: int) -> None:
    rng = np.random.default_rng(threshold)
    base = rng.integers(0, 2**63, 400, dtype=np.uint64)
    flips = [np.uint64(1) << np.uint64(b) for b in range(64)]
    near = []
    for value in base[:100]:  # copies a few bits away, some within the threshold and some past it
        changed = value
        for bit in rng.choice(64, int(rng.integers(0, threshold + 3)), replace=False):
            changed ^= flips[bit]
        near.append(changed)
    hashes = np.concatenate([base, np.array(near, np.uint64)])
    got = {tuple(pair) for pair in near_pairs(hashes, threshold).tolist()}
    d = distances(hashes[:, None], hashes[None, :])
    want = {(i, j) for i, j in zip(*np.nonzero(d <= threshold), strict=True) if i < j}
    assert got == want and len(want) >= (1 if threshold else 0)


def test_many_equal_hashes_are_one_group_without_pairing_them() -> None:
    """50,000 distinct images of one hash (all-black tiles): k^2 / 2 pairs would not fit in memory."""
    hashes = np.concatenate([np.zeros(50_000, np.uint64), np.array([1, 2**63 - 1, 3], np.uint64)])
    group = near_components(hashes, 2)
    assert len(set(group[:50_000].tolist())) == 1 and group[50_000] == group[0] == group[50_002]
    assert group[50_001] != group[0]


def test_a_link_in_another_source_is_leakage(tmp_path: Path) -> None:
    """A symlink farm or `cp -al` split: val/x.jpg is train/x.jpg. Within a source a link counts
    once; across sources it is the same image in both: leakage ("same file")."""
    train, val = tmp_path / "train", tmp_path / "val"
    train.mkdir()
    val.mkdir()
    photos(1)[0].save(train / "x.jpg", quality=90)
    os.symlink(train / "x.jpg", val / "x.jpg")
    os.link(train / "x.jpg", val / "y.jpg")
    report = find_duplicates([train, val], near=True)
    (group,) = report.groups
    assert group.kind == "exact" and group.match == "same file" and group.leakage
    assert group.files == [str(train / "x.jpg"), str(val / "x.jpg")] and report.files == 1


def test_bad_files_are_reported_and_links_count_once(tmp_path: Path) -> None:
    source = tmp_path / "src"
    source.mkdir()
    good = source / "a.jpg"
    photos(1)[0].save(good, quality=90)
    data = good.read_bytes()
    (source / "b_truncated.jpg").write_bytes(data[: len(data) // 3])
    (source / "c_garbage.jpg").write_bytes(b"\xff\xd8\xff" + os.urandom(500))
    (source / "g_text.jpg").write_bytes(b"plain text, named as a JPEG")
    Image.fromarray(picture(12, 9, 1, 3)).save(source / "d_tiny.png")
    os.symlink(good, source / "e_link.jpg")
    os.link(good, source / "f_hardlink.jpg")
    report = find_duplicates([source], near=True)
    assert report.groups == [] and report.files == 5  # a, b, c, d, g: the links are a's file
    reasons = {Path(f.path).name: f.reason for f in report.failures}
    assert set(reasons) >= {"c_garbage.jpg", "d_tiny.png", "g_text.jpg"}, reasons
    assert "too small to hash" in reasons["d_tiny.png"] and "cannot decode" in reasons["c_garbage.jpg"]
    assert reasons["g_text.jpg"] == "cannot decode (not a format Pillow recognises)"  # (not "<_io.BytesIO ...>")


def test_the_cli_writes_groups_with_paths_as_typed(shardkit, planted, tmp_path: Path) -> None:
    train, val, expected = planted
    out = tmp_path / "report.json"
    relative = os.path.relpath(val)
    sheet = tmp_path / "sheet.png"
    done = shardkit("duplicates", train, relative, "--near", "--json", out, "--plot", sheet)
    assert done.returncode == 0, done.stderr
    assert "span sources (leakage)" in " ".join(done.stdout.split())
    report = json.loads(out.read_text())
    assert report["threshold"] == DEFAULT_DEDUP_THRESHOLD and report["leakage"] == len(report["groups"])
    kinds = {group["kind"] for group in report["groups"]}
    assert kinds == {"exact", "near"}
    files = [path for group in report["groups"] for path in group["files"]]
    assert all(path.startswith((str(train), relative)) for path in files)
    assert os.path.join(relative, Path(expected["exact"][0][1]).name) in files
    with Image.open(sheet) as image:  # a row per group drawn (8 at most)
        assert image.format == "PNG" and image.height > 8 * 128


def test_the_cli_says_how_many_groups_it_leaves_out_and_names_files_not_hashed(shardkit, tmp_path: Path) -> None:
    """It printed 10 groups of 150 with no word of the rest, and "2 files not hashed" naming none."""
    for i, image in enumerate(photos(12)):
        image.save(tmp_path / f"p{i:02d}.jpg", quality=90)
        shutil.copyfile(tmp_path / f"p{i:02d}.jpg", tmp_path / f"p{i:02d}-copy.jpg")
    for i in range(7):
        (tmp_path / f"z{i}.jpg").write_bytes(f"not an image, number {i}".encode())  # (unlike: no group)
    done = shardkit("duplicates", tmp_path, "--near")  # (--near decodes: the garbage is found out)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "12 exact groups (the same bytes), 0 near groups; 0 groups span sources (leakage)" in lines
    assert sum(line.startswith("- exact: ") for line in lines) == 10
    assert "  and 2 more (every group: --json)" in lines
    assert "7 files not hashed (unreadable, undecodable or too small):" in lines
    named = [line for line in lines if line.startswith(f"- {tmp_path}/z")]
    assert len(named) == 5 and all(line.endswith(": cannot decode (not a format Pillow recognises)") for line in named)
    assert "  and 2 more (every file: --json)" in lines


@pytest.mark.parametrize(
    ("arguments", "words"),
    [
        (["--dedup-threshold", "5"], "--dedup-threshold is for --near"),
        (["--threshold", "5"], "--dedup-threshold is for --near"),  # its earlier name, still taken
        (["--near", "--dedup-threshold", "40"], "0 to 32 bits"),
        (["--workers", "0"], "at least 1"),
        (["--plot", "sheet.gif"], "a contact sheet must be"),
    ],
)
def test_bad_flags_are_one_line(shardkit, tmp_path: Path, arguments: list[str], words: str) -> None:
    done = shardkit("duplicates", tmp_path, *arguments)
    assert done.returncode != 0 and words in done.stderr and "Traceback" not in done.stderr


def test_no_source_is_refused() -> None:
    with pytest.raises(ConfigError, match="at least one source"):
        find_duplicates([])


# --- pack --dedup, the hashes in every record, and packed outputs compared -------------------


def _pack(source: Path, output: Path, **options) -> PackResult:
    return pack(pack_config(source, output, resize=96, workers=2, **options))


def _errors(output: Path) -> list[dict]:
    return [json.loads(line) for line in (output / "errors.jsonl").read_text().splitlines()]


def test_pack_dedup_near_keeps_the_first_of_each_set_and_lists_the_others(planted, tmp_path: Path) -> None:
    train, _val, expected = planted
    root = train.parent  # train/ sorts before val/: every original is the first of its set
    result = _pack(root, tmp_path / "out", dedup="near")
    rows = {row["path"]: row for row in _errors(tmp_path / "out")}
    copies = {
        f"val/{Path(copy).name}": f"train/{Path(original).stem}"
        for pairs in expected.values()
        for original, copy in pairs
    }
    dropped = {path for path, row in rows.items() if row["stage"] == "duplicate"}
    # every copy the search finds (test above: all of exact, q20, half, png, grey; 2 of 3 bright, crop3)
    assert dropped <= set(copies) and len(dropped) >= len(copies) - 2, sorted(set(copies) - dropped)
    assert all(rows[path]["duplicate_of"] == copies[path] for path in dropped)
    assert all(path.startswith("val/copy_exact") == ("same bytes" in rows[path]["reason"]) for path in dropped)
    kept = {record.meta["source"] for record in open_shards(tmp_path / "out").records(0)}
    assert not kept & dropped and {f"val/v{i:02d}.jpg" for i in range(6)} <= kept  # distinct photos all packed
    assert result.duplicates == len(dropped) and result.records + result.errors == result.inputs
    assert verify(tmp_path / "out").ok  # every source file packed or listed, once

    exact = _pack(root, tmp_path / "exact", dedup="exact")
    assert {row["path"] for row in _errors(tmp_path / "exact")} == {p for p in copies if "copy_exact" in p}
    assert exact.records == result.records + len(dropped) - 3


def test_records_carry_the_source_hash_and_the_picture_hash(planted, tmp_path: Path) -> None:
    import hashlib

    import pyarrow.parquet as pq

    train, _, _ = planted
    _pack(train, tmp_path / "out")
    ds = open_shards(tmp_path / "out")
    index = pq.read_table(tmp_path / "out" / "index.parquet").to_pylist()
    apart = []
    for record, row in zip(ds.records(0), index, strict=True):
        source = train / record.meta["source"]
        assert record.meta["source_sha256"] == row["source_sha256"] == hashlib.sha256(source.read_bytes()).hexdigest()
        assert row["phash"] == record.meta["phash"]
        ours = np.array([int(record.meta["phash"], 16)], np.uint64)
        theirs = np.array([hash_file(str(source), True, 1 << 30)[1]], np.uint64)
        apart.append(int(distances(ours, theirs)[0]))
    # the pack's hash (from its own decode, resized to 96 px here) and the file's (a 1/8-scale decode)
    # differ in a few bits: a record is always grouped with the file it came from
    assert max(apart) <= DEFAULT_DEDUP_THRESHOLD and np.median(apart) <= 3, apart


def test_packed_outputs_are_compared_from_their_index_without_reading_a_shard(
    planted, shardkit, tmp_path: Path
) -> None:
    train, val, _ = planted
    _pack(train, tmp_path / "train_out")
    _pack(val, tmp_path / "val_out")
    folders = find_duplicates([train], against=[val], near=True)
    for shard in (tmp_path / "train_out").glob("*.tar"):  # the same size, not one image left in it
        shard.write_bytes(bytes(shard.stat().st_size))
    report = json.loads(_cli(shardkit, tmp_path, "train_out", "--against", "val_out", "--near"))
    packed = {tuple(sorted(Path(f).name.split("#")[-1].removesuffix(".jpg").removesuffix(".png") for f in g["files"]))
              for g in report["groups"]}  # fmt: skip
    wanted = {tuple(sorted(Path(f).stem for f in g.files)) for g in folders.groups}
    # the same groups, but for a borderline copy (a crop or a brighter copy near the threshold): the
    # pack hashes its resized picture, not the file's 1/8-scale decode
    other = [group for group in packed ^ wanted if not any("crop3" in n or "bright" in n for n in group)]
    assert other == [] and len(packed & wanted) >= 16 and report["against"] == ["val_out"]
    assert all(group["leakage"] for group in report["groups"]) and report["errors"] == []


def test_an_output_without_hashes_is_hashed_record_by_record(planted, tmp_path: Path) -> None:
    """Tars someone else wrote (`shardkit index`): no hashes in them; read and decoded instead."""
    import tarfile

    train, _val, expected = planted
    adopted = tmp_path / "adopted"
    adopted.mkdir()
    with tarfile.open(adopted / "part-0.tar", "w") as tar:
        for _original, copy in expected["exact"] + expected["half"]:
            tar.add(copy, arcname=f"{Path(copy).stem}.{Path(copy).suffix[1:]}")
    from shardkit.packing.adopt import adopt_tars

    adopt_tars(adopted)
    _pack(train, tmp_path / "train_out")
    report = find_duplicates([tmp_path / "train_out"], against=[adopted], near=True)
    assert len(report.groups) == 6 and {g.kind for g in report.groups} == {"exact", "near"}
    assert all(f.split("#")[0] in (str(tmp_path / "train_out"), str(adopted)) for g in report.groups for f in g.files)


def test_resume_of_a_dedup_pack_and_bad_dedup_flags(planted, shardkit, tmp_path: Path) -> None:
    train, _val, _ = planted
    root = train.parent
    first = _pack(root, tmp_path / "out", dedup="near")
    again = pack(pack_config(root, tmp_path / "out", resize=96, workers=2, dedup="near", resume=True))
    assert again.already_complete and again.records == first.records
    assert again.duplicates == first.duplicates > 0  # from the manifest's totals, which verify checks
    manifest = read_manifest(tmp_path / "out")
    assert manifest.totals["duplicates"] == first.duplicates and verify(tmp_path / "out").ok
    told = replace(manifest, totals={**manifest.totals, "duplicates": first.duplicates - 1})
    write_json_atomic(tmp_path / "out" / "manifest.json", told.sealed().to_json())
    assert [p.detail for p in verify(tmp_path / "out").problems] == [
        f"totals say {first.duplicates - 1} duplicates, errors.jsonl lists {first.duplicates}"
    ]
    with pytest.raises(OutputError, match="other settings or inputs"):
        pack(pack_config(root, tmp_path / "out", resize=96, workers=2, dedup="exact", resume=True))
    for arguments, words in (
        (["--dedup", "exact", "--dedup-threshold", "4"], "--dedup-threshold is for --dedup near"),
        (["--dedup", "near", "--dedup-threshold", "33"], "0 to 32 bits"),
        (["--dedup", "fuzzy"], "fuzzy"),
    ):
        done = shardkit("pack", root, tmp_path / "new", *arguments)
        assert done.returncode != 0 and words in done.stderr and "Traceback" not in done.stderr, done.stderr
        assert not (tmp_path / "new").exists()  # refused before any work


def _cli(shardkit, cwd: Path, *arguments: str) -> str:
    out = cwd / "report.json"
    done = shardkit("duplicates", *arguments, "--json", out, cwd=cwd)
    assert done.returncode == 0, done.stderr
    return out.read_text()


@pytest.mark.parametrize("orientation", [3, 6, 8])
def test_the_hash_is_of_the_picture_as_displayed(tmp_path: Path, orientation: int) -> None:
    """A camera's rotated JPEG (pixels stored turned, an EXIF tag to turn them back) is the same
    picture as an upright copy: the file's hash and the pack's both follow the tag."""
    upright = photos(1)[0]
    turn = {3: Image.Transpose.ROTATE_180, 6: Image.Transpose.ROTATE_90, 8: Image.Transpose.ROTATE_270}[orientation]
    exif = Image.Exif()
    exif[0x0112] = orientation
    (tmp_path / "src").mkdir()
    upright.save(tmp_path / "src" / "a_upright.jpg", quality=90)
    upright.transpose(turn).save(tmp_path / "src" / "b_tagged.jpg", quality=90, exif=exif.tobytes())
    report = find_duplicates([tmp_path / "src"], near=True, threshold=4)
    assert [group.kind for group in report.groups] == ["near"], report.groups
    _pack(tmp_path / "src", tmp_path / "out")
    a, b = (int(record.meta["phash"], 16) for record in open_shards(tmp_path / "out").records(0))
    assert distances(np.array([a], np.uint64), np.array([b], np.uint64))[0] <= 4


def test_dedup_drops_only_copies_of_a_kept_file_never_through_a_chain() -> None:
    """Burst shots: A near B near C near D, each 8 bits from the next, threshold 10. B is a copy of
    A and goes; C is 16 bits from A and 8 from B, which is not kept: C stays, and D goes as C's copy."""
    a = 0
    chain = [a, a ^ 0xFF, a ^ 0xFFFF, a ^ 0xFFFFFF]  # 8, 16, 24 bits from A
    items = [Item(f"/src/{n}.jpg", f"{n}.jpg", str(n)) for n in "ABCDE"]
    digests = ["a", "b", "c", "d", "b"]  # E: the same bytes as B (left out with it, as a copy of A)
    table = Hashed(digests, np.array([*chain, chain[1]], np.uint64), np.ones(5, bool), [])
    kept, dropped, fallbacks = keep_first(items, table, 10)
    assert [item.key for item in kept] == ["A", "C"]
    assert [(row.path, row.duplicate_of) for row in dropped] == [("B.jpg", "A"), ("D.jpg", "C"), ("E.jpg", "A")]
    assert "8 bits apart" in dropped[0].reason and "near copy of A.jpg" in dropped[2].reason
    # each kept file's copies, in walk order, with their rows: what the worker tries if it fails
    assert fallbacks == {
        "A": Fallbacks("A.jpg", [(items[1], 0), (items[4], 2)]),
        "C": Fallbacks("C.jpg", [(items[3], 1)]),
    }
    exact_kept, exact_dropped, _ = keep_first(items, table, None)
    assert [item.key for item in exact_kept] == list("ABCD") and exact_dropped[0].reason == "the same bytes as B.jpg"


def test_sixteen_bit_and_transparent_images_hash_as_pack_converts_them(tmp_path: Path) -> None:
    """16-bit PNGs clipped to white would all hash alike: they are shifted to 8 bits as pack does."""
    source = tmp_path / "src"
    source.mkdir()
    for n in range(4):
        grey = picture(96, 80, n, 1)[..., 0].astype(np.uint16) * 257
        Image.fromarray(grey).save(source / f"{n}.png")  # a uint16 array: mode I;16
    Image.fromarray(picture(96, 80, 0, 1)[..., 0]).save(source / "z_eight_bit_copy.png")
    result = _pack(source, tmp_path / "out", dedup="near")
    assert [(row["path"], row["duplicate_of"]) for row in _errors(tmp_path / "out")] == [("z_eight_bit_copy.png", "0")]
    assert result.records == 4


def test_dedup_hashes_are_kept_for_a_resume_and_taken_again_only_for_changed_files(tmp_path: Path) -> None:
    """A stopped `pack --dedup` resumes without hashing again: each file's hashes go to the state
    folder as they are taken, and are used again (reuse: a --resume) while the file is unchanged:
    its size, mtime, ctime and inode. The cache is best effort and never followed out of its folder."""
    import resource
    import threading

    from shardkit.packing.dedup import hash_paths

    files = [write_image(tmp_path / "src" / f"p{i}.jpg", 64, 48, seed=i) for i in range(4)]
    paths = [str(p) for p in files]
    cache = tmp_path / "hashes.jsonl"

    def rows() -> int:
        """Rows in the cache: each file hashed adds one."""
        if not cache.is_file():
            return 0
        lines = cache.read_bytes().split(b"\n")
        return sum(1 for line in lines if line.startswith(b'["') and line.endswith(b"]") and line.count(b",") >= 6)

    def hashed(reuse: bool = True) -> tuple[Any, int]:
        """The hashes, and how many files came from the cache (those not hashed again)."""
        before = rows() if reuse else 0
        found = hash_paths(paths, True, 1 << 30, workers=1, cache=cache, reuse=reuse)
        return found, len(paths) - (rows() - before)

    first, cached = hashed(reuse=False)
    assert all(first.hashed) and cached == 0 and len(cache.read_text().splitlines()) == 1 + len(paths)
    again, cached = hashed()
    assert cached == len(paths) and again.digests == first.digests and (again.hashes == first.hashes).all()
    # p0: other bytes with its size and mtime put back (exiftool -P does that): its ctime tells
    status = os.stat(files[0])
    # A kernel before 6.13 stamps ctime from its coarse clock (a tick is 4-10 ms), and the file was
    # written a few ms ago: an edit within the same tick would keep its ctime, and nothing would tell.
    while time.time_ns() - status.st_ctime_ns < 50_000_000:
        time.sleep(0.01)
    data = bytearray(files[0].read_bytes())
    data[len(data) // 2] ^= 0xFF
    files[0].write_bytes(bytes(data))
    os.utime(files[0], ns=(status.st_atime_ns, status.st_mtime_ns))
    assert os.stat(files[0]).st_ctime_ns != status.st_ctime_ns  # (what the test is about)
    with cache.open("a") as out:
        out.write('["cut by a sto')  # the last line of a run stopped mid-write
    changed, cached = hashed()
    assert cached == len(paths) - 1 and changed.digests[0] == hashlib.sha256(bytes(data)).hexdigest()
    assert changed.digests[1:] == first.digests[1:]
    assert len(hashed()[0].digests) == len(paths) and hashed()[1] == len(paths)  # the cut row did not eat the next
    assert hashed(reuse=False)[1] == 0  # --overwrite: nothing of an earlier run is taken (a fresh cache)
    # damaged rows (a scalar, bytes that are not UTF-8, a nesting bomb, a digest that is none) are
    # left out, not a crash
    with cache.open("ab") as out:
        out.write(b"7\n" + b'["\xff"]\n' * 400 + b"[" * 100_000 + b"\n")
        out.write(json.dumps([paths[2], 1, 2, 3, 4, "", None, None]).encode() + b"\n")
    assert hashed()[1] == len(paths)
    # a path listed twice takes its cached hashes at both places
    before = rows()
    twice = hash_paths([paths[2], *paths], True, 1 << 30, workers=1, cache=cache)
    assert twice.digests[0] == twice.digests[3] == first.digests[2] and rows() == before  # nothing hashed again
    truth = hashed(reuse=False)[0].digests
    # links planted where the cache goes are not written through: a symlink, a hard link, a FIFO
    target = tmp_path / "elsewhere.txt"
    for plant in ("symlink", "hard link", "fifo"):
        target.write_text("mine")
        cache.unlink()
        if plant == "symlink":
            cache.symlink_to(target)
        elif plant == "hard link":
            os.link(target, cache)
        else:
            os.mkfifo(cache)
        done: list[Any] = []
        worker = threading.Thread(target=lambda out=done: out.append(hashed()[0]), daemon=True)
        worker.start()
        worker.join(60)
        assert done and done[0].digests == truth and target.read_text() == "mine", plant
    # a cache that cannot be written (a file size limit) ends the caching, not the hashing
    cache.unlink(missing_ok=True)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (200, hard))  # the header fits, the first rows do not
    try:
        limited = hash_paths(paths, True, 1 << 30, workers=1, cache=cache)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert limited.digests == truth and cache.stat().st_size <= 200


# --- pack --dedup when the file kept cannot be packed: one of its copies is, in its place ----


def _sidecar_copies(source: Path, captions: dict[str, bytes]) -> Image.Image:
    """a.jpg, b.jpg (its bytes) and c.jpg (a near copy), each with the caption given (a.txt: bytes
    that are not UTF-8 fail in the worker, after the hashes were taken), and z.jpg, distinct."""
    source.mkdir()
    image = photos(2)[0]
    image.save(source / "a.jpg", quality=90)
    (source / "b.jpg").write_bytes((source / "a.jpg").read_bytes())
    image.save(source / "c.jpg", quality=40)
    photos(2)[1].save(source / "z.jpg", quality=90)
    for name, data in captions.items():
        (source / f"{name}.txt").write_bytes(data)
    return image


@pytest.mark.parametrize("mode", ["exact", "near"])
def test_a_kept_file_that_fails_in_the_worker_leaves_its_copy_packed(tmp_path: Path, mode: str) -> None:
    """Issue #32: b and c are copies of a; a's caption is not UTF-8, so a fails in the worker.
    Dropping b and c for a lost the picture: one of them is packed in a's place, in a's slot, and
    errors.jsonl names only keys that are in the output. Inputs = records + errors."""
    _sidecar_copies(tmp_path / "src", {"a": b"\xff\xfe not text", "b": b"the copy", "c": b"near", "z": b"other"})
    result = _pack(tmp_path / "src", tmp_path / "out", dedup=mode, sidecars=True)
    rows = {row["path"]: row for row in _errors(tmp_path / "out")}
    records = list(open_shards(tmp_path / "out").records(0))
    keys = [record.key for record in records]
    # b in a's slot, before the others: the plan's order is kept (c's bytes are its own: exact keeps it)
    assert keys == (["b", "z"] if mode == "near" else ["b", "c", "z"]), keys
    assert rows["a.jpg"]["stage"] == "read" and "not UTF-8" in rows["a.jpg"]["reason"]
    assert records[0].text == "the copy"
    duplicates = {path: row for path, row in rows.items() if row["stage"] == "duplicate"}
    assert all(row["duplicate_of"] in keys for row in duplicates.values()), duplicates
    if mode == "near":  # c: a near copy of a, left out for b, which stands in for a
        assert set(duplicates) == {"c.jpg"} and duplicates["c.jpg"]["duplicate_of"] == "b"
        assert "a.jpg could not be packed" in duplicates["c.jpg"]["reason"]
    assert (
        result.records + result.errors == result.inputs == 4
        and len(rows) == 4 - len(keys)
        and result.duplicates == len(duplicates)
    )
    assert verify(tmp_path / "out").ok


def test_when_every_copy_fails_each_has_its_own_row_and_none_a_duplicate_row(tmp_path: Path) -> None:
    _sidecar_copies(tmp_path / "src", {"a": b"\xff bad", "b": b"\xfe bad too", "c": b"\xfd", "z": b"other"})
    result = _pack(tmp_path / "src", tmp_path / "out", dedup="near", sidecars=True)
    rows = _errors(tmp_path / "out")
    assert [(row["path"], row["stage"]) for row in rows] == [("a.jpg", "read"), ("b.jpg", "read"), ("c.jpg", "read")]
    assert result.records == 1 and result.duplicates == 0 and result.records + result.errors == result.inputs == 4
    assert read_manifest(tmp_path / "out").totals["duplicates"] == 0 and verify(tmp_path / "out").ok


def test_a_kept_file_changed_after_it_was_hashed_leaves_its_copy_packed(tmp_path: Path) -> None:
    """a.jpg is hashed, then overwritten with bytes no decoder takes before the worker reads it
    (the last hash reported is the moment): its byte copy b.jpg is packed in its place."""
    _sidecar_copies(tmp_path / "src", {})

    def spoil(done: int, total: int) -> None:
        if done == total:
            (tmp_path / "src" / "a.jpg").write_bytes(b"\xff\xd8\xff\xe0 not a JPEG any more")

    config = pack_config(tmp_path / "src", tmp_path / "out", resize=96, workers=2, dedup="exact")
    result = pack(config, dedup_progress=spoil)
    rows = _errors(tmp_path / "out")
    assert [record.key for record in open_shards(tmp_path / "out").records(0)] == ["b", "c", "z"]
    assert [row["path"] for row in rows] == ["a.jpg"] and rows[0]["stage"] != "duplicate"
    assert result.records + result.errors == result.inputs == 4 and result.duplicates == 0


KILLED_AT_MANIFEST = """
import os, signal, sys
from shardkit.core.pack_options import pack_config
from shardkit.packing.pack import pack

rename = os.replace

def replace(source, destination, *args, **kwargs):
    if os.path.basename(destination) == "manifest.json":  # every shard done: die before the manifest
        os.kill(os.getpid(), signal.SIGKILL)
    return rename(source, destination, *args, **kwargs)

if __name__ == "__main__":
    os.replace = replace
    pack(pack_config(sys.argv[1], sys.argv[2], resize=96, workers=1, dedup="near", sidecars=True, shard_size=1))
"""


@pytest.mark.parametrize("marker_key", ["copies_used", "stand_ins"])  # (stand_ins: an earlier marker's name)
def test_a_resume_keeps_what_the_workers_did_with_the_copies(tmp_path: Path, marker_key: str) -> None:
    """Killed before the manifest, a pack whose kept file failed resumes from its done markers:
    every shard reused, and errors.jsonl says again that b was packed in a's place."""
    _sidecar_copies(tmp_path / "src", {"a": b"\xff\xfe not text", "b": b"the copy", "c": b"near", "z": b"other"})
    clean = tmp_path / "clean"
    pack(pack_config(tmp_path / "src", clean, resize=96, workers=1, dedup="near", sidecars=True, shard_size=1))
    script = tmp_path / "killed.py"
    script.write_text(KILLED_AT_MANIFEST)
    killed = subprocess.run([sys.executable, str(script), str(tmp_path / "src"), str(tmp_path / "out")],
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})  # fmt: skip
    assert killed.returncode == -9 and not (tmp_path / "out" / "manifest.json").exists()
    markers = sorted((tmp_path / "out" / ".shardkit" / "done").glob("*.json"))
    assert markers and all("copies_used" in json.loads(m.read_text()) for m in markers)
    for marker in markers:  # as a marker written before the name changed says it
        data = json.loads(marker.read_text())
        data[marker_key] = data.pop("copies_used")
        marker.write_text(json.dumps(data))
    config = pack_config(tmp_path / "src", tmp_path / "out", resize=96, workers=1, dedup="near", sidecars=True,
                         shard_size=1, resume=True)  # fmt: skip
    resumed = pack(config)
    assert resumed.reused_shards == resumed.shards == 2

    def files(root: Path) -> dict[str, bytes]:
        return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}

    assert files(tmp_path / "out") == files(clean)
    assert [(row["path"], row.get("duplicate_of")) for row in _errors(clean)] == [("c.jpg", "b"), ("a.jpg", None)]


# --- near copies that cluster: memory in the hashes, not in their pairs ------------------------


def clustered_hashes(count: int, seed: int = 0, bits: int = 4) -> np.ndarray:
    """`count` hashes each at most `bits` bits from one centre, so all within 2 * `bits` of one
    another: burst shots, video frames, near-identical product photos."""
    rng = np.random.default_rng(seed)
    flips = np.zeros(count, np.uint64)
    for column in rng.integers(0, 64, (bits, count)):
        flips |= np.uint64(1) << column.astype(np.uint64)
    return rng.integers(0, 2**63, dtype=np.uint64) ^ flips


@pytest.mark.slow  # (1.9 s: the fast suite stays under a minute)
def test_a_dense_cluster_is_grouped_in_memory_linear_in_its_size() -> None:
    """Issue #32: 20,000 hashes all within 8 bits of one another make 200 million pairs; listing
    them took 575 MB for 2,000 and 970 MB for 3,000. Grouping must take memory in the hashes."""
    import tracemalloc

    hashes = clustered_hashes(20_000)
    tracemalloc.start()
    try:
        group = near_components(hashes, 10)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(set(group.tolist())) == 1
    assert peak < 256 << 20, f"{peak / 2**20:.0f} MiB"  # about 130 MiB: one band's table, 1 M candidates
    items = [Item(f"/src/{n}.jpg", f"{n}.jpg", str(n)) for n in range(len(hashes))]
    table = Hashed([f"{n}" for n in range(len(hashes))], hashes, np.ones(len(hashes), bool), [])
    tracemalloc.start()
    try:
        kept, dropped, _ = keep_first(items, table, 10)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [item.key for item in kept] == ["0"] and {row.duplicate_of for row in dropped} == {"0"}
    assert peak < 256 << 20, f"{peak / 2**20:.0f} MiB"


def _keep_first_by_pairs(hashes: np.ndarray, threshold: int) -> list[tuple[int, int | None]]:
    """What keep_first decided when it listed every pair: per item, the kept item it is a copy
    of (None: kept), each value's neighbours from near_pairs."""
    values, value_of = np.unique(hashes, return_inverse=True)
    neighbours: dict[int, list[int]] = {}
    for a, b in near_pairs(values, threshold).tolist():
        neighbours.setdefault(a, []).append(b)
        neighbours.setdefault(b, []).append(a)
    kept_with_value: dict[int, int] = {}
    decided: list[tuple[int, int | None]] = []
    for at, value in enumerate(value_of.ravel().tolist()):
        found = [kept_with_value[v] for v in [value, *neighbours.get(value, [])] if v in kept_with_value]
        decided.append((at, min(found) if found else None))
        if not found:
            kept_with_value.setdefault(value, at)
    return decided


# one seed in the inner loop, all four in `make test` (2-5 s each)
@pytest.mark.parametrize("seed", [0, *(pytest.param(seed, marks=pytest.mark.slow) for seed in (1, 2, 3))])
def test_groups_and_kept_files_are_those_of_all_pairs_on_ordinary_hashes(seed: int) -> None:
    """Random hashes with planted near copies (some chained, some past the threshold), a small
    cluster and repeated values: the groups are the components of every pair, and keep_first keeps
    and drops exactly what it did when it listed the pairs."""
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 2**63, 3000, dtype=np.uint64)
    copies = []
    for value in base[:600]:  # chains: a copy of a copy, each a few bits on
        for _ in range(int(rng.integers(1, 4))):
            for bit in rng.choice(64, int(rng.integers(0, 9)), replace=False):
                value ^= np.uint64(1) << np.uint64(bit)
            copies.append(value)
    hashes = np.concatenate([base, np.array(copies, np.uint64), clustered_hashes(300, seed), base[:50]])
    hashes = hashes[rng.permutation(len(hashes))]
    for threshold in (0, 6, 10):
        pairs = near_pairs(np.unique(hashes), threshold)
        want = components(len(np.unique(hashes)), pairs)
        _, first_index, inverse = np.unique(hashes, return_index=True, return_inverse=True)
        got = near_components(hashes, threshold)
        assert (got == first_index[want][inverse.ravel()]).all()
        for chunk in (1 << 10, 1 << 14):  # small work arrays: the same answer
            assert (near_components(hashes, threshold, chunk) == got).all()
            assert np.array_equal(near_pairs(np.unique(hashes), threshold, chunk), pairs)
        items = [Item(f"/src/{n}.jpg", f"{n}.jpg", str(n)) for n in range(len(hashes))]
        table = Hashed([None] * len(hashes), hashes, np.ones(len(hashes), bool), [])
        kept, dropped, _ = keep_first(items, table, threshold)
        decided = _keep_first_by_pairs(hashes, threshold)
        assert [item.key for item in kept] == [str(at) for at, keeper in decided if keeper is None]
        assert [(row.path, row.duplicate_of) for row in dropped] == [
            (f"{at}.jpg", str(keeper)) for at, keeper in decided if keeper is not None
        ]
        assert threshold == 0 or len(dropped) > 300


def test_sheet_labels_keep_the_part_of_the_names_that_differs() -> None:
    from shardkit.checks.duplicates import LABEL_CHARS, cell_labels

    prefix = "/data/train/n01440764/n01440764_very_long_shared_name_"
    labels = cell_labels([prefix + "0001.JPEG", prefix + "0002.JPEG"])
    assert all(len(label) <= LABEL_CHARS for label in labels)
    assert labels[0] != labels[1] and labels[0].endswith("0001.JPEG") and labels[0].startswith("…")
    # short names as they are; a long one alone keeps its end
    assert cell_labels(["a/cat.jpg", "b/dog.jpg"]) == ["cat.jpg", "dog.jpg"]
    (alone,) = cell_labels(["x" * 40 + "_end.png"])
    assert len(alone) == LABEL_CHARS and alone.endswith("_end.png") and "…" in alone
    # one name in two folders: the folders tell them apart
    left, right = cell_labels(["/a/some/folder/one/img.jpg", "/a/some/folder/two/img.jpg"])
    assert left != right and left.endswith("one/img.jpg")


@pytest.mark.parametrize("seed", [0, 1])
def test_an_append_looks_up_its_new_files_and_decides_as_grouping_the_whole_output_did(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An output's records (chains of near copies, a dense cluster, repeated values, records with
    no hash) and new files, some near records, some near each other: the new files looked up in
    the records (near_any) keep and drop what grouping every record with them decided."""
    from shardkit.packing import dedup
    from shardkit.packing.dedup import Earlier

    rng = np.random.default_rng(seed)
    base = rng.integers(0, 2**63, 2000, dtype=np.uint64)
    near_copies = [
        value ^ (np.uint64(1) << np.uint64(int(bit)))
        for value, bit in zip(base[:300], rng.integers(0, 64, 300), strict=True)
    ]
    hashes = np.concatenate([base, np.array(near_copies, np.uint64), clustered_hashes(200, seed), base[:30]])
    hashes = hashes[rng.permutation(len(hashes))]
    before = int(len(hashes) * 0.8)
    hashed = rng.random(len(hashes)) > 0.02
    earlier = Earlier(
        [f"old/{n}" for n in range(before)], [f"/old/{n}.jpg" for n in range(before)], [None] * before,
        hashes[:before], hashed[:before],
    )  # fmt: skip
    items = [Item(f"/src/{n}.jpg", f"{n}.jpg", str(n)) for n in range(before, len(hashes))]
    table = Hashed([None] * len(items), hashes[before:], hashed[before:], [])
    for threshold in (0, 6, 10):
        close = near_any(hashes[:before], hashes[before:], threshold, 1 << 40)
        brute = [
            (distances(np.full(len(items), value, np.uint64), hashes[before:]) <= threshold).any()
            for value in hashes[:before]
        ]
        assert close is not None and close.tolist() == brute
        chosen = dedup._near_new(hashed, hashes, before, threshold)
        assert 0 < chosen[:before].sum() < hashed[:before].sum() / 2  # looked up: few records grouped
        looked_up = keep_first(items, table, threshold, earlier)
        monkeypatch.setattr(dedup, "_LOOKUP_BUDGET_PER_RECORD", 0)  # every record grouped, as before
        grouped = keep_first(items, table, threshold, earlier)
        monkeypatch.undo()
        assert [item.key for item in looked_up.kept] == [item.key for item in grouped.kept]
        assert [(r.path, r.duplicate_of, r.reason) for r in looked_up.dropped] == [
            (r.path, r.duplicate_of, r.reason) for r in grouped.dropped
        ]
        assert threshold == 0 or any(r.duplicate_of.startswith("old/") for r in grouped.dropped)
