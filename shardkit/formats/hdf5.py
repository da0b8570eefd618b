"""HDF5 shards: one `.h5` per shard with random access by index and key.

Layout (no pickle, no object references): `data` uint8 [total bytes] holding every record back to
back (contiguous when the shard's data is under 32 MiB, else in chunks of `chunk_bytes`, 1 MiB by
default); `offsets` int64 [n+1]; `keys`, `exts`, `meta` (JSON) as UTF-8 strings; `labels` int64 (-1
when unlabelled; any other label outside the label rule, core.config.MAX_LABEL, is a damaged
record).

Reading: the index (offsets, keys, metadata, and where each raw chunk of `data` lies in the file)
loads once per shard; a record is then one pread from the file. h5py's own reads cost more than
the bytes they move, so they serve only files whose data is filtered (compressed) or odd.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from typing import Any, ClassVar

from ..core.errors import ConfigError, ShardFormatError, describe
from ..core.safeio import check_regular, open_regular
from .base import (
    Backend,
    Record,
    ShardReader,
    ShardWriter,
    checked,
    encode_json,
    encode_meta,
    files_layout,
    json_objects,
    parse_meta,
    split_files,
)

CHUNK_BYTES = 1 << 20
# Data kept in memory before the first write to the file. A shard whose data fits is written
# contiguous, at its exact size (chunks from the first byte would pad a small shard heavily); a
# bigger one goes into chunks, and HDF5 stores the last one whole: under one chunk of padding in
# 32 MiB.
_FLUSH_BYTES = 32 << 20
# Data read through h5py (filtered or odd layouts) is inflated a whole chunk at a time: a hostile
# shard could declare one chunk of gigabytes. shardkit writes 1 MiB by default (chunk_bytes).
_MAX_H5PY_CHUNK = 64 << 20
_RESERVE_SLACK = 2 << 20  # disk reserved beyond the data for HDF5's own structures
_META_BATCH = 256  # records whose metadata is parsed ahead of their data (see json_objects)
_MAX_CHUNK_LOOKUPS = 4096  # without chunk_iter, locating chunks is quadratic: past this many, read through h5py
VERSION = 1


class Hdf5ShardWriter(ShardWriter):
    """Writes through HDF5, but never lets HDF5 meet a full disk: a failed write inside HDF5 leaves
    its file state broken, and closing it then crashes the process. So the space every write needs
    is reserved first (posix_fallocate, a clean OSError when the disk is full), and the file is cut
    back to HDF5's own end-of-file address after closing: the bytes are those of an unreserved write."""

    # the HDF5 chunk of the data array (the unit h5py inflates on reading)
    OPTIONS: ClassVar[dict[str, Any]] = {"chunk_bytes": CHUNK_BYTES}

    def __init__(self, path: str, **options: object) -> None:
        import h5py

        super().__init__(path, **options)
        if not 4096 <= self.options["chunk_bytes"] <= _MAX_H5PY_CHUNK:
            raise ConfigError(
                f"chunk_bytes must be between 4096 and {_MAX_H5PY_CHUNK}, not {self.options['chunk_bytes']}"
            )
        self._chunk = self.options["chunk_bytes"]
        self._h5py = h5py
        self._path = path
        self._file = h5py.File(path, "w", libver="earliest", track_order=False)
        self._fd: int | None = self._file.id.get_vfd_handle()  # None: no space reservation here
        self._data: Any = None  # made at the first flush (chunked) or at close (contiguous)
        self._buffer = bytearray()
        self._offsets = [0]
        self._keys: list[str] = []
        self._exts: list[str] = []
        self._labels: list[int] = []
        self._meta: list[str] = []
        self._extras: list[str] = []  # per record: its caption and columns as JSON, "" when none
        self._index_bytes = 0  # what the index datasets will take, roughly

    def add(self, record: Record) -> None:
        meta = encode_meta(record.meta)
        self._buffer += record.data
        size = len(record.data)
        files = record.files or {}
        for name in sorted(files):  # fields follow the image; `extras` says how long each is
            self._buffer += files[name]
            size += len(files[name])
        self._offsets.append(self._offsets[-1] + size)
        self._keys.append(record.key)
        self._exts.append(record.ext)
        self._labels.append(-1 if record.label is None else record.label)
        self._meta.append(meta)
        extras = _encode_extras(record)
        self._extras.append(extras)
        self._index_bytes += 4 * 40 + 16 + len(record.key) + len(record.ext) + len(meta) + len(extras)
        if len(self._buffer) >= _FLUSH_BYTES:
            self._flush()

    def _reserve(self, extra: int) -> None:
        if self._fd is None:
            return
        try:
            os.posix_fallocate(self._fd, 0, self._offsets[-1] + 2 * self._chunk + _RESERVE_SLACK + extra)
        except OSError as error:
            if error.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise
            self._fd = None  # this filesystem cannot reserve: write unreserved (as HDF5 does by itself)

    def _flush(self) -> None:
        import numpy as np  # (with h5py, which imports it: the registry imports this module for any format)

        self._reserve(0)
        if self._data is None:
            self._data = self._file.create_dataset(
                "data", shape=(0,), maxshape=(None,), dtype=np.uint8, chunks=(self._chunk,), track_times=False
            )
        start = self._data.shape[0]
        self._data.resize((start + len(self._buffer),))
        self._data[start:] = np.frombuffer(self._buffer, dtype=np.uint8)
        self._buffer = bytearray()

    def close(self) -> int:
        import numpy as np

        if self._data is None:  # all of it still in the buffer: contiguous, no padding
            self._reserve(2 * self._index_bytes)
            data = np.frombuffer(self._buffer, dtype=np.uint8)
            self._data = self._file.create_dataset("data", data=data, track_times=False)
            self._buffer = bytearray()
        else:
            self._flush()
        self._reserve(2 * self._index_bytes)
        strings = self._h5py.string_dtype("utf-8")
        for name, values, dtype in (
            ("offsets", self._offsets, np.int64),
            ("labels", self._labels, np.int64),
            ("keys", self._keys, strings),
            ("exts", self._exts, strings),
            ("meta", self._meta, strings),
            # only when a record has a caption or columns: an image-only shard keeps its bytes
            *([("extras", self._extras, strings)] if any(self._extras) else []),
        ):
            self._file.create_dataset(name, data=np.array(values, dtype=dtype), track_times=False)
        self._file.attrs["shardkit_version"] = VERSION
        self._file.close()
        os.truncate(self._path, _end_of_file(self._path))
        return len(self._keys)

    def abort(self) -> None:
        # Free the reserved space first so that HDF5's closing writes (metadata) cannot fail.
        try:
            os.ftruncate(self._file.id.get_vfd_handle(), 0)
        finally:
            self._file.close()


