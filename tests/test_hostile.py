"""Shards from strangers: readers and verify raise only shardkit's errors (never a traceback, never
a hang, never an allocation the file does not justify), and what pack writes, its readers read."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from shardkit.checks.verify import verify
from shardkit.core.config import EncodeConfig, PackConfig, ResizeConfig
from shardkit.core.errors import ManifestError, ShardFormatError, ShardkitError, ShardReadError
from shardkit.core.manifest import Manifest, ShardInfo, read_manifest, sha256_file, write_json_atomic
from shardkit.formats import available_formats, get_format
from shardkit.formats.base import Record
from shardkit.packing.pack import pack
from shardkit.readers.dataset import open_shards
from shardkit.synthetic import encode, picture, write_image
from tests.helpers import raw_tar, read_errors

DEEP = b"[" * 200_000 + b"]" * 200_000  # json.loads recurses once per level


def jpeg(width: int = 48, height: int = 32, seed: int = 0) -> bytes:
    return encode(picture(width, height, seed, 3), "JPEG", quality=90)


def records(n: int = 6) -> list[Record]:
    return [Record(f"r{i}", jpeg(seed=i), "jpg", i % 2, {"stored_width": 48, "stored_height": 32}) for i in range(n)]


def write_shard(path: Path, name: str, rows: list[Record]) -> Path:
    writer = get_format(name).writer(str(path))
    for row in rows:
        writer.add(row)
    writer.close()
    return path


def seal(folder: Path, name: str, counts: dict[str, int], **fields) -> None:
    """A manifest for the shard files in `folder` (sizes and sha256 as they are now), sealed."""
    shards = [ShardInfo(shard, count, (folder / shard).stat().st_size, sha256_file(folder / shard))
              for shard, count in counts.items()]  # fmt: skip
    records_ = sum(counts.values())
    manifest = Manifest(name, shards, classes=["a", "b"], totals={"inputs": records_, "records": records_,
                        "errors": 0}, **fields).sealed()  # fmt: skip
    write_json_atomic(folder / "manifest.json", manifest.to_json())
    (folder / "errors.jsonl").write_text("")


def output_with(tmp_path: Path, name: str, rows: list[Record] | None = None, count: int | None = None) -> Path:
    folder = tmp_path / f"out-{name}"
    folder.mkdir()
    rows = records() if rows is None else rows
    shard = f"shard-000000{get_format(name).suffix}"
    write_shard(folder / shard, name, rows)
    seal(folder, name, {shard: len(rows) if count is None else count})
    return folder


def read_everything(folder: Path, **options) -> None:
    """Every way of reading: iteration, random access, by key, and verify --deep."""
    dataset = open_shards(folder, **options)
    for index in range(len(dataset)):
        dataset[index]
    list(dataset)
    for key in ("r0", "nope"):
        with contextlib.suppress(KeyError):
            dataset.get(key)


def only_shardkit_errors(folder: Path, **options) -> set[str]:
    """Read `folder` every way; return the problem kinds verify finds. Any exception but ours fails."""
    with contextlib.suppress(ShardReadError, ShardFormatError):
        read_everything(folder, **options)
    report = verify(folder, deep=True, workers=1, **options)
    kinds = {problem.kind for problem in report.problems}
    assert "internal" not in kinds and "crashed" not in kinds, report.problems
    return kinds


# --- JSON nested too deeply -------------------------------------------------------------------


def test_deep_json_in_a_tar_member(tmp_path: Path) -> None:
    folder = tmp_path / "out"
    folder.mkdir()
    raw_tar(folder / "shard-000000.tar", [("r0.jpg", jpeg()), ("r0.json", DEEP)])
    seal(folder, "webdataset", {"shard-000000.tar": 1})
    with pytest.raises(ShardReadError, match="nested too deeply"):
        list(open_shards(folder))
    assert only_shardkit_errors(folder) == {"unreadable"}


def test_deep_json_in_an_lmdb_header(tmp_path: Path) -> None:
    import lmdb

    from shardkit.formats.lmdb import INFO_KEY, _index_key

    folder = tmp_path / "out"
    folder.mkdir()
    env = lmdb.open(str(folder / "shard-000000.lmdb"), subdir=False, lock=False)
    with env.begin(write=True) as txn:
        txn.put(_index_key(0), len(DEEP).to_bytes(4, "big") + DEEP + jpeg())
        txn.put(b"kr0", (0).to_bytes(8, "big"))
        txn.put(INFO_KEY, b'{"count": 1, "version": 1}')
    env.close()
    seal(folder, "lmdb", {"shard-000000.lmdb": 1})
    assert only_shardkit_errors(folder) == {"unreadable"}


def test_deep_json_in_hdf5_meta(tmp_path: Path) -> None:
    import h5py

    folder = output_with(tmp_path, "hdf5")
    with h5py.File(folder / "shard-000000.h5", "a") as h5:
        meta = h5["meta"][:]
        meta[2] = DEEP
        del h5["meta"]
        h5.create_dataset("meta", data=meta, dtype=h5py.string_dtype("utf-8"))
    seal(folder, "hdf5", {"shard-000000.h5": 6})
    assert only_shardkit_errors(folder) == {"unreadable"}


def test_deep_json_in_the_manifest_and_the_error_log(tmp_path: Path) -> None:
    folder = output_with(tmp_path, "webdataset")
    (folder / "errors.jsonl").write_bytes(DEEP + b"\n")
    with pytest.raises(ManifestError, match="nested too deeply"):
        read_errors(folder)
    assert "errors-log" in {p.kind for p in verify(folder).problems}
    (folder / "manifest.json").write_bytes(b'{"schema_version": 1, "x": ' + DEEP + b"}")
    with pytest.raises(ManifestError, match="nested too deeply"):
        open_shards(folder)
    assert {p.kind for p in verify(folder).problems} == {"manifest"}


# --- manifests that lie ----------------------------------------------------------------------


@pytest.mark.parametrize("name", available_formats())
@pytest.mark.parametrize("claimed", [4, 9])
def test_manifest_counts_that_disagree_with_the_shard(tmp_path: Path, name: str, claimed: int) -> None:
    folder = output_with(tmp_path, name, count=claimed)  # the shard holds 6
    dataset = open_shards(folder)
    with pytest.raises(ShardReadError, match="manifest says"):
        dataset[claimed - 1]
    with pytest.raises(ShardReadError, match="manifest says"):
        list(open_shards(folder))  # never a silently short epoch
    with pytest.raises(ShardReadError, match=r"manifest says|ends after 6 records"):
        list(open_shards(folder, shuffle=True, shuffle_buffer=2))  # nor one read in shuffled blocks
    assert "count" in only_shardkit_errors(folder)


MANIFEST_EDITS = {
    "totals is a list": lambda m: m.update(totals=[1]),
    "settings is a string": lambda m: m.update(settings="x"),
    "classes is an object": lambda m: m.update(classes={"a": 1}),
    "a class is a number": lambda m: m.update(classes=[1, 2]),
    "shards is an object": lambda m: m.update(shards={"a": 1}),
    "a shard is a list": lambda m: m.update(shards=[[1]]),
    "shard name is a number": lambda m: m["shards"][0].update(name=5),
    "shard name climbs out": lambda m: m["shards"][0].update(name="../x.tar"),
    "shard count is a string": lambda m: m["shards"][0].update(count="6"),
    "shard count is negative": lambda m: m["shards"][0].update(count=-1),
    "shard count is a float": lambda m: m["shards"][0].update(count=6.0),
    "shard bytes is huge": lambda m: m["shards"][0].update(bytes=10**30),
    "shard sha256 is not hex": lambda m: m["shards"][0].update(sha256="z" * 64),
    "shard has extra fields": lambda m: m["shards"][0].update(extra=1),
    "format is a number": lambda m: m.update(format=7),
    "format is unknown": lambda m: m.update(format="zip"),
    "schema version is a string": lambda m: m.update(schema_version="1"),
    "schema version is a bool": lambda m: m.update(schema_version=True),
    "created_by is a list": lambda m: m.update(created_by=[]),
    "checksum is a number": lambda m: m.update(checksum=1),
    "a total is negative": lambda m: m["totals"].update(records=-6),
    "a total is a string": lambda m: m["totals"].update(records="6"),
    "not an object": lambda m: m.clear() or m.update(_list=True),
}


@pytest.mark.parametrize("edit", MANIFEST_EDITS)
def test_manifest_fields_of_the_wrong_type(tmp_path: Path, edit: str) -> None:
    folder = output_with(tmp_path, "webdataset")
    data = json.loads((folder / "manifest.json").read_text())
    MANIFEST_EDITS[edit](data)
    if data.pop("_list", False):
        data = [data]
    elif isinstance(data, dict) and "schema_version" in data:  # resealed: only the content is wrong
        content = {key: value for key, value in data.items() if key != "checksum"}
        data.setdefault("checksum", "")
        if not isinstance(data["checksum"], int):
            import hashlib

            data["checksum"] = hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()
    (folder / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(ManifestError):
        open_shards(folder)
    assert {p.kind for p in verify(folder).problems} == {"manifest"}


# --- broken containers ------------------------------------------------------------------------


@pytest.mark.parametrize("count", [b"-1", b'"six"', b"1e400", b"1000000000000000000000000000000", b"true", b"[6]"])
def test_lmdb_record_count_that_is_not_a_count(tmp_path: Path, count: bytes) -> None:
    import lmdb

    from shardkit.formats.lmdb import INFO_KEY

    folder = output_with(tmp_path, "lmdb")
    env = lmdb.open(str(folder / "shard-000000.lmdb"), subdir=False, lock=False)
    with env.begin(write=True) as txn:
        txn.put(INFO_KEY, b'{"count": ' + count + b', "version": 1}')
    env.close()
    seal(folder, "lmdb", {"shard-000000.lmdb": 6})
    with pytest.raises(ShardFormatError, match="count"):
        len(get_format("lmdb").reader(str(folder / "shard-000000.lmdb")))
    assert only_shardkit_errors(folder) == {"unreadable"}


READ_LMDB = """
import sys
from shardkit.core.errors import ShardkitError
from shardkit.readers import open_shards
try:
    dataset = open_shards(sys.argv[1])
    dataset.get("r0")
    list(dataset)
