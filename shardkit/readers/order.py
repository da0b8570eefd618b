"""Where an iteration stands in its epoch: `Progress`, pure functions of (seed, epoch) and small
counts, so a run can stop anywhere and resume exactly, or on another number of ranks.

An epoch is a sequence of positions 0..total-1 (a position is a record: shards in stored or seeded
order, records in stored order; for a mix, a weighted draw from its sources). A *split* cuts what
is left of the epoch into one contiguous run per rank and per DataLoader worker, each read as a
stream of blocks (readers/stream.py). Where a stream stands is one count, the positions it has
yielded, so nothing consumed is read again on resume.

`Progress` is that state: the epoch, the seed, and per split the layout (world size, workers) and
each worker stream's count, the same on every rank (ranks train in lock step, so rank 0's state is
enough). The batch loader adds, to its one stream's split, a *carry* (a batch that took the first
records of the next chunk of positions: how many, and through which of its positions) and, when it
skips records on several ranks, the rank whose counts these are (readers/batch.py): format 2, which
is written only where a state holds either, so every other state stays format 1. Resuming with
the layout of the last split continues its streams where they stood; resuming with another layout
subtracts what every stream of every split consumed and splits the remaining positions anew (a new
split). All of it is JSON: ints, bools and lists (and a mix's weights). A state may have been
edited or saved on other data: `Progress.from_state` refuses a field out of range and
`Progress.check` one that does not fit the dataset it is loaded into, before anything is allocated
or read, each refusal a ConfigError naming the field.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..core.errors import ConfigError
from .intervals import Interval, interval_length, subtract, take
from .stream import LANES, MAX_LANES, Stream

SEED_LIMIT = 2**64 - 1  # seeds: numpy takes any whole number >= 0; torch's initial_seed() fits 64 bits
INT64 = 2**63 - 1  # epochs (the torch glue shares the epoch as an int64), counts and sizes
# The most streams (ranks x workers, every split of an epoch together) an epoch of fewer positions
# may have: resuming builds each stream of every earlier split, so a state's world is bounded by the
# work its epoch is worth, and a real cluster's (8,192 ranks of 8 workers) fits.
MAX_STREAMS = 2**16


def shown(value: Any) -> str:
    """A value from a state or an argument, short whatever it is (str() refuses ints of 4,300 digits)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"a {value.bit_length()}-bit number"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def whole(value: Any, name: str, low: int, high: int, what: str = "") -> int:
    """`value` if it is an int (not a bool) from `low` to `high`, else a ConfigError naming `name`."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        bound = "2**64-1" if high == SEED_LIMIT else "2**63-1" if high == INT64 else f"{high:,}"
        raise ConfigError(f"{what}{name} must be a whole number from {low:,} to {bound}, not {shown(value)}")
    return value


def check_seed(seed: Any) -> int:
    return whole(seed, "seed", 0, SEED_LIMIT)


def check_epoch(epoch: Any) -> int:
    return whole(epoch, "epoch", 0, INT64)


def check_buffer(buffer: Any) -> int:
    """A shuffle buffer (below 1 taken as 1), at most what a state keeps (`from_state`)."""
    return max(1, whole(buffer, "shuffle_buffer", -INT64 - 1, INT64))


STATE_FORMAT = "shardkit.progress/1"
STATE_FORMAT_CARRY = "shardkit.progress/2"  # format 1 and a split's carry or rank (read as both)


@dataclass
class Split:
    world: int
    workers: int
    drop_last: bool
    done: list[int | None]  # positions each worker stream has yielded, the same on every rank
    turn: int = 0  # DataLoader worker w reads stream (w + turn) % workers: whose turn it was (plain DataLoader)
    # The batch loader's (one stream, workers == 1): (taken, through), its kept records of the chunk
    # starting at `done` that batches already took, and the positions of that chunk they reach
    # (readers/batch.py); None when the last batch ended with a chunk.
    carry: tuple[int, int] | None = None
    # The rank whose counts these are, where the loader skips records on several ranks: each rank
    # then reads its own number of positions, so a state resumes its own rank of the same layout.
    rank: int | None = None

    def per_rank(self, total: int) -> int:
        if self.world == 1:
            return total
        return total // self.world if self.drop_last else -(-total // self.world)

    def consumed_count(self, worker: int) -> int | None:
        """Positions of worker stream `worker` that are used up: its count, and its carry's (what a
        new split leaves out; records of the carry's chunk past them are read again)."""
        count = self.done[worker]
        if count is None or self.carry is None:
            return count
        return count + self.carry[1]


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
    weights: list[float] | None = None  # a mix's share of each source (None for one output): a fingerprint
    selection: str | None = None  # the subset read (readers/subset's hash; None for whole outputs): a fingerprint
    # each source's version and the start of its manifest's checksum ("2:<16 hex>", "1" for a first
    # version; None while every source is at its first): a fingerprint. Two changes of one output
    # may make two different version 2s: the checksum tells them apart.
    versions: list[str] | None = None

    def to_state(self, worker: int | None = None) -> dict[str, Any]:
        """The state; with `worker` (a DataLoader worker's id), only its stream's count of the last
        split is known (a DataLoader worker knows only its own)."""
        splits = []
        for index, split in enumerate(self.splits):
            done = list(split.done)
            if worker is not None and index == len(self.splits) - 1:
                mine = (worker + split.turn) % split.workers
                done = [count if i == mine else None for i, count in enumerate(done)]
            layout: dict[str, Any] = {
                "world": split.world, "workers": split.workers, "drop_last": split.drop_last, "done": done,
            }  # fmt: skip
            if split.turn:
                layout["turn"] = split.turn
            if split.carry is not None:
                layout["carry"] = {"taken": split.carry[0], "through": split.carry[1]}
            if split.rank is not None:
                layout["rank"] = split.rank
            splits.append(layout)
        carries = any(split.carry is not None or split.rank is not None for split in self.splits)
        state = {
            "format": STATE_FORMAT_CARRY if carries else STATE_FORMAT, "epoch": self.epoch, "seed": self.seed,
            "shuffle": self.shuffle,
            "buffer": self.buffer, "lanes": self.lanes, "sizes": list(self.sizes), "total": self.total,
            "splits": splits,
        }  # fmt: skip
        if self.selection is not None:
            state["selection"] = self.selection
        if self.versions is not None:
            state["versions"] = list(self.versions)
        return state if self.weights is None else {**state, "weights": list(self.weights)}

    @classmethod
    def from_state(cls, state: Any) -> Progress:
        """The progress a state describes, every field checked for its type and range (a state may
        have been edited); `check` then fits it to the dataset it is loaded into."""
        if not isinstance(state, dict) or state.get("format") not in (STATE_FORMAT, STATE_FORMAT_CARRY):
            raise ConfigError("not a shardkit iteration state (state_dict() of a shardkit loader or dataset)")
        try:
            splits = [_split(s, last=i == len(state["splits"]) - 1) for i, s in enumerate(_listed(state, "splits"))]
            sizes = [whole(n, "sizes", 0, INT64) for n in _listed(state, "sizes")]
            progress = cls(
                check_epoch(state["epoch"]), check_seed(state["seed"]), _flag(state, "shuffle"),
                whole(state["buffer"], "buffer", 1, INT64), sizes, whole(state["total"], "total", 0, INT64),
                splits, whole(state["lanes"], "lanes", 1, MAX_LANES), _weights(state.get("weights")),
                _selection(state.get("selection")), _versions(state.get("versions")),
            )  # fmt: skip
        except KeyError as error:
            raise ConfigError(f"a damaged shardkit iteration state: no {shown(error.args[0])}") from None
        except ConfigError as error:
            raise ConfigError(f"a damaged shardkit iteration state: {error}") from None
        return progress

    def check(self, fresh: Progress, total: int, cuts: np.ndarray | None) -> None:
        """Refuses this progress (from a state) unless it fits the dataset whose fresh progress is
        `fresh` and whose epoch (this progress's seed and epoch) has `total` positions, with shards
        starting at `cuts`: the same records and mix, a split's streams bounded by the epoch, each
        stream's count within its stream. Bounded work: about what resuming does anyway."""
        # the version first: a state of a version that took records out has other sizes too
        if self.versions != fresh.versions:
            raise ConfigError(
                f"this state was saved on {_versioned(self.versions)}, this dataset is {_versioned(fresh.versions)}: "
                "a state resumes the version it was saved on (open_shards(..., version=) is not supported yet)"
            )
        # the subset next: a state of another subset most often has other sizes too
        if self.selection != fresh.selection:
            said = "the whole output" if self.selection is None else f"selection {self.selection}"
            this = "the whole output" if fresh.selection is None else f"selection {fresh.selection}"
            raise ConfigError(
                f"this state was saved on {said}, this dataset reads {this}: a state resumes its own subset"
            )
        if self.sizes != fresh.sizes:
            raise ConfigError(
                f"this state was saved on {_records(self.sizes)}, this dataset has {_records(fresh.sizes)}: "
                "a state resumes the data it was saved on"
            )
        if self.weights != fresh.weights:
            said = "one output" if self.weights is None else f"a mix of weights {shown(self.weights)}"
            this = "one output" if fresh.weights is None else f"a mix of weights {shown(fresh.weights)}"
            raise ConfigError(f"this state was saved on {said}, this dataset is {this}: a state resumes its own mix")
        if self.total != total:
            raise ConfigError(
                f"this state's total is {self.total:,} positions, this dataset's epoch has {total:,}: "
                "a state resumes the epoch it was saved in (a mix: the same length)"
            )
        streams = 0
        for layout in self.splits:
            streams += layout.world * layout.workers
            if streams > max(self.total, MAX_STREAMS):
                raise ConfigError(
                    f"this state's splits have {streams:,} streams (world x workers) for an epoch of "
                    f"{self.total:,} positions: a damaged world or workers"
                )
        self.check_counts(cuts)

    def check_counts(self, cuts: np.ndarray | None = None) -> None:
        """Refuses a split whose stream counts (`done`) go past their streams."""
        sequence = [(0, self.total)]
        for index, layout in enumerate(self.splits):
            per_rank = layout.per_rank(interval_length(sequence)) if sequence else 0
            for worker in range(layout.workers):
                count = layout.consumed_count(worker)
                length = (worker + 1) * per_rank // layout.workers - worker * per_rank // layout.workers
                if count is not None and count > length:
                    raise ConfigError(
                        f"this state's done counts {count:,} positions of worker stream {worker} of split "
                        f"{index}, which has {length:,}"
                    )
            if index < len(self.splits) - 1:
                sequence = subtract(sequence, self.consumed(index, sequence, cuts))

    def stream_key(self, split: int, rank: int, worker: int) -> tuple[int, ...]:
        return (self.seed, self.epoch, split, rank, worker)

    # `cuts` below: the positions where a shard starts (sorted; None for none), which lanes start at
    # where they can (lane_starts). They follow from the data and (seed, epoch), so the state does
    # not carry them; the same cuts must come with every call on one epoch.

    def sequence(self, split: int, cuts: np.ndarray | None = None) -> list[Interval]:
        """The positions split number `split` cut among ranks: the whole epoch for the first, what
        the earlier splits left for each later one."""
        intervals = [(0, self.total)]
        for index in range(split):
            intervals = subtract(intervals, self.consumed(index, intervals, cuts))
        return intervals

    def consumed(self, split: int, sequence: list[Interval], cuts: np.ndarray | None = None) -> list[Interval]:
        """Every position the streams of split `split` yielded, on every rank."""
        layout = self.splits[split]
        if any(count is None for count in layout.done):
            raise ConfigError(
                "this state knows one DataLoader worker's position only, so it resumes with the same "
                "number of ranks and workers; for another layout, build the state from the number of "
                "batches consumed (ShardIterableDataset.state_from_batches)"
            )
        out: list[Interval] = []
        for rank in range(layout.world):
            for worker in range(layout.workers):
                count = layout.consumed_count(worker)
                assert count is not None
                out += self.stream(split, sequence, rank, worker, cuts).consumed(count)
        return out

    def stream(
        self, split: int, sequence: list[Interval], rank: int, worker: int, cuts: np.ndarray | None = None
    ) -> Stream:
        layout = self.splits[split]
        per_rank = layout.per_rank(interval_length(sequence))
        run = take(sequence, rank * per_rank, (rank + 1) * per_rank)
        length = interval_length(run)
        lo, hi = worker * length // layout.workers, (worker + 1) * length // layout.workers
        key = self.stream_key(split, rank, worker)
        return Stream(take(run, lo, hi), self.shuffle, self.buffer, key, self.lanes, cuts)

    def start(
        self, world: int, workers: int, drop_last: bool, cuts: np.ndarray | None = None
    ) -> tuple[int, list[Interval]]:
        """The split an iteration with this layout goes on with, and the positions it cuts: the last
        split when the layout is unchanged, else a new split of what is left."""
        if self.splits:
            last = self.splits[-1]
            if (last.world, last.workers, last.drop_last) == (world, workers, drop_last):
                return len(self.splits) - 1, self.sequence(len(self.splits) - 1, cuts)
            self.check_layout(world, workers, drop_last)
            if last.carry is not None:  # the new split takes the carry's positions as used
                last.done, last.carry = [last.consumed_count(0)], None
        streams = sum(s.world * s.workers for s in self.splits) + world * workers
        if streams > max(self.total, MAX_STREAMS):
            raise ConfigError(
                f"{world:,} ranks of {workers:,} workers make {streams:,} streams for an epoch of "
                f"{self.total:,} positions (at most {MAX_STREAMS:,} or one per position)"
            )
        # a new split cuts what every stream of the earlier ones left (needs each one's count)
        sequence = self.sequence(len(self.splits), cuts) if self.splits else [(0, self.total)]
        self.splits.append(Split(world, workers, drop_last, [0] * workers))
        return len(self.splits) - 1, sequence

    def check_layout(self, world: int, workers: int, drop_last: bool, rank: int | None = None) -> None:
        """Refuses to resume a state that is one rank's (its last split's `rank`) on another rank
        or another layout: the other ranks' counts, which a new split needs, are not in it."""
        last = self.splits[-1] if self.splits else None
        if last is None or last.rank is None:
            return
        if (last.world, last.workers, last.drop_last) != (world, workers, drop_last):
            raise ConfigError(
                f"this state is rank {last.rank}'s of {last.world} ranks whose loaders skip records "
                f'(on_error="skip"), each having read its own number of positions: it resumes on '
                f"{last.world} ranks, each from the state it saved"
            )
        if rank is not None and rank != last.rank:
            raise ConfigError(
                f'this state is rank {last.rank}\'s, loaded on rank {rank}: with on_error="skip" each '
                "rank reads its own number of positions, so each rank resumes from the state it saved"
            )