def _encode_extras(record: Record) -> str:
    extras: dict[str, Any] = {}
    if record.text is not None:
        extras["text"] = record.text
    if record.columns is not None:
        extras["columns"] = record.columns
    if record.files:
        extras["files"] = files_layout(record.files)
    return encode_json(extras).decode() if extras else ""


def _end_of_file(path: str) -> int:
    """HDF5's end-of-file address, from the superblock (versions 0-3)."""
    with open(path, "rb") as file:
        head = file.read(64)
    version = head[8] if len(head) > 8 and head[:8] == b"\x89HDF\r\n\x1a\n" else -1
    at = {0: 40, 1: 44, 2: 28, 3: 28}.get(version)
    if at is None:
        raise OSError(0, f"unexpected HDF5 superblock version {version}", path)
    return int.from_bytes(head[at : at + 8], "little")


def _refuse_links_outside(h5: Any, path: str) -> None:
    """Our shards hold plain datasets only. External storage, external or soft links and virtual
    datasets could make a hostile shard read other files on this machine: refuse them."""
    import h5py

    for name in h5:
        link = h5.get(name, getlink=True)
        if not isinstance(link, h5py.HardLink):
            raise ShardFormatError(f"{path}: {name} is a link to elsewhere; refusing to follow it")
        item = h5[name]
        if not isinstance(item, h5py.Dataset) or item.external or item.is_virtual:
            raise ShardFormatError(f"{path}: {name} is not a plain dataset in this file; refusing it")


