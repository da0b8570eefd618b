"""The worker's side of a table of URLs: a shard's images downloaded ahead of the encoder, in the
shard's order, by the process's Downloader (storage/download.py: its threads, its per-host limit,
its retries); and a download's bytes checked as a local file's are (header first, pixel limit)
before anything decodes them."""

from __future__ import annotations

import os
from collections.abc import Generator, Iterable, Sequence

from ..core.config import WebConfig
from ..core.errors import Failure, HeaderError, ImageError, OutputError
from ..core.headers import HEAD_BYTES, ImageHeader, parse_header
from ..formats import get_format
from ..formats.base import Record
from ..storage.download import Downloader, DownloadError
from .encode import check_pixels
from .sources import Item
from .sources.urls import expected_sha256

Fetched = bytes | DownloadError
Kept = Fetched | Record | Failure  # a retried shard's row: downloaded again, or kept as it was

_DOWNLOADERS: dict[int, tuple[WebConfig, Downloader]] = {}  # pid -> the process's downloader


def downloads(items: Iterable[Item], web: WebConfig) -> Generator[Fetched, None, None]:
    """Each item's bytes or why not, in the items' order, fetched ahead on the process's threads."""
    yield from _downloader(web).fetch((item.path, expected_sha256(item)) for item in items)


def refetched(
    items: Sequence[Item], shard: str, format: str, earlier: list[Failure], web: WebConfig
) -> Generator[Kept, None, None]:
    """A shard written again by --resume because some of its rows failed transiently: its records
    read back from the shard file it replaces (byte for byte what the formats write again), the
    rows that failed for good as they were, and only the rows that failed transiently downloaded
    again; in the items' order, streamed (the earlier shard holds its records in that order)."""
    transient = {row.path for row in earlier if row.transient}
    final = {row.path: row for row in earlier if not row.transient}
    reader = get_format(format).reader(shard)
    got = downloads([item for item in items if item.relpath in transient], web)
    try:
        records = iter(reader)
        record = next(records, None)
        for item in items:
            if item.relpath in transient:
                yield next(got)
            elif item.relpath in final:
                yield final[item.relpath]
            elif record is not None and record.key == item.key:
                yield record
                record = next(records, None)
            else:  # (the shard's bytes matched its done marker: a shardkit bug, never the input's)
                raise OutputError(f"{shard}: lacks the record of {item.key} that its done marker vouches for")
    finally:
        got.close()
        reader.close()


def _downloader(web: WebConfig) -> Downloader:
    held = _DOWNLOADERS.get(os.getpid())
    if held is not None and held[0] == web:
        return held[1]
    if held is not None:
        held[1].close()
    downloader = Downloader(web)
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
    return Failure(item.relpath, "download", error.reason, transient=error.transient, cause=error.cause)