def _listed(state: dict[str, Any], name: str) -> list[Any]:
    value = state[name]
    if not isinstance(value, list):
        raise ConfigError(f"{name} must be a list, not {shown(value)}")
    return value


def _flag(state: dict[str, Any], name: str) -> bool:
    value = state[name]
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be true or false, not {shown(value)}")
    return value


def _split(state: Any, last: bool) -> Split:
    """One split of a state: its layout in range, a count per worker (unknown, None, only in the last
    split: a DataLoader worker's state)."""
    if not isinstance(state, dict):
        raise ConfigError(f"a split must be an object, not {shown(state)}")
    world, workers = whole(state["world"], "world", 1, INT64), whole(state["workers"], "workers", 1, INT64)
    done = _listed(state, "done")
    if len(done) != workers:
        raise ConfigError(f"a split of {workers:,} workers has {len(done):,} done counts")
    counts = [None if last and count is None else whole(count, "done", 0, INT64) for count in done]
    turn = whole(state.get("turn", 0), "turn", 0, workers - 1)
    carry, rank = _carry(state.get("carry"), last, workers), state.get("rank")
    if rank is not None:
        if not last:
            raise ConfigError("only the last split is one rank's (rank)")
        rank = whole(rank, "rank", 0, world - 1)
    return Split(world, workers, _flag(state, "drop_last"), counts, turn, carry, rank)


