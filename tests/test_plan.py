"""The plan: shards cut as the walk goes, the seeded shuffle, and the fingerprint."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np

from shardkit.packing.plan import PlanDigest, fingerprint, plan_shards, settings_hash
from shardkit.packing.sources import Item
from shardkit.runtime.pools import map_local, map_threads


def counted_items(count: int, drawn: list[int], root: str = "/data/") -> Iterator[Item]:
    for i in range(count):
        drawn[0] += 1
        yield Item(f"{root}c{i % 3}/{i:04}.jpg", f"c{i % 3}/{i:04}.jpg", f"c{i % 3}/{i:04}", i % 3)


def test_shards_are_cut_as_the_walk_goes() -> None:
    drawn = [0]
    specs = plan_shards(counted_items(10, drawn), suffix=".tar", shard_size=3)
    first = next(specs)
    assert [item.relpath for item in first.items] == ["c0/0000.jpg", "c1/0001.jpg", "c2/0002.jpg"]
    assert drawn == [4]  # the walk went one item past the cut, no further
    assert [len(spec.items) for spec in specs] == [3, 3, 1] and drawn == [10]


def test_the_shuffle_is_the_seeded_permutation_of_the_whole_list() -> None:
    """Kept compactly (one block of text), the order is exactly permutation(len) of the list, and
    every field of every item comes back as it was, list-file paths that are not root + relpath too."""
    items = list(counted_items(50, [0]))
    items[7] = Item("/elsewhere/x.jpg", "c1/0007.jpg", "c1/0007", None)
    items[8] = Item("/data/é/ü.jpg", "é/ü.jpg", "%C3%A9/%C3%BC", 0)
    for seed in (0, 1, 12345):
        shuffled = [item for spec in plan_shards(iter(items), suffix=".h5", shard_size=7, shuffle=True, seed=seed)
                    for item in spec.items]  # fmt: skip
        assert shuffled == [items[i] for i in np.random.default_rng(seed).permutation(len(items))]


def test_the_fingerprint_of_a_streamed_plan_and_each_shard_hash(tmp_path: Path) -> None:
    for i in range(6):
        (tmp_path / f"{i}.jpg").write_bytes(b"x" * i)
    items = [Item(str(tmp_path / f"{i}.jpg"), f"{i}.jpg", str(i), None) for i in range(6)]
    settings = {"format": "webdataset", "shard_size": 2}
    specs = list(plan_shards(items, suffix=".tar", shard_size=2))
    digest = PlanDigest(settings)
    own = [digest.add(spec) for spec in specs]
    assert digest.hexdigest() == fingerprint(settings, specs) and len(set(own)) == 3
    assert digest.settings == settings_hash(settings)
    (tmp_path / "3.jpg").write_bytes(b"changed")  # in shard 1 only
    again = PlanDigest(settings)
    assert [again.add(spec) == hash_ for spec, hash_ in zip(specs, own, strict=True)] == [True, False, True]
    assert again.hexdigest() != digest.hexdigest()


def counted_jobs(count: int, drawn: list[int]) -> Iterator[int]:
    for job in range(count):
        drawn[0] += 1
        yield job


def square(job: int) -> int:
    return job * job


def test_executors_draw_jobs_from_a_generator_only_as_workers_free_up() -> None:
    for mapper in (map_local, map_threads):
        drawn = [0]
        results = mapper(square, counted_jobs(40, drawn), 2)
        index, result = next(results)
        assert result == index * index and drawn[0] <= 5, mapper.__name__  # 2 a worker in flight, + one
        assert sorted(rest for _, rest in [(index, result), *results]) == [job * job for job in range(40)]
