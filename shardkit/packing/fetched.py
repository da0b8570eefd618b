"""A table of URLs read: by the worker, a shard's images downloaded ahead of the encoder by the
process's Downloader (storage/download.py: its threads, its per-host limit, its retries), each
encoded as it arrives and handed on in the shard's order, a download's bytes checked as a local
file's are (header first, pixel limit) before anything decodes them; by probe, each image's header
by range requests (`probe_urls`). The reading a pack sends its workers is `sources.url_table.Downloads`."""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Generator, Sequence
from dataclasses import dataclass, replace
from typing import Any

from ..core.config import WebConfig
from ..core.errors import Failure, HeaderError, ImageError, OutputError
from ..core.headers import HEAD_BYTES, ImageHeader, parse_header
from ..formats import get_format
from ..formats.base import Record
from ..runtime.lanes import in_turn, job_done
from ..storage.download import Downloader, DownloadError, download, fetch_head, fetch_range
from .counters import count_waiting
from .encode import check_pixels
from .objects import Transfer
from .ranges import ReadRange, probe_row
from .reading import Outcome, Packing, attempt, image_record
from .scan_rows import ScanRow
from .sources.item import Item

_DOWNLOADERS: dict[int, tuple[WebConfig, Downloader]] = {}  # pid -> the process's downloader
_MADE = threading.Lock()
DOWNLOAD_WINDOW = 4096  # rows asked for ahead of the oldest unfinished one
DOWNLOAD_HOLD = 64 << 20  # bodies downloaded and not yet encoded, per worker process


def downloaded(packing: Packing, web: WebConfig, sha256s: Sequence[str | None]) -> Generator[Outcome, None, None]:
    """Each item's outcome in the shard's order, its image downloaded on the process's threads
    and encoded as soon as it arrives, in any order: the window of the process's Downloader stays
    anchored at the oldest unfinished row, which bounds what waits here for that row's turn, and a
    row waiting out its retries never idles the encoder. `sha256s`: what each row's table says its
    image's sha256 is (None: not said)."""
    items = packing.items
    requests = ((item.path, sha256) for item, sha256 in zip(items, sha256s, strict=True))
    done: dict[int, Outcome] = {}
    turn = 0
    for at, got in _downloader(web).fetch_unordered(requests):
        with in_turn():  # (a worker's shards encode one row at a time, the earliest shard's first)
            done[at] = _encoded(items[at], got, packing)
        job_done()  # (in any order: what waits for its turn here holds no download)
        while turn in done:
            yield done.pop(turn)
            turn += 1


def refetched(
    packing: Packing, web: WebConfig, sha256s: Sequence[str | None], shard: str, earlier: list[Failure]
) -> Generator[Outcome, None, None]:
    """A shard written again by --resume because some of its rows failed transiently: its records
    read back from the shard file it replaces (byte for byte what the formats write again), the
    rows that failed for good as they were, and only the rows that failed transiently downloaded
    again; in the items' order, streamed (the earlier shard holds its records in that order)."""
    items = packing.items
    transient, final = _earlier_rows(earlier, items)
    reader = get_format(packing.format).reader(shard)
    again = [(item.path, sha256) for item, sha256 in zip(items, sha256s, strict=True) if _row(item) in transient]
    got = _fetched(web, again)
    try:
        records = iter(reader)
        record = next(records, None)
        for item in items:
            job_done()
            row = _row(item)
            if row in transient:
                yield _encoded(item, next(got), packing)
            elif row in final:
                yield None, 0, [final[row]]
            elif record is not None and record.key == item.key:
                yield record, 0, []
                record = next(records, None)
            else:  # (the shard's bytes matched its done marker: a shardkit bug, never the input's)
                raise OutputError(f"{shard}: lacks the record of {item.key} that its done marker vouches for")
    finally:
        got.close()
        reader.close()


def _row(item: Item) -> str:
    """What tells a row apart: its key (two rows may name one URL with other credentials, which
    reports show alike), or its URL as shown where keys are off."""
    return item.key or item.relpath


def _earlier_rows(earlier: list[Failure], items: Sequence[Item]) -> tuple[set[str], dict[str, Failure]]:
    """The rows of an earlier run's failures, those to download again and those that failed for
    good, each named as `_row` names an item. A failure without a key (written by a shardkit that
    kept none) is matched by its URL as shown, to the rows that show it."""
    keyed = [row for row in earlier if row.key is not None]
    unkeyed = {row.path: row for row in earlier if row.key is None}
    named = {row.key: row for row in keyed if row.key}
    for item in items:
        if item.key and item.key not in named and item.relpath in unkeyed:
            named[item.key] = unkeyed[item.relpath]
    if not any(item.key for item in items):
        named = {row.path: row for row in earlier}
    transient = {row for row, failure in named.items() if failure.transient}
    return transient, {row: failure for row, failure in named.items() if not failure.transient}


def _fetched(web: WebConfig, requests: list[tuple[str, str | None]]) -> Generator[bytes | DownloadError, None, None]:
    """Each request's bytes or why not, in order, fetched ahead on the process's threads."""
    yield from _downloader(web).fetch(requests)


