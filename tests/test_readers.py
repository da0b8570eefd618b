from __future__ import annotations

import pickle
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardkit.core.errors import ConfigError, ShardFormatError
from shardkit.core.manifest import read_manifest
from shardkit.formats import available_formats, get_format
from shardkit.readers.dataset import ShardReadError, open_shards


@pytest.fixture(scope="module", params=available_formats())
def packed(request, packed_sample) -> Path:
    return packed_sample(request.param, 64, 7)  # (shared with other modules: read only)


def test_round_trip_through_open_shards(packed: Path) -> None:
    ds = open_shards(packed)
    manifest = read_manifest(packed)
    assert len(ds) == 60 and ds.classes == manifest.classes and ds.manifest == manifest
    samples = list(ds)
    stored = [r.key for shard in manifest.shards for r in get_format(manifest.format).reader(str(packed / shard.name))]
    assert [s.key for s in samples] == stored  # iteration in stored order
    for index in (0, 13, 59):
        sample = ds[index]
        assert sample.key == samples[index].key
        assert isinstance(sample.image, np.ndarray) and sample.image.dtype == np.uint8 and sample.image.shape[2] == 3
        assert sample.image.shape[:2] == (sample.meta["stored_height"], sample.meta["stored_width"])
        assert ds.get(sample.key).key == sample.key
        assert sample.label == ds.classes.index(sample.meta["source"].split("/")[0])
    with pytest.raises(KeyError):
        ds.get("no such key")
    with pytest.raises(IndexError):
        ds[60]


def test_decode_modes_scale_and_transform(packed: Path) -> None:
    raw = open_shards(packed, decode="bytes")[3]
    assert isinstance(raw.image, bytes) and raw.image[:2] == b"\xff\xd8"
    pil = open_shards(packed, decode="pil")[3]
    assert pil.image.mode == "RGB"
    full = open_shards(packed)[3].image
    half = open_shards(packed, scale=1 / 2)[3].image
    assert half.shape[0] == -(-full.shape[0] // 2) and half.shape[1] == -(-full.shape[1] // 2)
    assert open_shards(packed, transform=lambda s: s.key)[3] == raw.key
    with pytest.raises(ConfigError):
        open_shards(packed, scale=0.3)
    with pytest.raises(ConfigError):
        open_shards(packed, decode="cv2")


def test_torch_tensor_decode(packed: Path) -> None:
    torch = pytest.importorskip("torch")
    sample = open_shards(packed, decode="torch")[0]
    assert isinstance(sample.image, torch.Tensor) and sample.image.dtype == torch.uint8
    assert sample.image.shape[0] == 3


def test_dataloader_two_workers_two_ranks_sees_every_key_once(packed: Path) -> None:
    torch = pytest.importorskip("torch")
    seen: Counter[str] = Counter()
    for rank in range(2):
        ds = open_shards(packed, decode="bytes", rank=rank, world_size=2).iterable()
        loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2)
        seen.update(sample.key for sample in loader)
    assert len(seen) == 60 and set(seen.values()) == {1}


@pytest.mark.parametrize(("world", "drop_last"), [(7, False), (7, True), (16, False)])
def test_every_rank_gets_the_same_number_of_samples(packed: Path, world: int, drop_last: bool) -> None:
    """DDP needs equal step counts: 60 samples on 7 ranks, and more ranks (16) than shards (9)."""
    torch = pytest.importorskip("torch")
    per_rank: list[list[str]] = []
    for rank in range(world):
        ds = open_shards(packed, decode="bytes", rank=rank, world_size=world, drop_last=drop_last, shuffle=True)
        ds.set_epoch(2)
        iterable = ds.iterable()
        workers = 2 if rank < 2 else 0  # DataLoader workers split a rank's run too
        keys = [s.key for s in torch.utils.data.DataLoader(iterable, batch_size=None, num_workers=workers)]
        assert len(keys) == len(iterable)
        per_rank.append(keys)
    expected = 60 // world if drop_last else -(-60 // world)
    assert {len(keys) for keys in per_rank} == {expected}
    seen = Counter(key for keys in per_rank for key in keys)
    if drop_last:
        assert set(seen.values()) == {1} and len(seen) == expected * world
    else:  # the remainder wraps around: every key at least once, world * expected - 60 repeats
        assert len(seen) == 60 and sum(seen.values()) - 60 == expected * world - 60


def test_shuffled_epoch_across_ranks_sees_every_key_once(packed: Path) -> None:
    keys: list[str] = []
    for rank in range(3):
        ds = open_shards(packed, decode="bytes", rank=rank, world_size=3, shuffle=True, seed=5, shuffle_buffer=4)
        keys += [s.key for s in ds]
    assert len(keys) == 60 and len(set(keys)) == 60


