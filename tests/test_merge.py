"""`shardkit merge`: one output from several packed alike, in every format. Shards are hard links to
their sources' files, numbered again; the index, errors.jsonl and totals are the sources' joined;
verify passes and the reader reads every record. Keys two outputs share are refused unless
prefixed, class numbers that would change meaning unless relabelled, outputs packed otherwise
always. A kill at any step, then --resume, gives the bytes of a merge never killed."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from shardkit.changes.merge import merge
from shardkit.checks.verify import verify
from shardkit.core.config import PackConfig, ResizeConfig
from shardkit.core.errors import ConfigError, OutputError
from shardkit.core.manifest import read_manifest
from shardkit.formats import available_formats, get_format
from shardkit.packing.pack import pack
from shardkit.readers import open_shards
from shardkit.synthetic import write_image
from tests.helpers import stored_records
from tests.step_kills import every_step_finishes, hooked_env, unfinished_said
from tests.test_pack_kills import snapshot


def _records(out: Path) -> list[tuple[str, int | None, bytes]]:
    return [(record.key, record.label, record.data) for _, record in stored_records(out)]


def _folder(root: Path, classes: list[str], per_class: int, seed: int, stem: str) -> Path:
    for c, name in enumerate(classes):
        for i in range(per_class):
            write_image(root / name / f"{stem}_{i}.jpg", 90 + i, 70, seed=seed + 10 * c + i)
    (root / classes[0] / f"{stem}_broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not a jpeg")
    return root


@pytest.fixture(scope="module")
def second_source(tmp_path_factory: pytest.TempPathFactory, sample_dataset: Path) -> Path:
    """Another collection in the sample's classes, under keys of its own, with a broken file."""
    classes = sorted(entry.name for entry in sample_dataset.iterdir() if entry.is_dir())
    return _folder(tmp_path_factory.mktemp("second") / "src", classes, 3, 500, "b")


def _packed(source: Path, out: Path, format: str = "webdataset", size: int = 64) -> Path:
    pack(PackConfig(str(source), str(out), format=format, resize=ResizeConfig(size), shard_size=7))
    return out


@pytest.mark.parametrize("format", available_formats())
def test_a_merge_links_the_shards_and_joins_the_rest(
    packed_sample, second_source: Path, format: str, tmp_path: Path
) -> None:
    first = packed_sample(format, 64, 7)
    second = _packed(second_source, tmp_path / "second", format)
    a, b = read_manifest(first), read_manifest(second)
    out = tmp_path / "merged"

    result = merge([first, second], out)

    merged = read_manifest(out)
    assert (result.linked, result.rewritten, result.bytes_written) == (len(a.shards) + len(b.shards), 0, 0)
    assert merged.records == a.records + b.records == result.records
    suffix = get_format(format).suffix
    assert [s.name for s in merged.shards] == [f"shard-{i:06d}{suffix}" for i in range(len(merged.shards))]
    for old, new in zip([*a.shards, *b.shards], merged.shards, strict=True):  # the same files, linked
        source = (first if old in a.shards else second) / old.name
        assert os.path.samefile(source, out / new.name) and (old.sha256, old.count) == (new.sha256, new.count)
    assert _records(out) == _records(first) + _records(second)
    errors = (out / "errors.jsonl").read_bytes()
    assert errors == (first / "errors.jsonl").read_bytes() + (second / "errors.jsonl").read_bytes()
    assert merged.totals["inputs"] == a.totals["inputs"] + b.totals["inputs"]
    assert merged.totals["errors"] == a.totals["errors"] + b.totals["errors"]
    said = merged.settings["merged"]
    assert [entry["checksum"] for entry in said] == [a.checksum, b.checksum]
    assert said[1]["error_rows"] == [a.totals["errors"], a.totals["errors"] + b.totals["errors"]]
    index = pq.read_table(out / "index.parquet")
    assert index.column("key").to_pylist() == [key for key, _, _ in _records(out)]
    assert set(index.column("shard").to_pylist()) == {s.name for s in merged.shards}
    report = verify(out)
    assert report.ok, report.problems
    assert len(open_shards(out)) == merged.records
    assert verify(first).ok and verify(second).ok  # (the sources are as they were)


def test_keys_two_outputs_share_are_refused_unless_prefixed(packed_sample, tmp_path: Path) -> None:
    first = packed_sample("webdataset", 64, 7)
    copy = tmp_path / "copy"
    shutil.copytree(first, copy)
    out = tmp_path / "merged"
    with pytest.raises(OutputError, match=r"keys are in two of the outputs .*--prefix-keys"):
        merge([first, copy], out)
    assert not out.exists()  # (refused before the folder is made)

    result = merge([first, copy], out, prefix_keys=True)

    assert result.rewritten == len(read_manifest(out).shards)
    keys = [key for key, _, _ in _records(out)]
    half = len(keys) // 2
    assert all(key.startswith(f"{first.name}/") for key in keys[:half])
    assert all(key.startswith("copy/") for key in keys[half:])
    assert [(label, data) for _, label, data in _records(out)] == [
        (label, data) for _, label, data in _records(first)
    ] * 2
    report = verify(out)
    assert report.ok, report.problems


