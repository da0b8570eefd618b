"""LMDB shards: one single-file environment per shard (`subdir=False`), random access by index and key.

Layout (no pickle): b"i" + 8-byte big-endian index -> 4-byte header length, JSON header
{key, ext, label, meta}, then the image bytes; b"k" + key -> 8-byte index; b"__shardkit__" -> JSON
{count, version}.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import struct
import weakref
from collections.abc import Iterator
from typing import Any, ClassVar, NamedTuple

from ..core.errors import ShardFormatError, describe
from ..core.safeio import loads, open_regular
from .base import Backend, Leftover, Record, ShardReader, ShardWriter, checked, files_layout, json_objects, split_files

INFO_KEY = b"__shardkit__"
VERSION = 1
_BATCH = 256
_READ_BATCH = 64  # records whose headers are parsed ahead of their data (see json_objects)
_INITIAL_MAP = 64 * 1024 * 1024


def _index_key(index: int) -> bytes:
    return b"i" + index.to_bytes(8, "big")


def encode_value(record: Record) -> bytes:
    fields: dict[str, Any] = {"key": record.key, "ext": record.ext, "label": record.label, "meta": record.meta}
    if record.text is not None:  # only when there is one: an image-only record keeps its bytes
        fields["text"] = record.text
    if record.columns is not None:
        fields["columns"] = record.columns
    tail = b""
    if record.files:  # after the image, in name order
        fields["files"] = files_layout(record.files)
        tail = b"".join(record.files[name] for name, _ in fields["files"])
    header = json.dumps(fields, sort_keys=True).encode()
    return len(header).to_bytes(4, "big") + header + record.data + tail


def _header_size(value: bytes | memoryview, where: object) -> int:
    if len(value) < 4:
        raise ShardFormatError(f"{where}: record too short")
    size = int.from_bytes(value[:4], "big")
    if size > len(value) - 4:
        raise ShardFormatError(f"{where}: record header runs past the record")
    return size


def decode_value(value: bytes | memoryview, where: object, header: Any = None, size: int | None = None) -> Record:
    """A record from its stored value; `value` may be a view into the map (the image is copied
    once); `header` and `size`, when given, are its JSON header already parsed and that header's size."""
    if size is None:
        size = _header_size(value, where)
    try:
        if header is None:
            header = loads(bytes(value[4 : 4 + size]))
        record = Record(header["key"], bytes(value[4 + size :]), header["ext"], header["label"], header["meta"])
        if len(header) > 4:  # a caption, columns or fields beside key, ext, label and meta
            image, files = record.data, None
            if "files" in header:
                image, files = split_files(image, header["files"], where)
            record = record._replace(data=image, text=header.get("text"), columns=header.get("columns"), files=files)
    except (ValueError, KeyError, TypeError, IndexError):
        raise ShardFormatError(f"{where}: unreadable record header") from None
    return checked(record, where)


class _Where(NamedTuple):
    path: str
    position: int  # not `index`: that would hide tuple.index

    def __str__(self) -> str:
        return f"{self.path} record {self.position}"


class LmdbShardWriter(ShardWriter):
    OPTIONS: ClassVar[dict[str, Any]] = {"batch": _BATCH}  # records per write transaction

    def __init__(self, path: str, **options: object) -> None:
        import lmdb

        super().__init__(path, **options)
        self._lmdb = lmdb
        self._map_size = _INITIAL_MAP
        # lock=False: one writer per shard by design, and no '-lock' file next to the shard.
        try:
            self._env = lmdb.open(path, subdir=False, map_size=self._map_size, lock=False, sync=False, metasync=False)
        except lmdb.Error as error:  # (a disk that filled up between two shards: its first pages)
            raise _write_error(path, error, 0) from None
        self._path = path
        self._pending: list[Record] = []
        self._count = 0

    def add(self, record: Record) -> None:
        self._pending.append(record)
        if len(self._pending) >= self.options["batch"]:
            self._flush()

    def _flush(self, info: dict[str, Any] | None = None) -> None:
        try:
            self._commit(info)
        except self._lmdb.Error as error:
            raise _write_error(self._path, error, sum(len(r.data) for r in self._pending)) from None

    def _commit(self, info: dict[str, Any] | None) -> None:
        while True:
            try:
                with self._env.begin(write=True) as txn:
                    for offset, record in enumerate(self._pending):
                        index = self._count + offset
                        txn.put(_index_key(index), encode_value(record))
                        if not txn.put(b"k" + record.key.encode(), index.to_bytes(8, "big"), overwrite=False):
                            raise ShardFormatError(f"duplicate key {record.key} in one shard")
                    if info is not None:
                        txn.put(INFO_KEY, json.dumps(info, sort_keys=True).encode())
                break
            except self._lmdb.MapFullError:
                # Deterministic growth: the same records always grow the map at the same points.
                self._map_size *= 2
                self._env.set_mapsize(self._map_size)
        self._count += len(self._pending)
        self._pending = []

    def close(self) -> int:
        self._flush({"count": self._count + len(self._pending), "version": VERSION})
        try:
            self._env.sync(True)
        except self._lmdb.Error as error:
            raise _write_error(self._path, error, 0) from None
        finally:
            self._env.close()
        return self._count

    def abort(self) -> None:
        self._env.close()


