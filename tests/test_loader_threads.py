"""The loader's threads (readers/loader_threads.py): chunks decoded on a pool up to `prefetch` ahead
and taken back in order, in the calling thread with workers=0, and every thread ended by `stop`
whatever is pending."""

from __future__ import annotations

import threading
import time
from collections import deque
from pathlib import Path

import pytest

from shardkit.readers import open_shards
from shardkit.readers.batch import Batch
from shardkit.readers.chunks import chunks
from shardkit.readers.decoding import InOrder
from shardkit.readers.loader_threads import InCallingThread, decoded_ahead, loader_pool, stop

from .stage_outputs import PHOTOS, photos


@pytest.fixture(scope="module")
def output(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return photos(tmp_path_factory)


def keys_batch(key: tuple[int, ...], number: int, items: list) -> Batch:
    """A decode step of keys only: a batch of the chunk's keys, slow enough for the pool to run ahead."""
    time.sleep(0.01)
    return Batch(None, None, [item.record.key for item in items])


@pytest.mark.parametrize("workers", [0, 3])
def test_chunks_come_back_in_order_at_most_prefetch_ahead(output: Path, workers: int) -> None:
    started: list[int] = []

    def step(key: tuple[int, ...], number: int, items: list) -> Batch:
        started.append(number)
        return keys_batch(key, number, items)

    position, items = open_shards(output, shuffle=True, seed=1).epoch_items()
    pool, named = loader_pool(workers)
    assert isinstance(pool, InCallingThread) == (workers == 0)
    pending: deque = deque()
    handed = []
    try:
        for decoded in decoded_ahead(chunks(items, 5, 0, True), position.stream.key, step, pool, InOrder(), pending, 2):
            handed.append(decoded.batch.keys)
            assert len(started) <= len(handed) + 2  # (the one handed over and `prefetch` more)
    finally:
        stop(pool, InOrder(), named, pending)
    assert [key for keys in handed for key in keys] == [
        sample.key for sample in open_shards(output, shuffle=True, seed=1)
    ]
    assert sum(len(keys) for keys in handed) == PHOTOS


def test_stop_ends_every_thread_with_work_pending(output: Path) -> None:
    position, items = open_shards(output).epoch_items()
    pool, named = loader_pool(2)
    pending: deque = deque()
    decoded = decoded_ahead(chunks(items, 4, 0, True), position.stream.key, keys_batch, pool, InOrder(), pending, 4)
    next(decoded)
    assert pending  # chunks submitted and not handed out
    stop(pool, InOrder(), named, pending)
    assert not [thread for thread in threading.enumerate() if thread.name.startswith(named)]
    assert all(work is None or work.done() for work, _, _ in pending)


def test_a_chunk_with_no_record_read_is_no_decode(output: Path) -> None:
    """A chunk whose items were all skipped (a damaged shard) still counts its positions."""
    pool, named = loader_pool(0)
    pending: deque = deque()
    empty = [(0, 4, [], [])]
    (decoded,) = decoded_ahead(empty, (0,), keys_batch, pool, InOrder(), pending, 1)
    assert decoded.batch is None and decoded.positions == 4 and decoded.offsets == []
    stop(pool, InOrder(), named, pending)
