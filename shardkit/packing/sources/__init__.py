"""Sources: what a pack, a probe or a verify --source reads, as a stream of typed `Item`s and the
inputs not taken (`Failure`s). One module per source convention, each a function from a location
to a `SourceWalk`; `walk()` picks the convention:

- `folder`: class sub-folders or a flat folder (and the sorted listing the others share);
- `listfile`: a text file of `path[,label]` lines;
- `table`: a folder with a metadata table, one sample per row (`rows` reads CSV, TSV, JSONL, parquet);
- `sidecars`: files sharing a stem are one sample (x.jpg, x.txt, x.json, x.cls, x.seg.png);
- `urls`: a table file whose rows name images by http(s) URL (downloaded by the worker);
- `bucket`: an object-storage prefix walked with the folder, table and sidecar conventions;
- `video`: a folder of videos (class sub-folders or flat), each cut into clips by the worker.

A new convention is a module here and a branch in `walk()`.
"""

from __future__ import annotations

import os
import shutil
import weakref
from typing import Any

from ...core.config import LABEL_MODES, TableConfig, WebConfig
from ...core.errors import SourceError
from ...storage.urls import is_remote
from .bucket import fetch_copy, open_bucket
from .folder import IMAGE_EXTENSIONS, VIDEO_SUFFIXES, check_folder, from_folder
from .item import Item, Run, SourceList, SourceWalk, display, make_key, payload, with_payload
from .listfile import from_list
from .rows import Table, find_table, table_kind
from .sidecars import from_sidecars
from .table import from_table, local_runs
from .urls import from_urls, url_table
from .video import from_videos, holds_videos

__all__ = [
    "IMAGE_EXTENSIONS", "Item", "Run", "SourceList", "SourceWalk", "display", "make_key", "payload", "walk",
    "with_payload",
]  # fmt: skip


def walk(
    source: str | os.PathLike[str],
    labels: str = "auto",
    *,
    keys: bool = True,
    table: TableConfig | None = None,
    sidecars: bool = False,
    storage_options: dict[str, Any] | None = None,
    web: WebConfig | None = None,
    videos: bool = False,
) -> SourceWalk:
    """Start walking `source` (a folder, a list file, or a bucket's prefix: s3://, gs://... reached
    with `storage_options`, which a local source ignores: they are the output's too); `labels` is
    auto, folders or none. A bad source is refused here, before any item is yielded. keys=False
    leaves the keys of a folder's items empty (probe has no use for them, and they cost more than
    the walk). A folder with a metadata table (`table.path`, or metadata.jsonl|csv|parquet at its
    root) has one sample per row; with `sidecars`, files sharing a stem are one sample. A table
    file whose rows hold URLs (its column `web.url_column`) is a table of images to download.
    With `videos`, a local folder's videos are the items (class sub-folders or flat), not its images."""
    if labels not in LABEL_MODES:
        raise SourceError(f"labels must be auto, folders or none, not {labels!r}")
    if videos:
        return _videos(source, labels, keys, table, sidecars)
    if is_remote(source) and table_kind(os.fspath(source)) is not None:  # a table of URLs in a bucket or on the web
        return _remote_url_table(os.fspath(source), labels, keys, table, sidecars, storage_options, web)
    if is_remote(source):
        bucket = open_bucket(os.fspath(source), table or TableConfig(), storage_options)
        _refuse_mixed(bucket.root, bucket.table, sidecars, labels)
        if bucket.table is not None:
            return bucket.rows(labels, keys)
        return bucket.sidecars(keys) if sidecars else bucket.folders(labels, keys)
    root = os.fspath(source)
    if not os.path.exists(root):
        raise SourceError(f"{display(root)}: no such file or folder")
    if os.path.isfile(root):
        if os.path.splitext(root)[1].lower() in IMAGE_EXTENSIONS:
            raise SourceError(f"{display(root)}: is an image; give the folder that holds it (or a list file)")
        urls = url_table(root, table or TableConfig(), web or WebConfig())
        if urls is not None:
            if table is not None and table.path is not None:
                raise SourceError(f"{display(root)}: is a table of URLs itself; --metadata is for a source folder")
            if sidecars:
                raise SourceError(f"{display(root)}: a table of URLs has no sidecar files; leave out --sidecars")
            return from_urls(urls, labels, keys)
        if table is not None and table.path is not None:
            raise SourceError(f"{display(root)}: --metadata needs a source folder (the rows' paths are relative to it)")
        listed = from_list(root)
        return SourceWalk(listed.root, listed.layout, listed.items, listed.classes, listed.skipped, listed)
    if not os.path.isdir(root):
        raise SourceError(f"{display(root)}: not a folder or a list file")
    check_folder(root)
    metadata = find_table(root, table or TableConfig())
    _refuse_mixed(root, metadata, sidecars, labels)
    if metadata is not None:
        return from_table(root, metadata, labels, keys)
    if sidecars:
        return from_sidecars(root, keys)
    try:
        return from_folder(root, labels, keys)
    except SourceError:
        if holds_videos(root):  # a folder of videos given as one of images: say how to pack it
            raise SourceError(
                f"{display(root)}: no images found, but it holds videos; cut them into clips with --clip-seconds S"
            ) from None
        raise


