"""The compiled tar walk (shardkit.core._tar) must read what Python's walk reads: the same records, or
the same error after the same records, on our shards, on tars other writers made, and on damaged
ones. It takes only plain records and hands the rest to Python, so every case below is read both
ways, every way a reader reads (iteration, ranges from a mark, the member table), and compared."""

from __future__ import annotations

import io
import os
import random
import tarfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from shardkit.core.codecs import tar_walker
from shardkit.core.errors import ShardFormatError
from shardkit.formats import webdataset
from shardkit.formats.base import Record
from shardkit.formats.webdataset import TarShardReader
from tests.helpers import raw_tar
from tests.test_formats import seeded_bytes, write

walker = tar_walker()
needs_walker = pytest.mark.skipif(walker is None, reason="shardkit.core._tar was not compiled (no C compiler?)")

Outcome = list[Any]


def records(count: int = 6, seed: int = 0) -> list[Record]:
    """Records of every shape the writer makes: labels or none, captions (one, several), columns,
    sidecar files, images of sizes around the read-ahead (4 KiB)."""
    made = []
    for i in range(count):
        size = (100, 4000, 4096, 4097, 9000, 70000)[i % 6]
        text: str | list[str] | None = (None, "a cat", ["one", "two"])[i % 3]
        columns = {"url": f"http://x/{i}"} if i % 4 == 1 else None
        files = {"seg.png": seeded_bytes(300 + i, seed + i)} if i % 5 == 2 else None
        label = None if i % 7 == 3 else i
        made.append(
            Record(f"k{i:03d}", seeded_bytes(size, seed * 100 + i), "jpg", label, {"i": i}, text, columns, files)
        )
    return made


def our_tar(path: Path, made: list[Record] | None = None) -> Path:
    return write(path, "webdataset", made if made is not None else records())


def read_every_way(path: Path) -> Outcome:
    """What each way of reading gives: records as tuples, or the error's type and message (with the
    records read before it)."""
    outcome: Outcome = []

    def attempt(what: str, read: Callable[[], Any]) -> None:
        got: list[Any] = []
        try:
            for item in read():
                got.append(tuple(item) if isinstance(item, Record) else item)
        except (ShardFormatError, OSError) as error:
            got.append((type(error).__name__, str(error)))
        outcome.append((what, got))

    attempt("iteration", lambda: iter(TarShardReader(str(path))))
    for start, stop in ((0, 2), (1, 4), (3, 5), (2, 1000)):
        reader = TarShardReader(str(path))
        attempt(f"range {start}:{stop}", lambda reader=reader, start=start, stop=stop: reader.read_range(start, stop))
        attempt(f"then {stop}:{stop + 2}", lambda reader=reader, stop=stop: reader.read_range(stop, stop + 2))
    reader = TarShardReader(str(path))
    attempt("keys", lambda: reader.keys())
    attempt("by index", lambda: [reader.read(i) for i in range(len(reader))])
    return outcome


def both_ways(path: Path, monkeypatch: pytest.MonkeyPatch) -> Outcome:
    """Reads `path` with the compiled walk and with Python's; asserts they agree."""
    compiled = read_every_way(path)
    with monkeypatch.context() as patch:
        patch.setattr(webdataset, "tar_walker", lambda: None)
        python = read_every_way(path)
    assert compiled == python, path.name
    return compiled


