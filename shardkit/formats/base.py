"""What every format shares, so that a format module writes only its encoding and decoding.

A reader subclasses `ShardReader`: it is opened lazily in the process that reads (handles never
cross a fork or a pickle: `TRANSIENT` names them), gets `__iter__` from `read_range`, `read_key`
from its index of keys unless it has a native one, and refuses a record over the size limit with
one message. A writer subclasses `ShardWriter`, which validates its options (unknown keys and
wrong types refused before anything is written) and encodes metadata the one way all formats do.
"""

from __future__ import annotations

import json
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

from ..core.config import LABEL_RULE, MAX_LABEL, MAX_RECORD_BYTES
from ..core.errors import ConfigError, ShardFormatError
from ..core.safeio import loads

if TYPE_CHECKING:
    from ..core.manifest import ShardInfo


class Record(NamedTuple):
    """One stored sample. A NamedTuple: readers build one per record, and a tuple is cheaper to
    build than a frozen dataclass."""

    key: str
    data: bytes  # encoded image (ext "jpg") or .npy pixels (ext "npy")
    ext: str
    label: int | None
    meta: dict[str, Any]  # shardkit's own: source path, sizes (never the user's columns)
    text: str | list[str] | None = None  # the caption, or several
    columns: dict[str, Any] | None = None  # the user's columns (JSON values), apart from `meta`
    files: dict[str, bytes] | None = None  # sidecar fields by suffix ("seg.png": a mask's PNG bytes)


def checked(record: Record, where: object) -> Record:
    """Shards come from strangers: a record's fields must have the types readers rely on."""
    if not isinstance(record.key, str) or not isinstance(record.ext, str) or not isinstance(record.meta, dict):
        raise ShardFormatError(f"{where}: record {str(record.key)[:200]!r} has fields of the wrong type")
    label = record.label
    if label is not None and (not isinstance(label, int) or isinstance(label, bool) or not 0 <= label <= MAX_LABEL):
        raise ShardFormatError(f"{where}: record {record.key} has a label that is not {LABEL_RULE}")
    if record[5:] != _NOTHING_MORE:  # a caption, columns or fields (one comparison for image-only records)
        _check_more(record, where)
    if not record.key.isascii():  # our keys are ASCII; others must at least be valid UTF-8
        try:
            record.key.encode("utf-8")
        except UnicodeEncodeError:
            raise ShardFormatError(f"{where}: record key {record.key!r} is not UTF-8") from None
    return record


_NOTHING_MORE = (None, None, None)


def _check_more(record: Record, where: object) -> None:
    if record.text is not None and not _is_text(record.text):
        raise ShardFormatError(f"{where}: record {record.key} has a caption that is not text or a list of texts")
    if record.columns is not None and not isinstance(record.columns, dict):
        raise ShardFormatError(f"{where}: record {record.key} has columns that are not a JSON object")
    if record.files is not None and not (
        isinstance(record.files, dict)
        and all(isinstance(name, str) and isinstance(data, bytes) for name, data in record.files.items())
    ):
        raise ShardFormatError(f"{where}: record {record.key} has fields that are not named bytes")


def _is_text(text: object) -> bool:
    return isinstance(text, str) or (isinstance(text, list) and all(isinstance(item, str) for item in text))


# Member names a record's own parts take: a sidecar field may not be called one of these.
RESERVED_FIELDS = frozenset({"cls", "json", "txt", "captions.json", "columns.json", "jpg", "npy"})


def files_layout(files: dict[str, bytes]) -> list[list[Any]]:
    """[[name, size], ...] in name order: how LMDB and HDF5 find fields stored after the image."""
    return [[name, len(files[name])] for name in sorted(files)]


