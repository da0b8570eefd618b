"""Reading an epoch: positions (readers/order, readers/stream) to records, block by block, for
iteration, the torch IterableDataset and the batch loader alike, over one dataset or a weighted
mix of several.

A *space* maps an epoch's positions to records: `ShardSpace` for one output (shards in stored or
seeded order), `readers.mix.MixSpace` for a mix. What it needs of an output is `ShardSource`, which
`readers.dataset.ShardDataset` implements: reads go through its `read_range`, so counts are checked
against the manifest and on_error applies; a position whose record could not be read (a damaged
shard, skipped) comes out as None, so positions are still counted.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import numpy as np

from ..core.errors import ShardReadError
from ..core.manifest import Manifest
from ..formats.base import Record
from .handlers import OnError
from .intervals import runs
from .order import Progress
from .split import rank_and_world, record_ranges, worker_slot
from .stream import Stream

if TYPE_CHECKING:
    from ..storage.remote import Remote
    from .box_classes import BoxClasses


class ShardSource(Protocol):
    """What reading an epoch needs of one output: its manifest, its records by range, a record made
    a sample, and for a remote output its shards fetched ahead and let go. Implemented by
    readers.dataset.ShardDataset (named here, not imported, so this module sits below it)."""

    manifest: Manifest
    counts: list[int]  # records per shard as read: the manifest's, or a subset's kept (readers/subset)
    remote: Remote | None  # None for a local output
    skipped: int  # records skipped under on_error="skip" (readers.handlers.OnError counts them)

    def read_range(self, shard: int, start: int = 0, stop: int | None = None) -> Iterator[Record]:
        """The records [start, stop) of a shard, in stored order; fewer when a damaged shard was skipped."""
        ...

    def decode_record(self, record: Record, shard_name: str) -> Any:
        """The sample made of a record (decoded, transformed); ShardReadError when it cannot be."""
        ...

    def prefetch(self, shards: Sequence[int]) -> None:
        """Starts fetching these shards of a remote output ahead of their reading."""
        ...

    def close_shard(self, shard: int) -> None:
        """Lets a shard go until it is read again."""
        ...


class EpochRecord(NamedTuple):
    dataset: ShardSource  # the output the record comes from (one of a mix's sources)
    shard: int
    record: Record

    @property
    def shard_name(self) -> str:
        return self.dataset.manifest.shards[self.shard].name


class Space(Protocol):
    remote: bool  # whether any of its shards comes through the cache from object storage
    cuts: np.ndarray | None  # positions where a shard starts, sorted (readers.stream.lane_starts)

    def read(self, positions: np.ndarray) -> Iterator[EpochRecord | None]: ...

    def shards(self, positions: np.ndarray) -> list[tuple[ShardSource, int]]: ...


class ShardSpace:
    """One output's epoch: its shards in stored order, or shuffled by (seed, epoch); records in
    stored order. Position p is the p-th record of that sequence."""

    def __init__(self, dataset: ShardSource, seed: Any, shuffle: bool) -> None:
        self.dataset = dataset
        self.remote = dataset.remote is not None
        self.order = list(range(len(dataset.manifest.shards)))
        if shuffle and len(self.order) > 1:
            np.random.default_rng(seed).shuffle(self.order)
        self.counts = [dataset.counts[shard] for shard in self.order]
        self.starts = np.cumsum([0, *self.counts])
        self.cuts: np.ndarray | None = self.starts[:-1]

    def read(self, positions: np.ndarray) -> Iterator[EpochRecord | None]:
        """An item per position, in the order given; runs of consecutive positions are read as
        streams, so a shard is read sequentially."""
        for begin, end in runs(positions):
            for shard, start, stop in record_ranges(self.order, self.counts, begin, end):
                read = 0
                for record in self.dataset.read_range(shard, start, stop):
                    read += 1
                    yield EpochRecord(self.dataset, shard, record)
                for _ in range(stop - start - read):  # a damaged shard, skipped: the positions still count
                    yield None

    def shards(self, positions: np.ndarray) -> list[tuple[ShardSource, int]]:
        at = np.searchsorted(self.starts, positions, side="right") - 1
        return [(self.dataset, self.order[i]) for i in dict.fromkeys(at.tolist())]


# Records a shuffled block hands out between reads of the next block's: small enough that a block
# frees about as many records as it makes meanwhile, large enough that the bookkeeping is amortized.
_STEP = 16


class _Reading:
    """A block's items being read in ascending positions (each shard sequentially), to be emitted in
    the block's order; a read error is kept until the block's turn comes."""

    def __init__(self, space: Space, positions: np.ndarray) -> None:
        ascending = np.unique(positions)
        self.emit = np.searchsorted(ascending, positions).tolist()  # the block's order, as indexes into items
        self.size = len(ascending)
        self.source = space.read(ascending)
        self.items: list[EpochRecord | None] = []
        self.error: Exception | None = None

    def fill(self, count: int) -> None:
        """Reads until `count` items are read (or an error)."""
        if self.error is None and len(self.items) < count:
            try:
                self.items.extend(itertools.islice(self.source, count - len(self.items)))
                if len(self.items) == self.size:
                    # run the reads to their end: what follows a shard's last record (the check
                    # that it holds no more, the mark where a tar walk stopped) runs only then
                    for _ in self.source:
                        raise ShardReadError("a block read more items than it has positions (a shardkit bug)")
            except Exception as error:
                self.error = error

    def ready(self) -> list[EpochRecord | None]:
        self.fill(self.size)
        if self.error is not None:
            raise self.error
        return self.items


def emitted(space: Space, blocks: Iterator[np.ndarray], shuffle: bool) -> Iterator[EpochRecord | None]:
    """The items of consecutive blocks in their order. A shuffled block is read in ascending
    positions and kept, then emitted in its order, and the next block is read meanwhile, one record
    for each handed out (each handed-out record is let go): the reader keeps about one block in
    memory. Reading the next block whole only once this one is freed would make the garbage
    collector run far more often and move blocks to its oldest generation, whose collections are
    slow in a process that imported torch."""
    if not shuffle:
        for positions in blocks:
            yield from space.read(positions)
        return
    first = next(blocks, None)
    if first is None:
        return
    reading = _Reading(space, first)
    while True:
        items = reading.ready()
        following = next(blocks, None)
        ahead = _Reading(space, following) if following is not None else None
        emit = reading.emit
        for begin in range(0, len(emit), _STEP):
            for at in emit[begin : begin + _STEP]:
                item, items[at] = items[at], None
                yield item
            if ahead is not None:
                ahead.fill((begin + _STEP) * ahead.size // len(emit))
        if ahead is None:
            return
        reading = ahead


def stream_items(space: Space, stream: Stream, done: int) -> Iterator[EpochRecord | None]:
    """What a stream still yields after `done`."""
    blocks = stream.blocks_from(done)
    return emitted(space, _fetched(space, blocks) if space.remote else blocks, stream.shuffle)


def _fetched(space: Space, blocks: Iterator[np.ndarray]) -> Iterator[np.ndarray]:
    """Blocks from object storage: as block k is asked for, the shards of block k + 1 start to
    download, and a shard that blocks k and k + 1 do not read is closed (the cache may then evict
    it). A consumer asks for block k once it has read every record of block k - 1 (`emitted`)."""
    current = next(blocks, None)
    needed = space.shards(current) if current is not None else []
    earlier: list[tuple[ShardSource, int]] = []
    while current is not None:
        following = next(blocks, None)
        upcoming = space.shards(following) if following is not None else []
        _prefetch(upcoming)
        _close_unneeded(earlier, needed + upcoming)
        yield current
        earlier, current, needed = needed, following, upcoming
    _close_unneeded(earlier, [])


def _close_unneeded(shards: list[tuple[ShardSource, int]], needed: list[tuple[ShardSource, int]]) -> None:
    keep = {(id(dataset), shard) for dataset, shard in needed}
    for dataset, shard in shards:
        if dataset.remote is not None and (id(dataset), shard) not in keep:
            dataset.close_shard(shard)


def _prefetch(shards: list[tuple[ShardSource, int]]) -> None:
    by_dataset: dict[int, tuple[ShardSource, list[int]]] = {}
    for dataset, shard in shards:
        if dataset.remote is not None:
            by_dataset.setdefault(id(dataset), (dataset, []))[1].append(shard)
    for dataset, wanted in by_dataset.values():
        dataset.prefetch(wanted)


class Epochs(Protocol):
    """What iterates an epoch, of one output or of a mix: readers.iteration.EpochIteration (named
    here, not imported, so that the batch loader and the torch glue, which it imports, sit below it)."""

    rank: int | None
    world_size: int | None
    drop_last: bool
    on_error: OnError
    epoch: int
    max_pixels: int

    def __len__(self) -> int: ...

    def epoch_length(self, seed: int, epoch: int) -> int: ...

    def set_epoch(self, epoch: int) -> None: ...

    def samples_per_rank(self) -> int: ...

    def fresh_progress(self) -> Progress: ...

    def space(self, progress: Progress) -> Space: ...

    def epoch_items(
        self, progress: Progress | None = None, workers: tuple[int, int] | None = None, carry: bool = False
    ) -> tuple[Cursor, Iterator[EpochRecord | None]]: ...

    def iterate(self, progress: Progress | None = None) -> Iterator[Any]: ...

    def box_vocabulary(self, path: str) -> BoxClasses: ...

    def first_items(self) -> list[EpochRecord]: ...


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

    @property
    def carry(self) -> tuple[int, int] | None:
        """The batch loader's part-used chunk at `done`: (records taken, positions they reach)."""
        return self.progress.splits[self.split].carry

    def advance(self, count: int = 1) -> None:
        """`count` more positions used up (and no part-used chunk after them)."""
        layout = self.progress.splits[self.split]
        layout.done[self.worker] = self.done + count
        layout.carry = None

    def carry_over(self, taken: int, through: int) -> None:
        """The chunk at `done` part-used: `taken` of its kept records handed out, reaching `through`
        of its positions (readers/batch.py)."""
        self.progress.splits[self.split].carry = (taken, through)


