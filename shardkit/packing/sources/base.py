"""What every source convention is, and what its walk gives.

A `Source` is one convention of laying out samples (a class-folder tree, a list file, a metadata
table, sidecar files, a table of URLs, a folder of videos). Each is a class with the same small
contract, registered in `sources/__init__.py`'s `SOURCES`:

- `open(options)` (a class method): the source at `options.source` when this convention reads it,
  else None; a SourceError when it is its kind but cannot be read as asked. It lists and reads
  no more than it takes to tell (a list file from a table of URLs: its first line).
- `refuse(config)`: the pack flags it cannot take, each a ConfigError of one line; a pack calls it
  once, before any work.
- `walk()`: the `SourceWalk`, a stream of typed `Item`s and the inputs not taken. The walk's
  `source` is the convention that walked it: this one, or, where a listing decides (a bucket's
  prefix, a folder of videos with a table), the convention that listing found.
- what pack, probe and verify ask of a walked source: `kind` (the name the manifest keeps),
  `labelling`, `reading` (how a worker turns its items into records: `packing/reading.py`),
  `header_reads` (how probe reads headers that are not local files), `confine`, `downloads` and
  `shares_files`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

from ...core.config import PackConfig, TableConfig, WebConfig
from ...core.errors import ConfigError, Failure, OutputError
from ...storage.urls import is_remote
from ..reading import Files, Reading
from .item import Item, Run

if TYPE_CHECKING:
    from ..objects import Transfer
    from ..scan_rows import ScanRow
    from .rows import Table


@dataclass(frozen=True)
class WalkOptions:
    """What a walk is asked for: where the source is, and the flags that choose its convention and
    shape its items. `storage_options` reach a bucket (a local source ignores them); keys=False
    leaves a folder's keys empty (probe has no use for them); `videos` walks videos, not images."""

    source: str
    labels: str = "auto"
    keys: bool = True
    table: TableConfig | None = None
    sidecars: bool = False
    storage_options: dict[str, Any] | None = None
    web: WebConfig | None = None
    videos: bool = False


@dataclass(frozen=True)
class Labelling:
    """How a source's samples are labelled: `origin` is "folders" (a top-level folder a class),
    "list" (a list file's labels), "column" (a table's), "sidecars" (x.cls files) or "none"."""

    origin: str
    classes: int  # class names (0: labels are whole numbers, or there are none)
    said: str  # in words, for a summary
    warnings: list[str] = field(default_factory=list)  # one line each


ProbeJob = tuple[list[str], list[str], int]  # a chunk's paths, relpaths, and the pixel limit


class HeaderReads(NamedTuple):
    """How probe reads the headers of items that are not local files: `scan` a chunk into its
    rows, and `digest` a candidate copy (its sha256 and size, None when it cannot be read)."""

    scan: Callable[[ProbeJob], list[ScanRow]]
    digest: Callable[[str, int], tuple[str, int] | None]


class Source(ABC):
    """One source convention (see the module's docstring for the contract)."""

    KIND: ClassVar[str] = ""
    # Its items are downloaded from the web as they are read: a row may fail transiently (and a
    # --resume downloads it again), and the download settings decide which rows get in.
    downloads: ClassVar[bool] = False

    def __init__(self, options: WalkOptions) -> None:
        self.options = options

    @classmethod
    @abstractmethod
    def open(cls, options: WalkOptions) -> Source | None:
        """The source at `options.source` when this convention reads it, else None."""

    @abstractmethod
    def walk(self) -> SourceWalk:
        """The source walked: its items streamed, its classes known up front."""

    @property
    def kind(self) -> str:
        """The source's kind as the manifest names it (`settings.source.layout`)."""
        return self.KIND

    @property
    def root(self) -> str:
        return self.options.source

    def refuse(self, config: PackConfig) -> None:
        """The pack flags this source cannot take: a bucket's prefix or object is never hashed
        nor weighed here, and the output must not lie inside it."""
        if is_remote(self.root):
            refuse_remote(config)

    def labelling(self, found: SourceWalk, labels: str) -> Labelling:
        """How `found` (walked whole) labels its samples under the `labels` mode asked."""
        return Labelling("none", 0, "unlabelled")

    @property
    def confine(self) -> str | None:
        """The real folder the items' files must lie in (a link must not lead outside), where the
        items name files by paths the user wrote; None where the walk itself found the files."""
        return None

    def reading(self, config: PackConfig) -> Reading:
        """How a worker turns this source's items into records: image files by default."""
        return Files(self.confine)

    def header_reads(self, found: SourceWalk, transfer: Transfer) -> HeaderReads | None:
        """How probe reads the items' headers: None for local files (the compiled scanner); a
        bucket's objects by ranges, on threads."""
        if found.options is None:
            return None
        from ..objects import object_digest, probe_objects

        return HeaderReads(partial(probe_objects, found.options, transfer), partial(object_digest, found.options))

    @property
    def shares_files(self) -> bool:
        """Whether several items may name one input file, each packed or listed on its own (a span
        table's rows of one video): verify counts such a file once."""
        return False


def refuse_remote(config: PackConfig) -> None:
    """What a source in a bucket (or at a URL) does not take yet: both read local files."""
    if config.dedup != "none":
        raise ConfigError(f"{config.source}: --dedup hashes local files; it does not take a bucket source yet")
    if config.shard_bytes is not None:
        raise ConfigError(
            f"{config.source}: --shard-bytes estimates each image's output from its local file; "
            "use --shard-size with a bucket source"
        )
    if is_remote(config.output):
        source, output = config.source.rstrip("/"), config.output.rstrip("/")
        if output == source or output.startswith(source + "/"):
            raise OutputError(
                f"{config.output}: lies inside the source prefix {config.source}; write the shards elsewhere"
            )


@dataclass(frozen=True)
class SourceList:
    """A source read whole: a list file, or a walk once --dedup has hashed and thinned it."""

    root: str
    layout: str  # the source's kind, as the manifest names it
    items: list[Item]
    classes: list[str] = field(default_factory=list)
    skipped: list[Failure] = field(default_factory=list)


@dataclass
class SourceWalk:
    """A source being walked by its `source`: classes are known up front; `items` yields every
    sample in byte order of the relative paths (a table's: in row order), as the walk finds them,
    and fills `skipped` as it goes. Only the folders on the current path are held in memory, never
    the whole list."""

    root: str
    source: Source  # the convention that walks it
    items: Iterable[Item]
    classes: list[str] = field(default_factory=list)
    skipped: list[Failure] = field(default_factory=list)
    listed: SourceList | None = None  # a list file, read whole
    table: Table | None = None  # a metadata table the samples come from
    runs: Iterable[Run] | None = None  # a folder's walk, as runs of one folder's files (`items`, batched)
    options: dict[str, Any] | None = None  # a bucket's: the storage options that reach it (None: local)
    # What the walk saw as it went (complete once `items` is taken), for the words on its labels
    # (labelling.py): a folder walk's depths ('/'s in a relpath) with the first file at each, and a
    # sidecar walk's samples and those of them with a label (x.cls)
    depths: dict[int, str] = field(default_factory=dict)
    samples: int = 0
    labelled: int = 0

    @property
    def layout(self) -> str:
        """The source's kind, as the manifest names it (`Source.kind`)."""
        return self.source.kind