def _file_size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError as error:
        raise ShardFormatError(f"{path}: cannot read ({describe(error)})") from None


def _write_error(path: str, error: Exception, pending: int) -> OSError:
    """LMDB reports a short write on a full disk as EIO: name the real cause when the disk is full."""
    try:
        usage = shutil.disk_usage(os.path.dirname(path) or ".")
        full = usage.free < pending + (1 << 20)
    except OSError:
        full = False
    if full:
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
    return OSError(errno.EIO, f"LMDB: {error}", path)


_META_MAGIC = 0xBEEFC0DE
_PAGE_HEADER = 16  # pgno (8), pad (2), flags (2), lower/upper (4) on 64-bit builds
_DB_SIZE = 48


def check_lmdb_file(path: str) -> None:
    """Refuse an LMDB file that LMDB could not read without touching memory past the file's end,
    before it is memory-mapped: such a touch kills the process (SIGBUS). So the meta pages must
    point inside the file, and every page of the main B-tree must be well formed: its node pointers,
    keys and inline values inside the page, its child and overflow pages inside the file. Only
    branch and leaf pages are read (images sit in overflow pages, whose extent is checked without
    reading them), so the check stays small beside reading the shard."""
    try:
        fd = open_regular(path)
    except OSError as error:
        raise ShardFormatError(f"{path}: cannot read ({describe(error)})") from None
    try:
        size = os.fstat(fd).st_size
        meta = _chosen_meta(fd, path)
        needed = (meta.last_page + 1) * meta.page_size
        if needed > size:
            raise ShardFormatError(f"{path}: truncated LMDB file ({size:,} bytes, its pages need {needed:,})")
        _check_tree(fd, meta, path)
    except OSError as error:
        raise ShardFormatError(f"{path}: cannot read ({describe(error)})") from None
    finally:
        os.close(fd)


class _Meta(NamedTuple):
    page_size: int
    last_page: int
    txnid: int
    root: int  # of the main database; _NO_PAGE when it is empty
    depth: int


_NO_PAGE = 2**64 - 1
_P_BRANCH, _P_LEAF, _P_OVERFLOW = 0x01, 0x02, 0x04
_F_BIGDATA = 0x01
_NODE_HEADER = 8  # data size or child page (lo, hi), flags, key size: four uint16
_MAX_DEPTH = 32  # LMDB's cursor stack


def _read_meta(fd: int, offset: int) -> _Meta | None:
    meta = os.pread(fd, _PAGE_HEADER + 24 + 2 * _DB_SIZE + 16, offset)[_PAGE_HEADER:]
    if len(meta) < 24 + 2 * _DB_SIZE + 16 or int.from_bytes(meta[:4], "little") != _META_MAGIC:
        return None
    main = 24 + _DB_SIZE  # the main database's MDB_db record
    return _Meta(
        page_size=int.from_bytes(meta[24:28], "little"),  # md_pad of the free-list DB holds the page size
        last_page=int.from_bytes(meta[24 + 2 * _DB_SIZE : 24 + 2 * _DB_SIZE + 8], "little"),
        txnid=int.from_bytes(meta[24 + 2 * _DB_SIZE + 8 : 24 + 2 * _DB_SIZE + 16], "little"),
        root=int.from_bytes(meta[main + 40 : main + 48], "little"),
        depth=int.from_bytes(meta[main + 6 : main + 8], "little"),
    )


def _chosen_meta(fd: int, path: str) -> _Meta:
    """The meta page LMDB will use: of meta 0 (page 0) and meta 1 (one page later), the newer."""
    first = _read_meta(fd, 0)
    if first is None or not 512 <= first.page_size <= 65536 or first.page_size & (first.page_size - 1):
        raise ShardFormatError(f"{path}: not an LMDB file (no meta page)")
    second = _read_meta(fd, first.page_size)
    return first if second is None or second.page_size != first.page_size or first.txnid >= second.txnid else second


