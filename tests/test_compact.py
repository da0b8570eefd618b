"""`shardkit compact`: consecutive small shards joined into full ones in every format, without
decoding or encoding: the same records in the same order, byte for byte, from fewer shards; the
shards left alone stay as they were; verify passes and the reader reads the same samples."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from shardkit.changes.compact import compact
from shardkit.changes.remove import remove
from shardkit.checks.verify import verify
from shardkit.core.errors import ConfigError
from shardkit.core.manifest import read_manifest, sha256_file
from shardkit.formats import available_formats
from shardkit.readers import open_shards
from tests.test_pack_kills import snapshot
from tests.test_remove import _copy, _records


@pytest.mark.parametrize("format", available_formats())
def test_small_shards_are_joined_with_the_same_records_in_the_same_order(
    packed_sample, sample_dataset: Path, format: str, tmp_path: Path
) -> None:
    out = _copy(packed_sample, format, tmp_path)
    before, records = read_manifest(out), _records(out)
    assert max(s.count for s in before.shards) <= 7 and len(before.shards) >= 8  # (joined by threes below 21)

    result = compact(out, shard_size=21)

    after = read_manifest(out)
    assert [(key, data) for _, key, data in _records(out)] == [(key, data) for _, key, data in records]
    assert (result.shards_before, result.shards_after) == (len(before.shards), len(after.shards))
    assert all(s.count <= 21 for s in after.shards) and len(after.shards) < len(before.shards)
    alone = [s for s in before.shards if s in after.shards]  # left as they were: same name, bytes, sha256
    assert all(sha256_file(out / s.name) == s.sha256 for s in alone)
    assert after.shards[0].name == before.shards[0].name.replace(".", "-v2.", 1)
    assert after.version == 2 and after.history[0]["change"] == "compact"
    assert after.history[0]["shard_size"] == 21 and after.totals == before.totals
    gone = {s.name for s in before.shards} - {s.name for s in after.shards}
    assert not any((out / name).exists() for name in gone)
    index = pq.read_table(out / "index.parquet").to_pylist()
    assert [row["key"] for row in index] == [key for _, key, _ in records]
    assert [(row["shard"], row["position"]) for row in index] == [
        (s.name, at) for s in after.shards for at in range(s.count)
    ]
    assert verify(out, deep=True, source=sample_dataset).ok
    dataset = open_shards(out)
    assert [dataset[i].key for i in range(len(dataset))] == [key for _, key, _ in records]
    again = compact(out, shard_size=21)  # nothing more fits together
    assert again.joined == 0 and read_manifest(out) == after


def test_compact_after_a_remove_joins_what_the_remove_left_small(packed_sample, tmp_path: Path) -> None:
    out = _copy(packed_sample, "webdataset", tmp_path)
    keys = [key for _, key, _ in _records(out)]
    remove(out, keys[1:6] + keys[8:13], reason="opt-outs")  # two shards left with 2 records each
    kept = [(key, data) for _, key, data in _records(out)]
    result = compact(out, shard_bytes="1GB")
    assert result.shards_after == 1 and read_manifest(out).version == 3
    assert [(key, data) for _, key, data in _records(out)] == kept
    assert verify(out, deep=True).ok


@pytest.mark.parametrize(
    ("arguments", "said"),
    [
        ({}, "needs a target"),
        ({"shard_size": 10, "shard_bytes": "1MB"}, "not both"),
        ({"shard_size": 1}, "2 or more"),
        ({"shard_bytes": "12"}, "at least 1KB"),
        ({"shard_bytes": "lots"}, "lots"),
        ({"shard_bytes": 1.5e6}, "a whole number of bytes"),
        ({"shard_bytes": True}, "a whole number of bytes"),
    ],
)
def test_a_bad_target_is_refused_before_the_output_is_touched(
    packed_sample, tmp_path: Path, arguments: dict, said: str
) -> None:
    out = _copy(packed_sample, "lmdb", tmp_path)
    before = snapshot(out)
    with pytest.raises(ConfigError, match=said):
        compact(out, **arguments)
    assert snapshot(out) == before


def test_the_cli_says_what_it_joined(shardkit, packed_sample, tmp_path: Path) -> None:
    out = _copy(packed_sample, "hdf5", tmp_path)
    done = shardkit("compact", out, "--shard-size", "14", "--json", tmp_path / "c.json")
    assert done.returncode == 0, done.stderr
    said = " ".join(done.stdout.split())
    report = json.loads((tmp_path / "c.json").read_text())
    assert f"{report['shards_before']} shards into {report['shards_after']}" in said and "now version 2" in said
    unchanged = shardkit("compact", out, "--shard-size", "14")
    assert unchanged.returncode == 0 and "unchanged" in unchanged.stdout
    other = tmp_path / "other"
    shutil.copytree(out, other)
    refused = shardkit("remove", other, "--resume")
    assert refused.returncode == 0 and "nothing to finish" in " ".join(refused.stdout.split())


class Interrupted(Exception):
    pass


def _interrupted_compact(out: Path, size: int) -> dict:
    def stop(done: int, total: int) -> None:
        raise Interrupted

    with pytest.raises(Interrupted):
        compact(out, shard_size=size, progress=stop)
    return json.loads((out / ".shardkit" / "change.json").read_text())


@pytest.mark.parametrize("case", ["a shard gone that no new shard holds", "parts out of order", "a target of -3"])
def test_a_compact_journal_that_is_not_its_targets_plan_is_refused(packed_sample, tmp_path: Path, case: str) -> None:
    from shardkit.changes.rewrite import deletes
    from shardkit.core.errors import OutputError

    out = _copy(packed_sample, "webdataset", tmp_path)
    journal = _interrupted_compact(out, 21)
    plan = journal["plan"]
    if case == "a shard gone that no new shard holds":
        plan["gone"].append(read_manifest(out).shards[-1].name)
        journal["deletes"] = deletes(read_manifest(out), plan["gone"])
    elif case == "parts out of order":
        parts = plan["writes"][0][1]
        parts[0], parts[1] = parts[1], parts[0]
    else:
        plan["target"] = {"shard_size": -3}
    (out / ".shardkit" / "change.json").write_text(json.dumps(journal))
    shutil.rmtree(out / ".shardkit" / "next")
    before = snapshot(out)
    with pytest.raises(OutputError, match="the interrupted compact's plan"):
        compact(out, resume=True)
    assert snapshot(out) == before


def test_the_other_changes_resume_is_pointed_at_and_a_target_with_resume_refused(
    shardkit, packed_sample, tmp_path: Path
) -> None:
    out = _copy(packed_sample, "lmdb", tmp_path)
    _interrupted_compact(out, 21)
    wrong = shardkit("remove", out, "--resume")
    assert wrong.returncode == 1 and f"`shardkit compact {out} --resume` finishes it" in " ".join(wrong.stderr.split())
    with pytest.raises(ConfigError, match="give no target"):
        compact(out, resume=True, shard_size=50)
    finished = compact(out, resume=True)
    assert finished.resumed and finished.joined and verify(out, deep=True).ok


@pytest.mark.parametrize("change", ["compact", "remove"])
def test_a_damaged_shard_is_refused_not_written_again_as_whole(packed_sample, tmp_path: Path, change: str) -> None:
    from shardkit.core.errors import OutputError

    out = _copy(packed_sample, "webdataset", tmp_path)
    first = read_manifest(out).shards[0]
    data = bytearray((out / first.name).read_bytes())
    data[700] ^= 0xFF  # inside the first record's image
    (out / first.name).write_bytes(bytes(data))
    before = snapshot(out)
    with pytest.raises(OutputError, match=f"{first.name}: differs from the manifest"):
        if change == "compact":
            compact(out, shard_size=21)
        else:
            remove(out, [_records(out)[1][1]], reason="x")
    assert snapshot(out) == before
