"""Sources: what a pack, a probe or a verify --source reads, as a stream of typed `Item`s and the
inputs not taken (`Failure`s). One module per source convention, each a `Source` (base.py holds the
contract), registered in `SOURCES`:

- `folder`: class sub-folders or a flat folder (and the sorted listing the others share);
- `listfile`: a text file of `path[,label]` lines;
- `table`: a folder with a metadata table, one sample per row (`rows` reads CSV, TSV, JSONL, parquet);
- `sidecars`: files sharing a stem are one sample (x.jpg, x.txt, x.json, x.cls, x.seg.png);
- `url_table`: a table file whose rows name images by http(s) URL (downloaded by the worker), or
  a local folder or glob of its parts (`url_parts`);
- `bucket`: an object-storage prefix walked with the folder, table and sidecar conventions;
- `video`: a folder of videos (class sub-folders or flat, or a table), each cut into clips by the worker.

A new convention is a module here with its `Source`, and its line in `SOURCES`.
"""

from __future__ import annotations

import os
from typing import Any

from ...core.config import LABEL_MODES, PackConfig, TableConfig, WebConfig
from ...core.errors import SourceError
from .base import Source, SourceList, SourceWalk, WalkOptions
from .bucket import BucketSource
from .folder import IMAGE_EXTENSIONS, FolderSource
from .item import Item, Run, display, make_key, payload, with_payload
from .listfile import ListSource
from .sidecars import SidecarSource
from .table import TableSource
from .url_table import UrlSource
from .video import VideoSource

__all__ = [
    "IMAGE_EXTENSIONS", "SOURCES", "Item", "Run", "Source", "SourceList", "SourceWalk", "WalkOptions", "display",
    "make_key", "open_source", "pack_source", "payload", "walk", "with_payload",
]  # fmt: skip

# The source conventions, in the order each is asked whether a source is its kind: the first that
# takes it walks it. Videos are asked for by a flag; a table of URLs may be an object, so it comes
# before a bucket's prefix, and a folder of its parts, before the folder conventions; a local
# folder's table or --sidecars decide before its plain walk.
SOURCES: dict[str, type[Source]] = {
    "videos": VideoSource,
    "urls": UrlSource,
    "bucket": BucketSource,
    "list": ListSource,
    "table": TableSource,
    "sidecars": SidecarSource,
    "folder": FolderSource,
}


def open_source(
    source: str | os.PathLike[str],
    labels: str = "auto",
    *,
    keys: bool = True,
    table: TableConfig | None = None,
    sidecars: bool = False,
    storage_options: dict[str, Any] | None = None,
    web: WebConfig | None = None,
    videos: bool = False,
) -> Source:
    """The source at `source` (a folder, a list file, a table of URLs, or a bucket's prefix: s3://,
    gs://... reached with `storage_options`, which a local source ignores: they are the output's
    too), by the first convention of `SOURCES` that takes it; `labels` is auto, folders or none. A
    bad source is refused here or by its walk, before any item is yielded."""
    if labels not in LABEL_MODES:
        raise SourceError(f"labels must be auto, folders or none, not {labels!r}")
    options = WalkOptions(os.fspath(source), labels, keys, table, sidecars, storage_options, web, videos)
    for convention in SOURCES.values():
        found = convention.open(options)
        if found is not None:
            return found
    root = options.source
    if not os.path.exists(root):
        raise SourceError(f"{display(root)}: no such file or folder")
    raise SourceError(f"{display(root)}: not a folder or a list file")


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
    """Start walking `source` (see `open_source`). keys=False leaves the keys of a folder's items
    empty (probe has no use for them, and they cost more than the walk). A folder with a metadata
    table (`table.path`, or metadata.jsonl|csv|parquet at its root) has one sample per row; with
    `sidecars`, files sharing a stem are one sample. A table file whose rows hold URLs (its column
    `web.url_column`) is a table of images to download. With `videos`, a local folder's videos are
    the items (class sub-folders or flat), not its images."""
    return open_source(
        source, labels, keys=keys, table=table, sidecars=sidecars, storage_options=storage_options, web=web,
        videos=videos,
    ).walk()  # fmt: skip


def pack_source(config: PackConfig) -> Source:
    """The source a pack of `config` reads."""
    return open_source(
        config.source, config.labels, table=config.table, sidecars=config.sidecars,
        storage_options=config.storage_options, web=config.web, videos=config.clips.seconds is not None,
    )  # fmt: skip
