"""Merging outputs in a bucket into a new prefix, on a real SeaweedFS S3 server: the prefix ends up
holding the files a local merge of the same outputs makes, byte for byte (the manifest differs only
in the sources' names), its shards copied server-side; a kill -9 after any request the merge
makes of the bucket, then the same merge again, gives the uninterrupted merge's prefix."""

from __future__ import annotations

import json
import os
import signal
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from shardkit.changes.merge import merge
from shardkit.changes.remove import remove
from shardkit.checks.verify import verify
from shardkit.core.config import PackConfig, ResizeConfig
from shardkit.core.errors import ConfigError, ManifestError, OutputError
from shardkit.core.manifest import read_manifest
from shardkit.packing.pack import pack
from shardkit.readers import open_shards
from shardkit.synthetic import write_image
from tests.test_bucket_changes import REPO, _files, _objects, _upload
from tests.warm_starts import WarmStarter

pytestmark = pytest.mark.slow


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "cache"
    monkeypatch.setenv("SHARDKIT_CACHE", str(folder))
    return folder


def _packed(tmp_path: Path, name: str, format: str, count: int, seed: int) -> Path:
    """A small output of its own images (class folders shaped like ImageNet's), 3 records a shard."""
    images = tmp_path / f"{name}-images"
    for n in range(count):
        write_image(images / ("n01440764" if n % 3 else "n01443537") / f"{name}-{n}.JPEG", 70 + n, 50, seed=seed + n)
    out = tmp_path / name
    config = PackConfig(str(images), str(out), format=format, resize=ResizeConfig(48))
    pack(replace(config, shard_size=3))
    return out


def _same_but_sources(bucket: dict[str, bytes], local: dict[str, bytes]) -> None:
    """Every file byte for byte but the manifest, which differs only in where the sources were."""
    assert sorted(bucket) == sorted(local)
    assert {n: b for n, b in bucket.items() if n != "manifest.json"} == {
        n: b for n, b in local.items() if n != "manifest.json"
    }
    ours, theirs = json.loads(bucket["manifest.json"]), json.loads(local["manifest.json"])
    for manifest in (ours, theirs):
        manifest.pop("checksum")
        for entry in manifest["settings"]["merged"]:
            entry.pop("path")
    assert ours == theirs


@pytest.mark.parametrize("format", ["webdataset", "lmdb", "hdf5"])
def test_outputs_in_a_bucket_merge_there_as_local_folders_merge(s3, cache: Path, tmp_path: Path, format: str) -> None:
    a, b = _packed(tmp_path, "a", format, 7, 0), _packed(tmp_path, "b", format, 5, 100)
    base = f"{tmp_path.name}-{format}"
    urls = [_upload(s3, a, f"{base}/a"), _upload(s3, b, f"{base}/b")]
    local = merge([a, b], tmp_path / "ab")
    counted: list[tuple[int, int]] = []
    done = merge(urls, f"s3://data/{base}/ab", progress=lambda done, total: counted.append((done, total)))
    assert (done.records, done.shards, done.linked, done.rewritten) == (12, 5, 5, 0)
    assert [total for _, total in counted] == [5] * len(counted) and counted[-1] == (5, 5)
    assert [n for n, _ in counted] == sorted(n for n, _ in counted)  # (as copies end: how many at once varies)
    assert done.bytes_written == local.output_bytes
    _same_but_sources(_objects(s3, f"{base}/ab"), _files(tmp_path / "ab"))
    assert verify(f"s3://data/{base}/ab").problems == []
    assert [s.key for s in open_shards(f"s3://data/{base}/ab")] == [s.key for s in open_shards(tmp_path / "ab")]
    again = merge(urls, f"s3://data/{base}/ab")
    assert again.already_complete
    # prefixed keys: the shards written again here, uploaded
    twice = [_upload(s3, a, f"{base}/x/out"), _upload(s3, a, f"{base}/y/out")]
    prefixed = merge(twice, f"s3://data/{base}/xy", prefix_keys=True)
    assert (prefixed.linked, prefixed.rewritten) == (0, 6)
    keys = [s.key for s in open_shards(f"s3://data/{base}/xy")]
    assert keys[:7] == [f"out/{s.key}" for s in open_shards(a)] and keys[7:] == [
        f"out-2/{s.key}" for s in open_shards(a)
    ]
    assert verify(f"s3://data/{base}/xy").problems == []
    assert not (cache / "changes").exists() or not any((cache / "changes").iterdir())  # no mirror left


