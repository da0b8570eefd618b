"""`pack SRC s3://... --executor ray` on a real Ray cluster of several nodes on this machine and a
real SeaweedFS S3 server: no folder shared by the nodes is needed (the driver's staging folder is
made invisible to the tasks), a node lost mid-run changes no byte, and the bucket ends holding the
bytes of a local pack."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest

from shardkit import append
from shardkit.core.config import PackConfig, ResizeConfig
from shardkit.core.manifest import read_manifest
from shardkit.packing.pack import pack
from shardkit.synthetic import write_image

from .helpers import bucket_objects, folder_files
from .ray_helpers import LOOPBACK_ENV, restore_env, set_env, task_pids
from .servers import serving

pytest.importorskip("ray")
pytestmark = pytest.mark.slow

FLAGS = ("--resize", "96", "--shard-size", "3")


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    """Images large enough that a shard task runs for a while (a task to catch on a node)."""
    root = tmp_path_factory.mktemp("images")
    for i in range(24):
        write_image(root / f"c{i % 2}" / f"{i:03d}.jpg", 1200, 900, seed=i)
    (root / "c0" / "broken.jpg").write_bytes(b"\xff\xd8 not a jpeg")  # errors.jsonl has a row
    return root


@pytest.fixture(scope="module")
def reference(images: Path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("reference") / "out"
    pack(PackConfig(str(images), str(out), resize=ResizeConfig(96), shard_size=3, workers=2))
    return out


@pytest.fixture(scope="module")
def cluster(s3):
    """A head and a second node, one CPU each, started after the S3 server: their workers see its
    AWS_* variables, as a cluster's nodes have their credentials."""
    from ray.cluster_utils import Cluster

    saved = set_env()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    try:
        yield cluster
    finally:
        cluster.shutdown()
        restore_env(saved)