def test_class_numbers_that_would_change_meaning_are_refused_unless_relabelled(packed_sample, tmp_path: Path) -> None:
    first = packed_sample("webdataset", 64, 7)
    classes = read_manifest(first).classes
    other = _packed(_folder(tmp_path / "src", ["a-new-class", classes[2]], 2, 900, "c"), tmp_path / "other")
    out = tmp_path / "merged"
    with pytest.raises(OutputError, match=r"its label 0 is 'a-new-class'.*--relabel"):
        merge([first, other], out)

    merge([first, other], out, relabel=True)

    merged = read_manifest(out)
    assert merged.classes == [*classes, "a-new-class"]
    labels = {key.split("/")[0]: label for key, label, _ in _records(out) if key.split("/")[1].startswith("c_")}
    assert labels == {"a-new-class": len(classes), classes[2]: 2}
    index = pq.read_table(out / "index.parquet", columns=["key", "label"]).to_pylist()
    assert [(row["key"], row["label"]) for row in index] == [(key, label) for key, label, _ in _records(out)]
    assert verify(out).ok


@pytest.mark.parametrize(
    ("second", "said"),
    [
        ({"format": "lmdb"}, "packed with format"),
        ({"size": 96}, "packed with resize"),
    ],
)
def test_outputs_packed_otherwise_are_refused(
    packed_sample, second_source: Path, tmp_path: Path, second: dict, said: str
) -> None:
    first = packed_sample("webdataset", 64, 7)
    other = _packed(second_source, tmp_path / "other", **second)
    with pytest.raises(OutputError, match=said):
        merge([first, other], tmp_path / "merged")
    assert not (tmp_path / "merged" / "manifest.json").exists()


def test_bad_requests_are_refused_before_anything_is_written(packed_sample, tmp_path: Path) -> None:
    first = packed_sample("webdataset", 64, 7)
    with pytest.raises(ConfigError, match="two or more outputs"):
        merge([first], tmp_path / "m")
    with pytest.raises(ConfigError, match="named twice"):
        merge([first, first], tmp_path / "m")
    with pytest.raises(ConfigError, match="overlaps"):
        merge([first, tmp_path / "x"], first / "inside")
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("mine")
    copy = tmp_path / "copy"
    shutil.copytree(first, copy)
    with pytest.raises(OutputError, match=r"holds 'notes\.txt'; merge into a new folder"):
        merge([first, copy], taken, prefix_keys=True)
    assert sorted(path.name for path in taken.iterdir()) == ["notes.txt"]
    with pytest.raises(OutputError, match=r"no such file|missing|not a folder|manifest"):
        merge([first, tmp_path / "nowhere"], tmp_path / "m2")


def test_the_cli_merges_and_says_what_it_did(shardkit, packed_sample, second_source: Path, tmp_path: Path) -> None:
    first = packed_sample("webdataset", 64, 7)
    second = _packed(second_source, tmp_path / "second")
    done = shardkit("merge", first, second, tmp_path / "m", "--json", tmp_path / "m.json")
    assert done.returncode == 0, done.stderr
    said = " ".join(done.stdout.split())
    assert "merged 2 outputs into" in said and "linked" in said
    assert json.loads((tmp_path / "m.json").read_text())["records"] == read_manifest(tmp_path / "m").records
    again = shardkit("merge", first, second, tmp_path / "m")
    assert again.returncode == 0 and "already this merge, finished" in " ".join(again.stdout.split())
    other = shardkit("merge", second, first, tmp_path / "m")
    assert other.returncode == 1 and "holds an output already" in other.stderr
    alone = shardkit("merge", first)
    assert alone.returncode == 1 and "two or more outputs" in alone.stderr


@pytest.mark.slow  # kills a merge at each of its steps
def test_a_merge_killed_at_any_step_resumes_to_the_clean_merge(shardkit, packed_sample, tmp_path: Path) -> None:
    first = packed_sample("webdataset", 64, 30)  # (few shards: each of its steps is a run)
    copy = tmp_path / "copy"
    shutil.copytree(first, copy)
    clean, out = tmp_path / "clean", tmp_path / "out"
    assert shardkit("merge", first, copy, clean, "--prefix-keys").returncode == 0
    command = [sys.executable, "-m", "shardkit", "merge", str(first), str(copy), str(out), "--prefix-keys"]
    failed = every_step_finishes(
        out, None, command, lambda: shardkit("merge", first, copy, out, "--prefix-keys", "--resume"),
        snapshot(clean), tmp_path / "hook", checked=unfinished_said,
    )  # fmt: skip
    assert not failed, "\n".join(failed)