def test_local_folders_and_outputs_in_a_bucket_merge_either_way(s3, cache: Path, tmp_path: Path) -> None:
    """A local output merged with one in a bucket: into the bucket, the local shards uploaded and
    the bucket's copied server-side; into a local folder, the bucket's downloaded (each checked
    against its manifest) and then linked. Either way the files are a local merge's, but for the
    sources' names in the manifest, and no download is left in the cache."""
    a, b = _packed(tmp_path, "a", "webdataset", 7, 0), _packed(tmp_path, "b", "webdataset", 5, 100)
    base = tmp_path.name
    url_a, url_b = _upload(s3, a, f"{base}/a"), _upload(s3, b, f"{base}/b")
    local = merge([a, b], tmp_path / "ab")
    # what a merge killed while it downloaded left (its lock let go), and one running now (held)
    import fcntl

    downloads = cache / "merge-sources"
    (downloads / "0123456789abcdef-dead").mkdir(parents=True)
    (downloads / "0123456789abcdef-dead" / "shard-000000.tar").write_bytes(b"x" * 1000)
    (downloads / "0123456789abcdef-dead.lock").touch()
    (downloads / "0123456789abcdef-live").mkdir()
    running = os.open(downloads / "0123456789abcdef-live.lock", os.O_CREAT | os.O_RDWR)
    fcntl.flock(running, fcntl.LOCK_EX)
    into_bucket = merge([url_a, b], f"s3://data/{base}/ab")
    assert (into_bucket.records, into_bucket.shards, into_bucket.sources) == (12, 5, [url_a, str(b.resolve())])
    _same_but_sources(_objects(s3, f"{base}/ab"), _files(tmp_path / "ab"))
    assert verify(f"s3://data/{base}/ab").problems == []
    into_folder = merge([a, url_b], tmp_path / "here")
    downloaded = sum(shard.bytes for shard in read_manifest(b).shards)  # (a's linked, b's written here)
    assert (into_folder.records, into_folder.bytes_written, into_folder.output_bytes) == (
        12,
        downloaded,
        local.output_bytes,
    )
    _same_but_sources(_files(tmp_path / "here"), _files(tmp_path / "ab"))
    assert verify(tmp_path / "here").ok
    import s3fs

    # done already, or refused, before the output in the bucket is downloaded (a shard of it damaged,
    # which a download would refuse)
    first = read_manifest(b).shards[0].name
    damaged = bytearray((b / first).read_bytes())
    damaged[700] ^= 0xFF
    s3fs.S3FileSystem(**s3.options).pipe_file(f"data/{base}/b/{first}", bytes(damaged))
    assert merge([a, url_b], tmp_path / "here").already_complete
    with pytest.raises(OutputError, match="holds an output already"):
        merge([a, url_b], tmp_path / "ab")
    assert sorted(path.name for path in downloads.iterdir()) == ["0123456789abcdef-live", "0123456789abcdef-live.lock"]
    os.close(running)
    with pytest.raises(ConfigError, match="named twice"):
        merge([a, tmp_path / "a" / ".." / "a"], f"s3://data/{base}/aa")