def _encoded(item: Item, got: bytes | DownloadError, packing: Packing) -> Outcome:
    """A downloaded row's outcome: its image encoded into its record, or why it was not downloaded."""
    if isinstance(got, DownloadError):
        return None, 0, [download_failure(item, got)]
    body = got
    started = time.perf_counter()

    def made() -> tuple[Record, int]:
        data, header = read_downloaded(body, packing.encode.max_pixels)
        packing.timings["read"] += time.perf_counter() - started
        return image_record(item, data, header, packing)

    record, size, failures = attempt(item, made)
    return record, size, [replace(failure, key=item.key or None) for failure in failures]


def url_ranges(url: str, web: WebConfig) -> ReadRange:
    """A URL read by ranges for its header (probe's `RangeReads`): the first request says the
    image's size; a server that says no size gets one whole download. A failure is an OSError
    naming its cause (what probe's rows keep), after the retries a download gets."""
    size: list[int] = []

    def read_range(start: int, length: int) -> tuple[bytes, int]:
        try:
            if not size:
                head, total = fetch_head(url, web, length)
                if total is None:
                    head = download(url, web) if len(head) >= length else head
                    total = len(head)
                size.append(total)
                return head[:length], total
            return fetch_range(url, web, start, length), size[0]
        except DownloadError as error:
            raise OSError(error.reason) from None

    return read_range


def probe_urls(web: WebConfig, transfer: Transfer, job: tuple[list[str], list[str], int]) -> list[ScanRow]:
    """A chunk of a URL table's probe rows (probe's threads run many): each header by ranges,
    4 KiB first and more only where it runs on, as a bucket's objects are probed."""
    urls, relpaths, max_pixels = job
    rows: list[ScanRow] = []
    for url, relpath in zip(urls, relpaths, strict=True):
        row, taken = probe_row(url_ranges(url, web), relpath, relpath, max_pixels)
        rows.append(row)
        transfer.bytes += taken
    return rows


def url_digest(web: WebConfig, url: str, identity: int) -> tuple[str, int] | None:
    """The sha256 and size of the image at `url` (probe's candidate copies), downloaded; None when
    it cannot be."""
    try:
        data = download(url, web)
    except DownloadError:
        return None
    return hashlib.sha256(data).hexdigest(), len(data)


@dataclass(frozen=True)
class DownloadAdmission:
    """When a worker running shards of a table of URLs takes its next shard (runtime/lanes.py):
    once its downloader has fewer than `budget` rows that need a thread now (rows waiting out a
    retry need none) and holds less than DOWNLOAD_HOLD bytes of bodies for the encoder. Downloads
    thus run ahead of the encoder by up to that many bytes, across shards, and a row's retries
    start as early as its shard's turn allows, not after the shards before it are written."""

    budget: int

    @classmethod
    def of(cls, web: WebConfig) -> DownloadAdmission:
        return cls(2 * web.threads)

    def weight(self, job: Any) -> int:  # (a worker.ShardJob: worker.py imports this module's readers)
        return len(job.spec.items)

    def admits(self, left: int) -> bool:
        cached = _DOWNLOADERS.get(os.getpid())
        if cached is None:  # (no download yet: nothing holds room)
            return True
        if left >= DOWNLOAD_WINDOW:  # what its shards hold for their turn is bounded too
            return False
        wanted, held = cached[1].load()
        return wanted < self.budget and held < DOWNLOAD_HOLD

    def abandon(self) -> None:
        """Closes this process's downloader: a shard waiting on it raises at once (its tries in
        flight end by their own deadline, on threads nobody waits for)."""
        with _MADE:
            cached = _DOWNLOADERS.pop(os.getpid(), None)
        if cached is not None:
            cached[1].close(wait=False)


def _downloader(web: WebConfig) -> Downloader:
    with _MADE:  # (a worker's shards run on threads of their own, and share one)
        return _made_downloader(web)


def _made_downloader(web: WebConfig) -> Downloader:
    cached = _DOWNLOADERS.get(os.getpid())
    if cached is not None and cached[0] == web:
        return cached[1]
    if cached is not None:
        cached[1].close()
    # A window far wider than a plain fetch's, bounded by bytes instead: a shard's rows are asked
    # for as soon as it starts, so a row that waits out a retry (a 429's Retry-After, a 503's
    # backoff) waits while the rows after it are encoded, not at the shard's end; at most
    # DOWNLOAD_HOLD bytes of bodies wait for the encoder.
    downloader = Downloader(web, window=DOWNLOAD_WINDOW, hold=DOWNLOAD_HOLD, on_waiting=count_waiting)
    _DOWNLOADERS.clear()  # (a forked child's copy of its parent's: its threads are not there)
    _DOWNLOADERS[os.getpid()] = (web, downloader)
    return downloader


def read_downloaded(data: bytes, max_pixels: int) -> tuple[bytes, ImageHeader]:
    """A download's header, checked before it is decoded (the same checks as a local file's)."""
    try:
        header = parse_header(data[:HEAD_BYTES], lambda offset, n: data[offset : offset + n], len(data), None)
    except HeaderError as error:
        raise ImageError("header", str(error)) from None
    return data, check_pixels(header, max_pixels)


def download_failure(item: Item, error: DownloadError) -> Failure:
    """A row that could not be downloaded, as errors.jsonl keeps it: the URL as shown, the cause."""
    return Failure(
        item.relpath, "download", error.reason, transient=error.transient, cause=error.cause, key=item.key or None
    )
