"""The downloader of URL tables: image URLs fetched under the count form of the retry policy
(`retry.RetryPolicy.counted`: `--retries` more tries, each after a full-jitter wait or what a
429/503's Retry-After asks, a minute at most), and `Downloader`, a worker process's many downloads
at once, handed back in the order asked. One try is `storage/webget`'s."""

from __future__ import annotations

import heapq
import itertools
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar, cast

from ..core.config import WebConfig
from .retry import RetryPolicy
from .webget import MAGIC_BYTES, DownloadError, get_once, host_of, redact, url_problem

__all__ = ["DownloadError", "Downloader", "download", "fetch_head", "fetch_range", "redact", "url_problem"]

T = TypeVar("T")
BREAKER_FAILURES = 3  # connection failures in a row to one host that open its breaker


def url_policy(web: WebConfig) -> RetryPolicy:
    """The retry policy of a URL table's images: `web.retries` more tries, `web.backoff` the first
    retry's mean wait."""
    return RetryPolicy.counted(web.retries, web.backoff)


def retry_wait(error: DownloadError, retry: int, web: WebConfig, rng: random.Random) -> float:
    """Seconds before retry number `retry` (1, 2, ...): the server's Retry-After, else full jitter,
    uniform(0, backoff * 2**retry) (so the first retry's mean wait is `backoff`); a minute at most."""
    return url_policy(web).wait(retry, rng, error.retry_after)


def _retried(url: str, web: WebConfig, action: Callable[[], T]) -> T:
    problem = url_problem(url)
    if problem:
        raise DownloadError(problem, "url")
    policy = url_policy(web)
    rng = random.Random()  # jitter needs no seed; the global generator is left alone
    tries = 0
    while True:
        tries += 1
        try:
            return action()
        except DownloadError as error:
            wait = policy.next_wait(tries, rng, error.retry_after) if error.transient else None
            if wait is None:
                raise error.after(tries) from None
            time.sleep(wait)


def download(url: str, web: WebConfig, sha256: str | None = None) -> bytes:
    """The image at `url`, tried again after a transient failure `web.retries` times; DownloadError
    when it cannot be had (`transient` if a later run may have it)."""
    return _retried(url, web, lambda: get_once(url, web, sha256=sha256).body)


def fetch_head(url: str, web: WebConfig, size: int = 4096) -> tuple[bytes, int | None]:
    """The first `size` bytes of the image at `url` (a Range request; from a server that ignores
    it, the first bytes of its 200 with the rest left unread) and the object's size when the server
    says it. Retries and final errors as `download`."""
    if size < 1:
        raise ValueError(f"size must be at least 1, not {size}")
    ask = max(size, MAGIC_BYTES)  # enough to tell an image from a web page
    got = _retried(url, web, lambda: get_once(url, web, 0, ask))
    return got.body[:size], got.size


def fetch_range(url: str, web: WebConfig, start: int, length: int) -> bytes:
    """`length` bytes of `url` from `start` (fewer where the object ends first): a header that runs
    on past `fetch_head`'s bytes."""
    if start < 0 or length < 1:
        raise ValueError(f"not a range: {length} bytes from {start}")
    return _retried(url, web, lambda: get_once(url, web, start, length)).body


@dataclass(eq=False)
class _Slot:
    """One requested URL in a `fetch`'s window."""

    url: str
    sha256: str | None
    host: str
    window: _Window | None = None
    tries: int = 0
    due: float = 0.0  # when its next try may start (after a backoff)
    running: bool = False
    probe: bool = False  # its try is its host's probe
    result: bytes | BaseException | None = None
    position: int = 0  # its place among the requests of its `fetch`
    handed: bool = False  # its result went out (unordered), the slot kept until those before it are
    dropped: bool = False  # its fetch ended before its result was taken
    waiting: bool = False  # it waits out a retry's backoff (counted by the downloader's `on_waiting`)
    queued: bool = False  # in its host's queue of tries that may start

    @property
    def order(self) -> tuple[int, int]:
        """Which try starts first: the oldest fetch's, then the earliest request's."""
        return (self.window.number if self.window is not None else 0, self.position)

    def stale(self) -> bool:
        return self.dropped or self.running or self.result is not None


class _Window:
    """A `fetch`'s requests in order, the results in and not yet handed out (unordered), and the
    condition its caller waits on: woken by its own results only."""

    def __init__(self, number: int, lock: threading.Lock, ordered: bool) -> None:
        self.number, self.ordered = number, ordered
        self.slots: deque[_Slot] = deque()
        self.done: deque[_Slot] = deque()
        self.changed = threading.Condition(lock)

    def ready(self) -> bool:
        head = self.slots[0] if self.slots else None
        return head is not None and (head.result is not None if self.ordered else bool(self.done))


