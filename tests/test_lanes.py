"""Lanes (runtime/lanes.py) with real processes and threads: a job that waits frees its lane for the
next one, the budget bounds what runs at once, every result comes back once, and a failure or a
dead worker is said as map_local says it."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from shardkit.core.errors import WorkerDiedError
from shardkit.runtime.lanes import LANE_JOBS, job_done, map_lanes

_waiting = 0  # this process's units that only wait
_running = 0  # jobs running in this process now
_most = 0  # the most that ran at once
_lock = threading.Lock()
_abandoned = threading.Event()  # set by Budget.abandon: what a waiting job waits on ends


@dataclass(frozen=True)
class Work:
    name: str
    weight: int = 10
    wait: float = 0.0  # seconds the job only waits (what a retry's Retry-After is)
    busy: float = 0.02  # seconds of work
    fail: str = ""  # "raise" or "die"


@dataclass(frozen=True)
class Budget:
    """Room while the units left, less those that only wait, stay under `budget`."""

    budget: int

    def weight(self, job: Work) -> int:
        return job.weight

    def admits(self, left: int) -> bool:
        return left - _waiting < self.budget

    def abandon(self) -> None:
        _abandoned.set()


def run(job: Work) -> tuple[str, int, float, int]:
    """(name, pid, when it ended, the most jobs this process ran at once so far)."""
    global _waiting, _running, _most
    if job.fail == "raise":
        raise ValueError(f"{job.name} cannot be done")
    if job.fail == "die":
        os.kill(os.getpid(), signal.SIGKILL)
    with _lock:
        _running += 1
        _most = max(_most, _running)
    try:
        if job.wait:
            with _lock:
                _waiting += job.weight
            _abandoned.wait(job.wait)
            with _lock:
                _waiting -= job.weight
        time.sleep(job.busy)
        job_done(job.weight)
        return job.name, os.getpid(), time.monotonic(), _most
    finally:
        with _lock:
            _running -= 1


@pytest.fixture(autouse=True)
def _fresh_counts() -> None:
    global _most
    _most = 0
    _abandoned.clear()


@pytest.mark.parametrize("workers", [1, 2])
def test_a_job_that_waits_leaves_its_lane_to_the_next(workers: int) -> None:
    slow = [Work(f"slow{n}", wait=1.0) for n in range(workers)]
    quick = [Work(f"quick{n}") for n in range(6 * workers)]
    started = time.monotonic()
    done = {name: ended for _, (name, _, ended, _) in map_lanes(run, slow + quick, workers, Budget(5))}
    assert set(done) == {job.name for job in slow + quick}
    # every quick job ended while the slow ones still waited (one job a worker would put them after)
    assert max(done[job.name] for job in quick) < min(done[job.name] for job in slow)
    assert time.monotonic() - started < 1.0 + 6 * 0.02 * 4 + 3  # (the pool's start on a loaded machine)


@pytest.mark.parametrize("workers", [1, 2])
def test_jobs_that_do_not_wait_run_one_at_a_time_within_the_budget(workers: int) -> None:
    jobs = [Work(f"j{n}", weight=10, busy=0.05) for n in range(4 * workers)]
    results = [result for _, result in map_lanes(run, jobs, workers, Budget(5))]
    assert sorted(name for name, *_ in results) == sorted(job.name for job in jobs)
    assert max(most for *_, most in results) == 1
    light = [Work(f"l{n}", weight=1, busy=0.2) for n in range(4 * LANE_JOBS)]
    results = [result for _, result in map_lanes(run, light, 1, Budget(100))]
    assert max(most for *_, most in results) == LANE_JOBS  # never more than a lane's threads


def test_results_are_numbered_by_job_and_come_once() -> None:
    jobs = [Work(f"j{n}", wait=0.3 if n % 3 == 0 else 0.0, weight=4) for n in range(20)]
    got = list(map_lanes(run, jobs, 2, Budget(6)))
    assert sorted(number for number, _ in got) == list(range(20))
    assert all(result[0] == jobs[number].name for number, result in got)
    assert all(pid != os.getpid() for _, (_, pid, _, _) in got)  # (which lane takes which is the lanes' race)


def test_jobs_are_drawn_as_lanes_take_them() -> None:
    drawn: list[int] = []

    def jobs() -> Iterator[Work]:
        for number in range(40):
            drawn.append(number)
            yield Work(f"j{number}", busy=0.05)

    seen = 0
    for _ in map_lanes(run, jobs(), 2, Budget(5)):
        seen += 1
        assert len(drawn) <= seen + 2 * (LANE_JOBS + 1)
    assert seen == 40


@pytest.mark.parametrize("workers", [1, 2])
def test_a_job_that_raises_is_raised_in_the_driver(workers: int) -> None:
    jobs = [Work("a"), Work("b", fail="raise"), Work("c")]
    with pytest.raises(ValueError, match="b cannot be done"):
        list(map_lanes(run, jobs, workers, Budget(5)))


def test_a_worker_that_dies_is_said() -> None:
    jobs = [Work("a", wait=0.5), Work("b", fail="die"), *(Work(f"c{n}") for n in range(4))]
    with pytest.raises(WorkerDiedError, match="died"):
        list(map_lanes(run, jobs, 2, Budget(5)))


def test_a_failure_on_one_thread_ends_the_jobs_that_wait_at_once() -> None:
    """In this process (one worker): a job that fails while another waits for a minute is raised
    as soon as it fails; the waiting job is abandoned, not waited for."""
    started = time.monotonic()
    with pytest.raises(ValueError, match="b cannot be done"):
        list(map_lanes(run, [Work("a", wait=60), Work("b", fail="raise")], 1, Budget(50)))
    assert time.monotonic() - started < 10 and _abandoned.is_set()


def test_no_jobs_is_no_results() -> None:
    calls: list[str] = []
    assert list(map_lanes(run, iter([]), 2, Budget(5), started=lambda: calls.append("started"))) == []
    assert calls == ["started"]
