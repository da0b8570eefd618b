"""A bucket's prefix as a source (`BucketSource`): an object-storage prefix (s3://, gs://, any fsspec
URL that lists) walked with a folder's conventions: class prefixes or flat, a metadata table at its
root, sidecars, whichever its top-level listing and the flags ask for. It gives
the keys, relpaths, labels, classes and order a local walk of the same tree gives, from the same
code (folder's `walk_tree` and `sorted_listing`, sidecars' `sidecar_items`, table's `from_table`):
only the listing differs. Items carry the object's URL as their path.

The listing is streamed: one prefix at a time by the filesystem's delimiter listing, never a listing
of the whole bucket held; the top level is listed once, up front (the class names, a table). A table
is fetched to a temporary file and read as a local one. The objects are read by `packing/objects.py`."""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

from ...core.config import TableConfig
from ...core.errors import Failure, SourceError
from ...runtime.pools import map_threads
from ...storage.store import Store
from ...storage.urls import is_remote
from .base import Source, SourceWalk, WalkOptions
from .folder import IMAGE_EXTENSIONS, FolderSource, Listing, sorted_listing, walk_runs, walk_tree
from .item import Run, skip
from .rows import AUTO_TABLES, Table, both_present, find_table, metadata_kind
from .sidecars import Name, SidecarSource, counted, refuse_folder_labels, sidecar_items
from .table import TableSource, from_table, refuse_sidecars

_LISTING_THREADS = 16  # top-level prefixes checked for an image at once (each a listing or a few)


class BucketSource(Source):
    """A bucket's prefix: opened without a listing (what it cannot take is refused first), listed
    when walked, and walked by the folder, table or sidecar convention, which is the walk's `source`;
    the items' paths are the objects' URLs."""

    @classmethod
    def open(cls, options: WalkOptions) -> BucketSource | None:
        return cls(options) if is_remote(options.source) else None

    def walk(self) -> SourceWalk:
        options = self.options
        bucket = open_bucket(options.source, options.table or TableConfig(), options.storage_options)
        if bucket.table is not None:
            refuse_sidecars(bucket.root, bucket.table, options.sidecars)
        refuse_folder_labels(bucket.root, options)
        if bucket.table is not None:
            return bucket.rows(TableSource(options, bucket.table), options.labels, options.keys)
        if options.sidecars:
            return bucket.sidecars(SidecarSource(options), options.keys)
        return bucket.folders(FolderSource(options), options.labels, options.keys)


@dataclass
class Bucket:
    """A prefix opened for a walk: its store, its top-level entries (listed once) and the metadata
    table that makes it a table source, if any (a local copy)."""

    store: Store
    top: list[Name]
    table: Table | None

    @property
    def root(self) -> str:
        return self.store.url

    def folders(self, source: FolderSource, labels: str, keys: bool) -> SourceWalk:
        """Class prefixes or flat, as `folder.from_folder`."""
        skipped: list[Failure] = []
        found = walk_tree(
            source, self.root, self.root + "/", _listing(self.top, "", skipped, keys), labels, skipped,
            lambda folders: _holding(self.store, folders),
            lambda rel_dir: _listing(_visible(self.store, rel_dir), rel_dir, skipped, keys),
        )  # fmt: skip
        found.options = self.store.options
        return found

    def sidecars(self, source: SidecarSource, keys: bool) -> SourceWalk:
        """Files sharing a stem are one sample, as `sidecars.from_sidecars`."""
        found = SourceWalk(self.root, source, [], [], [], options=self.store.options)
        found.items = counted(
            found, sidecar_items(self.root + "/", "", found.skipped, partial(_visible, self.store), keys)
        )
        return found

    def rows(self, source: TableSource, labels: str, keys: bool) -> SourceWalk:
        """One sample per row of the table, as `table.from_table`; a row's path names an object
        under the prefix as written (a bucket has no links)."""
        assert self.table is not None
        found = from_table(source, self.root, self.table, labels, keys, real=str, images=self._images)
        found.options = self.store.options
        return found

    def _images(self) -> Iterator[Run]:
        ignored: list[Failure] = []  # (what is not an image is not a table's business)
        listed = _listing(self.top, "", ignored, False)
        return walk_runs(
            self.root + "/", listed, None, ignored, lambda rel_dir: _listing(_visible(self.store, rel_dir), rel_dir,
                                                                             ignored, False)
        )  # fmt: skip


