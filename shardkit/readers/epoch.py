"""Reading an epoch: positions (readers/order) to records, block by block, for iteration, the torch
IterableDataset and the batch loader alike, over one dataset or a weighted mix of several.

A *space* maps an epoch's positions to records: `ShardSpace` for one output (shards in stored or
seeded order), `readers.mix.MixSpace` for a mix. Reads go through `ShardDataset._range`, so counts are
checked against the manifest and on_error applies; a position whose record could not be read (a
damaged shard, skipped) comes out as None, so positions are still counted.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple, Protocol

import numpy as np

from ..core.errors import ConfigError, ShardReadError
from ..formats.base import Record
from .order import Progress, Stream
from .split import rank_and_world, record_ranges, worker_slot


class ShardDataset(Protocol):
    """What reading an epoch needs of one output (readers.dataset.ShardDataset; named here, not
    imported, so this module sits below it)."""

    manifest: Any
    remote: Any
    skipped: int
    _readers: list[Any]

    def _range(self, shard: int, start: int = 0, stop: int | None = None) -> Iterator[Record]: ...

    def _finish(self, record: Record, shard_name: str) -> Any: ...

    def _shard_id(self, shard: int) -> tuple[str, int, str]: ...


class Item(NamedTuple):
    dataset: ShardDataset  # the output the record comes from (one of a mix's sources)
    shard: int
    record: Record

    @property
    def shard_name(self) -> str:
        return self.dataset.manifest.shards[self.shard].name


class Space(Protocol):
    remote: bool  # whether any of its shards comes through the cache from object storage

    def read(self, positions: np.ndarray) -> Iterator[Item | None]: ...

    def shards(self, positions: np.ndarray) -> list[tuple[ShardDataset, int]]: ...


def runs(positions: np.ndarray) -> list[tuple[int, int]]:
    """Maximal runs of consecutive ascending positions, in the given order, as [begin, end)."""
    if len(positions) == 0:
        return []
    breaks = np.flatnonzero(np.diff(positions) != 1) + 1
    firsts = np.concatenate([[0], breaks])
    lasts = np.concatenate([breaks, [len(positions)]])
    return [(int(positions[a]), int(positions[b - 1]) + 1) for a, b in zip(firsts, lasts, strict=True)]


class ShardSpace:
    """One output's epoch: its shards in stored order, or shuffled by (seed, epoch); records in
    stored order. Position p is the p-th record of that sequence."""

    def __init__(self, dataset: ShardDataset, seed: Any, shuffle: bool) -> None:
        self.dataset = dataset
        self.remote = dataset.remote is not None
        self.order = list(range(len(dataset.manifest.shards)))
        if shuffle:
            np.random.default_rng(seed).shuffle(self.order)
        self.counts = [dataset.manifest.shards[shard].count for shard in self.order]
        self.starts = np.cumsum([0, *self.counts])

    def read(self, positions: np.ndarray) -> Iterator[Item | None]:
        """An item per position, in the order given; runs of consecutive positions are read as
        streams, so a shard is read sequentially."""
        for begin, end in runs(positions):
            for shard, start, stop in record_ranges(self.order, self.counts, begin, end):
                read = 0
                for record in self.dataset._range(shard, start, stop):
                    read += 1
                    yield Item(self.dataset, shard, record)
                for _ in range(stop - start - read):  # a damaged shard, skipped: the positions still count
                    yield None

    def shards(self, positions: np.ndarray) -> list[tuple[ShardDataset, int]]:
        at = np.searchsorted(self.starts, positions, side="right") - 1
        return [(self.dataset, self.order[i]) for i in dict.fromkeys(at.tolist())]


def read_block(space: Space, positions: np.ndarray, ordered: bool) -> Iterator[Item | None]:
    """The items of one block in its order. A shuffled block is read in ascending positions (each
    shard sequentially) and held, then emitted in the block's order: the memory the old shuffle
    buffer took."""
    if ordered or len(positions) < 2:
        yield from space.read(positions)
        return
    ascending = np.unique(positions)
    items = list(space.read(ascending))
    for at in np.searchsorted(ascending, positions).tolist():
        yield items[at]


def stream_items(space: Space, stream: Stream, done: int) -> Iterator[Item | None]:
    """What a stream still yields after `done`. From object storage, the shards of the next block
    download in the background meanwhile, and a shard the next block does not read is closed (the
    cache may then evict it)."""
    blocks = stream.blocks_from(done)
    if not space.remote:  # local files: nothing to fetch ahead or to let go of
        for positions in blocks:
            yield from read_block(space, positions, not stream.shuffle)
        return
    upcoming = next(blocks, None)
    needed = space.shards(upcoming) if upcoming is not None else []
    while upcoming is not None:
        positions, shards = upcoming, needed
        upcoming = next(blocks, None)
        needed = space.shards(upcoming) if upcoming is not None else []
        _prefetch(needed)
        yield from read_block(space, positions, not stream.shuffle)
        keep = {(id(dataset), shard) for dataset, shard in needed}
        for dataset, shard in shards:
            if dataset.remote is not None and (id(dataset), shard) not in keep:
                dataset._readers[shard].close()


def _prefetch(shards: list[tuple[ShardDataset, int]]) -> None:
    by_dataset: dict[int, tuple[ShardDataset, list[int]]] = {}
    for dataset, shard in shards:
        if dataset.remote is not None:
            by_dataset.setdefault(id(dataset), (dataset, []))[1].append(shard)
    for dataset, wanted in by_dataset.values():
        assert dataset.remote is not None
        dataset.remote.prefetch([dataset._shard_id(s) for s in wanted[: dataset.remote.ahead]])


class Cursor(NamedTuple):
    """Where this process's stream is: the progress it advances, its split and worker."""

    progress: Progress
    split: int
    worker: int  # the worker stream's number (not always the DataLoader worker's id: see Split.turn)
    stream: Stream

    @property
    def done(self) -> int:
        count = self.progress.splits[self.split].done[self.worker]
        assert count is not None
        return count

    def advance(self, count: int = 1) -> None:
        layout = self.progress.splits[self.split]
        layout.done[self.worker] = self.done + count


def cursor(owner: Any, progress: Progress, workers: tuple[int, int] | None = None) -> Cursor:
    """This rank's and worker's stream of `progress`, the split started or continued (`owner` is a
    ShardDataset or a MixedDataset: its rank, world_size and drop_last)."""
    rank, world = rank_and_world(owner.rank, owner.world_size)
    worker, count = workers if workers is not None else worker_slot()
    split, sequence = progress.start(world, count, owner.drop_last)
    mine = (worker + progress.splits[split].turn) % count  # the stream whose turn this worker serves
    return Cursor(progress, split, mine, progress.stream(split, sequence, rank, mine))


def check_sizes(progress: Progress, sizes: list[int]) -> None:
    """A state resumes only the data it was saved on (the same records per source)."""
    if progress.sizes != sizes:
        raise ConfigError(
            f"this state was saved on {_records(progress.sizes)}, this dataset has {_records(sizes)}: "
            "a state resumes the data it was saved on"
        )


def _records(sizes: list[int]) -> str:
    return " + ".join(f"{n:,}" for n in sizes) + " records"


def decoded(position: Cursor, items: Iterator[Item | None], on_error: str) -> Iterator[Any]:
    """Samples of a stream's items, each position counted as it is handed out."""
    for item in items:
        position.advance()
        if item is None:
            continue
        try:
            yield item.dataset._finish(item.record, item.shard_name)
        except ShardReadError:
            if on_error == "raise":
                raise
            item.dataset.skipped += 1