def _videos(
    source: str | os.PathLike[str], labels: str, keys: bool, table: TableConfig | None, sidecars: bool
) -> SourceWalk:
    """A local folder of videos, or of videos named by its metadata table: a row a video (its caption
    and columns go to each of its clips), or, when the table has `start` and `end` columns, a row a
    clip (that span of its video; --clip-seconds and --clip-stride do not apply). What the video
    convention does not take yet is refused."""
    root = os.fspath(source)
    if is_remote(root):
        raise SourceError(f"{root}: videos are packed from a local folder; a bucket's prefix is not taken yet")
    if not os.path.isdir(root):
        raise SourceError(f"{display(root)}: --clip-seconds needs a folder of videos")
    if sidecars:
        raise SourceError(f"{display(root)}: videos take class folders or a metadata table; --sidecars is for images")
    check_folder(root)
    metadata = find_table(root, table or TableConfig())
    if metadata is not None:  # videos no row names are listed, as images are in a pack of images
        videos = lambda: local_runs(root, VIDEO_SUFFIXES)  # noqa: E731
        return from_table(root, metadata, labels, keys, images=videos, spans=True)
    return from_videos(root, labels, keys)


def _remote_url_table(
    url: str,
    labels: str,
    keys: bool,
    table: TableConfig | None,
    sidecars: bool,
    storage_options: dict[str, Any] | None,
    web: WebConfig | None,
) -> SourceWalk:
    """A table of URLs that is itself an object (s3://.../laion.parquet, https://.../part-0.parquet):
    fetched to a temporary copy that lives as long as the walk, then read as a local one."""
    path, local = fetch_copy(url, storage_options, "table")
    found = url_table(path, table or TableConfig(), web or WebConfig())
    if found is None:
        shutil.rmtree(local, ignore_errors=True)
        raise SourceError(f"{url}: no {(web or WebConfig()).url_column!r} column; name it with --url-column")
    found.url = url
    if (table is not None and table.path is not None) or sidecars:
        shutil.rmtree(local, ignore_errors=True)
        raise SourceError(f"{url}: a table of URLs takes neither --metadata nor --sidecars")
    walked = from_urls(found, labels, keys)
    weakref.finalize(found, shutil.rmtree, local, True)  # the copy lives as long as the walk reading it
    return walked


def _refuse_mixed(root: str, metadata: Table | None, sidecars: bool, labels: str) -> None:
    """Conventions that exclude each other, refused alike for a folder and a bucket."""
    if metadata is not None and sidecars:
        raise SourceError(
            f"{display(root)}: samples come from {metadata.name}; --sidecars is for folders without a table"
        )
    if sidecars and labels == "folders":
        raise SourceError(f"{display(root)}: with --sidecars, labels come from x.cls files, not folders")
