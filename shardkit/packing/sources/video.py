"""The video convention (pack --clip-seconds; probe of a folder holding videos): a local folder's
videos, class sub-folders or flat, walked as the image folder convention walks images (folder.py),
one `Item` per video file (`VideoSource`); or a folder whose metadata table names its videos
(`VideoTableSource`): a row a video, or, when the table has `start` and `end` columns, a row a clip
(that span of its video). The worker cuts each item into clips (`Clips`, packing/clips.py); images
beside the videos are listed as skipped, never packed with them."""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Generator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import ClassVar

from ...core.clips import CLIP_EXT
from ...core.config import ClipConfig, PackConfig, TableConfig
from ...core.errors import ConfigError, SourceError
from ...core.manifest import sha256_file
from ...formats.base import Record
from ...storage.urls import is_remote
from ..reading import Outcome, Packing, Reading, attempt, check_confined
from .base import Labelling, SourceWalk, WalkOptions
from .folder import VIDEO_SUFFIXES, FolderSource, check_folder, from_folder, holds_file
from .item import Item, display
from .labelling import folder_labels
from .rows import Table, find_table
from .table import TableSource, from_table, has_spans, local_runs, names_spans


class VideoSource(FolderSource):
    """A local folder of videos, class sub-folders or flat, or of videos named by its metadata
    table (then the walk's source is a `VideoTableSource`). What the video convention does not
    take yet is refused."""

    @classmethod
    def open(cls, options: WalkOptions) -> VideoSource | None:
        return cls(options) if options.videos else None

    @property
    def kind(self) -> str:
        return "videos"  # (labelled or not: the walk's classes say)

    def walk(self) -> SourceWalk:
        metadata = self._table()
        if metadata is not None:  # videos no row names are listed, as images are in a pack of images
            return VideoTableSource(self.options, metadata).walk()
        return from_folder(self, self.root, self.options.labels, self.options.keys, VIDEO_SUFFIXES)

    def _table(self) -> Table | None:
        """The folder's metadata table, if any, once the folder is one a pack of videos takes."""
        root = self.root
        if is_remote(root):
            raise SourceError(f"{root}: videos are packed from a local folder; a bucket's prefix is not taken yet")
        if not os.path.isdir(root):
            raise SourceError(f"{display(root)}: --clip-seconds needs a folder of videos")
        if self.options.sidecars:
            raise SourceError(
                f"{display(root)}: videos take class folders or a metadata table; --sidecars is for images"
            )
        check_folder(root)
        return find_table(root, self.options.table or TableConfig())

    def refuse(self, config: PackConfig) -> None:
        """What a pack of videos does not take (yet), refused by name: each weighs or hashes an
        image's pixels, which a video is not; and a span table's rows give each clip's span."""
        super().refuse(config)
        where = config.source
        if config.dedup != "none":
            raise ConfigError(f"{where}: --dedup compares images; it does not take videos (--clip-seconds) yet")
        if config.shard_bytes is not None:
            raise ConfigError(
                f"{where}: --shard-bytes estimates images; with --clip-seconds use --shard-size (videos a shard)"
            )
        if config.resize.size == "auto":
            raise ConfigError(
                f"{where}: --resize auto follows probe's advice for images; give --resize N with --clip-seconds"
            )
        if config.resize.mode == "center-crop":
            raise ConfigError(f"{where}: clips keep the whole frame; --resize-mode center-crop is for images")
        if config.encode.encode != "jpeg":
            raise ConfigError(f"{where}: clips are always H.264 MP4; --encode is for images")
        if config.clips.stride is not None and (metadata := self._table()) is not None and names_spans(metadata):
            raise ConfigError(
                f"{config.source}: the table's start and end columns give each clip's span; leave out --clip-stride"
            )

    def labelling(self, found: SourceWalk, labels: str) -> Labelling:
        return folder_labels(found, labels, "videos")

    def reading(self, config: PackConfig) -> Reading:
        return Clips(config.clips)