@needs_walker
def test_our_shards_are_read_by_the_compiled_walk_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = our_tar(tmp_path / "ours.tar")
    calls: list[int] = []

    def no_python_walk(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        raise AssertionError("Python's walk ran on a shard the compiled walk takes whole")

    outcome = both_ways(path, monkeypatch)
    assert [record[0] for record in outcome[0][1]] == [r.key for r in records()]
    assert outcome[0][1] == [tuple(r) for r in records()]
    with monkeypatch.context() as patch:
        patch.setattr(webdataset, "tar_members", no_python_walk)
        assert read_every_way(path) == outcome
    assert not calls


@needs_walker
def test_batches_stop_at_the_record_and_byte_limits(tmp_path: Path) -> None:
    path = our_tar(tmp_path / "ours.tar", records(12))
    reader = TarShardReader(str(path))
    fd, size = reader._descriptor(), os.path.getsize(path)
    found, stop, state = walker.walk(fd, 0, size, 5, 1 << 40, 1 << 30, True)
    assert (len(found), state) == (5, 0) and stop == found[-1][2]
    rest, _, state = walker.walk(fd, stop, size, 100, 1 << 40, 1 << 30, True)
    assert (len(rest), state) == (7, 1)
    assert [entry[0] for entry in found + rest] == [r.key for r in records(12)]
    assert all(entry[3]["jpg"] == r.data for entry, r in zip(found + rest, records(12), strict=True))
    one, _, state = walker.walk(fd, 0, size, 100, 1, 1 << 30, True)  # one byte: a record crosses it at once
    assert (len(one), state) == (1, 0)
    over, at, state = walker.walk(fd, 0, size, 100, 1 << 40, 50, True)  # no record fits: Python refuses it
    assert (over, at, state) == ([], 0, 2)


@needs_walker
def test_offsets_past_the_file_are_left_to_python(tmp_path: Path) -> None:
    """A direct call with offsets no reader passes: no sum may wrap (a review found a crash at 2**63 - 1)."""
    path = our_tar(tmp_path / "ours.tar")
    fd, size = os.open(path, os.O_RDONLY), os.path.getsize(path)
    try:
        for pos, claimed in ((2**63 - 1, size), (2**63 - 512, size), (-1, size), (size + 1, size), (0, 2**62)):
            assert walker.walk(fd, pos, claimed, 10, 1 << 40, 1 << 30, True) == ([], pos, 2)
    finally:
        os.close(fd)


FOREIGN: dict[str, Callable[[Path], Path]] = {
    "gnu long names": lambda p: raw_tar(
        p,
        [("a/" + "x" * 120 + ".jpg", b"1" * 700), ("a/" + "x" * 120 + ".cls", b"3"), ("b.jpg", b"2" * 10)],
        tarfile.GNU_FORMAT,
    ),
    "pax names": lambda p: raw_tar(p, [("ä.jpg", b"1"), ("ä.cls", b"2"), ("b.jpg", b"3"), ("c.jpg", b"4")]),
    "pax after plain": lambda p: raw_tar(p, [("a.jpg", b"1"), ("b.jpg", b"2"), ("ö.jpg", b"3"), ("d.jpg", b"4")]),
    "ustar prefix": lambda p: raw_tar(
        p,
        [("d" * 90 + "/e" * 20 + "/a.jpg", b"1"), ("d" * 90 + "/e" * 20 + "/a.cls", b"5"), ("z.jpg", b"0")],
        tarfile.USTAR_FORMAT,
    ),
    "gnu magic": lambda p: raw_tar(p, [("a.jpg", b"1" * 5000), ("a.json", b"{}"), ("b.jpg", b"2")], tarfile.GNU_FORMAT),
    "no extension and hidden": lambda p: raw_tar(
        p, [("a.jpg", b"1"), ("README", b"r"), ("a.cls", b"1"), (".DS_Store", b"x"), ("b.jpg", b"2")]
    ),
    "caption only sample": lambda p: raw_tar(p, [("a.jpg", b"1"), ("b.txt", b"t"), ("c.jpg", b"3")]),
    "member twice": lambda p: raw_tar(p, [("a.jpg", b"1"), ("b.jpg", b"2"), ("b.jpg", b"2"), ("c.jpg", b"3")]),
    "key in two places": lambda p: raw_tar(p, [("a.jpg", b"1"), ("b.jpg", b"2"), ("a.cls", b"2")]),
    "two images": lambda p: raw_tar(p, [("a.jpg", b"1"), ("a.png", b"2"), ("a.cls", b"7"), ("b.jpg", b"3")]),
    "empty members": lambda p: raw_tar(p, [("a.jpg", b""), ("a.json", b""), ("b.jpg", b"")]),
    "empty tar": lambda p: raw_tar(p, []),
    "bad label": lambda p: raw_tar(p, [("a.jpg", b"1"), ("a.cls", b"x"), ("b.jpg", b"2")]),
    "label with spaces": lambda p: raw_tar(p, [("a.jpg", b"1"), ("a.cls", b" 7\n"), ("b.jpg", b"2")]),
    "dot only extension": lambda p: raw_tar(p, [("a.", b"1"), ("b.jpg", b"2")]),
    "many members": lambda p: raw_tar(p, [(f"a.f{i}", b"1") for i in range(70)] + [("b.jpg", b"2")]),
    "leading slash": lambda p: raw_tar(  # split_name's key of "/a.jpg" is "a"; of "//a.jpg", "//a"
        p,
        [("/a.jpg", b"1"), ("a.cls", b"7"), ("//c.jpg", b"2"), ("//c.cls", b"3"), ("d/e.jpg", b"4")],
        tarfile.USTAR_FORMAT,
    ),
}


@needs_walker
@pytest.mark.parametrize("case", sorted(FOREIGN))
def test_tars_other_writers_make(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    both_ways(FOREIGN[case](tmp_path / "foreign.tar"), monkeypatch)


def with_directory_and_link(path: Path) -> Path:
    with tarfile.open(path, "w") as tar:
        kinds = (
            ("a.jpg", tarfile.REGTYPE),
            ("a.d", tarfile.DIRTYPE),
            ("c.dir", tarfile.DIRTYPE),
            ("l.jpg", tarfile.SYMTYPE),
        )
        for name, kind in kinds:
            info = tarfile.TarInfo(name)
            info.type = kind
            info.size = 1 if kind == tarfile.REGTYPE else 0
            info.linkname = "a.jpg" if kind == tarfile.SYMTYPE else ""
            tar.addfile(info, io.BytesIO(b"1") if kind == tarfile.REGTYPE else None)
        info = tarfile.TarInfo("b.jpg")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"2"))
    return path


