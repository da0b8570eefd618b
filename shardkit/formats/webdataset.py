"""WebDataset shards: plain tars of `<key>.jpg|npy`, `<key>.cls`, `<key>.json` (shardkit's metadata),
`<key>.txt` (the caption; several are one per line, with the exact list in `<key>.captions.json`)
and `<key>.columns.json` (the user's columns), which stock webdataset and `datasets` read.

The reader parses tar headers itself (ustar, pax, GNU long names) instead of going through
`tarfile`, which is slow per member in Python: iteration reads headers and small members with a
small read-ahead and each image exactly once; a range that starts inside a shard walks on from the
nearest record offset an earlier range left (`marks`), and random access uses a table of member
offsets built from the headers. The tar's headers themselves are `tar_headers`' (written and
walked); the files other readers want beside the tars are `tar_companions`'. Where it was built, a
compiled walk (`core/_tar.c`) takes the plain records, a batch and their members per call, and
Python's walk goes on from the first record it leaves (`_walk`).
"""

from __future__ import annotations

import hashlib
import itertools
import os
import tarfile
from collections.abc import Iterator
from typing import Any

from ..core.codecs import tar_walker
from ..core.config import MAX_RECORD_BYTES
from ..core.errors import ShardFormatError, describe
from ..core.safeio import loads, open_regular
from .base import (
    Backend,
    Record,
    ShardReader,
    ShardWriter,
    checked,
    encode_json,
    encode_meta,
    json_objects,
    parse_meta,
)
from .tar_companions import dali_index, wids_files
from .tar_headers import BLOCK, READ_AHEAD, FileBytes, Member, member_header, split_name, tar_members


class TarShardWriter(ShardWriter):
    """Writes the bytes tarfile writes (PAX format, mtime 0, mode 0444, no owner), building plain
    headers itself: tarfile is slow per member, and a record is 3 to 5 members. A name too long
    for a plain header goes through tarfile's pax. It hashes what it writes and keeps each
    member's place as it goes, so the tar is not read again after its last record for its sha256
    and DALI's index."""

    def __init__(self, path: str, **options: object) -> None:
        super().__init__(path, **options)
        self._file = open(path, "wb")  # noqa: SIM115 - closed in close() or abort()
        self._offset = 0
        self._count = 0
        self._hash = hashlib.sha256()
        self.members: list[tuple[str, int, int]] | None = []

    def add(self, record: Record) -> None:
        members = [(f"{record.key}.{record.ext}", record.data)]
        if record.label is not None:
            members.append((f"{record.key}.cls", str(record.label).encode()))
        members.append((f"{record.key}.json", encode_meta(record.meta).encode()))
        if isinstance(record.text, str):
            members.append((f"{record.key}.txt", record.text.encode()))
        elif record.text is not None:  # several: one per line for stock readers, the exact list beside
            members.append((f"{record.key}.txt", "\n".join(record.text).encode()))
            members.append((f"{record.key}.captions.json", encode_json(record.text)))
        if record.columns is not None:
            members.append((f"{record.key}.columns.json", encode_json(record.columns)))
        for name, payload in sorted((record.files or {}).items()):
            members.append((f"{record.key}.{name}", payload))
        parts: list[bytes] = []
        at = self._offset
        for name, payload in members:
            header = member_header(name, len(payload))
            parts += (header, payload, bytes(-len(payload) % BLOCK))
            if self.members is not None:
                self.members.append((name, at + len(header), len(payload)))
            at += len(header) + len(payload) + -len(payload) % BLOCK
        self._write(b"".join(parts))
        self._count += 1

    def close(self) -> int:
        # tarfile's ending: two zero blocks, then zeros up to a whole 10 KiB record
        self._write(bytes(2 * BLOCK + -(self._offset + 2 * BLOCK) % tarfile.RECORDSIZE))
        self._file.close()
        return self._count

    def sha256(self) -> str:
        return self._hash.hexdigest()

    def close_part(self) -> int:
        self._file.close()
        return self._count

    def append(self, path: str, count: int, members: list[tuple[str, int, int]] | None) -> None:
        start = self._offset
        with open(path, "rb") as part:  # (a part of ours, in the output's own tmp folder)
            while chunk := part.read(_APPEND_CHUNK):
                self._write(chunk)
        self._count += count
        if members is None or self.members is None:  # (a part that kept none: the tar is read for its index)
            self.members = None
        else:
            self.members += [(name, start + offset, size) for name, offset, size in members]

    def _write(self, data: bytes) -> None:
        self._file.write(data)
        self._hash.update(data)
        self._offset += len(data)

    def abort(self) -> None:
        self._file.close()


