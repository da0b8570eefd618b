"""The `Output` contract (packing/output.py) on both of its kinds through the same tests: a local
folder, and a bucket prefix on a real SeaweedFS S3 server. Each test calls the operations in the
order a pack does and checks what the contract promises, whichever kind it holds: a shard put in
place on record, kept by a resume while whole and not once it changed, and a published output
that is a local pack's, byte for byte, with no state left behind."""

from __future__ import annotations

import hashlib
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from shardkit.core.config import EncodeConfig, PackConfig, ResizeConfig
from shardkit.core.manifest import MANIFEST_NAME, Manifest
from shardkit.core.safeio import load_json_file, loads
from shardkit.packing.bucket_output import BucketOutput
from shardkit.packing.folder_output import FolderOutput, claim
from shardkit.packing.index import part_path
from shardkit.packing.output import open_output
from shardkit.packing.pack import pack
from shardkit.packing.plan import ShardSpec
from shardkit.packing.resume import reused_shard
from shardkit.packing.shard_writing import ShardResult
from shardkit.packing.sources import Item
from shardkit.packing.worker import ShardJob, write_shard
from shardkit.packing.working_folder import done_path, state_dir, temp_dir
from shardkit.storage.store import Store
from shardkit.storage.urls import is_remote

from .helpers import bucket_objects, folder_files

KINDS = ["folder", pytest.param("bucket", marks=pytest.mark.slow)]  # (a bucket starts the S3 server)


class Where(NamedTuple):
    url: str  # a folder's path, or a prefix of the test bucket `data`
    s3: Any  # the S3 server, for a bucket

    def files(self) -> dict[str, bytes]:
        """Every file of the output (a bucket's at any depth, by the last part of its name)."""
        if self.s3 is None:
            return folder_files(Path(self.url))
        return bucket_objects(self.s3, self.url.removeprefix("s3://data/"))


@pytest.fixture(params=KINDS)
def where(request: pytest.FixtureRequest, tmp_path: Path) -> Where:
    """An output of each kind, not written yet."""
    if request.param == "folder":
        return Where(str(tmp_path / "out"), None)
    return Where(f"s3://data/{tmp_path.name}", request.getfixturevalue("s3"))


def _config(source: Path, where: str, tmp_path: Path, **flags: Any) -> PackConfig:
    staging = str(tmp_path / "staging") if is_remote(where) else None
    return PackConfig(str(source), where, resize=ResizeConfig(48), shard_size=10, staging=staging, **flags)


def _stored(where: str, name: str) -> bytes | None:
    """What the output keeps under `name` (None: nothing)."""
    if is_remote(where):
        try:
            return Store(where).read(name, 1 << 30)
        except FileNotFoundError:
            return None
    path = Path(where) / name
    return path.read_bytes() if path.is_file() else None


def _cut_short(where: str, name: str) -> None:
    """`name` replaced by its first half: a shard that changed since it was written."""
    data = _stored(where, name)
    assert data is not None
    if is_remote(where):
        Store(where).write(name, data[: len(data) // 2])
    else:
        (Path(where) / name).write_bytes(data[: len(data) // 2])


def _write_one(config: PackConfig, items: tuple[Item, ...]) -> tuple[ShardSpec, ShardResult]:
    """One shard through the contract, as a pack writes it: opened, its local folder claimed,
    begun, the shard written to the destination the output gives, then marked done."""
    output = open_output(config)
    assert output.open(config) is None  # nothing finished there
    local = output.local_config(config)
    claimed = claim(local.output, resume=local.resume, overwrite=local.overwrite)
    try:
        output.begin()
        spec = ShardSpec(0, "shard-000000.tar", items)
        job = ShardJob(spec, str(output.folder), config.format, config.resize, EncodeConfig(), "plan",
                       destination=output.destination(spec.name))  # fmt: skip
        result = write_shard(job)
        output.mark_done(result)
    finally:
        claimed.release(undo=False)
    return spec, result


def test_a_shard_is_put_in_place_on_record_and_kept_by_a_resume_while_whole(
    where: Where, sample_dataset: Path, tmp_path: Path
) -> None:
    config = _config(sample_dataset, where.url, tmp_path)
    images = sorted(sample_dataset.rglob("*.jpg"))[:5]
    spec, result = _write_one(config, tuple(Item(str(path), path.name, path.stem, None) for path in images))
    assert result.shard.count + len(result.errors) == 5 and result.companion is not None
    shard = _stored(where.url, spec.name)
    assert shard is not None and len(shard) == result.shard.bytes
    assert hashlib.sha256(shard).hexdigest() == result.shard.sha256
    assert _stored(where.url, result.companion.name) is not None  # its .idx file beside it
    folder = open_output(config).folder  # the local folder: its done marker and index part there
    marker = load_json_file(done_path(folder, spec.name))
    assert {**marker, "timings": None} == {**result.marker(), "timings": None}  # (timed until put in place)
    assert part_path(state_dir(folder), spec.name).is_file() and result.index_part is None
    assert list(temp_dir(folder).iterdir()) == []  # nothing half written left behind

    resumed = replace(config, resume=True)
    again = open_output(resumed)
    assert again.open(resumed) is None  # begun, not finished: nothing to compare
    kept = reused_shard(again.folder, spec, "plan", again.intact)
    assert kept is not None and kept.shard == result.shard and kept.reused
    _cut_short(where.url, spec.name)
    changed = open_output(resumed)
    changed.open(resumed)
    assert reused_shard(changed.folder, spec, "plan", changed.intact) is None  # written again, not trusted


def test_a_published_output_is_a_local_packs_with_no_state_left(
    where: Where, sample_dataset: Path, tmp_path: Path
) -> None:
    reference = tmp_path / "reference"
    pack(PackConfig(str(sample_dataset), str(reference), resize=ResizeConfig(48), shard_size=10))
    config = _config(sample_dataset, where.url, tmp_path)
    result = pack(config)
    assert result.output == where.url and not result.already_complete
    files = where.files()
    assert files == folder_files(reference)  # shards, .idx files, index, errors, manifest; no marker left
    resumed = replace(config, resume=True)
    output = open_output(resumed)
    assert not state_dir(output.folder).exists()  # the working folder (a bucket's staging state) is gone
    manifest = Manifest.from_json(loads(files[MANIFEST_NAME]))
    finished = output.open(resumed)
    assert finished is None or finished.shards == manifest.shards  # (a bucket hands its manifest back)
    assert output.complete(manifest)
    again = pack(resumed)
    assert again.already_complete and again.records == result.records


def test_the_kind_is_chosen_once_from_the_url(tmp_path: Path) -> None:
    folder = open_output(PackConfig("src", str(tmp_path / "out")))
    assert isinstance(folder, FolderOutput) and folder.folder == tmp_path / "out" and folder.shards_here
    as_url = open_output(PackConfig("src", f"file://{tmp_path}/out"))
    assert isinstance(as_url, FolderOutput)
    bucket = open_output(PackConfig("src", "s3://bucket/prefix", staging=str(tmp_path / "staging")))
    assert isinstance(bucket, BucketOutput) and bucket.url == "s3://bucket/prefix" and not bucket.shards_here
    assert bucket.folder == tmp_path / "staging"  # its local folder: where its state is kept
    assert not (tmp_path / "staging").exists() and not (tmp_path / "out").exists()  # nothing touched
