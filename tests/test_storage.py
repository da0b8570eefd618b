"""Reading shards from object storage: a real SeaweedFS S3 server and a real http.server on loopback,
real shards of every format, real processes sharing one cache. No mocks."""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from shardkit import open_shards
from shardkit.core.errors import ConfigError, ShardkitError, ShardReadError, StorageError
from shardkit.core.manifest import read_manifest
from shardkit.core.pack_options import pack_config
from shardkit.packing.pack import pack
from shardkit.storage.cache import ShardCache
from shardkit.storage.store import Store
from shardkit.storage.urls import is_remote, parse_storage_options
from tests.servers import free_ports, http_server, s3_server, serving, start_s3

pytestmark = pytest.mark.slow  # a real Ray instance or S3 server: `make test` runs these, `make test-fast` does not

FORMATS = ("webdataset", "lmdb", "hdf5")


def _samples(dataset) -> list[tuple[str, int | None, int, tuple[int, ...]]]:
    return [(s.key, s.label, int(np.asarray(s.image, dtype=np.int64).sum()), s.image.shape) for s in dataset]


@pytest.fixture(scope="module")
def packed(sample_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The sample dataset packed in every format, 10 records a shard."""
    root = tmp_path_factory.mktemp("packed")
    outputs = {}
    for name in FORMATS:
        outputs[name] = root / name
        pack(pack_config(sample_dataset, outputs[name], format=name, resize=48, shard_size=10, workers=1))
    return outputs


def _upload(s3, folder: Path, prefix: str) -> str:
    import s3fs

    fs = s3fs.S3FileSystem(**s3.options)
    for entry in sorted(folder.iterdir()):
        fs.put_file(str(entry), f"data/{prefix}/{entry.name}")
    return f"s3://data/{prefix}"


@pytest.fixture(scope="module")
def uploaded(s3, packed: dict[str, Path]) -> dict[str, str]:
    return {name: _upload(s3, folder, f"read/{name}") for name, folder in packed.items()}


def test_urls_are_told_from_paths() -> None:
    assert is_remote("s3://bucket/x") and is_remote("https://host/a/") and is_remote("gs://b")
    assert not is_remote("file:///tmp/x") and not is_remote("/tmp/s3://x") and not is_remote("relative/path")


def test_a_store_never_shows_its_credentials() -> None:
    """A Store formatted into a message or a log line (f"{store}", repr) names its URL, never the
    options that hold its key and secret."""
    store = Store("s3://data/out/", {"key": "AKIA-EXAMPLE", "secret": "s3cr3t-EXAMPLE", "client_kwargs": {}})
    for shown in (str(store), repr(store), f"{store!r}: cannot write"):
        assert "s3://data/out" in shown and "EXAMPLE" not in shown


def test_storage_options_parse_as_json_or_text_and_nest() -> None:
    options = parse_storage_options(["anon=true", "client_kwargs.region_name=eu-west-1", "block_size=1024", "key=k=v"])
    assert options == {"anon": True, "client_kwargs": {"region_name": "eu-west-1"}, "block_size": 1024, "key": "k=v"}
    with pytest.raises(ConfigError, match="key=value"):
        parse_storage_options(["anon"])


@pytest.mark.parametrize("fmt", FORMATS)
def test_s3_reads_the_same_samples_as_local(fmt: str, packed, uploaded, tmp_path: Path) -> None:
    local = open_shards(packed[fmt])
    remote = open_shards(uploaded[fmt], cache_dir=tmp_path / "cache")  # credentials from AWS_* variables
    assert len(remote) == len(local) and remote.classes == local.classes
    assert _samples(remote) == _samples(local)
    # random access and keys, through the same cached shards
    for index in (0, 17, len(local) - 1):
        assert remote[index].key == local[index].key
        assert np.array_equal(remote[index].image, local[index].image)
    key = local[23].key
    assert np.array_equal(remote.get(key).image, local.get(key).image)
    remote.close()
    # the cache holds each shard once, named by the manifest's sha256
    cached = sorted(p.name for p in (tmp_path / "cache" / "shards").iterdir())
    assert cached == sorted(s.sha256 + Path(s.name).suffix for s in local.manifest.shards)
    assert not any((tmp_path / "cache" / "tmp").iterdir())


def test_the_batch_loader_reads_from_s3(packed, uploaded, tmp_path: Path) -> None:
    pytest.importorskip("shardkit.core._crop")
    local = open_shards(packed["webdataset"])
    remote = open_shards(uploaded["webdataset"], cache_dir=tmp_path / "cache")
    batches = list(remote.loader(8, 32, crop="center", output="numpy", workers=2))
    expected = list(local.loader(8, 32, crop="center", output="numpy", workers=2))
    assert len(batches) == len(expected)
    for (images, labels), (want_images, want_labels) in zip(batches, expected, strict=True):
        assert np.array_equal(images, want_images) and np.array_equal(labels, want_labels)


def test_http_server_serves_shards(packed, tmp_path: Path) -> None:
    from shardkit.checks.verify import verify

    local = open_shards(packed["lmdb"])
    with http_server(packed["lmdb"].parent) as url:
        remote = open_shards(f"{url}/lmdb/manifest.json", cache_dir=tmp_path / "cache")
        assert _samples(remote) == _samples(local)
        assert remote.get(local[3].key).key == local[3].key
        report = verify(f"{url}/lmdb", deep=True)
        assert report.ok, report.problems
        assert report.records == len(local) and report.decoded == len(local)


def test_each_sample_once_per_rank_across_dataloader_workers(packed, uploaded, tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    local_keys = [s.key for s in open_shards(packed["webdataset"], decode="bytes")]
    seen = []
    for rank in range(2):
        dataset = open_shards(
            uploaded["webdataset"], decode="bytes", rank=rank, world_size=2, cache_dir=tmp_path / "cache"
        )
        loader = torch.utils.data.DataLoader(
            dataset.iterable(), batch_size=None, num_workers=2, collate_fn=lambda s: s.key
        )
        keys = list(loader)
        assert len(keys) == dataset.samples_per_rank() == len(local_keys) // 2
        seen.extend(keys)
    assert sorted(seen) == sorted(local_keys)  # each sample exactly once over both ranks


_SHARED_FETCH = textwrap.dedent(
    """
    import json, os, sys
    from shardkit.storage.cache import ShardCache
    from shardkit.storage.remote import Remote
    from shardkit.storage.store import Store
    url, cache_dir, name, size, sha = sys.argv[1:6]
    remote = Remote(Store(url), ShardCache.at(cache_dir, None))
    sys.stdin.readline()  # all start together
    fd = remote.open(name, int(size), sha)
    print(json.dumps(os.fstat(fd).st_ino))
    """
)


def test_processes_share_one_cache_and_download_a_shard_once(packed, uploaded, tmp_path: Path) -> None:
    shard = open_shards(packed["hdf5"]).manifest.shards[2]
    cache = tmp_path / "cache"
    args = [uploaded["hdf5"], str(cache), shard.name, str(shard.bytes), shard.sha256]
    children = [
        subprocess.Popen(
            [sys.executable, "-c", _SHARED_FETCH, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        for _ in range(4)
    ]
    for child in children:
        child.stdin.write("go\n")
        child.stdin.flush()
    inodes = [int(child.communicate(timeout=120)[0]) for child in children]
    assert all(child.returncode == 0 for child in children)
    # one download, renamed into place once: every process opened that same file
    assert len(set(inodes)) == 1
    assert inodes[0] == (cache / "shards" / f"{shard.sha256}.h5").stat().st_ino
    assert not any((cache / "tmp").iterdir())


def test_the_cache_stays_within_its_limit(packed, uploaded, tmp_path: Path) -> None:
    shards = open_shards(packed["webdataset"]).manifest.shards
    limit = shards[0].bytes * 2 + shards[1].bytes  # room for about two shards
    remote = open_shards(uploaded["webdataset"], cache_dir=tmp_path / "cache", cache_limit=limit)
    assert _samples(remote) == _samples(open_shards(packed["webdataset"]))
    cache = ShardCache.at(tmp_path / "cache", limit)
    assert 0 < cache.usage() <= limit
    with pytest.raises(ConfigError, match="cache limit"):
        open_shards(uploaded["webdataset"], cache_dir=tmp_path / "small", cache_limit=100)[0]


def test_a_damaged_object_is_refused_and_never_cached(s3, packed, tmp_path: Path) -> None:
    url = _upload(s3, packed["webdataset"], "damaged")
    shard = open_shards(packed["webdataset"]).manifest.shards[1]
    data = bytearray((packed["webdataset"] / shard.name).read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one byte flipped
    Store(url).write(shard.name, bytes(data))
    remote = open_shards(url, cache_dir=tmp_path / "cache")
    with pytest.raises(ShardReadError, match=f"{url}/{shard.name}: sha256 differs"):
        list(remote)
    remote.close()  # waits for the background downloads of the next shards
    assert not (tmp_path / "cache" / "shards" / f"{shard.sha256}.tar").exists()
    assert not any((tmp_path / "cache" / "tmp").iterdir())
    Store(url).write(shard.name, bytes(data) + bytes(10 << 20))  # a server sending more than it should
    with pytest.raises(ShardReadError, match=f"{url}/{shard.name}: more than the [0-9,]+ bytes the manifest says"):
        list(open_shards(url, cache_dir=tmp_path / "cache1"))
    assert not any((tmp_path / "cache1" / "shards").glob(f"{shard.sha256}*"))
    Store(url).delete(shard.name)
    with pytest.raises(ShardReadError, match=f"{url}/{shard.name}: listed in the manifest but missing"):
        list(open_shards(url, cache_dir=tmp_path / "cache2"))


def test_missing_folder_and_bad_credentials_give_one_line_errors(s3, uploaded, tmp_path: Path, monkeypatch) -> None:
    """Absence and refusal are final at once: a missing folder or bucket, a denied request (with a
    retry window of 15 s, each must be said in well under it)."""
    monkeypatch.setenv("SHARDKIT_RETRY_SECONDS", "15")
    started = time.monotonic()
    with pytest.raises(ShardkitError, match=re.escape("s3://data/nothing-here/manifest.json: no manifest")):
        open_shards("s3://data/nothing-here", cache_dir=tmp_path)
    with pytest.raises(ShardkitError, match=re.escape("s3://no-such-bucket/x/manifest.json: no manifest")):
        open_shards("s3://no-such-bucket/x", cache_dir=tmp_path)
    with pytest.raises(ShardkitError, match=r"s3://data/read/lmdb/manifest\.json: (access denied|.*failed)") as caught:
        open_shards(uploaded["lmdb"], storage_options={"key": "nobody", "secret": "wrong"}, cache_dir=tmp_path)
    assert "\n" not in str(caught.value)
    assert time.monotonic() - started < 10
    with pytest.raises(ConfigError, match="storage_options are for URLs"):
        open_shards(tmp_path, storage_options={"anon": True})


def test_no_credentials_anywhere_is_final_at_once(s3, uploaded, tmp_path: Path, monkeypatch) -> None:
    """No key in the environment, no profile, no instance metadata: said at once, with the fix,
    not retried for the whole retry window."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("SHARDKIT_RETRY_SECONDS", "15")
    started = time.monotonic()
    with pytest.raises(ShardkitError, match="no credentials") as caught:
        options = {"endpoint_url": s3.endpoint, "skip_instance_cache": True}  # not a cached client that has keys
        open_shards(uploaded["lmdb"], storage_options=options, cache_dir=tmp_path / "cache")
    assert time.monotonic() - started < 10 and "\n" not in str(caught.value)
    assert "AWS_ACCESS_KEY_ID" in str(caught.value)


def test_a_missing_filesystem_package_names_the_extra(tmp_path: Path) -> None:
    script = "import sys; sys.modules['gcsfs'] = None\nfrom shardkit import open_shards\nopen_shards('gs://b/x')"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode != 0
    assert "pip install 'shardkit[gcs]'" in result.stderr


@pytest.mark.slow
def test_the_s3_server_starts_again_on_new_ports_when_one_is_taken(tmp_path: Path) -> None:
    """CI once lost every S3 test to one port another process held when `weed` came to bind it.
    Here the first draw holds a port this test has bound: that start fails on it, the next draw's
    serves, and the failure is the only one taken for a lost race."""
    with contextlib.ExitStack() as stack:
        held = stack.enter_context(socket.socket())
        held.bind(("127.0.0.1", 0))
        held.listen()
        draws: list[list[int]] = []

        def choose(count: int) -> list[int]:
            ports = free_ports(count)
            if not draws:
                ports[5] = held.getsockname()[1]  # the volume server's gRPC port, as in CI
            draws.append(ports)
            return ports

        server = start_s3(tmp_path / "weed", choose=choose)
        stack.callback(server.kill)
        assert len(draws) == 2 and list(server.ports.values()) == draws[1]
        server.make_bucket("data")
        assert "address already in use" in (tmp_path / "weed" / "weed.log").read_text()

        draws.clear()

        def impossible(count: int) -> list[int]:
            draws.append([*free_ports(count - 1), 70000])
            return draws[-1]

        with pytest.raises(RuntimeError) as caught:  # any other failure is raised, not started again
            start_s3(tmp_path / "impossible", choose=impossible)
        assert len(draws) == 1 and "address already in use" not in str(caught.value)


def _server_stops_mid_epoch(
    tmp_path: Path, packed: Path, restart_after: float | None
) -> tuple[list, BaseException | None]:
    """Reads an S3 copy of `packed` with a 1-sample delay per record, kills the server after the
    first shard, optionally starts it again `restart_after` seconds later; (samples, error)."""
    with s3_server(tmp_path / "weed") as server:
        server.make_bucket("data")
        url = _upload(server, packed, "stop")
        dataset = open_shards(url, decode="bytes", storage_options=server.options, cache_dir=tmp_path / "cache")
        samples, error = [], None
        restarted = None
        try:
            for sample in dataset:
                samples.append(sample.key)
                if len(samples) == 10:  # the first shard is read: stop the server mid-epoch
                    server.kill()
                    if restart_after is not None:
                        restarted = threading.Timer(restart_after, server.start)
                        restarted.start()
        except ShardkitError as caught:
            error = caught
        dataset.close()  # waits for the background downloads (within the retry window)
        if restarted is not None:
            restarted.join()
    return samples, error


@pytest.mark.slow
def test_a_server_gone_for_good_gives_a_clean_error(packed, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("SHARDKIT_RETRY_SECONDS", "2")
    started = time.monotonic()
    samples, error = _server_stops_mid_epoch(tmp_path, packed["webdataset"], None)
    assert time.monotonic() - started < 60  # never a hang
    assert isinstance(error, (StorageError, ShardReadError)), error
    assert "s3://data/stop/shard-" in str(error) and "gave up" in str(error) and "\n" not in str(error)
    assert 10 <= len(samples) < 60
    # nothing half-downloaded was kept: every cached shard is whole and matches the manifest
    cache = tmp_path / "cache"
    by_sha = {s.sha256 for s in open_shards(packed["webdataset"]).manifest.shards}
    from shardkit.core.manifest import sha256_file

    for entry in (cache / "shards").iterdir():
        assert entry.stem in by_sha and sha256_file(entry) == entry.stem
    assert not any((cache / "tmp").iterdir())


@pytest.mark.slow
def test_a_server_back_within_the_retry_window_lets_the_epoch_finish(packed, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("SHARDKIT_RETRY_SECONDS", "60")
    samples, error = _server_stops_mid_epoch(tmp_path, packed["webdataset"], restart_after=1.0)
    assert error is None
    assert samples == [s.key for s in open_shards(packed["webdataset"], decode="bytes")]
    assert os.environ.get("SHARDKIT_RETRY_SECONDS") == "60"


def _close_inherited_connections() -> None:
    """What a garbage-collected client does in a forked child: close every connection it holds."""
    import asyncio.selector_events
    import gc

    for thing in gc.get_objects():
        if isinstance(thing, asyncio.selector_events._SelectorTransport):
            thing.close()


def test_a_forked_child_closing_connections_leaves_the_parents_alone(uploaded, tmp_path: Path) -> None:
    import multiprocessing

    dataset = open_shards(uploaded["lmdb"], cache_dir=tmp_path / "cache")
    store = dataset.remote.store
    store.read("manifest.json", 1 << 20)  # a pooled connection in the parent
    child = multiprocessing.get_context("fork").Process(target=_close_inherited_connections)
    child.start()
    child.join(30)
    started = time.monotonic()
    store.read("manifest.json", 1 << 20)
    store.listing()
    assert time.monotonic() - started < 5  # without the child's own epoll set: the read timeout, 60 s


def _hold_then_release(root: str, held: threading.Event, release: threading.Event) -> None:
    cache = ShardCache.at(root, None)
    cache.ready()
    with cache._lock("ab"):
        held.set()
        release.wait(10)


def _take(root: str) -> None:
    with ShardCache.at(root, None)._lock("ab"):
        pass


def test_a_child_forked_while_a_cache_lock_is_held_does_not_wait_on_itself(tmp_path: Path) -> None:
    import multiprocessing

    held, release = threading.Event(), threading.Event()
    holder = threading.Thread(target=_hold_then_release, args=(str(tmp_path), held, release))
    holder.start()
    assert held.wait(10)  # the lock is held by this process's thread when the child forks
    child = multiprocessing.get_context("fork").Process(target=_take, args=(str(tmp_path),))
    child.start()
    time.sleep(0.3)  # the child waits for the lock meanwhile (or, with flock, has it already)
    release.set()
    holder.join()
    child.join(15)
    alive = child.is_alive()
    if alive:
        child.kill()
    assert not alive and child.exitcode == 0  # with flock the child inherited the lock and hung


def _resealed(folder: Path, renames: dict[str, str]) -> None:
    """Renames shards of an output and reseals its manifest (a stranger's output with odd names)."""
    from dataclasses import replace

    from shardkit.core.manifest import write_json_atomic

    manifest = read_manifest(folder)
    shards = []
    for shard in manifest.shards:
        new = renames.get(shard.name, shard.name)
        (folder / shard.name).rename(folder / new)
        shards.append(replace(shard, name=new))
    (folder / "index.parquet").unlink(missing_ok=True)  # as a stranger's output without indexes
    for companion in manifest.companions:
        (folder / companion.name).unlink()
    stranger = replace(manifest, shards=shards, index=None, companions=[])
    write_json_atomic(folder / "manifest.json", stranger.sealed().to_json())


def test_odd_shard_names_and_oversized_objects_over_http(packed, tmp_path: Path) -> None:
    import shutil

    from shardkit.checks.verify import verify

    folder = tmp_path / "odd"
    shutil.copytree(packed["webdataset"], folder)
    first, second = read_manifest(folder).shards[:2]
    _resealed(folder, {first.name: "a b?#1.tar", second.name: "x." + "y" * 250})
    expected = _samples(open_shards(folder))
    with http_server(tmp_path) as url:
        assert _samples(open_shards(f"{url}/odd", cache_dir=tmp_path / "cache")) == expected
        # a server sending far more than the manifest says: refused at the manifest's size, through
        # the direct path and through fsspec's own (any storage option takes that one)
        big = folder / "a b?#1.tar"
        big.write_bytes(big.read_bytes() + bytes(8 << 20))
        for options in (None, {"simple_links": True}):
            dataset = open_shards(f"{url}/odd", storage_options=options, cache_dir=tmp_path / "c2", cache_limit="4MB")
            with pytest.raises(ShardReadError, match=r"more than the [0-9,]+ bytes the manifest says"):
                list(dataset)
            dataset.close()  # waits for the background downloads
            assert not any((tmp_path / "c2" / "tmp").iterdir())
        report = verify(f"{url}/odd")
        assert [(p.kind, p.shard) for p in report.problems] == [("size", "a b?#1.tar")]
        (folder / "manifest.json").write_bytes(b" " * (17 << 20))  # over the manifest limit, never held whole
        with pytest.raises(ShardkitError, match="over the limit"):
            open_shards(f"{url}/odd", cache_dir=tmp_path / "c3")


@contextlib.contextmanager
def objects_server(objects: dict[str, bytes]) -> Iterator[str]:
    """A loopback HTTP server of our own serving `objects` (name -> bytes) under /out/, with an
    index page linking them, as a static site or a bucket's HTTP endpoint does: names need not be
    names a file can have."""
    from http.server import BaseHTTPRequestHandler
    from urllib.parse import quote, unquote

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = unquote(self.path)
            if path.rstrip("/") == "/out":
                links = "".join(f'<a href="{quote(name)}">{name}</a>' for name in objects)
                body = f"<html><body>{links}</body></html>".encode()
            elif path.startswith("/out/") and path[5:] in objects:
                body = objects[path[5:]]
            else:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    with serving(Handler) as url:
        yield f"{url}/out"


def test_a_shard_named_longer_than_a_file_name_can_be(packed, tmp_path: Path) -> None:
    """File names end at 255 bytes, URLs do not: verify and the reader download such a shard under
    a name of their own and check it as any other (it was an internal error)."""
    from dataclasses import replace

    from shardkit.checks.verify import verify

    folder = packed["webdataset"]
    manifest = read_manifest(folder)
    long = "z" * 300 + ".tar"
    objects = {"errors.jsonl": (folder / "errors.jsonl").read_bytes()}
    renamed = []
    for shard in manifest.shards:
        name = long if shard is manifest.shards[0] else shard.name
        objects[name] = (folder / shard.name).read_bytes()
        renamed.append(replace(shard, name=name))
    sealed = replace(manifest, shards=renamed, index=None, companions=[]).sealed()
    objects["manifest.json"] = json.dumps(sealed.to_json()).encode()
    with objects_server(objects) as url:
        report = verify(url)
        assert report.ok, report.problems
        dataset = open_shards(url, cache_dir=tmp_path / "cache")
        assert _samples(dataset) == _samples(open_shards(folder))


def test_random_access_keeps_a_few_remote_shards_open(packed, uploaded, tmp_path: Path) -> None:
    from shardkit.readers.shards import OPEN_REMOTE_SHARDS

    dataset = open_shards(uploaded["webdataset"], cache_dir=tmp_path / "cache")
    before = len(os.listdir("/proc/self/fd"))
    for index in range(0, len(dataset), 3):
        dataset[index]
    assert len(os.listdir("/proc/self/fd")) - before <= 2 * OPEN_REMOTE_SHARDS + 4


SHARED_CACHE_READER = """
import hashlib, json, sys
from shardkit import open_shards
url, cache, epochs, seed = sys.argv[1], sys.argv[2], int(sys.argv[4]), int(sys.argv[5])
expected = json.load(open(sys.argv[3]))
wrong = 0
for epoch in range(epochs):
    dataset = open_shards(url, decode="bytes", shuffle=True, seed=seed, shuffle_buffer=8, cache_dir=cache,
                          cache_limit="110KB")  # about two of its ~51 KB shards
    dataset.set_epoch(epoch)
    seen = {}
    for sample in dataset:
        seen[sample.key] = hashlib.sha256(sample.image).hexdigest()
    dataset.close()
    wrong += seen != expected
print(json.dumps({"wrong_epochs": wrong}))
"""


@pytest.mark.slow
def test_processes_sharing_one_small_cache_read_every_sample_right(packed, tmp_path: Path) -> None:
    """Four readers (each with its prefetch threads) sharing one cache far smaller than the data,
    so shards are evicted and fetched again all the time: every epoch of every reader has every
    sample with its exact bytes (POSIX record locks made this fail with "Resource deadlock
    avoided": they belong to the process, not the thread)."""
    import hashlib

    folder = packed["webdataset"]
    expected = {s.key: hashlib.sha256(s.image).hexdigest() for s in open_shards(folder, decode="bytes")}
    (tmp_path / "expected.json").write_text(json.dumps(expected))
    with http_server(folder.parent) as url:
        command = [sys.executable, "-c", SHARED_CACHE_READER, f"{url}/{folder.name}", str(tmp_path / "cache"),
                   str(tmp_path / "expected.json"), "6"]  # fmt: skip
        readers = [
            subprocess.Popen([*command, str(seed)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for seed in range(4)
        ]
        results = [reader.communicate(timeout=240) for reader in readers]
    for reader, (out, err) in zip(readers, results, strict=True):
        assert reader.returncode == 0, err[-3000:]
        assert json.loads(out.strip().splitlines()[-1]) == {"wrong_epochs": 0}
