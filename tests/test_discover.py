from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

from shardkit.core.errors import SourceError
from shardkit.packing.sources import make_key, walk
from shardkit.synthetic import write_image
from tests.helpers import discover, image_files


def test_class_folders_get_sorted_labels(tmp_path: Path) -> None:
    for cls in ("zebra", "ant", "moose"):
        write_image(tmp_path / cls / "1.jpg", 20, 10)
    source = discover(tmp_path)
    assert source.layout == "folders"
    assert source.classes == ["ant", "moose", "zebra"]
    assert {item.relpath: item.label for item in source.items} == {"ant/1.jpg": 0, "moose/1.jpg": 1, "zebra/1.jpg": 2}


def test_flat_folder_has_no_labels_and_sorted_items(tmp_path: Path) -> None:
    for name in ("b.jpg", "a.png", "c.jpeg"):
        write_image(tmp_path / name, 10, 10)
    source = discover(tmp_path)
    assert source.layout == "flat" and source.classes == []
    assert [item.relpath for item in source.items] == ["a.png", "b.jpg", "c.jpeg"]
    assert all(item.label is None for item in source.items)


def test_keys_are_unique_and_free_of_dots(tmp_path: Path) -> None:
    write_image(tmp_path / "a.jpg", 10, 10)
    write_image(tmp_path / "a.png", 10, 10)
    write_image(tmp_path / "x.y.jpg", 10, 10)
    write_image(tmp_path / "it's here.jpg", 10, 10)
    keys = {item.relpath: item.key for item in discover(tmp_path).items}
    assert keys == {"a.jpg": "a%2Ejpg", "a.png": "a%2Epng", "x.y.jpg": "x%2Ey", "it's here.jpg": "it's here"}
    assert all("." not in key for key in keys.values())


def test_keys_are_stable_across_runs_and_escape_odd_bytes() -> None:
    assert make_key("n01/img_1.JPEG") == "n01/img_1"
    assert make_key("café/ü.jpg") == "caf%C3%A9/%C3%BC"
    assert make_key(os.fsdecode(b"bad\xffname.jpg")) == "bad%FFname"


def test_non_image_files_hidden_files_and_links_are_accounted(tmp_path: Path) -> None:
    write_image(tmp_path / "ok.jpg", 10, 10)
    (tmp_path / "README.txt").write_text("hi")
    (tmp_path / ".DS_Store").write_bytes(b"x")
    (tmp_path / "dangling.jpg").symlink_to(tmp_path / "missing.jpg")
    (tmp_path / "sub").mkdir()
    write_image(tmp_path / "sub" / "in.jpg", 10, 10)
    (tmp_path / "sub" / "loop").symlink_to(tmp_path)  # a folder link back to the root
    source = discover(tmp_path)
    assert [item.relpath for item in source.items] == ["ok.jpg", "sub/in.jpg"]
    reasons = {skip.path: skip.reason for skip in source.skipped}
    assert reasons["README.txt"] == "not an image file extension"
    assert reasons["dangling.jpg"] == "broken link"
    assert "loop" in reasons["sub/loop"]


def test_undecodable_file_names_are_kept(tmp_path: Path) -> None:
    name = os.fsdecode(b"caf\xe9.jpg")
    write_image(os.path.join(tmp_path, name), 12, 12)
    (item,) = discover(tmp_path).items
    assert os.path.exists(item.path)
    assert item.key == "caf%E9"


def test_order_is_byte_order_of_names_on_disk(tmp_path: Path) -> None:
    # b"\x80" (not UTF-8: "\udc80" once decoded) sorts before "é" (b"\xc3\xa9") as bytes, after it as a str
    names = [b"b.jpg", b"a.JPG", b"Z.jpg", b"\x80.jpg", b"\xe9.jpg", "\ue000.jpg".encode(), "é.jpg".encode()]
    for name in names:
        write_image(os.path.join(tmp_path, os.fsdecode(name)), 8, 8)
    expected = [os.fsdecode(name) for name in sorted(names)]
    assert [item.relpath for item in discover(tmp_path).items] == expected
    paths, relpaths, _ = image_files(tmp_path)
    assert relpaths == expected and paths == [os.path.join(tmp_path, rel) for rel in expected]


def test_list_file_with_labels(tmp_path: Path) -> None:
    write_image(tmp_path / "imgs" / "a.jpg", 10, 10)
    write_image(tmp_path / "imgs" / "b.jpg", 10, 10)
    listing = tmp_path / "train.txt"
    listing.write_text("# path,label\nimgs/a.jpg,dog\nimgs/b.jpg,cat\n\n")
    source = discover(listing)
    assert source.layout == "list" and source.classes == ["cat", "dog"]
    assert [(item.relpath, item.label) for item in source.items] == [("imgs/a.jpg", 1), ("imgs/b.jpg", 0)]


