"""A real two-node Ray cluster on this machine (two raylets, one GCS, all on 127.0.0.1): pack across
both nodes, survive a killed worker and a lost node, and end with a complete, verified output."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardkit.checks.verify import verify
from shardkit.core.config import PackConfig, ResizeConfig
from shardkit.core.manifest import read_manifest
from shardkit.packing.pack import pack
from shardkit.synthetic import write_image

from .ray_helpers import LOOPBACK_ENV, restore_env, set_env, task_pids

pytest.importorskip("ray")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def big_images(tmp_path_factory) -> Path:
    """Images large enough that each shard task runs for a while (something to kill mid-run)."""
    root = tmp_path_factory.mktemp("big")
    for i in range(48):
        write_image(root / f"c{i % 2}" / f"{i:03d}.jpg", 1600, 1200, seed=i)
    return root


@pytest.fixture(scope="module")
def reference(big_images: Path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("reference") / "out"
    pack(PackConfig(str(big_images), str(out), resize=ResizeConfig(128), shard_size=4, workers=2))
    return out


@pytest.fixture
def cluster():
    from ray.cluster_utils import Cluster

    saved = set_env()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"head_node": 1}})
    second = cluster.add_node(num_cpus=1, resources={"second_node": 1})
    cluster.wait_for_nodes()
    try:
        yield cluster, second
    finally:
        cluster.shutdown()
        restore_env(saved)


def start_pack(source: Path, out: Path, address: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "shardkit", "pack", str(source), str(out), "--resize", "128", "--shard-size", "4",
               "--executor", "ray", "--ray-address", address]  # fmt: skip
    env = {**os.environ, **LOOPBACK_ENV}
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def wait_for_task(process: subprocess.Popen, timeout: float = 90) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        pids = task_pids()
        if pids:
            return pids
        time.sleep(0.005)
    return []


def assert_complete(out: Path, source: Path, reference: Path) -> None:
    report = verify(out, deep=True, source=source)
    assert report.ok, report.problems
    assert {s.name: s.sha256 for s in read_manifest(out).shards} == {
        s.name: s.sha256 for s in read_manifest(reference).shards
    }
    assert not (out / ".shardkit").exists()


def test_two_nodes_survive_a_killed_worker_and_a_lost_node(cluster, big_images, reference, tmp_path) -> None:
    cluster, second = cluster
    # 1. A worker process is SIGKILLed in the middle of a shard: Ray retries the task.
    run = start_pack(big_images, tmp_path / "killed-worker", cluster.address)
    victims = wait_for_task(run)
    assert victims, "no shard task was seen running"
    os.kill(victims[0], signal.SIGKILL)
    stdout, stderr = run.communicate(timeout=300)
    assert run.returncode == 0, stderr
    assert "48 of 48 inputs" in stdout and "2 (Ray)" in stdout  # shards were written on both nodes
    assert_complete(tmp_path / "killed-worker", big_images, reference)

    # 2. The second node dies mid-run: its tasks are retried on the head node.
    run = start_pack(big_images, tmp_path / "lost-node", cluster.address)
    assert wait_for_task(run)
    cluster.remove_node(second, allow_graceful=False)
    stdout, stderr = run.communicate(timeout=300)
    assert run.returncode == 0, stderr
    assert_complete(tmp_path / "lost-node", big_images, reference)
