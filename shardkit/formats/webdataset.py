"""WebDataset shards: plain tars of `<key>.jpg|npy`, `<key>.cls`, `<key>.json` (shardkit's metadata),
`<key>.txt` (the caption; several are one per line, with the exact list in `<key>.captions.json`)
and `<key>.columns.json` (the user's columns), which stock webdataset and `datasets` read.

The reader parses tar headers itself (ustar, pax, GNU long names) instead of going through
`tarfile`, which costs ~10 us per member in Python: iteration reads headers and small members with a
small read-ahead and each image exactly once, and random access uses an index of member offsets
built from the headers.
"""

from __future__ import annotations

import itertools
import os
import re
import tarfile
from collections.abc import Iterator
from typing import Any

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


class TarShardWriter(ShardWriter):
    """Writes the bytes tarfile writes (PAX format, mtime 0, mode 0444, no owner), building plain
    headers itself: tarfile takes ~25 us a member, and a record is 3 to 5 members (measured: 4% of
    a whole pack with captions). A name too long for a plain header goes through tarfile's pax."""

    def __init__(self, path: str, **options: object) -> None:
        super().__init__(path, **options)
        self._file = open(path, "wb")  # noqa: SIM115 - closed in close() or abort()
        self._offset = 0
        self._count = 0

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
        for name, payload in members:
            parts += (member_header(name, len(payload)), payload, bytes(-len(payload) % _BLOCK))
        block = b"".join(parts)
        self._file.write(block)
        self._offset += len(block)
        self._count += 1

    def close(self) -> int:
        # tarfile's ending: two zero blocks, then zeros up to a whole 10 KiB record
        end = 2 * _BLOCK + -(self._offset + 2 * _BLOCK) % tarfile.RECORDSIZE
        self._file.write(bytes(end))
        self._file.close()
        return self._count

    def abort(self) -> None:
        self._file.close()


def member_header(name: str, size: int) -> bytes:
    """The header tarfile writes for a regular member (PAX format, mtime 0, mode 0444, no owner)."""
    raw = name.encode("utf-8", "surrogateescape")
    if len(raw) > 100 or not name.isascii() or size > 0o77777777777:  # pax: tarfile's own code
        info = tarfile.TarInfo(name)
        info.size, info.mtime, info.mode, info.uid, info.gid, info.uname, info.gname = size, 0, 0o444, 0, 0, "", ""
        return info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")
    header = b"".join((raw.ljust(100, b"\0"), _HEAD_MIDDLE, b"%011o\0" % size, _HEAD_TAIL))
    checksum = sum(header)  # the checksum field holds 8 spaces while it is summed
    return header[:148] + b"%06o\0 " % checksum + header[156:]


_HEAD_MIDDLE = b"0000444\0" + b"0000000\0" * 2  # mode, uid, gid
# mtime, checksum placeholder, type (regular), link name, magic and version, user, group, device
# numbers (tarfile writes them empty for a regular file), prefix, padding
_HEAD_TAIL = b"00000000000\0" + b" " * 8 + b"0" + bytes(100) + b"ustar\x0000" + bytes(64 + 16 + 155 + 12)


_BLOCK = 512
_ZERO_BLOCK = bytes(_BLOCK)
# Read-ahead for headers and small members (.cls, .json): 4 KiB holds a record's small members and
# their headers in one read, while images, read exactly, are copied once. A 1 MiB read-ahead copied
# every image twice (page cache -> buffer -> member) and measured ~25% slower per record.
_READ_AHEAD = 4096
_BATCH = 64  # records read together (see _records)
_BATCH_BYTES = 8 << 20  # ... or fewer, when their images add up to this
_MAX_HEADER_PAYLOAD = 1 << 20  # pax and GNU long-name payloads are small; more is hostile
Member = tuple[str, int, int]  # name, offset of its data, size
_NOT_IMAGE = frozenset({"cls", "json", "txt", "captions.json", "columns.json"})  # a record's other members


# (image extension, label, metadata JSON, bytes of all members, caption, columns, fields)
_Small = tuple[
    str, "int | None", bytes, int, "str | list[str] | None", "dict[str, Any] | None", "dict[str, bytes] | None"
]


