from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from shardkit.checks.verify import verify
from shardkit.core.manifest import WIDS_NAME, info_of, read_manifest, wids_index, write_json_atomic
from shardkit.formats import available_formats
from shardkit.readers.dataset import open_shards
from shardkit.synthetic import write_image


@pytest.fixture(scope="module", params=available_formats())
def packed(request, packed_sample) -> Path:
    return packed_sample(request.param, 48, 20)  # (shared with other modules: read only)


@pytest.fixture
def copy(packed: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(packed, tmp_path / "copy"))


def kinds(folder: Path, **options) -> set[str]:
    return {problem.kind for problem in verify(folder, **options).problems}


def shard(folder: Path, index: int = 1) -> Path:
    return folder / read_manifest(folder).shards[index].name


def test_clean_output_verifies_deep_and_against_source(packed: Path, sample_dataset: Path) -> None:
    report = verify(packed, deep=True, source=sample_dataset, workers=2)
    assert report.ok, report.problems
    assert (report.records, report.decoded, report.shards) == (60, 60, 4)


def test_one_flipped_byte_is_caught(copy: Path) -> None:
    data = bytearray(shard(copy).read_bytes())
    data[len(data) // 2] ^= 0x01
    shard(copy).write_bytes(bytes(data))
    assert kinds(copy) == {"checksum"}


def test_truncated_shard_is_caught(copy: Path) -> None:
    shard(copy).write_bytes(shard(copy).read_bytes()[:-100])
    assert kinds(copy) == {"size"}


def test_deleted_shard_is_caught(copy: Path) -> None:
    shard(copy).unlink()
    assert kinds(copy) == {"missing"}


def test_stray_shard_is_caught(copy: Path) -> None:
    shutil.copy(shard(copy), copy / ("shard-000099" + shard(copy).suffix))
    assert kinds(copy) == {"stray"}


def test_a_plain_lmdb_reader_s_lock_file_is_not_a_problem(copy: Path) -> None:
    """lmdb.open(shard, subdir=False) locks by default and leaves `<shard>-lock`: verify notes it
    and passes; the same name beside another format's shard is stray."""
    lmdb = pytest.importorskip("lmdb")
    path = shard(copy)
    if read_manifest(copy).format == "lmdb":
        env = lmdb.open(str(path), subdir=False, readonly=True)  # the library's defaults: lock=True
        with env.begin() as txn:
            assert txn.stat()["entries"] > 0
        env.close()
        assert (copy / f"{path.name}-lock").is_file()
        report = verify(copy)
        assert report.ok, report.problems
        assert report.notes == [
            f"{path.name}-lock: LMDB's lock file, left by a reader that opened the shard with lock=True; ignored"
        ]
    else:
        (copy / f"{path.name}-lock").write_bytes(b"")
        assert kinds(copy) == {"stray"}


def test_hand_edited_manifest_is_caught(copy: Path) -> None:
    data = json.loads((copy / "manifest.json").read_text())
    data["settings"]["resize"]["size"] = 512  # a lie that no shard byte contradicts
    (copy / "manifest.json").write_text(json.dumps(data))
    assert kinds(copy) == {"manifest"}
    data["shards"][0]["count"] += 1
    (copy / "manifest.json").write_text(json.dumps(data))
    tar = data["format"] == "webdataset"  # its shardindex.json no longer says what the manifest says
    assert kinds(copy) == {"manifest", "count"} | ({"companion"} if tar else set())


def test_missing_or_broken_manifest(copy: Path) -> None:
    (copy / "manifest.json").write_text("{not json")
    assert kinds(copy) == {"manifest"}
    (copy / "manifest.json").unlink()
    assert kinds(copy) == {"manifest"}


def test_manifest_cannot_point_outside_the_folder(copy: Path) -> None:
    data = json.loads((copy / "manifest.json").read_text())
    data["shards"][0]["name"] = "../../etc/passwd"
    (copy / "manifest.json").write_text(json.dumps(data))
    report = verify(copy)
    assert [p.kind for p in report.problems] == ["manifest"] and "plain file name" in report.problems[0].detail


def test_source_check_finds_lost_files(packed: Path, sample_dataset: Path, tmp_path: Path) -> None:
    source = Path(shutil.copytree(sample_dataset, tmp_path / "src"))
    write_image(source / "n00001001" / "new_after_pack.jpg", 30, 30)
    report = verify(packed, source=source)
    assert [p.kind for p in report.problems] == ["lost"] and "new_after_pack" in report.problems[0].detail


def test_cli_exit_codes_and_json(shardkit, packed: Path, copy: Path, tmp_path: Path) -> None:
    ok = shardkit("verify", packed, "--deep")
    assert ok.returncode == 0 and ok.stdout.startswith("OK")
    shard(copy).unlink()
    report = tmp_path / "r.json"
    bad = shardkit("verify", copy, "--json", report)
    assert bad.returncode == 1 and "FAILED" in bad.stdout and shard(copy).name in bad.stdout
    assert json.loads(report.read_text())["ok"] is False


def test_source_check_names_extra_and_twice_accounted_files(copy: Path, sample_dataset: Path) -> None:
    """errors.jsonl naming a file the source lacks, and a packed file a second time: found by
    hashes, then named by a second, shallow pass over the shards."""
    packed_path = next(iter(open_shards(copy))).meta["source"]
    with (copy / "errors.jsonl").open("a") as log:
        log.write(json.dumps({"path": "n99/ghost.jpg", "reason": "x", "stage": "decode"}) + "\n")
        log.write(json.dumps({"path": packed_path, "reason": "x", "stage": "decode"}) + "\n")
    # the totals counting them (a log longer than its manifest says is read no further than that)
    manifest = read_manifest(copy)
    totals = {**manifest.totals, "errors": manifest.totals["errors"] + 2, "inputs": manifest.totals["inputs"] + 2}
    write_json_atomic(copy / "manifest.json", replace(manifest, totals=totals).sealed().to_json())
    details = {(p.kind, p.detail) for p in verify(copy, source=sample_dataset).problems}
    assert details == {
        ("extra", "n99/ghost.jpg is packed or listed but not in the source"),
        ("duplicate-source", f"{packed_path} is accounted for 2 times"),
    }


def test_a_key_stored_in_two_shards_is_named(copy: Path) -> None:
    manifest = read_manifest(copy)
    first, second = manifest.shards[0], manifest.shards[1]
    shutil.copyfile(copy / first.name, copy / second.name)  # shard 1 now holds shard 0's records
    shards = [first, replace(first, name=second.name), *manifest.shards[2:]]
    records = sum(s.count for s in shards)
    totals = {**manifest.totals, "records": records, "inputs": records + manifest.totals["errors"]}
    # (index=None, no companions: as an output from before index.parquet and the tars' DALI and
    # wids indexes; the stale indexes are problems of their own)
    crafted = replace(manifest, shards=shards, totals=totals, index=None, companions=[])
    for companion in manifest.companions:
        (copy / companion.name).unlink()
    write_json_atomic(copy / "manifest.json", crafted.sealed().to_json())
    report = verify(copy)
    duplicates = [p for p in report.problems if p.kind == "duplicate-key"]
    assert [p.kind for p in report.problems] == ["duplicate-key"] * first.count
    assert sorted(p.key for p in duplicates) == sorted(r.key for r in open_shards(copy).records(0))
    assert all(p.detail == "key stored 2 times" for p in duplicates)


def test_a_listed_output_file_the_format_does_not_write_is_caught(copy: Path) -> None:
    """Files beside the whole output are checked as their format declares them (Backend.output_files):
    one the manifest lists that the format does not write (wids' shard list in an LMDB output) is a
    problem, not a file taken on the manifest's word."""
    manifest = read_manifest(copy)
    if manifest.format == "webdataset":  # it writes one: checked against what the format derives
        assert [c.name for c in manifest.companions if c.name == WIDS_NAME] == [WIDS_NAME] and verify(copy).ok
        return
    data = wids_index(manifest.shards)
    (copy / WIDS_NAME).write_bytes(data)
    listed = [*manifest.companions, info_of(WIDS_NAME, manifest.records, data)]
    write_json_atomic(copy / "manifest.json", replace(manifest, companions=listed).sealed().to_json())
    assert [(p.kind, p.shard) for p in verify(copy).problems] == [("companion", WIDS_NAME)]


def test_source_check_takes_a_path_listed_twice_as_packed_once_and_listed_once(tmp_path: Path) -> None:
    """A list file naming a path twice: pack packs it once and lists the second line (`listed more
    than once`); each line is accounted for once, and a listing taken away is a line lost."""
    from shardkit import PackConfig, pack

    for i in range(3):
        write_image(tmp_path / f"{i}.jpg", 40, 30)
    listed = tmp_path / "list.txt"
    listed.write_text("0.jpg\n1.jpg\n0.jpg\n2.jpg\n")
    out = tmp_path / "out"
    pack(PackConfig(str(listed), str(out), workers=1))
    assert (out / "errors.jsonl").read_text().count('"0.jpg"') == 1
    assert verify(out, source=listed).ok
    listed.write_text("0.jpg\n1.jpg\n0.jpg\n2.jpg\n0.jpg\n")  # a third line the pack did not see
    said = "0.jpg is named 3 times in the source but packed once and listed once in errors.jsonl"
    rule = "each time it is named, it is packed or listed once, packed at most once"
    assert [(p.kind, p.detail) for p in verify(out, source=listed).problems] == [("lost", f"{said}: {rule}")]