def test_refusals_come_before_anything_is_written(s3, cache: Path, tmp_path: Path, warm: WarmStarter) -> None:
    a, b = _packed(tmp_path, "a", "webdataset", 4, 0), _packed(tmp_path, "b", "webdataset", 4, 50)
    base = tmp_path.name
    urls = [_upload(s3, a, f"{base}/a"), _upload(s3, b, f"{base}/b")]
    with pytest.raises(ConfigError, match="named twice"):
        merge([urls[0], urls[0].replace("s3://", "s3a://")], f"s3://data/{base}/ab")
    with pytest.raises(ConfigError, match="overlaps"):
        merge(urls, f"{urls[0]}/inner")
    with pytest.raises(ConfigError, match="over HTTP"):
        merge(urls, "https://example.org/out")
    with pytest.raises(OutputError, match="holds an output already"):
        merge(urls, _upload(s3, a, f"{base}/c"))
    with pytest.raises(OutputError, match="keys are in two of the outputs"):
        merge([urls[0], _upload(s3, a, f"{base}/a2")], f"s3://data/{base}/aa")
    assert not any(name.startswith("aa/") or name.startswith("ab/") for name in _objects(s3, base))
    # killed after its journal and a copy: another merge into the prefix is refused, this one finishes
    assert _killed_merge(warm, urls, f"s3://data/{base}/ab", 2, tmp_path / "killed.log") == -signal.SIGKILL
    with pytest.raises(OutputError, match="an interrupted merge of other sources"):
        merge([urls[1], urls[0]], f"s3://data/{base}/ab")
    assert merge(urls, f"s3://data/{base}/ab").resumed
    assert verify(f"s3://data/{base}/ab").problems == []


_DRIVER = """
import os, signal, sys, json, threading
from shardkit.storage.store import Store
at, log = sys.argv[1], sys.argv[2]
count, counting = [0], threading.Lock()  # (copies run on several threads: each request counted once)
def hooked(method):
    original = getattr(Store, method)
    def call(self, *args):
        result = original(self, *args)
        name = args[{"copy": 1, "copy_from": 2, "upload": 1}.get(method, 0)]
        with counting:
            count[0] += 1
            with open(log, "a") as steps:
                steps.write(f"{method} {name}\\n")
            if str(count[0]) == at:
                os.kill(os.getpid(), signal.SIGKILL)
        return result
    setattr(Store, method, call)
for method in ("write", "upload", "copy", "copy_from", "delete"):
    hooked(method)
from shardkit.changes.merge import merge
merge(json.loads(sys.argv[3]), sys.argv[4], prefix_keys=sys.argv[5] == "1")
"""


def _killed_merge(warm: WarmStarter, urls: list[str], out: str, at: int, log: Path, prefix_keys: bool = False) -> int:
    args = [str(at), str(log), json.dumps(urls), out, "1" if prefix_keys else "0"]
    run = warm.run(args, {**os.environ, "PYTHONPATH": str(REPO)}, REPO, code=_DRIVER)
    assert run.returncode in (0, -signal.SIGKILL), run.stderr
    return run.returncode


def test_a_merge_killed_after_any_bucket_request_finishes_as_an_uninterrupted_one(
    s3, cache: Path, tmp_path: Path, warm: WarmStarter
) -> None:
    a, b = _packed(tmp_path, "a", "webdataset", 7, 0), _packed(tmp_path, "b", "webdataset", 5, 100)
    base = tmp_path.name
    urls = [_upload(s3, a, f"{base}/a"), _upload(s3, b, f"{base}/b")]
    clean_log = tmp_path / "clean.log"
    assert _killed_merge(warm, urls, f"s3://data/{base}/clean", 0, clean_log) == 0
    expected = _objects(s3, f"{base}/clean")
    steps = clean_log.read_text().splitlines()
    assert steps[0] == "write .shardkit/change.json" and steps[-1] == "delete .shardkit/change.json"
    copied = [step for step in steps if step.startswith("copy_from ")]
    assert len(copied) == 10 and sum(step.endswith(".tar") for step in copied) == 5  # and their .idx files
    assert steps.index("write .shardkit/change.json", 1) < steps.index("copy manifest.json")

    for at in range(1, len(steps) + 1):
        out = f"s3://data/{base}/at{at}"
        assert _killed_merge(warm, urls, out, at, tmp_path / f"at{at}.log") == -signal.SIGKILL
        held = _objects(s3, f"{base}/at{at}")
        if ".shardkit/change.json" in held:  # a pack into the prefix is refused while it is there
            with pytest.raises(OutputError, match="a change of it is unfinished"):
                pack(PackConfig(str(a), out, resize=ResizeConfig(48), overwrite=True))
            if "manifest.json" in held:
                assert [p.kind for p in verify(out).problems] == ["interrupted"], steps[at - 1]
            else:  # no output yet: verify says what is under way, and how it finishes
                said = " ".join(problem.detail for problem in verify(out).problems)
                assert "a merge into it began and has not finished" in said and "--resume` finishes it" in said
                with pytest.raises(OutputError, match="a merge into it began and has not finished"):
                    remove(out, resume=True)  # (a change of it says the same)
                with pytest.raises(ManifestError, match=r"no manifest yet: a merge into it began .* --resume` fin"):
                    open_shards(out)  # (as verify says it)
        if at % 2:
            merge(urls, out)
        else:
            merge(urls, out, resume=True)
        assert _objects(s3, f"{base}/at{at}") == expected, steps[at - 1]  # (the same sources: the same bytes)
        assert verify(out).problems == []


