"""HDF5 shards: one `.h5` per shard with random access by index and key.

Layout (no pickle, no object references): `data` uint8 [total bytes] in 1 MiB chunks holding every
record back to back; `offsets` int64 [n+1]; `keys`, `exts`, `meta` (JSON) as UTF-8 strings;
`labels` int64 (-1 when unlabelled).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import numpy as np

from ..errors import ShardFormatError
from . import MAX_RECORD_BYTES, Record, checked

CHUNK_BYTES = 1 << 20
_FLUSH_BYTES = 8 << 20
VERSION = 1


class Hdf5ShardWriter:
    def __init__(self, path: str) -> None:
        import h5py

        self._h5py = h5py
        self._file = h5py.File(path, "w", libver="earliest", track_order=False)
        self._data = self._file.create_dataset(
            "data", shape=(0,), maxshape=(None,), dtype=np.uint8, chunks=(CHUNK_BYTES,), track_times=False
        )
        self._buffer = bytearray()
        self._offsets = [0]
        self._keys: list[str] = []
        self._exts: list[str] = []
        self._labels: list[int] = []
        self._meta: list[str] = []

    def add(self, record: Record) -> None:
        self._buffer += record.data
        self._offsets.append(self._offsets[-1] + len(record.data))
        self._keys.append(record.key)
        self._exts.append(record.ext)
        self._labels.append(-1 if record.label is None else record.label)
        self._meta.append(json.dumps(record.meta, sort_keys=True))
        if len(self._buffer) >= _FLUSH_BYTES:
            self._flush()

    def _flush(self) -> None:
        start = self._data.shape[0]
        self._data.resize((start + len(self._buffer),))
        self._data[start:] = np.frombuffer(self._buffer, dtype=np.uint8)
        self._buffer = bytearray()

    def close(self) -> int:
        self._flush()
        strings = self._h5py.string_dtype("utf-8")
        for name, values, dtype in (
            ("offsets", self._offsets, np.int64),
            ("labels", self._labels, np.int64),
            ("keys", self._keys, strings),
            ("exts", self._exts, strings),
            ("meta", self._meta, strings),
        ):
            self._file.create_dataset(name, data=np.array(values, dtype=dtype), track_times=False)
        self._file.attrs["shardkit_version"] = VERSION
        self._file.close()
        return len(self._keys)


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


class Hdf5ShardReader:
    def __init__(self, path: str) -> None:
        self.path = path
        self._file: Any = None
        self._pid = 0
        self._index: tuple[np.ndarray, list[str], list[str], np.ndarray] | None = None
        self._by_key: dict[str, int] = {}
        self._meta: list[Any] = []

    def _open(self) -> Any:
        if self._file is None or self._pid != os.getpid():  # h5py handles must not cross a fork
            import h5py

            try:
                self._file = h5py.File(self.path, "r")
            except OSError as error:
                raise ShardFormatError(f"{self.path}: not a readable HDF5 file ({error})") from None
            self._pid = os.getpid()
        return self._file

    def _load_index(self) -> tuple[np.ndarray, list[str], list[str], np.ndarray]:
        if self._index is None:
            h5 = self._open()
            _refuse_links_outside(h5, self.path)
            try:
                offsets = h5["offsets"]
                n = offsets.shape[0] - 1
                # Hostile sizes: every record takes at least one byte of the file, so n is bounded.
                if n < 0 or n > os.path.getsize(self.path) or h5["data"].ndim != 1:
                    raise ShardFormatError(f"{self.path}: implausible record count {n}")
                offsets = offsets[:]
                keys = [k.decode() if isinstance(k, bytes) else k for k in h5["keys"][:n]]
                exts = [e.decode() if isinstance(e, bytes) else e for e in h5["exts"][:n]]
                labels = h5["labels"][:n]
                # Metadata is small: one read here beats one h5py call (~100 us) per record later.
                self._meta = list(h5["meta"][:n])
            except (KeyError, OSError, ValueError, TypeError, AttributeError, UnicodeDecodeError) as error:
                raise ShardFormatError(f"{self.path}: not a shardkit HDF5 shard ({error})") from None
            total = h5["data"].shape[0]
            sizes = np.diff(offsets)
            if offsets[0] != 0 or (sizes < 0).any() or offsets[-1] > total or len(keys) != n or len(labels) != n:
                raise ShardFormatError(f"{self.path}: inconsistent offsets or index")
            if labels.dtype.kind not in "iu":
                raise ShardFormatError(f"{self.path}: labels are not integers")
            self._by_key = {key: i for i, key in enumerate(keys)}
            self._index = (offsets, keys, exts, labels)
        return self._index

    def __len__(self) -> int:
        return len(self._load_index()[1])

    def keys(self) -> list[str]:
        return list(self._load_index()[1])

    def _data(self, start: int, end: int) -> bytes:
        try:
            return self._open()["data"][start:end].tobytes()
        except (OSError, ValueError, TypeError) as error:
            raise ShardFormatError(f"{self.path}: damaged data at bytes {start:,}-{end:,} ({error})") from None

    def _record(self, index: int, data: bytes) -> Record:
        _, keys, exts, labels = self._load_index()
        try:
            meta = json.loads(self._meta[index])
        except (ValueError, TypeError) as error:
            raise ShardFormatError(f"{self.path}: damaged record {keys[index]} ({error})") from None
        label = int(labels[index])
        return checked(Record(keys[index], data, exts[index], None if label < 0 else label, meta), self.path)

    def read(self, index: int) -> Record:
        offsets, keys, _, _ = self._load_index()
        if not 0 <= index < len(keys):
            raise IndexError(index)
        start, end = int(offsets[index]), int(offsets[index + 1])
        if end - start > MAX_RECORD_BYTES:
            raise ShardFormatError(f"{self.path}: record {keys[index]} is over the size limit")
        return self._record(index, self._data(start, end))

    def __iter__(self) -> Iterator[Record]:
        return self.read_range(0, len(self))

    def read_range(self, start: int, stop: int) -> Iterator[Record]:
        """Reads the data array in windows of ~8 MiB: one h5py call per window, not per record."""
        offsets, keys, _, _ = self._load_index()
        index, stop = max(0, start), min(stop, len(keys))
        while index < stop:
            last = index + 1
            while last < stop and offsets[last + 1] - offsets[index] <= _FLUSH_BYTES:
                last += 1
            base, end = int(offsets[index]), int(offsets[last])
            if int(offsets[index + 1]) - base > MAX_RECORD_BYTES:
                raise ShardFormatError(f"{self.path}: record {keys[index]} is over the size limit")
            window = memoryview(self._data(base, end))
            for i in range(index, last):
                yield self._record(i, bytes(window[int(offsets[i]) - base : int(offsets[i + 1]) - base]))
            index = last

    def read_key(self, key: str) -> Record:
        self._load_index()
        try:
            return self.read(self._by_key[key])
        except KeyError:
            raise KeyError(key) from None

    def close(self) -> None:
        if self._file is not None and self._pid == os.getpid():
            self._file.close()
        self._file = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_file": None, "_pid": 0}
