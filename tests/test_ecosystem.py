"""Other readers of our tars, with the real packages: DALI with the index files pack writes beside
each tar (byte for byte what DALI's own wds2idx writes), wids through shardindex.json, Hugging Face
datasets; and verify and the output's ledger treating those files as the output's own."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from shardkit.checks.verify import verify
from shardkit.core.config import PackConfig, ResizeConfig
from shardkit.core.manifest import WIDS_NAME, idx_name, read_manifest, write_json_atomic
from shardkit.formats import get_format
from shardkit.packing.pack import pack
from shardkit.readers.dataset import open_shards
from shardkit.synthetic import write_image


@pytest.fixture(scope="module")
def tars(packed_sample) -> Path:
    return packed_sample("webdataset", 48, 20)  # (test_verify's too: read only)


@pytest.fixture
def copy(tars: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(tars, tmp_path / "copy"))


def stored_keys(out: Path) -> list[str]:
    return [sample.key for sample in open_shards(out, decode="bytes")]


def test_pack_lists_an_index_per_tar_and_the_wids_shard_list(tars: Path) -> None:
    manifest = read_manifest(tars)
    names = sorted(companion.name for companion in manifest.companions)
    assert names == sorted([idx_name(shard.name) for shard in manifest.shards] + [WIDS_NAME])
    versions = set()
    for shard in manifest.shards:
        lines = (tars / idx_name(shard.name)).read_text().splitlines()
        version, count = lines[0].split()
        assert int(count) == shard.count and len(lines) == shard.count + 1
        versions.add(version)
    # the sample has a file named "it's a img_00037.jpg": DALI splits on spaces, so its tar's index
    # is v1.1, without names
    assert versions == {"v1.1", "v1.2"}
    listed = json.loads((tars / WIDS_NAME).read_text())
    assert listed["wids_version"] == 1
    assert [(s["url"], s["nsamples"], s["filesize"]) for s in listed["shardlist"]] == [
        (shard.name, shard.count, shard.bytes) for shard in manifest.shards
    ]
    produce = get_format("webdataset").output_files  # what the format declares is what pack wrote
    assert produce is not None and produce(manifest.shards) == [(WIDS_NAME, (tars / WIDS_NAME).read_bytes())]
    assert verify(tars).ok


def test_the_index_is_what_dali_s_wds2idx_writes(tars: Path, tmp_path: Path) -> None:
    wds2idx = shutil.which("wds2idx", path=str(Path(sys.executable).parent))
    if wds2idx is None or shutil.which("tar") is None:
        pytest.skip("DALI's wds2idx (nvidia-dali-cuda120, in the dev extra) or GNU tar is not installed")
    compared = 0
    for shard in read_manifest(tars).shards:
        ours = (tars / idx_name(shard.name)).read_bytes()
        if not ours.startswith(b"v1.2 "):
            continue  # names with spaces: wds2idx writes them, and DALI cannot read that line back
        theirs = tmp_path / idx_name(shard.name)
        subprocess.run([wds2idx, str(tars / shard.name), str(theirs)], check=True, capture_output=True)
        assert ours == theirs.read_bytes()
        compared += 1
    assert compared >= 2


DALI_READ = """
import json, sys
from nvidia.dali import fn, pipeline_def
paths, indexes = json.loads(sys.argv[1]), json.loads(sys.argv[2]) or None
@pipeline_def(batch_size=8, num_threads=1, device_id=None)
def pipe():
    image, label, meta = fn.readers.webdataset(
        paths=paths, index_paths=indexes, ext=["jpg", "cls", "json"], missing_component_behavior="error", name="r"
    )
    return image, label, meta
p = pipe()
p.build()
total, keys = p.epoch_size("r"), []
while len(keys) < total:
    metas = p.run()[2]
    keys += [json.loads(bytes(metas.at(i)))["source"] for i in range(len(metas))]