class Hdf5ShardReader(ShardReader):
    TRANSIENT = ("_file", "_fd", "_handle")

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self._file: Any = None
        self._directory: tuple[list[int], list[str], list[str], list[int]] | None = None
        self._meta: list[Any] = []
        self._extras: list[Any] | None = None
        self._chunks: tuple[int, list[int]] | None = None  # (chunk bytes, file offset of each chunk)
        self._fd: int | None = None
        self._fd_pid = 0
        self._handle: Any = None  # the file object h5py reads a /dev/fd/N shard through

    def _open(self) -> Any:
        if not self.in_this_process(self._file):  # h5py handles must not cross a fork
            import h5py

            try:
                check_regular(self.path)  # h5py opens the path itself: never a FIFO or a device
                if self.path.startswith("/dev/fd/"):
                    # a cached remote shard through this process's descriptor (readers.cached): HDF5
                    # opens a path by its real name, which another process's eviction may have
                    # unlinked meanwhile ("can't retrieve real path"); a file object stays readable
                    self._handle = os.fdopen(open_regular(self.path), "rb")  # (h5py leaves it open)
                    self._file = h5py.File(self._handle, "r")
                else:
                    self._file = h5py.File(self.path, "r")
            except (OSError, RuntimeError, ValueError) as error:
                raise ShardFormatError(f"{self.path}: not a readable HDF5 file ({describe(error)})") from None
            self.opened()
        return self._file

    def _load_directory(self) -> tuple[list[int], list[str], list[str], list[int]]:
        if self._directory is None:
            try:
                self._directory = self._read_directory()
            except (KeyError, OSError, ValueError, TypeError, AttributeError, RuntimeError, IndexError) as error:
                # h5py reports a damaged B-tree or heap as any of these
                raise ShardFormatError(f"{self.path}: not a shardkit HDF5 shard ({describe(error)})") from None
        return self._directory

    def _read_directory(self) -> tuple[list[int], list[str], list[str], list[int]]:
        import numpy as np

        h5 = self._open()
        _refuse_links_outside(h5, self.path)
        _check_index_datasets(h5, self.path)
        data = h5["data"]
        n = h5["offsets"].shape[0] - 1
        # Hostile sizes: every record takes at least one byte of the file, so n is bounded.
        if n < 0 or n > os.path.getsize(self.path) or data.ndim != 1 or data.dtype != np.uint8:
            raise ShardFormatError(f"{self.path}: implausible record count {n}")
        offsets = h5["offsets"][:]
        if offsets.dtype.kind == "u" and offsets.size and int(offsets.max()) >= 2**63:
            raise ShardFormatError(f"{self.path}: offsets past any file")
        offsets = offsets.astype(np.int64)  # unsigned offsets would wrap instead of going negative
        keys = [k.decode() if isinstance(k, bytes) else k for k in h5["keys"][:n]]
        exts = [e.decode() if isinstance(e, bytes) else e for e in h5["exts"][:n]]
        labels = h5["labels"][:n]
        # Metadata is small: all of it in one h5py call here, not one call per record later.
        self._meta = list(h5["meta"][:n])
        self._extras = list(h5["extras"][:n]) if "extras" in h5 else None
        if self._extras is not None and len(self._extras) != n:
            raise ShardFormatError(f"{self.path}: inconsistent offsets or index")
        sizes = np.diff(offsets)
        if offsets[0] != 0 or (sizes < 0).any() or offsets[-1] > data.shape[0] or len(keys) != n or len(labels) != n:
            raise ShardFormatError(f"{self.path}: inconsistent offsets or index")
        if labels.dtype.kind not in "iu" or labels.ndim != 1 or offsets.ndim != 1:
            raise ShardFormatError(f"{self.path}: labels are not integers")
        _check_stored(data, int(offsets[-1]) if n else 0, self.path)
        self._chunks = _chunk_table(data, os.path.getsize(self.path))
        if self._chunks is None and (data.chunks or (0,))[0] > _MAX_H5PY_CHUNK:
            raise ShardFormatError(f"{self.path}: data chunks of {data.chunks[0]:,} bytes; refusing to inflate")
        # Python ints: the hot loops index these per record, and numpy scalars are slow there.
        return offsets.tolist(), keys, exts, labels.tolist()

    def __len__(self) -> int:
        return len(self._load_directory()[1])

    def keys(self) -> list[str]:
        return list(self._load_directory()[1])

    def _data(self, start: int, end: int) -> bytes:
        try:
            data: bytes = self._open()["data"][start:end].tobytes()  # h5py is untyped: a numpy slice
            return data
        except (OSError, ValueError, TypeError, RuntimeError, KeyError) as error:
            where = f"{self.path}: damaged data at bytes {start:,}-{end:,}"
            raise ShardFormatError(f"{where} ({describe(error)})") from None

    def _record(self, index: int, data: bytes, meta: Any = None) -> Record:
        _, keys, exts, labels = self._load_directory()
        if meta is None:
            meta = parse_meta(self._meta[index], f"{self.path}: record {keys[index]}")
        label = labels[index]
        text, columns, files = None, None, None
        if self._extras is not None and self._extras[index]:
            where = f"{self.path}: record {keys[index]}"
            extras = parse_meta(self._extras[index], f"{where} caption and columns")
            text, columns = extras.get("text"), extras.get("columns")
            if "files" in extras:
                data, files = split_files(data, extras["files"], where)
        record = Record(keys[index], data, exts[index], None if label == -1 else label, meta, text, columns, files)
        return checked(record, self.path)

    def _descriptor(self) -> int:
        if self._fd is None or self._fd_pid != os.getpid():  # after fork, get our own descriptor
            try:
                self._fd, self._fd_pid = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK), os.getpid()
            except OSError as error:
                raise ShardFormatError(f"{self.path}: cannot open ({describe(error)})") from None
        return self._fd

    def _direct(self, start: int, end: int, chunks: tuple[int, list[int]]) -> bytes:
        """Bytes [start, end) of the data array read straight from the file's chunks: one pread
        and one copy per record, no h5py call (which costs more than the read)."""
        if end == start:
            return b""
        chunk_bytes, table = chunks
        fd = self._descriptor()
        first = start // chunk_bytes
        try:
            if (end - 1) // chunk_bytes == first:
                data = os.pread(fd, end - start, table[first] + start - first * chunk_bytes)
            else:  # across chunk boundaries (chunks need not be next to each other in the file)
                parts, position = [], start
                while position < end:
                    chunk = position // chunk_bytes
                    stop = min(end, (chunk + 1) * chunk_bytes)
                    parts.append(os.pread(fd, stop - position, table[chunk] + position - chunk * chunk_bytes))
                    position = stop
                data = b"".join(parts)
        except OSError as error:
            raise ShardFormatError(f"{self.path}: cannot read ({describe(error)})") from None
        if len(data) != end - start:
            raise ShardFormatError(f"{self.path}: data at bytes {start:,}-{end:,} is cut short (truncated shard)")
        return data

    def read(self, index: int) -> Record:
        offsets, keys, _, _ = self._load_directory()
        if not 0 <= index < len(keys):
            raise IndexError(index)
        start, end = offsets[index], offsets[index + 1]
        self.refuse_oversize(end - start, keys[index])
        data = self._direct(start, end, self._chunks) if self._chunks else self._data(start, end)
        return self._record(index, data)

    def read_range(self, start: int, stop: int) -> Iterator[Record]:
        """Records [start, stop): straight from the file's chunks where the layout allows, else
        through h5py in windows of up to 32 MiB or one record (one h5py call per window, not per
        record)."""
        offsets, keys, _, _ = self._load_directory()
        index, stop = max(0, start), min(stop, len(keys))
        chunks = self._chunks
        while chunks and index < stop:
            last = min(stop, index + _META_BATCH)
            metas = json_objects(self._meta[index:last])
            for i in range(index, last):
                self.refuse_oversize(offsets[i + 1] - offsets[i], keys[i])
                yield self._record(i, self._direct(offsets[i], offsets[i + 1], chunks), metas[i - index])
            index = last
        while index < stop:
            last = index + 1
            while last < stop and offsets[last + 1] - offsets[index] <= _FLUSH_BYTES:
                last += 1
            base, end = offsets[index], offsets[last]
            self.refuse_oversize(offsets[index + 1] - base, keys[index])
            window = memoryview(self._data(base, end))
            metas = json_objects(self._meta[index:last])
            for i in range(index, last):
                yield self._record(i, bytes(window[offsets[i] - base : offsets[i + 1] - base]), metas[i - index])
            index = last

    def close(self) -> None:
        if self.in_this_process(self._file):
            self._file.close()
            if self._handle is not None:
                self._handle.close()
        if self._fd is not None and self._fd_pid == os.getpid():
            os.close(self._fd)
        self._file = self._fd = self._handle = None