def cursor(
    owner: Epochs, progress: Progress, space: Space, workers: tuple[int, int] | None = None, carry: bool = False
) -> Cursor:
    """This rank's and worker's stream of `progress`, the split started or continued (`owner` is a
    ShardDataset or a MixedDataset: its rank, world_size and drop_last). `carry`: the caller is the
    batch loader, which resumes a carry itself; any other caller counts a carry's positions as used
    (what it read of them was handed out, or failed)."""
    rank, world = rank_and_world(owner.rank, owner.world_size)
    worker, count = workers if workers is not None else worker_slot()
    progress.check_layout(world, count, owner.drop_last, rank)
    split, sequence = progress.start(world, count, owner.drop_last, space.cuts)
    mine = (worker + progress.splits[split].turn) % count  # the stream whose turn this worker serves
    position = Cursor(progress, split, mine, progress.stream(split, sequence, rank, mine, space.cuts))
    carried = position.carry
    if carried is not None and not carry:
        position.advance(carried[1])
    return position


def check_progress(owner: Epochs, progress: Progress) -> Space:
    """Refuses a progress (from a state, which may have been edited or saved elsewhere) that does
    not fit `owner`'s data: readers.order.Progress.check, before anything is read. Returns the
    epoch's space it was checked against, for a caller that goes on to read it."""
    total = owner.epoch_length(progress.seed, progress.epoch)
    space = owner.space(progress)
    progress.check(owner.fresh_progress(), total, space.cuts)
    return space


def decoded(position: Cursor, items: Iterator[EpochRecord | None], on_error: OnError) -> Iterator[Any]:
    """Samples of a stream's items, each position counted as it is handed out."""
    for item in items:
        position.advance()
        if item is None:
            continue
        try:
            yield item.dataset.decode_record(item.record, item.shard_name)
        except ShardReadError as error:
            on_error(error, item.dataset)
