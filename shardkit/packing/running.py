"""Running a pack's shard jobs: on local worker processes (with a shared counter for live
progress) or on a Ray cluster (progress as each shard comes back), chosen by the executor's name;
`write_shard` knows nothing of who runs it."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from ..core.config import PackConfig
from ..runtime.cluster import check_ray, connect_ray, disconnect_ray, map_ray
from ..runtime.lanes import Admission, map_lanes
from ..runtime.pools import default_workers, map_local
from ..runtime.processes import mp_context, start_resource_tracker
from .counters import init_worker
from .shard_writing import PartResult, ShardResult
from .worker import ShardJob, run_job, write_shard

ProgressCallback = Callable[[int, "int | None", int], None]  # images done, total (None while walking), errors


@dataclass
class Planned:
    """How far the plan has got while shards are being written (for progress and the totals)."""

    shards: int = 0
    images: int = 0
    reused_images: int = 0
    reused_errors: int = 0
    walked: bool = False  # the walk is over: `images` is the total

    def total(self) -> int | None:
        return self.images if self.walked else None


@dataclass
class Tally:
    """A table of URLs' downloads so far, as shards come back (for the live progress line): bytes
    downloaded and the failed rows per cause; and the rows waiting out a retry now."""

    input_bytes: int = 0
    causes: dict[str, int] = field(default_factory=dict)
    waiting: int = 0  # rows waiting out a retry now (local workers: live; on Ray, not known)

    def add(self, result: ShardResult) -> None:
        self.input_bytes += result.input_bytes
        for row in result.errors:
            if row.cause is not None:
                self.causes[row.cause] = self.causes.get(row.cause, 0) + 1

    def top(self, count: int = 3) -> list[tuple[str, int]]:
        return sorted(self.causes.items(), key=lambda item: (-item[1], item[0]))[:count]


def run_jobs(
    config: PackConfig,
    jobs: Iterator[ShardJob],
    planned: Planned,
    progress: ProgressCallback | None,
    started: Callable[[], None] | None = None,
    admission: Admission | None = None,
    tally: Tally | None = None,
) -> Iterator[tuple[int, ShardResult | PartResult]]:
    """Yield (job number, result) as jobs finish, drawing jobs from the plan as workers free up: a
    shard's result, or a part's records (local workers only, packing/parts.py). `started` is
    called once the first jobs are out (map_local's). With an `admission` (a reading whose shards
    wait on downloads), each local worker runs several shards at once as it admits them
    (runtime/lanes.py), and `tally.waiting` says live how many rows wait out a retry."""
    if config.executor == "ray":
        return _run_on_ray(jobs, planned, progress, started)
    return _run_local(jobs, config.workers or default_workers(), planned, progress, started, admission, tally)


def _run_local(
    jobs: Iterator[ShardJob],
    workers: int,
    planned: Planned,
    progress: ProgressCallback | None,
    started: Callable[[], None] | None,
    admission: Admission | None,
    tally: Tally | None,
) -> Iterator[tuple[int, ShardResult | PartResult]]:
    """On local processes: a ticker reports images done (and the total once the walk is over)
    while shards are in flight, and the rows waiting out a retry."""
    start_resource_tracker()  # the counters' locks are semaphores: the tracker started as runtime/processes says
    counter, waiting = mp_context().Value("q", 0), mp_context().Value("q", 0)
    errors = [0]
    stop = threading.Event()

    def done() -> int:
        # Read without the counter's lock: a worker killed by a stop may die holding it.
        return int(counter.get_obj().value)

    def tick() -> None:
        while not stop.wait(0.25):
            if tally is not None:
                tally.waiting = max(0, int(waiting.get_obj().value))
            if progress is not None:
                progress(planned.reused_images + done(), planned.total(), planned.reused_errors + errors[0])

    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()
    try:
        if admission is not None:
            running = map_lanes(run_job, jobs, workers, admission, initializer=init_worker,
                                initargs=(counter, waiting), started=started)  # fmt: skip
        else:
            running = map_local(run_job, jobs, workers, initializer=init_worker, initargs=(counter,), started=started)
        for index, result in running:
            errors[0] += len(result.errors)
            yield index, result
    finally:
        stop.set()
        ticker.join()
        init_worker(None)
        if tally is not None:
            tally.waiting = 0
        if progress is not None:
            progress(planned.reused_images + done(), planned.total(), planned.reused_errors + errors[0])


def _run_on_ray(
    jobs: Iterable[ShardJob], planned: Planned, progress: ProgressCallback | None, started: Callable[[], None] | None
) -> Iterator[tuple[int, ShardResult]]:
    """On Ray: progress as each shard's result comes back (no shared counter across nodes)."""
    if started is not None:
        started()
    errors = 0
    done = 0
    if progress is not None:
        progress(planned.reused_images, planned.total(), planned.reused_errors)
    nodes: dict[int, str] = {}
    # connected by ray_session, whose disconnection ends the tasks of a stopped run
    for index, result in map_ray(write_shard, jobs, nodes=nodes, cancel=False):
        result.worker = nodes[index]
        done += result.shard.count + len(result.errors)
        errors += len(result.errors)
        if progress is not None:
            progress(planned.reused_images + done, planned.total(), planned.reused_errors + errors)
        yield index, result


@contextlib.contextmanager
def ray_session(config: PackConfig) -> Iterator[None]:
    """With --executor ray, the connection to the cluster, made first: a cluster that cannot be
    reached must be refused before --overwrite deletes anything."""
    if config.executor != "ray":
        yield
        return
    check_ray()
    started = connect_ray(config.ray_address)
    try:
        yield
    finally:
        if started:
            disconnect_ray()
