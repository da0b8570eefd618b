from __future__ import annotations

import hashlib
import json
import os
import random
from pathlib import Path

import numpy as np
import pytest

from shardkit.core.errors import ConfigError, ShardFormatError
from shardkit.formats import FORMATS, available_formats, get_format
from shardkit.formats.base import Record


def seeded_bytes(size: int, seed: int) -> bytes:
    """Incompressible bytes, the same on every run (a failure must be reproducible)."""
    return random.Random(seed).randbytes(size)


RECORDS = [
    Record(
        f"class{i % 3}/img_{i}", seeded_bytes(500 + 37 * i, i), "jpg", None if i % 5 == 0 else i % 3, {"i": i, "ü": "x"}
    )
    for i in range(40)
]


def write(path: Path, name: str, records=RECORDS) -> Path:
    writer = get_format(name).writer(str(path))
    for record in records:
        writer.add(record)
    assert writer.close() == len(records)
    return path


@pytest.mark.parametrize("name", available_formats())
def test_round_trip_by_index_key_and_iteration(tmp_path: Path, name: str) -> None:
    path = write(tmp_path / f"s{FORMATS[name].suffix}", name)
    reader = get_format(name).reader(str(path))
    assert len(reader) == 40
    assert list(reader) == RECORDS
    assert reader.read(17) == RECORDS[17]
    assert reader.read_key("class1/img_7") == RECORDS[7]
    assert reader.keys() == [r.key for r in RECORDS]
    with pytest.raises(KeyError):
        reader.read_key("nope")
    reader.close()


@pytest.mark.parametrize("name", available_formats())
def test_same_records_give_identical_bytes(tmp_path: Path, name: str) -> None:
    suffix = FORMATS[name].suffix
    first = write(tmp_path / f"a{suffix}", name)
    second = write(tmp_path / f"b{suffix}", name)
    assert hashlib.sha256(first.read_bytes()).digest() == hashlib.sha256(second.read_bytes()).digest()


@pytest.mark.parametrize("name", available_formats())
def test_lmdb_and_hdf5_shards_are_single_files(tmp_path: Path, name: str) -> None:
    write(tmp_path / f"s{FORMATS[name].suffix}", name)
    assert os.listdir(tmp_path) == [f"s{FORMATS[name].suffix}"]


@pytest.mark.parametrize("name", available_formats())
def test_truncated_shard_fails_with_a_format_error(tmp_path: Path, name: str) -> None:
    path = write(tmp_path / f"s{FORMATS[name].suffix}", name)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 3])
    reader = get_format(name).reader(str(path))
    with pytest.raises(ShardFormatError):
        list(reader)


@pytest.mark.parametrize("name", available_formats())
def test_garbage_file_fails_with_a_format_error(tmp_path: Path, name: str) -> None:
    path = tmp_path / f"s{FORMATS[name].suffix}"
    path.write_bytes(b"\x00garbage" * 1000)
    with pytest.raises(ShardFormatError):
        len(get_format(name).reader(str(path)))


def test_unknown_format_lists_the_valid_names() -> None:
    with pytest.raises(ConfigError, match="webdataset, lmdb, hdf5"):
        get_format("parquet")


def test_stock_webdataset_reads_our_tars(tmp_path: Path) -> None:
    webdataset = pytest.importorskip("webdataset")
    path = write(tmp_path / "s.tar", "webdataset")
    samples = list(webdataset.WebDataset(str(path), shardshuffle=False))
    assert [s["__key__"] for s in samples] == [r.key for r in RECORDS]
    assert samples[1]["jpg"] == RECORDS[1].data
    assert int(samples[1]["cls"]) == RECORDS[1].label
    assert "cls" not in samples[0]  # unlabelled records carry no .cls member


def test_hostile_tar_member_size_is_refused(tmp_path: Path) -> None:
    import io
    import tarfile

    path = tmp_path / "evil.tar"
    with tarfile.open(path, "w") as tar:
        info = tarfile.TarInfo("a.jpg")
        info.size = 10
        tar.addfile(info, io.BytesIO(b"0123456789"))
    data = bytearray(path.read_bytes())
    data[124:136] = b"77777777777\x00"  # size field: 8 GiB claimed, 10 bytes present
    path.write_bytes(bytes(data))
    with pytest.raises(ShardFormatError):
        reader = get_format("webdataset").reader(str(path))
        reader.read(0)


