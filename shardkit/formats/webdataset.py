"""WebDataset shards: plain tars of `<key>.jpg|npy`, `<key>.cls`, `<key>.json` that stock webdataset reads.

The reader indexes member offsets once (headers only), then reads any record with one pread.
"""

from __future__ import annotations

import io
import json
import os
import tarfile
from collections.abc import Iterator

from ..errors import ShardFormatError
from . import MAX_RECORD_BYTES, Record


class TarShardWriter:
    def __init__(self, path: str) -> None:
        self._file = open(path, "wb")  # noqa: SIM115 - both closed in close()
        self._tar = tarfile.open(fileobj=self._file, mode="w", format=tarfile.PAX_FORMAT)  # noqa: SIM115
        self._count = 0

    def add(self, record: Record) -> None:
        members = [(f"{record.key}.{record.ext}", record.data)]
        if record.label is not None:
            members.append((f"{record.key}.cls", str(record.label).encode()))
        members.append((f"{record.key}.json", json.dumps(record.meta, sort_keys=True).encode()))
        for name, payload in members:
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            info.mtime = 0  # reproducible bytes: no clock, no owner
            info.mode = 0o444
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            self._tar.addfile(info, io.BytesIO(payload))
        self._count += 1

    def close(self) -> int:
        self._tar.close()
        self._file.close()
        return self._count


class TarShardReader:
    """Random access over a tar written by any WebDataset writer (members grouped by key)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._entries: list[tuple[str, dict[str, tuple[int, int]]]] | None = None
        self._by_key: dict[str, int] = {}
        self._fd: int | None = None
        self._pid = 0

    def _index(self) -> list[tuple[str, dict[str, tuple[int, int]]]]:
        if self._entries is None:
            entries: list[tuple[str, dict[str, tuple[int, int]]]] = []
            try:
                with tarfile.open(self.path, "r:") as tar:
                    for member in tar:
                        if not member.isfile():
                            continue
                        head, _, base = member.name.rpartition("/")
                        stem, dot, ext = base.partition(".")
                        if not dot:
                            continue
                        key = f"{head}/{stem}" if head else stem
                        if not entries or entries[-1][0] != key:
                            entries.append((key, {}))
                        entries[-1][1][ext] = (member.offset_data, member.size)
            except (tarfile.TarError, OSError, EOFError) as error:
                raise ShardFormatError(f"{self.path}: not a readable tar ({error})") from None
            self._by_key = {key: i for i, (key, _) in enumerate(entries)}
            if len(self._by_key) != len(entries):
                raise ShardFormatError(f"{self.path}: a key appears in two places")
            self._entries = entries
        return self._entries

    def __len__(self) -> int:
        return len(self._index())

    def keys(self) -> list[str]:
        return [key for key, _ in self._index()]

    def _pread(self, offset: int, size: int, key: str) -> bytes:
        if size > MAX_RECORD_BYTES:
            raise ShardFormatError(f"{self.path}: record {key} claims {size:,} bytes, over the limit")
        if self._fd is None or self._pid != os.getpid():  # after fork, get our own descriptor
            self._fd, self._pid = os.open(self.path, os.O_RDONLY), os.getpid()
        data = os.pread(self._fd, size, offset)
        if len(data) != size:
            raise ShardFormatError(f"{self.path}: record {key} is cut short (truncated shard)")
        return data

    def read(self, index: int) -> Record:
        key, members = self._index()[index]
        image_ext = next((ext for ext in members if ext not in ("cls", "json")), None)
        if image_ext is None:
            raise ShardFormatError(f"{self.path}: record {key} has no image member")
        data = self._pread(*members[image_ext], key)
        label = None
        if "cls" in members:
            text = self._pread(*members["cls"], key)
            try:
                label = int(text)
            except ValueError:
                raise ShardFormatError(f"{self.path}: record {key} has a label that is not an integer") from None
        meta = {}
        if "json" in members:
            try:
                meta = json.loads(self._pread(*members["json"], key))
            except ValueError:
                raise ShardFormatError(f"{self.path}: record {key} has unreadable metadata") from None
        return Record(key, data, image_ext, label, meta)

    def read_key(self, key: str) -> Record:
        self._index()
        try:
            return self.read(self._by_key[key])
        except KeyError:
            raise KeyError(key) from None

    def __iter__(self) -> Iterator[Record]:
        for index in range(len(self)):
            yield self.read(index)

    def close(self) -> None:
        if self._fd is not None and self._pid == os.getpid():
            os.close(self._fd)
        self._fd = None

    def __getstate__(self) -> dict:
        # Descriptors do not travel to other processes; the index (plain data) does.
        return {**self.__dict__, "_fd": None, "_pid": 0}
