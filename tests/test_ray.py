"""`pack --executor ray` on a real local Ray instance: same bytes as the local pool."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardkit.config import PackConfig, ResizeConfig
from shardkit.errors import OutputError
from shardkit.executors import map_ray
from shardkit.formats import available_formats
from shardkit.pack import ShardJob, pack, write_shard
from shardkit.plan import plan_shards

from .ray_helpers import restore_env, set_env

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
    from shardkit.config import EncodeConfig
    from shardkit.discover import discover

    spec = plan_shards(discover(sample_dataset).items[:3], suffix=".tar", shard_size=3)[0]
    job = ShardJob(spec, "/nonexistent/shared/out", "webdataset", ResizeConfig(64), EncodeConfig(), "plan")
    with pytest.raises(OutputError, match="storage that every node shares"):
        list(map_ray(write_shard, [job]))