def _octal(field: bytes, where: str) -> int:
    if field[:1] and field[0] & 0x80:  # GNU base-256 for large numbers
        return int.from_bytes(field[1:], "big")
    digits = field.split(b"\0", 1)[0].strip(b" ")
    if not digits:
        return 0
    # isdigit: ASCII digits only, so no sign (int() would take "-1000": a loop backwards), no "_"
    if digits.isdigit() and b"8" not in digits and b"9" not in digits:
        return int(digits, 8)
    raise ShardFormatError(f"{where}: corrupt tar header (bad number {digits[:12]!r})")


class _Bytes:
    """pread with an optional read-ahead buffer for small reads; larger ones are read exactly."""

    def __init__(self, fd: int, size: int, chunk: int = 0) -> None:
        self.fd, self.size, self.chunk = fd, size, chunk
        self.buffer, self.start = b"", 0

    def get(self, offset: int, n: int) -> bytes:
        end = offset + n
        if self.start <= offset and end <= self.start + len(self.buffer):
            return self.buffer[offset - self.start : end - self.start]
        if not self.chunk or n >= self.chunk:
            return os.pread(self.fd, n, offset)
        self.buffer, self.start = os.pread(self.fd, self.chunk, offset), offset
        return self.buffer[:n]


def tar_members(data: _Bytes, where: str) -> Iterator[Member]:
    """Regular-file members of a ustar/pax/GNU tar, from the headers alone (nothing is extracted)."""
    pos = 0
    pax_path: str | None = None
    pax_size: int | None = None
    while pos + _BLOCK <= data.size:
        header = data.get(pos, _BLOCK)
        if len(header) < _BLOCK:
            raise ShardFormatError(f"{where}: truncated tar header")
        if header == _ZERO_BLOCK:  # end-of-archive marker
            return
        if header[257:262] != b"ustar":
            raise ShardFormatError(f"{where}: not a tar file (no ustar header at byte {pos:,})")
        size = _octal(header[124:136], where)
        kind = header[156:157]
        start = pos + _BLOCK
        pos = start + -(-size // _BLOCK) * _BLOCK
        if kind in (b"x", b"L"):
            if size > _MAX_HEADER_PAYLOAD:
                raise ShardFormatError(f"{where}: tar extended header of {size:,} bytes")
            payload = data.get(start, size)
            if kind == b"L":
                pax_path = _name(payload.split(b"\0", 1)[0], where)
            else:
                fields = _pax_fields(payload, where)
                pax_path = fields.get("path", pax_path)
                if "size" in fields:
                    if not re.fullmatch(r"[0-9]+", fields["size"]):
                        raise ShardFormatError(f"{where}: corrupt pax size {fields['size'][:20]!r}")
                    pax_size = int(fields["size"])
            continue
        if kind not in (b"0", b"\0", b"7"):
            pax_path = pax_size = None
            continue
        name = pax_path
        if name is None:
            name = _name(header[:100].split(b"\0", 1)[0], where)
            prefix = header[345:500].split(b"\0", 1)[0]
            if prefix and header[257:263] == b"ustar\0":
                name = _name(prefix, where) + "/" + name
        if pax_size is not None:
            size, pos = pax_size, start + -(-pax_size // _BLOCK) * _BLOCK
        pax_path = pax_size = None
        if start + size > data.size:
            raise ShardFormatError(f"{where}: member {name} runs past the end of the file (truncated shard)")
        yield name, start, size
    # Every tar writer ends with zero blocks; without them the file was cut (possibly between
    # members, where the walk above alone would take a shorter shard for a whole one).
    raise ShardFormatError(f"{where}: no end-of-archive marker (truncated shard)")


def _name(raw: bytes, where: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ShardFormatError(f"{where}: member name {raw[:80]!r} is not UTF-8") from None


def _pax_fields(payload: bytes, where: str) -> dict[str, str]:
    fields: dict[str, str] = {}
    pos = 0
    while pos < len(payload):
        space = payload.find(b" ", pos)
        try:
            length = int(payload[pos:space])
        except ValueError:
            raise ShardFormatError(f"{where}: corrupt pax header") from None
        if space < 0 or length <= 0:
            raise ShardFormatError(f"{where}: corrupt pax header")
        key, _, value = payload[space + 1 : pos + length - 1].partition(b"=")
        fields[key.decode("utf-8", "replace")] = _name(value, where) if key == b"path" else value.decode("latin-1")
        pos += length
    return fields


def _split_name(name: str) -> tuple[str, str] | None:
    """webdataset's rule: the key is the path up to the first '.' of the last component."""
    head, _, base = name.rpartition("/")
    stem, dot, ext = base.partition(".")
    if not dot:
        return None
    return (f"{head}/{stem}" if head else stem), ext


def _group(members: Iterator[Member], where: str) -> Iterator[tuple[str, dict[str, tuple[int, int]]]]:
    """Consecutive members with the same key form one record; a member repeated within a record is
    damage (which of the two would a reader take?)."""
    key: str | None = None
    parts: dict[str, tuple[int, int]] = {}
    for name, offset, size in members:
        split = _split_name(name)
        if split is None:
            continue
        if split[0] != key:
            if key is not None:
                yield key, parts
            key, parts = split[0], {}
        if split[1] in parts:
            raise ShardFormatError(f"{where}: record {key} has two {split[1]} members")
        parts[split[1]] = (offset, size)
    if key is not None:
        yield key, parts


class TarShardReader(ShardReader):
    """Reads tars from any WebDataset writer: sequentially with read-ahead, or by index and key
    through an index of member offsets built from the headers on first random access."""

    TRANSIENT = ("_fd", "_walk")

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self._entries: list[tuple[str, dict[str, tuple[int, int]]]] | None = None
        self._fd: int | None = None
        # A header walk a range stopped at: (next record, its entries, its bytes, the process), so
        # the next range from there streams on without an index (shuffled reading takes a shard in
        # several consecutive pieces; indexing it would cost a header read per member and ~1 KB per
        # record held until close, measured 1.35x slower and 3x the memory).
        self._walk: tuple[int, Iterator[tuple[str, dict[str, tuple[int, int]]]], _Bytes, int] | None = None

    def _descriptor(self) -> int:
        if not self.in_this_process(self._fd):  # after fork, get our own descriptor
            try:
                self._fd = open_regular(self.path)
            except OSError as error:
                raise ShardFormatError(f"{self.path}: cannot open ({describe(error)})") from None
            self.opened()
        assert self._fd is not None  # opened above, or earlier in this process
        return self._fd

    def _bytes(self, chunk: int = 0) -> _Bytes:
        fd = self._descriptor()
        return _Bytes(fd, os.fstat(fd).st_size, chunk)

    def _index(self) -> list[tuple[str, dict[str, tuple[int, int]]]]:
        if self._entries is None:
            entries = list(_group(tar_members(self._bytes(), self.path), self.path))
            if len({key for key, _ in entries}) != len(entries):
                raise ShardFormatError(f"{self.path}: a key appears in two places")
            self._entries = entries
        return self._entries

    def __len__(self) -> int:
        return len(self._index())

    def keys(self) -> list[str]:
        return [key for key, _ in self._index()]

    def _member(self, data: _Bytes, key: str, members: dict[str, tuple[int, int]], ext: str) -> bytes:
        offset, size = members[ext]
        payload = data.get(offset, size)
        if len(payload) != size:
            raise ShardFormatError(f"{self.path}: record {key} is cut short (truncated shard)")
        return payload

    def _records(self, data: _Bytes, entries: Iterator[tuple[str, dict[str, tuple[int, int]]]]) -> Iterator[Record]:
        """Records from (key, members) entries, a batch at a time (up to 64 records or 8 MiB):
        small members are read as the entries come (straight after their headers, so from the
        read-ahead buffer that just read those), the batch's metadata is parsed together, each
        image is read exactly once, and only then are the records handed out: between image
        decodes, the same Python work per record runs with cold caches and costs about twice as
        much. A damaged record ends the stream only after every good record before it."""
        while True:
            batch: list[tuple[str, dict[str, tuple[int, int]], _Small]] = []
            batch_bytes, damage = 0, None
            try:
                for key, members in entries:
                    small = self._small_members(data, key, members)
                    batch.append((key, members, small))
                    batch_bytes += small[3]
                    if len(batch) >= _BATCH or batch_bytes >= _BATCH_BYTES:
                        break
            except ShardFormatError as error:
                damage = error  # raised after the good records collected before it
            ready: list[Record] = []
            try:
                for (key, members, (image_ext, label, blob, _, text, columns, files)), meta in zip(
                    batch, json_objects([small[2] for _, _, small in batch]), strict=True
                ):
                    if meta is None:
                        meta = parse_meta(blob, f"{self.path}: record {key}")
                    image = self._member(data, key, members, image_ext)
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

    def _small_members(self, data: _Bytes, key: str, members: dict[str, tuple[int, int]]) -> _Small:
        """(image extension, label, metadata JSON, bytes of all members, caption, columns, fields)
        of one record; checks sizes before any read."""
        image_ext = None
        total = 0
        for ext, (_, size) in members.items():
            total += size
            if image_ext is None and ext not in _NOT_IMAGE:
                image_ext = ext
        if image_ext is None:
            raise ShardFormatError(f"{self.path}: record {key} has no image member")
        if total > MAX_RECORD_BYTES:
            raise ShardFormatError(f"{self.path}: record {key} claims {total:,} bytes, over the limit")
        label = None
        if "cls" in members:
            try:
                label = int(self._member(data, key, members, "cls"))
            except ValueError:
                raise ShardFormatError(f"{self.path}: record {key} has a label that is not an integer") from None
        blob = self._member(data, key, members, "json") if "json" in members else b"{}"
        if len(members) <= 3 and members.keys() <= {image_ext, "cls", "json"}:
            return image_ext, label, blob, total, None, None, None  # image, label, metadata: the common case
        text: str | list[str] | None = None
        where = f"{self.path}: record {key}"
        if "captions.json" in members:
            try:
                text = loads(self._member(data, key, members, "captions.json"))
            except ValueError as error:
                raise ShardFormatError(f"{where} has unreadable captions ({error})") from None
        elif "txt" in members:
            try:
                text = self._member(data, key, members, "txt").decode("utf-8")
            except UnicodeDecodeError:
                raise ShardFormatError(f"{where} has a caption that is not UTF-8") from None
        columns = None
        if "columns.json" in members:
            columns = parse_meta(self._member(data, key, members, "columns.json"), f"{where}: columns")
        others = [ext for ext in members if ext != image_ext and ext not in _NOT_IMAGE]
        files = {ext: self._member(data, key, members, ext) for ext in others} if others else None
        return image_ext, label, blob, total, text, columns, files

    def read(self, index: int) -> Record:
        key, members = self._index()[index]
        return next(self._records(self._bytes(), iter([(key, members)])))

    def __iter__(self) -> Iterator[Record]:
        return self._stream(0, None)  # no index needed from the first record

    def _stream(self, start: int, stop: int | None) -> Iterator[Record]:
        """Records from `start` (0, or where the last walk stopped), walking the headers; none past
        `stop` is read (not even ahead)."""
        walk, self._walk = self._walk, None
        if start == 0 or walk is None:
            data = self._bytes(_READ_AHEAD)
            walk = (0, self._unique(_group(tar_members(data, self.path), self.path)), data, os.getpid())
        _, entries, data, pid = walk
        wanted = None if stop is None else stop - start
        read = 0
        for record in self._records(data, itertools.islice(entries, wanted)):
            read += 1
            yield record
        if wanted is not None and read == wanted:  # a whole range: the next one may go on from here
            self._walk = (stop, entries, data, pid) if stop is not None else None

    def _unique(
        self, entries: Iterator[tuple[str, dict[str, tuple[int, int]]]]
    ) -> Iterator[tuple[str, dict[str, tuple[int, int]]]]:
        seen: set[str] = set()
        for key, members in entries:
            if key in seen:
                raise ShardFormatError(f"{self.path}: a key appears in two places")
            seen.add(key)
            yield key, members

    def read_range(self, start: int, stop: int) -> Iterator[Record]:
        """Records [start, stop) with read-ahead; from the first record no index is needed."""
        walk = self._walk
        if self._entries is None and (start == 0 or (walk and walk[0] == start and walk[3] == os.getpid())):
            return self._stream(start, stop)
        return self._records(self._bytes(_READ_AHEAD), iter(self._index()[start:stop]))

    def close(self) -> None:
        if self._fd is not None and self.in_this_process(self._fd):
            os.close(self._fd)
        self._fd, self._walk = None, None


BACKEND = Backend("webdataset", ".tar", True, TarShardWriter, TarShardReader)
