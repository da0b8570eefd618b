"""`shardkit remove`: records taken out of a finished output in every format. The shards that held
them are written again without them and the old files deleted (no byte of a removed image is in
any file afterwards), every other shard stays byte for byte, errors.jsonl lists each removed
record with the reason, the manifest says what each version removed, verify passes on the new
version, the reader reads it and refuses a state saved on the old one. A kill at any step of a
remove, then --resume, gives the same bytes as a remove never killed."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from shardkit.changes.remove import remove
from shardkit.checks.verify import verify
from shardkit.core.config import EncodeConfig, PackConfig, ResizeConfig
from shardkit.core.errors import ConfigError, OutputError
from shardkit.core.manifest import read_manifest, sha256_file
from shardkit.formats import available_formats
from shardkit.packing.pack import pack
from shardkit.readers import open_shards
from tests.helpers import stored_records
from tests.step_kills import every_step_finishes
from tests.test_pack_kills import snapshot

REASON = "takedown request 4711"


def _copy(packed_sample, format: str, tmp_path: Path) -> Path:
    out = tmp_path / "out"
    shutil.copytree(packed_sample(format, 64, 7), out)
    return out


def _records(out: Path) -> list[tuple[str, str, bytes]]:
    """(shard, key, image bytes) of every record, in stored order."""
    return [(shard, record.key, record.data) for shard, record in stored_records(out)]


def _all_bytes(out: Path) -> bytes:
    return b"".join(path.read_bytes() for path in sorted(out.rglob("*")) if path.is_file())


@pytest.mark.parametrize("format", available_formats())
def test_removed_records_are_gone_from_every_file_and_the_rest_is_untouched(
    packed_sample, sample_dataset: Path, format: str, tmp_path: Path
) -> None:
    out = _copy(packed_sample, format, tmp_path)
    before, records = read_manifest(out), _records(out)
    by_shard: dict[str, list[str]] = {}
    for shard, key, _ in records:
        by_shard.setdefault(shard, []).append(key)
    shards = list(by_shard)
    # two records of the first shard, and every record of the third (that shard goes)
    taken = [by_shard[shards[0]][1], by_shard[shards[0]][3], *by_shard[shards[2]]]
    gone = [data for _, key, data in records if key in taken]
    everything = _all_bytes(out)
    assert all(data in everything for data in gone)  # (so that their absence below means something)

    result = remove(out, taken, reason=REASON)

    assert (result.removed, result.rewritten, result.dropped, result.version) == (len(taken), 1, 1, 2)
    after = read_manifest(out)
    kept = [(key, data) for _, key, data in records if key not in taken]
    assert [(key, data) for _, key, data in _records(out)] == kept
    everything = _all_bytes(out)
    assert not any(data in everything for data in gone)
    untouched = [s for s in before.shards if s.name not in (shards[0], shards[2])]
    assert [s for s in after.shards if s in untouched] == untouched  # same names, bytes and sha256
    assert all(sha256_file(out / s.name) == s.sha256 for s in untouched)
    assert not (out / shards[0]).exists() and not (out / shards[2]).exists()
    assert after.shards[0].name == re.sub(r"(\.\w+)$", r"-v2\1", shards[0])
    assert not (out / ".shardkit").exists()

    assert after.version == 2 and len(after.history) == 1
    entry = after.history[0]
    assert (entry["change"], entry["reason"], entry["removed"], entry["after"]) == (
        "remove", REASON, len(taken), before.checksum
    )  # fmt: skip
    assert after.totals["records"] == before.records - len(taken) == after.records
    assert after.totals["removed"] == len(taken)
    assert after.totals["inputs"] == before.totals["inputs"]
    rows = [json.loads(line) for line in (out / "errors.jsonl").read_text().splitlines()]
    listed = [row for row in rows if row["stage"] == "removed"]
    assert sorted(row["key"] for row in listed) == sorted(taken)
    assert {row["reason"] for row in listed} == {REASON}
    index = pq.read_table(out / "index.parquet").to_pylist()
    assert [row["key"] for row in index] == [key for key, _ in kept]
    assert all(row["shard"] in {s.name for s in after.shards} for row in index)

    report = verify(out, deep=True, source=sample_dataset)
    assert report.ok, report.problems
    dataset = open_shards(out)
    assert [dataset[i].key for i in range(len(dataset))] == [key for key, _ in kept]


def test_a_second_remove_makes_version_three_and_rewrites_a_rewritten_shard(packed_sample, tmp_path: Path) -> None:
    out = _copy(packed_sample, "webdataset", tmp_path)
    keys = [key for _, key, _ in _records(out)]
    remove(out, [keys[0]], reason="first")
    remove(out, [keys[1]], reason="second")
    manifest = read_manifest(out)
    assert manifest.version == 3 and [h["reason"] for h in manifest.history] == ["first", "second"]
    assert manifest.shards[0].name == "shard-000000-v3.tar" and not (out / "shard-000000-v2.tar").exists()
    assert manifest.totals["removed"] == 2
    assert verify(out, deep=True).ok


def test_keys_the_output_lacks_are_refused_unless_missing_ok(packed_sample, tmp_path: Path) -> None:
    out = _copy(packed_sample, "lmdb", tmp_path)
    before = snapshot(out)
    keys = [key for _, key, _ in _records(out)]
    with pytest.raises(ConfigError, match=r"2 keys not in the output: 'nope', 'zzz'"):
        remove(out, [keys[0], "nope", "zzz"], reason=REASON)
    assert snapshot(out) == before  # nothing changed, no working folder left
    result = remove(out, [keys[0], "nope", "zzz"], reason=REASON, missing_ok=True)
    assert (result.removed, result.missing) == (1, 2)
    nothing = remove(out, ["nope"], reason=REASON, missing_ok=True)
    assert (nothing.removed, nothing.version) == (0, 2)


@pytest.mark.parametrize(
    ("arguments", "said"),
    [
        ({"keys": ["x"]}, "needs a reason"),
        ({"reason": REASON}, "needs the records to take out"),
        ({"keys": ["x"], "where": "y", "reason": REASON}, "one of them"),
        ({"keys": "abc", "reason": REASON}, "not one string"),
        ({"keys": ["x"], "resume": True}, "give no keys"),
    ],
)
def test_bad_requests_are_refused_before_the_output_is_touched(
    packed_sample, tmp_path: Path, arguments: dict, said: str
) -> None:
    out = _copy(packed_sample, "webdataset", tmp_path)
    before = snapshot(out)
    with pytest.raises(ConfigError, match=said):
        remove(out, **arguments)
    assert snapshot(out) == before


def test_removing_every_record_is_refused(packed_sample, tmp_path: Path) -> None:
    out = _copy(packed_sample, "hdf5", tmp_path)
    before = snapshot(out)
    with pytest.raises(ConfigError, match="every record"):
        remove(out, [key for _, key, _ in _records(out)], reason=REASON)
    assert snapshot(out) == before


def test_a_condition_over_the_index_selects_what_goes(packed_sample, tmp_path: Path) -> None:
    import pyarrow.compute as pc

    out = _copy(packed_sample, "webdataset", tmp_path)
    labels = pq.read_table(out / "index.parquet", columns=["label"]).column("label").to_pylist()
    result = remove(out, where=pc.field("label") == 1, reason="class 1 withdrawn")
    assert result.removed == labels.count(1)
    assert set(pq.read_table(out / "index.parquet", columns=["label"]).column("label").to_pylist()) == set(labels) - {1}
    assert verify(out).ok


def test_a_state_saved_on_the_old_version_is_refused_on_the_new(packed_sample, tmp_path: Path) -> None:
    out = _copy(packed_sample, "webdataset", tmp_path)
    iterator = open_shards(out, shuffle=True, seed=1).iterable()
    it = iter(iterator)
    next(it)
    state = iterator.state_dict()
    remove(out, [key for _, key, _ in _records(out)][-1:], reason=REASON)
    fresh = open_shards(out, shuffle=True, seed=1).iterable()
    with pytest.raises(ConfigError, match="saved on version 1, this dataset is version 2"):
        fresh.load_state_dict(state)


def test_a_state_of_one_version_2_is_refused_on_another(packed_sample, tmp_path: Path) -> None:
    """Two copies of an output, each with another record removed: both are version 2 and hold as
    many records, and still not the same data."""
    first, second = tmp_path / "first", tmp_path / "second"
    shutil.copytree(packed_sample("webdataset", 64, 7), first)
    shutil.copytree(first, second)
    keys = [key for _, key, _ in _records(first)]
    remove(first, [keys[0]], reason=REASON)
    remove(second, [keys[1]], reason=REASON)
    iterator = open_shards(first, shuffle=True, seed=1).iterable()
    next(iter(iterator))
    state = iterator.state_dict()
    said = r"saved on version 2 \(manifest [0-9a-f]{16}\.\.\.\), this dataset is version 2"
    with pytest.raises(ConfigError, match=said):
        open_shards(second, shuffle=True, seed=1).iterable().load_state_dict(state)
    open_shards(first, shuffle=True, seed=1).iterable().load_state_dict(state)  # (its own version takes it)


def test_a_damaged_or_tampered_output_is_refused(packed_sample, tmp_path: Path) -> None:
    out = _copy(packed_sample, "webdataset", tmp_path)
    key = _records(out)[0][1]
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["totals"]["records"] += 1  # a hand edit: the checksum no longer holds
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(OutputError, match="checksum does not match"):
        remove(out, [key], reason=REASON)
    other = tmp_path / "other"
    shutil.copytree(packed_sample("webdataset", 64, 7), other)
    (other / "index.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(Exception, match=r"index\.parquet: differs from the manifest"):
        remove(other, [key], reason=REASON)
    assert not (other / ".shardkit").exists()


def test_the_cli_reads_keys_from_a_file_and_says_what_it_did(shardkit, packed_sample, tmp_path: Path) -> None:
    out = _copy(packed_sample, "lmdb", tmp_path)
    keys = [key for _, key, _ in _records(out)]
    listing = tmp_path / "keys.txt"
    listing.write_text(f"{keys[2]}\n\n{keys[5]}\nnot-there\n")
    refused = shardkit("remove", out, "--keys", listing, "--reason", REASON)
    assert refused.returncode == 1 and "1 key not in the output: 'not-there'" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1
    done = shardkit("remove", out, "--keys", listing, "--reason", REASON, "--missing-ok", "--json", tmp_path / "r.json")
    assert done.returncode == 0, done.stderr
    said = " ".join(done.stdout.split())  # (rich wraps at the terminal's width)
    assert "removed 2 records" in said and "now version 2" in said and "1 key not in the output" in said
    assert json.loads((tmp_path / "r.json").read_text())["removed"] == 2
    nothing = shardkit("remove", out, "--resume")
    assert nothing.returncode == 0 and "no interrupted remove" in nothing.stdout, nothing.stderr


def test_a_takedown_by_content_finds_the_records_of_a_picture(
    shardkit, packed_sample, sample_dataset: Path, tmp_path: Path
) -> None:
    """`--like PICTURE`: the records packed from the same bytes go; with `--near`, those of the
    picture saved again too (its DCT hash within the threshold); a picture in no record is refused
    before any work, naming it, and an unreadable one too."""
    from PIL import Image

    out = _copy(packed_sample, "webdataset", tmp_path)
    rows = pq.read_table(out / "index.parquet", columns=["key", "source"]).to_pylist()
    first, second = rows[3], rows[9]
    saved_again = tmp_path / "request" / "saved_again.jpg"
    saved_again.parent.mkdir()
    with Image.open(sample_dataset / second["source"]) as image:
        image.convert("RGB").save(saved_again, quality=60)
    before = _all_bytes(out)
    with pytest.raises(ConfigError, match=r"1 of the pictures is in no record of it: .*saved_again\.jpg"):
        remove(out, like=[saved_again], reason=REASON)  # (other bytes: only near)
    with pytest.raises(ConfigError, match=r"nope\.jpg: cannot read"):
        remove(out, like=[tmp_path / "nope.jpg"], reason=REASON)
    assert _all_bytes(out) == before

    twice = tmp_path / "twice"  # (one picture under two names: both found)
    twice.mkdir()
    for name in ("a.jpg", "b.jpg"):
        shutil.copyfile(sample_dataset / first["source"], twice / name)
    done = remove(out, like=[twice], reason=REASON)
    assert (done.removed, done.missing) == (1, 0) and first["key"] not in [key for _, key, _ in _records(out)]
    cli = shardkit("remove", out, "--like", saved_again.parent, "--near", "--reason", REASON)
    assert cli.returncode == 0 and "removed 1 record" in " ".join(cli.stdout.split()), cli.stderr
    assert second["key"] not in [key for _, key, _ in _records(out)]
    rows = [json.loads(line) for line in (out / "errors.jsonl").read_text().splitlines()]
    assert [row["key"] for row in rows if row["stage"] == "removed"] == [first["key"], second["key"]]
    assert verify(out).ok
    kept = tmp_path / "kept"  # packed with --encode original before kept pictures were hashed: --near refused
    pack(PackConfig(str(sample_dataset), str(kept), resize=ResizeConfig(4096), encode=EncodeConfig("original")))
    with pytest.raises(ConfigError, match=r"of its records have no DCT hash, so --near cannot compare them"):
        remove(kept, like=[saved_again], near=True, reason=REASON)
    refused = shardkit("remove", out, "--keys", tmp_path / "k.txt", "--like", saved_again, "--reason", REASON)
    assert refused.returncode == 1 and refused.stderr == "error: remove takes one of --keys, --where and --like\n"


def test_a_pack_is_refused_while_a_remove_is_unfinished(shardkit, packed_sample, sample_dataset, tmp_path) -> None:
    out = _copy(packed_sample, "webdataset", tmp_path)
    (out / ".shardkit").mkdir()
    journal = {"action": "remove", "request": "r", "base": "b", "version": 2, "plan": {}, "moves": [],
               "deletes": [], "result": ""}  # fmt: skip
    (out / ".shardkit" / "change.json").write_text(json.dumps(journal))
    packed = shardkit("pack", sample_dataset, out, "--resize", "64", "--shard-size", "7", "--resume")
    assert packed.returncode == 1 and "an interrupted 'remove' is here" in packed.stderr
    (tmp_path / "keys.txt").write_text("k\n")
    other = shardkit("remove", out, "--keys", tmp_path / "keys.txt", "--reason", "x")
    assert other.returncode == 1 and "an interrupted 'remove' to version 2" in " ".join(other.stderr.split())


@pytest.mark.slow  # kills a change at each of its steps
@pytest.mark.parametrize("action", ["remove", "compact"])
def test_a_change_killed_at_any_step_resumes_to_the_clean_change(
    shardkit, packed_sample, tmp_path: Path, action: str
) -> None:
    source = packed_sample("webdataset", 64, 7)
    keys = [key for _, key, _ in _records(source)]
    listing = tmp_path / "keys.txt"
    listing.write_text("\n".join([keys[1], keys[3], *keys[13:20]]) + "\n")  # a shard rewritten, one dropped
    flags = ["--keys", str(listing), "--reason", REASON] if action == "remove" else ["--shard-size", "21"]
    clean, out = tmp_path / "clean", tmp_path / "out"
    shutil.copytree(source, clean)
    assert shardkit(action, clean, *flags).returncode == 0

    def finish() -> subprocess.CompletedProcess[str]:
        resumed = shardkit(action, out, "--resume")
        if resumed.returncode == 0 and read_manifest(out).version == 1:  # (killed before its journal)
            resumed = shardkit(action, out, *flags)
        return resumed

    command = [sys.executable, "-m", "shardkit", action, str(out), *flags]
    failed = every_step_finishes(out, source, command, finish, snapshot(clean), tmp_path / "hook", checked=_killed)
    assert not failed, "\n".join(failed)


def _killed(out: Path) -> str | None:
    """What verify says of a change's killed output that it should not: it is one version or the
    other, or (mid-commit) says it was interrupted."""
    report = verify(out)
    return None if report.ok or [p.kind for p in report.problems] == ["interrupted"] else str(report.problems)


@pytest.mark.parametrize(
    ("version", "history", "said"),
    [
        (0, [], "is not a version number"),
        (True, [], "is not a version number"),
        (2**40, [], "is not a version number"),
        (2, [], "an object per version after the first"),
        (2, ["x"], "an object per version after the first"),
        (1, [{}], "an object per version after the first"),
    ],
)
def test_a_manifests_version_and_history_are_checked(
    packed_sample, tmp_path: Path, version: object, history: list, said: str
) -> None:
    from shardkit.core.errors import ManifestError
    from shardkit.core.manifest import Manifest

    data = json.loads((packed_sample("webdataset", 64, 7) / "manifest.json").read_text())
    assert "version" not in data and "history" not in data  # a pack's manifest is as it was before versions
    with pytest.raises(ManifestError, match=said):
        Manifest.from_json({**data, "version": version, "history": history})


class Interrupted(Exception):
    """Raised from a remove's progress callback: a run stopped once its journal and part of next/
    are written, as a kill there leaves it."""


def _interrupted(out: Path, keys: list[str]) -> dict:
    def stop(done: int, total: int) -> None:
        raise Interrupted

    with pytest.raises(Interrupted):
        remove(out, keys, reason=REASON, progress=stop)
    return json.loads((out / ".shardkit" / "change.json").read_text())


def _damaged(journal: dict, case: str, victim: Path) -> dict:
    plan = journal["plan"]
    if case == "a new name outside":
        plan["writes"][0][0] = f"../../{victim.parent.name}/{victim.name}"
    elif case == "a shard not the output's":
        plan["writes"][0][1][0][0] = "shard-999999.tar"
    elif case == "positions past the shard":
        plan["writes"][0][1][0][1] = [10_000]
    elif case == "deletes every shard":
        journal["deletes"] = [f"shard-{n:06d}.tar" for n in range(9)]
    elif case == "no plan":
        journal["plan"] = {}
    elif case == "a version as text":
        journal["version"] = "2"
    elif case == "committing to a next that is not there":
        journal["result"] = "0" * 64
        journal["moves"] = ["manifest.json"]
    return journal


TAMPERINGS = [
    "a new name outside", "a shard not the output's", "positions past the shard", "deletes every shard",
    "no plan", "a version as text", "committing to a next that is not there",
]  # fmt: skip


@pytest.mark.parametrize("case", TAMPERINGS)
def test_a_tampered_journal_is_refused_and_nothing_is_touched(packed_sample, tmp_path: Path, case: str) -> None:
    out = _copy(packed_sample, "webdataset", tmp_path)
    victim = tmp_path / "victim" / "precious.tar"
    victim.parent.mkdir()
    victim.write_bytes(b"precious")
    keys = [key for _, key, _ in _records(out)]
    journal = _damaged(_interrupted(out, [keys[0], keys[8]]), case, victim)
    (out / ".shardkit" / "change.json").write_text(json.dumps(journal))
    shutil.rmtree(out / ".shardkit" / "next")
    before = snapshot(out)
    with pytest.raises(OutputError, match=r"move it away|move .* away to abandon|restore it from a copy"):
        remove(out, resume=True)
    assert snapshot(out) == before and victim.read_bytes() == b"precious"
    assert sorted(p.name for p in victim.parent.iterdir()) == ["precious.tar"]


def test_a_link_planted_as_next_is_refused(packed_sample, tmp_path: Path) -> None:
    out = _copy(packed_sample, "lmdb", tmp_path)
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(packed_sample("hdf5", 64, 7), elsewhere)
    keys = [key for _, key, _ in _records(out)]
    _interrupted(out, [keys[0], keys[8]])
    shutil.rmtree(out / ".shardkit" / "next")
    (out / ".shardkit" / "next").symlink_to(elsewhere)
    theirs = snapshot(elsewhere)
    with pytest.raises(OutputError, match="not a folder"):
        remove(out, resume=True)
    assert snapshot(elsewhere) == theirs


def test_an_output_changed_since_an_interrupted_remove_is_refused(packed_sample, tmp_path: Path) -> None:
    """Killed with its journal written; then another output of the same images is put in its place
    (a backup restored): the journal's positions are not that output's records."""
    out = _copy(packed_sample, "webdataset", tmp_path)
    keys = [key for _, key, _ in _records(out)]
    _interrupted(out, [keys[0], keys[8]])
    other = packed_sample("webdataset", 64, 5)
    for path in out.iterdir():
        if path.is_file():
            path.unlink()
    for path in other.iterdir():
        shutil.copy(path, out)
    with pytest.raises(OutputError, match="the output changed since the interrupted remove began"):
        remove(out, resume=True)
    assert [key for _, key, _ in _records(out)] == [key for _, key, _ in _records(other)]


def test_an_interrupted_remove_resumes_to_the_same_bytes(packed_sample, tmp_path: Path) -> None:
    clean, out = tmp_path / "clean", _copy(packed_sample, "hdf5", tmp_path)
    shutil.copytree(out, clean)
    keys = [key for _, key, _ in _records(out)]
    remove(clean, [keys[0], keys[8]], reason=REASON)
    _interrupted(out, [keys[0], keys[8]])
    result = remove(out, resume=True)
    assert result.resumed and result.removed == 2
    assert snapshot(out) == snapshot(clean)


def test_an_errors_log_without_a_last_newline_keeps_its_rows(packed_sample, tmp_path: Path) -> None:
    out = _copy(packed_sample, "webdataset", tmp_path)
    log = out / "errors.jsonl"
    earlier = log.read_bytes()
    log.write_bytes(earlier.rstrip(b"\n"))  # (verify takes such a log)
    assert verify(out).ok
    remove(out, [_records(out)[0][1]], reason=REASON)
    assert log.read_bytes().startswith(earlier) and verify(out).ok


def test_an_output_with_a_shard_missing_takes_no_remove(packed_sample, tmp_path: Path) -> None:
    out = _copy(packed_sample, "webdataset", tmp_path)
    key = _records(out)[0][1]
    (out / "shard-000003.tar").unlink()
    before = snapshot(out)
    with pytest.raises(
        OutputError, match=r"/shard-000003.tar: missing; a remove goes only onto an output that verifies"
    ):
        remove(out, [key], reason=REASON)
    assert snapshot(out) == before
