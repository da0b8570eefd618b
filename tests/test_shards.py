"""An output's shards as a dataset reads them (readers/shards.py), on real packed outputs of every
format: records by position and by range checked against the manifest's counts, a damaged shard
handed to on_error after the records before the damage, a peek that never decides for on_error,
and a local output's files checked against the manifest before any is opened."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest

from shardkit import PackConfig, pack
from shardkit.core.errors import ShardFormatError, ShardReadError
from shardkit.core.manifest import read_manifest
from shardkit.readers.shards import Shards, check_sizes
from shardkit.synthetic import write_image

from .conftest import built_once

FORMATS = ("webdataset", "lmdb", "hdf5")


@pytest.fixture(scope="module")
def outputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    def build(folder: Path) -> None:
        for i in range(9):
            write_image(folder / "src" / f"{i:02d}.jpg", 40 + i, 30, seed=i)
        for format in FORMATS:
            pack(PackConfig(str(folder / "src"), str(folder / format), format=format, shard_size=4, workers=1))

    root = built_once(tmp_path_factory, "stage-shards", build)
    return {format: root / format for format in FORMATS}


def shards_of(folder: Path) -> Shards:
    return Shards(folder, read_manifest(folder), None, None, None)


@pytest.mark.parametrize("format", FORMATS)
def test_records_by_position_range_and_key(outputs: dict[str, Path], format: str) -> None:
    shards = shards_of(outputs[format])
    keys = shards.keys(1)
    assert keys == ["04", "05", "06", "07"]
    failed: list[ShardReadError] = []
    assert [r.key for r in shards.read_range(1, 1, 4, failed.append)] == keys[1:] and not failed
    assert shards.read(2, 0).key == "08" and shards.peek(1, 2).key == "06"
    assert [r.key for r in shards.records(0)] == ["00", "01", "02", "03"]
    shards.close()


def test_a_count_the_manifest_does_not_match_is_refused(outputs: dict[str, Path]) -> None:
    manifest = read_manifest(outputs["lmdb"])
    wrong = dataclasses.replace(
        manifest, shards=[dataclasses.replace(manifest.shards[0], count=5), *manifest.shards[1:]]
    )
    shards = Shards(outputs["lmdb"], wrong, None, None, None)
    with pytest.raises(ShardFormatError, match="holds 4 records, the manifest says 5"):
        shards.read(0, 0)
    failed: list[ShardReadError] = []
    assert [r.key for r in shards.read_range(0, 0, 5, failed.append)] == ["00", "01", "02", "03"]
    assert len(failed) == 1 and "ends after 4 records, the manifest says 5" in str(failed[0])


def test_a_damaged_shard_fails_after_its_good_records(outputs: dict[str, Path], tmp_path: Path) -> None:
    folder = tmp_path / "out"
    shutil.copytree(outputs["webdataset"], folder)
    shard = folder / "shard-000001.tar"
    data = shard.read_bytes()
    shard.write_bytes(data[: data.index(b"07.jpg")])  # cut at the last record's header
    shards = shards_of(folder)
    failed: list[ShardReadError] = []
    got = [r.key for r in shards.read_range(1, 0, 4, failed.append)]
    assert got[:2] == ["04", "05"] and len(got) < 4 and len(failed) == 1
    assert shards.peek(1, 3) is None  # (whoever reads it next says why, under its on_error)
    with pytest.raises(ShardFormatError, match=r"shard-000001\.tar: .* bytes, the manifest says"):
        check_sizes(folder, read_manifest(folder))
    shard.unlink()
    with pytest.raises(ShardFormatError, match="listed in the manifest but missing"):
        check_sizes(folder, read_manifest(folder))