_APPEND_CHUNK = 1 << 20  # a part's bytes are copied (and hashed) in pieces of this
_BATCH = 64  # records read together (see _records)
_BATCH_BYTES = 8 << 20  # ... or fewer, when their images add up to this
Entry = tuple[
    str, dict[str, tuple[int, int]], int
]  # key, (data offset, size) by extension, where the next record starts
_WALK_END, _WALK_PYTHON = 1, 2  # how a compiled walk stopped: at the end marker; at a record for Python
_SKIP_STEP = 1024  # records a compiled walk passes over per call (it holds the GIL, so a call stays short)
_MAX_MARKS = 4096  # record offsets a reader remembers (a few per range read; forgotten all at once past this)
OTHER_PARTS = frozenset({"cls", "json", "txt", "captions.json", "columns.json"})  # a record's other members


Payloads = dict[str, bytes] | None  # a record's members read by the compiled walk, by extension
# (image extension, label, metadata JSON, bytes of all members, caption, columns, fields)
_Small = tuple[
    str, "int | None", bytes, int, "str | list[str] | None", "dict[str, Any] | None", "dict[str, bytes] | None"
]


def _group(members: Iterator[Member], where: str) -> Iterator[Entry]:
    """Consecutive members with the same key form one record; a member repeated within a record is
    damage (which of the two would a reader take?). Each record comes with the offset the next one
    starts at (its first header, or the end-of-archive marker after the last). A sample with no
    image member (only a caption, say, in a tar someone else wrote) is not a record: left out, as
    `shardkit index` lists it."""
    key: str | None = None
    parts: dict[str, tuple[int, int]] = {}
    end = 0
    for name, offset, size, first in members:
        split = split_name(name)
        if split is None:
            continue
        if split[0] != key:
            if key is not None and not parts.keys() <= OTHER_PARTS:
                yield key, parts, first
            key, parts = split[0], {}
        if split[1] in parts:
            raise ShardFormatError(f"{where}: record {key} has two {split[1]} members")
        parts[split[1]] = (offset, size)
        end = offset + -(-size // BLOCK) * BLOCK
    if key is not None and not parts.keys() <= OTHER_PARTS:
        yield key, parts, end


class TarShardReader(ShardReader):
    """Reads tars from any WebDataset writer: sequentially with read-ahead, or by index and key
    through a table of member offsets built from the headers on first random access."""

    TRANSIENT = ("_fd",)

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self._entries: list[Entry] | None = None
        self._fd: int | None = None
        # Record number -> offset of its first header, where ranges stopped and started: a range
        # walks the headers on from the nearest mark before it, so a shard read in pieces (a
        # shuffled epoch reads it in a few per lane) needs no member table. A member table costs a
        # header walk of the whole shard and a tuple and a dict per record kept until close, which
        # also makes the garbage collector run far more often; a mark is two ints.
        self._marks: dict[int, int] = {0: 0}

    def _descriptor(self) -> int:
        if not self.in_this_process(self._fd):  # after fork, get our own descriptor
            try:
                self._fd = open_regular(self.path)
            except OSError as error:
                raise ShardFormatError(f"{self.path}: cannot open ({describe(error)})") from None
            self.opened()
        assert self._fd is not None  # opened above, or earlier in this process
        return self._fd

    def _bytes(self, chunk: int = 0) -> FileBytes:
        fd = self._descriptor()
        return FileBytes(fd, os.fstat(fd).st_size, chunk)

    def _members(self) -> list[Entry]:
        if self._entries is None:
            entries = list(self._walk(self._bytes(READ_AHEAD), 0, [(None, False)]))  # (unread: 3-tuples)
            if len({key for key, _, _ in entries}) != len(entries):
                raise ShardFormatError(f"{self.path}: a key appears in two places")
            self._entries = entries
        return self._entries

    def _walk(self, data: FileBytes, pos: int, phases: list[tuple[int | None, bool]]) -> Iterator[Entry]:
        """The records from the header at byte `pos` (a record's first), as Entries: through the
        compiled walk (core/_tar.c) while it takes them, then Python's from the record it leaves
        (odd headers, damage: the same records, or the same error, either way). `phases`: (how many
        records, or None for all; whether their members are read) in turn: a read record's Entry
        carries its members' bytes, {extension: bytes}, as a fourth item (then nothing is read
        twice, and a batch of records is read in one call)."""
        walker = tar_walker()
        if walker is not None:
            for count, read in phases:
                left = (1 << 62) if count is None else count
                while left > 0:
                    step = min(left, _BATCH if read else _SKIP_STEP)
                    found, pos, state = walker.walk(
                        data.fd, pos, data.size, step, _BATCH_BYTES if read else 1 << 62, MAX_RECORD_BYTES, read
                    )
                    left -= len(found)
                    yield from found
                    if state == _WALK_END:
                        return
                    if state == _WALK_PYTHON:
                        yield from _group(tar_members(data, self.path, pos), self.path)
                        return
        yield from _group(tar_members(data, self.path, pos), self.path)

    def __len__(self) -> int:
        return len(self._members())

    def keys(self) -> list[str]:
        return [key for key, _, _ in self._members()]

    def _member(
        self, data: FileBytes, key: str, members: dict[str, tuple[int, int]], ext: str, read: Payloads = None
    ) -> bytes:
        if read is not None:  # read by the compiled walk
            return read[ext]
        offset, size = members[ext]
        payload = data.get(offset, size)
        if len(payload) != size:
            raise ShardFormatError(f"{self.path}: record {key} is cut short (truncated shard)")
        return payload

    def _records(self, data: FileBytes, entries: Iterator[Entry]) -> Iterator[Record]:
        """Records from (key, members) entries, a batch at a time (up to 64 records or 8 MiB):
        small members are read as the entries come (straight after their headers, so from the
        read-ahead buffer that just read those), the batch's metadata is parsed together, each
        image is read exactly once, and only then are the records handed out: between image
        decodes, the same Python work per record would run with cold caches. A damaged record ends
        the stream only after every good record before it."""
        while True:
            batch: list[tuple[str, dict[str, tuple[int, int]], _Small, Payloads]] = []
            batch_bytes, damage = 0, None
            try:
                for entry in entries:
                    key, members, read = entry[0], entry[1], entry[3] if len(entry) > 3 else None
                    small = self._small_members(data, key, members, read)
                    batch.append((key, members, small, read))
                    batch_bytes += small[3]
                    if len(batch) >= _BATCH or batch_bytes >= _BATCH_BYTES:
                        break
            except ShardFormatError as error:
                damage = error  # raised after the good records collected before it
            ready: list[Record] = []
            try:
                for (key, members, (image_ext, label, blob, _, text, columns, files), read), meta in zip(
                    batch, json_objects([small[2] for _, _, small, _ in batch]), strict=True
                ):
                    if meta is None:
                        meta = parse_meta(blob, f"{self.path}: record {key}")
                    image = self._member(data, key, members, image_ext, read)
                    record = Record(key, image, image_ext, label, meta, text, columns, files)
                    ready.append(checked(record, self.path))
            except ShardFormatError:
                yield from ready
                raise
            yield from ready
            if damage is not None:
                raise damage
            if not batch:
                return

    def _small_members(
        self, data: FileBytes, key: str, members: dict[str, tuple[int, int]], read: Payloads = None
    ) -> _Small:
        """(image extension, label, metadata JSON, bytes of all members, caption, columns, fields)
        of one record; checks sizes before any read (`read`: its members already read, whose sizes
        the compiled walk checked)."""
        image_ext = None
        total = 0
        for ext, (_, size) in members.items():
            total += size
            if image_ext is None and ext not in OTHER_PARTS:
                image_ext = ext
        if image_ext is None:  # _group leaves such samples out
            raise ShardFormatError(f"{self.path}: record {key} has no image member")
        if total > MAX_RECORD_BYTES:
            raise ShardFormatError(f"{self.path}: record {key} claims {total:,} bytes, over the limit")
        label = None
        if "cls" in members:
            try:
                label = int(self._member(data, key, members, "cls", read))
            except ValueError:
                raise ShardFormatError(f"{self.path}: record {key} has a label that is not an integer") from None
        blob = self._member(data, key, members, "json", read) if "json" in members else b"{}"
        if len(members) <= 3 and members.keys() <= {image_ext, "cls", "json"}:
            return image_ext, label, blob, total, None, None, None  # image, label, metadata: the common case
        text: str | list[str] | None = None
        where = f"{self.path}: record {key}"
        if "captions.json" in members:
            try:
                text = loads(self._member(data, key, members, "captions.json", read))
            except ValueError as error:
                raise ShardFormatError(f"{where} has unreadable captions ({error})") from None
        elif "txt" in members:
            try:
                text = self._member(data, key, members, "txt", read).decode("utf-8")
            except UnicodeDecodeError:
                raise ShardFormatError(f"{where} has a caption that is not UTF-8") from None
        columns = None
        if "columns.json" in members:
            columns = parse_meta(self._member(data, key, members, "columns.json", read), f"{where}: columns")
        others = [ext for ext in members if ext != image_ext and ext not in OTHER_PARTS]
        files = {ext: self._member(data, key, members, ext, read) for ext in others} if others else None
        return image_ext, label, blob, total, text, columns, files

    def read(self, index: int) -> Record:
        return next(self._records(self._bytes(), iter([self._members()[index]])))

    def __iter__(self) -> Iterator[Record]:
        return self._stream(0, None)  # no member table needed from the first record

    def _stream(self, start: int, stop: int | None) -> Iterator[Record]:
        """Records [start, stop), walking the headers on from the nearest mark at or before `start`
        (the records in between: headers only); none past `stop` is read, not even ahead. Where the
        walk stops is marked, so the next range from there goes straight on. Keys are checked unique
        within each walk (a walk of the whole shard, as verify's, checks them all)."""
        marks = dict(self._marks)  # a copy: another thread's range may add marks meanwhile
        mark = max(record for record in marks if record <= start)
        data = self._bytes(READ_AHEAD)
        reached = [mark, marks[mark]]  # records walked past, and the offset where the next one starts
        wanted = None if stop is None else stop - start
        phases = [(start - mark, False), (wanted, True)]
        entries = self._walked(self._walk(data, marks[mark], phases), reached)
        if start > mark:
            for _ in itertools.islice(entries, start - mark):
                pass
            if reached[0] < start:
                raise ShardFormatError(f"{self.path}: ends after {reached[0]:,} records")
            self._mark(start, reached[1])
        yield from self._records(data, itertools.islice(entries, wanted))
        if stop is not None and reached[0] == stop:
            self._mark(stop, reached[1])

    def _walked(self, entries: Iterator[Entry], reached: list[int]) -> Iterator[Entry]:
        """`entries` with their keys checked unique, counting into `reached` as they go."""
        seen: set[str] = set()
        for entry in entries:
            if entry[0] in seen:
                raise ShardFormatError(f"{self.path}: a key appears in two places")
            seen.add(entry[0])
            reached[0] += 1
            reached[1] = entry[2]
            yield entry

    def _mark(self, record: int, offset: int) -> None:
        if len(self._marks) >= _MAX_MARKS:
            self._marks = {0: 0}  # a new dict: a range reading from a copy of the old is unaffected
        self._marks[record] = offset

    def read_range(self, start: int, stop: int) -> Iterator[Record]:
        """Records [start, stop) with read-ahead: through the member table once random access built
        one, else by a walk from the nearest mark (no member table needed)."""
        if self._entries is not None:
            return self._records(self._bytes(READ_AHEAD), iter(self._entries[start:stop]))
        return self._stream(start, stop)

    def close(self) -> None:
        if self._fd is not None and self.in_this_process(self._fd):
            os.close(self._fd)
        self._fd = None


BACKEND = Backend(
    "webdataset",
    ".tar",
    True,
    TarShardWriter,
    TarShardReader,
    idx_file=dali_index,
    output_files=wids_files,
    appends=True,
)