def _private_mount() -> list[str]:
    """A command prefix that runs a process in a mount namespace of its own (where it may mount a
    folder no other process sees), or a skip where this machine allows none."""
    prefix = ["unshare", "--mount"] if os.geteuid() == 0 else ["unshare", "--user", "--map-root-user", "--mount"]
    try:
        probe = subprocess.run([*prefix, "true"], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as error:
        pytest.skip(f"no private mount namespace here: {error}")
    if probe.returncode != 0:
        pytest.skip(f"no private mount namespace here: {probe.stderr.decode().strip()}")
    return prefix


def test_a_ray_pack_to_a_bucket_needs_no_folder_the_nodes_share(cluster, s3, images, reference, tmp_path) -> None:
    # The driver runs where a fresh tmpfs covers `hidden`: its staging folder exists for it alone.
    # A task that read the staging folder would find nothing; one that wrote there would leave
    # files in the `hidden` every other process sees, which must stay empty.
    hidden = tmp_path / "driver-only"
    hidden.mkdir()
    driver = [sys.executable, "-m", "shardkit", "pack", str(images), "s3://data/ray-bucket", *FLAGS,
              "--executor", "ray", "--ray-address", cluster.address, "--staging", str(hidden / "staging")]  # fmt: skip
    command = [*_private_mount(), "sh", "-c", 'mount -t tmpfs tmpfs "$0" && exec "$@"', str(hidden), *driver]
    run = subprocess.run(command, capture_output=True, text=True, env={**os.environ, **LOOPBACK_ENV}, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "24 of 25 inputs" in run.stdout and "2 (Ray)" in run.stdout  # written on both nodes
    assert list(hidden.iterdir()) == []  # no task touched the staging folder's path
    # shards, .idx files, index.parquet, errors.jsonl, shardindex.json and manifest, byte for byte
    assert bucket_objects(s3, "ray-bucket") == folder_files(reference)


def test_a_node_lost_mid_pack_to_a_bucket_changes_no_byte(cluster, s3, images, reference, tmp_path) -> None:
    victim = cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    raylet = victim.all_processes["raylet"][0].process.pid
    caught: list[int] = []

    def kill_the_node(done: int, total: int | None, errors: int) -> None:
        if done == 0 or caught:
            return
        # A shard is back. Freeze a task running on the victim mid-shard, so that only a retry
        # elsewhere can finish its shard, then take the node away. None may be running there now
        # (the shard back may have been the victim's, and no more are sent while this blocks the
        # driver): look for a while, then let the driver send more, and look again at the next.
        deadline = time.monotonic() + 3
        while not caught and time.monotonic() < deadline:
            caught.extend(pid for pid in task_pids() if _parent(pid) == raylet)
            time.sleep(0.002)
        if not caught:
            return
        for pid in caught:
            os.kill(pid, signal.SIGSTOP)
        cluster.remove_node(victim, allow_graceful=False)
        # A lost machine takes its processes with it. A task process left frozen would keep its
        # connection to the driver open, and Ray then waits out its gRPC keepalive (minutes) before
        # it retries the task: that is a partitioned node, not a lost one.
        for pid in caught:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    config = PackConfig(
        str(images), "s3://data/ray-lost", resize=ResizeConfig(96), shard_size=3, executor="ray",
        ray_address=cluster.address, staging=str(tmp_path / "staging"),
    )  # fmt: skip
    result = pack(config, progress=kill_the_node)
    assert caught, "no shard task was seen running on the node to be lost"
    assert (result.records, result.errors, result.reused_shards) == (24, 1, 0)
    assert bucket_objects(s3, "ray-lost") == folder_files(reference)
    assert not (tmp_path / "staging").exists()


def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def _without_source(manifest: bytes) -> dict:
    """A manifest less what names the source: its path, and the plan (which hashes files' mtimes)."""
    data = json.loads(manifest)
    del data["checksum"], data["settings"]["source"]["path"], data["settings"]["plan"]
    return data


def _same_output(bucket: dict[str, bytes], folder: dict[str, bytes]) -> None:
    assert _without_source(bucket.pop("manifest.json")) == _without_source(folder.pop("manifest.json"))
    assert bucket == folder


def test_from_a_bucket_to_a_bucket_on_ray_is_a_local_pack(cluster, s3, images, reference, tmp_path) -> None:
    """Source and output in object storage: every task reads its own objects and uploads its own
    shard, and the bucket ends holding a local pack's bytes."""
    import s3fs

    fs = s3fs.S3FileSystem(**s3.options)
    for path in sorted(images.rglob("*")):
        if path.is_file():
            fs.put_file(str(path), f"data/ray-src/{path.relative_to(images).as_posix()}")
    config = PackConfig(
        "s3://data/ray-src", "s3://data/ray-from-bucket", resize=ResizeConfig(96), shard_size=3, executor="ray",
        ray_address=cluster.address, staging=str(tmp_path / "staging"),
    )  # fmt: skip
    result = pack(config)
    assert (result.records, result.errors, result.nodes) == (24, 1, 2)
    _same_output(bucket_objects(s3, "ray-from-bucket"), folder_files(reference))


def test_a_url_table_on_ray_to_a_bucket_is_a_local_pack(cluster, s3, tmp_path) -> None:
    """A table of URLs served over loopback HTTP: the tasks on both nodes download their rows, and
    the bucket holds what a local pack of the same table writes."""
    from .test_web_pack import _jpeg

    class Images(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            name = self.path.rsplit("/", 1)[-1].split(".")[0]
            body = _jpeg(int(name)) if self.path.startswith("/img/") else b"gone"
            self.send_response(200 if self.path.startswith("/img/") else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    with serving(Images) as base:
        table = tmp_path / "urls.csv"
        lines = [f"{base}/{'img' if i != 5 else 'gone'}/{i}.jpg,row {i}" for i in range(20)]
        table.write_text("url,caption\n" + "\n".join(lines) + "\n")
        local = tmp_path / "local"
        pack(PackConfig(str(table), str(local), resize=ResizeConfig(32), shard_size=4))
        config = PackConfig(
            str(table), "s3://data/ray-urls", resize=ResizeConfig(32), shard_size=4, executor="ray",
            ray_address=cluster.address, staging=str(tmp_path / "staging"),
        )  # fmt: skip
        result = pack(config)
    assert (result.records, result.errors, result.nodes) == (19, 1, 2)
    _same_output(bucket_objects(s3, "ray-urls"), folder_files(local))


def test_a_ray_append_to_a_bucket_needs_no_folder_the_nodes_share(cluster, s3, images, reference, tmp_path) -> None:
    """`pack --append` into an output in a bucket on Ray: the driver's mirror of the output and its
    staging folder exist for it alone (a tmpfs in its own mount namespace), so each task must
    upload its new shard to the bucket itself; the bucket ends holding what the same append leaves
    in a local copy of the output, byte for byte, and nothing else."""
    import s3fs

    fs = s3fs.S3FileSystem(**s3.options)
    for path in reference.iterdir():
        fs.put_file(str(path), f"data/ray-append/{path.name}")
    added = tmp_path / "added"
    for i in range(7):
        write_image(added / f"c{i % 2}" / f"new-{i:03d}.jpg", 1100, 800, seed=100 + i)
    local = tmp_path / "local"
    shutil.copytree(reference, local)
    assert append(str(added), str(local), workers=2).records == 7

    hidden = tmp_path / "driver-only"
    hidden.mkdir()
    driver = [sys.executable, "-m", "shardkit", "pack", str(added), "s3://data/ray-append", "--append",
              "--executor", "ray", "--ray-address", cluster.address, "--staging", str(hidden / "staging")]  # fmt: skip
    command = [*_private_mount(), "sh", "-c", 'mount -t tmpfs tmpfs "$0" && exec "$@"', str(hidden), *driver]
    env = {**os.environ, **LOOPBACK_ENV, "SHARDKIT_CACHE": str(hidden / "cache")}
    run = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr
    assert list(hidden.iterdir()) == []  # no task touched the mirror's or the staging folder's path
    objects = bucket_objects(s3, "ray-append")  # (and nothing of the append's own pack is left)
    assert objects == folder_files(local)
    assert len([name for name in objects if name.endswith(".tar")]) == len(read_manifest(local).shards) == 12
