"""`pack --executor ray` on a real local Ray instance: same bytes as the local pool."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardkit.core.config import PackConfig, ResizeConfig
from shardkit.core.errors import OutputError
from shardkit.formats import available_formats
from shardkit.packing.pack import pack
from shardkit.packing.plan import plan_shards
from shardkit.packing.worker import ShardJob, write_shard
from shardkit.runtime.cluster import map_ray

from .ray_helpers import restore_env, set_env

pytestmark = pytest.mark.slow  # a real Ray instance or S3 server: `make test` runs these, `make test-fast` does not

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def local_ray():
    saved = set_env()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()
    restore_env(saved)


@pytest.mark.parametrize("name", available_formats())
def test_ray_output_is_byte_identical_to_the_local_pool(local_ray, sample_dataset: Path, tmp_path: Path, name) -> None:
    def run(executor: str) -> Path:
        out = tmp_path / executor
        config = PackConfig(
            str(sample_dataset),
            str(out),
            format=name,
            resize=ResizeConfig(64),
            shard_size=9,
            workers=2,
            executor=executor,
        )
        result = pack(config)
        assert (result.records, result.errors) == (60, 1)
        return out

    local, distributed = run("local"), run("ray")
    for name_ in ("manifest.json", "errors.jsonl"):
        assert (local / name_).read_bytes() == (distributed / name_).read_bytes()
    shards = sorted(p.name for p in local.iterdir() if p.name.startswith("shard-"))
    assert shards == sorted(p.name for p in distributed.iterdir() if p.name.startswith("shard-"))
    for shard in shards:
        assert (local / shard).read_bytes() == (distributed / shard).read_bytes()


def test_a_worker_that_cannot_see_the_output_fails_fast_with_the_reason(local_ray, sample_dataset: Path) -> None:
    from shardkit.core.config import EncodeConfig
    from tests.helpers import discover

    spec = next(plan_shards(discover(sample_dataset).items[:3], suffix=".tar", shard_size=3))
    job = ShardJob(spec, "/nonexistent/shared/out", "webdataset", ResizeConfig(64), EncodeConfig(), "plan")
    with pytest.raises(OutputError, match="storage that every node shares"):
        list(map_ray(write_shard, [job]))


def test_an_unreachable_cluster_is_refused_before_overwrite_deletes_anything(python_command, sample_dataset, tmp_path):
    import subprocess

    out = tmp_path / "out"
    pack(PackConfig(str(sample_dataset), str(out), resize=ResizeConfig(32)))
    before = sorted(p.name for p in out.iterdir())
    run = subprocess.run(
        [*python_command, "pack", str(sample_dataset), str(out), "--resize", "32", "--overwrite",
         "--executor", "ray", "--ray-address", "127.0.0.1:1"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 1 and "cannot connect to the Ray cluster at 127.0.0.1:1" in run.stderr
    assert sorted(p.name for p in out.iterdir()) == before


def test_sigterm_stops_a_ray_pack_like_a_local_one(python_command, tmp_path) -> None:
    """Ray installs its own SIGTERM handler (an abrupt exit 15): shardkit's must stay in place."""
    import os
    import signal
    import subprocess
    import time

    from shardkit.synthetic import write_image

    source = tmp_path / "src"
    for i in range(60):
        write_image(source / f"{i:02d}.jpg", 900, 700, seed=i)
    out = tmp_path / "out"
    env = {**os.environ, **__import__("tests.ray_helpers", fromlist=["LOOPBACK_ENV"]).LOOPBACK_ENV}
    process = subprocess.Popen(
        [*python_command, "pack", str(source), str(out), "--resize", "none", "--shard-size", "2", "--executor", "ray"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (out.exists() and list(out.glob("shard-*.tar"))):
        time.sleep(0.05)
    os.kill(process.pid, signal.SIGTERM)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 143, stderr[-2000:]
    assert "stopped by SIGTERM" in stderr and "--resume" in stderr and "Traceback" not in stderr


def test_ray_data_reads_our_tars(local_ray, sample_dataset: Path, tmp_path: Path) -> None:
    """Ray Data's own webdataset reader, on the tars alone (not the index files beside them)."""
    from shardkit.core.manifest import read_manifest
    from shardkit.readers.dataset import open_shards

    out = tmp_path / "out"
    pack(PackConfig(str(sample_dataset), str(out), format="webdataset", resize=ResizeConfig(48), shard_size=20))
    tars = [str(out / shard.name) for shard in read_manifest(out).shards]
    rows = ray.data.read_webdataset(tars).take_all()
    assert sorted(row["__key__"] for row in rows) == sorted(s.key for s in open_shards(out, decode="bytes"))


def test_an_append_through_ray_writes_what_the_local_pool_writes(
    local_ray, sample_dataset: Path, tmp_path: Path
) -> None:
    from shardkit import append
    from shardkit.synthetic import write_image

    week_two = tmp_path / "week2"
    for number in range(12):
        write_image(week_two / "n00001000" / f"new_{number}.jpg", 90 + number, 70, seed=200 + number)
    outputs = {}
    for executor in ("local", "ray"):
        out = tmp_path / executor
        pack(PackConfig(str(sample_dataset), str(out), resize=ResizeConfig(64), shard_size=9))
        result = append(week_two, out, key_prefix="w2/", executor=executor, workers=2)
        assert (result.records, result.shards) == (12, 2)
        outputs[executor] = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    assert outputs["ray"] == outputs["local"]  # every shard, the index, errors.jsonl and the manifest