print(json.dumps(keys[:total]))
"""


@pytest.mark.slow  # (1.8 s: DALI's import and pipeline build)
def test_dali_reads_every_sample_with_our_index_files_and_scans_nothing(tars: Path) -> None:
    pytest.importorskip("nvidia.dali", reason="nvidia-dali-cuda120 (dev extra) is not installed")
    manifest = read_manifest(tars)
    paths = [str(tars / shard.name) for shard in manifest.shards]
    runs = {}
    for indexed in (True, False):
        indexes = [str(tars / idx_name(shard.name)) for shard in manifest.shards] if indexed else []
        done = subprocess.run(
            [sys.executable, "-c", DALI_READ, json.dumps(paths), json.dumps(indexes)],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        runs[indexed] = done
    scanning = "Index file not provided"
    assert scanning in runs[False].stderr  # the warning this is about: DALI scans every tar without one
    assert scanning not in runs[True].stderr
    sources = [sample.meta["source"] for sample in open_shards(tars, decode="bytes")]
    assert json.loads(runs[True].stdout) == sources == json.loads(runs[False].stdout)


def test_wids_opens_the_output_by_its_shard_list(tars: Path, tmp_path: Path) -> None:
    wids = pytest.importorskip("wids", reason="wids (dev extra) is not installed")
    dataset = wids.ShardListDataset(str(tars / WIDS_NAME), cache_dir=str(tmp_path / "cache"), transformations=[])
    keys = stored_keys(tars)
    assert len(dataset) == len(keys)
    for index in (0, 17, len(keys) - 1, 5):  # random access, across shards
        sample = dataset[index]
        assert sample["__key__"] == keys[index]
        assert (
            json.loads(sample[".json"].getvalue())["source"] == open_shards(tars, decode="bytes")[index].meta["source"]
        )


def test_hugging_face_datasets_reads_the_tars(tars: Path, tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    shards = [str(tars / shard.name) for shard in read_manifest(tars).shards]
    loaded = datasets.load_dataset("webdataset", data_files={"train": shards}, split="train", cache_dir=str(tmp_path))
    assert loaded["__key__"] == stored_keys(tars)


def test_verify_checks_the_index_files(copy: Path) -> None:
    manifest = read_manifest(copy)
    first = copy / idx_name(manifest.shards[0].name)
    data = first.read_bytes()
    first.write_bytes(data.replace(b" ", b"  ", 1))  # one more byte
    assert {(p.kind, p.shard) for p in verify(copy).problems} == {("size", first.name)}
    first.write_bytes(data[:-2] + b"9\n")  # same size, one digit changed
    assert {(p.kind, p.shard) for p in verify(copy).problems} == {("checksum", first.name)}
    first.unlink()
    (copy / WIDS_NAME).unlink()
    assert {(p.kind, p.shard) for p in verify(copy).problems} == {("missing", first.name), ("missing", WIDS_NAME)}


def test_verify_checks_the_index_against_its_tar(copy: Path) -> None:
    """An index whose listed sha256 matches its bytes but not the tar (a stale or forged one) is
    caught by deriving it from the tar again."""
    manifest = read_manifest(copy)
    first = copy / idx_name(manifest.shards[0].name)
    forged = first.read_bytes().replace(b"jpg 512 ", b"jpg 1024 ", 1)
    first.write_bytes(forged)
    import hashlib

    companions = [
        replace(c, bytes=len(forged), sha256=hashlib.sha256(forged).hexdigest()) if c.name == first.name else c
        for c in manifest.companions
    ]
    write_json_atomic(copy / "manifest.json", replace(manifest, companions=companions).sealed().to_json())
    assert {(p.kind, p.shard) for p in verify(copy).problems} == {("companion", first.name)}


def test_a_manifest_may_name_only_index_files_as_companions(copy: Path) -> None:
    data = json.loads((copy / "manifest.json").read_text())
    data["companions"][0]["name"] = "notes.txt"
    (copy / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(Exception, match=r"not a shard.s index or shardindex\.json"):
        read_manifest(copy)


def test_overwrite_and_resume_treat_the_index_files_as_ours(copy: Path, sample_dataset: Path) -> None:
    config = PackConfig(str(sample_dataset), str(copy), format="webdataset", resize=ResizeConfig(48), shard_size=20)
    assert pack(replace(config, resume=True)).already_complete
    result = pack(replace(config, shard_size=30, overwrite=True))  # fewer shards: the old indexes go
    names = {entry.name for entry in copy.iterdir()} - {".shardkit"}
    listed = {s.name for s in result.manifest.shards} | {c.name for c in result.manifest.companions}
    assert names == listed | {"manifest.json", "errors.jsonl", "index.parquet"}
    assert verify(copy).ok


def test_names_with_spaces_get_an_index_without_names(tmp_path: Path) -> None:
    source = tmp_path / "src"
    for i in range(3):
        write_image(source / "a class" / f"photo {i}.jpg", 40, 30, seed=i)
    out = tmp_path / "out"
    pack(PackConfig(str(source), str(out), format="webdataset", resize=ResizeConfig(32)))
    lines = (out / "shard-000000.idx").read_text().splitlines()
    assert lines[0] == "v1.1 3"
    assert all(len(line.split()) == 3 * 3 for line in lines[1:])  # jpg, cls and json: ext offset size
    assert verify(out).ok


def _readme_lmdb(path: str) -> list[tuple[str, bytes, int | None, dict, list]]:
    """README's "Reading shardkit's output without shardkit", LMDB, as written there."""
    import lmdb

    out = []
    env = lmdb.open(path, subdir=False, readonly=True, lock=False)
    with env.begin() as txn:
        for i in range(json.loads(txn.get(b"__shardkit__"))["count"]):
            value = txn.get(b"i" + i.to_bytes(8, "big"))
            size = int.from_bytes(value[:4], "big")
            header = json.loads(value[4 : 4 + size])  # key, ext, label, meta, ...
            fields = sum(n for _, n in header.get("files", []))  # sidecar bytes after the image
            image = value[4 + size : len(value) - fields]
            out.append((header["key"], image, header["label"], header["meta"], header.get("files", [])))
    env.close()
    return out


