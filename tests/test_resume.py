"""Stop anywhere, resume exactly: the epoch order as a pure function, states, elastic resume and
weighted mixing, on real shards of every format (readers/order, epoch, mix)."""

from __future__ import annotations

import itertools
import json
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardkit.core.config import PackConfig
from shardkit.core.errors import ConfigError, ShardReadError
from shardkit.formats import available_formats
from shardkit.packing.pack import pack
from shardkit.readers import open_shards
from shardkit.readers.intervals import interval_positions, take
from shardkit.readers.order import Progress, round_robin_counts
from shardkit.readers.stream import Stream

from .helpers import run_killing

SHUFFLED = dict(shuffle=True, seed=7, shuffle_buffer=16)


@pytest.fixture(scope="module", params=available_formats())
def packed(request, packed_sample) -> Path:
    return packed_sample(request.param, 64, 7)  # (shared with other modules: read only)


def roundtrip(state: dict) -> dict:
    """What a checkpoint keeps: the state through JSON."""
    return json.loads(json.dumps(state))


# --- the order, pure ---------------------------------------------------------------------------


def shard_starts(data, total: int) -> np.ndarray | None:
    """Where shards start in an epoch of `total` positions (None: cut evenly, as a mix is)."""
    if data.draw(st.booleans()):
        return None
    sizes = data.draw(st.lists(st.integers(0, 40), min_size=1, max_size=30))
    return np.unique(np.cumsum([0, *sizes]))[: total + 1].clip(0, total)