@pytest.mark.parametrize("size_field", [b"-0001000000\x00", b"abc\x00"])
def test_hostile_tar_size_fields_fail_cleanly_instead_of_looping(tmp_path: Path, size_field: bytes) -> None:
    path = write(tmp_path / "s.tar", "webdataset", RECORDS[:2])
    data = bytearray(path.read_bytes())
    data[124 : 124 + len(size_field)] = size_field
    path.write_bytes(bytes(data))
    with pytest.raises(ShardFormatError):
        list(get_format("webdataset").reader(str(path)))


def test_hdf5_shard_cannot_read_other_files_through_external_storage(tmp_path: Path) -> None:
    import h5py
    import numpy as np

    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"root:x:0:0")
    path = write(tmp_path / "s.h5", "hdf5", RECORDS[:1])
    with h5py.File(path, "a") as h5:
        del h5["data"]
        h5.create_dataset("data", shape=(10,), dtype=np.uint8, external=[(str(secret), 0, 10)])
    with pytest.raises(ShardFormatError, match="not a plain dataset"):
        get_format("hdf5").reader(str(path)).read(0)


BIG_RECORDS = [Record(f"big_{i}", seeded_bytes(300_000 + 7_919 * i, 100 + i), "jpg", i, {"i": i}) for i in range(12)]


@pytest.mark.parametrize("layout", ["as written", "gzip", "contiguous"])
def test_hdf5_records_across_chunks_and_any_data_layout(tmp_path: Path, layout: str) -> None:
    """Records span the 1 MiB chunks (read straight from the file); compressed data goes through h5py."""
    import h5py

    path = write(tmp_path / "s.h5", "hdf5", BIG_RECORDS)
    if layout != "as written":
        with h5py.File(path, "a") as h5:
            data = h5["data"][:]
            del h5["data"]
            if layout == "gzip":
                h5.create_dataset("data", data=data, chunks=(65536,), compression="gzip")
            else:
                h5.create_dataset("data", data=data)
    reader = get_format("hdf5").reader(str(path))
    assert list(reader) == BIG_RECORDS
    assert [r.key for r in reader.read_range(3, 7)] == [r.key for r in BIG_RECORDS[3:7]]
    assert reader.read(5) == BIG_RECORDS[5]
    assert (reader._chunks is None) == (layout == "gzip")