@pytest.mark.parametrize("kind", ["link", "fifo", "resized"])
def test_a_source_file_that_is_not_the_one_listed_is_refused(packed_sample, tmp_path: Path, kind: str) -> None:
    """A link would be linked as a link (or followed anywhere when copied), a FIFO would hang the
    merge: every file a source lists must be a regular file of its size, checked first."""
    first = packed_sample("webdataset", 64, 7)
    copy = tmp_path / "copy"
    shutil.copytree(first, copy)
    secret = tmp_path / "secret.txt"
    shard = copy / read_manifest(copy).shards[0].name
    secret.write_bytes(b"s" * shard.stat().st_size)
    if kind == "link":
        shard.unlink()
        shard.symlink_to(secret)
    elif kind == "fifo":
        (copy / "errors.jsonl").unlink()
        os.mkfifo(copy / "errors.jsonl")
    else:
        with open(shard, "ab") as grown:
            grown.write(b"x")
    out = tmp_path / "merged"
    with pytest.raises(OutputError, match=r"not the file its manifest lists|not a file shardkit wrote"):
        merge([first, copy], out, prefix_keys=True)
    assert not out.exists()


def _killed_in_its_commit(shardkit, first: Path, tmp_path: Path) -> tuple[Path, Path, Path]:
    """`first` and a copy of it merged with --prefix-keys twice: into `clean` whole, and into `out`
    killed (SIGKILL) as its commit renames the second shard into place; (copy, clean, out)."""
    copy, clean, out = tmp_path / "copy", tmp_path / "clean", tmp_path / "out"
    shutil.copytree(first, copy)
    assert shardkit("merge", first, copy, clean, "--prefix-keys").returncode == 0
    command = [sys.executable, "-m", "shardkit", "merge", str(first), str(copy), str(out), "--prefix-keys"]
    env = hooked_env(tmp_path / "hook", [out], at="replace out/shard-000001.tar")
    killed = subprocess.run(command, capture_output=True, text=True, env=env, start_new_session=True, timeout=120)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    return copy, clean, out


def test_a_merge_killed_in_its_commit_finishes_whatever_became_of_its_sources(
    shardkit, packed_sample, tmp_path: Path
) -> None:
    first = packed_sample("webdataset", 64, 30)
    copy, clean, out = _killed_in_its_commit(shardkit, first, tmp_path)
    (copy / "manifest.json").write_text((copy / "manifest.json").read_text().replace('"version"', '"versión"'))
    resumed = shardkit("merge", first, copy, out, "--prefix-keys", "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert snapshot(out) == snapshot(clean)


def test_a_merge_of_other_outputs_finishes_a_committed_one_and_says_so(shardkit, packed_sample, tmp_path: Path) -> None:
    first = packed_sample("webdataset", 64, 30)
    other = tmp_path / "other"
    shutil.copytree(first, other)
    _, clean, out = _killed_in_its_commit(shardkit, first, tmp_path)
    refused = shardkit("merge", first, other, out, "--prefix-keys")
    assert refused.returncode == 1 and "held an interrupted merge of other outputs, finished now" in refused.stderr
    assert snapshot(out) == snapshot(clean)


def test_a_merged_output_takes_an_append_and_a_changed_one_is_not_this_merge(
    packed_sample, second_source: Path, tmp_path: Path
) -> None:
    from shardkit.changes.append import append
    from shardkit.changes.remove import remove

    first = packed_sample("webdataset", 64, 7)
    second = _packed(second_source, tmp_path / "second")
    out = tmp_path / "merged"
    merge([first, second], out)
    new = _folder(tmp_path / "new", read_manifest(out).classes[:1], 2, 700, "n")
    assert append(new, out).records == 2 and verify(out).ok
    with pytest.raises(OutputError, match="holds an output already"):
        merge([first, second], out)  # (version 2 now: not what this merge makes)
    fresh = tmp_path / "fresh"
    merge([first, second], fresh)
    remove(fresh, [key for key, _, _ in _records(fresh)][:1], reason="takedown")
    with pytest.raises(OutputError, match="holds an output already"):
        merge([first, second], fresh)


def test_an_interrupted_pack_in_the_folder_is_refused(packed_sample, sample_dataset: Path, tmp_path: Path) -> None:
    first = packed_sample("webdataset", 64, 7)
    copy = tmp_path / "copy"
    shutil.copytree(first, copy)
    out = tmp_path / "out"
    (out / ".shardkit").mkdir(parents=True)
    (out / ".shardkit" / "state.json").write_text("{}")
    with pytest.raises(OutputError, match="an interrupted pack is here"):
        merge([first, copy], out, prefix_keys=True)
    assert (out / ".shardkit" / "state.json").exists()