def split_files(blob: bytes, layout: Any, where: object) -> tuple[bytes, dict[str, bytes]]:
    """(image, fields) from a record's bytes whose tail holds the fields `layout` describes."""
    if not isinstance(layout, list) or not all(
        isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str) and type(entry[1]) is int
        and entry[1] >= 0 for entry in layout
    ):  # fmt: skip
        raise ShardFormatError(f"{where}: unreadable field layout")
    total = sum(size for _, size in layout)
    if total > len(blob):
        raise ShardFormatError(f"{where}: fields run past the record")
    image, at, files = blob[: len(blob) - total], len(blob) - total, {}
    for name, size in layout:
        files[name] = blob[at : at + size]
        at += size
    return image, files


def encode_json(value: Any) -> bytes:
    """A caption list or the user's columns as stored: canonical JSON, UTF-8 kept as it is."""
    return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode()


def parse_meta(blob: bytes | str, where: object) -> dict[str, Any]:
    """A record's JSON metadata object (untrusted: nesting depth, type and encoding are checked)."""
    try:
        value = loads(blob)
    except ValueError as error:
        raise ShardFormatError(f"{where} has unreadable metadata ({error})") from None
    if type(value) is not dict:
        raise ShardFormatError(f"{where} has metadata that is not a JSON object")
    return value


_scan_json = json.JSONDecoder().scan_once  # type: ignore[attr-defined]  # the C scanner behind json.loads, minus its Python wrappers


def json_objects(blobs: list[bytes]) -> list[dict[str, Any] | None]:
    """Each blob's JSON object, or None where the blob is not exactly one JSON object (callers then
    parse it with parse_meta, which names the problem). The C scanner skips json.loads's Python
    wrappers, a cost paid once per record here; each object must span its whole blob, so nothing
    can shift between records."""
    objects: list[dict[str, Any] | None] = []
    for blob in blobs:
        try:
            text = blob.decode("utf-8").strip()
            value, end = _scan_json(text, 0)
        except (StopIteration, ValueError, TypeError, AttributeError, RecursionError):
            value, end, text = None, -1, ""
        objects.append(value if end == len(text) and type(value) is dict else None)
    return objects


def encode_meta(meta: dict[str, Any]) -> str:
    """A record's metadata as stored by every format: JSON with sorted keys (reproducible bytes)."""
    return json.dumps(meta, sort_keys=True)


class ShardWriter(ABC):
    """A writer opened on a temporary path with keyword options: `add(record)`, `close()` returning
    the count, `abort()` after a failure. A writer that sees every byte it writes may keep the
    shard's sha256 and its members as it goes (`sha256`, `members`), so that the shard just
    written is not read again to hash it and index it."""

    OPTIONS: ClassVar[dict[str, Any]] = {}  # option name -> default (its type is the default's type)
    # the members written, (name, data offset, size), for Backend.idx_file; None where not kept
    members: list[tuple[str, int, int]] | None = None

    def __init__(self, path: str, **options: Any) -> None:
        self.path = path
        unknown = set(options) - set(self.OPTIONS)
        if unknown:
            known = ", ".join(sorted(self.OPTIONS)) or "none"
            raise ConfigError(f"unknown writer option {sorted(unknown)[0]!r} (known: {known})")
        self.options = {**self.OPTIONS, **options}
        for name, value in options.items():
            wanted = type(self.OPTIONS[name])
            if not isinstance(value, wanted) or isinstance(value, bool) is not (wanted is bool):
                raise ConfigError(f"writer option {name} must be {wanted.__name__}, not {value!r}")

    @abstractmethod
    def add(self, record: Record) -> None: ...

    @abstractmethod
    def close(self) -> int: ...

    @abstractmethod
    def abort(self) -> None: ...

    def sha256(self) -> str | None:
        """The sha256 of the shard's bytes, once closed; None where the writer kept none (its file
        is hashed instead)."""
        return None

    # A format whose shard is its records' bytes end to end, then an ending (a tar: Backend.appends)
    # has a shard written in parts by several writers: each part's closed without the ending
    # (`close_part`), and the parts appended in order to the writer of the whole (`append`).

    def close_part(self) -> int:
        """Close what was written as a part of a shard, without the ending; the count."""
        raise NotImplementedError(f"{type(self).__name__} writes no parts")

    def append(self, path: str, count: int, members: list[tuple[str, int, int]] | None) -> None:
        """A part (its file, closed with close_part, holding `count` records and `members` placed
        from its own start) after what this writer has written so far."""
        raise NotImplementedError(f"{type(self).__name__} writes no parts")