def _check_stored(data: Any, used: int, path: str) -> None:
    """The records' bytes must be stored in the file: chunks never written read back as zeros, so a
    tiny file could otherwise claim terabytes of records. Compressed data may be up to 64x larger
    than what it takes in the file (JPEG bytes compress far less)."""
    stored = data.id.get_storage_size()
    filtered = data.chunks is not None and data.id.get_create_plist().get_nfilters() != 0
    if used > (64 * stored + (1 << 20) if filtered else stored):
        raise ShardFormatError(f"{path}: records claim {used:,} bytes, the file stores {stored:,}")


def _check_index_datasets(h5: Any, path: str) -> None:
    """Index datasets are read whole, so their size in memory must be bounded by the file: no filters
    (a compressed dataset can expand 1000x), strings variable-length (as we write them: a fixed
    width of 1 MiB per row would be a bomb), numbers plain 1-D integers."""
    import h5py

    for name in ("offsets", "labels", "keys", "exts", "meta", "extras"):
        if name == "extras" and name not in h5:  # written only when a record has a caption or columns
            continue
        dataset = h5[name]
        if dataset.ndim != 1 or dataset.id.get_create_plist().get_nfilters() != 0:
            raise ShardFormatError(f"{path}: index dataset {name} is not a plain 1-D array")
        if name in ("offsets", "labels"):
            if dataset.dtype.kind not in "iu" or dataset.dtype.shape != ():
                raise ShardFormatError(f"{path}: index dataset {name} does not hold integers")
        else:
            info = h5py.check_string_dtype(dataset.dtype)
            if info is None or info.length is not None:
                raise ShardFormatError(f"{path}: index dataset {name} does not hold variable-length strings")