def test_spellings_a_run_that_claimed_meanwhile_and_a_source_gone_mid_copy(
    s3, cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, warm: WarmStarter
) -> None:
    """Two spellings of one prefix are one source (a killed merge goes on under the other); another
    run's journal put up while this one works stops it before it puts anything up; a source object
    deleted while the merge runs is one line naming it; a finished merge of other sources, found
    committed, is finished and said."""
    import s3fs

    from shardkit.changes import bucket_merge

    a, b = _packed(tmp_path, "a", "webdataset", 4, 0), _packed(tmp_path, "b", "webdataset", 4, 50)
    base = tmp_path.name
    urls = [_upload(s3, a, f"{base}/a"), _upload(s3, b, f"{base}/b")]
    doubled = [url.replace("s3://data/", "s3a://data//") for url in urls]
    done = merge(doubled, f"s3://data/{base}/ab")
    assert done.sources == urls and verify(f"s3://data/{base}/ab").problems == []
    assert _killed_merge(warm, urls, f"s3://data/{base}/k", 5, tmp_path / "k.log") == -signal.SIGKILL
    assert merge(doubled, f"s3://data/{base}/k").resumed
    assert _objects(s3, f"{base}/k") == _objects(s3, f"{base}/ab")

    fs = s3fs.S3FileSystem(**s3.options)
    made = bucket_merge.write_merged

    def another_run_claims(*args: Any, **kwargs: Any) -> Any:
        journal = json.loads(fs.cat_file(f"data/{base}/race/.shardkit/change.json"))
        fs.pipe_file(f"data/{base}/race/.shardkit/change.json", json.dumps({**journal, "owner": "another"}).encode())
        return made(*args, **kwargs)

    monkeypatch.setattr(bucket_merge, "write_merged", another_run_claims)
    with pytest.raises(OutputError, match="another merge into it began meanwhile"):
        merge(urls, f"s3://data/{base}/race")
    assert sorted(_objects(s3, f"{base}/race")) == [".shardkit/change.json"]  # nothing else put up

    def source_taken_away(*args: Any, **kwargs: Any) -> Any:
        fs.rm_file(f"data/{base}/b/shard-000000.tar")
        return made(*args, **kwargs)

    monkeypatch.setattr(bucket_merge, "write_merged", source_taken_away)
    with pytest.raises(OutputError, match=f"^{urls[1]}/shard-000000.tar: gone while the merge copied it"):
        merge(urls, f"s3://data/{base}/gone")
    monkeypatch.undo()

    committed, other = f"s3://data/{base}/committed", [urls[0], _upload(s3, b, f"{base}/b2")]
    assert _killed_merge(warm, other, f"{committed}-clean", 0, tmp_path / "c.log") == 0
    at = (tmp_path / "c.log").read_text().splitlines().index("write .shardkit/change.json", 2)  # uploaded: true
    assert _killed_merge(warm, other, committed, at + 1, tmp_path / "c2.log") == -signal.SIGKILL
    with pytest.raises(OutputError, match=r"held an interrupted merge of other outputs .* finished now"):
        merge(urls, committed)
    assert verify(committed).problems == [] and len(open_shards(committed)) == 8
    assert _objects(s3, f"{base}/committed") == _objects(s3, f"{base}/committed-clean")
