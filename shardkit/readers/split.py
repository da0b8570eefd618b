"""Who reads what: this process's rank and DataLoader worker, and a sequence of shards' positions as
record ranges. Plain functions over counts, shared by iteration, the batch loader and bench (the
epoch's order and resumable progress are readers/order)."""

from __future__ import annotations

import bisect
import sys

import numpy as np

from ..core.errors import ConfigError


def record_ranges(order: list[int], counts: list[int], begin: int, end: int) -> list[tuple[int, int, int]]:
    """Positions [begin, end) of the sequence of shards `order` (with record `counts`), as (shard,
    start, stop) ranges; positions past the total wrap around to the start."""
    total = sum(counts)
    starts = np.cumsum([0, *counts]).tolist()
    ranges = []
    position = begin
    while total and position < end:
        at = position % total
        i = bisect.bisect_right(starts, at) - 1  # the last shard starting at or before `at`: never empty
        take = min(end - position, starts[i + 1] - at)
        ranges.append((order[i], at - starts[i], at - starts[i] + take))
        position += take
    return ranges


def rank_and_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    if rank is not None or world_size is not None:
        rank, world_size = rank or 0, world_size or 1
    else:
        rank, world_size = 0, 1
        dist = sys.modules.get("torch.distributed")  # only if torch is already in use
        if dist is not None and dist.is_available() and dist.is_initialized():
            rank, world_size = dist.get_rank(), dist.get_world_size()
    if not 0 <= rank < world_size:
        raise ConfigError(f"rank {rank} is not within world size {world_size}")
    return rank, world_size


def worker_slot() -> tuple[int, int]:
    """(id, count) of the torch DataLoader worker this runs in; (0, 1) outside one."""
    data = sys.modules.get("torch.utils.data")
    info = data.get_worker_info() if data is not None else None
    return (info.id, info.num_workers) if info is not None else (0, 1)
