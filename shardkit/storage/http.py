"""The direct download path: one pooled keep-alive GET per object (an S3 presigned URL or an http(s)
URL), read a MiB at a time into a reused buffer and hashed on the way. It costs about half the CPU
of fsspec's async client, which counts on a machine whose cores decode."""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from ..core.errors import ShardFormatError

_DIRECT_BUFFER = 1 << 20
_CONNECTIONS = threading.local()  # keep-alive connections of this thread: (pid, scheme, host, port) -> connection


class TooLong(ShardFormatError):
    """The body runs past the size the manifest gives (the caller names the URL)."""


def copy_body(read: Callable[..., Any], destination: str, limit: int | None, into: bool = False) -> str:
    """Copies a body into `destination` a MiB at a time, hashing on the way; stops with TooLong
    as soon as it passes `limit`. `read` is readinto (into=True, into a reused buffer) or read."""
    digest = hashlib.sha256()
    buffer = memoryview(bytearray(_DIRECT_BUFFER))
    total = 0
    with open(destination, "wb", buffering=0) as out:
        while True:
            if into:
                count = read(buffer)
                chunk = buffer[:count]
            else:
                chunk = read(_DIRECT_BUFFER)
                count = len(chunk)
            if not count:
                break
            total += count
            if limit is not None and total > limit:
                raise TooLong("")
            out.write(chunk)
            digest.update(chunk)
    return digest.hexdigest()


class NotDirect(Exception):
    """The direct GET was redirected or refused in a way the filesystem's own path handles."""


def _connection(scheme: str, host: str, port: int | None) -> Any:
    import http.client

    key = (os.getpid(), scheme, host, port)
    pool = getattr(_CONNECTIONS, "pool", None)
    if pool is None:
        pool = _CONNECTIONS.pool = {}
    if key not in pool:
        kind = http.client.HTTPSConnection if scheme == "https" else http.client.HTTPConnection
        pool[key] = kind(host, port, timeout=60)
    return pool[key]


def get_direct(url: str, destination: str, limit: int | None) -> str:
    """GET `url` into `destination`, hashing on the way; the sha256. FileNotFoundError on 404,
    PermissionError on 401/403, OSError (retried) on 5xx and 429, NotDirect on redirects."""
    import http.client

    parts = urlsplit(url)
    connection = _connection(parts.scheme, parts.hostname or "", parts.port)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    for attempt in (1, 2):
        reused = connection.sock is not None
        try:
            connection.request("GET", target)
            response = connection.getresponse()
            break
        except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
            connection.close()  # a kept-alive connection the server had closed: once more, anew
            if attempt == 2 or not reused:
                raise
        except BaseException:
            connection.close()  # never reuse a connection left mid-request
            raise
    try:
        status = response.status
        if status != 200:
            response.read(1 << 16)
            if status == 404:
                raise FileNotFoundError(status, "not found")
            if status in (401, 403):
                raise PermissionError(status, f"HTTP {status} {response.reason}")
            if status >= 500 or status == 429:
                raise OSError(status, f"HTTP {status} {response.reason}")
            raise NotDirect(status)
        try:
            return copy_body(response.readinto, destination, limit, into=True)
        except TooLong:
            connection.close()  # the rest of the body is not read: the connection cannot be reused
            raise
    except BaseException:
        connection.close()
        raise
