"""The batch loader's read stage: the epoch's stream of items (readers/epoch.py, read as it is pulled)
cut into chunks of `batch_size` positions, each numbered (its windows' seed) and decoded as one
batch (readers/decoding.py). A position whose shard was skipped as damaged is in no chunk's items,
but still counts among its positions, so the chunks, their numbers and their windows are the same
whatever was skipped."""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

from .epoch import EpochRecord


class Chunk(NamedTuple):
    number: int  # its place in the stream, counted from the stream's first chunk
    positions: int  # the stream positions it covers: batch_size, or fewer for the stream's last
    items: list[EpochRecord]  # the items read at them, in order
    offsets: list[int]  # each item's place among its positions


def chunks(items: Iterator[EpochRecord | None], batch_size: int, first: int, short_tail: bool) -> Iterator[Chunk]:
    """The chunks of `items`, numbered from `first`. The stream's last chunk may be shorter; it is
    read only where `short_tail` says so (drop_last drops it, unless records are skipped: only then
    can its records fill a batch, readers/batch.py)."""
    chunk: list[EpochRecord] = []
    offsets: list[int] = []
    positions, number = 0, first
    for item in items:
        if item is not None:
            chunk.append(item)
            offsets.append(positions)
        positions += 1
        if positions == batch_size:
            yield Chunk(number, positions, chunk, offsets)
            chunk, offsets, positions, number = [], [], 0, number + 1
    if positions and short_tail:
        yield Chunk(number, positions, chunk, offsets)