class ShardReader(ABC):
    """A reader of one shard file, untrusted."""

    # attributes holding per-process handles: reset to None when the reader is pickled
    TRANSIENT: ClassVar[tuple[str, ...]] = ()

    def __init__(self, path: str) -> None:
        self.path = path
        self._pid = 0  # the process the handles were opened in
        self._by_key: dict[str, int] | None = None

    def in_this_process(self, handle: Any) -> bool:
        """Whether `handle` may be used here: opened, and not inherited through a fork."""
        return handle is not None and self._pid == os.getpid()

    def opened(self) -> None:
        self._pid = os.getpid()

    def __getstate__(self) -> dict[str, Any]:
        # handles do not travel to other processes; an index (plain data) does
        return {**self.__dict__, **dict.fromkeys(self.TRANSIENT), "_pid": 0}

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def keys(self) -> list[str]: ...

    @abstractmethod
    def read(self, index: int) -> Record: ...

    @abstractmethod
    def read_range(self, start: int, stop: int) -> Iterator[Record]: ...

    @abstractmethod
    def close(self) -> None: ...

    def __iter__(self) -> Iterator[Record]:
        return self.read_range(0, len(self))

    def positions(self) -> dict[str, int]:
        """Key -> index, from keys(), built once; a key stored twice is a damaged shard."""
        if self._by_key is None:
            keys = self.keys()
            by_key = {key: index for index, key in enumerate(keys)}
            if len(by_key) != len(keys):
                raise ShardFormatError(f"{self.path}: a key appears in two places")
            self._by_key = by_key
        return self._by_key

    def read_key(self, key: str) -> Record:
        try:
            index = self.positions()[key]
        except KeyError:
            raise KeyError(key) from None
        return self.read(index)

    def refuse_oversize(self, size: int, record: object) -> None:
        """Shards come from strangers: never allocate a record over the readers' limit."""
        if size > MAX_RECORD_BYTES:
            raise ShardFormatError(f"{self.path}: record {record} is over the size limit")


class Leftover(NamedTuple):
    """A file a plain reader of the format may leave beside a shard, named `<shard><suffix>`: a
    reader's trace, not a change to the output (verify notes it and goes on)."""

    suffix: str
    what: str  # what it is and who left it, for a person reading verify's notes


@dataclass(frozen=True)
class Backend:
    name: str
    suffix: str  # shard file suffix, with the dot
    random_access: bool  # by index and key without reading the shard from the start
    writer: Callable[..., ShardWriter]  # (path, **options): unknown options are a ConfigError
    reader: Callable[[str], ShardReader]
    # a shard's .idx file for other readers (DALI's), written beside it (core.manifest.idx_name): its
    # bytes, or None where the shard cannot have one; None for formats that need none. Given the
    # members its writer kept (ShardWriter.members), from those, without reading the shard.
    idx_file: Callable[[str, list[tuple[str, int, int]] | None], bytes | None] | None = None
    # a shard is its records' bytes end to end (ShardWriter.close_part, append): a shard's parts
    # written by several workers are joined by appending their files
    appends: bool = False
    # files other readers may leave beside a shard (LMDB's lock file)
    leftovers: tuple[Leftover, ...] = ()
    # the files for other readers beside the whole output, derived from its shards in manifest order:
    # (name, bytes) pairs, written with the manifest and listed in it (wids' shardindex.json)
    output_files: Callable[[list[ShardInfo]], list[tuple[str, bytes]]] | None = None
