"""`shardkit pack SRC s3://...`, `verify` and `bench` on a URL: the real CLI in subprocesses against a
real SeaweedFS S3 server on loopback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardkit.core.manifest import read_manifest
from shardkit.storage.store import Store

from .helpers import bucket_objects, folder_files

pytestmark = pytest.mark.slow  # a real Ray instance or S3 server: `make test` runs these, `make test-fast` does not

SHARDKIT = [sys.executable, "-m", "shardkit"]


def _run(*args: str, cache: Path, **env: str) -> subprocess.CompletedProcess:
    environment = {**os.environ, "SHARDKIT_CACHE": str(cache), "COLUMNS": "200", **env}
    return subprocess.run([*SHARDKIT, *map(str, args)], capture_output=True, text=True, env=environment, timeout=300)


@pytest.fixture(scope="module")
def local_pack(sample_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("local") / "out"
    result = _run("pack", sample_dataset, out, "--resize", "48", "--shard-size", "10", cache=out.parent / "cache")
    assert result.returncode == 0, result.stderr
    return out


def test_pack_to_s3_gives_the_bytes_of_a_local_pack(s3, sample_dataset: Path, local_pack: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    result = _run("pack", sample_dataset, "s3://data/same", "--resize", "48", "--shard-size", "10", cache=cache)
    assert result.returncode == 0, result.stderr
    assert "s3://data/same" in result.stdout
    uploaded = bucket_objects(s3, "same")
    assert uploaded == folder_files(local_pack)  # shards, errors.jsonl and manifest, byte for byte
    assert not (cache / "staging").exists() or not any((cache / "staging").iterdir())  # staging cleared
    # packing again is refused, before any work
    again = _run("pack", sample_dataset, "s3://data/same", "--resize", "48", "--shard-size", "10", cache=cache)
    assert again.returncode != 0
    assert "s3://data/same: holds a finished shardkit output; use --resume or --overwrite" in again.stderr
    assert "Traceback" not in again.stderr
    # --resume finds it complete and uploads nothing
    resumed = _run("pack", sample_dataset, "s3://data/same", "--resize", "48", "--shard-size", "10", "--resume",
                   cache=cache)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr
    assert "already complete" in resumed.stdout
    assert bucket_objects(s3, "same") == uploaded


def test_verify_a_bucket_catches_damaged_missing_and_stray_objects(s3, local_pack: Path, tmp_path: Path) -> None:
    store = Store("s3://data/verify")
    for name, data in folder_files(local_pack).items():
        store.write(name, data)
    ok = _run("verify", "s3://data/verify", "--deep", cache=tmp_path)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "OK" in ok.stdout and "60" not in ok.stderr
    shards = read_manifest(local_pack).shards
    damaged = bytearray((local_pack / shards[1].name).read_bytes())
    damaged[-2000] ^= 0x01
    store.write(shards[1].name, bytes(damaged))
    store.delete(shards[3].name)
    store.write("notes.txt", b"not a shard")
    report_path = tmp_path / "report.json"
    bad = _run("verify", "s3://data/verify", "--json", report_path, cache=tmp_path)
    assert bad.returncode == 1
    problems = {(p["kind"], p["shard"]) for p in json.loads(report_path.read_text())["problems"]}
    assert ("checksum", shards[1].name) in problems
    assert ("missing", shards[3].name) in problems
    assert ("stray", "notes.txt") in problems


def test_a_bucket_with_foreign_objects_or_no_access_is_refused_before_work(s3, sample_dataset, tmp_path) -> None:
    Store("s3://data/foreign").write("keep-me.txt", b"a user's file")
    result = _run("pack", sample_dataset, "s3://data/foreign", "--overwrite", cache=tmp_path)
    assert result.returncode != 0
    assert "s3://data/foreign/keep-me.txt: not written by shardkit" in result.stderr
    assert bucket_objects(s3, "foreign") == {"keep-me.txt": b"a user's file"}
    denied = _run(
        "pack", sample_dataset, "s3://data/denied", "--storage-option", "key=nobody", "--storage-option",
        "secret=wrong", cache=tmp_path,
    )  # fmt: skip
    assert denied.returncode != 0 and "s3://data/denied" in denied.stderr
    assert len(denied.stderr.strip().splitlines()) == 1 and "Traceback" not in denied.stderr
    assert not (tmp_path / "staging").exists()  # nothing packed


def test_resume_uploads_only_what_the_bucket_lacks(s3, sample_dataset: Path, local_pack: Path, tmp_path) -> None:
    # The state an upload killed halfway leaves: some shards up, each with a finished marker, one
    # begun (a store that shows partial objects); no manifest.
    store = Store("s3://data/half")
    shards = read_manifest(local_pack).shards

    def mark(shard, uploaded: bool) -> None:
        record = {"bytes": shard.bytes, "sha256": shard.sha256, "uploaded": uploaded}
        store.write(f".shardkit/uploaded/{shard.name}.json", json.dumps(record).encode())

    for shard in shards[:3]:
        store.write(shard.name, (local_pack / shard.name).read_bytes())
        mark(shard, True)
    written = time.time()
    mark(shards[3], False)
    store.write(shards[3].name, b"half an upload")  # begun, not finished: not trusted
    refused = _run("pack", sample_dataset, "s3://data/half", "--resize", "48", "--shard-size", "10", cache=tmp_path)
    assert refused.returncode != 0 and "holds an interrupted pack; use --resume" in refused.stderr
    import s3fs

    fs = s3fs.S3FileSystem(**s3.options)
    before = {shard.name: fs.info(f"data/half/{shard.name}")["LastModified"] for shard in shards[:3]}
    time.sleep(max(0.0, written + 1.1 - time.time()))  # LastModified counts whole seconds: an upload again would show
    resumed = _run("pack", sample_dataset, "s3://data/half", "--resize", "48", "--shard-size", "10", "--resume",
                   cache=tmp_path)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr
    fs.invalidate_cache()
    after = {shard.name: fs.info(f"data/half/{shard.name}")["LastModified"] for shard in shards[:3]}
    assert after == before  # the shards the bucket held were not uploaded again
    assert bucket_objects(s3, "half") == folder_files(local_pack)  # markers gone, the half upload replaced


def test_a_pack_killed_midway_left_its_shards_in_the_bucket_and_resumes(s3, sample_dataset, local_pack, tmp_path):
    # Each shard goes up as soon as it is written and staging never holds one: a pack SIGKILLed
    # (with its workers) once its first shard is done leaves that shard in the bucket, on record.
    staging = tmp_path / "staging"
    done = staging / ".shardkit" / "done"
    command = [*SHARDKIT, "pack", sample_dataset, "s3://data/cut", "--resize", "48", "--shard-size", "10",
               "--workers", "1", "--staging", staging]  # fmt: skip
    run = subprocess.Popen(list(map(str, command)), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                           env={**os.environ, "SHARDKIT_CACHE": str(tmp_path)}, start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + 120
    while not any(done.glob("*.json")) and run.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    os.killpg(run.pid, signal.SIGKILL)
    assert run.wait() == -signal.SIGKILL, f"finished before it could be killed: {run.stderr.read()}"
    kept = sorted(marker.name.removesuffix(".json") for marker in done.glob("*.json"))
    assert kept
    assert not [path for path in staging.rglob("*") if path.name.endswith((".tar", ".idx"))]  # no shard staged
    store = Store("s3://data/cut")
    up = bucket_objects(s3, "cut")
    assert "manifest.json" not in up
    for name in kept:
        assert json.loads(up[name + ".json"])["uploaded"] is True  # (its marker)
        assert up[name] == (local_pack / name).read_bytes()
    import s3fs

    fs = s3fs.S3FileSystem(**s3.options)
    before = {name: fs.info(f"data/cut/{name}")["LastModified"] for name in kept}
    time.sleep(1.1)  # (LastModified counts seconds)
    resumed = _run("pack", sample_dataset, store.url, "--resize", "48", "--shard-size", "10", "--resume", "--staging",
                   staging, cache=tmp_path)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr
    assert f"({len(kept)} reused from the earlier run)" in resumed.stdout
    fs.invalidate_cache()
    assert {name: fs.info(f"data/cut/{name}")["LastModified"] for name in kept} == before  # kept, not sent again
    assert bucket_objects(s3, "cut") == folder_files(local_pack)  # the rest written again; markers gone
    assert not staging.exists()


def test_overwrite_replaces_only_shardkits_objects(s3, sample_dataset: Path, local_pack: Path, tmp_path) -> None:
    first = _run("pack", sample_dataset, "s3://data/over", "--resize", "48", "--shard-size", "5", cache=tmp_path)
    assert first.returncode == 0, first.stderr
    earlier = [name for name in bucket_objects(s3, "over") if name.startswith("shard-")]
    assert len(earlier) > len(read_manifest(local_pack).shards)  # more shards than the pack replacing it
    second = _run("pack", sample_dataset, "s3://data/over", "--resize", "48", "--shard-size", "10", "--overwrite",
                  cache=tmp_path)  # fmt: skip
    assert second.returncode == 0, second.stderr
    assert bucket_objects(s3, "over") == folder_files(local_pack)  # the six shards the new manifest names, nothing else


def test_bench_reads_a_bucket_through_the_cache(s3, local_pack: Path, tmp_path: Path) -> None:
    store = Store("s3://data/bench")
    for name, data in folder_files(local_pack).items():
        store.write(name, data)
    report_path = tmp_path / "bench.json"
    result = _run("bench", "s3://data/bench", "--repeat", "1", "--json", report_path, "--cache-dir", tmp_path / "c",
                  cache=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads(report_path.read_text())
    records = read_manifest(local_pack).records
    assert report["images"] == records and all(row["images"] == records for row in report["rows"])
    assert sorted(p.name for p in (tmp_path / "c" / "shards").iterdir()) == sorted(
        s.sha256 + ".tar" for s in read_manifest(local_pack).shards
    )


def test_an_overwrite_killed_after_the_manifest_went_can_be_finished(s3, sample_dataset, local_pack, tmp_path) -> None:
    from shardkit.packing.bucket_output import EARLIER
    from shardkit.storage.store import read_remote_manifest

    first = _run("pack", sample_dataset, "s3://data/killed", "--resize", "48", "--shard-size", "5", cache=tmp_path)
    assert first.returncode == 0, first.stderr
    # An --overwrite killed right after its first steps: the earlier shards on record, no manifest.
    store = Store("s3://data/killed")
    earlier = read_remote_manifest(store)
    store.write(EARLIER, json.dumps({"shards": {s.name: [s.bytes, s.sha256] for s in earlier.shards}}).encode())
    store.delete("manifest.json")
    refused = _run("pack", sample_dataset, "s3://data/killed", "--resize", "48", "--shard-size", "10", cache=tmp_path)
    assert refused.returncode != 0 and "holds an interrupted pack" in refused.stderr
    again = _run("pack", sample_dataset, "s3://data/killed", "--resize", "48", "--shard-size", "10", "--overwrite",
                 cache=tmp_path)  # fmt: skip
    assert again.returncode == 0, again.stderr
    assert bucket_objects(s3, "killed") == folder_files(local_pack)  # the earlier shards gone, no record left


def test_a_missing_filesystem_package_is_named_on_the_cli(tmp_path: Path) -> None:
    import importlib.util

    if importlib.util.find_spec("gcsfs") is not None:
        pytest.skip("gcsfs is installed here: gs:// would not need the hint")
    result = _run("verify", "gs://bucket/[prefix]", cache=tmp_path)
    assert result.returncode == 1
    assert "pip install 'shardkit[gcs]'" in result.stdout  # rich markup would have eaten "[gcs]"
    assert "gs://bucket/[prefix]" in result.stdout