def test_hdf5_direct_reads_of_a_shard_truncated_under_the_reader_fail_cleanly(tmp_path: Path) -> None:
    path = write(tmp_path / "s.h5", "hdf5", BIG_RECORDS)
    reader = get_format("hdf5").reader(str(path))
    assert reader.read(0) == BIG_RECORDS[0] and reader._chunks is not None
    with open(path, "r+b") as file:
        file.truncate(path.stat().st_size // 2)
    with pytest.raises(ShardFormatError, match="cut short"):
        list(reader)
    reader.close()
    with pytest.raises(ShardFormatError, match="truncated"):  # and a fresh open refuses it outright
        list(get_format("hdf5").reader(str(path)))


def test_hdf5_empty_records_anywhere(tmp_path: Path) -> None:
    from shardkit.formats.hdf5 import CHUNK_BYTES

    for records in (
        [Record("a", b"", "jpg", None, {})],
        [Record("a", b"x" * CHUNK_BYTES, "jpg", 1, {}), Record("b", b"", "jpg", 2, {})],
    ):
        path = write(tmp_path / f"s{len(records)}.h5", "hdf5", records)
        reader = get_format("hdf5").reader(str(path))
        assert list(reader) == records and reader.read(len(records) - 1) == records[-1]
        reader.close()


@pytest.mark.parametrize("dataset", ["keys-bomb", "labels-array", "offsets-gzip"])
def test_hdf5_index_that_would_expand_in_memory_is_refused(tmp_path: Path, dataset: str) -> None:
    """Index datasets are read whole: compressed or fixed-width ones could expand far beyond the file."""
    import h5py
    import numpy as np

    path = write(tmp_path / "s.h5", "hdf5", RECORDS[:3])
    with h5py.File(path, "a") as h5:
        if dataset == "keys-bomb":
            del h5["keys"]
            h5.create_dataset("keys", shape=(3,), dtype="S1048576", chunks=(1,), compression="gzip")
        elif dataset == "labels-array":
            del h5["labels"]
            h5.create_dataset("labels", shape=(3,), dtype=np.dtype(("i8", (3,))))
        else:
            offsets = h5["offsets"][:]
            del h5["offsets"]
            h5.create_dataset("offsets", data=offsets, chunks=(2,), compression="gzip")
    with pytest.raises(ShardFormatError, match="index dataset"):
        len(get_format("hdf5").reader(str(path)))


def damaged_tar(tmp_path: Path, bad: int = 5) -> Path:
    """Ten records whose record `bad` has metadata that is not JSON (same length, so the tar stays whole)."""
    records = [Record(f"r{i}", seeded_bytes(3000, 200 + i), "jpg", i, {"i": i}) for i in range(10)]
    path = write(tmp_path / "d.tar", "webdataset", records)
    data = path.read_bytes()
    at = data.index(b'{"i": %d}' % bad)
    path.write_bytes(data[:at] + b"X" + data[at + 1 :])
    return path


def test_tar_yields_every_good_record_before_a_damaged_one(tmp_path: Path) -> None:
    reader = get_format("webdataset").reader(str(damaged_tar(tmp_path)))
    keys = []
    with pytest.raises(ShardFormatError, match="record r5 has unreadable metadata"):
        for record in reader:
            keys.append(record.key)
    assert keys == ["r0", "r1", "r2", "r3", "r4"]
    assert [r.key for r in reader.read_range(0, 5)] == keys  # never reads ahead into r5


@pytest.mark.parametrize("name", ["lmdb", "hdf5"])
def test_range_reads_and_reads_refuse_oversized_values(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """One size check in the format base, for every format's read paths (the limit lowered here)."""
    from shardkit.formats import base

    path = write(tmp_path / f"s{FORMATS[name].suffix}", name, RECORDS[:3])
    monkeypatch.setattr(base, "MAX_RECORD_BYTES", 100)
    with pytest.raises(ShardFormatError, match="over the size limit"):
        list(get_format(name).reader(str(path)).read_range(0, 3))
    with pytest.raises(ShardFormatError, match="over the size limit"):
        get_format(name).reader(str(path)).read(1)


def test_writers_take_validated_options(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown writer option 'level'"):
        get_format("webdataset").writer(str(tmp_path / "a.tar"), level=3)
    with pytest.raises(ConfigError, match="batch must be int"):
        get_format("lmdb").writer(str(tmp_path / "a.lmdb"), batch="many")
    with pytest.raises(ConfigError, match="chunk_bytes must be between"):
        get_format("hdf5").writer(str(tmp_path / "a.h5"), chunk_bytes=10)
    import h5py

    small = get_format("hdf5").writer(str(tmp_path / "b.h5"), chunk_bytes=4096)
    for record in RECORDS[:5]:
        small.add(record)
    assert small.close() == 5
    with h5py.File(tmp_path / "b.h5") as h5:
        assert h5["data"].chunks is None  # all of it fits before the first flush: contiguous, exact
        assert h5["data"].shape == (sum(len(r.data) for r in RECORDS[:5]),)
    assert [r.key for r in get_format("hdf5").reader(str(tmp_path / "b.h5"))] == [r.key for r in RECORDS[:5]]
    big = get_format("hdf5").writer(str(tmp_path / "c.h5"), chunk_bytes=4096)
    blob = np.random.default_rng(0).integers(0, 256, 11 << 20, dtype=np.uint8).tobytes()
    records = [Record(f"k{i}", blob, "npy", None, {}) for i in range(3)]  # 33 MiB: past the first flush
    for record in records:
        big.add(record)
    assert big.close() == 3
    with h5py.File(tmp_path / "c.h5") as h5:
        assert h5["data"].chunks == (4096,)
    data_bytes = 3 * len(blob)
    # at most one chunk of padding; the rest is HDF5's chunk index (~40 bytes a chunk) and ours
    assert data_bytes < (tmp_path / "c.h5").stat().st_size < 1.01 * data_bytes + 4096 + 64 * 1024
    assert [r.data == blob for r in get_format("hdf5").reader(str(tmp_path / "c.h5"))] == [True] * 3


def test_hdf5_shards_are_not_padded_to_whole_chunks(tmp_path: Path) -> None:
    """A 100-record shard takes its data's bytes and a small index, not whole 1 MiB chunks."""
    rng = np.random.default_rng(1)
    records = [Record(f"k{i:03d}", rng.integers(0, 256, 27_000, dtype=np.uint8).tobytes(), "jpg", i % 3, {"i": i})
               for i in range(100)]  # fmt: skip
    data_bytes = sum(len(r.data) for r in records)
    h5 = write(tmp_path / "s.h5", "hdf5", records)
    tar = write(tmp_path / "s.tar", "webdataset", records)
    assert Path(h5).stat().st_size < 1.02 * data_bytes + 64 * 1024
    assert Path(h5).stat().st_size < 1.05 * Path(tar).stat().st_size


def test_hdf5_data_must_be_bytes(tmp_path: Path) -> None:
    import h5py

    path = write(tmp_path / "s.h5", "hdf5", RECORDS[:3])
    with h5py.File(path, "a") as h5:
        size = h5["data"].shape[0]
        del h5["data"]
        h5.create_dataset("data", shape=(size,), dtype="S65536", chunks=(4,), compression="gzip")
    with pytest.raises(ShardFormatError):
        get_format("hdf5").reader(str(path)).read(0)


def test_json_objects_never_shifts_metadata_between_records() -> None:
    from shardkit.formats.base import json_objects

    # Joined, these would parse as two objects: '{"a": "x},{"' and '}' then '{"b": 1}, {"c": 2}'.
    blobs = [b'{"a": "x}', b'{"}', b'{"b": 1}, {"c": 2}', b' {"ok": [1, 2]} ', b"\xff", b"[1]"]
    assert json_objects(blobs) == [None, None, None, {"ok": [1, 2]}, None, None]


def test_tar_cut_between_members_is_truncated_not_shorter(tmp_path: Path) -> None:
    path = write(tmp_path / "s.tar", "webdataset", RECORDS[:4])
    data = path.read_bytes()
    cut = data.index(b"class1/img_1.jpg") - 0  # the header block of record 1's first member
    cut -= cut % 512
    path.write_bytes(data[:cut])
    with pytest.raises(ShardFormatError, match="truncated"):
        list(get_format("webdataset").reader(str(path)))


def test_the_tar_writer_writes_the_bytes_tarfile_writes(tmp_path: Path) -> None:
    """Our tar headers (built by hand: tarfile costs ~25 us a member) are tarfile's, byte for byte,
    for plain names, names past 100 bytes (pax), empty members and captions."""
    import io
    import tarfile

    from shardkit.formats.base import Record
    from shardkit.formats.webdataset import TarShardWriter

    records = [
        Record("a", b"\xff\xd8jpeg", "jpg", 3, {"source": "a.jpg"}),
        Record("b/" + "long" * 40, b"x" * 1000, "jpg", None, {}, text="", columns={"k": [1, 2]}),
        Record("c", b"", "npy", 0, {"w": 1}, text=["one", "二"], columns={}),
    ]
    writer = TarShardWriter(str(tmp_path / "ours.tar"))
    for record in records:
        writer.add(record)
    writer.close()
    with tarfile.open(tmp_path / "theirs.tar", "w", format=tarfile.PAX_FORMAT) as tar:
        for record in records:
            members = [(f"{record.key}.{record.ext}", record.data)]
            members += [(f"{record.key}.cls", str(record.label).encode())] if record.label is not None else []
            members.append((f"{record.key}.json", json.dumps(record.meta, sort_keys=True).encode()))
            if isinstance(record.text, str):
                members.append((f"{record.key}.txt", record.text.encode()))
            elif record.text is not None:
                members.append((f"{record.key}.txt", "\n".join(record.text).encode()))
                compact = json.dumps(record.text, ensure_ascii=False, separators=(",", ":"))
                members.append((f"{record.key}.captions.json", compact.encode()))
            if record.columns is not None:
                compact = json.dumps(record.columns, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
                members.append((f"{record.key}.columns.json", compact.encode()))
            for name, payload in members:
                info = tarfile.TarInfo(name)
                info.size, info.mtime, info.mode, info.uid, info.gid, info.uname, info.gname = (
                    len(payload),
                    0,
                    0o444,
                    0,
                    0,
                    "",
                    "",
                )
                tar.addfile(info, io.BytesIO(payload))
    assert (tmp_path / "ours.tar").read_bytes() == (tmp_path / "theirs.tar").read_bytes()


def test_an_hdf5_shard_read_through_its_descriptor_outlives_its_name(tmp_path: Path) -> None:
    """A cached remote shard is read through this process's descriptor (/dev/fd/N) while another
    process's eviction may unlink it: HDF5 opened paths by their real name and could not ("can't
    retrieve real path"); the shard a reader holds stays readable."""
    path = write(tmp_path / "s.h5", "hdf5", RECORDS[:4])
    fd = os.open(path, os.O_RDONLY)
    try:
        os.unlink(path)  # evicted between the descriptor's open and the reader's
        reader = get_format("hdf5").reader(f"/dev/fd/{fd}")
        assert [(r.key, r.data) for r in reader] == [(r.key, r.data) for r in RECORDS[:4]]
        assert reader.read(2).key == RECORDS[2].key
        reader.close()
    finally:
        os.close(fd)


def test_output_files_are_the_formats_own() -> None:
    """A format declares the files for other readers beside the whole output: WebDataset's is wids'
    shardindex.json, listing the shards in manifest order with their counts and sizes; the others
    have none."""
    from shardkit.core.manifest import WIDS_NAME, ShardInfo

    shards = [ShardInfo("shard-000000.tar", 20, 4096, "a" * 64), ShardInfo("shard-000001.tar", 7, 2048, "b" * 64)]
    produce = get_format("webdataset").output_files
    assert produce is not None
    ((name, data),) = produce(shards)
    listed = json.loads(data)
    assert name == WIDS_NAME and data.endswith(b"\n") and data == produce(list(shards))[0][1]
    assert listed["__kind__"] == "wids-shard-index-v1" and listed["wids_version"] == 1
    assert listed["shardlist"] == [
        {"url": "shard-000000.tar", "nsamples": 20, "filesize": 4096},
        {"url": "shard-000001.tar", "nsamples": 7, "filesize": 2048},
    ]
    assert get_format("lmdb").output_files is None and get_format("hdf5").output_files is None


@pytest.mark.parametrize("name", available_formats())
def test_a_plain_reader_leaves_only_what_the_format_declares(tmp_path: Path, name: str) -> None:
    """Each format's own library, read with its defaults, leaves beside a shard only the files its
    Backend declares as leftovers (verify notes those and goes on): LMDB's lock file."""
    path = write(tmp_path / f"s{FORMATS[name].suffix}", name)
    if name == "lmdb":
        import lmdb

        lmdb.open(str(path), subdir=False, readonly=True).close()  # the library's defaults: lock=True
    elif name == "hdf5":
        import h5py

        h5py.File(path, "r").close()
    else:
        import tarfile

        with tarfile.open(path) as tar:
            tar.getmembers()
    declared = {path.name + leftover.suffix for leftover in get_format(name).leftovers}
    assert set(os.listdir(tmp_path)) == {path.name} | declared
    assert all(leftover.what for leftover in get_format(name).leftovers)
    assert (name == "lmdb") == bool(declared)


def test_the_tar_writers_hash_and_members_are_the_files(tmp_path: Path) -> None:
    """The writer hashes what it writes and keeps each member's place, so that pack reads no shard
    again: the sha256 and DALI's index it gives are the written file's, read back, for plain and
    pax names, names with spaces (DALI's v1.1), non-ASCII ones, captions, columns, sidecars, hidden
    and extension-less members, and a record whose key holds a dot (wds2idx groups by name)."""
    from shardkit.core.manifest import sha256_file
    from shardkit.formats.tar_companions import dali_index
    from shardkit.formats.tar_headers import FileBytes, tar_members

    cases = {
        "plain": [Record(f"k{n:03d}", seeded_bytes(700 + n, n), "jpg", n, {"source": f"{n}.jpg"}) for n in range(40)],
        "odd names": [
            Record("a", b"\xff\xd8jpeg", "jpg", 3, {"source": "a.jpg"}, files={"seg.png": b"png", "depth.npy": b""}),
            Record("b/" + "long" * 40, b"x" * 1000, "jpg", None, {}, text="", columns={"k": [1, 2]}),
            Record("c.d", b"", "npy", 0, {"w": 1}, text=["one", "二"], columns={}),
            Record("ünï/çödé", b"y" * 513, "jpg", 1, {}),
            Record(".hidden", b"z", "jpg", None, {}),
            Record("no_ext", b"z", "", None, {}),
        ],
        "spaced": [Record("my photo", b"p" * 10, "jpg", None, {}), Record("plain", b"q", "jpg", None, {})],
    }
    for name, records in cases.items():
        path = tmp_path / f"{name}.tar"
        writer = get_format("webdataset").writer(str(path))
        for record in records:
            writer.add(record)
        assert writer.close() == len(records)
        assert writer.sha256() == sha256_file(path), name
        fd = os.open(path, os.O_RDONLY)
        try:
            read = [member[:3] for member in tar_members(FileBytes(fd, os.fstat(fd).st_size), str(path))]
        finally:
            os.close(fd)
        assert writer.members == read, name
        assert dali_index(str(path), writer.members) == dali_index(str(path)), name
    assert dali_index(str(tmp_path / "spaced.tar"), None).startswith(b"v1.1 ")