def _check_tree(fd: int, meta: _Meta, path: str) -> None:
    if meta.root == _NO_PAGE:
        return
    size, pages = meta.page_size, meta.last_page + 1  # LMDB refuses page numbers from last_page + 1 on

    def bad(what: str) -> ShardFormatError:
        return ShardFormatError(f"{path}: damaged LMDB B-tree ({what})")

    stack, seen = [(meta.root, 1)], set()
    while stack:
        number, level = stack.pop()
        if not 2 <= number < pages or number in seen or level > _MAX_DEPTH:
            raise bad(f"page {number} out of place")
        seen.add(number)
        page = os.pread(fd, size, number * size)
        if len(page) < size:
            raise bad(f"page {number} is cut short")
        flags, lower, upper = struct.unpack_from("<HHH", page, 10)
        branch = flags & (_P_BRANCH | _P_LEAF | _P_OVERFLOW) == _P_BRANCH
        if not branch and flags & (_P_BRANCH | _P_LEAF | _P_OVERFLOW | 0x20) != _P_LEAF:
            raise bad(f"page {number} has flags {flags:#x}")
        if not _PAGE_HEADER <= lower <= upper <= size or (lower - _PAGE_HEADER) % 2:
            raise bad(f"page {number} has bounds {lower}..{upper}")
        for node in struct.unpack_from(f"<{(lower - _PAGE_HEADER) // 2}H", page, _PAGE_HEADER):
            if node < upper or node + _NODE_HEADER > size:
                raise bad(f"a node of page {number} lies outside it")
            low, high, node_flags, key_size = struct.unpack_from("<HHHH", page, node)
            data = node + _NODE_HEADER + key_size
            if data > size:
                raise bad(f"a key of page {number} runs past it")
            if branch:
                stack.append((low | high << 16 | node_flags << 32, level + 1))
            elif node_flags & ~_F_BIGDATA:
                raise bad(f"page {number} holds sub-databases or duplicates")
            elif node_flags & _F_BIGDATA:
                _check_overflow(page, data, low | high << 16, meta, bad)
            elif data + (low | high << 16) > size:
                raise bad(f"a value of page {number} runs past it")


def _check_overflow(page: bytes, data: int, value_size: int, meta: _Meta, bad: Any) -> None:
    """An F_BIGDATA value: its first overflow page and its whole extent must lie inside the file
    (measured, not read: LMDB hands the value back as a view of the map without touching it)."""
    if data + 8 > meta.page_size:
        raise bad("an overflow pointer runs past its page")
    first = int.from_bytes(page[data : data + 8], "little")
    if (
        not 2 <= first <= meta.last_page
        or first * meta.page_size + _PAGE_HEADER + value_size > (meta.last_page + 1) * meta.page_size
    ):
        raise bad(f"a value of {value_size:,} bytes at overflow page {first} runs past the file")


# py-lmdb refuses to open one file twice in a process (and a forked child inherits that guard), so
# readers of a shard share one read-only environment: [env, opener pid, readers]. A forked child
# reads through the inherited one: with lock=False there is no reader table to corrupt, only a
# read-only mapping. Only the process that opened an environment closes it.
_SHARED: dict[str, list[Any]] = {}


def _acquire(path: str) -> Any:
    import lmdb

    slot = os.path.realpath(path)
    if slot not in _SHARED:
        check_lmdb_file(path)
        try:
            env = lmdb.open(path, subdir=False, readonly=True, lock=False, readahead=False, max_readers=126)
        except lmdb.Error as error:
            raise ShardFormatError(f"{path}: not a readable LMDB file ({error})") from None
        _SHARED[slot] = [env, os.getpid(), 0]
    _SHARED[slot][2] += 1
    return _SHARED[slot][0]


def _release(path: str) -> None:
    slot = os.path.realpath(path)
    if slot in _SHARED:
        _SHARED[slot][2] -= 1
        if _SHARED[slot][2] <= 0:
            env, opener, _ = _SHARED.pop(slot)
            if opener == os.getpid():
                env.close()