class VideoTableSource(TableSource):
    """A folder of videos with a metadata table: a row a video (its caption and columns go to each
    of its clips), or, when the table has `start` and `end` columns, a row a clip ("spans": rows may
    share a video, and --clip-seconds and --clip-stride do not apply)."""

    spans = False  # settled by the walk's first pass over the table

    @property
    def kind(self) -> str:
        return "spans" if self.spans else "table"

    def walk(self) -> SourceWalk:
        root = self.root
        videos = lambda: local_runs(root, VIDEO_SUFFIXES)  # noqa: E731
        found = from_table(self, root, self.table, self.options.labels, self.options.keys, images=videos, spans=True)
        self.spans = has_spans(self.table)
        return found

    @property
    def shares_files(self) -> bool:
        return self.spans

    def reading(self, config: PackConfig) -> Reading:
        return Clips(config.clips, self.confine)


@dataclass(frozen=True)
class Clips(Reading):
    """How a worker reads videos: each cut into clips, a record a clip (keys: the video's, then the
    clip's number; a span row's one clip keeps the row's key). A video is packed whole or listed,
    one row, never both. `confine`: the real folder a table's videos must lie in."""

    clips: ClipConfig
    confine: str | None = None

    splits: ClassVar[bool] = False  # (a video's clips are one item's work)

    def packed(self, packing: Packing) -> Generator[Outcome, None, None]:
        return (self._cut(item, packing) for item in packing.items)

    def _cut(self, item: Item, packing: Packing) -> Outcome:
        from ..clips import clip_key, cut, cut_span  # (PyAV: only for a pack of videos)

        started = time.perf_counter()
        where = f"{item.span.where}: " if item.span is not None else ""  # a span row's error names its line

        def made() -> tuple[list[Record], int]:
            check_confined(item.path, self.confine)
            source, resize, max_pixels = display(item.relpath), packing.resize, packing.encode.max_pixels
            if item.span is not None:  # a span table's row: its one clip, keyed by the row already
                clips, keys = [cut_span(item.path, source, item.span, self.clips, resize, max_pixels)], [item.key]
            else:
                clips = cut(item.path, source, self.clips, resize, max_pixels)
                keys = [clip_key(item.key, clip.number) for clip in clips]
            packing.timings["encode"] += time.perf_counter() - started
            size = os.stat(item.path).st_size
            # the video's sha256, in each clip's meta and the index: an append tells a video it
            # holds from another under the same key, as it does an image
            started_reading = time.perf_counter()
            digest = {"source_sha256": _video_digest(item.path)}
            packing.timings["read"] += time.perf_counter() - started_reading
            records = [
                Record(key, clip.data, CLIP_EXT, item.label, {**clip.meta, **digest}, item.text, item.columns)
                for key, clip in zip(keys, clips, strict=True)
            ]
            return records, size

        record, size, failures = attempt(item, made, where)
        if item.span is not None:  # (rows share their video's path: a row's failure names the row's key)
            failures = [replace(failure, key=item.key) for failure in failures]
        return record, size, failures


def _video_digest(path: str) -> str:
    """The sha256 of a video file, once per process for the rows of a span table that share it (a
    long video with many rows is read once, not once a row): by its path, size, inode and times (the
    change time too: a file rewritten with its old modification time put back is another file)."""
    status = os.stat(path)
    return _digest_of(path, status.st_size, status.st_mtime_ns, status.st_ctime_ns, status.st_ino)


@functools.lru_cache(maxsize=64)
def _digest_of(path: str, size: int, mtime_ns: int, ctime_ns: int, inode: int) -> str:
    return sha256_file(Path(path))


def holds_videos(root: str) -> bool:
    """Whether a folder holds a video anywhere below it (stops at the first found): what turns "no
    images found" into the advice to cut the videos into clips."""
    return os.path.isdir(root) and holds_file(root, "", set(), VIDEO_SUFFIXES)
