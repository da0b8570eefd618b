"""`shardkit index`: tars someone else wrote (GNU tar, img2dataset, Python's tarfile with odd members)
adopted as outputs that verify, open_shards and the loader read as shardkit's own; the tars are
never touched."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

from shardkit.checks.verify import verify
from shardkit.core.errors import ConfigError, OutputError
from shardkit.core.manifest import WIDS_NAME, idx_name, read_manifest
from shardkit.formats.tar_companions import dali_index
from shardkit.packing.adopt import adopt_tars
from shardkit.readers.dataset import open_shards
from shardkit.synthetic import write_image

from .servers import http_server

ROOT = Path(__file__).resolve().parents[1]
IMG2DATASET = ROOT / ".venv-img2dataset" / "bin" / "img2dataset"


def fingerprint(folder: Path) -> dict[str, tuple[str, int]]:
    """Each tar's sha256 and modification time: what index must never change."""
    return {
        path.name: (hashlib.sha256(path.read_bytes()).hexdigest(), path.stat().st_mtime_ns)
        for path in sorted(folder.glob("*.tar"))
    }


def jpeg(seed: int, width: int = 48, height: int = 32) -> bytes:
    buffer = io.BytesIO()
    from PIL import Image

    Image.effect_noise((width, height), 40 + seed).convert("RGB").save(buffer, "JPEG")
    return buffer.getvalue()