def test_read_range_streams_any_slice(packed: Path) -> None:
    manifest = read_manifest(packed)
    backend = get_format(manifest.format)
    path = str(packed / manifest.shards[1].name)
    stored = [r.key for r in backend.reader(path)]
    for start, stop in [(0, 3), (2, 5), (0, len(stored)), (4, 99), (3, 3)]:
        fresh = backend.reader(path)  # tar: a range from 0 streams without building the index
        assert [r.key for r in fresh.read_range(start, stop)] == stored[start:stop]
        indexed = backend.reader(path)
        len(indexed)
        assert [r.key for r in indexed.read_range(start, stop)] == stored[start:stop]


def test_tar_ranges_in_any_order_walk_on_from_marks(tar_packed: Path) -> None:
    """A tar read in pieces, in any order, by ranges that start inside it: each range walks the
    headers on from where an earlier one stopped, never building the index; marks travel in a
    pickle (plain offsets) and a range past the end says where the shard ended."""
    packed = tar_packed
    manifest = read_manifest(packed)
    backend = get_format("webdataset")
    path = str(packed / manifest.shards[0].name)
    stored = [r.key for r in backend.reader(path)]
    n = len(stored)
    assert n >= 6
    reader = backend.reader(path)
    for start, stop in [(3, 5), (0, 2), (5, n), (2, 3), (1, 4), (4, n), (n - 1, n)]:
        assert [r.key for r in reader.read_range(start, stop)] == stored[start:stop]
    assert reader._entries is None  # no index was built
    assert set(reader._marks) >= {0, 2, 3, 5, n}
    moved = pickle.loads(pickle.dumps(reader))
    assert moved._marks == reader._marks
    assert [r.key for r in moved.read_range(5, n)] == stored[5:n]
    with pytest.raises(ShardFormatError, match=f"ends after {len(stored)} records"):
        list(backend.reader(path).read_range(len(stored) + 2, len(stored) + 3))


def test_map_style_with_distributed_sampler(packed: Path) -> None:
    pytest.importorskip("torch")
    from torch.utils.data import DataLoader, DistributedSampler

    ds = open_shards(packed, decode="bytes", transform=lambda s: s.key)
    keys: list[str] = []
    for rank in range(2):
        sampler = DistributedSampler(ds, num_replicas=2, rank=rank, shuffle=True, seed=3, drop_last=True)
        keys += list(DataLoader(ds, sampler=sampler, batch_size=None, num_workers=2))
    assert len(keys) == 60 and len(set(keys)) == 60


def test_slices_and_lists_of_indices_as_torch_and_numpy_take_them(packed: Path) -> None:
    ds = open_shards(packed, decode="bytes")
    keys = [sample.key for sample in ds]
    assert [s.key for s in ds[2:9:3]] == keys[2:9:3] and [s.key for s in ds[-3:]] == keys[-3:]
    assert [s.key for s in ds[[9, 0, 9, -1]]] == [keys[9], keys[0], keys[9], keys[-1]]
    assert [s.key for s in ds[np.array([4, 1])]] == [keys[4], keys[1]] and ds[np.int64(5)].key == keys[5]
    assert [s.key for s in ds.__getitems__(range(3))] == keys[:3]  # torch's batched fetch
    assert ds[len(ds) : len(ds) + 5] == []
    with pytest.raises(IndexError):
        ds[[0, len(ds)]]
    with pytest.raises(TypeError, match="an int, a slice or a list of ints, not str"):
        ds["key"]


def test_with_torch_imported_a_dataset_is_a_torch_dataset(packed: Path) -> None:
    """Frameworks that ask for a torch Dataset (isinstance) take the output; without torch imported,
    opening one never imports it (test_api checks that in a fresh process)."""
    pytest.importorskip("torch")
    from torch.utils.data import DataLoader, Dataset

    ds = open_shards(packed, decode="bytes", transform=lambda s: s.key)
    assert isinstance(ds, Dataset)
    batches = list(DataLoader(ds, batch_size=16, num_workers=2, collate_fn=list))
    assert [key for batch in batches for key in batch] == [s for s in ds]


def test_seeded_shuffle_repeats_and_changes_with_epoch(packed: Path) -> None:
    def order(seed: int, epoch: int) -> list[str]:
        ds = open_shards(packed, decode="bytes", shuffle=True, seed=seed, shuffle_buffer=10)
        ds.set_epoch(epoch)
        return [s.key for s in ds]

    first = order(1, 0)
    assert first == order(1, 0)
    assert first != order(1, 1) and first != order(2, 0)
    assert sorted(first) == sorted(s.key for s in open_shards(packed, decode="bytes"))


