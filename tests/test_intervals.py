"""Positions as spans (readers/spans.py): the arithmetic that splits an epoch among ranks and
workers and counts what a stream consumed, against the positions themselves."""

from __future__ import annotations

import numpy as np
import pytest

from shardkit.readers.intervals import (
    as_intervals,
    interval_length,
    interval_positions,
    merged,
    run_offsets,
    runs,
    subtract,
    take,
)

SPANS = [(0, 4), (10, 10), (10, 13), (20, 25)]  # an empty span among them


def test_take_lays_spans_end_to_end_and_wraps_around() -> None:
    laid = interval_positions(SPANS).tolist()
    assert interval_length(SPANS) == len(laid) == 12
    assert interval_positions(take(SPANS, 2, 9)).tolist() == laid[2:9]
    assert interval_positions(take(SPANS, 10, 15)).tolist() == laid[10:] + laid[:3]  # (an uneven split's repeats)
    assert take([], 0, 5) == []


def test_merged_and_subtract_are_set_operations() -> None:
    assert merged([(5, 7), (0, 2), (2, 3), (6, 9), (4, 4)]) == [(0, 3), (5, 9)]
    removed = [(1, 3), (11, 12), (22, 30)]
    left = set(interval_positions(SPANS).tolist()) - set(interval_positions(removed).tolist())
    assert interval_positions(subtract(SPANS, removed)).tolist() == sorted(left)


@pytest.mark.parametrize("seed", range(5))
def test_runs_and_offsets_of_random_positions(seed: int) -> None:
    rng = np.random.default_rng(seed)
    positions = np.unique(rng.integers(0, 200, 60))
    assert interval_positions(runs(positions)).tolist() == positions.tolist()
    assert as_intervals(rng.permutation(positions)) == runs(positions)  # (any order: sorted first)
    run = [(50, 80), (0, 20), (120, 150)]
    cuts = np.unique(rng.integers(0, 200, 10))
    laid = interval_positions(run).tolist()
    expected = sorted(laid.index(cut) for cut in cuts.tolist() if cut in laid)
    assert sorted(run_offsets(run, cuts).tolist()) == expected
