"""Positions as intervals: sorted runs [begin, end) of an epoch's positions, and the arithmetic on them
that splits an epoch among ranks and workers and counts what a stream has consumed. Pure functions
over small lists and numpy arrays."""

from __future__ import annotations

import bisect

import numpy as np

Interval = tuple[int, int]  # positions [begin, end)


def interval_length(intervals: list[Interval]) -> int:
    return sum(end - begin for begin, end in intervals)


def take(intervals: list[Interval], begin: int, end: int) -> list[Interval]:
    """Items [begin, end) of the sequence `intervals` laid end to end; items past its length wrap around
    to its start (the repeats an uneven split of an epoch among ranks needs)."""
    total = interval_length(intervals)
    starts = np.cumsum([0, *(e - b for b, e in intervals)]).tolist()
    out: list[Interval] = []
    at = begin
    while total and at < end:
        within = at % total
        i = bisect.bisect_right(starts, within) - 1
        while intervals[i][1] == intervals[i][0]:  # an empty interval shares its start with the next one
            i += 1
        first = intervals[i][0] + within - starts[i]
        count = min(end - at, intervals[i][1] - first)
        out.append((first, first + count))
        at += count
    return out


def interval_positions(intervals: list[Interval]) -> np.ndarray:
    if not intervals:
        return np.zeros(0, np.int64)
    return np.concatenate([np.arange(begin, end, dtype=np.int64) for begin, end in intervals])


def merged(intervals: list[Interval]) -> list[Interval]:
    """Sorted, disjoint and non-adjacent: the same set of positions."""
    out: list[Interval] = []
    for begin, end in sorted(s for s in intervals if s[1] > s[0]):
        if out and begin <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((begin, end))
    return out


def subtract(intervals: list[Interval], removed: list[Interval]) -> list[Interval]:
    """The positions of merged `intervals` not in `removed`, sorted."""
    out: list[Interval] = []
    cut = merged(removed)
    i = 0
    for begin, end in merged(intervals):
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


def runs(positions: np.ndarray) -> list[Interval]:
    """Maximal runs of consecutive ascending positions, in the given order."""
    if len(positions) == 0:
        return []
    breaks = np.flatnonzero(np.diff(positions) != 1) + 1
    firsts = np.concatenate([[0], breaks])
    lasts = np.concatenate([breaks, [len(positions)]])
    return [(int(positions[a]), int(positions[b - 1]) + 1) for a, b in zip(firsts, lasts, strict=True)]


def as_intervals(positions: np.ndarray) -> list[Interval]:
    """Spans of sorted positions (consecutive runs joined)."""
    return runs(np.unique(positions))


def run_offsets(run: list[Interval], cuts: np.ndarray) -> np.ndarray:
    """Where in `run` (intervals laid end to end) the sorted positions `cuts` fall, ascending."""
    if not run or not len(cuts):
        return np.zeros(0, np.int64)
    intervals = np.asarray(run, np.int64).reshape(-1, 2)
    begins, lengths = intervals[:, 0], intervals[:, 1] - intervals[:, 0]
    at = np.cumsum(lengths) - lengths  # each span's offset in the run
    first, counts = (
        np.searchsorted(cuts, begins),
        np.searchsorted(cuts, intervals[:, 1]) - np.searchsorted(cuts, begins),
    )
    owner = np.repeat(np.arange(len(intervals)), counts)
    within = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    starts: np.ndarray = cuts[np.repeat(first, counts) + within] - begins[owner] + at[owner]
    return starts