@settings(max_examples=300, deadline=None)
@given(
    st.integers(0, 300), st.booleans(), st.integers(1, 64), st.integers(1, 5), st.integers(1, 3), st.data()
)  # fmt: skip
def test_a_stream_resumes_where_it_stood(
    total: int, shuffle: bool, buffer: int, world: int, workers: int, data
) -> None:
    """Every stream's remainder after `done` is its uninterrupted order from `done` on, and what it
    consumed plus what remains is its run; the streams of all ranks and workers tile the epoch."""
    progress = Progress(0, 3, shuffle, buffer, [total], total)
    cuts = shard_starts(data, total)
    split, sequence = progress.start(world, workers, False, cuts)
    seen: Counter[int] = Counter()
    for rank in range(world):
        for worker in range(workers):
            stream = progress.stream(split, sequence, rank, worker, cuts)
            whole = np.concatenate([np.zeros(0, np.int64), *stream.blocks_from(0)]).tolist()
            assert len(whole) == stream.length
            done = data.draw(st.integers(0, stream.length))
            rest = np.concatenate([np.zeros(0, np.int64), *stream.blocks_from(done)]).tolist()
            assert rest == whole[done:]
            assert sorted(interval_positions(stream.consumed(done)).tolist()) == sorted(whole[:done])
            seen.update(whole)
    per_rank = total if world == 1 else -(-total // world)
    assert set(seen) == set(range(total)) and sum(seen.values()) == per_rank * world if total else not seen


@settings(max_examples=300, deadline=None)
@given(
    st.integers(1, 300), st.booleans(), st.integers(1, 40), st.integers(1, 5), st.integers(1, 5),
    st.integers(1, 3), st.integers(1, 3), st.booleans(), st.data(),
)  # fmt: skip
def test_elastic_resume_sees_every_position(
    total: int, shuffle: bool, buffer: int, world: int, new_world: int, workers: int, new_workers: int,
    drop_last: bool, data,
) -> None:  # fmt: skip
    """W ranks x workers stop after the same count each; W' ranks x workers' finish from rank 0's
    state: every position once, apart from the end-of-epoch repeats of both layouts."""
    progress = Progress(1, 5, shuffle, buffer, [total], total)
    cuts = shard_starts(data, total)
    split, sequence = progress.start(world, workers, drop_last, cuts)
    streams = [progress.stream(split, sequence, r, w, cuts) for r in range(world) for w in range(workers)]
    counts = [data.draw(st.integers(0, streams[w].length)) for w in range(workers)]
    seen: Counter[int] = Counter()
    for i, stream in enumerate(streams):
        seen.update(interval_positions(stream.consumed(counts[i % workers])).tolist())
    progress.splits[split].done = list(counts)
    resumed = Progress.from_state(roundtrip(progress.to_state()))
    split, sequence = resumed.start(new_world, new_workers, drop_last, cuts)
    for rank in range(new_world):
        for worker in range(new_workers):
            stream = resumed.stream(split, sequence, rank, worker, cuts)
            done = resumed.splits[split].done[worker]  # the same layout goes on where it stood
            assert done is not None
            seen.update(np.concatenate([np.zeros(0, np.int64), *stream.blocks_from(done)]).tolist())
    if not drop_last:
        assert set(seen) == set(range(total))
    assert sum(seen.values()) - len(seen) <= (world - 1) + (new_world - 1)


def test_reads_stay_sequential_within_each_lane() -> None:
    stream = Stream([(0, 10_000)], True, 1000, (1, 2, 3))
    blocks = [np.sort(block) for block in stream.blocks_from(0)]
    lanes = [[b[(b >= lane * 1250) & (b < (lane + 1) * 1250)] for b in blocks] for lane in range(8)]
    for lane in lanes:
        joined = np.concatenate(lane)
        assert (np.diff(joined) == 1).all()  # each block continues its lane where the last one stopped
    assert max(len(b) for b in blocks) <= 1000  # memory: the buffer's


@pytest.mark.parametrize("shard", [100, 1000, 1003])
def test_lanes_start_at_shard_starts(shard: int) -> None:
    """Lanes longer than a shard each start at a shard's first record (a tar is then never walked
    from its start to reach a lane), at most half a shard from the even cut; every lane ends in the
    last block, and a block holds the buffer and at most one more record per lane."""
    total, buffer = 40_000, 1000
    cuts = np.arange(0, total, shard)
    stream = Stream([(0, total)], True, buffer, (1, 2, 3), 8, cuts)
    starts = stream.lane_starts
    assert set(starts[:-1]) <= set(cuts.tolist())
    assert all(abs(start - i * total // 8) <= shard / 2 for i, start in enumerate(starts))
    blocks = list(stream.blocks_from(0))
    assert max(len(b) for b in blocks) <= buffer + 8
    last = np.sort(blocks[-1])
    for lane in range(8):  # each lane's last record is in the last block
        assert starts[lane + 1] - 1 in last
    assert np.array_equal(np.sort(np.concatenate(blocks)), np.arange(total))


def test_take_wraps_around() -> None:
    assert take([(5, 8), (0, 2)], 3, 9) == [(0, 2), (5, 8), (0, 1)]


# Ten DataLoaders with 2 or 3 worker processes for each format (some 75 processes, the slowest test
# of the inner loop on a busy machine); the round-robin arithmetic is the same for every format:
# `make test-fast` checks it on webdataset, `make test` on all three.
#
# The DataLoaders fork their workers in a fresh interpreter, not in the test session: by the time
# `make test`'s slow session reaches this module it has run Ray (whose native threads stay after
# ray.shutdown(): 14 threads in the process, 3 of them Python's) and S3 tests (fsspec's event loop
# thread), and a child forked from a process with threads may only make async-signal-safe calls.
# Once in CI both workers of one DataLoader here died of SIGSEGV at start; no run since reproduced
# it (5 slow sessions, 150 runs of this test after Ray and S3). The round-robin arithmetic does not
# depend on that history, and the fork path stays under test where nothing came before it.
ROUND_ROBIN = """
import operator, sys
import torch
from shardkit.readers import open_shards
packed = sys.argv[1]
def opened():
    return open_shards(packed, decode="bytes", transform=operator.attrgetter("key"), shuffle=True, seed=7,
                       shuffle_buffer=16).iterable()
iterable, checked = opened(), 0
for workers, batch_size, drop_last in [(2, 4, False), (3, 5, True), (0, 7, False)]:
    loader = torch.utils.data.DataLoader(
        iterable, batch_size=batch_size, num_workers=workers, drop_last=drop_last, collate_fn=list
    )
    batches = list(loader)
    for stop in (0, 1, len(batches) // 2, len(batches)):
        fresh = opened()
        fresh.load_state_dict(iterable.state_from_batches(stop, batch_size, workers, drop_last))
        rest = list(torch.utils.data.DataLoader(
            fresh, batch_size=batch_size, num_workers=workers, drop_last=drop_last, collate_fn=list
        ))
        assert rest == batches[stop:], (workers, batch_size, drop_last, stop)
        checked += 1
print("checked", checked)
"""


@pytest.mark.parametrize(
    "packed",
    [pytest.param(fmt, marks=pytest.mark.slow) for fmt in available_formats()],  # (4 s: DataLoader workers)
    indirect=True,
)
def test_round_robin_counts_match_a_dataloader(packed: Path) -> None:
    pytest.importorskip("torch")
    done = subprocess.run([sys.executable, "-c", ROUND_ROBIN, str(packed)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.split() == ["checked", "12"], done.stdout + done.stderr[-3000:]


def test_round_robin_counts_refuse_more_batches_than_the_epoch() -> None:
    assert round_robin_counts([10, 10], 3, 4) == ([8, 4], 1)
    assert round_robin_counts([10, 3], 4, 4) == ([10, 3], 0)
    assert round_robin_counts([10, 3], 2, 4) == ([4, 3], 0)  # worker 1 has nothing left: worker 0's turn
    with pytest.raises(ConfigError, match="more than this epoch"):
        round_robin_counts([10, 3], 5, 4)


# --- the batch loader and iteration on real shards ---------------------------------------------


def batches(out: Path, state: dict | None = None, **options) -> list:
    loader = open_shards(out, **{**SHUFFLED, **options}).loader(8, 32, flip=True, output="numpy", workers=2)
    if state is not None:
        loader.load_state_dict(state)
    return [(b.keys, b.images.copy()) for b in loader]


def test_the_loader_resumes_at_the_next_batch_with_the_same_pixels(packed: Path) -> None:
    whole = batches(packed)
    assert sorted(k for keys, _ in whole for k in keys) == sorted(s.key for s in open_shards(packed, decode="bytes"))
    for stop in (0, 1, 3, len(whole) - 1, len(whole)):
        loader = open_shards(packed, **SHUFFLED).loader(8, 32, flip=True, output="numpy", workers=2)
        for _, _batch in zip(range(stop), loader, strict=False):
            pass
        state = roundtrip(loader.state_dict())
        rest = batches(packed, state)
        assert [keys for keys, _ in rest] == [keys for keys, _ in whole[stop:]]
        assert all(np.array_equal(a, b) for (_, a), (_, b) in zip(rest, whole[stop:], strict=True))


def test_the_loader_starts_whole_epochs_after_a_resumed_one(packed: Path) -> None:
    loader = open_shards(packed, **SHUFFLED).loader(8, 32, output="numpy")
    first = [b.keys for b in loader]
    state = loader.state_dict()
    state["splits"][-1]["done"] = [16]
    loader.load_state_dict(state)
    assert [b.keys for b in loader] == first[2:]
    assert [b.keys for b in loader] == first  # the next pass is a whole epoch again
    loader.dataset.set_epoch(1)
    assert sorted(k for b in loader for k in b.keys) == sorted(k for keys in first for k in keys)


def test_iteration_resumes_exactly(packed: Path) -> None:
    pytest.importorskip("torch")
    whole = [s.key for s in open_shards(packed, decode="bytes", **SHUFFLED)]
    iterable = open_shards(packed, decode="bytes", **SHUFFLED).iterable()
    it = iter(iterable)
    head = [next(it).key for _ in range(23)]
    state = roundtrip(iterable.state_dict())
    fresh = open_shards(packed, decode="bytes", **SHUFFLED).iterable()
    fresh.load_state_dict(state)
    assert head + [s.key for s in fresh] == whole


def test_a_damaged_shard_stops_the_epoch_at_its_own_block(tar_packed: Path, tmp_path: Path) -> None:
    """Blocks are read while the one before is handed out; a shard that cannot be read stops the
    epoch (on_error="raise") only once every earlier block is out, and with "skip" the rest comes
    with its positions still counted, as when blocks were read one after the other."""
    out = tmp_path / "out"
    shutil.copytree(tar_packed, out)
    whole = [s.key for s in open_shards(out, decode="bytes", **SHUFFLED)]
    damaged = sorted(out.glob("*.tar"))[3]
    data = damaged.read_bytes()
    damaged.write_bytes(b"\xff" * 512 + data[512:])  # its first header: the same size, not a tar
    dataset = open_shards(out, decode="bytes", **SHUFFLED)
    position, items = dataset.epoch_items()
    handed: list[str] = []
    with pytest.raises(ShardReadError, match=damaged.name):
        for item in items:
            position.advance()
            assert item is not None
            handed.append(item.record.key)
    assert handed == whole[: len(handed)]
    stream = position.stream
    assert len(handed) in [stream.end(j) for j in range(stream.blocks + 1)]  # whole blocks, then the error
    skipping = open_shards(out, decode="bytes", on_error="skip", **SHUFFLED)
    position, items = skipping.epoch_items()
    kept = [item.record.key for item in items if item is not None]
    assert len(kept) < len(whole) and kept == [key for key in whole if key in set(kept)]
    assert skipping.skipped >= 1


@pytest.mark.parametrize(("world", "new_world"), [(2, 3), (4, 2)])
def test_the_loader_resumes_on_another_number_of_ranks(packed: Path, world: int, new_world: int) -> None:
    seen: Counter[str] = Counter()
    state = None
    for rank in range(world):
        loader = open_shards(packed, rank=rank, world_size=world, **SHUFFLED).loader(4, 32, output="numpy")
        for _, batch in zip(range(2), loader, strict=False):
            seen.update(batch.keys)
        if rank == 0:
            state = roundtrip(loader.state_dict())  # rank 0's state is all the others need
    for rank in range(new_world):
        loader = open_shards(packed, rank=rank, world_size=new_world, **SHUFFLED).loader(4, 32, output="numpy")
        loader.load_state_dict(state)
        seen.update(k for batch in loader for k in batch.keys)
    assert len(seen) == 60
    assert sum(seen.values()) - 60 <= (world - 1) + (new_world - 1)


@pytest.mark.parametrize("workers", [0, 1, 2])
def test_stateful_dataloader_resumes_exactly(packed: Path, workers: int) -> None:
    pytest.importorskip("torch")
    stateful = pytest.importorskip("torchdata.stateful_dataloader")

    def loader():
        iterable = open_shards(packed, decode="bytes", transform=lambda s: s.key, **SHUFFLED).iterable()
        return stateful.StatefulDataLoader(iterable, batch_size=4, num_workers=workers, collate_fn=list)

    whole = list(loader())
    first = loader()
    head = []
    for batch in first:
        head.append(batch)
        if len(head) == 5:
            state = first.state_dict()
            break
    resumed = loader()
    resumed.load_state_dict(state)
    assert head + list(resumed) == whole
    assert sorted(k for b in whole for k in b) == sorted(s.key for s in open_shards(packed, decode="bytes"))


def test_a_state_resumes_only_its_own_data(packed: Path) -> None:
    loader = open_shards(packed).loader(8, 32, output="numpy")
    state = loader.state_dict()
    with pytest.raises(ConfigError, match="this state was saved on 61 records"):
        state["sizes"], state["total"] = [61], 61
        open_shards(packed).loader(8, 32, output="numpy").load_state_dict(state)
    with pytest.raises(ConfigError, match="not a shardkit iteration state"):
        loader.load_state_dict({"epoch": 3})
    with pytest.raises(ConfigError, match="damaged"):
        loader.load_state_dict({**loader.state_dict(), "splits": [{"world": 1}]})


def test_one_workers_state_resumes_only_the_same_layout(packed: Path) -> None:
    pytest.importorskip("torch")
    state = open_shards(packed, **SHUFFLED).iterable().state_from_batches(3, 4, num_workers=2)
    state["splits"][-1]["done"][1] = None  # what a DataLoader worker saves: its own count only
    loader = open_shards(packed, **SHUFFLED).loader(8, 32, output="numpy")
    loader.load_state_dict(state)
    with pytest.raises(ConfigError, match="one DataLoader worker's position"):
        list(loader)


# --- weighted mixing -----------------------------------------------------------------------------


def test_mixing_draws_by_weight(packed: Path) -> None:
    mix = open_shards([packed, packed, packed], weights=[0.6, 0.3, 0.1], length=6000, decode="bytes", seed=2)
    _, items = mix.epoch_items()
    sources = Counter(mix.sources.index(item.dataset) for item in items)
    assert sum(sources.values()) == len(mix) == 6000
    for source, weight in enumerate([0.6, 0.3, 0.1]):
        sigma = (6000 * weight * (1 - weight)) ** 0.5
        assert abs(sources[source] - 6000 * weight) < 5 * sigma
    again = open_shards([packed, packed, packed], weights=[0.6, 0.3, 0.1], length=6000, decode="bytes", seed=2)
    assert [s.key for s in again] == [s.key for s in mix]  # deterministic per seed


def test_a_mix_resamples_or_stops_at_the_first_exhausted_source(packed: Path) -> None:
    def drawn(mix) -> list[tuple[int, str]]:
        _, items = mix.epoch_items()
        return [(mix.sources.index(item.dataset), item.record.key) for item in items]

    resampled = open_shards([packed, packed], weights=[0.9, 0.1], decode="bytes")  # positions in order
    assert len(resampled) == 120  # the sources' records together
    counts = Counter(source for source, _ in drawn(resampled))
    assert counts[0] > 60  # source 0 ran out and started again in a fresh order
    first_pass = [key for source, key in drawn(resampled) if source == 0][:60]
    assert sorted(first_pass) == sorted(s.key for s in open_shards(packed, decode="bytes"))
    stopped = open_shards([packed, packed], weights=[0.9, 0.1], exhausted="stop", decode="bytes")
    keys = drawn(stopped)
    assert len(keys) == len(stopped) and max(Counter(keys).values()) == 1 and 60 <= len(keys) < 120
    assert Counter(source for source, _ in keys)[0] == 60  # the epoch ends where source 0 ran out


@pytest.mark.parametrize(("world", "new_world"), [(1, 1), (2, 3)])
def test_a_mix_resumes_exactly_and_elastically(packed: Path, world: int, new_world: int) -> None:
    def mix(rank: int = 0, size: int = 1):
        return open_shards(
            [packed, packed], weights=[0.7, 0.3], rank=rank, world_size=size, shuffle=True, seed=4, shuffle_buffer=16
        )

    whole = Counter(k for b in mix().loader(8, 32, output="numpy") for k in b.keys)
    seen: Counter[str] = Counter()
    states = []
    for rank in range(world):
        loader = mix(rank, world).loader(8, 32, output="numpy")
        for _, batch in zip(range(3), loader, strict=False):
            seen.update(batch.keys)
        states.append(roundtrip(loader.state_dict()))
    state = states[0]
    for rank in range(new_world):
        loader = mix(rank, new_world).loader(8, 32, output="numpy")
        loader.load_state_dict(state)
        seen.update(k for b in loader for k in b.keys)
    assert not whole - seen  # every draw of the mix's epoch
    assert sum((seen - whole).values()) <= (world - 1) + (new_world - 1)


def test_mix_arguments_are_checked(packed: Path) -> None:
    with pytest.raises(ConfigError, match="2 weights for 3 sources"):
        open_shards([packed, packed, packed], weights=[1, 2])
    with pytest.raises(ConfigError, match="weights must be"):
        open_shards([packed, packed], weights=[1, -1])
    with pytest.raises(ConfigError, match="exhausted must be"):
        open_shards([packed, packed], exhausted="never")
    with pytest.raises(ConfigError, match="for a mix"):
        open_shards(packed, weights=[1])


# --- real processes: kill -9 anywhere, a real torch.distributed group -----------------------------

TRAIN = """
import json, os, sys, time
from shardkit.readers import open_shards
out, checkpoint = sys.argv[1], sys.argv[2]
loader = open_shards(out, shuffle=True, seed=7, shuffle_buffer=16).loader(4, 32, output="numpy", workers=2)
seen = []
if os.path.exists(checkpoint):
    with open(checkpoint) as file:
        saved = json.load(file)
    loader.load_state_dict(saved["state"])
    seen = saved["seen"]
for batch in loader:
    seen += batch.keys
    with open(checkpoint + ".tmp", "w") as file:  # the training step's checkpoint: state and model together
        json.dump({"state": loader.state_dict(), "seen": seen}, file)
        file.flush()
        os.fsync(file.fileno())
    os.replace(checkpoint + ".tmp", checkpoint)
    time.sleep(0.05)
"""


@pytest.mark.slow
def test_a_training_loop_killed_anywhere_resumes_exactly(tar_packed: Path, tmp_path: Path) -> None:
    packed = tar_packed
    expected = [k for b in open_shards(packed, **SHUFFLED).loader(4, 32, output="numpy") for k in b.keys]
    script, checkpoint = tmp_path / "train.py", tmp_path / "checkpoint.json"
    script.write_text(TRAIN)
    run_killing([sys.executable, str(script), str(packed), str(checkpoint)], checkpoint, 4, 18, 0.12)
    assert json.loads(checkpoint.read_text())["seen"] == expected


DISTRIBUTED = """
import json, sys
import torch.distributed as dist
from shardkit.readers import open_shards
out, rank, world, rendezvous, state_in, prefix, steps = sys.argv[1:]
dist.init_process_group("gloo", init_method="file://" + rendezvous, rank=int(rank), world_size=int(world))
loader = open_shards(out, shuffle=True, seed=7, shuffle_buffer=16).loader(4, 32, output="numpy")  # ranks from dist
if state_in != "-":
    with open(state_in) as file:
        loader.load_state_dict(json.load(file))
keys, state = [], loader.state_dict()
for step, batch in enumerate(loader, 1):
    keys += batch.keys
    dist.barrier()  # lock step, as gradients all-reduce
    state = loader.state_dict()  # saved after the step, with the model
    if step == int(steps):
        break
with open(f"{prefix}-{rank}.json", "w") as file:
    json.dump({"keys": keys, "state": state}, file)
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_a_torch_distributed_group_resumes_on_fewer_ranks(tar_packed: Path, tmp_path: Path) -> None:
    packed = tar_packed
    import subprocess
    import sys

    pytest.importorskip("torch")
    script = tmp_path / "distributed.py"
    script.write_text(DISTRIBUTED)

    def run(world: int, state_in: str, prefix: str, steps: int) -> list[dict]:
        rendezvous = tmp_path / f"rendezvous-{prefix}"
        children = [
            subprocess.Popen(
                [
                    sys.executable,
                    str(script),
                    str(packed),
                    str(rank),
                    str(world),
                    str(rendezvous),
                    state_in,
                    str(tmp_path / prefix),
                    str(steps),
                ]
            )
            for rank in range(world)
        ]
        assert [child.wait(timeout=240) for child in children] == [0] * world
        return [json.loads((tmp_path / f"{prefix}-{rank}.json").read_text()) for rank in range(world)]

    first = run(4, "-", "four", 2)
    (tmp_path / "rank0.json").write_text(json.dumps(first[0]["state"]))  # rank 0's state only
    second = run(2, str(tmp_path / "rank0.json"), "two", -1)
    seen = Counter(k for part in first + second for k in part["keys"])
    assert len(seen) == 60
    assert sum(seen.values()) - 60 <= (4 - 1) + (2 - 1)
    assert all(len(part["keys"]) == 8 for part in first)


def test_stateful_dataloader_resumes_a_mix(packed: Path) -> None:
    pytest.importorskip("torch")
    stateful = pytest.importorskip("torchdata.stateful_dataloader")

    def loader():
        mix = open_shards([packed, packed], weights=[2, 1], decode="bytes", transform=lambda s: s.key, **SHUFFLED)
        return stateful.StatefulDataLoader(mix.iterable(), batch_size=4, num_workers=2, collate_fn=list)

    whole = list(loader())
    first = loader()
    head = [batch for _, batch in zip(range(7), first, strict=False)]
    state = first.state_dict()
    resumed = loader()
    resumed.load_state_dict(state)
    assert head + list(resumed) == whole


# --- tampered and mismatched states: refused up front, naming the field ------------------------------


def loader_state(out: Path, **options) -> dict:
    """A state of a loader in the middle of its epoch, through JSON."""
    loader = open_shards(out, **{**SHUFFLED, **options}).loader(4, 32, output="numpy")
    for _, _batch in zip(range(3), loader, strict=False):
        pass
    return roundtrip(loader.state_dict())


def split_edit(**fields):
    def edit(state: dict) -> None:
        state["splits"][-1].update(fields)

    return edit


TAMPERED = {
    "seed": (lambda s: s.update(seed=-1), "seed"),
    "seed-huge": (lambda s: s.update(seed=2**64), "seed"),
    "seed-float": (lambda s: s.update(seed=7.5), "seed"),
    "epoch": (lambda s: s.update(epoch=-1), "epoch"),
    "total-huge": (lambda s: s.update(total=10**12), "total"),
    "total-short": (lambda s: s.update(total=5), "total"),
    "buffer": (lambda s: s.update(buffer=0), "buffer"),
    "lanes": (lambda s: s.update(lanes=10**9), "lanes"),
    "world": (split_edit(world=10**9), "world"),
    "world-float": (split_edit(world=1.5), "world"),
    "workers": (split_edit(workers=2), "workers"),
    "done-past": (split_edit(done=[10**6]), "done"),
    "done-negative": (split_edit(done=[-4]), "done"),
    "turn": (split_edit(turn=3), "turn"),
    "drop_last": (split_edit(drop_last="yes"), "drop_last"),
    "earlier-unknown": (
        lambda s: s["splits"].insert(0, {"world": 2, "workers": 1, "drop_last": False, "done": [None]}),
        "done",
    ),
    "sizes": (lambda s: s.update(sizes=[10**12]), "saved on"),
    "weights": (lambda s: s.update(weights=[1.0]), "weights"),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("field", list(TAMPERED))
@pytest.mark.parametrize("reader", ["loader", "iterable", "iterate"])
def test_a_tampered_state_is_refused_up_front_naming_its_field(tar_packed: Path, reader: str, field: str) -> None:
    """Every field of a state is checked against the dataset it is loaded into before anything is
    read: in range, and the epoch's own (a total that is not this dataset's would end the epoch
    early or allocate what it claims; a world of 10**9 took minutes)."""
    state = loader_state(tar_packed)
    edit, named = TAMPERED[field]
    edit(state)
    dataset = open_shards(tar_packed, **SHUFFLED)
    with pytest.raises(ConfigError, match=named):
        if reader == "loader":
            dataset.loader(4, 32, output="numpy").load_state_dict(state)
        elif reader == "iterable":
            pytest.importorskip("torch")
            dataset.iterable().load_state_dict(state)
        else:
            next(dataset.iterate(Progress.from_state(state)))


@pytest.mark.timeout(60)
def test_more_streams_than_an_epoch_can_hold_are_refused(tar_packed: Path) -> None:
    """A split of 10**9 ranks built a stream per rank (minutes), and 10**9 workers a list of counts."""
    with pytest.raises(ConfigError, match="streams"):
        list(open_shards(tar_packed, rank=0, world_size=10**9))
    pytest.importorskip("torch")
    with pytest.raises(ConfigError, match="streams"):
        open_shards(tar_packed).iterable().state_from_batches(1, 4, num_workers=10**9)
    assert len(list(open_shards(tar_packed, rank=999, world_size=1000))) == 1  # a few more than records: fine


def test_an_untouched_state_still_resumes(tar_packed: Path) -> None:
    state = loader_state(tar_packed)
    loader = open_shards(tar_packed, **SHUFFLED).loader(4, 32, output="numpy")
    loader.load_state_dict(state)
    assert sum(len(b.keys) for b in loader) == 60 - 12


@pytest.mark.parametrize("seed", [-1, 2**64, 1.5, True, "7"])
def test_bad_seeds_and_epochs_are_refused(tar_packed: Path, seed) -> None:
    with pytest.raises(ConfigError, match="seed"):
        open_shards(tar_packed, seed=seed, shuffle=True)
    with pytest.raises(ConfigError, match="seed"):
        open_shards([tar_packed, tar_packed], seed=seed, shuffle=True)
    dataset = open_shards(tar_packed, seed=2**64 - 1, shuffle=True)
    assert len(list(dataset)) == 60
    for buffer in (2**64, 1.5):
        with pytest.raises(ConfigError, match="shuffle_buffer"):
            open_shards(tar_packed, shuffle_buffer=buffer)
    for epoch in (-1, 2**63, 1.5):
        with pytest.raises(ConfigError, match="epoch"):
            dataset.set_epoch(epoch)


def test_a_mix_state_resumes_only_the_same_mix(tar_packed: Path) -> None:
    """A mix's epoch follows from its weights and length, which a state must match: a state of a
    400-long mix gave a default-length mix 99 batches while len() said 13."""
    sources = [tar_packed, tar_packed]
    saved = open_shards(sources, length=400, weights=[1, 3], **SHUFFLED).loader(8, 32, output="numpy")
    state = roundtrip(saved.state_dict())
    same = open_shards(sources, length=400, weights=[1, 3], **SHUFFLED).loader(8, 32, output="numpy")
    same.load_state_dict(state)
    assert sum(1 for _ in same) == len(same) == 50
    with pytest.raises(ConfigError, match="total"):
        open_shards(sources, weights=[1, 3], **SHUFFLED).loader(8, 32, output="numpy").load_state_dict(state)
    with pytest.raises(ConfigError, match="weights"):
        open_shards(sources, length=400, weights=[3, 1], **SHUFFLED).loader(8, 32, output="numpy").load_state_dict(
            state
        )
    with pytest.raises(ConfigError, match="weights"):  # a mix's state carries its weights; one output's none
        open_shards(sources, length=400, weights=[1, 3], **SHUFFLED).loader(8, 32, output="numpy").load_state_dict(
            {key: value for key, value in state.items() if key != "weights"}
        )


@pytest.mark.parametrize(
    "weights", [[1e308, 1e308], [1e308, 1e-308], [float("inf"), 1], [float("nan"), 1], [0, 0], [-1, 2], [True, 1]]
)
def test_weights_that_cannot_be_normalized_are_refused(tar_packed: Path, weights: list) -> None:
    with pytest.raises(ConfigError, match="weight"):
        open_shards([tar_packed, tar_packed], weights=weights)


def test_weights_are_normalized_without_overflow(tar_packed: Path) -> None:
    huge = open_shards([tar_packed, tar_packed], weights=[1e307, 3e307], decode="bytes", seed=2)
    small = open_shards([tar_packed, tar_packed], weights=[1, 3], decode="bytes", seed=2)
    assert [s.key for s in huge] == [s.key for s in small]


def small_output(tmp_path: Path, images: int) -> Path:
    """An output of `images` generated records."""
    from shardkit.synthetic import write_image

    source = tmp_path / f"source-{images}"
    source.mkdir()
    for i in range(images):
        write_image(source / f"{i:02d}_40x30.jpg", 40, 30, seed=i)
    out = tmp_path / f"out-{images}"
    pack(PackConfig(str(source), str(out), format="webdataset", shard_size=7))
    assert len(open_shards(out)) == images
    return out


@pytest.mark.slow  # (6 s of the fast suite's 60)
@pytest.mark.parametrize("shuffle", [True, False])
def test_a_long_mix_of_a_tiny_source_holds_bounded_memory(tmp_path: Path, shuffle: bool) -> None:
    """A source drawn past its end starts again in a fresh order each round: a mix kept every round's
    order of every source, so a 1-record source grew it by a space per draw (+39 MB over 100,000
    positions). Memory must not grow with the positions."""
    import tracemalloc

    mix = open_shards(
        [small_output(tmp_path, 12), small_output(tmp_path, 1)],
        length=9_000, decode="bytes", shuffle=shuffle, seed=3, shuffle_buffer=16,
    )  # fmt: skip
    _, items = mix.epoch_items()
    for _item in itertools.islice(items, 3_000):  # (untraced: the first rounds fill what is kept)
        pass
    tracemalloc.start()  # from here, what is traced is what the next 6,000 positions keep
    try:
        for _item in itertools.islice(items, 5_900):
            pass
        grown = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert grown < 1_000_000, f"grew {grown:,} bytes over 5,900 positions"  # (before the fix: 2.3 MB)


def test_a_stream_of_one_record_blocks_holds_no_table_of_them() -> None:
    """A stream's block ends were a (blocks + 1) x lanes table: a state's buffer of 1 over a large
    epoch (one block per lane's record) took 8 bytes a position, 8 GB for 10**9."""
    import tracemalloc

    tracemalloc.start()
    try:
        stream = Stream([(0, 10**7)], True, 1, (0, 0, 0, 0, 0), lanes=8)
        done = 10**7 // 2 + 3
        j, offset = stream.locate(done)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1_000_000, f"{peak:,} bytes"
    assert stream.blocks == 10**7 // 8 and stream.end(j) + offset == done and len(stream.block(j)) == 8