def _chunk_table(data: Any, file_size: int) -> tuple[int, list[int]] | None:
    """(chunk bytes, file offset of each chunk in order) when `data` is stored raw (no filters, every
    chunk written, all within the file), else None and reads go through h5py."""
    try:
        if data.chunks is None:  # contiguous: one "chunk" holding everything
            offset = data.id.get_offset()
            size = data.shape[0]
            if offset is None or offset + size > file_size:
                return None
            return max(1, size), [offset]
        if data.id.get_create_plist().get_nfilters() != 0:
            return None
        chunk_bytes = data.chunks[0]
        count = data.id.get_num_chunks()
        if chunk_bytes < 1 or count != -(-data.shape[0] // chunk_bytes):
            return None
        # get_chunk_info(i) walks the chunk index from the start (quadratic in the chunk count);
        # chunk_iter (HDF5 >= 1.12.3) visits each chunk once.
        if hasattr(data.id, "chunk_iter"):
            infos: list[Any] = []
            data.id.chunk_iter(infos.append)
        elif count <= _MAX_CHUNK_LOOKUPS:
            infos = [data.id.get_chunk_info(i) for i in range(count)]
        else:
            return None
        table = [-1] * count
        for info in infos:
            slot, remainder = divmod(info.chunk_offset[0], chunk_bytes)
            if (
                remainder or not 0 <= slot < count or info.filter_mask or info.byte_offset is None
                or info.size != chunk_bytes or info.byte_offset + info.size > file_size
            ):  # fmt: skip
                return None
            table[slot] = info.byte_offset
    except (AttributeError, ValueError, TypeError, OSError, RuntimeError):
        return None
    return (chunk_bytes, table) if -1 not in table else None


BACKEND = Backend("hdf5", ".h5", True, Hdf5ShardWriter, Hdf5ShardReader)