def _readme_hdf5(path: str) -> list[tuple[str, bytes, int | None, dict, list]]:
    """README's "Reading shardkit's output without shardkit", HDF5, as written there."""
    import h5py

    out = []
    with h5py.File(path, "r") as f:
        offsets, keys, labels = f["offsets"][:], f["keys"].asstr()[:], f["labels"][:]
        extras = f["extras"].asstr()[:] if "extras" in f else [""] * len(keys)
        for i, key in enumerate(keys):
            blob = f["data"][offsets[i] : offsets[i + 1]].tobytes()
            fields = sum(n for _, n in json.loads(extras[i] or "{}").get("files", []))
            image, label = blob[: len(blob) - fields], int(labels[i])
            meta = json.loads(f["meta"].asstr()[i])
            files = json.loads(extras[i] or "{}").get("files", [])
            out.append((key, image, None if label == -1 else label, meta, files))
    return out


@pytest.mark.parametrize(("name", "read"), [("lmdb", _readme_lmdb), ("hdf5", _readme_hdf5)])
def test_the_documented_layouts_read_with_the_formats_own_libraries(tmp_path: Path, name: str, read) -> None:
    source = tmp_path / "src"
    for i in range(3):
        write_image(source / f"photo{i}.jpg", 60, 40, seed=i)
        (source / f"photo{i}.seg.png").write_bytes(Path(write_image(tmp_path / f"m{i}.png", 60, 40)).read_bytes())
        (source / f"photo{i}.cls").write_text(str(i))
        (source / f"photo{i}.txt").write_text(f"caption {i}")
    out = tmp_path / "out"
    pack(PackConfig(str(source), str(out), format=name, sidecars=True, resize=ResizeConfig(32)))
    theirs = [row for shard in read_manifest(out).shards for row in read(str(out / shard.name))]
    dataset = open_shards(out, decode="bytes")  # after: py-lmdb opens a file once per process
    ours = list(dataset)
    dataset.close()
    assert [(key, image, label, meta) for key, image, label, meta, _ in theirs] == [
        (s.key, s.image, s.label, s.meta) for s in ours
    ]
    assert all([field for field, _ in files] == ["seg.png"] for *_, files in theirs)
    assert verify(out).ok  # lock=False: no lock file was left