def test_list_file_with_integer_labels_and_duplicates(tmp_path: Path) -> None:
    listing = tmp_path / "list.csv"
    listing.write_text("a.jpg,3\nb.jpg,7\na.jpg,3\n")
    write_image(tmp_path / "a.jpg", 10, 10)
    source = discover(listing)
    assert [(item.relpath, item.label) for item in source.items] == [("a.jpg", 3), ("b.jpg", 7)]
    assert [skip.reason for skip in source.skipped] == ["listed more than once"]


def test_a_list_naming_no_file_from_its_folder_is_refused_saying_where(tmp_path: Path, monkeypatch) -> None:
    """Paths written from the current folder, not the list's, named nothing: 0 of N packed, exit 0."""
    write_image(tmp_path / "imgs" / "a.jpg", 10, 10)
    (tmp_path / "lists").mkdir()
    (tmp_path / "lists" / "train.txt").write_text("imgs/a.jpg,0\nimgs/gone.jpg,1\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SourceError) as caught:
        discover(Path("lists/train.txt"))
    assert str(caught.value) == (
        "lists/train.txt: none of its 2 paths exists; they are read from the list's folder (the first: "
        "lists/imgs/a.jpg), and imgs/a.jpg exists from the current folder: write them from lists/ or as absolute paths"
    )
    (tmp_path / "lists" / "train.txt").write_text(f"{tmp_path}/imgs/gone.jpg,1\n../imgs/gone2.jpg,0\n")
    with pytest.raises(SourceError, match=r"none of its 2 paths exists; .* \(the first: /"):
        discover(tmp_path / "lists" / "train.txt")
    # one path that is there is a list: the others are each listed with their reason, as before
    (tmp_path / "lists" / "train.txt").write_text("../imgs/gone.jpg,1\n../imgs/a.jpg,0\n")
    assert [item.relpath for item in discover(Path("lists/train.txt")).items] == ["../imgs/gone.jpg", "../imgs/a.jpg"]


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: p / "missing", "no such file or folder"),
        (lambda p: p, "no images found"),
        (lambda p: write_image(p / "one.jpg", 5, 5), "is an image"),
    ],
)
def test_bad_sources_are_refused_in_one_line(tmp_path: Path, make, message: str) -> None:
    with pytest.raises(SourceError, match=message) as error:
        discover(make(tmp_path))
    assert "\n" not in str(error.value)


def test_keys_stay_unique_when_a_kept_extension_meets_a_double_extension(tmp_path: Path) -> None:
    for name in ("a.jpg", "a.png", "a.jpg.png"):
        write_image(tmp_path / name, 10, 10)
    source = discover(tmp_path)
    assert len(source.items) == 3 and not source.skipped
    assert len({item.key for item in source.items}) == 3


def test_streamed_walk_is_in_byte_order_of_the_whole_paths(tmp_path: Path) -> None:
    """Each folder is sorted on its own as the walk goes, yet the paths come out exactly as if the
    whole list were sorted: 'a-c/x' before 'a/b' ('-' < '/'), 'ab.jpg' after 'a/...'."""
    rng = random.Random(7)
    alphabet = ["a", "a-c", "ab", "a.b", "a0", "Z", "b", "é", os.fsdecode(b"\xff")]
    expected = []
    for _ in range(120):
        parts = [rng.choice(alphabet) for _ in range(rng.randint(0, 3))]
        rel = "/".join([*parts, rng.choice(alphabet) + rng.choice([".jpg", ".png"])])
        path = tmp_path / rel
        if any(p.exists() and not p.is_dir() for p in path.parents) or path.is_dir():
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x")
        expected.append(rel)
    expected = sorted(set(expected), key=os.fsencode)
    assert [item.relpath for item in walk(tmp_path, labels="none").items] == expected


def test_a_link_to_an_earlier_class_is_no_class_of_its_own(tmp_path: Path) -> None:
    """The walk enters a folder once: a top-level link to another class (or a class holding only a
    link into another) yields no image, so it must not take a label and shift the classes after it."""
    write_image(tmp_path / "a" / "1.jpg", 8, 8)
    write_image(tmp_path / "c" / "2.jpg", 8, 8)
    (tmp_path / "b").symlink_to("a")
    (tmp_path / "bb").mkdir()
    (tmp_path / "bb" / "link").symlink_to(tmp_path / "a")
    found = walk(tmp_path)
    assert found.classes == ["a", "c"]
    assert [(item.relpath, item.label) for item in found.items] == [("a/1.jpg", 0), ("c/2.jpg", 1)]


