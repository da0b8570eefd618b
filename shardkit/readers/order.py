"""The epoch's order and where an iteration stands in it: pure functions of (seed, epoch) and small
counts, so a run can stop anywhere and resume exactly, or on another number of ranks.

An epoch is a sequence of positions 0..total-1 (a position is a record: shards in stored or seeded
order, records in stored order; for a mix, a weighted draw from its sources). A *split* cuts what
is left of the epoch into one contiguous run per rank and per DataLoader worker. Each run is read
as a *stream* of blocks: with shuffling, a run is cut into lanes (LANES or more, lanes_for; each
starting at a shard's first record where one is near, lane_starts) and block j takes the same share
of every lane, about `buffer` positions in all, emitted in a permutation seeded by (seed, epoch,
split, rank, worker, j). Reads stay sequential within each lane (so within each shard), a block
holds what the old shuffle buffer held, and consecutive samples come from LANES far-apart places of
the run (the old buffer drew from the last ~buffer records of one place). Where a stream stands
is one count, the positions it has yielded; the rest follows from the functions here, so nothing
consumed is read again on resume.

`Progress` is that state: the epoch, the seed, and per split the layout (world size, workers) and
each worker stream's count, the same on every rank (ranks train in lock step, so rank 0's state is
enough). Resuming with the layout of the last split continues its streams where they stood;
resuming with another layout subtracts what every stream of every split consumed and splits the
remaining positions anew (a new split). All of it is JSON: ints, bools and lists.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..core.errors import ConfigError

LANES = 8  # the fewest places of a run one shuffled block draws from
MAX_LANES = 256  # the most: each lane is a shard open at once (a descriptor, a cached remote shard)


def lanes_for(buffer: int, positions_per_shard: float) -> int:
    """Lanes for a buffer: pieces of about a quarter shard, so a block of `buffer` records spans
    ~4 * buffer / shard-size shards, twice the ~2 * buffer / shard-size the old shuffle buffer's
    exponential window did (measured by scripts/bench_resume.py --only quality)."""
    wanted = math.ceil(4 * buffer / max(1.0, positions_per_shard))
    return max(LANES, min(MAX_LANES, wanted))


STATE_FORMAT = "shardkit.progress/1"

Span = tuple[int, int]  # positions [begin, end)


def span_length(spans: list[Span]) -> int:
    return sum(end - begin for begin, end in spans)


def take(spans: list[Span], begin: int, end: int) -> list[Span]:
    """Items [begin, end) of the sequence `spans` laid end to end; items past its length wrap around
    to its start (the repeats an uneven split of an epoch among ranks needs)."""
    total = span_length(spans)
    starts = np.cumsum([0, *(e - b for b, e in spans)]).tolist()
    out: list[Span] = []
    at = begin
    while total and at < end:
        within = at % total
        i = bisect.bisect_right(starts, within) - 1
        while spans[i][1] == spans[i][0]:  # an empty span shares its start with the next one
            i += 1
        first = spans[i][0] + within - starts[i]
        count = min(end - at, spans[i][1] - first)
        out.append((first, first + count))
        at += count
    return out


def span_positions(spans: list[Span]) -> np.ndarray:
    if not spans:
        return np.zeros(0, np.int64)
    return np.concatenate([np.arange(begin, end, dtype=np.int64) for begin, end in spans])


def merged(spans: list[Span]) -> list[Span]:
    """Sorted, disjoint and non-adjacent: the same set of positions."""
    out: list[Span] = []
    for begin, end in sorted(s for s in spans if s[1] > s[0]):
        if out and begin <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((begin, end))
    return out


def subtract(spans: list[Span], removed: list[Span]) -> list[Span]:
    """The positions of merged `spans` not in `removed`, sorted."""
    out: list[Span] = []
    cut = merged(removed)
    i = 0
    for begin, end in merged(spans):
        at = begin
        while i < len(cut) and cut[i][1] <= at:
            i += 1
        j = i
        while j < len(cut) and cut[j][0] < end:
            if cut[j][0] > at:
                out.append((at, cut[j][0]))
            at = max(at, cut[j][1])
            j += 1
        if at < end:
            out.append((at, end))
    return out


def runs(positions: np.ndarray) -> list[Span]:
    """Maximal runs of consecutive ascending positions, in the given order."""
    if len(positions) == 0:
        return []
    breaks = np.flatnonzero(np.diff(positions) != 1) + 1
    firsts = np.concatenate([[0], breaks])
    lasts = np.concatenate([breaks, [len(positions)]])
    return [(int(positions[a]), int(positions[b - 1]) + 1) for a, b in zip(firsts, lasts, strict=True)]


def as_spans(positions: np.ndarray) -> list[Span]:
    """Spans of sorted positions (consecutive runs joined)."""
    return runs(np.unique(positions))


def run_offsets(run: list[Span], cuts: np.ndarray) -> np.ndarray:
    """Where in `run` (spans laid end to end) the sorted positions `cuts` fall, ascending."""
    if not run or not len(cuts):
        return np.zeros(0, np.int64)
    spans = np.asarray(run, np.int64).reshape(-1, 2)
    begins, lengths = spans[:, 0], spans[:, 1] - spans[:, 0]
    at = np.cumsum(lengths) - lengths  # each span's offset in the run
    first, counts = np.searchsorted(cuts, begins), np.searchsorted(cuts, spans[:, 1]) - np.searchsorted(cuts, begins)
    owner = np.repeat(np.arange(len(spans)), counts)
    within = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    starts: np.ndarray = cuts[np.repeat(first, counts) + within] - begins[owner] + at[owner]
    return starts


def lane_starts(run: list[Span], lanes: int, cuts: np.ndarray | None) -> list[int]:
    """Where each lane of `run` starts (and the run's end): equal lanes, each boundary moved to the
    nearest of `cuts` (positions where a shard starts) within a lane's length, so a lane starts at
    a shard's first record (two boundaries may meet: a lane fewer). A tar read from inside has its
    headers walked from the start (or from where an earlier range stopped) first; at 8 equal lanes
    over 6 shards that walk took half the records of an epoch, twice (scripts/bench_resume.py
    --only throughput). With lanes longer than a shard, as in any large epoch, every boundary moves
    by at most half a shard."""
    n = span_length(run)
    ideal = [i * n // lanes for i in range(lanes + 1)]
    offsets = run_offsets(run, cuts) if cuts is not None and lanes > 1 else np.zeros(0, np.int64)
    if not len(offsets):
        return ideal
    reach = n / lanes
    starts = [0]
    for want in ideal[1:-1]:
        k = int(np.searchsorted(offsets, want))
        near = [int(offsets[i]) for i in (k - 1, k) if 0 <= i < len(offsets)]
        best = min(near, key=lambda offset: abs(offset - want))  # the lower of two as near
        starts.append(max(starts[-1], best if abs(best - want) <= reach else want))
    return [*starts, n]


class Stream:
    """One worker's run of one rank in one split, as the blocks it is read and emitted in: with
    shuffling, `lanes` lanes (lane_starts), block j taking the same share of each lane, so all
    lanes end in the last block."""

    def __init__(
        self,
        run: list[Span],
        shuffle: bool,
        buffer: int,
        key: tuple[int, ...],
        lanes: int = LANES,
        cuts: np.ndarray | None = None,
    ) -> None:
        self.run, self.shuffle, self.key = run, shuffle, key
        self.length = n = span_length(run)
        lanes = max(1, min(lanes, n)) if shuffle else 1
        quota = max(1, buffer // lanes)
        self.lane_starts = lane_starts(run, lanes, cuts)
        self.lengths = np.diff(self.lane_starts).astype(np.int64)
        self.blocks = blocks = -(-int(self.lengths.max(initial=0)) // quota)
        # lane i hands out its items [i_j, i_{j+1}) in block j, i_j = j * length_i // blocks
        done = (np.arange(blocks + 1, dtype=np.int64)[:, None] * self.lengths[None, :]) // max(1, blocks)
        self.ends = done.sum(axis=1)[1:].tolist()  # positions the stream has yielded after each block

    def _taken(self, lane: int, j: int) -> int:
        """Items of `lane` handed out in blocks before j."""
        return j * int(self.lengths[lane]) // self.blocks

    def block(self, j: int) -> np.ndarray:
        """Block j's positions in the order they are emitted."""
        parts = []
        for lane, lane_start in enumerate(self.lane_starts[:-1]):
            first, stop = lane_start + self._taken(lane, j), lane_start + self._taken(lane, j + 1)
            if first < stop:
                parts.append(span_positions(take(self.run, first, stop)))
        positions = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        if self.shuffle:
            positions = positions[np.random.default_rng((*self.key, j)).permutation(len(positions))]
        return positions

    def locate(self, done: int) -> tuple[int, int]:
        """(block, offset within it) of the stream's item number `done`."""
        if not 0 <= done <= self.length:
            raise ConfigError(f"a stream of {self.length:,} positions cannot have yielded {done:,}")
        j = bisect.bisect_right(self.ends, done)
        return j, done - (self.ends[j - 1] if j else 0)

    def blocks_from(self, done: int) -> Iterator[np.ndarray]:
        """The positions still to come after `done` were yielded, block by block."""
        j, offset = self.locate(done)
        for block in range(j, len(self.ends)):
            positions = self.block(block)
            yield positions[offset:] if block == j else positions

    def consumed(self, done: int) -> list[Span]:
        """The positions of the first `done` items (unsorted spans)."""
        j, offset = self.locate(done)
        out: list[Span] = []
        for lane, first in enumerate(self.lane_starts[:-1]):
            if j:
                out += take(self.run, first, first + self._taken(lane, j))
        if offset:
            out += as_spans(self.block(j)[:offset])
        return out


@dataclass
class Split:
    world: int
    workers: int
    drop_last: bool
    done: list[int | None]  # positions each worker stream has yielded, the same on every rank
    turn: int = 0  # DataLoader worker w reads stream (w + turn) % workers: whose turn it was (plain DataLoader)

    def per_rank(self, total: int) -> int:
        if self.world == 1:
            return total
        return total // self.world if self.drop_last else -(-total // self.world)


@dataclass
class Progress:
    """Where an iteration over one epoch stands: JSON-able (`to_state`), rebuilt by `from_state`."""

    epoch: int
    seed: int
    shuffle: bool
    buffer: int
    sizes: list[int]  # records per source (one for a dataset, one per source for a mix): a fingerprint
    total: int  # positions in the epoch
    splits: list[Split] = field(default_factory=list)
    lanes: int = LANES  # of a shuffled stream (lanes_for)

    def to_state(self, worker: int | None = None) -> dict[str, Any]:
        """The state; with `worker` (a DataLoader worker's id), only its stream's count of the last
        split is known (a DataLoader worker knows only its own)."""
        splits = []
        for index, split in enumerate(self.splits):
            done = list(split.done)
            if worker is not None and index == len(self.splits) - 1:
                mine = (worker + split.turn) % split.workers
                done = [count if i == mine else None for i, count in enumerate(done)]
            layout = {"world": split.world, "workers": split.workers, "drop_last": split.drop_last, "done": done}
            splits.append({**layout, "turn": split.turn} if split.turn else layout)
        return {
            "format": STATE_FORMAT, "epoch": self.epoch, "seed": self.seed, "shuffle": self.shuffle,
            "buffer": self.buffer, "lanes": self.lanes, "sizes": list(self.sizes), "total": self.total,
            "splits": splits,
        }  # fmt: skip

    @classmethod
    def from_state(cls, state: Any) -> Progress:
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise ConfigError("not a shardkit iteration state (state_dict() of a shardkit loader or dataset)")
        try:
            splits = [
                Split(
                    int(s["world"]),
                    int(s["workers"]),
                    bool(s["drop_last"]),
                    [None if c is None else int(c) for c in s["done"]],
                    int(s.get("turn", 0)),
                )
                for s in state["splits"]
            ]
            progress = cls(
                int(state["epoch"]), int(state["seed"]), bool(state["shuffle"]), int(state["buffer"]),
                [int(n) for n in state["sizes"]], int(state["total"]), splits, int(state["lanes"]),
            )  # fmt: skip
        except (KeyError, TypeError, ValueError) as error:
            raise ConfigError(f"a damaged shardkit iteration state ({type(error).__name__}: {error})") from None
        if (
            progress.buffer < 1
            or progress.total < 0
            or any(s.world < 1 or s.workers < 1 or len(s.done) != s.workers for s in splits)
        ):
            raise ConfigError("a damaged shardkit iteration state (bad counts)")
        return progress

    def stream_key(self, split: int, rank: int, worker: int) -> tuple[int, ...]:
        return (self.seed, self.epoch, split, rank, worker)

    # `cuts` below: the positions where a shard starts (sorted; None for none), which lanes start at
    # where they can (lane_starts). They follow from the data and (seed, epoch), so the state does
    # not carry them; the same cuts must come with every call on one epoch.

    def sequence(self, split: int, cuts: np.ndarray | None = None) -> list[Span]:
        """The positions split number `split` cut among ranks: the whole epoch for the first, what
        the earlier splits left for each later one."""
        spans = [(0, self.total)]
        for index in range(split):
            spans = subtract(spans, self.consumed(index, spans, cuts))
        return spans

    def consumed(self, split: int, sequence: list[Span], cuts: np.ndarray | None = None) -> list[Span]:
        """Every position the streams of split `split` yielded, on every rank."""
        layout = self.splits[split]
        if any(count is None for count in layout.done):
            raise ConfigError(
                "this state knows one DataLoader worker's position only, so it resumes with the same "
                "number of ranks and workers; for another layout, build the state from the number of "
                "batches consumed (ShardIterableDataset.state_from_batches)"
            )
        out: list[Span] = []
        for rank in range(layout.world):
            for worker in range(layout.workers):
                count = layout.done[worker]
                assert count is not None
                out += self.stream(split, sequence, rank, worker, cuts).consumed(count)
        return out

    def stream(
        self, split: int, sequence: list[Span], rank: int, worker: int, cuts: np.ndarray | None = None
    ) -> Stream:
        layout = self.splits[split]
        per_rank = layout.per_rank(span_length(sequence))
        run = take(sequence, rank * per_rank, (rank + 1) * per_rank)
        length = span_length(run)
        lo, hi = worker * length // layout.workers, (worker + 1) * length // layout.workers
        key = self.stream_key(split, rank, worker)
        return Stream(take(run, lo, hi), self.shuffle, self.buffer, key, self.lanes, cuts)

    def start(
        self, world: int, workers: int, drop_last: bool, cuts: np.ndarray | None = None
    ) -> tuple[int, list[Span]]:
        """The split an iteration with this layout goes on with, and the positions it cuts: the last
        split when the layout is unchanged, else a new split of what is left."""
        if self.splits:
            last = self.splits[-1]
            if (last.world, last.workers, last.drop_last) == (world, workers, drop_last):
                return len(self.splits) - 1, self.sequence(len(self.splits) - 1, cuts)
            sequence = self.sequence(len(self.splits), cuts)  # needs every stream's count of the last split
        else:
            sequence = [(0, self.total)]
        self.splits.append(Split(world, workers, drop_last, [0] * workers))
        return len(self.splits) - 1, sequence


def round_robin_counts(
    lengths: list[int], batches: int, batch_size: int, drop_last: bool = False
) -> tuple[list[int], int]:
    """Positions each worker stream (of `lengths`) has handed out after a DataLoader yielded
    `batches` batches, and whose turn is next: workers take turns one batch each, an exhausted
    worker drops out of the turn, each worker's last batch is short (or dropped with drop_last)."""
    if batch_size < 1 or batches < 0:
        raise ConfigError(f"batches must be >= 0 and batch_size >= 1, not {batches} and {batch_size}")
    per_worker = [n // batch_size if drop_last else -(-n // batch_size) for n in lengths]
    if batches > sum(per_worker):
        raise ConfigError(f"{batches:,} batches is more than this epoch has ({sum(per_worker):,})")
    rounds = 0  # turns every worker still in the turn took
    while rounds < max(per_worker, default=0) and sum(min(m, rounds + 1) for m in per_worker) <= batches:
        rounds += 1
    left = batches - sum(min(m, rounds) for m in per_worker)
    in_turn = [w for w, m in enumerate(per_worker) if m > rounds]  # serve in round `rounds`, in order
    taken = [min(m, rounds) + (1 if w in in_turn[:left] else 0) for w, m in enumerate(per_worker)]
    following = in_turn[left:] or [w for w, m in enumerate(per_worker) if m > rounds + 1] or [0]
    counts = [min(n, t * batch_size) for n, t in zip(lengths, taken, strict=True)]
    return counts, following[0]