def add(archive: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    archive.addfile(info, io.BytesIO(data))


@pytest.fixture
def gnu_tars(tmp_path: Path) -> Path:
    """Two tars made with GNU tar (sorted, as webdataset asks) from a folder of photos in class
    folders, with .cls files."""
    if shutil.which("tar") is None:
        pytest.skip("GNU tar is not installed")
    source, out = tmp_path / "photos", tmp_path / "tars"
    out.mkdir()
    for i in range(12):
        write_image(source / f"c{i % 3}" / f"img_{i:03d}.jpg", 64 + i, 48, seed=i)
        (source / f"c{i % 3}" / f"img_{i:03d}.cls").write_text(str(i % 3))
    for part, folder in enumerate(["c0 c1", "c2"]):
        command = ["tar", "--sort=name", "-cf", str(out / f"part-{part}.tar"), *folder.split()]
        subprocess.run(command, cwd=source, check=True)
    return out


def test_gnu_tars_are_adopted_and_read_as_our_own(gnu_tars: Path) -> None:
    before = fingerprint(gnu_tars)
    result = adopt_tars(gnu_tars, workers=2)
    assert fingerprint(gnu_tars) == before  # never modified or moved
    manifest = read_manifest(gnu_tars)
    assert (result.tars, result.adopted, result.records, result.errors) == (2, 2, 12, 0)  # folders: not errors
    assert [(s.name, s.count) for s in manifest.shards] == [("part-0.tar", 8), ("part-1.tar", 4)]
    assert manifest.settings["adopted"]["extensions"] == {"cls": 12, "jpg": 12}
    assert manifest.classes == ["0", "1", "2"]
    for shard in manifest.shards:
        assert (gnu_tars / idx_name(shard.name)).read_bytes() == dali_index(str(gnu_tars / shard.name))
    assert (gnu_tars / WIDS_NAME).is_file()
    report = verify(gnu_tars, deep=True)
    assert report.ok, report.problems
    dataset = open_shards(gnu_tars, shuffle=True, seed=1)
    samples = list(dataset)
    assert sorted(s.key for s in samples) == sorted(f"c{i % 3}/img_{i:03d}" for i in range(12))
    assert all(s.label == int(s.key[1]) and s.image.shape == (48, 64 + int(s.key[-3:]), 3) for s in samples)
    batches = list(dataset.loader(5, 32, workers=2, output="numpy"))
    assert sum(len(labels) for _, labels in batches) == 12
    from shardkit.checks.bench import bench

    report = bench(gnu_tars, repeat=1)
    assert report.images == 12 and report.rows and all(row.images_per_second > 0 for row in report.rows)


def test_an_unsorted_tar_s_split_samples_are_named_with_the_fix(gnu_tars: Path, tmp_path: Path) -> None:
    """`tar cf` stores files in the order the disk lists them, so a sample's members may not be
    consecutive: webdataset then sees two samples. The one without an image is listed, saying how
    to make the tar."""
    source, out = gnu_tars.parent / "photos", tmp_path / "unsorted"
    out.mkdir()
    members = ["c0/img_000.cls", "c0/img_003.jpg", "c0/img_003.cls", "c0/img_000.jpg"]
    subprocess.run(["tar", "-cf", str(out / "x.tar"), *members], cwd=source, check=True)
    result = adopt_tars(out)
    assert result.records == 2
    rows = [json.loads(line) for line in (out / "errors.jsonl").read_text().splitlines()]
    assert [(row["path"], row["stage"]) for row in rows] == [("x.tar/c0/img_000", "index")]
    assert rows[0]["reason"].endswith("the image is elsewhere in the tar: make tars with `tar --sort=name`")
    labels = {s.key: s.label for s in open_shards(out, decode="bytes")}
    assert labels == {"c0/img_003": 0, "c0/img_000": None}  # as stock webdataset reads it


def test_what_readers_leave_out_is_listed_not_fatal(tmp_path: Path) -> None:
    """A sample with no image, a link member, a key another tar holds too, and a tar that is
    damaged: listed in errors.jsonl (a folder member is nothing a reader takes or misses: not
    listed); the rest is adopted and verifies."""
    folder = tmp_path / "tars"
    folder.mkdir()
    with tarfile.open(folder / "a.tar", "w") as archive:
        folder_member = tarfile.TarInfo("images")
        folder_member.type = tarfile.DIRTYPE
        archive.addfile(folder_member)
        add(archive, "images/one.jpg", jpeg(1))
        add(archive, "images/one.txt", b"a caption")
        add(archive, "images/caption-only.txt", b"no image here")
        link = tarfile.TarInfo("images/link.jpg")
        link.type, link.linkname = tarfile.SYMTYPE, "one.jpg"
        archive.addfile(link)
        add(archive, "images/two.jpg", jpeg(2))
    with tarfile.open(folder / "b.tar", "w") as archive:
        add(archive, "images/two.jpg", jpeg(3))  # a.tar holds this key too
        add(archive, "images/three.jpg", jpeg(4))
    whole = io.BytesIO()
    with tarfile.open(fileobj=whole, mode="w") as archive:
        add(archive, "x.jpg", jpeg(5))
    (folder / "c.tar").write_bytes(whole.getvalue()[:700])  # cut inside its image
    (folder / "notes.md").write_text("the folder's own file")
    result = adopt_tars(folder)
    assert (result.adopted, result.records) == (2, 4)
    rows = [json.loads(line) for line in (folder / "errors.jsonl").read_text().splitlines()]
    stages = sorted((row["stage"], row["path"]) for row in rows)
    assert stages == [
        ("duplicate", "b.tar/images/two"),
        ("index", "a.tar/images/caption-only"),
        ("index", "a.tar/images/link.jpg"),
        ("read", "c.tar"),
    ]
    assert "truncated" in next(row["reason"] for row in rows if row["path"] == "c.tar")
    report = verify(folder)
    assert report.ok, report.problems  # the listed duplicate, the left-out tar and notes.md are not problems
    assert report.notes == [
        "2 other files beside the adopted tars (theirs, or tars listed in errors.jsonl): not checked"
    ]
    keys = [s.key for s in open_shards(folder, decode="bytes")]
    assert keys == ["images/one", "images/two", "images/two", "images/three"]
    assert open_shards(folder, decode="bytes")[0].text == "a caption"


@pytest.fixture
def tree_tar(tmp_path: Path) -> Path:
    """`tar --sort=name -cf train.tar -C train .` of a class-folder tree: no .cls members, every
    member named ./class/file, and the folders themselves stored."""
    if shutil.which("tar") is None:
        pytest.skip("GNU tar is not installed")
    source, out = tmp_path / "train", tmp_path / "tree"
    out.mkdir()
    for i in range(9):
        write_image(source / ["dog", "cat", "zebra"][i % 3] / f"img_{i:03d}.jpg", 40, 30, seed=i)
    write_image(source / "top.jpg", 40, 30, seed=99)  # in no class folder
    subprocess.run(["tar", "--sort=name", "-cf", str(out / "train.tar"), "-C", str(source), "."], check=True)
    return out


def test_a_tar_of_a_class_tree_gets_its_classes_from_the_folders(tree_tar: Path, shardkit) -> None:
    done = shardkit("index", tree_tar, "--folder-labels")
    assert done.returncode == 0, done.stderr
    assert "labels: 3 classes from the keys' folders" in done.stdout
    assert (tree_tar / "errors.jsonl").read_text() == ""  # the folder members are not errors
    manifest = read_manifest(tree_tar)
    assert manifest.classes == ["cat", "dog", "zebra"]  # sorted, as a pack names class folders
    assert manifest.settings["adopted"]["labels"] == "folders"
    assert manifest.settings["adopted"]["records_in_no_folder"] == 1
    assert verify(tree_tar, deep=True).ok
    labels = {s.key: s.label for s in open_shards(tree_tar, decode="bytes")}
    expected = {f"./{['dog', 'cat', 'zebra'][i % 3]}/img_{i:03d}": [1, 0, 2][i % 3] for i in range(9)}
    assert labels == {**expected, "./top": None}
    batch = next(iter(open_shards(tree_tar).loader(10, 16, workers=1, output="numpy", crop="center")))
    assert sorted(batch.labels.tolist()) == sorted([-1, *expected.values()])


def test_folder_labels_are_refused_where_they_cannot_hold(tree_tar: Path, gnu_tars: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"part-0\.tar has \.cls labels of its own"):
        adopt_tars(gnu_tars, folder_labels=True)
    flat = tmp_path / "flat"
    flat.mkdir()
    with tarfile.open(flat / "a.tar", "w") as archive:
        add(archive, "one.jpg", jpeg(1))
    with pytest.raises(ConfigError, match="no key is in a folder"):
        adopt_tars(flat, folder_labels=True)
    assert not (flat / "manifest.json").exists() and not (gnu_tars / "manifest.json").exists()
    adopt_tars(tree_tar)  # without the option, the same tar has no labels
    assert {s.label for s in open_shards(tree_tar, decode="bytes")} == {None}


def test_index_refuses_before_any_work(tmp_path: Path, gnu_tars: Path) -> None:
    with pytest.raises(ConfigError, match=r"no \.tar files"):
        adopt_tars(tmp_path / "photos")  # class folders of photos, no tars
    adopt_tars(gnu_tars)
    with pytest.raises(OutputError, match=r"already has a manifest\.json; use --overwrite"):
        adopt_tars(gnu_tars)
    before = fingerprint(gnu_tars)
    assert adopt_tars(gnu_tars, overwrite=True).records == 12
    assert fingerprint(gnu_tars) == before and verify(gnu_tars).ok


def test_the_cli_says_what_it_did_or_why_not_in_one_line(gnu_tars: Path, shardkit) -> None:
    done = shardkit("index", gnu_tars)
    assert done.returncode == 0, done.stderr
    assert "2 of 2 tars, 12 records" in " ".join(done.stdout.split())  # (rich wraps at the terminal's width)
    again = shardkit("index", gnu_tars)
    assert again.returncode != 0 and "Traceback" not in again.stderr
    assert "already has a manifest.json" in again.stderr and len(again.stderr.strip().splitlines()) <= 3


@pytest.mark.slow  # img2dataset's own run, a whole process in its own venv: 10-12 s
def test_img2dataset_output_is_adopted(tmp_path: Path) -> None:
    """img2dataset's real output: it downloads photos from a local HTTP server and writes its tars,
    parquet and stats files; index adopts the tars, and the rest stays theirs."""
    if not IMG2DATASET.exists():
        pytest.skip("img2dataset is not installed (make img2dataset puts it in .venv-img2dataset)")
    photos = tmp_path / "photos"
    for i in range(30):
        write_image(photos / f"p{i:03d}.jpg", 100 + i, 80, seed=i)
    with http_server(photos) as url:
        urls = tmp_path / "urls.txt"
        urls.write_text("".join(f"{url}/p{i:03d}.jpg\n" for i in range(30)) + f"{url}/missing.jpg\n")
        out = tmp_path / "out"
        done = subprocess.run(
            [str(IMG2DATASET), "--url_list", str(urls), "--input_format", "txt", "--output_format", "webdataset",
             "--output_folder", str(out), "--processes_count", "1", "--thread_count", "4", "--image_size", "64",
             "--number_sample_per_shard", "12", "--enable_wandb", "False"],
            capture_output=True, text=True, timeout=300, env={**os.environ, "NO_ALBUMENTATIONS_UPDATE": "1"},
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(p.name for p in out.glob("*.tar")) == ["00000.tar", "00001.tar", "00002.tar"]
    before = fingerprint(out)
    result = adopt_tars(out)
    assert fingerprint(out) == before
    assert (result.adopted, result.records, result.errors) == (3, 30, 0)
    assert result.extensions == {"jpg": 30, "json": 30}  # img2dataset writes .txt only for captions
    report = verify(out, deep=True)
    assert report.ok, report.problems
    samples = list(open_shards(out))
    assert sorted(s.meta["url"] for s in samples) == sorted(f"{url}/p{i:03d}.jpg" for i in range(30))
    assert all(s.image.shape == (64, 64, 3) for s in samples)
    assert sum(len(labels) for _, labels in open_shards(out).loader(8, 32, output="numpy")) == 30


@pytest.mark.slow
def test_a_bucket_of_tars_is_adopted_in_place(s3, gnu_tars: Path, tmp_path: Path) -> None:
    from shardkit.storage.store import Store

    options = s3.options  # (the pool's processes may predate the fixture's AWS_* variables)
    store = Store("s3://data/adopt", options)
    for path in sorted(gnu_tars.glob("*.tar")):
        store.upload(str(path), path.name)
    result = adopt_tars("s3://data/adopt", storage_options=options)
    assert (result.adopted, result.records) == (2, 12), store.read("errors.jsonl", 1 << 20)
    assert {"manifest.json", "errors.jsonl", "part-0.idx", "part-1.idx", WIDS_NAME} <= set(store.listing())
    assert verify("s3://data/adopt", storage_options=options).ok
    dataset = open_shards("s3://data/adopt", decode="bytes", cache_dir=str(tmp_path / "cache"), storage_options=options)
    keys = [s.key for s in dataset]
    assert sorted(keys) == sorted(f"c{i % 3}/img_{i:03d}" for i in range(12))


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {
        path.relative_to(folder).as_posix(): path.read_bytes() for path in sorted(folder.rglob("*")) if path.is_file()
    }


def test_overwrite_refuses_an_output_that_pack_wrote_and_leaves_it_whole(tmp_path: Path) -> None:
    """--overwrite replaces only index's own files: on pack's output it would replace pack's manifest
    (its class names, its totals) and errors.jsonl and orphan index.parquet, so it is refused."""
    from shardkit import PackConfig, ResizeConfig, pack

    source, out = tmp_path / "src", tmp_path / "out"
    for i in range(6):
        write_image(source / f"c{i % 2}" / f"{i}.jpg", 40, 30, seed=i)
    (source / "c0" / "broken.jpg").write_bytes(b"not a jpeg")
    pack(PackConfig(str(source), str(out), resize=ResizeConfig(size=None), shard_size=4))
    before = _snapshot(out)
    with pytest.raises(OutputError, match=r"written by `shardkit pack`"):
        adopt_tars(out, overwrite=True)
    assert _snapshot(out) == before and read_manifest(out).classes == ["c0", "c1"]
    assert verify(out).ok


def test_index_refuses_a_folder_where_a_pack_is_running_or_was_stopped(tmp_path: Path, gnu_tars: Path) -> None:
    """A pack's working folder (.shardkit/) means its shards are on the way and its manifest is yet to
    come: a manifest written there by index would claim a half-made output."""
    (gnu_tars / ".shardkit" / "done").mkdir(parents=True)
    before = _snapshot(gnu_tars)
    for overwrite in (False, True):
        with pytest.raises(OutputError, match=r"\.shardkit/.*`shardkit pack`"):
            adopt_tars(gnu_tars, overwrite=overwrite)
    assert _snapshot(gnu_tars) == before


def test_labels_too_many_for_class_names_get_none_not_a_huge_list(tmp_path: Path) -> None:
    """A `.cls` of 99999999999 must not become a list of 10^11 class names (MemoryError): past a sane
    count the manifest has no class names, and says why."""
    folder = tmp_path / "tars"
    folder.mkdir()
    with tarfile.open(folder / "a.tar", "w") as archive:
        add(archive, "x/0.jpg", jpeg(0))
        add(archive, "x/0.cls", b"99999999999")
        add(archive, "x/1.jpg", jpeg(1))
        add(archive, "x/1.cls", b"3")
    result = adopt_tars(folder)
    manifest = read_manifest(folder)
    assert result.records == 2 and manifest.classes == []
    assert manifest.settings["adopted"]["labels"] == {"largest": 99999999999, "names": "too many to name"}
    assert verify(folder).ok
    assert sorted(s.label for s in open_shards(folder, decode="bytes")) == [3, 99999999999]


def test_a_label_past_int64_leaves_its_tar_out(tmp_path: Path) -> None:
    """A label no reader's int64 holds is refused as packing refuses it: the tar is left out, with why."""
    folder = tmp_path / "tars"
    folder.mkdir()
    for name, label in (("a.tar", b"1"), ("b.tar", b"99999999999999999999")):
        with tarfile.open(folder / name, "w") as archive:
            add(archive, "x/0.jpg", jpeg(0))
            add(archive, "x/0.cls", label)
    result = adopt_tars(folder)
    assert (result.adopted, result.records) == (1, 1)
    rows = [json.loads(line) for line in (folder / "errors.jsonl").read_text().splitlines()]
    assert [(row["path"], row["stage"]) for row in rows] == [("b.tar", "read")]
    assert "label" in rows[0]["reason"] and "2**63" in rows[0]["reason"]
    assert read_manifest(folder).classes == ["0", "1"] and verify(folder).ok


def test_a_tar_of_many_distinct_extensions_keeps_the_manifest_small(tmp_path: Path) -> None:
    """Each distinct member extension was a manifest entry: a stranger's tar of a million of them made
    a manifest over the size readers take. The most common are counted, the rest summed."""
    folder = tmp_path / "tars"
    folder.mkdir()
    with tarfile.open(folder / "a.tar", "w") as archive:
        add(archive, "x/0.jpg", jpeg(0))
        for i in range(300):
            add(archive, f"x/0.f{i:03d}", b"")
    result = adopt_tars(folder)
    adopted = read_manifest(folder).settings["adopted"]
    assert len(adopted["extensions"]) == len(result.extensions) == 100
    assert adopted["other_extensions"] == result.other_extensions == {"kinds": 201, "members": 201}
    assert verify(folder).ok


def no_surrogates(value: object) -> bool:
    """Whether parsed JSON holds only text: no lone surrogate (a name's undecodable bytes) anywhere."""
    if isinstance(value, dict):
        return all(no_surrogates(k) and no_surrogates(v) for k, v in value.items())
    if isinstance(value, list):
        return all(no_surrogates(v) for v in value)
    return not isinstance(value, str) or not any("\ud800" <= char <= "\udfff" for char in value)


def test_members_no_reader_takes_are_listed_so_inputs_are_records_and_errors(tmp_path: Path) -> None:
    """Members with no extension and hidden ones belong to no sample (webdataset and DALI skip them):
    they were left out with no errors.jsonl row."""
    folder = tmp_path / "tars"
    folder.mkdir()
    with tarfile.open(folder / "a.tar", "w") as archive:
        for name, data in [("k1.jpg", jpeg(1)), ("README", b"x"), (".hidden.jpg", jpeg(2)),
                           ("d/.x.jpg", jpeg(3)), ("k2.jpg", jpeg(4))]:  # fmt: skip
            add(archive, name, data)
    result = adopt_tars(folder, workers=1)
    rows = [json.loads(line) for line in (folder / "errors.jsonl").read_text().splitlines()]
    assert [(row["path"], row["reason"].split(",")[0]) for row in rows] == [
        ("a.tar/README", "no extension"), ("a.tar/.hidden.jpg", "a hidden file"), ("a.tar/d/.x.jpg", "a hidden file"),
    ]  # fmt: skip
    assert (result.records, result.errors, result.manifest.totals["inputs"]) == (2, 3, 5)
    assert verify(folder).ok


def test_a_tar_whose_name_is_not_utf8_is_listed_and_the_json_stays_utf8(tmp_path: Path) -> None:
    """A tar named with bytes that are not UTF-8 went into manifest.json (and shardindex.json) as
    a lone surrogate ("\\udcff"), which strict JSON readers refuse."""
    folder = tmp_path / "tars"
    folder.mkdir()
    for name in ("good.tar", b"caf\xe9.tar"):
        target = os.path.join(os.fsencode(folder), name) if isinstance(name, bytes) else folder / name
        with tarfile.open(target, "w") as archive:
            add(archive, "k.jpg", jpeg(1))
    result = adopt_tars(folder, workers=1)
    for name in ("manifest.json", "errors.jsonl", WIDS_NAME):
        text = (folder / name).read_bytes().decode("utf-8")  # strict
        parsed = [json.loads(line) for line in text.splitlines()] if name.endswith("jsonl") else json.loads(text)
        assert no_surrogates(parsed), (name, text)
    rows = [json.loads(line) for line in (folder / "errors.jsonl").read_text().splitlines()]
    assert [(row["path"], row["stage"]) for row in rows] == [("caf\ufffd.tar", "read")]
    assert "not UTF-8" in rows[0]["reason"] and (result.records, result.errors) == (1, 1)
    assert verify(folder).ok