def test_corrupt_record_names_shard_and_key_or_is_skipped(packed: Path, tmp_path: Path) -> None:
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(packed, copy)
    manifest = read_manifest(copy)
    victim = open_shards(copy, decode="bytes")[8]  # shard 1, record 1 (7 per shard)
    data = (copy / manifest.shards[1].name).read_bytes()
    at = data.index(victim.image)
    damaged = data[:at] + bytes(64) + data[at + 64 :]  # same size: only decoding can tell
    (copy / manifest.shards[1].name).write_bytes(damaged)
    with pytest.raises(ShardReadError) as error:
        list(open_shards(copy))
    assert manifest.shards[1].name in str(error.value) and victim.key in str(error.value)
    tolerant = open_shards(copy, on_error="skip")
    assert len(list(tolerant)) == 59 and tolerant.skipped == 1


def test_truncated_shard_is_refused_before_it_is_opened(packed: Path, tmp_path: Path) -> None:
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(packed, copy)
    shard = copy / read_manifest(copy).shards[0].name
    shard.write_bytes(shard.read_bytes()[:1000])
    with pytest.raises(ShardFormatError, match="truncated or replaced"):
        open_shards(copy)


def test_reading_never_imports_the_pack_side(packed: Path) -> None:
    code = (
        "import sys; from shardkit.readers import open_shards; "
        f"ds = open_shards({str(packed)!r}); list(ds); ds[0]; "
        "bad = [m for m in sys.modules if m.startswith(('shardkit.packing', 'shardkit.runtime'))]; "
        "sys.exit(1 if bad else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(min_value=0, max_value=9), min_size=1, max_size=8),
    st.integers(min_value=1, max_value=6),
    st.integers(min_value=1, max_value=4),
)
def test_ranges_cut_the_epoch_into_equal_runs(counts: list[int], world: int, workers: int) -> None:
    """Pure planning: every rank gets ceil(total/world) positions, runs tile the epoch, wrapping at the end."""
    from shardkit.readers.split import record_ranges

    total = sum(counts)
    order = list(range(len(counts)))[::-1]
    sequence = [(shard, i) for shard in order for i in range(counts[shard])]
    per_rank = -(-total // world)
    for rank in range(world):
        got = []
        for worker in range(workers):
            begin = rank * per_rank
            plan = record_ranges(
                order,
                [counts[s] for s in order],
                begin + worker * per_rank // workers,
                begin + (worker + 1) * per_rank // workers,
            )
            got += [(shard, i) for shard, start, stop in plan for i in range(start, stop)]
        expected = [sequence[p % total] for p in range(rank * per_rank, (rank + 1) * per_rank)] if total else []
        assert got == expected


def test_set_epoch_reaches_persistent_dataloader_workers(packed: Path) -> None:
    torch = pytest.importorskip("torch")

    def epochs(persistent: bool) -> list[list[str]]:
        iterable = open_shards(packed, decode="bytes", shuffle=True, seed=4, shuffle_buffer=5).iterable()
        loader = torch.utils.data.DataLoader(
            iterable, batch_size=None, num_workers=2, persistent_workers=persistent, collate_fn=lambda s: s.key
        )
        orders = []
        for epoch in range(3):
            iterable.set_epoch(epoch)
            orders.append(list(loader))
        return orders

    persistent = epochs(True)
    assert persistent == epochs(False)
    assert persistent[0] != persistent[1] != persistent[2]
    assert sorted(persistent[0]) == sorted(persistent[2])


def test_a_dataset_dropped_without_close_lets_go_of_its_lmdb_files(packed_sample) -> None:
    """A notebook's `del ds` (no close()) kept each LMDB file open for the process's life, and py-lmdb
    refuses to open a file twice in a process: the docs' "without shardkit" snippet then failed."""
    import gc

    import lmdb

    packed = packed_sample("lmdb", 64, 7)
    shard = packed / read_manifest(packed).shards[0].name
    dataset = open_shards(packed, decode="bytes")
    dataset[0]
    del dataset
    gc.collect()
    lmdb.open(str(shard), subdir=False, readonly=True, lock=False).close()
    closed = open_shards(packed, decode="bytes")
    closed[0]
    closed.close()
    lmdb.open(str(shard), subdir=False, readonly=True, lock=False).close()
    del closed
    gc.collect()  # (close() released it already: the collector must not release it again)
