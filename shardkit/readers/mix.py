"""Weighted mixing: `open_shards([a, b, c], weights=[0.6, 0.3, 0.1])` draws from several outputs.

Position p of a mix's epoch comes from source s with probability weights[s], drawn in chunks of
CHUNK positions by a generator seeded by (seed, epoch, chunk): a pure function of (seed, epoch), so
the mix splits among ranks and workers, stops and resumes (readers/order) like one output. The k-th
draw of source s is record k of that source's own epoch order; past the source's end (k >= its
length) the source starts again in a fresh order (exhausted="resample"), or the mix's epoch ends
before the first draw a source cannot serve (exhausted="stop"). A source's draws stay in its order,
so each source is read sequentially within its shards.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ..core.errors import ConfigError
from .epoch import EpochRecord, ShardSource, ShardSpace
from .iteration import EpochIteration
from .options import OpenOptions, ReadOptions
from .order import Progress, check_buffer, shown, version_mark
from .stream import lanes_for

if TYPE_CHECKING:
    from .box_classes import BoxClasses

CHUNK = 4096  # positions drawn per generator: the unit the draws are counted and cached in
# A mix keeps the shard orders of its sources' latest rounds up to this many shards, each order
# counted SPACE_COST more (its objects): a block reads a few rounds of each source, while a source
# smaller than the epoch has a round per pass over it (a 1-record source, one per draw), so keeping
# every round would grow memory with the positions.
SPACE_BUDGET = 2**16
SPACE_COST = 64
EXHAUSTED = ("resample", "stop")
_MIX = 0x6D6978  # keeps the draws' generator apart from every other seeded by (seed, epoch)


class Draws:
    """The sources of one epoch's positions: which source each comes from and its draw number."""

    def __init__(self, shares: np.ndarray, seed: tuple[int, int], positions: int) -> None:
        self.cdf = np.cumsum(shares)  # each source's share of the draws (MixedDataset.share)
        self.cdf[-1] = 1.0
        self.seed = seed
        self.chunks = -(-positions // CHUNK)
        self._cache: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()
        # Draws of each source before each chunk: one pass over the chunks.
        counts = np.zeros((self.chunks + 1, len(shares)), np.int64)
        for chunk in range(self.chunks):
            counts[chunk + 1] = counts[chunk] + np.bincount(self._choices(chunk), minlength=len(shares))
        self.before = counts

    def _choices(self, chunk: int) -> np.ndarray:
        """The source of each of the chunk's positions."""
        uniform = np.random.default_rng((*self.seed, _MIX, chunk)).random(CHUNK)
        return np.searchsorted(self.cdf, uniform, side="right").astype(np.int64)

    def _drawn(self, chunk: int) -> tuple[np.ndarray, np.ndarray]:
        """The chunk's sources, and per source its draws within the chunk before each offset."""
        cached = self._cache.get(chunk)
        if cached is None:
            choices = self._choices(chunk)
            earlier = np.zeros((len(self.cdf), CHUNK + 1), np.int64)
            earlier[:, 1:] = np.cumsum(choices[None, :] == np.arange(len(self.cdf))[:, None], axis=1)
            cached = self._cache[chunk] = (choices, earlier)
            while len(self._cache) > 16:
                self._cache.popitem(last=False)
        return cached

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, draw number of that source) of each position."""
        sources = np.zeros(len(positions), np.int64)
        draws = np.zeros(len(positions), np.int64)
        chunks = positions // CHUNK
        for chunk in np.unique(chunks).tolist():
            where = np.flatnonzero(chunks == chunk)
            choices, earlier = self._drawn(chunk)
            offsets = positions[where] - chunk * CHUNK
            picked = choices[offsets]
            sources[where] = picked
            draws[where] = self.before[chunk, picked] + earlier[picked, offsets]
        return sources, draws

    def first_short(self, sizes: Sequence[int]) -> int:
        """The first position whose draw a source of `sizes` records cannot serve (or the end)."""
        end = self.chunks * CHUNK
        for source, size in enumerate(sizes):
            chunk = int(np.searchsorted(self.before[:, source], size + 1, side="left")) - 1
            if chunk >= self.chunks:
                continue
            counted = self._drawn(chunk)[1][source, 1:]  # draws of the source up to each offset
            end = min(end, chunk * CHUNK + int(np.searchsorted(counted, size - self.before[chunk, source] + 1)))
        return end


class MixSource(ShardSource, Protocol):
    """What a mix needs of each of its outputs beyond reading an epoch of it
    (readers.dataset.ShardDataset, named here, not imported: the dataset imports the mix)."""

    folder: Path | str
    classes: list[str]
    max_pixels: int

    @property
    def selection(self) -> str | None:
        """The subset read (readers/subset's hash), None for the whole output."""
        ...

    def __len__(self) -> int: ...

    def close(self) -> None: ...

    def box_vocabulary(self, path: str) -> BoxClasses: ...

    def first_items(self) -> list[EpochRecord]: ...


class MixSpace:
    """A mix's epoch positions as records of its sources (each in its own epoch order, a fresh
    order for each time a source starts again)."""

    def __init__(self, mix: MixedDataset, progress: Progress) -> None:
        self.mix, self.progress = mix, progress
        self.remote = any(source.remote is not None for source in mix.sources)
        self.cuts: np.ndarray | None = None  # a source's shards start at scattered draws: lanes are cut evenly
        self.draws = mix.draws(progress.seed, progress.epoch)
        self._spaces: OrderedDict[tuple[int, int], ShardSpace] = OrderedDict()  # least recently used first
        self._kept_cost = 0  # the kept spaces' shards, each space counted SPACE_COST more

    def _space(self, source: int, round_: int) -> ShardSpace:
        """Round `round_` of a source's epoch order (a pure function of seed, epoch, source and
        round, so one let go is made again alike): the last few kept, within SPACE_BUDGET."""
        key = (source, round_ if self.progress.shuffle else 0)  # unshuffled, every round is stored order
        space = self._spaces.get(key)
        if space is not None:
            self._spaces.move_to_end(key)
            return space
        seed = (self.progress.seed, self.progress.epoch, source, round_)
        space = self._spaces[key] = ShardSpace(self.mix.sources[source], seed, self.progress.shuffle)
        self._kept_cost += len(space.order) + SPACE_COST
        while self._kept_cost > SPACE_BUDGET and len(self._spaces) > 1:
            _, oldest = self._spaces.popitem(last=False)
            self._kept_cost -= len(oldest.order) + SPACE_COST
        return space

    def _split(self, positions: np.ndarray) -> Iterator[tuple[ShardSpace, np.ndarray, np.ndarray]]:
        """(space, where in `positions`, record positions in that space), per source and round."""
        sources, draws = self.draws.locate(positions)
        for source, dataset in enumerate(self.mix.sources):
            where = np.flatnonzero(sources == source)
            if len(where) == 0:
                continue
            rounds, local = np.divmod(draws[where], len(dataset))
            for round_ in np.unique(rounds).tolist():
                chosen = rounds == round_
                yield self._space(source, round_), where[chosen], local[chosen]

    def read(self, positions: np.ndarray) -> Iterator[EpochRecord | None]:
        items: list[EpochRecord | None] = [None] * len(positions)
        for space, where, local in self._split(positions):
            for at, item in zip(where.tolist(), space.read(local), strict=True):
                items[at] = item
        yield from items

    def shards(self, positions: np.ndarray) -> list[tuple[ShardSource, int]]:
        return [pair for space, _, local in self._split(positions) for pair in space.shards(local)]


def _shares(weights: list[Any]) -> np.ndarray:
    """Each source's share of the draws: `weights` normalized, refused where that fails (a weight
    that is no finite number >= 0, all of them 0, a sum that overflows, a share that underflows to 0:
    a source with a weight that would never be drawn)."""
    if any(isinstance(w, bool) or not isinstance(w, int | float) or not math.isfinite(w) or w < 0 for w in weights):
        raise ConfigError(f"weights must be finite numbers >= 0, not {shown(weights)}")
    array = np.array(weights, np.float64)
    if not (array > 0).any():
        raise ConfigError("at least one weight must be above 0")
    with np.errstate(all="ignore"):
        share: np.ndarray = array / array.sum()
    if not np.isfinite(share).all() or ((share > 0) != (array > 0)).any():
        raise ConfigError(f"weights {shown(weights)} cannot be normalized (their sum overflows, or a share underflows)")
    return share


class MixedDataset(EpochIteration):
    """Several outputs drawn by weight (see open_shards): iterable, `loader()`, `iterable()`. Made
    from open_shards' options: the mix is shuffled, split and skips as they say; each source was
    opened with the same ones, unshuffled and unsplit."""

    def __init__(self, sources: Sequence[MixSource], options: ReadOptions, opening: OpenOptions) -> None:
        weights = [1.0] * len(sources) if opening.weights is None else list(opening.weights)
        if len(weights) != len(sources):
            raise ConfigError(f"{len(weights)} weights for {len(sources)} sources")
        share = _shares(weights)
        exhausted, length = opening.exhausted, opening.length
        if exhausted not in EXHAUSTED:
            raise ConfigError(f"exhausted must be 'resample' or 'stop', not {exhausted!r}")
        empty = [i for i, (source, w) in enumerate(zip(sources, weights, strict=True)) if w > 0 and len(source) == 0]
        if empty:
            raise ConfigError(f"source {empty[0]} ({sources[empty[0]].folder}) holds no records but has a weight")
        if length is not None and (isinstance(length, bool) or not isinstance(length, int) or length < 0):
            raise ConfigError(f"length must be a whole number >= 0, not {length!r}")
        self.sources = sources
        self.weights, self.share = np.array(weights, np.float64), share
        self.length = sum(len(s) for s in sources) if length is None else length
        self.exhausted = exhausted
        self.shuffle, self.seed, self.shuffle_buffer = (
            options.shuffle,
            options.seed,
            check_buffer(options.shuffle_buffer),
        )
        self.rank, self.world_size, self.drop_last = options.rank, options.world_size, options.drop_last
        self.on_error = options.handler
        self.epoch = 0
        self.max_pixels = min(s.max_pixels for s in sources)
        self.classes = [list(s.classes) for s in sources]  # labels are each source's own
        self._draws: tuple[tuple[int, int], Draws] | None = None

    def draws(self, seed: int, epoch: int) -> Draws:
        if self._draws is None or self._draws[0] != (seed, epoch):
            self._draws = ((seed, epoch), Draws(self.share, (seed, epoch), self.length))
        return self._draws[1]

    def epoch_length(self, seed: int, epoch: int) -> int:
        if self.exhausted == "stop":
            return min(self.length, self.draws(seed, epoch).first_short([len(s) for s in self.sources]))
        return self.length

    def __len__(self) -> int:
        """Samples in this epoch of the mix (with exhausted="stop", up to where a source ran out)."""
        return self.epoch_length(self.seed, self.epoch)

    def fresh_progress(self) -> Progress:
        sizes = [len(s) for s in self.sources]
        # a mix's positions per shard: a source's shard lasts its records / its share of the draws
        per_shard = min(
            len(s) / max(1, len(s.manifest.shards)) / w for s, w in zip(self.sources, self.share, strict=True) if w > 0
        )
        lanes = lanes_for(self.shuffle_buffer, per_shard)
        progress = Progress(self.epoch, self.seed, self.shuffle, self.shuffle_buffer, sizes, len(self), lanes=lanes)
        progress.weights = self.share.tolist()  # a state resumes only a mix of the same weights
        if any(source.manifest.version > 1 for source in self.sources):  # a state resumes only the versions it read
            progress.versions = [version_mark(s.manifest.version, s.manifest.checksum) for s in self.sources]
        selections = [source.selection for source in self.sources]
        if any(selection is not None for selection in selections):  # a state resumes only the subsets it read
            progress.selection = hashlib.sha256(repr(selections).encode()).hexdigest()[:16]
        return progress

    def space(self, progress: Progress) -> MixSpace:
        return MixSpace(self, progress)

    def box_classes(self, path: str) -> list[Any]:
        """The sorted distinct categories of column `path` over every record of every output of the
        mix (see ShardDataset.box_classes): one vocabulary for all of them."""
        return list(self.box_vocabulary(path).classes)

    def box_vocabulary(self, path: str) -> BoxClasses:
        from .box_classes import merged

        return merged([source.box_vocabulary(path) for source in self.sources], path)

    def first_items(self) -> list[EpochRecord]:
        """Each source's first record (readers.dataset.ShardDataset.first_items)."""
        return [item for source in self.sources for item in source.first_items()]

    @property
    def skipped(self) -> int:
        return sum(s.skipped for s in self.sources)

    def close(self) -> None:
        for source in self.sources:
            source.close()