def test_a_class_folder_filled_after_the_walk_began_is_recorded_not_guessed(tmp_path: Path) -> None:
    write_image(tmp_path / "a" / "1.jpg", 8, 8)
    (tmp_path / "c").mkdir()
    found = walk(tmp_path)
    write_image(tmp_path / "c" / "2.jpg", 8, 8)  # a class that did not exist when labels were settled
    assert [(item.relpath, item.label) for item in found.items] == [("a/1.jpg", 0)]
    assert [(skip.path, skip.stage) for skip in found.skipped] == [("c/2.jpg", "discover")]


def test_classes_are_folders_with_an_image_below_them_found_before_the_walk(tmp_path: Path) -> None:
    write_image(tmp_path / "b" / "deep" / "er" / "1.jpg", 8, 8)
    write_image(tmp_path / "a-c" / "1.jpg", 8, 8)
    (tmp_path / "empty" / "sub").mkdir(parents=True)
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "note.txt").write_text("x")
    found = walk(tmp_path)
    assert found.classes == ["a-c", "b"]  # known before a single item is yielded
    assert [(item.relpath, item.label) for item in found.items] == [("a-c/1.jpg", 0), ("b/deep/er/1.jpg", 1)]
    assert [skip.path for skip in found.skipped] == ["texts/note.txt"]


@pytest.mark.parametrize("label", ["99999999999999999999", "9223372036854775808", "9" * 5000])
def test_a_list_file_label_past_int64_is_refused_naming_its_line(tmp_path: Path, label: str) -> None:
    """The label rule every source shares: a whole number from 0 to 2**63-1 (int64, as stored)."""
    listing = tmp_path / "list.csv"
    listing.write_text(f"a.jpg,3\nb.jpg,{label}\nc.jpg,9223372036854775807\n")
    with pytest.raises(SourceError, match=r"list\.csv:2: label .* is over 2\*\*63-1") as error:
        discover(listing)
    assert "\n" not in str(error.value) and len(str(error.value)) < 200
    listing.write_text("a.jpg,3\nc.jpg,9223372036854775807\n")
    write_image(tmp_path / "a.jpg", 10, 10)  # (a list that names no file at all is refused)
    assert [item.label for item in discover(listing).items] == [3, 2**63 - 1]


def test_a_list_file_with_a_byte_order_mark_names_its_first_path(tmp_path: Path) -> None:
    """Notepad and Excel start UTF-8 text with a byte-order mark; it is not part of the first path."""
    write_image(tmp_path / "a.jpg", 10, 10)
    write_image(tmp_path / "b.jpg", 10, 10)
    listing = tmp_path / "list.csv"
    listing.write_bytes(b"\xef\xbb\xbfa.jpg,cat\nb.jpg,dog\n")
    source = discover(listing)
    assert [(item.relpath, item.label) for item in source.items] == [("a.jpg", 0), ("b.jpg", 1)]
    assert source.classes == ["cat", "dog"] and not source.skipped


def test_links_to_devices_and_fifos_are_not_regular_files_not_broken_links(tmp_path: Path) -> None:
    """A link to /dev/zero was reported as a "broken link" (it leads somewhere: to no file); a
    pack lists it in errors.jsonl for what it is."""
    from shardkit.core.config import PackConfig
    from shardkit.packing.pack import pack

    source = tmp_path / "src"
    source.mkdir()
    write_image(source / "ok.jpg", 10, 10)
    (source / "zero.jpg").symlink_to("/dev/zero")
    os.mkfifo(source / "pipe.jpg")
    (source / "to-pipe.jpg").symlink_to(source / "pipe.jpg")
    (source / "dangling.jpg").symlink_to(source / "missing.jpg")
    expected = {
        "zero.jpg": "not a regular file (a device), through a link",
        "pipe.jpg": "not a regular file (a FIFO)",
        "to-pipe.jpg": "not a regular file (a FIFO), through a link",
        "dangling.jpg": "broken link",
    }
    assert {skip.path: skip.reason for skip in discover(source).skipped} == expected
    pack(PackConfig(str(source), str(tmp_path / "out"), format="webdataset"))
    rows = [json.loads(line) for line in (tmp_path / "out" / "errors.jsonl").read_text().splitlines()]
    assert {row["path"]: row["reason"] for row in rows} == expected
    # the sidecar walk says the same of the same entries
    sidecar = walk(source, sidecars=True)
    assert [item.relpath for item in sidecar.items] == ["ok.jpg"]
    assert {skip.path: skip.reason for skip in sidecar.skipped} == expected
