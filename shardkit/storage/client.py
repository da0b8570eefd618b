"""The process's HTTP client: one urllib3 pool manager per process (a new one after a fork, so a
child never shares its parent's sockets), used by the shard reads of `http` and the URL downloads of
`webget`, and the watchdog that cuts off a request at its deadline. The manager retries nothing and
follows no redirect of its own: each caller passes its timeouts, redirects and pool size with the
request, and `retry` decides what is tried again."""

from __future__ import annotations

import contextlib
import heapq
import itertools
import os
import socket
import threading
import time
import zlib
from typing import Any

import urllib3
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool

HOSTS_KEPT = 256  # host pools a process keeps open (urllib3's default of 10 churns on a URL table)
CONNECTIONS_PER_HOST = 16  # the connections kept to one host, unless a request's caller says otherwise
# the Content-Encodings the client inflates itself, a bounded step at a time: zlib's window bits for each
INFLATE_BITS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


class Watch:
    """One request's deadline and the connection it uses: past the deadline the watchdog shuts the
    socket, which ends any read blocked in it (a socket timeout alone is reset by every byte, so a
    server sending headers or a body a byte at a time would never be cut off)."""

    __slots__ = ("conn", "deadline", "done", "expired")

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline
        self.conn: HTTPConnection | None = None
        self.done = False  # finished: its connection may serve another request, never to be cut
        self.expired = False


class Watchdog:
    """One thread per process that shuts the socket of each watched request still running at its
    deadline; started with the first watch."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, Watch]] = []
        self._order = itertools.count()
        self._thread: threading.Thread | None = None

    def start(self, deadline: float) -> Watch:
        watch = Watch(deadline)
        with self._cond:
            heapq.heappush(self._heap, (deadline, next(self._order), watch))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="shardkit-deadlines", daemon=True)
                self._thread.start()
            self._cond.notify()
        return watch

    def attach(self, watch: Watch, conn: HTTPConnection) -> None:
        with self._cond:
            watch.conn = conn

    def finish(self, watch: Watch) -> None:
        """Called before the connection can go back to the pool: from then on it is never cut."""
        with self._cond:
            watch.done = True

    def _run(self) -> None:
        with self._cond:
            while True:
                now = time.monotonic()
                while self._heap and self._heap[0][0] <= now:
                    watch = heapq.heappop(self._heap)[2]
                    if not watch.done:
                        watch.expired = True
                        _cut(watch.conn)
                self._cond.wait(self._heap[0][0] - now if self._heap else None)


def _cut(conn: HTTPConnection | None) -> None:
    sock = getattr(conn, "sock", None)
    if sock is not None:
        # the plain socket's shutdown, under TLS too: the reader's SSL object is left alone (and a
        # socket closed already raises)
        with contextlib.suppress(OSError):
            socket.socket.shutdown(sock, socket.SHUT_RDWR)


class HttpClient:
    """The process's connections and the watchdog of their deadlines. A request made while its
    thread has a watch (`local.watch`) attaches the connection it connects or sends on to it."""

    def __init__(self) -> None:
        self.manager = urllib3.PoolManager(num_pools=HOSTS_KEPT, maxsize=CONNECTIONS_PER_HOST, retries=False)
        self.manager.pool_classes_by_scheme = {"http": _HTTPPool, "https": _HTTPSPool}
        self.watchdog = Watchdog()
        self.local = threading.local()  # the watch of the request this thread is making

    def attach(self, conn: HTTPConnection) -> None:
        watch = getattr(self.local, "watch", None)
        if watch is not None:
            self.watchdog.attach(watch, conn)


class _WatchedHTTP(HTTPConnection):
    def connect(self) -> None:
        http_client().attach(self)
        super().connect()

    def request(self, *args: Any, **kwargs: Any) -> None:  # a kept-alive connection connects no more
        http_client().attach(self)
        super().request(*args, **kwargs)


class _WatchedHTTPS(HTTPSConnection):
    def connect(self) -> None:
        http_client().attach(self)
        super().connect()

    def request(self, *args: Any, **kwargs: Any) -> None:
        http_client().attach(self)
        super().request(*args, **kwargs)


class _HTTPPool(HTTPConnectionPool):
    ConnectionCls = _WatchedHTTP


class _HTTPSPool(HTTPSConnectionPool):
    ConnectionCls = _WatchedHTTPS


_CLIENTS: dict[int, HttpClient] = {}  # pid -> client: a client's sockets (and its watchdog) never cross a fork
_CLIENTS_LOCK = threading.Lock()


def http_client() -> HttpClient:
    """This process's client, made on first use."""
    client = _CLIENTS.get(os.getpid())
    if client is None:
        with _CLIENTS_LOCK:
            client = _CLIENTS.get(os.getpid()) or _CLIENTS.setdefault(os.getpid(), HttpClient())
    return client