@dataclass
class _Host:
    """What the downloader knows of one host: tries in flight, the tries that may start (a heap by
    order), and its breaker. After BREAKER_FAILURES connection failures in a row (refused, reset, no
    answer to a connect, a failed lookup) the breaker opens: the host's rows fail at once as
    transient "host unreachable" but for one probe at a time, the first once `probe_every` has
    passed, the next that long after each failed probe; while a probe is out the host's other rows
    wait. Any answer closes it."""

    name: str
    running: int = 0
    queue: list[tuple[tuple[int, int], int, _Slot]] = field(default_factory=list)
    failures: int = 0  # connection failures in a row
    last: str = ""  # the last one's reason
    open: bool = False
    probe_at: float = 0.0
    probing: bool = False


class Downloader:
    """A worker process's downloads: `fetch` takes (url, sha256 or None) pairs and yields, in the
    same order, each one's bytes or DownloadError. At most `web.threads` tries are in flight and
    `web.per_host` to one host; a window of `window` requests (2 x threads unless given) is read
    ahead, so a slow URL holds back the ones after it only once the window is full. Retries wait
    out their backoff without holding a thread. Thread-safe; `close` when done.

    Every step costs the log of what is queued, never a pass over it: a worker's windows hold
    thousands of rows (a shard's, and those of the shards after it), and a pass over them at each
    try's end cost more CPU than the download. Tries that may start wait in their host's heap, the
    hosts with room in a heap of their first try's order; retries wait in a heap by when they are
    due, which a thread of the downloader's own starts on time; a fetch's caller is woken by its
    own window's results alone."""

    def __init__(
        self,
        web: WebConfig,
        window: int | None = None,
        hold: int | None = None,
        on_waiting: Callable[[int], None] | None = None,
    ) -> None:
        self._web = web
        self._on_waiting = on_waiting  # told each change in the requests waiting out a retry (+1, -1)
        self._window = window if window is not None else max(2 * web.threads, 8)
        # no new try starts while the bodies downloaded and not yet taken pass this many bytes:
        # a wide window reads far ahead of a slow consumer without holding more than this
        self._hold = hold
        self._untaken = 0
        if self._window < 1:
            raise ValueError(f"the window must hold at least one request, not {self._window}")
        self._policy = url_policy(web)
        # a probe at most as often as a row's own last retry would wait, at most a minute
        self._probe_every = self._policy.bound(web.retries)
        self._executor = ThreadPoolExecutor(web.threads, thread_name_prefix="shardkit-download")
        self._lock = threading.Lock()
        self._timer = threading.Condition(self._lock)  # the waker's: a new retry, or close
        self._waker: threading.Thread | None = None
        self._windows: set[_Window] = set()
        self._numbers = itertools.count()  # windows, in the order their fetches began
        self._ties = itertools.count()  # (heap entries that compare equal)
        self._hosts: dict[str, _Host] = {}
        self._with_room: list[tuple[tuple[int, int], int, str]] = []  # hosts by their first try's order
        self._retries: list[tuple[float, int, _Slot]] = []  # by when each is due
        self._queued = 0  # tries that may start and wait for a thread or their host's room
        self._running = 0
        self._rng = random.Random()
        self._closed = False

    def __enter__(self) -> Downloader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self, wait: bool = True) -> None:
        """Stops taking work; tries in flight end within their deadline (waited for unless `wait`
        is False)."""
        with self._lock:
            self._closed = True
            for window in self._windows:
                for slot in window.slots:
                    self._unwait(slot)
                window.changed.notify_all()
            self._windows.clear()
            self._timer.notify_all()
        self._executor.shutdown(wait=wait, cancel_futures=True)

    def load(self) -> tuple[int, int]:
        """(requests that need a thread now: running, or due and not started; bytes of bodies
        downloaded and not yet taken). A request waiting out a backoff or a Retry-After is neither."""
        with self._lock:
            return self._running + self._queued, self._untaken

    def fetch(self, requests: Iterable[tuple[str, str | None]]) -> Iterator[bytes | DownloadError]:
        for _, result in self._fetch(requests, ordered=True):
            yield result

    def fetch_unordered(
        self, requests: Iterable[tuple[str, str | None]]
    ) -> Iterator[tuple[int, bytes | DownloadError]]:
        """(position, bytes or DownloadError) of each request as it finishes: a slow URL holds back
        nothing (the caller puts them in order, e.g. a shard's encoder, which then never idles while
        one row waits out its retries). The window bounds what is read ahead, as `fetch`'s does."""
        return self._fetch(requests, ordered=False)

    def _fetch(
        self, requests: Iterable[tuple[str, str | None]], ordered: bool
    ) -> Iterator[tuple[int, bytes | DownloadError]]:
        source = iter(requests)
        position = 0
        with self._lock:
            if self._closed:
                raise RuntimeError("the downloader is closed")
            window = _Window(next(self._numbers), self._lock, ordered)
            self._windows.add(window)
        try:
            more = True
            while True:
                while more and len(window.slots) < self._window:  # the source is read outside the lock
                    request = next(source, None)
                    if request is None:
                        more = False
                    else:
                        slot = self._slot(*request)
                        slot.window, slot.position, position = window, position, position + 1
                        with self._lock:
                            window.slots.append(slot)
                            if slot.result is not None:
                                self._finish(slot)
                            else:
                                self._enqueue(slot)
                ready = self._take(window)
                if not ready and not more:
                    return
                for at, result in ready:
                    if isinstance(result, bytes | DownloadError):
                        yield at, result
                    else:
                        raise result  # a bug in a try, not a bad URL: said, never swallowed
        finally:
            with self._lock:
                self._windows.discard(window)  # its waiting rows are dropped; running ones end
                for slot in window.slots:  # its bodies not yet taken count no more (a try still running counts nothing)
                    if not slot.handed:
                        self._release(slot)
                    self._unwait(slot)
                    if slot.queued:
                        slot.queued = False
                        self._queued -= 1
                    slot.dropped = True
                window.done.clear()

    def _slot(self, url: str, sha256: str | None) -> _Slot:
        slot = _Slot(url, sha256, host_of(url))
        problem = url_problem(url)
        if problem:
            slot.result = DownloadError(problem, "url")
        return slot

    def _take(self, window: _Window) -> list[tuple[int, bytes | BaseException]]:
        """The results at the head of the window, once the first of them is in (none when empty);
        unordered, every result in, once one is."""
        with self._lock:
            self._pump(time.monotonic())
            while window.slots and not window.ready():
                if self._closed:
                    raise RuntimeError("the downloader was closed while fetching")
                window.changed.wait()  # (woken by its own results, and by close)
            if self._closed and window.slots and not window.ready():
                raise RuntimeError("the downloader was closed while fetching")
            if not window.ordered:
                # handed out, but kept in the window until every request before it is: the window
                # stays anchored at the oldest unfinished request, so what the caller holds while
                # it waits for that one to put the rest in order is bounded by the window
                done = list(window.done)
                window.done.clear()
                for slot in done:
                    slot.handed = True
                    self._release(slot)
                while window.slots and window.slots[0].handed:
                    window.slots.popleft()
                return [(slot.position, cast(bytes | BaseException, slot.result)) for slot in done]
            ready: list[tuple[int, bytes | BaseException]] = []
            while window.slots and window.slots[0].result is not None:
                slot = window.slots.popleft()
                assert slot.result is not None
                self._release(slot)
                ready.append((slot.position, slot.result))
            return ready

    def _unwait(self, slot: _Slot) -> None:
        """The slot waits no more (its try starts, or it is dropped or failed). With the lock taken."""
        if slot.waiting:
            slot.waiting = False
            if self._on_waiting is not None:
                self._on_waiting(-1)

    def _release(self, slot: _Slot) -> None:
        """A body taken by the caller: no longer counted against `hold`. Called with the lock taken."""
        if isinstance(slot.result, bytes) and not slot.dropped:
            self._untaken -= len(slot.result)
            self._pump(time.monotonic())

    def _room(self, host: _Host) -> bool:
        return not host.probing and host.running < self._web.per_host

    def _enqueue(self, slot: _Slot) -> None:
        """A try that may start now, queued at its host (and the host among those with room).
        With the lock taken."""
        host = self._hosts.get(slot.host)
        if host is None:
            host = self._hosts[slot.host] = _Host(slot.host)
        heapq.heappush(host.queue, (slot.order, next(self._ties), slot))
        slot.queued = True
        self._queued += 1
        if self._room(host):
            heapq.heappush(self._with_room, (slot.order, next(self._ties), host.name))

    def _head(self, host: _Host) -> _Slot | None:
        """The host's first try that may start, past the stale ones. With the lock taken."""
        while host.queue and host.queue[0][2].stale():
            heapq.heappop(host.queue)
        return host.queue[0][2] if host.queue else None

    def _offer(self, host: _Host) -> None:
        """The host among those with room, where it has room and a try to start."""
        head = self._head(host)
        if head is not None and self._room(host):
            heapq.heappush(self._with_room, (head.order, next(self._ties), host.name))

    def _pump(self, now: float) -> None:
        """Starts what may start, in order (the oldest fetch's first); fails at once the rows of a
        host whose breaker is open. Called with the lock taken."""
        while self._retries and self._retries[0][0] <= now:
            slot = heapq.heappop(self._retries)[2]
            if not slot.stale():
                self._unwait(slot)
                self._enqueue(slot)
        if self._hold is not None and self._untaken >= self._hold:
            return
        while self._running < self._web.threads and self._with_room:
            order, _, name = heapq.heappop(self._with_room)
            host = self._hosts[name]
            head = self._head(host)
            if head is None or not self._room(host):
                continue
            if head.order != order:  # (an entry left from before: the host's place is its head's)
                self._offer(host)
                continue
            heapq.heappop(host.queue)
            head.queued = False
            self._queued -= 1
            if host.open and not host.probing and now < host.probe_at:
                head.result = DownloadError(
                    f"host unreachable ({host.last}, {host.failures} times in a row)", "unreachable", True
                ).after(head.tries)
                self._finish(head)
            else:
                if host.open:
                    host.probing = head.probe = True
                self._start(head, host)
            self._offer(host)

    def _start(self, slot: _Slot, host: _Host) -> None:
        self._unwait(slot)
        slot.running, slot.tries = True, slot.tries + 1
        host.running += 1
        self._running += 1
        self._executor.submit(self._try, slot, host)

    def _try(self, slot: _Slot, host: _Host) -> None:
        outcome: bytes | BaseException
        try:
            outcome = get_once(slot.url, self._web, sha256=slot.sha256).body
        except Exception as error:  # DownloadError, or a bug said where the result is taken
            outcome = error
        with self._lock:
            now = time.monotonic()
            slot.running = False
            host.running -= 1
            self._running -= 1
            self._settle(slot, host, outcome, now)
            self._offer(host)
            self._pump(now)

    def _settle(self, slot: _Slot, host: _Host, outcome: bytes | BaseException, now: float) -> None:
        if slot.probe:
            slot.probe = host.probing = False
        if isinstance(outcome, DownloadError) and outcome.unreachable:
            host.failures += 1
            host.last = outcome.reason
            if host.failures >= BREAKER_FAILURES:
                host.open, host.probe_at = True, now + self._probe_every
        else:  # an answer of any kind: the host is there
            host.failures, host.open = 0, False
        wait = None
        if isinstance(outcome, DownloadError) and outcome.transient:
            wait = self._policy.next_wait(slot.tries, self._rng, outcome.retry_after)
        if wait is not None:
            if not slot.dropped:
                slot.due = now + wait
                slot.waiting = True
                if self._on_waiting is not None:
                    self._on_waiting(1)
                self._wait_retry(slot)
        else:
            slot.result = outcome.after(slot.tries) if isinstance(outcome, DownloadError) else outcome
            if isinstance(outcome, bytes) and not slot.dropped:
                self._untaken += len(outcome)
            self._finish(slot)

    def _finish(self, slot: _Slot) -> None:
        """A slot's result is in: its window's caller is told. With the lock taken."""
        window = slot.window
        if window is not None and not slot.dropped:
            if not window.ordered:
                window.done.append(slot)
            window.changed.notify()

    def _wait_retry(self, slot: _Slot) -> None:
        """The slot's next try, started when due by the downloader's waker thread. With the lock taken."""
        earliest = not self._retries or slot.due < self._retries[0][0]
        heapq.heappush(self._retries, (slot.due, next(self._ties), slot))
        if self._waker is None:
            self._waker = threading.Thread(target=self._wake, daemon=True, name="shardkit-download-retries")
            self._waker.start()
        elif earliest:
            self._timer.notify()

    def _wake(self) -> None:
        """Starts each retry when it is due (a retry due while nothing else happens has no one else
        to start it)."""
        with self._lock:
            while not self._closed:
                now = time.monotonic()
                if self._retries and self._retries[0][0] <= now:
                    self._pump(now)
                    continue
                self._timer.wait(self._retries[0][0] - now if self._retries else None)