@needs_walker
def test_folders_and_links_are_left_out_alike(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    outcome = both_ways(with_directory_and_link(tmp_path / "t.tar"), monkeypatch)
    assert [record[0] for record in outcome[0][1]] == ["a", "b"]


@needs_walker
def test_a_record_over_the_size_limit_is_refused_alike(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = our_tar(tmp_path / "ours.tar")
    monkeypatch.setattr(webdataset, "MAX_RECORD_BYTES", 5000)  # record 4 (a 9,000-byte image) is the first over it
    outcome = both_ways(path, monkeypatch)
    assert [record[0] for record in outcome[0][1][:4]] == ["k000", "k001", "k002", "k003"]
    assert outcome[0][1][4] == ("ShardFormatError", f"{path}: record k004 claims 9,014 bytes, over the limit")


@needs_walker
@pytest.mark.parametrize(
    "edit", ["size 8s", "size base-256", "size spaces", "magic", "kind x", "name utf-8", "name bad"]
)
def test_header_fields_python_reads_differently(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, edit: str) -> None:
    path = our_tar(tmp_path / "ours.tar")
    data = bytearray(path.read_bytes())
    second = data.index(b"k001.jpg") // 512 * 512  # the second record's first header
    header = second
    if edit == "size 8s":
        data[header + 124 : header + 136] = b"00000000089\0"
    elif edit == "size base-256":
        data[header + 124 : header + 136] = b"\x80" + bytes(7) + (4000).to_bytes(4, "big")
    elif edit == "size spaces":
        data[header + 124 : header + 136] = b"  7640     \0"  # 4000 in octal, spaced: Python reads it
    elif edit == "magic":
        data[header + 257 : header + 262] = b"ustaR"
    elif edit == "kind x":
        data[header + 156] = ord("x")
    elif edit == "name utf-8":
        data[header : header + 8] = "kö01.jp".encode()[:8]
    elif edit == "name bad":
        data[header : header + 2] = b"\xff\xfe"
    path.write_bytes(bytes(data))
    both_ways(path, monkeypatch)


@needs_walker
def test_truncated_anywhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    whole = our_tar(tmp_path / "ours.tar").read_bytes()
    cuts = sorted({*range(0, len(whole), 512), *random.Random(3).sample(range(len(whole)), 40)})
    for cut in cuts:
        path = tmp_path / f"cut{cut}.tar"
        path.write_bytes(whole[:cut])
        both_ways(path, monkeypatch)
        path.unlink()


@needs_walker
def test_fuzzed_headers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Bytes of the headers and small members changed at random: a shard a stranger damaged."""
    whole = our_tar(tmp_path / "ours.tar", records(8, seed=4)).read_bytes()
    headers = [at for at in range(0, len(whole), 512) if whole[at + 257 : at + 262] == b"ustar"]
    rng = random.Random(11)
    for case in range(150):
        data = bytearray(whole)
        for _ in range(rng.choice((1, 1, 2, 4))):
            at = rng.choice(headers) + rng.choice((rng.randrange(512), rng.randrange(100), rng.randrange(124, 136),
                                                   156, rng.randrange(257, 265), rng.randrange(512, 700)))  # fmt: skip
            values = (0, 32, *b"057xL./", 0x80, 0xFF, rng.randrange(256))
            data[min(at, len(data) - 1)] = rng.choice(values)
        path = tmp_path / f"fuzz{case}.tar"
        path.write_bytes(bytes(data))
        both_ways(path, monkeypatch)
        path.unlink()
