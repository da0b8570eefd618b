"""Where a batch loader's time goes: `loader.stats()`.

The training loop's thread splits each epoch's time into the loop's own work (`step`: from a batch
handed out to the next one asked for) and its waits for the loader, split by what the loader did on
that thread meanwhile:

    read      records read from the shards (the next chunk's records pulled from the stream)
    storage   a remote shard waited for: fetched into the cache, or its fetch by another waited out
    decode    the loader threads waited for (or, with workers=0, their work done on this thread)
    collate   the rest of the wait: batches joined and handed over

The loader threads report their busy seconds: `decode` (crop, resize, flip: the decoder's own),
`targets` (masks, boxes and labels), `device` (the device path's decode and make, on its lane's two
threads: host time, which waits for the device's decode but not for its kernels). Every
time is exclusive: a stage timed inside another (storage inside read, targets inside decode) is
taken out of it, so the training thread's five add up to its wall time.

A verdict says whether the input holds training back: `input-bound` when the loop waited more than
INPUT_BOUND of its time, else `compute-bound`; and the stage that dominates the loader, comparing the
training thread's seconds with the threads' busy seconds over their number (their wall time when
all work at once). Timing costs a few clock reads a batch (scripts/bench_train.py measures it on and
off); loader(stats=False) leaves them out.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Generator, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

from ..core.config import usable_cores

INPUT_BOUND = 0.1  # the share of its time a training loop may wait before the input is what bounds it
WAITS = ("read", "storage", "decode", "collate")  # the training thread's waits, in the order a batch meets them
BUSY = ("decode", "targets", "device")  # the loader threads' stages

_NO_TIMING: AbstractContextManager[None] = nullcontext()
_HERE = threading.local()  # .stages: this thread's stages being timed (_Open), innermost last


@dataclass(frozen=True)
class LoaderStats:
    """A loader's time over a span (since it started, or since the last stats() call): see the
    module's docstring for each stage."""

    seconds: float  # wall time while an epoch was iterated
    batches: int
    samples: int
    step: float  # the training loop's own seconds
    waits: dict[str, float]  # the training loop's waits, by WAITS
    busy: dict[str, float]  # the loader threads' busy seconds, by BUSY
    threads: int  # loader threads (0: everything on the training thread)
    cpu_seconds: float  # the process's CPU time over the span (all threads, the training step's too)
    cores: int
    stored_pixels: int  # pixels of the records decoded, as stored
    output_pixels: int  # pixels of the images handed out

    @property
    def waited(self) -> float:
        return sum(self.waits.values())

    @property
    def input_share(self) -> float:
        """The share of the span the training loop waited for its batches."""
        return self.waited / self.seconds if self.seconds > 0 else 0.0

    @property
    def verdict(self) -> str:
        """`input-bound`, `compute-bound`, or `idle` for a span in which no batch was asked for."""
        if self.seconds <= 0:
            return "idle"
        return "input-bound" if self.input_share > INPUT_BOUND else "compute-bound"

    @property
    def loads(self) -> dict[str, float]:
        """Each loader stage's wall seconds: the training thread's as they are, the threads' busy
        seconds over their number (what they take when all work at once)."""
        spread = max(1, self.threads)
        loads = {name: self.waits[name] for name in ("read", "storage", "collate")}
        loads.update({name: self.busy[name] / spread for name in ("decode", "targets")})
        loads["device"] = self.busy["device"] / 2  # (the device lane's two threads: decode, then make)
        return loads

    @property
    def dominant(self) -> str:
        """The loader stage that takes the most wall time (loads); "none" before any was timed."""
        loads = self.loads
        dominant = max(loads, key=lambda name: loads[name])
        return dominant if loads[dominant] > 0 else "none"

    @property
    def samples_per_second(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else 0.0

    @property
    def batches_per_second(self) -> float:
        return self.batches / self.seconds if self.seconds > 0 else 0.0

    @property
    def cpu_share(self) -> float:
        """The process's CPU use over the span, as a share of all cores."""
        return self.cpu_seconds / (self.seconds * self.cores) if self.seconds > 0 else 0.0

    @property
    def pixels_per_output_pixel(self) -> float:
        """Stored pixels of the decoded records per pixel handed out (0: not measured)."""
        return self.stored_pixels / self.output_pixels if self.output_pixels else 0.0

    def table(self) -> list[tuple[str, float, str]]:
        """(stage, seconds, what it is) rows: the training thread's time, then the threads' busy time."""
        rows = [("step", self.step, "the training loop's own work")]
        rows += [(f"wait: {name}", self.waits[name], _WAIT_WHAT[name]) for name in WAITS]
        rows += [(f"threads: {name}", self.busy[name], _BUSY_WHAT[name]) for name in BUSY if self.busy[name] > 0]
        return rows

    def __str__(self) -> str:
        if self.verdict == "idle":
            return "idle: no batch was asked for in this span"
        lines = [
            f"{self.verdict}, {self.dominant} dominates: {self.samples_per_second:,.0f} samples/s, "
            f"{self.batches:,} batches in {self.seconds:.2f} s, waited {self.input_share:.0%} of it"
        ]
        lines += [f"  {name:<17} {seconds:8.3f} s  {what}" for name, seconds, what in self.table()]
        return "\n".join(lines)


_WAIT_WHAT = {
    "read": "records read from the shards",
    "storage": "remote shards waited for",
    "decode": "the loader threads waited for",
    "collate": "batches joined and handed over",
}
_BUSY_WHAT = {
    "decode": "crop, resize and flip (busy seconds, all threads)",
    "targets": "masks, boxes and labels (busy seconds, all threads)",
    "device": "the device lane's decode and make (host busy seconds)",
}


@dataclass
class Totals:
    seconds: float = 0.0
    batches: int = 0
    samples: int = 0
    step: float = 0.0
    stages: dict[str, float] = field(default_factory=dict)  # "wait:read", "busy:decode", ...
    cpu_seconds: float = 0.0
    stored_pixels: int = 0
    output_pixels: int = 0


@dataclass
class _Epoch:
    """An epoch being iterated: its start, the process's CPU time then, the training thread's open
    stages (the wait in progress, innermost last) and the start of the step in progress."""

    start: float
    cpu: float
    stages: list[_Open]
    step_since: float | None = None


class LoaderClock:
    """A loader's running totals: timed by its stages on the training thread and the loader
    threads, read by stats() from any thread (a wait or a step in progress counted up to the call)."""

    def __init__(self, threads: int, enabled: bool = True) -> None:
        self.threads, self.enabled = threads, enabled
        self._guard = threading.Lock()
        self._totals = Totals()
        self._epochs: list[_Epoch] = []  # being iterated (two when an abandoned one is not closed yet)
        self._last = Totals()  # the totals at the last stats(since_last=True)

    def timed(self, stage: str) -> AbstractContextManager[None]:
        """Times `stage` ("wait:read", "busy:decode", ...) on this thread, less the stages timed inside it."""
        return _timed(self, stage) if self.enabled else _NO_TIMING

    def pixels(self, stored: int, output: int) -> None:
        if self.enabled:
            with self._guard:
                self._totals.stored_pixels += stored
                self._totals.output_pixels += output

    def batches(self, batches: Generator[Any, None, None]) -> Iterator[Any]:
        """`batches` (an epoch's), timed: the waits for each (its collate, the stages inside it) and
        the training loop's step between them. Each span starts at the clock read that ended the
        one before, so none of the epoch's time falls between them (a wait for the GIL included).
        The epoch's set-up runs in its first wait; its wind-down (`batches` closed, the loader's
        threads stopped) in its last, or after a loop that stopped early in a wait of its own."""
        if not self.enabled:
            yield from batches
            return
        open_stages = _thread_stages()
        wait = _Open(self, "wait:collate", time.perf_counter())
        epoch = _Epoch(wait.start, _cpu(), open_stages)
        with self._guard:
            self._epochs.append(epoch)
        handed = wait.start  # (the last clock read of the training thread's spans)
        try:
            while True:
                open_stages.append(wait)
                try:
                    batch = next(batches, None)
                finally:
                    handed = time.perf_counter()
                    with self._guard:  # (stats() from another thread sees it open, or added, never both)
                        open_stages.pop()
                        _add(self._totals.stages, "wait:collate", handed - wait.start - wait.inner)
                if batch is None:
                    return
                with self._guard:
                    self._totals.batches += 1
                    self._totals.samples += len(batch.keys)
                    epoch.step_since = handed
                yield batch
                wait = _Open(self, "wait:collate", time.perf_counter())
                with self._guard:
                    since, epoch.step_since = epoch.step_since, None  # (cleared first: a Ctrl-C never counts it twice)
                    self._totals.step += wait.start - (wait.start if since is None else since)
        finally:
            with self._guard:
                stepping, epoch.step_since = epoch.step_since, None
                # (from the last span's end: a thread switch before this read, 5 ms where another
                # thread holds the GIL, is the epoch's time too)
                ending = _Open(self, "wait:collate", handed if stepping is None else time.perf_counter())
                if stepping is not None:  # a loop that stopped early: its last step ends here
                    self._totals.step += ending.start - stepping
                open_stages.append(ending)
            try:
                batches.close()  # (a no-op for an epoch that ran out: it wound down in its last wait)
            finally:
                with self._guard:
                    now = time.perf_counter()
                    open_stages.pop()
                    _add(self._totals.stages, "wait:collate", now - ending.start - ending.inner)
                    self._epochs.remove(epoch)
                    self._totals.seconds += now - epoch.start
                    self._totals.cpu_seconds += _cpu() - epoch.cpu

    def stats(self, since_last: bool = False) -> LoaderStats:
        """The totals since the loader started, or since the last call with since_last=True (a call
        without it only reads, so it leaves that span alone)."""
        with self._guard:
            now = self._current()
            base = self._last if since_last else Totals()
            if since_last:
                self._last = now
        return self.between(base, now)

    def mark(self) -> Totals:
        """The totals as of now, for `between` (a progress line's window, apart from stats() calls)."""
        with self._guard:
            return self._current()

    def between(self, base: Totals, now: Totals) -> LoaderStats:
        stages = {name: now.stages.get(name, 0.0) - base.stages.get(name, 0.0) for name in now.stages}
        return LoaderStats(
            seconds=now.seconds - base.seconds,
            batches=now.batches - base.batches,
            samples=now.samples - base.samples,
            step=now.step - base.step,
            waits={name: max(0.0, stages.get(f"wait:{name}", 0.0)) for name in WAITS},
            busy={name: max(0.0, stages.get(f"busy:{name}", 0.0)) for name in BUSY},
            threads=self.threads,
            cpu_seconds=now.cpu_seconds - base.cpu_seconds,
            cores=usable_cores(),
            stored_pixels=now.stored_pixels - base.stored_pixels,
            output_pixels=now.output_pixels - base.output_pixels,
        )

    def _current(self) -> Totals:
        """The totals as of now (under the guard): each running epoch to now, its step in progress,
        and the wait in progress split among its open stages (each its time less its inner ones')."""
        now = dataclasses.replace(self._totals, stages=dict(self._totals.stages))
        clock = time.perf_counter()
        for epoch in self._epochs:
            now.seconds += clock - epoch.start
            now.cpu_seconds += _cpu() - epoch.cpu
            if epoch.step_since is not None:
                now.step += clock - epoch.step_since
            frames = [frame for frame in epoch.stages if frame.clock is self]
            for at, frame in enumerate(frames):
                inner = frames[at + 1] if at + 1 < len(frames) else None
                taken = 0.0 if inner is None or not _counts_in(inner.stage, frame.stage) else clock - inner.start
                _add(now.stages, frame.stage, clock - frame.start - frame.inner - taken)
        return now


@dataclass(slots=True)
class _Open:
    """A stage being timed on a thread: its clock, its name, its start, and the seconds of the
    stages inside it that ended."""

    clock: LoaderClock
    stage: str
    start: float
    inner: float = 0.0


@contextmanager
def _timed(clock: LoaderClock, stage: str) -> Iterator[None]:
    """`stage`'s exclusive seconds on this thread: its own, less those of stages timed inside it.
    A threads' stage run inside a wait of the training thread (workers=0: the decode done where it
    is waited for) stays in the wait as well: the training thread's waits add up to its wall time,
    and the threads' busy time is told apart."""
    open_stages = _thread_stages()
    frame = _Open(clock, stage, time.perf_counter())
    with clock._guard:
        open_stages.append(frame)
    try:
        yield
    finally:
        elapsed = time.perf_counter() - frame.start
        with clock._guard:  # (stats() from another thread sees it open, or added, never both)
            open_stages.pop()
            outer = open_stages[-1] if open_stages else None
            if outer is not None and _counts_in(stage, outer.stage):
                outer.inner += elapsed
            _add(clock._totals.stages, stage, elapsed - frame.inner)


def _thread_stages() -> list[_Open]:
    """This thread's stages being timed, innermost last (made empty on the thread's first use)."""
    open_stages: list[_Open] | None = getattr(_HERE, "stages", None)
    if open_stages is None:
        open_stages = _HERE.stages = []
    return open_stages


def _counts_in(inner: str, outer: str) -> bool:
    """Whether a stage's time is taken out of the stage it runs inside: always, but a threads' stage
    inside a training thread's wait (see _timed)."""
    return not (inner.startswith("busy:") and outer.startswith("wait:"))


def _add(stages: dict[str, float], stage: str, seconds: float) -> None:
    stages[stage] = stages.get(stage, 0.0) + seconds


def storage_wait() -> AbstractContextManager[None]:
    """Times a wait for a remote shard as `storage` where a loader is timing this thread (its read
    stage); elsewhere (iteration, a DataLoader's workers) it times nothing."""
    open_stages = _thread_stages()
    if not open_stages:
        return _NO_TIMING
    return _timed(open_stages[-1].clock, "wait:storage")


def _cpu() -> float:
    times = os.times()
    return times.user + times.system
