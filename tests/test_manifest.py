"""manifest.json and errors.jsonl: the checksum, strict parsing of what strangers send, atomic writes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from shardkit.core.errors import ManifestError
from shardkit.core.manifest import (
    ERRORS_NAME,
    MANIFEST_NAME,
    Manifest,
    ShardInfo,
    iter_errors,
    read_manifest,
    write_json_atomic,
)


def manifest() -> Manifest:
    shards = [ShardInfo(f"shard-{i:06}.tar", 10 + i, 1000 * (i + 1), f"{i:064x}") for i in range(3)]
    totals = {"inputs": 34, "records": 33, "errors": 1}
    return Manifest("webdataset", shards, ["cat", "dog"], {"resize": {"size": 256}}, totals).sealed()


def test_a_written_manifest_reads_back_equal_and_its_checksum_holds(tmp_path: Path) -> None:
    write_json_atomic(tmp_path / MANIFEST_NAME, manifest().to_json())
    back = read_manifest(tmp_path)
    assert back == manifest() and back.records == 33
    assert back.checksum == back.computed_checksum()
    edited = Manifest(**{**back.to_json(), "shards": back.shards, "classes": ["cat", "cow"]})
    assert edited.checksum != edited.computed_checksum()  # a hand edit shows


def test_atomic_writes_leave_no_temporary_file_and_usual_permissions(tmp_path: Path) -> None:
    write_json_atomic(tmp_path / "x.json", {"a": 1}, temp_dir=tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["x.json"]
    assert (tmp_path / "x.json").stat().st_mode & 0o777 == 0o666 & ~_umask()
    with pytest.raises(ValueError):
        write_json_atomic(tmp_path / "y.json", {"a": float("nan")})  # JSON has no NaN: refused, not written
    assert [p.name for p in tmp_path.iterdir()] == ["x.json"]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d.update(schema_version=2), "schema version"),
        (lambda d: d.update(format=7), "format must be a str"),
        (lambda d: d["shards"][0].pop("sha256"), "shard entry"),
        (lambda d: d.update(classes=[1, 2]), "classes must be a list of names"),
        (lambda d: d["totals"].update(records=-1), "total records is not a count"),
    ],
)
def test_a_stranger_s_manifest_is_checked_field_by_field(tmp_path: Path, edit, message: str) -> None:
    data = manifest().to_json()
    edit(data)
    (tmp_path / MANIFEST_NAME).write_text(json.dumps(data))
    with pytest.raises(ManifestError, match=message):
        read_manifest(tmp_path)


def test_errors_rows_stream_and_a_bad_row_names_its_line(tmp_path: Path) -> None:
    assert list(iter_errors(tmp_path)) == []  # no file: no errors
    rows = [{"path": f"a/{i}.jpg", "stage": "decode", "reason": "broken"} for i in range(3)]
    (tmp_path / ERRORS_NAME).write_text("".join(json.dumps(row) + "\n" for row in rows) + '{"path": 1}\n')
    found = iter_errors(tmp_path)
    assert [next(found) for _ in range(3)] == rows
    with pytest.raises(ManifestError, match="line 4 is not an object"):
        next(found)


def test_a_folder_without_a_manifest_says_what_began_there_and_what_finishes_it(tmp_path: Path) -> None:
    """A reader of a folder whose pack or change was stopped before its manifest: the words name
    it and the command that finishes it; a journal that is no file is no change."""
    from shardkit.core.errors import ManifestError
    from shardkit.core.manifest import read_manifest

    state = tmp_path / ".shardkit"
    state.mkdir()
    with pytest.raises(ManifestError, match=r"no manifest \(is this a shardkit output folder\?\)"):
        read_manifest(tmp_path)
    (state / "change.json").mkdir()  # (not a journal)
    with pytest.raises(ManifestError, match=r"no manifest \(is this"):
        read_manifest(tmp_path)
    (state / "change.json").rmdir()
    (state / "state.json").write_text("{}")
    with pytest.raises(ManifestError, match=r"no manifest yet: a pack into it began .*`shardkit pack` with --resume"):
        read_manifest(tmp_path)
    plan = {"sources": ["/data/2025", "/data/2026"], "prefix_keys": True}
    (state / "change.json").write_text(json.dumps({"action": "merge", "plan": plan}))
    with pytest.raises(ManifestError) as said:
        read_manifest(tmp_path)
    assert "no manifest yet: a merge into it began and has not finished (it may still be running)" in str(said.value)
    assert f"`shardkit merge /data/2025 /data/2026 {tmp_path} --prefix-keys --resume` finishes it" in str(said.value)


def test_a_journal_a_stranger_wrote_is_read_safely_for_the_words(tmp_path: Path) -> None:
    """A journal nested past the parser's depth, a FIFO planted as one, a merge of more sources than
    a line shows: one line each, no traceback, no hang."""
    from shardkit.core.errors import ManifestError
    from shardkit.core.manifest import change_action, read_manifest

    state = tmp_path / ".shardkit"
    state.mkdir()
    (state / "change.json").write_bytes(b"[" * 100_000)
    with pytest.raises(ManifestError, match=r"no manifest yet: a change of it .*`shardkit verify` says what"):
        read_manifest(tmp_path)
    (state / "change.json").unlink()
    os.mkfifo(state / "change.json")
    assert change_action(tmp_path) == ("change", None)  # (a plain open would wait for a writer)
    (state / "change.json").unlink()
    plan = {"sources": [f"/data/{n}" for n in range(70)]}
    (state / "change.json").write_text(json.dumps({"action": "merge", "plan": plan}))
    with pytest.raises(ManifestError, match=r"/data/63 \.\.\.6 more .* --resume` finishes it"):
        read_manifest(tmp_path)
