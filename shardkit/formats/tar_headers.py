"""A tar's headers, written and walked: the header tarfile writes for a regular member, built here
(tarfile's own is slow per member), and the regular-file members of a ustar, pax or GNU tar found
from the headers alone (nothing is extracted), read with `os.pread` through a small read-ahead.
What the members mean (a record's, a DALI sample's) is for the modules above: `webdataset` and
`tar_companions`.
"""

from __future__ import annotations

import os
import re
import tarfile
from collections.abc import Iterator

from ..core.errors import ShardFormatError

BLOCK = 512
_ZERO_BLOCK = bytes(BLOCK)
# Read-ahead for headers and small members (.cls, .json): 4 KiB holds a record's small members and
# their headers in one read, while images, read exactly, are copied once. A read-ahead large enough
# to hold images would copy every image twice (page cache -> buffer -> member).
READ_AHEAD = 4096
_MAX_HEADER_PAYLOAD = 1 << 20  # pax and GNU long-name payloads are small; more is hostile
Member = tuple[str, int, int, int]  # name, offset of its data, size, offset of its first header


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


class FileBytes:
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


def tar_members(
    data: FileBytes, where: str, pos: int = 0, skipped: list[tuple[str, str]] | None = None
) -> Iterator[Member]:
    """Regular-file members of a ustar/pax/GNU tar, from the headers alone (nothing is extracted),
    from the header at byte `pos` on (the start, or where a member's headers begin); the others
    (folders, links, devices) are left out, and listed in `skipped` as (name, kind) when given."""
    pax_path: str | None = None
    pax_size: int | None = None
    first = pos  # where the current member's headers (pax or GNU long name, then its own) begin
    while pos + BLOCK <= data.size:
        header = data.get(pos, BLOCK)
        if len(header) < BLOCK:
            raise ShardFormatError(f"{where}: truncated tar header")
        if header == _ZERO_BLOCK:  # end-of-archive marker
            return
        if header[257:262] != b"ustar":
            raise ShardFormatError(f"{where}: not a tar file (no ustar header at byte {pos:,})")
        size = _octal(header[124:136], where)
        kind = header[156:157]
        start = pos + BLOCK
        pos = start + -(-size // BLOCK) * BLOCK
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
            if skipped is not None:
                other = pax_path or _name(header[:100].split(b"\0", 1)[0], where)
                skipped.append((other, _KINDS.get(kind, f"type {kind.decode('latin-1')!r}")))
            pax_path = pax_size = None
            first = pos
            continue
        name = pax_path
        if name is None:
            name = _name(header[:100].split(b"\0", 1)[0], where)
            prefix = header[345:500].split(b"\0", 1)[0]
            if prefix and header[257:263] == b"ustar\0":
                name = _name(prefix, where) + "/" + name
        if pax_size is not None:
            size, pos = pax_size, start + -(-pax_size // BLOCK) * BLOCK
        pax_path = pax_size = None
        if start + size > data.size:
            raise ShardFormatError(f"{where}: member {name} runs past the end of the file (truncated shard)")
        yield name, start, size, first
        first = pos
    # Every tar writer ends with zero blocks; without them the file was cut (possibly between
    # members, where the walk above alone would take a shorter shard for a whole one).
    raise ShardFormatError(f"{where}: no end-of-archive marker (truncated shard)")


_KINDS = {b"1": "a hard link", b"2": "a symbolic link", b"3": "a character device", b"4": "a block device",
          b"5": "a folder", b"6": "a FIFO"}  # fmt: skip


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


def split_name(name: str) -> tuple[str, str] | None:
    """webdataset's rule: the key is the path up to the first '.' of the last component. None for
    a name with no extension, and for a hidden file (one starting with '.'), which DALI and
    webdataset leave out too."""
    head, _, base = name.rpartition("/")
    stem, dot, ext = base.partition(".")
    if not dot or not stem:
        return None
    return (f"{head}/{stem}" if head else stem), ext