def open_bucket(url: str, config: TableConfig, options: dict[str, Any] | None) -> Bucket:
    """The prefix at `url`, its top level listed: SourceError when nothing lies under it."""
    store = Store(url, dict(options or {}))
    try:
        top = _visible(store, "", missing_ok=False)
    except (FileNotFoundError, NotADirectoryError):
        top = []
    if not top:
        raise SourceError(f"{store.url}: no such prefix")
    return Bucket(store, top, _table(store, top, config))


def _visible(store: Store, rel_dir: str, missing_ok: bool = True) -> list[Name]:
    """A prefix's entries but hidden ones (a name starting with '.', as a folder's), sorted by
    name; none when the prefix has gone since its parent was listed."""
    try:
        entries = store.folder(rel_dir)
    except FileNotFoundError:
        if not missing_ok:
            raise
        return []
    return sorted((name, is_dir) for name, is_dir in entries if not name.startswith("."))


def _listing(names: list[Name], rel_dir: str, skipped: list[Failure], keys: bool) -> Listing:
    """A prefix's `Listing`, as `folder.listing` makes a folder's: image objects and sub-prefixes."""
    base = rel_dir + "/" if rel_dir else ""
    kept: list[str] = []
    for name, is_dir in names:
        if is_dir:
            kept.append(name + "/")
        elif (dot := name.rfind(".")) > 0 and name[dot:].lower() in IMAGE_EXTENSIONS:
            kept.append(name)
        else:
            skipped.append(skip(base + name, "not an image file extension"))
    return sorted_listing(kept, rel_dir, keys)


def _holding(store: Store, folders: list[str]) -> list[str]:
    """The top-level prefixes with an image object somewhere below them (the classes), checked in
    threads: each a listing, or a few where images lie deeper."""
    has_images = [False] * len(folders)
    for index, found in map_threads(partial(_holds_image, store), folders, _LISTING_THREADS):
        has_images[index] = found
    return [rel for rel, found in zip(folders, has_images, strict=True) if found]


def _holds_image(store: Store, rel_dir: str) -> bool:
    """Whether an image object lies somewhere below `rel_dir`; stops at the first one found."""
    stack = [rel_dir]
    while stack:
        rel = stack.pop()
        for name, is_dir in _visible(store, rel):
            if is_dir:
                stack.append(f"{rel}/{name}")
            elif (dot := name.rfind(".")) > 0 and name[dot:].lower() in IMAGE_EXTENSIONS:
                return True
    return False


def _table(store: Store, top: list[Name], config: TableConfig) -> Table | None:
    """The metadata table of a bucket source: --metadata (a local file, or an object fetched), else
    metadata.jsonl|csv|parquet at the prefix's root, fetched; None when there is neither."""
    if config.path is not None and not is_remote(config.path):
        return find_table(store.url, config)  # a local table naming objects under the prefix
    if config.path is not None:
        url = os.fspath(config.path)
    else:
        present = [name for name in AUTO_TABLES if (name, False) in top]
        if not present:
            return None
        if len(present) > 1:
            raise both_present(store.url, present)
        url = store.child(present[0])
    kind = metadata_kind(url)
    path, local = fetch_copy(url, store.options, "metadata table")
    table = Table(path, kind, config, os.path.basename(path), url=url)
    weakref.finalize(table, shutil.rmtree, local, True)  # the copy lives as long as the walk reading it
    return table


def fetch_copy(url: str, options: dict[str, Any] | None, what: str) -> tuple[str, str]:
    """A local copy of the object at `url` (a table: read twice, streamed): its path, and the
    temporary folder that holds it, the caller's to remove. SourceError when there is none."""
    folder, _, name = url.rpartition("/")
    local = tempfile.mkdtemp(prefix="shardkit-table-")
    path = os.path.join(local, name or "table")
    try:
        Store(folder, dict(options or {})).get(name, path)
    except FileNotFoundError:
        shutil.rmtree(local, ignore_errors=True)
        raise SourceError(f"{url}: no such {what}") from None
    except BaseException:
        shutil.rmtree(local, ignore_errors=True)
        raise
    return path, local