except ShardkitError as error:
    print("refused:", error)
"""


@pytest.mark.parametrize("damage", ["key size", "value size", "child page", "node pointer"])
def test_lmdb_pages_that_point_past_the_file_are_refused_before_mapping(tmp_path: Path, damage: str) -> None:
    """LMDB itself would read past the end of the file (SIGBUS, the process dies) on these."""
    import struct

    from shardkit.formats.lmdb import _chosen_meta

    rows = [Record(f"r{i}", jpeg(seed=i)[:100], "jpg", i, {}) for i in range(300)]  # values stored inline
    folder = output_with(tmp_path, "lmdb", rows)
    path = folder / "shard-000000.lmdb"
    data = bytearray(path.read_bytes())
    fd = os.open(path, os.O_RDONLY)
    meta = _chosen_meta(fd, str(path))
    os.close(fd)
    root = meta.root * meta.page_size
    flags, lower = struct.unpack_from("<HH", data, root + 10)
    assert flags & 1, "expected a branch page at the root (300 records need several leaves)"
    nodes = struct.unpack_from(f"<{(lower - 16) // 2}H", data, root + 16)
    if damage == "child page":
        struct.pack_into("<HHH", data, root + nodes[-1], 0xFFFF, 0xFFFF, 0)  # a page far past the end
    else:
        low, high, _, _ = struct.unpack_from("<HHHH", data, root + nodes[-1])
        leaf = (low | high << 16) * meta.page_size  # the last leaf: the one nearest the end of the file
        _, lower = struct.unpack_from("<HH", data, leaf + 10)
        last = struct.unpack_from("<H", data, leaf + lower - 2)[0]
        if damage == "key size":
            struct.pack_into("<H", data, leaf + last + 6, 0xFFFF)
        elif damage == "value size":
            struct.pack_into("<HH", data, leaf + last, 0xFFFF, 0x7FFF)
        else:
            struct.pack_into("<H", data, leaf + lower - 2, meta.page_size - 2)
    path.write_bytes(bytes(data))
    seal(folder, "lmdb", {"shard-000000.lmdb": 300})
    read = subprocess.run([sys.executable, "-c", READ_LMDB, str(folder)], capture_output=True, text=True, timeout=60)
    assert read.returncode == 0, f"the reader died ({read.returncode}): {read.stderr[-500:]}"
    assert "refused:" in read.stdout and "damaged LMDB B-tree" in read.stdout
    assert only_shardkit_errors(folder) == {"unreadable"}


def test_damaged_hdf5_metadata_is_a_format_error(tmp_path: Path) -> None:
    folder = output_with(tmp_path, "hdf5")
    path = folder / "shard-000000.h5"
    data = bytearray(path.read_bytes())
    data[17] = 0xFF  # the root group's address: h5py raises RuntimeError ("addr overflow")
    path.write_bytes(bytes(data))
    seal(folder, "hdf5", {"shard-000000.h5": 6})
    with pytest.raises(ShardFormatError):
        len(get_format("hdf5").reader(str(path)))
    assert only_shardkit_errors(folder) == {"unreadable"}


def test_hdf5_chunks_far_larger_than_their_records_are_not_inflated(tmp_path: Path) -> None:
    import h5py

    folder = output_with(tmp_path, "hdf5")
    path = folder / "shard-000000.h5"
    with h5py.File(path, "a") as h5:
        data = h5["data"][:]
        del h5["data"]
        h5.create_dataset("data", data=data, maxshape=(None,), chunks=(128 << 20,), compression="gzip")
    seal(folder, "hdf5", {"shard-000000.h5": 6})
    with pytest.raises(ShardFormatError, match="refusing to inflate"):
        get_format("hdf5").reader(str(path)).read(0)
    assert only_shardkit_errors(folder) == {"unreadable"}


def npy_header(shape: tuple, dtype: str = "|u1") -> bytes:
    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(buffer, {"descr": dtype, "fortran_order": False, "shape": shape})
    return buffer.getvalue()


@pytest.mark.parametrize(
    "payload",
    [
        npy_header((65000, 65000, 3)) + b"\0" * 100,  # claims 12 GB
        npy_header((300000,)) + b"\0" * 300000,  # 1-D
        npy_header((10, 10, 3), "<f4") + b"\0" * 1200,  # float pixels
        npy_header((10, 10, 4)) + b"\0" * 400,  # four channels
        npy_header((10, 10, 3)) + b"\0" * 299,  # one byte short
        npy_header((10, 10, 3), "|O") + b"\0" * 300,  # objects (pickle)
        b"\x93NUMPY\x01\x00\xff\x7f" + b" " * 100,  # a header longer than the record
    ],
)
def test_hostile_raw_records(tmp_path: Path, payload: bytes) -> None:
    folder = output_with(tmp_path, "webdataset", [Record("r0", payload, "npy", 0, {})])
    with pytest.raises(ShardReadError, match=r"raw pixels|over the limit"):
        open_shards(folder)[0]
    assert only_shardkit_errors(folder) == {"decode"}


def bomb_jpeg() -> bytes:
    """A small valid JPEG whose frame header says 65000 x 65000."""
    data = bytearray(jpeg(16, 16))
    at = data.index(b"\xff\xc0")
    data[at + 5 : at + 9] = (65000).to_bytes(2, "big") * 2
    return bytes(data)


BOMB_CHECK = """
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))  # 12 GiB would be needed to decode it
from shardkit.checks.verify import verify
report = verify(sys.argv[1], deep=True, workers=1)
print(sorted({p.kind for p in report.problems}), [p.detail for p in report.problems][:1])
"""


def test_a_pixel_bomb_record_is_refused_from_its_header(tmp_path: Path) -> None:
    bomb = bomb_jpeg()
    assert len(bomb) < 1000
    folder = output_with(tmp_path, "webdataset", [Record("r0", bomb, "jpg", 0, {})])
    with pytest.raises(ShardReadError, match="over the limit"):
        open_shards(folder)[0]
    checked = subprocess.run([sys.executable, "-c", BOMB_CHECK, str(folder)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr
    assert "['decode']" in checked.stdout and "over the limit" in checked.stdout


def test_a_cmyk_jpeg_record_decodes_on_every_read_path(tmp_path: Path) -> None:
    """Valid CMYK JPEGs (print workflows, some stock photos) in a tar someone else wrote: libjpeg-turbo
    makes no RGB of them, so ds[i], iteration, verify --deep and the loader all go through Pillow."""
    pixels = np.random.default_rng(3).integers(0, 255, (32, 48, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).convert("CMYK").save(buffer, "JPEG", quality=95)
    folder = tmp_path / "out"
    folder.mkdir()
    raw_tar(folder / "shard-000000.tar", [("cmyk.jpg", buffer.getvalue()), ("cmyk.cls", b"0")])
    seal(folder, "webdataset", {"shard-000000.tar": 1})
    dataset = open_shards(folder)
    expected = np.asarray(Image.open(io.BytesIO(buffer.getvalue())).convert("RGB"))
    assert np.array_equal(dataset[0].image, expected) and np.array_equal(next(iter(dataset)).image, expected)
    images, labels = next(iter(dataset.loader(1, (32, 48), crop=None, output="numpy")))
    assert images.shape == (1, 3, 32, 48) and labels.tolist() == [0]
    assert np.abs(images[0].transpose(1, 2, 0).astype(int) - expected).max() <= 2  # (the kernel's own decode)
    report = verify(folder, deep=True)
    assert report.ok, report.problems


def test_the_pixel_limit_is_configurable(tmp_path: Path) -> None:
    folder = output_with(tmp_path, "webdataset")
    with pytest.raises(ShardReadError, match="over the limit of 1,000 pixels"):
        open_shards(folder, max_pixels=1000)[0]
    assert open_shards(folder, max_pixels=48 * 32)[0].image.shape == (32, 48, 3)
    assert {p.kind for p in verify(folder, deep=True, max_pixels=1000).problems} == {"decode"}
    torch = importlib.util.find_spec("torch") is not None  # (a pip install without the [torch] extra)
    for decode in ("pil", "torch") if torch else ("pil",):
        with pytest.raises(ShardReadError, match="over the limit"):
            open_shards(folder, decode=decode, max_pixels=1000)[0]


def test_tar_keys_readers_rely_on(tmp_path: Path) -> None:
    folder = tmp_path / "out"
    folder.mkdir()
    raw_tar(folder / "shard-000000.tar", [("r0.jpg", jpeg()), ("r0.jpg", jpeg(seed=1)), ("r0.cls", b"0")])
    seal(folder, "webdataset", {"shard-000000.tar": 1})
    with pytest.raises(ShardReadError, match="two jpg members"):
        list(open_shards(folder))
    assert only_shardkit_errors(folder) == {"unreadable"}
    raw_tar(folder / "shard-000000.tar", [("r\udcff0.jpg".encode("utf-8", "surrogateescape").decode("latin-1"),
                                          jpeg())])  # fmt: skip
    data = (folder / "shard-000000.tar").read_bytes()
    assert b"r\xc3\xbf0.jpg" in data  # tarfile wrote it as UTF-8 of the latin-1 text: make it raw bytes
    (folder / "shard-000000.tar").write_bytes(data.replace(b"r\xc3\xbf0.jpg", b"r\xff0.jpg\0"))
    seal(folder, "webdataset", {"shard-000000.tar": 1})
    with pytest.raises(ShardReadError, match="not UTF-8"):
        list(open_shards(folder))
    assert only_shardkit_errors(folder) == {"unreadable"}


def test_lmdb_key_index_that_is_not_utf8(tmp_path: Path) -> None:
    import lmdb

    folder = output_with(tmp_path, "lmdb")
    env = lmdb.open(str(folder / "shard-000000.lmdb"), subdir=False, lock=False)
    with env.begin(write=True) as txn:
        txn.put(b"k\xff\xfe", (1).to_bytes(8, "big"))
    env.close()
    seal(folder, "lmdb", {"shard-000000.lmdb": 6})
    with pytest.raises(ShardReadError, match="not UTF-8"):
        open_shards(folder).get("r0")


# --- never hang: FIFOs and devices ------------------------------------------------------------


@pytest.mark.parametrize("what", ["shard", "manifest.json", "errors.jsonl"])
@pytest.mark.parametrize("kind", ["fifo", "link to /dev/zero"])
@pytest.mark.timeout(60)  # a wait on the FIFO or /dev/zero would be the failure
def test_fifos_and_devices_are_refused_not_waited_on(shardkit, tmp_path: Path, what: str, kind: str) -> None:
    folder = output_with(tmp_path, "webdataset")
    target = folder / ("shard-000000.tar" if what == "shard" else what)
    if what == "shard":  # keep the manifest's word on its size, so that only the file type is wrong
        manifest = json.loads((folder / "manifest.json").read_text())
        manifest["shards"][0]["bytes"] = 0
        Manifest.from_json(manifest)
        (folder / "manifest.json").write_text(json.dumps(manifest))
    target.unlink()
    os.mkfifo(target) if kind == "fifo" else os.symlink("/dev/zero", target)
    verified = shardkit("verify", folder)
    assert verified.returncode == 1 and "Traceback" not in verified.stderr + verified.stdout
    assert "not a regular file" in verified.stdout
    if what != "errors.jsonl":
        with pytest.raises(ShardkitError, match="not a regular file"):  # (the timeout above: not waited on)
            list(open_shards(folder))


def test_a_fifo_in_a_list_source_is_skipped_with_its_reason(tmp_path: Path) -> None:
    write_image(tmp_path / "a.jpg", 40, 30)
    os.mkfifo(tmp_path / "b.jpg")
    (tmp_path / "list.txt").write_text("a.jpg\nb.jpg\n")
    result = pack(PackConfig(str(tmp_path / "list.txt"), str(tmp_path / "out"), workers=1))
    assert (result.records, result.errors) == (1, 1)
    assert read_errors(tmp_path / "out") == [
        {"path": "b.jpg", "stage": "read", "reason": "not a regular file (a FIFO)"}
    ]


# --- what pack writes, its readers read -------------------------------------------------------


def test_pack_refuses_a_raw_record_over_the_reader_limit(tmp_path: Path) -> None:
    from PIL import Image

    source, out = tmp_path / "src", tmp_path / "out"
    source.mkdir()
    Image.new("RGB", (9500, 9500), (90, 120, 200)).save(source / "huge.jpg", quality=50)  # 271 MB as pixels
    write_image(source / "small.jpg", 40, 30)
    result = pack(PackConfig(str(source), str(out), encode=EncodeConfig(encode="raw"), workers=1))
    assert (result.records, result.errors) == (1, 1)
    (row,) = read_errors(out)
    assert row["path"] == "huge.jpg" and row["stage"] == "encode" and "over the 256 MiB readers accept" in row["reason"]
    assert verify(out, deep=True).ok


def test_pack_refuses_an_upscaled_output_over_the_pixel_limit(tmp_path: Path) -> None:
    write_image(tmp_path / "src" / "a.jpg", 40, 30)
    config = PackConfig(str(tmp_path / "src"), str(tmp_path / "out"), resize=ResizeConfig(2000, upscale=True),
                        encode=EncodeConfig(max_pixels=1_000_000), workers=1)  # fmt: skip
    result = pack(config)
    assert result.errors == 1 and read_errors(tmp_path / "out")[0]["stage"] == "resize"


HUGE_INPUT = """
import re, sys
from shardkit.core.config import PackConfig
from shardkit.packing.pack import pack
result = pack(PackConfig(sys.argv[1], sys.argv[2], workers=1))
# VmHWM is this process image's peak (ru_maxrss would include the forked parent's, kept across exec)
peak_kb = int(re.search(r"VmHWM:\\s+(\\d+)", open("/proc/self/status").read()).group(1))
print(result.records, result.errors, peak_kb // 1024)
"""


def test_pack_never_reads_a_multi_gigabyte_input_whole(tmp_path: Path) -> None:
    source = tmp_path / "src"
    write_image(source / "huge.jpg", 64, 48)
    with open(source / "huge.jpg", "r+b") as file:
        file.truncate(4 << 30)  # sparse: a valid header, then 4 GiB of nothing
    write_image(source / "fine.jpg", 64, 48)
    run = subprocess.run([sys.executable, "-c", HUGE_INPUT, str(source), str(tmp_path / "out")],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert run.returncode == 0, run.stderr
    records, errors, peak_mb = map(int, run.stdout.split())
    assert (records, errors) == (1, 1) and peak_mb < 1024
    (row,) = read_errors(tmp_path / "out")
    assert row["stage"] == "read" and "not read" in row["reason"]


def test_resource_module_is_available() -> None:
    assert resource.getrlimit(resource.RLIMIT_AS)  # the bomb test relies on it (Linux)


@pytest.mark.parametrize("name", available_formats())
def test_written_shards_pass_their_own_reader_checks(sample_dataset: Path, tmp_path: Path, name: str) -> None:
    out = tmp_path / "out"
    pack(PackConfig(str(sample_dataset), str(out), format=name, resize=ResizeConfig(48), workers=1))
    assert verify(out, deep=True).ok
    assert len(list(open_shards(out))) == read_manifest(out).records


def test_hdf5_records_the_file_does_not_store_are_refused(tmp_path: Path) -> None:
    """Chunks never written read back as zeros: a small file could claim terabytes of records."""
    import h5py

    folder = output_with(tmp_path, "hdf5")
    path = folder / "shard-000000.h5"
    with h5py.File(path, "a") as h5:
        n = len(h5["offsets"]) - 1
        del h5["data"], h5["offsets"]
        h5.create_dataset("data", shape=(n * (200 << 20),), maxshape=(None,), dtype="u1", chunks=(1 << 20,))
        h5.create_dataset("offsets", data=np.arange(n + 1, dtype=np.int64) * (200 << 20))
    seal(folder, "hdf5", {"shard-000000.h5": 6})
    assert path.stat().st_size < 1 << 20
    with pytest.raises(ShardFormatError, match="the file stores"):
        len(get_format("hdf5").reader(str(path)))
    assert only_shardkit_errors(folder) == {"unreadable"}


@pytest.mark.parametrize(
    "payload",
    [
        b"DDS "
        + (124).to_bytes(4, "little")
        + bytes(72)
        + (32).to_bytes(4, "little")
        + (0x10000).to_bytes(4, "little")
        + bytes(48),  # a DDS header with unknown pixel format flags: Pillow raised NotImplementedError
        b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n",  # EPS: Pillow would run Ghostscript
        b"\x89PNG\r\n\x1a\n" + bytes(40),
    ],
)
@pytest.mark.parametrize("ext", ["png", "dds", "jpg"])
def test_records_pillow_would_open_with_other_plugins_are_refused(tmp_path: Path, payload: bytes, ext: str) -> None:
    folder = output_with(tmp_path, "webdataset", [Record("r0", payload, ext, 0, {})])
    for decode in ("rgb", "pil"):
        with pytest.raises(ShardReadError, match="cannot decode"):
            open_shards(folder, decode=decode)[0]
    assert only_shardkit_errors(folder) == {"decode"}


def test_a_manifest_over_the_size_limit_is_refused_unread(tmp_path: Path) -> None:
    from shardkit.core.manifest import MAX_MANIFEST_BYTES

    folder = output_with(tmp_path, "webdataset")
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["settings"]["padding"] = [{}] * (MAX_MANIFEST_BYTES // 3)
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ManifestError, match="over the limit"):
        open_shards(folder)


def test_bench_against_a_folder_refuses_record_paths_outside_it(shardkit, tmp_path: Path) -> None:
    source = tmp_path / "src"
    write_image(source / "a.jpg", 40, 30)
    (tmp_path / "secret.jpg").write_bytes(jpeg())
    os.mkfifo(source / "fifo.jpg")
    for crafted in ("../secret.jpg", str(tmp_path / "secret.jpg"), "fifo.jpg"):
        folder = tmp_path / f"out{len(crafted)}"
        folder.mkdir()
        write_shard(folder / "shard-000000.tar", "webdataset", [Record("r0", jpeg(), "jpg", 0, {"source": crafted})])
        seal(folder, "webdataset", {"shard-000000.tar": 1})
        run = shardkit("bench", folder, "--against", source, "--repeat", "1")
        assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr
        assert "not a path inside" in run.stderr or "not a regular file" in run.stderr, run.stderr


# --- labels outside the label rule (0..2**63-1): a damaged record ---------------------------------


def refused_everywhere(folder: Path, key: str) -> None:
    """A record breaking the label rule raises ShardReadError on every read path (never an
    OverflowError from the loader's int64 labels, never a ValueError from torch's collate), and
    on_error="skip" leaves it out."""
    dataset = open_shards(folder)
    index = [s.key for s in open_shards(folder, decode="bytes", on_error="skip")].count(key)
    assert index == 0
    with pytest.raises(ShardReadError, match="label"):
        dataset.get(key)
    with pytest.raises(ShardReadError, match="label"):
        list(dataset)
    with pytest.raises(ShardReadError, match="label"):
        list(dataset.loader(2, 16, output="numpy", workers=1))
    skipping = open_shards(folder, on_error="skip")
    assert sum(len(batch.keys) for batch in skipping.loader(2, 16, output="numpy", workers=1)) < len(skipping)
    assert skipping.skipped >= 1
    if importlib.util.find_spec("torch") is not None:
        from torch.utils.data import DataLoader

        with pytest.raises(ShardReadError, match="label"):
            list(DataLoader(open_shards(folder), batch_size=2))


@pytest.mark.parametrize("label", [b"99999999999999999999", b"-0000000000000000005"])
def test_an_adopted_tar_with_a_label_edited_past_the_rule(tmp_path: Path, label: bytes) -> None:
    """A stranger's tar, adopted, then its first `.cls` edited in place (the same size) to a number
    no int64 holds or a negative one: sample.label was that number, and the loader raised
    OverflowError, DataLoader(ds) a ValueError."""
    from shardkit.packing.adopt import adopt_tars

    folder = tmp_path / "adopted"
    folder.mkdir()
    stored = b"10000000000000000000"[:-1] + b"\n"  # 10**18: 20 bytes with its newline
    members = [member for i in range(3) for member in ((f"r{i}.jpg", jpeg(seed=i)), (f"r{i}.cls", stored))]
    tar = raw_tar(folder / "data-000.tar", members)
    adopt_tars(folder, workers=1)
    data = tar.read_bytes()
    at = data.index(stored)
    tar.write_bytes(data[:at] + label + data[at + len(label) :])
    refused_everywhere(folder, "r0")


@pytest.mark.parametrize("label", [2**63, 2**70, -5])
def test_an_lmdb_header_label_past_the_rule(tmp_path: Path, label: int) -> None:
    rows = records(4)
    rows[0] = rows[0]._replace(label=label)
    refused_everywhere(output_with(tmp_path, "lmdb", rows), "r0")


@pytest.mark.parametrize("label", [2**63, 2**64 - 1, -5])
def test_an_hdf5_label_past_the_rule(tmp_path: Path, label: int) -> None:
    """HDF5 stores labels as an array, -1 where a record has none: another negative, or an unsigned
    array's value past int64, breaks the rule."""
    h5py = pytest.importorskip("h5py")
    folder = output_with(tmp_path, "hdf5", records(4))
    shard = folder / "shard-000000.h5"
    with h5py.File(shard, "r+") as h5:
        labels = h5["labels"][:].astype(np.uint64 if label > 0 else np.int64)
        labels[0] = label
        del h5["labels"]
        h5.create_dataset("labels", data=labels)
    seal(folder, "hdf5", {shard.name: 4})
    refused_everywhere(folder, "r0")
    (tmp_path / "none").mkdir()
    unlabelled = output_with(tmp_path / "none", "hdf5", [r._replace(label=None) for r in records(2)])
    assert open_shards(unlabelled)[0].label is None  # -1: no label