def _carry(value: Any, last: bool, workers: int) -> tuple[int, int] | None:
    """A split's carry: `taken` records of a chunk, which reach `through` of its positions (each
    record is a position of its own, so taken <= through); the batch loader's, in the last split."""
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) != {"taken", "through"}:
        raise ConfigError(f"carry must be an object of taken and through, not {shown(value)}")
    if not last or workers != 1:
        raise ConfigError("a carry belongs to the batch loader's split, the last one, of one worker stream")
    through = whole(value["through"], "carry through", 1, INT64)
    return whole(value["taken"], "carry taken", 1, through), through


def _weights(value: Any) -> list[float] | None:
    """A mix's shares, each a number from 0 to 1 (None for one output)."""
    if value is None:
        return None
    if not isinstance(value, list) or not all(
        isinstance(w, float) and 0 <= w <= 1 for w in value
    ):  # (NaN fails 0 <= w)
        raise ConfigError(f"weights must be a list of shares from 0 to 1, not {shown(value)}")
    return value


def _selection(value: Any) -> str | None:
    """A subset's identity: a short hex text (None for whole outputs)."""
    if value is None:
        return None
    if not isinstance(value, str) or not 0 < len(value) <= 64 or not value.isalnum():
        raise ConfigError(f"selection must be a subset's hash, not {shown(value)}")
    return value


def _versions(value: Any) -> list[str] | None:
    """Each source's version and manifest (None where all are at their first)."""
    if value is None:
        return None
    if (
        not isinstance(value, list)
        or not value
        or not all(isinstance(v, str) and re.fullmatch(r"[1-9]\d{0,9}(:[0-9a-f]{16})?", v) for v in value)
    ):
        raise ConfigError(f"versions must be a list of versions of outputs, not {shown(value)}")
    return value


def version_mark(version: int, checksum: str) -> str:
    """A source's entry of `Progress.versions`."""
    return str(version) if version == 1 else f"{version}:{checksum[:16]}"


def _versioned(versions: list[str] | None) -> str:
    if versions is None:
        return "version 1"
    shown_ = [v.replace(":", " (manifest ") + ("...)" if ":" in v else "") for v in versions]
    return ("versions " if len(versions) > 1 else "version ") + " + ".join(shown_)


def _records(sizes: list[int]) -> str:
    return " + ".join(f"{n:,}" for n in sizes) + " records"


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