class LmdbShardReader(ShardReader):
    TRANSIENT = ("_env", "_releaser")

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self._env: Any = None
        self._releaser: weakref.finalize[Any, Any] | None = None
        self._count: int | None = None

    def _open(self) -> Any:
        if not self.in_this_process(self._env):  # opened lazily, once per process
            if self._releaser is not None:
                self._releaser.detach()  # (a parent's, inherited through a fork: the parent releases its own)
            self._env = _acquire(self.path)
            # Released when the reader is collected too, not only by close(): a dataset dropped
            # without close() (`del ds`) would otherwise keep the file open for the process's life,
            # and py-lmdb refuses to open it again ("already open in this process").
            self._releaser = weakref.finalize(self, _release, self.path)
            self.opened()
        return self._env

    def _get(self, key: bytes) -> bytes | None:
        import lmdb

        try:
            with self._open().begin(buffers=False) as txn:
                value: bytes | None = txn.get(key)  # lmdb is untyped; buffers=False gives bytes
                return value
        except lmdb.Error as error:
            raise ShardFormatError(f"{self.path}: damaged LMDB file ({error})") from None

    def __len__(self) -> int:
        if self._count is None:
            raw = self._get(INFO_KEY)
            try:
                count = loads(raw)["count"] if raw is not None else None
            except (ValueError, KeyError, TypeError, IndexError):
                count = None
            if count is None:
                raise ShardFormatError(f"{self.path}: no shardkit record count (not a shardkit LMDB shard?)")
            # Every record takes at least a page entry of the file: more than its bytes is a lie.
            if type(count) is not int or not 0 <= count <= _file_size(self.path):
                raise ShardFormatError(f"{self.path}: implausible record count {str(count)[:20]}")
            self._count = count
        return self._count

    def read(self, index: int) -> Record:
        if not 0 <= index < len(self):
            raise IndexError(index)
        value = self._get(_index_key(index))
        if value is None:
            raise ShardFormatError(f"{self.path}: record {index} is missing")
        self.refuse_oversize(len(value), index)
        return decode_value(value, f"{self.path} record {index}")

    def read_key(self, key: str) -> Record:  # LMDB's own key index, not the base's
        raw = self._get(b"k" + key.encode())
        if raw is None:
            raise KeyError(key)
        return self.read(int.from_bytes(raw, "big"))

    def keys(self) -> list[str]:
        """Keys in stored order, from the key index alone (no image bytes are read)."""
        import lmdb

        pairs: list[tuple[int, str]] = []
        try:
            with self._open().begin(buffers=False) as txn:
                cursor = txn.cursor()
                if cursor.set_range(b"k"):
                    for key, index in cursor:
                        if not key.startswith(b"k"):
                            break
                        pairs.append((int.from_bytes(index, "big"), key[1:].decode()))
        except UnicodeDecodeError:
            raise ShardFormatError(f"{self.path}: a key is not UTF-8") from None
        except lmdb.Error as error:
            raise ShardFormatError(f"{self.path}: damaged LMDB file ({error})") from None
        return [key for _, key in sorted(pairs)]

    def read_range(self, start: int, stop: int) -> Iterator[Record]:
        import lmdb

        stop = min(stop, len(self))
        try:
            # buffers=True: values are views into the map, valid in this transaction, which
            # decode_value copies once (buffers=False would copy the whole value first).
            with self._open().begin(buffers=True) as txn:
                for first in range(max(0, start), stop, _READ_BATCH):
                    indices = range(first, min(stop, first + _READ_BATCH))
                    values = [txn.get(_index_key(index)) for index in indices]
                    for index, value in zip(indices, values, strict=True):
                        if value is None:
                            raise ShardFormatError(f"{self.path}: record {index} is missing")
                        self.refuse_oversize(len(value), index)
                    where = [_Where(self.path, index) for index in indices]  # formatted only for an error
                    sizes = [_header_size(value, at) for value, at in zip(values, where, strict=True)]
                    blobs = [bytes(value[4 : 4 + size]) for value, size in zip(values, sizes, strict=True)]
                    for value, at, header, size in zip(values, where, json_objects(blobs), sizes, strict=True):
                        yield decode_value(value, at, header, size)
        except lmdb.Error as error:
            raise ShardFormatError(f"{self.path}: damaged LMDB file ({error})") from None

    def close(self) -> None:
        if self._releaser is not None:
            self._releaser()  # (once: a finalize runs at most once, by close() or by the collector)
        self._releaser = None
        self._env = None


# py-lmdb's lmdb.open(shard, subdir=False) locks by default, leaving `<shard>-lock` beside it
LOCK_FILE = Leftover("-lock", "LMDB's lock file, left by a reader that opened the shard with lock=True")
BACKEND = Backend("lmdb", ".lmdb", True, LmdbShardWriter, LmdbShardReader, leftovers=(LOCK_FILE,))
