"""One worker's stream of an epoch: its run of positions read as blocks. With shuffling, a run is
cut into lanes (LANES or more, `lanes_for`; each starting at a shard's first record where one is
near, `lane_starts`) and block j takes the same share of every lane, emitted in a permutation
seeded by the stream's key and j. Reads stay sequential within each lane, so within each shard,
while consecutive samples come from far-apart places of the run. Where a stream stands is one
count, the positions it has yielded: the rest follows from the functions here."""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np

from ..core.errors import ConfigError
from .intervals import Interval, as_intervals, interval_length, interval_positions, run_offsets, take

LANES = 8  # the fewest places of a run one shuffled block draws from
MAX_LANES = 256  # the most: each lane is a shard open at once (a descriptor, a cached remote shard)


def lanes_for(buffer: int, positions_per_shard: float) -> int:
    """Lanes for a buffer: pieces of about a quarter shard, so a block of `buffer` records draws
    from about 4 * buffer / shard-size shards."""
    wanted = math.ceil(4 * buffer / max(1.0, positions_per_shard))
    return max(LANES, min(MAX_LANES, wanted))


def lane_starts(run: list[Interval], lanes: int, cuts: np.ndarray | None) -> list[int]:
    """Where each lane of `run` starts (and the run's end): equal lanes, each boundary moved to the
    nearest of `cuts` (positions where a shard starts) within a lane's length, so a lane starts at
    a shard's first record (two boundaries may meet: a lane fewer): a tar read from inside has its
    headers walked from its start first. With lanes longer than a shard, as in any large epoch,
    every boundary moves by at most half a shard."""
    n = interval_length(run)
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
        run: list[Interval],
        shuffle: bool,
        buffer: int,
        key: tuple[int, ...],
        lanes: int = LANES,
        cuts: np.ndarray | None = None,
    ) -> None:
        self.run, self.shuffle, self.key = run, shuffle, key
        self.length = n = interval_length(run)
        lanes = max(1, min(lanes, n)) if shuffle else 1
        quota = max(1, buffer // lanes)
        self.lane_starts = lane_starts(run, lanes, cuts)
        self.lengths = np.diff(self.lane_starts).astype(np.int64)
        self.blocks = -(-int(self.lengths.max(initial=0)) // quota)
        self._lengths = [int(n) for n in self.lengths]  # Python ints: j * length overflows no int64

    def _taken(self, lane: int, j: int) -> int:
        """Items of `lane` handed out in blocks before j: lane i hands out its items [i_j, i_{j+1})
        in block j, i_j = j * length_i // blocks."""
        return j * self._lengths[lane] // self.blocks

    def end(self, j: int) -> int:
        """Positions the stream has yielded after its blocks before j, computed, never tabled (a
        buffer of 1 over a large epoch has a block per lane's record)."""
        return sum(j * n // self.blocks for n in self._lengths) if self.blocks else 0

    def block(self, j: int) -> np.ndarray:
        """Block j's positions in the order they are emitted."""
        parts = []
        for lane, lane_start in enumerate(self.lane_starts[:-1]):
            first, stop = lane_start + self._taken(lane, j), lane_start + self._taken(lane, j + 1)
            if first < stop:
                parts.append(interval_positions(take(self.run, first, stop)))
        positions = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        if self.shuffle:
            positions = positions[np.random.default_rng((*self.key, j)).permutation(len(positions))]
        return positions

    def locate(self, done: int) -> tuple[int, int]:
        """(block, offset within it) of the stream's item number `done`."""
        if not 0 <= done <= self.length:
            raise ConfigError(f"a stream of {self.length:,} positions cannot have yielded {done:,}")
        j, high = 0, self.blocks  # the last j with end(j) <= done (end grows with every block)
        while j < high:
            middle = (j + high + 1) // 2
            j, high = (middle, high) if self.end(middle) <= done else (j, middle - 1)
        return j, done - self.end(j)

    def blocks_from(self, done: int) -> Iterator[np.ndarray]:
        """The positions still to come after `done` were yielded, block by block."""
        j, offset = self.locate(done)
        for block in range(j, self.blocks):
            positions = self.block(block)
            yield positions[offset:] if block == j else positions

    def consumed(self, done: int) -> list[Interval]:
        """The positions of the first `done` items (unsorted intervals)."""
        j, offset = self.locate(done)
        out: list[Interval] = []
        for lane, first in enumerate(self.lane_starts[:-1]):
            if j:
                out += take(self.run, first, first + self._taken(lane, j))
        if offset:
            out += as_intervals(self.block(j)[:offset])
        return out
